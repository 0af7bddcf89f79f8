"""The fused GEMM as built (``cpp/cuda/fused/fused_gemm_kernel.cuh`` for sm_90a, its FP8 form
``fused_gemm_fp8.cuh``, ``fused_gemm_kernel_sm100.cuh`` for sm_100a; their flag protocol
``fused_gemm_sync.cuh``), read back from ``_cuda``'s fatbinary with cuobjdump (as
``test_multimem.py`` does): no GPU runs it here, so what it does is checked in its machine code
(SASS), per kernel (sm_90a bf16, f16, and the FP8 instantiations e4m3 x e4m3 -> bf16, f16
and f32 and e5m2 x e4m3 -> bf16; sm_100a bf16 and f16):

* the stock CUTLASS mainloop's tensor-core instructions are there and pipelined
  (``HGMMA.64x256x16.F32.BF16``, ``HGMMA.64x256x16.F32`` for f16; sm_90's FP8 wgmma assembles
  to ``QGMMA.64x128x32.F32.E4M3.E4M3`` / ``.E5M2.E4M3``; not every one waiting for itself,
  which is what a build without ``-DNDEBUG`` gives: ptxas serialises wgmma);
* FP8: the promotion of CUTLASS's FP8 mainloop (not fast accumulation): in the mainloop, a wait
  for every wgmma (``WARPGROUP.DEPBAR.LE gsb0, 0x0``) followed, before the next wgmma, by one
  ``FADD`` per accumulator register a thread holds of a 64 x N wgmma (64 for N = 128): the
  tensor cores' sum added into the float32 accumulators; and the epilogue's scale loads
  (``ld.relaxed.gpu``: ``LDG.E.STRONG.GPU``) between the mainloop and the first TMA store;
* sm_100a: the stock tcgen05 mainloop with 2-SM MMA (``UTCHMMA.2CTA``: bf16 and f16 share the
  opcode, their types are in the instruction descriptor the kernel moves into the register the
  MMA reads as ``idesc[...]``, decoded per ``cute/arch/mma_sm100_desc.hpp``), its commit
  (``UTCBAR.2CTA``), the tensor-memory allocation (``UTCATOMSWS.2CTA.FIND_AND_SET``), the
  accumulator loads (``LDTM``), 2-SM TMA loads (``UTMALDG.*.2CTA``), and no device asserts
  (``CALL.ABS.NOINC``: a build without ``-DNDEBUG``);
* before the first TMA load (``UTMALDG``): a spin — a loop with ``NANOSLEEP`` (exactly:
  ``NANOSLEEP.SYNCS`` is the stock mbarrier wait's back-off) and the global timer (its bound) —
  around an acquire at system scope (``ld.acquire.sys`` assembles to ``LDG.E.STRONG.SYS``
  followed by ``CCTL.IVALL``; a relaxed load has no ``CCTL.IVALL``), then the proxy fence
  ``FENCE.VIEW.ASYNC.G`` (``fence.proxy.async.global``) before the load;
* after the epilogue's last TMA store (``UTMASTG``): the store wait
  (``cp.async.bulk.wait_group 0``: ``DEPBAR.LE SB0, 0x0`` then ``CCTL.IVALL``; the stock
  ``.read`` form has no ``CCTL.IVALL``), the proxy fence, then the release at system scope
  (``st.release.sys``: ``MEMBAR.ALL.SYS`` before ``STG.E.STRONG.SYS``);
* a wait that gives up (a replayable call's trap, sm_90a and sm_100a): the compare-and-swap
  claiming the fault record, its three fields, a system fence, ``recorded`` (strong, system
  scope), then a system fence and ``BPT.TRAP`` (``trap_problems``; not among the checks the
  variants below were built against: its control is a made-up sequence missing each part).

"Before" and "after" are in address order: the producer's and the epilogue's code are laid
out as they run (a wait, then the loads; the stores, then the release). Each check was shown
to fail on a build of the kernel without its feature: ``test_each_check_fails_without_its_feature``
rebuilds those variants of each kernel's 16-bit family (9 minutes on two cores, so it runs only
when ``JAXOVERLAP_SASS_VARIANTS=1``).
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

pytestmark = pytest.mark.jax_independent  # the built binary read back: no JAX

ROOT = Path(__file__).resolve().parents[2]
KERNEL = "FlagWaitMainloop"  # in the mangled name of every fused kernel


def _fp8(atom: str, d: str) -> str:
    """An FP8 kernel's mangled name: its MMA atom (the mainloop comes first), then its
    epilogue's element D between the two strides of CollectiveEpilogue<..., void, StrideC, D,
    StrideD, fusion::Sm90TreeVisitor<...>> (Itanium ABI: S<id>_ a substitution, f float)."""
    return rf"{atom}.*EvS[0-9A-Z]*_{d}S[0-9A-Z]*_NS[0-9A-Z]*_6fusion15Sm90TreeVisitor"


# kernel: (a regular expression over its mangled name: its MMA atom, for FP8 also y's type;
# its tensor-core opcode, a regular expression: f16 inputs have no suffix; FP8 is QGMMA, K 32
# per instruction, the 128-column tile's N, whatever y)
E4M3 = r"QGMMA\.64x128x32\.F32\.E4M3\.E4M3"
DTYPES = {"bf16": ("F32BF16BF16", r"HGMMA\.64x256x16\.F32\.BF16"),
          "f16": ("F32F16F16", r"HGMMA\.64x256x16\.F32"),
          "e4m3_bf16": (_fp8("F32E4M3E4M3", "NS_10bfloat16_tE"), E4M3),
          "e4m3_f16": (_fp8("F32E4M3E4M3", "NS_6half_tE"), E4M3),
          "e4m3_f32": (_fp8("F32E4M3E4M3", "f"), E4M3),
          "e5m2e4m3_bf16": (_fp8("F32E5M2E4M3", "NS_10bfloat16_tE"),
                            r"QGMMA\.64x128x32\.F32\.E5M2\.E4M3")}
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


def _fused(sass: str, dtypes=DTYPES) -> dict[str, list[tuple[int, str]]]:
    """The fused kernels of a dump, by dtype."""
    kernels = {}
    for name, code in _functions(sass).items():
        if KERNEL in name:
            (dtype,) = [d for d, (mangled, _) in dtypes.items() if re.search(mangled, name)]
            assert dtype not in kernels, f"two {dtype} fused kernels"
            kernels[dtype] = code
    return kernels


def _base(text: list[str], i: int, reg: str) -> str:
    """What register ``reg`` holds at instruction ``i``: the parameter word it was last loaded
    from (``c[0x0][...]``), or the register itself (an address computed from one)."""
    writes = [u for u in text[:i] if re.match(rf"\S+ {reg},", u)]
    load = re.search(r"c\[0x0\]\[0x[0-9a-f]+\]", writes[-1]) if writes else None
    return load.group(0) if load else reg


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
        return any(re.match(r"NANOSLEEP(?!\.SYNCS)\b", t) for t in body) and any(
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


# ---- sm_100a ---------------------------------------------------------------------------------

# dtype: (regex over the mangled name, expected instruction-descriptor fields)
SM100_DTYPES = {"bf16": (r"10bfloat16_t.*SM100_MMA_F16BF16_2x1SM_SS", {"a_format": 1,
                                                                        "b_format": 1}),
                "f16": (r"6half_t.*SM100_MMA_F16BF16_2x1SM_SS", {"a_format": 0, "b_format": 0})}
SM100_PARTS = [("2-SM MMA (tcgen05.mma.cta_group::2)", r"^UTCHMMA\.2CTA\b"),
               ("its commit to an mbarrier (tcgen05.commit)", r"^UTCBAR\.2CTA\b"),
               ("the TMEM allocation (tcgen05.alloc)", r"^UTCATOMSWS\.2CTA\.FIND_AND_SET\b"),
               ("the accumulator's loads (tcgen05.ld)", r"^LDTM\.x\d+\b"),
               ("2-SM TMA loads", r"^UTMALDG\.\dD\.2CTA\b")]
# cute/arch/mma_sm100_desc.hpp InstrDescriptor: {field: (lowest bit, bits)}. Both 16-bit kinds:
# f32 accumulator, A K-major, B MN-major (row-major), N 256, M 256 (the 2-SM MMA tile).
IDESC_FIELDS = {"c_format": (4, 2), "a_format": (7, 3), "b_format": (10, 3), "a_major": (15, 1),
                "b_major": (16, 1), "n_dim": (17, 6), "m_dim": (24, 5)}
IDESC_COMMON = {"c_format": 1, "a_major": 0, "b_major": 1, "n_dim": 256 >> 3, "m_dim": 256 >> 4}


def sm100_tensor_core_problems(code, dtype) -> list[str]:
    problems = [f"no {what} ({regex})" for what, regex in SM100_PARTS
                if not any(re.search(regex, t) for _, t in code)]
    regs = {r for _, t in code if t.startswith("UTCHMMA")
            for r in re.findall(r"idesc\[(UR\d+)\]", t)}
    values = {int(m.group(2), 16) for _, t in code
              for m in [re.match(r"^UMOV (UR\d+), 0x([0-9a-f]+)$", t)] if m and m.group(1) in regs}
    decoded = [{k: (v >> lo) & ((1 << n) - 1) for k, (lo, n) in IDESC_FIELDS.items()}
               for v in values]
    want = {**IDESC_COMMON, **SM100_DTYPES[dtype][1]}
    if not any(d == want for d in decoded):
        problems.append(f"no UTCHMMA instruction descriptor for {dtype} ({want}); found {decoded}")
    if any(t.startswith("CALL.ABS.NOINC") for _, t in code):
        problems.append("device asserts (CALL.ABS.NOINC to __assertfail): built without -DNDEBUG")
    return problems


SM100_CHECKS = {"tensor cores": sm100_tensor_core_problems, "acquire spin": acquire_spin_problems,
                "release": release_problems}


def _sm100_problems(code, dtype) -> dict[str, list[str]]:
    return {name: (check(code, dtype) if name == "tensor cores" else check(code))
            for name, check in SM100_CHECKS.items()}


@pytest.fixture(scope="module")
def fused_sm100_sass(cuda):
    return _fused(_dump(cuda, "-sass", "-arch", "sm_100a"), SM100_DTYPES)


def test_the_sm100_fused_kernels_are_in_the_module(fused_sm100_sass):
    assert sorted(fused_sm100_sass) == sorted(SM100_DTYPES)


@pytest.mark.parametrize("dtype", sorted(SM100_DTYPES))
def test_fused_sm100_kernel_sass(fused_sm100_sass, dtype):
    assert _sm100_problems(fused_sm100_sass[dtype], dtype) == {n: [] for n in SM100_CHECKS}


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


def test_fused_kernels_are_arch_specific_cubins_without_ptx(cuda):
    """Arch-specific code runs on its architecture only and its PTX cannot be JIT-compiled for
    newer GPUs: the sm90 kernels ship as sm_90a cubins, the sm100 one as an sm_100a cubin,
    nothing else (other GPUs keep the chunked path)."""
    elf = _sections(_dump(cuda, "-elf"), "elf")
    archs = {(arch, "SM100_MMA" in body) for arch, body in elf if KERNEL in body}
    assert archs == {("sm_90a", False), ("sm_100a", True)}
    assert all(KERNEL not in body for _, body in _sections(_dump(cuda, "-ptx"), "ptx"))


# ---- the replayable call's trap (fused_gemm_sync.cuh WaitFlag, docs/gpu-internals.md §8) ----

# FusedGemmFault (fused_gemm_launch.h): timed_out (the claim) at 0, then flag, seen, epoch, and
# recorded, stored last with release.
FAULT_FIELDS, FAULT_RECORDED = (4, 8, 12), 16
_CLAIM = re.compile(r"ATOMG\.E\.CAS\S* PT, R\d+, (?:desc\[\w+\])?\[(R\d+)(?:\.64)?\]")
_STORE = re.compile(r"(STG\.E\S*) (?:desc\[\w+\])?\[(R\d+)\.64(?:\+(0x[0-9a-f]+))?\]")
_SYS_FENCES = ("MEMBAR.SC.SYS", "MEMBAR.ALL.SYS")  # __threadfence_system(), a release's


def _fenced_trap(code, start: int) -> bool:
    """Whether the code from ``start`` reaches BPT.TRAP behind a system fence, with no branch,
    exit or store first."""
    fenced = False
    for _, t in code[start:start + 12]:
        if t.startswith(_SYS_FENCES):
            fenced = True
        elif t.startswith("BPT.TRAP"):
            return fenced
        elif t.startswith(("BRA", "EXIT", "RET", "ST", "ATOM")):
            return False
    return False


def trap_problems(code) -> list[str]:
    """Each give-up of a wait: the compare-and-swap claiming the record (its address a parameter
    word, Launch::fault), then the record's three fields to that address, a system fence, the
    strong system-scope store of ``recorded``, and then — next (sm_100a: a branch skips it when
    the launch does not trap) or at the target of a branch right after (sm_90a lays it out
    apart) — a system fence and BPT.TRAP. A regression check of ptxas's output, as
    test_flag_wait_sass.py's, not a proof of the ordering."""
    text = [t for _, t in code]
    claims = [(i, _base(text, i, m.group(1))) for i, t in enumerate(text)
              for m in [_CLAIM.match(t)] if m]
    if not claims:
        return ["no compare-and-swap on a parameter's address (the record's claim, ATOMG.E.CAS)"]
    where = {a: j for j, (a, _) in enumerate(code)}
    problems = []
    for c, word in claims:
        stores: dict[int, tuple[int, str]] = {}
        for j in range(c + 1, min(c + 40, len(text))):
            m = _STORE.match(text[j])
            if m and _base(text, j, m.group(2)) == word:
                stores.setdefault(int(m.group(3) or "0", 16), (j, m.group(1)))
            if FAULT_RECORDED in stores:
                break
        if sorted(stores) != sorted((*FAULT_FIELDS, FAULT_RECORDED)):
            problems.append(f"the claim at {code[c][0]:#x} ({word}) is followed by stores at "
                            f"{sorted(stores)}, not the record's {FAULT_FIELDS} and "
                            f"{FAULT_RECORDED}")
            continue
        recorded, kind = stores[FAULT_RECORDED]
        if kind != "STG.E.STRONG.SYS":
            problems.append(f"recorded is stored with {kind}, not STG.E.STRONG.SYS")
        last_field = max(stores[f][0] for f in FAULT_FIELDS)
        if not any(t.startswith(_SYS_FENCES) for t in text[last_field + 1:recorded]):
            problems.append(f"no system fence between the fields and recorded ({code[c][0]:#x})")
        starts = [recorded + 1]
        for j in range(recorded + 1, min(recorded + 6, len(text))):
            if text[j].startswith("BRA"):
                target = int(text[j].rsplit("0x", 1)[1], 16)
                starts += [j + 1] + ([where[target]] if target in where else [])
        if not any(_fenced_trap(code, s) for s in starts):
            problems.append(f"no system fence and BPT.TRAP after recorded ({code[recorded][0]:#x})")
    return problems


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_fused_kernel_traps_after_its_record(fused_sass, dtype):
    assert trap_problems(fused_sass[dtype]) == []


