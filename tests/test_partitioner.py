"""Under Auto mesh axes XLA calls the ops' partitioner back once per instance of a call; the
per-device module is made once per distinct call (``_partitioner``), except where it lowers a
native call, which is named where it lowers and so lowers at every instance."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import dp_tp_mesh, rand
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoverlap as jo
from jaxoverlap import _partitioner

B, S, H, F, LAYERS = 2, 8, 16, 24, 3   # shapes of this file's own: no other test's signature


def _model(impl: str | None):
    """LAYERS alike blocks (an AG+GEMM and a GEMM+RS each); ``impl`` None: the plain math."""
    def loss(x, ups, downs):
        for up, down in zip(ups, downs, strict=True):
            if impl is None:
                x = x + jnp.tanh(x @ up) @ down
            else:
                h = jo.ag_matmul(x, up, "tp", axis=1, impl=impl)
                x = x + jo.matmul_rs(jnp.tanh(h), down, "tp", axis=1, impl=impl)
        return jnp.sum(x ** 2)

    return jax.value_and_grad(loss, argnums=(0, 1, 2))


def _inputs(mesh):
    x = jax.device_put(rand(0, (B, S, H)), NamedSharding(mesh, P("dp", "tp")))
    ups = [jax.device_put(rand(1 + i, (H, F), scale=0.3), NamedSharding(mesh, P(None, "tp")))
           for i in range(LAYERS)]
    downs = [jax.device_put(rand(9 + i, (F, H), scale=0.3), NamedSharding(mesh, P("tp", None)))
             for i in range(LAYERS)]
    return x, ups, downs


@pytest.mark.parametrize("impl, modules", [("xla", 4), ("native", 4 * LAYERS)])
def test_alike_calls_share_one_partitioning_unless_native(monkeypatch, impl, modules):
    """Each layer's two calls, forward and backward, are four distinct calls: 12 instances.
    ``xla`` makes 4 per-device modules; ``native`` one per instance (each is named where it
    lowers); both give the plain math's loss and gradients."""
    made = collections.Counter()
    make = _partitioner.jax_cp._custom_partitioning_partition

    def counted(*args):
        made[args[-1]] += 1
        return make(*args)

    monkeypatch.setattr(_partitioner.jax_cp, "_custom_partitioning_partition", counted)
    monkeypatch.setattr(_partitioner, "_program", None)
    mesh = dp_tp_mesh()
    args = _inputs(mesh)
    with jax.set_mesh(mesh):
        got = jax.jit(_model(impl))(*args)
        assert sum(made.values()) == modules, made
        if impl == "xla":
            # Another program (a new lowering of the same function) partitions afresh: what
            # the process changed between the two (here nothing) cannot reach it through a
            # module made for the first.
            again = jax.jit(_model(impl))(*args)
            assert sum(made.values()) == 2 * modules, made
            for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(got), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    want = _model(None)(*(jax.tree.map(lambda a: np.asarray(a, np.float64), args)))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-4)
