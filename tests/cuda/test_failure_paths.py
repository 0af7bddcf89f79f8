"""Failure paths that must not hang: a peer that never calls, with the process going on.

A rank that never makes its call leaves its peers' work waiting on their GPUs; the watchdog
(cpp/cuda/watchdog.h) must report it, release the GPUs and break the clique whatever else the
process does meanwhile: many calls queued behind the stuck one, a call that needs set-up (a new
cuBLASLt plan, more workspace) behind it, one work queue per device. Each test here failed on
the fake with the executor before the fix it names.
"""

from __future__ import annotations

import pytest

from .fake_cases import OPS, inputs, play, problem, spanning

pytestmark = pytest.mark.jax_independent


def _missing_peer(fake, op, transport, rows=4, chunks=2, set_up=True, **kwargs):
    """``op`` on 4 ranks where rank 2 never calls, after a call of every rank that set the clique
    up (``set_up``); the watchdog's timeout is 200 ms (on the fake's virtual clock, which moves
    only while the fake GPU cannot progress)."""
    p = problem(op, transport, 4, batch=1, rows=rows, k=8, nw=6, chunks=chunks)
    xs, ws = inputs(p)
    args = (p, xs, ws,
            [0, 1, 2, 3])
    if set_up:
        first = play(fake, *args, clique_key=kwargs["clique_key"], timeout_ms=200)
        assert first["statuses"] == [None] * 4 and fake.errors() == [], fake.errors()
    return play(fake, *args, skip_rank=2, timeout_ms=200, **kwargs)


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
    assert "not finished on GPU" in warning and "epoch 2:" in warning, warning


@pytest.mark.parametrize("op", ["matmul_rs", "ag_matmul"])
def test_a_set_up_behind_a_stuck_nccl_call_does_not_keep_the_communicators(fake, op):
    """Every rank's first call is stuck in NCCL (rank 2 never calls); the next call, of another
    call site, needs set-up (chunks 4 -> 1: larger GEMMs, new cuBLASLt plans and a larger
    warm-up buffer, which the first rank to reserve the epoch allocates for every rank:
    cudaMalloc waits for the device, i.e. for the stuck call). The watchdog aborts the
    communicators meanwhile, which lets the device drain and the set-up finish; the call then
    fails for the abort — or, for a rank waiting for that set-up, for its timeout (real time
    here: the fake's clock for the watchdog moves only while every rank's thread waits for the
    GPU). The communicators are leased only from just before the first enqueue: with the lease
    taken at the reservation, the abort waited for the set-up and the set-up for the abort."""
    fake.reset(fake.Config(grace_ms=10000))
    out = _missing_peer(fake, op, "nccl", rows=64, chunks=4, clique_key=41,
                        chunks_per_call=[4, 1])
    assert out["drained"], fake.errors()
    assert fake.errors() == []
    statuses = [s for r, s in enumerate(out["statuses"]) if r != 2]
    assert all(s and any(word in s for word in ("aborted", "broken", "timeout"))
               for s in statuses), statuses
    # Whichever came first: the watchdog's report of the stuck call, or a waiting rank's timeout
    # (which aborts the communicators too: CudaSite::Enqueue).
    assert ("inside NCCL" in fake.last_warning()
            or any("growing the ranks' pools" in s for s in statuses)), (fake.last_warning(),
                                                                        statuses)


