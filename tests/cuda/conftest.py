"""tests/cuda: what can be tested of the CUDA executor without a GPU.

When the build was asked for ``_cuda`` (``make test CUDA=ON`` sets
``JAXOVERLAP_REQUIRE_CUDA=1``, as CI does), a missing or broken module is a
failure, never a skip. Otherwise (a build without nvcc) these tests skip, saying why.
"""

from __future__ import annotations

import importlib
import os

import pytest

REQUIRED = os.environ.get("JAXOVERLAP_REQUIRE_CUDA", "") == "1"


def require_module(name: str):
    """Imports ``jaxoverlap.<name>`` (after preloading the wheels' libraries)."""
    from jaxoverlap._executors import runtime

    try:
        if name == "_cuda":
            return runtime.load_cuda()
        runtime.load_cuda()  # same preload; _cuda_fake itself links no CUDA library
        return importlib.import_module(f"jaxoverlap.{name}")
    except ImportError as e:
        if REQUIRED:
            pytest.fail(f"jaxoverlap.{name} must be built (JAXOVERLAP_REQUIRE_CUDA=1): {e}")
        pytest.skip(f"jaxoverlap.{name} is unavailable here: {e}")


@pytest.fixture(scope="module")
def cuda():
    return require_module("_cuda")


@pytest.fixture()
def fake():
    module = require_module("_cuda_fake")
    module.reset()
    yield module
    module.reset()
