"""FP8 operands of the ops: which dtypes they are, the output dtype they default to, their scales.

An fp8 operand stands for ``a.astype(float32) * a_scale``: the ops take its float32
dequantization scale next to it (``x_scale=`` / ``w_scale=``), multiply the fp8 values
themselves, accumulate in float32 and apply the scales to the product before its one rounding
to the output dtype. The scales travel as a pair ``(x_scale, w_scale)`` of float32 scalars
(shape ``()``), 1.0 for an operand that is not fp8; calls without fp8 operands carry none
(``()``), and run exactly as before FP8 existed.

Block scales (MXFP8, the OCP Microscaling format v1.0,
https://www.opencompute.org/documents/ocp-microscaling-formats-mx-v1-0-spec-final-pdf): instead,
one ``float8_e8m0fnu`` scale (a power of two) per :data:`BLOCK` consecutive elements along the
contraction dim K, laid out as ``jax.nn.scaled_matmul``'s scales are: the operand's shape with
K divided by 32 (x ``[..., rows, K/32]``, w ``[K/32, N]``). Both operands fp8, both
block-scaled; the pair is then two e8m0 arrays (:func:`block_scaled`). The ``xla`` and
``ring`` impls dequantize each block to float32 and multiply in float32, and so does the host
executor (``native`` on CPU); the CUDA executor's block-scaled cuBLASLt GEMMs on compute
capability 10.x take them in cuBLAS's tiled layout (``_plan.BLOCK_SCALED_REASON``).

The ops with fp8 operands are a forward building block: a gradient with respect to fp8 values
means nothing (quantization has no derivative). Training goes through ``jaxoverlap.fp8``,
whose own rule quantizes the gradients (e5m2) and passes them straight through to the
high-precision inputs and weights, as Flax's FP8 recipe does.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxoverlap import _kinds

FP8_DTYPES = tuple(jnp.dtype(name) for name in _kinds.names(_kinds.DTYPES, fp8=True))
# What y may be with fp8 operands (lax.dot_general's preferred_element_type); bfloat16 by
# default, as an FP8 GEMM writes in training recipes (TransformerEngine, Flax).
OUT_DTYPES = tuple(jnp.dtype(name) for name in _kinds.names(_kinds.DTYPES, out=True))
DEFAULT_OUT = jnp.dtype(jnp.bfloat16)
# MXFP8's block: one e8m0 scale per 32 consecutive elements along K (OCP MX v1.0, MXFP8).
BLOCK = 32
# cuBLASLt's tile of block scales: 128 rows (or columns of w) by 4 blocks, i.e. 128 of K
# (cuBLAS docs, "1D Block Scaling Factors Layout"; cpp/cuda/gemm/block_scales.h); the CUDA
# executor moves and reads whole tiles only.
SCALE_TILE_ROWS = 128
SCALE_DTYPE = jnp.dtype(jnp.float8_e8m0fnu)


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in FP8_DTYPES


def any_fp8(*arrays) -> bool:
    return any(is_fp8(a.dtype) for a in arrays)


def gemm_dtype(x, w):
    """The dtype a call's GEMMs run in, as the performance model prices them (its rate and its
    programs): the fp8 operand's if any, else x's. Whether an executor runs the call depends
    on both operands' dtypes (``capabilities.unavailable_reason``)."""
    for a in (x, w):
        if is_fp8(a.dtype):
            return jnp.dtype(a.dtype)
    return jnp.dtype(x.dtype)


def block_scaled(scales: tuple) -> bool:
    """Whether a call's ``(x_scale, w_scale)`` are block scales (e8m0 arrays)."""
    return bool(scales) and jnp.dtype(scales[0].dtype) == SCALE_DTYPE


def dequantize_blocks(a, scale, axis: int):
    """``a`` in float32, each run of :data:`BLOCK` elements along ``axis`` (K) times its e8m0
    scale: exact wherever float32 holds the value (an e4m3 significand times a power of two)."""
    return a.astype(jnp.float32) * jnp.repeat(scale.astype(jnp.float32), BLOCK, axis=axis)


def quantize_blocks(a, q_dtype, axis: int):
    """``a`` as MXFP8: ``(q, scale)``, ``q`` in ``q_dtype`` (e4m3 or e5m2) and ``scale`` one e8m0
    power of two per :data:`BLOCK` consecutive elements along ``axis`` (``a``'s shape with that
    dim divided by 32), the conversion of the OCP MX spec v1.0, §6.3 (as
    https://github.com/microsoft/microxcaling ``mx/mx_ops.py`` ``_quantize_mx`` computes it):

    * the block's shared exponent is ``floor(log2(amax)) - emax`` (``emax``: the exponent of
      the element type's largest normal, 8 for e4m3, 15 for e5m2), clamped to e8m0's
      ``[-127, 127]`` (a block of zeros takes -127; one with an inf or NaN a NaN scale);
    * each element is divided by ``2**exponent`` (exact: times ``2**-exponent``) and rounded
      to nearest even in ``q_dtype``, saturating at its largest finite value (the block's
      largest element keeps its exponent, so only its top significands saturate).

    TransformerEngine and ``jax.nn.scaled_matmul``'s quantizer round the scale up instead
    (``amax / max`` to the next power of two: nothing saturates, one bit less for the rest);
    this is the spec's rule. ``a.shape[axis]`` must be a multiple of 32 (the caller says how to
    fix it)."""
    axis = axis % a.ndim
    assert a.shape[axis] % BLOCK == 0, (a.shape, axis)
    q_dtype = jnp.dtype(q_dtype)
    info = jnp.finfo(q_dtype)
    emax, top = int(info.maxexp) - 1, float(info.max)
    v = a.astype(jnp.float32)
    blocks = v.reshape(v.shape[:axis] + (v.shape[axis] // BLOCK, BLOCK) + v.shape[axis + 1:])
    amax = jnp.max(jnp.abs(blocks), axis=axis + 1)
    _, e = jnp.frexp(amax)                      # amax = m * 2**e, m in [0.5, 1): floor(log2) = e-1
    exponent = jnp.clip(e - 1 - emax, -127, 127)
    exponent = jnp.where(amax == 0, -127, exponent)
    raw = jnp.where(jnp.isfinite(amax), exponent + 127, 255).astype(jnp.uint8)
    scale = lax.bitcast_convert_type(raw, SCALE_DTYPE)
    # 2**-exponent from its bits (a normal float32: a finite amax gives exponent <= 127 - emax)
    inverse = lax.bitcast_convert_type(((127 - exponent) << 23).astype(jnp.int32), jnp.float32)
    q = jnp.clip(v * jnp.repeat(inverse, BLOCK, axis=axis), -top, top).astype(q_dtype)
    return q, scale


def out_dtype(x, out: str | None):
    """y's dtype: ``out`` (the plan's ``out_dtype``), else x's."""
    return jnp.dtype(out) if out is not None else jnp.dtype(x.dtype)


def no_gradient(op: str) -> TypeError:
    """What differentiating an op with fp8 operands raises."""
    return TypeError(
        f"{op}: jax.grad through an op with float8 operands is not defined (the fp8 values "
        f"are quantized; quantization has no derivative). Differentiate "
        f"jaxoverlap.fp8.{op} instead: it quantizes high-precision x and w with their "
        "scales, runs this op in fp8 and passes the e5m2-quantized gradients straight "
        "through to x and w (Flax's FP8 recipe).")
