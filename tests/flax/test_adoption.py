"""The layers in the flow Flax users already have: their partitioning metadata and logical
rules, abstract init before any mesh exists, and every argument of Flax's own layers."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax_helpers import B, F, H, S, assert_tree_close, mesh_named, x_spec
from helpers import dp_tp_mesh, put, rand, tp_mesh
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxoverlap.flax import _common
from jaxoverlap.flax import linen as jl
from jaxoverlap.flax import nnx as jn

# Whole Flax models, trained and compared: seconds each.
pytestmark = pytest.mark.slow

INIT = nn.initializers.lecun_normal()
ZEROS = nn.initializers.zeros_init()


class LogicalMLP(nn.Module):
    """An MLP annotated with logical axis names, as Flax's example models are."""

    column: type = nn.Dense
    row: type = nn.Dense
    kw: dict | None = None

    @nn.compact
    def __call__(self, x):
        kw = self.kw or {}
        h = self.column(F, name="up", **kw,
                        kernel_init=nn.with_logical_partitioning(INIT, ("embed", "mlp")),
                        bias_init=nn.with_logical_partitioning(ZEROS, ("mlp",)))(x)
        return self.row(x.shape[-1], name="down", **kw,
                        kernel_init=nn.with_logical_partitioning(INIT, ("mlp", "embed")),
                        bias_init=nn.with_logical_partitioning(ZEROS, ("embed",)))(nn.gelu(h))


def swapped(**kw) -> LogicalMLP:
    return LogicalMLP(jl.ColumnParallelDense, jl.RowParallelDense, kw)


def value_and_grads(apply, params, x):
    def loss(params, x):
        y = apply(params, x)
        return jnp.mean(y ** 2), y

    (value, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return y, value, grads


_STOCK: dict = {}


def stock_once(what: str, compute, *inputs):
    """``compute(*inputs)``, the stock model's run, done once per the inputs' values (paths,
    dtypes, shapes and bytes) and reused by the cases that compare with it: those run the
    swapped model anew, and differ in the mesh and layout only, not in the stock run's
    inputs."""
    digest = hashlib.sha256(what.encode())
    for path, leaf in jax.tree_util.tree_flatten_with_path(inputs)[0]:
        a = np.asarray(leaf)
        digest.update(f"{jax.tree_util.keystr(path)} {a.dtype} {a.shape}".encode())
        digest.update(a.tobytes())
    key = digest.hexdigest()
    if key not in _STOCK:
        _STOCK[key] = compute(*inputs)
    return _STOCK[key]


# ---------------------------------------------------------------- metadata (linen)


@pytest.mark.parametrize("mesh_name", ["dp2_tp4_explicit", "tp4_auto"])
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_linen_logical_names_are_kept_and_the_users_rules_place_them(mesh_name,
                                                                      sequence_parallel):
    mesh = mesh_named(mesh_name)
    rules = (("mlp", "tp"), ("batch", "dp"))
    x = rand(0, (B, S, H))
    model = swapped(sequence_parallel=sequence_parallel, impl="xla")
    # Flax's flow: an abstract init with no mesh and no rules, the user's names...
    abstract = jax.eval_shape(model.init, jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, nn.unbox(abstract)) == jax.tree.map(
        jnp.shape, nn.unbox(jax.eval_shape(LogicalMLP().init, jax.random.key(0), x)))
    specs = nn.get_partition_spec(abstract)["params"]
    assert specs["up"] == {"kernel": P("embed", "mlp"), "bias": P("mlp")}
    assert specs["down"] == {"kernel": P("mlp", "embed"), "bias": P("embed")}
    # ... placed by the user's rules, initialised under jit with those shardings.
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
        variables = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x)
    params = nn.unbox(variables)["params"]
    assert params["up"]["kernel"].sharding.spec == P(None, "tp")
    assert params["down"]["kernel"].sharding.spec == P("tp", None)
    with jax.set_mesh(mesh) if mesh_name.endswith("explicit") else contextlib.nullcontext():
        got = value_and_grads(lambda p, x: model.apply({"params": p}, x), params,
                              put(x, mesh, x_spec(mesh, sequence_parallel)))
    want = stock_once("LogicalMLP", functools.partial(
        value_and_grads, lambda p, x: LogicalMLP().apply({"params": p}, x)),
        jax.tree.map(np.asarray, params), x)
    assert_tree_close(got, want, jnp.float32, "y, loss, grads")


