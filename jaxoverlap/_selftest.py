"""``python -m jaxoverlap selftest``: does the native path work on this machine?

On a machine with GPUs: runs ``ag_matmul`` and ``matmul_rs`` with ``impl="native"``
for every transport the GPUs offer, every dtype and a few shapes (with chunks
and bidirectional rings), and compares each with the ``"xla"`` impl. Prints a
pass/fail table; the exit status is 0 only if every row passed.

Without a GPU: says so clearly, then runs the same table on host devices (the
host executor), plus the CUDA executor's host code on the fake (if built) —
which checks the argument building, not any GPU.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

SHAPES = (  # (batch dims before the sequence axis, rows per rank, K, Nw per rank)
    ((), 8, 64, 32),
    ((2,), 4, 48, 24),
    ((), 12, 40, 18),
)
DTYPES = ("float32", "bfloat16", "float16")
VARIANTS = ((1, False), (2, False), (4, True))  # (chunks, bidirectional); chunks | rows


def _gpu_table() -> dict[str, Any]:
    from jaxoverlap import _cuda_caps

    return _cuda_caps.capabilities()


def _prepare_host_devices(n: int) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _run_row(jo, jax, jnp, np, mesh, op, transport, dtype, shape, chunks, bidirectional) -> str:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    batch, rows, k, nw = shape
    n = mesh.shape["tp"]
    rng = np.random.default_rng(0)
    axis = len(batch)
    lead = (None,) * axis
    if op == "ag_matmul":
        x = rng.standard_normal((*batch, rows * n, k)).astype(np.float32)
        w = rng.standard_normal((k, nw * n)).astype(np.float32)
        xs, ws = P(*lead, "tp", None), P(None, "tp")
    else:
        x = rng.standard_normal((*batch, rows * n, k * n)).astype(np.float32)
        w = rng.standard_normal((k * n, nw)).astype(np.float32)
        xs, ws = P(*lead, None, "tp"), P("tp", None)
    x = jax.device_put(jnp.asarray(x, dtype), NamedSharding(mesh, xs))
    w = jax.device_put(jnp.asarray(w, dtype), NamedSharding(mesh, ws))
    fn = getattr(jo, op)
    kwargs = dict(axis=axis, mesh=mesh)
    native = jax.jit(lambda a, b: fn(a, b, "tp", impl="native", transport=transport,
                                     chunks=chunks, bidirectional=bidirectional, **kwargs))
    xla = jax.jit(lambda a, b: fn(a, b, "tp", impl="xla", **kwargs))
    got = np.asarray(jnp.asarray(native(x, w), jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(xla(x, w), jnp.float32), np.float64)
    tol = dict(rtol=1e-4, atol=1e-3) if dtype == "float32" else dict(rtol=3e-2, atol=3e-1)
    err = float(np.max(np.abs(got - want)))
    np.testing.assert_allclose(got, want, **tol)
    return f"max |native - xla| = {err:.2e}"


def _fake_rows() -> list[tuple[str, bool, str]]:
    """The CUDA executor's host code against the fake, for every transport (if built)."""
    rows = []
    try:
        from jaxoverlap import _cuda_caps

        _cuda_caps.load_cuda()
        from jaxoverlap import _cuda_fake
    except ImportError as e:
        print(f"  (CUDA executor on the fake: skipped, {e})")
        return []
    import numpy as np

    for op in ("ag_matmul", "matmul_rs"):
        for transport in ("nccl", "p2p", "multicast"):
            _cuda_fake.reset()
            n, b, r, k, nw = 4, 2, 3, 8, 6
            rng = np.random.default_rng(1)
            xr = r if op == "ag_matmul" else r * n
            xs = [rng.standard_normal((b, xr, k)).astype(np.float32) for _ in range(n)]
            ws = [rng.standard_normal((k, nw)).astype(np.float32) for _ in range(n)]
            out = _cuda_fake.run(op, transport, n, b, r, k, nw, "float32", 2, True, False,
                                 [x.tobytes() for x in xs], [w.tobytes() for w in ws],
                                 list(range(n)))
            if op == "ag_matmul":
                g = np.concatenate(xs, axis=1).astype(np.float64)
                refs = [g @ w for w in ws]
            else:
                tot = sum(x.astype(np.float64) @ w for x, w in zip(xs, ws, strict=True))
                refs = [tot[:, i * r:(i + 1) * r] for i in range(n)]
            ok = out["drained"] and not _cuda_fake.errors() and all(
                s is None for s in out["statuses"]) and all(
                np.allclose(np.frombuffer(y, np.float32).reshape(ref.shape), ref, atol=1e-4)
                for y, ref in zip(out["ys"], refs, strict=True))
            detail = "" if ok else "; ".join([*_cuda_fake.errors()[:2],
                                              *[s for s in out["statuses"] if s][:2]])
            rows.append((f"{op:9s} {transport:9s} (CUDA executor on the host-side fake)", ok,
                         detail or "matches float64"))
    _cuda_fake.reset()
    return rows