@pytest.mark.parametrize("op", ["matmul_rs", "ag_matmul", "matmul_ar"])
def test_a_peer_missing_at_the_first_nccl_call_is_found_at_set_up(fake, op):
    """NCCL connects to its peers at set-up (a one-element send/receive per peer, awaited): a
    rank that never makes its first call is found there, after the call's timeout (real time
    here: 300 ms), as a timeout naming the connection; the communicators are aborted and the
    clique broken, nothing is enqueued and no host call waits for the device meanwhile."""
    fake.reset()
    p = problem(op, "nccl", 4, batch=1, rows=4, k=8, nw=6, chunks=2, bidirectional=True)
    xs, ws = inputs(p)
    out = play(fake, p, xs, ws, [0, 1, 2, 3], clique_key=42, skip_rank=2, timeout_ms=300)
    assert out["drained"] and fake.errors() == [], fake.errors()
    statuses = [s for r, s in enumerate(out["statuses"]) if r != 2]
    assert any(s and s.startswith("timeout") and "NCCL's connection to the peers" in s
               for s in statuses), statuses
    assert all(s and ("timeout" in s or "aborted" in s) for s in statuses), statuses
    assert fake.counters().get("ncclCommAbort", 0) > 0  # their groups on the GPU exit


@pytest.mark.parametrize("stuck", [True, False], ids=["stuck", "returns"])
def test_the_watchdog_reports_an_abort_that_does_not_return(fake, stuck):
    """ncclCommAbort frees device memory, which waits for the device's other work (NCCL issue
    #549): behind a wait nobody satisfies it does not return. Nobody waits for an abort (each
    runs on a thread of its own), so the watchdog says so once the timeout has passed on its
    clock, while it hangs; an abort that returns is not reported."""
    got = fake.stuck_abort(stuck=stuck)
    assert got["errors"] == [], got["errors"]
    if stuck:
        assert "stuck_abort clique: ncclCommAbort of rank 0 on GPU 0" in got["warning"], got
        assert "has not returned after 0.2 s" in got["warning"], got
    else:
        assert got["warning"] == "", got


@pytest.mark.slow  # waits for a 2 s creation timeout
def test_the_cliques_are_described_while_a_transport_connects(fake):
    """Process 1 never makes its first call, so process 0's NCCL communicators cannot be made
    (every rank must join) until the 2 s timeout. The connection runs without the clique's lock:
    meanwhile ``cliques()`` (info(), the selftest's report) describes the clique as connecting,
    instead of waiting for the lock until the timeout."""
    import threading


    spanning(fake, 43, [0, 1])
    xs, ws = inputs(problem("matmul_rs", "nccl", 2, batch=1, rows=4, k=8, nw=6))
    result = {}

    def run():
        result["out"] = play(fake, problem("matmul_rs", "nccl", 2, batch=1, rows=4, k=8, nw=6), xs,
                             ws, [0, 0], clique_key=43, skip_rank=1, timeout_ms=2000,
                             processes=[0, 1])

    runner = threading.Thread(target=run)
    runner.start()
    seen = []
    while runner.is_alive():
        described = fake.cliques()
        seen.append(described)
        if "connecting" in described:
            break
    runner.join()
    assert any("connecting" in d for d in seen), seen[-3:]
    status = result["out"]["statuses"][0]
    assert status and "NCCL communicator creation" in status, status


def _device_memory_after(fake, op, transport, rows_per_run):
    """Device allocations the executor holds (cudaMalloc - cudaFree: nccl and p2p make all of
    theirs so) after one run per entry of ``rows_per_run`` on one clique, the clique, and the
    allocations it still holds once dropped."""
    fake.reset()
    for rows in rows_per_run:
        p = problem(op, transport, 4, batch=1, rows=rows, k=8, nw=6, chunks=2)
        xs, ws = inputs(p)
        out = play(fake, p, xs, ws, [0, 1, 2, 3], clique_key=44)
        assert out["statuses"] == [None] * 4 and fake.errors() == [], (out["statuses"],
                                                                      fake.errors())
    counters = fake.counters()
    held = counters.get("cudaMalloc", 0) - counters.get("cudaFree", 0)
    described = fake.cliques()
    fake._reset_cliques()
    counters = fake.counters()
    return held, described, counters.get("cudaMalloc", 0) - counters.get("cudaFree", 0)


