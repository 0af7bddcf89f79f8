"""The engine's ops of the programs that reduce beside a fused GEMM and all-reduce in one
launch (``Reduce``, a ``FusedGemm`` leaving SMs, ``AllReduce``), on timelines computed by hand
from programs written out op by op (the op dicts of ``_host.build_program``)."""

import types

import pytest

from jaxoverlap import sim
from jaxoverlap.sim import fused

pytestmark = pytest.mark.jax_independent

US = 1e-6
# Round numbers: 1 TFLOP/s on 100 SMs, no shape effects or kernel cost; a reduction SM streams
# 10 GB/s up to 0.5 of a 1000 GB/s HBM; links of 10 GB/s; a queued kernel starts in 2 us, a flag
# round 1 us; no interference and no host cost unless a test switches them on.
TOY = sim.Preset(
    name="toy", gpu="toy", sms=100,
    peak_tflops={"bfloat16": 1.0, "float16": 1.0, "float32": 1.0},
    gemm_efficiency=1.0, hbm_gbps=1000.0, link_gbps=10.0, nccl_gbps=5.0, p2p_gbps=10.0,
    multicast_gbps=10.0, gemm_m_half=0.0, gemm_n_half=0.0, gemm_k_half=0.0, gemm_tiles=(),
    gemm_overhead_us=0.0, nccl_latency_us=3.0, ce_latency_us=5.0, mc_latency_us=1.0,
    nccl_ramp_us=0.0, nccl_step_us=0.0, ce_ramp_us=0.0, mc_ramp_us=0.0, signal_latency_us=2.0,
    event_latency_us=0.0, nccl_sms=25, mc_sms=10, interference=0.0, host_op_us=0.0,
    host_call_us=0.0, graph_node_us=0.0, reduce_sm_gbps=10.0, reduce_efficiency=0.5,
    ar_start_us=2.0, ar_flag_us=1.0)


def op(kind, stream=0, **kw):
    return {"kind": kind, "stream": stream, "text": kind, **kw}


def gemm(m, n, k, stream=0):
    return op("Gemm", stream, batch=1, m=m, n=n, k=k, accumulate=False, bytes=2 * m * n)


def reduce_op(nbytes, sources, sms, stream=1, rank=0):
    return op("Reduce", stream, bytes=nbytes, sms=sms,
              sources=[{"buf": "WORKSPACE", "rank": s} for s in sources],
              d={"buf": "Y", "rank": rank})


def program(rank, ops, streams=2, **kw):
    return {"rank": rank, "num_streams": streams, "ops": ops, "dtype": "bf16",
            "transport": "p2p", "algorithm": "two_shot", **kw}


def test_a_reduce_reads_its_sources_once_on_its_sm_budget():
    block = 1_000_000
    # 8 local partials: 9 passes of the block at 16 SMs x 10 GB/s (below the HBM cap of 500)
    tl = sim.simulate_programs([program(0, [reduce_op(block, [0] * 8, 16)])], TOY)
    assert tl.total == pytest.approx(2 * US + 9 * block / 160e9)
    # no budget (0): as many SMs as reach the cap, 0.5 x 1000 GB/s
    tl = sim.simulate_programs([program(0, [reduce_op(block, [0] * 8, 0)])], TOY)
    assert tl.total == pytest.approx(2 * US + 9 * block / 500e9)
    # peers' partials read over the links: 7 blocks at 10 GB/s bound it
    tl = sim.simulate_programs([program(0, [reduce_op(block, range(8), 16)])], TOY)
    assert tl.total == pytest.approx(2 * US + 7 * block / 10e9)


def test_a_reduce_takes_its_sms_and_its_bytes_slow_the_gemm_beside_it():
    m = n = k = 1000
    g = 2 * m * n * k / 1e12  # the GEMM alone: 2 ms
    block = 1_000_000
    d = 9 * block / 250e9  # the reduction on 25 SMs: 36 us
    progs = [program(0, [gemm(m, n, k), reduce_op(block, [0] * 8, 25)])]
    tl = sim.simulate_programs(progs, TOY)
    # from 2 us to 2 us + d the GEMM runs on 75 of the 100 SMs
    assert tl.total == pytest.approx(g + 0.25 * d)
    # and with interference its HBM traffic (9 blocks in d) slows the GEMM further
    p = TOY.replace(interference=1.0)
    tl = sim.simulate_programs(progs, p)
    rate = 0.75 / (1 + 250e9 / 1000e9)
    assert tl.total == pytest.approx(g + (1 - rate) * d)


