"""``jaxoverlap.fp8.MXFP8BlockScaling``: the MXFP8 recipe trained through the ops (xla, ring,
and native on the host executor).

The reference is written here with numpy alone, from the OCP MX spec v1.0 §6.3
(https://www.opencompute.org/documents/ocp-microscaling-formats-mx-v1-0-spec-final-pdf): per
block of 32 along the contracted dim, the shared exponent ``floor(log2(amax)) - emax`` (8 for
e4m3, 15 for e5m2) clamped to [-127, 127], each element divided by ``2**exponent``, clipped to
the element type's largest finite value and rounded to it (ml_dtypes), then multiplied back, all
in float64; then the float64 product. Each GEMM quantizes its operands along its own
contraction dim (TransformerEngine's MXFP8BlockScaling: rowwise and columnwise copies): y =
Q(x, K)·Q(w, K), dx = Q(dy, N)·Q(w, N)ᵀ, dw = Q(x, rows)ᵀ·Q(dy, rows).
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import f64, put, rand, tp_mesh
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxoverlap import fp8
from jaxoverlap.flax import linen as jl

E4, E5 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
EMAX = {E4: 8, E5: 15}
ML = {E4: ml_dtypes.float8_e4m3fn, E5: ml_dtypes.float8_e5m2}
N = 2


def qdq(a, q_dtype, axis: int) -> np.ndarray:
    """``a`` quantized to MXFP8 along ``axis`` and dequantized, in float64 (the spec's rule)."""
    q_dtype = jnp.dtype(q_dtype)
    v = np.moveaxis(np.asarray(a, np.float64), axis, -1)
    blocks = v.reshape(v.shape[:-1] + (v.shape[-1] // 32, 32))
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        exponent = np.clip(np.floor(np.log2(amax)) - EMAX[q_dtype], -127, 127)
    top = float(ml_dtypes.finfo(ML[q_dtype]).max)
    scaled = np.clip(blocks / 2.0 ** exponent, -top, top)
    values = scaled.astype(ML[q_dtype]).astype(np.float64) * 2.0 ** exponent
    return np.moveaxis(values.reshape(v.shape), -1, axis)


def assert_equal_to_reference(got, want, magnitude) -> None:
    """Equal up to float32 sums (the operands are exact; the adds round), relative to the
    sum of the absolute products."""
    err = np.abs(f64(got) - want)
    assert (err <= 1e-6 * magnitude + 1e-30).all(), float((err / magnitude).max())


def test_quantizer_is_the_spec():
    """The library's quantizer against the numpy one, at magnitudes that saturate (a block's
    top significand above 1.75), underflow, and a block of zeros."""
    from jaxoverlap._fp8_dtypes import dequantize_blocks, quantize_blocks

    a = np.asarray(rand(0, (4, 96), jnp.float32)) * np.array([1e-30, 1.0, 3e4, 1e30])[:, None]
    a[1, 32:64] = 0.0
    a[2, 0] = 1.9 * 2.0 ** 16                       # 1.9 x 2^(emax + e): saturates to 448
    a = a.astype(np.float32)
    for q in (E4, E5):
        for axis in (0, 1) if q == E4 else (1,):
            b = a if axis == 1 else np.ascontiguousarray(a[:, :32].T)   # (32, 4) along rows
            qa, sa = jax.jit(quantize_blocks, static_argnums=(1, 2))(jnp.asarray(b), q, axis)
            assert qa.dtype == q and sa.dtype == jnp.float8_e8m0fnu
            np.testing.assert_array_equal(f64(dequantize_blocks(qa, sa, axis)), qdq(b, q, axis))


def _vjp_case(op, x_split: int, w_split: int, y_split: int, shapes, impl: str, grad_dtype,
              opts):
    mesh = tp_mesh(N)
    x_shape, w_shape, y_shape = shapes
    x, w, dy = rand(1, x_shape), rand(2, w_shape) * 0.5, rand(3, y_shape) * 3.0
    recipe = fp8.MXFP8BlockScaling(grad_dtype)

    def spec(split, ndim):
        return P(*(("tp" if d == split else None) for d in range(ndim)))

    kw = {fp8.ag_matmul: dict(axis=1, impl=impl, **opts), fp8.matmul_rs: dict(
        axis=1, impl=impl, **opts), fp8.matmul_ar: dict(impl=impl, **opts)}.get(op, {})
    f = jax.shard_map(lambda x, w: op(x, w, "tp", scaling=recipe, **kw), mesh=mesh,
                      in_specs=(spec(x_split, 3), spec(w_split, 2)),
                      out_specs=spec(y_split, 3))

    def loss(x, w):
        y = f(x, w)
        return jnp.sum(y * dy), y

    xs, ws = put(x, mesh, spec(x_split, 3)), put(w, mesh, spec(w_split, 2))
    (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(xs, ws)
    xq, wq = qdq(x, E4, 2), qdq(w, E4, 0)
    gq, wqn = qdq(dy, grad_dtype, 2), qdq(w, E4, 1)
    xr, gr = qdq(x, E4, 1), qdq(dy, grad_dtype, 1)
    assert y.dtype == x.dtype and dx.dtype == x.dtype and dw.dtype == w.dtype
    assert_equal_to_reference(y, xq @ wq, np.abs(xq) @ np.abs(wq))
    assert_equal_to_reference(dx, gq @ wqn.T, np.abs(gq) @ np.abs(wqn.T))
    assert_equal_to_reference(dw, np.einsum("bsk,bsn->kn", xr, gr),
                              np.einsum("bsk,bsn->kn", np.abs(xr), np.abs(gr)))


# (impl, gradient dtype, the ops' options): the first runs in the quick loop.
CASES = [("ring", E4, dict(chunks=2, bidirectional=True)), ("xla", E5, {}),
         ("native", E5, dict(transport="p2p", chunks=2)),   # the host executor
         ("native", E4, dict(transport="nccl"))]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1].name}")
def test_forward_and_gradients_are_the_reference(case):
    """AG+GEMM (backward: GEMM+RS, and x's rows gathered blocked along them), GEMM+RS
    (backward: AG+GEMM, and the gradient's rows gathered), GEMM+AR and Megatron's f (local
    GEMMs): y, dx and dw. Rows and N per rank are whole blocks of 32."""
    impl, grad_dtype, opts = case
    # AG: x [1, 64, 32] rows split, w [32, 64] columns split; y [1, 64, 64] columns split.
    _vjp_case(fp8.ag_matmul, 1, 1, 2, ((1, 64, 32), (32, 64), (1, 64, 64)), impl,
              grad_dtype, opts)
    # RS: x [1, 64, 64] K split, w [64, 32] rows split; y [1, 64, 32] rows split.
    _vjp_case(fp8.matmul_rs, 2, 0, 1, ((1, 64, 64), (64, 32), (1, 64, 32)), impl,
              grad_dtype, opts)
    # AR: x [1, 32, 64] K split, w [64, 32] rows split; y replicated.
    _vjp_case(fp8.matmul_ar, 2, 0, None, ((1, 32, 64), (64, 32), (1, 32, 32)), impl,
              grad_dtype, opts)
    # Megatron's f: x [1, 32, 32] replicated (its gradient summed over the ranks), w [32, 64]
    # columns split; y columns split.
    _vjp_case(fp8.copy_matmul, None, 1, 2, ((1, 32, 32), (32, 64), (1, 32, 64)), impl,
              grad_dtype, opts)


def _reference_step(x, w1, w2, g):
    """The loss of the two-layer model and its weight gradients, by hand: each GEMM's operands
    quantized along its contraction dim, each layer's output rounded to float32 (its dtype)."""
    def f32(a):
        return a.astype(np.float32).astype(np.float64)

    h = f32(qdq(x, E4, 2) @ qdq(w1, E4, 0))
    a = f32(np.sin(h))
    y = f32(qdq(a, E4, 2) @ qdq(w2, E4, 0))
    dy = y                                               # loss = sum(y**2) / 2
    da = f32(qdq(dy, g, 2) @ qdq(w2, E4, 1).T)
    dw2 = np.einsum("bsk,bsn->kn", qdq(a, E4, 1), qdq(dy, g, 1))
    dh = f32(da * np.cos(h))
    dw1 = np.einsum("bsk,bsn->kn", qdq(x, E4, 1), qdq(dh, g, 1))
    return 0.5 * np.sum(y ** 2), dw1, dw2


def test_a_training_step_is_the_reference_models():
    """Three SGD steps of AG+GEMM -> sin -> GEMM+RS (sequence parallel, xla then ring): the
    loss of each step equals the reference model's, whose weights take the reference's own
    gradients."""
    mesh, lr = tp_mesh(N), 0.05
    x, w1, w2 = rand(4, (1, 64, 32)), rand(5, (32, 64)) * 0.3, rand(6, (64, 32)) * 0.3
    recipe = fp8.MXFP8BlockScaling()

    def body(x, w1, w2):
        h = fp8.ag_matmul(x, w1, "tp", axis=1, scaling=recipe, impl="xla")
        return fp8.matmul_rs(jnp.sin(h), w2, "tp", axis=1, scaling=recipe, impl="ring")

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), P("tp")),
                      out_specs=P(None, "tp"))

    @jax.jit
    def step(x, w1, w2):
        loss, (g1, g2) = jax.value_and_grad(lambda w1, w2: 0.5 * jnp.sum(f(x, w1, w2) ** 2),
                                            argnums=(0, 1))(w1, w2)
        return loss, w1 - lr * g1, w2 - lr * g2

    r1, r2 = f64(w1), f64(w2)
    for _ in range(3):
        loss, w1, w2 = step(x, w1, w2)
        want, d1, d2 = _reference_step(f64(x), r1, r2, E4)
        np.testing.assert_allclose(float(loss), want, rtol=1e-5)
        r1, r2 = (r1 - lr * d1).astype(np.float32), (r2 - lr * d2).astype(np.float32)
        np.testing.assert_allclose(f64(w1), r1, rtol=0, atol=1e-5 * np.abs(r1).max())
        np.testing.assert_allclose(f64(w2), r2, rtol=0, atol=1e-5 * np.abs(r2).max())


