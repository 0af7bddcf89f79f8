"""``python -m jaxoverlap selftest``: does the native path work on this machine?

On a machine with GPUs: runs ``ag_matmul`` and ``matmul_rs`` with ``impl="native"``
for every transport the GPUs offer, every dtype and a few shapes (with chunks
and bidirectional rings), and ``matmul_ar``'s one-shot on a decode step's single
row, and compares each with the ``"xla"`` impl. Prints a
pass/fail table; the exit status is 0 only if every row passed.

Without a GPU: says so clearly, then runs the same table on host devices (the
host executor), plus a few rows of the CUDA executor on the fake (if built).

``--fake``: the table (and ``matmul_ar``, two-shot and one-shot) through the CUDA executor
linked against
the host-side fake of CUDA, NCCL and cuBLASLt, on any machine: the executor's
host code, its enqueue order through ``CUDA_DEVICE_MAX_CONNECTIONS`` work queues
(read from the environment as the driver does), NCCL's per-communicator
serialisation and the kernels' own per-element code, compared with float64.
It checks what decides hangs and wrong results, not a GPU's speed.
"""

from __future__ import annotations

import itertools
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
# f32 references are computed at HIGHEST (no TF32); half types round their output.
TOLERANCE = {"float32": dict(rtol=1e-4, atol=1e-3), "bfloat16": dict(rtol=3e-2, atol=3e-1),
             "float16": dict(rtol=3e-2, atol=3e-1)}


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
    op, _, algorithm = op.partition("/")
    kwargs: dict[str, Any] = dict(axis=axis, mesh=mesh)
    if op == "matmul_ar":  # one-shot: a decode step's single row per batch, which no N splits
        x = rng.standard_normal((*batch, 1, k * n)).astype(np.float32)
        w = rng.standard_normal((k * n, nw)).astype(np.float32)
        xs, ws = P(*lead, None, "tp"), P("tp", None)
        kwargs = dict(mesh=mesh, algorithm=algorithm)
    elif op == "ag_matmul":
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
    # Both at HIGHEST: XLA's float32 dots default to TF32 on A100/H100-class GPUs, which
    # would fail the float32 tolerance (and the native GEMM would use TF32 too).
    kwargs["precision"] = "highest"
    native = jax.jit(lambda a, b: fn(a, b, "tp", impl="native", transport=transport,
                                     chunks=chunks, bidirectional=bidirectional, **kwargs))
    kwargs.pop("algorithm", None)
    xla = jax.jit(lambda a, b: fn(a, b, "tp", impl="xla", **kwargs))
    got = np.asarray(jnp.asarray(native(x, w), jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(xla(x, w), jnp.float32), np.float64)
    err = float(np.max(np.abs(got - want)))
    np.testing.assert_allclose(got, want, **TOLERANCE[dtype])
    return f"max |native - xla| = {err:.2e}"


# "op/algorithm": matmul_ar's one-shot, on rows that do not split over the ranks
FAKE_OPS = ("ag_matmul", "matmul_rs", "matmul_ar", "matmul_ar/one_shot")
FAKE_RANKS = 4


def _fake_row(fake, np, op, transport, dtype, shape, chunks, bidirectional) -> tuple[bool, str]:
    """One case through the CUDA executor on the fake, against a float64 reference."""
    import ml_dtypes

    batch_dims, rows, k, nw = shape
    batch = int(np.prod(batch_dims)) if batch_dims else 1
    n = FAKE_RANKS
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16,
                "float16": np.float16}[dtype]
    rng = np.random.default_rng(1)
    op, _, algorithm = op.partition("/")
    if algorithm == "one_shot":
        rows = rows * n + 1          # the canonical one-shot problem: all rows, not N blocks
    x_rows = rows if op == "ag_matmul" or algorithm == "one_shot" else rows * n
    xs = [rng.standard_normal((batch, x_rows, k)).astype(np.float32).astype(np_dtype)
          for _ in range(n)]
    ws = [rng.standard_normal((k, nw)).astype(np.float32).astype(np_dtype) for _ in range(n)]
    fake.reset()  # CUDA_DEVICE_MAX_CONNECTIONS from the environment, as the driver reads it
    out = fake.run(op, transport, n, batch, rows, k, nw, dtype, chunks, bidirectional, False,
                   [x.tobytes() for x in xs], [w.tobytes() for w in ws], list(range(n)),
                   algorithm=algorithm or "two_shot")
    x64 = [x.astype(np.float64) for x in xs]
    w64 = [w.astype(np.float64) for w in ws]
    if op == "ag_matmul":
        gathered = np.concatenate(x64, axis=1)
        refs = [gathered @ w for w in w64]
    else:
        total = sum(x @ w for x, w in zip(x64, w64, strict=True))
        refs = [total] * n if op == "matmul_ar" else [
            total[:, r * rows:(r + 1) * rows] for r in range(n)]
    problems = [*fake.errors()[:2], *[s for s in out["statuses"] if s][:2]]
    if not out["drained"] and not problems:
        problems.append("the fake GPU did not drain")
    err = 0.0
    if not problems:
        for r, (y, ref) in enumerate(zip(out["ys"], refs, strict=True)):
            got = np.frombuffer(y, np_dtype).reshape(ref.shape).astype(np.float64)
            err = max(err, float(np.max(np.abs(got - ref))))
            if not np.allclose(got, ref, **TOLERANCE[dtype]):
                problems.append(f"rank {r}: max |native - float64| = "
                                f"{float(np.max(np.abs(got - ref))):.2e}")
                break
    return not problems, "; ".join(problems) or f"matches float64 (max err {err:.1e})"


