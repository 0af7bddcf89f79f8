"""The ops on local shards: what every device runs, whichever path the call came down.

:class:`LocalOp` is one call's per-device function. The public ops run it on the local shards
inside ``shard_map``, where it makes the call's plan for the shards it sees (``_plan.make``);
on global arrays they hand it to the global-array paths (``_global``, ``_partition``), which
have it make its plan once, at trace time, for the shards the devices get
(:meth:`LocalOp.planned`), and call down into it on each device, maybe later, when XLA
partitions the program. It runs the plan's impl under the op's autodiff rule:

* the dispatch (``_run_ag`` / ``_run_rs`` / ``_run_ar``): ``_xla`` (the unfused reference),
  ``_ring`` (``ppermute`` rings) or ``_native.primitive`` (the executors' custom calls), each
  under the op's own name (``jaxoverlap.ag_matmul``, ...) and the call's dot precision;
* autodiff pairs AG+GEMM and GEMM+RS: the backward pass of one is the other, so it is
  overlapped by the same impl. GEMM+AR's result is replicated, so its backward pass is two
  local GEMMs on the cotangent. Calls with fp8 operands (their ``scales``, ``_fp8_dtypes``)
  have no backward pass: differentiating one raises, pointing to ``jaxoverlap.fp8``.

Megatron's f (``_megatron``, the kind ``matmul``) runs here too: it is g's transpose, and the
global paths ask a call for its transpose.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxoverlap import _megatron, _plan, _precision, _ring, _xla
from jaxoverlap._compat import bound_axis_size, check_vma_active, match_varying, varying_axes
from jaxoverlap._fp8_dtypes import no_gradient
from jaxoverlap._layout import AG, AR, RS, TRANSPOSE, F
from jaxoverlap._native import primitive as native
from jaxoverlap._plan import OpPlan, Request


@dataclasses.dataclass(frozen=True)
class LocalOp:
    """One call's per-device function, made at trace time from what the call asked for.

    Hashable, so that the global paths can carry it in a static argument; it brings the
    settings of its trace (``Request.settings``, ``Request.default_precision``) to wherever it
    is traced. ``plan``: the plan made for the shards ``shards`` (their shapes and dtypes) by
    :meth:`planned`, which the devices run when those are the shards they get; None: the
    devices make it.
    """

    request: Request
    plan: OpPlan | None = None
    shards: tuple | None = None

    @property
    def precision(self) -> str | None:
        return self.request.precision

    @property
    def out_dtype(self) -> str | None:
        """y's dtype name for fp8 operands (None: x's)."""
        return self.request.out_dtype

    def __call__(self, x, w, want_gathered: bool = False, scales: tuple = ()):
        """The op on local shards ``x``, ``w`` (``axis_name`` bound): y, or (y, gathered x)
        for ``ag_matmul`` with ``want_gathered``; ``scales``: this rank's ``(x_scale,
        w_scale)`` for fp8 operands (float32 scalars), else ``()``."""
        r = self.request
        with self._traced_as_called():
            if r.op == F:
                return _megatron.copy_matmul(x, w, r.axis_name, precision=r.precision)
            plan = self.plan
            if plan is None or self.shards != _shards(x, w):
                plan = _plan.make(r, x, w, bound_axis_size(r.axis_name))
            return run(plan, x, w, want_gathered, tuple(scales))

    def planned(self, mesh, x, w) -> LocalOp:
        """This function with its plan made now, once, for the shards ``x``, ``w`` (anything
        with a shape and a dtype) that each device of ``mesh`` will get: what the global-array
        paths call before handing it down, so that the plan (and, on a concrete mesh, the
        native call's transport) is decided at trace time, where every misuse is reported."""
        r = self.request
        if r.op == F:
            return self
        context = jax.sharding.get_abstract_mesh()
        where = (mesh.abstract_mesh if isinstance(mesh, jax.sharding.Mesh) else mesh) \
            if context.empty else context
        with self._traced_as_called(), jax.sharding.use_abstract_mesh(where):
            plan = _plan.make(r, x, w, mesh.shape[r.axis_name], mesh=mesh)
        return dataclasses.replace(self, plan=plan, shards=_shards(x, w))

    def transposed(self) -> LocalOp:
        """The call computing this one's input gradient: AG+GEMM <-> GEMM+RS with the same
        arguments; f <-> g with the precision only (g's other choices left open)."""
        r, op = self.request, TRANSPOSE[self.request.op]
        if op in (AG, RS):
            return LocalOp(dataclasses.replace(r, op=op))
        precision = _precision.normalize(op, r.precision) if op == AR else r.precision
        return LocalOp(Request(op, r.axis_name, r.settings, precision=precision,
                               default_precision=r.default_precision))

    def weight_grad(self, a, b, dtype):
        """``aᵀ·b`` over every dim but the last (the weight gradient), at the call's precision."""
        precision = _precision.normalize(self.request.op, self.request.precision)
        with self._traced_as_called(), _precision.scope(precision):
            return weight_grad(a, b, dtype)

    def _traced_as_called(self):
        """JAX's default matmul precision as it was where the call was traced."""
        if self.request.default_precision is None:
            return contextlib.nullcontext()
        return jax.default_matmul_precision(self.request.default_precision)


def run(plan: OpPlan, x, w, want_gathered: bool = False, scales: tuple = ()):
    """``plan`` on local shards, differentiably (the impl's autodiff rule); ``scales``: the
    fp8 operands' ``(x_scale, w_scale)`` or ``()``."""
    if plan.op == AG:
        return _ag_matmul(x, w, scales, plan, want_gathered, _types(x, w))
    if plan.op == RS:
        return _matmul_rs(x, w, scales, plan, _types(x, w))
    assert plan.op == AR, plan
    typed = check_vma_active()
    if typed:
        # The sum over ranks of x_r @ w_r, as psum sums an invariant operand's N copies.
        x, w, *scales = (a if plan.axis_name in varying_axes(a)
                         else lax.pcast(a, (plan.axis_name,), to="varying")
                         for a in (x, w, *scales))
        scales = tuple(scales)
    if plan.impl == "xla" and not scales:
        return _run_ar(x, w, plan)  # dot + psum: JAX differentiates it
    return _matmul_ar(x, w, scales, plan, _types(x, w), typed)


# ---------------------------------------------------------------- dispatch


def _run_ag(x, w, plan: OpPlan, want_gathered: bool, scales: tuple = ()):
    # Every impl of every op under its own name: JAX's profiler and the HLO op_name metadata
    # show "jaxoverlap.ag_matmul/..." (the backward passes run the other op, named as such).
    with jax.named_scope("jaxoverlap.ag_matmul"), _precision.scope(plan.precision):
        if plan.impl == "xla":
            y, gathered = _xla.ag_matmul(x, w, plan, scales)
        elif plan.impl == "ring":
            y, gathered = _ring.ag_matmul(x, w, plan, want_gathered, scales)
        else:
            out = native.ag_matmul(x, w, plan, want_gathered, **_native_scales(scales))
            y, gathered = out if want_gathered else (out, None)
    return y, (gathered if want_gathered else None)


def _run_rs(x, w, plan: OpPlan, scales: tuple = ()):
    with jax.named_scope("jaxoverlap.matmul_rs"), _precision.scope(plan.precision):
        if plan.impl == "xla":
            return _xla.matmul_rs(x, w, plan, scales)
        if plan.impl == "ring":
            return _ring.matmul_rs(x, w, plan, scales)
        return native.matmul_rs(x, w, plan, **_native_scales(scales))


def _run_ar(x, w, plan: OpPlan, scales: tuple = ()):
    with jax.named_scope("jaxoverlap.matmul_ar"), _precision.scope(plan.precision):
        if plan.impl == "xla":
            return _xla.matmul_ar(x, w, plan, scales)
        if plan.impl == "ring":
            return _ring.matmul_ar(x, w, plan, scales)
        return native.matmul_ar(x, w, plan, **_native_scales(scales))


def _native_scales(scales: tuple) -> dict:
    """The native primitive's scale arguments (none without fp8: they default to 1.0):
    float32 scalars, or block scales (e8m0, MXFP8), which only the host executor takes
    (``_plan`` keeps them off the CUDA executor)."""
    return dict(x_scale=scales[0], w_scale=scales[1]) if scales else {}


def weight_grad(a, b, dtype):
    """aᵀ·b over every dim but the last: the weight gradient, accumulated in float32."""
    dims = tuple(range(a.ndim - 1))
    return lax.dot_general(a, b, ((dims, dims), ((), ())),
                           preferred_element_type=jnp.float32).astype(dtype)


# ---------------------------------------------------------------- autodiff


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _ag_matmul(x, w, scales: tuple, plan: OpPlan, want_gathered: bool, types: tuple):
    y, gathered = _run_ag(x, w, plan, want_gathered, scales)
    return (y, gathered) if want_gathered else y


def _ag_matmul_fwd(x, w, scales, plan, want_gathered, types):
    y, gathered = _run_ag(x, w, plan, True, scales)
    return ((y, gathered) if want_gathered else y), (gathered, w, scales)


def _ag_matmul_bwd(plan, want_gathered, types, res, ct):
    gathered, w, scales = res
    if scales:
        raise no_gradient(AG)
    x_type, w_type = types
    dy, dgathered = ct if want_gathered else (ct, None)
    # AG+GEMM's backward is GEMM+RS: dX = reduce_scatter(dY @ Wᵀ).
    dx = _run_rs(dy, w.T, plan.for_op(RS))
    if dgathered is not None:  # only when the caller asked for the gathered x
        dx = dx + lax.psum_scatter(dgathered, plan.axis_name, scatter_dimension=plan.axis,
                                   tiled=True)
    with _precision.scope(plan.precision):
        dw = weight_grad(gathered, dy, w.dtype)
    return match_varying(dx, x_type), match_varying(dw, w_type), ()


_ag_matmul.defvjp(_ag_matmul_fwd, _ag_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _matmul_rs(x, w, scales: tuple, plan: OpPlan, types: tuple):
    return _run_rs(x, w, plan, scales)


def _matmul_rs_fwd(x, w, scales, plan, types):
    return _run_rs(x, w, plan, scales), (x, w, scales)


def _matmul_rs_bwd(plan, types, res, dy):
    x, w, scales = res
    if scales:
        raise no_gradient(RS)
    x_type, w_type = types
    # GEMM+RS's backward is AG+GEMM: dX = all_gather(dY) @ Wᵀ, reusing the
    # gathered dY for dW = Xᵀ·dY_gathered.
    dx, dy_gathered = _run_ag(dy, w.T, plan.for_op(AG), True)
    with _precision.scope(plan.precision):
        dw = weight_grad(x, dy_gathered, w.dtype)
    return match_varying(dx, x_type), match_varying(dw, w_type), ()


_matmul_rs.defvjp(_matmul_rs_fwd, _matmul_rs_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _matmul_ar(x, w, scales: tuple, plan: OpPlan, types: tuple, typed: bool):
    return _run_ar(x, w, plan, scales)


def _matmul_ar_fwd(x, w, scales, plan, types, typed):
    return _run_ar(x, w, plan, scales), (x, w, scales)


def _matmul_ar_bwd(plan, types, typed, res, dy):
    x, w, scales = res
    if scales:
        raise no_gradient(AR)
    x_type, w_type = types
    # y is the same on every rank, so its cotangent goes straight into the GEMMs:
    # dX = dY @ Wᵀ, dW = Xᵀ·dY. Under check_vma=True dY is that cotangent (invariant, as
    # psum's transpose would take it: no communication). Under check_vma=False JAX hands each
    # rank a share of a replicated value's cotangent; the shares are summed first, as JAX's
    # own transpose of psum does there.
    if not typed:
        dy = lax.psum(dy, plan.axis_name)
    with _precision.scope(plan.precision):
        dx = _xla.local_matmul(dy, w.T)
        dw = weight_grad(x, dy, w.dtype)
    return match_varying(dx, x_type), match_varying(dw, w_type), ()


_matmul_ar.defvjp(_matmul_ar_fwd, _matmul_ar_bwd)


def _shards(x, w) -> tuple:
    """What a plan was made for: the shapes and dtypes of the local shards."""
    return tuple((tuple(a.shape), jnp.dtype(a.dtype).name) for a in (x, w))


def _types(*arrays) -> tuple[frozenset, ...]:
    """The inputs' varying-axes types, carried statically into the backward pass."""
    return tuple(varying_axes(a) for a in arrays)
