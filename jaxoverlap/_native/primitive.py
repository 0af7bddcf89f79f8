"""The native impl: one JAX primitive, lowered to the XLA FFI custom calls of the executors.

``ag_matmul`` / ``matmul_rs`` / ``matmul_ar`` run on local shards inside ``jax.shard_map``
(argument checks are the public ops' job; this module only asserts its own invariants). They
bind one primitive with the call's plan (``_plan.OpPlan``) as its parameter; its lowering rule
is where a native call gets its identity: it reads the concrete mesh from the lowering context
(the mesh ``shard_map`` lowers for, known there even when the trace saw only the abstract
mesh), describes the call once (``_executors.call``: rank table, clique, the transport decided)
unless the plan was made knowing this very mesh and carries that description (global arrays),
registers the platform's handlers (``runtime``), sets up cliques spanning processes
(``bootstrap``) and emits the custom call of the platform it lowers for (``jaxoverlap_*`` on
CPU, the host executor; ``jaxoverlap_cuda_*`` on GPU, the CUDA executor) with the attributes of
``attributes``, among them its site key: what the call is, the same in every process
(``site_key``). docs/native.md follows one call through.

FP8: x and w may be float8 (``capabilities.FP8_DTYPES``), each with its float32 dequantization
scale (``x_scale``, ``w_scale``: this rank's own; the real value is ``x.astype(float32) *
x_scale``). The scales are always operands of the custom call (1.0 for an operand that is not
fp8), so the call has one shape; y's dtype is ``plan.out_dtype`` (None: x's). Block scales
(MXFP8) are e8m0 arrays instead, x's ``[..., rows, K/32]`` and w's ``[K/32, N]``; the host
executor takes them as they are; on GPUs (compute capability 10.x) they are handed over in
cuBLAS's 128x4-tiled layout over the program's rows (``tiled_block_scales``, chosen where the
program lowers; the CUDA lowering refuses scales that are not whole tiles). On GPUs
an fp8 w is asked of XLA in K-major layout (cuBLASLt's FP8 GEMMs take both operands K-major,
docs/gpu-internals.md §6).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core
from jax._src.interpreters import mlir

from jaxoverlap import _kinds, _precision
from jaxoverlap._compat import varying_axes, with_varying
from jaxoverlap._config import logger
from jaxoverlap._executors import bootstrap, capabilities, replay, runtime
from jaxoverlap._executors.call import describe, ranks
from jaxoverlap._fp8_dtypes import SCALE_TILE_ROWS
from jaxoverlap._native.attributes import attributes, naming
from jaxoverlap._native.site_key import lower_keyed
from jaxoverlap._plan import AG, AR, RS, OpPlan
from jaxoverlap._transforms import differentiable_once, map_over_batch

_TARGETS = {
    "cpu": {op.name: f"jaxoverlap_{op.name}" for op in _kinds.OPS},
    "cuda": {op.name: f"jaxoverlap_cuda_{op.name}" for op in _kinds.OPS},
}
# The command-buffer compatible target (cpp/cuda/ffi_handlers.cc), for calls that replay; CPU
# has no command buffers.
_REPLAYABLE = {"cuda": "jaxoverlap_cuda_replayable"}

# ---------------------------------------------------------------- the primitive

native_p = core.Primitive("jaxoverlap_native")
native_p.multiple_results = True


def _out_dtype(plan: OpPlan, x):
    """y's dtype: the plan's ``out_dtype`` (``preferred_element_type``), else x's."""
    return jnp.dtype(plan.out_dtype) if plan.out_dtype is not None else x.dtype


