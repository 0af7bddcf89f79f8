"""The native path: XLA FFI custom calls run by the host executor (CPU) or the CUDA executor (GPU).

Call ``ag_matmul_shard`` / ``matmul_rs_shard`` inside ``jax.shard_map`` on
local shards. They lower to the custom calls ``jaxoverlap_ag_matmul`` and
``jaxoverlap_matmul_rs`` (see ``docs/native.md`` for the handler interface);
argument validation is the caller's job (``ops.py``), this module only
asserts its own invariants. On GPU the calls lower to ``jaxoverlap_cuda_ag_matmul``
/ ``jaxoverlap_cuda_matmul_rs`` (``jaxoverlap._cuda``, docs/gpu.md): those take no
``coords`` operand (a device scalar would force a sync); the handler finds its
rank in the rank table attributes from its device ordinal, so the concrete mesh
must be known at trace time (``jax.set_mesh`` or the ops' ``mesh=``).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import threading
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxoverlap import _bootstrap, _runtime

# Order must match jo::Transport in cpp/core/program.h.
_TRANSPORTS = ("nccl", "p2p", "multicast")
_TARGETS = ("jaxoverlap_ag_matmul", "jaxoverlap_matmul_rs")
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

_CUDA_TARGETS = {"jaxoverlap_ag_matmul": "jaxoverlap_cuda_ag_matmul",
                 "jaxoverlap_matmul_rs": "jaxoverlap_cuda_matmul_rs"}
_GPU_PLATFORMS = ("gpu", "cuda")

_lock = threading.Lock()
_registered = False
# The concrete mesh of the global-array entry (``_spmd``): jax.shard_map(mesh=...) does not make
# it visible inside the body, and multi-process runs need it for the rank table.
_entry_mesh: contextvars.ContextVar[jax.sharding.Mesh | None] = contextvars.ContextVar(
    "jaxoverlap_entry_mesh", default=None)


@contextlib.contextmanager
def entry_mesh(mesh) -> Iterator[None]:
    """Makes ``mesh`` the concrete mesh of the native calls traced inside the block."""
    token = _entry_mesh.set(mesh if isinstance(mesh, jax.sharding.Mesh) else None)
    try:
        yield
    finally:
        _entry_mesh.reset(token)

_cuda_registered = False


def available() -> bool:
    """True when the host extension loads (it is built with the package)."""
    return _runtime.host_error() is None


def transports(platform: str = "cpu") -> tuple[str, ...]:
    """Transports the native path offers on ``platform`` (the host executor emulates all).

    On GPU: those every GPU of the concrete mesh (else every local GPU) supports,
    from the real capability queries (``_cuda_caps``).
    """
    if platform in _GPU_PLATFORMS:
        from jaxoverlap import _cuda_caps

        if _cuda_caps.cuda_error() is not None:
            return ()
        reasons = _cuda_caps.transport_reasons(_cuda_caps.capabilities(), _local_gpu_ordinals())
        return tuple(t for t in _TRANSPORTS if reasons.get(t) is None)
    return _TRANSPORTS if platform == "cpu" and available() else ()


def _local_gpu_ordinals() -> list[int]:
    """Local ordinals of this process's GPUs in the concrete mesh (all local GPUs if unknown)."""
    concrete = _concrete_mesh()
    devices = (list(concrete.devices.flat) if concrete is not None
               else jax.local_devices(backend="gpu"))
    me = jax.process_index()
    return sorted({_local_ordinal(d) for d in devices if d.process_index == me})


def _local_ordinal(device) -> int:
    ordinal = getattr(device, "local_hardware_id", None)
    return int(device.id if ordinal is None else ordinal)


