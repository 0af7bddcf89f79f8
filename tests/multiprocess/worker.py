"""One process of a multi-process test, started by ``harness.py`` (never collected by pytest).

Usage: ``worker.py SCENARIO PARAMS_JSON`` with ``JO_MP_COORDINATOR``, ``JO_MP_NUM_PROCESSES`` and
``JO_MP_PROCESS_ID`` in the environment. The process joins the ``jax.distributed`` job, runs the
scenario (which raises on any mismatch), prints ``JO_MP_RESULT <json>`` and exits 0.

Every check compares the shards this process holds with a float64 NumPy reference computed
from the same seeded inputs in every process.
"""

from __future__ import annotations

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
    done = []
    for transport in transports:
        for op in ("ag_matmul", "matmul_rs"):
            for axis in axes or [0, 1]:
                bidir = axis == 1
                check_op(op, mesh, "native", dtype=dtype, axis=axis, transport=transport,
                         chunks=2, bidirectional=bidir, seed=axis)
                done.append(f"{op}/{transport}/axis{axis}")
    return {"checked": done, "cliques": _cliques()}


def _cliques() -> str:
    from jaxoverlap import _runtime

    return _runtime.load_host().cliques()


def hang() -> dict[str, Any]:
    """Harness self-test: never returns (the harness must kill it at its deadline)."""
    while True:
        time.sleep(1.0)


def leak_shm() -> dict[str, Any]:
    """Harness self-test: leaves a segment named with the run's tag in /dev/shm."""
    path = f"/dev/shm/jaxoverlap-{os.environ['JAXOVERLAP_SHM_TAG']}-leak"
    with open(path, "wb") as f:
        f.write(b"x")
    return {"leaked": path}


def fail() -> dict[str, Any]:
    """Harness self-test: a failed check."""
    np.testing.assert_allclose(np.zeros(2), np.ones(2))
    return {}


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    "portable": portable,
    "native": native,
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