def _abstract_eval(x, w, x_scale, w_scale, coords, *, plan: OpPlan, return_gathered: bool):
    # The results vary over the same manual axes as x (an x_gathered too, although every rank
    # holds the same values: the type system cannot prove it); matmul_ar's sum is the same on
    # every rank of axis_name, as psum's.
    del x_scale, w_scale, coords
    # The results' shapes by the op's rows rule (_kinds; the handlers' CanonicalProblem).
    shapes = _kinds.canonical_problem(plan.op, x.shape, w.shape, plan.axis, plan.axis_size,
                                      plan.algorithm)
    y = x.update(shape=shapes.y, dtype=_out_dtype(plan, x))
    if _kinds.op(plan.op).collective == "all_reduce":
        return [with_varying(y, (varying_axes(x) | varying_axes(w)) - {plan.axis_name})]
    outs = [y]
    if return_gathered:
        outs.append(x.update(shape=shapes.x_gathered, dtype=x.dtype))
    return outs


native_p.def_abstract_eval(_abstract_eval)


map_over_batch(native_p)
differentiable_once(native_p, lambda plan, **_: (
    f"{plan.op} with impl='native'",
    "impl='xla' or impl='ring'" if plan.op != "matmul_ar" else "impl='xla'"))


def _lowering_mesh(ctx, axis_name: str, platform: str):
    """The mesh this call lowers for, from the shard_map's lowering context: the one place the
    native path learns which device is which rank. It is concrete whenever the shard_map got a
    concrete mesh (or jax.set_mesh is active); an abstract one will do only for a CPU call in
    one process (its handler then places itself by its coords operand)."""
    mesh = ctx.module_context.axis_context.mesh
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    if platform != "cpu" or jax.process_count() > 1:
        raise ValueError(
            f"jaxoverlap native ops {'on GPU' if platform != 'cpu' else 'across processes'} need "
            f"the concrete mesh where the program lowers, to know which device (and process) is "
            f"which rank of {axis_name!r}: give jax.shard_map a concrete jax.sharding.Mesh, pass "
            f"the ops mesh=..., or lower inside `with jax.set_mesh(mesh):`")
    return mesh


_lowered = 0  # native calls this process has lowered (lowered())


def lowered() -> int:
    """How many native calls this process has lowered: a global-array call's per-device
    function that lowered one lowers again at every instance (``_partitioner``)."""
    return _lowered