def main(quick: bool = False) -> int:
    caps = _gpu_table()
    gpus = caps.get("devices", [])
    if not gpus:
        _prepare_host_devices(4)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, Mesh

    import jaxoverlap as jo
    from jaxoverlap import _native

    devices = jax.devices()
    platform = devices[0].platform
    print(f"jaxoverlap {jo.__version__} selftest; jax {jax.__version__}")
    if gpus and platform in ("gpu", "cuda"):
        names = ", ".join(sorted({d["name"] for d in gpus}))
        print(f"GPUs: {len(gpus)} x {names}; driver {caps.get('cuda_driver')}, "
              f"NCCL {caps.get('nccl')}, cuBLAS {caps.get('cublas')}")
    elif gpus:
        print(f"GPUs are present ({len(gpus)}) but JAX runs on {platform!r} (is jax[cuda13] "
              "installed?): testing the host executor only.")
    else:
        print(f"NO GPU FOUND ({caps.get('error')}).")
        print("Running the same checks on host devices with the host executor; this does NOT "
              "test the CUDA executor on a GPU.")
    n = min(len(devices), 8)
    mesh = Mesh(np.array(devices[:n]), ("tp",), axis_types=(AxisType.Auto,))
    transports = _native.offered_transports(platform)
    print(f"devices in the test mesh: {n}; transports offered on {platform}: {list(transports)}")
    results: list[tuple[str, bool, str]] = []
    shapes = SHAPES[:1] if quick else SHAPES
    for op in ("ag_matmul", "matmul_rs"):
        for transport in transports:
            for dtype in DTYPES:
                for shape in shapes:
                    for chunks, bidi in VARIANTS:
                        name = (f"{op:9s} {transport:9s} {dtype:8s} "
                                f"{'x'.join(map(str, (*shape[0], shape[1] * n, shape[2])))}"
                                f" chunks={chunks}{' bidi' if bidi else ''}")
                        start = time.perf_counter()
                        try:
                            detail = _run_row(jo, jax, jnp, np, mesh, op, transport, dtype,
                                              shape, chunks, bidi)
                            ok = True
                        except Exception as e:  # noqa: BLE001 - a row reports, the run goes on
                            ok = False
                            detail = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                            if os.environ.get("JAXOVERLAP_LOG") == "debug":
                                traceback.print_exc()
                        detail += f" ({time.perf_counter() - start:.1f} s)"
                        results.append((name, ok, detail))
                        print(f"  {'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)
    if not (gpus and platform in ("gpu", "cuda")):
        for name, ok, detail in _fake_rows():
            results.append((name, ok, detail))
            print(f"  {'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)
    failed = [r for r in results if not r[1]]
    print(f"\n{len(results) - len(failed)}/{len(results)} passed"
          + ("" if gpus and platform in ("gpu", "cuda") else "  (no GPU: host executor only)"))
    for name, _, detail in failed:
        print(f"FAILED: {name}: {detail}")
    return 0 if results and not failed else 1
