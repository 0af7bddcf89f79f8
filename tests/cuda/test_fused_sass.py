"""The fused GEMM as built (``cpp/cuda/fused/fused_gemm_kernel.cuh``, its FP8 form
``fused_gemm_fp8.cuh``), read back from ``_cuda``'s fatbinary with cuobjdump (as
``test_multimem.py`` does): no GPU runs it here, so what it does is checked in its machine code
(SASS), per kernel (bf16, f16, and the FP8 instantiations e4m3 x e4m3 -> bf16 and
e5m2 x e4m3 -> bf16):

* the stock CUTLASS mainloop's tensor-core instructions are there and pipelined
  (``HGMMA.64x256x16.F32.BF16``, ``HGMMA.64x256x16.F32`` for f16; sm_90's FP8 wgmma assembles
  to ``QGMMA.64x128x32.F32.E4M3.E4M3`` / ``.E5M2.E4M3``; not every one waiting for itself,
  which is what a build without ``-DNDEBUG`` gives: ptxas serialises wgmma);
* FP8: the promotion of CUTLASS's FP8 mainloop (not fast accumulation): in the mainloop, a wait
  for every wgmma (``WARPGROUP.DEPBAR.LE gsb0, 0x0``) followed, before the next wgmma, by one
  ``FADD`` per accumulator register a thread holds of a 64 x N wgmma (64 for N = 128): the
  tensor cores' sum added into the float32 accumulators; and the epilogue's scale loads
  (``ld.relaxed.gpu``: ``LDG.E.STRONG.GPU``) between the mainloop and the first TMA store;
* before the first TMA load (``UTMALDG``): a spin — a loop with ``NANOSLEEP`` and the global
  timer (its bound) — around an acquire at system scope (``ld.acquire.sys`` assembles to
  ``LDG.E.STRONG.SYS`` followed by ``CCTL.IVALL``; a relaxed load has no ``CCTL.IVALL``), then
  the proxy fence ``FENCE.VIEW.ASYNC.G`` (``fence.proxy.async.global``) before the load;
* after the epilogue's last TMA store (``UTMASTG``): the store wait
  (``cp.async.bulk.wait_group 0``: ``DEPBAR.LE SB0, 0x0`` then ``CCTL.IVALL``; the stock
  ``.read`` form has no ``CCTL.IVALL``), the proxy fence, then the release at system scope
  (``st.release.sys``: ``MEMBAR.ALL.SYS`` before ``STG.E.STRONG.SYS``).

"Before" and "after" are in address order: the producer's and the epilogue's code are laid
out as they run (a wait, then the loads; the stores, then the release). Each check was shown
to fail on a build of the kernel without its feature: ``test_each_check_fails_without_its_feature``
rebuilds those variants (about 35 CPU-seconds each, so it runs only when
``JAXOVERLAP_SASS_VARIANTS=1``).
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from .test_multimem import _cuobjdump, _dump, _sections

ROOT = Path(__file__).resolve().parents[2]
KERNEL = "FlagWaitMainloop"  # in the mangled name of every fused kernel
# kernel: (its MMA atom in the mangled name, its tensor-core opcode, a regular expression: f16
# inputs have no suffix; FP8 is QGMMA, K 32 per instruction, the 128-column tile's N)
DTYPES = {"bf16": ("F32BF16BF16", r"HGMMA\.64x256x16\.F32\.BF16"),
          "f16": ("F32F16F16", r"HGMMA\.64x256x16\.F32"),
          "e4m3_bf16": ("F32E4M3E4M3", r"QGMMA\.64x128x32\.F32\.E4M3\.E4M3"),
          "e5m2e4m3_bf16": ("F32E5M2E4M3", r"QGMMA\.64x128x32\.F32\.E5M2\.E4M3")}
FP8 = [d for d, (_, opcode) in DTYPES.items() if opcode.startswith("QGMMA")]

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*?)\s*;")


def _functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """{mangled name: [(address, instruction without predicate)]} of a -sass dump."""
    out = {}
    for part in re.split(r"^\s*Function : ", sass, flags=re.M)[1:]:
        name, body = part.split("\n", 1)
        code = []
        for address, text in _LINE.findall(body):
            text = re.sub(r"^@!?U?P\w+\s+", "", " ".join(text.split()))
            code.append((int(address, 16), text))
        out[name.strip()] = code
    return out


def _fused(sass: str) -> dict[str, list[tuple[int, str]]]:
    """The fused kernels of a dump, by dtype."""
    kernels = {}
    for name, code in _functions(sass).items():
        if KERNEL in name:
            (dtype,) = [d for d, (mangled, _) in DTYPES.items() if mangled in name]
            assert dtype not in kernels, f"two {dtype} fused kernels"
            kernels[dtype] = code
    return kernels


def _loops(code):
    """(first, last) address of every backward branch's range."""
    out = []
    for address, text in code:
        if text.split(" ")[0].startswith("BRA"):
            target = int(text.rsplit("0x", 1)[1], 16)
            if target <= address:
                out.append((target, address))
    return out


