"""The device kernels' own code, run in CI on the fake.

Each thread of AddBlock, Reduce, McStore and McReduce runs ``cpp/cuda/kernels/kernel_body.h`` —
on a GPU compiled by nvcc, here compiled by the host compiler and run by the fake for every thread
of the grid, with only the GPU-only instructions (global loads/stores, multimem, fences, bf16/f16
conversion) behind the fake's ``FakeOps``. ``run_block`` goes through the real launchers
(``kernels_common.cc``: access width, geometry in accesses, grid), so what is checked here is the
index math, vector widths and offsets the GPU would run. The fake also models which compiled
variant of a kernel a device runs and that a trap kills the context (``fake_kernels.cc`` cites the
CUDA documentation for both).
"""

from __future__ import annotations

import collections

import ml_dtypes
import numpy as np
import pytest

from .fake_cases import check, run_case

# The CUDA executor on its fake, driven directly: no JAX.
pytestmark = pytest.mark.jax_independent

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
THREADS = 128  # kernel_body.h kThreads

# The build's fatbinary as of before this check existed: sm_80 + sm_90a, i.e. compute_80 PTX
# (no multimem: its multimem instructions are __trap()) and arch-specific compute_90a PTX.
OLD_BUILD = {"add": ["sm_80", "compute_80", "sm_90a", "compute_90a"],
             "multimem": ["sm_80", "compute_80", "sm_90a", "compute_90a"]}


def _index(batch, m, n, bs, ld, offset):
    """Element indices of a batched-strided block, shape (batch, m, n)."""
    b, r, c = np.meshgrid(np.arange(batch), np.arange(m), np.arange(n), indexing="ij")
    return offset + b * bs + r * ld + c


def _random(rng, dtype, size):
    return rng.standard_normal(size).astype(np.float32).astype(DTYPES[dtype])


def _bits(a):
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


# (batch, m, n, src_bs, src_ld, dst_bs, dst_ld, src_offset, dst_offset, access bytes of the
# launch: the widest width every address divides, after merging rows/batches that lie back to
# back). Offsets count elements; buffers start page-aligned.
LAYOUTS = {
    "float32": [
        ((2, 3, 8, 24, 8, 24, 8, 0, 0), 16),       # dense: one row of 48
        ((2, 3, 8, 40, 12, 36, 10, 0, 0), 8),      # strided rows; dst ld 40 bytes
        ((1, 3, 5, 15, 5, 15, 5, 0, 0), 4),        # dense, 60 bytes
        ((2, 2, 8, 16, 8, 16, 8, 1, 0), 4),        # the source starts 4 bytes in
        ((3, 2, 4, 12, 4, 16, 8, 0, 4), 16),       # padded destination, 16-byte offset
    ],
    "bfloat16": [
        ((3, 2, 16, 32, 16, 32, 16, 0, 0), 16),    # dense
        ((2, 3, 12, 48, 16, 64, 20, 0, 0), 8),     # rows of 24 bytes in 32/40-byte pitches
        ((1, 2, 6, 12, 6, 12, 6, 2, 2), 4),        # dense, 4-byte aligned starts
    ],
    "float16": [
        ((2, 3, 12, 48, 16, 64, 20, 0, 0), 8),
        ((2, 2, 8, 16, 8, 16, 8, 0, 8), 16),
    ],
}
ADD_ONLY = {  # odd 16-bit widths: AddBlock takes single elements, multimem refuses (pairs)
    "bfloat16": [((1, 3, 7, 21, 7, 21, 7, 0, 0), 2), ((2, 2, 5, 12, 6, 10, 5, 1, 0), 2)],
    "float16": [((1, 2, 3, 6, 3, 6, 3, 0, 1), 2)],
}


def _cases(table):
    return [(dtype, layout, width) for dtype, rows in table.items() for layout, width in rows]


def _ids(case):
    dtype, layout, width = case
    return f"{dtype}-{'x'.join(map(str, layout))}-{width}B"


def _extent(batch, m, n, bs, ld, offset):
    return int(_index(batch, m, n, bs, ld, offset).max()) + 1 + 16  # slack to catch stray writes


