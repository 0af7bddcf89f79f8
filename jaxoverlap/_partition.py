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
  asks for the layout of ``_layout.layouts`` (a kernel sharded on its other dim,
  FSDP, is gathered for the call) and returns the per-device function it was
  handed (``Call.local``): the op on local shards, the very code that runs
  inside ``shard_map`` (as TransformerEngine's outer primitive partitions into
  its inner one, ``transformer_engine/jax/cpp_extensions/base.py``);
* autodiff is a ``custom_vjp`` over the primitives: a call's backward pass is one
  primitive (XLA calls the partitioner back once per instance of a primitive, so
  one and not two per call) computing dx by the transposed call (AG+GEMM's
  backward is a GEMM+RS and vice versa, f and g likewise) and the weight
  gradient, reduced over the batch's mesh axes: a reduce-scatter onto the
  kernel's own layout for the axes that also shard the kernel (FSDP), an
  all-reduce for the others (data parallel). A call with fp8
  operands takes their per-tensor scales as two more (replicated, scalar)
  operands, or their block scales (MXFP8) laid out as x and w, and has no backward pass
  (``jaxoverlap.fp8`` differentiates FP8).

Settings read at trace time (``jo.config``, ``jax.default_matmul_precision``)
travel in the per-device function to the partition callback, which runs when
XLA compiles the program. So does where the call is: the partitioner lowers each
call in a module of its own, in which identical calls (the Q, K and V projections
of one input) look alike; a native call there is named by the provenance of its w
in the program's own module (``_native/site_key.py``), taken by the primitive that
wraps the ``custom_partitioning`` one (``_located_p``) where it lowers. That primitive
also hands the call to ``_partitioner``, whose partition callback makes a per-device module
once per distinct call, where XLA would call back once per instance (a layer's calls in every
block of a model).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core, dispatch
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxoverlap import _partitioner
from jaxoverlap._fp8_dtypes import no_gradient
from jaxoverlap._layout import (
    AG,
    RS,
    Call,
    F,
    entry_axes,
    layouts,
    open_layouts,
    without_axis,
)
from jaxoverlap._native.site_key import provenance
from jaxoverlap._transforms import differentiable_once, map_over_batch
from jaxoverlap._xla import local_matmul, scaled_matmul

# ---------------------------------------------------------------- the rules


def _factors(call: Call, row: str, last: str) -> str:
    """One factor per dim of x: ``b<d>`` for the pass-through dims."""
    return " ".join(row if d == call.axis else (last if d == call.ndim - 1 else f"b{d}")
                    for d in range(call.ndim))


def sharding_rule(call: Call, where: str, mesh, value_types, result_types) -> str:
    """The Shardy rule: pass-through dims shared by x and the outputs; tp dims tied together.

    The row dims and the contraction dims that are not split over
    ``axis_name`` get factors of their own, so propagation carries nothing
    across them (an FSDP axis on a kernel's other dim must not leak onto the
    activations). The per-tensor fp8 scales (scalars) have no factor; block scales share
    their operand's factors but K's (K/32 long: a factor of their own, ``g``, ``h``).
    """
    del where, mesh, result_types
    scales = ", " * (len(value_types) - 2)
    blocks = len(value_types) > 2 and ir.RankedTensorType(value_types[2]).rank > 0
    if call.kind == AG:      # y's columns are w's (split over tp); the gathered x is free
        if blocks:
            scales = f", {_factors(call, 'r', 'g')}, h n"
        return (f"{_factors(call, 'r', 'k')}, q n{scales} -> {_factors(call, 's', 'n')}, "
                f"{_factors(call, 't', 'c')}")
    row = "r" if call.kind == RS else ""
    if blocks:               # x's features' blocks are w's rows' (split over tp)
        scales = f", {_factors(call, row, 'g')}, g m"
    if call.kind == RS:      # x's features are w's rows (split over tp)
        return f"{_factors(call, 'r', 'f')}, f m{scales} -> {_factors(call, 's', 'n')}"
    if call.kind == F:
        return f"{_factors(call, '', 'k')}, q n{scales} -> {_factors(call, '', 'n')}"
    return f"{_factors(call, '', 'f')}, f m{scales} -> {_factors(call, '', 'n')}"


def backward_rule(call: Call, where: str, mesh, value_types, result_types) -> str:
    """The backward pass ``(dy, wᵀ, x, w) -> (dx, dw)``: the transposed call's rule on dy, wᵀ
    and dx; x (the gathered x of AG+GEMM) shares dy's pass-through dims, which dw's product
    contracts; dw is w's (its factors ``o p``). x's row and last dims get factors of their
    own, as the transposed call's free dims do: the partition callback asks for their layout."""
    del where, mesh, value_types, result_types
    t = call.transposed()
    dy_wt_dx = sharding_rule(t, "", None, (None, None), None).split(" -> ")
    if t.kind == AG:         # the transposed call's gathered dy is not an output here
        dy_wt_dx[1] = dy_wt_dx[1].split(", ")[0]
    x = _factors(call, "u", "v")
    return f"{dy_wt_dx[0]}, {x}, o p -> {dy_wt_dx[1]}, o p"


