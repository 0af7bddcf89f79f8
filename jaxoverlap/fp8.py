"""FP8 training through the collective matmuls: Flax's FP8 recipe, with the communication hidden.

The ops take fp8 operands with their scales (``jo.ag_matmul(x8, w8, ..., x_scale=...,
w_scale=...)``), a forward building block that is not differentiable. This module is what
trains: each function takes high-precision ``x`` and ``w`` (one of the ops' dtypes that are not
fp8, the same for both) and

* quantizes them to ``float8_e4m3fn`` with their scales, runs the op on the fp8 values (the
  all-gather of ``ag_matmul`` moves the fp8 bytes, each shard's scale alongside) and returns y
  in x's dtype;
* in the backward pass quantizes the output gradient to ``float8_e5m2`` and runs the other op
  on fp8 operands: AG+GEMM's backward is an fp8 GEMM + reduce-scatter (the partial products
  reduce in x's dtype), GEMM+RS's an fp8 all-gather + GEMM (the e5m2 gradient moves as fp8
  bytes, with its scale); the weight gradient multiplies the fp8 x by the fp8 gradient;
* passes the gradients straight through the quantization to ``x`` and ``w`` (the derivative
  of the dequantized value with respect to the high-precision one is taken to be 1).

Two ways to get the scales:

* **Delayed scaling** (``scaling=DelayedScaling(...)``): Flax's recipe and variables
  (``flax.linen.Fp8DotGeneralOp``, https://flax.readthedocs.io/en/latest/guides/quantization/
  fp8_basics.html). The scale of each tensor comes from its amax history (the last steps'
  absolute maxima); its gradient *is* its new value, computed by Flax's own
  ``fp8_ops.update_fp8_meta``, which ``flax.training.train_state.TrainState.apply_gradients``
  writes over the old one (the ``_overwrite_with_gradient`` collection). The amax that enters
  the history is the whole tensor's, as in Flax: inside ``shard_map`` a ``pmax`` of one float
  over the axes the tensor is split on, needed only by the next step. Every rank quantizes
  with the same scale, so the model trains as Flax's unparallel FP8 model does.
* **Current scaling** (``scaling=None``): the scale from this step's amax, ``amax /
  finfo(fp8).max`` (Flax's ``fp8_ops.compute_scale``), with no state. Inside ``shard_map`` each
  rank scales its own shard: no rank waits for an amax all-reduce before the gather, and each
  shard travels with its own scale. On global arrays the scales are per tensor (XLA reduces
  the amax of the whole array first, as TransformerEngine does).

:func:`dot_general` is current scaling as a ``lax.dot_general`` replacement on one device (for
``nn.Dense(dot_general=...)`` / ``nnx.Linear(dot_general=...)``): the parallel layers given it
run the overlapped current-scaling path. Flax's own ``Fp8DotGeneralOp`` /
``Fp8DirectDotGeneralOp`` give the parallel layers delayed scaling.

Needs Flax (its FP8 bookkeeping, ``flax.linen.fp8_ops``): ``pip install 'jaxoverlap[flax]'``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding

from jaxoverlap import _kinds, _layout, _megatron, _optional, ops
from jaxoverlap._compat import bound_axis_size, check_vma_active, match_varying, varying_axes
from jaxoverlap._config import config, current_config
from jaxoverlap._fp8_dtypes import OUT_DTYPES
from jaxoverlap._fused_gemm import fused_dtype_reason
from jaxoverlap._layout import AG, AR, RS, F

if _optional.missing("flax"):
    raise ModuleNotFoundError(
        "jaxoverlap.fp8 uses Flax's FP8 scale bookkeeping (flax.linen.fp8_ops): "
        + _optional.install_hint(["flax"], "flax"), name="flax")

from flax.linen import fp8_ops  # noqa: E402 - after the check that says what to install

__all__ = ["E4M3", "E5M2", "DelayedScaling", "ag_matmul", "copy_matmul", "dot_general",
           "matmul_ar", "matmul_rs"]

E4M3 = jnp.dtype(jnp.float8_e4m3fn)   # activations and weights (forward)
E5M2 = jnp.dtype(jnp.float8_e5m2)     # gradients (backward)
# What x and w may be: the ops' dtypes that are not fp8 and may be y (y is x's dtype).
_HIGH = tuple(d for d in ops.SUPPORTED_DTYPES if d in OUT_DTYPES)


class DelayedScaling(NamedTuple):
    """The delayed-scaling state of one GEMM, with the names of Flax's ``Fp8DotGeneralOp``
    variables: each tensor's float32 scale (shape ``(1,)``) and amax history (shape
    ``(amax_history_length,)``).

    Differentiating a function of it gives, as its gradient, the updated state (Flax's rule:
    ``fp8_ops.update_fp8_meta``), to be written over the old one.
    """

    input_scale: jax.Array
    input_amax_history: jax.Array
    kernel_scale: jax.Array
    kernel_amax_history: jax.Array
    output_grad_scale: jax.Array
    output_grad_amax_history: jax.Array

    @classmethod
    def init(cls, amax_history_length: int = 1024) -> DelayedScaling:
        """The initial state, as Flax's: scales 1, histories of zeros."""
        scale, history = jnp.ones((1,), jnp.float32), jnp.zeros((amax_history_length,),
                                                                jnp.float32)
        return cls(scale, history, scale, history, scale, history)


