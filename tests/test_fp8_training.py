"""``jaxoverlap.fp8``: the ops trained under Flax's FP8 recipe.

Delayed scaling is checked against Flax's own functions on one device (``fp8_ops.in_qdq`` /
``out_qdq``, what ``nn.Fp8DotGeneralOp`` runs): the gradients of x and w, and the new FP8 state
(the gradient of the state), over steps that feed the state back. Current scaling is checked
against the formula with each rank's own scales. The backward pass moves fp8 where the forward
did: the lowered program's all-gathers are e4m3 (x) and e5m2 (the gradient); with
``impl="native"`` the executors' calls receive those fp8 operands. Every impl runs here,
``native`` (the host executor) included.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import fp8_ops
from helpers import assert_close, native_calls, put, rand, tp_mesh
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import jaxoverlap as jo
from jaxoverlap import fp8

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
N = 4


def _flax_dot(a, b, s: fp8.DelayedScaling):
    """Flax's FP8 GEMM (nn.Fp8DotGeneralOp's computation) with the state ``s``."""
    a = fp8_ops.in_qdq(jnp.float32, E4, a, s.input_scale, s.input_amax_history)
    b = fp8_ops.in_qdq(jnp.float32, E4, b, s.kernel_scale, s.kernel_amax_history)
    y = fp8_ops.dot_general_with_precision(a, b, (((a.ndim - 1,), (0,)), ((), ())))
    return fp8_ops.out_qdq(jnp.float32, E5, y, s.output_grad_scale, s.output_grad_amax_history)


def _reference(x, w1, w2, s1, s2):
    return jnp.sum(jnp.sin(_flax_dot(jax.nn.gelu(_flax_dot(x, w1, s1)), w2, s2)))


def _inputs():
    return rand(0, (2, 8, 16), jnp.float32), rand(1, (16, 8), jnp.float32) * 0.3, \
        rand(2, (8, 16), jnp.float32) * 0.3


def _assert_same(ours, flax) -> None:
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(flax), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * max(np.abs(b).max(), 1e-30))


def _train(loss, args, steps: int = 2):
    """``steps`` gradients of ``loss`` against Flax's, the FP8 states fed back each step."""
    x, w1, w2 = _inputs()
    s1 = s2 = fp8.DelayedScaling.init(16)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    flax_grad = jax.jit(jax.grad(_reference, argnums=(0, 1, 2, 3, 4)))
    for _ in range(steps):
        ours = grad(*args(x, w1, w2), s1, s2)
        flax = flax_grad(x, w1, w2, s1, s2)
        _assert_same(ours, flax)
        s1, s2 = flax[3], flax[4]
    assert float(s1.input_scale[0]) != 1.0 and float(s2.output_grad_scale[0]) != 1.0


# (sequence parallel, the impl of the first op, of the second, the native ops' options)
LAYOUTS = [(True, "xla", "ring", {}), (False, None, "ring", {}),
           (True, "native", "native", dict(transport="p2p", chunks=2, bidirectional=True)),
           (False, None, "native", dict(transport="multicast"))]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["ag_rs", "f_ar", "ag_rs-native",
                                                 "f_ar-native"])
def test_delayed_scaling_inside_shard_map_is_flax_recipe(layout):
    sequence_parallel, first, second, options = layout
    mesh = tp_mesh(N)

    def body(x, w1, w2, s1, s2):
        if sequence_parallel:
            h = fp8.ag_matmul(x, w1, "tp", axis=1, scaling=s1, impl=first,
                              **(options if first == "native" else {}))
            return fp8.matmul_rs(jax.nn.gelu(h), w2, "tp", axis=1, scaling=s2, impl=second,
                                 **options)
        h = fp8.copy_matmul(x, w1, "tp", scaling=s1)
        return fp8.matmul_ar(jax.nn.gelu(h), w2, "tp", scaling=s2, impl=second, **options)

    x_spec, y_spec = (P(None, "tp"), P(None, "tp")) if sequence_parallel else (P(), P())
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, P(None, "tp"), P("tp"), P(), P()),
                           out_specs=y_spec)
    _train(lambda *a: jnp.sum(jnp.sin(mapped(*a))), lambda *a: a)


@pytest.mark.slow
def test_delayed_scaling_on_global_arrays_is_flax_recipe():
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    for types, impl in ((AxisType.Explicit, "auto"), (AxisType.Auto, "native")):
        mesh = Mesh(devices, ("dp", "tp"), axis_types=(types, types))

        def loss(x, w1, w2, s1, s2, mesh=mesh, impl=impl):
            h = jax.nn.gelu(fp8.ag_matmul(x, w1, "tp", axis=1, scaling=s1, mesh=mesh,
                                          impl=impl))
            return jnp.sum(jnp.sin(fp8.matmul_rs(h, w2, "tp", axis=1, scaling=s2, mesh=mesh,
                                                 impl=impl)))

        with jax.set_mesh(mesh):
            _train(loss, lambda x, w1, w2, mesh=mesh: (
                put(x, mesh, P("dp", "tp")), put(w1, mesh, P(None, "tp")),
                put(w2, mesh, P("tp", None))), steps=2)


