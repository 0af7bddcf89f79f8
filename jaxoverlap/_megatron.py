"""Megatron's f and g around a plain matmul: tensor parallelism without sequence parallelism.

* ``copy_matmul`` (column layer, f): the input is replicated over
  ``axis_name`` and multiplied by the local column block of w; f is the
  identity forward and an all-reduce of the input's gradient backward.
* ``matmul_reduce`` (row layer, g): the partial products of the local row
  blocks are all-reduced forward; g's backward is the identity.

Like the public ops, both run on local shards inside ``jax.shard_map`` (where
``axis_name`` is bound) and on global arrays outside it (``_spmd``: the
layouts ``matmul`` and ``matmul_psum``).

Inside ``shard_map`` f and g need no custom rules: with ``check_vma=True``
JAX's varying-axes types give ``pcast``/``psum`` exactly those transposes;
with ``check_vma=False`` JAX transposes every value as if it varied (``psum``
transposes to ``psum``, a replicated output's cotangent is split over the
ranks), which sums the gradient where Megatron needs it. Hand-written
custom_vjps would double count there.
"""

from __future__ import annotations

from typing import Any

from jax import lax

from jaxoverlap import _spmd
from jaxoverlap._compat import bound_axis_size, varying_axes


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


def reduce_from_tp(x, axis_name: str, typed: bool):
    """Megatron g: all-reduce forward; the backward follows from ``psum``'s transpose."""
    del typed  # psum's transpose is right under both check_vma settings
    return lax.psum(x, axis_name)


def copy_matmul(x, w, axis_name: str, *, precision: Any = None, mesh: Any = None):
    """``f(x) @ w``: x replicated over ``axis_name``, w and the result split on their last dim."""
    if bound_axis_size(axis_name) is None:
        return _global(_spmd.F, x, w, axis_name, precision, mesh)
    # The kernel is sharded over axis_name, so under check_vma=True it varies
    # over it; check_vma=False leaves every type empty.
    typed = axis_name in varying_axes(w)
    return _dot(copy_to_tp(x, axis_name, typed), w, precision)


def matmul_reduce(x, w, axis_name: str, *, precision: Any = None, mesh: Any = None):
    """``g(x @ w)``: x and w split on the contraction, the result all-reduced (replicated)."""
    if bound_axis_size(axis_name) is None:
        return _global(_spmd.G, x, w, axis_name, precision, mesh)
    typed = axis_name in varying_axes(w)
    return reduce_from_tp(_dot(x, w, precision), axis_name, typed)


def _global(kind: str, x, w, axis_name: str, precision: Any, mesh: Any):
    op = "copy_matmul" if kind == _spmd.F else "matmul_reduce"
    mesh = _spmd.resolve_mesh(op, axis_name, mesh, x, w)
    call = _spmd.make_call(kind, axis_name, x.ndim, precision=precision)
    return _spmd.run(call, mesh, x, w)