def _fake_rows(quick: bool = True, ops=("ag_matmul", "matmul_rs")) -> list[tuple[str, bool, str]]:
    """The selftest's table through the CUDA executor on the host-side fake (if built)."""
    try:
        from jaxoverlap import _cuda_caps

        _cuda_caps.load_cuda()
        from jaxoverlap import _cuda_fake
    except ImportError as e:
        print(f"  (CUDA executor on the fake: skipped, {e})")
        return []
    import numpy as np

    rows = []
    shapes = SHAPES[:1] if quick else SHAPES
    dtypes = DTYPES[:1] if quick else DTYPES
    variants = VARIANTS[-1:] if quick else VARIANTS
    cases = itertools.product(ops, ("nccl", "p2p", "multicast"), dtypes, shapes, variants)
    try:
        for op, transport, dtype, shape, (chunks, bidi) in cases:
            dims = (*shape[0], shape[1] * FAKE_RANKS + op.endswith("one_shot"), shape[2])
            name = (f"{op:9s} {transport:9s} {dtype:8s} {'x'.join(map(str, dims))}"
                    f" chunks={chunks}{' bidi' if bidi else ''}"
                    " (CUDA executor on the host-side fake)")
            ok, detail = _fake_row(_cuda_fake, np, op, transport, dtype, shape, chunks, bidi)
            rows.append((name, ok, detail))
            print(f"  {'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)
    finally:
        _cuda_fake.reset()
    return rows


def fake_main(quick: bool = False) -> int:
    """``selftest --fake``: the whole table on the CUDA executor against the host-side fake."""
    from jaxoverlap import __version__

    print(f"jaxoverlap {__version__} selftest on the host-side CUDA fake (no GPU is used)")
    print("Runs the CUDA executor's host code, its enqueue order through the fake's work queues "
          f"(CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', '')!s}"
          "; unset: the driver's 8), NCCL's serialisation per communicator, and the kernels' "
          "per-element code compiled for the host; it proves nothing about a GPU's timing.")
    print(f"ranks: {FAKE_RANKS}; ops: {', '.join(FAKE_OPS)}; transports: nccl, p2p, multicast")
    results = _fake_rows(quick=quick, ops=FAKE_OPS)
    failed = [r for r in results if not r[1]]
    print(f"\n{len(results) - len(failed)}/{len(results)} passed (CUDA executor on the fake)")
    for name, _, detail in failed:
        print(f"FAILED: {name}: {detail}")
    return 0 if results and not failed else 1


def main(quick: bool = False, fake: bool = False) -> int:
    if fake:
        return fake_main(quick=quick)
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
    for op in ("ag_matmul", "matmul_rs", "matmul_ar/one_shot"):
        for transport in transports:
            for dtype in DTYPES:
                for shape in shapes:
                    for chunks, bidi in VARIANTS if "/" not in op else ((1, False),):
                        rows = 1 if "/" in op else shape[1] * n  # one-shot: a decode step
                        name = (f"{op:9s} {transport:9s} {dtype:8s} "
                                f"{'x'.join(map(str, (*shape[0], rows, shape[2])))}"
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
        results.extend(_fake_rows(quick=True))
        print("  (the whole table on the CUDA executor: python -m jaxoverlap selftest --fake)")
    failed = [r for r in results if not r[1]]
    print(f"\n{len(results) - len(failed)}/{len(results)} passed"
          + ("" if gpus and platform in ("gpu", "cuda") else "  (no GPU: host executor only)"))
    for name, _, detail in failed:
        print(f"FAILED: {name}: {detail}")
    return 0 if results and not failed else 1
