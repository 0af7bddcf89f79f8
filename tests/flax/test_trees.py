"""The converted model's parameter tree is the stock model's, so checkpoints keyed on parameter
paths load either way.

A user swaps ``nn.Dense`` / ``nnx.Linear`` and the attention for the parallel layers and keeps
everything else, the checkpointer included (EasyLM's style: leaves keyed on their paths). So the
trees must be equal as ``jax.tree_util.tree_flatten_with_path`` sees them — paths, shapes,
dtypes and boxes — after ``init`` and after a train step, with and without the user's own
partitioning metadata (which boxes the stock tree too), while the layers still lay their
parameters out over the tensor axis.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax_helpers import assert_tree_close, mesh_named
from helpers import rand
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxoverlap.flax import linen as jl
from jaxoverlap.flax import nnx as jn

# Models initialised, trained a step and compiled twice over: seconds each.
pytestmark = pytest.mark.slow

B, S, E, HEADS, F = 2, 8, 16, 4, 32


def flat(tree: Any) -> list[tuple[str, tuple, str]]:
    """What a path-keyed checkpointer sees of a tree: per leaf its path, shape and dtype (a
    Flax box is a pytree node: it shows in the path, ``.value``, and in the treedef)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(p), tuple(np.shape(v)), str(jnp.result_type(v)))
            for p, v in leaves]


def assert_same_tree(ours: Any, theirs: Any) -> None:
    assert flat(ours) == flat(theirs)
    assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(theirs)


