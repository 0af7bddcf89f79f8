"""The Flax layers given Flax's FP8 recipe run it overlapped, and train like Flax's layers.

The unparallel model (``nn.Dense(dot_general_cls=nn.Fp8DotGeneralOp)``, nnx's ``nnx.Linear``
with ``jaxoverlap.flax.nnx.Fp8DotGeneral``) and the tensor-parallel one start from the same
variables (the unparallel checkpoint, loaded unchanged) and train through
``flax.training.train_state.TrainState`` (linen) or ``nnx.Optimizer`` plus the overwrite of the
FP8 state (nnx). Tolerance: the losses and the FP8 state agree to 1e-5 relative. Both sides
quantize the same values with the same scales through Flax's own functions, so the fp8
operands are the same bits and their products are exact in float32; what differs is the order
of the float32 sums (the tensor-parallel GEMMs add per shard, the reductions per rank), a few
float32 ulps (~1e-7). Such a difference changes a later e4m3/e5m2 quantization only where a
value lies within those ulps of a rounding boundary (one element in ~10^5 here), and then by
one fp8 step of that element, a far smaller share of the loss than 1e-5 over these few steps.
The lowered train step moves fp8: the all-gathers of x (e4m3) and of the gradient (e5m2).
"""

from __future__ import annotations

import logging
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from flax_helpers import B, F, H, S, loss_of, mesh_named, x_spec
from helpers import assert_close, dp_tp_mesh, put, rand, tp_mesh
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoverlap as jo
from jaxoverlap import fp8
from jaxoverlap.flax import linen as jl
from jaxoverlap.flax import nnx as jn

RTOL = 1e-5
STEPS = 3


def _fp8_gathers(text: str) -> set[str]:
    """The element types of the lowered program's all-gathers of more than a few elements.

    Under Auto mesh axes the ops are custom-partitioned primitives whose collectives appear
    only when XLA partitions the program (and XLA:CPU then widens fp8 collectives): there,
    the element types of the fp8 operands the primitives receive.
    """
    found = re.findall(r'"stablehlo\.all_gather".*?->\s*tensor<([^>]*)>', text, re.S)
    found += [t for line in re.findall(r"@CustomSPMDPartitioning[^\n]*", text)
              for t in re.findall(r"tensor<([^>]*f8E\w+)>", line)]
    return {t.rsplit("x", 1)[1] for t in found if t.count("x") >= 2}


class _FlaxMLP(nn.Module):
    """The unparallel MLP: two nn.Dense with Flax's FP8 recipe, named as ParallelMLP's."""

    dot_general_cls: type

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(F, dot_general_cls=self.dot_general_cls, name="up")(x)
        return nn.Dense(H, dot_general_cls=self.dot_general_cls, name="down")(nn.gelu(h))


def _train_linen(model, variables, x, target, steps: int = STEPS):
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables,
                                          tx=optax.adam(1e-2))

    @jax.jit
    def step(state, x, target):
        loss, grads = jax.value_and_grad(
            lambda v: loss_of(state.apply_fn(v, x), target))(state.params)
        return state.apply_gradients(grads=grads), loss

    losses = []
    for _ in range(steps):
        state, loss = step(state, x, target)
        losses.append(float(loss))
    return losses, state, step


def _assert_trains_alike(losses, ref_losses, owg, ref_owg) -> None:
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    for a, b in zip(jax.tree.leaves(owg), jax.tree.leaves(ref_owg), strict=True):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=RTOL, atol=RTOL * np.abs(b).max())
    assert any(float(np.asarray(s).reshape(-1)[0]) != 1.0 for s in jax.tree.leaves(owg)
               if np.size(s) == 1)   # the scales moved: the recipe ran


@pytest.mark.slow
@pytest.mark.parametrize("recipe,mesh_name,sequence_parallel", [
    (nn.Fp8DotGeneralOp, "dp2_tp4_explicit", True),
    (nn.Fp8DirectDotGeneralOp, "tp4_auto", False),
], ids=["Fp8DotGeneralOp-sp-explicit", "Fp8DirectDotGeneralOp-f_g-auto"])
def test_linen_mlp_trains_like_flax_fp8_dense(recipe, mesh_name, sequence_parallel):
    mesh = mesh_named(mesh_name)
    x, target = rand(0, (B, S, H)), rand(1, (B, S, H))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)   # Flax deprecates Fp8DotGeneralOp
        ref = _FlaxMLP(recipe)
        variables = ref.init(jax.random.key(0), x)            # the unparallel checkpoint
        ref_losses, ref_state, _ = _train_linen(ref, variables, x, target)
        par = jl.ParallelMLP(F, dot_general_cls=recipe, sequence_parallel=sequence_parallel)
        # The checkpoint loads: the same tree, names and global shapes as the parallel init.
        assert jax.tree.map(jnp.shape, nn.unbox(par.init(jax.random.key(0), x))) == \
            jax.tree.map(jnp.shape, variables)
        with jax.set_mesh(mesh):
            specs = nn.get_partition_spec(par.init(jax.random.key(0), x))
            placed = jax.device_put(variables, jax.tree.map(
                lambda s: NamedSharding(mesh, s), specs))
            xs, ts = (put(a, mesh, x_spec(mesh, sequence_parallel)) for a in (x, target))
            losses, state, step = _train_linen(par, placed, xs, ts)
            text = step.lower(state, xs, ts).as_text()
    _assert_trains_alike(losses, ref_losses, state.params["_overwrite_with_gradient"],
                         ref_state.params["_overwrite_with_gradient"])
    gathered = _fp8_gathers(text)
    if sequence_parallel:   # x gathered as e4m3, the gradient of the row layer as e5m2
        assert gathered == {"f8E4M3FN", "f8E5M2"}, gathered
    else:                   # Megatron's f / g: no collective moves fp8, none moves a copy
        assert not gathered & {"f32", "bf16"}, gathered


