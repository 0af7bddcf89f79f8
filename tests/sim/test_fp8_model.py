"""The performance model with fp8 operands: the GEMM at the FP8 peak, half the bytes of x, the
executors' own FP8 programs (each shard's scale moved with it)."""

import dataclasses

import pytest

from jaxoverlap import sim
from jaxoverlap.sim import fused, model
from jaxoverlap.sim import plan as sim_plan

# The performance model: no JAX.
pytestmark = pytest.mark.jax_independent

H100 = sim.get_preset("h100")
AG = sim.Shape.from_global(8192, 8192, 3584, 8)
RS = sim.Shape.from_global(8192, 3584, 8192, 8)


def test_an_fp8_gemm_runs_at_its_own_fit_of_the_fp8_peak():
    """FP8 GEMMs are priced by their own fit (published FP8 GEMMs), not the BF16 efficiency at
    the FP8 peak: at the fit's best shape they reach its efficiency of the FP8 peak, and an
    8192^3 GEMM's FP8 / BF16 speed ratio lands in what pytorch/FBGEMM PR #2546 measured on one
    H100 (1.88-2.09x; the FP8 rows of the h100-hbm2e check it shape by shape)."""
    fp8 = H100.gemm_fit("fp8")
    assert fp8.measured and fp8.tiles == sim.presets.FP8_TILES
    m, n, k = fp8.best_shape
    assert model.gemm_plan(H100, "float8_e4m3fn", 1, m, n, k)[1] == pytest.approx(fp8.efficiency)
    assert fp8.efficiency != H100.gemm_efficiency
    big = (1, 8192, 8192, 8192)                      # compute-bound
    bf16, f8 = (model.gemm_time(H100, d, *big) for d in ("bfloat16", "float8_e4m3fn"))
    assert 1.85 < bf16 / f8 < 2.10
    assert sim.get_preset("h100").peak("e5m2") == 1979.0
    # without a fit of its own a class is the 16-bit fit at its peak, and says so
    bare = H100.replace(gemm_classes={})
    assert not bare.gemm_fit("fp8").measured
    overhead = H100.gemm_overhead_us * 1e-6
    bf16, f8 = (model.gemm_time(bare, d, *big) for d in ("bfloat16", "float8_e4m3fn"))
    assert (bf16 - overhead) / (f8 - overhead) == pytest.approx(2.0, rel=2e-3)
    a100 = sim.get_preset("a100")                    # no FP8 tensor cores: the BF16 rate
    assert "float8" not in a100.peak_tflops and a100.peak("fp8") == a100.peak_tflops["bfloat16"]
    assert model.gemm_time(a100, "float8_e4m3fn", *big) == pytest.approx(
        model.gemm_time(a100, "bfloat16", *big), rel=1e-3)


def test_ag_moves_one_byte_per_element_the_reductions_their_bfloat16_output():
    def moved(op, shape, dtype):
        return model.collective_bytes(op, 8, shape.batch, shape.rows, shape.k, shape.n, dtype)

    assert moved("ag_matmul", AG, "float8_e4m3fn") * 2 == moved("ag_matmul", AG, "bfloat16")
    for op, shape in (("matmul_rs", RS), ("matmul_ar", RS)):
        assert moved(op, shape, "float8_e5m2") == moved(op, shape, "bfloat16")

    def transfers(op, shape, dtype, transport="p2p"):
        """(bytes of data, count and bytes of scales) the ranks' real programs move."""
        ranks = sim_plan.programs(op, transport, 8, shape, dtype, 2, True, False)
        moved = [o for pr in ranks for o in pr["ops"]
                 if o["kind"] in ("Copy", "Send", "McStore", "McReduce")]
        scales = [o["bytes"] for o in moved
                  if any("SCALE" in (o[k] or {}).get("buf", "") for k in "ad")]
        return sum(o["bytes"] for o in moved) - sum(scales), (len(scales), sum(scales))

    # AG+GEMM's real program moves the fp8 shards (half bf16's bytes) and each shard's float32
    # scale to each other rank: 8 x 7 transfers (multicast: one store per rank reaches all)
    for transport, count in (("p2p", 8 * 7), ("nccl", 8 * 7), ("multicast", 8)):
        data, scales = transfers("ag_matmul", AG, "fp8", transport)
        assert data * 2 == transfers("ag_matmul", AG, "bf16", transport)[0]
        assert scales == (count, 4 * count), (transport, scales)
    assert transfers("matmul_rs", RS, "fp8") == transfers("matmul_rs", RS, "bf16")
    ranks = sim_plan.programs("ag_matmul", "p2p", 8, AG, "fp8", 1, False, False)
    assert {pr["dtype"] for pr in ranks} == {"f8e4m3fn"}
    assert {o["kind"] for pr in ranks for o in pr["ops"] if o.get("a_scale")} == {"Gemm"}

