"""The bounded flag wait as built (``cpp/cuda/kernels/flag_wait_body.h``, docs/gpu-internals.md §8,
"A dead peer"), read back from ``_cuda``'s fatbinary with cuobjdump as ``test_allreduce_sass.py``
does: no GPU runs it here, so what its ordering argument rests on is checked in the code the
driver would run.

* the compute_90 PTX: the flag's ``ld.acquire.sys.global.b32``, the bound's ``%globaltimer``
  and ``nanosleep``, the fault record's ``fence.acq_rel.sys`` before its code;
* the sm_90 and sm_80 SASS: the acquire assembled as ``LDG.E.STRONG.SYS`` (32-bit) followed by
  ``CCTL.IVALL`` (a relaxed load has none: the fault record's read is one), at least twice (the
  first poll and the spin's), a ``NANOSLEEP`` inside a loop that holds an acquire, the
  ``GLOBALTIMER`` read, and the record's code stored after ``MEMBAR.ALL.SYS``.
"""

from __future__ import annotations

import pytest

from .test_fused_sass import _functions, _loops
from .test_multimem import _dump, _sections

pytestmark = pytest.mark.jax_independent  # the built binary read back: no JAX

KERNEL = "FlagWaitEntry"


@pytest.fixture(scope="module")
def ptx(cuda) -> str:
    text = "".join(b for arch, b in _sections(_dump(cuda, "-ptx"), "ptx") if arch == "sm_90")
    start = text.index(f"{KERNEL}ENS1_2fw4ArgsE(")
    return text[start:text.index("\n}\n", start)]


@pytest.fixture(scope="module")
def sass(cuda) -> dict[str, list[list[tuple[int, str]]]]:
    return {arch: [c for n, c in _functions(_dump(cuda, "-sass", "-arch", arch)).items()
                   if KERNEL in n] for arch in ("sm_90", "sm_80")}


def _acquires(code) -> list[int]:
    """Addresses of 32-bit strong system-scope loads followed by CCTL.IVALL within five
    instructions (the scheduler puts unrelated arithmetic between them: four instructions
    apart in the sm_80 spin)."""
    text = [t for _, t in code]
    return [code[i][0] for i, t in enumerate(text)
            if t.startswith("LDG.E.STRONG.SYS") and any(u.startswith("CCTL.IVALL")
                                                         for u in text[i + 1:i + 6])]


def test_ptx_has_the_acquire_the_bound_and_the_fence(ptx):
    assert ptx.count("ld.acquire.sys.global.b32") >= 2, ptx  # the first poll and the spin's
    assert "%globaltimer" in ptx and "nanosleep" in ptx, ptx
    assert ptx.index("fence.acq_rel.sys") < ptx.rindex("st.relaxed.sys.global.b32"), ptx


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_sass_has_the_acquire_in_a_bounded_spin(sass, arch):
    assert len(sass[arch]) == 1, f"{arch}: {len(sass[arch])} {KERNEL} functions"
    code = sass[arch][0]
    acquires = _acquires(code)
    assert len(acquires) >= 2, (arch, acquires)
    loops = _loops(code)
    naps = [a for a, t in code if t.startswith("NANOSLEEP")]
    assert any(lo <= n <= hi and any(lo <= q <= hi for q in acquires)
               for n in naps for lo, hi in loops), f"{arch}: no NANOSLEEP and acquire in a loop"
    assert any("GLOBALTIMER" in t for _, t in code), f"{arch}: no %globaltimer"
    text = [t for _, t in code]
    fence = max(i for i, t in enumerate(text) if t.startswith("MEMBAR.ALL.SYS"))
    assert any(t.startswith("STG.E.STRONG.SYS") for t in text[fence + 1:fence + 5]), \
        f"{arch}: the fault record's code is not stored right after MEMBAR.ALL.SYS"


def test_the_acquire_check_fails_on_a_relaxed_load():
    """Control for the check itself: a strong load without the invalidation is not an acquire."""
    acquire = [(0, "LDG.E.STRONG.SYS R0, desc[UR6][R2.64]"), (16, "CCTL.IVALL")]
    relaxed = [(0, "LDG.E.STRONG.SYS R4, desc[UR6][R10.64]"), (16, "ISETP.NE.AND P0, PT, R4")]
    assert _acquires(acquire) == [0]
    assert _acquires(relaxed) == []