def _lower(ctx, x, w, x_scale, w_scale, coords, *, plan: OpPlan, return_gathered: bool):
    del return_gathered  # the results say it
    global _lowered
    _lowered += 1
    platforms = tuple(ctx.module_context.platforms)
    if len(platforms) != 1:
        raise ValueError(f"jaxoverlap native ops lower for one platform at a time, got "
                         f"{platforms}")
    platform = capabilities.executor_platform(platforms[0])
    if platform not in _TARGETS:
        raise ValueError(capabilities.unavailable_reason(platform, jnp.float32))
    x_aval, w_aval = ctx.avals_in[:2]
    if platform == "cuda":  # the GEMMs cuBLASLt has, on the GPUs it has them (FP8: sm_89+)
        reason = capabilities.gpu_fp8_reason(capabilities.gpu_table(), x_aval.dtype,
                                             w_aval.dtype)
        if reason is not None:
            raise capabilities.NativeUnavailableError(f"jaxoverlap {plan.op}: {reason}")
        if jnp.dtype(ctx.avals_in[2].dtype) == jnp.dtype(jnp.float8_e8m0fnu):
            # The scales must have gone over tiled (tiled_block_scales): never hand the
            # executor row-major bytes it would read as tiles.
            bad = block_scales_untileable(plan, x_aval.shape, w_aval.shape)
            if bad is not None:
                raise capabilities.NativeUnavailableError(
                    f"jaxoverlap {plan.op}: block scales (MXFP8) on a GPU go over in cuBLAS's "
                    f"128x4 tiles, so each GEMM's rows, K and w's columns must be multiples of "
                    f"128; x {tuple(x_aval.shape)}, w {tuple(w_aval.shape)} give {bad}. "
                    f"Change the shapes, or use impl='xla' or impl='ring'.")
    mesh = _lowering_mesh(ctx, plan.axis_name, platform)
    call = plan.call
    if call is None or (call.platform, call.ranks) != (platform, ranks(mesh, plan.axis_name)):
        # Described once, here, unless the plan was made knowing this very mesh.
        call = describe(mesh, plan.axis_name, platform, plan.transport, plan.preferred,
                        jax.process_index(), plan.fused, plan.algorithm)
    assert call.axis_size == plan.axis_size, (call.axis_size, plan.axis_size)
    runtime.register(platform)
    if call.spans_processes:
        bootstrap.setup_cliques(call, plan.timeout_s)
    operands = [x, w, x_scale, w_scale, coords]
    layouts = None
    if platform != "cpu":  # the GPU handler finds its rank in the table, never in device memory
        operands, ctx = operands[:4], ctx.replace(avals_in=ctx.avals_in[:4])
        if capabilities.is_fp8(w_aval.dtype):
            # K-major w ([n, k] in memory: minor-to-major (0, 1)), as cuBLASLt's FP8 GEMMs take
            # it: XLA makes the transposed copy before the call (fused into w's producer where
            # it can), docs/gpu-internals.md §6.
            layouts = [None, (0, 1), None, None]
    if platform == "cuda":
        # Built replayable where the plan asks for it (the model's pick: OpPlan.replayable) and
        # the program builder builds it so (the gate; docs/gpu-internals.md §8).
        builds = plan.replayable and _builds_replayable(ctx, plan, call)
        if plan.replayable and not builds:
            logger.debug("%s: the plan picked the replayable program, but the program builder "
                         "does not build this call's (transport %s) so: the plain program runs",
                         plan.op, call.transport)
        call = dataclasses.replace(call, replayable=builds)
    # A call that replays (docs/gpu.md §6: a kernel algorithm's, docs/gpu-internals.md §7, or a
    # program built replayable) goes to the command-buffer compatible target.
    target = _REPLAYABLE.get(platform) if call.replays else None
    rule = jax.ffi.ffi_lowering(target or _TARGETS[platform][plan.op], has_side_effect=False,
                                operand_layouts=layouts)

    def note(key: int) -> None:  # its next instance in XLA belongs to a new program (CallSite)
        runtime.note_lowering(platform, key)

    def emit(key: int) -> Sequence[Any]:
        return rule(ctx, *operands, **attributes(plan, call, x_aval, key))

    # w (operand 1) names the call; x (operand 0) tells alike calls apart; coords (operand 4,
    # host calls only) can be made to wait for another call.
    return lower_keyed(ctx, naming(plan, call, x_aval), operands, (1,), (0,),
                       4 if len(operands) > 4 else None, emit, note)


def _builds_replayable(ctx, plan: OpPlan, call) -> bool:
    """Whether the program builder builds this GPU call's program replayable
    (``replay.builds_replayable``), on its canonical problem as the handler makes it from its
    operands (``_kinds.canonical_problem``)."""
    x, w, x_scale = ctx.avals_in[:3]
    shapes = _kinds.canonical_problem(plan.op, x.shape, w.shape, plan.axis, plan.axis_size,
                                      call.algorithm)
    return replay.builds_replayable(
        plan.op, call.transport, plan.axis_size, shapes.batch, shapes.rows, shapes.k, shapes.n,
        jnp.dtype(x.dtype).name, w_dtype=jnp.dtype(w.dtype).name,
        out_dtype=jnp.dtype(ctx.avals_out[0].dtype).name, chunks=int(plan.chunks),
        bidirectional=bool(plan.bidirectional), return_gathered=len(ctx.avals_out) > 1,
        algorithm=call.algorithm, fused=call.fused,
        block_scaled=jnp.dtype(x_scale.dtype) == jnp.dtype(jnp.float8_e8m0fnu))


# Not cached: every native call of a program lowers on its own and gets its own site key
# (site_key.py), even when its operands' types and attributes equal another's.
mlir.register_lowering(native_p, _lower, cacheable=False)


