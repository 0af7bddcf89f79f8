"""The public ops: argument checks, autodiff, and the choice of implementation.

The ops work on local shards inside ``jax.shard_map`` (where ``axis_name`` is
bound) and on global arrays outside it (they then wrap themselves in
``shard_map``, see ``_spmd``). Every misuse is reported here, at trace time,
naming the argument and the fix, before any implementation runs.

Autodiff pairs AG+GEMM and GEMM+RS: the backward pass of one is the other, so
the backward pass is overlapped by the same implementation. GEMM+AR's result is
replicated, so its backward pass is two local GEMMs on the cotangent.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxoverlap import _choose, _precision, _ring, _spmd, _xla
from jaxoverlap._compat import bound_axis_size, check_vma_active, match_varying, varying_axes
from jaxoverlap._config import (
    check_algorithm,
    check_bidirectional,
    check_chunks,
    check_impl,
    check_transport,
    configure_logging,
    current_config,
    logger,
)
from jaxoverlap._native import capabilities, runtime
from jaxoverlap._native import primitive as native
from jaxoverlap._native.call import describe
from jaxoverlap._native.capabilities import NativeUnavailableError
from jaxoverlap._plan import Plan

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# ---------------------------------------------------------------- checks


def _check_array(op: str, name: str, a: Any) -> None:
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{op}: {name} must be an array, got {type(a).__name__}.")


def _check_operands(op: str, x: Any, w: Any, axis: Any) -> int:
    """Checks ranks, the contraction and dtypes; returns ``axis`` normalised."""
    _check_array(op, "x", x)
    _check_array(op, "w", w)
    if x.ndim < 2:
        raise ValueError(f"{op}: x must have rank >= 2 ([..., rows, ..., features]); got shape "
                         f"{tuple(x.shape)}.")
    if w.ndim != 2:
        raise ValueError(f"{op}: w must have rank 2 ([features, out]); got shape "
                         f"{tuple(w.shape)}.")
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"{op}: axis={axis!r} must be an int (the sharded row dim of x).")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{op}: axis={axis} is out of range for x of rank {x.ndim}.")
    axis %= x.ndim
    if axis == x.ndim - 1:
        raise ValueError(
            f"{op}: axis={axis} is x's last dim, which is the contraction dim; pass the row "
            f"(sequence) dim, one of 0..{x.ndim - 2}."
        )
    if x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"{op}: contraction dims differ: x.shape[-1]={x.shape[-1]} but w.shape[0]="
            f"{w.shape[0]} (x {tuple(x.shape)}, w {tuple(w.shape)}). w must be [x.shape[-1], out]."
        )
    for name, a in (("x", x), ("w", w)):
        if jnp.dtype(a.dtype) not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{op}: {name}.dtype={jnp.dtype(a.dtype).name} is not supported; use float32, "
                "bfloat16 or float16."
            )
    if jnp.dtype(x.dtype) != jnp.dtype(w.dtype):
        raise TypeError(
            f"{op}: x.dtype={jnp.dtype(x.dtype).name} and w.dtype={jnp.dtype(w.dtype).name} "
            "differ; cast one of them (e.g. w.astype(x.dtype))."
        )
    return axis


def _check_axis_name(op: str, axis_name: Any) -> None:
    if isinstance(axis_name, (tuple, list)):
        raise TypeError(
            f"{op}: axis_name={axis_name!r} must be a single mesh axis name; several axes are "
            "not supported."
        )
    if not isinstance(axis_name, str):
        raise TypeError(
            f"{op}: axis_name={axis_name!r} must be a mesh axis name (a str, e.g. \"tp\"), "
            f"got {type(axis_name).__name__}. It is the third positional argument: "
            f"{op}(x, w, \"tp\", ...)."
        )


def _check_mesh(op: str, mesh: Any) -> None:
    if mesh is not None and not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise TypeError(f"{op}: mesh={mesh!r} must be a jax.sharding.Mesh (or None).")


# ---------------------------------------------------------------- plan


def _platform() -> str:
    mesh = jax.sharding.get_abstract_mesh()
    device = getattr(mesh, "abstract_device", None)
    platform = getattr(device, "platform", None)
    return platform or jax.default_backend()


_GPU_PLATFORMS = ("gpu", "cuda")
_gpu_fallback_warned = False


def _warn_gpu_fallback(op: str) -> None:
    """Once per process: on GPUs without the CUDA extension, impl='auto' cannot fuse; say so.

    The product's point would otherwise be off without a word; the warning names the cause
    and the fix (``runtime.cuda_error``).
    """
    global _gpu_fallback_warned
    if _gpu_fallback_warned or _platform() not in _GPU_PLATFORMS:
        return
    error = runtime.cuda_error()
    if error is None:
        return
    _gpu_fallback_warned = True
    warnings.warn(
        f"jaxoverlap: {op} with impl='auto' runs on GPUs without jaxoverlap's CUDA extension, "
        f"so it falls back to the unfused path: {error}", RuntimeWarning, stacklevel=3)


def _native_reason(dtype) -> str | None:
    """Why the native path cannot run here (None if it can)."""
    return capabilities.unavailable_reason(_platform(), dtype)


def _resolve_impl(op: str, impl: str, transport: str | None, dtype, n: int) -> str:
    if impl == "native" or (impl == "auto" and transport not in (None, "auto")):
        reason = _native_reason(dtype)
        if reason is not None:
            raise NativeUnavailableError(
                f"{op}: impl='native' was requested"
                + (f" (transport={transport!r})" if transport not in (None, "auto") else "")
                + f" but cannot run: {reason}. Use impl='ring' or impl='xla'."
            )
        return "native"
    if impl == "auto":
        # The only native executor in this build is the CPU host executor: an
        # exact emulation for testing schedules, not a speed-up (host devices
        # share the cores). Until a cost model says otherwise, auto stays with
        # the unfused path, which is never slower by choice.
        return "xla"
    if transport not in (None, "auto"):
        raise ValueError(
            f"{op}: transport={transport!r} applies to impl='native' only, but impl={impl!r}. "
            "Drop transport= or use impl='native'."
        )
    return impl


def _make_plan(
    op: str, x, w, axis_name, n: int, axis: int, rows_per_shard: int,
    impl: Any, transport: Any, chunks: Any, bidirectional: Any, rows_what: str | None = None,
    log: bool = True, algorithms: tuple[str, ...] = ("two_shot",),
) -> Plan:
    """The plan of one call site. ``rows_what`` names the ``rows_per_shard`` rows that
    ``chunks`` must divide (default: those each rank holds on ``axis``); ``algorithms``:
    matmul_ar's algorithms the model may pick among (the first without a model)."""
    check_impl(impl)
    check_transport(transport)
    check_chunks(chunks)
    check_bidirectional(bidirectional)
    configure_logging()
    settings = current_config()
    chosen_impl = impl if impl != "auto" else settings.impl
    explicit_transport = transport if transport not in (None, "auto") else None
    source = "chunks"
    if chunks is None and settings.chunks is not None:
        chunks, source = settings.chunks, "chunks (from jo.config / JAXOVERLAP_CHUNKS)"
    if chunks is not None and rows_per_shard % chunks:
        what = rows_what or f"rows each rank holds on axis {axis}"
        raise ValueError(
            f"{op}: {source}={chunks} does not divide the {rows_per_shard} {what}; pick a "
            f"divisor of {rows_per_shard}."
        )
    if bidirectional is None:
        bidirectional = settings.bidirectional
    transport_wanted = explicit_transport or (
        settings.transport if settings.transport != "auto" else None)

    forced_native = chosen_impl == "native" or (
        chosen_impl == "auto" and explicit_transport is not None)
    if chosen_impl == "auto" and not forced_native:
        _warn_gpu_fallback(op)
    picked = _model_pick(op, x, w, n, axis, rows_per_shard, chosen_impl, forced_native,
                         transport_wanted, chunks, bidirectional, settings.preset, algorithms)
    if picked is not None:
        chosen_impl = picked.impl
        chunks = picked.chunks if chunks is None else chunks
        bidirectional = picked.bidirectional if bidirectional is None else bidirectional
    else:
        chosen_impl = _resolve_impl(op, chosen_impl, explicit_transport, x.dtype, n)
    plan = Plan(
        impl=chosen_impl,
        axis_name=axis_name,
        axis=axis,
        n=n,
        chunks=1 if chunks is None else chunks,
        bidirectional=(n > 2) if bidirectional is None else bidirectional,
        transport=transport_wanted or "auto",
        preferred=picked.transport if picked is not None and picked.impl == "native" else None,
        timeout_s=settings.timeout_s,
        algorithm=picked.algorithm if picked is not None and picked.impl != "xla"
        else algorithms[0],
    )
    if log:
        logger.debug("%s x=%s%s: %s", op, jnp.dtype(x.dtype).name, tuple(x.shape),
                     plan.describe())
    return plan


