"""The fused FP8 all-gather + GEMM and GEMM + reduce-scatter on the CUDA executor and the
fake's tile-level FP8 kernel.

The fake runs ``fused_gemm_fp8.cuh`` as ``cpp/cuda/fake/fake_fused_gemm.cc`` describes it:
128 x 128 tiles, w read K-major, Hopper's FP8 accumulator (``fp8_accumulator.h``) promoted into
float32 every 128 elements of K (CUTLASS's interval 4), each row scaled by its own shard's scale
slot times w's scale, a slot read before any flag of its shard is poisoned. The GPU kernel is
compiled only: nothing here has run on a GPU.

The values are chosen so that the expected results are worked out independently of the fake:
small integers (every partial sum exact in the accumulator's 14 bits) under power-of-two scales
give exact products, and one hand-derived case tells Hopper's promoted accumulator from float32
and from an unpromoted one.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from jaxoverlap import _kinds

from .fake_cases import NP, play, problem

# The CUDA executor on its fake, driven directly: no JAX.
pytestmark = pytest.mark.jax_independent

FUSED_FP8 = [(t.x, t.w, t.y) for t in _kinds.FUSED_FP8]
# (n, rows per shard, k, output columns, chunks, bidirectional): 96 and 160 rows per shard put
# shards' boundaries inside 128-row tiles (a tile straddles two shards, or three for 96 x 3),
# 136 columns are two 128-column tiles.
GRID = [
    (2, 96, 32, 16, 1, False),
    (3, 96, 64, 136, 2, True),
    (4, 160, 32, 16, 2, False),
    (8, 96, 48, 24, 3, True),
]


def _scales(n: int) -> tuple[list[float], list[float]]:
    """Per rank: x's scale (a distinct power of two per shard, so a row scaled by another
    shard's scale is off by an exact factor) and w's."""
    return [2.0 ** (r - 2) for r in range(n)], [2.0 ** -(r % 3) for r in range(n)]


def _inputs(dtypes, n, x_rows, k, nw, seed):
    """Per rank: small-integer x [1, x_rows, k] and w [k, nw] in their FP8 dtypes."""
    x_dtype, w_dtype, _ = dtypes
    rng = np.random.default_rng(seed)
    xs = [rng.integers(-2, 3, (1, x_rows, k)).astype(np.float32).astype(NP[x_dtype])
          for _ in range(n)]
    ws = [rng.integers(-2, 3, (k, nw)).astype(np.float32).astype(NP[w_dtype]) for _ in range(n)]
    return xs, ws


def _case(fake, transport, dtypes, n, rows, k, nw, chunks, bidi, seed, calls=1, fused=True):
    """One FP8 all-gather (fused, or chunked: a cuBLASLt GEMM per sub-chunk, exact too on these
    inputs) on fresh small-integer inputs: (outcome, expected ys)."""
    x_dtype, w_dtype, y_dtype = dtypes
    xs, ws = _inputs(dtypes, n, rows, k, nw, seed)
    sx, sw = _scales(n)
    p = problem("ag_matmul", transport, n, batch=1, rows=rows, k=k, nw=nw, dtype=x_dtype,
                w_dtype=w_dtype, out_dtype=y_dtype, chunks=chunks, bidirectional=bidi,
                fused=fused)
    out = play(fake, p, xs, [np.ascontiguousarray(w.T) for w in ws], calls=calls, x_scales=sx,
               w_scales=sw)
    # |sums| <= 4k < 2^10: exact in the accumulator; the scales' products are powers of two.
    gathered = np.concatenate([x.astype(np.float64) * s for x, s in zip(xs, sx, strict=True)],
                              axis=1)
    expected = [(gathered @ (w.astype(np.float64) * s)).astype(NP[y_dtype])
                for w, s in zip(ws, sw, strict=True)]
    return out, expected


def _rs_case(fake, transport, dtypes, n, rows, k, nw, chunks, seed):
    """One fused FP8 GEMM + reduce-scatter on fresh small-integer inputs: (outcome, expected
    ys). Each partial (|sum| <= 4k <= 256 times a power of two, at most 2^13) is exact in bf16,
    f16 and f32, their float32 sum too, so y is the float64 sum rounded once."""
    x_dtype, w_dtype, y_dtype = dtypes
    xs, ws = _inputs(dtypes, n, n * rows, k, nw, seed)
    sx, sw = _scales(n)
    p = problem("matmul_rs", transport, n, batch=1, rows=rows, k=k, nw=nw, dtype=x_dtype,
                w_dtype=w_dtype, out_dtype=y_dtype, chunks=chunks, bidirectional=False,
                fused=True)
    out = play(fake, p, xs, [np.ascontiguousarray(w.T) for w in ws], x_scales=sx, w_scales=sw)
    total = sum((x.astype(np.float64) * a) @ (w.astype(np.float64) * b)
                for x, w, a, b in zip(xs, ws, sx, sw, strict=True))
    return out, [total[:, r * rows:(r + 1) * rows].astype(NP[y_dtype]) for r in range(n)]


def _mismatch(out, expected, y_dtype) -> str:
    """"" when every rank's y is bit for bit the expected one, else what differs."""
    bits = np.dtype(f"u{np.dtype(NP[y_dtype]).itemsize}")  # bf16 and f16: 16 bits, f32: 32
    for r, (y, want) in enumerate(zip(out["ys"], expected, strict=True)):
        got = np.frombuffer(y, NP[y_dtype]).reshape(want.shape)
        if not np.array_equal(got.view(bits), want.view(bits)):
            bad = np.argwhere(got.view(bits) != want.view(bits))
            return f"rank {r}: {len(bad)} elements differ, first at {tuple(bad[0])}"
    return ""