# ---------------------------------------------------------------- the public functions


def ag_matmul(x: jax.Array, w: jax.Array, axis_name: str, *,
              scaling: DelayedScaling | None = None, axis: int = 0, impl: str = "auto",
              transport: str | None = None, chunks: int | None = None,
              bidirectional: bool | None = None, mesh: jax.sharding.Mesh | None = None):
    """``jo.ag_matmul(x, w, ...)`` in FP8, differentiable: x and w quantized to e4m3 (the
    all-gather moves fp8), e5m2 gradients, straight-through to x and w. y has x's dtype.
    ``scaling``: Flax's delayed-scaling state, or None for current scaling (module
    docstring)."""
    return _call(AG, x, w, axis_name, scaling, mesh, axis=axis, impl=impl,
                 transport=transport, chunks=chunks, bidirectional=bidirectional)


def matmul_rs(x: jax.Array, w: jax.Array, axis_name: str, *,
              scaling: DelayedScaling | None = None, axis: int = 0, impl: str = "auto",
              transport: str | None = None, chunks: int | None = None,
              bidirectional: bool | None = None, mesh: jax.sharding.Mesh | None = None):
    """``jo.matmul_rs(x, w, ...)`` in FP8, differentiable (as :func:`ag_matmul`); the
    reduction runs in x's dtype, the backward all-gather moves the e5m2 gradient."""
    return _call(RS, x, w, axis_name, scaling, mesh, axis=axis, impl=impl,
                 transport=transport, chunks=chunks, bidirectional=bidirectional)


def matmul_ar(x: jax.Array, w: jax.Array, axis_name: str, *,
              scaling: DelayedScaling | None = None, impl: str = "auto",
              transport: str | None = None, chunks: int | None = None,
              bidirectional: bool | None = None, algorithm: str | None = None,
              mesh: jax.sharding.Mesh | None = None):
    """``jo.matmul_ar(x, w, ...)`` in FP8, differentiable (as :func:`ag_matmul`); the
    all-reduce runs in x's dtype."""
    return _call(AR, x, w, axis_name, scaling, mesh, impl=impl, transport=transport,
                 chunks=chunks, bidirectional=bidirectional, algorithm=algorithm)