def test_linen_dense_runs_the_recipe_fused():
    """One layer, quick: Flax's forward and its FP8 state, the program gathering e4m3."""
    mesh = tp_mesh(4)
    x = rand(2, (B, S, H))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ref = nn.Dense(F, dot_general_cls=nn.Fp8DotGeneralOp)
        variables = ref.init(jax.random.key(0), x)
        par = jl.ColumnParallelDense(F, dot_general_cls=nn.Fp8DotGeneralOp)
        y_ref = ref.apply(variables, x)
        with jax.set_mesh(mesh):
            fn = jax.jit(par.apply)
            xs = put(x, mesh, P(None, "tp"))
            y = fn(variables, xs)
            text = fn.lower(variables, xs).as_text()
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=RTOL,
                               atol=RTOL * float(jnp.abs(y_ref).max()))
    assert _fp8_gathers(text) == {"f8E4M3FN"}


@pytest.mark.parametrize("recipe", [dict(dot_general_cls=nn.Fp8DotGeneralOp),
                                    dict(dot_general=fp8.dot_general)],
                         ids=["delayed", "current"])
def test_linen_mlp_asked_to_run_fused_does(recipe):
    """jo.config(fused=True) with Flax's FP8 recipe (bfloat16 computation, sequence parallel):
    the column layer's AG+GEMM (e4m3 x e4m3) and the row layer's backward AG+GEMM (e5m2 x
    e4m3) run the fused program, and so do the row layer's GEMM + reduce-scatter (e4m3 x e4m3)
    and the column layer's backward one (e5m2 x e4m3); the loss and gradients are the xla
    impl's within bfloat16's tolerance. Rows of whole 16-byte units: H = 16 and F / 4 = 16,
    fp8 or bfloat16."""
    mesh = tp_mesh(4, kind=AxisType.Explicit)
    x = rand(3, (2, 32, 16), jnp.bfloat16)
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for impl in ("native", "xla"):
            par = jl.ParallelMLP(64, sequence_parallel=True, dtype=jnp.bfloat16, impl=impl,
                                 **recipe)
            variables = par.init(jax.random.key(0), x)
            with jax.set_mesh(mesh), jo.config(fused=impl == "native" or None):
                placed = jax.device_put(nn.unbox(variables), jax.tree.map(
                    lambda s: NamedSharding(mesh, s), nn.get_partition_spec(variables)))
                xs = put(x, mesh, P(None, "tp"))
                step = jax.jit(jax.value_and_grad(lambda v, x, par=par: jnp.sum(jnp.sin(
                    par.apply(v, x).astype(jnp.float32))), argnums=(0, 1)))
                out[impl] = step(placed, xs)
                if impl == "native":
                    text = step.lower(placed, xs).as_text()
    calls = set(re.findall(r"@jaxoverlap_(\w+)\(.*?fused = (\w+)", text))
    assert calls == {("ag_matmul", "true"), ("matmul_rs", "true")}, calls
    assert text.count("fused = true") == 4 and text.count("fused = false") == 0
    for a, b in zip(jax.tree.leaves(out["native"]), jax.tree.leaves(out["xla"]), strict=True):
        assert_close(a, np.asarray(b, np.float64), jnp.bfloat16)