def unavailable_reason(platform: str, dtype) -> str | None:
    """Why the native path cannot run on ``platform`` with ``dtype``; None if it can."""
    error = _runtime.host_error()
    if error is not None:
        return f"the native extension does not load ({error})"
    if platform in _GPU_PLATFORMS:
        from jaxoverlap import _cuda_caps

        cuda_error = _cuda_caps.cuda_error()
        if cuda_error is not None:
            return f"the CUDA extension is unavailable: {cuda_error}"
        if jnp.dtype(dtype) not in tuple(jnp.dtype(d) for d in _DTYPES):
            return f"dtype {jnp.dtype(dtype).name} is not supported"
        return None
    if platform != "cpu":
        return (f"there is no native executor for platform {platform!r} in this build "
                "(only the CPU host executor)")
    if jnp.dtype(dtype) not in tuple(jnp.dtype(d) for d in _DTYPES):
        return f"dtype {jnp.dtype(dtype).name} is not supported"
    return None


def info() -> dict:
    """What the native path offers on this machine, for ``jo.info()``."""
    error = _runtime.host_error()
    if error is not None:
        return {"available": False, "error": error}
    host = _runtime.load_host()
    from jaxoverlap import _cuda_caps

    return {
        "available": True,
        "backends": {"cpu": {"executor": "host", "transports": list(_TRANSPORTS)},
                     "gpu": _cuda_caps.info()},
        "dtypes": ["float32", "bfloat16", "float16"],
        "build": dict(host.build_info()),
        "cliques": host.cliques(),
        # Cliques spanning processes bootstrap through jax.distributed (docs/multiprocess.md).
        "processes": jax.process_count() if _bootstrap.is_multiprocess() else 1,
    }


def _ensure_registered() -> None:
    global _registered
    with _lock:
        if _registered:
            return
        host = _runtime.load_host()
        # The CPU backend must exist before handlers are registered
        # (BUILD-NOTES: registering early fails with FAILED_PRECONDITION).
        # The instantiate-stage state type goes first: XLA checks that the
        # types a handler uses are registered before the handler.
        jax.devices()
        for name, capsules in host.types().items():
            jax.ffi.register_ffi_type(name, capsules, platform="cpu")
        for name, stages in host.registrations().items():
            jax.ffi.register_ffi_target(name, stages, platform="cpu")
        _registered = True


def _ensure_cuda_registered() -> None:
    global _cuda_registered
    with _lock:
        if _cuda_registered:
            return
        from jaxoverlap import _cuda_caps

        cuda = _cuda_caps.load_cuda()
        cuda.set_process_index(jax.process_index())
        # No traits: the handlers are not command-buffer compatible (and the
        # CUDA plugin rejects traits= at registration anyway).
        for name, capsule in cuda.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
        _cuda_registered = True


def _concrete_mesh(mesh=None):
    """The concrete mesh of this call: the plan's, else ``current_mesh()``; None if unknown."""
    return mesh if mesh is not None else current_mesh()


def _call_platform(mesh=None) -> str:
    concrete = _concrete_mesh(mesh)
    if concrete is not None:
        return concrete.devices.flat[0].platform
    return jax.default_backend()


def _gpu_rank_table(axis_name: str, names: tuple, sizes: tuple, manual: tuple, mesh=None):
    """(processes, local ordinals) of the mesh's devices in (group, rank) order."""
    concrete = _concrete_mesh(mesh)
    if concrete is None or tuple(concrete.axis_names) != names or \
            tuple(concrete.axis_sizes) != sizes:
        raise ValueError(
            "jaxoverlap impl='native' on GPU needs the concrete mesh at trace time: call the "
            "op with mesh=... (global arrays) or inside `with jax.set_mesh(mesh):` around the "
            "shard_map; the CUDA handler finds its rank from the mesh's device table")
    devices = np.moveaxis(np.asarray(concrete.devices), names.index(axis_name), -1).reshape(-1)
    processes = np.array([d.process_index for d in devices], np.int64)
    ordinals = np.array([_local_ordinal(d) for d in devices], np.int64)
    return processes, ordinals


