"""The mechanisms of an overlapped GEMM + reduce-scatter, by hand (sim.reduction)."""

import pytest

from jaxoverlap import sim
from jaxoverlap.sim import reduction

# The performance model: no JAX.
pytestmark = pytest.mark.jax_independent

US = 1e-6
H100 = sim.get_preset("h100")
BLOCK = 8192 * 8192 * 2 // 8  # RS std's output block per rank: 16 MiB
TD = "triton-dist-rs"


def test_a_gemm_on_fewer_sms_takes_their_share_of_the_peak():
    full = reduction.gemm_time_on_sms(H100, "bf16", 1, 8192, 8192, 3584, H100.sms)
    assert full == sim.gemm_time(H100, "bf16", 1, 8192, 8192, 3584)
    times = [reduction.gemm_time_on_sms(H100, "bf16", 1, 8192, 8192, 3584, s)
             for s in (132, 116, 66)]
    assert times == sorted(times)
    overhead = H100.ar_start_us * US  # a queued kernel's start
    # compute-bound: half the SMs, about twice the time (waves of 66 instead of 132 tiles)
    assert (times[2] - overhead) / (times[0] - overhead) == pytest.approx(2.0, rel=0.05)
    # memory-bound (M 16): the HBM is shared, so fewer SMs cost little
    skinny = [reduction.gemm_time_on_sms(H100, "bf16", 1, 16, 8192, 3584, s) for s in (132, 116)]
    assert skinny[1] < 1.02 * skinny[0]
    with pytest.raises(ValueError, match="sms"):
        reduction.gemm_time_on_sms(H100, "bf16", 1, 16, 8192, 3584, 0)


def test_a_reduction_reads_n_partials_and_writes_one():
    overhead = H100.ar_start_us * US  # a queued kernel's start
    whole = reduction.reduction_time(H100, 8, BLOCK)
    rate = H100.reduce_efficiency * H100.hbm_gbps * 1e9  # every SM: HBM-bound
    assert whole == pytest.approx(9 * BLOCK / rate + overhead)
    # on 16 SMs: 16 x 28 GB/s
    assert reduction.reduction_time(H100, 8, BLOCK, sms=16) == pytest.approx(
        9 * BLOCK / (16 * H100.reduce_sm_gbps * 1e9) + overhead)
    # peers' partials over the links: the link, not HBM, bounds it
    remote = reduction.reduction_time(H100, 8, BLOCK, remote=True)
    assert remote == pytest.approx(7 * BLOCK / (H100.link_gbps * 1e9) + overhead)
    # one pass of N inputs against today's copy and N-1 pairwise adds (2 + 3(N-1) passes)
    adds = reduction.pairwise_adds_time(H100, 8, BLOCK)
    # (each an elementwise kernel at a GEMM-sized kernel cost, as the engine prices an Add)
    assert adds == pytest.approx(23 * BLOCK / (H100.hbm_gbps * 1e9)
                                 + 8 * H100.gemm_overhead_us * US)
    assert whole < adds / 2.5


def test_the_tail_is_one_blocks_transfer_and_reduction():
    tail = reduction.tail_time(H100, "p2p", 8, BLOCK)
    x = BLOCK / (H100.p2p_gbps * 1e9)
    assert tail == pytest.approx(sim.model.transfer_fill(H100, "p2p", BLOCK) + x
                                 + reduction.reduction_time(H100, 8, BLOCK))
    # the SMs a reduction needs to keep pace with a GEMM producing a block per `seconds`
    s = reduction.sms_for(H100, 8, BLOCK, 100 * US)
    assert reduction.reduction_time(H100, 8, BLOCK, s) <= 100 * US
    assert reduction.reduction_time(H100, 8, BLOCK, s - 1) > 100 * US


