"""The ring really is a ring: collective-permutes, and no all-gather / reduce-scatter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import rand, tp_mesh
from jax.sharding import PartitionSpec as P

import jaxoverlap as jo


def _hlo(op, impl, **kw):
    mesh = tp_mesh(4)
    if op is jo.ag_matmul:
        x, w, specs, out = (rand(0, (8, 4), jnp.float32), rand(1, (4, 8), jnp.float32),
                            (P("tp"), P(None, "tp")), P(None, "tp"))
    else:
        x, w, specs, out = (rand(0, (8, 8), jnp.float32), rand(1, (8, 4), jnp.float32),
                            (P(None, "tp"), P("tp", None)), P("tp"))
    f = jax.jit(jax.shard_map(lambda x, w: op(x, w, "tp", impl=impl, **kw), mesh=mesh,
                              in_specs=specs, out_specs=out))
    return f.lower(x, w).compile().as_text()


@pytest.mark.parametrize("op", [jo.ag_matmul, jo.matmul_rs], ids=["ag", "rs"])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_ring_lowers_to_collective_permutes_only(op, bidirectional):
    text = _hlo(op, "ring", bidirectional=bidirectional, chunks=2)
    assert "collective-permute" in text
    for collective in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all"):
        assert collective not in text


@pytest.mark.parametrize("op,collective", [(jo.ag_matmul, "all-gather"),
                                           (jo.matmul_rs, "reduce-scatter")], ids=["ag", "rs"])
def test_xla_impl_uses_the_collective(op, collective):
    text = _hlo(op, "xla")
    assert collective in text
    assert "collective-permute" not in text
