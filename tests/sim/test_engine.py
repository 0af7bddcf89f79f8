"""The event engine on timelines computable by hand (real programs where possible)."""

import copy
import gc
import math

import pytest

from jaxoverlap import _kinds, sim
from jaxoverlap._executors.runtime import load_host

# The performance model: no JAX.
pytestmark = pytest.mark.jax_independent

host = load_host()
US = 1e-6

# A machine with round numbers: 1 TFLOP/s, no shape or quantisation penalty, no
# per-kernel cost, "infinite" HBM; links of 10 GB/s; NCCL at half the line rate; fixed
# latencies but no size ramp, no memory interference, no host cost (the tests of those
# mechanisms switch them on one at a time).
TOY = sim.Preset(
    name="toy", gpu="toy", sms=100,
    peak_tflops={"bfloat16": 1.0, "float16": 1.0, "float32": 1.0},
    gemm_efficiency=1.0, hbm_gbps=1e12, link_gbps=10.0, nccl_gbps=5.0, p2p_gbps=10.0,
    multicast_gbps=10.0, gemm_m_half=0.0, gemm_n_half=0.0, gemm_k_half=0.0, gemm_tiles=(),
    gemm_overhead_us=0.0, nccl_latency_us=3.0, ce_latency_us=5.0, mc_latency_us=1.0,
    nccl_ramp_us=0.0, nccl_step_us=0.0, ce_ramp_us=0.0, mc_ramp_us=0.0, signal_latency_us=2.0,
    event_latency_us=0.0, nccl_sms=25, mc_sms=10, interference=0.0, host_op_us=0.0,
    host_call_us=0.0)


def clique(op, transport, n, rows, k, n_out, **kw):
    return [host.build_program(op, transport, n, r, 1, rows, k, n_out, dtype="bfloat16", **kw)
            for r in range(n)]


def gemm_s(rows, k, n_out):
    return 2 * rows * k * n_out / 1e12


def test_pure_compute_is_the_sum_of_gemm_times():
    progs = clique("ag_matmul", "nccl", 1, 256, 512, 1024)
    tl = sim.simulate_programs(progs, TOY)
    assert tl.total == pytest.approx(gemm_s(256, 512, 1024))
    # with an overhead per kernel and the shape effects the GEMM takes longer; and a call
    # cannot finish before the host has enqueued it (one op after the per-call cost)
    p = sim.get_preset("h100")
    tl = sim.simulate_programs(progs, p)
    host_s = (p.host_call_us + p.host_op_us) * US
    assert tl.total == pytest.approx(max(sim.gemm_time(p, "bf16", 1, 256, 1024, 512), host_s))
    assert tl.total > 2 * 256 * 512 * 1024 / (989e12 * 0.803)


@pytest.mark.parametrize("rows", [64, 4096])  # comm shorter / longer than one GEMM
def test_ag_p2p_two_ranks_by_hand(rows):
    k, n_out = 1024, 2048
    progs = clique("ag_matmul", "p2p", 2, rows, k, n_out)
    tl = sim.simulate_programs(progs, TOY)
    g = gemm_s(rows, k, n_out)
    copy_s = 5 * US + rows * k * 2 / 10e9
    arrive = copy_s + 2 * US  # + Signal latency
    assert tl.total == pytest.approx(max(g, arrive) + g)
    # the timeline: rank 0's compute stream is Gemm, Wait, Gemm; the copy on stream 1
    s0 = tl.of(0, 0)
    assert [s.kind for s in s0] == ["Gemm", "Wait", "Gemm"]
    assert s0[0].start == 0 and s0[0].end == pytest.approx(g)
    assert s0[2].start == pytest.approx(max(g, arrive))
    (cp,) = [s for s in tl.of(0, 1) if s.kind == "Copy"]
    assert cp.end == pytest.approx(copy_s)


def test_ag_nccl_two_ranks_gemm_slowed_while_nccl_runs():
    rows, k, n_out = 1024, 1024, 2048
    progs = clique("ag_matmul", "nccl", 2, rows, k, n_out)
    tl = sim.simulate_programs(progs, TOY)
    g = gemm_s(rows, k, n_out)  # 4.29 ms
    lat, xfer = 3 * US, rows * k * 2 / 5e9  # 0.42 ms at the NCCL rate
    assert lat + xfer < g
    f = 25 / 100  # SMs NCCL takes
    # first GEMM: full speed during the latency, (1 - f) during the transfer, full after
    end1 = lat + xfer + (g - lat - (1 - f) * xfer)
    assert tl.of(0, 0)[0].end == pytest.approx(end1)
    assert tl.total == pytest.approx(end1 + g)


