"""Under Auto mesh axes the ops take part in sharding propagation: checked on the compiled module.

A data-parallel axis on the batch stays there (no all-gather of activations over
it, every device multiplies 1/(data·tensor) of the FLOPs), and kernels sharded
over an FSDP axis on their other dim are gathered per layer, with their
gradients reduce-scattered onto that layout.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import dp_tp_mesh, rand
from hlo_tools import axes_spanned, collectives, dot_flops, elements
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoverlap as jo
from jaxoverlap.flax.linen import ParallelMLP, ParallelMultiHeadDotProductAttention, partition_specs

B, S, H, F = 4, 16, 32, 64


def compiled_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


class DenseMLP(nn.Module):
    """The unparallel reference: what the whole program costs on one device."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(F, name="up")(x)
        return nn.Dense(x.shape[-1], name="down")(nn.gelu(h))


def train_step(model):
    def step(params, x):
        def loss(p):
            return jnp.mean(model.apply({"params": p}, x) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, _ = optax.sgd(0.1).update(grads, optax.sgd(0.1).init(params), params)
        return value, optax.apply_updates(params, updates)

    return step


@functools.cache
def reference_flops() -> int:
    """The unparallel train step's matmul FLOPs (the same for every case: computed once)."""
    x = np.asarray(rand(0, (B, S, H), jnp.float32))
    params = jax.tree.map(np.asarray, DenseMLP().init(jax.random.key(0), x)["params"])
    return dot_flops(compiled_text(train_step(DenseMLP()), params, x))


def assert_batch_stays_on(text: str, mesh: Mesh, axis: str, biggest_param: int) -> None:
    """Only the parameters' gradients cross ``axis``: no activation moves over it."""
    for c in collectives(text):
        if axis not in axes_spanned(c.groups, mesh):
            continue
        assert c.op == "all-reduce", f"an activation {c.op} over {axis!r}: {c.line}"
        assert elements(c.shape) <= biggest_param, f"an activation all-reduce: {c.line}"


# ---------------------------------------------------------------- the ops


@pytest.mark.parametrize("impl", ["xla", "ring", "native"])
def test_ops_keep_the_data_axis_on_the_batch(impl):
    mesh = dp_tp_mesh(names=("data", "tp"))
    x = jax.device_put(rand(0, (B, S, H), jnp.float32), NamedSharding(mesh, P("data", "tp")))
    w1 = jax.device_put(rand(1, (H, F), jnp.float32), NamedSharding(mesh, P(None, "tp")))
    w2 = jax.device_put(rand(2, (F, H), jnp.float32), NamedSharding(mesh, P("tp", None)))

    def loss(x, w1, w2):
        h = jo.ag_matmul(x, w1, "tp", axis=1, impl=impl, mesh=mesh)
        return jnp.sum(jo.matmul_rs(jnp.tanh(h), w2, "tp", axis=1, impl=impl, mesh=mesh) ** 2)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    text = compiled_text(grad, x, w1, w2)
    assert_batch_stays_on(text, mesh, "data", H * F)
    got = jax.jit(grad)(x, w1, w2)
    want = jax.grad(lambda x, w1, w2: jnp.sum((jnp.tanh(x @ w1) @ w2) ** 2), argnums=(0, 1, 2))(
        *(np.asarray(a, np.float64) for a in (x, w1, w2)))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-3)
    assert got[0].sharding.spec[0] == "data"        # the input gradient keeps the batch split
    if impl != "native":                            # native multiplies inside its custom calls
        # Forward 2 matmuls, backward 4, each split over data x tp.
        assert dot_flops(text) * 8 == 6 * 2 * B * S * H * F


# ---------------------------------------------------------------- the Flax layers


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [True, False])
@pytest.mark.parametrize("impl", ["xla", "ring"])
def test_layers_split_the_flops_over_data_and_tensor(sequence_parallel, impl):
    """A train step of ParallelMLP: per device, 1/(data·tensor) of the matmul FLOPs."""
    mesh = dp_tp_mesh(names=("data", "tp"))
    model = ParallelMLP(F, sequence_parallel=sequence_parallel, impl=impl)
    x = rand(0, (B, S, H), jnp.float32)
    specs = partition_specs(model, jax.random.key(0), x)["params"]
    params = jax.jit(model.init, out_shardings=jax.tree.map(
        lambda s: NamedSharding(mesh, s), {"params": specs}))(jax.random.key(0), x)["params"]
    params = nn.unbox(params)
    x = jax.device_put(x, NamedSharding(mesh, P("data", "tp" if sequence_parallel else None)))
    text = compiled_text(train_step(model), params, x)
    assert_batch_stays_on(text, mesh, "data", H * F)
    assert dot_flops(text) * 8 == reference_flops()