def test_linen_rules_that_miss_the_tensor_axis_name_the_rule_to_add():
    mesh = tp_mesh(4)
    x = rand(0, (B, S, H))
    with nn.logical_axis_rules((("embed", None),)):          # nothing maps "mlp" to tp
        with pytest.raises(ValueError, match=r"Add the rule \('mlp', 'tp'\)"):
            swapped(mesh=mesh).init(jax.random.key(0), x)
    with nn.logical_axis_rules((("embed", "tp"), ("mlp", None))):
        with pytest.raises(ValueError, match=r"logical axis 'embed'"):
            swapped(mesh=mesh).init(jax.random.key(0), x)
    # Mesh-axis names (nn.with_partitioning) are checked without rules.
    layer = jl.ColumnParallelDense(F, kernel_init=nn.with_partitioning(INIT, (None, "model")),
                                   mesh=mesh)
    with pytest.raises(ValueError, match=r"needs dim 1 split over 'tp'"):
        layer.init(jax.random.key(0), x)
    # The rules of the box itself count as well.
    boxed = nn.with_logical_partitioning(INIT, ("embed", "mlp"), rules=(("mlp", "other"),))
    with pytest.raises(ValueError, match=r"Add the rule \('mlp', 'tp'\)"):
        jl.ColumnParallelDense(F, kernel_init=boxed, mesh=mesh).init(jax.random.key(0), x)


# ---------------------------------------------------------------- no mesh needed


LINEN_PAIRS = [
    (jl.ColumnParallelDense(F), nn.Dense(F), (B, S, H)),
    (jl.RowParallelDense(H), nn.Dense(H), (B, S, F)),
    (jl.ParallelMLP(F), LogicalMLP(), (B, S, H)),
    (jl.ColumnParallelDenseGeneral((8, 4)), nn.DenseGeneral((8, 4)), (B, S, H)),
    (jl.RowParallelDenseGeneral(H, axis=(-2, -1)), nn.DenseGeneral(H, axis=(-2, -1)),
     (B, S, 8, 4)),
    (jl.ParallelMultiHeadDotProductAttention(num_heads=8),
     nn.MultiHeadDotProductAttention(num_heads=8), (B, S, H)),
]


@pytest.mark.parametrize("ours,theirs,shape", LINEN_PAIRS,
                         ids=[type(p[0]).__name__ for p in LINEN_PAIRS])
def test_linen_abstract_init_and_apply_need_no_mesh(ours, theirs, shape):
    """No mesh anywhere: shapes and specs from an abstract init; applied, Flax's numbers."""
    x = rand(0, shape)
    abstract = jax.eval_shape(ours.init, jax.random.key(0), x)
    shapes = jax.tree.map(jnp.shape, nn.unbox(abstract))
    assert shapes == jax.tree.map(jnp.shape,
                                  nn.unbox(jax.eval_shape(theirs.init, jax.random.key(0), x)))
    nn.get_partition_spec(abstract)                  # Flax's tool works on it
    variables = theirs.init(jax.random.key(1), x)
    np.testing.assert_allclose(ours.apply(variables, x), theirs.apply(variables, x),
                               rtol=1e-5, atol=1e-5)


def test_nnx_abstract_init_needs_no_mesh():
    abstract = nnx.eval_shape(lambda: jn.ParallelMLP(H, F, rngs=nnx.Rngs(0)))
    specs = jn.partition_specs(abstract)
    assert specs["up"]["kernel"].get_value() == P(None, "tp")
    assert abstract.down.kernel.shape == (F, H)
    attn = nnx.eval_shape(lambda: jn.ParallelMultiHeadAttention(8, H, 32, rngs=nnx.Rngs(0)))
    assert attn.query.kernel.shape == (H, 8, 4)
    # Built without a mesh and applied without one: nnx.Linear's numbers.
    ours, theirs = jn.ColumnParallelLinear(H, F, rngs=nnx.Rngs(0)), nnx.Linear(
        H, F, rngs=nnx.Rngs(0))
    x = rand(0, (B, S, H))
    np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- metadata (nnx)