def _placed(variables, mesh):
    """A linen layer's variables unboxed and placed as their partitioning metadata says."""
    return jax.device_put(nn.unbox(variables), jax.tree.map(
        lambda s: jax.NamedSharding(mesh, s), nn.get_partition_spec(variables)))


@pytest.mark.slow
def test_linen_layer_runs_the_recipe_natively_on_the_host_executor():
    """A RowParallelDense (GEMM+RS forward, AG+GEMM backward) given the recipe and
    impl="native" on global Explicit arrays: the host executor runs its block-scaled calls
    (the program's custom calls carry e8m0 operands), y and the gradients are the reference's."""
    from helpers import native_calls

    mesh = tp_mesh(N, kind=AxisType.Explicit)
    x, dy = rand(9, (1, 64, 64)), rand(10, (1, 64, 32))
    layer = jl.RowParallelDense(32, use_bias=False, impl="native",
                                dot_general=fp8.MXFP8BlockScaling())
    variables = layer.init(jax.random.key(1), x)
    with jax.set_mesh(mesh):
        placed = _placed(variables, mesh)
        xs = put(x, mesh, P(None, None, "tp"))

        def loss(v, x):
            y = layer.apply(v, x)
            return jnp.sum(y * dy), y

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        (_, y), (dv, dx) = step(placed, xs)
        calls = native_calls(step.lower(placed, xs).as_text())
    assert calls and all("f8E8M0FNU" in operands for _, operands, _ in calls), calls
    w = f64(variables["params"]["kernel"])
    xq, wq = qdq(x, E4, 2), qdq(w, E4, 0)
    gq, wqn, xr, gr = qdq(dy, E4, 2), qdq(w, E4, 1), qdq(x, E4, 1), qdq(dy, E4, 1)
    assert_equal_to_reference(y, xq @ wq, np.abs(xq) @ np.abs(wq))
    assert_equal_to_reference(dx, gq @ wqn.T, np.abs(gq) @ np.abs(wqn.T))
    assert_equal_to_reference(dv["params"]["kernel"], np.einsum("bsk,bsn->kn", xr, gr),
                              np.einsum("bsk,bsn->kn", np.abs(xr), np.abs(gr)))


