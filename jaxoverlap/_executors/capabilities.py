"""What the native path can do here: on which platform and dtype, over which transport.

Whether the native path runs at all (:func:`unavailable_reason`) depends on the extensions
(``runtime``), the platform and the dtype. What each transport needs of the GPUs is a pure
function of a capability table (:func:`gpu_transport_reasons`), so that it is unit-tested with
injected tables; the real table comes from :func:`gpu_table` (``_cuda.capabilities()``:
devices, compute capability, ``CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED``, the peer-access
matrix, driver/runtime/NCCL/cuBLAS versions). On CPU the host executor emulates every
transport. The choice among them is made by one rule, :func:`resolve_transport`, once per call
(``call.describe``); :func:`offered_transports` is what the performance model may choose among
before.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxoverlap import _kinds
from jaxoverlap._executors import bootstrap, runtime
from jaxoverlap._fp8_dtypes import is_fp8
from jaxoverlap._fused_gemm import FUSED_KERNELS


class NativeUnavailableError(ValueError):
    """``impl="native"`` (or a native transport) was asked for but cannot run here."""


# FP8_DTYPES (_fp8_dtypes): operands only, each with a float32 scale; the executors run them as
# FP8 GEMMs (the host: in float32 after an exact conversion; the CUDA executor: cuBLASLt's FP8
# kernels, docs/gpu-internals.md §6).
DTYPES = tuple(jnp.dtype(name) for name in _kinds.names(_kinds.DTYPES))
# cuBLASLt's FP8 GEMMs need compute capability 8.9 (Ada) or newer.
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)
GPU_PLATFORMS = ("cuda", "gpu")
# transport="auto" prefers them in this order (when every GPU of the clique can serve it).
AUTO_ORDER = _kinds.auto_order()
# Multicast objects need the CUDA 12.1 driver API; our runtime is CUDA 13 (driver >= 580).
MULTICAST_MIN_DRIVER = 12010


# ---------------------------------------------------------------- the native path at all


def transports() -> tuple[str, ...]:
    """Every transport of the native path, in id order (``_kinds``: the executors' table, which
    ``tests/test_kinds.py`` holds equal)."""
    return _kinds.names(_kinds.TRANSPORTS)


def available() -> bool:
    """True when the host extension loads (it is built with the package)."""
    return runtime.host_error() is None


def executor_platform(platform: str) -> str:
    """The executors' name of a JAX platform: ``"cuda"`` for the GPUs' (``"gpu"``, ``"cuda"``),
    else the platform's own (``"cpu"``)."""
    return "cuda" if platform in GPU_PLATFORMS else platform


def current_platform() -> str:
    """The platform of the program being traced: the mesh's devices, else JAX's default."""
    mesh = jax.sharding.get_abstract_mesh()
    device = getattr(mesh, "abstract_device", None)
    platform = getattr(device, "platform", None)
    return platform or jax.default_backend()


def unavailable_reason(platform: str, dtype, w_dtype=None) -> str | None:
    """Why the native path cannot run on ``platform`` with x of ``dtype`` (and w of
    ``w_dtype``, when given); None if it can."""
    error = runtime.host_error()
    if error is not None:
        return f"the native extension does not load ({error})"
    if platform in GPU_PLATFORMS:
        cuda_error = runtime.cuda_error()
        if cuda_error is not None:
            return f"the CUDA extension is unavailable: {cuda_error}"
    elif platform != "cpu":
        return (f"there is no native executor for platform {platform!r} in this build "
                "(the host executor runs on CPU, the CUDA executor on NVIDIA GPUs)")
    for d in (dtype,) if w_dtype is None else (dtype, w_dtype):
        if jnp.dtype(d) not in tuple(jnp.dtype(t) for t in DTYPES):
            return f"dtype {jnp.dtype(d).name} is not supported"
    if platform in GPU_PLATFORMS:
        return gpu_fp8_reason(gpu_table(), dtype, w_dtype)
    return None


