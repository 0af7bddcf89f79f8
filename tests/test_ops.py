"""Forward results of every impl against a float64 NumPy reference, inside shard_map."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, f64, rand, spec_on, tp_mesh

import jaxoverlap as jo
from jaxoverlap import _kinds

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
NS = [1, 2, 4, 8]
# (shape of x per rank before the contraction dim, axis): rank-2, batch-first, sequence-first.
LAYOUTS = [((4,), 0), ((2, 4), 1), ((4, 3), 0)]
RING_OPTIONS = [(c, b) for c, b in itertools.product([1, 2], [False, True])]
LAYOUT_IDS = ["2d", "batch_first", "seq_first"]
# The ring's schedule depends on N, the layout and the ring options: their whole grid. The dtype
# changes what is added, not when: it rotates through the grid so that each dtype meets every
# N, layout and option (every pair of values), not every triple of them again.
RING_GRID = [pytest.param(n, DTYPES[(i + j + c) % len(DTYPES)], layout, chunks, bidirectional,
                          id=f"{(chunks, bidirectional)}-{LAYOUT_IDS[j]}-{n}-"
                             f"{jnp.dtype(DTYPES[(i + j + c) % len(DTYPES)]).name}")
             for c, (chunks, bidirectional) in enumerate(RING_OPTIONS)
             for j, layout in enumerate(LAYOUTS) for i, n in enumerate(NS)]


def _ag_case(n, dtype, layout, **kw):
    local_rows, axis = layout
    k, nw = 8, 3 * n
    shape = list(local_rows) + [k]
    shape[axis] *= n
    x = rand(0, shape, dtype)
    w = rand(1, (k, nw), dtype)
    mesh = tp_mesh(n)
    ndim = len(shape)
    fn = jax.jit(jax.shard_map(
        lambda x, w: jo.ag_matmul(x, w, "tp", axis=axis, **kw),
        mesh=mesh, in_specs=(spec_on(ndim, axis, "tp"), spec_on(2, 1, "tp")),
        out_specs=spec_on(ndim, ndim - 1, "tp")))
    return fn(x, w), f64(x) @ f64(w)


def _rs_case(n, dtype, layout, **kw):
    local_rows, axis = layout
    kf, nw = 4, 5
    shape = list(local_rows) + [kf * n]
    shape[axis] *= n
    x = rand(2, shape, dtype)
    w = rand(3, (kf * n, nw), dtype)
    mesh = tp_mesh(n)
    ndim = len(shape)
    fn = jax.jit(jax.shard_map(
        lambda x, w: jo.matmul_rs(x, w, "tp", axis=axis, **kw),
        mesh=mesh, in_specs=(spec_on(ndim, ndim - 1, "tp"), spec_on(2, 0, "tp")),
        out_specs=spec_on(ndim, axis, "tp")))
    return fn(x, w), f64(x) @ f64(w)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_xla_matches_reference(n, dtype, layout):
    y, ref = _ag_case(n, dtype, layout, impl="xla")
    assert y.dtype == dtype
    assert_close(y, ref, dtype)
    y, ref = _rs_case(n, dtype, layout, impl="xla")
    assert y.dtype == dtype
    assert_close(y, ref, dtype)


@pytest.mark.parametrize("n,dtype,layout,chunks,bidirectional", RING_GRID)
def test_ring_ag_matches_reference(n, dtype, layout, chunks, bidirectional):
    y, ref = _ag_case(n, dtype, layout, impl="ring", chunks=chunks, bidirectional=bidirectional)
    assert y.dtype == dtype and y.shape == ref.shape
    assert_close(y, ref, dtype)


@pytest.mark.parametrize("n,dtype,layout,chunks,bidirectional", RING_GRID)
def test_ring_rs_matches_reference(n, dtype, layout, chunks, bidirectional):
    y, ref = _rs_case(n, dtype, layout, impl="ring", chunks=chunks, bidirectional=bidirectional)
    assert y.dtype == dtype and y.shape == ref.shape
    assert_close(y, ref, dtype)


@pytest.mark.parametrize("impl", ["xla", "ring", "native"])
def test_return_gathered(impl):
    n, axis = 4, 1
    x = rand(4, (2, 8, 6), jnp.float32)
    w = rand(5, (6, 8), jnp.float32)
    mesh = tp_mesh(n)
    fn = jax.jit(jax.shard_map(
        lambda x, w: jo.ag_matmul(x, w, "tp", axis=axis, impl=impl, return_gathered=True),
        mesh=mesh, in_specs=(spec_on(3, 1, "tp"), spec_on(2, 1, "tp")),
        out_specs=(spec_on(3, 2, "tp"), spec_on(3, 0, None)), check_vma=False))
    y, gathered = fn(x, w)
    np.testing.assert_array_equal(np.asarray(gathered), np.asarray(x))
    assert_close(y, f64(x) @ f64(w), jnp.float32)


def test_four_dim_input_with_axis_in_the_middle():
    n = 2
    x = rand(6, (2, 3, 4, 5), jnp.float32)   # [B, H, S, K], S on axis 2
    w = rand(7, (5, 4), jnp.float32)
    mesh = tp_mesh(n)
    fn = jax.jit(jax.shard_map(
        lambda x, w: jo.ag_matmul(x, w, "tp", axis=2, impl="ring", chunks=2),
        mesh=mesh, in_specs=(spec_on(4, 2, "tp"), spec_on(2, 1, "tp")),
        out_specs=spec_on(4, 3, "tp")))
    assert_close(fn(x, w), f64(x) @ f64(w), jnp.float32)


@pytest.mark.parametrize("transport", _kinds.names(_kinds.TRANSPORTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("chunks,bidirectional", [(1, False), (2, True)], ids=lambda v: str(v))
def test_native_through_the_public_ops(transport, dtype, n, chunks, bidirectional):
    """impl="native" via jo.ag_matmul / jo.matmul_rs (the executor's own matrix: tests/native)."""
    kw = dict(impl="native", transport=transport, chunks=chunks, bidirectional=bidirectional)
    y, ref = _ag_case(n, dtype, LAYOUTS[1], **kw)
    assert y.dtype == dtype
    assert_close(y, ref, dtype)
    y, ref = _rs_case(n, dtype, LAYOUTS[2], **kw)
    assert_close(y, ref, dtype)
