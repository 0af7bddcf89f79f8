"""Shared test helpers: meshes, inputs rounded to a dtype, the float64 reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

TOLERANCE = {
    jnp.dtype(jnp.float32): dict(rtol=1e-5, atol=1e-5),
    jnp.dtype(jnp.bfloat16): dict(rtol=2e-2, atol=2e-3),
    jnp.dtype(jnp.float16): dict(rtol=2e-2, atol=2e-3),
}


def tp_mesh(n: int, name: str = "tp") -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), (name,), axis_types=(AxisType.Auto,))


def rand(key: int, shape, dtype) -> jax.Array:
    """Random values already rounded to ``dtype``, so the reference sees the same inputs."""
    values = np.random.default_rng(key).standard_normal(shape).astype(np.float32)
    return jnp.asarray(values, dtype=dtype)


def f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32), dtype=np.float64)


def spec_on(ndim: int, dim: int, name) -> P:
    entries = [None] * ndim
    entries[dim] = name
    return P(*entries)


def put(a, mesh, spec) -> jax.Array:
    return jax.device_put(a, NamedSharding(mesh, spec))


def assert_close(actual, expected, dtype) -> None:
    """Compares with the dtype's tolerance (f32 1e-5 relative; bf16/f16 2e-2).

    Sums are reordered (and, below float32, every partial sum travelling
    between ranks is rounded), so an element near zero carries an error
    proportional to the terms summed, not to itself: the absolute tolerance
    scales with the result's magnitude.
    """
    expected = np.asarray(expected, np.float64)
    tol = dict(TOLERANCE[jnp.dtype(dtype)])
    tol["atol"] = max(tol["atol"], tol["rtol"] * float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(f64(actual), expected, **tol)


def late(x, rank: int, seconds: float, enabled=lambda: True, axis_name: str = "tp"):
    """``x``, after ``seconds`` of sleep on ``rank`` of ``axis_name`` while ``enabled()``: a peer
    that reaches the next call late (call inside shard_map). The sleep runs in a callback on
    the device's own thread, so that device's next call starts late, as with OS jitter."""
    import time

    from jax import lax

    def host(value, r):
        if enabled() and int(r) == rank:
            time.sleep(seconds)
        return value

    held = lax.stop_gradient(x)
    slept = jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), held,
                              lax.axis_index(axis_name))
    return x + (slept - held)  # exactly x, but ordered after the callback
