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

Three ways to get the scales:

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
* **MXFP8** (``scaling=MXFP8BlockScaling()``): e4m3 with one e8m0 scale per 32 elements
  along the dim each GEMM contracts (OCP MX v1.0), every tensor quantized once per GEMM it
  enters, the gradient too (e4m3 by default, as TransformerEngine's recipe); through the ops'
  block scales, so on their ``xla`` and ``ring`` impls only (:class:`MXFP8BlockScaling`).

:func:`dot_general` is current scaling as a ``lax.dot_general`` replacement on one device (for
``nn.Dense(dot_general=...)`` / ``nnx.Linear(dot_general=...)``): the parallel layers given it
run the overlapped current-scaling path. Flax's own ``Fp8DotGeneralOp`` /
``Fp8DirectDotGeneralOp`` give the parallel layers delayed scaling.

Needs Flax (its FP8 bookkeeping, ``flax.linen.fp8_ops``): ``pip install 'jaxoverlap[flax]'``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding

from jaxoverlap import _kinds, _layout, _megatron, _optional, ops
from jaxoverlap._compat import bound_axis_size, check_vma_active, match_varying, varying_axes
from jaxoverlap._config import config, current_config
from jaxoverlap._fp8_dtypes import BLOCK, OUT_DTYPES, dequantize_blocks, quantize_blocks
from jaxoverlap._fused_gemm import fused_dtype_reason
from jaxoverlap._layout import AG, AR, RS, F

if _optional.missing("flax"):
    raise ModuleNotFoundError(
        "jaxoverlap.fp8 uses Flax's FP8 scale bookkeeping (flax.linen.fp8_ops): "
        + _optional.install_hint(["flax"], "flax"), name="flax")

from flax.linen import fp8_ops  # noqa: E402 - after the check that says what to install

__all__ = ["E4M3", "E5M2", "DelayedScaling", "MXFP8BlockScaling", "ag_matmul", "copy_matmul",
           "dot_general", "matmul_ar", "matmul_rs"]

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


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling:
    """MXFP8 (the OCP Microscaling format v1.0, https://www.opencompute.org/documents/
    ocp-microscaling-formats-mx-v1-0-spec-final-pdf): e4m3 elements with one e8m0 scale per 32
    consecutive elements along the dim each GEMM contracts, computed from those 32 values
    (``_fp8_dtypes.quantize_blocks``, the spec's §6.3). No state, no amax reduction: a block
    never straddles two ranks' shards, so every rank quantizes its own.

    As TransformerEngine's ``MXFP8BlockScaling`` recipe
    (https://nvidia.github.io/TransformerEngine/features/low_precision_training/mxfp8/
    mxfp8.html), each tensor is quantized twice from its high-precision values, once per
    contraction dim it meets: x along K (the forward) and along its rows (dw = xᵀ·dy); w along
    K (the forward) and along N (dx = dy·wᵀ); the output gradient along N (dx) and along its
    rows (dw). ``grad_dtype``: the gradient's element type, e4m3 by default as there (e5m2 is
    TransformerEngine's ``HYBRID`` format).

    Give it as ``scaling=`` to this module's functions, or as ``dot_general=`` to the Flax
    layers (an instance is also a one-device ``lax.dot_general`` replacement under the same
    recipe). Every dim a GEMM contracts must be a multiple of 32 (as in TransformerEngine, no
    padding): K; and when differentiated, N (per rank where it is split) and the rows, dim -2
    (per rank where they are split); the error names the dim.
    """

    grad_dtype: Any = E4M3

    def __post_init__(self) -> None:
        try:
            dtype = jnp.dtype(self.grad_dtype)
        except TypeError:
            dtype = None
        if dtype not in (E4M3, E5M2):
            raise TypeError(f"MXFP8BlockScaling: grad_dtype={self.grad_dtype!r} must be "
                            "jnp.float8_e4m3fn (the default) or jnp.float8_e5m2.")
        object.__setattr__(self, "grad_dtype", dtype)

    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, out_sharding=None):
        """``lax.dot_general(lhs, rhs, ...)`` under this recipe on one device, for the form
        the layers use: lhs's last dim contracted with the first of a 2-d rhs, no batch dims.
        ``precision`` is ignored (an fp8 GEMM has one)."""
        del precision
        name = "jaxoverlap.fp8.MXFP8BlockScaling"
        if out_sharding is not None:
            raise ValueError(f"{name}: out_sharding is not supported; lay the result out "
                             "afterwards.")
        lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
        dims = jax.tree.map(int, dimension_numbers)
        dims = tuple(tuple(tuple(d) for d in pair) for pair in dims)
        if rhs.ndim != 2 or lhs.ndim < 2 or dims != _last_first(lhs):
            raise ValueError(
                f"{name}: as a dot_general it multiplies lhs [..., rows, K] by rhs [K, N] "
                "(dimension_numbers=(((lhs.ndim - 1,), (0,)), ((), ())), what the layers "
                f"pass); got lhs {lhs.shape}, rhs {rhs.shape}, "
                f"dimension_numbers={dims}. Reshape to that form.")
        _check_inputs(name, lhs, rhs)
        y = _mx(_Call(_DOT, "", jnp.dtype(lhs.dtype).name, (), None, mx=self), lhs, rhs)
        return y.astype(preferred_element_type or lhs.dtype)


