"""Global arrays under ``Auto`` mesh axes: the ops as primitives that take part in propagation.

Under Auto axes a jitted program's shardings are decided by XLA's sharding
propagation (Shardy) after tracing, so an op cannot read them from its inputs'
types: a ``shard_map`` placed at trace time would have to guess the mesh axes
of the batch, and guessing "replicated" makes every data-parallel group compute
the whole batch. Here each op is a ``jax.experimental.custom_partitioning``
primitive instead, the mechanism JAX provides for fused ops (TransformerEngine
uses it the same way, see github.com/NVIDIA/TransformerEngine,
``transformer_engine/jax/cpp_extensions``):

* a Shardy sharding rule ties each pass-through dim of x (the batch dims) to the
  same dim of the outputs, and the tensor-parallel dims of x, w and y to each
  other, so a data or FSDP axis on the batch flows through the op;
* the partition callback receives the shardings propagation chose and the
  concrete mesh, keeps the other mesh axes x carries on its pass-through dims,
  asks for the tensor-parallel layout on ``axis_name`` (parameters sharded on
  their other dim, FSDP, are gathered for the call) and returns the per-device
  function: the op on local shards, exactly what runs inside ``shard_map``;
* autodiff is a ``custom_vjp`` over the primitives: AG+GEMM's backward is a
  GEMM+RS primitive and vice versa, the weight gradients are plain dots that
  XLA partitions (reducing over data axes, or reduce-scattering onto an FSDP
  layout).

Four primitive kinds, each with its per-device layout (``r`` the row dim
``axis``, ``..`` the pass-through dims, ``tp`` = ``axis_name``):

==============  =====================  ============  ====================
kind            x                      w             y
==============  =====================  ============  ====================
``ag_matmul``   ``[.., r:tp, k]``      ``[k, n:tp]``  ``[.., r, n:tp]`` (+ gathered x)
``matmul_rs``   ``[.., r, f:tp]``      ``[f:tp, n]``  ``[.., r:tp, n]``
``matmul``      ``[.., k]``            ``[k, n:tp]``  ``[.., n:tp]`` (Megatron f)
``matmul_psum`` ``[.., f:tp]``         ``[f:tp, n]``  ``[.., n]`` (Megatron g)
==============  =====================  ============  ====================

Settings read at trace time (``jo.config``, ``jax.default_matmul_precision``)
are carried into the partition callback, which runs when XLA compiles.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxoverlap import _spmd
from jaxoverlap._config import config
from jaxoverlap._spmd import AG, RS, Call, free_dims, layouts


def open_layouts(call: Call) -> tuple[P, tuple[P, ...]]:
    """x's and the outputs' layouts with the pass-through dims left to propagation."""
    u = P.UNCONSTRAINED
    x_spec, _, out_specs = layouts(call, (None,) * call.ndim)
    free = free_dims(call)

    def reopen(spec: P) -> P:
        return P(*[e if d in free else u for d, e in enumerate(spec)])

    return reopen(x_spec), tuple(reopen(s) for s in out_specs)


def sharding_rule(call: Call, mesh, value_types, result_types) -> str:
    """The Shardy rule: pass-through dims shared by x and the outputs; tp dims tied together.

    Factors ``b<d>`` are x's pass-through dims. The row dims and the contraction
    dims that are not split over ``axis_name`` get factors of their own, so
    propagation carries nothing across them (an FSDP axis on a kernel's other
    dim must not leak onto the activations).
    """
    del mesh, value_types, result_types
    last, row = call.ndim - 1, call.axis

    def dims(row_factor: str, last_factor: str) -> str:
        return " ".join(row_factor if d == row else (last_factor if d == last else f"b{d}")
                        for d in range(call.ndim))

    if call.kind == AG:      # y's columns are w's (split over tp); the gathered x is free
        return f"{dims('r', 'k')}, q n -> {dims('s', 'n')}, {dims('t', 'c')}"
    if call.kind == RS:      # x's features are w's rows (split over tp)
        return f"{dims('r', 'f')}, f m -> {dims('s', 'n')}"
    if call.kind == _spmd.F:
        return f"{dims('', 'k')}, q n -> {dims('', 'n')}"
    return f"{dims('', 'f')}, f m -> {dims('', 'n')}"


# ---------------------------------------------------------------- per device


@contextlib.contextmanager
def _device_context(call: Call, mesh: Mesh) -> Iterator[None]:
    """Where the per-device function is traced: every mesh axis manual, trace-time settings."""
    manual = mesh.abstract_mesh.update_axis_types({a: AxisType.Manual for a in mesh.axis_names})
    with contextlib.ExitStack() as stack:
        stack.enter_context(jax.sharding.use_abstract_mesh(manual))
        if call.settings is not None:
            s = call.settings
            stack.enter_context(config(impl=s.impl, transport=s.transport, chunks=s.chunks,
                                       bidirectional=s.bidirectional, timeout_s=s.timeout_s,
                                       preset=s.preset))
        if call.matmul_precision is not None:
            stack.enter_context(jax.default_matmul_precision(call.matmul_precision))
        stack.enter_context(_native_mesh(mesh))
        yield


@contextlib.contextmanager
def _native_mesh(mesh: Mesh) -> Iterator[None]:
    """Tells the native path the concrete mesh (its rank table), as the shard_map entry does."""
    try:
        from jaxoverlap import _native
    except ImportError:
        yield
        return
    with _native.entry_mesh(mesh):
        yield


def _global_body(call: Call, x, w):
    """The op's meaning on global arrays: what fixes the output types, and XLA's fallback."""
    y = lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=call.precision,
                        preferred_element_type=jnp.float32).astype(x.dtype)
    return (y, x) if call.kind == AG else (y,)


def _partition(call: Call, mesh, arg_shapes, result_shape):
    x_sharding = arg_shapes[0].sharding
    if not isinstance(x_sharding, NamedSharding) or call.axis_name not in mesh.axis_names:
        raise ValueError(
            f"jaxoverlap {call.kind}: the compiled program's mesh {mesh} does not have axis "
            f"{call.axis_name!r}; pass mesh= or use jax.set_mesh(mesh) around jit.")
    x_spec, w_spec, out_specs = layouts(call, tuple(x_sharding.spec))

    def lower(x, w):
        with _device_context(call, mesh):
            out = _spmd.local_op(call, want_gathered=True)(x, w)
        return out if call.kind == AG else (out,)

    named = functools.partial(NamedSharding, mesh)
    return mesh, lower, tuple(map(named, out_specs)), (named(x_spec), named(w_spec))


_primitive = custom_partitioning(_global_body, static_argnums=(0,))
_primitive.def_partition(partition=_partition, sharding_rule=sharding_rule)


# ---------------------------------------------------------------- global entry + autodiff


def _apply(call: Call, mesh, x, w):
    """One primitive call, its input and outputs pinned to the tensor-parallel layout."""
    x_open, out_open = open_layouts(call)
    x = lax.with_sharding_constraint(x, NamedSharding(mesh, x_open))
    outs = _primitive(call, x, w)
    return tuple(lax.with_sharding_constraint(o, NamedSharding(mesh, s))
                 for o, s in zip(outs, out_open, strict=True))


def _weight_grad(a, b, dtype):
    """aᵀ·b over every dim but the last, accumulated in float32."""
    dims = tuple(range(a.ndim - 1))
    return lax.dot_general(a, b, ((dims, dims), ((), ())),
                           preferred_element_type=jnp.float32).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _call(call: Call, mesh, want_gathered: bool, x, w):
    outs = _apply(call, mesh, x, w)
    return outs if want_gathered else outs[0]


def _call_fwd(call, mesh, want_gathered, x, w):
    outs = _apply(call, mesh, x, w)
    # The gathered x (AG+GEMM) is what the weight gradient needs; the others keep x.
    return (outs if want_gathered else outs[0]), (outs[1] if call.kind == AG else x, w)


def _call_bwd(call, mesh, want_gathered, res, ct):
    x_full, w = res
    dy, dgathered = ct if want_gathered else (ct, None)
    wt = w.T
    if call.kind == RS:           # GEMM+RS's backward: all_gather(dY) @ Wᵀ, reusing gathered dY
        dx, dy_full = _apply(call.transposed(), mesh, dy, wt)
        return dx, _weight_grad(x_full, dy_full, w.dtype)
    (dx, *_) = _apply(call.transposed(), mesh, dy, wt)
    if dgathered is not None:
        dx = dx + dgathered
    return dx, _weight_grad(x_full, dy, w.dtype)


_call.defvjp(_call_fwd, _call_bwd)


def call(c: Call, mesh, x, w, *, want_gathered: bool = False):
    """Runs ``c`` on global arrays ``x``, ``w`` over ``mesh`` (Auto axes), differentiably."""
    return _call(c, mesh, want_gathered, x, w)