def _shard_quantized(a, q_dtype, axis: int, n: int):
    """a's n shards along ``axis``, each quantized with its own amax (current scaling), and
    dequantized: what each rank's fp8 shard stands for."""
    out = []
    for part in np.split(np.asarray(a), n, axis=axis):
        amax = np.abs(part).max().astype(np.float32)
        scale = fp8_ops.compute_scale(jnp.float32(amax), jnp.float32(1.0),
                                      fp8_ops.get_fp8_max(q_dtype, jnp.float32))
        q = fp8_ops.quantize(jnp.asarray(part), q_dtype, scale, jnp.float32)
        out.append(np.asarray(q, np.float64) * np.float64(np.float32(scale)))
    return np.concatenate(out, axis=axis)


def _value_and_vjp(f, x, w, dy):
    y, vjp = jax.vjp(f, x, w)
    return y, vjp(dy)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla", "ring", "native"])
def test_current_scaling_uses_each_ranks_own_scales(impl):
    """Forward and backward of AG+GEMM and GEMM+RS: every shard quantized with its own amax
    (x's row shards, w's column / row shards, the gradient's shards), no amax all-reduce."""
    mesh = tp_mesh(N)
    x = rand(3, (2, 8, 16), jnp.float32) * np.repeat(np.array([0.1, 1, 7, 0.01]), 2)[:, None]
    w = rand(4, (16, 8), jnp.float32)
    dy = rand(5, (2, 8, 8), jnp.float32)

    for op, x_split, w_split, y_split in ((fp8.ag_matmul, 1, 1, 2), (fp8.matmul_rs, 2, 0, 1)):
        spec = [None] * 3
        spec[x_split] = "tp"
        out = [None] * 3
        out[y_split] = "tp"
        f = jax.shard_map(lambda x, w, op=op: op(x, w, "tp", axis=1, impl=impl), mesh=mesh,
                          in_specs=(P(*spec), P(*[("tp" if d == w_split else None)
                                                  for d in range(2)])), out_specs=P(*out))
        y, (dx, dw) = jax.jit(functools.partial(_value_and_vjp, f))(x, w, dy)
        xd = _shard_quantized(x, E4, x_split, N)
        wd = _shard_quantized(w, E4, w_split, N)
        gd = _shard_quantized(dy, E5, y_split, N)
        ref = xd @ wd
        np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=1e-5,
                                   atol=1e-5 * np.abs(ref).max())
        np.testing.assert_allclose(np.asarray(dx, np.float64), gd @ wd.T, rtol=1e-5,
                                   atol=1e-5 * np.abs(gd @ wd.T).max())
        dw_ref = np.einsum("bsk,bsn->kn", xd, gd)
        np.testing.assert_allclose(np.asarray(dw, np.float64), dw_ref, rtol=1e-5,
                                   atol=1e-5 * np.abs(dw_ref).max())


@pytest.mark.parametrize("impl", ["xla", "native"])
def test_the_backward_pass_moves_fp8_too(impl):
    """Forward AG+GEMM gathers e4m3 x; GEMM+RS's backward all-gather moves the e5m2
    gradient; the reductions (GEMM+RS forward, AG+GEMM backward) move float32 here. Native:
    the executors' calls receive those fp8 operands (they move them: tests/native)."""
    mesh = tp_mesh(N)
    x, w1, w2 = _inputs()

    def loss(x, w1, w2):
        def body(x, w1, w2):
            h = fp8.ag_matmul(x, w1, "tp", axis=1, impl=impl)
            return fp8.matmul_rs(h, w2, "tp", axis=1, impl=impl)
        return jnp.sum(jnp.sin(jax.shard_map(
            body, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), P("tp")),
            out_specs=P(None, "tp"))(x, w1, w2)))

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, w1, w2).as_text()
    gathers = re.findall(r'"stablehlo\.all_gather".*?->\s*tensor<([^>]*)>', text, re.S)
    big = [t for t in gathers if t.count("x") >= 2]
    scatters = re.findall(r'"stablehlo\.reduce_scatter".*?->\s*tensor<([^>]*)>', text, re.S)
    if impl == "native":          # (op, x's element type, y's): forward, then backward
        def elements(types: str) -> list[str]:
            return re.findall(r"tensor<(?:\d+x)*(\w+)>", types)

        calls = {(op, elements(operands)[0], *elements(results))
                 for op, operands, results in native_calls(text)}
        assert calls == {("ag_matmul", "f8E4M3FN", "f32", "f8E4M3FN"),  # y, the gathered x
                         ("matmul_rs", "f8E4M3FN", "f32"),
                         ("ag_matmul", "f8E5M2", "f32", "f8E5M2"),
                         ("matmul_rs", "f8E5M2", "f32")}, calls
        assert not big and not scatters, (big, scatters)
        return
    assert any(t.endswith("f8E4M3FN") for t in big) and any(t.endswith("f8E5M2") for t in big)
    assert all(t.endswith(("f8E4M3FN", "f8E5M2")) for t in big), big
    assert len(scatters) == 2 and all(t.endswith("f32") for t in scatters), scatters