def _is_mma(text: str, dtype: str) -> bool:
    return re.fullmatch(DTYPES[dtype][1], text.split(" ")[0]) is not None


def tensor_core_problems(code, dtype) -> list[str]:
    mma = [t for _, t in code if _is_mma(t, dtype)]
    if not mma:
        return [f"no {DTYPES[dtype][1]}: the stock tensor-core mainloop is missing"]
    if all("gsb0" in t for t in mma):
        return ["every wgmma waits for itself (gsb0): the wgmma pipeline is serialised "
                "(ptxas does this to a build without -DNDEBUG)"]
    return []


def promotion_problems(code, dtype) -> list[str]:
    """FP8: a wait for every wgmma, then (before the next one) an FADD per accumulator register
    of a 64 x 128 wgmma a thread holds (64 x 128 / 128 threads): CUTLASS's promotion
    (``GmmaFP8Accumulation::promote_core``). The fast-accumulation mainloop has neither."""
    mma = [a for a, t in code if _is_mma(t, dtype)]
    if not mma:
        return ["no tensor-core instruction"]
    registers = 64 * 128 // 128
    body = [(a, t) for a, t in code if min(mma) <= a <= max(mma) + 0x1000]
    for i, (_, t) in enumerate(body):
        if t != "WARPGROUP.DEPBAR.LE gsb0, 0x0":
            continue
        fadds = 0
        for _, later in body[i + 1:]:
            if later.startswith("WARPGROUP.ARRIVE") or _is_mma(later, dtype):
                break
            fadds += later.startswith("FADD ")
        if fadds >= registers:
            return []
    return [f"no promotion: no wait for every wgmma followed by {registers} FADDs before the "
            "next wgmma in the mainloop"]


def scale_load_problems(code, dtype) -> list[str]:
    """FP8: the epilogue's scale loads (ld.relaxed.gpu: w's and one per row the thread stores)
    between the mainloop and the first TMA store."""
    mma = [a for a, t in code if _is_mma(t, dtype)]
    stores = [a for a, t in code if t.startswith("UTMASTG")]
    if not mma or not stores:
        return ["no tensor-core instruction or no TMA store (UTMASTG)"]
    loads = [a for a, t in code if max(mma) < a < min(stores) and t.startswith("LDG.E.STRONG.GPU")]
    if len(loads) < 2:
        return ["fewer than two LDG.E.STRONG.GPU (w's scale, a row's) between the mainloop and "
                "the first UTMASTG"]
    return []