def gpu_fp8_reason(caps: dict[str, Any], x_dtype, w_dtype=None,
                   devices: Sequence[int] | None = None) -> str | None:
    """Why the CUDA executor cannot run GEMMs of these operand dtypes on the GPUs ``devices``
    (None: every GPU of the table); None when it can, or when neither operand is fp8.

    cuBLASLt's FP8 GEMMs (cuBLAS docs, cublasLtMatmul, the FP8 requirements and type table)
    take two fp8 operands, never both float8_e5m2, on compute capability 8.9 or newer; the
    CUDA executor converts no operand, so an fp8 operand with a non-fp8 one runs only on the
    host executor (or impl="xla").
    """
    x_fp8 = is_fp8(x_dtype)
    w_fp8 = x_fp8 if w_dtype is None else is_fp8(w_dtype)
    if not x_fp8 and not w_fp8:
        return None
    if x_fp8 != w_fp8:
        return (f"the CUDA executor's FP8 GEMMs (cuBLASLt) take two fp8 operands, not x "
                f"{jnp.dtype(x_dtype).name} with w {jnp.dtype(w_dtype).name}: pass both as "
                f"fp8, or use impl='xla'")
    e5m2 = jnp.dtype(jnp.float8_e5m2)
    if jnp.dtype(x_dtype) == e5m2 and w_dtype is not None and jnp.dtype(w_dtype) == e5m2:
        return ("cuBLASLt has no float8_e5m2 x float8_e5m2 GEMM (its FP8 types: e4m3 x e4m3, "
                "e4m3 x e5m2, e5m2 x e4m3): make one operand float8_e4m3fn, or use impl='xla'")
    known = {d["ordinal"]: d for d in caps.get("devices", [])}
    ordinals = list(known) if devices is None else list(devices)
    old = [d for d in ordinals if d in known
           and tuple(known[d]["compute_capability"]) < FP8_MIN_COMPUTE_CAPABILITY]
    if old:
        ccs = sorted({"sm_{}{}".format(*known[d]["compute_capability"]) for d in old})
        return (f"GPU(s) {old} ({', '.join(ccs)}) have no FP8 GEMMs (cuBLASLt's FP8 kernels need "
                f"compute capability 8.9 or newer: Ada, Hopper, Blackwell); use bfloat16 "
                f"operands, or impl='xla'")
    return None


def local_ordinal(device) -> int:
    """The device's ordinal within its process (what the GPU handler sees as its device)."""
    ordinal = getattr(device, "local_hardware_id", None)
    return int(device.id if ordinal is None else ordinal)


# ---------------------------------------------------------------- the GPUs


@functools.cache
def gpu_table() -> dict[str, Any]:
    """This machine's GPU capability table (never raises; ``error`` says what is missing)."""
    error = runtime.cuda_error()
    if error is not None:
        return {"error": error, "devices": [], "peer_access": []}
    return dict(runtime.load_cuda().capabilities())


def gpu_transport_reasons(caps: dict[str, Any], devices: Sequence[int], *,
                          across_processes: bool = False) -> dict[str, str | None]:
    """For each transport, why it cannot serve a clique of local GPUs ``devices`` (None: it can).

    ``across_processes``: the clique also has ranks in other processes (``devices`` are this
    process's). Then this process's GPUs must serve p2p and multicast themselves (peer access
    among them, multicast support); the peers' buffers are mapped at the first execution,
    through fabric handles or CUDA IPC (docs/gpu-internals.md §1, "One process per GPU").
    """
    if caps.get("error") and not caps.get("devices"):
        return {t: f"no usable GPU ({caps['error']})" for t in AUTO_ORDER}
    known = {d["ordinal"]: d for d in caps.get("devices", [])}
    missing = [d for d in devices if d not in known]
    if missing:
        return {t: f"GPU(s) {missing} not visible to this process" for t in AUTO_ORDER}
    peer = caps.get("peer_access", [])
    no_peer = [(a, b) for a in devices for b in devices
               if a != b and not (a < len(peer) and b < len(peer[a]) and peer[a][b])]
    if len(set(devices)) == 1:
        # One GPU here: nothing moves between our own GPUs. Alone, every transport is
        # trivially fine; with peers in other processes, multicast still needs this GPU.
        facts = _kinds.GpuFacts(peer_access=None, multicast=_multicast_device_reason(
            caps, devices, known) if across_processes else None)
    else:
        facts = _kinds.GpuFacts(
            peer_access=None if not no_peer else
            f"no peer access between GPUs {no_peer[0][0]} and {no_peer[0][1]} (no NVLink/PCIe "
            "P2P path, or disabled)",
            multicast=_multicast_device_reason(caps, devices, known))
    # Each transport's own rule (its table row) on what the GPUs can do.
    return {t.name: t.reason(facts) for t in _kinds.TRANSPORTS}