def test_linen_layer_takes_the_recipe():
    """ColumnParallelDense(dot_general=MXFP8BlockScaling()) on global arrays (Explicit axes,
    sequence parallel) and without a mesh (one device): y and the gradients of x and the
    kernel are the reference's; the
    lowered program's all-gathers are x's e4m3 rows and their e8m0 scales (the backward's
    gather of x's copy blocked along its rows is XLA's, placed when it partitions the dw dot
    of global arrays)."""
    mesh = tp_mesh(N, kind=AxisType.Explicit)
    x, dy = rand(7, (1, 64, 32)), rand(8, (1, 64, 64))
    layer = jl.ColumnParallelDense(64, use_bias=False, impl="xla",
                                   dot_general=fp8.MXFP8BlockScaling())
    variables = layer.init(jax.random.key(0), x)
    with jax.set_mesh(mesh):
        placed = _placed(variables, mesh)
        xs = put(x, mesh, P(None, "tp"))

        def loss(v, x):
            y = layer.apply(v, x)
            return jnp.sum(y * dy), y

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        parallel = step(placed, xs)
        text = step.lower(placed, xs).as_text()
    one_device = step(variables, x)                   # no mesh: the recipe as a dot_general
    w = f64(variables["params"]["kernel"])
    xq, wq = qdq(x, E4, 2), qdq(w, E4, 0)
    gq, wqn, xr, gr = qdq(dy, E4, 2), qdq(w, E4, 1), qdq(x, E4, 1), qdq(dy, E4, 1)
    for (_, y), (dv, dx) in (parallel, one_device):
        assert_equal_to_reference(y, xq @ wq, np.abs(xq) @ np.abs(wq))
        assert_equal_to_reference(dx, gq @ wqn.T, np.abs(gq) @ np.abs(wqn.T))
        assert_equal_to_reference(dv["params"]["kernel"], np.einsum("bsk,bsn->kn", xr, gr),
                                  np.einsum("bsk,bsn->kn", np.abs(xr), np.abs(gr)))
    gathers = re.findall(r'"stablehlo\.all_gather".*?->\s*tensor<([^>]*)>', text, re.S)
    assert sorted(gathers) == ["1x64x1xf8E8M0FNU", "1x64x32xf8E4M3FN"], gathers


