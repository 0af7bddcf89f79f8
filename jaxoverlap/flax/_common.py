"""The computation shared by the linen and nnx layers: one place for both APIs.

A layer runs in one of two modes, chosen at trace time:

* **local** - ``axis_name`` is bound (the layer is called inside the user's
  ``jax.shard_map``): x, kernel and bias are local shards and the public ops
  run on them directly.
* **global** - ``axis_name`` is not bound: x, kernel and bias are global arrays
  and the whole layer (matmul *and* bias) is wrapped in one ``shard_map`` over
  the mesh from ``mesh=``, ``jax.set_mesh`` or the inputs' ``NamedSharding``.
  Wrapping the layer rather than the op keeps the bias add and the Megatron
  f/g collectives inside the same manual region, so Explicit and Auto mesh
  axes behave alike.

The Megatron f (identity forward, all-reduce backward) needs no custom rule:
with ``check_vma=True`` JAX's varying-axes types give ``pcast`` exactly that
transpose; with ``check_vma=False`` JAX transposes every value as if it
varied (``psum`` transposes to ``psum``, a replicated output's cotangent is
split over the ranks), which sums the gradient where Megatron needs it. A
hand-written custom_vjp would double count there (the tests cover both
settings). Megatron g (all-reduce forward, identity backward) is the GEMM
before it fused with the all-reduce, ``jaxoverlap.matmul_ar``, whose backward
follows the same two rules.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxoverlap.ops as ops
from jaxoverlap import _spmd
from jaxoverlap._compat import bound_axis_size, context_mesh, varying_axes
from jaxoverlap._config import check_impl

COLUMN = "column"
ROW = "row"


# ---------------------------------------------------------------- argument checks


def check_features(layer: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TypeError(f"{layer}: {name}={value!r} must be a positive int.")
    return value


def check_common(layer: str, *, axis_name: Any, sequence_parallel: Any, impl: Any,
                 use_bias: Any, kernel_init: Any, bias_init: Any, mesh: Any) -> None:
    """Checks the arguments every layer takes; raises naming the argument."""
    if not isinstance(axis_name, str) or not axis_name:
        raise TypeError(f"{layer}: axis_name={axis_name!r} must be the name (a str) of the "
                        "tensor-parallel mesh axis.")
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"{layer}: sequence_parallel={sequence_parallel!r} must be True or False.")
    if not isinstance(use_bias, bool):
        raise TypeError(f"{layer}: use_bias={use_bias!r} must be True or False.")
    check_impl(impl, where=f"{layer}: impl")
    for name, fn in (("kernel_init", kernel_init), ("bias_init", bias_init)):
        if not callable(fn):
            raise TypeError(f"{layer}: {name}={fn!r} must be an initializer "
                            "(key, shape, dtype) -> array.")
    if mesh is not None and not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise TypeError(f"{layer}: mesh={mesh!r} must be a jax.sharding.Mesh or None.")
    if mesh is not None and axis_name not in mesh.axis_names:
        raise ValueError(f"{layer}: axis_name={axis_name!r} is not an axis of mesh (its axes: "
                         f"{tuple(mesh.axis_names)}).")


def check_input(layer: str, x: Any) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{layer}: inputs must be an array, got {type(x).__name__}.")
    if x.ndim < 2:
        raise ValueError(f"{layer}: inputs must have rank >= 2 ([..., S, features], the sequence "
                         f"dim second to last); got shape {tuple(x.shape)}.")


def divide(layer: str, name: str, size: int, n: int, axis_name: str) -> int:
    """``size // n``, or a ValueError naming ``name`` when ``n`` does not divide it."""
    if size % n:
        raise ValueError(f"{layer}: {name}={size} is not divisible by the size {n} of mesh axis "
                         f"{axis_name!r}; use a multiple of {n}.")
    return size // n


def known_tp_size(axis_name: str, mesh: Any) -> int | None:
    """The size of ``axis_name`` in ``mesh`` or the ``jax.set_mesh`` mesh, if it is there."""
    target = mesh if mesh is not None else context_mesh()
    if target is None or axis_name not in target.axis_names:
        return None
    return target.shape[axis_name]


def tp_size_if_bound(axis_name: str) -> int | None:
    """The size of ``axis_name`` inside shard_map, else None (global mode)."""
    return bound_axis_size(axis_name)


def partition_names(kind: str, axis_name: str, param: str) -> tuple[Any, ...] | None:
    """The global layout of a parameter; None means replicated (no metadata)."""
    if kind == COLUMN:
        return (None, axis_name) if param == "kernel" else (axis_name,)
    return (axis_name, None) if param == "kernel" else None


# ---------------------------------------------------------------- Megatron f / g


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


# ---------------------------------------------------------------- local computation


def _precision_scope(precision: Any):
    """Applies ``precision`` to the fused ops, which take no precision argument."""
    if precision is None:
        return contextlib.nullcontext()
    if isinstance(precision, (tuple, list)):
        if len(set(precision)) != 1:
            raise ValueError(f"precision={precision!r}: the fused ops take one precision for "
                             "both operands.")
        precision = precision[0]
    if isinstance(precision, lax.Precision):
        precision = {lax.Precision.DEFAULT: "default", lax.Precision.HIGH: "high",
                     lax.Precision.HIGHEST: "highest"}[precision]
    return jax.default_matmul_precision(str(precision).lower())


