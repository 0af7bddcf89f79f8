"""decode=True in the parallel attention against Flax's own, and rows that do not split.

A decode runs a sequence through the cache one token per step, from the same parameters as
Flax's layer (linen ``nn.MultiHeadDotProductAttention``, nnx ``nnx.MultiHeadAttention`` with
grouped key/value heads), and compares every step's output and the final cache with it: on
global arrays under Explicit and Auto mesh axes, inside ``shard_map``, with and without
sequence parallelism, on every impl. The compiled step shows which all-reduce ran. Whole
models (Flax's WMT and lm1b examples) decode in tests/test_examples.py.
"""

from __future__ import annotations

import contextlib
import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from flax_helpers import assert_tree_close, mesh_named
from helpers import dp_tp_mesh, put, rand, tp_mesh
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxoverlap.flax import _common
from jaxoverlap.flax import linen as jl
from jaxoverlap.flax import nnx as jn

B, L, E, HEADS = 8, 12, 16, 8       # batch, cache length, width, heads (2 per rank of tp=4)
TP = 4


def _mesh_scope(mesh, explicit: bool):
    return jax.set_mesh(mesh) if explicit else contextlib.nullcontext()


def _tokens(seed: int = 0):
    return rand(seed, (B, L, E))


def _assert_step_collectives(text: str, impl: str, one_shot: bool = False) -> None:
    """A decode step: no gather of its one token, and the output projection's all-reduce
    by the impl asked for: two-shot where the rows (B) split into N blocks per device,
    one-shot where they do not (its ring permutes the partial 2 ranks on, its native call
    has the algorithm attribute 1)."""
    assert "all-gather" not in text, "a decode step gathered its token (sequence parallel?)"
    if impl == "xla":
        assert "all-reduce" in text
    elif impl == "ring":
        assert "collective-permute" in text and "all-reduce" not in text
        assert ("source_target_pairs={{0,2}" in text) == one_shot, "one-shot's permute by 2"
    else:
        calls = [line for line in text.splitlines() if 'custom_call_target="jaxoverlap_matmul_ar"'
                 in line]
        assert calls and "all-reduce" not in text
        assert all(f"algorithm = {int(one_shot)} : i32" in line for line in calls)


def _heads_per_device(a) -> int:
    return a.sharding.shard_shape(a.shape)[-2]


_REFERENCES: dict = {}


def _reference(key, compute):
    """Flax's own layer's decode, run once per ``key`` (what it depends on) for the cases that
    compare with it; the parallel layer decodes anew in every case."""
    if key not in _REFERENCES:
        _REFERENCES[key] = compute()
    return _REFERENCES[key]


def _linen_reference(batch: int):
    """nn.MultiHeadDotProductAttention's variables and its decode of the first ``batch``
    sequences: every step's output and the final cache."""
    x = _tokens()[:batch]
    ref = nn.MultiHeadDotProductAttention(num_heads=HEADS, decode=True)
    expected = ref.init(jax.random.key(0), x)
    ref_step = jax.jit(lambda v, t: ref.apply(v, t, mutable=["cache"]))
    ref_cache, ref_outs = expected["cache"], []
    for t in range(L):
        y, new = ref_step({"params": expected["params"], "cache": ref_cache}, x[:, t:t + 1])
        ref_cache = new["cache"]
        ref_outs.append(y)
    return expected, ref_outs, ref_cache


# ---------------------------------------------------------------- linen


@pytest.mark.parametrize("mesh_name,sequence_parallel,impl,batch", [
    ("dp2_tp4_explicit", True, "ring", B), ("tp4_auto", False, "native", B),
    ("tp4_auto", True, "xla", B), ("dp2_tp4_explicit", False, "native", B),
    ("tp4_auto", True, "ring", B), ("dp2_tp4_explicit", True, "native", B),
    ("tp4_auto", True, "native", 1), ("dp2_tp4_explicit", False, "ring", 2)])