@pytest.mark.slow
def test_fp8_projections_are_marked_and_fused_in_both_ops():
    """The fused FP8 GEMM serves AG+GEMM and GEMM+RS (``_kinds.FUSED_FP8``): its plans are
    priced in both, on the FP8 class's fitted rate and fused tile; GEMM+RS's fused program
    moves and reduces the bfloat16 partials, as in bfloat16, next to a GEMM of half the time."""
    choice = sim.choose("ag_matmul", AG, "float8_e4m3fn", 8, H100)
    fused = [r for r in choice.table if r.candidate.fused]
    assert fused and {r.candidate.transport for r in fused} == {"p2p", "multicast"}
    rs = sim.choose("matmul_rs", RS, "float8_e4m3fn", 8, H100)
    rs_bf16 = sim.choose("matmul_rs", RS, "bfloat16", 8, H100)
    for transport, chunks in (("p2p", 1), ("multicast", 2)):
        c = sim.Candidate("native", transport, chunks, False, fused=True)
        f8, bf16 = (sim.simulate("matmul_rs", RS, d, 8, H100, c) for d in ("fp8", "bfloat16"))
        # the same partials' bytes on the wire; the kernel at the FP8 rate
        assert f8.t_wire == bf16.t_wire and f8.t_compute < 0.6 * bf16.t_compute
        assert any(r.candidate == c for r in rs.table) and any(
            r.candidate == c for r in rs_bf16.table)
    assert any("fp8 GEMM alone measured" in why and "fp8 call extrapolated" in why
               for why in choice.outside)
    pcie = sim.outside_calibrated(sim.get_preset("pcie8"), "ag_matmul", AG, "fp8", 8)
    assert any("fp8 GEMM alone extrapolated" in why for why in pcie)
    bf16 = sim.choose("ag_matmul", AG, "bfloat16", 8, H100)
    assert choice.table[0].t_gemm < 0.55 * bf16.table[0].t_gemm      # xla's GEMM: ~half
    with pytest.raises(ValueError, match="the fused GEMM is compiled for"):
        sim.simulate("ag_matmul", AG, "float32", 8, H100,
                     sim.Candidate("native", "p2p", 1, True, fused=True))
    rows = sim.projection_table(["h100"], sim.FP8_CASES)
    assert {r["case"] for r in rows} == {"AG std fp8", "RS std fp8", "AG flux fp8",
                                         "RS flux fp8"}
    assert all(r["published"].startswith("—") for r in rows)


def test_the_fused_fp8_all_gather_is_priced_by_its_gpu_not_its_enqueue():
    """Each shard's scale crosses on its data stream (core/build_ag.cc): the fused p2p FP8
    AG+GEMM at AG std is the bfloat16 program plus one op a hop (7) and the own scale's copy,
    so the host's enqueue of the plain program (45.3 µs + 9.08 µs an op, §2.5) stays well under
    the GPU's time and its projection ends where the fused kernel ends. A scale stream of its
    own (a Wait, a Record and a StreamWait more a hop: 48 ops, 481 µs) made the host the bound.
    The same plan with its replayable program (the builder builds the fused all-gather over
    p2p so) is priced captured: no host enqueue, the GPU's time — the fused kernel, then the
    acknowledgement round (a reset and a Signal, the writer's wait kernel), one event latency
    to join; eager, the host's enqueue of its ops would bound it."""
    c = sim.Candidate("native", "p2p", 1, True, fused=True)
    built = {(d, rep): sim_plan.programs("ag_matmul", "p2p", 8, AG, d, 1, True, False,
                                         fused=True, replayable=rep)
             for d in ("fp8", "bf16") for rep in (False, True)}
    ops = {key: len(ranks[0]["ops"]) for key, ranks in built.items()}
    assert ops["fp8", False] == ops["bf16", False] + 7 + 1
    assert not any(pr["replayable"] for pr in built["fp8", False])
    assert all(pr["replayable"] for pr in built["fp8", True])
    r = sim.simulate("ag_matmul", AG, "fp8", 8, H100, c)
    assert not r.captured
    host = (H100.host_call_us + ops["fp8", False] * H100.host_op_us) * 1e-6
    kernel_end = max(s.end for s in r.spans if s.kind == "FusedGemm")
    assert host < 0.8 * r.t_fused and r.t_fused == pytest.approx(kernel_end)
    r = sim.simulate("ag_matmul", AG, "fp8", 8, H100,
                     dataclasses.replace(c, replayable=True))
    assert r.captured
    kernel_end = max(s.end for s in r.spans if s.kind == "FusedGemm")
    comm_end = max(s.end for s in r.spans if s.stream > 0)
    assert kernel_end < comm_end < r.t_fused
    assert r.t_fused == pytest.approx(comm_end + H100.event_latency_us * 1e-6)
    assert sim.model.host_time(H100, built["fp8", True]) > r.t_fused  # eager, the bound