@pytest.mark.parametrize("transport", ["nccl", "p2p"])
def test_outgrown_buffers_are_freed_once_no_call_uses_them(fake, transport):
    """Calls on 4 rows per rank, then on 8 (more workspace and scratch: a new buffer generation,
    a larger scratch in each rank's pool), then on 8 again: by then every rank is past the first
    generation, so the third run's set-up frees it. A pool only grows (clique_state.h: an
    allocation or free waits for the peers that map the memory, so only the first rank to
    reserve an epoch makes them, for every rank): the outgrown scratch is kept, one per rank,
    and freed with the clique, like everything else. Before, a past generation lived until the
    next growth."""
    for op in OPS:
        grown, described, left = _device_memory_after(fake, op, transport, [4, 8, 8])
        alone, _, _ = _device_memory_after(fake, op, transport, [8, 8, 8])
        # at most the outgrown scratch of each rank (programs without scratch have none)
        assert grown - alone in (0, 4), (op, grown, alone, described)
        assert "(1 generation(s) live" in described, described
        assert left == 0, (op, left)


@pytest.mark.parametrize("finish", [True, False], ids=["finishes", "stays-late"])
def test_a_late_call_that_finishes_before_the_watchdog_fires(fake, finish):
    """Between the watchdog's pass finding a call late and its firing, the call can finish and the
    clique move past its generation (cpp/cuda/watchdog.cc, Fire). The watchdog looks again before
    it fires, and hands its generation reference back to the clique instead of dropping it: the
    last reference would free device memory on its thread, which waits for the device. The fake
    watchdog's fire hook finishes the call and drops the test's reference there."""
    out = fake.late_call(finish)
    assert out["errors"] == [], out
    if finish:
        assert out["warning"] == "" and out["broken"] == "", out
        assert out["gen_alive_after_watchdog"], out  # not freed on the watchdog's thread
    else:
        assert "late_call rank 0" in out["warning"] and "not finished" in out["broken"], out
    assert out["pending_after"] == 0, out
    assert out["gen_freed_with_clique"], out


def test_the_watchdog_makes_no_cuda_call_under_its_lock(fake):
    """Every handler's Watch takes the watchdog's lock; a CUDA query "may block" (CUDA driver
    API, "API synchronization behavior"). The watchdog's pass queries its calls' events without
    the lock: here its query blocks (the fake's seam) and a handler's Watch still returns. With
    the lock held across the query, Watch waited for it."""
    out = fake.watchdog_query_race()
    assert out["query_blocked"], out
    assert not out["watch_waited"], out
    assert out["errors"] == [], out


@pytest.mark.parametrize("connections", [1, 8])
def test_the_watchdog_reports_the_fused_gemms_fault(fake, connections):
    """A fused all-gather GEMM on two ranks whose peer (rank 1) never calls: rank 0's kernel
    waits for the peer's flags inside the kernel (nothing else of its call waits). The watchdog
    reports the call after its timeout and writes the flags from a stream of its own; with one
    work queue that write is held up behind the call's next task, which waits for the kernel, so
    the kernel's own bound (twice the timeout, plus a second) ends the wait: it records the flag
    in its fault record and finishes, its results garbage. The watchdog reads the record once
    the call is done and says so, naming the flag and the rank. With eight queues the write
    releases the kernel: no fault to report."""
    fake.reset(fake.Config(grace_ms=10000, connections=connections))
    p = problem("ag_matmul", "p2p", 2, batch=1, rows=16, k=16, nw=8, dtype="bfloat16",
                fused=True)
    xs, ws = inputs(p)
    first = play(fake, p, xs, ws, clique_key=45, timeout_ms=200)
    assert first["statuses"] == [None] * 2 and fake.errors() == [], fake.errors()
    out = play(fake, p, xs, ws, clique_key=45, skip_rank=1, timeout_ms=200)
    assert out["drained"] and fake.errors() == [], fake.errors()
    warning = fake.last_warning()
    if connections == 1:
        assert "the fused GEMM gave up waiting for flag" in warning, warning
        assert "from rank 1" in warning and "expected epoch 2" in warning, warning
    else:
        assert "gave up" not in warning and "not finished on GPU" in warning, warning