def _add(fake, dtype, layout, rng):
    batch, m, n, sbs, sld, dbs, dld, soff, doff = layout
    src = _random(rng, dtype, _extent(batch, m, n, sbs, sld, soff))
    dst = _random(rng, dtype, _extent(batch, m, n, dbs, dld, doff))
    out = fake.run_block("add", dtype, batch, m, n, sbs, sld, dbs, dld, soff, doff,
                         src=src.tobytes(), dst=dst.tobytes(), trace=True)
    want = dst.copy()
    si, di = _index(batch, m, n, sbs, sld, soff), _index(batch, m, n, dbs, dld, doff)
    want[di] = (dst[di].astype(np.float32) + src[si].astype(np.float32)).astype(DTYPES[dtype])
    return out, want, np.frombuffer(out["dst"], DTYPES[dtype])


@pytest.mark.parametrize("case", _cases(LAYOUTS) + _cases(ADD_ONLY), ids=_ids)
def test_add_block_is_exact(fake, case):
    dtype, layout, width = case
    out, want, got = _add(fake, dtype, layout, np.random.default_rng(1))
    assert out["status"] is None and out["drained"], (out["status"], fake.errors())
    assert fake.errors() == []
    assert out["access_bytes"] == width
    # f32 addition rounded once to the element type (round to nearest even), nothing else touched.
    np.testing.assert_array_equal(_bits(got), _bits(want))
    (trace,) = out["traces"]
    assert trace["variant"] == "sm_90"  # a fake Hopper runs the sm_90 cubin
    assert {a[7] for a in trace["accesses"]} == {width}


@pytest.mark.parametrize("case", _cases(LAYOUTS), ids=_ids)
@pytest.mark.parametrize("ranks", [2, 4])
def test_multicast_store_reaches_every_rank(fake, case, ranks):
    dtype, layout, width = case
    batch, m, n, sbs, sld, dbs, dld, soff, doff = layout
    rng = np.random.default_rng(2)
    src = _random(rng, dtype, _extent(batch, m, n, sbs, sld, soff))
    size = _extent(batch, m, n, dbs, dld, doff)
    memory = [_random(rng, dtype, size) for _ in range(ranks)]
    out = fake.run_block("mc_store", dtype, batch, m, n, sbs, sld, dbs, dld, soff, doff,
                         src=src.tobytes(), memory=[x.tobytes() for x in memory])
    assert out["status"] is None and out["drained"] and fake.errors() == []
    assert out["access_bytes"] == width
    si, di = _index(batch, m, n, sbs, sld, soff), _index(batch, m, n, dbs, dld, doff)
    for before, after in zip(memory, out["memory"], strict=True):
        want = before.copy()
        want[di] = src[si]
        np.testing.assert_array_equal(_bits(np.frombuffer(after, DTYPES[dtype])), _bits(want))


@pytest.mark.parametrize("case", _cases(LAYOUTS), ids=_ids)
@pytest.mark.parametrize("ranks", [2, 3])
def test_multicast_load_reduce_sums_every_rank(fake, case, ranks):
    dtype, layout, width = case
    batch, m, n, sbs, sld, dbs, dld, soff, doff = layout
    rng = np.random.default_rng(3)
    size = _extent(batch, m, n, sbs, sld, soff)
    memory = [_random(rng, dtype, size) for _ in range(ranks)]
    dst = _random(rng, dtype, _extent(batch, m, n, dbs, dld, doff))
    out = fake.run_block("mc_reduce", dtype, batch, m, n, sbs, sld, dbs, dld, soff, doff,
                         dst=dst.tobytes(), memory=[x.tobytes() for x in memory])
    assert out["status"] is None and out["drained"] and fake.errors() == []
    assert out["access_bytes"] == width
    si, di = _index(batch, m, n, sbs, sld, soff), _index(batch, m, n, dbs, dld, doff)
    got = np.frombuffer(out["dst"], DTYPES[dtype])
    total = sum(x.astype(np.float64)[si] for x in memory)
    ulp = {"float32": 2.0 ** -22, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}[dtype]
    np.testing.assert_allclose(got[di].astype(np.float64), total, rtol=ulp, atol=ulp)
    untouched = np.ones(got.shape, bool)
    untouched[di] = False
    np.testing.assert_array_equal(_bits(got[untouched]), _bits(dst[untouched]))