@pytest.mark.parametrize("transport", ["p2p", "multicast"])
def test_the_fused_fp8_all_gather_is_exact_on_the_fake(fake, transport):
    """Every grid case (tiles straddling shards and sub-chunks, two N tiles), each FP8
    instantiation, 1 and 8 work queues, two calls back to back: one fused kernel per rank and
    call, every row scaled by its own shard's scale (distinct powers of two), bit for bit."""
    for i, ((n, rows, k, nw, chunks, bidi), connections) in enumerate(
            itertools.product(GRID, (1, 8))):
        dtypes = FUSED_FP8[i % len(FUSED_FP8)]
        fake.reset(fake.Config(connections=connections, sms=(132, 6)[i % 2], seed=i + 1))
        out, expected = _case(fake, transport, dtypes, n, rows, k, nw, chunks, bidi, seed=i,
                              calls=2)
        try:
            assert out["statuses"] == [None] * n, out["statuses"]
            assert out["drained"] and fake.errors() == [], fake.errors()
            assert _mismatch(out, expected, dtypes[2]) == ""
            assert fake.counters().get("cudaLaunchKernelEx") == 2 * n  # fused: one per call
        except AssertionError as e:
            e.add_note(f"in the case {(n, rows, k, nw, chunks, bidi, connections, dtypes)}")
            raise


