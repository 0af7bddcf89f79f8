"""The native impl alone on local shards, for the executor's tests: no planning, no autodiff.

Call inside ``jax.shard_map``; the plan is given field by field (``_plan.OpPlan``'s), as the
public ops would have made it, and bound to the native primitive as they bind it (fp8: with
``x_scale`` / ``w_scale``, this rank's own, and ``out_dtype``).
"""

from __future__ import annotations

from jax import lax

from jaxoverlap._native import primitive
from jaxoverlap._plan import OpPlan


def plan(op: str, axis_name: str = "tp", axis: int = 0, **fields) -> OpPlan:
    return OpPlan(op=op, impl="native", axis_name=axis_name, axis=axis,
                  axis_size=int(lax.axis_size(axis_name)), **fields)


def ag_matmul(x, w, *, axis_name: str = "tp", return_gathered: bool = False, x_scale=None,
              w_scale=None, **fields):
    return primitive.ag_matmul(x, w, plan("ag_matmul", axis_name, **fields), return_gathered,
                               x_scale=x_scale, w_scale=w_scale)


def matmul_rs(x, w, *, axis_name: str = "tp", x_scale=None, w_scale=None, **fields):
    return primitive.matmul_rs(x, w, plan("matmul_rs", axis_name, **fields), x_scale=x_scale,
                               w_scale=w_scale)


def matmul_ar(x, w, *, axis_name: str = "tp", x_scale=None, w_scale=None, **fields):
    return primitive.matmul_ar(x, w, plan("matmul_ar", axis_name, **fields), x_scale=x_scale,
                               w_scale=w_scale)
