"""The tensor-parallel MLP block, forward and backward, projected per impl (a model).

What ``examples/scaling.py`` times on the devices present (``ParallelMLP``: column layer,
gelu, row layer; ``jax.value_and_grad`` of it), composed from the model's projections of
its calls, per rank:

* sequence parallel: forward AG+GEMM ``[B, S/N, H] -> [B, S, F/N]``, gelu, GEMM+RS back to
  ``[B, S/N, H]``; backward the mirror images (GEMM+RS's input gradient is an AG+GEMM of
  the output gradient, AG+GEMM's a GEMM+RS) and the two weight gradients, local GEMMs
  contracting the ``B * S`` rows (the gathered activations are reused);
* without it (Megatron's f / g): a local GEMM, gelu, GEMM+AR forward; backward the two
  local GEMMs of GEMM+AR's cotangent, the column layer's weight and input gradients, and
  the all-reduce of that input gradient (f's backward, an unfused all-reduce for every
  impl).

Each call runs as its impl would on the preset's GPUs: ``"xla"`` the unfused collective then
the GEMM, ``"ring"`` the ``ppermute`` ring (both directions when N > 2, one chunk: the plan's
defaults), ``"native"`` the native plan the model picks for that call (``sim.choose`` among
the native candidates). Calls are added up: the block's calls depend on each other, one
after the other. Gelu's passes over the hidden activations are memory-bound kernels, the
same for every impl. A model, not a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxoverlap.sim import model
from jaxoverlap.sim.model import Shape
from jaxoverlap.sim.plan import Candidate, candidates, choose, simulate
from jaxoverlap.sim.presets import Preset, canonical_dtype, dtype_bytes, load_preset

IMPLS = ("xla", "ring", "native")
# Gelu over the hidden activations: forward reads x and writes y, backward reads x and the
# gradient and writes the input gradient.
_GELU_PASSES = (2, 3)


@dataclass(frozen=True)
class BlockProjection:
    """One block's projected forward + backward time on a preset, and its parts (seconds)."""

    preset: str
    impl: str
    seconds: float
    calls: tuple[tuple[str, str, float], ...]   # (op, plan, seconds) of each collective call
    local: float                                # the local GEMMs and gelu, every impl alike


def mlp_block(preset: str | Preset, impl: str, *, tp: int, batch: int, rows: int, hidden: int,
              ffn: int, dtype: str = "bfloat16",
              sequence_parallel: bool = True) -> BlockProjection:
    """Projects ``examples/scaling.py``'s block — ``rows`` the global sequence length,
    ``ffn`` split over ``tp`` ranks — on ``preset``'s GPUs run as ``impl``."""
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    split = rows if sequence_parallel else batch * rows
    if tp < 1 or split % tp or ffn % tp:
        raise ValueError(f"the block splits {'rows' if sequence_parallel else 'batch * rows'}="
                         f"{split} and ffn={ffn} over tp={tp}: they must be multiples of it")
    p = load_preset(preset)
    dtype = canonical_dtype(dtype)
    f = ffn // tp
    local = 0.0
    activations = batch * rows * f * dtype_bytes(dtype)
    for passes in _GELU_PASSES:
        local += model.elementwise_time(p, activations, passes)
    if sequence_parallel:
        up, down = Shape(batch, rows // tp, hidden, f), Shape(batch, rows // tp, f, hidden)
        # forward AG(up), RS(down); backward AG(down's gradient), RS(up's input gradient)
        ops = (("ag_matmul", up), ("matmul_rs", down), ("ag_matmul", up),
               ("matmul_rs", down))
        # the weight gradients: [H, B*S] @ [B*S, F/N] and [F/N, B*S] @ [B*S, H]
        local += 2 * model.gemm_time(p, dtype, 1, hidden, f, batch * rows)
    else:
        ops = (("matmul_ar", Shape(1, batch * rows, f, hidden)),)
        m = batch * rows
        # forward x @ W1; backward GEMM+AR's two GEMMs, W1's gradient and x's gradient
        local += model.gemm_time(p, dtype, 1, m, f, hidden)            # x @ W1
        local += model.gemm_time(p, dtype, 1, m, f, hidden)            # dy @ W2^T
        local += model.gemm_time(p, dtype, 1, f, hidden, m)            # h^T dy
        local += model.gemm_time(p, dtype, 1, hidden, f, m)            # x^T dh
        local += model.gemm_time(p, dtype, 1, m, hidden, f)            # dh @ W1^T
        local += model.collective_time(p, "nccl", tp, m * hidden * dtype_bytes(dtype),
                                       "matmul_ar")                    # f's backward psum
    calls, done = [], {}
    for op, shape in ops:
        if (op, shape) not in done:        # forward and backward calls alike: once
            done[op, shape] = _call(p, impl, op, shape, dtype, tp)
        calls.append((op, done[op, shape].candidate.label, done[op, shape].t_fused))
    return BlockProjection(p.name, impl, local + sum(t for *_, t in calls), tuple(calls), local)


def _call(p: Preset, impl: str, op: str, shape: Shape, dtype: str, tp: int):
    if impl == "xla":
        return simulate(op, shape, dtype, tp, p, Candidate("xla", None))
    if impl == "ring":
        return simulate(op, shape, dtype, tp, p, Candidate("ring", None, 1, tp > 2))
    native = candidates(p, tp, shape, impls=("native",), op=op, dtype=dtype)
    return choose(op, shape, dtype, tp, p, native, unfused=False).best
