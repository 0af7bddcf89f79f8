"""Megatron's f around a plain matmul: the column layer without sequence parallelism.

``copy_matmul``: the input is replicated over ``axis_name`` and multiplied by
the local column block of w; f is the identity forward and an all-reduce of
the input's gradient backward. (The row layer's g, an all-reduce forward, is
fused with its GEMM: ``jaxoverlap.matmul_ar``.)

This is the per-device code, on local shards (``axis_name`` bound); on global
arrays ``ops.copy_matmul`` runs it on every device (the layout ``matmul`` of
``_layout``), as the public ops run theirs.

Inside ``shard_map`` f needs no custom rule: with ``check_vma=True`` JAX's
varying-axes types give ``pcast`` exactly that transpose; with
``check_vma=False`` JAX transposes every value as if it varied (``psum``
transposes to ``psum``, a replicated output's cotangent is split over the
ranks), which sums the gradient where Megatron needs it. A hand-written
custom_vjp would double count there.
"""

from __future__ import annotations

from typing import Any

from jax import lax

from jaxoverlap._compat import varying_axes


def _dot(x, w, precision):
    return lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)


def copy_to_tp(x, axis_name: str, typed: bool):
    """Megatron f: identity forward, all-reduce of the gradient backward.

    Under ``check_vma=True``, ``pcast`` to varying moves no data and transposes
    to the psum f needs. Under ``check_vma=False`` JAX transposes every value as
    if it varied: the all-reduce then happens where the gradient meets a
    ``psum`` (Megatron g, whose transpose is a psum there) or the shard_map
    boundary, so f is the identity both ways.
    """
    if not typed or axis_name in varying_axes(x):
        return x
    return lax.pcast(x, (axis_name,), to="varying")


def copy_matmul(x, w, axis_name: str, *, precision: Any = None):
    """``f(x) @ w`` on local shards: x replicated over ``axis_name``, w and the result split on
    their last dim."""
    # The kernel is sharded over axis_name, so under check_vma=True it varies
    # over it; check_vma=False leaves every type empty.
    typed = axis_name in varying_axes(w)
    return _dot(copy_to_tp(x, axis_name, typed), w, precision)
