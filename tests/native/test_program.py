"""The program builders, read through the bindings: order, offsets, bytes, deadlock freedom.

A property that must hold for every problem of a grid is one test looping over the grid (the
builders take microseconds); a failure names its case (``case``).
"""

import contextlib
import copy
import itertools

import pytest
import testing_ext

from jaxoverlap import _kinds
from jaxoverlap._executors.runtime import load_host

from . import schedule_check
from .schedule_check import (
    ScheduleError,
    buffer_sizes,
    check_bounds,
    check_deadlock_free,
    check_dtypes,
    check_race_free,
    fused_blocks,
)

# The builders and checkers run no JAX.
pytestmark = pytest.mark.jax_independent

host = load_host()
TRANSPORTS = _kinds.names(_kinds.TRANSPORTS)
OPS = ("ag_matmul", "matmul_rs")
# GEMM + all-reduce: two-shot (the RS ring, then an AG ring of Y's blocks; multicast: each
# block reduced in the switch) and one-shot ("op/algorithm": every partial to every rank)
ONE_SHOT = "matmul_ar/one_shot"
ALL_OPS = (*OPS, "matmul_ar", ONE_SHOT)
# The dtypes of a call (build's keywords): all float32, or fp8 operands with a bfloat16 output
# (x's shards and their scales travel in an all-gather; partial sums in bfloat16 elsewhere).
F32 = {}
FP8 = dict(dtype="float8_e4m3fn", w_dtype="float8_e5m2", out_dtype="bfloat16")


# Block scales (MXFP8): fp8 x and w with e8m0 scales, one per 32 elements of k.
MX = dict(dtype="float8_e4m3fn", w_dtype="float8_e4m3fn", out_dtype="bfloat16",
          block_scaled=True)


def build(op, transport, n, rank, *, batch=2, rows=6, k=5, n_out=3, dtype="float32", chunks=1,
          bidirectional=False, return_gathered=False, w_dtype="", out_dtype="",
          block_scaled=False):
    op, _, algorithm = op.partition("/")
    return host.build_program(op, transport, n, rank, batch, rows, k, n_out, dtype, chunks,
                              bidirectional, return_gathered, algorithm=algorithm or "two_shot",
                              w_dtype=w_dtype, out_dtype=out_dtype, block_scaled=block_scaled)


def clique(op, transport, n, **kw):
    return [build(op, transport, n, r, **kw) for r in range(n)]


@contextlib.contextmanager
def case(*values):
    """Adds the grid case to the failure of the assertion or error raised in its body."""
    try:
        yield
    except Exception as e:
        e.add_note(f"in the case {values}")
        raise


def grid(*axes):
    """Every combination of the axes' values (itertools.product)."""
    return itertools.product(*axes)


def gemm_chunks(program):
    return [(op["shard"], op["sub"]) for op in program["ops"] if op["kind"] == "Gemm"]


# ---- chunk order ---------------------------------------------------------------------------

def test_ag_ring_order_local_first_then_ring():
    for transport, n in grid(["nccl", "p2p"], [1, 2, 4, 5, 8]):
        for r in range(n):
            with case(transport, n, r):
                order = [c for c, _ in gemm_chunks(build("ag_matmul", transport, n, r))]
                assert order == [(r - t) % n for t in range(n)]


