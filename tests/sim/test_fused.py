"""The fused path in the model (``sim.fused``): one persistent GEMM waiting on per-block flags.

Where it is offered (Hopper presets, and B200 presets for bf16 with the sm100 kernel; p2p and
multicast, never nccl, the kernel's dtypes and row alignment), that the simulator plays the
executors' own fused programs, the persistent kernel's tiles on timelines computable by hand
(the stock scheduler's static striding in two lanes, or one lane of 2-SM clusters; stalls,
releases), and what it changes at the standard shapes.
"""

from __future__ import annotations

import math

import pytest

from jaxoverlap import sim
from jaxoverlap._executors.runtime import load_host
from jaxoverlap.sim import fused
from jaxoverlap.sim.plan import programs

# The performance model: no JAX.
pytestmark = pytest.mark.jax_independent

US = 1e-6
H100 = sim.get_preset("h100")
AG_STD = sim.Shape.from_global(8192, 8192, 3584, 8)
RS_STD = sim.Shape.from_global(8192, 3584, 8192, 8)


def fused_cands(preset, shape, op, **kw):
    return [c for c in sim.candidates(preset, 8, shape, op=op, **kw) if c.fused]


# ---- where it is offered --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["h100", "h200", "h800"])
def test_offered_on_hopper_with_p2p_and_multicast_only(name):
    p = sim.get_preset(name)
    assert p.compute_capability == (9, 0) and p.fused_gemm
    for op, shape in (("ag_matmul", AG_STD), ("matmul_rs", RS_STD)):
        cands = fused_cands(p, shape, op)
        assert {c.transport for c in cands} == {"p2p", "multicast"}, (name, op)
        assert all(c.impl == "native" and "fused" in c.label for c in cands)
        # the chunked plans are all still there, before the fused ones
        plain = sim.candidates(p, 8, shape, op=op, fused=False)
        assert sim.candidates(p, 8, shape, op=op)[:len(plain)] == plain
        # GEMM + RS scatters every partial straight to its owner: no direction to choose
        directions = {c.bidirectional for c in cands if c.transport == "p2p"}
        assert directions == ({False} if op == "matmul_rs" else {False, True})
    assert not fused_cands(p, sim.Shape(1, 1024, 1024, 8192), "matmul_ar")


@pytest.mark.parametrize("name", ["b200", "gb200-nvl72"])
def test_offered_on_b200_for_16_bit_types_only(name):
    """Compute capability 10.0 runs the sm_100a build, 16-bit only (no FP8 instantiation)."""
    p = sim.get_preset(name)
    assert p.compute_capability == (10, 0) and p.fused_gemm and p.fused_kernel.mma_pair == 2
    for op, shape in (("ag_matmul", AG_STD), ("matmul_rs", RS_STD)):
        for dtype in ("bf16", "f16"):
            cands = fused_cands(p, shape, op, dtype=dtype)
            assert {c.transport for c in cands} == {"p2p", "multicast"}, (name, op, dtype)
    assert not fused_cands(p, AG_STD, "ag_matmul", dtype="float8_e4m3fn")
    assert "sm_100a" in fused.why_not(p, "ag_matmul", "p2p", dtype="float8_e4m3fn")
    assert fused.why_not(p, "ag_matmul", "p2p", dtype="float16") == ""


