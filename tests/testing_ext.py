"""Loads ``jaxoverlap_testing``, the test helpers built beside the package but never installed.

The module (``cpp/python/testing_module.cc``) lives in the scikit-build build tree of this
checkout (``build/<wheel tag>/cpp``), which ``make install`` / ``pip install -e .`` fill.
"""

from __future__ import annotations

import glob
import importlib
import os
import sysconfig
from types import ModuleType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load() -> ModuleType:
    """``jaxoverlap_testing`` from this checkout's build tree (ImportError naming the fix)."""
    import sys

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    found = sorted(glob.glob(os.path.join(ROOT, "build", "*", "cpp",
                                          f"jaxoverlap_testing{suffix}")),
                   key=os.path.getmtime)
    if not found:
        raise ImportError(f"jaxoverlap_testing{suffix} is not in {ROOT}/build/*/cpp: build the "
                          "checkout first (make install, or pip install -e .)")
    directory = os.path.dirname(found[-1])
    if directory not in sys.path:
        sys.path.insert(0, directory)
    return importlib.import_module("jaxoverlap_testing")
