"""Compile check: the sm_90a code of _cuda really contains the multimem instructions.

Reads the fatbinary of the built module with cuobjdump (from the
``nvidia-cuda-cuobjdump`` wheel; SASS needs ``nvidia-cuda-nvdisasm`` too), so a
refactor cannot silently drop them.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from .conftest import REQUIRED


def _cuobjdump() -> str:
    try:
        import nvidia
    except ImportError:
        nvidia = None
    for root in getattr(nvidia, "__path__", []):
        for sub in ("cu13", "cuda_cuobjdump", "cu12"):
            path = os.path.join(root, sub, "bin", "cuobjdump")
            if os.path.exists(path):
                return path
    found = shutil.which("cuobjdump")
    if found:
        return found
    if REQUIRED:
        pytest.fail("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")


def _dump(cuda, *args) -> str:
    # -sass needs nvdisasm next to cuobjdump (the nvidia-cuda-nvdisasm wheel).
    done = subprocess.run([_cuobjdump(), *args, cuda.__file__], capture_output=True, text=True)
    assert done.returncode == 0, f"cuobjdump {' '.join(args)} failed: {done.stderr.strip()}"
    return done.stdout


def test_both_architectures_are_embedded(cuda):
    listing = _dump(cuda, "-lelf")
    assert "sm_80" in listing and "sm_90a" in listing


def test_sm90a_ptx_has_every_multimem_instruction(cuda):
    ptx = _dump(cuda, "-ptx", "-arch", "sm_90a")
    for instruction in (
        "multimem.st.relaxed.sys.global.f32",
        "multimem.st.relaxed.sys.global.bf16x2",
        "multimem.st.relaxed.sys.global.f16x2",
        "multimem.ld_reduce.relaxed.sys.global.add.f32",
        "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.bf16x2",
        "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.f16x2",
    ):
        assert instruction in ptx, f"{instruction} missing from the sm_90a PTX"


def test_sm90a_sass_has_multicast_load_reduce(cuda):
    sass = _dump(cuda, "-sass", "-arch", "sm_90a")
    # multimem.ld_reduce assembles to LDGMC (one per dtype).
    assert sass.count("LDGMC") >= 3, "no LDGMC (multimem.ld_reduce) in the sm_90a SASS"


def test_sm80_code_has_no_multimem(cuda):
    """The sm_80 build is guarded: multimem exists on sm_90 only."""
    assert "LDGMC" not in _dump(cuda, "-sass", "-arch", "sm_80")
    assert "multimem" not in _dump(cuda, "-ptx", "-arch", "sm_80")