def copy_matmul(x: jax.Array, w: jax.Array, axis_name: str, *,
                scaling: DelayedScaling | None = None, mesh: jax.sharding.Mesh | None = None):
    """Megatron's f around an FP8 matmul (the column layer without sequence parallelism): x
    replicated over ``axis_name``, w split on its columns; x's gradient is all-reduced (in
    x's dtype). No collective moves fp8 here."""
    return _call(F, x, w, axis_name, scaling, mesh)


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                out_sharding=None):
    """``lax.dot_general`` under Flax's FP8 recipe with current scaling, on one device.

    lhs and rhs are quantized to e4m3 with the scale of their own amax, multiplied in fp8
    (float32 accumulation) and y returned in lhs's dtype (or ``preferred_element_type``);
    backward, the output gradient is quantized to e5m2 with its amax and passed straight
    through to lhs and rhs. ``precision`` is ignored (an fp8 GEMM has one precision), as by
    Flax's FP8 ops. The parallel layers given this function (``dot_general=``) run the same
    recipe overlapped (current scaling, per shard).
    """
    del precision
    if out_sharding is not None:
        raise ValueError("jaxoverlap.fp8.dot_general: out_sharding is not supported; lay the "
                         "result out afterwards.")
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    out = jnp.dtype(preferred_element_type or lhs.dtype)
    dims = jax.tree.map(int, dimension_numbers)
    dims = tuple(tuple(tuple(d) for d in pair) for pair in dims)
    return _current_dot(lhs, rhs, dims, out.name, (lhs.dtype.name, rhs.dtype.name))


# ---------------------------------------------------------------- one call


@dataclasses.dataclass(frozen=True)
class _Call:
    """One FP8 call, static: the kind, the op's options, and where it runs.

    ``mesh`` is None on local shards (``axis_name`` bound); ``typed``: inside a
    ``check_vma=True`` shard_map; ``x_type`` / ``w_type``: the inputs' varying axes there.
    Under Explicit mesh axes ``layouts`` holds the shardings the plain dots give their
    results (dx as x, dw as w, f's y as the layout says).
    """

    kind: str
    axis_name: str
    dtype: str
    options: tuple
    mesh: Any
    typed: bool = False
    x_type: frozenset = frozenset()
    w_type: frozenset = frozenset()
    layouts: tuple | None = None

    @property
    def local(self) -> bool:
        return self.mesh is None


def _call(kind: str, x, w, axis_name: str, scaling: DelayedScaling | None, mesh, **options):
    name = f"jaxoverlap.fp8.{'copy_matmul' if kind == F else kind}"
    for arg, a in (("x", x), ("w", w)):
        if not hasattr(a, "dtype") or jnp.dtype(a.dtype) not in _HIGH:
            raise TypeError(f"{name}: {arg} must be a {_kinds.listing(d.name for d in _HIGH)} "
                            "array (the high-precision values this function quantizes), got "
                            f"{getattr(a, 'dtype', type(a).__name__)}.")
    if jnp.dtype(x.dtype) != jnp.dtype(w.dtype):
        raise TypeError(f"{name}: x.dtype={jnp.dtype(x.dtype).name} and "
                        f"w.dtype={jnp.dtype(w.dtype).name} differ; cast one of them.")
    if scaling is not None:
        _check_scaling(name, scaling)
    options = {k: v for k, v in options.items() if v is not None}
    if "axis" in options:
        options["axis"] = int(options["axis"]) % x.ndim if x.ndim else 0
    if bound_axis_size(axis_name) is not None:
        typed = check_vma_active()
        c = _Call(kind, axis_name, jnp.dtype(x.dtype).name, tuple(sorted(options.items())),
                  None, typed, varying_axes(x), varying_axes(w))
    else:
        mesh = _layout.resolve_mesh(name, axis_name, mesh, x, w)
        layouts = None
        if _layout.is_explicit(mesh):
            # Laid out as the op lays them out (its own reshard then moves nothing); the plain
            # GEMMs give dx, dw and f's y these layouts.
            call = _layout.Call(kind, axis_name, x.ndim, options.get("axis"))
            x_spec, w_spec, (y_spec, *_) = _layout.layouts(call, _layout.spec_entries(x, mesh))
            x, w = _layout.place(x, mesh, x_spec), _layout.place(w, mesh, w_spec)
            layouts = tuple(NamedSharding(mesh, spec) for spec in (x_spec, w_spec, y_spec))
        c = _Call(kind, axis_name, jnp.dtype(x.dtype).name, tuple(sorted(options.items())),
                  mesh, layouts=layouts)
    return _fp8(c, x, w, scaling)