def test_ag_bidirectional_order_interleaves_directions():
    for n in [2, 3, 4, 5, 8]:
        for r in range(n):
            with case(n, r):
                p = build("ag_matmul", "p2p", n, r, bidirectional=True)
                cw, ccw = p["cw_steps"], p["ccw_steps"]
                assert (cw, ccw) == ((n - 1 + 1) // 2, (n - 1) // 2)
                want = [r]
                for t in range(cw):
                    want.append((r - 1 - t) % n)
                    if t < ccw:
                        want.append((r + 1 + t) % n)
                assert [c for c, _ in gemm_chunks(p)] == want
                assert sorted(want) == list(range(n))  # every shard exactly once


def test_rs_ring_order():
    for transport, n in grid(["nccl", "p2p"], [2, 4, 8]):
        for r in range(n):
            with case(transport, n, r):
                order = [c for c, _ in gemm_chunks(build("matmul_rs", transport, n, r))]
                assert order == [(r - t - 1) % n for t in range(n)]  # own block r last


def test_sub_chunks_in_order_and_uneven():
    p = build("ag_matmul", "p2p", 4, 1, rows=7, chunks=3)
    gemms = [op for op in p["ops"] if op["kind"] == "Gemm"]
    assert [(g["shard"], g["sub"]) for g in gemms[:3]] == [(1, 0), (1, 1), (1, 2)]
    assert [g["m"] for g in gemms[:3]] == [2, 2, 3]  # 7 rows split as evenly as possible
    assert build("ag_matmul", "p2p", 4, 1, rows=2, chunks=5)["chunks"] == 2  # clamped to rows


# ---- offsets: every output row written exactly once, from the right input rows -------------

def _rows_written(program, buf, row_width, total_rows):
    """Multiset of (batch, row) written into `buf` by Gemm/McReduce ops."""
    rows = []
    for op in program["ops"]:
        if op["kind"] in ("Gemm", "McReduce") and op["d"]["buf"] == buf:
            d = op["d"]
            assert d["offset"] % row_width == 0 and d["ld"] == row_width
            assert d["batch_stride"] == total_rows * row_width
            for b in range(op["batch"]):
                rows += [(b, d["offset"] // row_width + i) for i in range(op["m"])]
    return rows


def _check_rows_written(op, transport, n, chunks, bidir, r):
    batch, rows, k, n_out = 2, 6, 5, 3
    p = build(op, transport, n, r, batch=batch, rows=rows, k=k, n_out=n_out, chunks=chunks,
              bidirectional=bidir)
    total_rows = rows * n if op == "ag_matmul" else rows
    written = sorted(_rows_written(p, "Y", n_out, total_rows))
    assert written == [(b, i) for b in range(batch) for i in range(total_rows)]
    for g in (o for o in p["ops"] if o["kind"] == "Gemm" and o["d"]["buf"] == "Y"):
        # The GEMM reads the same row block of (gathered or full) x that it writes.
        a, d = g["a"], g["d"]
        a_row = (a["offset"] % (a["batch_stride"] or 1)) // k
        d_row = (d["offset"] % d["batch_stride"]) // n_out
        if op == "ag_matmul":
            if a["buf"] == "X":
                a_row += r * rows  # the local shard is row block r of the gathered x
            assert a_row == d_row
        else:
            assert a_row == r * rows + d_row


def test_output_rows_written_once():
    for op, transport, n, chunks, bidir in grid(OPS, TRANSPORTS, [1, 3, 4], [1, 4],
                                                [False, True]):
        for r in range(n):
            with case(op, transport, n, chunks, bidir, r):
                _check_rows_written(op, transport, n, chunks, bidir, r)


# ---- byte accounting -----------------------------------------------------------------------

def test_ring_sends_exactly_n_minus_1_over_n():
    """N-1 of N shards (AG) or partial blocks (RS) leave each rank, in their dtype: an fp8 x
    moves one byte per element, each shard with its 4-byte scale; fp8 partial sums move in the
    output type (bfloat16)."""
    batch, rows, k, n_out = 2, 6, 5, 3
    for op, transport, n, chunks, bidir, dtypes in grid(
            OPS, ["nccl", "p2p"], [2, 3, 4, 8], [1, 3], [False, True],
            [F32, dict(dtype="bfloat16"), FP8]):
        fp8 = dtypes is FP8
        elem = {"float32": 4, "bfloat16": 2}.get(dtypes.get("dtype", "float32"), 1)
        if op != "ag_matmul" and fp8:
            elem = 2  # partial sums in the output type
        width = k if op == "ag_matmul" else n_out
        gathered_bytes = batch * n * rows * width * elem
        scale_bytes = 4 * (n - 1) if fp8 and op == "ag_matmul" else 0
        for r in range(n):
            with case(op, transport, n, chunks, bidir, dtypes, r):
                p = build(op, transport, n, r, batch=batch, rows=rows, k=k, n_out=n_out,
                          chunks=chunks, bidirectional=bidir, **dtypes)
                sent = sum(o["remote_bytes"] for o in p["ops"])
                assert (sent - scale_bytes) * n == (n - 1) * gathered_bytes, sent


def test_ring_all_reduce_sends_exactly_2_n_minus_1_over_n():
    """GEMM + AR sends the ring all-reduce bound: 2(N-1)/N of Y per rank, no more."""
    batch, rows, k, n_out = 2, 6, 5, 3
    for transport, n, chunks, bidir in grid(["nccl", "p2p"], [1, 2, 3, 4, 8], [1, 3],
                                            [False, True]):
        y_bytes = batch * n * rows * n_out * 4
        for r in range(n):
            with case(transport, n, chunks, bidir, r):
                p = build("matmul_ar", transport, n, r, batch=batch, rows=rows, k=k,
                          n_out=n_out, chunks=chunks, bidirectional=bidir)
                sent = sum(o["remote_bytes"] for o in p["ops"])
                assert sent * n == 2 * (n - 1) * y_bytes, sent


def test_multicast_ar_reduces_and_stores_own_block_only():
    """In the switch: each rank load-reduces its own block and stores it back, Y/N each way."""
    n, batch, rows, n_out = 4, 2, 6, 3
    for r in range(n):
        p = build("matmul_ar", "multicast", n, r, batch=batch, rows=rows, n_out=n_out, chunks=2)
        reduces = [o for o in p["ops"] if o["kind"] == "McReduce"]
        assert reduces and {o["shard"] for o in reduces} == {r}


def test_one_shot_sends_every_partial_once_and_sums_in_rank_order():
    """One hop: each rank's whole partial reaches every peer once (multicast: none leaves, every
    rank load-reduces all rows); each sub-chunk of Y is slot 0 copied, then slots 1..N-1 added,
    the same order on every rank. Rows need not split over the ranks (1 row on 8)."""
    batch, k, n_out = 2, 5, 3
    for transport, n, rows, chunks in grid(TRANSPORTS, [2, 3, 8], [1, 6, 7], [1, 3]):
        for r in range(n):
            with case(transport, n, rows, chunks, r):
                p = build(ONE_SHOT, transport, n, r, batch=batch, rows=rows, k=k, n_out=n_out,
                          chunks=chunks)
                partial = batch * rows * n_out * 4
                sent = sum(o["remote_bytes"] for o in p["ops"])
                assert sent == (0 if transport == "multicast" else (n - 1) * partial)
                gemms = [o for o in p["ops"] if o["kind"] == "Gemm"]
                assert sum(o["m"] for o in gemms) == rows and gemms[0]["a"]["buf"] == "X"
                into_y = [(o["kind"], o["shard"], o["sub"]) for o in p["ops"]
                          if o["d"] and o["d"]["buf"] == "Y"]
                subs = range(min(chunks, rows))
                if transport == "multicast":
                    assert into_y == [("McReduce", r, s) for s in subs]
                else:
                    assert into_y == [("Copy" if j == 0 else "Add", j, s)
                                      for s in subs for j in range(n)]


def test_multicast_ag_stores_each_shard_once():
    batch, rows, k = 2, 6, 5
    for n, chunks in grid([1, 2, 4, 8], [1, 4]):
        for r in range(n):
            with case(n, chunks, r):
                p = build("ag_matmul", "multicast", n, r, batch=batch, rows=rows, k=k,
                          chunks=chunks)
                stores = [o for o in p["ops"] if o["kind"] == "McStore"]
                if n == 1:
                    assert not stores
                    continue
                assert sum(o["bytes"] for o in stores) == batch * rows * k * 4
                assert {o["shard"] for o in stores} == {r}
                assert sum(o["remote_bytes"] for o in p["ops"]) == batch * rows * k * 4


def test_multicast_rs_reduces_own_block_only():
    for r in range(4):
        p = build("matmul_rs", "multicast", 4, r, chunks=2)
        reduces = [o for o in p["ops"] if o["kind"] == "McReduce"]
        assert [o["shard"] for o in reduces] == [r, r]
        assert sum(o["remote_bytes"] for o in p["ops"]) == 0


# ---- fp8: each shard's scale travels with it ----------------------------------------------

SCALE_BUFFERS = ("XSCALE", "WSCALE", "SCRATCH_SCALES", "WORKSPACE_SCALES")


def _scale_ops(program):
    """The ops moving a float32 scale (from or into a scale buffer)."""
    return [o for o in program["ops"] if o["kind"] != "Gemm"
            and any(ref and ref["buf"] in SCALE_BUFFERS for ref in (o["a"], o["d"]))]


def test_fp8_all_gather_moves_each_shards_scale_with_it():
    """Every GEMM of an fp8 all-gather dequantizes with its own shard's scale, which came with
    the shard: the local one is the x_scale operand, the others sit in their shard's slot
    (ScratchScales on nccl, WorkspaceScales on p2p and multicast), written once by the scale's
    own transfer — one per shard and hop, next to the shard's first sub-chunk (N-1 x 4 bytes per
    rank on a ring, one 4-byte multicast store). GEMM + RS / AR use the rank's own scales."""
    for transport, n, chunks, bidir in grid(TRANSPORTS, [1, 2, 3, 4, 8], [1, 3],
                                            [False, True]):
        slots = "SCRATCH_SCALES" if transport == "nccl" else "WORKSPACE_SCALES"
        for r in range(n):
            with case(transport, n, chunks, bidir, r):
                p = build("ag_matmul", transport, n, r, chunks=chunks, bidirectional=bidir,
                          **FP8)
                for g in (o for o in p["ops"] if o["kind"] == "Gemm"):
                    assert g["b_scale"]["buf"] == "WSCALE"
                    want = (("XSCALE", 0) if g["shard"] == r else (slots, g["shard"]))
                    assert (g["a_scale"]["buf"], g["a_scale"]["offset"]) == want, g["text"]
                    if slots == "WORKSPACE_SCALES" and g["shard"] != r:
                        assert g["a_scale"]["rank"] == r  # the own workspace's slot
                moved = _scale_ops(p)
                assert all(o["sub"] == 0 and o["bytes"] == 4 for o in moved)
                out = [o for o in moved if o["remote_bytes"]]
                if n == 1:
                    assert not moved
                elif transport == "multicast":
                    assert [(o["kind"], o["shard"]) for o in out] == [("McStore", r)]
                else:
                    assert sorted(o["shard"] for o in out) == sorted(
                        o["shard"] for o in p["ops"] if o["remote_bytes"] and o["sub"] == 0
                        and o not in moved)  # one scale per shard sent, with it
                    assert sum(o["remote_bytes"] for o in out) == 4 * (n - 1)
        for op in ("matmul_rs", "matmul_ar"):
            p = build(op, transport, n, 0, chunks=chunks, bidirectional=bidir, **FP8)
            assert not _scale_ops(p) and p["workspace_scales"] == p["scratch_scales"] == 0
            assert {(g["a_scale"]["buf"], g["b_scale"]["buf"]) for g in p["ops"]
                    if g["kind"] == "Gemm"} == {("XSCALE", "WSCALE")}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_race_checker_catches_a_scale_that_did_not_travel(transport):
    """Drop the transfers of one rank's scale (its sends, and their receives): the schedule
    still completes, but a GEMM reads a scale slot no op of its call wrote."""
    programs = clique("ag_matmul", transport, 4, rows=3, k=2, n_out=2, chunks=2, **FP8)
    check_race_free(programs)
    broken = copy.deepcopy(programs)
    for p in broken:
        p["ops"] = [o for o in p["ops"] if not (o in _scale_ops(p) and o["shard"] == 1)]
    check_deadlock_free(broken)
    with pytest.raises(ScheduleError, match="no write of its call"):
        check_race_free(broken)


def test_block_scales_travel_with_every_sub_chunk():
    """MXFP8: an all-gather moves each sub-chunk's e8m0 scale rows ([rows, k/32]) by the same
    mechanism as its data rows, into the same rows of the gathered scale layout, before the
    flag (p2p, multicast) or in the same NCCL group; every GEMM reads the scale rows beside its
    own rows and all of w's. GEMM + RS / AR move no scales. Every such clique is deadlock- and
    race-free (also two calls back to back: both workspace parities), in bounds for both
    checkers, and drains through one work queue per device in the executors' issue order."""
    testing = testing_ext.load()
    k = 64
    for transport, (n, chunks, bidir) in grid(TRANSPORTS, [(1, 2, False), (2, 1, False),
                                                           (3, 2, True), (4, 2, False)]):
        with case(transport, n, chunks, bidir):
            programs = clique("ag_matmul", transport, n, rows=4, k=k, n_out=2, chunks=chunks,
                              bidirectional=bidir, return_gathered=True, **MX)
            for p in programs:
                host.check_program(p)
                check_bounds(p)
                check_dtypes(p)
                def key(o):  # a transfer: what it moves, to or from whom
                    return (o["kind"], o["shard"], o["sub"], o["peer"],
                            o["d"]["rank"] if o["d"] else None)

                data = {key(o): o for o in p["ops"]
                        if o["kind"] in ("Copy", "Send", "Recv", "McStore") and o["stream"] > 0
                        and o["n"] == k}  # the transfers (the compute stream's copies: x's own)
                moved = _scale_ops(p)
                assert len(moved) == len(data), (len(moved), len(data))
                for o in moved:
                    twin = data[key(o)]
                    assert (o["m"], o["n"], o["bytes"]) == (twin["m"], k // 32, twin["bytes"] // 32)
                    for role in ("a", "d"):
                        if o[role] is not None and twin[role] is not None:
                            assert o[role]["offset"] * 32 == twin[role]["offset"]
                            assert o[role]["rank"] == twin[role]["rank"]
                for g in (o for o in p["ops"] if o["kind"] == "Gemm"):
                    assert g["a_scale"]["offset"] * 32 == g["a"]["offset"]
                    assert g["a_scale"]["ld"] * 32 == g["a"]["ld"]
                    assert (g["b_scale"]["buf"], g["b_scale"]["ld"]) == ("WSCALE", 2)
            check_deadlock_free(programs)
            check_race_free(programs, calls=2)
            orders = [testing.issue_order("ag_matmul", transport, n, r, 4, chunks, bidir, True,
                                          False, block_scaled=True) for r in range(n)]
            assert _one_queue(programs, orders)
    for op in ("matmul_rs", "matmul_ar", ONE_SHOT):
        p = build(op, "p2p", 4, 1, rows=4, k=k, chunks=2, **MX)
        assert not _scale_ops(p) and p["workspace_scales"] == p["scratch_scales"] == 0
        assert {(g["a_scale"]["buf"], g["b_scale"]["buf"]) for g in p["ops"]
                if g["kind"] == "Gemm"} == {("XSCALE", "WSCALE")}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_race_checker_catches_block_scales_that_did_not_travel(transport):
    """Drop the moves of one sub-chunk's block scales: the schedule completes, but a GEMM reads
    scale rows no op of its call wrote."""
    programs = clique("ag_matmul", transport, 4, rows=4, k=64, n_out=2, chunks=2, **MX)
    check_race_free(programs)
    broken = copy.deepcopy(programs)
    for p in broken:
        p["ops"] = [o for o in p["ops"]
                    if not (o in _scale_ops(p) and (o["shard"], o["sub"]) == (1, 1))]
    check_deadlock_free(broken)
    with pytest.raises(ScheduleError, match="no write of its call"):
        check_race_free(broken)


def test_a_gemm_reading_other_rows_scales_is_refused():
    """A block-scaled GEMM whose a_scale names scale rows other than its own rows' (another
    sub-chunk's) stays inside the buffer, so only the scales-beside-rows rule refuses it."""
    p = build("ag_matmul", "nccl", 2, 0, rows=4, k=64, chunks=2, **MX)
    host.check_program(p)
    i = next(i for i, o in enumerate(p["ops"]) if o["kind"] == "Gemm" and o["sub"] == 1)
    broken = copy.deepcopy(p)
    broken["ops"][i]["a_scale"]["offset"] -= 2 * 2        # sub-chunk 0's rows (2 rows x k/32)
    check_bounds(broken)
    with pytest.raises(ValueError, match="scale rows beside a's rows"):
        host.check_program(broken)


def test_block_scaled_programs_refuse_what_they_cannot_be():
    """k not whole blocks of 32, an operand not fp8, or the fused GEMM: refused naming why."""
    for kw, match in ((dict(k=48), "multiple of 32"),
                      (dict(k=64, dtype="bfloat16"), "must both be fp8"),
                      (dict(k=64, fused=True), "fused GEMM takes no block scales")):
        fused = kw.pop("fused", False)
        args = {**MX, **kw}
        with pytest.raises(ValueError, match=match):
            host.build_program("ag_matmul", "p2p", 2, 0, 1, 4, args["k"], 2, args["dtype"], 1,
                               False, False, w_dtype=args["w_dtype"],
                               out_dtype=args["out_dtype"], fused=fused, block_scaled=True)


def _p2p_fp8(n, chunks, bidir, fused, dtype="float8_e4m3fn"):
    """A p2p all-gather clique (x [3, 16] per rank); ``dtype`` of both operands."""
    return [host.build_program("ag_matmul", "p2p", n, r, 1, 3, 16, 8, dtype, chunks, bidir,
                               False, w_dtype=dtype, out_dtype="bfloat16", fused=fused)
            for r in range(n)]


def _flag_of(program, scale_copy):
    """The index of the Signal that releases a scale copy's shard (its first sub-chunk) to the
    peer the copy writes to."""
    (flag,) = [j for j, o in enumerate(program["ops"]) if o["kind"] == "Signal"
               and o["peer"] == scale_copy["d"]["rank"]
               and o["id"] == scale_copy["shard"] * program["chunks"]]
    return flag


def test_p2p_scale_copies_ride_the_data_stream_before_their_shards_flag():
    """On p2p a shard's scale crosses on its first sub-chunk's own stream, after that stream's
    wait for the shard's flag (it forwards the slot the previous rank filled) and before the
    flag that releases the shard to the next rank: stream order alone keeps a peer from reading
    the slot before the scale is in it, at one op per hop (the same streams and events as the
    16-bit program, which moves no scale). Moved after the flag, or before the wait, the race
    checker sees a slot read unordered with its write (the peers' GEMMs, chunked; the fused
    kernel's blocks) or a forward of a slot not yet filled."""
    for n, chunks, bidir, fused in grid([1, 2, 3, 8], [1, 3], [False, True], [False, True]):
        with case(n, chunks, bidir, fused):
            programs = _p2p_fp8(n, chunks, bidir, fused)
            plain = _p2p_fp8(n, chunks, bidir, fused, dtype="bfloat16")
            for r, (p, q) in enumerate(zip(programs, plain, strict=True)):
                ops = p["ops"]
                sent = [i for i, o in enumerate(ops) if o in _scale_ops(p) and o["d"]["rank"] != r]
                hops = p["cw_steps"] + p["ccw_steps"] if n > 1 else 0
                assert len(sent) == hops
                own = 1 if fused and n > 1 else 0  # the fused prologue's copy of the own scale
                assert len(ops) == len(q["ops"]) + hops + own
                assert (p["num_streams"], p["num_events"]) == (q["num_streams"], q["num_events"])
                for i in sent:
                    o, flag = ops[i], _flag_of(p, ops[i])
                    assert o["stream"] == ops[flag]["stream"] > 0, o["text"]
                    between = [x for x in ops[i + 1:flag] if x["stream"] == o["stream"]]
                    assert [x["kind"] for x in between] == ["Copy"], o["text"]  # the shard's
                    assert (between[0]["shard"], between[0]["sub"]) == (o["shard"], 0)
                    if o["a"]["buf"] == "WORKSPACE_SCALES":  # forwarded: after the flag's wait
                        before = [x for x in ops[:i] if x["stream"] == o["stream"]][-1]
                        assert (before["kind"], before["id"]) == ("Wait", o["shard"] * chunks)
                    else:
                        assert (o["a"]["buf"], o["shard"]) == ("XSCALE", r)
            check_race_free(programs)
            if n == 1:
                continue
            for late in (True, False):  # after the flag; before the wait
                broken = copy.deepcopy(programs)
                moved = 0
                for r, p in enumerate(broken):
                    ops = p["ops"]
                    for o in [o for o in _scale_ops(p) if o["d"]["rank"] != r]:
                        if not late and o["a"]["buf"] != "WORKSPACE_SCALES":
                            continue  # the first hop's copy has no wait to precede
                        i = next(i for i, x in enumerate(ops) if x is o)
                        if late:
                            ops.insert(_flag_of(p, o), ops.pop(i))  # just after the flag
                        else:
                            wait = max(j for j in range(i) if ops[j]["stream"] == o["stream"])
                            ops.insert(wait, ops.pop(i))
                        moved += 1
                if moved == 0:  # no hop forwards (one step a way): nothing to move before a wait
                    assert not late and max(p["cw_steps"], p["ccw_steps"]) == 1
                    continue
                check_deadlock_free(broken)
                with pytest.raises(ScheduleError, match="'WORKSPACE_SCALES'"):  # race or stale
                    check_race_free(broken)


def test_fp8_dtype_rules_are_checked_by_both_checkers():
    """A GEMM of an fp8 x without its scale, a scale on a float32 operand, or a copy between
    buffers of two dtypes: refused by the C++ check and the independent Python one."""
    p = build("ag_matmul", "p2p", 4, 1, rows=3, k=2, n_out=2, **FP8)
    host.check_program(p)
    check_dtypes(p)
    gemm = next(i for i, o in enumerate(p["ops"]) if o["kind"] == "Gemm")
    unscaled = copy.deepcopy(p)
    unscaled["ops"][gemm]["a_scale"] = None
    copied = copy.deepcopy(p)
    push = next(o for o in copied["ops"] if o["kind"] == "Copy" and o["bytes"] > 4)
    push["d"]["buf"] = "Y"
    f32 = build("matmul_rs", "nccl", 4, 0, rows=3, k=2, n_out=2)
    scaled = copy.deepcopy(f32)
    gemm32 = next(o for o in scaled["ops"] if o["kind"] == "Gemm")
    gemm32["a_scale"] = dict(buf="XSCALE", rank=0, offset=0, batch_stride=0, ld=1)
    for broken, cpp, py in [(unscaled, "a_scale must name a scale slot", "a_scale must"),
                            (copied, "operand d is bf16 \\(Y\\), expected f8e4m3fn",
                             "moves f8e4m3fn into bf16"),
                            (scaled, "a_scale must be unset", "a_scale must be unset")]:
        with pytest.raises(ValueError, match=cpp):
            host.check_program(broken)
        with pytest.raises(ScheduleError, match=py):
            check_dtypes(broken)
    # A scale slot one past the shards': refused by both bounds checks.
    past = copy.deepcopy(p)
    scaled_gemm = next(o for o in past["ops"] if o["kind"] == "Gemm" and o["shard"] != 1)
    scaled_gemm["a_scale"]["offset"] = p["workspace_scales"]
    with pytest.raises(ValueError, match="operand a_scale .* of a WORKSPACE_SCALES buffer of 4"):
        host.check_program(past)
    with pytest.raises(ScheduleError, match="operand a_scale reaches element 5"):
        check_bounds(past)


def test_a_call_of_unsupported_dtypes_is_refused():
    for dtypes, message in [
            (dict(dtype="bfloat16", w_dtype="float16"), "same dtype unless one of them is float8"),
            (dict(dtype="bfloat16", out_dtype="float16"), "must be x's or float32"),
            (dict(dtype="float8_e4m3fn", out_dtype="float8_e4m3fn"), "must be float32, bfloat16"),
            (dict(dtype="int8"), "dtype: expected float32, bfloat16, float16, float8_e4m3fn")]:
        with pytest.raises(ValueError, match=message):
            build("ag_matmul", "p2p", 2, 0, **dtypes)
    # fp8 with another operand type, or a float32 output of 16-bit operands: fine.
    for dtypes in (dict(dtype="float8_e4m3fn", w_dtype="bfloat16", out_dtype="float32"),
                   dict(dtype="bfloat16", w_dtype="float8_e5m2"),
                   dict(dtype="bfloat16", out_dtype="float32")):
        check_dtypes(build("matmul_rs", "p2p", 2, 0, **dtypes))


# ---- deadlock freedom ----------------------------------------------------------------------

def test_every_clique_is_deadlock_free():
    for values in grid(ALL_OPS, TRANSPORTS, [1, 2, 3, 4, 5, 8], [1, 3], [False, True],
                       [F32, FP8]):
        op, transport, n, chunks, bidir, dtypes = values
        with case(*values):
            programs = clique(op, transport, n, chunks=chunks, bidirectional=bidir,
                              return_gathered=op == "ag_matmul", **dtypes)
            assert check_deadlock_free(programs) == sum(len(p["ops"]) for p in programs)


def _drop_first(programs, rank, kind):
    broken = copy.deepcopy(programs)
    ops = broken[rank]["ops"]
    ops.pop(next(i for i, o in enumerate(ops) if o["kind"] == kind))
    return broken


@pytest.mark.parametrize("transport,kind", [("p2p", "Signal"), ("nccl", "Send"),
                                            ("multicast", "Signal"), ("nccl", "Record")])
def test_checker_catches_broken_programs(transport, kind):
    programs = clique("ag_matmul", transport, 4, chunks=2)
    check_deadlock_free(programs)
    with pytest.raises(ScheduleError, match="deadlock"):
        check_deadlock_free(_drop_first(programs, 1, kind))


def test_checker_catches_a_cyclic_wait():
    # Rank 0 waits for rank 1 before signalling it, and vice versa.
    def prog(rank):
        peer = 1 - rank
        return {"rank": rank, "num_streams": 1, "ops": [
            {"kind": "Wait", "stream": 0, "peer": peer, "id": 0, "text": f"Wait({rank})"},
            {"kind": "Signal", "stream": 0, "peer": peer, "id": 0, "text": f"Signal({rank})"},
        ]}
    with pytest.raises(ScheduleError, match="deadlock"):
        check_deadlock_free([prog(0), prog(1)])


def test_program_is_printable_and_invalid_problems_raise():
    p = build("matmul_rs", "p2p", 4, 2, chunks=2, bidirectional=True)
    assert "stream 0 (compute)" in p["text"] and "Signal" in p["text"]
    with pytest.raises(ValueError, match="rank must be in"):
        build("ag_matmul", "p2p", 4, 4)
    with pytest.raises(ValueError, match="transport"):
        build("ag_matmul", "smoke-signals", 4, 0)


# ---- data races ----------------------------------------------------------------------------

def test_every_clique_is_race_free():
    """fp8 alternates with float32: its scales' transfers and reads are checked alike."""
    for op, transport, n, (chunks, bidir, dtypes) in grid(
            ALL_OPS, TRANSPORTS, [1, 2, 3, 4, 8],
            [(1, False, F32), (3, True, FP8), (2, False, FP8), (1, True, F32)]):
        with case(op, transport, n, chunks, bidir, dtypes):
            programs = clique(op, transport, n, rows=3, k=2, n_out=2, chunks=chunks,
                              bidirectional=bidir, return_gathered=op == "ag_matmul", **dtypes)
            check_race_free(programs)


def test_back_to_back_calls_reuse_buffers_safely():
    """Three calls in a row: parity double-buffering never lets a call clobber data in use
    (fp8: the workspace's scale slots too)."""
    for op, transport, n, (chunks, bidir, dtypes) in grid(
            ALL_OPS, TRANSPORTS, [2, 3, 4], [(1, False, F32), (2, True, FP8)]):
        with case(op, transport, n, chunks, bidir, dtypes):
            programs = clique(op, transport, n, rows=2, k=2, n_out=2, chunks=chunks,
                              bidirectional=bidir, return_gathered=op == "ag_matmul", **dtypes)
            check_race_free(programs, calls=3)


@pytest.mark.parametrize("op,transport", [("ag_matmul", "p2p"), ("matmul_rs", "multicast"),
                                          (ONE_SHOT, "p2p"), (ONE_SHOT, "multicast")])
def test_a_single_workspace_buffer_would_race_across_calls(op, transport):
    programs = clique(op, transport, 4, rows=2, k=2, n_out=2)
    check_race_free(programs, calls=3, parities=2)
    with pytest.raises(ScheduleError, match="race|another call"):
        check_race_free(programs, calls=3, parities=1)


def _drop_all(programs, rank, stream, kind):
    broken = copy.deepcopy(programs)
    broken[rank]["ops"] = [o for o in broken[rank]["ops"]
                           if not (o["stream"] == stream and o["kind"] == kind)]
    return broken


@pytest.mark.parametrize("op,transport,kind", [
    ("ag_matmul", "p2p", "Wait"),          # GEMM would read a slot before the peer's push lands
    (ONE_SHOT, "p2p", "Wait"),             # the sum would read a slot before its push lands
    (ONE_SHOT, "nccl", "StreamWait"),      # ... before its Recv completed
    (ONE_SHOT, "multicast", "Wait"),       # load-reduce before the peers' partials are written
    ("ag_matmul", "nccl", "StreamWait"),   # GEMM would read before the Recv completed
    ("matmul_rs", "p2p", "Wait"),
    ("matmul_rs", "multicast", "Wait"),    # reduce before the peers' partials are written
])
def test_race_checker_catches_a_missing_dependency(op, transport, kind):
    programs = clique(op, transport, 4, rows=3, k=2, n_out=2, chunks=2)
    check_race_free(programs)
    broken = _drop_all(programs, 1, 0, kind)  # compute stream of rank 1 stops waiting
    check_deadlock_free(broken)               # still deadlock-free ...
    with pytest.raises(ScheduleError, match="race|no write of its call"):
        check_race_free(broken)               # ... but racy


# ---- bounds ----------------------------------------------------------------------------------

def test_every_program_stays_inside_its_buffers():
    """Both checkers (C++ _host.check_program, which BuildProgram and the executors run, and
    the independent Python one) accept every program the builders make."""
    for op, transport, n, (chunks, bidir, gathered, dtypes) in grid(
            ALL_OPS, TRANSPORTS, [1, 2, 3, 8],
            [(1, False, False, F32), (3, True, True, FP8), (2, False, False, FP8)]):
        for p in clique(op, transport, n, rows=3, k=2, n_out=5, chunks=chunks,
                        bidirectional=bidir, return_gathered=gathered and op == "ag_matmul",
                        **dtypes):
            with case(op, transport, n, chunks, bidir, gathered, dtypes, p["rank"]):
                host.check_program(p)
                check_bounds(p)
                check_dtypes(p)


def _shifted(program, index, role, by):
    """A copy of `program` whose op `index` has operand `role` moved by `by` elements."""
    broken = copy.deepcopy(program)
    broken["ops"][index][role]["offset"] += by
    return broken


@pytest.mark.parametrize("op,transport,kind,role,buf", [
    ("ag_matmul", "p2p", "Copy", "d", "WORKSPACE"),      # a push one block past the slot
    ("ag_matmul", "nccl", "Recv", "d", "SCRATCH"),
    ("matmul_rs", "p2p", "Gemm", "c", "WORKSPACE"),     # accumulating onto a slot past the end
    ("matmul_rs", "multicast", "McReduce", "d", "Y"),
    ("ag_matmul", "multicast", "Gemm", "a", "WORKSPACE"),
])
def test_an_operand_past_its_buffer_is_refused_by_both_checkers(op, transport, kind, role, buf):
    program = clique(op, transport, 4, rows=3, k=2, n_out=2, chunks=2)[1]
    size = buffer_sizes(program)[buf]
    index, first = next((i, o) for i, o in enumerate(program["ops"])
                        if o["kind"] == kind and o[role] and o[role]["buf"] == buf)
    rows, cols = first["m"], first["k"] if (kind, role) == ("Gemm", "a") else first["n"]
    ref = first[role]
    end = ref["offset"] + (first["batch"] - 1) * ref["batch_stride"] + (rows - 1) * ref["ld"] + cols
    # Moved to end exactly at the buffer's end: still inside (the checks are exact) ...
    inside = _shifted(program, index, role, size - end)
    host.check_program(inside)
    check_bounds(inside)
    # ... one element further: refused, naming the op, the operand and the buffer.
    broken = _shifted(program, index, role, size - end + 1)
    with pytest.raises(ValueError, match=f"operand {role} .* reaches element {size + 1} of a "
                                         f"{buf} buffer of {size} elements"):
        host.check_program(broken)
    with pytest.raises(ScheduleError, match=f"operand {role} reaches element {size + 1}"):
        check_bounds(broken)


def test_out_of_range_ids_are_refused():
    program = clique("ag_matmul", "p2p", 4, rows=3, k=2, n_out=2)[0]
    for kind, field, value, what in [("Signal", "peer", 4, "peer"), ("Wait", "id", 99, "flag"),
                                     ("Copy", "stream", 7, "stream")]:
        broken = copy.deepcopy(program)
        next(o for o in broken["ops"] if o["kind"] == kind)[field] = value
        with pytest.raises(ValueError, match=f"{what} {value} is outside"):
            host.check_program(broken)
        with pytest.raises(ScheduleError, match=f"{what} out of range"):
            check_bounds(broken)


# ---- the kernel algorithms (one launch: docs/gpu-internals.md §7) --------------------------

KERNELS = ("matmul_ar/one_shot_kernel", "matmul_ar/two_shot_kernel")


def test_kernel_programs_are_a_gemm_and_one_all_reduce():
    """matmul_ar's kernel algorithms: the GEMM of all rows into y, then one AllReduce of y in
    place (no comm stream, no event, no chunks); both checkers accept them, and the clique is
    deadlock-free and race-free over three calls (the AllReduce checked as its host semantics:
    schedule_check.all_reduce_ops)."""
    for op, transport, n, dtypes in grid(KERNELS, FUSED_TRANSPORTS, [1, 2, 3, 8], [F32, FP8]):
        with case(op, transport, n, dtypes):
            programs = clique(op, transport, n, batch=1, rows=3, k=2, n_out=4, chunks=3,
                              **dtypes)
            for p in programs:
                kinds = [o["kind"] for o in p["ops"]]
                assert kinds == (["Gemm", "AllReduce"] if n > 1 else ["Gemm"])
                assert (p["num_streams"], p["num_events"], p["chunks"]) == (1, 0, 1)
                gemm = p["ops"][0]
                assert (gemm["m"], gemm["d"]["buf"]) == (3, "Y")
                host.check_program(p)
                check_bounds(p)
                check_dtypes(p)
            check_race_free(programs, calls=3)


def test_kernel_algorithms_refuse_nccl_and_calls_past_their_area():
    with pytest.raises(ValueError, match="p2p or multicast, not nccl"):
        build("matmul_ar/one_shot_kernel", "nccl", 4, 0)
    # One-shot over p2p: 8 slots of all of y in 8 MiB: 1 MiB of y fits, 2 MiB do not.
    assert host.allreduce_fits("p2p", "one_shot_kernel", 8, 1 << 20)
    assert not host.allreduce_fits("p2p", "one_shot_kernel", 8, 2 << 20)
    assert host.allreduce_fits("p2p", "two_shot_kernel", 8, 3 << 20)
    assert host.allreduce_fits("multicast", "one_shot_kernel", 8, 8 << 20)
    with pytest.raises(ValueError, match="moves at most 8388608 bytes"):
        build("matmul_ar/one_shot_kernel", "p2p", 8, 0, batch=1, rows=64, k=8, n_out=8192)


def test_the_race_checker_catches_an_all_reduce_reading_before_its_flags():
    programs = clique(KERNELS[0], "p2p", 4, batch=1, rows=3, k=2, n_out=2)
    check_race_free(programs, calls=2)
    real = schedule_check.all_reduce_ops

    def without_waits(program, op):
        return [o for o in real(program, op) if o["kind"] != "Wait"]

    schedule_check.all_reduce_ops = without_waits
    try:
        with pytest.raises(ScheduleError, match="race|no write of its call"):
            check_race_free(programs, calls=2)
    finally:
        schedule_check.all_reduce_ops = real


def test_the_issue_order_of_the_kernel_algorithms_completes_with_one_work_queue():
    testing = testing_ext.load()
    for op, transport, n in grid(KERNELS, FUSED_TRANSPORTS, [2, 3, 8]):
        with case(op, transport, n):
            orders = [testing.issue_order(op, transport, n, r, 3, 1, False, False, False)
                      for r in range(n)]
            assert orders == [[0, 1]] * n  # the GEMM, then the kernel


# ---- the fused programs (docs/gpu-internals.md §5) -----------------------------------------

FUSED_TRANSPORTS = ("p2p", "multicast")


def fused_clique(op, transport, n, *, chunks=1, bidirectional=False, return_gathered=False):
    """Every rank's fused program: batch 2, 3 rows per shard, k and n of 8 (16-byte rows)."""
    return [host.build_program(op, transport, n, r, 2, 3, 8, 8, "bfloat16", chunks,
                               bidirectional, return_gathered, fused=True) for r in range(n)]


def _kernel(program):
    (kernel,) = [o for o in program["ops"] if o["kind"] == "FusedGemm"]
    assert kernel["stream"] == 0
    assert not [o for o in program["ops"] if o["kind"] == "Gemm"]  # one GEMM, the kernel
    return kernel


def test_fused_programs_are_one_kernel_deadlock_free_race_free_and_in_bounds():
    """Every fused clique: one FusedGemm per rank over every row, waiting (AG) or releasing
    (RS) but never both, in bounds for both checkers, deadlock-free and race-free (the kernel
    checked as the block-level ops it stands for: schedule_check.fused_blocks), three calls in
    a row too."""
    for op, transport, n, chunks, bidir in grid(OPS, FUSED_TRANSPORTS, [1, 2, 3, 4, 8], [1, 3],
                                                [False, True]):
        with case(op, transport, n, chunks, bidir):
            programs = fused_clique(op, transport, n, chunks=chunks, bidirectional=bidir,
                                    return_gathered=op == "ag_matmul")
            for p in programs:
                host.check_program(p)
                check_bounds(p)
                if n == 1:  # nothing to wait for: the plain GEMM
                    assert not [o for o in p["ops"] if o["kind"] == "FusedGemm"]
                    continue
                kernel, f = _kernel(p), _kernel(p)["fused"]
                assert kernel["m"] == n * 3 and kernel["batch"] == 2
                assert (f["wait_flags"] >= 0) != (f["release_flags"] >= 0)
                assert (f["wait_flags"] >= 0) == (op == "ag_matmul")
                assert sorted(f["sequence"]) == list(range(n * f["chunks"]))
            check_deadlock_free(programs)
            check_race_free(programs, calls=1 if n > 4 else 3)


def _order(programs_chunked, rank, chunks):
    """The chunked AG program's order: the local shard, then each stream-0 Wait's flag."""
    s0 = [o for o in programs_chunked[rank]["ops"] if o["stream"] == 0]
    return [rank * chunks + s for s in range(chunks)] + [o["id"] for o in s0
                                                         if o["kind"] == "Wait"]


def test_fused_ag_order_is_the_local_shard_then_arrivals():
    """Tiles start with the local shard, then follow the chunked program's arrival order; every
    waited block is the flag its writer raises (the deadlock checker also checks the writer)."""
    for transport, n, chunks, bidir in grid(FUSED_TRANSPORTS, [2, 3, 4, 8], [1, 2],
                                            [False, True]):
        chunked = [host.build_program("ag_matmul", transport, n, r, 2, 3, 8, 8, "bfloat16",
                                      chunks, bidir) for r in range(n)]
        for r, p in enumerate(fused_clique("ag_matmul", transport, n, chunks=chunks,
                                           bidirectional=bidir)):
            with case(transport, n, chunks, bidir, r):
                f = _kernel(p)["fused"]
                assert f["order"] == "last_arrival" and f["ready_shard"] == r
                assert f["sequence"] == _order(chunked, r, chunks)
                assert [w >= 0 for w in f["writers"]] == [b // chunks != r
                                                          for b in range(n * chunks)]
                # the kernel reads every shard from the own workspace; the local one is
                # copied there first (p2p) or stored there by the own multimem store
                s0 = [o for o in p["ops"] if o["stream"] == 0]
                first = "Copy" if transport == "p2p" else "StreamWait"
                assert s0[0]["kind"] == first and _kernel(p)["a"]["buf"] == "WORKSPACE"


def test_fused_rs_reduces_each_sub_chunk_beside_the_kernel():
    """GEMM + RS: the kernel releases C rounds, round s taking sub-chunk s of every destination
    (p2p: r-1, r-2, ..., its own last; multicast: 0, 1, ..., N-1 on every rank, so that all
    ranks release a sub-chunk together); over p2p each rank copies exactly N-1 partials (each to
    its owner's slot: (N-1)/N of its partials), alternating between streams 1 and 2 so that
    one copy's start overlaps another's bytes. The last stream (p2p: 3; multicast, which
    copies nothing: 2) reduces the own block sub-chunk by
    sub-chunk once every rank's partial of it is in — p2p: one Reduce of the N partials in rank
    order; multicast: one load-reduce — each sized to the SMs the kernel leaves, except the one
    whose input the kernel releases last, which runs after it on the whole device."""
    batch, rows, n_out = 2, 3, 8
    for transport, n, chunks in grid(FUSED_TRANSPORTS, [2, 3, 4, 8], [1, 2, 3]):
        for r, p in enumerate(fused_clique("matmul_rs", transport, n, chunks=chunks)):
            with case(transport, n, chunks, r):
                f = _kernel(p)["fused"]
                c = f["chunks"]
                mc = transport == "multicast"
                reducer = 2 if mc else 3
                dests = list(range(n)) if mc else [(r - 1 - t) % n for t in range(n)]
                assert f["sequence"] == [d * c + s for s in range(c) for d in dests]
                assert f["order"] == "first_departure"
                spare = f["spare_sms"]
                assert (spare > 0) == (mc or c > 1)
                remote = sum(o["remote_bytes"] for o in p["ops"])
                assert remote == (0 if mc else (n - 1) * batch * rows * n_out * 2)
                sums = [o for o in p["ops"] if o["kind"] in ("Reduce", "McReduce", "Add")]
                assert [(o["kind"], o["stream"], o["shard"], o["sub"]) for o in sums] == [
                    ("McReduce" if mc else "Reduce", reducer, r, s) for s in range(c)]
                copies = [o for o in p["ops"] if o["kind"] == "Copy" and o["stream"] != 0]
                assert [o["stream"] for o in copies] == [1 + i % 2 for i in range(len(copies))]
                last = f["sequence"][-1]
                for s, o in enumerate(sums):
                    tail = last == r * c + s  # its input is the kernel's last release
                    assert o["sms"] == (0 if tail else spare), o["text"]
                    assert o["d"]["buf"] == "Y"
                    if not mc:  # rank order: rank i's partial of this block, the own in scratch
                        assert [(src["buf"], src["rank"]) for src in o["sources"]] == [
                            ("SCRATCH", r) if i == r else ("WORKSPACE", r) for i in range(n)]
                # before each sum, its stream waits for the own release and every peer's flag
                s2 = [o for o in p["ops"] if o["stream"] == reducer]
                for s in range(c):
                    at = s2.index(sums[s])
                    waits = {(o["peer"], o["id"]) for o in s2[:at] if o["kind"] == "Wait"}
                    assert (r, f["release_flags"] + r * c + s) in waits
                    assert {(i, i * c + s) for i in range(n) if i != r} <= waits


def test_a_reduction_before_its_last_release_is_a_race():
    """The race checker sees a reduction that does not wait for the kernel's release of the own
    partial (p2p: the Reduce reads the kernel's rows; multicast: the load-reduce reads every
    rank's), or for a peer's flag (the slot its copy writes, or its partial in the switch)."""
    for transport in FUSED_TRANSPORTS:
        programs = fused_clique("matmul_rs", transport, 4, chunks=2)
        check_race_free(programs)
        reducer = 2 if transport == "multicast" else 3
        own = copy.deepcopy(programs)
        f = _kernel(own[1])["fused"]
        own[1]["ops"] = [o for o in own[1]["ops"] if not (
            o["stream"] == reducer and o["kind"] == "Wait" and o["id"] >= f["release_flags"])]
        check_deadlock_free(own)
        with pytest.raises(ScheduleError, match="race|no write of its call"):
            check_race_free(own)
        peer = copy.deepcopy(programs)
        peer[1]["ops"] = [o for o in peer[1]["ops"] if not (
            o["stream"] == reducer and o["kind"] == "Wait" and o["peer"] == 2)]
        check_deadlock_free(peer)
        with pytest.raises(ScheduleError, match="race|no write of its call"):
            check_race_free(peer)


def test_fused_refusals_name_the_reason():
    for args, match in [
        (("ag_matmul", "nccl"), "never runs with transport nccl"),
        (("matmul_ar", "p2p"), "serves ag_matmul and matmul_rs"),
    ]:
        with pytest.raises(ValueError, match=match):
            host.build_program(*args, 4, 0, 1, 4, 8, 8, "bfloat16", 1, False, False, fused=True)
    with pytest.raises(ValueError, match="bfloat16 and float16"):
        host.build_program("ag_matmul", "p2p", 4, 0, 1, 4, 8, 8, "float32", fused=True)
    with pytest.raises(ValueError, match="multiples of 8"):
        host.build_program("matmul_rs", "p2p", 4, 0, 1, 4, 8, 12, "bfloat16", fused=True)


def test_the_fused_fp8_reduce_scatter_scales_every_row_by_the_ranks_one_scale():
    """The fused FP8 GEMM + reduce-scatter: x is the rank's own, so its FusedGemm reads one
    scale (x_scale_stride 0: XSCALE's one slot) for every row block, the all-gather's reads
    the shards' slots (1); a per-shard read of the one scale reaches past XSCALE, and a stride
    outside {0, 1} is refused."""
    kw = (4, 1, 1, 8, 32, 16, "float8_e4m3fn", 2, False, False)
    rs = host.build_program("matmul_rs", "p2p", *kw, w_dtype="float8_e4m3fn",
                            out_dtype="bfloat16", fused=True)
    ag = host.build_program("ag_matmul", "p2p", *kw, w_dtype="float8_e4m3fn",
                            out_dtype="bfloat16", fused=True)
    (fused,) = (o for o in rs["ops"] if o["kind"] == "FusedGemm")
    assert fused["fused"]["x_scale_stride"] == 0 and fused["a_scale"]["buf"] == "XSCALE"
    assert [o["fused"]["x_scale_stride"] for o in ag["ops"] if o["kind"] == "FusedGemm"] == [1]
    for stride, match in [(1, "operand a_scale .* reaches element 4 of a XSCALE buffer of 1"),
                          (2, "x_scale_stride is 1 .* or 0")]:
        broken = copy.deepcopy(rs)
        next(o for o in broken["ops"] if o["kind"] == "FusedGemm")["fused"][
            "x_scale_stride"] = stride
        with pytest.raises(ValueError, match=match):
            host.check_program(broken)


def test_the_fused_checks_refuse_broken_kernels():
    """check_program refuses a FusedGemm that both waits and releases, whose order is not
    every block once, or whose writers do not match its waits; the race checker sees a kernel
    that reads the local shard before it is copied into the workspace, and a comm stream that
    copies a partial out before the kernel released it."""
    p = fused_clique("ag_matmul", "p2p", 4, chunks=2)[1]
    host.check_program(p)
    for change, match in [
        (lambda f: f.update(release_flags=0), "waits or releases"),
        (lambda f: f["sequence"].pop(), "every block"),
        (lambda f: f["writers"].__setitem__(0, -1), "writer"),
    ]:
        broken = copy.deepcopy(p)
        change(_kernel(broken)["fused"])
        with pytest.raises(ValueError, match=match):
            host.check_program(broken)
    programs = fused_clique("ag_matmul", "p2p", 4, chunks=2)
    check_race_free(programs)
    programs[1]["ops"] = [o for o in programs[1]["ops"]  # the local shard never copied in
                          if not (o["stream"] == 0 and o["kind"] == "Copy")]
    with pytest.raises(ScheduleError, match="race|no write of its call"):
        check_race_free(programs)
    rs = fused_clique("matmul_rs", "p2p", 4, chunks=2)
    check_race_free(rs)
    rs[2]["ops"] = [o for o in rs[2]["ops"] if not (o["stream"] == 1 and o["kind"] == "Wait")]
    with pytest.raises(ScheduleError, match="race|no write of its call"):
        check_race_free(rs)  # a partial copied out before the kernel stored it


def _one_queue(programs, orders):
    """Replays every rank's units in its issue order as ONE FIFO per device (the single work
    queue of CUDA_DEVICE_MAX_CONNECTIONS=1): the head runs once its dependency is met — a Wait
    its flag, a StreamWait its event, a FusedGemm every flag its kernel waits for (it holds every
    SM until then, and the work behind it waits) — then raises what it raises (a Signal its
    peer's flag, a Record its event, a FusedGemm its own release flags). True if all drain."""
    flags, events = set(), set()
    pos = [0] * len(programs)
    progress = True
    while progress:
        progress = False
        for r, (p, order) in enumerate(zip(programs, orders, strict=True)):
            while pos[r] < len(order):
                op = p["ops"][order[pos[r]]]
                if op["kind"] == "Wait" and (r, op["id"]) not in flags:
                    break
                if op["kind"] == "StreamWait" and (r, op["id"]) not in events:
                    break
                parts = fused_blocks(p, op) if op["kind"] == "FusedGemm" else []
                if any(w["kind"] == "Wait" and (r, w["id"]) not in flags for w in parts):
                    break
                if op["kind"] == "Signal":
                    flags.add((op["peer"], op["id"]))
                if op["kind"] == "Record":
                    events.add((r, op["id"]))
                flags |= {(r, s["id"]) for s in parts if s["kind"] == "Signal"}
                pos[r] += 1
                progress = True
    return all(pos[r] == len(o) for r, o in enumerate(orders))


def test_the_issue_order_puts_what_the_fused_gemm_waits_for_before_it():
    """core/issue_order (the executors' order): every fused clique completes when each device
    has one work queue, checked by a replay of its own; the same programs with each rank's
    fused GEMM moved to the front of its order do not (AG: the kernel and the copy of the
    gathered x behind it would hold up the outgoing pushes the peers' kernels wait for)."""
    testing = testing_ext.load()
    for op, transport, n, chunks, bidir in grid(OPS, FUSED_TRANSPORTS, [2, 3, 4, 8], [1, 2],
                                                [False, True]):
        with case(op, transport, n, chunks, bidir):
            gathered = op == "ag_matmul"
            programs = fused_clique(op, transport, n, chunks=chunks, bidirectional=bidir,
                                    return_gathered=gathered)
            orders = [testing.issue_order(op, transport, n, r, 3, chunks, bidir, gathered, True)
                      for r in range(n)]
            assert all(sorted(o) == sorted(set(o)) for o in orders)
            assert _one_queue(programs, orders)
            if op == "ag_matmul":
                kernel_first = []
                for p, order in zip(programs, orders, strict=True):
                    k = next(i for i in order if p["ops"][i]["kind"] == "FusedGemm")
                    kernel_first.append([k] + [i for i in order if i != k])
                assert not _one_queue(programs, kernel_first)
