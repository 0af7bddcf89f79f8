"""jaxoverlap.flax.linen against ``nn.Dense``: same params give the same outputs, loss, grads."""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax_helpers import (
    MESHES,
    B,
    F,
    H,
    S,
    assert_equivalent,
    assert_tree_close,
    loss_of,
    mesh_named,
    x_spec,
)
from helpers import dp_tp_mesh, put, rand, tp_mesh
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxoverlap import _megatron, _xla
from jaxoverlap.flax.linen import (
    ColumnParallelDense,
    ColumnParallelDenseGeneral,
    ParallelMLP,
    RowParallelDense,
    RowParallelDenseGeneral,
    partition_specs,
)


class ReferenceMLP(nn.Module):
    """The unparallel model: nn.Dense, gelu, nn.Dense, with the sub-layer names of ParallelMLP."""

    features: int
    use_bias: bool = True
    dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(self.features, use_bias=self.use_bias, dtype=self.dtype, name="up")(x)
        return nn.Dense(x.shape[-1], use_bias=self.use_bias, dtype=self.dtype,
                        name="down")(nn.gelu(h))


def unbox(tree):
    """Partitioned boxes -> values, without flax's sharding constraint."""
    return jax.tree.map(lambda v: v.value if isinstance(v, nn.Partitioned) else v, tree,
                        is_leaf=lambda v: isinstance(v, nn.Partitioned))


def value_and_grads(apply, params, x, target):
    def loss(params, x):
        y = apply(params, x)
        return loss_of(y, target), y

    (value, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        params, x)
    return y, value, grads


def reference(params, x, target, use_bias=True, features=F):
    model = ReferenceMLP(features, use_bias=use_bias)
    params = jax.tree.map(np.asarray, params)          # plain host arrays: no mesh at all
    return value_and_grads(model.apply, params, np.asarray(x), target)


def specs_of(model, x, mesh=None):
    """The layers' partition specs (an abstract init, under a mesh), as
    ``nn.get_partition_spec`` would give them if the parameters were boxed."""
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        return partition_specs(model, jax.random.key(0), x)


def setup(use_bias=True, features=F):
    """The unparallel model's parameters (a 'checkpoint'), the input and the target."""
    x, target = rand(0, (B, S, H)), rand(1, (B, S, H))
    params = ReferenceMLP(features, use_bias=use_bias).init(jax.random.key(2), x)
    return params, x, target


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("sequence_parallel", [True, False])
@pytest.mark.parametrize("use_bias", [True, False])
def test_mlp_matches_dense_on_global_arrays(mesh_name, sequence_parallel, use_bias):
    mesh = mesh_named(mesh_name)
    params, x, target = setup(use_bias)
    # The Explicit mesh comes from jax.set_mesh, the Auto one from mesh=.
    explicit = mesh_name.endswith("explicit")
    model = ParallelMLP(F, use_bias=use_bias, sequence_parallel=sequence_parallel,
                        impl="xla" if explicit else "ring", mesh=None if explicit else mesh)
    with jax.set_mesh(mesh) if explicit else contextlib.nullcontext():
        specs = specs_of(model, x)
        # The unparallel checkpoint loads unchanged, placed by the layers' own metadata.
        placed = jax.tree.map(lambda a, s: put(a, mesh, s), params, specs)
        got = value_and_grads(model.apply, placed,
                              put(x, mesh, x_spec(mesh, sequence_parallel)), target)
    assert_equivalent(got, reference(params, x, target, use_bias))
    if explicit:  # data parallel passes through; tp is on S (SP) or nowhere (Megatron g)
        assert got[0].sharding.spec == P("dp", "tp" if sequence_parallel else None, None)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_mlp_inside_users_shard_map(check_vma, sequence_parallel):
    mesh = dp_tp_mesh(AxisType.Explicit)
    params, x, target = setup()
    model = ParallelMLP(F, sequence_parallel=sequence_parallel, impl="ring")
    specs = specs_of(model, x, mesh)
    xs = x_spec(mesh, sequence_parallel)

    def apply(params, x):
        fn = jax.shard_map(model.apply, mesh=mesh, in_specs=(specs, xs), out_specs=xs,
                           check_vma=check_vma)
        return fn(params, x)

    placed = jax.tree.map(lambda a, s: put(a, mesh, s), params, specs)
    got = value_and_grads(apply, placed, put(x, mesh, xs), target)
    assert_equivalent(got, reference(params, x, target))


