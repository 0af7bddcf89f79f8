"""sim.calibrate: points generated from a known preset are fitted back to it.

What `python -m jaxoverlap bench --calibrate` does on GPUs, checked on CPU: the
measured points here are the model's own times for a preset whose numbers we chose,
so the fit must recover those numbers.
"""

import pytest

from jaxoverlap import sim
from jaxoverlap.sim import fit, model

# The performance model: no JAX.
pytestmark = pytest.mark.jax_independent

MiB = 1 << 20
BASE = sim.get_preset("h100")


def test_gemm_points_recover_efficiency_k_curve_and_kernel_cost():
    truth = BASE.replace(gemm_efficiency=0.7, gemm_k_half=1500.0, gemm_overhead_us=5.0)
    shapes = [(2048, 2048, 13312), (2048, 8192, 8192), (2048, 4096, 4096), (4096, 6144, 12288),
              (1024, 3584, 8192), (8192, 8192, 2048)]
    points = [sim.GemmPoint(m, n, k, sim.gemm_time(truth, "bf16", 1, m, n, k))
              for m, n, k in shapes]
    fitted = sim.calibrate(BASE, gemm=points)
    assert fitted.gemm_best_shape == (2048, 2048, 13312)  # the fastest point
    assert fitted.gemm_efficiency == pytest.approx(0.7, rel=2e-3)
    assert fitted.gemm_k_half == pytest.approx(1500.0, rel=2e-2)
    assert fitted.gemm_overhead_us == pytest.approx(5.0, abs=0.2)
    for m, n, k in shapes:
        assert sim.gemm_time(fitted, "bf16", 1, m, n, k) == pytest.approx(
            sim.gemm_time(truth, "bf16", 1, m, n, k), rel=2e-3)


def test_collective_points_recover_bandwidth_and_ramp():
    truth = BASE.replace(nccl_gbps=300.0, nccl_ramp_us=1.2)
    points = [sim.CollectivePoint(op, 8, mib * MiB,
                                  sim.collective_time(truth, "nccl", 8, mib * MiB, op))
              for op in ("ag_matmul", "matmul_rs") for mib in (2, 8, 32, 128)]
    fitted = sim.calibrate(BASE, collectives=points)
    assert fitted.nccl_gbps == pytest.approx(300.0, rel=1e-3)
    assert fitted.nccl_ramp_us == pytest.approx(1.2, rel=1e-2)
    # a send/recv keeps its ratio to the ring collective
    assert fitted.nccl_p2p_gbps == pytest.approx(BASE.nccl_p2p_gbps * 300.0 / BASE.nccl_gbps,
                                                 rel=1e-3)
    # one size only: the ramp stays, the bandwidth is solved
    one = sim.calibrate(BASE, collectives=points[2:3])
    assert one.nccl_ramp_us == BASE.nccl_ramp_us
    assert sim.collective_time(one, "nccl", 8, 32 * MiB) == pytest.approx(points[2].seconds,
                                                                          rel=1e-3)


def test_concurrent_points_recover_interference_and_nccl_sms():
    truth = BASE.replace(interference=2.5, nccl_sms=20)
    points = [sim.ConcurrentPoint(8192, 8192, 8192, "ag_matmul", 8, 512 * MiB, 0.0, transport)
              for transport in ("p2p", "nccl")]
    points = [sim.ConcurrentPoint(**{**vars(c), "seconds": fit.simulate_concurrent(truth, c)})
              for c in points]
    fitted = sim.calibrate(BASE, concurrent=points)
    assert fitted.interference == pytest.approx(2.5, rel=1e-2)
    assert fitted.nccl_sms == 20


