"""matmul_ar's kernel algorithms (docs/gpu-internals.md §7) through the CUDA executor on the
fake: the GEMM and ONE all-reduce kernel (``cpp/cuda/kernels/allreduce_body.h``, run per thread
by the fake with the PTX ordering rules of ``fake_allreduce.cc``), its sequence numbers on the
device.

What decides hangs and wrong results here: calls back to back on one clique (the device-side
halves and flags), a call captured into a CUDA graph and replayed with new inputs (a rank
launching late), one work queue per device, a missing peer (the kernel gives up, the watchdog
reports), and one deliberate misuse per rule (a release or a read before its barrier; a
host-side epoch baked into a graph).
"""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from jaxoverlap._config import timeout_ms

from .fake_cases import play, problem

pytestmark = pytest.mark.jax_independent

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# Unit roundoff: the kernel sums the N partials in float32 and rounds once; each partial was
# rounded once by the GEMM.
UNIT = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
KERNELS = ("one_shot_kernel", "two_shot_kernel")
TRANSPORTS = ("p2p", "multicast")


def _inputs(rng, n, rows, k, cols, dtype):
    np_dtype = DTYPES[dtype]
    xs = [rng.standard_normal((1, rows, k)).astype(np.float32).astype(np_dtype) for _ in range(n)]
    ws = [rng.standard_normal((k, cols)).astype(np.float32).astype(np_dtype) for _ in range(n)]
    return xs, ws


def _check(ys, xs, ws, dtype):
    """Every rank holds the float64 sum within the two roundings (partials, result) plus the
    float32 accumulation, and the same bits as every other rank."""
    x64 = [x[0].astype(np.float64) for x in xs]
    w64 = [w.astype(np.float64) for w in ws]
    ref = sum(x @ w for x, w in zip(x64, w64, strict=True))
    partials = sum(np.abs(x @ w) for x, w in zip(x64, w64, strict=True))
    k = xs[0].shape[-1]
    bound = (2 * UNIT[dtype] + k * 2.0**-24) * partials + 2 * UNIT[dtype] * np.abs(ref) + 1e-30
    for r, y in enumerate(ys):
        got = np.frombuffer(y, DTYPES[dtype]).reshape(ref.shape).astype(np.float64)
        assert np.all(np.abs(got - ref) <= bound), f"rank {r}: {np.max(np.abs(got - ref))}"
    assert all(y == ys[0] for y in ys), "the ranks' sums differ"


def _run(fake, transport, algorithm, n, *, rows=3, k=16, cols=24, dtype="float32", calls=1,
         seed=0, **kw):
    xs, ws = _inputs(np.random.default_rng(seed), n, rows, k, cols, dtype)
    out = play(fake, problem("matmul_ar", transport, n, batch=1, rows=rows, k=k, nw=cols,
                             dtype=dtype, algorithm=algorithm), xs, ws, calls=calls, **kw)
    return out, xs, ws


CASES = [  # (n, rows, cols, dtype): odd sizes give slices of unequal length and narrow accesses
    (2, 1, 24, "float32"),
    (3, 5, 24, "bfloat16"),
    (4, 3, 10, "float16"),
    (8, 2, 16, "bfloat16"),
    (8, 1, 7, "float32"),
]


@pytest.mark.parametrize("connections", [1, 8])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("algorithm", KERNELS)
def test_calls_back_to_back_match_float64(fake, algorithm, transport, connections):
    """Three calls in a row on one clique (the device-side halves alternate), each case's
    sizes as they come (16-, 4- or 2-byte accesses)."""
    for n, rows, cols, dtype in CASES:
        if transport == "multicast" and rows * cols % 2 and dtype != "float32":
            continue  # multimem moves element pairs (refused: test_multicast_refuses_odd)
        fake.reset(fake.Config(connections=connections, seed=n))
        out, xs, ws = _run(fake, transport, algorithm, n, rows=rows, cols=cols, dtype=dtype,
                           calls=3)
        assert out["statuses"] == [None] * n, out["statuses"]
        assert out["drained"] and fake.errors() == [], fake.errors()
        assert fake.counters()["AllReduce"] == 3 * n  # one kernel launch per call and rank
        _check(out["ys"], xs, ws, dtype)