def test_a_fused_gemm_leaving_sms_runs_on_the_rest():
    m, n, k = 128 * 20, 256 * 10, 1024  # 200 tiles of 128 x 256: 2 waves on 100, 4 on 50
    flops = 2 * m * n * k
    assert fused.kernel_busy(TOY, "bf16", 1, m, n, k) == pytest.approx(flops / 1e12)
    assert fused.kernel_busy(TOY, "bf16", 1, m, n, k, sms=50) == pytest.approx(2 * flops / 1e12)
    f = {"shards": 1, "chunks": 1, "shard_rows": m, "sequence": [0], "order": "arrival",
         "wait_flags": -1, "ready_shard": 0, "writers": [], "release_flags": -1}
    fop = op("FusedGemm", batch=1, m=m, n=n, k=k, accumulate=False, bytes=2 * m * n, fused=f)
    assert fused.kernel_sms(TOY, "bf16", fop) == 100
    # the SMs it leaves are the CUDA executor's (fused_tiles.h SpareSms): at most a quarter of
    # the device, as many as cost its 2 waves no third: with 200 tiles even 2 do (ceil(200/98)
    # = 3), so it leaves the least, 2
    assert fused.kernel_sms(TOY, "bf16", {**fop, "fused": {**f, "spare_sms": 50}}) == 98
    with pytest.raises(ValueError, match="spare_sms"):
        fused.kernel_sms(TOY, "bf16", {**fop, "fused": {**f, "spare_sms": 100}})
    rate = TOY.fused_gemm_rate
    alone = sim.simulate_programs([program(0, [fop], streams=1)], TOY).total
    assert alone == pytest.approx(flops / 1e12 / rate)
    # 120 tiles: 2 waves on 100 SMs (100 CTAs) and on 76 (76 CTAs): it leaves 24
    m = 128 * 12
    flops = 2 * m * n * k
    spared = op("FusedGemm", batch=1, m=m, n=n, k=k, accumulate=False, bytes=2 * m * n,
                fused={**f, "shard_rows": m, "spare_sms": 50})
    assert fused.kernel_sms(TOY, "bf16", spared) == 76
    # a reduction asking for 25 SMs beside it gets the 24 it left, taken from those, not from it
    tl = sim.simulate_programs([program(0, [spared, reduce_op(1_000_000, [0] * 8, 25)])], TOY)
    assert tl.total == pytest.approx(
        fused.kernel_busy(TOY, "bf16", 1, m, n, k, sms=76) / rate)


def test_all_reduce_kernels_end_together_one_kernel_after_the_last_arrives():
    nbytes = 1 << 20
    m = n = k = 1000
    g = 2 * m * n * k / 1e12
    progs = [program(r, ([gemm(m, n, k)] if r == 1 else []) + [op("AllReduce", bytes=nbytes)],
                     streams=1, algorithm="one_shot_kernel") for r in range(2)]
    tl = sim.simulate_programs(progs, TOY)
    # start, one flag round, one peer's bytes; (N + 2) S through HBM (push, sum of the slots)
    kernel = (2 + 1) * US + nbytes / 10e9 + 4 * nbytes / 1e12
    assert tl.total == pytest.approx(g + kernel)
    ends = [max(s.end for s in tl.of(r) if s.kind == "AllReduce") for r in range(2)]
    assert ends[0] == pytest.approx(ends[1])
    # two-shot: two flag rounds, 2(N-1)/N of the bytes, 4 S through HBM
    progs = [{**pr, "algorithm": "two_shot_kernel"} for pr in progs]
    tl = sim.simulate_programs(progs, TOY)
    assert tl.total == pytest.approx(g + 4 * US + nbytes / 10e9 + 4 * nbytes / 1e12)


def test_a_one_launch_call_is_priced_captured():
    # with host costs, a host-enqueued call is bound by the host; a one-launch call is
    # replayed from a command buffer: its ops' nodes instead (sim.launch)
    p = TOY.replace(host_call_us=30.0, host_op_us=5.0, graph_node_us=0.5)
    nbytes = 1 << 16
    ops = [op("AllReduce", bytes=nbytes)]
    kernel = 3 * US + nbytes / 10e9 + 4 * nbytes / 1e12
    captured = [program(r, ops, streams=1, algorithm="one_shot_kernel") for r in range(2)]
    assert sim.simulate_programs(captured, p).total == pytest.approx(kernel + 0.5 * US)
    enqueued = [{**pr, "algorithm": "one_shot"} for pr in captured]
    assert sim.simulate_programs(enqueued, p).total == pytest.approx(35 * US)
    # its family (the margin the automatic choice will need for it): a one-launch one-shot
    # over its transport (peer loads and multimem are families of their own)
    for transport in ("p2p", "multicast"):
        kernel = types.SimpleNamespace(impl="native", algorithm="one_shot_kernel", fused=False,
                                       transport=transport)
        assert sim.families.family("matmul_ar", kernel) == (
            f"matmul_ar:one_launch:one_shot:{transport}")
    assert sim.families.family("matmul_ar", types.SimpleNamespace(
        impl="native", algorithm="one_shot", fused=False)) == "matmul_ar:one_shot"


