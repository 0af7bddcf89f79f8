"""The event engine on timelines computable by hand (real programs where possible)."""

import copy

import pytest

from jaxoverlap import sim
from jaxoverlap._runtime import load_host

host = load_host()
US = 1e-6

# A machine with round numbers: 1 TFLOP/s, no shape penalty, no per-kernel cost,
# "infinite" HBM; links of 10 GB/s; NCCL at half the line rate.
TOY = sim.Preset(
    name="toy", gpu="toy", sms=100,
    peak_tflops={"bfloat16": 1.0, "float16": 1.0, "float32": 1.0},
    gemm_efficiency=1.0, hbm_gbps=1e12, link_gbps=10.0, nccl_gbps=5.0, p2p_gbps=10.0,
    multicast_gbps=10.0, gemm_m_half=0.0, gemm_n_half=0.0, gemm_k_half=0.0,
    gemm_overhead_us=0.0, nccl_latency_us=3.0, ce_latency_us=5.0, mc_latency_us=1.0,
    signal_latency_us=2.0, event_latency_us=0.0, nccl_sms=25, mc_sms=10)


def clique(op, transport, n, rows, k, n_out, **kw):
    return [host.build_program(op, transport, n, r, 1, rows, k, n_out, dtype="bfloat16", **kw)
            for r in range(n)]


def gemm_s(rows, k, n_out):
    return 2 * rows * k * n_out / 1e12


def test_pure_compute_is_the_sum_of_gemm_times():
    progs = clique("ag_matmul", "nccl", 1, 256, 512, 1024)
    tl = sim.simulate_programs(progs, TOY)
    assert tl.total == pytest.approx(gemm_s(256, 512, 1024))
    # with an overhead per kernel and the shape curve the time grows accordingly
    p = sim.get_preset("h100")
    tl = sim.simulate_programs(progs, p)
    assert tl.total == pytest.approx(sim.gemm_time(p, "bf16", 1, 256, 1024, 512))
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
                "id": tag, "chunk": -1, "sub": -1, "accumulate": False}
        progs[src]["ops"].append({**base, "kind": "Send", "peer": dst, "group": 0,
                                  "text": f"Send {src}->{dst}"})
        progs[dst]["ops"].append({**base, "kind": "Recv", "peer": src, "group": 0,
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


@pytest.mark.parametrize("transport", ["nccl", "p2p", "multicast"])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_all_programs_run_on_every_preset(op, transport):
    progs = clique(op, transport, 8, 128, 256, 512, chunks=2)
    for preset in sim.PRESETS.values():
        if transport in preset.transports:
            assert sim.simulate_programs(progs, preset).total > 0