def _check_scaling(name: str, s: Any) -> None:
    if not isinstance(s, DelayedScaling):
        raise TypeError(f"{name}: scaling={type(s).__name__} must be a "
                        "jaxoverlap.fp8.DelayedScaling (Flax's FP8 variables) or None (current "
                        "scaling).")
    for field, value in zip(s._fields, s, strict=True):
        if not hasattr(value, "dtype"):
            raise TypeError(f"{name}: scaling.{field} must be an array, got "
                            f"{type(value).__name__}.")
        if jnp.dtype(value.dtype) != jnp.dtype(jnp.float32) and not jax.dtypes.issubdtype(
                value.dtype, jax.dtypes.extended):
            raise TypeError(f"{name}: scaling.{field}.dtype={value.dtype} must be float32.")
        if field.endswith("_scale") and tuple(value.shape) not in ((), (1,)):
            raise ValueError(f"{name}: scaling.{field} has shape {tuple(value.shape)}; a scale "
                             "is a scalar, shape (1,) as Flax's (or ()).")
        if field.endswith("_history") and len(value.shape) != 1:
            raise ValueError(f"{name}: scaling.{field} has shape {tuple(value.shape)}; an amax "
                             "history is 1-d, (amax_history_length,).")


# ---------------------------------------------------------------- scales


def _f32(value):
    """A scale as a plain float32 array (Flax's ``fp32_max_grad`` dtype converted)."""
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.extended):
        return lax.convert_element_type(value, jnp.float32)
    return value


def _amax(c: _Call, a, whole: bool):
    """max |a|: of the whole tensor if ``whole`` (on local shards a ``pmax`` over the axes it
    is split on), else of this shard."""
    m = jnp.max(jnp.abs(a))
    if c.local and whole:
        axes = varying_axes(m) if c.typed else frozenset(
            jax.sharding.get_abstract_mesh().manual_axes)
        if axes:
            m = lax.pmax(m, tuple(sorted(axes)))
    return m


def _delayed(c: _Call, a, q_dtype, scale, history):
    """Flax's update (``fp8_ops.update_fp8_meta``) from the whole tensor's amax: the scale of
    this step (from the history before it) and the history with this step's amax."""
    return fp8_ops.update_fp8_meta(_amax(c, a, whole=True), q_dtype, scale, history)


def _current(c: _Call, a, q_dtype):
    """This step's scale from this shard's amax (Flax's ``compute_scale``: 1 for an amax of 0
    or not finite)."""
    return _scale(_amax(c, a, whole=False), q_dtype)


def _scale(amax, q_dtype):
    """Flax's ``compute_scale`` from this step's ``amax`` alone (no history)."""
    return fp8_ops.compute_scale(amax.astype(jnp.float32), jnp.ones((), jnp.float32),
                                 fp8_ops.get_fp8_max(q_dtype, jnp.float32))


def _quantize(a, q_dtype, scale):
    """Flax's ``quantize``: a / scale, clipped to the fp8 range, in fp8."""
    return fp8_ops.quantize(a, q_dtype, _f32(scale), a.dtype)


# ---------------------------------------------------------------- the rule


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8(c: _Call, x, w, scaling):
    return _forward(c, x, w, scaling)[0]


def _op_options(c: _Call, kind: str) -> dict:
    options = dict(c.options)
    if kind != AR:
        options.pop("algorithm", None)
    return options


def _forward(c: _Call, x, w, scaling):
    if scaling is None:
        sx, sw = _current(c, x, E4M3), _current(c, w, E4M3)
        new = None
    else:
        sx, new_x_history = _delayed(c, x, E4M3, scaling.input_scale,
                                     scaling.input_amax_history)
        sw, new_w_history = _delayed(c, w, E4M3, scaling.kernel_scale,
                                     scaling.kernel_amax_history)
        new = (sx, new_x_history, sw, new_w_history)
    qx, qw = _quantize(x, E4M3, sx), _quantize(w, E4M3, sw)
    sx, sw = _f32(sx), _f32(sw)
    out = jnp.dtype(c.dtype)
    kw = dict(x_scale=sx, w_scale=sw, preferred_element_type=out, mesh=c.mesh,
              **_op_options(c, c.kind))
    if c.kind == AG:
        y, qx = _op(ops.ag_matmul, qx, qw, c.axis_name, return_gathered=True, **kw)
        if c.local and scaling is None:   # the gathered x's shards each have their scale
            sx = lax.all_gather(jnp.reshape(sx, ()), c.axis_name)
    elif c.kind == RS:
        y = _op(ops.matmul_rs, qx, qw, c.axis_name, **kw)
    elif c.kind == AR:
        y = ops.matmul_ar(qx, qw, c.axis_name, **kw)
    else:  # Megatron's f: a local GEMM on the replicated x
        a = qx
        if c.local:
            a = _megatron.copy_to_tp(qx, c.axis_name, c.typed and c.axis_name in c.w_type)
        y = (_dot(c, a, qw, _last_first(qx), c.layouts and c.layouts[2])
             * (sx * sw)).astype(out)
    state = None if scaling is None else (scaling.output_grad_scale,
                                          scaling.output_grad_amax_history)
    return y, (qx, qw, sx, sw, state, new)


