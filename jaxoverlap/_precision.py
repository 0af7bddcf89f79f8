"""The ops' ``precision``: JAX's dot precision semantics, for every impl.

``precision`` is what ``lax.dot_general`` takes (None, a ``lax.Precision``, its
name, or a pair of equal ones); None defers to ``jax.default_matmul_precision``
as a ``jnp.dot`` would. The unfused and ring impls trace their dots under it;
the native impl hands the CUDA executor one bit: whether its float32 GEMMs may
use TF32 tensor cores (cuBLASLt's ``CUBLAS_COMPUTE_32F_FAST_TF32``), as XLA's
own float32 dots may at ``DEFAULT`` on A100/H100-class GPUs. ``HIGHEST`` (and
the ``"float32"`` setting) never do.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
from jax import lax

# lax.Precision's names and the jax_default_matmul_precision spellings that mean them.
_NAMES = {"default": "default", "fastest": "default", "bfloat16": "default",
          "high": "high", "tensorfloat32": "high", "bfloat16_3x": "high",
          "highest": "highest", "float32": "highest"}


def normalize(op: str, precision: Any) -> str | None:
    """``precision`` as "default", "high" or "highest" (None: defer to JAX's default)."""
    if precision is None:
        return None
    if isinstance(precision, (tuple, list)):
        if len(precision) != 2 or len({normalize(op, p) for p in precision}) != 1:
            raise ValueError(f"{op}: precision={precision!r}: the fused ops take one precision "
                             "for both operands; pass a single lax.Precision.")
        return normalize(op, precision[0])
    if isinstance(precision, lax.Precision):
        return {lax.Precision.DEFAULT: "default", lax.Precision.HIGH: "high",
                lax.Precision.HIGHEST: "highest"}[precision]
    if isinstance(precision, str) and precision.lower() in _NAMES:
        return _NAMES[precision.lower()]
    raise ValueError(f"{op}: precision={precision!r} is not a precision the ops take; pass None, "
                     "a jax.lax.Precision (DEFAULT, HIGH, HIGHEST) or its name.")


def effective(precision: str | None) -> str:
    """The precision a dot traced now would use: ``precision``, else JAX's default."""
    if precision is not None:
        return precision
    ambient = jax.config.jax_default_matmul_precision
    return _NAMES.get(str(ambient).lower(), "default") if ambient else "default"


def allows_tf32(precision: str | None) -> bool:
    """May float32 GEMMs round their inputs to TF32? Not at HIGHEST."""
    return effective(precision) != "highest"


def scope(precision: str | None):
    """Traces the dots inside at ``precision`` (nothing to do for None)."""
    if precision is None:
        return contextlib.nullcontext()
    return jax.default_matmul_precision(precision)