# ---------------------------------------------------------------- per device


def _manual(mesh: Mesh):
    """Where the per-device function is traced: every mesh axis manual (the function carries
    the settings of its trace itself)."""
    manual = mesh.abstract_mesh.update_axis_types({a: AxisType.Manual for a in mesh.axis_names})
    return jax.sharding.use_abstract_mesh(manual)


def _body(call: Call, where: str, x, w, *scales):
    """The op's meaning on global arrays: what fixes the output types, and XLA's fallback."""
    del where
    y = scaled_matmul(x, w, scales, call.local.out_dtype, call.local.precision)
    return (y, x) if call.kind == AG else (y,)


def _check_mesh(call: Call, mesh, sharding) -> None:
    if not isinstance(sharding, NamedSharding) or call.axis_name not in mesh.axis_names:
        raise ValueError(
            f"jaxoverlap {call.kind}: the compiled program's mesh {mesh} does not have axis "
            f"{call.axis_name!r}; pass mesh= or use jax.set_mesh(mesh) around jit.")


def _partition(call: Call, where: str, mesh, arg_shapes, result_shape):
    del result_shape
    _check_mesh(call, mesh, arg_shapes[0].sharding)
    x_spec, w_spec, out_specs = layouts(call, tuple(arg_shapes[0].sharding.spec))

    def lower(x, w, *scales):
        # The call's place in the program, in the name stack of its native calls' site keys.
        with _manual(mesh), jax.named_scope(f"jaxoverlap.w.{where}"):
            out = call.local(x, w, want_gathered=True, scales=scales)
        return out if call.kind == AG else (out,)

    named = functools.partial(NamedSharding, mesh)
    # Block scales are split as their operands; per-tensor ones are replicated.
    blocks = len(arg_shapes) > 2 and arg_shapes[2].ndim > 0
    scales = (named(x_spec), named(w_spec)) if blocks else tuple(
        named(P()) for _ in arg_shapes[2:])
    return (mesh, lower, tuple(map(named, out_specs)),
            (named(x_spec), named(w_spec), *scales))


_primitive = custom_partitioning(_body, static_argnums=(0, 1))
_primitive.def_partition(partition=_partition, sharding_rule=sharding_rule)


# The custom_partitioning call, wrapped so that it lowers where the provenance of its w in the
# program can be taken (the partitioner's own module of the call has none: site_key.py).
_located_p = core.Primitive("jaxoverlap_partitioned")
_located_p.multiple_results = True
dispatch.prim_requires_devices_during_lowering.add(_located_p)  # as custom_partitioning's


def _located_abstract_eval(*avals, call: Call, backward: bool):
    outs = jax.eval_shape(lambda *a: (_backward_body if backward else _body)(call, "", *a),
                          *avals)
    return [core.ShapedArray(o.shape, o.dtype) for o in outs]


def _located_lowering(ctx, *args, call: Call, backward: bool):
    where = provenance(ctx, args[1:2]).hex()
    primitive = _backward if backward else _primitive
    outs = mlir.lower_fun(lambda *a: primitive(call, where, *a), multiple_results=True)(
        ctx, *args)
    # One partitioning per distinct call, not per instance (_partitioner).
    _partitioner.adopt(outs[0].owner)
    return outs


_located_p.def_abstract_eval(_located_abstract_eval)
mlir.register_lowering(_located_p, _located_lowering, cacheable=False)  # per call: its own w
map_over_batch(_located_p)
differentiable_once(_located_p, lambda call, backward: (
    f"{call.kind} on global arrays over Auto mesh axes",
    "impl='xla' over Explicit mesh axes (jax.make_mesh's default)"))


def _backward_body(call: Call, where: str, dy, wt, x, w):
    """The backward pass's meaning on global arrays (its output types, XLA's fallback)."""
    del where
    t = call.transposed().local
    dx = local_matmul(dy, wt, t.out_dtype, None, t.precision)
    dims = tuple(range(x.ndim - 1))
    dw = lax.dot_general(x, dy, ((dims, dims), ((), ())), preferred_element_type=jnp.float32)
    return dx, dw.astype(w.dtype)