def test_delayed_scaling_needs_typed_shard_map_to_differentiate():
    mesh = tp_mesh(2)
    x, w1, _ = _inputs()
    state = fp8.DelayedScaling.init(4)

    def loss(x, w, s, scaling):
        y = jax.shard_map(lambda x, w, s: fp8.ag_matmul(x, w, "tp", axis=1,
                                                        scaling=s if scaling else None),
                          mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), P()),
                          out_specs=P(None, None, "tp"), check_vma=False)(x, w, s)
        return jnp.sum(y)

    jax.jit(loss, static_argnums=3)(x, w1, state, True)              # the forward runs
    with pytest.raises(ValueError, match="check_vma=False cannot be differentiated"):
        jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(x, w1, state, True)
    dx, dw, _ = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(x, w1, state,
                                                                             False)
    assert dx.shape == x.shape and bool(jnp.all(jnp.isfinite(dw)))


@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "current"])
def test_fused_gemm_asked_for_runs_the_recipes_gemms(delayed):
    """jo.config(fused=True) under the recipe: the AG+GEMMs and the GEMM + reduce-scatters
    (the forward's e4m3 x e4m3, the backward's e5m2 x e4m3, all to bfloat16) run the fused
    program. The fused AG+GEMM's y is the chunked program's bit for bit and the xla impl's
    within bfloat16's tolerance; the loss and every gradient (the new FP8 state too) are the
    xla impl's within bfloat16's tolerance. (Not the chunked program's: its ring adds the
    partials in bfloat16 step by step where the fused GEMM + reduce-scatter sums them in
    float32 once, and the e5m2 quantization of the next gradient magnifies that rounding.)
    Rows of whole 16-byte units: 16 fp8 elements of K per rank."""
    mesh = tp_mesh(N)
    x = rand(0, (2, 8 * N, 16), jnp.bfloat16)
    w1, w2 = (rand(i, shape, jnp.bfloat16) * 0.3 for i, shape in ((1, (16, 16 * N)),
                                                                   (2, (16 * N, 16))))
    state = fp8.DelayedScaling.init(16) if delayed else None

    def loss(impl):
        kw = dict(axis=1, impl=impl) | ({} if impl == "xla" else dict(transport="p2p"))

        def body(x, w1, w2, s1, s2):
            h = fp8.ag_matmul(x, w1, "tp", scaling=s1, **kw)
            return fp8.matmul_rs(h, w2, "tp", scaling=s2, **kw), h

        def f(*args):
            y, h = jax.shard_map(body, mesh=mesh, out_specs=(P(None, "tp"), P(None, None, "tp")),
                                 in_specs=(P(None, "tp"), P(None, "tp"), P("tp"), P(), P()))(*args)
            return jnp.sum(jnp.sin(y.astype(jnp.float32))), h
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4) if delayed else (0, 1, 2),
                                          has_aux=True))

    args = (x, w1, w2, state, state)
    with jo.config(fused=True):
        text = loss("native").lower(*args).as_text()
        ours = loss("native")(*args)
    calls = {(op, fused) for op, fused in
             re.findall(r"@jaxoverlap_(\w+)\(.*?fused = (\w+)", text)}
    assert calls == {("ag_matmul", "true"), ("matmul_rs", "true")}, calls
    assert text.count("fused = true") == 4 and text.count("fused = false") == 0
    with jo.config(fused=False):
        (_, h_chunked), _ = loss("native")(*args)
    xla = loss("xla")(*args)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(xla), strict=True):
        assert_close(a, np.asarray(b, np.float64), jnp.bfloat16)
    (_, h), _ = ours
    np.testing.assert_array_equal(np.asarray(h), np.asarray(h_chunked))


@pytest.mark.slow
def test_dot_general_is_current_scaling():
    """The one-device dot_general: e4m3 operands with their amax's scales, e5m2 gradient."""
    x, w, _ = _inputs()
    dy = rand(6, (2, 8, 8), jnp.float32)
    dims = (((2,), (0,)), ((), ()))
    y, vjp = jax.vjp(lambda a, b: fp8.dot_general(a, b, dims), x, w)
    dx, dw = vjp(dy)
    xd, wd, gd = (_shard_quantized(a, q, 0, 1) for a, q in ((x, E4), (w, E4), (dy, E5)))
    for got, want in ((y, xd @ wd), (dx, gd @ wd.T), (dw, np.einsum("bsk,bsn->kn", xd, gd))):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5,
                                   atol=1e-5 * np.abs(want).max())