def _cuda_call(target, x, w, results, *, axis_name, axis, transport, chunks, bidirectional,
               timeout_s, mesh=None):
    from jaxoverlap import _cuda_caps

    _ensure_cuda_registered()
    names, sizes, manual = _mesh_facts(axis_name)
    processes, ordinals = _gpu_rank_table(axis_name, names, sizes, manual, mesh)
    mine = sorted({int(o) for p, o in zip(processes, ordinals, strict=True)
                   if p == jax.process_index()})
    axis_size = sizes[names.index(axis_name)]
    groups = processes.reshape(-1, axis_size)
    spans = bool((groups != groups[:, :1]).any())
    # An explicit transport this machine's GPUs cannot serve raises here, with the reason.
    transport = _cuda_caps.choose_transport(_cuda_caps.capabilities(), mine, transport,
                                            across_processes=spans)
    key_devices = processes * (1 << 32) + ordinals
    if spans:
        bootstrap_gpu_cliques(_cuda_caps.load_cuda(),
                              _clique_key(names, sizes, axis_name, transport, key_devices),
                              processes, axis_size, timeout_s)
    call = jax.ffi.ffi_call(_CUDA_TARGETS[target], results, vmap_method="sequential",
                            has_side_effect=False)
    return call(
        x,
        w,
        clique_key=_clique_key(names, sizes, axis_name, transport, key_devices),
        axis=np.int64(axis),
        axis_size=np.int64(sizes[names.index(axis_name)]),
        transport=np.int32(_TRANSPORTS.index(transport)),
        chunks=np.int64(chunks),
        bidirectional=bool(bidirectional),
        timeout_ms=np.int64(max(1, round(timeout_s * 1000))),
        devices=ordinals,
        processes=processes,
    )


_gpu_bootstrapped: set[tuple[int, int, int]] = set()


def bootstrap_gpu_cliques(cuda, clique_key, processes: np.ndarray, axis_size: int,
                          timeout_s: float) -> dict[int, bytes]:
    """Trace time, cliques spanning processes: NCCL id and exchange of each clique here.

    The process of each clique's rank 0 makes the id (``cuda.nccl_unique_id()``); it travels
    through the jax.distributed store (``_bootstrap.broadcast_bytes``; a silent root is named
    after ``timeout_s``) and is registered with ``cuda.set_nccl_id`` for the handler to find at
    the first execution, where every process creates its ranks' communicators. Once per
    clique per process (every process traces the same programs, so all skip alike). ``cuda`` is
    ``_cuda``, or ``_cuda_fake`` in tests. Returns group -> id for the cliques bootstrapped now.
    """
    me = jax.process_index()
    done: dict[int, bytes] = {}
    for group, ranks in enumerate(np.asarray(processes).reshape(-1, axis_size)):
        table = [int(p) for p in ranks]
        if me not in table or len(set(table)) == 1:
            continue
        token = (id(cuda), int(clique_key), group)
        with _lock:
            if token in _gpu_bootstrapped:
                continue
        cid = _bootstrap.clique_id(int(clique_key), group)
        root = table[0]
        uid = _bootstrap.broadcast_bytes(
            f"{cid}-gpu", "nccl_id", bytes(cuda.nccl_unique_id()) if me == root else None,
            root=root, processes=sorted(set(table)), timeout_s=timeout_s)
        cuda.set_nccl_id(int(clique_key), group, me, uid)
        # p2p and multicast: the CUDA IPC handles of each buffer generation (and the multicast
        # object's fd, through its share_fds) go through this exchange from C++ at the first
        # execution (cpp/cuda/cuda_clique.cc ImportPeerBuffers, ShareMulticastObject).
        cuda.set_exchange(int(clique_key), group, me,
                          _bootstrap.StoreExchange(f"{cid}-gpu", sorted(set(table)), timeout_s))
        with _lock:
            _gpu_bootstrapped.add(token)
        done[group] = uid
    return done


