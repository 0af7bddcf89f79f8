"""One process of a multi-process test, started by ``harness.py`` (never collected by pytest).

Usage: ``worker.py SCENARIO PARAMS_JSON`` with ``JO_MP_COORDINATOR``, ``JO_MP_NUM_PROCESSES`` and
``JO_MP_PROCESS_ID`` in the environment. The process joins the ``jax.distributed`` job, runs the
scenario (which raises on any mismatch), prints ``JO_MP_RESULT <json>`` and exits 0.

Every check compares the shards this process holds with a float64 NumPy reference computed
from the same seeded inputs in every process.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoverlap as jo

TOL = {"float32": dict(rtol=1e-5, atol=1e-4), "bfloat16": dict(rtol=2e-2, atol=2e-2)}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def log(*args: Any) -> None:
    print(f"[process {jax.process_index()}]", *args, file=sys.stderr, flush=True)


def mesh_of(shape: tuple[int, ...], names: tuple[str, ...], order: list[int] | None = None) -> Mesh:
    devices = jax.devices()
    if order is not None:
        devices = [devices[i] for i in order]
    return Mesh(np.array(devices).reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))


def values(seed: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Seeded inputs, rounded to ``dtype`` and returned as float64 (the reference sees them)."""
    v = np.random.default_rng(seed).uniform(-1.0, 1.0, size=shape).astype(np.float32)
    return np.asarray(jnp.asarray(v, DTYPES[dtype]).astype(jnp.float32), np.float64)


def global_array(a: np.ndarray, mesh: Mesh, spec: P, dtype: str) -> jax.Array:
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(
        a.shape, sharding, lambda idx: np.asarray(a[idx], np.float32).astype(DTYPES[dtype]))


def check_shards(name: str, got: jax.Array, want: np.ndarray, dtype: str) -> None:
    """Every shard this process holds equals the reference's slice of it."""
    assert got.shape == want.shape, (name, got.shape, want.shape)
    scale = float(np.abs(want).max(initial=0.0))
    tol = dict(TOL[dtype])
    tol["atol"] = max(tol["atol"], tol["rtol"] * scale)
    assert got.addressable_shards, name
    for shard in got.addressable_shards:
        data = np.asarray(shard.data.astype(jnp.float32), np.float64)
        np.testing.assert_allclose(data, want[shard.index], err_msg=f"{name} {shard.index}", **tol)


def check_op(op: str, mesh: Mesh, impl: str, dtype: str = "float32", axis: int = 1,
             seed: int = 0, **kw: Any) -> None:
    """Forward and gradients of one op on global arrays against float64 NumPy.

    x is [B, S, K] with the rows on ``axis`` (0 or 1), y = x @ w, loss = sum(y * c), so
    dx = c @ w.T and dw = sum over rows of x.T @ c.
    """
    n = mesh.shape["tp"]
    shape = [2, 2, 8]
    shape[axis] = 2 * n
    k, nw = 8, 2 * n
    x64 = values(seed, tuple(shape), dtype)
    w64 = values(seed + 1, (k, nw), dtype)
    c64 = values(seed + 2, tuple(shape[:-1]) + (nw,), dtype)
    rows = [None] * 3
    rows[axis] = "tp"
    fn = jo.ag_matmul if op == "ag_matmul" else jo.matmul_rs
    if op == "ag_matmul":
        x_spec, w_spec, y_spec = P(*rows), P(None, "tp"), P(None, None, "tp")
    else:
        x_spec, w_spec, y_spec = P(None, None, "tp"), P("tp", None), P(*rows)
    x = global_array(x64, mesh, x_spec, dtype)
    w = global_array(w64, mesh, w_spec, dtype)
    c = global_array(c64, mesh, y_spec, dtype)

    def forward(x, w):
        return fn(x, w, "tp", axis=axis, impl=impl, mesh=mesh, **kw)

    def loss(x, w, c):
        return jnp.sum(forward(x, w).astype(jnp.float32) * c.astype(jnp.float32))

    y = jax.jit(forward)(x, w)
    check_shards(f"{op} {impl} {kw} y", y, x64 @ w64, dtype)
    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w, c)
    check_shards(f"{op} {impl} {kw} dx", dx, c64 @ w64.T, dtype)
    dw_ref = x64.reshape(-1, k).T @ c64.reshape(-1, nw)
    check_shards(f"{op} {impl} {kw} dw", dw, dw_ref, dtype)


# ------------------------------------------------------------------ scenarios


def portable(impls: list[str]) -> dict[str, Any]:
    """impl="xla"/"ring" of both ops, forward and backward, over a tp mesh of every device."""
    mesh = mesh_of((len(jax.devices()),), ("tp",))
    done = []
    for impl in impls:
        for op in ("ag_matmul", "matmul_rs"):
            for axis in (0, 1):
                check_op(op, mesh, impl, axis=axis, chunks=2 if impl == "ring" else None)
                done.append(f"{op}/{impl}/axis{axis}")
    return {"checked": done}


def native(transports: list[str], order: list[int] | None = None, dtype: str = "float32",
           axes: list[int] | None = None) -> dict[str, Any]:
    """impl="native" of both ops, fwd+bwd, every transport, over a tp mesh of every device.

    With several devices per process one clique mixes local threads and remote processes.
    ``order`` permutes the devices (e.g. interleaving processes round the ring).
    """
    mesh = mesh_of((len(jax.devices()),), ("tp",), order)
    n = len(jax.devices())
    done, one_shot = [], []
    for transport in transports:
        for op in ("ag_matmul", "matmul_rs"):
            for axis in axes or [0, 1]:
                bidir = axis == 1
                check_op(op, mesh, "native", dtype=dtype, axis=axis, transport=transport,
                         chunks=2, bidirectional=bidir, seed=axis)
                done.append(f"{op}/{transport}/axis{axis}")
        # matmul_ar's one-shot on a decode step's single row (which no N splits)
        x, w = values(11, (1, 8 * n), dtype), values(12, (8 * n, 6), dtype)
        y = jax.jit(lambda x, w, t=transport: jo.matmul_ar(
            x, w, "tp", impl="native", transport=t, algorithm="one_shot", mesh=mesh))(
                global_array(x, mesh, P(None, "tp"), dtype),
                global_array(w, mesh, P("tp", None), dtype))
        check_shards(f"matmul_ar one-shot {transport}", y, x @ w, dtype)
        one_shot.append(transport)
    # Nothing of the job has a name in /dev/shm while it runs (segments are memfds).
    held = in_dev_shm()
    return {"checked": done, "one_shot": one_shot, "cliques": _cliques(),
            "linked": held["dev_shm"], "memfds": held["memfds"]}


def fp8(transports: list[str]) -> dict[str, Any]:
    """fp8 operands with per-rank scales through the native primitive, every op and transport,
    over a tp mesh of every device (cliques spanning processes: each shard's scale crosses them
    with the shard), against the float64 product of the float32 dequantized operands."""
    from jaxoverlap._native import primitive
    from jaxoverlap._plan import OpPlan
    from jaxoverlap._selftest import _compare, bound

    mesh = mesh_of((len(jax.devices()),), ("tp",))
    n = len(jax.devices())
    rng = np.random.default_rng(5)
    sx = np.asarray([0.5 * (1 + 0.37 * r) for r in range(n)], np.float32)
    sw = np.asarray([1.25 - 0.1 * r for r in range(n)], np.float32)
    k, rows, nw = 16, 4, 8
    e4 = jnp.float8_e4m3fn
    done = []

    def dequantized(a, scale):
        return (np.asarray(a, np.float32) * np.float32(scale)).astype(np.float64)

    def put(a, spec, dtype):
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec),
                                            lambda idx: np.asarray(a[idx]).astype(dtype))

    scales = (put(sx, P("tp"), np.float32), put(sw, P("tp"), np.float32))
    for transport in transports:
        for op in ("ag_matmul", "matmul_rs", "matmul_ar"):
            ag = op == "ag_matmul"
            x = (rng.standard_normal((2, rows * n, k if ag else k * n)) * 3).astype(e4)
            w = (rng.standard_normal((k if ag else k * n, nw * n if ag else nw)) * 3).astype(e4)
            specs = (P(None, "tp"), P(None, "tp")) if ag else (P(None, None, "tp"), P("tp"))
            plan = OpPlan(op=op, impl="native", axis_name="tp", axis=0 if op == "matmul_ar"
                          else 1, axis_size=n, chunks=2, bidirectional=True,
                          transport=transport, out_dtype="bfloat16")

            def local(x, w, sx, sw, plan=plan):
                return getattr(primitive, plan.op)(x, w, plan, x_scale=sx[0], w_scale=sw[0])

            out_spec = {"ag_matmul": P(None, None, "tp"), "matmul_rs": P(None, "tp"),
                        "matmul_ar": P()}[op]
            y = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(*specs, P("tp"), P("tp")),
                                      out_specs=out_spec))(put(x, specs[0], e4),
                                                           put(w, specs[1], e4), *scales)
            if ag:  # shard j's rows with x's scale j; rank r's columns with w's scale r
                a = np.concatenate([dequantized(x[:, j * rows:(j + 1) * rows], sx[j])
                                    for j in range(n)], axis=1)
                b = np.concatenate([dequantized(w[:, r * nw:(r + 1) * nw], sw[r])
                                    for r in range(n)], axis=1)
            else:  # rank r's slice of the contraction with its own scales
                a = np.concatenate([dequantized(x[..., r * k:(r + 1) * k], sx[r])
                                    for r in range(n)], axis=-1)
                b = np.concatenate([dequantized(w[r * k:(r + 1) * k], sw[r]) for r in range(n)])
            ref = a @ b
            allowed = bound(op, "bfloat16", n, k, a, b)
            assert y.addressable_shards, op
            for shard in y.addressable_shards:
                got = np.asarray(shard.data.astype(jnp.float32), np.float64)
                ok, detail = _compare(np, got, ref[shard.index], allowed[shard.index])
                assert ok, f"{op} {transport} {shard.index}: {detail}"
            done.append(f"{op}/{transport}")
    return {"checked": done}


