"""The bounded flag wait as built (``cpp/cuda/kernels/flag_wait_body.h``, docs/gpu-internals.md §8,
"A dead peer"), read back from ``_cuda``'s fatbinary with cuobjdump as ``test_allreduce_sass.py``
does: no GPU runs it here, so the code the driver would run is checked to keep what the PTX
asks for. NVIDIA documents no SASS semantics: the mapping below (``ld.acquire.sys`` assembled
as ``LDG.E.STRONG.SYS`` then ``CCTL.IVALL``; ``fence.acq_rel.sys`` as ``MEMBAR.ALL.SYS``; ``trap``
as ``BPT.TRAP``) is read off ptxas's output, so this is a regression check of the compiler's
output, not a proof of the ordering (which rests on the PTX ISA).

* the compute_90 PTX: the flag's ``ld.acquire.sys.global.b32`` on the address of the kernel's
  first parameter word (``Args::flag``), the bound's ``%globaltimer`` and ``nanosleep``, the
  fault record's ``fence.acq_rel.sys`` before its code, then ``membar.sys`` and ``trap``;
* the SASS of every cubin built (sm_80, sm_90, sm_100): an acquire of the flag (its address
  loaded from the parameter's first word) inside a loop with a ``NANOSLEEP``, the ``GLOBALTIMER``
  read, the record's four fields stored before a ``MEMBAR.ALL.SYS``, its code (the lowest offset
  of the five stores) after it, then another ``MEMBAR.ALL.SYS`` and the ``BPT.TRAP``.
"""

from __future__ import annotations

import re

import pytest

from .test_fused_sass import _base, _functions, _loops
from .test_multimem import _dump, _sections

pytestmark = pytest.mark.jax_independent  # the built binary read back: no JAX

KERNEL = "FlagWaitEntry"


@pytest.fixture(scope="module")
def ptx(cuda) -> str:
    text = "".join(b for arch, b in _sections(_dump(cuda, "-ptx"), "ptx") if arch == "sm_90")
    start = text.index(f"{KERNEL}ENS1_2fw4ArgsE(")
    return text[start:text.index("\n}\n", start)]


ARCHS = ("sm_80", "sm_90", "sm_100")
# Where each architecture's SASS reads the kernel's parameters from (constant bank 0): Args::flag
# is their first word.
PARAMS = {"sm_80": 0x160, "sm_90": 0x210, "sm_100": 0x380}


@pytest.fixture(scope="module")
def sass(cuda) -> dict[str, list[list[tuple[int, str]]]]:
    return {arch: [c for n, c in _functions(_dump(cuda, "-sass", "-arch", arch)).items()
                   if KERNEL in n] for arch in ARCHS}


def _acquires(code, params: int | None = None) -> list[int]:
    """Addresses of 32-bit strong system-scope loads followed by CCTL.IVALL within five
    instructions (the scheduler puts unrelated arithmetic between them: four instructions
    apart in the sm_80 spin); with ``params``, only those whose address register was last
    loaded from the parameter word at that constant-bank offset (the flag's pointer)."""
    text = [t for _, t in code]
    found = []
    for i, t in enumerate(text):
        if not (t.startswith("LDG.E.STRONG.SYS")
                and any(u.startswith("CCTL.IVALL") for u in text[i + 1:i + 6])):
            continue
        if params is not None:
            reg = re.search(r"\[(R\d+)\.64", t)
            if reg is None:
                continue
            writes = [u for u in text[:i] if re.match(rf"\S+ {reg.group(1)},", u)]
            if not writes or f"c[0x0][{params:#x}]" not in writes[-1]:
                continue
        found.append(code[i][0])
    return found


def _record_stores(text: list[str]) -> tuple[dict[int, int], int]:
    """The fault record's stores: {offset: instruction index} of the strong system-scope
    stores to one base (a register, or several loaded from one parameter word): five, the code
    and four fields; and the index of the code's (the lowest offset)."""
    stores: dict[str, dict[int, int]] = {}
    for i, t in enumerate(text):
        m = re.match(r"STG\.E\.STRONG\.SYS (?:desc\[\w+\])?\[(R\d+)\.64(?:\+(-?0x[0-9a-f]+))?\]",
                     t)  # an offset: "+0x8", or "+-0x4" below the register
        if m:
            stores.setdefault(_base(text, i, m.group(1)), {})[int(m.group(2) or "0", 16)] = i
    five = [group for group in stores.values() if len(group) == 5]
    assert len(five) == 1, stores
    offsets = five[0]
    code = min(offsets)
    assert sorted(offsets) == [code, code + 8, code + 12, code + 16, code + 20], offsets
    return offsets, offsets[code]