def _model_pick(op, x, w, n, axis, rows_per_shard, impl, forced_native, transport, chunks,
                bidirectional, preset, algorithms=("two_shot",)):
    """The performance model's candidate for what the caller left open, or None.

    None means no model applies (no preset: host devices by default) or nothing
    is left open; the simple defaults then hold.
    """
    mesh = jax.sharding.get_abstract_mesh()
    device_kind = getattr(getattr(mesh, "abstract_device", None), "device_kind", None)
    preset = _choose.machine_preset(preset, device_kind)
    open_choice = (impl == "auto" or chunks is None or bidirectional is None
                   or transport is None)
    if preset is None or not open_choice or impl not in ("auto", "native") or n == 1:
        return None                      # xla/ring asked for: nothing for the model to pick
    native_ok = _native_reason(x.dtype) is None
    if forced_native and not native_ok:
        return None                      # _resolve_impl raises the clear error
    if forced_native:
        impls: tuple = ("native",)
    else:
        impls = ("xla", "ring", "native") if native_ok else ("xla", "ring")
    transports = ((transport,) if transport else capabilities.offered_transports(_platform())) \
        if native_ok else ()
    try:
        pick = _choose.choose(
            op, _choose.canonical_shape(op, tuple(x.shape), tuple(w.shape), axis, n),
            jnp.dtype(x.dtype).name, n, preset, impls, tuple(transports),
            tuple(c for c in (1, 2, 4, 8) if rows_per_shard % c == 0)
            if chunks is None else (chunks,),
            (False, True) if bidirectional is None else (bidirectional,), algorithms)
    except (ValueError, OSError) as err:
        raise ValueError(f"{op}: the performance model (preset={preset!r}) failed: {err}") from err
    return pick