# ---------------------------------------------------------------- binding


def _check_manual(axis_name: str) -> None:
    """Every mesh axis of size > 1 must be manual: else devices that differ only in an
    automatic axis would share one (rank, group) of the clique."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(mesh.manual_axes)
    assert axis_name in manual, f"{axis_name!r} is not a manual axis of {mesh.axis_names}"
    auto = [a for a, s in zip(mesh.axis_names, mesh.axis_sizes, strict=True)
            if a not in manual and s > 1]
    if auto:
        raise ValueError(
            f"jaxoverlap native ops need every mesh axis of size > 1 to be manual in the "
            f"enclosing shard_map; mesh axes {auto} are not (pass axis_names covering all "
            f"axes, or omit axis_names)")


def _coords(axis_name: str):
    """(rank, group) of this device from lax.axis_index: where a CPU call sits when its mesh
    is abstract where it lowers (group: the linear index over the other mesh axes)."""
    mesh = jax.sharding.get_abstract_mesh()
    group = jnp.int32(0)
    for name, size in zip(mesh.axis_names, mesh.axis_sizes, strict=True):
        if name != axis_name and name in set(mesh.manual_axes):  # the others have size 1
            group = group * size + lax.axis_index(name)
    return jnp.stack([lax.axis_index(axis_name).astype(jnp.int32), group.astype(jnp.int32)])


def _scale(name: str, scale):
    """The operand of a dequantization scale: a float32 scalar (1.0 when None), or e8m0 block
    scales as they are (MXFP8, laid out as their operand with K divided by 32).

    The executors apply a scale to an fp8 operand only (an all-gather moves it only with fp8
    shards): the ops pass 1.0 for an operand that is not fp8 (``_fp8_dtypes``), and so must
    any other caller.
    """
    if scale is None:
        return jnp.ones((), jnp.float32)
    scale = jnp.asarray(scale)
    if jnp.dtype(scale.dtype) == jnp.dtype(jnp.float8_e8m0fnu):
        return scale
    assert jnp.dtype(scale.dtype) == jnp.float32 and scale.size == 1, (name, scale)
    return jnp.reshape(scale, ())


def _bind(x, w, plan: OpPlan, return_gathered: bool = False, x_scale=None, w_scale=None):
    assert plan.impl == "native", plan
    assert x.dtype in capabilities.DTYPES and w.dtype in capabilities.DTYPES, (x.dtype, w.dtype)
    assert (x.dtype == w.dtype or capabilities.is_fp8(x.dtype)
            or capabilities.is_fp8(w.dtype)), (x.dtype, w.dtype)
    assert plan.axis_size == lax.axis_size(plan.axis_name), (plan, lax.axis_size(plan.axis_name))
    _check_manual(plan.axis_name)
    # The precision the GEMMs use, resolved now: None defers to JAX's default matmul precision,
    # which is the one in force here, not where the program lowers.
    plan = dataclasses.replace(plan, precision=_precision.effective(plan.precision))
    x_scale, w_scale = _scale("x_scale", x_scale), _scale("w_scale", w_scale)
    if jnp.dtype(x_scale.dtype) == jnp.dtype(jnp.float8_e8m0fnu):
        # Block scales: the CUDA executor's GEMMs read them in cuBLAS's tiled layout, the host
        # executor's as they are; which one runs is known where the program lowers.
        x_scale, w_scale = lax.platform_dependent(
            x_scale, w_scale, cuda=tiled_block_scales, default=lambda xs, ws: (xs, ws))
    return native_p.bind(x, w, x_scale, w_scale, _coords(plan.axis_name), plan=plan,
                         return_gathered=bool(return_gathered))


def block_scales_untileable(plan: OpPlan, x_shape: Sequence[int], w_shape: Sequence[int]):
    """Why the block scales of a call cannot go over in whole 128x4 tiles (None: they can):
    its GEMM units' rows (before sub-chunks: the canonical problem's, ``_kinds``), K and w's
    columns must be multiples of ``SCALE_TILE_ROWS``."""
    rows = _kinds.canonical_problem(plan.op, x_shape, w_shape, plan.axis, plan.axis_size,
                                    plan.algorithm).rows
    dims = {"rows per GEMM (as the program splits x)": rows, "K": x_shape[-1],
            "w's columns": w_shape[-1]}
    bad = [f"{name} {v}" for name, v in dims.items() if v % SCALE_TILE_ROWS]
    return ", ".join(bad) if bad else None


def _tiled(scales):
    """``[rows, blocks]`` e8m0 scales in cuBLAS's 128x4-tiled layout (docs/gpu-internals.md
    §6): tiles of 128 rows by 4 blocks in row-of-tiles order, rows r, r + 32, r + 64 and r + 96
    of a tile side by side in 16 bytes. A group of 128 whole rows keeps its bytes' place, so
    the programs move the tiles as rows."""
    rows, blocks = scales.shape
    t = SCALE_TILE_ROWS
    tiles = jnp.swapaxes(scales.reshape(rows // t, t, blocks // 4, 4), -3, -2)
    tiles = tiles.reshape(rows // t, blocks // 4, 4, t // 4, 4)
    return jnp.swapaxes(tiles, -3, -2).reshape(scales.shape)


def tiled_block_scales(x_scale, w_scale):
    """The block scales as the CUDA executor takes them: x's ``[..., K/32]`` tiled over all its
    rows flattened (every dim but the last: the program's rows, batches back to back; when a
    GEMM unit's rows are whole tiles, as ``block_scales_untileable`` demands, these are the
    bytes of tiling each unit); w's ``[K/32, N]`` as the tiled ``[N, K/32]`` of the K-major w
    (cuBLASLt's A), in an array of w_scale's shape. Not whole tiles: as they are, for the
    CUDA lowering refuses such calls (``_lower``)."""
    blocks = x_scale.shape[-1]
    flat = x_scale.reshape(-1, blocks)
    if flat.shape[0] % SCALE_TILE_ROWS or blocks % 4 or w_scale.shape[1] % SCALE_TILE_ROWS:
        return x_scale, w_scale
    return _tiled(flat).reshape(x_scale.shape), _tiled(w_scale.T).reshape(w_scale.shape)


def ag_matmul(x, w, plan: OpPlan, return_gathered: bool = False, *, x_scale=None,
              w_scale=None):
    """``all_gather(x, axis_name, axis=axis, tiled=True) @ w`` on local shards: y, or
    (y, x_gathered) when ``return_gathered``. fp8 x: each rank's shard is dequantized with its
    own ``x_scale`` (this rank's, moved with its shard); x_gathered is the fp8 gathered x."""
    assert plan.op == AG, plan
    out = _bind(x, w, plan, return_gathered, x_scale, w_scale)
    return (out[0], out[1]) if return_gathered else out[0]


def matmul_rs(x, w, plan: OpPlan, *, x_scale=None, w_scale=None):
    """``psum_scatter(x @ w, axis_name, scatter_dimension=axis, tiled=True)`` on local
    shards; each rank's partial with its own scales, summed in y's dtype."""
    assert plan.op == RS, plan
    (y,) = _bind(x, w, plan, x_scale=x_scale, w_scale=w_scale)
    return y


def matmul_ar(x, w, plan: OpPlan, *, x_scale=None, w_scale=None):
    """``psum(x @ w, axis_name)`` on local shards; the result is typed invariant over
    ``axis_name`` (as psum's). Two-shot splits the rows (every dim of x but the last) into
    ``axis_size`` blocks, one-shot takes any number of rows."""
    assert plan.op == AR and plan.axis == 0, plan
    (y,) = _bind(x, w, plan, x_scale=x_scale, w_scale=w_scale)
    return y
