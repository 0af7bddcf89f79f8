"""The fused GEMM's tiles, row blocks, flags and tile order (``cpp/core/fused_tiles.h``).

The header is compiled into the kernel and, here, into ``jaxoverlap_testing`` (the same source).
Its answers are checked against what does not come from it: the row blocks and flag ids the
program builders give each (shard, sub-chunk) (``_host.build_program``: every Wait's flag and the
rows of the GEMM after it), the arrival order of the AG programs' waits and the compute order of
the RS programs' chunks, and brute force in Python (the block of every row by scanning, each
tile's order key by looking at every row of the tile, the order by sorting).
"""

from __future__ import annotations

import itertools

import pytest
import testing_ext

from jaxoverlap._executors.runtime import load_host

host = load_host()
tiles_ext = testing_ext.load()
pytestmark = pytest.mark.jax_independent

K = 8  # the programs' k (row length of x), to turn offsets into rows
NS = range(2, 9)
CHUNKS = range(1, 5)
SHARD_ROWS = (4, 7, 13, 64, 130)  # even and uneven splits into chunks
TILE_ROWS = (1, 5, 16, 128)


def _program(op, transport, n, rank, rows, chunks, bidirectional):
    return host.build_program(op, transport, n, rank, 1, rows, K, 8, "bfloat16", chunks,
                              bidirectional)


def _gemm_rows(op, rank, rows):
    """The rows of the M dimension a program GEMM works on: [begin, end)."""
    a = op["a"]
    shard_start = rank * rows if a["buf"] == "X" and op["kind"] == "Gemm" else 0
    begin = shard_start + a["offset"] // K
    return begin, begin + op["m"]