def test_block_scaled_gemms_dequantize_w_once_per_rank():
    """A block-scaled call's GEMMs (the xla and ring impls' dequantize-then-multiply): each a
    float32 GEMM after one memory pass over its fp8 operands read, their float32 copies written
    and its float32 product rounded to bfloat16; w's copy is made by the rank's first GEMM only.
    By hand on TOY: 2e7 FLOPs at 1 TFLOP/s = 20 us each (its float32 bytes, 0.84 MB, take 0.84
    us: compute-bound); the first pass moves 5 x 200,000 + 200,000 / 32 + 6 x 10,000 bytes, the
    second 5 x 100,000 + 100,000 / 32 + 6 x 10,000, at 1000 GB/s."""
    ops = [gemm(100, 100, 1000), gemm(100, 100, 1000)]
    first = (5 * 200_000 + 200_000 // 32 + 6 * 10_000) / 1e12
    second = (5 * 100_000 + 100_000 // 32 + 6 * 10_000) / 1e12
    tl = sim.simulate_programs([program(0, ops, streams=1, dtype="f8e4m3fn")], TOY,
                               block_scaled=True)
    assert tl.total == pytest.approx(2 * 20 * US + first + second, rel=1e-9)
    plain = sim.simulate_programs([program(0, ops, streams=1, dtype="f8e4m3fn")], TOY)
    assert plain.total == pytest.approx(2 * 20 * US)  # per-tensor scales: no pass (TOY has no
    # FP8 peak: its FP8 GEMMs run at the BF16 rate, here float32's)


def _replayable_pair(replayable=True):
    """Two ranks of a replayable program, written out: each rank's comm stream signals its
    shard to its peer (flag 0) and ends with the acknowledgement wait (flag 1) and its reset;
    the compute stream waits for the shard, runs a GEMM, resets flag 0 and acknowledges."""
    def rank(r):
        peer = 1 - r
        return program(r, [
            op("Signal", 1, peer=peer, id=0),
            op("Wait", 0, id=0, peer=peer),
            gemm(1000, 1000, 1000),  # 2 ms at 1 TFLOP/s
            op("ResetFlags", 0, id=0, n=1),
            op("Signal", 0, peer=peer, id=1),
            op("Wait", 1, id=1, peer=peer),
            op("ResetFlags", 1, id=1, n=3),  # three flags lowered: three nodes
        ], nranks=2, replayable=replayable)
    return [rank(0), rank(1)]


def test_a_replayable_program_is_priced_as_built_and_captured():
    """A call whose every program replays (sim.launch.replays) is priced captured: no host
    enqueue, each op one replayed node (graph_node_us; a ResetFlags one per flag) on its own
    stream before it starts, so the comm stream's nodes beside the GEMM cost nothing; its
    acknowledgement wait (the comm stream's last Wait, only ResetFlags after it) is the bounded
    flag-wait kernel, ending no sooner than a kernel's start after its stream reached it
    (timelines by hand below). The same programs not replayable: the host's enqueue bounds
    them, no nodes."""
    node, start = 0.5, 2.0
    p = TOY.replace(graph_node_us=node, host_op_us=1000.0, host_call_us=0.0, ar_start_us=start,
                    signal_latency_us=2.0)
    tl = sim.simulate_programs(_replayable_pair(), p)
    assert tl.captured
    # comm: Signal at 0.5 (visible 2.5); compute: Wait reached 0, its node to 0.5, the flag at
    # 2.5; the GEMM's node to 3.0, the GEMM to 2003; the reset's node to 2003.5, the Signal's to
    # 2004 (visible 2006); comm: its Wait reached at 0.5, node to 1.0, its kernel's start to
    # 3.0, the acknowledgement at 2006; the reset's three nodes to 2007.5
    spans = {(s.rank, s.stream, s.kind): s for s in tl.spans}
    gemm_span = spans[(0, 0, "Gemm")]
    assert gemm_span.start == pytest.approx(3.0 * US) and gemm_span.end == pytest.approx(2003 * US)
    assert spans[(0, 1, "Wait")].end == pytest.approx(2006 * US)
    assert tl.total == pytest.approx(2007.5 * US)
    # its kernel's start bounds the wait when the acknowledgement comes first
    quick = [program(r, [op("Signal", 0, peer=1 - r, id=1), op("Wait", 1, id=1, peer=1 - r),
                         op("ResetFlags", 1, id=1, n=1)], nranks=2, replayable=True)
             for r in range(2)]
    tl = sim.simulate_programs(quick, p.replace(ar_start_us=10.0))
    # Signal's node to 0.5 (visible 2.5); the Wait reached at 0: its node (to 0.5) is part of
    # its kernel's start (to 10.0), not added to it; the reset's node to 10.5
    assert tl.total == pytest.approx(10.5 * US)
    # not replayable: eager, the host's enqueue of its ops (7 + 2 more for the 3-flag reset)
    eager = sim.simulate_programs(_replayable_pair(replayable=False), p)
    assert not eager.captured and eager.total == pytest.approx(9 * 1000.0 * US)
    assert sim.model.host_ops(_replayable_pair()[0]) == 9