def test_fused_points_recover_the_fixed_costs_and_set_the_margin():
    scale = 1.7
    truth = BASE.replace(**{k: getattr(BASE, k) * scale for k in fit.FUSED_PATH_COSTS})
    points = []
    for op, m, k, n in (("ag_matmul", 2048, 8192, 3584), ("matmul_rs", 4096, 3584, 8192)):
        shape = sim.Shape.from_global(m, k, n, 8)
        c = sim.Candidate("native", "p2p", 1, True)
        r = sim.simulate(op, shape, "bf16", 8, truth, c)
        points.append(sim.FusedPoint(op, shape, "bf16", 8, c, r.t_fused, r.t_xla))
    fitted = sim.calibrate(BASE, fused=points)
    for key in fit.FUSED_PATH_COSTS:
        assert getattr(fitted, key) == pytest.approx(getattr(truth, key), rel=1e-2), key
    # the model now matches every point: the measured families' margins are only what rounding
    # leaves, and so are their ops' (GEMM+AR, not measured, takes the larger of its two halves');
    # the families not measured (the fused ones) keep the base's, derived from published rows
    measured = ("ag_matmul:chunked", "matmul_rs:chunked", "ag_matmul", "matmul_rs", "matmul_ar")
    assert all(0.0 <= fitted.min_gain[k] < 0.01 for k in measured)
    assert fitted.min_gain["matmul_ar"] == max(fitted.min_gain["ag_matmul"],
                                               fitted.min_gain["matmul_rs"])
    assert fitted.min_gain["matmul_rs:fused"] == BASE.min_gain["matmul_rs:fused"] > 0.1
    assert fitted.margin("matmul_rs", "matmul_rs:chunked") < 0.01
    # the preset records the range it was calibrated on
    assert set(fitted.calibrated) >= {"gemm_flop", "collective_bytes", "ag_matmul",
                                      "matmul_rs"}


def test_fused_points_the_gpu_bounds_leave_the_host_costs_alone():
    """A call whose GPU time exceeds the host's enqueue does not see the host's costs: the fit
    keeps them (any scale up to the host bound fits it equally)."""
    shape = sim.Shape.from_global(8192, 8192, 3584, 8)
    c = sim.Candidate("native", "p2p", 1, True, fused=True)
    r = sim.simulate("ag_matmul", shape, "bf16", 8, BASE, c)
    assert r.t_fused > model.host_time(BASE, [{"ops": [{}] * 40}])  # ~30 ops: GPU-bound
    fitted = sim.calibrate(BASE, fused=[sim.FusedPoint("ag_matmul", shape, "bf16", 8, c,
                                                       r.t_fused, r.t_xla)])
    for key in fit.FUSED_PATH_COSTS:
        assert getattr(fitted, key) == getattr(BASE, key), key


def test_margin_from_errors():
    # serial errors of +-5%: a plan must be predicted 5% faster
    assert fit.margin([0.05, -0.03], [1.0]) == 0.05
    # a fused call 25% slower than predicted: 1 - 1/1.25 = 20%
    assert fit.margin([0.05], [1.25, 0.9]) == pytest.approx(0.2)
    assert fit.margin([], []) == 0.0
    # rounded up, never down: a plan projected 1.1428x where its design lost (TDH-s4's ratio,
    # a loss counted as no gain) needs 1 - 1/1.1428 = 12.49% and gets 12.5%, so that plan
    # (t = xla / 1.1428 > xla x (1 - 0.125)) stays unfused
    assert fit.margin([0.0], [1.1428]) == 0.125 > 1 - 1 / 1.1428
    assert fit.margin([0.0], [1.1432]) == 0.126


def test_pipelined_time_is_the_best_chunk_count():
    """(sqrt(ramp) + sqrt(x))^2 is the optimum over chunk counts c of a pipeline of d stages
    whose every chunk pays alpha per stage: T(c) = (c + d - 1) (alpha + x / c), with
    ramp = (d - 1) alpha. Checked against integer chunk counts."""
    for d, alpha, x in ((2, 3.0, 50.0), (8, 0.5, 400.0), (3, 2.0, 5.0)):
        best = min((c + d - 1) * (alpha + x / c) for c in range(1, 2000))
        assert model.pipelined_time((d - 1) * alpha, x) == pytest.approx(best, rel=0.01)
    assert model.pipelined_time(3.0, 0.0) == 3.0