def _comm_only(sends):
    """Synthetic programs of 3 ranks: each (src, dst) is a Send/Recv on stream 1, all of a
    rank's in one group (issued together, as one ncclGroup)."""
    progs = [{"rank": r, "nranks": 3, "num_streams": 2, "dtype": "bf16", "elem_bytes": 2,
              "ops": []} for r in range(3)]
    for tag, (src, dst) in enumerate(sends):
        base = {"stream": 1, "batch": 1, "m": 1000, "n": 500, "k": 0, "bytes": 1_000_000,
                "id": tag, "shard": -1, "sub": -1, "accumulate": False}
        progs[src]["ops"].append({**base, "kind": "Send", "peer": dst, "bundle": 0,
                                  "text": f"Send {src}->{dst}"})
        progs[dst]["ops"].append({**base, "kind": "Recv", "peer": src, "bundle": 0,
                                  "text": f"Recv {src}->{dst}"})
    return progs


def test_pure_comm_and_per_direction_contention():
    one = 3 * US + 1e6 / 5e9  # latency + bytes / NCCL rate
    assert sim.simulate_programs(_comm_only([(0, 1)]), TOY).total == pytest.approx(one)
    # opposite directions of one pair: separate ports, no contention
    assert sim.simulate_programs(_comm_only([(0, 1), (1, 0)]), TOY).total == pytest.approx(one)
    # two senders into one receiver share its ingress port: twice the transfer time
    two_in = sim.simulate_programs(_comm_only([(0, 1), (2, 1)]), TOY).total
    assert two_in == pytest.approx(3 * US + 2 * 1e6 / 5e9)
    # one sender to two receivers shares its egress port
    two_out = sim.simulate_programs(_comm_only([(0, 1), (0, 2)]), TOY).total
    assert two_out == pytest.approx(3 * US + 2 * 1e6 / 5e9)


def test_every_op_of_every_rank_is_simulated_once():
    progs = clique("matmul_rs", "p2p", 4, 64, 128, 256, chunks=2, bidirectional=True)
    tl = sim.simulate_programs(progs, sim.get_preset("h100"))
    assert len(tl.spans) == sum(len(p["ops"]) for p in progs)
    for s in tl.spans:
        assert 0 <= s.start <= s.end <= tl.total


def test_a_missing_signal_deadlocks():
    progs = clique("ag_matmul", "p2p", 2, 8, 16, 16)
    broken = copy.deepcopy(progs)
    broken[1]["ops"] = [o for o in broken[1]["ops"] if o["kind"] != "Signal"]
    with pytest.raises(sim.SimulationError, match="deadlock"):
        sim.simulate_programs(broken, TOY)


def test_a_run_leaves_the_cyclic_garbage_collector_as_it_found_it():
    """The engine pauses the collector while it runs (engine.cyclic_gc_paused): on again
    after a run and after a deadlock, still off if the caller had switched it off."""
    progs = clique("ag_matmul", "p2p", 2, 8, 16, 16)
    broken = copy.deepcopy(progs)
    broken[1]["ops"] = [o for o in broken[1]["ops"] if o["kind"] != "Signal"]
    was_on = gc.isenabled()
    try:
        for on in (True, False):
            gc.enable() if on else gc.disable()
            sim.simulate_programs(progs, TOY)
            assert gc.isenabled() == on
            with pytest.raises(sim.SimulationError, match="deadlock"):
                sim.simulate_programs(broken, TOY)
            assert gc.isenabled() == on
    finally:
        gc.enable() if was_on else gc.disable()


def test_a_projection_and_a_choice_leave_the_collector_as_they_found_it():
    """sim.simulate and sim.choose pause the collector for all of their runs: on again after
    them and after they raise, still off if the caller had switched it off."""
    shape = sim.Shape(1, 64, 128, 128)
    was_on = gc.isenabled()
    try:
        for on in (True, False):
            gc.enable() if on else gc.disable()
            sim.simulate("ag_matmul", shape, "bfloat16", 2, "h100", sim.Candidate("native", "p2p"))
            sim.choose("ag_matmul", shape, "bfloat16", 2, "h100")
            assert gc.isenabled() == on
            with pytest.raises(ValueError, match="nranks=16"):
                sim.simulate("ag_matmul", shape, "bfloat16", 16, "h100")
            with pytest.raises(ValueError, match="op: expected"):
                sim.choose("no_such_op", shape, "bfloat16", 2, "h100")
            assert gc.isenabled() == on
    finally:
        gc.enable() if was_on else gc.disable()


@pytest.mark.parametrize("transport", _kinds.names(_kinds.TRANSPORTS))
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_all_programs_run_on_every_preset(op, transport):
    progs = clique(op, transport, 8, 128, 256, 512, chunks=2)
    for preset in sim.PRESETS.values():
        if transport in preset.transports:
            assert sim.simulate_programs(progs, preset).total > 0