def save(tree: Any) -> dict[str, np.ndarray]:
    """A checkpoint keyed on parameter paths (what EasyLM's checkpointer writes)."""
    return {jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def load(template: Any, checkpoint: dict[str, np.ndarray]) -> Any:
    """``template``'s tree filled from ``checkpoint`` by path: a missing path is a KeyError, an
    unused entry an error; each value placed as the template's leaf is."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    used = [jax.tree_util.keystr(p) for p, _ in leaves]
    assert set(checkpoint) == set(used), set(checkpoint) ^ set(used)
    values = [jax.device_put(checkpoint[k], getattr(v, "sharding", None))
              for k, (_, v) in zip(used, leaves, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, values)


def tp_dims(tree: Any) -> dict[str, tuple]:
    """Per leaf, the dims its array is split on over "tp"."""
    out = {}
    for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]:
        spec = tuple(v.sharding.spec) if isinstance(v.sharding, NamedSharding) else ()
        out[jax.tree_util.keystr(p)] = tuple(d for d, e in enumerate(spec) if e == "tp")
    return out


# ---------------------------------------------------------------- linen


class LinenBlock(nn.Module):
    """Attention and an MLP, the layers given unnamed (Flax auto-names them)."""

    column: Any
    row: Any
    attention: Any
    kw: Any
    metadata: bool

    @nn.compact
    def __call__(self, x):
        init, boxed = nn.initializers.lecun_normal(), {}
        if self.metadata:   # the user's own names, the tensor axis where the layer splits
            boxed = dict(column=dict(kernel_init=nn.with_partitioning(init, (None, "tp"))),
                         row=dict(kernel_init=nn.with_partitioning(init, ("tp", None))),
                         attention=dict(
                             kernel_init=nn.with_partitioning(init, (None, "tp", None)),
                             out_kernel_init=nn.with_partitioning(init, ("tp", None, None))))
        x = x + self.attention(num_heads=HEADS, **boxed.get("attention", {}), **self.kw)(x)
        h = self.column(F, **boxed.get("column", {}), **self.kw)(x)
        return x + self.row(E, **boxed.get("row", {}), **self.kw)(nn.gelu(h))


def _linen_train_step(model, params, x):
    tx = optax.sgd(0.1)

    def step(params, opt_state, x):
        grads = jax.grad(lambda p: jnp.mean(model.apply({"params": p}, x) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(step)(params, tx.init(params), x)[0]


@pytest.mark.parametrize("metadata", [False, True])
def test_linen_tree_is_the_stock_tree_after_init_and_a_train_step(metadata):
    mesh = mesh_named("tp4_auto")
    x = rand(0, (B, S, E))
    stock = LinenBlock(nn.Dense, nn.Dense, nn.MultiHeadDotProductAttention, {}, metadata)
    ours = LinenBlock(jl.ColumnParallelDense, jl.RowParallelDense,
                      jl.ParallelMultiHeadDotProductAttention, dict(mesh=mesh, impl="xla"),
                      metadata)
    theirs_vars = stock.init(jax.random.key(0), x)
    ours_vars = jax.jit(ours.init)(jax.random.key(0), x)
    assert_same_tree(ours_vars, theirs_vars)
    assert_tree_close(nn.unbox(ours_vars), nn.unbox(theirs_vars), jnp.float32, "init")
    # Boxed only by the user's metadata, as the stock tree is; laid out over tp without it.
    assert any(isinstance(v, nn.Partitioned) for v in jax.tree.leaves(
        ours_vars, is_leaf=lambda v: isinstance(v, nn.Partitioned))) == metadata
    if not metadata:
        dims = tp_dims(ours_vars["params"])
        assert dims["['Dense_0']['kernel']"] == (1,) and dims["['Dense_0']['bias']"] == (0,)
        assert dims["['Dense_1']['kernel']"] == (0,) and dims["['Dense_1']['bias']"] == ()
        attention = "['MultiHeadDotProductAttention_0']"
        assert dims[attention + "['query']['kernel']"] == (1,)
        assert dims[attention + "['out']['kernel']"] == (0,)
    # After a train step: still the same tree.
    theirs_after = _linen_train_step(stock, theirs_vars["params"], x)
    ours_after = _linen_train_step(ours, ours_vars["params"], x)
    assert_same_tree(ours_after, theirs_after)
    assert_tree_close(nn.unbox(ours_after), nn.unbox(theirs_after), jnp.float32, "a step")
    if not metadata:
        assert tp_dims(ours_after) == tp_dims(ours_vars["params"])


@pytest.mark.jax_api
def test_linen_checkpoints_load_both_ways_by_path():
    """A stock checkpoint loads into the converted model and back, with no rename."""
    mesh = mesh_named("tp4_auto")
    x = rand(0, (B, S, E))
    stock = LinenBlock(nn.Dense, nn.Dense, nn.MultiHeadDotProductAttention, {}, False)
    ours = LinenBlock(jl.ColumnParallelDense, jl.RowParallelDense,
                      jl.ParallelMultiHeadDotProductAttention, dict(mesh=mesh, impl="xla"),
                      False)
    theirs_params = stock.init(jax.random.key(1), x)["params"]
    template = jax.jit(ours.init)(jax.random.key(0), x)["params"]     # other values
    loaded = load(template, save(theirs_params))
    assert tp_dims(loaded) == tp_dims(template)                        # placed over tp
    y = jax.jit(ours.apply)({"params": loaded}, x)
    np.testing.assert_allclose(y, stock.apply({"params": theirs_params}, x), rtol=1e-5,
                               atol=1e-5)
    back = load(jax.tree.map(np.asarray, theirs_params), save(loaded))
    assert_tree_close(back, theirs_params, jnp.float32, "round trip")


# ---------------------------------------------------------------- nnx


class NnxBlock(nnx.Module):
    def __init__(self, column, row, attention, kw: dict, metadata: bool, *, rngs: nnx.Rngs):
        meta = lambda *names: dict(kernel_metadata={"out_sharding": names}) if metadata else {}
        self.attention = attention(HEADS, E, decode=False, rngs=rngs, **kw)
        self.up = column(E, F, rngs=rngs, **meta(None, "tp"), **kw)
        self.down = row(F, E, rngs=rngs, **meta("tp", None), **kw)

    def __call__(self, x):
        x = x + self.attention(x)
        return x + self.down(nnx.gelu(self.up(x)))


def _nnx_train_step(model):
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)

    step(model, optimizer, rand(0, (B, S, E)))


@pytest.mark.parametrize("metadata", [False, True])
def test_nnx_state_is_the_stock_state_after_init_and_a_train_step(metadata):
    # The stock layers split over tp by the user's metadata run under Auto axes only (under
    # Explicit ones their sharded contractions need an out_sharding).
    mesh = mesh_named("tp4_auto" if metadata else "dp2_tp4_explicit")
    with jax.set_mesh(mesh):      # params placed as they are made (sharding metadata: by it)
        theirs = NnxBlock(nnx.Linear, nnx.Linear, nnx.MultiHeadAttention, {}, metadata,
                          rngs=nnx.Rngs(0))
        ours = NnxBlock(jn.ColumnParallelLinear, jn.RowParallelLinear,
                        jn.ParallelMultiHeadAttention, dict(impl="xla"), metadata,
                        rngs=nnx.Rngs(0))
    assert_same_tree(nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param))
    assert_tree_close(nnx.to_pure_dict(nnx.state(ours, nnx.Param)),
                      nnx.to_pure_dict(nnx.state(theirs, nnx.Param)), jnp.float32, "init")
    assert bool(ours.up.kernel.get_metadata().get("out_sharding")) == metadata
    dims = tp_dims(nnx.state(ours, nnx.Param))
    assert dims["['up']['kernel'].value"] == (1,) and dims["['down']['kernel'].value"] == (0,)
    assert dims["['attention']['query']['kernel'].value"] == (1,)
    if not metadata:   # the stock layers, unannotated, are not split at all
        assert set(tp_dims(nnx.state(theirs, nnx.Param)).values()) == {()}
        assert jn.partition_specs(ours)["up"]["kernel"].get_value() == P(None, "tp")
    with jax.set_mesh(mesh):
        _nnx_train_step(theirs)
        _nnx_train_step(ours)
    assert_same_tree(nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param))
    assert_tree_close(nnx.to_pure_dict(nnx.state(ours, nnx.Param)),
                      nnx.to_pure_dict(nnx.state(theirs, nnx.Param)), jnp.float32, "a step")
    assert tp_dims(nnx.state(ours, nnx.Param)) == dims


@pytest.mark.jax_api
def test_nnx_checkpoints_load_both_ways_by_path():
    mesh = mesh_named("dp2_tp4_explicit")
    x = rand(0, (B, S, E))
    theirs = NnxBlock(nnx.Linear, nnx.Linear, nnx.MultiHeadAttention, {}, False,
                      rngs=nnx.Rngs(1))
    with jax.set_mesh(mesh):
        ours = NnxBlock(jn.ColumnParallelLinear, jn.RowParallelLinear,
                        jn.ParallelMultiHeadAttention, dict(impl="xla"), False,
                        rngs=nnx.Rngs(0))
        template = nnx.state(ours, nnx.Param)
        loaded = load(template, save(nnx.state(theirs, nnx.Param)))
        assert tp_dims(loaded) == tp_dims(template)
        nnx.update(ours, loaded)
        y = nnx.jit(lambda m, x: m(x))(ours, x)
    np.testing.assert_allclose(y, theirs(x), rtol=1e-5, atol=1e-5)
    stock_template = nnx.state(
        NnxBlock(nnx.Linear, nnx.Linear, nnx.MultiHeadAttention, {}, False, rngs=nnx.Rngs(2)),
        nnx.Param)
    back = load(stock_template, save(nnx.state(ours, nnx.Param)))
    assert_tree_close(nnx.to_pure_dict(back), nnx.to_pure_dict(nnx.state(theirs, nnx.Param)),
                      jnp.float32, "round trip")