def test_block_scaled_calls_are_priced_as_the_xla_and_ring_impls_compute_them():
    """Block-scaled fp8 (MXFP8) runs on xla and ring only, each GEMM dequantizing its operands
    to float32 and multiplying in float32 (``_xla.block_product``): at TF32, the preset's float32
    peak, a quarter of the FP8 peak on H100 (datasheet: 494.7 vs 1979 TFLOP/s), not the FP8
    GEMM's rate; the gathered bytes stay fp8's. A native plan of such a call is refused."""
    fp8 = sim.simulate("ag_matmul", AG, "float8_e4m3fn", 8, H100, sim.Candidate("xla", None))
    blocks = sim.simulate("ag_matmul", AG, "float8_e4m3fn", 8, H100, sim.Candidate("xla", None),
                          block_scaled=True)
    tf32 = model.gemm_time(H100, "float32", 1, 8192, 3584, 8192)
    assert blocks.t_gemm > tf32 > 3.5 * fp8.t_gemm
    assert blocks.t_comm_xla == fp8.t_comm_xla
    # the dequantization: a memory pass over the fp8 operands read and their float32 copies
    # written (w's once: the ring's steps share it), the float32 product rounded to bfloat16
    once = model.dequantized_gemm_time(H100, 1, 1024, 3584, 8192)
    again = model.dequantized_gemm_time(H100, 1, 1024, 3584, 8192, dequantize_w=False)
    w_bytes = 8192 * 3584 * (1 + 4) + 8192 * 3584 // 32
    assert once - again == pytest.approx(w_bytes / (H100.hbm_gbps * 1e9), rel=1e-6)
    ring = sim.simulate("ag_matmul", AG, "fp8", 8, H100, sim.Candidate("ring", None, 1, True),
                        block_scaled=True)
    assert ring.t_compute > blocks.t_gemm  # eight float32 GEMMs of 1024 rows, one w copy
    choice = sim.choose("ag_matmul", AG, "fp8", 8, H100, block_scaled=True)
    assert {r.candidate.impl for r in choice.table} == {"xla", "ring"}
    assert any("dequantizes its operands and multiplies in float32" in why
               for why in choice.outside)
    for dtype, c in (("fp8", sim.Candidate("native", "p2p", 1, True)),
                     ("bfloat16", sim.Candidate("xla", None))):
        with pytest.raises(ValueError, match="block_scaled: block scales are for fp8 operands, "
                                             "and the model prices them on the xla and ring"):
            sim.simulate("ag_matmul", AG, dtype, 8, H100, c, block_scaled=True)


def test_an_fp8_fused_gemm_leaves_the_sms_its_own_tile_grid_spares():
    """The SMs a release-only fused GEMM leaves to its reduction follow the waves of the
    kernel's own CTA tiles (``fused_tiles.h`` ``CtaTileOf``): 8192 x 256 is 64 tiles of
    128 x 256 for bfloat16 (one wave on any 64 SMs: it leaves the most, 16 of 132) but 128
    tiles of 128 x 128 for FP8 (one wave on 128 SMs, two on 116: it leaves 132 - 128 = 4)."""
    op = {"kind": "FusedGemm", "batch": 1, "m": 8192, "n": 256, "k": 1024,
          "fused": {"spare_sms": 16}}
    assert fused.kernel_tile(H100, "float8_e4m3fn") == (128, 128)
    assert fused.spare_sms(H100, "bfloat16", op) == 16
    assert fused.spare_sms(H100, "float8_e4m3fn", op) == 4
    assert fused.spare_sms(H100, "f8e4m3fn", op) == 4  # a program's short name
    assert fused.kernel_sms(H100, "float8_e4m3fn", op) == 128