def _multicast_device_reason(caps: dict[str, Any], devices: Sequence[int],
                             known: dict[int, Any]) -> str | None:
    """Why the GPUs ``devices`` themselves cannot take part in multicast (None: they can)."""
    old_sm = [d for d in devices if tuple(known[d]["compute_capability"]) < (9, 0)]
    no_mc = [d for d in devices if not known[d].get("multicast")]
    driver = int(caps.get("cuda_driver_int") or 0)
    if not caps.get("driver_multicast_api", False) or driver < MULTICAST_MIN_DRIVER:
        return ("the driver lacks the multicast API (cuMulticastCreate needs a CUDA >= 12.1 "
                "driver)")
    if old_sm:
        return f"GPU(s) {old_sm} are older than sm_90 (multimem needs Hopper+)"
    if no_mc:
        return (f"GPU(s) {no_mc} report no CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED "
                "(needs NVSwitch with Fabric Manager running)")
    return None


# ---------------------------------------------------------------- the transport of a call


def transport_reasons(platform: str, local_ordinals: Sequence[int],
                      spans_processes: bool) -> dict[str, str | None]:
    """For each transport, why it cannot serve the call here (None: it can).

    On CPU the host executor emulates every transport, across processes too. On GPU the
    reasons come from this process's GPUs of the clique (:func:`gpu_transport_reasons`).
    """
    if platform not in GPU_PLATFORMS:
        return {t: None for t in AUTO_ORDER}
    return gpu_transport_reasons(gpu_table(), local_ordinals, across_processes=spans_processes)


def resolve_transport(platform: str, requested: str, preferred: str | None, *,
                      spans_processes: bool, local_ordinals: Sequence[int],
                      among: Sequence[str] = AUTO_ORDER) -> str:
    """The transport of a call: the one asked for, else the best one that can serve it.

    The one rule that picks a transport. ``auto`` picks ``nccl`` for a clique spanning
    processes (whether peers in other processes can reach our buffers directly is not known
    here); else the performance model's ``preferred`` pick if it can serve, else the first of
    ``AUTO_ORDER`` that can. ``among``: the transports ``auto`` may pick (the fused GEMM's, for
    a plan that asked for it). An explicit request that cannot be served raises
    ``NativeUnavailableError`` naming the reason and what can.
    """
    reasons = transport_reasons(platform, local_ordinals, spans_processes)
    usable = [t for t in AUTO_ORDER if reasons[t] is None]
    if requested in (None, "auto"):
        allowed = [t for t in usable if t in among]
        # Across processes, one that moves the data itself (NCCL): peers' buffers need not
        # be reachable.
        messages = [t for t in allowed if _kinds.transport(t).mechanism == "messages"]
        if spans_processes and messages:
            return messages[0]
        if preferred in allowed:
            return preferred
        if allowed:
            return allowed[0]
        if tuple(among) == AUTO_ORDER:
            raise NativeUnavailableError(
                f"jaxoverlap: no transport can run here: {reasons[AUTO_ORDER[-1]]}")
        raise NativeUnavailableError(
            f"jaxoverlap: none of {tuple(among)} can run here: "
            + "; ".join(f"{t}: {reasons[t]}" for t in among))
    if requested not in reasons:
        raise ValueError(f"transport: expected one of auto, {', '.join(AUTO_ORDER)}; got "
                         f"{requested!r}")
    if reasons[requested] is not None:
        where = f"GPUs {list(local_ordinals)}" if platform in GPU_PLATFORMS else platform
        raise NativeUnavailableError(
            f"transport={requested!r} is not available on {where}: {reasons[requested]}. "
            f"Available: {usable or 'none'} (or transport='auto')")
    return requested