def test_the_overlapped_projection_is_its_streams_longest_plus_the_tail():
    m, n, k = 8192, 8192, 3584
    o = reduction.overlapped(H100, "bf16", 1, m, n, k, 8, sms=16, chunks=2, design=TD)
    assert (o.sms, o.chunks) == (16, 2)
    assert o.seconds == pytest.approx(H100.gemm_overhead_us * US
                                      + max(o.gemm, o.copies, o.reductions) + o.tail)
    # the GEMM on 116 SMs is slower than on all 132, and slower still with the bytes beside it
    alone = (reduction.gemm_time_on_sms(H100, "bf16", 1, m, n, k, 116)
             - H100.gemm_overhead_us * US) / H100.fused_gemm_rate
    assert o.gemm > alone > (sim.gemm_time(H100, "bf16", 1, m, n, k)
                             - H100.gemm_overhead_us * US) / H100.fused_gemm_rate
    # the 7 peers' sub-chunks, 2 each, copied back to back
    sub = m * n * 2 / 8 / 2
    copy = sim.model.transfer_fill(H100, "p2p", sub) + sub / (H100.p2p_gbps * 1e9)
    assert o.copies == pytest.approx(14 * copy)
    # sms 0: the GEMM keeps every SM, one reduction of the whole block after it
    after = reduction.overlapped(H100, "bf16", 1, m, n, k, 8, sms=0, chunks=1, design=TD)
    assert after.reductions == pytest.approx(reduction.reduction_time(H100, 8, m * n * 2 / 8))
    assert after.gemm < o.gemm
    # the fastest design is one of those tried
    best = reduction.overlapped(H100, "bf16", 1, m, n, k, 8, design=TD)
    assert best.seconds <= min(o.seconds, after.seconds)
    with pytest.raises(ValueError, match="transport"):
        reduction.overlapped(H100, "bf16", 1, m, n, k, 8, transport="nccl", design=TD)
    with pytest.raises(ValueError, match="blocks"):
        reduction.overlapped(H100, "bf16", 1, m + 1, n, k, 8, design=TD)
    with pytest.raises(ValueError, match="design"):
        reduction.overlapped(H100, "bf16", 1, m, n, k, 8, design="flux-rs")


def test_each_design_pays_the_host_ops_its_call_issues():
    """The ops each copy-engine design's Python enqueues per call, counted by hand from its
    source (reduction.HOST_OPS cites the functions): a stream wait and a copy per destination,
    the own one included; per call Triton-distributed's 16 (five torch wait_streams, an event
    record and a stream wait each; two fills; two barriers; the GEMM; the reduction) and
    kraken's 9 (two wait_streams, two fills, a barrier, the GEMM, the reduction)."""
    assert reduction.HOST_OPS["triton-dist-rs"].count(4) == 5 * 2 + 2 + 2 + 2 + 4 * 2
    assert reduction.HOST_OPS["triton-dist-rs"].count(8) == 32
    assert reduction.HOST_OPS["kraken-ce-rs"].count(8) == 2 * 2 + 2 + 1 + 2 + 8 * 2
    # sub-chunks: each destination's block waited on and copied once per sub-chunk
    assert reduction.HOST_OPS["kraken-ce-rs"].count(8, chunks=2) == 9 + 32
    # a small GEMM (PR #166's small shape at TP 4): the GPU is done before the host has
    # enqueued the call's 24 ops, so the call takes their enqueue
    o = reduction.overlapped(H100, "bf16", 1, 4096, 4096, 2048, 4, sms=0, chunks=1, design=TD)
    assert o.seconds == pytest.approx((H100.host_call_us + 24 * H100.host_op_us) * US)
    kraken = reduction.overlapped(H100, "bf16", 1, 4096, 4096, 2048, 4, sms=0, chunks=1,
                                  design="kraken-ce-rs")
    assert kraken.seconds == pytest.approx((H100.host_call_us + 17 * H100.host_op_us) * US)


def test_the_overlapped_projection_reproduces_the_published_designs_it_prices_on_h100():
    """Held out (fitted to nothing): Triton-distributed's and kraken's copy-engine GEMM+RS on
    8xH100 (sim.published.OVERLAPPED_DESIGNS), each priced as its code runs a call (one copy of
    each destination's block, the reduction after the GEMM, the host ops its call issues):
    each gain within -20% / +5%, each loss a loss (its depth is not checked)."""
    from jaxoverlap.sim import published

    checks = published.overlapped_checks(("h100",))
    assert len(checks) >= 9
    tdh8 = next(c.row for c in checks if c.row.id == "TDH-8")
    p = published.machine("h100")
    one = reduction.overlapped(p, "bf16", 1, tdh8.m, tdh8.n, tdh8.k, 8, sms=0, chunks=1,
                               design=TD)
    assert published.design_projection(tdh8) == pytest.approx(
        sum(sim.plan.baseline_times("matmul_rs", tdh8.shape, "bf16", 8, p)) / one.seconds)
    for c in checks:
        if c.row.loss:
            assert c.projected < 1.0, c.row.id
        else:
            assert 0.8 <= c.ratio <= 1.05, (c.row.id, c.projected, c.row.published_speedup)


