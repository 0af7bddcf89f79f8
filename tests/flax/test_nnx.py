"""jaxoverlap.flax.nnx against ``nnx.Linear``, and against the linen layers with copied params."""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import nnx
from flax_helpers import (
    MESHES,
    B,
    F,
    H,
    S,
    assert_equivalent,
    loss_of,
    mesh_named,
    x_spec,
)
from helpers import dp_tp_mesh, put, rand, tp_mesh
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxoverlap.flax import linen as jo_linen
from jaxoverlap.flax.nnx import (
    ColumnParallelLinear,
    ColumnParallelLinearGeneral,
    ParallelMLP,
    RowParallelLinear,
    RowParallelLinearGeneral,
    partition_specs,
)


class ReferenceMLP(nnx.Module):
    """The unparallel model: nnx.Linear, gelu, nnx.Linear, with ParallelMLP's attribute names."""

    def __init__(self, h: int, f: int, *, use_bias: bool = True, rngs: nnx.Rngs):
        self.up = nnx.Linear(h, f, use_bias=use_bias, rngs=rngs)
        self.down = nnx.Linear(f, h, use_bias=use_bias, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.gelu(self.up(x)))


def value_and_grads(model: nnx.Module, x, target, wrap=None):
    """Output, loss, and (pure-dict) gradients w.r.t. the state and the input."""
    graphdef, state = nnx.split(model)

    def apply(state, x):
        return nnx.merge(graphdef, state)(x)

    if wrap is not None:
        apply = wrap(apply, state)

    def loss(state, x):
        y = apply(state, x)
        return loss_of(y, target), y

    (value, y), (g_state, g_x) = jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(state, x)
    return y, value, (nnx.to_pure_dict(g_state), g_x)


def checkpoint(use_bias=True):
    """The unparallel model's parameters as a pure dict, the input and the target."""
    ref = ReferenceMLP(H, F, use_bias=use_bias, rngs=nnx.Rngs(2))
    return ref, rand(0, (B, S, H)), rand(1, (B, S, H))


