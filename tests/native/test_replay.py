"""Replayable programs (core/program.h Problem::replayable): every p2p program of ag_matmul and
matmul_rs (chunked and fused) built so that every call enqueues the same work — flags of value 1
reset by their reader, one workspace region, an acknowledgement from each reader to each of its
writers (core/build_internal.h Acknowledge) — checked by the builder's rules, by the whole-clique
model over several calls, and run by the host executor as several calls in flight at once
(docs/gpu-internals.md §8)."""

import copy
import re

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


def build(n, rank, *, chunks=1, bidirectional=False, replayable=True, op="ag_matmul", fused=True,
          transport="p2p", **kw):
    op, _, algorithm = op.partition("/")  # matmul_ar/one_shot: its algorithm
    args = dict(dtype="bfloat16", chunks=chunks, bidirectional=bidirectional, fused=fused,
                replayable=replayable, algorithm=algorithm or "two_shot")
    args.update(kw)
    return host.build_program(op, transport, n, rank, 1, ROWS, K, COLS, **args)


def clique(n, **kw):
    return [build(n, r, **kw) for r in range(n)]


def first_ack(program):
    """The first acknowledgement flag: the program's last nranks flags are them."""
    return program["num_flags"] - program["nranks"]


def acks(program):
    """The ops on the acknowledgement flags."""
    first = first_ack(program)
    return [o for o in program["ops"]
            if o["kind"] in ("Signal", "Wait", "ResetFlags") and o["id"] >= first]


# Every replayable program: (op[/algorithm], transport, fused).
PROGRAMS = [(op, transport, fused) for transport in ("p2p", "multicast")
            for op, fused in (("ag_matmul", True), ("ag_matmul", False), ("matmul_rs", False),
                              ("matmul_rs", True), ("matmul_ar/two_shot", False),
                              ("matmul_ar/one_shot", False))]
IDS = [f"{op}-{transport}-{'fused' if fused else 'chunked'}" for op, transport, fused in PROGRAMS]


def _writes(program):
    """{stream: the peers it writes into (a push into a peer's workspace, a Signal, a multicast
    store: every rank's)}."""
    out = {}
    for o in program["ops"]:
        peers = []
        if o["kind"] == "Signal" and o["id"] < first_ack(program):
            peers = [o["peer"]]
        elif o["kind"] == "Copy" and o["d"]["buf"].startswith("WORKSPACE"):
            peers = [o["d"]["rank"]]
        elif o["kind"] == "McStore":
            peers = range(program["nranks"])
        for peer in peers:
            if peer != program["rank"]:
                out.setdefault(o["stream"], set()).add(peer)
    return out


def _waited(program):
    """(flags, writers) this rank waits on: Waits and the fused GEMM's block waits."""
    flags, writers = set(), set()
    for o in program["ops"]:
        if o["kind"] == "Wait" and o["id"] < first_ack(program):
            flags.add(o["id"])
            writers.add(o["peer"])
        if o["kind"] == "FusedGemm" and o["fused"]["wait_flags"] >= 0:
            f = o["fused"]
            for b, w in enumerate(f["writers"]):
                if b // f["chunks"] != f["ready_shard"]:
                    flags.add(f["wait_flags"] + b)
                    writers.add(w)
    return flags, writers - {program["rank"]}