def _dot(x, k, precision):
    return lax.dot_general(x, k, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)


def local_forward(kind: str, x, kernel, bias, *, axis_name: str, sequence_parallel: bool,
                  impl: str, precision: Any):
    """The layer on local shards, inside a shard_map where ``axis_name`` is bound."""
    # The kernel is sharded over axis_name, so under check_vma=True it varies
    # over it; check_vma=False leaves every type empty.
    typed = axis_name in varying_axes(kernel)
    seq = x.ndim - 2
    if kind == COLUMN:
        if sequence_parallel:
            with _precision_scope(precision):
                y = ops.ag_matmul(x, kernel, axis_name, axis=seq, impl=impl)
        else:
            y = _dot(copy_to_tp(x, axis_name, typed), kernel, precision)
    else:
        if sequence_parallel:
            with _precision_scope(precision):
                y = ops.matmul_rs(x, kernel, axis_name, axis=seq, impl=impl)
        else:  # Megatron g, fused with the GEMM before it
            with _precision_scope(precision):
                y = ops.matmul_ar(x, kernel, axis_name, impl=impl)
    if bias is not None:
        y = y + bias
    return y


# ---------------------------------------------------------------- global mode


def global_forward(layer: str, kind: str, x, kernel, bias, *, axis_name: str,
                   sequence_parallel: bool, impl: str, precision: Any, mesh: Any):
    """The layer on global arrays: one shard_map around :func:`local_forward`."""
    mesh = _spmd.resolve_mesh(layer, axis_name, mesh, x, kernel)
    n = mesh.shape[axis_name]
    seq, last = x.ndim - 2, x.ndim - 1
    if sequence_parallel:
        divide(layer, f"inputs.shape[{seq}] (the sequence length)", x.shape[seq], n, axis_name)
    if kind == COLUMN:
        divide(layer, "features", kernel.shape[1], n, axis_name)
    else:
        divide(layer, "inputs.shape[-1] (the input features)", x.shape[-1], n, axis_name)

    # Keep the other mesh axes (data parallel) x carries on its batch dims.
    entries = _spmd._batch_entries(layer, x, mesh, axis_name, last)
    if sequence_parallel:
        entries[seq] = None
    with_tp = lambda d: P(*[axis_name if i == d else e for i, e in enumerate(entries)])
    if kind == COLUMN:
        x_spec = with_tp(seq) if sequence_parallel else with_tp(None)
        y_spec = with_tp(last)
        k_spec, b_spec = P(None, axis_name), P(axis_name)
    else:
        x_spec = with_tp(last)
        y_spec = with_tp(seq) if sequence_parallel else with_tp(None)
        k_spec, b_spec = P(axis_name, None), P()

    local = functools.partial(local_forward, kind, axis_name=axis_name,
                              sequence_parallel=sequence_parallel, impl=impl,
                              precision=precision)
    if bias is None:
        fn = jax.shard_map(lambda x, k: local(x, k, None), mesh=mesh,
                           in_specs=(x_spec, k_spec), out_specs=y_spec)
        return fn(_spmd._place(x, mesh, x_spec), _spmd._place(kernel, mesh, k_spec))
    fn = jax.shard_map(local, mesh=mesh, in_specs=(x_spec, k_spec, b_spec),
                       out_specs=y_spec)
    return fn(_spmd._place(x, mesh, x_spec), _spmd._place(kernel, mesh, k_spec),
              _spmd._place(bias, mesh, b_spec))


def forward(layer: str, kind: str, x, kernel, bias, *, axis_name: str,
            sequence_parallel: bool, impl: str, precision: Any, mesh: Any):
    """Dispatches to the local or the global mode (see the module docstring)."""
    if tp_size_if_bound(axis_name) is not None:
        return local_forward(kind, x, kernel, bias, axis_name=axis_name,
                             sequence_parallel=sequence_parallel, impl=impl, precision=precision)
    return global_forward(layer, kind, x, kernel, bias, axis_name=axis_name,
                          sequence_parallel=sequence_parallel, impl=impl, precision=precision,
                          mesh=mesh)


def placed_init(init: Callable, names: tuple[Any, ...] | None, axis_name: str,
                mesh: Any) -> Callable:
    """Wraps ``init`` so its output is laid out as ``names`` on the mesh, when one is known.

    Under Explicit mesh axes Flax's partitioning metadata only asserts the
    layout, so the value is resharded here; under Auto axes a sharding
    constraint suffices. Inside shard_map (axis bound) values are local shards
    and stay as they are.
    """
    if names is None:
        return init

    def wrapped(key, shape, *args, **kwargs):
        value = init(key, shape, *args, **kwargs)
        if bound_axis_size(axis_name) is not None:
            return value
        target = mesh if mesh is not None else context_mesh()
        if target is None or axis_name not in target.axis_names:
            return value
        sharding = jax.sharding.NamedSharding(target, P(*names))
        if _spmd._is_explicit(target):
            return jax.reshard(value, sharding)
        return lax.with_sharding_constraint(value, sharding)

    return wrapped