# ---------------------------------------------------------------- dispatch


def _run_ag(x, w, plan: Plan, want_gathered: bool):
    # Every impl of every op under its own name: JAX's profiler and the HLO op_name metadata
    # show "jaxoverlap.ag_matmul/..." (the backward passes run the other op, named as such).
    with jax.named_scope("jaxoverlap.ag_matmul"), _precision.scope(plan.precision):
        return _run_ag_impl(x, w, plan, want_gathered)


def _run_ag_impl(x, w, plan: Plan, want_gathered: bool):
    if plan.impl == "xla":
        y, gathered = _xla.ag_matmul(x, w, plan)
    elif plan.impl == "ring":
        y, gathered = _ring.ag_matmul(x, w, plan, want_gathered)
    else:
        out = native.ag_matmul_shard(x, w, return_gathered=want_gathered, **_native_args(plan))
        y, gathered = out if want_gathered else (out, None)
    return y, (gathered if want_gathered else None)


def _run_rs(x, w, plan: Plan):
    with jax.named_scope("jaxoverlap.matmul_rs"), _precision.scope(plan.precision):
        return _run_rs_impl(x, w, plan)


def _run_rs_impl(x, w, plan: Plan):
    if plan.impl == "xla":
        return _xla.matmul_rs(x, w, plan)
    if plan.impl == "ring":
        return _ring.matmul_rs(x, w, plan)
    return native.matmul_rs_shard(x, w, **_native_args(plan))


def _run_ar(x, w, plan: Plan):
    with jax.named_scope("jaxoverlap.matmul_ar"), _precision.scope(plan.precision):
        return _run_ar_impl(x, w, plan)


def _run_ar_impl(x, w, plan: Plan):
    if plan.impl == "xla":
        return _xla.matmul_ar(x, w, plan)
    if plan.impl == "ring":
        return _ring.matmul_ar(x, w, plan)
    args = _native_args(plan)
    del args["axis"]  # matmul_ar takes all of x's rows
    return native.matmul_ar_shard(x, w, algorithm=plan.algorithm, **args)


def _native_args(plan: Plan) -> dict:
    return dict(axis_name=plan.axis_name, axis=plan.axis, transport=plan.transport,
                preferred=plan.preferred, chunks=plan.chunks, bidirectional=plan.bidirectional,
                timeout_s=plan.timeout_s, tf32=_precision.allows_tf32(plan.precision))


def _weight_grad(a, b, dtype):
    """aᵀ·b over every dim but the last: the weight gradient, accumulated in float32."""
    dims = tuple(range(a.ndim - 1))
    return lax.dot_general(a, b, ((dims, dims), ((), ())),
                           preferred_element_type=jnp.float32).astype(dtype)


