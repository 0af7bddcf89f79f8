"""The ops on global arrays under jit: they wrap themselves in shard_map (README)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, dp_tp_mesh, f64, put, rand, tp_mesh
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoverlap as jo
from jaxoverlap import _kinds

AXIS_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("impl", ["xla", "ring", "native"])
def test_ag_matmul_global_with_mesh_argument(kind, impl):
    mesh = dp_tp_mesh(AXIS_TYPES[kind])
    x = put(rand(0, (4, 8, 6), jnp.float32), mesh, P("dp", "tp", None))   # [B, S, H]
    w = put(rand(1, (6, 12), jnp.float32), mesh, P(None, "tp"))
    y = jax.jit(lambda x, w: jo.ag_matmul(x, w, "tp", axis=1, impl=impl, mesh=mesh))(x, w)
    assert y.shape == (4, 8, 12)
    assert_close(y, f64(x) @ f64(w), jnp.float32)
    if kind == "explicit":
        # Under Explicit axes the data-parallel axis passes through, tp moves to the features.
        assert y.sharding.spec == P("dp", None, "tp")


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("impl", ["xla", "ring", "native"])
def test_matmul_rs_global_with_set_mesh(kind, impl):
    mesh = dp_tp_mesh(AXIS_TYPES[kind])
    x = put(rand(2, (4, 8, 12), jnp.float32), mesh, P("dp", None, "tp"))
    w = put(rand(3, (12, 6), jnp.float32), mesh, P("tp", None))
    with jax.set_mesh(mesh):
        y = jax.jit(lambda x, w: jo.matmul_rs(x, w, "tp", axis=1, impl=impl))(x, w)
    assert y.shape == (4, 8, 6)
    assert_close(y, f64(x) @ f64(w), jnp.float32)
    if kind == "explicit":
        assert y.sharding.spec == P("dp", "tp", None)


@pytest.mark.parametrize("impl", ["xla", "ring", "native"])
def test_mesh_taken_from_input_sharding(impl):
    mesh = dp_tp_mesh(AxisType.Explicit)
    x = put(rand(4, (8, 6), jnp.float32), mesh, P("tp", None))
    w = put(rand(5, (6, 8), jnp.float32), mesh, P(None, "tp"))
    y = jo.ag_matmul(x, w, "tp", impl=impl)                  # eager, no mesh given
    assert_close(y, f64(x) @ f64(w), jnp.float32)
    y = jax.jit(lambda x, w: jo.ag_matmul(x, w, "tp", impl=impl))(x, w)
    assert_close(y, f64(x) @ f64(w), jnp.float32)


def test_unsharded_inputs_are_laid_out_by_the_op():
    mesh = dp_tp_mesh(AxisType.Explicit)
    x = rand(6, (2, 8, 6), jnp.float32)     # plain arrays on one device
    w = rand(7, (6, 8), jnp.float32)
    y = jax.jit(lambda x, w: jo.ag_matmul(x, w, "tp", axis=1, impl="ring", mesh=mesh))(x, w)
    assert_close(y, f64(x) @ f64(w), jnp.float32)
    z = jax.jit(lambda y, w: jo.matmul_rs(y, w.T, "tp", axis=1, impl="ring", mesh=mesh))(y, w)
    assert_close(z, f64(y) @ f64(w).T, jnp.float32)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("impl", ["xla", "ring", "native"])
def test_global_mlp_gradients(kind, impl):
    mesh = dp_tp_mesh(AXIS_TYPES[kind])
    x = put(rand(8, (4, 8, 6), jnp.float32), mesh, P("dp", "tp", None))
    w1 = put(rand(9, (6, 8), jnp.float32), mesh, P(None, "tp"))
    w2 = put(rand(10, (8, 6), jnp.float32), mesh, P("tp", None))

    def loss(x, w1, w2, impl):
        h = jo.ag_matmul(x, w1, "tp", axis=1, impl=impl, mesh=mesh)
        return jnp.sum(jo.matmul_rs(jnp.tanh(h), w2, "tp", axis=1, impl=impl, mesh=mesh) ** 2)

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(x, w1, w2, impl)

    def dense(x, w1, w2):
        return jnp.sum((jnp.tanh(x @ w1) @ w2) ** 2)

    want = jax.grad(dense, argnums=(0, 1, 2))(*(jnp.asarray(np.asarray(a)) for a in (x, w1, w2)))
    for a, b in zip(got, want, strict=True):
        assert_close(a, f64(b), jnp.float32)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_a_global_call_is_planned_described_and_checked_once(monkeypatch, kind):
    """On global arrays the shapes are checked, the plan made and the native call's transport
    decided once per call, at trace time, for the shards every device gets (x's batch on "dp"
    under Explicit axes): the devices run that plan (the backward pass too, under the same
    plan) and the lowering reads that transport."""
    from jaxoverlap import _global, _layout, _local, _plan
    from jaxoverlap._executors import capabilities

    counts = {"check_shapes": 0, "make": 0, "resolve_transport": 0}
    ran = []

    def count(module, name):
        real = getattr(module, name)

        def spy(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)

    count(_layout, "check_shapes")
    count(_global, "check_shapes")  # imported by name there
    count(_plan, "make")
    count(capabilities, "resolve_transport")
    real_run = _local.run
    monkeypatch.setattr(_local, "run", lambda plan, *a: ran.append(plan) or real_run(plan, *a))
    mesh = dp_tp_mesh(AXIS_TYPES[kind]) if kind == "explicit" else tp_mesh(4)
    x_spec = P("dp", "tp", None) if kind == "explicit" else P(None, "tp", None)
    x = put(rand(8, (4, 8, 6), jnp.float32), mesh, x_spec)
    w = put(rand(9, (6, 8), jnp.float32), mesh, P(None, "tp"))

    def f(x, w):
        return jo.ag_matmul(x, w, "tp", axis=1, impl="native", transport="p2p", mesh=mesh)

    assert_close(jax.jit(f)(x, w), f64(x) @ f64(w), jnp.float32)
    assert counts == {"check_shapes": 1, "make": 1, "resolve_transport": 1}, counts
    assert [p.call.transport for p in ran] == ["p2p"]
    assert ran[0].axis_size == 4 and ran[0].call.ranks, ran[0]
    if kind == "explicit":  # the backward pass (GEMM+RS) runs the forward call's plan
        counts.update(dict.fromkeys(counts, 0))
        ran.clear()
        jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) ** 2), argnums=(0, 1)))(x, w)
        assert counts == {"check_shapes": 1, "make": 1, "resolve_transport": 1}, counts
        assert [p.op for p in ran] == ["ag_matmul"]  # the backward is in its custom_vjp


@pytest.mark.parametrize("impl", ["xla", "ring", "native"])
def test_global_return_gathered(impl):
    mesh = dp_tp_mesh(AxisType.Explicit)
    x = put(rand(11, (2, 8, 6), jnp.float32), mesh, P("dp", "tp", None))
    w = put(rand(12, (6, 8), jnp.float32), mesh, P(None, "tp"))
    y, g = jax.jit(lambda x, w: jo.ag_matmul(x, w, "tp", axis=1, impl=impl, mesh=mesh,
                                             return_gathered=True))(x, w)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(x))
    assert g.sharding.spec == P("dp", None, None)
    assert_close(y, f64(x) @ f64(w), jnp.float32)


def test_two_d_mesh_forward_inside_shard_map():
    mesh = dp_tp_mesh()
    x = rand(13, (4, 8, 6), jnp.float32)
    w1 = rand(14, (6, 8), jnp.float32)
    w2 = rand(15, (8, 6), jnp.float32)

    def block(x, w1, w2):
        h = jo.ag_matmul(x, w1, "tp", axis=1, impl="ring", chunks=2)
        return jo.matmul_rs(h, w2, "tp", axis=1, impl="ring", chunks=2)

    f = jax.jit(jax.shard_map(block, mesh=mesh,
                              in_specs=(P("dp", "tp"), P(None, "tp"), P("tp", None)),
                              out_specs=P("dp", "tp")))
    assert_close(f(x, w1, w2), f64(x) @ f64(w1) @ f64(w2), jnp.float32)


def test_global_output_sharding_is_named():
    mesh = dp_tp_mesh(AxisType.Explicit)
    x = put(rand(16, (8, 6), jnp.float32), mesh, P("tp", None))
    w = put(rand(17, (6, 8), jnp.float32), mesh, P(None, "tp"))
    y = jax.jit(lambda x, w: jo.ag_matmul(x, w, "tp", impl="ring", mesh=mesh))(x, w)
    assert isinstance(y.sharding, NamedSharding)
    assert y.sharding.spec == P(None, "tp")


@pytest.mark.parametrize("op", _kinds.names(_kinds.OPS))
def test_an_eager_call_under_auto_axes_runs_the_native_program(op):
    """Called outside jit on single-device inputs, the op still runs natively when asked:
    evaluated eagerly, a custom_partitioning primitive would run its plain-XLA body instead."""
    from jaxoverlap._executors.runtime import load_host

    mesh = tp_mesh(4)
    x, w = rand(31, (8, 16), jnp.float32), rand(32, (16, 8), jnp.float32)
    before = load_host().cliques()
    kw = {} if op == "matmul_ar" else {"axis": 0}
    y = getattr(jo, op)(x, w, "tp", impl="native", transport="p2p", chunks=1, mesh=mesh, **kw)
    assert_close(y, f64(x) @ f64(w), jnp.float32)
    after = load_host().cliques()
    assert after.count("clique") == before.count("clique") + 1, (before, after)