# What ``scaling=`` takes: delayed, block (MXFP8), or None for current scaling.
_Scaling = DelayedScaling | MXFP8BlockScaling | None


# ---------------------------------------------------------------- the public functions


def ag_matmul(x: jax.Array, w: jax.Array, axis_name: str, *,
              scaling: _Scaling = None, axis: int = 0, impl: str = "auto",
              transport: str | None = None, chunks: int | None = None,
              bidirectional: bool | None = None, mesh: jax.sharding.Mesh | None = None):
    """``jo.ag_matmul(x, w, ...)`` in FP8, differentiable: x and w quantized to e4m3 (the
    all-gather moves fp8), e5m2 gradients, straight-through to x and w. y has x's dtype.
    ``scaling``: Flax's delayed-scaling state, :class:`MXFP8BlockScaling`, or None for current
    scaling (module docstring)."""
    return _call(AG, x, w, axis_name, scaling, mesh, axis=axis, impl=impl,
                 transport=transport, chunks=chunks, bidirectional=bidirectional)


def matmul_rs(x: jax.Array, w: jax.Array, axis_name: str, *,
              scaling: _Scaling = None, axis: int = 0, impl: str = "auto",
              transport: str | None = None, chunks: int | None = None,
              bidirectional: bool | None = None, mesh: jax.sharding.Mesh | None = None):
    """``jo.matmul_rs(x, w, ...)`` in FP8, differentiable (as :func:`ag_matmul`); the
    reduction runs in x's dtype, the backward all-gather moves the e5m2 gradient."""
    return _call(RS, x, w, axis_name, scaling, mesh, axis=axis, impl=impl,
                 transport=transport, chunks=chunks, bidirectional=bidirectional)


def matmul_ar(x: jax.Array, w: jax.Array, axis_name: str, *,
              scaling: _Scaling = None, impl: str = "auto",
              transport: str | None = None, chunks: int | None = None,
              bidirectional: bool | None = None, algorithm: str | None = None,
              mesh: jax.sharding.Mesh | None = None):
    """``jo.matmul_ar(x, w, ...)`` in FP8, differentiable (as :func:`ag_matmul`); the
    all-reduce runs in x's dtype."""
    return _call(AR, x, w, axis_name, scaling, mesh, impl=impl, transport=transport,
                 chunks=chunks, bidirectional=bidirectional, algorithm=algorithm)