def load(model: nnx.Module, ref: nnx.Module, mesh=None) -> None:
    """Loads the reference's values into ``model`` unchanged (placed on ``mesh`` if given)."""
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, nnx.to_pure_dict(nnx.state(ref)))
    if mesh is not None:
        specs = partition_specs(model)
        state = jax.tree.map(lambda a, s: put(a, mesh, s), state, specs)
    nnx.update(model, state)


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("sequence_parallel", [True, False])
@pytest.mark.parametrize("use_bias", [True, False])
def test_mlp_matches_linear_on_global_arrays(mesh_name, sequence_parallel, use_bias):
    mesh = mesh_named(mesh_name)
    ref, x, target = checkpoint(use_bias)
    explicit = mesh_name.endswith("explicit")
    with jax.set_mesh(mesh) if explicit else contextlib.nullcontext():
        model = ParallelMLP(H, F, use_bias=use_bias, sequence_parallel=sequence_parallel,
                            impl="ring" if explicit else "xla",
                            mesh=None if explicit else mesh, rngs=nnx.Rngs(0))
        load(model, ref, mesh)
        got = value_and_grads(model, put(x, mesh, x_spec(mesh, sequence_parallel)), target)
    assert_equivalent(got, value_and_grads(ref, x, target))
    if explicit:
        assert got[0].sharding.spec == P("dp", "tp" if sequence_parallel else None, None)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_mlp_inside_users_shard_map(check_vma, sequence_parallel):
    mesh = dp_tp_mesh(AxisType.Explicit)
    ref, x, target = checkpoint()
    model = ParallelMLP(H, F, sequence_parallel=sequence_parallel, impl="xla",
                        rngs=nnx.Rngs(0))                    # built without a mesh: unplaced
    load(model, ref, mesh)
    xs = x_spec(mesh, sequence_parallel)

    def wrap(apply, state):
        return jax.shard_map(apply, mesh=mesh, in_specs=(partition_specs(model), xs),
                             out_specs=xs, check_vma=check_vma)

    got = value_and_grads(model, put(x, mesh, xs), target, wrap)
    assert_equivalent(got, value_and_grads(ref, x, target))


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_nnx_and_linen_agree_with_copied_params(sequence_parallel):
    mesh = tp_mesh(4)
    x, target = rand(0, (B, S, H)), rand(1, (B, S, H))
    lin = jo_linen.ParallelMLP(F, sequence_parallel=sequence_parallel, mesh=mesh, impl="ring")
    variables = lin.init(jax.random.key(5), x)
    params = jax.tree.map(lambda v: v.value if isinstance(v, nn.Partitioned) else v,
                          variables["params"], is_leaf=lambda v: isinstance(v, nn.Partitioned))
    model = ParallelMLP(H, F, sequence_parallel=sequence_parallel, mesh=mesh, impl="ring",
                        rngs=nnx.Rngs(0))
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)

    def linen_loss(params, x):
        y = lin.apply({"params": params}, x)
        return loss_of(y, target), y

    (l_loss, l_y), l_grads = jax.jit(jax.value_and_grad(linen_loss, argnums=(0, 1),
                                                        has_aux=True))(params, x)
    n_y, n_loss, n_grads = value_and_grads(model, x, target)
    np.testing.assert_array_equal(np.asarray(n_y), np.asarray(l_y))
    np.testing.assert_array_equal(np.asarray(n_loss), np.asarray(l_loss))
    for a, b in zip(jax.tree.leaves(n_grads), jax.tree.leaves(l_grads), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_partition_specs_and_placement():
    def specs(layer):
        return {k: v.get_value() for k, v in partition_specs(layer).items()}

    # Without a mesh: unplaced; the layout is the layer's own.
    col = ColumnParallelLinear(H, F, axis_name="model", rngs=nnx.Rngs(0))
    assert specs(col) == {"kernel": P(None, "model"), "bias": P("model")}
    row = RowParallelLinear(F, H, axis_name="model", rngs=nnx.Rngs(0))
    assert specs(row) == {"kernel": P("model", None), "bias": P()}
    assert specs(ColumnParallelLinear(H, F, use_bias=False, rngs=nnx.Rngs(0))) == {
        "kernel": P(None, "tp")}
    # Global shapes are nnx.Linear's.
    assert col.kernel.shape == (H, F) and row.kernel.shape == (F, H) and row.bias.shape == (H,)
    # Under a dp x tp mesh (jax.set_mesh, Explicit axes) the params are placed at once,
    # and also when built inside nnx.jit.
    mesh = dp_tp_mesh(AxisType.Explicit)
    with jax.set_mesh(mesh):
        eager = ParallelMLP(H, F, rngs=nnx.Rngs(0))
        jitted = nnx.jit(lambda: ParallelMLP(H, F, rngs=nnx.Rngs(0)))()
    for mlp in (eager, jitted):
        assert mlp.up.kernel.get_value().sharding.spec == P(None, "tp")
        assert mlp.up.bias.get_value().sharding.spec == P("tp")
        assert mlp.down.kernel.get_value().sharding.spec == P("tp", None)
        assert all(e is None for e in mlp.down.bias.get_value().sharding.spec)


# ---------------------------------------------------------------- misuse


def test_misuse_raises_naming_the_argument():
    mesh = tp_mesh(4)
    with pytest.raises(ValueError, match="out_features=10"):
        ColumnParallelLinear(H, 10, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="in_features=10"):
        RowParallelLinear(10, H, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="in_features"):
        ColumnParallelLinear(8.0, F, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="rngs"):
        ColumnParallelLinear(H, F, rngs=None)
    for general in (ColumnParallelLinearGeneral, RowParallelLinearGeneral):
        with pytest.raises(ValueError, match=r"out_features=\(\) has no dim"):
            general(H, (), mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="impl='fast'"):
        ColumnParallelLinear(H, F, impl="fast", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="kernel_metadata"):
        ColumnParallelLinear(H, F, kernel_metadata={"out_sharding": ("tp", None)},
                             rngs=nnx.Rngs(0))
    layer = ColumnParallelLinear(H, F, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"inputs.shape\[-1\]=6"):
        layer(rand(0, (B, S, 6)))
    # Inside shard_map the state must hold local shards.
    graphdef, state = nnx.split(layer)
    replicated = jax.tree.map(lambda _: P(), state)
    fn = jax.shard_map(lambda st, x: nnx.merge(graphdef, st)(x), mesh=mesh,
                       in_specs=(replicated, P(None, "tp")), out_specs=P(None, None, "tp"))
    with pytest.raises(ValueError, match="local shard"):
        fn(state, rand(0, (B, S, H)))