def test_blocks_that_do_not_fit_are_a_clear_error():
    """K, N per rank and the rows per rank must be whole blocks of 32; forward-only calls need
    only K (a decode step's single row runs)."""
    mesh = tp_mesh(N)
    recipe = fp8.MXFP8BlockScaling()

    def run(x_shape, w_shape, grad: bool):
        x, w = rand(0, x_shape), rand(1, w_shape)
        f = jax.shard_map(lambda x, w: fp8.ag_matmul(x, w, "tp", axis=1, scaling=recipe,
                                                     impl="xla"),
                          mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp")),
                          out_specs=P(None, None, "tp"))
        if grad:
            return jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w)), argnums=1))(x, w)
        return jax.jit(f)(x, w)

    with pytest.raises(ValueError, match=r"K, this rank's x\.shape\[-1\] = 48 is not a "
                                         r"multiple of 32.*pad x's features"):
        run((1, 64, 48), (48, 64), grad=False)
    assert run((1, 2, 32), (32, 64), grad=False).shape == (1, 2, 64)
    with pytest.raises(ValueError, match=r"the rows, this rank's x\.shape\[-2\] = 1 .*"
                                         r"dw = xᵀ·dy .*pad the sequence"):
        run((1, 2, 32), (32, 64), grad=True)
    with pytest.raises(ValueError, match=r"N, this rank's w\.shape\[1\] = 16 .*dx = dy·wᵀ"):
        run((1, 64, 32), (32, 32), grad=True)
    with pytest.raises(TypeError, match=r"grad_dtype=.*float8_e4m3fn .* or jnp\.float8_e5m2"):
        fp8.MXFP8BlockScaling(jnp.bfloat16)
