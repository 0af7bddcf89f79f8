"""The unfused reference: XLA's all_gather / psum_scatter / psum next to a dot.

This is what the fused paths are checked against and timed against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxoverlap._plan import OpPlan


def local_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` over x's last dim, accumulated in float32, returned in x's dtype."""
    out = lax.dot_general(
        x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    return out.astype(x.dtype)


def ag_matmul(x: jax.Array, w: jax.Array, plan: OpPlan) -> tuple[jax.Array, jax.Array]:
    gathered = lax.all_gather(x, plan.axis_name, axis=plan.axis, tiled=True)
    return local_matmul(gathered, w), gathered


def matmul_rs(x: jax.Array, w: jax.Array, plan: OpPlan) -> jax.Array:
    return lax.psum_scatter(
        local_matmul(x, w), plan.axis_name, scatter_dimension=plan.axis, tiled=True
    )


def matmul_ar(x: jax.Array, w: jax.Array, plan: OpPlan) -> jax.Array:
    return lax.psum(local_matmul(x, w), plan.axis_name)
