"""Gradients of both ops against jax.grad of the unfused "xla" impl (and a float64 reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, dp_tp_mesh, f64, rand, spec_on, tp_mesh
from jax.sharding import PartitionSpec as P

import jaxoverlap as jo

IMPLS = ["xla", "ring", "native"]


def _mlp(impl, n, axis, checkpoint=False, **kw):
    """AG+GEMM then GEMM+RS (the Megatron MLP pair) on local shards; returns a scalar loss fn."""
    ndim = 3

    def block(x, w1, w2):
        h = jo.ag_matmul(x, w1, "tp", axis=axis, impl=impl, **kw)
        h = jnp.tanh(h)
        return jo.matmul_rs(h, w2, "tp", axis=axis, impl=impl, **kw)

    if checkpoint:
        block = jax.checkpoint(block)
    mesh = tp_mesh(n)
    sharded = jax.shard_map(
        block, mesh=mesh,
        in_specs=(spec_on(ndim, axis, "tp"), spec_on(2, 1, "tp"), spec_on(2, 0, "tp")),
        out_specs=spec_on(ndim, axis, "tp"))
    return lambda x, w1, w2: jnp.sum(sharded(x, w1, w2).astype(jnp.float32) ** 2)


def _flat(a):
    return a.reshape(-1, a.shape[-1])


def _reference_grads(x, w1, w2):
    """Float64 NumPy gradients of sum((tanh(x@w1)@w2)**2)."""
    x, w1, w2 = f64(x), f64(w1), f64(w2)
    h = np.tanh(x @ w1)
    y = h @ w2
    dy = 2 * y
    dw2 = _flat(h).T @ _flat(dy)
    dh = dy @ w2.T * (1 - h**2)
    dw1 = _flat(x).T @ _flat(dh)
    dx = dh @ w1.T
    return dx, dw1, dw2


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_grads_match_reference(impl, n, axis, dtype):
    shape = [2, 2, 8]
    shape[axis] = 2 * n
    x = rand(10, shape, dtype)
    w1 = rand(11, (8, 4 * n), dtype) * 0.3
    w2 = rand(12, (4 * n, 8), dtype) * 0.3
    grads = jax.jit(jax.grad(_mlp(impl, n, axis), argnums=(0, 1, 2)))(x, w1, w2)
    for g, ref, p in zip(grads, _reference_grads(x, w1, w2), (x, w1, w2), strict=True):
        assert g.shape == p.shape and g.dtype == p.dtype
        assert_close(g, ref, dtype)


FUSED_N, FUSED_AXIS = 4, 1  # test_fused_grads_equal_xla_grads' ranks and sharded axis


def _fused_grads_inputs():
    """x, w1, w2 of test_fused_grads_equal_xla_grads."""
    return (rand(13, (2, 8, 8), jnp.float32), rand(14, (8, 8), jnp.float32),
            rand(15, (8, 8), jnp.float32))


@pytest.fixture(scope="module")
def xla_grads():
    """The xla impl's gradients at those inputs: the same program for every case, compiled and
    run once rather than once a case."""
    xla = jax.grad(_mlp("xla", FUSED_N, FUSED_AXIS), argnums=(0, 1, 2))
    return jax.jit(xla)(*_fused_grads_inputs())


@pytest.mark.parametrize("impl,transport", [("ring", None), ("native", "nccl"),
                                            ("native", "p2p"), ("native", "multicast")])
@pytest.mark.parametrize("chunks,bidirectional", [(1, False), (2, True), (2, False)])
def test_fused_grads_equal_xla_grads(impl, transport, chunks, bidirectional, xla_grads):
    n, axis = FUSED_N, FUSED_AXIS
    x, w1, w2 = _fused_grads_inputs()
    extra = {"transport": transport} if transport else {}
    ring = jax.grad(_mlp(impl, n, axis, chunks=chunks, bidirectional=bidirectional, **extra),
                    argnums=(0, 1, 2))
    for a, b in zip(jax.jit(ring)(x, w1, w2), xla_grads, strict=True):
        assert_close(a, f64(b), jnp.float32)


@pytest.mark.parametrize("transport", ["p2p", "multicast"])
def test_fused_gemm_grads_match_reference(transport):
    """jo.config(fused=True): the MLP pair forward (AG+GEMM, GEMM+RS) and backward (their
    transposes) all run the fused programs on the host executor (bf16, 16-byte rows)."""
    n, axis = 4, 1
    x = rand(19, (2, 8 * n, 16), jnp.bfloat16)
    w1 = rand(20, (16, 8 * n), jnp.bfloat16) * 0.3
    w2 = rand(21, (8 * n, 16), jnp.bfloat16) * 0.3
    with jo.config(fused=True):
        f = jax.jit(jax.grad(_mlp("native", n, axis, transport=transport, chunks=2),
                             argnums=(0, 1, 2)))
        text = f.lower(x, w1, w2).as_text()
        grads = f(x, w1, w2)
    # four native calls (two forward, two backward), every one fused
    assert text.count("fused = true") == 4 and "fused = false" not in text
    for g, ref, p in zip(grads, _reference_grads(x, w1, w2), (x, w1, w2), strict=True):
        assert g.shape == p.shape and g.dtype == p.dtype
        assert_close(g, ref, jnp.bfloat16)


@pytest.mark.parametrize("impl", IMPLS)
def test_grads_under_checkpoint(impl):
    n, axis = 2, 0
    x = rand(16, (4, 2, 8), jnp.float32)
    w1 = rand(17, (8, 6), jnp.float32)
    w2 = rand(18, (6, 8), jnp.float32)
    plain = jax.grad(_mlp(impl, n, axis), argnums=(0, 1, 2))(x, w1, w2)
    remat = jax.jit(jax.grad(_mlp(impl, n, axis, checkpoint=True), argnums=(0, 1, 2)))(x, w1, w2)
    for a, b in zip(plain, remat, strict=True):
        assert_close(a, f64(b), jnp.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_replicated_weight_gets_summed_gradient(impl):
    """A weight replicated over a second mesh axis (data parallel) gets the psum of its parts."""
    mesh = dp_tp_mesh()
    x = rand(19, (4, 8, 8), jnp.float32)      # [B, S, H], B on dp, S on tp
    w = rand(20, (8, 8), jnp.float32)

    def loss(x, w):
        f = jax.shard_map(
            lambda x, w: jo.ag_matmul(x, w, "tp", axis=1, impl=impl), mesh=mesh,
            in_specs=(P("dp", "tp", None), P(None, "tp")), out_specs=P("dp", None, "tp"))
        return jnp.sum(f(x, w) ** 2)

    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    y = f64(x) @ f64(w)
    assert_close(dw, np.einsum("bsh,bsn->hn", f64(x), 2 * y), jnp.float32)
    assert_close(dx, 2 * y @ f64(w).T, jnp.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_grad_through_gathered_output(impl):
    """return_gathered=True: a cotangent on the gathered x flows back to x."""
    n = 4
    x = rand(21, (8, 4), jnp.float32)
    w = rand(22, (4, 8), jnp.float32)
    mesh = tp_mesh(n)

    def loss(x, w):
        def body(x, w):
            y, g = jo.ag_matmul(x, w, "tp", impl=impl, return_gathered=True)
            return y, jnp.sum(g**3, axis=1, keepdims=True)
        y, g = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                             out_specs=(P(None, "tp"), P("tp")))(x, w)
        return jnp.sum(y**2) + jnp.sum(g) / n

    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    xf, wf = f64(x), f64(w)
    y = xf @ wf
    assert_close(dx, 2 * y @ wf.T + 3 * xf**2, jnp.float32)
    assert_close(dw, xf.T @ (2 * y), jnp.float32)
