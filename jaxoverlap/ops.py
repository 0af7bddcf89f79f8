"""The two public ops: argument checks, autodiff, and the choice of implementation.

Both ops work on local shards inside ``jax.shard_map`` (where ``axis_name`` is
bound) and on global arrays outside it (they then wrap themselves in
``shard_map``, see ``_spmd``). Every misuse is reported here, at trace time,
naming the argument and the fix, before any implementation runs.

Autodiff pairs the two ops: the backward pass of AG+GEMM is a GEMM+RS and vice
versa, so the backward pass is overlapped by the same implementation.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxoverlap import _choose, _ring, _spmd, _xla
from jaxoverlap._compat import bound_axis_size, match_varying, varying_axes
from jaxoverlap._config import (
    check_bidirectional,
    check_chunks,
    check_impl,
    check_transport,
    configure_logging,
    current_config,
    logger,
)
from jaxoverlap._plan import Plan

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class NativeUnavailableError(ValueError):
    """``impl="native"`` (or a native transport) was asked for but cannot run here."""


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
    try:
        hash(axis_name)
    except TypeError:
        raise TypeError(
            f"{op}: axis_name={axis_name!r} must be a mesh axis name (a str)."
        ) from None
    if isinstance(axis_name, (tuple, list)):
        raise TypeError(
            f"{op}: axis_name={axis_name!r} must be a single mesh axis name; several axes are "
            "not supported."
        )


# ---------------------------------------------------------------- plan


def _native():
    """The native module (FFI custom calls), or None if this installation lacks it."""
    try:
        from jaxoverlap import _native
    except ImportError:
        return None
    return _native


# Transport preference for transport="auto" (DESIGN §3.2).
_TRANSPORT_ORDER = ("multicast", "p2p", "nccl")


def _platform() -> str:
    mesh = jax.sharding.get_abstract_mesh()
    device = getattr(mesh, "abstract_device", None)
    platform = getattr(device, "platform", None)
    return platform or jax.default_backend()


def _native_reason(dtype) -> str | None:
    """Why the native path cannot run here (None if it can)."""
    native = _native()
    if native is None:
        return "this installation of jaxoverlap has no native module"
    return native.unavailable_reason(_platform(), dtype)


def _native_transport(op: str, transport: str | None) -> str:
    """The transport native will use: the one asked for, or the best this machine has."""
    available = _native().transports(_platform())
    if transport in (None, "auto"):
        chosen = next(t for t in _TRANSPORT_ORDER if t in available)
        logger.debug("%s: transport=auto picks %s (available: %s)", op, chosen, available)
        return chosen
    if transport not in available:
        raise NativeUnavailableError(
            f"{op}: transport={transport!r} is not available on this machine (available: "
            f"{available}). Use transport='auto' to pick the best available one."
        )
    return transport


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
    impl: Any, transport: Any, chunks: Any, bidirectional: Any, log: bool = True,
) -> Plan:
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
        raise ValueError(
            f"{op}: {source}={chunks} does not divide the {rows_per_shard} rows each rank holds "
            f"on axis {axis}; pick a divisor of {rows_per_shard}."
        )
    if bidirectional is None:
        bidirectional = settings.bidirectional
    transport_wanted = explicit_transport or (
        settings.transport if settings.transport != "auto" else None)

    forced_native = chosen_impl == "native" or (
        chosen_impl == "auto" and explicit_transport is not None)
    picked = _model_pick(op, x, w, n, axis, rows_per_shard, chosen_impl, forced_native,
                         transport_wanted, chunks, bidirectional, settings.preset)
    if picked is not None:
        chosen_impl = picked.impl
        chunks = picked.chunks if chunks is None else chunks
        bidirectional = picked.bidirectional if bidirectional is None else bidirectional
        if picked.impl == "native":
            transport_wanted = transport_wanted or picked.transport
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
        timeout_s=settings.timeout_s,
    )
    if chosen_impl == "native":
        plan = dataclasses.replace(plan, transport=_native_transport(op, plan.transport),
                                   mesh=_native().current_mesh())
    if log:
        logger.debug("%s x=%s%s: %s", op, jnp.dtype(x.dtype).name, tuple(x.shape),
                     plan.describe())
    return plan


def _model_pick(op, x, w, n, axis, rows_per_shard, impl, forced_native, transport, chunks,
                bidirectional, preset):
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
    transports = ((transport,) if transport else _native().transports(_platform())) \
        if native_ok else ()
    try:
        pick = _choose.choose(
            op, _choose.canonical_shape(op, tuple(x.shape), tuple(w.shape), axis, n),
            jnp.dtype(x.dtype).name, n, preset, impls, tuple(transports),
            tuple(c for c in (1, 2, 4, 8) if rows_per_shard % c == 0)
            if chunks is None else (chunks,),
            (False, True) if bidirectional is None else (bidirectional,))
    except (ValueError, OSError) as err:
        raise ValueError(f"{op}: the performance model (preset={preset!r}) failed: {err}") from err
    return pick


# ---------------------------------------------------------------- dispatch


def _run_ag(x, w, plan: Plan, want_gathered: bool):
    if plan.impl == "xla":
        y, gathered = _xla.ag_matmul(x, w, plan)
    elif plan.impl == "ring":
        y, gathered = _ring.ag_matmul(x, w, plan, want_gathered)
    else:
        out = _native().ag_matmul_shard(x, w, return_gathered=want_gathered, **_native_args(plan))
        y, gathered = out if want_gathered else (out, None)
    return y, (gathered if want_gathered else None)


def _run_rs(x, w, plan: Plan):
    if plan.impl == "xla":
        return _xla.matmul_rs(x, w, plan)
    if plan.impl == "ring":
        return _ring.matmul_rs(x, w, plan)
    return _native().matmul_rs_shard(x, w, **_native_args(plan))


def _native_args(plan: Plan) -> dict:
    return dict(axis_name=plan.axis_name, axis=plan.axis, transport=plan.transport,
                chunks=plan.chunks, bidirectional=plan.bidirectional, timeout_s=plan.timeout_s,
                mesh=plan.mesh)


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
    dw = _weight_grad(x, dy_gathered, w.dtype)
    return match_varying(dx, x_type), match_varying(dw, w_type)


_matmul_rs.defvjp(_matmul_rs_fwd, _matmul_rs_bwd)


def _types(*arrays) -> tuple[frozenset, ...]:
    """The inputs' varying-axes types, carried statically into the backward pass."""
    return tuple(varying_axes(a) for a in arrays)