def _mesh_facts(axis_name: str):
    """(axis names, sizes, manual axes) of the mesh we are tracing under."""
    mesh = jax.sharding.get_abstract_mesh()
    names = tuple(mesh.axis_names)
    sizes = tuple(int(s) for s in mesh.axis_sizes)
    manual = tuple(a for a in names if a in set(mesh.manual_axes))
    assert axis_name in manual, f"{axis_name!r} is not a manual axis of {names}"
    auto = [a for a, s in zip(names, sizes, strict=True) if a not in manual and s > 1]
    if auto:
        # Devices that differ only in an automatic axis would get the same
        # (rank, group) and share one clique rank: refuse at trace time.
        raise ValueError(
            f"jaxoverlap native ops need every mesh axis of size > 1 to be manual in the "
            f"enclosing shard_map; mesh axes {auto} are not (pass axis_names covering all "
            f"axes, or omit axis_names)")
    return names, sizes, manual


def current_mesh() -> jax.sharding.Mesh | None:
    """The concrete mesh known here: ``jax.set_mesh``'s, else the global-array entry's."""
    try:
        from jax._src import mesh as mesh_lib

        concrete = mesh_lib.get_concrete_mesh()
    except Exception:  # noqa: BLE001 - private API: any failure means "unknown"
        concrete = None
    if concrete is None or getattr(concrete, "empty", True):
        concrete = _entry_mesh.get()
    return concrete


def _rank_table(axis_name: str, names: tuple, sizes: tuple, manual: tuple,
                mesh: jax.sharding.Mesh | None = None) -> np.ndarray:
    """Global device ids in (group, rank) order, or empty if the concrete mesh is unknown.

    Inside shard_map only the abstract mesh is known; the concrete one is
    available when the user set it with ``jax.set_mesh``. Only built when
    every mesh axis is manual, so that (group, rank) names exactly one device.
    """
    concrete = mesh if mesh is not None else current_mesh()
    if concrete is None or getattr(concrete, "empty", True) or len(manual) != len(names):
        return np.zeros((0,), np.int64)
    if tuple(concrete.axis_names) != names or tuple(concrete.axis_sizes) != sizes:
        return np.zeros((0,), np.int64)
    ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(concrete.devices)
    ids = np.moveaxis(ids, names.index(axis_name), -1)
    return ids.reshape(-1).astype(np.int64)


def _group_index(axis_name: str, names: tuple, sizes: tuple, manual: tuple):
    """Linear index of this device over the other manual axes (mesh order)."""
    group = jnp.int32(0)
    for name, size in zip(names, sizes, strict=True):
        if name == axis_name or name not in manual:
            continue
        group = group * size + lax.axis_index(name)
    return group


def _clique_key(names, sizes, axis_name, transport, devices: np.ndarray) -> np.int64:
    text = repr((names, sizes, axis_name, transport, tuple(int(d) for d in devices)))
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return np.int64(int.from_bytes(digest, "little", signed=True))


def _bootstrap_cliques(key: np.int64, devices: np.ndarray, axis_size: int,
                       timeout_s: float) -> None:
    """Multi-process runs: sets up every clique of this call that has a rank here.

    Each group of the rank table is one clique; its ranks' processes come from the global
    device list. Cliques whose ranks are all local need nothing (made on first use).
    """
    if devices.size == 0:
        raise ValueError(
            "jaxoverlap native ops in a multi-process run need the concrete mesh to know which "
            "process owns each rank: call the op on global arrays (with mesh= or jax.set_mesh), "
            "or trace your shard_map under `with jax.set_mesh(mesh):`")
    by_id = {d.id: d for d in jax.devices()}
    if any(by_id[int(i)].platform != "cpu" for i in devices):
        return  # the host executor's cliques only; another executor bootstraps its own
    host = _runtime.load_host()
    for group, ids in enumerate(devices.reshape(-1, axis_size)):
        table = [by_id[int(i)].process_index for i in ids]
        _bootstrap.ensure_host_clique(host, int(key), group, table, timeout_s)


