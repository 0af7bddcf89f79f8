"""The program builders, read through the bindings: order, offsets, bytes, deadlock freedom.

A property that must hold for every problem of a grid is one test looping over the grid (the
builders take microseconds); a failure names its case (``case``).
"""

import contextlib
import copy
import itertools

import pytest

from jaxoverlap._native.runtime import load_host

from .schedule_check import (
    ScheduleError,
    buffer_sizes,
    check_bounds,
    check_deadlock_free,
    check_race_free,
)

# The builders and checkers run no JAX.
pytestmark = pytest.mark.jax_independent

host = load_host()
TRANSPORTS = ("nccl", "p2p", "multicast")
OPS = ("ag_matmul", "matmul_rs")
# GEMM + all-reduce: two-shot (the RS ring, then an AG ring of Y's blocks; multicast: each
# block reduced in the switch) and one-shot ("op/algorithm": every partial to every rank)
ONE_SHOT = "matmul_ar/one_shot"
ALL_OPS = (*OPS, "matmul_ar", ONE_SHOT)


def build(op, transport, n, rank, *, batch=2, rows=6, k=5, n_out=3, dtype="float32", chunks=1,
          bidirectional=False, return_gathered=False):
    op, _, algorithm = op.partition("/")
    return host.build_program(op, transport, n, rank, batch, rows, k, n_out, dtype, chunks,
                              bidirectional, return_gathered, algorithm=algorithm or "two_shot")


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
    batch, rows, k, n_out = 2, 6, 5, 3
    for op, transport, n, chunks, bidir, dtype in grid(
            OPS, ["nccl", "p2p"], [2, 3, 4, 8], [1, 3], [False, True], ["float32", "bfloat16"]):
        elem = 4 if dtype == "float32" else 2
        width = k if op == "ag_matmul" else n_out
        gathered_bytes = batch * n * rows * width * elem
        for r in range(n):
            with case(op, transport, n, chunks, bidir, dtype, r):
                p = build(op, transport, n, r, batch=batch, rows=rows, k=k, n_out=n_out,
                          dtype=dtype, chunks=chunks, bidirectional=bidir)
                sent = sum(o["remote_bytes"] for o in p["ops"])
                assert sent * n == (n - 1) * gathered_bytes, sent


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


# ---- deadlock freedom ----------------------------------------------------------------------

def test_every_clique_is_deadlock_free():
    for values in grid(ALL_OPS, TRANSPORTS, [1, 2, 3, 4, 5, 8], [1, 3], [False, True]):
        op, transport, n, chunks, bidir = values
        with case(*values):
            programs = clique(op, transport, n, chunks=chunks, bidirectional=bidir,
                              return_gathered=op == "ag_matmul")
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
    for op, transport, n, (chunks, bidir) in grid(
            ALL_OPS, TRANSPORTS, [1, 2, 3, 4, 8], [(1, False), (3, True), (2, False), (1, True)]):
        with case(op, transport, n, chunks, bidir):
            programs = clique(op, transport, n, rows=3, k=2, n_out=2, chunks=chunks,
                              bidirectional=bidir, return_gathered=op == "ag_matmul")
            check_race_free(programs)


def test_back_to_back_calls_reuse_buffers_safely():
    """Three calls in a row: parity double-buffering never lets a call clobber data in use."""
    for op, transport, n, (chunks, bidir) in grid(ALL_OPS, TRANSPORTS, [2, 3, 4],
                                                  [(1, False), (2, True)]):
        with case(op, transport, n, chunks, bidir):
            programs = clique(op, transport, n, rows=2, k=2, n_out=2, chunks=chunks,
                              bidirectional=bidir, return_gathered=op == "ag_matmul")
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
    for op, transport, n, (chunks, bidir, gathered) in grid(
            ALL_OPS, TRANSPORTS, [1, 2, 3, 8], [(1, False, False), (3, True, True)]):
        for p in clique(op, transport, n, rows=3, k=2, n_out=5, chunks=chunks,
                        bidirectional=bidir, return_gathered=gathered and op == "ag_matmul"):
            with case(op, transport, n, chunks, bidir, gathered, p["rank"]):
                host.check_program(p)
                check_bounds(p)


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