# ---------------------------------------------------------------- autodiff


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _ag_matmul(x, w, plan: Plan, want_gathered: bool, types: tuple):
    y, gathered = _run_ag(x, w, plan, want_gathered)
    return (y, gathered) if want_gathered else y


def _ag_matmul_fwd(x, w, plan, want_gathered, types):
    y, gathered = _run_ag(x, w, plan, True)
    return ((y, gathered) if want_gathered else y), (gathered, w)


def _ag_matmul_bwd(plan, want_gathered, types, res, ct):
    gathered, w = res
    x_type, w_type = types
    dy, dgathered = ct if want_gathered else (ct, None)
    # AG+GEMM's backward is GEMM+RS: dX = reduce_scatter(dY @ Wᵀ).
    dx = _run_rs(dy, w.T, plan)
    if dgathered is not None:  # only when the caller asked for the gathered x
        dx = dx + lax.psum_scatter(dgathered, plan.axis_name, scatter_dimension=plan.axis,
                                   tiled=True)
    with _precision.scope(plan.precision):
        dw = _weight_grad(gathered, dy, w.dtype)
    return match_varying(dx, x_type), match_varying(dw, w_type)


_ag_matmul.defvjp(_ag_matmul_fwd, _ag_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul_rs(x, w, plan: Plan, types: tuple):
    return _run_rs(x, w, plan)


def _matmul_rs_fwd(x, w, plan, types):
    return _run_rs(x, w, plan), (x, w)


def _matmul_rs_bwd(plan, types, res, dy):
    x, w = res
    x_type, w_type = types
    # GEMM+RS's backward is AG+GEMM: dX = all_gather(dY) @ Wᵀ, reusing the
    # gathered dY for dW = Xᵀ·dY_gathered.
    dx, dy_gathered = _run_ag(dy, w.T, plan, True)
    with _precision.scope(plan.precision):
        dw = _weight_grad(x, dy_gathered, w.dtype)
    return match_varying(dx, x_type), match_varying(dw, w_type)


_matmul_rs.defvjp(_matmul_rs_fwd, _matmul_rs_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _matmul_ar(x, w, plan: Plan, types: tuple, typed: bool):
    return _run_ar(x, w, plan)


def _matmul_ar_fwd(x, w, plan, types, typed):
    return _run_ar(x, w, plan), (x, w)


def _matmul_ar_bwd(plan, types, typed, res, dy):
    x, w = res
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
        dw = _weight_grad(x, dy, w.dtype)
    return match_varying(dx, x_type), match_varying(dw, w_type)


_matmul_ar.defvjp(_matmul_ar_fwd, _matmul_ar_bwd)


def _types(*arrays) -> tuple[frozenset, ...]:
    """The inputs' varying-axes types, carried statically into the backward pass."""
    return tuple(varying_axes(a) for a in arrays)


# ---------------------------------------------------------------- global arrays


def _global(op: str, x, w, axis_name, axis: int | None, mesh, want_gathered: bool,
            op_args: dict, precision: str | None):
    """The op on global arrays (outside shard_map), through ``_spmd``."""
    mesh = _spmd.resolve_mesh(op, axis_name, mesh, x, w)
    call = _spmd.make_call(op, axis_name, x.ndim, axis, precision=precision, **op_args)
    _spmd.check_shapes(call, x, w, mesh)
    # The per-device plan may be made later (when XLA partitions the program):
    # make it once now for the shards' shapes, so that every misuse is reported
    # here, at trace time.
    n = mesh.shape[axis_name]
    x_shape = list(x.shape)
    if op == "ag_matmul":         # x split on its rows, w on its columns
        x_shape[axis] //= n
        w_shape = (w.shape[0], w.shape[1] // n)
    else:                         # x split on its features, w on its rows
        x_shape[-1] //= n
        w_shape = (w.shape[0] // n, w.shape[1])
    local_x = jax.ShapeDtypeStruct(tuple(x_shape), x.dtype)
    local_w = jax.ShapeDtypeStruct(w_shape, w.dtype)
    if op == "matmul_ar":
        plan = _ar_plan(local_x, local_w, axis_name, n, log=False, **op_args)
    else:
        rows = x_shape[axis] if op == "ag_matmul" else x_shape[axis] // n
        plan = _make_plan(op, local_x, local_w, axis_name, n, axis, rows, log=False, **op_args)
    if plan.impl == "native" and isinstance(mesh, jax.sharding.Mesh):
        # Under Auto axes the call lowers while XLA compiles, where a refusal surfaces as an
        # XLA error: ask the one transport resolver now, for this very mesh.
        platform = mesh.devices.flat[0].platform
        describe(mesh, axis_name, "cuda" if platform == "gpu" else platform, plan.transport,
                 plan.preferred, jax.process_index())
    return _spmd.run(call, mesh, x, w, want_gathered=want_gathered)


# ---------------------------------------------------------------- public API


def ag_matmul(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    *,
    axis: int = 0,
    impl: str = "auto",
    transport: str | None = None,
    chunks: int | None = None,
    bidirectional: bool | None = None,
    return_gathered: bool = False,
    precision: Any = None,
    mesh: jax.sharding.Mesh | None = None,
):
    """All-gather ``x`` over ``axis_name`` along ``axis``, then multiply by ``w``.

    Equals ``all_gather(x, axis_name, axis=axis, tiled=True) @ w`` with the
    gather hidden behind the multiply. Inside ``shard_map`` x and w are local
    (x: ``[.., S/N, .., K]``, w: ``[K, Nw]`` column shard); outside it they are
    global arrays (see ``_spmd``). ``return_gathered=True`` also returns the
    gathered x. Dims before ``axis`` act as a batch; ``axis`` may be any dim
    but the last. ``precision`` is ``lax.dot_general``'s (None: JAX's default
    matmul precision); at ``HIGHEST`` no impl uses TF32 for float32.
    """
    op = "ag_matmul"
    _check_axis_name(op, axis_name)
    _check_mesh(op, mesh)
    axis = _check_operands(op, x, w, axis)
    precision = _precision.normalize(op, precision)
    if not isinstance(return_gathered, bool):
        raise TypeError(f"{op}: return_gathered={return_gathered!r} must be True or False.")
    n = bound_axis_size(axis_name)
    if n is None:
        return _global(op, x, w, axis_name, axis, mesh, return_gathered,
                       dict(impl=impl, transport=transport, chunks=chunks,
                            bidirectional=bidirectional), precision)
    plan = _make_plan(op, x, w, axis_name, n, axis, x.shape[axis], impl, transport, chunks,
                      bidirectional)
    plan = dataclasses.replace(plan, precision=precision)
    return _ag_matmul(x, w, plan, return_gathered, _types(x, w))


def matmul_rs(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    *,
    axis: int = 0,
    impl: str = "auto",
    transport: str | None = None,
    chunks: int | None = None,
    bidirectional: bool | None = None,
    precision: Any = None,
    mesh: jax.sharding.Mesh | None = None,
):
    """Multiply ``x`` by ``w``, then reduce-scatter the product over ``axis_name`` along ``axis``.

    Equals ``psum_scatter(x @ w, axis_name, scatter_dimension=axis, tiled=True)``
    with the reduction hidden behind the multiply. Inside ``shard_map`` x is
    ``[.., S, .., Kf]`` with Kf the local slice of the contraction and w is
    ``[Kf, Nw]``; outside it they are global arrays (see ``_spmd``).
    ``precision`` as in :func:`ag_matmul`.
    """
    op = "matmul_rs"
    _check_axis_name(op, axis_name)
    _check_mesh(op, mesh)
    axis = _check_operands(op, x, w, axis)
    precision = _precision.normalize(op, precision)
    n = bound_axis_size(axis_name)
    if n is None:
        return _global(op, x, w, axis_name, axis, mesh, False,
                       dict(impl=impl, transport=transport, chunks=chunks,
                            bidirectional=bidirectional), precision)
    if x.shape[axis] % n:
        raise ValueError(
            f"{op}: x.shape[{axis}]={x.shape[axis]} rows are not divisible by the size {n} of "
            f"mesh axis {axis_name!r}; pad the rows to a multiple of {n}."
        )
    plan = _make_plan(op, x, w, axis_name, n, axis, x.shape[axis] // n, impl, transport, chunks,
                      bidirectional)
    plan = dataclasses.replace(plan, precision=precision)
    return _matmul_rs(x, w, plan, _types(x, w))


def matmul_ar(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    *,
    impl: str = "auto",
    transport: str | None = None,
    chunks: int | None = None,
    bidirectional: bool | None = None,
    algorithm: str | None = None,
    precision: Any = None,
    mesh: jax.sharding.Mesh | None = None,
):
    """Multiply ``x`` by ``w``, then all-reduce (sum) the product over ``axis_name``.

    Equals ``psum(x @ w, axis_name)`` with the reduction hidden behind the multiply.
    Inside ``shard_map`` x is ``[.., S, .., Kf]`` with Kf the local slice of the
    contraction and w is ``[Kf, Nw]``; y ``[.., S, .., Nw]`` is the same on every rank
    of ``axis_name`` (typed invariant over it, as psum's result). Outside it they are
    global arrays (see ``_spmd``). The rows of x are every dim but the last.

    ``algorithm`` (the fused impls): ``"two_shot"`` splits the rows into N blocks (a
    reduce-scatter ring, then an all-gather ring of the reduced blocks; or a reduction
    in the switch with multicast), so their number must divide by N; ``"one_shot"``
    sends every rank's whole partial to every rank (multicast: every rank load-reduces
    all rows in the switch), one hop instead of 2(N-1), for small M, any number of rows;
    None: the performance model's pick where a preset applies, else two-shot when the
    rows split and one-shot when they do not.

    Autodiff: the backward pass takes the replicated cotangent straight into the
    GEMMs, dx = dy @ wᵀ and dw = xᵀ·dy, with no communication under
    ``check_vma=True``; under ``check_vma=False`` each rank's share of the cotangent
    is summed first, as JAX's transpose of ``psum`` does there. ``precision`` as in
    :func:`ag_matmul`.
    """
    op = "matmul_ar"
    _check_axis_name(op, axis_name)
    _check_mesh(op, mesh)
    _check_operands(op, x, w, 0)
    check_algorithm(algorithm)
    precision = _precision.normalize(op, precision)
    n = bound_axis_size(axis_name)
    if n is None:
        return _global(op, x, w, axis_name, None, mesh, False,
                       dict(impl=impl, transport=transport, chunks=chunks,
                            bidirectional=bidirectional, algorithm=algorithm), precision)
    plan = _ar_plan(x, w, axis_name, n, impl, transport, chunks, bidirectional, algorithm)
    plan = dataclasses.replace(plan, precision=precision)
    typed = check_vma_active()
    if typed:
        # The sum over ranks of x_r @ w_r, as psum sums an invariant operand's N copies.
        x, w = (a if axis_name in varying_axes(a) else lax.pcast(a, (axis_name,), to="varying")
                for a in (x, w))
    if plan.impl == "xla":
        return _run_ar(x, w, plan)  # dot + psum: JAX differentiates it
    return _matmul_ar(x, w, plan, _types(x, w), typed)


def _ar_plan(x, w, axis_name, n, impl, transport, chunks, bidirectional, algorithm=None,
             log=True) -> Plan:
    """matmul_ar's plan. Two-shot splits x's rows (every dim but the last) in N blocks, so
    rows that do not split run one-shot; the model (where a preset applies) picks between
    the two for what the caller left open."""
    op = "matmul_ar"
    algorithm = check_algorithm(algorithm)
    check_impl(impl)
    asked = impl if impl != "auto" else current_config().impl
    if algorithm is not None and asked == "xla":
        raise ValueError(f"{op}: algorithm={algorithm!r} applies to the fused impls ('ring', "
                         f"'native'), but impl='xla'. Drop algorithm= or pick a fused impl.")
    rows = math.prod(x.shape[:-1])
    splits = rows % n == 0
    if algorithm == "two_shot" and not splits:
        raise ValueError(
            f"{op}: algorithm='two_shot' splits the rows of x (every dim but the last: {rows} "
            f"for shape {tuple(x.shape)}) into one block per rank of {axis_name!r} ({n}), but "
            f"{rows} is not divisible by {n}. Use algorithm='one_shot' (or None), or pad the "
            f"rows to a multiple of {n}."
        )
    if algorithm is not None:
        algorithms: tuple[str, ...] = (algorithm,)
    else:
        algorithms = ("two_shot", "one_shot") if splits else ("one_shot",)
    one_shot = algorithms[0] == "one_shot"
    where = ("rows of x (every dim but the last; one-shot takes them all)" if one_shot else
             f"rows of each rank's block (x's {rows} rows, every dim but the last, over the "
             f"{n} ranks of {axis_name!r})")
    return _make_plan(op, x, w, axis_name, n, 0, rows if one_shot else rows // n, impl,
                      transport, chunks, bidirectional, rows_what=where, log=log,
                      algorithms=algorithms)
