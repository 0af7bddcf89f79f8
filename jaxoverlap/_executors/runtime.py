"""The extensions in this process: loading ``_host`` and ``_cuda``, registering their handlers.

``_host`` links the BLAS of the ``scipy-openblas32`` wheel, ``_cuda`` links cuBLASLt and NCCL
from the ``nvidia-*`` wheels (``nvidia-cublas``, ``nvidia-nccl-cu13``). Their rpaths point at
those wheels' ``lib`` directories next to ours, but an editable install or an unusual layout
breaks that, so the libraries are preloaded here with ``RTLD_GLOBAL`` before the import: the
dynamic loader then resolves the extension's symbols against the copies already in the
process. Importing ``_cuda`` needs no GPU and no driver.

A platform's FFI handlers are registered with XLA once per process, when its first native call
lowers (:func:`register`); what must start with the first native call hooks in there
(:func:`on_register`: the profiler's ``JAXOVERLAP_PROFILE``).

A source checkout has no ``_host`` until it is built (``pip install -e .``); importing it from
there is refused with the reason (:func:`source_tree_error`).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType

# ---------------------------------------------------------------- the host extension


def _preload_blas() -> str:
    import scipy_openblas32

    lib_dir = scipy_openblas32.get_lib_dir()
    name = scipy_openblas32.get_library()
    for candidate in sorted(os.listdir(lib_dir)):
        if candidate.startswith(f"lib{name}.") and ".so" in candidate:
            path = os.path.join(lib_dir, candidate)
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return path
    raise ImportError(f"jaxoverlap: no lib{name}.so in {lib_dir} (scipy-openblas32 wheel)")


@functools.cache
def load_host() -> ModuleType:
    """Returns ``jaxoverlap._host``, preloading its BLAS first (once)."""
    _preload_blas()
    from jaxoverlap import _host

    return _host


def host_error() -> str | None:
    """Why ``load_host()`` fails, or None when it works."""
    try:
        load_host()
    except ImportError as e:
        return str(e)
    return None


# ---------------------------------------------------------------- the CUDA extension


def _preload_cuda_libraries(wheel_dirs: Sequence[str]) -> list[str]:
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
        _preload_cuda_libraries(("cu13", "cublas", "cu12"))
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


# ---------------------------------------------------------------- registration with XLA

_lock = threading.Lock()
_registered: set[str] = set()
_hooks: list[Callable[[], None]] = []


def on_register(hook: Callable[[], None]) -> None:
    """Runs ``hook()`` whenever a platform's handlers are registered: before that platform's
    first native call runs (``hook`` must tolerate being run more than once)."""
    _hooks.append(hook)


def register(platform: str) -> None:
    """Registers the FFI targets of ``platform`` ("cpu" or "cuda") with XLA (once per
    process), then runs the :func:`on_register` hooks."""
    # jax is imported here, not above: jaxoverlap/__init__ imports this module first, to check
    # the source tree before anything else.
    import jax

    with _lock:
        if platform in _registered:
            return
        host = load_host()
        host.set_process_index(jax.process_index())
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
            cuda = load_cuda()
            cuda.set_process_index(jax.process_index())
            for name, capsules in cuda.types().items():
                jax.ffi.register_ffi_type(name, capsules, platform="CUDA")
            # No traits: the handlers are not command-buffer compatible (and the CUDA plugin
            # rejects traits= at registration anyway).
            for name, stages in cuda.registrations().items():
                jax.ffi.register_ffi_target(name, stages, platform="CUDA")
        _registered.add(platform)
    for hook in _hooks:
        hook()


def note_lowering(platform: str, site_key: int) -> None:
    """Tells the executors that the native call ``site_key`` lowered for ``platform`` (whose
    handlers are registered): its next instance belongs to a new program, so XLA's instances of
    it number from 1 again (``cpp/core/call.h``, ``CallSite``). Each extension keeps its own
    notes; ``_host`` hears of every lowering, ``_cuda`` of those for a GPU."""
    load_host().note_lowering(site_key)
    if platform != "cpu":
        load_cuda().note_lowering(site_key)


# ---------------------------------------------------------------- the source tree


def source_tree_error() -> str | None:
    """Why this ``jaxoverlap`` cannot work: an unbuilt source checkout (None: it is not one).

    ``python -m``/``-c`` put the current directory first on ``sys.path`` (a script, its own
    directory), so from the repository root ``import jaxoverlap`` finds the sources, which
    hide the installed package and lack the extension that ``pip install .`` compiled.
    """
    if importlib.util.find_spec("jaxoverlap._host") is not None:
        return None
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not all(os.path.isfile(os.path.join(root, name))
               for name in ("pyproject.toml", "CMakeLists.txt")):
        return None
    return (f"jaxoverlap is being imported from its source tree ({root}), where the compiled "
            "extension (jaxoverlap._host) is not built: the current directory comes first on "
            "sys.path and hides any installed jaxoverlap. Either run from another directory "
            "(to use the jaxoverlap that `pip install .` installed), or build this tree in "
            f"place with `pip install -e .` in {root}.")


def run_as_command() -> bool:
    """True under ``python -m jaxoverlap[.sub]``: errors then print as a line, not a traceback."""
    argv = getattr(sys, "orig_argv", [])
    return any(flag == "-m" and module.split(".")[0] == "jaxoverlap"
               for flag, module in zip(argv, argv[1:], strict=False))
