"""The CUDA side of the native path: loading ``_cuda``, capabilities, transport choice.

``_cuda`` links cuBLASLt and NCCL from the ``nvidia-*`` wheels (``nvidia-cublas``,
``nvidia-nccl-cu13``). Its rpath points into site-packages, but an editable install
or another layout breaks that, so the libraries are preloaded here with
``RTLD_GLOBAL`` before the import (as ``_runtime.load_host`` does for the BLAS).
Importing ``_cuda`` needs no GPU and no driver.

What each transport needs of the GPUs is a pure function of a capability table
(:func:`transport_reasons`), so that it is unit-tested with injected tables; the
real table comes from :func:`capabilities` (``_cuda.capabilities()``: devices,
compute capability, ``CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED``, the peer-access
matrix, driver/runtime/NCCL/cuBLAS versions). The choice among them is made in one
place, ``_native_call.resolve_transport``.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from jaxoverlap._native_call import AUTO_ORDER

# Multicast objects need the CUDA 12.1 driver API; our runtime is CUDA 13 (driver >= 580).
MULTICAST_MIN_DRIVER = 12010


def _preload(wheel_dirs: Sequence[str]) -> list[str]:
    import nvidia  # namespace package of the nvidia-* wheels

    loaded = []
    wanted = [("nccl/lib", "libnccl.so")] + [(f"{d}/lib", "libcublasLt.so") for d in wheel_dirs]
    for rel, prefix in wanted:
        for root in nvidia.__path__:
            lib_dir = os.path.join(root, rel)
            if not os.path.isdir(lib_dir):
                continue
            for name in sorted(os.listdir(lib_dir)):
                if name.startswith(prefix + "."):
                    path = os.path.join(lib_dir, name)
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                    loaded.append(path)
                    break
    return loaded


# What to do about a missing extension, by cause.
REBUILD_FIX = ("to get it, rebuild where nvcc (CUDA 13) is on PATH, without JAXOVERLAP_CUDA=OFF: "
               "pip install --force-reinstall --no-deps <jaxoverlap source> (README, Install)")
WHEELS_FIX = "pip install 'jaxoverlap[cuda]' (the nvidia-nccl-cu13 and nvidia-cublas wheels)"


def build_record() -> str:
    """What the build made of ``_cuda``: ``"built with CUDA ..."`` or ``"not built: <why>"``."""
    try:
        from jaxoverlap._build_config import CUDA_EXTENSION
    except ImportError:
        return "not built (this installation has no record of its build)"
    return CUDA_EXTENSION


@functools.cache
def load_cuda() -> ModuleType:
    """Returns ``jaxoverlap._cuda`` (ImportError, naming the cause and the fix, when it was not
    built or cannot load)."""
    if importlib.util.find_spec("jaxoverlap._cuda") is None:
        record = build_record()
        if record.startswith("built"):
            record = "not in this installation"
        raise ImportError(f"jaxoverlap._cuda was {record}; {REBUILD_FIX}")
    try:
        _preload(("cu13", "cublas", "cu12"))
    except (ImportError, OSError) as e:
        raise ImportError(
            f"jaxoverlap._cuda needs NCCL and cuBLASLt from the nvidia-* wheels ({e}); "
            f"{WHEELS_FIX}") from e
    from jaxoverlap import _cuda

    return _cuda


def cuda_error() -> str | None:
    """Why ``load_cuda()`` fails (the cause and the fix), or None when it works."""
    try:
        load_cuda()
    except ImportError as e:
        return str(e) or f"jaxoverlap._cuda does not load; {REBUILD_FIX}"
    return None


def extension_summary() -> str:
    """One line for ``jo.info()``: the CUDA extension as built, and whether it loads here."""
    error = cuda_error()
    if error is None:
        return f"{build_record()}; loads"
    return f"unavailable: {error}"


@functools.cache
def capabilities() -> dict[str, Any]:
    """This machine's GPU capability table (never raises; ``error`` says what is missing)."""
    error = cuda_error()
    if error is not None:
        return {"error": error, "devices": [], "peer_access": []}
    return dict(load_cuda().capabilities())


def transport_reasons(caps: dict[str, Any], devices: Sequence[int], *,
                      across_processes: bool = False) -> dict[str, str | None]:
    """For each transport, why it cannot serve a clique of local GPUs ``devices`` (None: it can).

    ``across_processes``: the clique also has ranks in other processes (``devices`` are this
    process's). Then this process's GPUs must serve p2p and multicast themselves (peer access
    among them, multicast support); the peers' buffers are mapped at the first execution,
    through fabric handles or CUDA IPC (docs/gpu.md, "Across processes").
    """
    reasons: dict[str, str | None] = {}
    if caps.get("error") and not caps.get("devices"):
        return {t: f"no usable GPU ({caps['error']})" for t in AUTO_ORDER}
    known = {d["ordinal"]: d for d in caps.get("devices", [])}
    missing = [d for d in devices if d not in known]
    if missing:
        return {t: f"GPU(s) {missing} not visible to this process" for t in AUTO_ORDER}
    peer = caps.get("peer_access", [])
    no_peer = [(a, b) for a in devices for b in devices
               if a != b and not (a < len(peer) and b < len(peer[a]) and peer[a][b])]
    p2p_reason = (None if not no_peer else
                  f"no peer access between GPUs {no_peer[0][0]} and {no_peer[0][1]} "
                  "(no NVLink/PCIe P2P path, or disabled)")
    reasons["nccl"] = None
    reasons["p2p"] = p2p_reason
    reasons["multicast"] = _multicast_device_reason(caps, devices, known)
    if reasons["multicast"] is None and p2p_reason is not None:
        reasons["multicast"] = p2p_reason + " (flags live in peer memory)"
    if len(set(devices)) == 1:
        # One GPU here: nothing moves between our own GPUs. Alone, every transport is
        # trivially fine; with peers in other processes, multicast still needs this GPU.
        reasons = {t: None for t in AUTO_ORDER}
        if across_processes:
            reasons["multicast"] = _multicast_device_reason(caps, devices, known)
    return reasons


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


def info() -> dict[str, Any]:
    """The GPU section of ``jo.info()``."""
    error = cuda_error()
    if error is not None:
        return {"cuda_extension": f"unavailable: {error}"}
    cuda = load_cuda()
    caps = capabilities()
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
    reasons = transport_reasons(caps, ordinals)
    out["transports (all GPUs)"] = {
        t: "yes" if r is None else f"no: {r}" for t, r in reasons.items()}
    from jaxoverlap._native_call import resolve_transport

    try:
        out["auto picks"] = resolve_transport("cuda", "auto", None, spans_processes=False,
                                              local_ordinals=ordinals)
    except ValueError as e:
        out["auto picks"] = f"nothing: {e}"
    out["cliques"] = cuda.cliques() or "none yet"
    return out
