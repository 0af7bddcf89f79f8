"""The general layers and the tensor-parallel attention against Flax's own (linen and nnx).

Same parameters (Flax initialises them; ours must have the same paths, shapes
and initial values), same outputs, loss and gradients w.r.t. parameters and
inputs, with masks and dropout, under Explicit and Auto meshes, with and
without sequence parallelism.
"""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax_helpers import assert_tree_close, mesh_named, x_spec
from helpers import dp_tp_mesh, put, rand, tp_mesh
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxoverlap.flax import linen as jl
from jaxoverlap.flax import nnx as jn

B, S, E, HEADS = 4, 8, 16, 8          # batch, sequence, width, heads (2 per tp rank)


def _mesh_scope(mesh: Mesh, explicit: bool):
    """Explicit meshes come from jax.set_mesh, Auto ones from the layers' mesh=."""
    return jax.set_mesh(mesh) if explicit else contextlib.nullcontext()


def _grads(apply, params, *inputs):
    def loss(params, *inputs):
        y = apply(params, *inputs)
        return jnp.mean(y.astype(jnp.float32) ** 2), y

    argnums = tuple(range(len(inputs) + 1))
    (value, y), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(
        params, *inputs)
    return y, value, grads


# ---------------------------------------------------------------- linen


_REFERENCES: dict = {}


def _reference(key, compute):
    """Flax's own layer's result, computed once per ``key`` (what it depends on) for the
    cases that compare with it; the parallel layer runs anew in every case."""
    if key not in _REFERENCES:
        _REFERENCES[key] = compute()
    return _REFERENCES[key]


class _LinenPair(nn.Module):
    column: type
    row: type
    kw: dict

    @nn.compact
    def __call__(self, x):
        h = self.column(features=(HEADS, 2), name="q", **self.kw)(x)
        return self.row(features=E, axis=(-2, -1), name="o", **self.kw)(jnp.tanh(h))


def _dense_general_reference():
    """The nn.DenseGeneral pair's parameters and (y, loss, grads)."""
    x, ref = rand(0, (B, S, E)), _LinenPair(nn.DenseGeneral, nn.DenseGeneral, {})
    params = ref.init(jax.random.key(1), x)
    return params, _grads(ref.apply, params, x)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", ["dp2_tp4_explicit", "tp4_auto"])
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_linen_general_layers_match_dense_general(mesh_name, sequence_parallel):
    """Column (features=(heads, head_dim)) then row (axis=(-2, -1)), as an attention's
    projections are, against the same nn.DenseGeneral pair."""
    mesh = mesh_named(mesh_name)
    explicit = mesh_name.endswith("explicit")
    x = rand(0, (B, S, E))
    params, want = _reference("dense_general", _dense_general_reference)
    ours = _LinenPair(jl.ColumnParallelDenseGeneral, jl.RowParallelDenseGeneral,
                dict(sequence_parallel=sequence_parallel, impl="ring",
                     mesh=None if explicit else mesh))
    with _mesh_scope(mesh, explicit):
        own = ours.init(jax.random.key(1), x)       # same initial values as Flax's
        assert_tree_close(own, params, jnp.float32, "initial parameters")
        specs = jl.partition_specs(ours, jax.random.key(1), x)["params"]
        assert specs["q"] == {"kernel": P(None, "tp", None), "bias": P("tp", None)}
        assert specs["o"] == {"kernel": P("tp", None, None), "bias": P()}
        # Plain arrays (nn.DenseGeneral's tree), laid out as those specs say.
        assert own["params"]["q"]["kernel"].sharding.is_equivalent_to(
            NamedSharding(mesh, specs["q"]["kernel"]), 3)
        got = _grads(ours.apply, params, put(x, mesh, x_spec(mesh, sequence_parallel)))
    assert_tree_close(got, want, jnp.float32, "y, loss, grads")


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name,sequence_parallel,dropout", [
    ("dp2_tp4_explicit", True, 0.3), ("tp4_auto", False, 0.3), ("tp4_auto", True, 0.0)])
def test_linen_attention_matches_flax(mesh_name, sequence_parallel, dropout):
    mesh = mesh_named(mesh_name)
    explicit = mesh_name.endswith("explicit")
    x = rand(0, (B, S, E))
    mask = nn.make_causal_mask(np.ones((B, S)))
    ref = nn.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=dropout,
                                          deterministic=dropout == 0.0)
    ours = jl.ParallelMultiHeadDotProductAttention(
        num_heads=HEADS, dropout_rate=dropout, deterministic=dropout == 0.0,
        sequence_parallel=sequence_parallel, impl="xla", mesh=None if explicit else mesh)
    rngs = {"dropout": jax.random.key(3)}

    def apply(model):
        return lambda p, x: model.apply(p, x, mask=mask, rngs=rngs)

    def reference():
        params = ref.init(jax.random.key(0), x, mask=mask)
        return params, _grads(apply(ref), params, x)

    params, want = _reference(("linen attention", dropout), reference)
    with _mesh_scope(mesh, explicit):
        own = ours.init(jax.random.key(0), x, mask=mask)
        assert_tree_close(own, params, jnp.float32, "initial parameters")
        specs = jl.partition_specs(ours, jax.random.key(0), x, mask=mask)
        placed = jax.tree.map(lambda a, s: put(a, mesh, s), params, specs)
        got = _grads(apply(ours), placed, put(x, mesh, x_spec(mesh, sequence_parallel)))
    assert_tree_close(got, want, jnp.float32, "y, loss, grads")