@pytest.mark.parametrize("transport,algorithm", [  # first: the case that split y unevenly
    ("multicast", "two_shot_kernel"), ("p2p", "two_shot_kernel"),
    ("multicast", "one_shot_kernel"), ("p2p", "one_shot_kernel")])
def test_sizes_spread_over_every_block_match_float64(fake, algorithm, transport):
    """y long enough that every block of the grid has accesses, more than one each (4 ranks:
    10000 16-byte accesses over 32 blocks of 256 threads; 3 ranks: 3000, slices of 1000): the
    copy, the sum and the gather of an access are one block's, the only block whose flags
    order it (the fake reports a read of what another block stored or released)."""
    for n, rows, cols, dtype in [(4, 40, 1000, "float32"), (3, 24, 1000, "bfloat16")]:
        fake.reset(fake.Config(seed=n))
        out, xs, ws = _run(fake, transport, algorithm, n, rows=rows, cols=cols, dtype=dtype,
                           calls=2)
        assert out["statuses"] == [None] * n, out["statuses"]
        assert out["drained"] and fake.errors() == [], fake.errors()
        _check(out["ys"], xs, ws, dtype)


def test_multicast_refuses_odd_16_bit_lengths(fake):
    out, _, _ = _run(fake, "multicast", "one_shot_kernel", 2, rows=1, cols=7, dtype="bfloat16")
    assert all("moves whole 32-bit words" in s for s in out["statuses"]), out["statuses"]


def _replays(fake, transport, algorithm, n, replays, *, late_rank=-1, capture_any=False, seed=1):
    rng = np.random.default_rng(seed)
    rows, k, cols = 3, 16, 24
    xs, ws = _inputs(rng, n, rows, k, cols, "float32")
    replay_xs = [_inputs(rng, n, rows, k, cols, "float32")[0] for _ in range(replays)]
    out = play(fake, problem("matmul_ar", transport, n, batch=1, rows=rows, k=k, nw=cols,
                             algorithm=algorithm), xs, ws, calls=1, capture=True,
               replays=replays, replay_xs=[[x.tobytes() for x in r] for r in replay_xs],
               replay_late_rank=late_rank, capture_any=capture_any)
    return out, replay_xs, ws


@pytest.mark.parametrize("connections", [1, 8])
@pytest.mark.parametrize("transport,algorithm", list(itertools.product(TRANSPORTS, KERNELS)))
def test_a_captured_call_replayed_k_times_gives_k_right_answers(fake, transport, algorithm,
                                                                 connections):
    """As XLA does with a command buffer: one ordinary execution (the set-up), the call
    captured into a graph on every rank, then the graph launched four times with new inputs
    in the same buffers, rank 1's launch last, after the others ran as far as they could."""
    fake.reset(fake.Config(connections=connections))
    out, replay_xs, ws = _replays(fake, transport, algorithm, 4, 4, late_rank=1)
    assert out["statuses"] == [None] * 4, out["statuses"]
    assert out["replay_drained"] == [True] * 4 and fake.errors() == [], fake.errors()
    for ys, xs in zip(out["replay_ys"], replay_xs, strict=True):
        _check(ys, xs, ws, "float32")
    assert "captured into a graph" in fake.cliques()


def test_a_replayed_call_with_a_host_side_epoch_is_wrong(fake):
    """The misuse the device-side sequence numbers avoid: the multicast one-shot program of
    separate ops (host-side epochs in its flag values and its workspace half) recorded into a
    graph anyway. Its first replay is right; from the second on its waits are satisfied by
    the flags of the first (the epoch baked in) and rank 0 sums partials of an earlier call.
    The handler refuses to record it (without the test seam) — the same call as a kernel
    algorithm replays right (above)."""
    out, replay_xs, ws = _replays(fake, "multicast", "one_shot", 4, 3, late_rank=1,
                                  capture_any=True)
    assert out["statuses"] == [None] * 4
    _check(out["replay_ys"][0], replay_xs[0], ws, "float32")
    with pytest.raises(AssertionError, match="rank 0"):
        _check(out["replay_ys"][1], replay_xs[1], ws, "float32")
    fake.reset()
    out, _, _ = _replays(fake, "multicast", "one_shot", 4, 3)
    assert all("this program's host side would not replay" in s for s in out["statuses"])