@pytest.mark.parametrize("dtype", sorted(SM100_DTYPES))
def test_fused_sm100_kernel_traps_after_its_record(fused_sm100_sass, dtype):
    assert trap_problems(fused_sm100_sass[dtype]) == []


# The sm_90a layout: the trap apart, reached by a branch on Launch::trap.
_TRAPPING = [
    "LDC.64 R4, c[0x0][0x538]", "ATOMG.E.CAS.STRONG.GPU PT, R6, [R4], R6, R7",
    "STG.E desc[UR30][R4.64+0x4], R11", "STG.E desc[UR30][R4.64+0x8], R13",
    "LDC.64 R6, c[0x0][0x538]", "STG.E desc[UR30][R4.64+0xc], R9", "MEMBAR.SC.SYS",
    "MEMBAR.ALL.SYS", "STG.E.STRONG.SYS desc[UR30][R6.64+0x10], R23", "ULDC.U8 UR4, c[0x0][0x540]",
    "BRA 0xc0", "EXIT", "MEMBAR.SC.SYS", "BPT.TRAP 0x1"]


def test_the_trap_check_fails_without_a_fence_the_record_or_the_trap():
    """Control for the check itself: the sm_90a layout passes; without the fence before the trap,
    without the one before recorded, without a field, or without the trap, it does not."""
    def code(lines):
        return [(16 * i, t) for i, t in enumerate(lines)]

    def without(text):
        lines = list(_TRAPPING)
        lines[len(lines) - 1 - lines[::-1].index(text)] = "NOP"
        return code(lines)

    assert trap_problems(code(_TRAPPING)) == []
    assert trap_problems(without("MEMBAR.SC.SYS"))  # the trap's fence
    assert trap_problems(code([t if not t.startswith("MEMBAR") or i > 8 else "NOP"
                               for i, t in enumerate(_TRAPPING)]))
    assert trap_problems(without("STG.E desc[UR30][R4.64+0x8], R13"))
    assert trap_problems(without("BPT.TRAP 0x1"))
    assert trap_problems(code(_TRAPPING[:1] + _TRAPPING[2:]))  # no claim


