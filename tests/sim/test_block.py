"""The MLP block's projection (``sim.mlp_block``, what ``make demo`` shows next to its table)."""

import pytest

from jaxoverlap import sim
from jaxoverlap.sim import model

# The performance model: no JAX.
pytestmark = pytest.mark.jax_independent

BLOCK = dict(tp=4, batch=2, rows=1024, hidden=512, ffn=2048, dtype="bfloat16")


def test_the_unfused_block_is_its_gemms_collectives_and_gelu():
    """Sequence parallel, impl="xla": per rank, forward AG then GEMM [B, S, H] x [H, F/N], gelu,
    GEMM [B, S, F/N] x [F/N, H] then RS; backward the same collectives and GEMMs once more,
    and the two weight gradients (written out here from the model's GEMM and collective
    costs, not from the block's composition)."""
    p = sim.load_preset("h100")
    tp, b, s, h, f = 4, 2, 1024, 512, 2048 // 4
    ag = (model.gemm_time(p, "bfloat16", b, s, f, h)
          + model.collective_time(p, "nccl", tp, b * s * h * 2, "ag_matmul"))
    rs = (model.gemm_time(p, "bfloat16", b, s, h, f)
          + model.collective_time(p, "nccl", tp, b * s * h * 2, "matmul_rs"))
    grads = model.gemm_time(p, "bfloat16", 1, h, f, b * s) * 2
    gelu = model.elementwise_time(p, b * s * f * 2, 2) + model.elementwise_time(p, b * s * f * 2, 3)
    got = sim.mlp_block(p, "xla", **BLOCK)
    assert got.seconds == pytest.approx(2 * ag + 2 * rs + grads + gelu, rel=1e-9)
    assert [op for op, *_ in got.calls] == ["ag_matmul", "matmul_rs", "ag_matmul", "matmul_rs"]


def test_native_runs_the_models_native_plan_and_grows_with_the_problem():
    small = sim.mlp_block("b200", "native", **BLOCK)
    assert all(plan.startswith("native ") for _, plan, _ in small.calls), small.calls
    big = sim.mlp_block("b200", "native", **dict(BLOCK, rows=8192))
    assert big.seconds > small.seconds
    ring = sim.mlp_block("b200", "ring", **BLOCK)
    assert all(plan.startswith("ring") for _, plan, _ in ring.calls), ring.calls
    # Without sequence parallelism: one GEMM + all-reduce forward (f's backward all-reduce
    # and the local GEMMs are the same for every impl).
    ar = sim.mlp_block("b200", "xla", **BLOCK, sequence_parallel=False)
    assert [op for op, *_ in ar.calls] == ["matmul_ar"]


def test_misuse_names_the_argument():
    with pytest.raises(ValueError, match="impl"):
        sim.mlp_block("h100", "fast", **BLOCK)
    with pytest.raises(ValueError, match="multiples of it"):
        sim.mlp_block("h100", "xla", **dict(BLOCK, rows=1022))