def _ag_blocks_and_arrivals(n, rank, rows, chunks, transport, bidirectional):
    """From an AG program: {flag: rows} of every block and the blocks in arrival order (the
    local shard first, then each stream-0 Wait's flag in order)."""
    ops = _program("ag_matmul", transport, n, rank, rows, chunks, bidirectional)["ops"]
    blocks, arrivals, waited = {}, [], None
    for op in (o for o in ops if o["stream"] == 0):
        if op["kind"] == "Wait":
            waited = op["id"]
        elif op["kind"] == "Gemm":
            if op["a"]["buf"] == "X":  # the local shard: no flag, labelled (shard, sub)
                block = op["shard"] * chunks + op["sub"]
                blocks[block] = _gemm_rows(op, rank, rows)
            else:
                block = waited
                blocks[block] = (op["a"]["offset"] // K, op["a"]["offset"] // K + op["m"])
            arrivals.append(block)
    return blocks, arrivals


def _rs_departures(n, rank, rows, chunks, transport, bidirectional):
    """From an RS program: the blocks in the order their partial products are computed (and
    leave), with their rows."""
    ops = _program("matmul_rs", transport, n, rank, rows, chunks, bidirectional)["ops"]
    gemms = [o for o in ops if o["stream"] == 0 and o["kind"] == "Gemm"]
    return [(g["shard"] * chunks + g["sub"], (g["a"]["offset"] // K,
                                              g["a"]["offset"] // K + g["m"])) for g in gemms]


def _tile_blocks(block_rows, rows, tile_rows, tile):
    """The blocks a tile's rows touch, by scanning every row of it."""
    begin, end = tile * tile_rows, min((tile + 1) * tile_rows, rows)
    return sorted({b for row in range(begin, end)
                   for b, (lo, hi) in enumerate(block_rows) if lo <= row < hi})


def test_row_blocks_are_the_programs_flagged_blocks():
    """Block b = (shard, sub) is exactly the rows the programs multiply after waiting on flag b
    (AG, every transport and direction) and the rows of RS's chunk (shard, sub)."""
    for n, chunks, rows in itertools.product(NS, CHUNKS, SHARD_ROWS):
        m = tiles_ext.fused_mapping(n, chunks, rows, 128)
        assert m["blocks"] == n * chunks and m["rows"] == n * rows
        seen = {}
        for transport, bidi in (("p2p", False), ("p2p", True), ("multicast", False)):
            for rank in {0, n - 1, n // 2}:
                blocks, _ = _ag_blocks_and_arrivals(n, rank, rows, chunks, transport, bidi)
                seen.update(blocks)
                for block, (begin, _) in blocks.items():
                    assert m["shard_of_block"][block] == begin // rows
        for rank in {0, n - 1}:
            for block, block_rows in _rs_departures(n, rank, rows, chunks, "p2p", True):
                assert tuple(m["block_rows"][block]) == block_rows, ("rs", n, chunks, rows)
        assert sorted(seen) == list(range(n * chunks))
        assert [tuple(r) for r in m["block_rows"]] == [seen[b] for b in range(n * chunks)], (
            n, chunks, rows)
        # Every row lies in exactly the block BlockOf names.
        for row, block in enumerate(m["block_of_row"]):
            lo, hi = m["block_rows"][block]
            assert lo <= row < hi


def test_every_tile_waits_for_exactly_the_blocks_its_rows_touch():
    """Each tile's (first, last) blocks are the blocks its rows touch — all of them, so its flags
    cover every row it reads, and no other; each block's tiles are the inverse; a padding tile
    past the last row touches none. The grid has tiles inside one block, tiles straddling
    sub-chunks and tiles straddling shards."""
    inside = straddling_chunks = straddling_shards = 0
    for n, chunks, rows, tile_rows in itertools.product(NS, CHUNKS, SHARD_ROWS, TILE_ROWS):
        m = tiles_ext.fused_mapping(n, chunks, rows, tile_rows)
        total = n * rows
        assert m["tiles"] == -(-total // tile_rows)
        block_rows = m["block_rows"]
        for tile in range(m["tiles"]):
            touched = _tile_blocks(block_rows, total, tile_rows, tile)
            first, last = m["blocks_of_tile"][tile]
            assert list(range(first, last + 1)) == touched, (n, chunks, rows, tile_rows, tile)
            shards = {m["shard_of_block"][b] for b in touched}
            inside += len(touched) == 1
            straddling_chunks += len(touched) > 1 and len(shards) == 1
            straddling_shards += len(shards) > 1
        assert tuple(m["blocks_of_tile"][m["tiles"]]) == (0, -1)  # padding tile: no block
        for block, (first, last) in enumerate(m["tiles_of_block"]):
            expected = [t for t in range(m["tiles"])
                        if block in _tile_blocks(block_rows, total, tile_rows, t)]
            assert list(range(first, last + 1)) == expected
    assert inside and straddling_chunks and straddling_shards


def _expected_order(m, sequence, key):
    """Tiles sorted by (key, index): the key is the position in the sequence of the last block
    a tile reads (AG) or the first block it writes (RS)."""
    position = {b: i for i, b in enumerate(sequence)}
    pick = max if key == "last_arrival" else min
    keyed = []
    for tile in range(m["tiles"]):
        first, last = m["blocks_of_tile"][tile]
        keyed.append((pick(position[b] for b in range(first, last + 1)), tile))
    return [tile for _, tile in sorted(keyed)]


def test_tile_order_follows_arrival_and_departure_order():
    """The order is a permutation of the tiles (a slot past the end maps to itself): AG tiles
    by the arrival of the last block they read — the local shard's own tiles first — and RS
    tiles by the departure of the first block they write, ties by tile index; for every
    program's order, every transport and direction."""
    checked = 0
    for n, chunks, rows, tile_rows in itertools.product(NS, CHUNKS, SHARD_ROWS, TILE_ROWS):
        m = tiles_ext.fused_mapping(n, chunks, rows, tile_rows)
        rank = n // 2
        orders = []
        for transport, bidi in (("p2p", False), ("p2p", True), ("multicast", False)):
            _, arrivals = _ag_blocks_and_arrivals(n, rank, rows, chunks, transport, bidi)
            orders.append((arrivals, "last_arrival"))
        for bidi in (False, True):
            departures = [b for b, _ in _rs_departures(n, rank, rows, chunks, "p2p", bidi)]
            orders.append((departures, "first_departure"))
        for sequence, key in orders:
            assert sorted(sequence) == list(range(n * chunks))
            got = tiles_ext.fused_order(n, chunks, rows, tile_rows, sequence, key)
            assert sorted(got["tiles"][:-1]) == list(range(m["tiles"]))
            assert got["tiles"][-1] == m["tiles"]  # padding slot: unchanged
            assert got["tiles"][:-1] == _expected_order(m, sequence, key), (
                n, chunks, rows, tile_rows, key, sequence)
            assert 1 <= got["runs"] <= min(64, m["tiles"])
            if key == "last_arrival":  # tiles wholly in the local shard come first
                local = [t for t in range(m["tiles"])
                         if {m["shard_of_block"][b] for b in range(
                             m["blocks_of_tile"][t][0], m["blocks_of_tile"][t][1] + 1)} == {rank}]
                assert got["tiles"][:len(local)] == local
            checked += 1
    assert checked == len(NS) * len(CHUNKS) * len(SHARD_ROWS) * len(TILE_ROWS) * 5


@pytest.mark.parametrize(("sequence", "error"), [
    ([0, 1, 2], "bad_sequence"),        # a block missing
    ([0, 1, 2, 2], "bad_sequence"),     # a block twice
    ([0, 1, 2, 4], "bad_sequence"),     # no such block
    ([0, -1, 2, 3], "bad_sequence"),
])
def test_tile_order_refuses_a_sequence_that_is_not_every_block_once(sequence, error):
    with pytest.raises(ValueError, match=error):
        tiles_ext.fused_order(2, 2, 8, 4, sequence, "last_arrival")


def _never_continuing(blocks):
    """0, last, 2, last - 2, ...: no block arrives right after the one before it in memory."""
    return [b for pair in zip(range(0, blocks, 2), range(blocks - 1, 0, -2), strict=True)
            for b in pair]


def test_tile_order_refuses_more_runs_than_the_kernel_parameters_hold():
    """One-row blocks and tiles in an order that never continues a run: 64 runs fit the
    kernel's parameters, 100 do not."""
    assert tiles_ext.fused_order(64, 1, 1, 1, _never_continuing(64), "last_arrival")["runs"] == 64
    with pytest.raises(ValueError, match="too_many_runs"):
        tiles_ext.fused_order(100, 1, 1, 1, _never_continuing(100), "last_arrival")


def test_the_spare_sms_cost_no_wave_and_the_model_leaves_the_same():
    """SpareSms (what a release-only fused GEMM leaves to the reduction beside it): the most,
    up to ``most``, that keep the persistent grid's number of waves; two when even two cost one;
    always even. ``jaxoverlap.sim.fused.spare`` mirrors it exactly."""
    from jaxoverlap.sim import fused as model

    def waves(m_tiles, n_tiles, batch, sms):
        g = tiles_ext.fused_grid(m_tiles, n_tiles, batch, sms)
        return -(-len(g["units"]) // g["ctas"])

    assert tiles_ext.fused_spare_sms(64, 32, 1, 132, 16) == 4  # 2048 tiles: 16 waves on 128
    assert tiles_ext.fused_spare_sms(256, 32, 1, 132, 16) == 2  # 8192: 63 waves, 64 on 130
    assert tiles_ext.fused_spare_sms(4, 1, 1, 132, 16) == 16  # 4 tiles: any 16 are free
    for m_tiles, n_tiles, batch, sms, most in itertools.product(
            (1, 3, 32, 64, 65), (1, 14, 32), (1, 2), (8, 78, 132), (0, 2, 5, 16)):
        got = tiles_ext.fused_spare_sms(m_tiles, n_tiles, batch, sms, most)
        assert got == model.spare(m_tiles, n_tiles, batch, sms, most)
        if most < 2:
            assert got == 0
            continue
        assert got % 2 == 0 and 2 <= got <= most
        full = waves(m_tiles, n_tiles, batch, sms)
        if got > 2:
            assert waves(m_tiles, n_tiles, batch, sms - got) == full
        for more in range(got + 2, min(most, sms - 2) + 1, 2):  # the most that keeps the waves
            assert waves(m_tiles, n_tiles, batch, sms - more) > full


def test_mapping_refuses_invalid_row_blocks():
    with pytest.raises(ValueError, match="shard_rows >= chunks"):
        tiles_ext.fused_mapping(2, 4, 3, 16)  # a sub-chunk without rows
    with pytest.raises(ValueError, match="bad_blocks"):
        tiles_ext.fused_order(600, 1, 1, 1, list(range(600)), "last_arrival")  # > 512 blocks


def test_the_persistent_grid_is_the_stock_schedulers_and_the_models():
    """PersistentGrid (the stock sm90 scheduler's static striding, which the fake and the model
    use): every unit of work is one (batch, M slot, N tile), each exactly once; the two CTAs of
    a cluster take the two M slots of a pair (a CTA's slots all have its parity); 132 SMs give
    132 CTAs (an H100's whole grid: 7 GPCs of 18 and the 6 of the last); fewer units than SMs
    give one CTA per unit; ``jaxoverlap.sim.fused`` mirrors it exactly."""
    from jaxoverlap.sim import fused as model

    assert tiles_ext.fused_grid(64, 14, 1, 132)["ctas"] == 132
    assert tiles_ext.fused_grid(3, 1, 1, 132)["ctas"] == 4  # 3 M tiles: 4 slots, a padding one
    for m_tiles, n_tiles, batch, sms in itertools.product((1, 2, 3, 8, 65), (1, 3, 14), (1, 2),
                                                          (2, 5, 17, 20, 114, 132)):
        g = tiles_ext.fused_grid(m_tiles, n_tiles, batch, sms)
        units = [tuple(u) for u in g["units"]]
        assert g["m_slots"] == m_tiles + m_tiles % 2
        assert sorted(units) == sorted(itertools.product(range(batch), range(g["m_slots"]),
                                                         range(n_tiles)))
        assert g["ctas"] % 2 == 0 and 2 <= g["ctas"] <= sms - sms % 2
        assert g["ctas"] == min(sms - sms % 2, len(units))
        for c in range(g["ctas"]):
            assert {units[i][1] % 2 for i in range(c, len(units), g["ctas"])} == {c % 2}
        assert model.grid(m_tiles, n_tiles, batch, sms) == (g["m_slots"], g["ctas"])
        assert [model.unit(i, g["m_slots"], n_tiles) for i in range(len(units))] == units


def test_the_fused_programs_orders_are_tile_orders():
    """Every fused program's block order makes a tile order the kernel's parameters hold (AG: the
    local shard first; RS: rounds of sub-chunks, p2p's destinations r-1, r-2, ..., the own
    block last, multicast's 0, 1, ..., N-1 on every rank)."""
    for n, chunks, rows in itertools.product(NS, CHUNKS, SHARD_ROWS):
        for op, transport in itertools.product(("ag_matmul", "matmul_rs"), ("p2p", "multicast")):
            rank = n // 2
            p = host.build_program(op, transport, n, rank, 1, rows, K, 8, "bfloat16", chunks,
                                   True, fused=True)
            (kernel,) = [o for o in p["ops"] if o["kind"] == "FusedGemm"]
            f = kernel["fused"]
            got = tiles_ext.fused_order(n, f["chunks"], rows, 128, f["sequence"], f["order"])
            assert 1 <= got["runs"] <= 64
            c = f["chunks"]
            if op == "ag_matmul":
                assert [b // c for b in f["sequence"][:c]] == [rank] * c
            else:
                dests = [(rank - 1 - t) % n for t in range(n)] if transport == "p2p" else range(n)
                assert f["sequence"] == [d * c + s for s in range(c) for d in dests]


def test_each_kernels_cta_tile_is_one_definition_on_both_sides():
    """``fused_tiles.h`` ``CtaTileOf`` (the tile the kernels' static_asserts hold their shapes
    to, the fake computes with and the CUDA executor counts SpareSms's waves over) and
    ``_fused_gemm.FUSED_KERNELS`` (the performance model's) give every kernel the same tile,
    for 16-bit operands and for FP8 where the kernel has an FP8 build; and the sm_90a FP8
    kernel's is not its 16-bit one's (half as wide), so one tile for every kernel fails here."""
    from jaxoverlap._fused_gemm import FUSED_KERNELS

    for cc, kernel in FUSED_KERNELS.items():
        assert tiles_ext.fused_cta_tile(kernel.mma_pair, False) == kernel.tile, cc
        if kernel.fp8_tile is not None:
            assert tiles_ext.fused_cta_tile(kernel.mma_pair, True) == kernel.fp8_tile, cc
    assert tiles_ext.fused_cta_tile(1, True) == (128, 128)
    assert tiles_ext.fused_cta_tile(1, False) == (128, 256)
    assert FUSED_KERNELS[(9, 0)].tile_for("float8_e4m3fn") == (128, 128)
    assert FUSED_KERNELS[(10, 0)].tile_for("float8_e4m3fn") is None  # no sm_100a FP8 build
