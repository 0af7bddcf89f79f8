"""The native path: a JAX primitive lowered to the XLA FFI custom calls of the executors.

Call ``ag_matmul_shard`` / ``matmul_rs_shard`` / ``matmul_ar_shard`` inside ``jax.shard_map``
on local shards (argument validation is ``ops.py``'s job; this module only asserts its own
invariants). They bind one primitive; its lowering rule is where a native call gets its
identity: it reads the concrete mesh from the lowering context (the mesh ``shard_map`` lowers
for, known there even when the trace saw only the abstract mesh), describes the call once
(``_native_call``: rank table, clique, transport), sets up cliques spanning processes
(``_bootstrap``) and emits the custom call of the platform it lowers for (``jaxoverlap_*``
on CPU, the host executor; ``jaxoverlap_cuda_*`` on GPU, the CUDA executor). docs/native.md
follows one call through.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core
from jax._src.interpreters import mlir
from jax.interpreters import batching

from jaxoverlap import _bootstrap, _call_site, _native_call, _profile, _runtime
from jaxoverlap._compat import varying_axes, with_varying
from jaxoverlap._config import timeout_ms

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
OPS = ("ag_matmul", "matmul_rs", "matmul_ar")  # the `op` attribute is the index
AR_ALGORITHMS = ("two_shot", "one_shot")  # the `algorithm` attribute is the index
_TARGETS = {
    "cpu": {op: f"jaxoverlap_{op}" for op in OPS},
    "cuda": {op: f"jaxoverlap_cuda_{op}" for op in OPS},
}

_lock = threading.Lock()
_registered: set[str] = set()


def transports() -> tuple[str, ...]:
    """Every transport of the native path, in the executors' order (from the extension)."""
    return tuple(_runtime.load_host().TRANSPORTS)


def available() -> bool:
    """True when the host extension loads (it is built with the package)."""
    return _runtime.host_error() is None


def unavailable_reason(platform: str, dtype) -> str | None:
    """Why the native path cannot run on ``platform`` with ``dtype``; None if it can."""
    error = _runtime.host_error()
    if error is not None:
        return f"the native extension does not load ({error})"
    if platform in _native_call.GPU_PLATFORMS:
        from jaxoverlap import _cuda_caps

        cuda_error = _cuda_caps.cuda_error()
        if cuda_error is not None:
            return f"the CUDA extension is unavailable: {cuda_error}"
    elif platform != "cpu":
        return (f"there is no native executor for platform {platform!r} in this build "
                "(the host executor runs on CPU, the CUDA executor on NVIDIA GPUs)")
    if jnp.dtype(dtype) not in tuple(jnp.dtype(d) for d in _DTYPES):
        return f"dtype {jnp.dtype(dtype).name} is not supported"
    return None


def offered_transports(platform: str) -> tuple[str, ...]:
    """Transports that can serve calls among this process's devices of ``platform``.

    What the performance model may choose among; whether a clique spans processes is known
    only when the call lowers (``_native_call.resolve_transport`` decides then).
    """
    if platform in _native_call.GPU_PLATFORMS:
        from jaxoverlap import _cuda_caps

        if _cuda_caps.cuda_error() is not None:
            return ()
        ordinals = [_native_call.local_ordinal(d) for d in jax.local_devices(backend="gpu")]
        reasons = _native_call.transport_reasons("cuda", ordinals, spans_processes=False)
        return tuple(t for t in transports() if reasons[t] is None)
    return transports() if platform == "cpu" and available() else ()


def info() -> dict:
    """What the native path offers on this machine, for ``jo.info()``."""
    error = _runtime.host_error()
    if error is not None:
        return {"available": False, "error": error}
    host = _runtime.load_host()
    from jaxoverlap import _cuda_caps

    return {
        "available": True,
        "backends": {"cpu": {"executor": "host", "transports": list(transports())},
                     "gpu": _cuda_caps.info()},
        "dtypes": ["float32", "bfloat16", "float16"],
        "build": dict(host.build_info()),
        "cliques": host.cliques(),
        # Cliques spanning processes bootstrap through jax.distributed (docs/multiprocess.md).
        "processes": jax.process_count() if _bootstrap.is_multiprocess() else 1,
    }