def test_the_sm100_kernel_rate_is_the_published_persistent_2sm_gemm_over_cublas():
    """The sm_100a kernel's rate alone is derived, not assumed from Hopper: the published
    Blackwell GEMM of its structure (jax-ml/jax docs/pallas/gpu/blackwell_matmul.md, step 5:
    2-SM MMA, static persistent clusters, a dedicated epilogue over two accumulators, no grid
    tiling: 63.38% utilization, cuBLAS 63.38%), not the swizzled one (69.44%) nor CUTLASS's
    best (69.30%), which our raster along N without swizzle does not have. Both Blackwell
    presets take it; the Hopper ones keep theirs."""
    from jaxoverlap.sim import presets

    assert (presets.SM100_PERSISTENT_UTILIZATION, presets.SM100_CUBLAS_UTILIZATION) == (63.38,
                                                                                      63.38)
    for name in ("b200", "gb200-nvl72"):
        p = sim.get_preset(name)
        assert p.fused_gemm_rate == pytest.approx(63.38 / 63.38)
        assert p.fused_gemm_rate < 69.44 / 63.38 and "blackwell_matmul" in p.sources[
            "fused_gemm_rate"]
    assert H100.fused_gemm_rate == 0.975


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bfloat16"])
def test_published_blackwell_fused_rs_losses_stay_unfused_on_b200(dtype):
    """pytorch/pytorch issue #179770: symmetric memory's fused FP8 GEMM + reduce-scatter on
    8xB300 (K 7168, N 16384, M 32-448) ran at 0.30-0.39x of scaled_mm + NCCL's reduce-scatter.
    On a b200 no plan of ours is projected faster than xla there (FP8: no fused GEMM+RS is
    built; bfloat16: the fused kernel's tiles are few and its fixed costs the call's), so the
    unfused path is kept whatever the margins (the ends of the published range of M)."""
    for m in (32, 448):
        shape = sim.Shape(1, max(m // 8, 1), 7168 // 8, 16384)
        choice = sim.choose("matmul_rs", shape, dtype, 8, "b200")
        assert choice.candidate.impl == "xla", (m, choice.format())
        fastest = min(choice.table, key=lambda r: r.t_fused)
        assert fastest.candidate.impl == "xla", (m, choice.format())


@pytest.mark.parametrize("name", ["a100", "a800", "pcie8"])
def test_never_offered_where_neither_kernel_runs(name):
    p = sim.get_preset(name)
    assert not p.fused_gemm and p.compute_capability not in (None, (9, 0), (10, 0))
    for op, shape in (("ag_matmul", AG_STD), ("matmul_rs", RS_STD)):
        assert not fused_cands(p, shape, op)
        assert sim.choose(op, shape, "bf16", 8, p).candidate.fused is False
    with pytest.raises(ValueError, match="compute capability 9.0"):
        sim.simulate("ag_matmul", AG_STD, "bf16", 8, p,
                     sim.Candidate("native", "p2p", 1, False, fused=True))
    # a preset file without the field does not get the fused path
    assert not H100.replace(compute_capability=None).fused_gemm


def test_never_with_nccl_nor_where_the_kernel_cannot_run():
    assert all(c.transport != "nccl" for c in fused_cands(H100, AG_STD, "ag_matmul"))
    with pytest.raises(ValueError, match="never nccl.*deadlock"):
        sim.Candidate("native", "nccl", 1, False, fused=True)
    with pytest.raises(ValueError, match="fused=True needs impl='native'"):
        sim.Candidate("ring", None, fused=True)
    with pytest.raises(ValueError, match="fused=True"):
        sim.Candidate("native", "p2p", algorithm="one_shot", fused=True)
    # the kernel's dtypes and 16-byte rows, as the builders refuse them
    assert not fused_cands(H100, AG_STD, "ag_matmul", dtype="float32")
    assert fused_cands(H100, AG_STD, "ag_matmul", dtype="float16")
    assert not fused_cands(H100, sim.Shape(1, 1024, 8190, 3584), "ag_matmul")
    for dtype, shape, match in (("float32", AG_STD, "compiled for"),
                                ("bf16", sim.Shape(1, 1024, 8192, 3588), "16-byte")):
        with pytest.raises(ValueError, match=match):
            sim.simulate("ag_matmul", shape, dtype, 8, H100,
                         sim.Candidate("native", "p2p", 1, False, fused=True))


# ---- the programs: the executors' own --------------------------------------------------------


def _stream0(program):
    return [o for o in program["ops"] if o["stream"] == 0]


def _moves(program):
    """The comm streams' ops of a program, as they move data and flags (not the text, which
    says a flag's value: the epoch, or 1 in a replayable program)."""
    return [{k: v for k, v in o.items() if k != "text"} for o in program["ops"]
            if o["stream"] > 0]


def test_the_model_plays_the_executors_fused_programs():
    """The simulator's fused programs are ``_host.build_program(..., fused=True)``, plain or
    built replayable as the candidate asks (``replayable``; refused where the program builder
    does not build it so: the gate the lowering applies too); AG's comm streams are the chunked
    programs' (the plain one's; the replayable one pushes each shard straight to every peer,
    docs/gpu-internals.md §8), and its host enqueues fewer ops (one kernel where the chunked
    program has a wait and a GEMM per block) — a replayable one's comm streams end with the
    acknowledgement (the wait for the reader's acknowledgement, then its reset)."""
    host = load_host()
    for op, transport, chunks, bidi in (("ag_matmul", "p2p", 2, True),
                                        ("ag_matmul", "multicast", 1, False),
                                        ("matmul_rs", "p2p", 2, False),
                                        ("matmul_rs", "multicast", 1, False)):
        shape = AG_STD if op == "ag_matmul" else RS_STD
        problem = dict(op=op, transport=transport, nranks=8, batch=1, rows=shape.rows,
                       k=shape.k, n=shape.n, dtype="bfloat16", chunks=chunks,
                       bidirectional=bidi, fused=True)
        builds = host.replay_refusal(problem) == ""
        if (op, transport) == ("ag_matmul", "p2p"):  # the builder's replayable program
            assert builds
        if not builds:
            with pytest.raises(ValueError, match="not built replayable"):
                programs(op, transport, 8, shape, "bfloat16", chunks, bidi, False, fused=True,
                         replayable=True)
        for replayable in (False, True) if builds else (False,):
            got = programs(op, transport, 8, shape, "bfloat16", chunks, bidi, False,
                           fused=True, replayable=replayable)
            assert list(got) == [host.build_program(op, transport, 8, r, 1, shape.rows,
                                                    shape.k, shape.n, dtype="bfloat16",
                                                    chunks=chunks, bidirectional=bidi,
                                                    fused=True, replayable=replayable)
                                 for r in range(8)]
            chunked = programs(op, transport, 8, shape, "bfloat16", chunks, bidi, False,
                               replayable=replayable)  # the chunked program of the same kind
            for f, c in zip(got, chunked, strict=True):
                assert f["replayable"] is replayable
                assert [o["kind"] for o in _stream0(f)].count("FusedGemm") == 1
                if op == "ag_matmul":  # the same transfers, fewer ops
                    assert len(f["ops"]) < len(c["ops"])
                    moves = [o for o in _moves(f) if o["kind"] != "Record"]
                    if replayable:  # each comm stream's acknowledgement: its wait, its reset
                        tails = [i for i, o in enumerate(moves) if o["kind"] == "ResetFlags"]
                        assert tails and all(moves[i - 1]["kind"] == "Wait" for i in tails)
                    else:  # the replayable one pushes each shard straight to every peer
                        assert moves == _moves(c)


# ---- the kernel, tile by tile, on timelines computable by hand --------------------------------

# 4 SMs of 1 TFLOP/s, no shape penalty but the kernel's own tiles, no costs but the flags'.
TOY = sim.Preset(
    name="toy-hopper", gpu="toy", sms=4, compute_capability=(9, 0), fused_gemm_rate=1.0,
    fused_gemm_tile=(128, 256), peak_tflops={"bfloat16": 1.0, "float16": 1.0, "float32": 1.0},
    gemm_efficiency=1.0, hbm_gbps=1e12, link_gbps=10.0, nccl_gbps=5.0, p2p_gbps=10.0,
    multicast_gbps=10.0, gemm_k_half=0.0, gemm_tiles=(), gemm_overhead_us=0.0,
    signal_latency_us=0.0, event_latency_us=0.0, interference=0.0, host_op_us=0.0,
    host_call_us=0.0, ar_start_us=0.0)
K = 1024
TAU = 4 * 2 * 128 * 256 * K / 1e12  # one 128x256 tile on one of the 4 SMs


def kernel_program(releases=False):
    """One rank: stream 0 runs a fused GEMM over shard A (640 rows, 5 tiles, in place) and
    shard B (5 tiles) whose flag (1) stream 1 raises at once (visible a Signal's latency later);
    releasing, A's release flag (5) is what stream 1 waits for instead."""
    f = {"shards": 2, "chunks": 1, "shard_rows": 640, "sequence": [0, 1],
         "order": "first_departure" if releases else "last_arrival",
         "wait_flags": -1 if releases else 0, "ready_shard": -1 if releases else 0,
         "writers": [] if releases else [-1, 0], "release_flags": 5 if releases else -1}
    kernel = {"kind": "FusedGemm", "stream": 0, "batch": 1, "m": 1280, "n": 256, "k": K,
              "accumulate": False, "bytes": 0, "fused": f, "text": "FusedGemm"}
    comm = ([{"kind": "Wait", "stream": 1, "id": 5, "peer": 0, "text": "Wait(5)"}] if releases
            else [{"kind": "Signal", "stream": 1, "peer": 0, "id": 1, "text": "Signal(1)"}])
    return [{"rank": 0, "nranks": 1, "num_streams": 2, "dtype": "bfloat16", "elem_bytes": 2,
             "ops": [kernel, *comm]}]


def run_kernel(flag_at, **kw):
    p = TOY.replace(signal_latency_us=flag_at / US)
    return sim.simulate_programs(kernel_program(**kw), p)


def test_the_kernel_alone_is_its_gemm_in_whole_waves():
    # 10 tiles on 4 CTAs (2 clusters): 3 waves, the last partial (one quantisation, once)
    tl = run_kernel(0.0)
    assert tl.total == pytest.approx(3 * TAU)
    plan = fused.tile_plan(TOY, "bfloat16", kernel_program()[0]["ops"][0])
    assert [(lane.units, lane.ctas) for lane in plan.lanes] == [(5, 2), (5, 2)]
    assert plan.alone == pytest.approx(3 * TAU)


@pytest.mark.parametrize(("flag_at", "end"), [
    # M slot s holds tile s (A first): the even slots are lane 0, the odd lane 1. Lane 0's CTA
    # 0 takes slots 0, 4, 8, its CTA 1 slots 2, 6; lane 1's CTA 0 slots 1, 5, 9, its CTA 1
    # slots 3, 7. Slots 0-4 are A, 5-9 are B: CTA 1 of both lanes and lane 1's CTA 0 reach B
    # at TAU, lane 0's CTA 0 at 2 TAU.
    (0.5, 3.0),   # B arrived before any CTA needed it: no stall
    (1.5, 3.5),   # lane 1's CTA 0 waits 0.5 TAU for slot 5, then slot 9: carried to the end
    (4.0, 6.0),   # comm-bound: lane 1's CTA 0 runs its two B tiles after the arrival
])
def test_a_late_block_stalls_the_ctas_whose_next_tile_reads_it(flag_at, end):
    assert run_kernel(flag_at * TAU).total == pytest.approx(end * TAU)


def test_a_block_is_released_when_its_last_tile_is_stored():
    # A's five tiles: slots 0-3 end at TAU, slot 4 (lane 0's CTA 0's second) at 2 TAU
    tl = run_kernel(0.0, releases=True)
    (wait,) = [s for s in tl.of(0, 1) if s.kind == "Wait"]
    assert wait.end == pytest.approx(2 * TAU)


@pytest.mark.parametrize("releases", [False, True])
def test_the_kernel_starts_after_the_zero_fill_of_its_state(releases):
    """A fused GEMM that waits zero-fills its fault record, one that releases its tile
    counters, by a cudaMemsetAsync on its stream before the kernel (cpp/cuda/executor.cc,
    fused_gemm_enqueue.cuh): one kernel start of GPU time before the tiles, one more operation
    for the host to enqueue."""
    fill = 0.25 * TAU
    tl = sim.simulate_programs(kernel_program(releases), TOY.replace(ar_start_us=fill / US))
    (kernel,) = [s for s in tl.spans if s.kind == "FusedGemm"]
    assert kernel.start == 0.0 and kernel.end == pytest.approx(fill + 3 * TAU)
    (program,) = kernel_program(releases)
    assert sim.model.host_ops(program) == len(program["ops"]) + 1
    neither = dict(program["ops"][0], fused=dict(program["ops"][0]["fused"], wait_flags=-1,
                                                  release_flags=-1))
    assert fused.fill_seconds(TOY.replace(ar_start_us=1.0), neither) == 0.0
    assert sim.model.host_ops({"ops": [neither]}) == 1


TOY_B200 = TOY.replace(name="toy-blackwell", compute_capability=(10, 0))


@pytest.mark.parametrize(("flag_at", "end"), [
    # 2-SM MMA: the order is over 256-row MMA tiles (0, 1 of A; 2 straddles A and B; 3, 4 of
    # B), one lane of 2 clusters: cluster 0 takes tiles 0, 2, 4, cluster 1 tiles 1, 3, each in
    # one CTA tile's time (both CTAs at once). Tile 2 waits for B, for its upper half's rows.
    (0.5, 3.0),   # B arrived before tile 2 starts: the kernel alone
    (1.5, 3.5),   # both clusters wait 0.5 TAU (tiles 2 and 3), cluster 0 carries it to the end
    (4.0, 6.0),   # comm-bound: cluster 0 runs tiles 2 and 4 after the arrival
])
def test_the_sm100_kernel_plays_one_lane_of_256_row_tiles(flag_at, end):
    plan = fused.tile_plan(TOY_B200, "bfloat16", kernel_program()[0]["ops"][0])
    assert [(lane.units, lane.ctas) for lane in plan.lanes] == [(5, 2)]
    assert plan.alone == pytest.approx(3 * TAU)
    # the MMA tile straddling the shards waits for B (the sm90 CTA tile of rows 512-639 not)
    (lane,) = plan.lanes
    assert [run.waits for run in lane.runs if run.start <= 2 < run.end] == [(1,)]
    p = TOY_B200.replace(signal_latency_us=flag_at * TAU / US)
    assert sim.simulate_programs(kernel_program(), p).total == pytest.approx(end * TAU)


def test_the_fused_rate_scales_the_tile_work():
    slow = TOY.replace(fused_gemm_rate=0.8)
    tl = sim.simulate_programs(kernel_program(), slow)
    assert tl.total == pytest.approx(3 * TAU / 0.8)


# ---- at the standard shapes -----------------------------------------------------------------

FREE = H100.replace(link_gbps=1e7, p2p_gbps=1e7, multicast_gbps=1e7, nccl_gbps=1e7,
                    nccl_p2p_gbps=1e7, ce_latency_us=0.0, ce_ramp_us=0.0, mc_latency_us=0.0,
                    mc_ramp_us=0.0, signal_latency_us=0.0, event_latency_us=0.0,
                    interference=0.0, host_op_us=0.0, host_call_us=0.0, graph_node_us=0.0)


def test_one_kernel_pays_one_quantisation_and_one_launch():
    """With free communication the fused call is the local shard's copy into the workspace,
    then its GEMM alone: the whole GEMM's cuBLAS time at the fused rate, against the chunked
    call's eight quantised, launched GEMMs."""
    f = sim.simulate("ag_matmul", AG_STD, "bf16", 8, FREE,
                     sim.Candidate("native", "p2p", 1, False, fused=True))
    c = sim.simulate("ag_matmul", AG_STD, "bf16", 8, FREE, sim.Candidate("native", "p2p", 1))
    t_gemm = sim.gemm_time(FREE, "bf16", 1, 8192, 3584, 8192)
    overhead = FREE.gemm_overhead_us * US
    fill = FREE.ar_start_us * US  # the zero-fill of its fault record, a kernel before it
    (copy,) = [s for s in f.spans if s.rank == 0 and s.stream == 0 and s.kind == "Copy"]
    assert copy.start == 0.0
    kernel = fill + overhead + (t_gemm - overhead) / FREE.fused_gemm_rate
    assert f.t_fused == pytest.approx(copy.end + kernel, rel=1e-3)
    assert f.t_compute == pytest.approx(kernel, rel=1e-3)
    assert c.t_fused > f.t_fused and c.t_compute > 8 * sim.gemm_time(FREE, "bf16", 1, 1024,
                                                                       3584, 8192) * 0.999


@pytest.mark.parametrize(("m", "k", "n", "exposed"), [
    # AG std: 64 M tiles x 14 N tiles, two lanes of 448 units on 66 CTAs each; the local
    # shard's 4 M slots per lane are 56 units, so CTAs 56-65 of each lane wait for the first
    # remote block; 448 = 6 x 66 + 52: those CTAs have one unit fewer, and the wait is absorbed
    (8192, 8192, 3584, False),
    # AG flux: 32 x 24 tiles, 384 units per lane = 5 x 66 + 54; the local 2 M slots per lane
    # are 48 units, so CTAs 48-65 wait, and CTAs 48-53 also have the most units: exposed
    (4096, 12288, 6144, True),
])
def test_the_first_remote_block_and_static_striding(m, k, n, exposed):
    """Copies fast enough that only the first remote block can be late (GEMM-bound after):
    the call is the local copy and the kernel alone, plus the first block's arrival when the
    CTAs that wait for it are among those with the most units."""
    fast = H100.replace(link_gbps=1e7, p2p_gbps=1e7, ce_latency_us=20.0, ce_ramp_us=0.0,
                        signal_latency_us=6.61, event_latency_us=6.61,
                        interference=0.0, host_op_us=0.0, host_call_us=0.0, graph_node_us=0.0)
    r = sim.simulate("ag_matmul", sim.Shape.from_global(m, k, n, 8), "bf16", 8, fast,
                     sim.Candidate("native", "p2p", 1, False, fused=True))
    (copy,) = [s for s in r.spans if s.rank == 0 and s.stream == 0 and s.kind == "Copy"]
    (kernel,) = [s for s in r.spans if s.rank == 0 and s.kind == "FusedGemm"]
    assert kernel.start == pytest.approx(copy.end)
    # the first remote block (shard 7 on rank 0) is visible one flag latency after the Signal
    # (its comm stream's first: the replayable program's compute stream signals only its
    # acknowledgement, after the kernel)
    signal = next(s for s in r.spans if s.rank == 7 and s.stream > 0 and s.kind == "Signal")
    first = signal.end + fast.signal_latency_us * US
    # before the first tile: the zero-fill of the fault record, then the launch
    overhead = (fast.ar_start_us + fast.gemm_overhead_us) * US
    if exposed:
        assert kernel.end == pytest.approx(first + r.t_compute - overhead, rel=1e-9)
        assert first > copy.end + overhead
    else:
        assert kernel.end == pytest.approx(copy.end + r.t_compute, rel=1e-9)


def test_the_fused_rs_never_waits_so_no_chunking_deadlocks():
    """GEMM + RS releases only (docs/gpu-internals.md §5): tiles straddling blocks and shards, every
    chunking, both transports, simulate to the end; over p2p with one sub-chunk the sum of the
    N partials (one Reduce) has nothing to overlap and runs after the kernel."""
    tiny = sim.Shape.from_global(64, 256, 256, 8)  # 8 rows per shard: one tile over all blocks
    for transport in ("p2p", "multicast"):
        for chunks in (1, 2, 4, 8):
            r = sim.simulate("matmul_rs", tiny, "bf16", 8, H100,
                             sim.Candidate("native", transport, chunks, False, fused=True))
            assert math.isfinite(r.t_fused)
    r = sim.simulate("matmul_rs", RS_STD, "bf16", 8, H100,
                     sim.Candidate("native", "p2p", 1, False, fused=True))
    mine = [s for s in r.spans if s.rank == 0]
    kernel = next(s for s in mine if s.kind == "FusedGemm")
    (reduce,) = [s for s in mine if s.kind == "Reduce"]
    assert not [s for s in mine if s.kind == "Add"] and reduce.start >= kernel.end


@pytest.mark.slow  # several choices at the standard shape: seconds
def test_standard_ag_h100_picks_fused_near_the_published_fused_kernels():
    """AG std on 8xH100: a fused plan, projected above the margin and no more than 5% above
    the best published fused kernel on an H100 at that shape (P2/8192, 1.36x)."""
    choice = sim.choose("ag_matmul", AG_STD, "bf16", 8, "h100")
    best = choice.best
    assert best.candidate.fused and "fused" in best.candidate.label, choice.format()
    assert 1 + H100.margin("ag_matmul", "ag_matmul:fused") < best.speedup_vs_xla <= 1.05 * 1.36
    chunked = min((r for r in choice.table if r.candidate.impl == "native"
                   and not r.candidate.fused), key=lambda r: r.t_fused)
    assert best.t_fused < chunked.t_fused
    # robust to the assumed kernel rate: the lowest published large-tile ratio keeps it
    low = sim.choose("ag_matmul", AG_STD, "bf16", 8, H100.replace(fused_gemm_rate=0.90))
    assert low.best.candidate.fused
    # every Hopper preset picks it; a GPU without a fused kernel cannot
    for name in ("h200", "h800"):
        assert sim.choose("ag_matmul", AG_STD, "bf16", 8, name).candidate.fused, name
    assert not sim.choose("ag_matmul", AG_STD, "bf16", 8, "a100").candidate.fused  # no kernel


@pytest.mark.slow  # two choices at the standard shape: seconds
def test_standard_rs_h100_picks_the_fused_program_reducing_beside_the_kernel():
    """RS std is F8/8192's shape on F8's machine, where Flux's fused GEMM+RS lost (0.84x; its
    mechanism priced by the model: 1.05x, sim.reduction.pulled). The fused program that
    reduces each round beside the kernel (multicast) answers to the copy-engine designs it is
    built from (Triton-distributed: 1.23x at nearly this shape on 8xH100, PR #166) and is
    picked: the fastest plan, above its family's margin; the release-only fused GEMM+RS (its
    reduction after the kernel: over p2p a copy and 7 adds of the own block), whose margin
    Flux's rows set, is slower."""
    choice = sim.choose("matmul_rs", RS_STD, "bf16", 8, "h100")
    fastest = min(choice.table, key=lambda r: r.t_fused)
    assert choice.best is fastest and fastest.candidate.fused, choice.format()
    assert fastest.candidate.transport == "multicast"
    assert sim.families.family("matmul_rs", fastest.candidate) == "matmul_rs:overlapped"
    for r in choice.table:
        if sim.families.family("matmul_rs", r.candidate) == "matmul_rs:fused":
            assert r.t_fused > fastest.t_fused
    assert fastest.speedup_vs_xla > 1 / (1 - H100.margin("matmul_rs", "matmul_rs:overlapped"))


def test_the_fused_time_never_beats_its_kernel_alone_nor_the_ideal():
    for op, shape in (("ag_matmul", AG_STD), ("matmul_rs", RS_STD),
                      ("ag_matmul", sim.Shape.from_global(2048, 8192, 3584, 8)),
                      ("matmul_rs", sim.Shape(2, 256, 1024, 2048))):
        for c in fused_cands(H100, shape, op, chunk_options=(1, 4)):
            r = sim.simulate(op, shape, "bf16", 8, H100, c)
            assert r.t_fused >= r.t_compute * (1 - 1e-9), (op, c)
            assert r.speedup <= r.ideal_speedup * (1 + 1e-9), (op, c)
            assert math.isfinite(r.t_fused)
