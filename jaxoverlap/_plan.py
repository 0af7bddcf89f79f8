"""The plan of one op call: what the call asked for, the rule that decides the rest, the result.

A call's plan is made on each device's local shards, at trace time, from three things: what the
caller asked for (a :class:`Request`; ``None`` leaves a choice open), the ``jo.config`` /
``JAXOVERLAP_*`` settings in force when the call was traced, and the machine. The rule
(:func:`make`):

* **Shapes that do not split.** ``chunks`` must divide the rows a sub-chunk splits (the rows
  each rank holds, or for ``matmul_ar`` those of a block); ``matmul_ar``'s two-shot splits its
  rows (every dim of x but the last) into N blocks, so rows that do not split run one-shot.
* **The model's pick.** When a hardware preset applies — named with ``jo.config(preset=...)``
  / ``JAXOVERLAP_PRESET`` (a built-in name or a JSON file), or recognised from the GPU's device
  kind — whatever the caller left open (``impl="auto"``, ``chunks=None``,
  ``bidirectional=None``, ``transport="auto"``, ``algorithm=None``) is picked by simulating
  every candidate plan the machine supports (``jaxoverlap.sim``), the unfused ``"xla"`` path
  included: a plan must be predicted faster by more than the preset's margin for its program
  family (derived from the model's measured error, docs/performance.md §5) to be chosen, so the
  model does not make a call slower by choice. The debug log marks projections outside the preset's
  calibrated range.
* **The fused GEMM** (``ag_matmul`` and ``matmul_rs`` over ``p2p`` or ``multicast``: one
  persistent GEMM waiting on per-block flags, docs/gpu-internals.md §5) is one of the model's
  candidates wherever the executor runs it: compute capability 9.0 GPUs and, 16-bit only, 10.0
  (the CUDA executor), and CPU (the host executor, which runs its semantics) once a preset is
  configured.
  ``jo.config(fused=True)`` / ``JAXOVERLAP_FUSED=1`` asks for it for ``ag_matmul`` and ``matmul_rs``
  (among the fused plans only, or, without a model, over the best transport the devices offer),
  ``fused=False`` never takes it; asking for it where it cannot run (``nccl``, float32, a GPU other
  than compute capability 9.0 or 10.0, FP8 on 10.0, rows that are not whole 16-byte units) is
  a clear error.
* **Otherwise, the simple defaults.** Host devices (CPU) have no preset by default: there
  ``impl="auto"`` is ``"xla"`` (host devices share the cores and nothing overlaps), one chunk,
  both ring directions when N > 2, two-shot where the rows split. Asking for ``"native"`` (or a
  transport) where it cannot run is :class:`NativeUnavailableError`, never a silent fallback.

The result, :class:`OpPlan`, is what the implementations run (``_local``) and what the native
primitive is bound with (``_native/primitive.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from jaxoverlap import _kinds
from jaxoverlap._config import Settings, configure_logging, current_config, logger
from jaxoverlap._executors import capabilities, runtime
from jaxoverlap._executors.call import NativeCall, describe
from jaxoverlap._executors.capabilities import NativeUnavailableError
from jaxoverlap._fp8_dtypes import FP8_DTYPES, SCALE_TILE_ROWS, gemm_dtype, is_fp8
from jaxoverlap._fp8_dtypes import out_dtype as fp8_out_dtype
from jaxoverlap._fused_gemm import FUSED_OPS, FUSED_TRANSPORTS, fused_align, fused_dtype_reason
from jaxoverlap._one_launch import (
    KERNEL_ALGORITHMS,
    KERNEL_TRANSPORTS,
    fits,
    splits_rows,
)

# The ops with logic of their own here (the others' is the tables', _kinds).
AG, RS, AR = "ag_matmul", "matmul_rs", "matmul_ar"
OPS = _kinds.names(_kinds.OPS)
AR_ALGORITHMS = _kinds.AR_ALGORITHMS
# Device-kind substrings of the GPUs that have a built-in preset.
_DEVICE_PRESETS = (("H200", "h200"), ("H100", "h100"), ("H800", "h800"), ("GB200", "gb200-nvl72"),
                   ("B200", "b200"), ("A100", "a100"), ("A800", "a800"))
_CHUNK_OPTIONS = (1, 2, 4, 8)


@dataclasses.dataclass(frozen=True)
class Request:
    """What one call asked for, its arguments checked (``None``: left open), and where it was
    traced: the settings and JAX's default matmul precision in force then.

    Hashable: the global-array paths carry it to the devices as a static argument, and may
    trace the per-device code later (when XLA partitions the program), where those settings
    still apply. ``op`` is one of :data:`OPS`, or ``"matmul"`` (Megatron's f around a plain
    matmul, which has no plan); ``axis`` is normalised (0 for ``matmul_ar``, whose rows are
    every dim of x but the last); ``precision`` is ``_precision.normalize``'d (Megatron's f:
    as given, ``lax.dot_general``'s); ``out_dtype``: y's dtype name for fp8 operands (None:
    x's); ``block_scaled``: the fp8 operands carry block scales (MXFP8), which the host
    executor takes and the CUDA executor on compute capability 10.x only
    (:data:`BLOCK_SCALED_REASON`), in whole 128x4 tiles (``_check_block_tiles``).
    """

    op: str
    axis_name: str
    settings: Settings
    axis: int = 0
    impl: str = "auto"
    transport: str | None = None
    chunks: int | None = None
    bidirectional: bool | None = None
    algorithm: str | None = None
    precision: str | None = None
    default_precision: str | None = None
    out_dtype: str | None = None
    block_scaled: bool = False

    @classmethod
    def now(cls, op: str, axis_name: str, **args: Any) -> Request:
        """The request of a call traced now: ``args`` and the settings in force here."""
        return cls(op, axis_name, current_config(),
                   default_precision=jax.config.jax_default_matmul_precision, **args)


@dataclasses.dataclass(frozen=True)
class OpPlan:
    """What one call of an op runs: its implementation and how, decided at trace time.

    Hashable: a static argument of the ops' ``custom_vjp`` and the one parameter of the native
    primitive, whose custom-call attributes are made from it (``_native/attributes.py``). It is
    not the C++ executor's per-device plan of a call site (``cpp/core/call.h``), which the
    handler derives from those attributes and the operands' shapes.

    ``axis`` is the sharded row dim of x, normalised (0 for ``matmul_ar``); ``axis_size`` is
    N, the number of ranks of ``axis_name`` (not the C++ ``Problem.n``, the output columns);
    ``chunks`` sub-chunks split every shard (or block); ``bidirectional`` sends half the
    traffic each way round the ring; ``transport`` is as asked (``"auto"`` is resolved when the
    call lowers, preferring the performance model's ``preferred`` pick); ``precision``:
    ``_precision.normalize``'d, None for JAX's default matmul precision; ``algorithm``:
    ``matmul_ar``'s, one of :data:`AR_ALGORITHMS`; ``out_dtype``: the numpy dtype name of y
    (None: x's dtype; set for fp8 operands, whose y is a dtype with ``_kinds``' ``out``); ``fused``:
    the compute stream runs one persistent GEMM waiting on per-block flags (docs/gpu-internals.md
    §5) when the call's transport is one of :data:`FUSED_TRANSPORTS` (``_executors/call.py``);
    ``replayable``: the performance model picked the call's replayable program (captured by
    XLA's command buffers: docs/gpu.md §6) over its plain one; the lowering asks for it where
    the program builder builds it so (the gate), else the plain program runs; ``call``: the
    native call described where the plan was made, its transport decided there, when the
    concrete mesh was known (global arrays); None: the lowering describes it.
    """

    op: str
    impl: str
    axis_name: str
    axis: int
    axis_size: int
    chunks: int = 1
    bidirectional: bool = False
    transport: str = "auto"
    preferred: str | None = None
    timeout_s: float = 120.0
    precision: str | None = None
    algorithm: str = "two_shot"
    out_dtype: str | None = None
    fused: bool = False
    replayable: bool = False
    call: NativeCall | None = None

    def for_op(self, op: str) -> OpPlan:
        """The same plan for ``op``: the backward pass of AG+GEMM is GEMM+RS under the
        forward call's plan, and vice versa."""
        return dataclasses.replace(self, op=op)

    def describe(self) -> str:
        text = (f"impl={self.impl} axis_name={self.axis_name!r} N={self.axis_size} "
                f"axis={self.axis}")
        if self.impl in ("ring", "native"):
            text += f" chunks={self.chunks} bidirectional={self.bidirectional}"
            if self.algorithm != "two_shot":
                text += f" algorithm={self.algorithm}"
        if self.precision is not None:
            text += f" precision={self.precision}"
        if self.out_dtype is not None:
            text += f" out={self.out_dtype}"
        if self.impl == "native":
            text += f" transport={self.transport}" + (" fused" if self.fused else "")
            text += " replayable" if self.replayable else ""
            if self.preferred is not None:
                text += f" (model prefers {self.preferred})"
        return text


# ---------------------------------------------------------------- the rule


def make(request: Request, x, w, axis_size: int, *, log: bool = True,
         mesh: Any = None) -> OpPlan:
    """The plan of ``request`` on the local shards ``x``, ``w`` (arrays, or anything with a
    shape and a dtype) over the ``axis_size`` ranks of its axis. ``log``: print it at debug
    level (``JAXOVERLAP_LOG=debug``). ``mesh``: the mesh the call runs on, where the caller
    knows it (global arrays); a concrete one has a native call described here, once, its
    transport decided (``OpPlan.call``)."""
    r, settings, n = request, request.settings, axis_size
    configure_logging()
    rows, rows_what, algorithms = _rows(r, x, n)
    chunks, source = r.chunks, "chunks"
    if chunks is None and settings.chunks is not None:
        chunks, source = settings.chunks, "chunks (from jo.config / JAXOVERLAP_CHUNKS)"
    if chunks is not None and rows % chunks:
        raise ValueError(f"{r.op}: {source}={chunks} does not divide the {rows} {rows_what}; "
                         f"pick a divisor of {rows}.")
    bidirectional = r.bidirectional if r.bidirectional is not None else settings.bidirectional
    impl = r.impl if r.impl != "auto" else settings.impl
    explicit_transport = r.transport if r.transport not in (None, "auto") else None
    transport = explicit_transport or (
        settings.transport if settings.transport != "auto" else None)
    fused = settings.fused if r.op in FUSED_OPS and n > 1 else False
    kernel = r.algorithm in KERNEL_ALGORITHMS
    if r.block_scaled:
        _check_block_scaled(r.op, impl, explicit_transport, fused, kernel)
        fused = False  # never a fused plan: the chunked one (BLOCK_SCALED_FUSED_REASON)
    if fused:
        impl = _check_fused(r.op, impl, transport, x, w, r.out_dtype)
    if kernel:
        impl = _check_kernel(r.algorithm, impl, transport)
    forced_native = impl == "native" or (impl == "auto" and explicit_transport is not None)
    if impl == "auto" and not forced_native:
        _warn_gpu_fallback(r.op)
    if is_fp8(gemm_dtype(x, w)) and not forced_native:
        _say_fp8_dequantized(r.op)
    picked = _model_pick(r.op, x, w, n, r.axis, rows, impl, forced_native, transport, chunks,
                         bidirectional, settings.preset, algorithms, fused, r.out_dtype,
                         block_scaled=r.block_scaled)
    if picked is not None:
        impl = picked.impl
        chunks = picked.chunks if chunks is None else chunks
        bidirectional = picked.bidirectional if bidirectional is None else bidirectional
    else:
        impl = _resolve_impl(r.op, impl, explicit_transport, x.dtype, w.dtype)
    fused_plan = picked.fused if picked is not None else bool(fused)
    if fused_plan and fused and transport is None:
        # Asked for: the transport is the plan's, so that the call runs fused or fails to
        # resolve it (a model's pick leaves "auto" to fall back to the chunked path).
        transport = picked.transport if picked is not None else _unmodelled_transport(
            FUSED_TRANSPORTS, f"{r.op}: jo.config(fused=True) asks for the fused GEMM")
    if kernel and transport is None and impl == "native":
        # Asked for: likewise, one the kernel runs with (a model's pick leaves "auto": where it
        # resolves to nccl the call runs the one-shot program of separate ops).
        transport = picked.transport if picked is not None else _unmodelled_transport(
            KERNEL_TRANSPORTS, f"matmul_ar: algorithm={r.algorithm!r} asks for its kernel")
    plan = OpPlan(
        op=r.op,
        impl=impl,
        axis_name=r.axis_name,
        axis=r.axis,
        axis_size=n,
        chunks=1 if chunks is None else chunks,
        bidirectional=(n > 2) if bidirectional is None else bidirectional,
        transport=transport or "auto",
        preferred=picked.transport if picked is not None and picked.impl == "native" else None,
        timeout_s=settings.timeout_s,
        precision=r.precision,
        algorithm=picked.algorithm if picked is not None and picked.impl != "xla"
        else algorithms[0],
        out_dtype=r.out_dtype,
        fused=fused_plan,
        replayable=picked is not None and picked.replayable,
    )
    if plan.impl == "native" and plan.algorithm in KERNEL_ALGORITHMS:
        _check_kernel_fits(plan, x, w)
    if (r.block_scaled and plan.impl == "native"
            and capabilities.current_platform() in capabilities.GPU_PLATFORMS):
        _check_block_tiles(plan, x, w)
    if plan.impl == "native" and isinstance(mesh, jax.sharding.Mesh):
        platform = capabilities.executor_platform(mesh.devices.flat[0].platform)
        plan = dataclasses.replace(plan, call=describe(
            mesh, r.axis_name, platform, plan.transport, plan.preferred, jax.process_index(),
            plan.fused, plan.algorithm))
    if log:
        logger.debug("%s x=%s%s w=%s: %s", r.op, jnp.dtype(x.dtype).name, tuple(x.shape),
                     jnp.dtype(w.dtype).name, plan.describe())
    return plan


def _rows(r: Request, x, n: int) -> tuple[int, str, tuple[str, ...]]:
    """The rows ``chunks`` must divide, what they are (for the error), and the algorithms the
    plan may take (the first without a model).

    ``matmul_ar``'s two-shot splits x's rows (every dim but the last) into N blocks, so rows
    that do not split run one-shot; an explicit ``algorithm`` is kept (two-shot on rows that
    do not split is an error).
    """
    rule = _kinds.op(r.op).rows
    if rule == "gather":
        return x.shape[r.axis], f"rows each rank holds on axis {r.axis}", ("two_shot",)
    if rule == "scatter":
        return x.shape[r.axis] // n, f"rows each rank holds on axis {r.axis}", ("two_shot",)
    asked = r.impl if r.impl != "auto" else r.settings.impl
    if r.algorithm is not None and asked == "xla":
        raise ValueError(f"{r.op}: algorithm={r.algorithm!r} applies to the fused impls "
                         f"('ring', 'native'), but impl='xla'. Drop algorithm= or pick a fused "
                         f"impl.")
    rows = math.prod(x.shape[:-1])
    splits = rows % n == 0
    if r.algorithm in KERNEL_ALGORITHMS and asked == "ring":
        raise ValueError(f"{r.op}: algorithm={r.algorithm!r} is one kernel of the native "
                         f"executor (docs/gpu.md §6), but impl='ring'. Use impl='native' (or "
                         f"'auto'), or algorithm='one_shot'.")
    if r.algorithm == "two_shot" and not splits:
        raise ValueError(
            f"{r.op}: algorithm='two_shot' splits the rows of x (every dim but the last: {rows} "
            f"for shape {tuple(x.shape)}) into one block per rank of {r.axis_name!r} ({n}), "
            f"but {rows} is not divisible by {n}. Use algorithm='one_shot' (or None), or pad "
            f"the rows to a multiple of {n}.")
    if r.algorithm is not None:
        algorithms: tuple[str, ...] = (r.algorithm,)
    else:  # the first is the pick without a model; a model weighs them all
        algorithms = ("two_shot",) * splits + ("one_shot", *KERNEL_ALGORITHMS)
    if not splits_rows(algorithms[0]):
        return rows, "rows of x (every dim but the last; one-shot takes them all)", algorithms
    return rows // n, (f"rows of each rank's block (x's {rows} rows, every dim but the last, "
                       f"over the {n} ranks of {r.axis_name!r})"), algorithms


def fused_reason(op: str, x_dtype, w_dtype, k: int, cols: int,
                 platform: str | None = None, out_dtype=None) -> str | None:
    """Why the fused GEMM cannot run this call here (None if it can): the executors' own
    refusals (``cpp/core/build.cc``; the CUDA executor refuses GPUs other than compute
    capability 9.0 and 10.0, and dtypes 10.0's kernel lacks, when it prepares the call).
    ``out_dtype``: y's (None: x's)."""
    if op not in FUSED_OPS:
        return f"the fused GEMM serves {FUSED_OPS}, not {op}"
    x, w = jnp.dtype(x_dtype).name, jnp.dtype(w_dtype).name
    y = x if out_dtype is None else jnp.dtype(out_dtype).name
    reason = fused_dtype_reason(op, x, w, y)
    if reason is not None:
        return reason
    k_unit, cols_unit = fused_align(x), fused_align(y)
    if k % k_unit or cols % cols_unit:
        units = str(k_unit) if k_unit == cols_unit else f"{k_unit} and {cols_unit}"
        return (f"the fused GEMM loads and stores rows of whole 16-byte units: x's last dim "
                f"({k}) and w's ({cols}) must be multiples of {units}")
    return capabilities.fused_device_reason(platform or capabilities.current_platform(), x)


def _check_fused(op: str, impl: str, transport: str | None, x, w,
                 out_dtype: str | None = None) -> str:
    """The impl of a call that asked for the fused GEMM (``jo.config(fused=True)``), or the
    error saying why it cannot have it."""
    where = "jo.config(fused=True) / JAXOVERLAP_FUSED=1"
    if impl in ("xla", "ring"):
        raise ValueError(f"{op}: {where} asks for the native fused GEMM, but impl={impl!r}. "
                         "Use impl='native' (or 'auto'), or drop fused.")
    if transport is not None and transport not in FUSED_TRANSPORTS:
        raise ValueError(
            f"{op}: {where} with transport={transport!r}: the fused GEMM never runs with nccl "
            "(a persistent kernel holding every SM while an NCCL kernel waits for SMs can "
            "deadlock; docs/gpu-internals.md §5). Use transport in "
            f"{FUSED_TRANSPORTS}, or drop fused.")
    reason = (fused_reason(op, x.dtype, w.dtype, x.shape[-1], w.shape[-1], out_dtype=out_dtype)
              or native_reason(x.dtype, w.dtype))
    if reason is not None:
        raise NativeUnavailableError(f"{op}: {where}, but {reason}. Drop fused (the chunked "
                                     "path runs everywhere).")
    return "native"


# Why a block-scaled (MXFP8) call does not run natively on these GPUs: what impl="native"
# there raises and what impl="auto" logs when it picks among xla and ring. The host executor
# takes block scales (the dequantize-then-multiply reference, exactly); the CUDA executor's
# block-scaled cuBLASLt GEMMs need compute capability 10.x (docs/gpu-internals.md §6).
BLOCK_SCALED_REASON = ("the CUDA executor's block-scaled GEMMs are cuBLASLt's VEC32_UE8M0 mode, "
                       "on compute capability 10.x only (B200, GB200); Hopper and the others "
                       "have no block-scaled cuBLASLt GEMM")
# The model prices no native block-scaled call: with a preset, auto picks among xla and ring.
BLOCK_SCALED_MODEL_REASON = ("the performance model prices no native block-scaled GEMM (ask "
                             "for impl='native' on compute capability 10.x GPUs)")
# Why no fused plan takes block scales: the chunked native plan runs them instead.
BLOCK_SCALED_FUSED_REASON = ("the fused GEMM's kernels are 16-bit and per-tensor FP8 only (no "
                             "block-scaled MMA), so a block-scaled call takes the chunked "
                             "native path")


def block_scaled_reason(platform: str) -> str | None:
    """Why the native executor of ``platform`` cannot take block scales (None: it can): on
    GPUs, unless every GPU of the capability table is compute capability 10.x."""
    if platform not in capabilities.GPU_PLATFORMS:
        return None
    devices = capabilities.gpu_table().get("devices") or []
    others = sorted({"sm_{}{}".format(*d["compute_capability"]) for d in devices
                     if tuple(d["compute_capability"])[0] != 10})
    if devices and not others:
        return None
    return BLOCK_SCALED_REASON + (f" (here: {', '.join(others)})" if others else "")


def _check_block_tiles(plan: OpPlan, x, w) -> None:
    """A native block-scaled call on a GPU: every GEMM of its program (rank 0's; the GEMMs'
    shapes are the same on every rank and transport) must be whole 128x4 tiles of scales —
    its rows (a sub-chunk's), its columns and k multiples of 128 (docs/gpu-internals.md §6) —
    or the CUDA executor refuses it when it prepares; the error says so here first."""
    if runtime.host_error() is not None:
        return  # the executor's own check at prepare stands
    host = runtime.load_host()
    c = host.canonical_problem(plan.op, list(x.shape), list(w.shape), plan.axis,
                               plan.axis_size, plan.algorithm)
    program = host.build_program(
        plan.op, plan.transport if plan.transport != "auto" else "nccl", plan.axis_size, 0,
        c["batch"], c["rows"], c["k"], c["n"], dtype=jnp.dtype(x.dtype).name,
        chunks=plan.chunks, bidirectional=plan.bidirectional, algorithm=plan.algorithm,
        w_dtype=jnp.dtype(w.dtype).name, out_dtype=fp8_out_dtype(x, plan.out_dtype).name,
        block_scaled=True)
    bad = sorted({(g["m"], g["n"], g["k"]) for g in program["ops"] if g["kind"] == "Gemm"
                  and any(v % SCALE_TILE_ROWS for v in (g["m"], g["n"], g["k"]))})
    if bad:
        raise NativeUnavailableError(
            f"{plan.op}: impl='native' with block scales (MXFP8) on a GPU: cuBLASLt's block "
            f"scales are 128x4-tiled (cuBLAS docs, \"1D Block Scaling Factors Layout\"), and "
            f"the CUDA executor moves and reads whole tiles only, so every GEMM's rows (a "
            f"sub-chunk's: rows per shard / chunks={plan.chunks}), output columns and K must be "
            f"multiples of 128; this call's GEMMs are (m, n, k) {bad}. Change the shapes or "
            f"chunks, or use impl='xla' or impl='ring'.")


def _check_block_scaled(op: str, impl: str, transport: str | None, fused, kernel: bool) -> None:
    """A call with block scales (MXFP8) runs on ``xla``, ``ring`` or the native path of the host
    executor or of the CUDA executor on compute capability 10.x (``block_scaled_reason``; its
    tiles: ``_check_block_tiles``): asking for the fused GEMM, or for the native path on other
    GPUs (``impl``, a ``transport``, a kernel algorithm), is an error naming the reason and the
    fix; ``impl="auto"`` leaves what cannot run out, and says so in the debug log."""
    if fused:
        raise NativeUnavailableError(
            f"{op}: jo.config(fused=True) / JAXOVERLAP_FUSED=1 asks for the fused GEMM, but the "
            f"operands carry block scales (float8_e8m0fnu, MXFP8) and "
            f"{BLOCK_SCALED_FUSED_REASON}. Drop fused (the chunked path runs the call).")
    reason = block_scaled_reason(capabilities.current_platform())
    if reason is None:
        return
    asked = ("impl='native'" if impl == "native" else
             f"transport={transport!r}" if transport is not None else
             "a kernel algorithm" if kernel else None)
    if asked is None:
        logger.debug("%s with block scales (MXFP8): impl=%r picks among 'xla' and 'ring': %s.",
                     op, impl, reason)
        return
    raise NativeUnavailableError(
        f"{op}: {asked} asks for the native path, but the operands carry block scales "
        f"(float8_e8m0fnu, MXFP8) and {reason}. Use impl='ring' or impl='xla' "
        "(or 'auto', which picks among them), or float32 per-tensor scales for the native path.")


def _check_kernel(algorithm: str, impl: str, transport: str | None) -> str:
    """The impl of a call that asked for a kernel algorithm, or the error saying why it cannot
    have it."""
    if impl == "xla":  # (impl='ring' is refused with the rows, _rows)
        raise ValueError(f"matmul_ar: algorithm={algorithm!r} is one kernel of the native "
                         f"executor (docs/gpu.md §6), but impl='xla'. Use impl='native' (or "
                         f"'auto'), or drop algorithm=.")
    if transport is not None and transport not in KERNEL_TRANSPORTS:
        raise ValueError(f"matmul_ar: algorithm={algorithm!r} with transport={transport!r}: the "
                         f"kernel writes into its peers' memory, so it runs over "
                         f"{KERNEL_TRANSPORTS}, not nccl. Use one of those, or "
                         f"algorithm='one_shot'.")
    return "native" if impl == "auto" else impl


def _check_kernel_fits(plan: OpPlan, x, w) -> None:
    """A kernel algorithm's y must fit the kernel's fixed area over every transport the call
    may run it with (``_one_launch.fits``); the error says what to use instead."""
    y_bytes = math.prod(x.shape[:-1]) * w.shape[-1] * fp8_out_dtype(x, plan.out_dtype).itemsize
    transports = (plan.transport,) if plan.transport in KERNEL_TRANSPORTS else KERNEL_TRANSPORTS
    for transport in transports:
        if not fits(transport, plan.algorithm, plan.axis_size, y_bytes):
            raise ValueError(
                f"matmul_ar: algorithm={plan.algorithm!r} moves y ({y_bytes} bytes per rank) "
                f"through one fixed area per rank, which {plan.axis_size} ranks' y of this "
                f"size over {transport} does not fit (docs/gpu.md §6). Use algorithm="
                f"'two_shot' or 'one_shot' (or None) for calls this large.")


def _unmodelled_transport(among: tuple[str, ...], what: str) -> str:
    """The transport of a kernel or fused call asked for without a model: the one rule's pick
    among ``among`` (the transports its program runs with) that this process's devices offer;
    ``what`` names the call and the program in the error."""
    platform = capabilities.current_platform()
    try:
        return capabilities.resolve_transport(
            platform, "auto", None, spans_processes=False,
            local_ordinals=capabilities.local_ordinals(platform), among=among)
    except NativeUnavailableError as err:
        raise NativeUnavailableError(
            f"{what}, but neither transport it runs with ({among}) is available here "
            f"({err})") from None


def native_reason(x_dtype, w_dtype=None) -> str | None:
    """Why the native path cannot run GEMMs of x's and w's dtypes in the program being traced
    (None if it can; ``w_dtype`` None: x's)."""
    return capabilities.unavailable_reason(capabilities.current_platform(), x_dtype, w_dtype)


def _resolve_impl(op: str, impl: str, transport: str | None, x_dtype, w_dtype) -> str:
    """The impl without a model: native if asked for (or a transport was), xla for auto."""
    if impl == "native" or (impl == "auto" and transport is not None):
        reason = native_reason(x_dtype, w_dtype)
        if reason is not None:
            raise NativeUnavailableError(
                f"{op}: impl='native' was requested"
                + (f" (transport={transport!r})" if transport is not None else "")
                + f" but cannot run: {reason}. Use impl='ring' or impl='xla'."
            )
        return "native"
    if impl == "auto":
        # Without a model, auto stays with the unfused path, which is never slower by choice
        # (on CPU the host executor is an exact emulation for testing schedules, not a
        # speed-up: host devices share the cores).
        return "xla"
    if transport is not None:
        raise ValueError(
            f"{op}: transport={transport!r} applies to impl='native' only, but impl={impl!r}. "
            "Drop transport= or use impl='native'."
        )
    return impl


_gpu_fallback_warned = False


def _warn_gpu_fallback(op: str) -> None:
    """Once per process: on GPUs without the CUDA extension, impl='auto' cannot fuse; say so.

    The product's point would otherwise be off without a word; the warning names the cause
    and the fix (``runtime.cuda_error``).
    """
    global _gpu_fallback_warned
    platform = capabilities.current_platform()
    if _gpu_fallback_warned or platform not in capabilities.GPU_PLATFORMS:
        return
    error = runtime.cuda_error()
    if error is None:
        return
    _gpu_fallback_warned = True
    warnings.warn(
        f"jaxoverlap: {op} with impl='auto' runs on GPUs without jaxoverlap's CUDA extension, "
        f"so it falls back to the unfused path: {error}", RuntimeWarning, stacklevel=4)


_fp8_dequantized_said = False


def _say_fp8_dequantized(op: str) -> None:
    """Once per process: on GPUs without FP8 tensor cores (before sm_89), XLA computes the
    fp8 GEMMs of the ``xla`` and ``ring`` impls dequantized; say so (the native path refuses
    there, naming the GPUs)."""
    global _fp8_dequantized_said
    if _fp8_dequantized_said or capabilities.current_platform() not in \
            capabilities.GPU_PLATFORMS:
        return
    # The GPUs' own reason (an e4m3 x e4m3 GEMM asks only for sm_89+).
    reason = capabilities.gpu_fp8_reason(capabilities.gpu_table(), FP8_DTYPES[0])
    if reason is None:
        return
    _fp8_dequantized_said = True
    logger.warning("%s with fp8 operands: %s. The fp8 bytes still travel; XLA dequantizes "
                   "them for the GEMMs.", op, reason)


# ---------------------------------------------------------------- the performance model


def machine_preset(configured: str | None, device_kind: str | None) -> str | None:
    """The preset that applies: the configured one, else the GPU's, else None."""
    if configured:
        return configured
    for needle, name in _DEVICE_PRESETS:
        if device_kind and needle in device_kind.upper():
            return name
    return None


def canonical_shape(op: str, x_shape: tuple, w_shape: tuple, axis: int, n: int):
    """The per-rank problem of docs/native.md §1 (a ``sim.Shape``: batch, rows, k, n), as the
    executors make it (``_host.canonical_problem``; its mirror ``_kinds.canonical_problem``
    where the extension does not load). An op with a one-shot algorithm has all its rows in
    one block (the one-shot problem): the model prices either algorithm from it."""
    from jaxoverlap.sim import Shape

    algorithm = "one_shot" if _kinds.op(op).one_shot else "two_shot"
    if runtime.host_error() is None:
        c = runtime.load_host().canonical_problem(op, list(x_shape), list(w_shape), axis, n,
                                                  algorithm)
        return Shape(c["batch"], c["rows"], c["k"], c["n"])
    c = _kinds.canonical_problem(op, x_shape, w_shape, axis, n, algorithm)
    return Shape(c.batch, c.rows, c.k, c.n)


def _model_pick(op, x, w, n, axis, rows_per_shard, impl, forced_native, transport, chunks,
                bidirectional, preset, algorithms, fused, out_dtype=None,
                block_scaled: bool = False):
    """The performance model's candidate for what the caller left open, or None.

    None means no model applies (no preset: host devices by default) or nothing
    is left open; the simple defaults then hold. ``fused``: True, the fused plans only;
    False, none; None, wherever the executor runs them. ``block_scaled``: fp8 operands with
    block scales, whose native GEMMs the model does not price
    (:data:`BLOCK_SCALED_MODEL_REASON`): it picks among xla and ring, priced as they compute
    them.
    """
    mesh = jax.sharding.get_abstract_mesh()
    device_kind = getattr(getattr(mesh, "abstract_device", None), "device_kind", None)
    preset = machine_preset(preset, device_kind)
    open_choice = (impl == "auto" or chunks is None or bidirectional is None
                   or transport is None)
    if preset is None or not open_choice or impl not in ("auto", "native") or n == 1:
        return None                      # xla/ring asked for: nothing for the model to pick
    dtype = gemm_dtype(x, w)
    native_ok = native_reason(x.dtype, w.dtype) is None
    if block_scaled and native_ok:
        # The model prices no native block-scaled call (the host executor's, or the CUDA
        # executor's on compute capability 10.x in whole tiles): xla and ring only.
        logger.debug("%s with block scales (MXFP8): the model (preset %r) picks among 'xla' "
                     "and 'ring': %s.", op, preset, BLOCK_SCALED_MODEL_REASON)
        native_ok = False
    if forced_native and not native_ok:
        return None                      # _resolve_impl raises the clear error
    if forced_native:
        impls: tuple = ("native",)
    else:
        impls = ("xla", "ring", "native") if native_ok else ("xla", "ring")
    transports = ((transport,) if transport else
                  capabilities.offered_transports(capabilities.current_platform())) \
        if native_ok else ()
    # The kernels bounded by the GPU's clock run only from a cubin of the GPU's architecture
    # (capabilities.clocked_kernel_reason): where it lacks one, the model offers neither the
    # one-launch kernels over that transport nor the replayable programs (whose flag wait is
    # one), unless the call asked for a kernel algorithm itself (the executor then refuses it,
    # saying why).
    platform = capabilities.current_platform()
    asked_kernel = len(algorithms) == 1 and algorithms[0] in KERNEL_ALGORITHMS
    refused = {f: why for f in dict.fromkeys(capabilities.CLOCKED_KERNELS.values())
               if (why := capabilities.clocked_kernel_reason(platform, f))}
    no_kernel_over = () if asked_kernel else tuple(
        t for t in transports if capabilities.CLOCKED_KERNELS.get(t) in refused)
    replays = capabilities.FLAG_WAIT_KERNELS not in refused
    for why in refused.values():
        logger.debug("%s: %s; the model picks among the other plans.", op, why)
    if fused:
        fused_mode = "only"
        transports = tuple(t for t in transports if t in FUSED_TRANSPORTS)
    elif fused is None and native_ok and fused_reason(op, x.dtype, w.dtype, x.shape[-1],
                                                      w.shape[-1], out_dtype=out_dtype) is None:
        fused_mode = "allowed"
    else:
        fused_mode = "no"
    try:
        return _model_choice(
            op, canonical_shape(op, tuple(x.shape), tuple(w.shape), axis, n),
            dtype.name, n, preset, impls, tuple(transports),
            tuple(c for c in _CHUNK_OPTIONS if rows_per_shard % c == 0)
            if chunks is None else (chunks,),
            (False, True) if bidirectional is None else (bidirectional,), algorithms,
            fused_mode, block_scaled=block_scaled, no_kernel_over=no_kernel_over,
            replays=replays)
    except (ValueError, OSError) as err:
        raise ValueError(f"{op}: the performance model (preset={preset!r}) failed: {err}") from err


@functools.lru_cache(maxsize=512)
def _model_choice(op: str, shape: Any, dtype: str, n: int, preset: str, impls: tuple,
                  transports: tuple, chunks: tuple, bidirectional: tuple, algorithms: tuple,
                  fused: str = "no", block_scaled: bool = False, no_kernel_over: tuple = (),
                  replays: bool = True):
    """The model's pick among the allowed plans (cached per call-site signature);
    ``algorithms``: matmul_ar's allowed algorithms; ``fused``: "no" (no fused plan), "allowed"
    (the fused plans too, where the preset's GPU runs them: ``sim.fused.why_not``) or "only"
    (asked for: the fused plans only); ``block_scaled``: fp8 operands with block scales, which
    the xla and ring impls dequantize and multiply in float32 (the model prices that);
    ``no_kernel_over``: transports whose one-launch kernels these GPUs would refuse;
    ``replays``: whether they run the replayable programs (their flag wait)."""
    from jaxoverlap import sim

    cands = [
        c for c in sim.candidates(preset, n, shape, chunk_options=_CHUNK_OPTIONS, impls=impls,
                                  transports=transports or None, op=op, algorithms=algorithms,
                                  fused=fused != "no", dtype=dtype)
        if ((c.impl == "xla" and fused != "only")
            or (c.chunks in chunks and c.bidirectional in bidirectional
                and (c.fused or fused != "only")))
        and not (c.algorithm in KERNEL_ALGORITHMS and c.transport in no_kernel_over)
        and (replays or not c.replayable)
    ]
    if fused == "only" and not any(c.fused for c in cands):
        p = sim.load_preset(preset)
        raise ValueError(f"fused=True, but preset {p.name!r} offers no fused plan for this call: "
                         f"{sim.fused.why_not(p, op, transports[0] if transports else None)}")
    # impl="native" (or a transport, or fused) asked for: pick among the native plans only
    choice = sim.choose(op, shape, dtype, n, preset, cands, unfused="xla" in impls
                        and fused != "only", block_scaled=block_scaled)
    logger.debug("%s %s on %s, N=%d (model, not a measurement):\n%s", op, shape, preset, n,
                 choice.format())
    return choice.candidate