@pytest.mark.parametrize("op, transport, fused", PROGRAMS, ids=IDS)
def test_the_acknowledgement_is_one_per_writer_and_reader(op, transport, fused):
    """Each program ends the same way (Acknowledge): the compute stream joins the other
    streams, resets exactly the flags the rank waited on and acknowledges each rank it waited
    on (flag first_ack + own rank on that writer); each peer the rank wrote into has its
    acknowledgement waited for and reset once, on a stream that wrote into it, at that stream's
    end; and a rank's acknowledgements go exactly to the ranks that wrote into it."""
    for n, chunks, bidir in [(n, c, b) for n in (2, 3, 4, 5) for c in (1, 2)
                             for b in (False, True)]:
        programs = clique(n, op=op, transport=transport, fused=fused, chunks=chunks,
                          bidirectional=bidir)
        for r, p in enumerate(programs):
            case = (n, chunks, bidir, r)
            first = first_ack(p)
            flags, writers = _waited(p)
            resets = [o for o in p["ops"] if o["kind"] == "ResetFlags" and o["stream"] == 0
                      and o["id"] < first]
            assert sorted(f for o in resets for f in range(o["id"], o["id"] + o["n"])) == \
                sorted(flags), case
            signals = sorted(o["peer"] for o in acks(p) if o["kind"] == "Signal")
            assert signals == sorted(writers), case
            assert all(o["stream"] == 0 and o["id"] == first + r
                       for o in acks(p) if o["kind"] == "Signal"), case
            writes = _writes(p)
            waits = [o for o in acks(p) if o["kind"] == "Wait"]
            assert sorted(o["peer"] for o in waits) == sorted(set().union(*writes.values())), case
            for o in waits:
                assert o["id"] == first + o["peer"] and o["peer"] in writes[o["stream"]], case
                mine = [x for x in p["ops"] if x["stream"] == o["stream"]]
                assert all(x["kind"] in ("Wait", "ResetFlags")
                           for x in mine[mine.index(o):]), case
            # symmetric: r acknowledges w exactly when w writes into r
            for w, q in enumerate(programs):
                assert (w in writers) == (r in set().union(*_writes(q).values())), (case, w)


@pytest.mark.parametrize("op, transport, fused", PROGRAMS[1:], ids=IDS[1:])
def test_the_body_is_the_plain_program(op, transport, fused):
    """But for the fused all-gather, the replayable program is the plain one (its flags hold 1
    where the plain one's hold the epoch) followed by its acknowledgement."""
    for n, chunks, bidir in ((2, 1, False), (3, 2, True), (4, 2, False), (5, 1, True)):
        for r in range(n):
            kw = dict(op=op, transport=transport, fused=fused, chunks=chunks,
                      bidirectional=bidir)
            plain = build(n, r, replayable=False, **kw)
            p = build(n, r, **kw)
            body = [o["text"].replace(" = 1)", " = epoch)").replace(">= 1,", ">= epoch,")
                    for o in p["ops"][:len(plain["ops"])]]
            assert body == [o["text"] for o in plain["ops"]], (n, chunks, bidir, r)
            assert p["num_flags"] == plain["num_flags"] + n


CASES = [(n, chunks, bidir) for n in (2, 3, 4, 5) for chunks in (1, 2) for bidir in (False, True)]