# ---- each check against a build without its feature ----------------------------------------

SOURCES = ("cpp/cuda/fused/fused_gemm_sync.cuh", "cpp/cuda/fused/fused_gemm_kernel.cuh")
# kernel: (its object and source in the build, its checks, its dtypes)
KERNELS = {
    "sm90": ("jo_cuda_fused_gemm.dir/fused/fused_gemm_sm90.cu.o", "fused_gemm_sm90.cu",
             _problems, DTYPES),
    "sm100": ("jo_cuda_fused_gemm_sm100.dir/fused/fused_gemm_sm100.cu.o",
              "fused_gemm_sm100.cu", _sm100_problems, SM100_DTYPES),
}
_WAIT = "  if (cute::elect_one_sync()) WaitForTileRows<kTileRows>(w, tile);\n"
# name: (check that must fail, [(text in SOURCES, replacement)] or {kernel: [...]}, drop -DNDEBUG)
VARIANTS = {
    "no wait": ("acquire spin", [(_WAIT, "")], False),
    "relaxed wait": ("acquire spin", [("ld.acquire.sys.global.u32", "ld.relaxed.sys.global.u32")],
                     False),
    "no proxy fence before the loads": (
        "acquire spin", [("  __syncwarp();\n  FenceProxyAsyncGlobal();\n}", "  __syncwarp();\n}")],
        False),
    "no store wait": ("release", {
        "sm90": [("      WaitBulkStoresComplete();\n      FenceProxyAsyncGlobal();",
                  "      FenceProxyAsyncGlobal();")],
        "sm100": [("  if (r.flags == nullptr) return;\n  WaitBulkStoresComplete();\n",
                   "  if (r.flags == nullptr) return;\n")]}, False),
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


def _compile_variant(build: Path, tmp: Path, kernel: str, name: str, edits,
                     drop_ndebug: bool) -> str:
    """The kernel's 16-bit family's object (bf16 and f16) built by the build's own nvcc
    command from an edited copy of cpp/ (each edit's text once in SOURCES)."""
    obj, source = KERNELS[kernel][:2]
    obj = f"cpp/cuda/CMakeFiles/{obj}"
    command = subprocess.run(["ninja", "-C", str(build), "-t", "commands", obj],
                             capture_output=True, text=True, check=True).stdout.splitlines()[-1]
    src = tmp / f"{kernel}_{name.replace(' ', '_')}" / "cpp"
    for part in ("core", "cuda"):
        for f in (ROOT / "cpp" / part).rglob("*.[hc]*"):
            copy = src / f.relative_to(ROOT / "cpp")
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(f.read_text())
    files = {f: (src / Path(f).relative_to("cpp")).read_text() for f in SOURCES}
    for old, new in edits:
        (where,) = [f for f, text in files.items() if old in text]
        assert files[where].count(old) == 1, f"{name}: {old!r} is not once in {where}"
        files[where] = files[where].replace(old, new)
    for f, text in files.items():
        (src / Path(f).relative_to("cpp")).write_text(text)
    args = shlex.split(command)
    args = [a for a in args if not (drop_ndebug and a == "-DNDEBUG")]
    out = src.parent / "k.o"
    i = args.index("-MD")
    args[i:i + 5] = []  # -MD -MT <obj> -MF <dep>
    args = [f"-I{src}" if a == f"-I{ROOT}/cpp/cuda/.." else a for a in args]
    assert f"-I{src}" in args, f"the build's include of cpp/ is not in: {command}"
    args[args.index("-o") + 1] = str(out)
    args[args.index("-c") + 1] = str(src / "cuda" / "fused" / source)
    subprocess.run(args, cwd=build, check=True, capture_output=True, text=True)
    return subprocess.run([_cuobjdump(), "-sass", str(out)], capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.skipif(os.environ.get("JAXOVERLAP_SASS_VARIANTS") != "1",
                    reason="rebuilds 7 variants of each fused kernel (9 minutes on two cores): "
                           "set JAXOVERLAP_SASS_VARIANTS=1 to run it")
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_each_check_fails_without_its_feature(tmp_path, kernel):
    build = _build_dir()
    problems_of, dtypes = KERNELS[kernel][2:]

    def edits(spec):
        return spec.get(kernel, []) if isinstance(spec, dict) else spec

    with ThreadPoolExecutor(max_workers=2) as pool:
        dumps = dict(zip(VARIANTS, pool.map(
            lambda item: _compile_variant(build, tmp_path, kernel, item[0], edits(item[1][1]),
                                          item[1][2]),
            VARIANTS.items()), strict=True))
    for name, (failing, _, _) in VARIANTS.items():
        code = _fused(dumps[name], dtypes)["bf16"]
        problems = problems_of(code, "bf16")
        assert problems[failing], f"{kernel}, {name}: the {failing} check did not notice"
        assert all(not p for check, p in problems.items() if check != failing), (name, problems)
