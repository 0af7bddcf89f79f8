"""Loading the native extension.

``_host`` links the BLAS of the ``scipy-openblas32`` wheel. Its rpath points
at the wheel's ``lib`` directory next to ours, but an editable install or an
unusual layout breaks that, so the library is preloaded here with
``RTLD_GLOBAL`` before ``_host`` is imported: the dynamic loader then resolves
``_host``'s BLAS symbols against the copy already in the process.
"""

from __future__ import annotations

import ctypes
import functools
import os
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