def _one_copy(nbytes, transport="p2p"):
    """Rank 0 sends ``nbytes`` to rank 1 (a Copy, or an NCCL Send/Recv), nothing else."""
    progs = [{"rank": r, "nranks": 2, "num_streams": 2, "dtype": "bf16", "elem_bytes": 2,
              "ops": []} for r in range(2)]
    if transport == "p2p":
        progs[0]["ops"].append({"kind": "Copy", "stream": 1, "bytes": nbytes, "text": "Copy",
                                "d": {"buf": "WORKSPACE", "rank": 1}})
    else:
        base = {"stream": 1, "bytes": nbytes, "id": 0, "bundle": 0}
        progs[0]["ops"].append({**base, "kind": "Send", "peer": 1, "text": "Send"})
        progs[1]["ops"].append({**base, "kind": "Recv", "peer": 0, "text": "Recv"})
    return progs


@pytest.mark.parametrize("nbytes", [10_000, 1_000_000, 100_000_000])
def test_a_transfer_ramps_with_its_size(nbytes):
    """latency + (sqrt(ramp) + sqrt(bytes / rate))^2: the bandwidth a copy gets grows
    with its size (pipelined chunks, each paying a fixed overhead)."""
    p = TOY.replace(ce_ramp_us=4.0)
    x = nbytes / 10e9
    expected = 5 * US + (math.sqrt(4 * US) + math.sqrt(x)) ** 2
    assert sim.simulate_programs(_one_copy(nbytes), p).total == pytest.approx(expected)
    # small copies get a small fraction of the rate, large ones nearly all of it
    achieved = x / (expected - 5 * US)
    assert achieved < 0.5 if nbytes == 10_000 else achieved > 0.6


def test_a_send_recv_runs_below_the_ring_collective_rate():
    """One NCCL send/recv is capped at nccl_p2p_gbps (fewer channels than a ring)."""
    nbytes = 10_000_000
    capped = TOY.replace(nccl_p2p_gbps=2.0)
    assert sim.simulate_programs(_one_copy(nbytes, "nccl"), TOY).total == pytest.approx(
        3 * US + nbytes / 5e9)
    assert sim.simulate_programs(_one_copy(nbytes, "nccl"), capped).total == pytest.approx(
        3 * US + nbytes / 2e9)


def test_transfers_through_a_ranks_memory_slow_its_gemm():
    """A copy-engine copy takes no SMs, but its bytes pass the memory of both ranks:
    the GEMM runs at 1 / (1 + interference * traffic / hbm) while it flows."""
    rows, k, n_out = 1024, 1024, 2048
    g = gemm_s(rows, k, n_out)  # 4.29 ms
    nbytes = 20_000_000  # 2 ms at 10 GB/s, after the 5 us start
    progs = clique("ag_matmul", "nccl", 1, rows, k, n_out)
    progs[0]["num_streams"] = 2
    progs[0]["nranks"] = 2
    progs.append({"rank": 1, "nranks": 2, "num_streams": 2, "dtype": "bf16", "elem_bytes": 2,
                  "ops": []})
    progs[0]["ops"].append({"kind": "Copy", "stream": 1, "bytes": nbytes, "text": "Copy",
                            "d": {"buf": "WORKSPACE", "rank": 1}})
    p = TOY.replace(interference=2.0, hbm_gbps=100.0)
    rate = 1 / (1 + 2.0 * 10e9 / 100e9)  # traffic 10 GB/s out of rank 0's memory
    xfer = nbytes / 10e9
    end = 5 * US + xfer + (g - 5 * US - rate * xfer)
    assert sim.simulate_programs(progs, p).total == pytest.approx(end)
    assert sim.simulate_programs(progs, TOY).total == pytest.approx(g)


def test_the_host_enqueue_bounds_a_call_of_many_small_ops():
    progs = clique("ag_matmul", "p2p", 4, 64, 64, 64, chunks=8)
    ops = max(len(pr["ops"]) for pr in progs)
    p = TOY.replace(host_op_us=10.0, host_call_us=50.0)
    assert sim.simulate_programs(progs, TOY).total < (50 + 10 * ops) * US
    assert sim.simulate_programs(progs, p).total == pytest.approx((50 + 10 * ops) * US)


def test_fork_and_join_cost_an_event_latency_each():
    """Comm streams start one event after the call and the call ends one event after them."""
    nbytes = 1_000_000
    p = TOY.replace(event_latency_us=7.0)
    assert sim.simulate_programs(_one_copy(nbytes), p).total == pytest.approx(
        7 * US + 5 * US + nbytes / 10e9 + 7 * US)