@pytest.mark.slow
def test_linen_attention_with_fp8_projections_matches_flax():
    """Each projection keeps its own FP8 state (query/Fp8DotGeneralOp_0, ...) as in Flax."""
    mesh = tp_mesh(4)
    x = rand(3, (2, S, 16))
    kw = dict(num_heads=4, qkv_dot_general_cls=nn.Fp8DotGeneralOp,
              out_dot_general_cls=nn.Fp8DotGeneralOp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ref = nn.MultiHeadDotProductAttention(**kw)
        par = jl.ParallelMultiHeadDotProductAttention(**kw)
        variables = ref.init(jax.random.key(0), x)

        def loss(model, v, x):
            return jnp.sum(jnp.sin(model.apply(v, x)))

        want = jax.jit(jax.grad(loss, (1, 2)), static_argnums=0)(ref, variables, x)
        with jax.set_mesh(mesh):
            got = jax.jit(jax.grad(loss, (1, 2)), static_argnums=0)(
                par, variables, put(x, mesh, P(None, "tp")))
    assert set(variables["_overwrite_with_gradient"]) == {"query", "key", "value", "out"}
    # The key bias's gradient is zero but for rounding (softmax ignores a shift of every
    # key): each leaf is compared at the scale of the largest gradient.
    scale = max(float(np.abs(np.asarray(b)).max()) for b in jax.tree.leaves(want[0]["params"]))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=RTOL,
                                   atol=RTOL * max(np.abs(b).max(), scale))


class _NnxMLP(nnx.Module):
    """The unparallel nnx MLP: nnx.Linear with the recipe as its dot_general."""

    def __init__(self, dot_general, rngs: nnx.Rngs):
        self.up = nnx.Linear(H, F, dot_general=dot_general(), rngs=rngs)
        self.down = nnx.Linear(F, H, dot_general=dot_general(), rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.gelu(self.up(x)))


def _train_nnx(model, x, target, steps: int = STEPS):
    owg = jn.OverwriteWithGradient
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, target):
        loss, grads = nnx.value_and_grad(lambda m: loss_of(m(x), target),
                                         argnums=nnx.DiffState(0, nnx.Any(nnx.Param, owg)))(model)
        optimizer.update(model, nnx.filter_state(grads, nnx.Param))
        nnx.update(model, nnx.filter_state(grads, owg))   # the new FP8 state, as TrainState does
        return loss

    return [float(step(model, optimizer, x, target)) for _ in range(steps)]


@pytest.mark.jax_api
@pytest.mark.slow
@pytest.mark.parametrize("current", [False, True], ids=["delayed", "current"])
def test_nnx_mlp_trains_like_nnx_fp8_linear(current):
    mesh = dp_tp_mesh(AxisType.Explicit)
    x, target = rand(4, (B, S, H)), rand(5, (B, S, H))
    recipe = (lambda: fp8.dot_general) if current else jn.Fp8DotGeneral
    ref = _NnxMLP(recipe, nnx.Rngs(0))
    checkpoint = nnx.state(ref)
    with jax.set_mesh(mesh):
        par = jn.ParallelMLP(H, F, rngs=nnx.Rngs(1), **(
            dict(dot_general=fp8.dot_general) if current else
            dict(dot_general_cls=jn.Fp8DotGeneral)))
        nnx.update(par, checkpoint)                   # the unparallel checkpoint loads
        ref_losses = _train_nnx(ref, x, target)
        xs, ts = (put(a, mesh, x_spec(mesh, True)) for a in (x, target))
        losses = _train_nnx(par, xs, ts)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    if not current:
        owg = jn.OverwriteWithGradient
        _assert_trains_alike(losses, ref_losses, jax.tree.leaves(nnx.state(par, owg)),
                             jax.tree.leaves(nnx.state(ref, owg)))


def test_nnx_shares_no_fp8_state_between_layers():
    with pytest.raises(ValueError, match="dot_general_cls=Fp8DotGeneral"):
        jn.ParallelMLP(H, F, dot_general=jn.Fp8DotGeneral(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="qkv_dot_general_cls=Fp8DotGeneral"):
        jn.ParallelMultiHeadAttention(4, 16, qkv_dot_general=jn.Fp8DotGeneral(),
                                      rngs=nnx.Rngs(0))
    attn = jn.ParallelMultiHeadAttention(4, 16, qkv_dot_general_cls=jn.Fp8DotGeneral,
                                         decode=False, rngs=nnx.Rngs(0))
    names = {"/".join(map(str, k)) for k, _ in nnx.to_flat_state(
        nnx.state(attn, jn.OverwriteWithGradient))}
    assert {f"{p}/dot_general/input_scale" for p in ("query", "key", "value")} <= names


def test_other_fp8_flavours_run_unfused_and_say_so(caplog):
    """NANOO's fnuz dtypes are not the ops': the layer runs Flax's op unfused, said once."""
    mesh = tp_mesh(4)
    x = rand(6, (B, S, H))
    layer = jl.ColumnParallelDense(F, dot_general_cls=nn.NANOOFp8DotGeneralOp)
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="jaxoverlap"):
        warnings.simplefilter("ignore", DeprecationWarning)
        variables = layer.init(jax.random.key(0), x)
        with jax.set_mesh(mesh):
            jax.eval_shape(layer.apply, variables, put(x, mesh, P(None, "tp")))
    assert any("dot_general_cls was given" in r.getMessage() for r in caplog.records)
