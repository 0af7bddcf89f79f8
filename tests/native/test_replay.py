"""Replayable programs (core/program.h Problem::replayable): the fused all-gather over p2p built
so that every call enqueues the same work — flags of value 1 reset by their reader, one
workspace region, an acknowledgement from each reader to its writer — checked by the builder's
rules, by the whole-clique model over several calls, and run by the host executor as several
calls in flight at once (docs/gpu-internals.md §8)."""

import copy

import ml_dtypes
import numpy as np
import pytest
import testing_ext

from jaxoverlap._executors.runtime import load_host

from .schedule_check import ScheduleError, check_deadlock_free, check_race_free

pytestmark = pytest.mark.jax_independent

host = load_host()
testing = testing_ext.load()
BF16 = ml_dtypes.bfloat16
# Sizes the fused GEMM takes (k and the columns whole 16-byte rows of bfloat16).
ROWS, K, COLS = 6, 16, 8


def build(n, rank, *, chunks=1, bidirectional=False, replayable=True, **kw):
    args = dict(dtype="bfloat16", chunks=chunks, bidirectional=bidirectional, fused=True,
                replayable=replayable)
    args.update(kw)
    return host.build_program("ag_matmul", "p2p", n, rank, 1, ROWS, K, COLS, **args)


def clique(n, **kw):
    return [build(n, r, **kw) for r in range(n)]


def acks(program):
    """The ops on the acknowledgement flags (the last two)."""
    first = program["nranks"] * program["chunks"]
    return [o for o in program["ops"]
            if o["kind"] in ("Signal", "Wait", "ResetFlags") and o["id"] >= first]


CASES = [(n, chunks, bidir) for n in (2, 3, 4, 5) for chunks in (1, 2) for bidir in (False, True)]