def test_nnx_sharding_metadata_is_kept_and_checked():
    mesh = dp_tp_mesh(AxisType.Explicit)
    rules = (("embed", None), ("mlp", "tp"))
    x = rand(0, (B, S, H))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        layer = jn.ColumnParallelLinear(H, F, kernel_metadata={"out_sharding": ("embed", "mlp")},
                                        rngs=nnx.Rngs(0))
        ref = nnx.Linear(H, F, kernel_metadata={"out_sharding": ("embed", "mlp")},
                         rngs=nnx.Rngs(0))
        assert layer.kernel.get_metadata()["out_sharding"] == ("embed", "mlp")   # as written
        assert nnx.get_partition_spec(nnx.state(layer))["kernel"].get_value() == P(None, "tp")
        assert layer.kernel.get_value().sharding.spec == P(None, "tp")          # placed by them
        y = nnx.jit(lambda m, x: m(x))(layer, put(x, mesh, P("dp", "tp")))
    np.testing.assert_allclose(y, ref(x), rtol=1e-5, atol=1e-5)
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    with jax.set_mesh(mesh), nnx.logical_axis_rules((("embed", None), ("mlp", None))):
        with pytest.raises(ValueError, match=r"Add the rule \('mlp', 'tp'\)"):
            jn.ColumnParallelLinear(H, F, kernel_init=init, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match="kernel_metadata"):
            jn.RowParallelLinear(F, H, kernel_metadata={"out_sharding": (None, "tp")},
                                 rngs=nnx.Rngs(0))


# ---------------------------------------------------------------- Flax's signatures


def _fields(cls) -> list[str]:
    return [f for f in cls.__dataclass_fields__ if f not in ("parent", "name")]


def _params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


OURS = {"axis_name", "sequence_parallel", "impl", "mesh"}


@pytest.mark.parametrize("ours,theirs", [
    (jl.ColumnParallelDense, nn.Dense), (jl.RowParallelDense, nn.Dense),
    (jl.ColumnParallelDenseGeneral, nn.DenseGeneral), (jl.RowParallelDenseGeneral, nn.DenseGeneral),
    (jl.ParallelMultiHeadDotProductAttention, nn.MultiHeadDotProductAttention),
], ids=lambda c: c.__name__)
def test_linen_layers_take_every_field_of_flax(ours, theirs):
    """Flax's fields in Flax's order (positional use keeps working), then ours; same call."""
    assert _fields(ours) == _fields(theirs) + [f for f in _fields(ours) if f in OURS]
    assert _params(ours.__call__) == _params(theirs.__call__)