def _op(op, qx, qw, axis_name: str, **kw):
    """``op`` on the fp8 operands. Under ``jo.config(fused=True)`` the fused GEMM runs where it
    has an instantiation for these element types (``_kinds.FUSED_FP8``: e4m3 x e4m3 and e5m2 x
    e4m3 to bfloat16, in the AG+GEMM and the GEMM + reduce-scatter) and the chunked path runs
    the others: the fp8 types are the recipe's choice, not the caller's, so no error asks the
    caller to drop ``fused``."""
    name = op.__name__
    if current_config().fused and fused_dtype_reason(
            name, qx.dtype, qw.dtype, kw["preferred_element_type"]) is not None:
        with config(fused=False):
            return op(qx, qw, axis_name, **kw)
    return op(qx, qw, axis_name, **kw)


def _backward(c: _Call, res, dy):
    qx, qw, sx, sw, g_state, new = res
    x_dtype = w_dtype = jnp.dtype(c.dtype)
    if new is not None and c.local and not c.typed:
        raise ValueError(
            "jaxoverlap.fp8: delayed scaling inside a shard_map with check_vma=False cannot be "
            "differentiated: there JAX sums every rank's gradient of a replicated input, and "
            "the gradient of the FP8 state is its new value (Flax's rule), which a sum would "
            "multiply by the number of ranks. Use check_vma=True (the default), global arrays, "
            "or current scaling (scaling=None).")
    if c.kind == AR and c.local and not c.typed:
        # As jo.matmul_ar's own rule: JAX hands each rank a share of the replicated y's
        # cotangent under check_vma=False; the shares are summed first.
        dy = lax.psum(dy, c.axis_name)
    if g_state is None:
        sg = _current(c, dy, E5M2)
        g_new: tuple = ()
    else:
        sg, g_history = _delayed(c, dy, E5M2, *g_state)
        g_new = (sg, g_history)
    qg = _quantize(dy, E5M2, sg)
    sg = _f32(sg)
    kw = dict(preferred_element_type=x_dtype, mesh=c.mesh)
    x_sharding, w_sharding = (c.layouts[0], c.layouts[1]) if c.layouts else (None, None)
    row_scales, row_axis = None, 0
    if c.kind == AG:        # AG+GEMM's backward: fp8 GEMM + reduce-scatter
        dx = _op(ops.matmul_rs, qg, qw.T, c.axis_name, x_scale=sg, w_scale=sw,
                 **kw, **_op_options(c, RS))
        a, b = qx, qg
        if jnp.ndim(sx) == 1 and sx.shape[0] > 1:   # the gathered x's shards' own scales
            row_scales, row_axis, scale = sx, dict(c.options)["axis"], sg
        else:
            scale = sx * sg
    elif c.kind == RS:      # GEMM+RS's backward: the e5m2 gradient all-gathered, GEMM
        dx, qg_all = _op(ops.ag_matmul, qg, qw.T, c.axis_name, x_scale=sg, w_scale=sw,
                         return_gathered=True, **kw, **_op_options(c, AG))
        a, b = qx, qg_all
        if c.local and g_state is None:   # each gathered gradient shard has its scale
            row_scales = lax.all_gather(jnp.reshape(sg, ()), c.axis_name)
            row_axis, scale = dict(c.options)["axis"], sx
        else:
            scale = sx * sg
    else:                   # AR, f: both GEMMs are local
        dx = (_dot(c, qg, qw.T, _last_first(qg), x_sharding) * (sg * sw)).astype(x_dtype)
        a, b, scale = qx, qg, sx * sg
    dw = _weight_grad(c, a, b, scale, row_scales, row_axis, w_sharding).astype(w_dtype)
    if c.local:
        dx, dw = match_varying(dx, c.x_type), match_varying(dw, c.w_type)
    if new is None:
        return dx, dw, None
    return dx, dw, DelayedScaling(*new, *g_new)