@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("dtypes", ["bf16", "fp8"])
def test_replayable_is_the_program_plus_its_acknowledgement(dtypes, gathered):
    """The replayable program is the plain one with, at its end, each comm stream's Record,
    wait for its next rank's ack and reset of it, and the compute stream's join of them, reset
    of exactly the flags it waited on and acks to its writers; the plain program is unchanged."""
    kw = dict(return_gathered=gathered)
    if dtypes == "fp8":
        kw.update(dtype="float8_e4m3fn", w_dtype="float8_e4m3fn", out_dtype="bfloat16")
    for n, chunks, bidir in CASES:
        for r in range(n):
            plain = build(n, r, chunks=chunks, bidirectional=bidir, replayable=False, **kw)
            p = build(n, r, chunks=chunks, bidirectional=bidir, **kw)
            c, dirs = p["chunks"], [d for d in (0, 1) if p[("cw_steps", "ccw_steps")[d]]]
            assert p["num_flags"] == plain["num_flags"] + 2 == n * c + 2
            added = ("ResetFlags", "Record", "StreamWait")
            body = [o for o in p["ops"] if o["kind"] not in added and o not in acks(p)]
            # the same ops; its flags hold 1 where the plain program's hold the epoch
            assert [o["text"].replace(" = 1)", " = epoch)").replace(">= 1,", ">= epoch,")
                    for o in body] == [o["text"] for o in plain["ops"]]
            waited = sorted(f for f in range(n * c) if f // c != r)
            resets = [o for o in p["ops"] if o["kind"] == "ResetFlags"]
            reset = sorted(f for o in resets if o["stream"] == 0
                           for f in range(o["id"], o["id"] + o["n"]))
            assert reset == waited, (n, chunks, bidir, r)
            prev = {0: (r - 1) % n, 1: (r + 1) % n}
            nxt = {0: (r + 1) % n, 1: (r - 1) % n}
            ack = sorted((o["kind"], o["stream"], o["peer"], o["id"]) for o in acks(p))
            assert ack == sorted([("Wait", 1 + d, nxt[d], n * c + d) for d in dirs]
                                 + [("ResetFlags", 1 + d, -1, n * c + d) for d in dirs]
                                 + [("Signal", 0, prev[d], n * c + d) for d in dirs]), \
                (n, chunks, bidir, r)
            # Each comm stream ends with its ack's wait and reset; the compute stream with acks.
            for d in dirs:
                mine = [o["kind"] for o in p["ops"] if o["stream"] == 1 + d]
                assert mine[-3:] == ["Record", "Wait", "ResetFlags"]
            assert [o["kind"] for o in p["ops"] if o["stream"] == 0][-len(dirs):] == \
                ["Signal"] * len(dirs)


def test_the_program_text_says_what_the_flags_hold():
    """A replayable program's Signals write 1 and its waits wait for >= 1 (no epoch): its text
    says so; the plain program's says epoch."""
    p, plain = build(4, 1), build(4, 1, replayable=False)
    signals = [o["text"] for o in p["ops"] if o["kind"] in ("Signal", "Wait")]
    assert signals and all("epoch" not in t for t in signals), signals
    assert any(" = 1)" in t for t in signals) and any(">= 1," in t for t in signals), signals
    assert "epoch" not in p["text"].split("\n", 1)[1]
    assert all("epoch" in o["text"] for o in plain["ops"] if o["kind"] in ("Signal", "Wait"))


@pytest.mark.parametrize("bidir", [False, True])
def test_model_replays_several_calls_race_free(bidir):
    """The whole-clique model plays 3 calls of the same programs with one workspace region and
    flags of value 1: no signal finds its flag raised, no wait is satisfied by another call's
    signal, every read sees its own call's data."""
    for n, chunks in ((2, 1), (3, 2), (4, 1), (4, 2), (5, 2)):
        programs = clique(n, chunks=chunks, bidirectional=bidir, return_gathered=True)
        check_deadlock_free(programs)
        check_race_free(programs, calls=3)


@pytest.mark.parametrize("bidir", [False, True])
def test_model_catches_a_dropped_acknowledgement(bidir):
    """Without the ack, a writer runs into its next call while its reader still reads this one:
    the model finds the race (or the signal that finds its flag still raised)."""
    for n in (2, 3, 4):
        programs = clique(n, chunks=2, bidirectional=bidir)
        broken = copy.deepcopy(programs)
        for p in broken:
            p["ops"] = [o for o in p["ops"] if o not in acks(p)]
        check_deadlock_free(broken)  # one call alone still completes
        with pytest.raises(ScheduleError, match="race|still raised|satisfied by call"):
            check_race_free(broken, calls=3)


def test_builder_refuses_what_is_not_replayable_yet():
    for op, transport, fused in (("ag_matmul", "nccl", False), ("ag_matmul", "p2p", False),
                                 ("ag_matmul", "multicast", True), ("matmul_rs", "p2p", True)):
        with pytest.raises(ValueError, match="replayable program .* is built for ag_matmul over "
                                             "p2p with the fused GEMM only"):
            host.build_program(op, transport, 4, 0, 1, 8, 8, 8, dtype="bfloat16", fused=fused,
                               replayable=True)


def _check_fails(program, match):
    with pytest.raises(ValueError, match=match):
        host.check_program(program)


def test_check_program_rules():
    """Each sequencing rule of a replayable program (check_program.cc CheckReplayable), broken
    once: the check names it."""
    p = build(4, 1, chunks=2)
    host.check_program(p)
    ops = p["ops"]
    main_reset = next(o for o in ops if o["kind"] == "ResetFlags" and o["stream"] == 0)

    dropped = copy.deepcopy(p)
    dropped["ops"] = [o for o in ops if o not in acks(p)]
    _check_fails(dropped, "writes into rank 2 with no acknowledgement")

    early = copy.deepcopy(p)  # the reset before the fused GEMM that waits on those flags
    early["ops"].remove(main_reset)
    early["ops"].insert(0, main_reset)
    _check_fails(early, "not after its wait")

    unjoined = copy.deepcopy(p)  # no join of the comm streams: their forwarding waits race it
    unjoined["ops"] = [o for o in ops if o["kind"] != "StreamWait"]
    _check_fails(unjoined, "not after its wait Wait")

    twice = copy.deepcopy(p)
    twice["ops"].insert(twice["ops"].index(main_reset), main_reset)
    _check_fails(twice, "reset 2 times")

    never = copy.deepcopy(p)
    never["ops"] = [o for o in ops if o is not main_reset]
    _check_fails(never, "reset 0 times")

    own = copy.deepcopy(p)  # rank 1's own shard (flags 2, 3) never arrives: never waited on
    own["ops"] = [{**o, "n": o["n"] + 2} if o is main_reset else o for o in ops]
    _check_fails(own, "resets flag 2, which it never waited on")

    plain = build(4, 1, chunks=2, replayable=False)
    plain["ops"].append({**main_reset})
    _check_fails(plain, "only a replayable program resets flags")


def _replay(n, chunks, bidir, calls, *, gathered=False, slow_rank=-1, slow_ms=0, drop_ack=False,
            seed=0):
    rng = np.random.default_rng(seed)
    xs = [[rng.standard_normal((ROWS, K)).astype(BF16) for _ in range(n)] for _ in range(calls)]
    w = rng.standard_normal((K, COLS)).astype(BF16)
    problem = dict(op="ag_matmul", transport="p2p", nranks=n, batch=1, rows=ROWS, k=K, n=COLS,
                   dtype="bfloat16", chunks=chunks, bidirectional=bidir, fused=True,
                   replayable=True, return_gathered=gathered)
    out = testing.replay_host(problem, [[x.tobytes() for x in c] for c in xs], w.tobytes(),
                              slow_rank=slow_rank, slow_ms=slow_ms, drop_ack=drop_ack,
                              timeout_s=20.0)
    return xs, w, out


@pytest.mark.parametrize("bidir", [False, True])
def test_host_runs_the_same_program_call_after_call(bidir):
    """Every rank a thread running the SAME program 4 times in a row, at uneven paces (a few
    milliseconds' jitter, and one rank that reads late), so that neighbours are in different
    calls at once: each call's y (and gathered x) is its own inputs' product."""
    for n, chunks, slow in ((2, 1, -1), (3, 2, 1), (4, 1, 2), (4, 2, 0), (5, 2, 3)):
        xs, w, out = _replay(n, chunks, bidir, 4, gathered=True, slow_rank=slow, slow_ms=5,
                             seed=n)
        w64 = w.astype(np.float64)
        for c, x in enumerate(xs):
            gathered = np.concatenate(x)
            want = gathered.astype(np.float64) @ w64
            for r in range(n):
                assert out["errors"][c][r] == "", (n, chunks, c, r, out["errors"][c][r])
                y = np.frombuffer(out["y"][c][r], BF16).astype(np.float64).reshape(want.shape)
                np.testing.assert_allclose(y, want, rtol=2e-2, atol=2e-2,
                                           err_msg=f"n {n} chunks {chunks} call {c} rank {r}")
                g = np.frombuffer(out["gathered"][c][r], BF16).reshape(gathered.shape)
                assert np.array_equal(g.view(np.uint16), gathered.view(np.uint16))


def test_host_catches_a_writer_a_call_ahead():
    """The acknowledgement taken out (and the sequencing check skipped): a writer whose reader
    reads late runs into its next call and signals a flag its reader has not consumed — the
    host executor refuses that signal (the data under it would be the next call's)."""
    _, _, out = _replay(4, 1, False, 3, slow_rank=2, slow_ms=30, drop_ack=True)
    errors = [e for call in out["errors"] for e in call if e]
    assert any("which is still raised" in e and "missing acknowledgement" in e for e in errors)
    _, _, fine = _replay(4, 1, False, 3, slow_rank=2, slow_ms=30)
    assert all(e == "" for call in fine["errors"] for e in call)
