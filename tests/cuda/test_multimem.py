"""The built fatbinary, read back: which code the kernels carry, and who can run it.

Reads the fatbinary of the built ``_cuda`` module with cuobjdump (from the
``nvidia-cuda-cuobjdump`` wheel; SASS needs ``nvidia-cuda-nvdisasm`` too) and checks

* that it holds exactly the variants the build recorded (``build_info()["kernel_images"]``,
  which the fake's model of variant selection uses), so the fake never models a binary we do
  not ship;
* that the multimem kernels have code that runs on sm_90 and sm_100 (cubins) and later
  (compute_90 PTX, which the driver JIT-compiles there), with no arch-specific (sm_90a)
  code and nothing compiled for less than sm_90 — such a variant would ``__trap()``;
* that the multimem instructions, in their 16-byte vector forms (and the integer .b32/.b64
  stores that move fp8 shards as bits), and the release fences are in that code, so a refactor
  cannot silently drop them.

The variant choice itself (cubin of the same major revision, else PTX of a lower-or-equal
compute capability) is the fake's ``SelectKernelVariant``, which cites the CUDA compatibility
rules; here it is fed what cuobjdump found.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from .conftest import REQUIRED
from .fake_cases import check, run_case

pytestmark = pytest.mark.jax_independent  # the built binary read back, the fake: no JAX


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


def _family(symbol: str) -> str | None:
    if "McStoreBody" in symbol or "McReduceBody" in symbol:
        return "multimem"
    if "AddBody" in symbol or "ReduceBody" in symbol:  # compiled together (kernels.cu)
        return "add"
    if "FlagWaitMainloop" in symbol:  # the fused GEMM (docs/gpu-internals.md §5)
        return "fused_sm100" if "SM100_MMA" in symbol else "fused"
    return None


def _sections(text: str, kind: str) -> list[tuple[str, str]]:
    """(arch, body) per fatbinary entry of `kind` ("elf" or "ptx") in cuobjdump output."""
    parts = re.split(r"^Fatbin (elf|ptx) code:\n", text, flags=re.M)
    out = []
    for k, body in zip(parts[1::2], parts[2::2], strict=True):
        if k == kind:
            arch = re.search(r"^arch = (sm_\w+)", body, flags=re.M).group(1)
            out.append((arch, body))
    return out


@pytest.fixture(scope="module")
def fatbin(cuda):
    """{family: [images]} as in the build's record: cubins "sm_XY", PTX "compute_XY"."""
    images: dict[str, list[str]] = {}
    for arch, body in _sections(_dump(cuda, "-elf"), "elf"):
        for family in {_family(s) for s in re.findall(r"\.text\.(\S+)", body)} - {None}:
            images.setdefault(family, []).append(arch)
    for arch, body in _sections(_dump(cuda, "-ptx"), "ptx"):
        for family in {_family(s) for s in re.findall(r"\.entry (\w+)", body)} - {None}:
            images.setdefault(family, []).append(arch.replace("sm_", "compute_"))
    return {family: sorted(set(found)) for family, found in images.items()}


def test_the_fatbinary_holds_what_the_build_recorded(cuda, fatbin):
    """The fake models variant selection from the build's record: it must be the binary's."""
    recorded = {f: sorted(images) for f, images in cuda.build_info()["kernel_images"].items()}
    assert fatbin == recorded


def test_multimem_code_runs_on_sm90_and_later_and_nowhere_else(fatbin):
    images = fatbin["multimem"]
    assert "sm_90" in images, "no sm_90 cubin of the multimem kernels"
    assert "sm_100" in images, "no sm_100 cubin: a B200 would JIT-compile the PTX at load"
    assert "compute_90" in images, "no compute_90 PTX: an sm_100 GPU could not run them"
    for image in images:
        number = int(re.match(r"(?:sm|compute)_(\d+)", image).group(1))
        assert number >= 90, f"{image}: multimem code compiled for less than sm_90 would trap"
        assert not image.endswith("a"), f"{image}: arch-specific code runs on one GPU only"