def _ensure_registered(platform: str) -> None:
    """Registers the platform's FFI targets with XLA (once per process)."""
    with _lock:
        if platform in _registered:
            return
        host = _runtime.load_host()
        host.set_process_index(jax.process_index())
        _profile.start_from_env()  # JAXOVERLAP_PROFILE=DIR: record from the first call on
        if platform == "cpu":
            # The CPU backend must exist before a stateful handler is registered (registering
            # earlier fails with FAILED_PRECONDITION), and the instantiate-stage state type
            # before the targets that use it.
            jax.devices("cpu")
            for name, capsules in host.types().items():
                jax.ffi.register_ffi_type(name, capsules, platform="cpu")
            for name, stages in host.registrations().items():
                jax.ffi.register_ffi_target(name, stages, platform="cpu")
        else:
            from jaxoverlap import _cuda_caps

            cuda = _cuda_caps.load_cuda()
            cuda.set_process_index(jax.process_index())
            for name, capsules in cuda.types().items():
                jax.ffi.register_ffi_type(name, capsules, platform="CUDA")
            # No traits: the handlers are not command-buffer compatible (and the CUDA plugin
            # rejects traits= at registration anyway).
            for name, stages in cuda.registrations().items():
                jax.ffi.register_ffi_target(name, stages, platform="CUDA")
        _registered.add(platform)


# ---------------------------------------------------------------- the primitive

native_p = core.Primitive("jaxoverlap_native")
native_p.multiple_results = True


def _abstract_eval(x, w, coords, *, op, axis_name, axis, axis_size, return_gathered, **_):
    # The results vary over the same manual axes as x (an x_gathered too, although every rank
    # holds the same values: the type system cannot prove it); matmul_ar's sum is the same on
    # every rank of axis_name, as psum's.
    shape = list(x.shape)
    if op == "matmul_ar":
        y = x.update(shape=(*shape[:-1], w.shape[1]), dtype=x.dtype)
        return [with_varying(y, (varying_axes(x) | varying_axes(w)) - {axis_name})]
    if op == "ag_matmul":
        shape[axis] *= axis_size
        outs = [x.update(shape=(*shape[:-1], w.shape[1]), dtype=x.dtype)]
        if return_gathered:
            outs.append(x.update(shape=tuple(shape), dtype=x.dtype))
        return outs
    assert shape[axis] % axis_size == 0, (x.shape, axis, axis_size)
    shape[axis] //= axis_size
    shape[-1] = w.shape[1]
    return [x.update(shape=tuple(shape), dtype=x.dtype)]


native_p.def_abstract_eval(_abstract_eval)


def _batch(args, dims, **params):
    """vmap: one native call per batch element, in order (a collective cannot fuse them)."""
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True)
                if d is not batching.not_mapped)
    front = [jnp.broadcast_to(a, (size, *a.shape)) if d is batching.not_mapped
             else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims, strict=True)]
    outs = lax.map(lambda xw: tuple(native_p.bind(*xw, **params)), tuple(front))
    return list(outs), [0] * len(outs)


batching.primitive_batchers[native_p] = _batch


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


def _lower(ctx, x, w, coords, *, op, axis_name, axis, axis_size, chunks, bidirectional,
           transport, preferred, timeout_s, return_gathered, tf32, algorithm):
    platforms = tuple(ctx.module_context.platforms)
    if len(platforms) != 1:
        raise ValueError(f"jaxoverlap native ops lower for one platform at a time, got "
                         f"{platforms}")
    platform = "cuda" if platforms[0] in _native_call.GPU_PLATFORMS else platforms[0]
    if platform not in _TARGETS:
        raise ValueError(unavailable_reason(platform, jnp.float32))
    call = _native_call.describe(_lowering_mesh(ctx, axis_name, platform), axis_name, platform,
                                 transport, preferred, jax.process_index())
    assert call.axis_size == axis_size, (call.axis_size, axis_size)
    _ensure_registered(platform)
    if call.spans_processes:
        _bootstrap.setup_cliques(call, timeout_s)
    rule = jax.ffi.ffi_lowering(_TARGETS[platform][op], has_side_effect=False)
    operands = [x, w, coords]
    if platform != "cpu":  # the GPU handler finds its rank in the table, never in device memory
        operands, ctx = operands[:2], ctx.replace(avals_in=ctx.avals_in[:2])
    # Attributes carry the exact C++ types of the handler binding.
    attributes = dict(op=np.int32(OPS.index(op)), axis=np.int64(axis),
                      axis_size=np.int64(axis_size),
                      transport=np.int32(transports().index(call.transport)),
                      chunks=np.int64(chunks), bidirectional=bool(bidirectional),
                      tf32=bool(tf32), algorithm=np.int32(AR_ALGORITHMS.index(algorithm)))
    site_key = _call_site.site_key(ctx, clique_key=call.clique_key, platform=platform,
                                   attributes=dict(attributes, axis_name=axis_name,
                                                   return_gathered=bool(return_gathered)))
    return rule(ctx, *operands, **attributes, site_key=np.int64(site_key),
                timeout_ms=np.int64(timeout_ms(timeout_s)), **call.attributes())