def copy_matmul(x: jax.Array, w: jax.Array, axis_name: str, *,
                scaling: _Scaling = None, mesh: jax.sharding.Mesh | None = None):
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
    results (dx as x, dw as w, f's y as the layout says). ``mx``: the MXFP8 recipe, if that
    is the scaling.
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
    mx: MXFP8BlockScaling | None = None

    @property
    def local(self) -> bool:
        return self.mesh is None


def _check_inputs(name: str, x, w) -> None:
    for arg, a in (("x", x), ("w", w)):
        if not hasattr(a, "dtype") or jnp.dtype(a.dtype) not in _HIGH:
            raise TypeError(f"{name}: {arg} must be a {_kinds.listing(d.name for d in _HIGH)} "
                            "array (the high-precision values this function quantizes), got "
                            f"{getattr(a, 'dtype', type(a).__name__)}.")
    if jnp.dtype(x.dtype) != jnp.dtype(w.dtype):
        raise TypeError(f"{name}: x.dtype={jnp.dtype(x.dtype).name} and "
                        f"w.dtype={jnp.dtype(w.dtype).name} differ; cast one of them.")
    for arg, a in (("x", x), ("w", w)):  # before the scales: the amax of nothing is undefined
        if 0 in a.shape:
            raise ValueError(
                f"{name}: {arg} has a zero-size dim (x {tuple(x.shape)}, w {tuple(w.shape)}): "
                "there is nothing to quantize. Skip the call for an empty batch (the shapes "
                "are static under jit: `if x.size:`).")


def _call(kind: str, x, w, axis_name: str, scaling, mesh, **options):
    name = f"jaxoverlap.fp8.{'copy_matmul' if kind == F else kind}"
    _check_inputs(name, x, w)
    mx = scaling if isinstance(scaling, MXFP8BlockScaling) else None
    if scaling is not None and mx is None:
        _check_scaling(name, scaling)
    options = {k: v for k, v in options.items() if v is not None}
    if "axis" in options:
        options["axis"] = int(options["axis"]) % x.ndim if x.ndim else 0
    if bound_axis_size(axis_name) is not None:
        typed = check_vma_active()
        c = _Call(kind, axis_name, jnp.dtype(x.dtype).name, tuple(sorted(options.items())),
                  None, typed, varying_axes(x), varying_axes(w), mx=mx)
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
                  mesh, layouts=layouts, mx=mx)
    if mx is not None:
        return _mx(c, x, w)
    return _fp8(c, x, w, scaling)


