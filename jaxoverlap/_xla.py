"""The unfused reference: XLA's all_gather / psum_scatter / psum next to a dot.

This is what the fused paths are checked against and timed against. With fp8 operands the
collectives move what they moved before: the all-gather the fp8 x (its shards' scales, one
float32 each, gathered alongside), the reductions the partial products in the output dtype.
Block scales (MXFP8) are gathered with x's rows, e8m0 as they are; each GEMM dequantizes its
operands per block (``_fp8_dtypes.dequantize_blocks``) and multiplies them in float32: the
reference, not a block-scaled GEMM.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxoverlap._fp8_dtypes import block_scaled, dequantize_blocks, out_dtype
from jaxoverlap._plan import OpPlan


def local_matmul(x: jax.Array, w: jax.Array, out=None, scale=None,
                 precision=None) -> jax.Array:
    """``x @ w`` over x's last dim, accumulated in float32, times ``scale`` (the fp8
    operands' scales, a float32 scalar or an array broadcasting against the product), rounded
    once to ``out`` (default: x's dtype)."""
    y = lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32)
    if scale is not None:
        y = y * scale
    return y.astype(x.dtype if out is None else out)


def block_product(x: jax.Array, w: jax.Array, x_scale: jax.Array, w_scale: jax.Array,
                  precision=None) -> jax.Array:
    """``x @ w`` of block-scaled fp8 operands in float32: each dequantized per block of K
    (x's scales ``[..., rows, K/32]``, w's ``[K/32, N]``), then multiplied."""
    xd, wd = dequantize_blocks(x, x_scale, x.ndim - 1), dequantize_blocks(w, w_scale, 0)
    return lax.dot_general(xd, wd, (((x.ndim - 1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def scaled_matmul(x: jax.Array, w: jax.Array, scales: tuple, out, precision=None) -> jax.Array:
    """This rank's ``x @ w`` with its ``scales`` (none, per-tensor or block), rounded once to
    ``out``."""
    if block_scaled(scales):
        return block_product(x, w, *scales, precision).astype(out)
    return local_matmul(x, w, out, scale_product(scales), precision)


def per_row(values, rows: int, axis: int, ndim: int):
    """``values`` (one per shard) repeated ``rows`` times each, shaped to broadcast along
    ``axis`` of an array of rank ``ndim``."""
    shape = [1] * ndim
    shape[axis] = values.shape[0] * rows
    return jnp.repeat(values, rows).reshape(shape)


def ag_matmul(x: jax.Array, w: jax.Array, plan: OpPlan,
              scales: tuple = ()) -> tuple[jax.Array, jax.Array]:
    gathered = lax.all_gather(x, plan.axis_name, axis=plan.axis, tiled=True)
    out = out_dtype(x, plan.out_dtype)
    if not scales:
        return local_matmul(gathered, w, out), gathered
    x_scale, w_scale = scales
    if block_scaled(scales):  # x's block scales are gathered with its rows
        every = lax.all_gather(x_scale, plan.axis_name, axis=plan.axis, tiled=True)
        return block_product(gathered, w, every, w_scale).astype(out), gathered
    # The rows of shard r are (x_r * x_scale_r) @ (w * w_scale): each shard's own scale.
    every = lax.all_gather(x_scale, plan.axis_name) * w_scale
    scale = per_row(every, x.shape[plan.axis], plan.axis, x.ndim)
    return local_matmul(gathered, w, out, scale), gathered


def matmul_rs(x: jax.Array, w: jax.Array, plan: OpPlan, scales: tuple = ()) -> jax.Array:
    return lax.psum_scatter(scaled_matmul(x, w, scales, out_dtype(x, plan.out_dtype)),
                            plan.axis_name, scatter_dimension=plan.axis, tiled=True)


def matmul_ar(x: jax.Array, w: jax.Array, plan: OpPlan, scales: tuple = ()) -> jax.Array:
    return lax.psum(scaled_matmul(x, w, scales, out_dtype(x, plan.out_dtype)), plan.axis_name)


def scale_product(scales: tuple):
    """This rank's per-tensor ``x_scale * w_scale`` (None without fp8)."""
    return scales[0] * scales[1] if scales else None