# Not cached: every native call of a program lowers on its own and gets its own site key
# (_call_site), even when its operands' types and attributes equal another's.
mlir.register_lowering(native_p, _lower, cacheable=False)


# ---------------------------------------------------------------- entry points


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


def _bind(op, x, w, *, axis_name, axis, transport, chunks, bidirectional, timeout_s,
          return_gathered=False, preferred=None, tf32=False, algorithm="two_shot"):
    assert x.dtype == w.dtype and x.dtype in _DTYPES, (x.dtype, w.dtype)
    _check_manual(axis_name)
    return native_p.bind(
        x, w, _coords(axis_name), op=op, axis_name=axis_name, axis=int(axis),
        axis_size=int(lax.axis_size(axis_name)), chunks=int(chunks),
        bidirectional=bool(bidirectional), transport=transport or "auto", preferred=preferred,
        timeout_s=float(timeout_s), return_gathered=bool(return_gathered),
        tf32=bool(tf32) and x.dtype == jnp.float32, algorithm=algorithm)


def ag_matmul_shard(x, w, *, axis_name, axis=0, transport="auto", chunks=1, bidirectional=False,
                    return_gathered=False, timeout_s=120.0, preferred=None, tf32=False):
    """``all_gather(x, axis_name, axis=axis, tiled=True) @ w`` on local shards.

    Returns y, or (y, x_gathered) when ``return_gathered``. ``transport``: one of
    ``transports()`` or "auto" (``preferred``: the performance model's pick for "auto").
    ``tf32``: float32 GEMMs may use TF32 (on GPU; ``_precision.allows_tf32``).
    """
    out = _bind("ag_matmul", x, w, axis_name=axis_name, axis=axis, transport=transport,
                chunks=chunks, bidirectional=bidirectional, timeout_s=timeout_s,
                return_gathered=return_gathered, preferred=preferred, tf32=tf32)
    return (out[0], out[1]) if return_gathered else out[0]


def matmul_rs_shard(x, w, *, axis_name, axis=0, transport="auto", chunks=1, bidirectional=False,
                    timeout_s=120.0, preferred=None, tf32=False):
    """``psum_scatter(x @ w, axis_name, scatter_dimension=axis, tiled=True)`` on local shards."""
    (y,) = _bind("matmul_rs", x, w, axis_name=axis_name, axis=axis, transport=transport,
                 chunks=chunks, bidirectional=bidirectional, timeout_s=timeout_s,
                 preferred=preferred, tf32=tf32)
    return y


def matmul_ar_shard(x, w, *, axis_name, transport="auto", chunks=1, bidirectional=False,
                    timeout_s=120.0, preferred=None, tf32=False, algorithm="two_shot"):
    """``psum(x @ w, axis_name)`` on local shards; the result is typed invariant over
    ``axis_name`` (as psum's). ``algorithm`` one of ``AR_ALGORITHMS``: two-shot splits the
    rows (every dim of x but the last) into ``lax.axis_size(axis_name)`` blocks, one-shot
    takes any number of rows."""
    assert algorithm in AR_ALGORITHMS, algorithm
    (y,) = _bind("matmul_ar", x, w, axis_name=axis_name, axis=0, transport=transport,
                 chunks=chunks, bidirectional=bidirectional, timeout_s=timeout_s,
                 preferred=preferred, tf32=tf32, algorithm=algorithm)
    return y