@pytest.mark.parametrize("kind", ["mc_store", "mc_reduce"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_multimem_refuses_odd_16_bit_blocks(fake, kind, dtype):
    (batch, m, n, sbs, sld, dbs, dld, soff, doff), _ = ADD_ONLY[dtype][0]
    buf = np.zeros(64, DTYPES[dtype]).tobytes()
    out = fake.run_block(kind, dtype, batch, m, n, sbs, sld, dbs, dld, soff, doff, src=buf,
                         dst=buf, memory=[buf, buf])
    assert "element pairs" in out["status"] and "transport='p2p'" in out["status"]
    assert fake.counters().get("cudaLaunchKernel", 0) == 0


def _check_grid_stride(trace, batch, m, cols, dst_bs, dst_ld, width, op):
    """Every access of the destination made once, by the thread grid-stride assigns it to."""
    gx, gy, gz = trace["grid"]
    stores = [a for a in trace["accesses"] if a[4] == op]
    offsets = collections.Counter(a[6] for a in stores)
    want = {(b * dst_bs + r * dst_ld) * width + j * width
            for b in range(batch) for r in range(m) for j in range(cols)}
    assert set(offsets) == want and set(offsets.values()) == {1}
    for bx, by, bz, tx, _, _, offset, _ in stores:
        # The layouts below do not overlap: an offset names its (batch, row, access) uniquely.
        b, rest = divmod(offset // width, dst_bs)
        r, j = divmod(rest, dst_ld)
        assert (b % gz, r % gy, j % (gx * THREADS)) == (bz, by, bx * THREADS + tx)


@pytest.mark.parametrize("shape", [
    # (batch, m, n, src_ld, dst_ld): f32, 16-byte accesses, rows that do not merge
    (2, 3, 44, 48, 52),       # one block per (batch, row); 11 threads busy per row
    (1, 2100, 4, 8, 4),       # more rows than the grid's 2048 blocks: rows grid-stride in y
    (2100, 1, 4, 8, 4),       # ... batches grid-stride in z (rows of one: batch strides differ)
])
def test_each_thread_does_what_grid_stride_assigns_it(fake, shape):
    """The trace of the fake's run is per thread (block and thread index) — the kernels' own loop
    in kernel_body.h, not a re-implementation looping over elements."""
    batch, m, n, sld, dld = shape
    sbs, dbs = m * sld, m * dld
    if m == 1:
        sbs, dbs = sld, dld
    src = np.arange(batch * sbs, dtype=np.float32)
    dst = np.zeros(batch * dbs, np.float32)
    out = fake.run_block("add", "float32", batch, m, n, sbs, sld, dbs, dld, src=src.tobytes(),
                         dst=dst.tobytes(), trace=True)
    assert out["status"] is None and fake.errors() == []
    (trace,) = out["traces"]
    cols = n // 4
    _check_grid_stride(trace, batch, m, cols, dbs // 4, dld // 4, 16, "s")
    assert trace["grid"][1] <= 2048 and trace["grid"][2] <= 2048


# (dtype, batch, m, n, dst (bs, ld, offset), sources [(bs, ld, offset)], sms, access bytes):
# the fused GEMM + RS's sum of N partials — the kernel's rows (ld N*R*n... here any strides) and
# the received slots — in the widest access every address divides; 0 SMs: the whole device.
REDUCE_CASES = [
    ("bfloat16", 2, 3, 16, (48, 16, 0), [(96, 16, 0), (48, 16, 0), (48, 16, 48 * 2)], 0, 16),
    ("bfloat16", 2, 3, 16, (64, 16, 8), [(96, 16, 16), (48, 16, 0)], 2, 16),
    ("float16", 1, 4, 12, (48, 12, 0), [(48, 12, 0), (64, 16, 0), (64, 16, 4), (48, 12, 0)], 1,
     8),
    ("float16", 1, 2, 5, (10, 5, 1), [(10, 5, 0), (10, 5, 3)], 0, 2),
    ("float32", 3, 2, 8, (16, 8, 0), [(16, 8, 0)] * 8, 0, 16),
    ("float32", 1, 300, 8, (2400, 8, 0), [(4800, 16, 0), (2400, 8, 0)], 1, 16),
]


@pytest.mark.parametrize("case", REDUCE_CASES, ids=lambda c: f"{c[0]}-{len(c[5])}x-sms{c[6]}")
def test_reduce_sums_its_sources_in_order_in_float32(fake, case):
    """d <- the sum of the sources in their order, in float32, rounded once; every destination
    access stored once by the thread grid-stride assigns it, after loading each source at the
    same (batch, row, column); the grid at most 16 blocks per SM of its budget."""
    dtype, batch, m, n, (dbs, dld, doff), sources, sms, width = case
    rng = np.random.default_rng(7)
    srcs = [_random(rng, dtype, _extent(batch, m, n, bs, ld, off)) for bs, ld, off in sources]
    dst = _random(rng, dtype, _extent(batch, m, n, dbs, dld, doff))
    out = fake.run_reduce(dtype, batch, m, n, dbs, dld, doff, dst.tobytes(),
                          [(x.tobytes(), bs, ld, off) for x, (bs, ld, off)
                           in zip(srcs, sources, strict=True)], sms=sms, trace=True)
    assert out["status"] is None and out["drained"], (out["status"], fake.errors())
    assert fake.errors() == []
    acc = np.zeros((batch, m, n), np.float32)
    for x, (bs, ld, off) in zip(srcs, sources, strict=True):
        acc = acc + x[_index(batch, m, n, bs, ld, off)].astype(np.float32)
    want = dst.copy()
    want[_index(batch, m, n, dbs, dld, doff)] = acc.astype(DTYPES[dtype])
    np.testing.assert_array_equal(_bits(np.frombuffer(out["dst"], DTYPES[dtype])), _bits(want))
    (trace,) = out["traces"]
    assert {a[7] for a in trace["accesses"]} == {width}
    gx, gy, gz = trace["grid"]
    assert sms == 0 or gx * gy * gz <= 16 * sms
    loads = collections.Counter((a[0], a[1], a[2], a[3]) for a in trace["accesses"] if a[4] == "l")
    stores = collections.Counter((a[0], a[1], a[2], a[3]) for a in trace["accesses"] if a[4] == "s")
    assert {t: loads[t] for t in stores} == {t: len(sources) * c for t, c in stores.items()}


def test_long_rows_grid_stride_in_x(fake):
    """A row longer than the grid (2048 blocks x 128 threads of 4-byte accesses)."""
    n = 2048 * THREADS + 1001
    src = np.random.default_rng(4).standard_normal(n).astype(np.float32)
    dst = np.ones(n, np.float32)
    out = fake.run_block("add", "float32", 1, 1, n, n, n, n, n, src=src.tobytes(),
                         dst=dst.tobytes())
    assert out["status"] is None and fake.errors() == []
    assert out["access_bytes"] == 4
    np.testing.assert_array_equal(np.frombuffer(out["dst"], np.float32), dst + src)


def test_multicast_store_releases_after_its_stores(fake):
    """Every McStore thread issues fence.proxy.alias then fence.acq_rel.sys after its last
    multimem.st (the release the consumers' flag relies on); McReduce threads start with the proxy
    fence; AddBlock has none."""
    layout = (2, 3, 8, 40, 12, 36, 10, 0, 0)
    batch, m, n, sbs, sld, dbs, dld, soff, doff = layout
    buf = np.zeros(512, np.float32).tobytes()
    for kind in ("mc_store", "mc_reduce"):
        out = fake.run_block(kind, "float32", batch, m, n, sbs, sld, dbs, dld, src=buf, dst=buf,
                             memory=[buf, buf], trace=True)
        assert out["status"] is None and fake.errors() == []
        (trace,) = out["traces"]
        by_thread = collections.defaultdict(list)
        for a in trace["accesses"]:
            by_thread[a[:4]].append(a[4])
        gx, gy, gz = trace["grid"]
        assert len(by_thread) == gx * gy * gz * THREADS  # every thread, busy or not
        for ops in by_thread.values():
            if kind == "mc_store":
                assert ops[-2:] == ["a", "f"] and "a" not in ops[:-2] and "f" not in ops[:-2]
            else:
                assert ops[0] == "a" and ops.count("a") == 1 and "f" not in ops
    src = np.zeros(64, np.float32).tobytes()
    out = fake.run_block("add", "float32", 1, 1, 16, 16, 16, 16, 16, src=src, dst=src, trace=True)
    assert not any(a[4] in "af" for a in out["traces"][0]["accesses"])


# ---------------------------------------------------------------- which variant runs


BUILT = {"add": ["sm_80", "sm_90", "compute_90"], "multimem": ["sm_90", "compute_90"]}


@pytest.mark.parametrize("images, cc, want", [
    # This build: a cubin of the same major revision (same or lower minor) ...
    (BUILT["multimem"], (9, 0), ("sm_90", False, 90)),
    (BUILT["add"], (8, 6), ("sm_80", False, 80)),
    (BUILT["add"], (8, 9), ("sm_80", False, 80)),
    # ... else the PTX of a lower-or-equal compute capability, JIT-compiled (Blackwell: 10.0, 12.0).
    (BUILT["multimem"], (10, 0), ("compute_90", True, 90)),
    (BUILT["multimem"], (12, 0), ("compute_90", True, 90)),
    (BUILT["add"], (10, 3), ("compute_90", True, 90)),
    # Nothing for older devices.
    (BUILT["multimem"], (8, 0), None),
    (BUILT["add"], (7, 5), None),
    # The old build: sm_90a runs on 9.0 only and its PTX never JITs for 10.0: compute_80 does.
    (OLD_BUILD["multimem"], (9, 0), ("sm_90a", False, 90)),
    (OLD_BUILD["multimem"], (10, 0), ("compute_80", True, 80)),
    (["sm_90a", "compute_90a"], (10, 0), None),
    # Family targets: the same major revision, an equal or higher minor one.
    (["sm_100f"], (10, 3), ("sm_100f", False, 100)),
    (["sm_100f", "compute_100f"], (11, 0), None),
    (["compute_100f"], (10, 3), ("compute_100f", True, 100)),
])
def test_the_variant_a_device_runs(fake, images, cc, want):
    got = fake.kernel_variant("multimem", *cc, images={"multimem": images})
    if want is None:
        assert got is None
        return
    image, jit, ptx = want
    assert (got["image"], got["jit"], got["ptx_version"]) == (image, jit, ptx)
    assert got["binary_version"] == (cc[0] * 10 + cc[1] if jit else ptx)


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_multicast_runs_on_blackwell(fake, op, dtype):
    """A fake B200 (10.0) runs the multimem kernels from this build's sm_100 cubin."""
    fake.reset(fake.Config(cc_major=10))
    out, xs, ws = run_case(fake, op, "multicast", 4, rows=4, chunks=2, dtype=dtype)
    check(fake, out, op, xs, ws, 4, dtype)
    assert fake.counters()["cudaFuncGetAttributes"] > 0


def test_the_launcher_refuses_a_variant_without_multimem(fake):
    """The old build on a fake Blackwell: the launcher asks cudaFuncGetAttributes which variant
    the device runs (compute_80: no multimem) and refuses before any launch — no trap. A peer
    may have queued a flag wait by then (which one depends on the host threads' timing): the
    watchdog releases it after the call's timeout, here on the fake's virtual clock."""
    fake.reset(fake.Config(cc_major=10, kernel_images=OLD_BUILD, grace_ms=2000))
    out, *_ = run_case(fake, "matmul_rs", "multicast", 2, timeout_ms=1000)
    for status in out["statuses"]:
        assert "compute_80" in status and "no multimem" in status and "sm_100" in status
    assert fake.counters().get("McReduce", 0) == 0
    assert fake.errors() == []


def test_the_launcher_names_a_device_without_any_variant(fake):
    fake.reset(fake.Config(cc_major=8))
    out, *_ = run_case(fake, "ag_matmul", "multicast", 2)
    for status in out["statuses"]:
        assert "sm_80" in status and "needs an sm_90" in status
    assert fake.counters().get("McStore", 0) == 0


def test_a_trap_is_sticky(fake):
    """Deliberate misuse: a multimem kernel launched on a fake Blackwell whose only variant of it
    without arch-specific code is compute_80 PTX (the old build) — bypassing the launcher's check.
    The device code's __trap() poisons the context: every later call on it fails, and
    cudaGetLastError keeps answering cudaErrorIllegalInstruction."""
    fake.reset(fake.Config(devices=1, cc_major=10, kernel_images=OLD_BUILD))
    got = fake.trap_check()
    sticky = got["illegal_instruction"]
    assert got["launch"] == 0  # launches are asynchronous: the trap comes later
    assert any("trapped" in e and "compute_80" in e for e in got["errors"]), got["errors"]
    assert got["memset_after"] != 0
    assert got["last_error"] == got["last_error_again"] == sticky
    assert got["launch_after"] == got["attributes_after"] == sticky


def test_this_build_never_traps_on_blackwell(fake):
    """The same launch with this build's variants: compute_90 PTX has the multimem instructions."""
    fake.reset(fake.Config(devices=1, cc_major=10))
    got = fake.trap_check()
    assert got["errors"] == [] and got["memset_after"] == 0 and got["last_error"] == 0
