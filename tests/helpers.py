"""Shared test helpers, one dialect for every test module: meshes, inputs rounded to a dtype,
specs and placement, the float64 reference.

Every test runs on 8 host devices (conftest.py). The meshes: :func:`tp_mesh` (one axis over the
first n devices) and :func:`dp_tp_mesh` (2 x 4, data parallel x tensor parallel), Auto axes
unless ``kind`` says otherwise. Inputs: :func:`rand` (seeded, rounded to the dtype, so that the
reference sees the very values the op does) and :func:`f64` (the float64 reference's view).
"""

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


def tp_mesh(n: int = 4, name: str = "tp", kind: AxisType = AxisType.Auto, *,
            reverse: bool = False) -> Mesh:
    """One mesh axis ``name`` over the first ``n`` devices (``reverse``: in reverse order)."""
    devices = jax.devices()[:n]
    return Mesh(np.array(devices[::-1] if reverse else devices), (name,), axis_types=(kind,))


def dp_tp_mesh(kind: AxisType = AxisType.Auto, names: tuple[str, str] = ("dp", "tp")) -> Mesh:
    """The 2 x 4 mesh over the 8 devices: data parallel (``names[0]``) x tensor parallel."""
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), names, axis_types=(kind,) * 2)


def rand(key: int, shape, dtype=jnp.float32, *, scale: float = 1.0,
         positive: bool = False) -> jax.Array:
    """Random values already rounded to ``dtype`` (fp8 included), so the reference sees the same
    inputs: standard normal times ``scale``, or uniform in [0, 1) where ``positive`` (partial
    sums that never cancel, for a low-precision ring that rounds its accumulator on every
    hop)."""
    rng = np.random.default_rng(key)
    if positive:
        values = rng.uniform(0.0, 1.0, size=shape).astype(np.float32)
    else:
        values = rng.standard_normal(shape).astype(np.float32)
    if scale != 1.0:
        values = values * scale
    return jnp.asarray(values, dtype=dtype)


def f64(a) -> np.ndarray:
    """``a`` in float64, converted on the host (exact from every float dtype; a device array
    converted on its device would compile a program per shape and sharding)."""
    return np.asarray(a).astype(np.float64)


def spec_on(ndim: int, dim: int, name="tp") -> P:
    """The spec of a rank-``ndim`` array split over ``name`` on ``dim`` (negative: from the
    end), replicated on the others."""
    entries = [None] * ndim
    entries[dim] = name
    return P(*entries)


def put(a, mesh, spec) -> jax.Array:
    """``a`` placed by ``spec`` over ``mesh``, split on the host (an array on one device split
    on the devices would compile a slicing program per shape and sharding)."""
    if isinstance(a, jax.Array) and a.is_fully_addressable:
        a = np.asarray(a)
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


def absent(x, rank: int, enabled=lambda: True, axis_name: str = "tp"):
    """``x``, on ``rank`` of ``axis_name`` only once a clique of this process has broken, while
    ``enabled()``: a peer that misses a call until the others have timed out waiting for it,
    however fast or slow the machine runs them (call inside shard_map). The wait (bounded, 120 s)
    blocks the device's own thread in a callback."""
    import time

    from jax import lax

    from jaxoverlap._executors.runtime import load_host

    host = load_host()

    def broken() -> set[str]:
        return {line for line in host.cliques().splitlines() if "BROKEN" in line}

    def wait(value, r):
        if enabled() and int(r) == rank:
            before, end = broken(), time.monotonic() + 120
            while not broken() - before and time.monotonic() < end:
                time.sleep(0.01)
        return value

    held = lax.stop_gradient(x)
    waited = jax.pure_callback(wait, jax.ShapeDtypeStruct(x.shape, x.dtype), held,
                               lax.axis_index(axis_name))
    return x + (waited - held)  # exactly x, but ordered after the callback


def late(t, r, j, big):
    """``t``, late on the ranks ``r`` with ``r % 3 == j % 3``: behind a chain of real GEMMs on
    ``big`` (ones XLA cannot fold away), so that the devices see the calls of one program
    become ready in different orders (call inside shard_map, ``r`` the axis index)."""
    from jax import lax

    def slow(t):
        acc = big
        for _ in range(3):
            acc = jnp.tanh(acc @ big)
        return t + (0.0 * acc[0, 0]).astype(t.dtype)

    return lax.cond(r % 3 == j % 3, slow, lambda t: t, t)


# ---- fp8 operands and the formula they are checked against ---------------------------------

# The unit roundoff of each output dtype: one rounding moves a value v by at most u * |v|.
UNIT_ROUNDOFF = {jnp.dtype(jnp.float32): 2.0 ** -24, jnp.dtype(jnp.bfloat16): 2.0 ** -8,
                 jnp.dtype(jnp.float16): 2.0 ** -11}


def dequantized(a, scale) -> np.ndarray:
    """``a.astype(float32) * scale`` (the real value of an fp8 operand), in float64."""
    return np.asarray(np.asarray(a).astype(np.float32) * np.float32(scale), np.float64)


def assert_fp8_exact(y, ref, magnitude, out_dtype, *, k: int, reductions: int = 0) -> None:
    """``y`` equals the float64 ``ref`` of the dequantized operands up to one rounding to
    ``out_dtype`` (and, for a reduction in ``out_dtype``, one more per add: ``reductions``),
    plus float32 accumulation over ``k`` terms. ``magnitude``: the sum of the absolute products
    (``|x| @ |w|``), which bounds every partial sum."""
    u = UNIT_ROUNDOFF[jnp.dtype(out_dtype)]
    assert jnp.dtype(y.dtype) == jnp.dtype(out_dtype), (y.dtype, out_dtype)
    y, ref, magnitude = f64(y), np.asarray(ref, np.float64), np.asarray(magnitude, np.float64)
    bound = u * np.abs(ref) + (reductions * u + (k + 4) * 2.0 ** -24) * magnitude
    excess = np.abs(y - ref) - bound
    assert excess.max() <= 0, (
        f"{int((excess > 0).sum())} of {excess.size} elements off by more than the bound; "
        f"worst |y - ref| = {np.abs(y - ref).max():.3g}")


def native_calls(text: str) -> list[tuple[str, str, str]]:
    """(op, operand types, result types) of every native custom call of a lowered StableHLO
    module, in program order."""
    import re

    return re.findall(r"custom_call @jaxoverlap_(\w+)\(.*?\}\s*:\s*\(([^)]*)\)\s*->\s*(.*)",
                      text)