def _backward_partition(call: Call, where: str, mesh, arg_shapes, result_shape):
    """dx by the transposed call, and ``xᵀ·dy`` reduced over the batch's mesh axes, scattered
    onto w's own layout where it can, in one per-device function.

    The mesh axes on dy's pass-through dims are the batch's: each device sums its share of
    the weight gradient, then the partial sums are reduce-scattered over the axes that also
    split w's other dim (FSDP: dw lands on the kernel's layout) and all-reduced over the rest
    (data parallel). GEMM+RS's backward gathers dy for dx (AG+GEMM) and reuses it for dw.
    """
    del result_shape
    dy_shape, _, x_shape, w_shape = arg_shapes
    _check_mesh(call, mesh, dy_shape.sharding)
    t = call.transposed()
    dy_spec, wt_spec, out_specs = layouts(t, tuple(dy_shape.sharding.spec))
    tp = call.axis_name
    column = call.kind in (AG, F)            # dw [k, n] is split over tp on n, else on k
    tp_dim, other = (1, 0) if column else (0, 1)
    lead = [without_axis(dy_spec[d], tp) for d in range(call.ndim - 1)]
    batch_axes = [axis for entry in lead for axis in entry_axes(entry)]
    w_spec = tuple(w_shape.sharding.spec)
    w_other = entry_axes(w_spec[other] if other < len(w_spec) else None)
    scatter = w_other if w_other and set(w_other) <= set(batch_axes) else ()
    reduce = tuple(a for a in batch_axes if a not in scatter)
    dw_spec = [None, None]
    dw_spec[tp_dim] = tp
    dw_spec[other] = (scatter if len(scatter) > 1 else scatter[0]) if scatter else None

    def lower(dy, wt, x, w):
        del w                                       # an operand for its layout only
        with _manual(mesh), jax.named_scope(f"jaxoverlap.w.{where}"):
            out = t.local(dy, wt, want_gathered=True)
            dx, dy_full = out if t.kind == AG else (out, dy)
            dw = call.local.weight_grad(x, dy_full, jnp.float32)
            if reduce:
                dw = lax.psum(dw, reduce)
            if scatter:
                dw = lax.psum_scatter(dw, scatter, scatter_dimension=other, tiled=True)
            return dx, dw.astype(w_shape.dtype)

    named = functools.partial(NamedSharding, mesh)
    return (mesh, lower, (named(out_specs[0]), named(P(*dw_spec))),
            (named(dy_spec), named(wt_spec), named(P(*lead, None if column else tp)),
             named(w_shape.sharding.spec)))


_backward = custom_partitioning(_backward_body, static_argnums=(0, 1))
_backward.def_partition(partition=_backward_partition, sharding_rule=backward_rule)


# ---------------------------------------------------------------- global entry + autodiff


def _apply(call: Call, mesh, x, w, scales: tuple = ()):
    """One primitive call, its input and outputs pinned to the tensor-parallel layout."""
    x_open, out_open = open_layouts(call)
    x = lax.with_sharding_constraint(x, NamedSharding(mesh, x_open))
    outs = _located_p.bind(x, w, *scales, call=call, backward=False)
    return tuple(lax.with_sharding_constraint(o, NamedSharding(mesh, s))
                 for o, s in zip(outs, out_open, strict=True))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _call(call: Call, mesh, want_gathered: bool, x, w, scales: tuple):
    outs = _apply(call, mesh, x, w, scales)
    return outs if want_gathered else outs[0]


def _call_fwd(call, mesh, want_gathered, x, w, scales):
    outs = _apply(call, mesh, x, w, scales)
    # The gathered x (AG+GEMM) is what the weight gradient needs; the others keep x.
    return (outs if want_gathered else outs[0]), (outs[1] if call.kind == AG else x, w, scales)


def _call_bwd(call, mesh, want_gathered, res, ct):
    x_full, w, scales = res
    if scales:
        raise no_gradient(call.kind)
    dy, dgathered = ct if want_gathered else (ct, None)
    # One primitive for dx (AG+GEMM's backward is a GEMM+RS and vice versa, f and g likewise)
    # and dw: one partitioning callback per call's backward pass instead of two.
    t = call.transposed()
    dy_open, (dx_open, *_) = open_layouts(t)
    dy = lax.with_sharding_constraint(dy, NamedSharding(mesh, dy_open))
    dx, dw = _located_p.bind(dy, w.T, x_full, w, call=call, backward=True)
    dx = lax.with_sharding_constraint(dx, NamedSharding(mesh, dx_open))
    if dgathered is not None:
        dx = dx + dgathered
    return dx, dw, ()


_call.defvjp(_call_fwd, _call_bwd)


# Under jit, so that a call made eagerly is partitioned too: evaluated op by op, a
# custom_partitioning primitive runs its body (_body, plain XLA) and never its partition rule.
_jitted = jax.jit(_call, static_argnums=(0, 1, 2))


def call(c: Call, mesh, x, w, *, want_gathered: bool = False, scales: tuple = ()):
    """Runs ``c`` on global arrays ``x``, ``w`` over ``mesh`` (Auto axes), differentiably;
    ``scales``: the fp8 operands' per-tensor ``(x_scale, w_scale)``, or ``()``."""
    return _jitted(c, mesh, want_gathered, x, w, tuple(scales))
