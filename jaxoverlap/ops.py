"""The public ops: argument checks, then one path down to the devices.

``ag_matmul``, ``matmul_rs`` and ``matmul_ar`` check every argument here, at trace time, naming
the argument and the fix, and record what the call asked for (``_plan.Request``). Its
per-device function (``_local.LocalOp``: make the plan, run its impl under the op's autodiff
rule) then runs

* inside ``jax.shard_map`` (where ``axis_name`` is bound), on the local shards, at once;
* on global arrays (outside it), on every device: the ops hand it to the global-array paths
  (``_global``), which check the shapes, make its plan once for the shards the devices get,
  lay the arrays out (``_layout``) and call down into it, in a ``shard_map`` under Explicit
  mesh axes or as a ``custom_partitioning`` primitive under Auto ones (``_partition``).

``copy_matmul`` (Megatron's f around a plain matmul, for the Flax layers) takes the same paths.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxoverlap import _global, _kinds, _layout, _precision
from jaxoverlap._compat import bound_axis_size, match_varying, varying_axes
from jaxoverlap._config import (
    check_algorithm,
    check_bidirectional,
    check_chunks,
    check_impl,
    check_transport,
)
from jaxoverlap._fp8_dtypes import (
    BLOCK,
    DEFAULT_OUT,
    FP8_DTYPES,
    OUT_DTYPES,
    SCALE_DTYPE,
    any_fp8,
    block_scaled,
    is_fp8,
)
from jaxoverlap._local import LocalOp
from jaxoverlap._plan import Request

SUPPORTED_DTYPES = tuple(jnp.dtype(d) for d in _kinds.names(_kinds.DTYPES, fp8=False))

# ---------------------------------------------------------------- the ops


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
    x_scale: Any = None,
    w_scale: Any = None,
    preferred_element_type: Any = None,
):
    """All-gather ``x`` over ``axis_name`` along ``axis``, then multiply by ``w``.

    Equals ``all_gather(x, axis_name, axis=axis, tiled=True) @ w`` with the
    gather hidden behind the multiply. Inside ``shard_map`` x and w are local
    (x: ``[.., S/N, .., K]``, w: ``[K, Nw]`` column shard); outside it they are
    global arrays (see ``_global``). ``return_gathered=True`` also returns the
    gathered x. Dims before ``axis`` act as a batch; ``axis`` may be any dim
    but the last. ``precision`` is ``lax.dot_general``'s (None: JAX's default
    matmul precision); at ``HIGHEST`` no impl uses TF32 for float32.

    FP8: x and/or w may be fp8 (``jaxoverlap.ops.FP8_DTYPES``; README), each with its float32
    dequantization scale (``x_scale=`` / ``w_scale=``, shape ``()`` or ``(1,)``: the real
    value is ``x.astype(float32) * x_scale``). Inside ``shard_map`` each rank passes its own
    shard's scale (ranks may differ): y's rows of shard r are ``(x_r * x_scale_r) @ (w *
    w_scale)``, accumulated in float32 and rounded once to ``preferred_element_type``
    (one of ``ops.OUT_DTYPES``; default bfloat16). The gather moves the fp8 bytes, each
    shard's scale alongside; the gathered x is fp8. Not differentiable (use
    ``jaxoverlap.fp8``).

    MXFP8 (block scales): x and w fp8 and ``x_scale`` / ``w_scale`` ``float8_e8m0fnu`` arrays
    laid out as ``jax.nn.scaled_matmul``'s, one power-of-two scale per 32 consecutive
    elements of K: ``x_scale`` ``[..., rows, K/32]``, ``w_scale`` ``[K/32, Nw]`` (inside
    ``shard_map`` this rank's shards': x's rows, w's columns); K a multiple of 32. The real
    value is ``x.astype(float32) * repeat(x_scale.astype(float32), 32, axis=-1)``. Each
    shard's scales travel with its rows. ``xla`` and ``ring`` only (``native`` raises
    ``NativeUnavailableError``; ``auto`` picks among them), which dequantize per block; not
    differentiable.
    """
    op = "ag_matmul"
    _check_axis_name(op, axis_name)
    _check_mesh(op, mesh)
    axis = _check_operands(op, x, w, axis)
    options = _check_options(impl, transport, chunks, bidirectional)
    precision = _precision.normalize(op, precision)
    if not isinstance(return_gathered, bool):
        raise TypeError(f"{op}: return_gathered={return_gathered!r} must be True or False.")
    scales, out = _check_fp8(op, x, w, x_scale, w_scale, preferred_element_type, precision)
    request = Request.now(op, axis_name, axis=axis, precision=precision, out_dtype=out,
                          block_scaled=block_scaled(scales), **options)
    return _run(request, x, w, mesh, return_gathered, scales)


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
    x_scale: Any = None,
    w_scale: Any = None,
    preferred_element_type: Any = None,
):
    """Multiply ``x`` by ``w``, then reduce-scatter the product over ``axis_name`` along ``axis``.

    Equals ``psum_scatter(x @ w, axis_name, scatter_dimension=axis, tiled=True)``
    with the reduction hidden behind the multiply. Inside ``shard_map`` x is
    ``[.., S, .., Kf]`` with Kf the local slice of the contraction and w is
    ``[Kf, Nw]``; outside it they are global arrays (see ``_global``).
    ``precision`` as in :func:`ag_matmul`.

    FP8 operands as in :func:`ag_matmul`: each rank's partial is ``(x * x_scale) @ (w *
    w_scale)`` with its own scales (no scale travels), accumulated in float32 and reduced in
    float32 or ``preferred_element_type``, never in fp8. MXFP8 block scales as in
    :func:`ag_matmul` (``x_scale`` ``[..., S, Kf/32]``, ``w_scale`` ``[Kf/32, Nw]``: this rank's
    slice of K's blocks; on global arrays K a multiple of 32·N), dequantizing this rank's partial.
    """
    op = "matmul_rs"
    _check_axis_name(op, axis_name)
    _check_mesh(op, mesh)
    axis = _check_operands(op, x, w, axis)
    options = _check_options(impl, transport, chunks, bidirectional)
    precision = _precision.normalize(op, precision)
    scales, out = _check_fp8(op, x, w, x_scale, w_scale, preferred_element_type, precision)
    n = bound_axis_size(axis_name)
    if n is not None and x.shape[axis] % n:  # on global arrays, _layout.check_shapes says it
        raise ValueError(
            f"{op}: x.shape[{axis}]={x.shape[axis]} rows are not divisible by the size {n} of "
            f"mesh axis {axis_name!r}; pad the rows to a multiple of {n}."
        )
    request = Request.now(op, axis_name, axis=axis, precision=precision, out_dtype=out,
                          block_scaled=block_scaled(scales), **options)
    return _run(request, x, w, mesh, scales=scales)


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
    x_scale: Any = None,
    w_scale: Any = None,
    preferred_element_type: Any = None,
):
    """Multiply ``x`` by ``w``, then all-reduce (sum) the product over ``axis_name``.

    Equals ``psum(x @ w, axis_name)`` with the reduction hidden behind the multiply.
    Inside ``shard_map`` x is ``[.., S, .., Kf]`` with Kf the local slice of the
    contraction and w is ``[Kf, Nw]``; y ``[.., S, .., Nw]`` is the same on every rank
    of ``axis_name`` (typed invariant over it, as psum's result). Outside it they are
    global arrays (see ``_global``). The rows of x are every dim but the last.

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
    :func:`ag_matmul`. FP8 operands, and MXFP8 block scales, as in :func:`matmul_rs`.
    """
    op = "matmul_ar"
    _check_axis_name(op, axis_name)
    _check_mesh(op, mesh)
    _check_operands(op, x, w, 0)
    options = _check_options(impl, transport, chunks, bidirectional)
    algorithm = check_algorithm(algorithm)
    precision = _precision.normalize(op, precision)
    scales, out = _check_fp8(op, x, w, x_scale, w_scale, preferred_element_type, precision)
    request = Request.now(op, axis_name, algorithm=algorithm, precision=precision,
                          out_dtype=out, block_scaled=block_scaled(scales), **options)
    return _run(request, x, w, mesh, scales=scales)


def copy_matmul(x: jax.Array, w: jax.Array, axis_name: str, *, precision: Any = None,
                mesh: jax.sharding.Mesh | None = None):
    """Megatron's f around a plain matmul, for the Flax layers: ``x @ w`` with x replicated over
    ``axis_name`` and w split on its columns; backward, x's gradient is all-reduced
    (``_megatron``). ``precision`` as ``lax.dot_general``'s."""
    if isinstance(precision, list):
        precision = tuple(precision)
    return _run(Request.now(_layout.F, axis_name, precision=precision), x, w, mesh)


# ---------------------------------------------------------------- the two paths


def _run(request: Request, x, w, mesh, want_gathered: bool = False, scales: tuple = ()):
    """The call on local shards (``axis_name`` bound) or on global arrays; ``scales``: the
    fp8 operands' ``(x_scale, w_scale)``, float32 scalars (``()`` without fp8)."""
    if x.size == 0 or x.shape[-1] == 0:
        return _empty(request, x, w, want_gathered)
    local = LocalOp(request)
    if (n := bound_axis_size(request.axis_name)) is not None:
        if mesh is not None and dict(mesh.shape).get(request.axis_name) != n:
            raise ValueError(
                f"{request.op}: mesh= has {dict(mesh.shape)}, but inside this shard_map "
                f"axis_name {request.axis_name!r} has {n} devices: inside shard_map the op runs "
                "over the shard_map's mesh. Drop mesh= (it is for global arrays), or pass the "
                "shard_map's mesh.")
        return local(x, w, want_gathered, scales)
    mesh = _layout.resolve_mesh(request.op, request.axis_name, mesh, x, w)
    call = _layout.Call(kind=request.op, axis_name=request.axis_name, ndim=x.ndim,
                        axis=request.axis if request.op in (_layout.AG, _layout.RS) else None,
                        local=local)
    return _global.run(call, mesh, x, w, want_gathered=want_gathered, scales=scales)


def _empty(request: Request, x, w, want_gathered: bool):
    """The call's result where x holds no element or K is 0: zeros (an empty sum) of the
    shapes the call would give, with nothing moved (XLA's collectives refuse a zero-size dim
    and the executors a zero K). Inside shard_map the shapes are this rank's (the op's rows
    rule) and y varies over the axes of x and w, as a call's result does."""
    bound = bound_axis_size(request.axis_name)
    n = bound or 1
    rows = list(x.shape[:-1])
    if request.op == _layout.AG:
        rows[request.axis] *= n
    elif request.op == _layout.RS:
        rows[request.axis] //= n
    dtype = request.out_dtype or x.dtype
    y = jnp.zeros((*rows, w.shape[1]), dtype)
    gathered = jnp.zeros((*rows, x.shape[-1]), x.dtype)
    if bound is not None:
        axes = varying_axes(x) | varying_axes(w)
        if request.op == _layout.AR:  # the same sum on every rank, as psum's
            axes -= {request.axis_name}
        y, gathered = match_varying(y, axes), match_varying(gathered, varying_axes(x))
    return (y, gathered) if want_gathered else y


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
        if jnp.dtype(a.dtype) not in SUPPORTED_DTYPES + FP8_DTYPES:
            raise TypeError(
                f"{op}: {name}.dtype={jnp.dtype(a.dtype).name} is not supported; use "
                f"{_kinds.listing(d.name for d in SUPPORTED_DTYPES)}, or "
                f"{' / '.join(d.name for d in FP8_DTYPES)} with a scale."
            )
    if jnp.dtype(x.dtype) != jnp.dtype(w.dtype) and not any_fp8(x, w):
        raise TypeError(
            f"{op}: x.dtype={jnp.dtype(x.dtype).name} and w.dtype={jnp.dtype(w.dtype).name} "
            "differ; cast one of them (e.g. w.astype(x.dtype))."
        )
    return axis


def _check_fp8(op: str, x, w, x_scale: Any, w_scale: Any, preferred_element_type: Any,
               precision: str | None) -> tuple[tuple, str | None]:
    """The fp8 operands' scales — float32 scalars, or both e8m0 block scales — (``()`` without
    fp8) and y's dtype name (None: x's). Raises naming the argument and the fix."""
    fp8 = any_fp8(x, w)
    out = None
    if preferred_element_type is not None:
        try:
            out = jnp.dtype(preferred_element_type)
        except TypeError:
            out = None
        if out not in OUT_DTYPES:
            raise TypeError(f"{op}: preferred_element_type={preferred_element_type!r} must be "
                            f"{_kinds.listing(d.name for d in OUT_DTYPES)} (or None).")
        if not fp8 and out != jnp.dtype(x.dtype):
            raise TypeError(
                f"{op}: preferred_element_type={out.name} differs from x's dtype "
                f"{jnp.dtype(x.dtype).name}: without fp8 operands y has x's dtype. Drop "
                "preferred_element_type= and cast y.")
    if not fp8:
        for name, scale in (("x_scale", x_scale), ("w_scale", w_scale)):
            if scale is not None:
                raise TypeError(f"{op}: {name} is given but neither x nor w is fp8: scales "
                                "dequantize float8 operands only. Drop it, or multiply the "
                                "operand by it.")
        return (), None
    if precision == "highest":
        raise ValueError(
            f"{op}: precision=HIGHEST asks for float32 products, but an operand is fp8 (x "
            f"{jnp.dtype(x.dtype).name}, w {jnp.dtype(w.dtype).name}): fp8 GEMMs multiply "
            "the fp8 values themselves. Drop precision= (or pass DEFAULT), or dequantize the "
            "operands to float32 first.")
    if any(_is_block(s) for s in (x_scale, w_scale)):
        return _check_block_scales(op, x, w, x_scale, w_scale), (out or DEFAULT_OUT).name
    scales = tuple(_check_scale(op, name, a, scale)
                   for name, a, scale in (("x", x, x_scale), ("w", w, w_scale)))
    return scales, (out or DEFAULT_OUT).name


def _is_block(scale: Any) -> bool:
    return hasattr(scale, "dtype") and jnp.dtype(scale.dtype) == SCALE_DTYPE


def _check_block_scales(op: str, x, w, x_scale: Any, w_scale: Any) -> tuple:
    """Block scales (MXFP8): both operands fp8, both scales e8m0 arrays, one per 32 elements
    of K laid out as the operand (x ``[..., rows, K/32]``, w ``[K/32, N]``)."""
    for name, a, arg in (("x", x, "x_scale"), ("w", w, "w_scale")):
        if not is_fp8(a.dtype):
            raise TypeError(
                f"{op}: block scales (float8_e8m0fnu, MXFP8) dequantize fp8 operands only, but "
                f"{name} is {jnp.dtype(a.dtype).name}. Quantize {name} to "
                f"{' / '.join(d.name for d in FP8_DTYPES)} with its own block scales {arg}=, "
                "or pass float32 per-tensor scales.")
    for arg, scale in (("x_scale", x_scale), ("w_scale", w_scale)):
        dtype = jnp.dtype(scale.dtype) if hasattr(scale, "dtype") else None
        if dtype is not None and dtype not in (SCALE_DTYPE, jnp.dtype(jnp.float32)):
            raise TypeError(
                f"{op}: {arg}.dtype={dtype.name} must be float8_e8m0fnu (block scales, MXFP8, "
                f"as the other scale is), or float32 for per-tensor scales; pass "
                f"{arg}.astype(jnp.float8_e8m0fnu).")
        if not _is_block(scale):
            got = "missing" if scale is None else (
                f"{jnp.dtype(scale.dtype).name}" if hasattr(scale, "dtype")
                else type(scale).__name__)
            raise TypeError(
                f"{op}: one scale is block-scaled (float8_e8m0fnu) but {arg} is {got}: block "
                "and per-tensor scales do not mix. Pass both as float8_e8m0fnu block scales "
                "(MXFP8), or both as float32 per-tensor scales.")
    k = x.shape[-1]
    if k % BLOCK:
        raise ValueError(
            f"{op}: block scales cover {BLOCK} consecutive elements of the contraction dim, but "
            f"x.shape[-1]={k} is not a multiple of {BLOCK}. Pad K (x's last dim, w's first) to "
            f"a multiple of {BLOCK} with zeros, or use per-tensor scales.")
    for arg, a, want, layout in (
            ("x_scale", x, (*x.shape[:-1], k // BLOCK), "[..., rows, K/32]: x's shape, its last "
             "dim divided by 32"),
            ("w_scale", w, (k // BLOCK, w.shape[1]), "[K/32, N]: w's shape, its first dim "
             "divided by 32")):
        scale = x_scale if arg == "x_scale" else w_scale
        if tuple(scale.shape) != want:
            raise ValueError(
                f"{op}: {arg} has shape {tuple(scale.shape)} but block scales of "
                f"{arg[0]} {tuple(a.shape)} must have shape {want} ({layout}; one e8m0 scale "
                f"per {BLOCK} elements of K, as jax.nn.scaled_matmul's; inside shard_map this "
                "rank's shard's).")
    return (x_scale, w_scale)


_FLOAT32_MAX = float(jnp.finfo(jnp.float32).max)  # a Python scale above it would become inf


def _check_scale(op: str, name: str, a, scale: Any):
    """``scale`` of operand ``name`` as a float32 scalar (1.0 if ``a`` is not fp8)."""
    arg = f"{name}_scale"
    if not is_fp8(a.dtype):
        if scale is not None:
            raise TypeError(f"{op}: {arg} is given but {name} is {jnp.dtype(a.dtype).name}, not "
                            f"fp8: scales dequantize float8 operands only. Drop {arg}, or "
                            f"multiply {name} by it.")
        return jnp.ones((), jnp.float32)
    if scale is None:
        raise TypeError(
            f"{op}: {name} is {jnp.dtype(a.dtype).name} but {arg} is missing. Pass {arg}=, its "
            f"float32 dequantization scale (the real value is {name}.astype(float32) * {arg}; "
            f"inside shard_map this rank's shard's), e.g. {arg}=jnp.float32(1.0).")
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        try:
            value = float(scale)
        except OverflowError:  # an int beyond any float's range
            value = math.inf
        if not abs(value) <= _FLOAT32_MAX:  # nan compares false too
            raise ValueError(f"{op}: {arg}={value!r} is not a finite float32 (its largest is "
                             f"{_FLOAT32_MAX:.3e}): the product would be inf or nan. Pass the "
                             "scale that dequantizes the fp8 values.")
        return jnp.asarray(scale, jnp.float32)
    if not hasattr(scale, "shape") or not hasattr(scale, "dtype"):
        raise TypeError(f"{op}: {arg} must be a float32 scalar array (or a Python float), got "
                        f"{type(scale).__name__}.")
    if jnp.dtype(scale.dtype) != jnp.dtype(jnp.float32):
        raise TypeError(f"{op}: {arg}.dtype={jnp.dtype(scale.dtype).name} must be float32 (a "
                        f"per-tensor scale; pass {arg}.astype(jnp.float32)) or float8_e8m0fnu "
                        "(block scales, MXFP8).")
    if tuple(scale.shape) not in ((), (1,)):
        raise ValueError(
            f"{op}: {arg} has shape {tuple(scale.shape)} but must be a scalar, shape () or "
            f"(1,): one scale per tensor (inside shard_map, one per rank's shard). Block scales "
            f"(one per 32 elements of K, MXFP8) are float8_e8m0fnu.")
    return jnp.reshape(scale, ())


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


def _check_options(impl: Any, transport: Any, chunks: Any, bidirectional: Any) -> dict:
    """The options every op takes, checked; as the ``Request`` fields they are."""
    return dict(impl=check_impl(impl), transport=check_transport(transport),
                chunks=check_chunks(chunks), bidirectional=check_bidirectional(bidirectional))