def mxfp8(transports: list[str]) -> dict[str, Any]:
    """Block-scaled (MXFP8) AG+GEMM through the ops' native path over a tp mesh of every device
    (cliques spanning processes: each sub-chunk's e8m0 scale rows cross them with its fp8
    rows), chunked and bidirectional, on every transport: equal to the numpy
    dequantize-then-multiply reference bit for bit (small integers and scales 2^0..2^2: every
    float32 sum is exact)."""
    import ml_dtypes

    mesh = mesh_of((len(jax.devices()),), ("tp",))
    n = len(jax.devices())
    rng = np.random.default_rng(6)
    rows, k, nw = 4, 64, 2
    e4 = jnp.float8_e4m3fn
    x = rng.integers(-8, 9, size=(2, rows * n, k)).astype(np.float32)
    w = rng.integers(-8, 9, size=(k, nw * n)).astype(np.float32)
    xe = (rng.integers(0, 3, size=(2, rows * n, k // 32)) + 127).astype(np.uint8)
    we = (rng.integers(0, 3, size=(k // 32, nw * n)) + 127).astype(np.uint8)
    ref = ((x * np.repeat(2.0 ** (xe.astype(np.float64) - 127), 32, 2))
           @ (w * np.repeat(2.0 ** (we.astype(np.float64) - 127), 32, 0)))

    def put(a, spec):
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec),
                                            lambda idx: jnp.asarray(a[idx]))

    rows_spec = P(None, "tp")
    args = (put(x.astype(ml_dtypes.float8_e4m3fn), rows_spec),
            put(w.astype(ml_dtypes.float8_e4m3fn), P(None, "tp")),
            put(xe.view(ml_dtypes.float8_e8m0fnu), rows_spec),
            put(we.view(ml_dtypes.float8_e8m0fnu), P(None, "tp")))
    assert args[0].dtype == e4
    done = []
    for transport in transports:
        def local(x, w, xs, ws, transport=transport):
            return jo.ag_matmul(x, w, "tp", axis=1, impl="native", transport=transport,
                                chunks=2, bidirectional=True, x_scale=xs, w_scale=ws,
                                preferred_element_type=jnp.float32)

        y = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(rows_spec, P(None, "tp"),
                                                              rows_spec, P(None, "tp")),
                                  out_specs=P(None, None, "tp")))(*args)
        assert y.addressable_shards
        for shard in y.addressable_shards:
            got = np.asarray(shard.data, np.float64)
            assert np.array_equal(got, ref[shard.index]), (transport, shard.index)
        done.append(transport)
    return {"checked": done}


def fused(transports: list[str], calls: int = 5) -> dict[str, Any]:
    """The fused GEMM's programs (JAXOVERLAP_FUSED=1) of both ops over a tp mesh of every device,
    bfloat16 with 16-byte rows: the host executor runs them block by block on a clique in shared
    memory across the processes; ``calls`` calls of each against float64 NumPy."""
    n = len(jax.devices())
    mesh = mesh_of((n,), ("tp",))
    done = []
    for transport in transports:
        for op in ("ag_matmul", "matmul_rs"):
            k = 16 if op == "ag_matmul" else 8 * n
            nw = 8 * n if op == "ag_matmul" else 16
            x64, w64 = values(1, (2, 4 * n, k), "bfloat16"), values(2, (k, nw), "bfloat16")
            if op == "ag_matmul":
                x_spec, w_spec, fn = P(None, "tp", None), P(None, "tp"), jo.ag_matmul
            else:
                x_spec, w_spec, fn = P(None, None, "tp"), P("tp", None), jo.matmul_rs
            x = global_array(x64, mesh, x_spec, "bfloat16")
            w = global_array(w64, mesh, w_spec, "bfloat16")
            step = jax.jit(lambda x, w, fn=fn, t=transport: fn(
                x, w, "tp", axis=1, impl="native", transport=t, mesh=mesh)).lower(x, w).compile()
            text = step.as_text()  # of the executable that runs below
            assert "fused = true" in text, [c for c in text.splitlines() if "custom" in c]
            for _ in range(calls):
                y = step(x, w)
            check_shards(f"{op} {transport} fused", y, x64 @ w64, "bfloat16")
            done.append(f"{op}/{transport}")
    return {"checked": done, "cliques": _cliques()}


def mixed(transport: str = "p2p") -> dict[str, Any]:
    """Cliques of several kinds in one job (run with 2 processes x 2 devices).

    * tp=4 over [0, 2, 1, 3]: every ring hop crosses processes (one clique, two processes);
    * (dp=2, tp=2) with tp inside a process: in-process cliques, no shared memory;
    * (dp=2, tp=2) with tp across processes: two cliques spanning both processes;
    * changing shapes back to back (a call site each across processes).
    """
    devices = jax.devices()
    assert len(devices) == 4 and jax.process_count() == 2, "run with 2 processes x 2 devices"
    done, kinds = [], []
    mesh = mesh_of((4,), ("tp",), order=[0, 2, 1, 3])
    check_op("ag_matmul", mesh, "native", transport=transport, chunks=1, seed=3)
    check_op("matmul_rs", mesh, "native", transport="nccl", chunks=2, seed=4)
    done.append("interleaved ring")
    for name, order in (("tp within a process", [0, 1, 2, 3]),
                        ("tp across processes", [0, 2, 1, 3])):
        mesh2 = mesh_of((2, 2), ("dp", "tp"), order)
        kinds.append(check_dp_tp(mesh2, transport))
        done.append(name)
    growth(mesh, transport)
    done.append("growth")
    user_shard_map(mesh, transport)
    done.append("user shard_map")
    held = in_dev_shm()
    return {"checked": done, "cliques": "".join(kinds) + _cliques(),
            "linked": held["dev_shm"], "memfds": held["memfds"]}


def user_shard_map(mesh: Mesh, transport: str) -> None:
    """A user's own jit(shard_map(mesh=...)), the plain way, without jax.set_mesh: the call
    learns the concrete mesh where it lowers. Also with "auto", which must pick nccl for a
    clique spanning processes."""
    x64 = values(30, (16, 8), "float32")
    w64 = values(31, (8, 8), "float32")
    x = global_array(x64, mesh, P("tp", None), "float32")
    w = global_array(w64, mesh, P(None, "tp"), "float32")
    for t in (transport, "auto"):
        f = jax.jit(jax.shard_map(
            lambda x, w, t=t: jo.ag_matmul(x, w, "tp", impl="native", transport=t),
            mesh=mesh, in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp")))
        check_shards(f"user shard_map {t}", f(x, w), x64 @ w64, "float32")
        text = f.lower(x, w).as_text()
        want = transport if t != "auto" else "nccl"
        assert f"transport = {('nccl', 'p2p', 'multicast').index(want)} : i32" in text, text


def check_dp_tp(mesh: Mesh, transport: str) -> str:
    """x [dp*2, 4*tp, 8] sharded (dp, tp): ag_matmul then matmul_rs, forward and grads.

    Returns the cliques while the programs are alive (in-process cliques belong to
    their call sites and go with the executable).
    """
    x64 = values(20, (4, 8, 8), "float32")
    w1 = values(21, (8, 8), "float32")
    w2 = values(22, (8, 8), "float32")
    x = global_array(x64, mesh, P("dp", "tp", None), "float32")
    a = global_array(w1, mesh, P(None, "tp"), "float32")
    b = global_array(w2, mesh, P("tp", None), "float32")

    def block(x, a, b):
        h = jo.ag_matmul(x, a, "tp", axis=1, impl="native", transport=transport, mesh=mesh)
        return jo.matmul_rs(h, b, "tp", axis=1, impl="native", transport=transport, mesh=mesh)

    y = jax.jit(block)(x, a, b)
    check_shards("dp,tp block", y, x64 @ w1 @ w2, "float32")
    loss = lambda x, a, b: jnp.sum(block(x, a, b) ** 2)  # noqa: E731
    grad = jax.jit(jax.grad(loss))
    dx = grad(x, a, b)
    ref = x64 @ w1 @ w2
    check_shards("dp,tp dx", dx, (2 * ref) @ w2.T @ w1.T, "float32")
    cliques = _cliques()
    del grad
    return cliques


def growth(mesh: Mesh, transport: str) -> None:
    """Shapes grow and shrink over back-to-back calls; every result stays right."""
    for i, s in enumerate((8, 32, 16, 64, 8, 128)):
        x64 = values(100 + i, (2, s, 8), "float32")
        w64 = values(200 + i, (8, 8), "float32")
        x = global_array(x64, mesh, P(None, "tp", None), "float32")
        w = global_array(w64, mesh, P(None, "tp"), "float32")
        for t in (transport, "nccl"):
            y = jax.jit(lambda x, w, t=t: jo.ag_matmul(x, w, "tp", axis=1, impl="native",
                                                       transport=t, chunks=2, mesh=mesh))(x, w)
            check_shards(f"growth {s} {t}", y, x64 @ w64, "float32")


def peer_loss(victim: int, mode: str, timeout_s: float) -> dict[str, Any]:
    """Every process runs a native call; then ``victim`` goes and the others call again.

    ``mode``: "exit" (the victim exits between two calls), "kill" (SIGKILL while its rank is
    inside a call, waiting for its peers) or "stall" (it stays alive but never calls again).
    The survivors must fail, not hang: a dead peer is reported within seconds, a stalled one at
    the timeout, naming the victim's rank and process. They report what they saw and leave
    with os._exit: jax.distributed's own shutdown would wait for the lost peer.
    """
    from jax import lax

    n = len(jax.devices())
    mesh = mesh_of((n,), ("tp",))
    x64 = values(1, (2, 2 * n, 8), "float32")
    w64 = values(2, (8, 2 * n), "float32")
    x = global_array(x64, mesh, P(None, "tp", None), "float32")
    w = global_array(w64, mesh, P(None, "tp"), "float32")
    me = jax.process_index()

    def late(a):  # the survivors enter the second call a moment after the victim
        def host(a):
            if me != victim:
                time.sleep(1.0)
            return a
        return jax.pure_callback(host, jax.ShapeDtypeStruct(a.shape, a.dtype), a)

    with jo.config(timeout_s=timeout_s):
        f = jax.jit(lambda x, w: jo.ag_matmul(x, w, "tp", axis=1, impl="native", mesh=mesh,
                                              transport="p2p"))
        check_shards("before the loss", f(x, w), x64 @ w64, "float32")
        # late() runs per device, inside the shard_map (no collective of XLA's own).
        g = jax.jit(jax.shard_map(
            lambda x, w: jo.ag_matmul(lax.stop_gradient(late(x)), w, "tp", axis=1,
                                      impl="native", transport="p2p"),
            mesh=mesh, in_specs=(P(None, "tp", None), P(None, "tp")),
            out_specs=P(None, None, "tp")))
    if me == victim:
        if mode == "exit":
            log("exiting early on purpose")
            os._exit(0)
        if mode == "stall":
            log("stalling on purpose")
            time.sleep(timeout_s + 60)  # the harness kills it
            os._exit(0)
        import signal
        import threading

        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        log("entering a call, to be killed inside it")
        with jax.set_mesh(mesh), jo.config(timeout_s=timeout_s):
            g(x, w).block_until_ready()
        time.sleep(60)
    start = time.monotonic()
    try:
        with jax.set_mesh(mesh), jo.config(timeout_s=timeout_s):  # read when g is traced
            g(x, w).block_until_ready()
    except Exception as e:  # noqa: BLE001 - the error is what this scenario reports
        result = {"error": str(e), "elapsed_s": time.monotonic() - start - 1.0}
    else:
        result = {"error": None, "elapsed_s": time.monotonic() - start - 1.0}
    result["process_id"] = me
    print("JO_MP_RESULT " + json.dumps(result), flush=True)
    from jaxoverlap._executors import bootstrap

    # Process 0 hosts the coordination service: it leaves last, or it would take the others
    # down with it before they report.
    store = bootstrap.client()
    if me != 0:
        store.key_value_set(f"jo_test/peer_loss/{me}", "done")
    else:
        for p in range(1, jax.process_count()):
            if p != victim:
                store.blocking_key_value_get(f"jo_test/peer_loss/{p}", 60_000)
    os._exit(0)


def bootstrap_missing(timeout_s: float) -> dict[str, Any]:
    """Process 1 never reaches the native call: the leader's bootstrap names it."""
    if jax.process_index() == 1:
        time.sleep(timeout_s + 20)  # stays alive (the harness kills it), never traces
        return {}
    mesh = mesh_of((len(jax.devices()),), ("tp",))
    x = global_array(np.ones((4, 8)), mesh, P("tp", None), "float32")
    w = global_array(np.ones((8, 4)), mesh, P(None, "tp"), "float32")
    start = time.monotonic()
    try:
        with jo.config(timeout_s=timeout_s):
            jax.jit(lambda x, w: jo.ag_matmul(x, w, "tp", impl="native", mesh=mesh))(x, w)
        error = None
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    held = in_dev_shm()
    result = {"error": error, "elapsed_s": time.monotonic() - start,
              "leftover": held["dev_shm"], "memfds": held["memfds"]}
    print("JO_MP_RESULT " + json.dumps(result), flush=True)
    os._exit(0)


def bootstrap_death(role: str, timeout_s: float) -> dict[str, Any]:
    """Process 1 dies in the middle of the bootstrap of a clique it is the ``role`` of (the
    devices are ordered so that rank 0, the leader, is process 0's or process 1's): as a
    follower after publishing its pid, as the leader after every process attached and before
    its verdict. Process 0 (the coordinator, which stays) reports its error and how long it
    took, leaving without jax.distributed's shutdown barrier."""
    from jaxoverlap._executors import bootstrap, runtime

    n = len(jax.devices())
    order = list(range(n)) if role == "follower" else list(reversed(range(n)))
    mesh = mesh_of((n,), ("tp",), order)
    x = global_array(np.ones((4, 8)), mesh, P("tp", None), "float32")
    w = global_array(np.ones((8, 4)), mesh, P(None, "tp"), "float32")
    if jax.process_index() == 1:
        if role == "follower":   # its pid is published: die instead of fetching the segment
            runtime.load_host()._shm_domain_receive = lambda *a, **k: os._exit(7)
        else:                    # every process attached: die instead of giving the verdict
            publish = bootstrap._set

            def _set(key: str, value: bytes) -> None:
                if key.endswith("/result"):
                    os._exit(7)
                publish(key, value)

            bootstrap._set = _set
    start = time.monotonic()
    try:
        with jo.config(timeout_s=timeout_s):
            jax.jit(lambda x, w: jo.ag_matmul(x, w, "tp", impl="native", mesh=mesh))(x, w)
        error = None
    except Exception as e:  # noqa: BLE001 - the error is what this scenario reports
        error = f"{type(e).__name__}: {e}"
    result = {"error": error, "elapsed_s": time.monotonic() - start}
    print("JO_MP_RESULT " + json.dumps(result), flush=True)
    os._exit(0)


def bootstrap_retry(timeout_s: float) -> dict[str, Any]:
    """Process 1 reaches the first native call late: the leader's bootstrap fails naming it.
    Process 0 then simply calls again (a re-trace, as after any trace-time error) and the
    clique comes up: attempts are agreed through the store, so the late process joins the new
    attempt, not the failed one, and both get the right numbers."""
    n = len(jax.devices())
    mesh = mesh_of((n,), ("tp",))
    x64 = values(5, (8, 16), "float32")
    w64 = values(6, (16, 4 * n), "float32")
    x = global_array(x64, mesh, P("tp", None), "float32")
    w = global_array(w64, mesh, P(None, "tp"), "float32")
    errors = []
    if jax.process_index() == 1:
        time.sleep(timeout_s + 2)  # alive, just late
    for _ in range(3):
        try:
            with jo.config(timeout_s=timeout_s):
                y = jax.jit(lambda x, w: jo.ag_matmul(x, w, "tp", impl="native", mesh=mesh,
                                                      transport="p2p"))(x, w)
            break
        except Exception as e:  # noqa: BLE001 - the first failure is part of the scenario
            errors.append(f"{type(e).__name__}: {e}")
    else:
        raise AssertionError(f"the bootstrap never recovered: {errors}")
    check_shards("after the retry", y, x64 @ w64, "float32")
    held = in_dev_shm()
    return {"errors": errors, "cliques": _cliques(), "linked": held["dev_shm"],
            "memfds": held["memfds"]}


def disagree(timeout_s: float) -> dict[str, Any]:
    """Process 1 calls with another contraction size: another call, so another call site. Each
    process waits in its own site for a peer that waits in another, which is refused before
    the timeout, naming both calls."""
    mesh = mesh_of((len(jax.devices()),), ("tp",))
    k = 8 if jax.process_index() == 0 else 16
    x = global_array(np.ones((4, k)), mesh, P("tp", None), "float32")
    w = global_array(np.ones((k, 4)), mesh, P(None, "tp"), "float32")
    start = time.monotonic()
    try:
        with jo.config(timeout_s=timeout_s):
            jax.jit(lambda x, w: jo.ag_matmul(x, w, "tp", impl="native", mesh=mesh,
                                              transport="nccl"))(x, w).block_until_ready()
        error = None
    except Exception as e:  # noqa: BLE001
        error = str(e)
    return {"error": error, "elapsed_s": time.monotonic() - start}


def _ag_p2p_program(mesh: Mesh):
    """A user's jitted shard_map of one native p2p ag_matmul over _ag_problem's x and w."""
    return jax.jit(jax.shard_map(
        lambda x, w: jo.ag_matmul(x, w, "tp", axis=1, impl="native", transport="p2p"),
        mesh=mesh, in_specs=(P(None, "tp", None), P(None, "tp")),
        out_specs=P(None, None, "tp")))


def _ag_problem(seed: int, mesh: Mesh, rows: int, k: int = 8, nw: int | None = None):
    """x [2, rows*tp, k] (rows on tp), w [k, nw] (columns on tp), and their float64 values."""
    n = mesh.shape["tp"]
    nw = nw or 2 * n
    x64 = values(seed, (2, rows * n, k), "float32")
    w64 = values(seed + 1, (k, nw), "float32")
    return (x64, w64, global_array(x64, mesh, P(None, "tp", None), "float32"),
            global_array(w64, mesh, P(None, "tp"), "float32"))


def _ag(mesh: Mesh, transport: str = "p2p") -> Callable:
    """A program of one native call (jit of an ag_matmul on global arrays)."""
    return jax.jit(lambda x, w: jo.ag_matmul(x, w, "tp", axis=1, impl="native", mesh=mesh,
                                             transport=transport))


def chief_aot(timeout_s: float) -> dict[str, Any]:
    """What a multi-controller program does that processes do not all alike, then steps every
    process runs. None of the common steps may wait for a peer (they fail at the timeout if
    they do), and every result must be right.

    * the chief alone AOT-compiles an eval step to log its memory (the compiled object dropped
      at once), keeps another AOT-compiled program it never runs, and compiles a third on a
      background thread (all on the model's mesh and transport: a mesh-axis group that only
      some processes ever lower would wait in its bootstrap, docs/multiprocess.md);
    * the processes compile two programs in opposite orders;
    * the chief calls jax.clear_caches() and recompiles the train step while its old
      executable is still alive; the other process keeps using its own;
    * the chief drops the train step altogether (its peer keeps it), compiles it again and
      carries on: its ranks continue the site's calls where they left off.
    """
    import gc
    import threading

    n = len(jax.devices())
    mesh = mesh_of((n,), ("tp",))
    me = jax.process_index()
    checked: list[str] = []
    x64, w64, x, w = _ag_problem(40, mesh, rows=2)
    c64 = values(43, (2, 2 * n, 2 * n), "float32")
    c = global_array(c64, mesh, P(None, None, "tp"), "float32")

    def train_fn(x, w, c):
        loss = lambda x, w: jnp.sum(jo.ag_matmul(  # noqa: E731
            x, w, "tp", axis=1, impl="native", mesh=mesh, transport="p2p") * c)
        return jax.grad(loss, argnums=(0, 1))(x, w)

    def check_train(dx, dw, what):
        check_shards(f"{what} dx", dx, c64 @ w64.T, "float32")
        check_shards(f"{what} dw", dw, x64.reshape(-1, x64.shape[-1]).T @ c64.reshape(
            -1, c64.shape[-1]), "float32")

    with jo.config(timeout_s=timeout_s):
        xe64, we64, xe, we = _ag_problem(44, mesh, rows=3)
        evaluate = _ag(mesh)
        xa64, wa64, xa, wa = _ag_problem(46, mesh, rows=4)
        xb64, wb64, xb, wb = _ag_problem(48, mesh, rows=5)
        if me == 0:
            memory = evaluate.lower(xe, we).compile().memory_analysis()
            checked.append(f"chief AOT eval step ({memory is not None})")
            x2, w2 = _ag_problem(50, mesh, rows=6)[2:]
            kept = _ag(mesh).lower(x2, w2).compile()  # never run
            x3, w3 = _ag_problem(52, mesh, rows=7)[2:]
            background = threading.Thread(target=lambda: _ag(mesh).lower(x3, w3).compile())
            background.start()
            background.join()
            checked.append("chief-only programs")
        programs = {"a": (_ag(mesh), xa, wa, xa64 @ wa64), "b": (_ag(mesh), xb, wb, xb64 @ wb64)}
        order = ["a", "b"] if me == 0 else ["b", "a"]
        compiled = {name: programs[name][0].lower(*programs[name][1:3]).compile()
                    for name in order}
        start = time.monotonic()
        train = jax.jit(train_fn)
        for step in range(3):
            check_train(*train(x, w, c), f"train step {step}")
            for name in ("a", "b"):
                _, xi, wi, want = programs[name]
                check_shards(f"program {name} step {step}", compiled[name](xi, wi), want,
                             "float32")
            check_shards(f"eval step {step}", evaluate(xe, we), xe64 @ we64, "float32")
        checked.append("common steps")
        common_s = time.monotonic() - start
        # The chief recompiles the train step while its old executable lives on.
        old = train.lower(x, w, c).compile()
        if me == 0:
            jax.clear_caches()
        for step in range(2):
            check_train(*train(x, w, c), f"train after clear_caches {step}")
        checked.append("recompiled while alive")
        # The chief drops the train step entirely, its peer keeps it; then the chief makes it
        # again and both carry on.
        kept_for_peers = ""
        if me == 0:
            del old, train
            jax.clear_caches()
            gc.collect()
            kept_for_peers = _cliques()
            train = jax.jit(train_fn)
        for step in range(2):
            check_train(*train(x, w, c), f"train after the chief rejoined {step}")
        checked.append("rejoined")
        if me == 0:
            del kept
    return {"checked": checked, "common_s": common_s, "kept_for_peers": kept_for_peers,
            "cliques": _cliques()}


def many_sites(programs: int, calls: int, timeout_s: float) -> dict[str, Any]:
    """A long job's recompiles: a train step stays alive while `programs` programs of `calls`
    native calls each (shapes of their own) are compiled, run and dropped one after another —
    run with JAXOVERLAP_MAX_CALL_SITES below their total. Then one program with more calls than
    the directory has room for: every process fails at once, naming the capacity."""
    import gc

    n = len(jax.devices())
    mesh = mesh_of((n,), ("tp",))
    x64, w64, x, w = _ag_problem(60, mesh, rows=2)
    most_open = 0

    def batch(first: int, count: int):
        problems = [_ag_problem(1000 + 2 * (first + i), mesh, rows=1 + (first + i) % 5,
                                k=8 + 2 * (first + i)) for i in range(count)]

        def f(*args):
            return [jo.ag_matmul(args[2 * i], args[2 * i + 1], "tp", axis=1, impl="native",
                                 mesh=mesh, transport="p2p") for i in range(count)]

        args = [a for p in problems for a in p[2:]]
        return f, args, [p[0] @ p[1] for p in problems]

    with jo.config(timeout_s=timeout_s):
        train = _ag(mesh).lower(x, w).compile()  # alive throughout
        check_shards("train", train(x, w), x64 @ w64, "float32")
        made = _site_ids()
        for p in range(programs):
            f, args, wants = batch(p * calls, calls)
            compiled = jax.jit(f).lower(*args).compile()
            for i, (y, want) in enumerate(zip(compiled(*args), wants, strict=True)):
                check_shards(f"program {p} call {i}", y, want, "float32")
            most_open = max(most_open, _open_sites())
            made |= _site_ids()
            del compiled, f, args
            jax.clear_caches()
            gc.collect()
            check_shards(f"train after program {p}", train(x, w), x64 @ w64, "float32")
        f, args, _ = batch(10_000, int(os.environ["JAXOVERLAP_MAX_CALL_SITES"]) + 1)
        start = time.monotonic()
        try:
            jax.block_until_ready(jax.jit(f)(*args))
            error = None
        except Exception as e:  # noqa: BLE001 - the error is what this step reports
            error = str(e)
        elapsed = time.monotonic() - start
    print("JO_MP_RESULT " + json.dumps({"made": len(made), "most_open": most_open, "error": error,
                                        "full_elapsed_s": elapsed}), flush=True)
    _leave_last_from_process_0("many_sites")


def _site_ids() -> set[str]:
    """The call sites this process has open now, by id (from their info() lines)."""
    import re

    return set(re.findall(r"/site (0x[0-9a-f]+)/", _cliques()))


def _open_sites() -> int:
    """Call sites this process has open in its domains (from their info() lines)."""
    import re

    return sum(int(m) for m in re.findall(r"(\d+) call sites open here", _cliques()))


def watched(iterations: int) -> dict[str, Any]:
    """A job that keeps making call sites (new shapes, compiled, run, dropped) while a process
    of the same user that is not part of it (watcher.py, started here in a session of its
    own) looks for its shared memory: in /dev/shm, through /proc/<pid>/fd, and at its Unix
    sockets. Returns what the watcher reports. Two canaries the watcher must find prove that it
    looks: a named segment in /dev/shm (what jaxoverlap's segments were), mode 0600, and a
    memfd that process 0 keeps open all along (what a segment's descriptor would be while a
    process holds it)."""
    import gc
    import subprocess

    from jaxoverlap._executors import bootstrap

    n = len(jax.devices())
    mesh = mesh_of((n,), ("tp",))
    me = jax.process_index()
    pids = bootstrap.allgather_bytes("watched", "pids", str(os.getpid()).encode(),
                                     processes=list(range(jax.process_count())), timeout_s=60)
    canary = f"/dev/shm/jaxoverlap-{os.environ['JAXOVERLAP_SHM_TAG']}-canary"
    watcher = held = None
    if me == 0:
        fd = os.open(canary, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.write(fd, b"canary")
        os.close(fd)
        held = os.memfd_create("jaxoverlap-canary-memfd")
        os.ftruncate(held, 4096)
        argv = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                             "watcher.py"), ",".join(p.decode() for p in
                                                                     pids.values())]
        watcher = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True)
        assert watcher.stdout.readline().strip() == "watching", watcher.stderr.read()
    bootstrap.allgather_bytes("watched", "started", b"1",
                              processes=list(range(jax.process_count())), timeout_s=60)
    for i in range(iterations):
        x64, w64, x, w = _ag_problem(200 + i, mesh, rows=1 + i, k=8 + i)
        compiled = _ag(mesh, ("p2p", "nccl", "multicast")[i % 3]).lower(x, w).compile()
        for _ in range(3):
            check_shards(f"iteration {i}", compiled(x, w), x64 @ w64, "float32")
        del compiled
        jax.clear_caches()
        gc.collect()
    report = {}
    if watcher is not None:
        out, err = watcher.communicate(input="stop\n", timeout=60)
        os.unlink(canary)
        os.close(held)
        report = json.loads(out.strip().splitlines()[-1])
        report["stderr"] = err[-2000:]
    return {"watcher": report}


def deserialized(directory: str, timeout_s: float) -> dict[str, Any]:
    """A program that every process loads from a serialized executable and never lowers: its
    group spanning processes was never bootstrapped in this job. The first run serializes it
    (after running it); a second job loads and runs it, and must fail at once naming the cause,
    not wait for peers until the timeout."""
    from jax.experimental import serialize_executable

    n = len(jax.devices())
    mesh = mesh_of((n,), ("tp",))
    x64, w64, x, w = _ag_problem(80, mesh, rows=2)
    program_of = _ag_p2p_program(mesh)
    path = os.path.join(directory, f"program.{jax.process_index()}")
    start = time.monotonic()
    try:
        with jo.config(timeout_s=timeout_s):
            if not os.path.exists(path):
                compiled = program_of.lower(x, w).compile()
                check_shards("compiled here", compiled(x, w), x64 @ w64, "float32")
                with open(path, "wb") as f:
                    f.write(serialize_executable.serialize(compiled)[0])
                loaded = "serialized"
            else:
                from jaxoverlap._executors import runtime

                runtime.register("cpu")  # the FFI targets the program calls
                in_tree = jax.tree.structure(((x, w), {}))
                out_tree = jax.tree.structure(x)
                with open(path, "rb") as f:
                    program = serialize_executable.deserialize_and_load(f.read(), in_tree,
                                                                        out_tree)
                check_shards("loaded", program(x, w), x64 @ w64, "float32")
                loaded = "deserialized"
        error = None
    except Exception as e:  # noqa: BLE001 - the error is what this scenario reports
        error, loaded = str(e), "failed"
    print("JO_MP_RESULT " + json.dumps({"error": error, "loaded": loaded,
                                        "elapsed_s": time.monotonic() - start}), flush=True)
    _leave_last_from_process_0("deserialized")


def cached(cache_dir: str) -> dict[str, Any]:
    """A user's shard_map program with JAX's persistent compilation cache: the second job
    loads it from the cache (it still lowers there, so its group is set up) and runs it right,
    next to a program compiled afresh."""
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    n = len(jax.devices())
    mesh = mesh_of((n,), ("tp",))
    x64, w64, x, w = _ag_problem(90, mesh, rows=2)
    program = _ag_p2p_program(mesh)
    entries = len(os.listdir(cache_dir))
    for step in range(3):
        check_shards(f"cached program {step}", program(x, w), x64 @ w64, "float32")
    return {"new_entries": len(os.listdir(cache_dir)) - entries, "cliques": _cliques()}


def _leave_last_from_process_0(what: str) -> None:
    """Exits without jax.distributed's shutdown (a failed job's barrier would wait); process 0
    hosts the coordination service, so it leaves last, once the others have reported."""
    from jaxoverlap._executors import bootstrap

    store = bootstrap.client()
    me = jax.process_index()
    if me != 0:
        store.key_value_set(f"jo_test/{what}/{me}", "done")
    else:
        for p in range(1, jax.process_count()):
            store.blocking_key_value_get(f"jo_test/{what}/{p}", 60_000)
    os._exit(0)


def small_dev_shm() -> dict[str, Any]:
    """A call site whose buffers need more than the 4 MiB /dev/shm this runs with (a tmpfs in
    a user + mount namespace): its segments are memfds, so it runs, right."""
    import re

    n = len(jax.devices())
    mesh = mesh_of((n,), ("tp",))
    x64 = values(70, (1, 4096, 256), "float32")
    w64 = values(71, (256, 2 * n), "float32")
    x = global_array(x64, mesh, P(None, "tp", None), "float32")
    w = global_array(w64, mesh, P(None, "tp"), "float32")
    y = jax.jit(lambda x, w: jo.ag_matmul(x, w, "tp", axis=1, impl="native", mesh=mesh,
                                          transport="p2p"))(x, w)
    check_shards("bigger than /dev/shm", y, x64 @ w64, "float32")
    per_rank = max(int(m) for m in re.findall(r"workspace 2 x (\d+) bytes", _cliques()))
    fs = os.statvfs("/dev/shm")
    return {"checked": True, "site_bytes": 2 * n * per_rank,
            "dev_shm_bytes": fs.f_blocks * fs.f_frsize}


def set_order(transports: list[str],
              forms: tuple[str, ...] = ("shard_map", "global")) -> dict[str, Any]:
    """Identical calls traced in another order per process: a loop over a ``set`` of names
    (each process has its own hash seed, so its own order) makes, for each name, an
    ag_matmul of one input and a matmul_rs of that name's own partials, native, inside a
    ``shard_map`` body and on global arrays under Auto axes, forward and backward. Every shard
    must equal the float64 reference: calls are matched across processes by what they
    compute, not by the order a process traced them in. Returns the order this process
    traced and the wrong shards per transport and form."""
    n = len(jax.devices())
    mesh = mesh_of((n,), ("tp",))
    names = {"query", "key", "value"}
    order = list(names)                       # this process's own order
    b, s, k, f = 2, 4 * n, 16, 8 * n
    x64 = values(90, (b, s, k), "float32")
    w64 = {nm: values(91 + i, (k, f), "float32") for i, nm in enumerate(sorted(names))}
    v64 = {nm: values(95 + i, (f, k), "float32") for i, nm in enumerate(sorted(names))}
    x = global_array(x64, mesh, P(None, "tp", None), "float32")
    ws = {nm: global_array(w, mesh, P(None, "tp"), "float32") for nm, w in w64.items()}
    vs = {nm: global_array(v, mesh, P("tp", None), "float32") for nm, v in v64.items()}
    ref = {nm: (x64 @ w64[nm]) @ v64[nm] for nm in names}
    dx_ref = sum((np.ones_like(ref[nm]) @ v64[nm].T) @ w64[nm].T for nm in names)
    wrong: dict[str, int] = {}
    for transport in transports:
        kw = dict(impl="native", transport=transport)

        def layer(x, ws, vs, shard, kw=kw):
            out = {}
            for nm in names:                  # a set: each process its own order
                o = {} if shard else {"mesh": mesh}
                h = jo.ag_matmul(x, ws[nm], "tp", axis=1, **kw, **o)
                out[nm] = jo.matmul_rs(h, vs[nm], "tp", axis=1, **kw, **o)
            return out

        inside = jax.shard_map(functools.partial(layer, shard=True), mesh=mesh,
                               in_specs=(P(None, "tp", None), P(None, "tp"), P("tp", None)),
                               out_specs=P(None, "tp", None))
        made = {"shard_map": inside, "global": functools.partial(layer, shard=False)}
        for form in forms:
            fn = made[form]
            with jax.set_mesh(mesh):
                ys = jax.jit(fn)(x, ws, vs)
                dx = jax.jit(jax.grad(lambda x, ws, vs, fn=fn: sum(
                    jnp.sum(y) for y in fn(x, ws, vs).values())))(x, ws, vs)
            bad = sum(_wrong_shards(ys[nm], ref[nm], "float32") for nm in names)
            wrong[f"{transport}/{form}"] = bad + _wrong_shards(dx, dx_ref, "float32")
    return {"order": order, "wrong": wrong}


def set_order_one_weight(transports: list[str], backward: bool = True) -> dict[str, Any]:
    """One kernel applied to the results of a ``set`` of others (each process its own order)
    inside a ``shard_map``, native: a matmul_rs makes the input, then for each name an
    ag_matmul of it by that name's kernel and a matmul_rs of the result by one shared kernel.
    The last calls are alike but for their input; so are, in the backward pass, the three
    ag_matmul calls of the shared kernel on one cotangent, whose results each process feeds
    to the calls of the names in its own order. Every shard of the outputs and of the
    gradient of x must equal the float64 reference. Returns the order, and the wrong shards
    per transport or the error."""
    n = len(jax.devices())
    mesh = mesh_of((n,), ("tp",))
    names = {"query", "key", "value"}
    b, s, k, f = 2, 4 * n, 16, 8 * n
    x64, u64 = values(90, (b, s, f), "float32"), values(89, (f, k), "float32")
    w64 = {nm: values(91 + i, (k, f), "float32") for i, nm in enumerate(sorted(names))}
    v64 = values(95, (f, k), "float32")
    x = global_array(x64, mesh, P(None, None, "tp"), "float32")
    u = global_array(u64, mesh, P("tp", None), "float32")
    ws = {nm: global_array(w, mesh, P(None, "tp"), "float32") for nm, w in w64.items()}
    v = global_array(v64, mesh, P("tp", None), "float32")
    wrong: dict[str, int] = {}
    for transport in transports:
        kw = dict(impl="native", transport=transport)

        def layer(x, u, ws, v, kw=kw):
            x = jo.matmul_rs(x, u, "tp", axis=1, **kw)
            return {nm: jo.matmul_rs(jo.ag_matmul(x, ws[nm], "tp", axis=1, **kw), v, "tp",
                                     axis=1, **kw)
                    for nm in names}   # a set: each process its own order

        fn = jax.shard_map(layer, mesh=mesh, in_specs=(P(None, None, "tp"), P("tp", None),
                                                       P(None, "tp"), P("tp", None)),
                           out_specs=P(None, "tp", None))
        try:
            with jax.set_mesh(mesh):
                ys = jax.jit(fn)(x, u, ws, v)
                if backward:
                    dx = jax.jit(jax.grad(lambda x, u, ws, v, fn=fn: sum(
                        jnp.sum(y) for y in fn(x, u, ws, v).values())))(x, u, ws, v)
            wrong[transport] = sum(_wrong_shards(ys[nm], ((x64 @ u64) @ w64[nm]) @ v64,
                                                 "float32") for nm in names)
            if backward:
                ones = np.ones((b, s, k))
                dx_ref = sum(((ones @ v64.T) @ w64[nm].T) for nm in names) @ u64.T
                wrong[transport] += _wrong_shards(dx, dx_ref, "float32")
        except Exception as e:  # noqa: BLE001 - reported to the test
            return {"order": list(names), "wrong": None, "error": f"{type(e).__name__}: {e}"}
    return {"order": list(names), "wrong": wrong, "error": None}


def order_mismatch(transports: list[str], slow_s: float) -> dict[str, Any]:
    """Two native calls of other kernels on one input, inside a shard_map. First in one order
    everywhere, with process 1 sleeping ``slow_s`` before the second call while process 0
    waits in it: that must run, right. Then, per transport, in another order per process
    (each makes its second call wait for its first one's result, as a program traced in
    another order would): that must fail at once, not at the timeout. Returns the slow run's
    wrong shards and time, and per transport the error and the seconds until it came."""
    n = len(jax.devices())
    mesh = mesh_of((n,), ("tp",))
    me = jax.process_index()
    b, s, k, f = 2, 4 * n, 16, 8 * n
    x64 = values(80, (b, s, k), "float32")
    w64 = [values(81 + i, (k, f), "float32") for i in range(2)]
    x = global_array(x64, mesh, P(None, "tp", None), "float32")
    ws = [global_array(w, mesh, P(None, "tp"), "float32") for w in w64]
    specs = dict(mesh=mesh, in_specs=(P(None, "tp", None), P(None, "tp"), P(None, "tp")),
                 out_specs=(P(None, None, "tp"), P(None, None, "tp")))

    def after(x, y):  # x, but made after y (0 * a float XLA cannot fold)
        return x + 0 * y[:1, :1, :1]

    def slow(x):
        def host(a):
            if me == 1:
                time.sleep(slow_s)
            return a
        return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    def run(transport: str, mismatched: bool) -> tuple[Any, Any]:
        kw = dict(impl="native", transport=transport)

        def body(x, w0, w1):
            if not mismatched:
                a = jo.ag_matmul(x, w0, "tp", axis=1, **kw)
                return a, jo.ag_matmul(slow(after(x, a)), w1, "tp", axis=1, **kw)
            if me == 0:
                a = jo.ag_matmul(x, w0, "tp", axis=1, **kw)
                return a, jo.ag_matmul(after(x, a), w1, "tp", axis=1, **kw)
            c = jo.ag_matmul(x, w1, "tp", axis=1, **kw)
            return jo.ag_matmul(after(x, c), w0, "tp", axis=1, **kw), c

        with jax.set_mesh(mesh):
            return jax.jit(jax.shard_map(body, **specs))(x, *ws)

    start = time.monotonic()
    ys = run(transports[0], False)
    wrong = sum(_wrong_shards(y, x64 @ w, "float32") for y, w in zip(ys, w64, strict=True))
    slow_run = time.monotonic() - start
    errors: dict[str, Any] = {}
    for transport in transports:
        start = time.monotonic()
        try:
            jax.block_until_ready(run(transport, True))
            errors[transport] = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors[transport] = [f"{type(e).__name__}: {e}", time.monotonic() - start]
    return {"wrong": wrong, "slow_run_s": slow_run, "errors": errors}


def qkv(transports: list[str], steps: int = 30, skew_s: float = 0.02, backward: bool = True,
        dtype: str = "float32") -> dict[str, Any]:
    """Three independent native calls over one mesh axis (the Q/K/V projections of an
    attention layer), with ranks at uneven speeds: at each step one rank sleeps before one of
    the calls (a different rank and call every step), so devices run the three calls in
    different orders. Every output shard of every step must equal the float64 reference;
    returns how many were wrong (the test requires none) per transport.
    """
    from jax import lax

    n = len(jax.devices())
    mesh = mesh_of((n,), ("tp",))
    # Big enough that XLA:CPU runs the program's thunks concurrently: it runs programs whose
    # buffers are all tiny one thunk at a time, in program order.
    b, s, k, nw = 2, 16 * n, 64, 16 * n
    x64 = values(50, (b, s, k), dtype)
    ws64 = [values(51 + i, (k, nw), dtype) for i in range(3)]
    cs64 = [values(61 + i, (b, s, nw), dtype) for i in range(3)]
    x = global_array(x64, mesh, P(None, "tp", None), dtype)
    ws = [global_array(w, mesh, P(None, "tp"), dtype) for w in ws64]
    cs = [global_array(c, mesh, P(None, None, "tp"), dtype) for c in cs64]

    def nap(a, rank, step, call):
        def host(a, rank, step):
            if int(rank) == int(step) % n and int(step) // n % 3 == call:
                time.sleep(skew_s)
            return a
        # The callback runs on the primal value only (callbacks have no derivative); adding
        # (slept - a) keeps the call's data dependency on it and leaves the value exact.
        held = lax.stop_gradient(a)
        slept = jax.pure_callback(host, jax.ShapeDtypeStruct(a.shape, a.dtype), held, rank, step)
        return a + (slept - held)

    wrong: dict[str, int] = {}
    for transport in transports:
        def local(x, wq, wk, wv, step, transport=transport):
            rank = lax.axis_index("tp")
            return tuple(jo.ag_matmul(nap(x, rank, step, i), w, "tp", axis=1, impl="native",
                                      transport=transport)
                         for i, w in enumerate((wq, wk, wv)))

        spec_w = P(None, "tp")
        f = jax.shard_map(local, mesh=mesh,
                          in_specs=(P(None, "tp", None), spec_w, spec_w, spec_w, P()),
                          out_specs=(P(None, None, "tp"),) * 3)

        def loss(x, wq, wk, wv, step, cq, ck, cv, f=f):
            ys = f(x, wq, wk, wv, step)
            return sum(jnp.sum(y.astype(jnp.float32) * c.astype(jnp.float32))
                       for y, c in zip(ys, (cq, ck, cv), strict=True))

        with jax.set_mesh(mesh):
            fwd = jax.jit(f)
            grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
            bad = 0
            for step in range(steps):
                st = jnp.int32(step)
                ys = fwd(x, *ws, st)
                for i, y in enumerate(ys):
                    bad += _wrong_shards(y, x64 @ ws64[i], dtype)
                if backward:
                    dx, *dws = grad(x, *ws, st, *cs)
                    dx_ref = sum(c @ w.T for c, w in zip(cs64, ws64, strict=True))
                    bad += _wrong_shards(dx, dx_ref, dtype)
                    for i, dw in enumerate(dws):
                        dw_ref = x64.reshape(-1, k).T @ cs64[i].reshape(-1, nw)
                        bad += _wrong_shards(dw, dw_ref, dtype)
        wrong[transport] = bad
        log(f"qkv {transport}: {bad} wrong shards over {steps} steps")
    return {"wrong": wrong, "cliques": _cliques()}


def _wrong_shards(got: jax.Array, want: np.ndarray, dtype: str) -> int:
    """How many of this process's shards of ``got`` differ from the reference's."""
    scale = float(np.abs(want).max(initial=0.0))
    tol = dict(TOL[dtype])
    tol["atol"] = max(tol["atol"], tol["rtol"] * scale)
    bad = 0
    for shard in got.addressable_shards:
        data = np.asarray(shard.data.astype(jnp.float32), np.float64)
        if not np.allclose(data, want[shard.index], **tol):
            bad += 1
    return bad


def _testing_module():
    """The test helpers' extension module (built in the checkout, not installed)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import testing_ext

    return testing_ext.load()


def in_dev_shm() -> dict[str, list[str]]:
    """What this process holds in /dev/shm (open or mapped), and its memfds' names (for the
    reader: where its shared memory is instead)."""
    from harness import shm_held  # beside this script (on sys.path when it runs as one)

    named, memfds = shm_held()
    return {"dev_shm": sorted(named), "memfds": sorted(memfds)}


def exchange() -> dict[str, Any]:
    """The bytes-in, bytes-out exchange API (what the CUDA executor calls), on CPU."""
    from jaxoverlap._executors import bootstrap

    me, n = jax.process_index(), jax.process_count()
    procs = list(range(n))
    got = bootstrap.allgather_bytes("cafe-g0", "handles", bytes([me]) * (me + 1),
                                     processes=procs, timeout_s=60)
    assert got == {p: bytes([p]) * (p + 1) for p in procs}, got
    # The same (clique, tag) again gets fresh keys.
    again = bootstrap.allgather_bytes("cafe-g0", "handles", b"x%d" % me, processes=procs,
                                       timeout_s=60)
    assert again == {p: b"x%d" % p for p in procs}, again
    uid = np.random.default_rng(7).bytes(128)  # an ncclUniqueId's size
    root = n - 1
    out = bootstrap.broadcast_bytes("cafe-g0", "uid", uid if me == root else None, root=root,
                                     processes=procs, timeout_s=60)
    assert out == uid
    table = [p for p in procs for _ in range(2)]
    nccl_id, handles = bootstrap.exchange_cuda_handles(
        "beef-g1", rank_process=table, local_handles=b"ipc%d" % me,
        nccl_unique_id=uid if me == 0 else None, timeout_s=60)
    assert nccl_id == uid and handles == {p: b"ipc%d" % p for p in procs}
    # A subset of the processes exchanges alone; a process outside it is refused.
    if me < 2:
        pair = bootstrap.allgather_bytes("pair-g0", "t", b"%d" % me, processes=[0, 1],
                                          timeout_s=60)
        assert pair == {0: b"0", 1: b"1"}
    # Nobody answers: the error names the silent process.
    error = None
    if me == 0:
        try:
            bootstrap.broadcast_bytes("dead-g0", "uid", None, root=1, processes=procs,
                                       timeout_s=1.0)
        except bootstrap.BootstrapError as e:
            error = str(e)
        assert error is not None and "process 1 did not answer" in error, error
    # The same from C++, through jo::Exchange over a StoreExchange (a 128-byte id with NULs).
    testing = _testing_module()
    got_cpp = testing.exchange_selftest(
        bootstrap.StoreExchange("c0de-g0", procs, timeout_s=60))
    assert got_cpp["uid"] == bytes((i * 7 + 3) % 256 for i in range(128)), got_cpp["uid"]
    assert got_cpp["handles"] == {p: b"handles of process %d\0" % p for p in procs}, got_cpp
    if me == 0:  # process 1 stays silent: the C++ caller gets a timeout naming it
        try:
            testing.exchange_selftest(
                bootstrap.StoreExchange("silent-g0", [0, 1], timeout_s=1.0))
        except RuntimeError as e:
            assert "did not answer" in str(e) and "[1]" in str(e), e
            assert str(e).startswith("timeout: exchange allgather"), e
        else:
            raise AssertionError("a silent process did not fail the C++ exchange")
    # POSIX fds (what cuMemExportToShareableHandle gives) travel both ways.
    checked = ["allgather", "broadcast", "cuda handles", "subset", "timeout", "c++ exchange"]
    # The multicast shape, from C++ (jo::Exchange::ShareFds -> StoreExchange.share_fds): only
    # the first process (the multicast object's owner) offers an fd; the others get a duplicate.
    owner_fd = os.memfd_create("jo-test-owner") if me == procs[0] else -1
    if owner_fd >= 0:
        os.write(owner_fd, b"the owner's handle")
    try:
        got_fds = testing.exchange_selftest(
            bootstrap.StoreExchange("f00d-g0", procs, timeout_s=60), share_fds=True,
            owner_fd=owner_fd)["fds"]
    finally:
        if owner_fd >= 0:
            os.close(owner_fd)
    if me == procs[0]:
        assert got_fds == {}, got_fds
    else:
        assert list(got_fds) == [procs[0]] and len(got_fds[procs[0]]) == 1, got_fds
        dup = got_fds[procs[0]][0]
        assert os.pread(dup, 64, 0) == b"the owner's handle"
        os.close(dup)
    checked.append("c++ share_fds from one owner")
    # The same exchange from inside a jitted XLA execution (what the CUDA handlers do at their
    # first execution): the handler takes the GIL and uses the store while XLA runs.
    jax.ffi.register_ffi_target("jaxoverlap_test_exchange_probe",
                                testing.exchange_probe_target(), platform="cpu")
    testing.set_probe_exchange(bootstrap.StoreExchange("ab1e-g0", procs, timeout_s=60))
    probe = jax.jit(lambda x: jax.ffi.ffi_call(
        "jaxoverlap_test_exchange_probe", jax.ShapeDtypeStruct(x.shape, x.dtype))(x))
    total = sum(p + 1 for p in procs)
    for step in range(2):
        y = np.asarray(probe(np.full(4, float(step), np.float32)))
        assert np.array_equal(y, np.full(4, step + total, np.float32)), y
    testing.set_probe_exchange(None)
    checked.append("exchange inside an XLA execution")
    for method in ("socket", "pidfd"):
        fd = os.memfd_create(f"jo-test-{me}")
        os.write(fd, b"process %d" % me)
        try:
            shared = bootstrap.share_fds("cafe-g0", "fds", [fd], processes=procs, timeout_s=60,
                                          method=method)
        except RuntimeError as e:
            assert method == "pidfd" and "no ptrace access" in str(e), e
            checked.append(f"pidfd refused: {e}")
            os.close(fd)
            continue
        os.close(fd)
        assert sorted(shared) == [p for p in procs if p != me], shared
        for p, (dup,) in shared.items():
            assert os.pread(dup, 64, 0) == b"process %d" % p, (method, p)
            os.close(dup)
        checked.append(f"fds over {method}")
    return {"checked": checked, "error": error}


def _cliques() -> str:
    from jaxoverlap._executors import runtime

    return runtime.load_host().cliques()


def hang() -> dict[str, Any]:
    """Harness self-test: never returns (the harness must kill it at its deadline)."""
    while True:
        time.sleep(1.0)


def leak_shm() -> dict[str, Any]:
    """Harness self-test: leaves a segment named with the run's tag in /dev/shm, and one
    without, held open for a second (the harness sees it held by the job)."""
    path = f"/dev/shm/jaxoverlap-{os.environ['JAXOVERLAP_SHM_TAG']}-leak"
    with open(path, "wb") as f:
        f.write(b"x")
    untagged = f"/dev/shm/jo-untagged-leak-{os.getpid()}"
    with open(untagged, "wb") as f:
        f.write(b"x")
        time.sleep(1.0)
    return {"leaked": [path, untagged]}


def fail() -> dict[str, Any]:
    """Harness self-test: a failed check."""
    np.testing.assert_allclose(np.zeros(2), np.ones(2))
    return {}


def cuda_nccl_id(timeout_s: float = 60.0, root_absent: bool = False) -> dict[str, Any]:
    """Multi-process GPU cliques on the host-side fake: the trace-time exchange for real.

    Two cliques span every process (group 0: rank r in process r; group 1: reversed, so its
    root is the last process). ``bootstrap.ensure_gpu_cliques`` makes the NCCL unique id in the
    root process (the fake's ncclGetUniqueId), moves it through this job's jax.distributed store
    and registers it with the module, exactly as a GPU trace does. Then every process runs each
    whole clique through the CUDA executor on its own fake, playing the other processes' ranks
    (they register the id this process received): the executor's multi-process path
    (NCCL communicators made with the exchanged id) against the reference. What does not cross
    processes here is the fake's NCCL traffic itself (no GPU, no NCCL network).
    """
    from jaxoverlap._executors import bootstrap, runtime

    runtime.load_cuda()
    import jaxoverlap._cuda_fake as fake

    me, n = jax.process_index(), jax.process_count()
    table = np.array(list(range(n)) + list(reversed(range(n))), np.int64)
    key = 0x5EED
    fake.reset(fake.Config(devices=1))
    if root_absent:
        if me == 0:
            # Never traces; leaves without jax.distributed's shutdown barrier, which the peer
            # (gone with os._exit) would hold up for a long time.
            time.sleep(timeout_s + 5)
            os._exit(0)
        start = time.monotonic()
        try:
            bootstrap.ensure_gpu_cliques(fake, key, table, n, timeout_s)
            error = None
        except Exception as e:  # noqa: BLE001 - the error is what this scenario reports
            error = f"{type(e).__name__}: {e}"
        result = {"error": error, "elapsed_s": time.monotonic() - start}
        print("JO_MP_RESULT " + json.dumps(result), flush=True)
        os._exit(0)
    ids = bootstrap.ensure_gpu_cliques(fake, key, table, n, timeout_s)
    assert sorted(ids) == [0, 1], ids
    assert bootstrap.ensure_gpu_cliques(fake, key, table, n, timeout_s) == {}  # once per clique
    made = fake.counters().get("ncclGetUniqueId", 0)
    assert made == (me == 0) + (me == n - 1), (me, made)  # only the roots made ids
    everyone = bootstrap.allgather_bytes("nccl-id-check", "ids", ids[0] + ids[1],
                                          processes=list(range(n)), timeout_s=timeout_s)
    assert len(set(everyone.values())) == 1, "processes got different NCCL ids"
    assert ids[0] != ids[1] and all(i.startswith(b"fake-nccl-id") for i in ids.values())
    rows, k, nw = 3, 8, 6
    checked = []
    for group in (0, 1):
        procs = [int(p) for p in table[group * n:(group + 1) * n]]
        # The whole clique plays here as one group of its own: the id this process received
        # is registered for every played process.
        run_key = key + 1000 * (group + 1)
        for p in range(n):
            fake.set_nccl_id(run_key, 0, p, ids[group])
        for op in ("ag_matmul", "matmul_rs"):
            rng = np.random.default_rng(group)
            x_rows = rows if op == "ag_matmul" else rows * n
            xs = [rng.standard_normal((1, x_rows, k)).astype(np.float32) for _ in range(n)]
            ws = [rng.standard_normal((k, nw)).astype(np.float32) for _ in range(n)]
            # Each played process calls through a site of its own from the op's site key,
            # as every process instantiates its own program (same key: the same site).
            problem = dict(op=op, transport="nccl", nranks=n, batch=1, rows=rows, k=k, n=nw,
                           dtype="float32", chunks=2)
            out = fake.run(problem, xs=[x.tobytes() for x in xs], ws=[w.tobytes() for w in ws],
                           devices=[0] * n, clique_key=run_key, calls=1, processes=procs,
                           site_keys=[0x51E + ("ag_matmul", "matmul_rs").index(op)] * n)
            assert out["statuses"] == [None] * n and out["drained"], (out["statuses"],
                                                                       fake.errors())
            if op == "ag_matmul":
                refs = [np.concatenate(xs, axis=1) @ w for w in ws]
            else:
                total = sum(x @ w for x, w in zip(xs, ws, strict=True))
                refs = [total[:, r * rows:(r + 1) * rows] for r in range(n)]
            for y, ref in zip(out["ys"], refs, strict=True):
                np.testing.assert_allclose(np.frombuffer(y, np.float32).reshape(ref.shape), ref,
                                           rtol=1e-5, atol=1e-4)
            checked.append(f"{op}/g{group}")
    if me < 2:
        checked.append(p2p_handles_cross(fake, key + 7, timeout_s))
    fake.reset()
    return {"checked": checked, "made_ids": made}


def p2p_handles_cross(fake: Any, key: int, timeout_s: float) -> str:
    """p2p across processes 0 and 1: CUDA IPC (then fabric) handles travel from C++ through
    jo::Exchange.

    Each process runs only its own rank of a 2-rank p2p clique. At its first execution the
    clique exports its buffers (the fake's cudaIpcGetMemHandle), allgathers the handles through
    the exchange ``bootstrap_gpu_cliques`` registered (PyExchange -> StoreExchange -> this job's
    store) and opens the peer's: the fake refuses that, since its "device memory" is this
    process's heap, and its error names the pid the handle came from — the peer's.
    """
    from jaxoverlap._executors import bootstrap

    me = jax.process_index()
    bootstrap.ensure_gpu_cliques(fake, key, np.array([0, 1], np.int64), 2, timeout_s)
    pids = bootstrap.allgather_bytes("p2p-pids", "pid", str(os.getpid()).encode(),
                                      processes=[0, 1], timeout_s=timeout_s)
    problem = dict(op="ag_matmul", transport="p2p", nranks=2, batch=1, rows=3, k=8, n=6,
                   dtype="float32")
    inputs = dict(xs=[np.ones((1, 3, 8), np.float32).tobytes()] * 2,
                  ws=[np.ones((8, 6), np.float32).tobytes()] * 2, devices=[0, 0])
    out = fake.run(problem, **inputs, clique_key=key, skip_rank=1 - me,
                   timeout_ms=int(timeout_s * 1000), processes=[0, 1])
    status = out["statuses"][me] or ""
    assert "cudaIpcOpenMemHandle" in status and "failed" in status, status
    errors = " ".join(fake.errors())
    assert f"handle from pid {pids[1 - me].decode()}" in errors, errors
    assert fake.counters().get("cudaIpcGetMemHandle") == 2, fake.counters()
    # Again with GPUs that support fabric handles: both processes agree on them through the
    # store, and the peer's fabric handle (bytes) arrives here and is imported.
    fake.reset(fake.Config(fabric=True))
    bootstrap.ensure_gpu_cliques(fake, key + 1, np.array([0, 1], np.int64), 2, timeout_s)
    out = fake.run(problem, **inputs, clique_key=key + 1, skip_rank=1 - me,
                   timeout_ms=int(timeout_s * 1000), processes=[0, 1])
    status = out["statuses"][me] or ""
    assert "cuMemImportFromShareableHandle" in status, status
    errors = " ".join(fake.errors())
    assert f"handle from pid {pids[1 - me].decode()}" in errors, errors
    assert "cudaIpcGetMemHandle" not in fake.counters(), fake.counters()
    return "p2p-ipc-handles"


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    "portable": portable,
    "native": native,
    "fp8": fp8,
    "mxfp8": mxfp8,
    "fused": fused,
    "qkv": qkv,
    "set_order": set_order,
    "set_order_one_weight": set_order_one_weight,
    "order_mismatch": order_mismatch,
    "small_dev_shm": small_dev_shm,
    "chief_aot": chief_aot,
    "many_sites": many_sites,
    "watched": watched,
    "deserialized": deserialized,
    "cached": cached,
    "mixed": mixed,
    "peer_loss": peer_loss,
    "bootstrap_missing": bootstrap_missing,
    "bootstrap_death": bootstrap_death,
    "exchange": exchange,
    "cuda_nccl_id": cuda_nccl_id,
    "disagree": disagree,
    "bootstrap_retry": bootstrap_retry,
    "hang": hang,
    "leak_shm": leak_shm,
    "fail": fail,
}


def main() -> int:
    scenario, params = sys.argv[1], json.loads(sys.argv[2])
    process_id = int(os.environ["JO_MP_PROCESS_ID"])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    start = time.monotonic()
    jax.distributed.initialize(os.environ["JO_MP_COORDINATOR"],
                               num_processes=int(os.environ["JO_MP_NUM_PROCESSES"]),
                               process_id=process_id, initialization_timeout=90)
    result = SCENARIOS[scenario](**params)
    result["process_id"] = process_id
    result["elapsed_s"] = round(time.monotonic() - start, 2)
    print("JO_MP_RESULT " + json.dumps(result), flush=True)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
