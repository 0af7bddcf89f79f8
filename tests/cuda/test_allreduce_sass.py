"""The one-launch all-reduce as built (``cpp/cuda/kernels/allreduce_body.h``, docs/gpu-internals.md
§7), read back from ``_cuda``'s fatbinary with cuobjdump (as ``test_fused_sass.py`` does): no GPU
runs it here, so the instructions its ordering argument rests on are checked in the code the
driver would run, per instantiation (f32, bf16, f16 × access width × p2p / multicast).

* the compute_90 PTX: the flag release ``st.release.sys.global.b64`` and acquire
  ``ld.acquire.sys.global.b64`` (one per round), the alias proxy fences, the bounded wait's
  ``%globaltimer`` and ``nanosleep``; ``multimem.ld_reduce`` and ``multimem.st`` in the
  multicast ones and in no p2p one;
* the sm_90 SASS (and sm_80's, which carries the p2p ones): the release assembled as
  ``MEMBAR.ALL.SYS`` before ``STG.E.64.STRONG.SYS``, the acquire as ``LDG.E.64.STRONG.SYS``
  followed by ``CCTL.IVALL`` (a relaxed load has none; sm_80's schedule puts an instruction
  between them), the wait's spin a loop with
  ``NANOSLEEP``; multimem.ld_reduce assembled to ``LDGMC`` in the multicast ones only.
"""

from __future__ import annotations

import re

import pytest

from .test_fused_sass import _functions, _loops
from .test_multimem import _dump, _sections

pytestmark = pytest.mark.jax_independent  # the built binary read back: no JAX

KERNEL = "AllReduceKernel"
# 8 over p2p (f32: 4- and 16-byte accesses; bf16, f16: 2, 4, 16), 6 over multicast (4, 16).
P2P, MULTICAST = 8, 6


def _multicast(name: str) -> bool:
    """AllReduceBody<elem, bytes, kMulticast>: the bool is the mangled name's last literal."""
    return re.search(r"ELb([01])EEEE", name).group(1) == "1"


@pytest.fixture(scope="module")
def ptx(cuda) -> dict[str, str]:
    text = "".join(b for arch, b in _sections(_dump(cuda, "-ptx"), "ptx") if arch == "sm_90")
    entries = {}
    for part in re.split(r"(?=\.visible \.entry )", text):
        name = part.split("(", 1)[0].rsplit(" ", 1)[-1]
        if KERNEL in name:
            entries[name] = part
    return entries


@pytest.fixture(scope="module")
def sass(cuda) -> dict[str, dict[str, list[tuple[int, str]]]]:
    return {arch: {n: c for n, c in _functions(_dump(cuda, "-sass", "-arch", arch)).items()
                   if KERNEL in n} for arch in ("sm_90", "sm_80")}


def test_every_instantiation_is_built(ptx, sass):
    for found in (ptx, sass["sm_90"]):
        assert sum(not _multicast(n) for n in found) == P2P, sorted(found)
        assert sum(_multicast(n) for n in found) == MULTICAST, sorted(found)
    # sm_80 has no multimem: the p2p kernels only
    assert len(sass["sm_80"]) == P2P and not any(_multicast(n) for n in sass["sm_80"])


def test_ptx_has_the_release_acquire_and_fences(ptx):
    for name, body in ptx.items():
        assert body.count("st.release.sys.global.b64") >= 2, name  # rounds 0 and 1
        assert body.count("ld.acquire.sys.global.b64") >= 2, name
        assert "fence.proxy.alias" in body, name
        assert "%globaltimer" in body and "nanosleep" in body, name  # the bounded wait
        multimem = "multimem.ld_reduce" in body and "multimem.st" in body
        assert multimem == _multicast(name), name
        assert ("multimem." in body) == _multicast(name), name


def _release_and_acquire(code) -> tuple[int, int]:
    """(releases, acquires) in a function's SASS: a 64-bit strong system-scope store right
    after MEMBAR.ALL.SYS, and a 64-bit strong system-scope load followed by CCTL.IVALL (each
    within three instructions: the scheduler puts unrelated arithmetic between them)."""
    text = [t for _, t in code]
    releases = sum(1 for i, t in enumerate(text) if t.startswith("STG.E.64.STRONG.SYS")
                   and any(u.startswith("MEMBAR.ALL.SYS") for u in text[max(0, i - 3):i]))
    acquires = sum(1 for i, t in enumerate(text) if t.startswith("LDG.E.64.STRONG.SYS")
                   and any(u.startswith("CCTL.IVALL") for u in text[i + 1:i + 4]))
    return releases, acquires


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_sass_has_the_release_acquire_and_a_bounded_spin(sass, arch):
    for name, code in sass[arch].items():
        releases, acquires = _release_and_acquire(code)
        assert releases >= 2 and acquires >= 2, (arch, name, releases, acquires)
        nap = [a for a, t in code if t.startswith("NANOSLEEP")]
        assert nap and any(lo <= a <= hi for a in nap for lo, hi in _loops(code)), \
            f"{arch} {name}: no NANOSLEEP inside a loop (the wait's spin)"
        assert any("GLOBALTIMER" in t for _, t in code), f"{arch} {name}: no %globaltimer"
        load_reduce = any(t.startswith("LDGMC") for _, t in code)
        assert load_reduce == _multicast(name), f"{arch} {name}: LDGMC {load_reduce}"


def test_the_release_check_fails_on_a_relaxed_store():
    """The SASS check tells a release from a relaxed store (control for the check itself)."""
    release = [(0, "MEMBAR.ALL.SYS"), (16, "STG.E.64.STRONG.SYS desc[UR4][R2.64], R4")]
    relaxed = [(0, "STG.E.64.STRONG.SYS desc[UR4][R2.64], R4")]
    acquire = [(0, "LDG.E.64.STRONG.SYS R4, desc[UR4][R2.64]"), (16, "CCTL.IVALL")]
    load = [(0, "LDG.E.64.STRONG.SYS R4, desc[UR4][R2.64]"), (16, "IADD3 R1, R1, 1, RZ")]
    assert _release_and_acquire(release + acquire) == (1, 1)
    assert _release_and_acquire(relaxed + load) == (0, 0)