_fp8.defvjp(lambda c, x, w, scaling: _forward(c, x, w, scaling), _backward)


# ---------------------------------------------------------------- the local GEMMs


def _last_first(a) -> tuple:
    return (((a.ndim - 1,), (0,)), ((), ()))


def _dot(c: _Call, a, b, dims, sharding):
    """A GEMM of fp8 operands accumulated in float32 (no collective of ours): on local
    shards as it is, on global arrays laid out by XLA (under Explicit axes as ``sharding``
    says: its reductions over split dims are XLA's, in float32)."""
    def dot(a, b):
        return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

    if sharding is not None and not c.local:
        # Under Auto axes inside: XLA reduces over the split contracted dims (data parallel).
        return jax.sharding.auto_axes(dot, out_sharding=sharding)(a, b)
    return dot(a, b)


def _weight_grad(c: _Call, a, b, scale, row_scales, row_axis: int, sharding):
    """aᵀ·b over every dim but the last (fp8 a and b, float32 accumulation) times ``scale``;
    with ``row_scales`` (one per rank) the rows of rank r's shard along ``row_axis`` also
    times ``row_scales[r]``: one batched GEMM over the shards, summed."""
    if row_scales is None:
        lead = tuple(range(a.ndim - 1))
        return _dot(c, a, b, ((lead, lead), ((), ())), sharding) * scale
    n = row_scales.shape[0]

    def shards_first(t):
        shape = t.shape[:row_axis] + (n, t.shape[row_axis] // n) + t.shape[row_axis + 1:]
        return jnp.moveaxis(t.reshape(shape), row_axis, 0)

    a, b = shards_first(a), shards_first(b)
    lead = tuple(range(1, a.ndim - 1))
    per_shard = lax.dot_general(a, b, ((lead, lead), ((0,), (0,))),
                                preferred_element_type=jnp.float32)
    return jnp.sum(per_shard * row_scales[:, None, None], axis=0) * scale


# ---------------------------------------------------------------- dot_general, current scaling


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _current_dot(lhs, rhs, dims, out: str, in_dtypes: tuple[str, str]):
    return _current_dot_fwd(lhs, rhs, dims, out, in_dtypes)[0]


def _current_dot_fwd(lhs, rhs, dims, out, in_dtypes):
    """The fp8 product; the backward keeps the fp8 operands and scales, not lhs and rhs (only
    their dtypes, ``in_dtypes``, which the gradients take)."""
    del in_dtypes
    sl, sr = (_scale(jnp.max(jnp.abs(a)), E4M3) for a in (lhs, rhs))
    ql, qr = _quantize(lhs, E4M3, sl), _quantize(rhs, E4M3, sr)
    y = lax.dot_general(ql, qr, dims, preferred_element_type=jnp.float32) * (sl * sr)
    return y.astype(out), (ql, qr, sl, sr)


def _current_dot_bwd(dims, out, in_dtypes, res, g):
    ql, qr, sl, sr = res
    sg = _scale(jnp.max(jnp.abs(g)), E5M2)
    qg = _quantize(g, E5M2, sg)
    # Flax's own transposes of dot_general (what its Fp8DirectDotGeneralOp uses).
    dl = fp8_ops.dot_general_transpose_lhs(qg, ql, qr, dimension_numbers=dims, precision=None,
                                           preferred_element_type=jnp.float32)
    dr = fp8_ops.dot_general_transpose_rhs(qg, ql, qr, dimension_numbers=dims, precision=None,
                                           preferred_element_type=jnp.float32)
    return (dl * (sg * sr)).astype(in_dtypes[0]), (dr * (sl * sg)).astype(in_dtypes[1])


_current_dot.defvjp(_current_dot_fwd, _current_dot_bwd)