def acquire_spin_problems(code) -> list[str]:
    loads = [a for a, t in code if t.startswith("UTMALDG")]
    if not loads:
        return ["no TMA load (UTMALDG)"]
    first_load = min(loads)
    acquires = [a for (a, t), (_, after) in zip(code, code[1:], strict=False)
                if a < first_load and t.startswith("LDG.E.STRONG.SYS") and after == "CCTL.IVALL"]
    if not acquires:
        return ["no acquire at system scope (LDG.E.STRONG.SYS, CCTL.IVALL) before the first "
                "UTMALDG"]

    def bounded_spin(lo, hi):
        body = [t for a, t in code if lo <= a <= hi]
        return any(t.startswith("NANOSLEEP") for t in body) and any(
            "SR_GLOBALTIMER" in t for t in body)

    spins = [a for a in acquires
             if any(lo <= a <= hi and bounded_spin(lo, hi) for lo, hi in _loops(code))]
    if not spins:
        return ["the acquire before the first UTMALDG is not in a loop with NANOSLEEP and the "
                "global timer (a bounded spin)"]
    if not any(min(spins) < a < first_load for a, t in code if t == "FENCE.VIEW.ASYNC.G"):
        return ["no proxy fence (FENCE.VIEW.ASYNC.G) between the spin and the first UTMALDG"]
    return []


def release_problems(code) -> list[str]:
    stores = [a for a, t in code if t.startswith("UTMASTG")]
    if not stores:
        return ["no TMA store (UTMASTG)"]
    after = [t for a, t in code if a > max(stores)]
    releases = [i for i, t in enumerate(after)
                if t.startswith("STG.E.STRONG.SYS") and "MEMBAR.ALL.SYS" in after[max(0, i - 4):i]]
    if not releases:
        return ["no release at system scope (MEMBAR.ALL.SYS, STG.E.STRONG.SYS) after the last "
                "UTMASTG"]
    before = after[:releases[0]]
    waits = [i for i, (t, nxt) in enumerate(zip(before, before[1:], strict=False))
             if t == "DEPBAR.LE SB0, 0x0" and nxt == "CCTL.IVALL"]
    if not waits:
        return ["no wait for the stores' completion (DEPBAR.LE SB0, 0x0, CCTL.IVALL: "
                "cp.async.bulk.wait_group 0) between the last UTMASTG and the release"]
    if "FENCE.VIEW.ASYNC.G" not in before[waits[0]:]:
        return ["no proxy fence (FENCE.VIEW.ASYNC.G) between the store wait and the release"]
    return []


CHECKS = {"tensor cores": tensor_core_problems, "acquire spin": acquire_spin_problems,
          "release": release_problems, "promotion": promotion_problems,
          "scale loads": scale_load_problems}
BY_DTYPE = ("tensor cores", "promotion", "scale loads")  # the checks that take the dtype
FP8_ONLY = ("promotion", "scale loads")


def _problems(code, dtype) -> dict[str, list[str]]:
    return {name: (check(code, dtype) if name in BY_DTYPE else check(code))
            for name, check in CHECKS.items() if dtype in FP8 or name not in FP8_ONLY}


@pytest.fixture(scope="module")
def fused_sass(cuda):
    return _fused(_dump(cuda, "-sass", "-arch", "sm_90a"))


def test_every_fused_kernel_is_in_the_module(fused_sass):
    assert sorted(fused_sass) == sorted(DTYPES)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_fused_kernel_sass(fused_sass, dtype):
    problems = _problems(fused_sass[dtype], dtype)
    assert problems == {name: [] for name in problems}
    assert set(problems) == set(CHECKS) - (set() if dtype in FP8 else set(FP8_ONLY))


def test_fused_kernels_are_sm90a_cubins_without_ptx(cuda):
    """sm_90a code runs on sm_90 only and its PTX cannot be JIT-compiled for newer GPUs: the
    fused kernels ship as sm_90a cubins, nothing else (other GPUs keep the chunked path)."""
    elf = _sections(_dump(cuda, "-elf"), "elf")
    archs = {arch for arch, body in elf if KERNEL in body}
    assert archs == {"sm_90a"}
    assert all(KERNEL not in body for _, body in _sections(_dump(cuda, "-ptx"), "ptx"))


# ---- each check against a build without its feature ----------------------------------------