def test_linen_decode_matches_flax(mesh_name, sequence_parallel, impl, batch):
    """init with decode=True makes Flax's cache (global shapes, each device its heads); every
    step's output and the final cache equal Flax's for the same parameters. A batch of one
    per device does not split over tp: the output projection runs one-shot."""
    mesh = mesh_named(mesh_name)
    explicit = mesh_name.endswith("explicit")
    x = _tokens()[:batch]
    one_shot = (batch // (2 if explicit else 1)) % TP != 0
    ours = jl.ParallelMultiHeadDotProductAttention(
        num_heads=HEADS, decode=True, sequence_parallel=sequence_parallel, impl=impl,
        mesh=None if explicit else mesh)
    expected, ref_outs, ref_cache = _reference(("linen", batch),
                                               lambda: _linen_reference(batch))
    dp = "dp" if explicit else None
    with _mesh_scope(mesh, explicit):
        x_in = put(x, mesh, P(dp, "tp" if sequence_parallel else None))
        variables = jax.jit(ours.init)(jax.random.key(0), x_in)
        assert_tree_close(variables["params"], expected["params"], jnp.float32,
                          "initial parameters")
        cache = variables["cache"]
        assert jax.tree.map(jnp.shape, cache) == jax.tree.map(jnp.shape, expected["cache"])
        for name in ("cached_key", "cached_value"):
            assert _heads_per_device(cache[name]) == HEADS // TP, name
        params = jax.tree.map(lambda a, s: put(a, mesh, s), expected["params"],
                              jl.partition_specs(ours, jax.random.key(0), x_in)["params"])
        step = jax.jit(lambda v, t: ours.apply(v, t, mutable=["cache"]))
        token = put(x[:, :1], mesh, P(dp))
        _assert_step_collectives(step.lower({"params": params, "cache": cache}, token)
                                 .compile().as_text(), impl, one_shot)
        outs = []
        for t in range(L):
            y, new = step({"params": params, "cache": cache}, put(x[:, t:t + 1], mesh, P(dp)))
            cache = new["cache"]
            outs.append(y)
        assert _heads_per_device(cache["cached_key"]) == HEADS // TP
    assert_tree_close(outs, ref_outs, jnp.float32, "decode step outputs")
    assert_tree_close(cache, ref_cache, jnp.float32, "cache after the decode")
    assert int(cache["cache_index"]) == L


@pytest.mark.slow
def test_linen_decode_inside_shard_map():
    """Local shards: the cache holds this device's heads; a step takes the replicated token
    (one token cannot be split) and returns the replicated output, under both vma modes."""
    mesh = tp_mesh(4)
    x = _tokens(1)
    ref = nn.MultiHeadDotProductAttention(num_heads=HEADS, decode=True)
    ours = jl.ParallelMultiHeadDotProductAttention(num_heads=HEADS, decode=True, impl="ring")
    expected = ref.init(jax.random.key(0), x)
    specs = jl.partition_specs(ours, jax.random.key(0), x)["params"]
    cache_specs = {"cached_key": P(None, None, "tp"), "cached_value": P(None, None, "tp"),
                   "cache_index": P()}
    for check_vma in (True, False):
        init = jax.jit(jax.shard_map(
            lambda p, x: ours.apply({"params": p}, x, mutable=["cache"])[1]["cache"],
            mesh=mesh, in_specs=(specs, P(None, "tp")), out_specs=cache_specs,
            check_vma=check_vma))
        cache = init(expected["params"], x)          # sequence parallel: x split on its length
        step = jax.jit(jax.shard_map(
            lambda p, c, t: ours.apply({"params": p, "cache": c}, t, mutable=["cache"]),
            mesh=mesh, in_specs=(specs, cache_specs, P()),
            out_specs=(P(), {"cache": cache_specs}), check_vma=check_vma))
        ref_cache = expected["cache"]
        for t in range(L):
            y, new = step(expected["params"], cache, x[:, t:t + 1])
            cache = new["cache"]
            y_ref, ref_new = ref.apply({"params": expected["params"], "cache": ref_cache},
                                       x[:, t:t + 1], mutable=["cache"])
            ref_cache = ref_new["cache"]
            assert_tree_close(y, y_ref, jnp.float32, f"step {t}, check_vma={check_vma}")
        assert_tree_close(cache, ref_cache, jnp.float32, f"cache, check_vma={check_vma}")


# ---------------------------------------------------------------- nnx


@pytest.mark.parametrize("mesh_name,sequence_parallel,impl,kv_heads", [
    ("dp2_tp4_explicit", True, "ring", 4), ("tp4_auto", False, "native", None),
    ("tp4_auto", True, "xla", 4), ("dp2_tp4_explicit", False, "native", None)])
def test_nnx_decode_matches_flax(mesh_name, sequence_parallel, impl, kv_heads):
    """init_cache makes nnx's cache (global, each device its key/value heads); steps equal
    nnx.MultiHeadAttention's, is_causal ignored in decode as Flax 0.12.12 does."""
    mesh = mesh_named(mesh_name)
    explicit = mesh_name.endswith("explicit")
    x = _tokens(2)
    kw = dict(num_kv_heads=kv_heads, decode=True)

    def reference():
        ref = nnx.MultiHeadAttention(HEADS, E, **kw, rngs=nnx.Rngs(0))
        ref.init_cache(x.shape)
        ref_step = nnx.jit(lambda m, t: m(t))
        ref_outs = [ref_step(ref, x[:, t:t + 1]) for t in range(L)]
        return ref_outs, nnx.to_pure_dict(nnx.state(ref, nnx.Cache))

    ref_outs, ref_cache = _reference(("nnx", kv_heads), reference)
    with _mesh_scope(mesh, explicit):
        ours = jn.ParallelMultiHeadAttention(HEADS, E, **kw, sequence_parallel=sequence_parallel,
                                             impl=impl, mesh=None if explicit else mesh,
                                             rngs=nnx.Rngs(0))
        ours.init_cache(x.shape)
        kv = kv_heads or HEADS
        for cached in (ours.cached_key, ours.cached_value):
            assert cached[...].shape == (B, L, kv, E // HEADS)
            assert _heads_per_device(cached[...]) == kv // TP
        step = nnx.jit(lambda m, t: m(t, is_causal=True))
        graphdef, state = nnx.split(ours)
        _assert_step_collectives(
            jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)).lower(state, x[:, :1])
            .compile().as_text(), impl)
        dp = "dp" if explicit else None
        outs = [step(ours, put(x[:, t:t + 1], mesh, P(dp))) for t in range(L)]
        assert _heads_per_device(ours.cached_key[...]) == kv // TP
    assert_tree_close(outs, ref_outs, jnp.float32, "decode step outputs")
    assert_tree_close(nnx.to_pure_dict(nnx.state(ours, nnx.Cache)), ref_cache, jnp.float32,
                      "cache")