@pytest.mark.slow
def test_fsdp_gathers_kernels_per_layer_and_reduce_scatters_their_gradients():
    """Kernels split over "fsdp" on their non-tensor dim (logical rules), the batch too."""
    mesh = dp_tp_mesh(names=("fsdp", "tp"))
    rules = (("embed", "fsdp"), ("mlp", "tp"))
    model = _FsdpMLP()
    x = rand(0, (B, S, H), jnp.float32)
    abstract = jax.eval_shape(model.init, jax.random.key(0), x)        # no mesh needed
    with nn.logical_axis_rules(rules):
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
        params = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x)
    params = nn.unbox(params)["params"]
    assert params["up"]["kernel"].sharding.spec == P("fsdp", "tp")
    assert params["down"]["kernel"].sharding.spec == P("tp", "fsdp")
    x = jax.device_put(x, NamedSharding(mesh, P("fsdp", "tp")))
    text = compiled_text(train_step(model), params, x)
    kernel_shard = H * F // 4                  # a kernel gathered over fsdp, split over tp
    over_fsdp = [c for c in collectives(text) if "fsdp" in axes_spanned(c.groups, mesh)]
    gathered = {c.shape.split("{")[0] for c in over_fsdp if c.op == "all-gather"}
    # Each kernel is gathered for its layer (up [H, F/tp], down [F/tp, H]; again for the
    # backward pass, as FSDP does), and no activation is: every gather is a parameter's.
    assert {f"f32[{H},{F // 4}]", f"f32[{F // 4},{H}]"} <= gathered, gathered
    assert all(elements(c.shape) <= kernel_shard for c in over_fsdp if c.op == "all-gather")
    # The kernels' gradients are reduce-scattered onto their fsdp layout, not all-reduced.
    scatters = [c for c in over_fsdp if c.op == "reduce-scatter"]
    assert len(scatters) == 2 and all(elements(c.shape) == kernel_shard // 2 for c in scatters)
    assert all(elements(c.shape) < kernel_shard for c in over_fsdp if c.op == "all-reduce")
    assert {c.op for c in over_fsdp} <= {"all-gather", "reduce-scatter", "all-reduce"}
    assert dot_flops(text) * 8 == reference_flops()


class _FsdpMLP(nn.Module):
    """ParallelMLP's layers with logical names on their kernels, as a model's own MLP has."""

    @nn.compact
    def __call__(self, x):
        from jaxoverlap.flax.linen import ColumnParallelDense, RowParallelDense

        init = nn.initializers.lecun_normal()
        h = ColumnParallelDense(
            F, name="up", kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",)))(x)
        return RowParallelDense(
            x.shape[-1], name="down",
            kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)))(
            nn.gelu(h))


@pytest.mark.slow
def test_self_attention_is_one_gather_and_one_scatter_each_way():
    """Query, key and value share one all-gather forward (and one reduce-scatter backward);
    the batch's data axis stays put; every device does 1/(data·tensor) of the matmul FLOPs."""
    mesh = dp_tp_mesh()
    x = rand(0, (B, S, H), jnp.float32)
    mask = nn.make_causal_mask(np.ones((B, S)))
    ref = nn.MultiHeadDotProductAttention(num_heads=8)
    ours = ParallelMultiHeadDotProductAttention(num_heads=8, impl="xla")
    params = ref.init(jax.random.key(0), x, mask=mask)

    def loss(model):
        return jax.grad(lambda p, x: jnp.sum(model.apply(p, x, mask=mask) ** 2),
                        argnums=(0, 1))

    reference = dot_flops(jax.jit(loss(ref)).lower(params, x).compile().as_text())
    specs = partition_specs(ours, jax.random.key(0), x, mask=mask)
    placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)
    text = jax.jit(loss(ours)).lower(
        placed, jax.device_put(x, NamedSharding(mesh, P("dp", "tp")))).compile().as_text()
    over_tp = [c.op for c in collectives(text) if axes_spanned(c.groups, mesh) == {"tp"}
               and c.op in ("all-gather", "reduce-scatter")]
    # Forward: the q/k/v gather and the output's scatter; backward: the mirror images.
    assert sorted(over_tp) == ["all-gather", "all-gather", "reduce-scatter", "reduce-scatter"]
    for c in collectives(text):
        if "dp" in axes_spanned(c.groups, mesh):
            assert c.op == "all-reduce", c.line       # the parameters' gradients only
    assert dot_flops(text) * 8 == reference