@pytest.mark.parametrize("ours,theirs", [
    (jn.ColumnParallelLinear, nnx.Linear), (jn.RowParallelLinear, nnx.Linear),
    (jn.ColumnParallelLinearGeneral, nnx.LinearGeneral),
    (jn.RowParallelLinearGeneral, nnx.LinearGeneral),
    (jn.ParallelMultiHeadAttention, nnx.MultiHeadAttention),
], ids=lambda c: c.__name__)
def test_nnx_layers_take_every_argument_of_flax(ours, theirs):
    mine, flax_args = inspect.signature(ours.__init__).parameters, \
        inspect.signature(theirs.__init__).parameters
    for name, p in flax_args.items():
        assert name in mine, f"{ours.__name__} lacks {theirs.__name__}'s argument {name!r}"
        assert mine[name].kind == p.kind, name
    positional = [n for n, p in flax_args.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert [n for n, p in mine.items() if p.kind == p.POSITIONAL_OR_KEYWORD] == positional
    assert set(mine) - set(flax_args) == OURS
    call = inspect.signature(ours.__call__).parameters
    assert set(inspect.signature(theirs.__call__).parameters) <= set(call)


# ---------------------------------------------------------------- a user's dot_general


def test_custom_dot_general_runs_unfused_and_is_said_once(caplog, monkeypatch):
    monkeypatch.setattr(_common, "_said", set())      # what earlier tests said is forgotten
    calls = []

    def rounding_dot(x, k, dims, precision=None, **kw):
        """A stand-in for quantisation: the kernel rounded to bfloat16."""
        calls.append(k.shape)
        return lax.dot_general(x, k.astype(jnp.bfloat16).astype(k.dtype), dims,
                               precision=precision, **kw)

    x = rand(0, (B, S, H))
    ref = LogicalMLP(nn.Dense, nn.Dense, {"dot_general": rounding_dot})
    params = ref.init(jax.random.key(0), x)
    want = ref.apply(params, x)
    exact = LogicalMLP().apply(params, x)
    assert not np.allclose(want, exact, atol=1e-4)    # the rounding shows in the output
    for mesh_name in ("tp4_auto", "dp2_tp4_explicit"):
        mesh = mesh_named(mesh_name)
        for sp in (True, False):
            model = swapped(dot_general=rounding_dot, sequence_parallel=sp, mesh=mesh)
            calls.clear()
            with caplog.at_level(logging.WARNING, logger="jaxoverlap"):
                got = jax.jit(model.apply)(params, put(x, mesh, x_spec(mesh, sp)))
            assert calls, "the user's dot_general was not called"
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    said = [r for r in caplog.records if "custom dot_general" in r.getMessage()]
    assert len(said) == 2 and {r.getMessage().split(":")[0] for r in said} == {
        "ColumnParallelDense", "RowParallelDense"}
    # Inside the user's shard_map: local shards, the user's function next to the collectives.
    mesh = tp_mesh(4)
    model = swapped(dot_general=rounding_dot)
    specs = nn.logical_to_mesh(nn.get_partition_spec(params), (("mlp", "tp"),))
    fn = jax.shard_map(model.apply, mesh=mesh, in_specs=(specs, P(None, "tp")),
                       out_specs=P(None, "tp"))
    placed = jax.tree.map(lambda a, s: put(a, mesh, s), nn.unbox(params), specs)
    np.testing.assert_allclose(jax.jit(fn)(placed, put(x, mesh, P(None, "tp"))), want,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mesh_name", ["tp4_auto", "dp2_tp4_explicit"])
def test_flax_fp8_dot_general_cls(mesh_name):
    """Flax's FP8 op (its scales live in their own collection) through the swapped MLP."""
    mesh = mesh_named(mesh_name)
    x = rand(0, (B, S, H))
    ref = LogicalMLP(nn.Dense, nn.Dense, {"dot_general_cls": nn.Fp8DirectDotGeneralOp})
    model = swapped(dot_general_cls=nn.Fp8DirectDotGeneralOp, impl="xla")
    variables = ref.init(jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, nn.unbox(model.init(jax.random.key(0), x))) == \
        jax.tree.map(jnp.shape, nn.unbox(variables))           # same collections and paths

    def grads(model, variables, x):
        def loss(params):
            return jnp.mean(model.apply({**variables, "params": params}, x) ** 2)
        return jax.jit(jax.value_and_grad(loss))(variables["params"])

    with jax.set_mesh(mesh):
        got = grads(model, variables, put(x, mesh, x_spec(mesh, True)))
    assert_tree_close(got, stock_once("fp8 MLP", functools.partial(grads, ref), variables, x),
                      jnp.float32, "loss, grads")


def test_nnx_call_arguments_of_linear():
    """preferred_element_type, a custom dot_general and out_sharding, as nnx.Linear takes them."""
    mesh = dp_tp_mesh(AxisType.Explicit)
    x = rand(0, (B, S, H), jnp.bfloat16)
    kw = dict(dtype=jnp.bfloat16, preferred_element_type=jnp.float32)
    ref = nnx.Linear(H, F, **kw, rngs=nnx.Rngs(0))
    with jax.set_mesh(mesh):
        layer = jn.ColumnParallelLinear(H, F, **kw, rngs=nnx.Rngs(0))
        y = nnx.jit(lambda m, x: m(x))(layer, put(x, mesh, P("dp", "tp")))
        assert y.dtype == jnp.float32                         # accumulated and returned in f32
        # Equal up to the order of the float32 sums: the layer's dot runs on each device's
        # shards, nnx.Linear's on whole arrays, and XLA's CPU dot sums the H products (exact in
        # float32: bf16 x bf16) in an order that depends on the operands' shapes. Each result
        # is within H * eps * sum|x_h w_h| of the exact sum, so they are within twice that.
        w = np.asarray(ref.kernel.get_value().astype(jnp.bfloat16), np.float64)
        magnitude = np.einsum("bsh,hf->bsf", np.abs(np.asarray(x, np.float64)), np.abs(w))
        bound = 2 * H * np.finfo(np.float32).eps * magnitude
        difference = np.abs(np.asarray(y, np.float64) - np.asarray(ref(x), np.float64))
        assert (difference <= bound).all(), (difference.max(), bound.min())
        # out_sharding (Flax's Gemma passes the activation layout this way).
        row = jn.RowParallelLinear(F, H, rngs=nnx.Rngs(1))
        h = put(rand(1, (B, S, F)), mesh, P("dp", None, "tp"))
        out = nnx.jit(lambda m, h: m(h, out_sharding=P("dp", None, "tp")))(row, h)
        assert out.sharding.spec == P("dp", None, "tp")
        np.testing.assert_allclose(out, nnx.Linear(F, H, rngs=nnx.Rngs(1))(np.asarray(h)),
                                   rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- training with and without swap


class LogicalBlock(nn.Module):
    """A pre-LayerNorm transformer block, every parameter named with logical axes."""

    swap: bool = False
    kw: dict | None = None

    @nn.compact
    def __call__(self, x, *, train: bool):
        kw = self.kw or {}
        dense = (jl.ColumnParallelDense, jl.RowParallelDense) if self.swap else (nn.Dense,) * 2
        attention = (functools.partial(jl.ParallelMultiHeadDotProductAttention, **kw)
                     if self.swap else nn.MultiHeadDotProductAttention)
        names = nn.with_logical_partitioning
        ln = functools.partial(nn.LayerNorm, scale_init=names(nn.initializers.ones, ("embed",)),
                               bias_init=names(ZEROS, ("embed",)))
        h = attention(num_heads=4, dropout_rate=0.1, deterministic=not train,
                      kernel_init=names(INIT, ("embed", "heads", "kv")),
                      out_kernel_init=names(INIT, ("heads", "kv", "embed")),
                      bias_init=names(ZEROS, ("heads", "kv")),
                      out_bias_init=names(ZEROS, ("embed",)))(ln()(x))
        x = x + h
        h = dense[0](F, **kw, kernel_init=names(INIT, ("embed", "mlp")),
                     bias_init=names(ZEROS, ("mlp",)))(ln()(x))
        # (nn.Dropout on activations split under Explicit axes is refused by JAX's types;
        # the attention's dropout is there.)
        return x + dense[1](x.shape[-1], **kw, kernel_init=names(INIT, ("mlp", "embed")),
                            bias_init=names(ZEROS, ("embed",)))(nn.gelu(h))


def _train(model, params, batches, in_shardings=None):
    """Three SGD steps of a regression loss, with dropout; the losses and the final params.

    (SGD rather than Adam: the key bias's gradient is zero up to rounding, and Adam would
    scale that rounding up to a full step.)
    """
    import optax

    tx = optax.sgd(0.1)

    def step(params, opt_state, x, key):
        def loss(p):
            y = model.apply({"params": p}, x, train=True, rngs={"dropout": key})
            return jnp.mean((y - jnp.flip(x, axis=-1)) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    if in_shardings is None:
        step = jax.jit(step)
    else:
        step = jax.jit(step, in_shardings=(in_shardings, None, None, None),
                       out_shardings=(in_shardings, None, None))
    opt_state, losses = tx.init(params), []
    for i, x in enumerate(batches):
        params, opt_state, value = step(params, opt_state, x, jax.random.key(i))
        losses.append(float(value))
    return losses, params


@pytest.mark.parametrize("mesh_name", ["dp2_tp4_explicit", "dp2_tp4_auto"])
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_a_logical_model_trains_identically_with_the_swap(mesh_name, sequence_parallel):
    """Linen: the user's rules and flow (abstract init, rules -> shardings, jit of the init)."""
    mesh = mesh_named(mesh_name)
    explicit = mesh_name.endswith("explicit")
    rules = (("mlp", "tp"), ("heads", "tp"), ("batch", "dp"))
    batches = [rand(i, (B, S, H)) for i in range(3)]
    swapped = LogicalBlock(swap=True, kw=dict(sequence_parallel=sequence_parallel, impl="xla"))
    abstract = jax.eval_shape(functools.partial(swapped.init, train=False), jax.random.key(0),
                              batches[0])
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
    # Under Explicit axes Flax's own layers (the layer norms) assert their logical layout when
    # rules are in force, so the init runs without them there; the shardings place the params.
    with jax.set_mesh(mesh), nn.logical_axis_rules(() if explicit else rules):
        variables = jax.jit(functools.partial(swapped.init, train=False),
                            out_shardings=shardings)(jax.random.key(0), batches[0])
    params = nn.unbox(variables)["params"]
    assert params["Dense_0"]["kernel"].sharding.spec == P(None, "tp")
    assert params["MultiHeadDotProductAttention_0"]["out"]["kernel"].sharding.spec[0] == "tp"
    data = NamedSharding(mesh, x_spec(mesh, sequence_parallel))
    with jax.set_mesh(mesh) if explicit else contextlib.nullcontext():
        got = _train(swapped, params, [jax.device_put(x, data) for x in batches],
                     nn.unbox(shardings)["params"])
    # The original model, on one device, from the same parameters.
    want = stock_once("LogicalBlock", functools.partial(_train, LogicalBlock()),
                      jax.tree.map(np.asarray, params), batches)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    assert_tree_close(got[1], want[1], jnp.float32, "trained parameters")


class _NnxBlock(nnx.Module):
    """An MLP with logical sharding names on its kernels (nnx)."""

    def __init__(self, swap: bool, rngs: nnx.Rngs, **kw):
        column, row = (jn.ColumnParallelLinear, jn.RowParallelLinear) if swap else (
            nnx.Linear, nnx.Linear)
        self.up = column(H, F, kernel_metadata={"out_sharding": ("embed", "mlp")}, rngs=rngs,
                         **kw)
        self.down = row(F, H, kernel_metadata={"out_sharding": ("mlp", "embed")}, rngs=rngs,
                        **kw)

    def __call__(self, x):
        return x + self.down(nnx.gelu(self.up(x)))


@pytest.mark.parametrize("mesh_name", ["dp2_tp4_explicit", "dp2_tp4_auto"])
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_an_nnx_model_with_logical_names_trains_identically(mesh_name, sequence_parallel):
    import optax

    mesh = mesh_named(mesh_name)
    rules = (("mlp", "tp"), ("embed", None))
    batches = [rand(i, (B, S, H)) for i in range(3)]

    def train(model, batches):
        graphdef, params = nnx.split(model, nnx.Param)
        tx = optax.sgd(0.1)

        @jax.jit
        def step(params, opt_state, x):
            def loss(p):
                return jnp.mean((nnx.merge(graphdef, p)(x) - jnp.flip(x, axis=-1)) ** 2)

            value, grads = jax.value_and_grad(loss)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        opt_state, losses = tx.init(params), []
        for x in batches:
            params, opt_state, value = step(params, opt_state, x)
            losses.append(float(value))
        return losses, nnx.to_pure_dict(params)

    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        swapped = _NnxBlock(True, nnx.Rngs(0), sequence_parallel=sequence_parallel, impl="xla")
        assert swapped.up.kernel.get_value().sharding.spec == P(None, "tp")
        data = NamedSharding(mesh, x_spec(mesh, sequence_parallel))
        got = train(swapped, [jax.device_put(x, data) for x in batches])
    def stock(batches):
        with nnx.use_eager_sharding(False):
            return train(_NnxBlock(False, nnx.Rngs(0)), batches)

    want = stock_once("_NnxBlock", stock, batches)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    assert_tree_close(got[1], want[1], jnp.float32, "trained parameters")


def test_unnamed_linen_layers_take_flax_names():
    """A model whose unnamed nn.Dense / attention were swapped keeps its parameter paths."""

    class Model(nn.Module):
        swap: bool

        @nn.compact
        def __call__(self, x):
            column, row = (jl.ColumnParallelDense, jl.RowParallelDense) if self.swap else \
                (nn.Dense, nn.Dense)
            attention = jl.ParallelMultiHeadDotProductAttention if self.swap else \
                nn.MultiHeadDotProductAttention
            h = nn.Dense(F)(x)                          # an unswapped one in between
            h = attention(num_heads=4)(column(F)(row(H)(h)))
            return nn.DenseGeneral((4, 2))(h)

    x = rand(0, (B, S, H))
    ours, theirs = (jax.eval_shape(Model(swap).init, jax.random.key(0), x) for swap in (1, 0))
    assert jax.tree.map(jnp.shape, nn.unbox(ours)) == jax.tree.map(jnp.shape, nn.unbox(theirs))
    assert set(ours["params"]) == {"Dense_0", "Dense_1", "Dense_2",
                                   "MultiHeadDotProductAttention_0", "DenseGeneral_0"}