KERNEL_SOURCE = "cpp/cuda/fused/fused_gemm_kernel.cuh"
# name: (check that must fail, [(text in KERNEL_SOURCE, replacement)], drop -DNDEBUG)
VARIANTS = {
    "no wait": ("acquire spin", [("    if (wait.flags != nullptr) {\n      if (cute::",
                                  "    if (false) {\n      if (cute::")], False),
    "relaxed wait": ("acquire spin", [("ld.acquire.sys.global.u32", "ld.relaxed.sys.global.u32")],
                     False),
    "no proxy fence before the loads": (
        "acquire spin", [("      FenceProxyAsyncGlobal();  // every lane", "      // every lane")],
        False),
    "no store wait": ("release", [("      WaitBulkStoresComplete();\n", "")], False),
    "store wait .read": ("release", [("cp.async.bulk.wait_group 0;",
                                      "cp.async.bulk.wait_group.read 0;")], False),
    "relaxed release": ("release", [("st.release.sys.global.u32", "st.relaxed.sys.global.u32")],
                        False),
    "without NDEBUG": ("tensor cores", [], True),
}


def _build_dir() -> Path:
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    found = glob.glob(str(ROOT / "build" / "*" / "cpp" / "cuda" / f"_cuda{suffix}"))
    if not found:
        pytest.fail(f"no _cuda{suffix} under {ROOT}/build: build the checkout first")
    return Path(found[0]).parents[2]


def _compile_variant(build: Path, tmp: Path, name: str, edits, drop_ndebug: bool) -> str:
    """The bf16 kernel built by the build's own nvcc command from an edited copy of cpp/."""
    obj = "cpp/cuda/CMakeFiles/jo_cuda_fused_gemm.dir/fused/fused_gemm_bf16.cu.o"
    command = subprocess.run(["ninja", "-C", str(build), "-t", "commands", obj],
                             capture_output=True, text=True, check=True).stdout.splitlines()[-1]
    src = tmp / name.replace(" ", "_") / "cpp"
    for part in ("core", "cuda"):
        for f in (ROOT / "cpp" / part).rglob("*.[hc]*"):
            copy = src / f.relative_to(ROOT / "cpp")
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(f.read_text())
    kernel = src / Path(KERNEL_SOURCE).relative_to("cpp")
    text = kernel.read_text()
    for old, new in edits:
        assert text.count(old) == 1, f"{name}: {old!r} is not once in {KERNEL_SOURCE}"
        text = text.replace(old, new)
    kernel.write_text(text)
    args = shlex.split(command)
    args = [a for a in args if not (drop_ndebug and a == "-DNDEBUG")]
    out = src.parent / "k.o"
    i = args.index("-MD")
    args[i:i + 5] = []  # -MD -MT <obj> -MF <dep>
    args = [f"-I{src}" if a == f"-I{ROOT}/cpp/cuda/.." else a for a in args]
    assert f"-I{src}" in args, f"the build's include of cpp/ is not in: {command}"
    args[args.index("-o") + 1] = str(out)
    args[args.index("-c") + 1] = str(src / "cuda" / "fused" / "fused_gemm_bf16.cu")
    subprocess.run(args, cwd=build, check=True, capture_output=True, text=True)
    return subprocess.run([_cuobjdump(), "-sass", str(out)], capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.skipif(os.environ.get("JAXOVERLAP_SASS_VARIANTS") != "1",
                    reason="rebuilds 7 variants of the fused kernel (about 35 CPU-seconds each): "
                           "set JAXOVERLAP_SASS_VARIANTS=1 to run it")
def test_each_check_fails_without_its_feature(tmp_path):
    build = _build_dir()
    with ThreadPoolExecutor(max_workers=2) as pool:
        dumps = dict(zip(VARIANTS, pool.map(
            lambda item: _compile_variant(build, tmp_path, item[0], item[1][1], item[1][2]),
            VARIANTS.items()), strict=True))
    for name, (failing, _, _) in VARIANTS.items():
        (code,) = _fused(dumps[name]).values()
        problems = _problems(code, "bf16")
        assert problems[failing], f"{name}: the {failing} check did not notice"
        assert all(not p for check, p in problems.items() if check != failing), (name, problems)