def test_nnx_view_makes_the_cache():
    """nnx.view(model, decode=True, batch_size=, max_length=) gives the layer its cache."""
    mesh = tp_mesh(4)
    attn = jn.ParallelMultiHeadAttention(HEADS, E, decode=False, mesh=mesh, rngs=nnx.Rngs(0))
    view = nnx.view(attn, decode=True, batch_size=B, max_length=L)
    assert view.decode and view.cached_key[...].shape == (B, L, HEADS, E // HEADS)
    assert _heads_per_device(view.cached_key[...]) == HEADS // TP


# ---------------------------------------------------------------- misuse


def test_decode_misuse_raises_clearly():
    """Where Flax raises, so do the layers, naming what to change; where Flax would silently
    write past the cache's end (outside jit), they raise too."""
    mesh = tp_mesh(4)
    x = _tokens()
    ref = nn.MultiHeadDotProductAttention(num_heads=HEADS, decode=True)
    ours = jl.ParallelMultiHeadDotProductAttention(num_heads=HEADS, decode=True, mesh=mesh)
    v = ref.init(jax.random.key(0), x)

    def step(model, cache, tokens):
        return model.apply({"params": v["params"], "cache": cache}, tokens, mutable=["cache"])

    with pytest.raises(ValueError, match="Autoregressive cache shape error"):
        step(ref, v["cache"], x[:, :3])                       # Flax refuses 3 tokens too
    with pytest.raises(ValueError, match=r"takes one token.*got shape \(8, 3, 16\)"):
        step(ours, v["cache"], x[:, :3])
    with pytest.raises(ValueError, match=r"made for batch \(8,\), but this step's batch is "
                                         r"\(2,\)"):
        step(ours, v["cache"], x[:2, :1])
    local = jax.tree.map(lambda a: a[:, :, : HEADS // TP] if a.ndim else a, v["cache"])
    with pytest.raises(ValueError, match="2 heads, but this step computes 8"):
        step(ours, local, x[:, :1])                            # a device's shard, not global
    short = dict(v["cache"], cached_value=v["cache"]["cached_value"][:, :3])
    with pytest.raises(ValueError, match=r"cached_value has shape \(8, 3, 8, 2\) but "
                                         r"cached_key \(8, 12, 8, 2\)"):
        step(ours, short, x[:, :1])
    with pytest.raises(ValueError, match="integer scalar"):
        step(ours, dict(v["cache"], cache_index=jnp.zeros(2, jnp.int32)), x[:, :1])
    full = dict(v["cache"], cache_index=jnp.array(L, jnp.int32))
    with pytest.raises(ValueError, match="holds 12 positions and all are written"):
        step(ours, full, x[:, :1])

    attn = jn.ParallelMultiHeadAttention(HEADS, E, decode=True, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="init_cache"):
        attn(x[:, :1])
    attn.init_cache(x.shape)
    with pytest.raises(ValueError, match="takes one token"):
        attn(x[:, :2])
    undecided = jn.ParallelMultiHeadAttention(HEADS, E, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no `decode` argument"):
        undecided(x)


# ---------------------------------------------------------------- rows that do not split


class _MLP(nn.Module):
    """Column, gelu, row: as ParallelMLP, from any pair of dense layers."""

    column: type
    row: type
    kw: dict

    @nn.compact
    def __call__(self, x):
        return self.row(E, name="down", **self.kw)(nn.gelu(self.column(32, name="up",
                                                                       **self.kw)(x)))


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", ["dp2_tp4_explicit", "tp4_auto"])
def test_rows_that_do_not_split_run_without_sequence_parallelism(mesh_name, caplog,
                                                                 monkeypatch):
    """A sequence of 6 over tp=4 (and a decode token) runs Megatron's f/g for that call:
    Flax's numbers, forward and backward, said once at debug level."""
    monkeypatch.setattr(_common, "_said", set())      # what earlier tests said is forgotten
    mesh = mesh_named(mesh_name)
    explicit = mesh_name.endswith("explicit")
    x = rand(3, (4, 6, E))
    ref = _MLP(nn.Dense, nn.Dense, {})
    params = ref.init(jax.random.key(0), x)
    ours = _MLP(jl.ColumnParallelDense, jl.RowParallelDense,
                dict(impl="ring", mesh=None if explicit else mesh))

    def loss(model):
        return jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(model.apply(p, x) ** 2),
                                          argnums=(0, 1)))

    caplog.set_level(logging.DEBUG, logger="jaxoverlap")
    with _mesh_scope(mesh, explicit):
        got = loss(ours)(params, put(x, mesh, P("dp" if explicit else None)))
    assert_tree_close(got, loss(ref)(params, x), jnp.float32, "loss, grads")
    said = [r.getMessage() for r in caplog.records if "does not split" in r.getMessage()]
    assert said and all(r.levelno == logging.DEBUG for r in caplog.records
                        if "does not split" in r.getMessage())
    assert any("the sequence length 6" in m and "without sequence parallelism" in m
               for m in said)

    # nnx, on a decode-shaped call (one token).
    with jax.set_mesh(mesh):
        column = jn.ColumnParallelLinear(E, 32, impl="ring", mesh=None if explicit else mesh,
                                         rngs=nnx.Rngs(0))
        row = jn.RowParallelLinear(32, E, impl="ring", mesh=None if explicit else mesh,
                                   rngs=nnx.Rngs(1))
        y = nnx.jit(lambda c, r, x: r(c(x)))(column, row, x[:, :1])
    want = nnx.Linear(32, E, rngs=nnx.Rngs(1))(nnx.Linear(E, 32, rngs=nnx.Rngs(0))(x[:, :1]))
    assert_tree_close(y, want, jnp.float32, "nnx, one token")


@pytest.mark.parametrize("mesh_name", ["tp4_auto", "dp2_tp4_explicit"])
@pytest.mark.parametrize("shape", [(0, 8, E), (4, 0, E)], ids=["no_examples", "no_tokens"])
def test_an_empty_batch_gives_flax_s_result(mesh_name, shape):
    """An empty batch (no examples, or no tokens) on global arrays: Flax's empty output and
    zero gradients, linen and nnx (a reshape to -1 could not size an empty batch)."""
    mesh = mesh_named(mesh_name)
    explicit = mesh_name.endswith("explicit")
    x = jnp.ones(shape)
    ref = _MLP(nn.Dense, nn.Dense, {})
    params = ref.init(jax.random.key(0), rand(3, (4, 8, E)))
    ours = _MLP(jl.ColumnParallelDense, jl.RowParallelDense,
                dict(impl="native", mesh=None if explicit else mesh))

    def loss(model):
        return jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(model.apply(p, x) ** 2)))

    with _mesh_scope(mesh, explicit):
        got = loss(ours)(params, put(x, mesh, P("dp" if explicit else None)))
        y = jax.jit(ours.apply)(params, put(x, mesh, P("dp" if explicit else None)))
    assert y.shape == ref.apply(params, x).shape
    assert_tree_close(got, loss(ref)(params, x), jnp.float32, "loss, grads")
    with jax.set_mesh(mesh):
        column = jn.ColumnParallelLinear(E, 32, mesh=None if explicit else mesh,
                                         rngs=nnx.Rngs(0))
        assert nnx.jit(lambda c, x: c(x))(column, x).shape == shape[:-1] + (32,)


def test_all_reduce_rows_that_do_not_split_run_one_shot():
    """GEMM + all-reduce (Megatron g) with impl='ring': rows per device that split into N
    blocks run the two-shot ring; rows that do not (2 tokens over dp=2 and tp=4) run the
    one-shot (every partial to every rank: a permute 2 ranks on), never unfused."""
    mesh = dp_tp_mesh(AxisType.Explicit)
    layer = jl.RowParallelDense(E, sequence_parallel=False, impl="ring")
    with jax.set_mesh(mesh):
        for rows, one_shot in ((8, False), (2, True)):
            h = rand(4, (rows, 1, 32))
            params = nn.Dense(E).init(jax.random.key(0), h)
            h_in = jax.device_put(h, NamedSharding(mesh, P("dp", None, "tp")))
            apply = jax.jit(layer.apply)
            _assert_step_collectives(apply.lower(params, h_in).compile().as_text(), "ring",
                                     one_shot)
            assert_tree_close(apply(params, h_in), nn.Dense(E).apply(params, h), jnp.float32,
                              f"{rows} rows")
