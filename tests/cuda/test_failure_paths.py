"""Failure paths that must not hang: a peer that never calls, with the process going on.

A rank that never makes its call leaves its peers' work waiting on their GPUs; the watchdog
(cpp/cuda/watchdog.h) must report it, release the GPUs and break the clique whatever else the
process does meanwhile: many calls queued behind the stuck one, a call that needs set-up (a new
cuBLASLt plan, more workspace) behind it, one work queue per device. Each test here failed on
the fake with the executor before the fix it names.
"""

from __future__ import annotations

import pytest

from .test_fake import _inputs

pytestmark = pytest.mark.jax_independent


def _missing_peer(fake, op, transport, **kwargs):
    """``op`` on 4 ranks where rank 2 never calls; the watchdog's timeout is 200 ms (on the fake's
    virtual clock, which moves only while the fake GPU cannot progress)."""
    xs, ws = _inputs(op, 4, 1, 4, 8, 6, "float32")
    return fake.run(op, transport, 4, 1, 4, 8, 6, "float32", kwargs.pop("chunks", 2), False,
                    False, [x.tobytes() for x in xs], [w.tobytes() for w in ws], [0, 1, 2, 3],
                    skip_rank=2, timeout_ms=200, **kwargs)


@pytest.mark.parametrize("transport", ["nccl", "p2p"])
def test_the_watchdog_fires_with_many_calls_queued_behind_a_stuck_one(fake, transport):
    """The host runs 40 calls ahead of a call stuck for a missing peer. Each call has events of
    its own (clique_state.h CallEvents): with 32 reused slots, the stuck call stopped being
    watched once its slot was re-recorded, and the calls behind it never started their clock —
    no warning, a GPU that never drains."""
    fake.reset(fake.Config(grace_ms=10000))
    out = _missing_peer(fake, "matmul_rs", transport, clique_key=40, calls=40)
    assert out["drained"], fake.errors()
    assert fake.errors() == []
    warning = fake.last_warning()
    assert "not finished on GPU" in warning and "epoch 1:" in warning, warning