def fused_device_reason(platform: str, dtype: str | None = None) -> str | None:
    """Why this process's devices of ``platform`` cannot run the fused GEMM (None: they can).

    The host executor runs its semantics on CPU; on GPUs the kernel is sm_90a code for compute
    capability 9.0 and sm_100a code (16-bit types only) for 10.0 (``_fused_gemm.FUSED_KERNELS``):
    every GPU of the process must run one, for ``dtype`` when given.
    """
    if platform not in GPU_PLATFORMS:
        return None if platform == "cpu" else f"no fused GEMM on platform {platform!r}"
    caps = gpu_table()
    devices = caps.get("devices", [])
    if not devices:
        return f"no usable GPU ({caps.get('error')})"
    kernels = {d["ordinal"]: FUSED_KERNELS.get(tuple(d["compute_capability"])) for d in devices}
    other = [o for o, k in kernels.items() if k is None]
    if other:
        return (f"GPU(s) {other} are neither compute capability 9.0 nor 10.0: the fused GEMM is "
                "sm_90a code (H100, H200, GH200) and sm_100a code (B200, GB200)")
    if dtype is not None:
        lacking = {o: k for o, k in kernels.items() if k is not None and dtype not in k.dtypes}
        if lacking:
            (kernel, *_) = lacking.values()
            return (f"GPU(s) {list(lacking)} run the {kernel.image} fused GEMM, compiled for "
                    f"{' and '.join(kernel.dtypes)} only, not {dtype}")
    return None


# The kernels whose waits are bounded by the GPU's %globaltimer — the flag wait of a replayable
# program, matmul_ar's one-launch all-reduce — run only from a cubin, never JIT-compiled from
# PTX (whose %globaltimer the PTX ISA leaves unspecified): the executor refuses them at set-up
# (cpp/cuda/kernels/kernels_common.cc PrepareKernel). Over p2p (and the flag wait) they are the
# "add" kernels' code, over multicast the "multimem" kernels' (the build's kernel_images).
CLOCKED_KERNELS = {"p2p": "add", "multicast": "multimem"}
FLAG_WAIT_KERNELS = "add"


def _runs_cubin(image: str, cc: tuple[int, int]) -> bool:
    """Whether a device of compute capability ``cc`` runs the cubin ``image`` ("sm_90",
    "sm_100", "sm_90a"): one of the same major and a minor no larger, and an arch-specific
    ("a") one only on its own (CUDA C++ Programming Guide, "Binary Compatibility")."""
    digits = image.removeprefix("sm_").rstrip("abf")
    major, minor = int(digits[:-1]), int(digits[-1])
    if image[-1] in "abf":
        return (major, minor) == cc
    return major == cc[0] and minor <= cc[1]