@pytest.mark.slow
def test_linen_cross_attention_and_normalize_qk():
    mesh = tp_mesh(4)
    x, kv = rand(0, (B, S, E)), rand(1, (B, 2 * S, E))
    kw = dict(num_heads=HEADS, qkv_features=32, out_features=12, normalize_qk=True)
    ref = nn.MultiHeadDotProductAttention(**kw)
    ours = jl.ParallelMultiHeadDotProductAttention(**kw, mesh=mesh, impl="ring")
    params = ref.init(jax.random.key(0), x, kv)
    got = _grads(lambda p, x, kv: ours.apply(p, x, kv), params, x, kv)
    assert_tree_close(got, _grads(lambda p, x, kv: ref.apply(p, x, kv), params, x, kv),
                      jnp.float32, "y, loss, grads")


def test_linen_attention_misuse():
    mesh = tp_mesh(4)
    x = rand(0, (B, S, E))
    with pytest.raises(ValueError, match="num_heads"):
        jl.ParallelMultiHeadDotProductAttention(num_heads=2, mesh=mesh).init(
            jax.random.key(0), x)
    with pytest.raises(ValueError, match="batch_dims"):
        jl.ColumnParallelDenseGeneral((HEADS, 2), batch_dims=(0,), mesh=mesh).init(
            jax.random.key(0), x)
    with pytest.raises(ValueError, match="trailing dims"):
        jl.RowParallelDenseGeneral(E, axis=(1, 2), mesh=mesh).init(
            jax.random.key(0), rand(0, (B, S, HEADS, 2)))


# ---------------------------------------------------------------- nnx


def _nnx_grads(model, *inputs, **kw):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def apply(params, *inputs):
        return nnx.merge(graphdef, params, rest)(*inputs, **kw)

    y, value, (g_params, *g_inputs) = _grads(apply, params, *inputs)
    return y, value, (nnx.to_pure_dict(g_params), *g_inputs)


@pytest.mark.parametrize("mesh_name,sequence_parallel,dropout,kv_heads", [
    ("dp2_tp4_explicit", True, 0.3, None), ("tp4_auto", False, 0.3, None),
    ("dp2_tp4_explicit", False, 0.0, 4), ("tp4_auto", True, 0.0, 4)])
def test_nnx_attention_matches_flax(mesh_name, sequence_parallel, dropout, kv_heads):
    mesh = mesh_named(mesh_name)
    explicit = mesh_name.endswith("explicit")
    x = rand(0, (B, S, E))
    mask = nnx.make_causal_mask(np.ones((B, S)))
    kw = dict(num_kv_heads=kv_heads, dropout_rate=dropout, deterministic=dropout == 0.0,
              decode=False)
    call = dict(mask=mask)

    def run(model, x):        # a fresh dropout stream inside the traced function, for both
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def apply(params, x):
            return nnx.merge(graphdef, params, rest)(x, **call, rngs=nnx.Rngs(dropout=7))

        y, value, (g_params, g_x) = _grads(apply, params, x)
        return y, value, (nnx.to_pure_dict(g_params), g_x)

    def reference():
        ref = nnx.MultiHeadAttention(HEADS, E, **kw, rngs=nnx.Rngs(0))
        return nnx.to_pure_dict(nnx.state(ref, nnx.Param)), run(ref, x)

    ref_params, want = _reference(("nnx attention", dropout, kv_heads), reference)
    with _mesh_scope(mesh, explicit):
        ours = jn.ParallelMultiHeadAttention(
            HEADS, E, **kw, sequence_parallel=sequence_parallel, impl="ring",
            mesh=None if explicit else mesh, rngs=nnx.Rngs(0))
        # Same initial values as Flax's, and the heads split over tp.
        assert_tree_close(nnx.to_pure_dict(nnx.state(ours, nnx.Param)), ref_params,
                          jnp.float32, "init")
        specs = jn.partition_specs(ours)
        assert specs["query"]["kernel"].get_value() == P(None, "tp", None)
        assert specs["out"]["kernel"].get_value() == P("tp", None, None)
        got = run(ours, put(x, mesh, x_spec(mesh, sequence_parallel)))
    assert_tree_close(got, want, jnp.float32, "y, loss, grads")


class _Pair(nnx.Module):
    """A column projection to (heads, head_dim), tanh, a row projection back."""

    def __init__(self, column, row):
        self.column, self.row = column, row

    def __call__(self, x):
        return self.row(jnp.tanh(self.column(x)))


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_nnx_general_layers_match_linear_general(sequence_parallel):
    mesh = dp_tp_mesh(AxisType.Explicit)
    x = rand(0, (B, S, E))
    with jax.set_mesh(mesh):
        ours = _Pair(
            jn.ColumnParallelLinearGeneral(E, (HEADS, 2), sequence_parallel=sequence_parallel,
                                           impl="xla", rngs=nnx.Rngs(0)),
            jn.RowParallelLinearGeneral((HEADS, 2), E, axis=(-2, -1),
                                        sequence_parallel=sequence_parallel, impl="xla",
                                        rngs=nnx.Rngs(1)))
        got = _nnx_grads(ours, put(x, mesh, x_spec(mesh, sequence_parallel)))
    ref = _Pair(nnx.LinearGeneral(E, (HEADS, 2), rngs=nnx.Rngs(0)),
                nnx.LinearGeneral((HEADS, 2), E, axis=(-2, -1), rngs=nnx.Rngs(1)))
    assert_tree_close(got, _nnx_grads(ref, x), jnp.float32, "y, loss, grads")


def test_nnx_attention_misuse():
    mesh = tp_mesh(4)
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        jn.ParallelMultiHeadAttention(HEADS, E, num_kv_heads=2, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="batch_axis"):
        jn.ColumnParallelLinearGeneral(E, (HEADS, 2), batch_axis={0: B}, rngs=nnx.Rngs(0))