def _call(target, x, w, results, *, axis_name, axis, transport, chunks, bidirectional, timeout_s,
          mesh=None):
    if _call_platform(mesh) in _GPU_PLATFORMS:
        return _cuda_call(target, x, w, results, axis_name=axis_name, axis=axis,
                          transport=transport, chunks=chunks, bidirectional=bidirectional,
                          timeout_s=timeout_s, mesh=mesh)
    _ensure_registered()
    assert transport in _TRANSPORTS, transport
    assert x.dtype == w.dtype and x.dtype in _DTYPES, (x.dtype, w.dtype)
    names, sizes, manual = _mesh_facts(axis_name)
    devices = _rank_table(axis_name, names, sizes, manual, mesh)
    clique_key = _clique_key(names, sizes, axis_name, transport, devices)
    axis_size = sizes[names.index(axis_name)]
    if _bootstrap.is_multiprocess():
        _bootstrap_cliques(clique_key, devices, axis_size, timeout_s)
    coords = jnp.stack(
        [lax.axis_index(axis_name).astype(jnp.int32),
         _group_index(axis_name, names, sizes, manual).astype(jnp.int32)]
    )
    call = jax.ffi.ffi_call(target, results, vmap_method="sequential", has_side_effect=False)
    return call(
        x,
        w,
        coords,
        # Attributes carry the exact C++ types of the handler binding.
        clique_key=clique_key,
        axis=np.int64(axis),
        axis_size=np.int64(axis_size),
        transport=np.int32(_TRANSPORTS.index(transport)),
        chunks=np.int64(chunks),
        bidirectional=bool(bidirectional),
        timeout_ms=np.int64(max(1, round(timeout_s * 1000))),
        devices=devices,
    )


def ag_matmul_shard(x, w, *, axis_name, axis=0, transport="nccl", chunks=1, bidirectional=False,
                    return_gathered=False, timeout_s=120.0, mesh=None):
    """``all_gather(x, axis_name, axis=axis, tiled=True) @ w`` on local shards.

    Returns y, or (y, x_gathered) when ``return_gathered``. ``mesh``: the concrete mesh, when
    the caller knows it and it is not set with ``jax.set_mesh`` (it gives the rank table).
    """
    n = lax.axis_size(axis_name)
    gathered = list(x.shape)
    gathered[axis] *= n
    y_shape = (*gathered[:-1], w.shape[1])
    x_type = jax.typeof(x)
    results = [x_type.update(shape=y_shape, dtype=x.dtype)]
    if return_gathered:
        results.append(x_type.update(shape=tuple(gathered), dtype=x.dtype))
    out = _call("jaxoverlap_ag_matmul", x, w, results, axis_name=axis_name, axis=axis,
                transport=transport, chunks=chunks, bidirectional=bidirectional,
                timeout_s=timeout_s, mesh=mesh)
    return (out[0], out[1]) if return_gathered else out[0]


def matmul_rs_shard(x, w, *, axis_name, axis=0, transport="nccl", chunks=1, bidirectional=False,
                    timeout_s=120.0, mesh=None):
    """``psum_scatter(x @ w, axis_name, scatter_dimension=axis, tiled=True)`` on local shards."""
    n = lax.axis_size(axis_name)
    assert x.shape[axis] % n == 0, (x.shape, axis, n)
    y_shape = list(x.shape)
    y_shape[axis] //= n
    y_shape[-1] = w.shape[1]
    results = [jax.typeof(x).update(shape=tuple(y_shape), dtype=x.dtype)]
    (y,) = _call("jaxoverlap_matmul_rs", x, w, results, axis_name=axis_name, axis=axis,
                 transport=transport, chunks=chunks, bidirectional=bidirectional,
                 timeout_s=timeout_s, mesh=mesh)
    return y