@pytest.mark.slow
def test_bfloat16_within_its_tolerance():
    mesh = tp_mesh(4)
    params, x, target = setup()
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    x16 = x.astype(jnp.bfloat16)
    model = ParallelMLP(F, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, mesh=mesh, impl="ring")
    got = value_and_grads(model.apply, params, x16, target)
    ref = ReferenceMLP(F, dtype=jnp.bfloat16)
    want = value_and_grads(ref.apply, jax.tree.map(np.asarray, params), np.asarray(x16), target)
    assert got[0].dtype == jnp.bfloat16
    assert_equivalent(got, want, jnp.bfloat16)


@pytest.mark.slow
def test_init_under_jit_places_parameters_from_flax_metadata():
    mesh = dp_tp_mesh(AxisType.Explicit)
    model = ParallelMLP(F)
    x = rand(0, (B, S, H))
    with jax.set_mesh(mesh):
        specs = specs_of(model, x)
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
        variables = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x)
        # Without out_shardings the initialisers place the values themselves.
        implicit = jax.jit(model.init)(jax.random.key(0), x)
    for tree in (variables, implicit):
        got = jax.tree.map(lambda a: a.sharding.spec, unbox(tree))["params"]
        assert got["up"]["kernel"] == P(None, "tp") and got["up"]["bias"] == P("tp")
        assert got["down"]["kernel"] == P("tp", None)
        assert all(e is None for e in got["down"]["bias"])
    # Global shapes are nn.Dense's.
    assert jax.tree.map(jnp.shape, unbox(variables)) == jax.tree.map(
        jnp.shape, ReferenceMLP(F).init(jax.random.key(0), x))


def test_partition_specs():
    x = rand(0, (B, S, H))
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    col = specs_of(ColumnParallelDense(F, axis_name="model"), x, mesh)["params"]
    assert col == {"kernel": P(None, "model"), "bias": P("model")}
    row = specs_of(RowParallelDense(H, axis_name="model"), rand(0, (B, S, F)), mesh)["params"]
    assert row == {"kernel": P("model", None), "bias": P()}
    nobias = specs_of(ColumnParallelDense(F, use_bias=False), x, tp_mesh(4))["params"]
    assert nobias == {"kernel": P(None, "tp")}


