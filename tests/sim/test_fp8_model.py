"""The performance model with fp8 operands: the GEMM at the FP8 peak, half the bytes of x."""

import pytest

from jaxoverlap import sim
from jaxoverlap.sim import model
from jaxoverlap.sim import plan as sim_plan

# The performance model: no JAX.
pytestmark = pytest.mark.jax_independent

H100 = sim.get_preset("h100")
AG = sim.Shape.from_global(8192, 8192, 3584, 8)
RS = sim.Shape.from_global(8192, 3584, 8192, 8)


def test_an_fp8_gemm_runs_at_the_fp8_peak_where_there_is_one():
    big = (1, 8192, 8192, 8192)                      # compute-bound
    bf16, f8 = (model.gemm_time(H100, d, *big) for d in ("bfloat16", "float8_e4m3fn"))
    overhead = H100.gemm_overhead_us * 1e-6
    assert (bf16 - overhead) / (f8 - overhead) == pytest.approx(
        H100.peak_tflops["float8"] / H100.peak_tflops["bfloat16"], rel=1e-6)
    assert sim.get_preset("h100").peak("e5m2") == 1979.0
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

    def transfers(op, shape, dtype):
        ranks = sim_plan.programs(op, "p2p", 8, shape, dtype, 2, True, False)
        return sum(o["bytes"] for pr in ranks for o in pr["ops"]
                   if o["kind"] in ("Copy", "Send", "Recv", "McStore", "McReduce"))

    assert transfers("ag_matmul", AG, "fp8") * 2 == transfers("ag_matmul", AG, "bf16")
    assert transfers("matmul_rs", RS, "fp8") == transfers("matmul_rs", RS, "bf16")
    ranks = sim_plan.programs("ag_matmul", "p2p", 8, AG, "fp8", 1, False, False)
    assert {pr["dtype"] for pr in ranks} == {"float8_e4m3fn"}


@pytest.mark.slow
def test_fp8_projections_are_marked_and_never_fused():
    choice = sim.choose("ag_matmul", AG, "float8_e4m3fn", 8, H100)
    assert not any(r.candidate.fused for r in choice.table)
    assert any("no FP8 measurement" in why for why in choice.outside)
    bf16 = sim.choose("ag_matmul", AG, "bfloat16", 8, H100)
    assert choice.table[0].t_gemm < 0.55 * bf16.table[0].t_gemm      # xla's GEMM: ~half
    with pytest.raises(ValueError, match="no FP8 kernel"):
        sim.simulate("ag_matmul", AG, "fp8", 8, H100, sim.Candidate("native", "p2p", 1, True,
                                                                    fused=True))
    rows = sim.projection_table(["h100"], sim.FP8_CASES)
    assert {r["case"] for r in rows} == {"AG std fp8", "RS std fp8", "AG flux fp8",
                                         "RS flux fp8"}
    assert all(r["published"].startswith("—") for r in rows)