def test_the_p2p_fp8_all_gather_at_uneven_speeds_is_exact(fake):
    """The p2p FP8 all-gather, chunked and fused, whose scales cross on the shards' own
    streams ahead of their data, each released by its shard's first flag only once it has
    landed (core/build_ag.cc): the ranks' host threads at uneven speeds (``host_jitter``), 1
    and 8 work queues, every grid case (N 2..8, 1..3 chunks, both directions), two calls back
    to back: every row scaled by its own shard's scale (distinct powers of two), bit for bit."""
    for i, ((n, rows, k, nw, chunks, bidi), fused) in enumerate(
            itertools.product(GRID, (False, True))):
        connections = (1, 8)[(i + i // 2) % 2]  # each program with 1 and with 8 queues
        dtypes = ("float8_e4m3fn", "float8_e4m3fn", "bfloat16")  # cuBLASLt's and the kernel's
        fake.reset(fake.Config(connections=connections, seed=i + 1, host_jitter=1 + i % 3))
        out, expected = _case(fake, "p2p", dtypes, n, rows, k, nw, chunks, not bidi, seed=i,
                              calls=2, fused=fused)
        try:
            assert out["statuses"] == [None] * n, out["statuses"]
            assert out["drained"] and fake.errors() == [], fake.errors()
            assert _mismatch(out, expected, dtypes[2]) == ""
        except AssertionError as e:
            e.add_note(f"in the case {(n, rows, k, nw, chunks, not bidi, connections, fused)}")
            raise


@pytest.mark.parametrize("transport", ["p2p", "multicast"])
def test_the_fused_fp8_gemm_reduce_scatter_is_exact_on_the_fake(fake, transport):
    """The overlapped FP8 GEMM + reduce-scatter: one release-only FP8 kernel per rank whose
    rows all take the rank's one x scale (a distinct power of two per rank), its partials in y's
    dtype reduced beside it (p2p: copies and a Reduce; multicast: McReduce) as each block is
    released; every grid case (blocks straddling 128-row tiles, two N tiles), each
    instantiation, on a full and a 6-SM device: bit for bit."""
    for i, (n, rows, k, nw, chunks, _) in enumerate(GRID):
        dtypes = FUSED_FP8[i % len(FUSED_FP8)]
        fake.reset(fake.Config(connections=(1, 8)[i % 2], sms=(132, 6)[i % 2], seed=i + 1))
        out, expected = _rs_case(fake, transport, dtypes, n, rows, k, nw, chunks, seed=i)
        try:
            assert out["statuses"] == [None] * n, out["statuses"]
            assert out["drained"] and fake.errors() == [], fake.errors()
            assert _mismatch(out, expected, dtypes[2]) == ""
            assert fake.counters().get("cudaLaunchKernelEx") == n  # fused: one per rank
        except AssertionError as e:
            e.add_note(f"in the case {(n, rows, k, nw, chunks, dtypes)}")
            raise


def test_the_fused_fp8_gemm_leaves_the_sms_its_own_tile_grid_spares(fake):
    """The release-only FP8 kernel's persistent grid is of its own 128 x 128 tiles
    (fused_tiles.h CtaTileOf), and the executor leaves the reduction beside it the SMs that cost
    that grid no wave (SpareSms, at most a quarter of the 64). N = 2, 4096 rows (32 M tiles) x
    256 columns: 64 units of 128 x 128, one wave on 64 SMs, two on any 60 or fewer, so it leaves
    the least, 2 (the 16-bit tile's 32 units of 128 x 256 would fit one wave on 48 and leave
    16); the result is exact."""
    fake.reset(fake.Config(sms=64, seed=7))
    dtypes = FUSED_FP8[0]
    out, expected = _rs_case(fake, "p2p", dtypes, 2, rows=2048, k=16, nw=256, chunks=2, seed=3)
    assert out["statuses"] == [None, None], out["statuses"]
    assert out["drained"] and fake.errors() == [], fake.errors()
    assert _mismatch(out, expected, dtypes[2]) == ""
    launched = {k: v for k, v in fake.counters().items() if k.startswith("fused GEMM on")}
    assert launched == {"fused GEMM on 62 SMs": 2}, launched


def test_the_fused_fp8_kernel_accumulates_as_hopper_with_promotion(fake):
    """Every row of x and column of w is [128, 1, 1, ..., 1] over K = 256, scales 1: the exact
    sum is 2^14 + 255, bf16 16640. Hopper's FP8 tensor cores keep 14 bits per block of 32
    (fp8_accumulator.h): the first block's 31 ones vanish below 2^14's last kept bit, and so
    does every later one while the running sum holds 2^14 — unpromoted, 16384. CUTLASS's
    mainloop promotes every 128 elements of K into float32 and restarts the tensor-core sum, so
    the second 128 ones count: 16384 + 128 = 16512, a bf16 value. Only that model gives it, in
    every e4m3 x e4m3 instantiation: 16512 is exact in bf16, f16 and f32 (so is float32
    accumulation's 16639 in f32)."""
    n, rows, k, nw = 2, 8, 256, 16
    e4m3 = NP["float8_e4m3fn"]
    vector = np.array([128.0] + [1.0] * (k - 1), np.float32)
    xs = [np.broadcast_to(vector, (1, rows, k)).astype(e4m3) for _ in range(n)]
    w_t = np.broadcast_to(vector, (nw, k)).astype(e4m3)  # K-major w: [nw, k]
    outputs = [t[2] for t in FUSED_FP8 if t[:2] == ("float8_e4m3fn", "float8_e4m3fn")]
    assert {"bfloat16", "float16", "float32"} <= set(outputs), outputs
    for y_dtype in outputs:
        fake.reset(fake.Config())
        p = problem("ag_matmul", "p2p", n, batch=1, rows=rows, k=k, nw=nw, dtype="float8_e4m3fn",
                    w_dtype="float8_e4m3fn", out_dtype=y_dtype, chunks=1, bidirectional=False,
                    fused=True)
        out = play(fake, p, xs, [w_t] * n, x_scales=[1.0] * n, w_scales=[1.0] * n)
        assert out["statuses"] == [None] * n and fake.errors() == [], fake.errors()
        assert fake.counters().get("cudaLaunchKernelEx") == n
        for y in out["ys"]:
            got = np.frombuffer(y, NP[y_dtype]).astype(np.float32)
            assert set(got.tolist()) == {16512.0}, (y_dtype, sorted(set(got.tolist())))


def test_a_tile_with_the_wrong_shards_scale_is_caught(fake):
    """A kernel that scales each row by the next shard's scale (Config.fused_scale_shard_shift,
    a wrong row -> shard mapping) either reads a shard's slot before any of its flags arrived
    (poisoned: the fake names the read) or scales by a real but wrong scale (an exact factor
    of two off: the comparison fails). On this grid both happen; the control (no shift) is the
    exactness test above."""
    caught = {"poisoned": False, "wrong": False}
    for i, (n, rows, k, nw, chunks, bidi) in enumerate(GRID):
        fake.reset(fake.Config(fused_scale_shard_shift=1, seed=i + 1))
        out, expected = _case(fake, "p2p", FUSED_FP8[0], n, rows, k, nw, chunks, bidi, seed=i)
        errors = fake.errors()
        poisoned = any("read the scale of shard" in e and "before any flag" in e for e in errors)
        wrong = _mismatch(out, expected, "bfloat16") != ""
        assert poisoned or wrong, (i, errors)
        caught["poisoned"] |= poisoned
        caught["wrong"] |= wrong and not poisoned
    assert caught == {"poisoned": True, "wrong": True}, caught


def test_fp8_fused_calls_the_kernel_is_not_built_for_are_refused(fake):
    """x e4m3 with w e5m2, or e5m2 x e4m3 with a float32 y: no instantiation
    (``_kinds.FUSED_FP8``); the call fails when its program is built, naming what is compiled
    and the way out, in either op."""
    for dtypes, op in [(("float8_e4m3fn", "float8_e5m2", "bfloat16"), "ag_matmul"),
                       (("float8_e5m2", "float8_e4m3fn", "float32"), "ag_matmul"),
                       (("float8_e4m3fn", "float8_e5m2", "bfloat16"), "matmul_rs")]:
        p = problem(op, "p2p", 2, batch=1, rows=8, k=32, nw=16, dtype=dtypes[0],
                    w_dtype=dtypes[1], out_dtype=dtypes[2], chunks=1, bidirectional=False,
                    fused=True)
        with pytest.raises(ValueError, match="chunked path") as info:
            fake.reset(fake.Config())
            x_rows = 8 if op == "ag_matmul" else 16
            xs = [np.zeros((1, x_rows, 32), NP[dtypes[0]])] * 2
            ws = [np.zeros((16, 32), NP[dtypes[1]])] * 2
            out = play(fake, p, xs, ws, x_scales=[1.0] * 2, w_scales=[1.0] * 2)
            if out["statuses"][0]:
                raise ValueError(out["statuses"][0])
        assert "fused" in str(info.value)


def test_the_sm100_kernel_refuses_fp8_at_prepare(fake):
    """The sm_100a build has no FP8 instantiation: an FP8 fused call on a 10.0 GPU fails before
    anything is enqueued, naming what it is built for and the way out."""
    fake.reset(fake.Config(cc_major=10, cc_minor=0))
    out, _ = _case(fake, "p2p", ("float8_e4m3fn", "float8_e4m3fn", "bfloat16"), 2, rows=8, k=32,
                   nw=16, chunks=1, bidi=False, seed=0)
    for status in out["statuses"]:
        assert status is not None and "bfloat16 and float16 only" in status, status
        assert "chunked path" in status
    assert out["drained"]
    assert fake.counters().get("cudaLaunchKernelEx") is None