@pytest.mark.parametrize(("cc", "image", "jit"), [
    ((9, 0), "sm_90", False),        # H100/H200: the cubin
    ((10, 0), "sm_100", False),      # B200: the sm_100 cubin
    ((10, 3), "sm_100", False),      # B300: a cubin runs on its major revision, higher minors too
    ((12, 0), "compute_90", True),   # RTX PRO 6000 Blackwell: the driver JIT-compiles the PTX
])
def test_the_built_variants_run_multimem_on(fake, fatbin, cc, image, jit):
    got = fake.kernel_variant("multimem", *cc, images=fatbin)
    assert got is not None and (got["image"], got["jit"]) == (image, jit)
    assert got["ptx_version"] >= 90  # what the launcher checks before a launch


def test_the_built_variants_run_multicast_on_a_fake_blackwell(fake, fatbin):
    """The launch path with the images cuobjdump found, on a fake B200."""
    fake.reset(fake.Config(cc_major=10, kernel_images=fatbin))
    out, xs, ws = run_case(fake, "matmul_rs", "multicast", 4, rows=4, chunks=2)
    check(fake, out, "matmul_rs", xs, ws, 4, "float32")


def test_sm90_ptx_has_every_multimem_instruction(cuda):
    ptx = "".join(b for arch, b in _sections(_dump(cuda, "-ptx"), "ptx") if arch == "sm_90")
    for kind in ("f32", "bf16x2", "f16x2"):
        acc = "" if kind == "f32" else ".acc::f32"
        for vec in ("", ".v2", ".v4"):  # 4, 8 and 16 bytes per instruction
            for instruction in (f"multimem.st.relaxed.sys.global{vec}.{kind}",
                                f"multimem.ld_reduce.relaxed.sys.global.add{acc}{vec}.{kind}"):
                assert instruction in ptx, f"{instruction} missing from the compute_90 PTX"
    # fp8 shards are stored as bits, through the integer forms (4 and 8 bytes; 16 as two .b64).
    for kind in ("b32", "b64"):
        instruction = f"multimem.st.relaxed.sys.global.{kind}"
        assert instruction in ptx, f"{instruction} missing from the compute_90 PTX"
    # The release before the flag (kernel_body.h): proxy fence, then a system-scope fence.
    assert "fence.proxy.alias" in ptx and "fence.acq_rel.sys" in ptx


def test_sm90_sass_has_multicast_load_reduce(cuda):
    sass = _dump(cuda, "-sass", "-arch", "sm_90")
    # multimem.ld_reduce assembles to LDGMC.
    assert sass.count("LDGMC") >= 3, "no LDGMC (multimem.ld_reduce) in the sm_90 SASS"


def test_sm80_code_has_no_multimem(cuda):
    """sm_80 carries the AddBlock kernels only."""
    assert "LDGMC" not in _dump(cuda, "-sass", "-arch", "sm_80")
    elf = [b for arch, b in _sections(_dump(cuda, "-elf"), "elf") if arch == "sm_80"]
    assert elf and not any("McStoreBody" in b or "McReduceBody" in b for b in elf)


def test_the_reduce_kernels_load_and_store_16_bytes_per_access(cuda):
    """The fused GEMM + RS's reduction (kernel_body.h ReduceBody) in the sm_90 SASS: every element
    type's 16-byte variant moves each source and the result as one 128-bit access (LDG.E.128,
    STG.E.128) and adds in float32 (FADD); it has no fence or atomic: what it reads is ordered by
    its stream's flag waits (docs/gpu-internals.md §5), not by device-side acquires."""
    sass = _dump(cuda, "-sass", "-arch", "sm_90")
    bodies = {}
    for part in re.split(r"\n\s+Function : ", sass)[1:]:
        name, body = part.split("\n", 1)
        if "10ReduceBody" in name and "Li16E" in name:  # not McReduceBody
            bodies[name] = body
    assert len(bodies) == 3, sorted(bodies)  # f32, bf16, f16
    for name, body in bodies.items():
        assert "LDG.E.128" in body and "STG.E.128" in body and "FADD" in body, name
        assert "MEMBAR" not in body and "ATOM" not in body and "RED." not in body, name