def test_single_layers_match_dense():
    """Column alone returns features sharded; row alone takes them: each matches nn.Dense."""
    mesh = tp_mesh(4)
    x, h = rand(0, (B, S, H)), rand(1, (B, S, F))
    for layer, ref, inp in ((ColumnParallelDense(F, mesh=mesh), nn.Dense(F), x),
                            (RowParallelDense(H, mesh=mesh, sequence_parallel=False),
                             nn.Dense(H), h)):
        params = ref.init(jax.random.key(3), inp)
        params = jax.tree.map(lambda a: a + 0.1, params)   # a nonzero bias
        np.testing.assert_allclose(jax.jit(layer.apply)(params, inp), ref.apply(params, inp),
                                   rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the check can fail


@pytest.mark.slow
def test_check_fails_on_a_transposed_kernel():
    mesh = tp_mesh(4)
    params, x, target = setup(features=H)        # square kernels: a transpose keeps shapes
    model = ParallelMLP(H, mesh=mesh, impl="ring")
    got = value_and_grads(model.apply, params, x, target)
    assert_equivalent(got, reference(params, x, target, features=H))
    flipped = jax.tree.map(lambda a: a, params)
    flipped["params"]["up"]["kernel"] = params["params"]["up"]["kernel"].T
    with pytest.raises(AssertionError):
        assert_equivalent(got, reference(flipped, x, target, features=H))


@pytest.mark.parametrize("mesh_name", MESHES)
def test_check_fails_without_the_forward_reduction(monkeypatch, mesh_name):
    # Megatron g (GEMM + all-reduce; its unfused impl, which every device runs on its shards)
    # keeping one rank's partial product instead of the sum (types still valid).
    def broken_g(x, kernel, plan, scales=()):
        y = x @ kernel
        return lax.psum(jnp.where(lax.axis_index(plan.axis_name) == 0, y, jnp.zeros_like(y)),
                        plan.axis_name)

    monkeypatch.setattr(_xla, "matmul_ar", broken_g)
    mesh = mesh_named(mesh_name)
    params, x, target = setup()
    model = ParallelMLP(F, sequence_parallel=False, mesh=mesh, impl="xla")
    got = value_and_grads(model.apply, params, x, target)
    with pytest.raises(AssertionError, match="output"):
        assert_equivalent(got, reference(params, x, target))


def test_check_fails_without_the_backward_psum(monkeypatch):
    # Megatron f whose backward keeps one rank's part of the input gradient
    # instead of the all-reduce: only the input's gradient is wrong.
    @jax.custom_vjp
    def broken_f(x):
        return lax.pcast(x, ("tp",), to="varying")

    def bwd(_, ct):
        return (lax.psum(jnp.where(lax.axis_index("tp") == 0, ct, jnp.zeros_like(ct)), "tp"),)

    broken_f.defvjp(lambda x: (broken_f(x), None), bwd)
    monkeypatch.setattr(_megatron, "copy_to_tp", lambda x, axis_name, typed: broken_f(x))
    # Explicit axes: the layer runs in a shard_map, where f's backward is copy_to_tp's
    # transpose (under Auto axes it is the g primitive, covered by the test above).
    mesh = dp_tp_mesh(AxisType.Explicit)
    params, x, target = setup()
    model = ParallelMLP(F, sequence_parallel=False, mesh=mesh, impl="xla")
    got = value_and_grads(model.apply, params, x, target)
    assert_tree_close(got[:2], reference(params, x, target)[:2], jnp.float32, "forward")
    with pytest.raises(AssertionError, match=r"gradient \[1\]"):   # [1]: the input's
        assert_equivalent(got, reference(params, x, target))


# ---------------------------------------------------------------- misuse


def test_misuse_raises_naming_the_argument():
    mesh = tp_mesh(4)
    x = rand(0, (B, S, H))
    with pytest.raises(ValueError, match="features=10"):
        ColumnParallelDense(10, mesh=mesh).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"inputs.shape\[-1\]"):
        RowParallelDense(H, mesh=mesh).init(jax.random.key(0), rand(0, (B, S, 6)))
    with pytest.raises(ValueError, match="axis_name='model'"):
        ColumnParallelDense(F, axis_name="model", mesh=mesh).init(jax.random.key(0), x)
    with pytest.raises(TypeError, match="sequence_parallel"):
        ColumnParallelDense(F, sequence_parallel="yes", mesh=mesh).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="impl='fast'"):
        ColumnParallelDense(F, impl="fast", mesh=mesh).init(jax.random.key(0), x)
    with pytest.raises(TypeError, match="features"):
        ColumnParallelDense(F / 2, mesh=mesh).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="rank >= 2"):
        ColumnParallelDense(F, mesh=mesh).init(jax.random.key(0), rand(0, (H,)))
    for general in (ColumnParallelDenseGeneral, RowParallelDenseGeneral):  # no IndexError
        with pytest.raises(ValueError, match=r"features=\(\) has no dim"):
            general(features=(), mesh=mesh).init(jax.random.key(0), x)
    with pytest.raises(TypeError, match=r"float8_e4m3fn .* needs scales.*Fp8DotGeneralOp"):
        ColumnParallelDense(F, dtype=jnp.float8_e4m3fn, mesh=mesh).init(jax.random.key(0), x)
    # A stored layout that disagrees with the layer's (e.g. a row checkpoint in a column layer).
    variables = ColumnParallelDense(F, mesh=mesh).init(jax.random.key(0), x)
    variables["params"]["kernel"] = nn.Partitioned(unbox(variables)["params"]["kernel"],
                                                   names=("tp", None))
    with pytest.raises(ValueError, match="partitioning"):
        ColumnParallelDense(F, mesh=mesh).apply(variables, x)


@pytest.mark.parametrize("precision", ["highest", lax.Precision.HIGHEST, None])
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_precision_is_accepted_on_both_paths(precision, sequence_parallel):
    mesh = tp_mesh(4)
    params, x, target = setup()
    model = ParallelMLP(F, precision=precision, sequence_parallel=sequence_parallel, mesh=mesh,
                        impl="xla")
    y = jax.jit(model.apply)(params, x)
    np.testing.assert_allclose(y, ReferenceMLP(F).apply(params, x), rtol=1e-5, atol=1e-5)


def test_init_inside_users_shard_map_gives_local_shards():
    mesh = tp_mesh(4)
    x = rand(0, (B, S, H))
    model = ParallelMLP(F)
    shapes = {}

    def init(x):
        variables = unbox(model.init(jax.random.key(0), x))
        shapes.update(jax.tree.map(jnp.shape, variables["params"]))   # recorded while tracing
        return model.apply(variables, x)

    fn = jax.shard_map(init, mesh=mesh, in_specs=P(None, "tp"), out_specs=P(None, "tp"))
    assert jax.eval_shape(fn, x).shape == (B, S, H)
    assert shapes["up"] == {"kernel": (H, F // 4), "bias": (F // 4,)}
    assert shapes["down"] == {"kernel": (F // 4, H), "bias": (H,)}