def _check_scaling(name: str, s: Any) -> None:
    if not isinstance(s, DelayedScaling):
        raise TypeError(f"{name}: scaling={type(s).__name__} must be a "
                        "jaxoverlap.fp8.DelayedScaling (Flax's FP8 variables), a "
                        "jaxoverlap.fp8.MXFP8BlockScaling() (block scales) or None (current "
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
    has an instantiation for these element types (``_kinds.FUSED_FP8``: e4m3 x e4m3 to bfloat16,
    float16 and float32, e5m2 x e4m3 to bfloat16, in the AG+GEMM and the GEMM + reduce-scatter)
    and the chunked path runs
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


# ---------------------------------------------------------------- MXFP8: block scales

_DOT = "dot"   # MXFP8BlockScaling as a dot_general on one device: no collective


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mx(c: _Call, x, w):
    return _mx_forward(c, x, w, residuals=False)[0]


def _mx_op(op, qx, qw, axis_name: str, **kw):
    """``op`` on block-scaled operands, on the impl the config asks for: ``xla``, ``ring`` or
    ``native`` (the host executor; the CUDA executor on compute capability 10.x, whole 128x4
    tiles, refused otherwise). No fused GEMM takes block scales; the recipe, not the caller,
    chose them, so a ``fused=True`` config runs them unfused rather than raising."""
    if current_config().fused:
        with config(fused=False):
            return op(qx, qw, axis_name, **kw)
    return op(qx, qw, axis_name, **kw)


def _mx_forward(c: _Call, x, w, residuals: bool):
    """y from x and w quantized along K; with ``residuals`` (differentiated) also the copies
    the backward GEMMs take: x along its rows, w along N."""
    _check_blocks(c, x, w, grad=residuals)
    qx, sx = _mx_quantize(c, x, E4M3, x.ndim - 1)
    qw, sw = _mx_quantize(c, w, E4M3, 0)
    out = jnp.dtype(c.dtype)
    kw = dict(x_scale=sx, w_scale=sw, preferred_element_type=out, mesh=c.mesh,
              **_op_options(c, c.kind))
    if c.kind == AG:
        y = _mx_op(ops.ag_matmul, qx, qw, c.axis_name, **kw)
    elif c.kind == RS:
        y = _mx_op(ops.matmul_rs, qx, qw, c.axis_name, **kw)
    elif c.kind == AR:
        y = _mx_op(ops.matmul_ar, qx, qw, c.axis_name, **kw)
    else:  # Megatron's f (a local GEMM on the replicated x), or one device
        if c.kind == F and c.local:
            qx = _megatron.copy_to_tp(qx, c.axis_name, c.typed and c.axis_name in c.w_type)
        y = _block_dot(c, (qx, sx, qx.ndim - 1), (qw, sw, 0), _last_first(qx),
                       c.layouts and c.layouts[2]).astype(out)
    if not residuals:
        return y, None
    return y, (_mx_quantize(c, x, E4M3, x.ndim - 2), _mx_quantize(c, w, E4M3, 1))


def _mx_backward(c: _Call, res, dy):
    (qx, sx), (qw, sw) = res        # x blocked along its rows, w along N
    if c.kind == AR and c.local and not c.typed:
        dy = lax.psum(dy, c.axis_name)   # as in _backward: the shares of the replicated y's
    g = c.mx.grad_dtype
    qg, sg = _mx_quantize(c, dy, g, dy.ndim - 1)        # dx = dy·wᵀ contracts over N
    qgr, sgr = _mx_quantize(c, dy, g, dy.ndim - 2)      # dw = xᵀ·dy over the rows
    qwt, swt = qw.T, sw.T                               # wᵀ [N, K], blocks along N
    x_dtype = w_dtype = jnp.dtype(c.dtype)
    x_sharding, w_sharding = (c.layouts[0], c.layouts[1]) if c.layouts else (None, None)
    kw = dict(x_scale=sg, w_scale=swt, preferred_element_type=x_dtype, mesh=c.mesh)
    if c.kind == AG:        # dx: GEMM + reduce-scatter; dw needs every rank's rows of x
        dx = _mx_op(ops.matmul_rs, qg, qwt, c.axis_name, **kw, **_op_options(c, RS))
        if c.local:
            qx, sx = (lax.all_gather(a, c.axis_name, axis=dict(c.options)["axis"], tiled=True)
                      for a in (qx, sx))
    elif c.kind == RS:      # dx: all-gather + GEMM; dw needs every rank's rows of dy
        dx = _mx_op(ops.ag_matmul, qg, qwt, c.axis_name, **kw, **_op_options(c, AG))
        if c.local:
            qgr, sgr = (lax.all_gather(a, c.axis_name, axis=dict(c.options)["axis"], tiled=True)
                        for a in (qgr, sgr))
    else:                   # AR, f, one device: both GEMMs are local
        dx = _block_dot(c, (qg, sg, qg.ndim - 1), (qwt, swt, 0), _last_first(qg),
                        x_sharding).astype(x_dtype)
    lead = tuple(range(qx.ndim - 1))
    dw = _block_dot(c, (qx, sx, qx.ndim - 2), (qgr, sgr, qgr.ndim - 2),
                    ((lead, lead), ((), ())), w_sharding).astype(w_dtype)
    if c.local and c.kind != _DOT:
        dx, dw = match_varying(dx, c.x_type), match_varying(dw, c.w_type)
    return dx, dw


_mx.defvjp(lambda c, x, w: _mx_forward(c, x, w, residuals=True), _mx_backward)


def _mx_quantize(c: _Call, a, q_dtype, axis: int):
    """``quantize_blocks``; on global arrays under Explicit mesh axes under Auto ones inside,
    the values and scales laid out as ``a`` (a dim whose blocks do not split evenly: whole)."""
    if c.local or not _layout.is_explicit(c.mesh):
        return quantize_blocks(a, q_dtype, axis)
    spec = list(jax.typeof(a).sharding.spec) + [None] * a.ndim
    spec = spec[:a.ndim]
    blocks = a.shape[axis] // BLOCK
    if spec[axis] is not None:
        names = spec[axis] if isinstance(spec[axis], tuple) else (spec[axis],)
        if blocks % math.prod(c.mesh.shape[n] for n in names):
            spec[axis] = None
    q_sharding = NamedSharding(c.mesh, jax.sharding.PartitionSpec(*spec))
    return jax.sharding.auto_axes(lambda a: quantize_blocks(a, q_dtype, axis),
                                  out_sharding=(q_sharding, q_sharding))(a)


def _block_dot(c: _Call, a: tuple, b: tuple, dims, sharding):
    """A GEMM of block-scaled operands ``(fp8 values, e8m0 scales, the blocks' axis)``: each
    dequantized per block to float32 (exact), multiplied in float32 (as the ops' ``xla`` impl
    does); placed as :func:`_dot` places its GEMMs."""
    def dot(qa, sa, qb, sb):
        return lax.dot_general(dequantize_blocks(qa, sa, a[2]), dequantize_blocks(qb, sb, b[2]),
                               dims, precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)

    if sharding is not None and not c.local:
        return jax.sharding.auto_axes(dot, out_sharding=sharding)(a[0], a[1], b[0], b[1])
    return dot(a[0], a[1], b[0], b[1])


def _check_blocks(c: _Call, x, w, grad: bool) -> None:
    """Every dim a GEMM of the recipe contracts is whole blocks of 32 (on local shards, this
    rank's; the ops check how global arrays split): K always; differentiated, also N (dx)
    and the rows (dw)."""
    name = "jaxoverlap.fp8 (MXFP8BlockScaling)"
    if x.ndim < 2:
        raise ValueError(f"{name}: x has shape {x.shape}; MXFP8 needs x [..., rows, K] (its "
                         "rows are blocked for the weight gradient). Add a leading dim.")
    where = "this rank's " if c.local and c.kind != _DOT else ""
    checks = [(x.shape[-1], f"K, {where}x.shape[-1]", "the forward GEMM contracts over it",
               "pad x's features and w's rows with zeros")]
    if grad:
        checks.append((w.shape[1], f"N, {where}w.shape[1]", "dx = dy·wᵀ contracts over it",
                       "pad w's columns with zeros"))
        rows, what = x.shape[-2], f"the rows, {where}x.shape[-2]"
        if c.kind == RS and c.local and dict(c.options)["axis"] == x.ndim - 2:
            rows //= bound_axis_size(c.axis_name)
            what = "the rows of this rank's output gradient, x.shape[-2] / ranks"
        checks.append((rows, what, "dw = xᵀ·dy contracts over them",
                       "pad the sequence with zero rows (they add nothing to dw)"))
    for size, what, why, fix in checks:
        if size % BLOCK:
            raise ValueError(f"{name}: {what} = {size} is not a multiple of {BLOCK}: MXFP8 "
                             f"scales blocks of {BLOCK} along every dim a GEMM contracts and "
                             f"{why}. Fix: {fix} to a multiple of {BLOCK}, or use per-tensor "
                             "scaling (scaling=None or a DelayedScaling).")