@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("dtypes", ["bf16", "fp8"])
def test_the_fused_all_gather_pushes_its_own_shard_to_every_peer(dtypes, gathered):
    """The replayable fused all-gather forwards nothing: each comm stream, before its
    acknowledgement tail, only copies the rank's own shard (and its scale) from x into peers'
    workspaces, the nearest first, and raises their flags — no wait. Each rank still receives
    the shards in the ring's arrival order (the fused GEMM's block order is the plain
    program's), each block waiting for its shard's owner."""
    kw = dict(return_gathered=gathered)
    if dtypes == "fp8":
        kw.update(dtype="float8_e4m3fn", w_dtype="float8_e4m3fn", out_dtype="bfloat16")
    for n, chunks, bidir in CASES:
        for r in range(n):
            case = (n, chunks, bidir, r)
            plain = build(n, r, chunks=chunks, bidirectional=bidir, replayable=False, **kw)
            p = build(n, r, chunks=chunks, bidirectional=bidir, **kw)
            assert p["num_flags"] == plain["num_flags"] + n == n * p["chunks"] + n
            tail = set(map(id, acks(p)))
            pushed = {}
            for o in p["ops"]:
                if o["stream"] == 0 or id(o) in tail or o["kind"] in ("Record", "StreamWait"):
                    continue
                assert o["kind"] in ("Copy", "Signal"), (case, o["text"])
                if o["kind"] == "Copy":
                    assert o["a"]["buf"] in ("X", "XSCALE") and o["shard"] == r, (case, o["text"])
                    pushed.setdefault(o["stream"], []).append(o["d"]["rank"])
            cw, ccw = p["cw_steps"], p["ccw_steps"]
            want = {1: [(r + 1 + t) % n for t in range(cw)]}
            if ccw:
                want[2] = [(r - 1 - t) % n for t in range(ccw)]
            assert {s: list(dict.fromkeys(d)) for s, d in pushed.items()} == want, case
            (fused,) = [o["fused"] for o in p["ops"] if o["kind"] == "FusedGemm"]
            (plain_fused,) = [o["fused"] for o in plain["ops"] if o["kind"] == "FusedGemm"]
            assert fused["sequence"] == plain_fused["sequence"], case
            c = p["chunks"]
            assert all(w == (-1 if b // c == r else b // c)
                       for b, w in enumerate(fused["writers"])), case


def test_the_program_text_says_what_the_flags_hold():
    """A replayable program's Signals write 1 and its waits wait for >= 1 (no epoch): its text
    says so; the plain program's says epoch."""
    p, plain = build(4, 1), build(4, 1, replayable=False)
    signals = [o["text"] for o in p["ops"] if o["kind"] in ("Signal", "Wait")]
    assert signals and all("epoch" not in t for t in signals), signals
    assert any(" = 1)" in t for t in signals) and any(">= 1," in t for t in signals), signals
    assert "epoch" not in p["text"].split("\n", 1)[1]
    assert all("epoch" in o["text"] for o in plain["ops"] if o["kind"] in ("Signal", "Wait"))


@pytest.mark.parametrize("op, transport, fused", PROGRAMS, ids=IDS)
def test_model_replays_several_calls_race_free(op, transport, fused):
    """The whole-clique model plays 3 calls of the same programs with one workspace region and
    flags of value 1: no signal finds its flag raised, no wait is satisfied by another call's
    signal, every read sees its own call's data; N 2, 3, 5, both directions."""
    for n, chunks in ((2, 1), (3, 2), (5, 2)):
        for bidir in (False, True):
            programs = clique(n, op=op, transport=transport, fused=fused, chunks=chunks,
                              bidirectional=bidir, return_gathered=op == "ag_matmul")
            check_deadlock_free(programs)
            check_race_free(programs, calls=3)


@pytest.mark.parametrize("op, transport, fused", PROGRAMS, ids=IDS)
def test_model_catches_a_dropped_acknowledgement(op, transport, fused):
    """Without the acks, a writer runs into its next call while its reader still reads this one:
    the model finds the race (or the signal that finds its flag still raised). Except in
    matmul_ar's two-shot ring over p2p both ways at N 3 and 4, where the model finds nothing
    without them: its data accesses are ordered by the program's own flags, and the model
    checks flag reuse in the one schedule it plays, not in every interleaving (pinned: the
    acknowledgement is kept there too, for the one argument)."""
    unfound = set()
    for n in (2, 3, 4):
        for bidir in (False, True):
            programs = clique(n, op=op, transport=transport, fused=fused, chunks=2,
                              bidirectional=bidir)
            broken = copy.deepcopy(programs)
            for p in broken:
                p["ops"] = [o for o in p["ops"] if o not in acks(p)]
            check_deadlock_free(broken)  # one call alone still completes
            try:
                check_race_free(broken, calls=3)
                unfound.add((n, bidir))
            except ScheduleError as e:
                assert re.search("race|still raised|satisfied by call", str(e)), e
    pinned = {(3, True), (4, True)} if (op, transport) == ("matmul_ar/two_shot", "p2p") else set()
    assert unfound == pinned


def test_builder_refuses_what_is_not_replayable_yet():
    for op, transport, algorithm in (("ag_matmul", "nccl", "two_shot"),
                                     ("matmul_rs", "nccl", "two_shot"),
                                     ("matmul_ar", "nccl", "one_shot"),
                                     ("matmul_ar", "p2p", "one_shot_kernel"),
                                     ("matmul_ar", "multicast", "two_shot_kernel")):
        with pytest.raises(ValueError, match="replayable program .* is built over p2p and "
                                             "multicast only, and not for the kernel algorithms"):
            host.build_program(op, transport, 4, 0, 1, 8, 8, 8, dtype="bfloat16",
                               algorithm=algorithm, replayable=True)


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

    ring = build(4, 1, chunks=2, fused=False)  # the chunked ring forwards on its comm streams
    unjoined = copy.deepcopy(ring)  # no join of the comm streams: their forwarding waits race it
    unjoined["ops"] = [o for o in ring["ops"] if o["kind"] != "StreamWait"]
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


def test_check_program_rules_of_the_other_programs():
    """The rules the other programs brought, each broken once: a wait for an own flag that no
    fused GEMM releases (rule 1); an acknowledgement waited for on a stream that another stream
    wrote into the same peer before, without joining it (rule 3); with a fused GEMM that waits,
    a wait for a peer's flag that does not end its stream (rule 4: its bounded wait kernel could
    wait for an SM the GEMM holds)."""
    ring = build(4, 1, op="matmul_rs", fused=False)
    host.check_program(ring)
    own = copy.deepcopy(ring)
    wait = next(o for o in own["ops"] if o["kind"] == "Wait")
    wait["peer"] = 1
    _check_fails(own, "waits for an own flag that no fused GEMM of the rank releases")

    rs = build(4, 1, op="matmul_rs", fused=True, chunks=2)
    host.check_program(rs)
    # the stream that waits for a peer's acknowledgement joins the other stream that wrote
    # into that peer first; without that join the other stream's pushes are unacknowledged
    joins = [o for o in rs["ops"] if o["kind"] == "StreamWait" and o["stream"] != 0]
    assert joins
    unjoined = copy.deepcopy(rs)
    unjoined["ops"] = [o for o in rs["ops"] if o not in joins]
    _check_fails(unjoined, "with no acknowledgement")

    ag = build(4, 1, chunks=2)
    (ack_wait,) = [o for o in acks(ag) if o["kind"] == "Wait" and o["stream"] == 1][:1]
    early = copy.deepcopy(ag)  # stream 1's first acknowledgement wait before its last push
    early["ops"].remove(ack_wait)
    last_push = max(i for i, o in enumerate(early["ops"])
                    if o["stream"] == 1 and o["kind"] == "Copy")
    early["ops"].insert(last_push, ack_wait)
    _check_fails(early, "a wait for a peer's flag must end its stream")


def test_check_program_rules_of_the_multicast_reduction():
    """Rule 5, each side broken once: a McReduce (it reads every rank's workspace) with its
    acknowledgements to the peers taken out; a write of the rank's own workspace, which the
    peers' McReduce reads, moved after its acknowledgement waits."""
    p = build(4, 1, op="matmul_rs", transport="multicast", fused=False)
    host.check_program(p)
    unacked = copy.deepcopy(p)
    unacked["ops"] = [o for o in p["ops"] if not (o in acks(p) and o["kind"] == "Signal")]
    _check_fails(unacked, "reads rank 0's workspace with no Signal to that rank after it")
    late = copy.deepcopy(p)
    gemm = [o for o in late["ops"] if o["kind"] == "Gemm"][-1]
    late["ops"].remove(gemm)
    late["ops"].append(gemm)
    _check_fails(late, "writes this rank's workspace, which its peers' McReduce reads, with no "
                       "wait for rank 0's flag after it")


def _replay(n, chunks, bidir, calls, *, op="ag_matmul", transport="p2p", fused=True,
            gathered=False, slow_rank=-1, slow_ms=0, drop_ack=False, seed=0):
    rng = np.random.default_rng(seed)
    op, _, algorithm = op.partition("/")
    x_rows = ROWS if op == "ag_matmul" or algorithm == "one_shot" else n * ROWS
    xs = [[rng.standard_normal((x_rows, K)).astype(BF16) for _ in range(n)]
          for _ in range(calls)]
    w = rng.standard_normal((K, COLS)).astype(BF16)
    problem = dict(op=op, transport=transport, nranks=n, batch=1, rows=ROWS, k=K, n=COLS,
                   dtype="bfloat16", chunks=chunks, bidirectional=bidir, fused=fused,
                   replayable=True, return_gathered=gathered,
                   algorithm=algorithm or "two_shot")
    out = testing.replay_host(problem, [[x.tobytes() for x in c] for c in xs], w.tobytes(),
                              slow_rank=slow_rank, slow_ms=slow_ms, drop_ack=drop_ack,
                              timeout_s=20.0)
    return xs, w, out


def _want(op, x, w64, r):
    """Rank r's y from the call's xs, in float64 (numpy, not the code under test)."""
    if op == "ag_matmul":
        return np.concatenate(x).astype(np.float64) @ w64
    if op.startswith("matmul_ar"):  # all of the sum
        return sum(xi.astype(np.float64) for xi in x) @ w64
    return sum(xi.astype(np.float64)[r * ROWS:(r + 1) * ROWS] for xi in x) @ w64


@pytest.mark.parametrize("bidir", [False, True])
@pytest.mark.parametrize("op, transport, fused", PROGRAMS, ids=IDS)
def test_host_runs_the_same_program_call_after_call(op, transport, fused, bidir):
    """Every rank a thread running the SAME program 4 times in a row, at uneven paces (a few
    milliseconds' jitter, and one rank that reads late), so that neighbours are in different
    calls at once: each call's y (and gathered x) is its own inputs' product."""
    gathered = op == "ag_matmul"
    for n, chunks, slow in ((2, 1, -1), (3, 2, 1), (4, 1, 2), (4, 2, 0), (5, 2, 3)):
        xs, w, out = _replay(n, chunks, bidir, 4, op=op, transport=transport, fused=fused,
                             gathered=gathered, slow_rank=slow, slow_ms=5, seed=n)
        w64 = w.astype(np.float64)
        for c, x in enumerate(xs):
            for r in range(n):
                assert out["errors"][c][r] == "", (n, chunks, c, r, out["errors"][c][r])
                want = _want(op, x, w64, r)
                y = np.frombuffer(out["y"][c][r], BF16).astype(np.float64).reshape(want.shape)
                # bf16 partials rounded at each ring step: a few ulps of the largest output
                np.testing.assert_allclose(y, want, rtol=2e-2, atol=1.5e-2 * np.abs(want).max(),
                                           err_msg=f"n {n} chunks {chunks} call {c} rank {r}")
                if gathered:
                    g = np.frombuffer(out["gathered"][c][r], BF16).reshape(-1, K)
                    assert np.array_equal(g.view(np.uint16), np.concatenate(x).view(np.uint16))


@pytest.mark.parametrize("op, transport, fused", PROGRAMS, ids=IDS)
def test_host_catches_a_writer_a_call_ahead(op, transport, fused):
    """The acknowledgement taken out (and the sequencing check skipped): a writer whose reader
    reads late runs into its next call and signals a flag its reader has not consumed — the
    host executor refuses that signal (the data under it would be the next call's). Whether a
    writer gets a call ahead in one run is the threads' timing (a run where none does ends with
    no error: the dropped acknowledgement did no harm there), so the runs repeat, each with the
    same late rank, until one does; every run that errs must err with the refusal."""
    caught = False
    for _attempt in range(10):
        _, _, out = _replay(4, 1, False, 3, op=op, transport=transport, fused=fused,
                            slow_rank=2, slow_ms=30, drop_ack=True)
        errors = [e for call in out["errors"] for e in call if e]
        if errors:
            assert any("which is still raised" in e and "missing acknowledgement" in e
                       for e in errors), errors
            caught = True
            break
    assert caught, "in 10 runs no writer ran a call ahead of its late reader"
    _, _, fine = _replay(4, 1, False, 3, op=op, transport=transport, fused=fused, slow_rank=2,
                         slow_ms=30)
    assert all(e == "" for call in fine["errors"] for e in call)
