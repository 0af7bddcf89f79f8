"""Loading the native extension.

``_host`` links the BLAS of the ``scipy-openblas32`` wheel. Its rpath points
at the wheel's ``lib`` directory next to ours, but an editable install or an
unusual layout breaks that, so the library is preloaded here with
``RTLD_GLOBAL`` before ``_host`` is imported: the dynamic loader then resolves
``_host``'s BLAS symbols against the copy already in the process.

A source checkout has no ``_host`` until it is built (``pip install -e .``);
importing it from there is refused with the reason (:func:`source_tree_error`).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import sys
from types import ModuleType


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


def source_tree_error() -> str | None:
    """Why this ``jaxoverlap`` cannot work: an unbuilt source checkout (None: it is not one).

    ``python -m``/``-c`` put the current directory first on ``sys.path`` (a script, its own
    directory), so from the repository root ``import jaxoverlap`` finds the sources, which
    hide the installed package and lack the extension that ``pip install .`` compiled.
    """
    if importlib.util.find_spec("jaxoverlap._host") is not None:
        return None
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