def clocked_kernel_reason(platform: str, family: str) -> str | None:
    """Why the clock-bounded kernels of the kernel ``family`` (:data:`CLOCKED_KERNELS`) would
    be refused on this process's GPUs of ``platform`` (None: every GPU has a cubin of it that
    it runs, or the platform has no such kernels)."""
    if platform not in GPU_PLATFORMS or runtime.cuda_error() is not None:
        return None
    devices = gpu_table().get("devices", [])
    images = tuple(runtime.load_cuda().build_info()["kernel_images"].get(family, ()))
    cubins = [i for i in images if i.startswith("sm_")]
    lacking = sorted({"sm_{}{}".format(*d["compute_capability"]) for d in devices
                      if not any(_runs_cubin(i, tuple(d["compute_capability"])) for i in cubins)})
    if not lacking:
        return None
    return (f"GPU(s) of {', '.join(lacking)} have no cubin of the {family} kernels (built: "
            f"{', '.join(images) or 'none'}): the kernels that bound their waits with the GPU's "
            "clock (a replayable program's flag wait, matmul_ar's one-launch all-reduce) would "
            "be JIT-compiled from PTX, which the executor refuses")


def offered_transports(platform: str) -> tuple[str, ...]:
    """Transports that can serve calls among this process's devices of ``platform``.

    What the performance model may choose among; whether a clique spans processes is known
    only where the call is described (``call.describe``, which asks :func:`resolve_transport`).
    """
    if platform in GPU_PLATFORMS:
        if runtime.cuda_error() is not None:
            return ()
        reasons = transport_reasons("cuda", local_ordinals(platform), spans_processes=False)
        return tuple(t for t in transports() if reasons[t] is None)
    return transports() if platform == "cpu" and available() else ()


def local_ordinals(platform: str) -> list[int]:
    """This process's devices of ``platform`` as the GPU handler numbers them (on CPU, none:
    the host executor emulates every transport wherever its devices are)."""
    if platform not in GPU_PLATFORMS:
        return []
    return [local_ordinal(d) for d in jax.local_devices(backend="gpu")]


# ---------------------------------------------------------------- jo.info()


def info() -> dict:
    """What the native path offers on this machine: the ``native`` section of ``jo.info()``."""
    error = runtime.host_error()
    if error is not None:
        return {"available": False, "error": error}
    host = runtime.load_host()
    return {
        "available": True,
        "backends": {"cpu": {"executor": "host", "transports": list(transports())},
                     "gpu": gpu_info()},
        "dtypes": [jnp.dtype(d).name for d in DTYPES],
        "build": dict(host.build_info()),
        "cliques": host.cliques(),
        # Cliques spanning processes bootstrap through jax.distributed (docs/multiprocess.md).
        "processes": jax.process_count() if bootstrap.is_multiprocess() else 1,
    }


def gpu_info() -> dict[str, Any]:
    """The GPU part of :func:`info`."""
    error = runtime.cuda_error()
    if error is not None:
        return {"cuda_extension": f"unavailable: {error}"}
    cuda = runtime.load_cuda()
    caps = gpu_table()
    out: dict[str, Any] = {
        "cuda_extension": dict(cuda.build_info()),
        "driver": caps.get("cuda_driver") or "none found",
        "cuda_runtime": caps.get("cuda_runtime"),
        "cublas": caps.get("cublas"),
        "nccl": caps.get("nccl"),
    }
    devices = caps.get("devices", [])
    if not devices:
        out["gpus"] = f"none ({caps.get('error')})"
        return out
    out["gpus"] = {
        str(d["ordinal"]): "{} sm_{}{}, multicast {}".format(
            d["name"], *d["compute_capability"], "yes" if d.get("multicast") else "no")
        for d in devices
    }
    out["peer_access"] = "\n" + "\n".join(
        "      " + " ".join("x" if v else "." for v in row) for row in caps.get("peer_access", []))
    ordinals = [d["ordinal"] for d in devices]
    reasons = gpu_transport_reasons(caps, ordinals)
    out["transports (all GPUs)"] = {
        t: "yes" if r is None else f"no: {r}" for t, r in reasons.items()}
    try:
        out["auto picks"] = resolve_transport("cuda", "auto", None, spans_processes=False,
                                              local_ordinals=ordinals)
    except ValueError as e:
        out["auto picks"] = f"nothing: {e}"
    out["cliques"] = cuda.cliques() or "none yet"
    return out