# ---------------------------------------------------------------- global arrays


def _global(op: str, x, w, axis_name, axis: int, mesh, want_gathered: bool, op_args: dict):
    """The op on global arrays (outside shard_map), through ``_spmd``."""
    mesh = _spmd.resolve_mesh(op, axis_name, mesh, x, w)
    call = _spmd.make_call(op, axis_name, x.ndim, axis, **op_args)
    _spmd.check_shapes(call, x, w, mesh)
    # The per-device plan may be made later (when XLA partitions the program):
    # make it once now for the shards' shapes, so that every misuse is reported
    # here, at trace time.
    n = mesh.shape[axis_name]
    x_shape = list(x.shape)
    if op == "ag_matmul":         # x split on its rows, w on its columns
        x_shape[axis] //= n
        w_shape, rows = (w.shape[0], w.shape[1] // n), x_shape[axis]
    else:                         # x split on its features, w on its rows
        x_shape[-1] //= n
        w_shape, rows = (w.shape[0] // n, w.shape[1]), x_shape[axis] // n
    local_x = jax.ShapeDtypeStruct(tuple(x_shape), x.dtype)
    local_w = jax.ShapeDtypeStruct(w_shape, w.dtype)
    _make_plan(op, local_x, local_w, axis_name, n, axis, rows, log=False, **op_args)
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
    mesh: jax.sharding.Mesh | None = None,
):
    """All-gather ``x`` over ``axis_name`` along ``axis``, then multiply by ``w``.

    Equals ``all_gather(x, axis_name, axis=axis, tiled=True) @ w`` with the
    gather hidden behind the multiply. Inside ``shard_map`` x and w are local
    (x: ``[.., S/N, .., K]``, w: ``[K, Nw]`` column shard); outside it they are
    global arrays (see ``_spmd``). ``return_gathered=True`` also returns the
    gathered x. Dims before ``axis`` act as a batch; ``axis`` may be any dim
    but the last.
    """
    op = "ag_matmul"
    _check_axis_name(op, axis_name)
    axis = _check_operands(op, x, w, axis)
    if not isinstance(return_gathered, bool):
        raise TypeError(f"{op}: return_gathered={return_gathered!r} must be True or False.")
    n = bound_axis_size(axis_name)
    if n is None:
        return _global(op, x, w, axis_name, axis, mesh, return_gathered,
                       dict(impl=impl, transport=transport, chunks=chunks,
                            bidirectional=bidirectional))
    plan = _make_plan(op, x, w, axis_name, n, axis, x.shape[axis], impl, transport, chunks,
                      bidirectional)
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
    mesh: jax.sharding.Mesh | None = None,
):
    """Multiply ``x`` by ``w``, then reduce-scatter the product over ``axis_name`` along ``axis``.

    Equals ``psum_scatter(x @ w, axis_name, scatter_dimension=axis, tiled=True)``
    with the reduction hidden behind the multiply. Inside ``shard_map`` x is
    ``[.., S, .., Kf]`` with Kf the local slice of the contraction and w is
    ``[Kf, Nw]``; outside it they are global arrays (see ``_spmd``).
    """
    op = "matmul_rs"
    _check_axis_name(op, axis_name)
    axis = _check_operands(op, x, w, axis)
    n = bound_axis_size(axis_name)
    if n is None:
        return _global(op, x, w, axis_name, axis, mesh, False,
                       dict(impl=impl, transport=transport, chunks=chunks,
                            bidirectional=bidirectional))
    if x.shape[axis] % n:
        raise ValueError(
            f"{op}: x.shape[{axis}]={x.shape[axis]} rows are not divisible by the size {n} of "
            f"mesh axis {axis_name!r}; pad the rows to a multiple of {n}."
        )
    plan = _make_plan(op, x, w, axis_name, n, axis, x.shape[axis] // n, impl, transport, chunks,
                      bidirectional)
    return _matmul_rs(x, w, plan, _types(x, w))