def test_the_first_execution_under_capture_is_refused(fake):
    """The set-up allocates the kernel area, which a capture cannot hold: refused with a
    reason (XLA runs an executable once before it records it)."""
    xs, ws = _inputs(np.random.default_rng(0), 2, 3, 16, 24, "float32")
    out = play(fake, problem("matmul_ar", "p2p", 2, batch=1, rows=3, k=16, nw=24,
                             algorithm="one_shot_kernel"), xs, ws, calls=0, capture=True,
               replays=1)
    assert all("under CUDA-graph capture" in s for s in out["statuses"]), out["statuses"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("algorithm", KERNELS)
def test_a_gpu_that_would_jit_compile_the_kernel_refuses_it_on_every_rank(fake, algorithm,
                                                                          transport):
    """The kernel bounds its waits by %globaltimer, which the PTX ISA leaves unspecified in
    JIT-compiled code: on a GPU this build has no cubin of it for (sm_120: it would JIT-compile
    compute_90) every rank's set-up refuses the call, each call, with that reason and what to do
    instead, and nothing hangs (the same calls on 9.0 run: test_calls_back_to_back_...)."""
    fake.reset(fake.Config(cc_major=12, cc_minor=0))
    out, _, _ = _run(fake, transport, algorithm, 2, calls=2)
    for status in out["statuses"]:
        assert status is not None and "one-launch all-reduce kernel bounds its waits" in status \
            and "sm_120" in status and "impl='xla'" in status, out["statuses"]
    assert out["drained"] and fake.errors() == [], fake.errors()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_missing_peer_is_reported_by_the_watchdog(fake, transport):
    """Rank 2 never calls: every other rank's kernel gives up after the call's timeout on the
    GPU's clock (its waits are bounded), records why in its fault record, and the watchdog
    reports it and breaks the clique; the next call fails with that reason."""
    fake.reset(fake.Config(grace_ms=5000))
    out, _, _ = _run(fake, transport, "one_shot_kernel", 4, calls=2, timeout_ms=1000,
                     skip_rank=2)
    assert out["statuses"] == [None] * 4, out["statuses"]  # every call made (set up in time)
    assert out["drained"] and fake.errors() == [], fake.errors()
    warning = fake.last_warning()
    assert "one-launch all-reduce" in warning and "the flag from rank 2" in warning
    assert "did not reach this call within 1.0 s" in warning
    assert "BROKEN" in fake.cliques()


def test_a_slow_local_set_up_does_not_break_the_clique(fake):
    """The first rank to need the kernel area makes it while the other local ranks wait; its
    allocations and zero-fill wait for the GPUs, so on a loaded host it may take longer than a
    short JAXOVERLAP_TIMEOUT_S (here its zero-fill poll pauses 600 ms of real time; the timeout
    is 200 ms). The others wait for a local thread, not a peer: they must outlast it (the
    timeout + 2 s), not give up and break the clique. Rank 2 missing, every other rank then
    makes both calls and its kernel gives up on rank 2, as in the watchdog test above."""
    fake.reset(fake.Config(grace_ms=5000))
    out, _, _ = _run(fake, "p2p", "one_shot_kernel", 4, calls=2, timeout_ms=200, skip_rank=2,
                     setup_pause_ms=600)
    assert out["statuses"] == [None] * 4, out["statuses"]
    assert out["drained"] and fake.errors() == [], fake.errors()
    assert "the flag from rank 2 did not reach this call" in fake.last_warning()


@pytest.mark.parametrize("misuse,message", [
    ("release_early", "without making it visible"),
    ("read_early", "before acquiring that flag"),
])
@pytest.mark.parametrize("transport,algorithm", [("p2p", "one_shot_kernel"),
                                                 ("multicast", "two_shot_kernel")])
def test_the_fake_catches_a_kernel_that_breaks_the_ordering_rules(fake, misuse, message,
                                                                  transport, algorithm):
    """PTX ISA §8.9: data reaches a peer through a release after a bar.sync the stores precede,
    and is read after an acquire of its flag and a bar.sync. A thread that releases (or reads)
    before its block's barrier is reported; the same kernel run right is not (control)."""
    fake.reset(fake.Config(allreduce_misuse=misuse))
    out, _, _ = _run(fake, transport, algorithm, 4, calls=2)
    assert any(message in e for e in fake.errors()), fake.errors()
    fake.reset()
    out, xs, ws = _run(fake, transport, algorithm, 4, calls=2)
    assert fake.errors() == []
    _check(out["ys"], xs, ws, "float32")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_timeout_inf_waits_for_a_missing_peer_instead_of_giving_up(fake, transport):
    """JAXOVERLAP_TIMEOUT_S=inf reaches C++ as 2^62 ms (``_config.timeout_ms``), which in int64
    nanoseconds wraps to 0: the kernel's waits would give up at once. Saturated, they wait:
    rank 2 never calls, and after 3 s of the GPUs' clock (all the grace the fake gives) the
    other ranks' kernels still wait (the fake calls it a deadlock), none gave up, the clique
    is whole. With a finite timeout the same case gives up (test above). (The clique is set up
    by a call of every rank first, with a finite timeout.)"""
    fake.reset(fake.Config(grace_ms=3000))
    out, _, _ = _run(fake, transport, "two_shot_kernel", 4, clique_key=11)
    assert out["statuses"] == [None] * 4, out["statuses"]
    before = fake.last_warning()
    out, _, _ = _run(fake, transport, "two_shot_kernel", 4, clique_key=11,
                     timeout_ms=timeout_ms(float("inf")), skip_rank=2)
    assert fake.last_warning() == before, "a wait gave up: " + fake.last_warning()
    assert not out["drained"]
    assert fake.errors()[-1].startswith("deadlock") and "AllReduce" in fake.errors()[-1]
    assert "BROKEN" not in fake.cliques()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_rank_that_gave_up_makes_its_peers_give_up(fake, transport):
    """Rank 0 gives up at its first wait (the fake's "rank0_gives_up": stalled past its
    timeout) while ranks 1-3 are on time and pass their round-0 waits. Rank 0 then sends
    nothing on and releases its round-1 flags as "gave up": each peer's round-1 wait reads it,
    records why and gives up instead of gathering rank 0's garbage; the watchdog reports every
    rank (rank 0's timeout first, its peers' after)."""
    fake.reset(fake.Config(allreduce_misuse="rank0_gives_up"))
    out, _, _ = _run(fake, transport, "two_shot_kernel", 4, timeout_ms=60_000)
    assert out["statuses"] == [None] * 4, out["statuses"]
    assert out["drained"] and fake.errors() == [], fake.errors()
    warning = fake.last_warning()
    assert "one-launch all-reduce, rank 3" in warning, warning
    assert "rank 0 gave up (its flag says so" in warning, warning
    assert "BROKEN" in fake.cliques()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ranks_that_chose_different_access_widths_disagree(fake, transport):
    """Each rank picks its access width from its own y's address, and the width sets how y is
    split among the blocks. Rank 1's y 4 bytes into its allocation moves 4-byte accesses where
    the others move 16-byte ones: the width is in what the flags carry, so the ranks record
    that they disagree instead of reading what other blocks released (or other slot offsets).
    Control: every rank's y at that offset: one width, the right sum."""
    fake.reset()
    out, _, _ = _run(fake, transport, "two_shot_kernel", 4, timeout_ms=60_000,
                     y_offsets=[0, 4, 0, 0])
    assert out["drained"] and fake.errors() == [], fake.errors()
    assert "ranks disagree" in fake.last_warning(), fake.last_warning()
    assert "BROKEN" in fake.cliques()
    fake.reset()
    out, xs, ws = _run(fake, transport, "two_shot_kernel", 4, y_offsets=[4] * 4)
    assert out["statuses"] == [None] * 4 and fake.errors() == [], fake.errors()
    _check(out["ys"], xs, ws, "float32")