def test_ptx_has_the_acquire_the_bound_the_fence_and_the_trap(ptx):
    flag = re.search(r"ld\.param\.u64\s+(%rd\d+), \[\w+_param_0\];", ptx)
    assert flag, ptx
    assert re.search(rf"ld\.acquire\.sys\.global\.b32\s+%r\d+, \[{flag.group(1)}\];", ptx), ptx
    assert "%globaltimer" in ptx and "nanosleep" in ptx, ptx
    code = ptx.rindex("st.relaxed.sys.global.b32")
    assert ptx.index("fence.acq_rel.sys") < code < ptx.rindex("membar.sys") \
        < ptx.index("trap;"), ptx


@pytest.mark.parametrize("arch", ARCHS)
def test_sass_has_the_acquire_in_a_bounded_spin_and_the_record_before_the_trap(sass, arch):
    assert len(sass[arch]) == 1, f"{arch}: {len(sass[arch])} {KERNEL} functions"
    code = sass[arch][0]
    acquires = _acquires(code, PARAMS[arch])
    assert acquires, f"{arch}: no acquire of the flag's address"
    loops = _loops(code)
    naps = [a for a, t in code if t.startswith("NANOSLEEP")]
    assert any(lo <= n <= hi and any(lo <= q <= hi for q in acquires)
               for n in naps for lo, hi in loops), f"{arch}: no NANOSLEEP and acquire in a loop"
    assert any("GLOBALTIMER" in t for _, t in code), f"{arch}: no %globaltimer"
    text = [t for _, t in code]
    offsets, stored = _record_stores(text)
    fields = [i for off, i in offsets.items() if i != stored]
    fences = [i for i, t in enumerate(text) if t.startswith(("MEMBAR.ALL.SYS", "MEMBAR.SC.SYS"))]
    traps = [i for i, t in enumerate(text) if t.startswith("BPT.TRAP")]
    assert any(max(fields) < f < stored for f in fences), \
        f"{arch}: no fence between the fields and the code"
    assert traps and any(stored < f < min(t for t in traps if t > stored) for f in fences), \
        f"{arch}: the trap does not follow the record's code behind a fence"
    assert not any(t < stored for t in traps), f"{arch}: a trap before the record is written"


def test_the_acquire_check_fails_on_a_relaxed_load_or_another_address():
    """Control for the check itself: a strong load without the invalidation is not an acquire,
    and an acquire of another parameter's address is not the flag's."""
    acquire = [(0, "LDC.64 R2, c[0x0][0x210]"), (8, "LDG.E.STRONG.SYS R0, desc[UR6][R2.64]"),
               (16, "CCTL.IVALL")]
    relaxed = [(0, "LDC.64 R2, c[0x0][0x210]"), (8, "LDG.E.STRONG.SYS R4, desc[UR6][R2.64]"),
               (16, "ISETP.NE.AND P0, PT, R4")]
    other = [(0, "LDC.64 R2, c[0x0][0x230]"), (8, "LDG.E.STRONG.SYS R0, desc[UR6][R2.64]"),
             (16, "CCTL.IVALL")]
    assert _acquires(acquire, 0x210) == [8]
    assert _acquires(relaxed, 0x210) == []
    assert _acquires(other, 0x210) == []


def test_the_record_check_fails_on_a_missing_field():
    text = ["STG.E.STRONG.SYS [R2.64+0x4], R5", "STG.E.STRONG.SYS [R2.64+0x8], R9",
            "STG.E.STRONG.SYS [R2.64+0xc], R7", "MEMBAR.ALL.SYS",
            "STG.E.STRONG.SYS [R2.64+-0x4], R1"]
    with pytest.raises(AssertionError):
        _record_stores(text)