def test_fluxs_pulled_design_is_its_gemm_beside_the_pulls_then_a_slow_sum():
    """Flux's Hopper GEMM+RS (sim.reduction.pulled) by its parts: the GEMM slowed by the pulled
    bytes (the whole partial read by its owners, the reduce buffer written), the 7 peers'
    tiles over the links beside it, no barrier (the host skips it on one Hopper node), then
    ATen's stacked sum at 23-43% of HBM (pytorch/pytorch PR #191803), not the 85% of a
    dedicated reduction kernel."""
    m, n, k = 8192, 8192, 3584
    out = m * n * 2
    o = reduction.pulled(H100, "bf16", 1, m, n, k, 8)
    assert o.seconds == pytest.approx(H100.gemm_overhead_us * US + max(o.gemm, o.pulls)
                                      + o.last + o.sum)
    alone = sim.fused.kernel_busy(H100, "bf16", 1, m, n, k) / H100.fused_gemm_rate
    assert o.gemm == pytest.approx(alone * (1 + H100.interference * 2 * out / alone
                                            / (H100.hbm_gbps * 1e9)))
    assert o.pulls == pytest.approx(7 * BLOCK / (H100.link_gbps * 1e9)) and o.pulls < o.gemm
    lo, hi = reduction.STACKED_SUM_HBM
    sums = [reduction.pulled(H100, "bf16", 1, m, n, k, 8, e).sum for e in (lo, hi)]
    assert sums[0] == pytest.approx(9 * BLOCK / (lo * H100.hbm_gbps * 1e9) + H100.ar_start_us * US)
    assert sums[0] > o.sum > sums[1] > 1.9 * reduction.reduction_time(H100, 8, BLOCK)
    with pytest.raises(ValueError, match="sum_efficiency"):
        reduction.pulled(H100, "bf16", 1, m, n, k, 8, 1.5)
    with pytest.raises(ValueError, match="blocks"):
        reduction.pulled(H100, "bf16", 1, m + 1, n, k, 8)
    with pytest.raises(ValueError, match="reduce"):
        reduction.pulled(H100, "bf16", 1, m, n, k, 8, reduce="pushed")


def test_fluxs_2024_design_adds_in_place_into_its_own_block_then_copies_it():
    """The release of Flux's README table (bytedance/flux @239a13d): each peer's tile added in
    place into a buffer of the own block (it stays in L2, written back once), so beside the
    GEMM only the partial read by its owners and one block written; after the kernel a copy
    of the block (ATen's sum over a dim of one), no stacked sum to take an efficiency for."""
    m, n, k = 8192, 8192, 3584
    out = m * n * 2
    stacked = reduction.pulled(H100, "bf16", 1, m, n, k, 8)
    o = reduction.pulled(H100, "bf16", 1, m, n, k, 8, reduce="in_kernel")
    alone = sim.fused.kernel_busy(H100, "bf16", 1, m, n, k) / H100.fused_gemm_rate
    assert o.gemm == pytest.approx(alone * (1 + H100.interference * (out + BLOCK) / alone
                                            / (H100.hbm_gbps * 1e9)))
    assert o.pulls == stacked.pulls and o.last == stacked.last and o.gemm < stacked.gemm
    assert o.sum == pytest.approx(2 * BLOCK / (H100.reduce_efficiency * H100.hbm_gbps * 1e9)
                                  + H100.ar_start_us * US)
    assert o.seconds == pytest.approx(H100.gemm_overhead_us * US + max(o.gemm, o.pulls)
                                      + o.last + o.sum) and o.seconds < stacked.seconds
    with pytest.raises(ValueError, match="sum_efficiency"):
        reduction.pulled(H100, "bf16", 1, m, n, k, 8, 0.3, reduce="in_kernel")


def test_fluxs_mechanism_reproduces_its_h800_gain_but_not_its_h100_losses():
    """Held out (fitted to nothing): each Flux row priced by the release that measured it. The
    2024 in-kernel design gains on 8xH800 as published (F2, 1.51x: within 5%); the stacked
    design of the 8xH100 run of bytedance/flux#90 (F8, 0.80-0.98x) projects a gain at every M
    with the middle of the published stacked sums, and at half of them even with the slowest:
    what that run lost is not in the mechanism (published.DISAGREES says why)."""
    from jaxoverlap.sim import published

    checks = {c.row.id: c for c in published.overlapped_checks(
        ("h100", "h800"), tuple(published.PULLED_DESIGNS))}
    assert checks["F2"].row.design == "flux-rs-inkernel"
    assert 0.95 <= checks["F2"].ratio <= 1.05
    assert {checks[f"F8/{m}"].row.design for m in (1024, 8192)} == {"flux-rs"}
    lo = reduction.STACKED_SUM_HBM[0]
    f8 = [r for r in published.CALLS if r.id.startswith("F8/")]
    assert len(f8) == 6 and all(r.loss for r in f8)
    for r in f8:
        assert published.design_projection(r) > 1.0, r.id
    assert sum(published.design_projection(r, lo) > 1.0 for r in f8) >= 3
