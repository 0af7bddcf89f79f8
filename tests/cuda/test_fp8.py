"""FP8 through the CUDA executor on the host-side fake (docs/gpu-internals.md §6).

The executor's FP8 GEMMs are cuBLASLt's: A/B scale pointers per GEMM (an all-gather's chunk
names its shard's scale, moved with the shard), float32 compute without fast accumulation,
the TN layout (w arrives K-major: the native primitive asks XLA for it), C and D of the output
type. The fake enforces cuBLASLt's FP8 rules as the cuBLAS documentation states them
(``fake_cublaslt.cc``; one deliberate misuse each below) and computes the GEMMs itself,
accumulating as the FP8 tensor cores do (``fp8_accumulator.h``: a truncating block FMA of
13 fraction bits on compute capability 8.9 and 9.0, promoted into float32 every 128 elements of
K), so every op and transport is compared here with the float64 product of the float32
dequantized operands, under the selftest's bound with that accumulator's term. Nothing of this
has run on a GPU.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from jaxoverlap import _selftest
from jaxoverlap._selftest import _compare, bound

from .fake_cases import NP, OPS, TRANSPORTS, play, problem

# The CUDA executor on its fake, driven directly: no JAX.
pytestmark = pytest.mark.jax_independent

# (x, w, y): every FP8 pairing cuBLASLt has, each output type.
FP8 = [("float8_e4m3fn", "float8_e4m3fn", "bfloat16"),
       ("float8_e4m3fn", "float8_e5m2", "float32"),
       ("float8_e5m2", "float8_e4m3fn", "float16")]


def fp8_case(fake, op, transport, n, dtypes, *, batch=2, rows=4, k=32, nw=16, chunks=1,
             bidirectional=False, return_gathered=False, calls=1, seed=0, block_scaled=False,
             **run):
    """Runs one call per rank: x and w of `dtypes`, every rank with its own scales; returns the
    outcome and, per rank, the float64 factors of its exact result (dequantized in float32)."""
    x_dtype, w_dtype, out = dtypes
    rng = np.random.default_rng(seed)
    x_rows = rows if op == "ag_matmul" else rows * n
    xs = [(rng.standard_normal((batch, x_rows, k)) * 3).astype(NP[x_dtype]) for _ in range(n)]
    ws = [(rng.standard_normal((k, nw)) * 3).astype(NP[w_dtype]) for _ in range(n)]
    sx = [np.float32(0.5 * (1 + 0.37 * r)) for r in range(n)]
    sw = [np.float32(1.25 - 0.1 * r) for r in range(n)]
    p = problem(op, transport, n, batch=batch, rows=rows, k=k, nw=nw, dtype=x_dtype,
                chunks=chunks, bidirectional=bidirectional, return_gathered=return_gathered,
                w_dtype=w_dtype, out_dtype=out, **({"block_scaled": True} if block_scaled else {}))
    # an fp8 w arrives K-major: [nw, k] row-major (cuda/gemm/gemm.h)
    result = play(fake, p, xs, [np.ascontiguousarray(w.T) for w in ws], calls=calls, x_scales=sx,
                  w_scales=sw, **run)
    xd = [(x.astype(np.float32) * s).astype(np.float64) for x, s in zip(xs, sx, strict=True)]
    wd = [(w.astype(np.float32) * s).astype(np.float64) for w, s in zip(ws, sw, strict=True)]
    if op == "ag_matmul":
        gathered = np.concatenate(xd, axis=1)
        factors = [(gathered, w) for w in wd]
    else:
        xk, wk = np.concatenate(xd, axis=2), np.concatenate(wd, axis=0)
        factors = [(xk if op == "matmul_ar" else xk[:, r * rows:(r + 1) * rows], wk)
                   for r in range(n)]
    return result, factors, xs


def check_fp8(fake, op, out, factors, dtypes, n, k, xs=None):
    assert out["statuses"] == [None] * n, out["statuses"]
    assert out["drained"], fake.errors()
    assert fake.errors() == []
    for r, (y, (a, b)) in enumerate(zip(out["ys"], factors, strict=True)):
        ref = a @ b
        got = np.frombuffer(y, NP[dtypes[2]]).reshape(ref.shape).astype(np.float64)
        ok, detail = _compare(np, got, ref, bound(op, dtypes[2], n, k, a, b, fp8=True))
        assert ok, f"rank {r}: {detail}"
    if op == "matmul_ar":
        assert all(y == out["ys"][0] for y in out["ys"]), "ranks' sums differ"
    if xs is not None:  # x_gathered: every shard's fp8 bytes
        whole = np.concatenate(xs, axis=1).tobytes()
        assert all(g == whole for g in out["x_gathered"])


CASES = [(2, 1, False), (3, 2, True), (4, 2, False), (4, 1, True), (8, 2, True)]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fp8_every_op_matches_the_dequantized_reference(fake, transport):
    """Every op, N 2..8, chunks, both ring directions, each FP8 pairing and output type, per-rank
    scales: within one rounding of y (reductions in y's dtype) of the float64 product of the
    dequantized operands; x_gathered holds the fp8 bytes."""
    for i, (n, chunks, bidir) in enumerate(CASES):
        dtypes = FP8[(i + TRANSPORTS.index(transport)) % len(FP8)]
        for j, op in enumerate(OPS):
            fake.reset()
            gathered = op == "ag_matmul" and i % 2 == 0
            out, factors, xs = fp8_case(fake, op, transport, n, dtypes, chunks=chunks,
                                        bidirectional=bidir, return_gathered=gathered, seed=i + j)
            try:
                check_fp8(fake, op, out, factors, dtypes, n, 32, xs if gathered else None)
            except AssertionError as e:
                e.add_note(f"in the case {(op, n, chunks, bidir, dtypes)}")
                raise


def test_fp8_back_to_back_calls_and_a_scale_per_gemm(fake):
    """Five calls queued before the fake GPU runs any, on every transport: the scale pointers
    are set on the cached plan's descriptor before each matmul (a host-side update, allowed on
    the enqueue path), so every chunk's GEMM gets its own shard's scale."""
    for key, transport in enumerate(TRANSPORTS, 40):
        fake.reset(fake.Config(seed=key))
        out, factors, _ = fp8_case(fake, "ag_matmul", transport, 4, FP8[0], chunks=2,
                                   bidirectional=True, calls=5, clique_key=key)
        check_fp8(fake, "ag_matmul", out, factors, FP8[0], 4, 32)
        counters = fake.counters()
        gemms = counters["cublasLtMatmul"]
        # two scale pointers per matmul (warm-ups included), FAST_ACCUM and TRANSA per plan
        assert counters["cublasLtMatmulDescSetAttribute"] >= 2 * gemms


@pytest.mark.parametrize("connections", [1, 8])
def test_fp8_all_gathers_complete_through_the_work_queues(fake, connections):
    """The scale transfers add ops before a shard's first flag or in its NCCL group: every fp8
    all-gather program, N 2..8, chunks, both directions, still completes with one hardware work
    queue per device (and eight) in the executor's issue order, with the right result."""
    for transport, n, chunks, bidir in itertools.product(TRANSPORTS, (2, 3, 5, 8), (1, 3),
                                                         (False, True)):
        fake.reset(fake.Config(connections=connections, seed=1 + 8 * n + 2 * chunks + bidir))
        out, factors, _ = fp8_case(fake, "ag_matmul", transport, n, FP8[n % 3], batch=1,
                                   rows=3, chunks=chunks, bidirectional=bidir)
        try:
            check_fp8(fake, "ag_matmul", out, factors, FP8[n % 3], n, 32)
        except AssertionError as e:
            e.add_note(f"in the case {(transport, n, chunks, bidir)}")
            raise


@pytest.mark.parametrize("config,dtypes,k,reason", [
    (dict(cc_major=8, cc_minor=0), FP8[0], 32, "compute capability 8.9 or newer"),
    ({}, FP8[0], 24, "16-byte aligned, so k a multiple of 16"),
    ({}, ("float8_e4m3fn", "bfloat16", "bfloat16"), 32, "take two fp8 operands"),
    ({}, ("float8_e5m2", "float8_e5m2", "bfloat16"), 32, "no float8_e5m2 x float8_e5m2"),
])
def test_fp8_gemms_the_gpu_cannot_run_fail_at_prepare(fake, config, dtypes, k, reason):
    """A GPU without FP8 GEMMs (before sm_89), a k that breaks cuBLASLt's 16-byte rule, or a
    type pairing cuBLASLt lacks: every rank gets an error naming the rule at prepare, before
    anything is enqueued — never a crash, and the fake sees no misuse."""
    fake.reset(fake.Config(**config))
    out, _, _ = fp8_case(fake, "matmul_rs", "p2p", 2, dtypes, k=k)
    assert all(s and reason in s for s in out["statuses"]), out["statuses"]
    assert fake.errors() == [] and fake.counters().get("cublasLtMatmul", 0) == 0


# (batch, m, n, src_bs, src_ld, dst_bs, dst_ld, src_offset, dst_offset) in fp8 elements (bytes),
# and the access width the launcher picks: 16 (two .b64 stores), 8 (.b64) or 4 (.b32).
FP8_STORES = [((2, 3, 32, 96, 32, 96, 32, 0, 0), 16),
              ((2, 3, 24, 80, 24, 96, 40, 0, 0), 8),
              ((1, 2, 12, 24, 12, 48, 20, 4, 8), 4)]


@pytest.mark.parametrize("layout,width", FP8_STORES)
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_multicast_store_moves_the_bits_to_every_rank(fake, dtype, layout, width):
    """The multicast all-gather stores fp8 shards through multimem's integer forms (.b32, .b64:
    bits, never values), in the widest access every address allows; every rank's memory gets
    the source's bytes exactly, NaN patterns included, and nothing else."""
    batch, m, n, sbs, sld, dbs, dld, soff, doff = layout
    rng = np.random.default_rng(4)
    src = rng.integers(0, 256, soff + batch * sbs + 16, dtype=np.uint8)
    size = doff + batch * dbs + 16
    memory = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(3)]
    out = fake.run_block("mc_store", dtype, batch, m, n, sbs, sld, dbs, dld, soff, doff,
                         src=src.tobytes(), memory=[x.tobytes() for x in memory])
    assert out["status"] is None and out["drained"] and fake.errors() == []
    assert out["access_bytes"] == width
    b, r, c = np.meshgrid(np.arange(batch), np.arange(m), np.arange(n), indexing="ij")
    si, di = soff + b * sbs + r * sld + c, doff + b * dbs + r * dld + c
    for before, after in zip(memory, out["memory"], strict=True):
        want = before.copy()
        want[di] = src[si]
        np.testing.assert_array_equal(np.frombuffer(after, np.uint8), want)


def test_fp8_multicast_store_needs_whole_words(fake):
    """multimem moves fp8 as 32- or 64-bit words: a row width that is not a multiple of 4
    bytes is refused with the reason, before any launch."""
    buf = np.zeros(64, np.uint8).tobytes()
    out = fake.run_block("mc_store", "float8_e4m3fn", 1, 2, 6, 12, 6, 12, 6, 0, 0, src=buf,
                         memory=[buf, buf])
    assert "multiples of 4" in out["status"] and "transport='p2p'" in out["status"]
    assert fake.counters().get("cudaLaunchKernel", 0) == 0


FP8_MISUSES = {
    # cuBLAS docs, cublasLtMatmul, FP8 requirements: "A must be transposed and B non-transposed
    # (The TN format) on Ada (8.9), Hopper (9.0), and Blackwell GeForce (12.x)"
    "fp8 gemm not in the TN format": "needs A transposed and B non-transposed",
    "fp8 gemm on sm_80": "compute capability 8.9 or newer",
    # the FP8 type table: no e5m2 x e5m2, no FP8 with a non-FP8 operand
    "fp8 gemm e5m2 x e5m2": "not in cuBLAS's FP8 type table",
    "fp8 gemm with a bf16 operand": "FP8 A with a non-FP8 B",
    # "The compute type must be CUBLAS_COMPUTE_32F."
    "fp8 gemm with TF32 compute": "compute type other than CUBLAS_COMPUTE_32F",
    # "pointers and matrix dimension must support 16-byte alignment"
    "fp8 gemm with k not a multiple of 16 bytes": "not multiples of 16 bytes",
    # cublasLtMatmulDescAttributes_t: the A/B scale pointers are device pointers ...
    "fp8 gemm with a host scale pointer": "cublasLtMatmul scale pointer",
    # ... "If set for an unsupported matrix data ... CUBLAS_INVALID_VALUE"
    "scale pointers on a bf16 gemm": "scale pointers set on a GEMM without FP8 matrices",
    # the executor's choice (cuda/gemm/gemm.h): no fast accumulation
    "fp8 fast accumulation": "fast accumulation",
    # MXFP8 (cuBLAS docs, cublasLtMatmul: "Scaling Modes Support Overview", "1D Block Scaling
    # Factors Layout"): Blackwell only, both matrices, FP8 ones, device pointers to the padded
    # tiled tensors, 16-byte aligned
    "mxfp8 gemm on sm_90": "need compute capability 10.0 or newer",
    "mxfp8 block scales on B only": "on one of A and B only",
    "mxfp8 block scales on a bf16 gemm": "block scales on a GEMM without FP8 matrices",
    "mxfp8 block scales not 16-byte aligned": "not 16-byte aligned",
    "mxfp8 block scales without their padded tile": "cublasLtMatmul scale pointer",
    "mxfp8 block scales without a scale pointer": "without a scale pointer",
}
FP8_CONTROLS = {"fp8 gemm as the executor makes it (control)", "fp8 gemm on sm_89 (control)",
                "mxfp8 gemm as the executor makes it (control)"}


def test_the_fake_enforces_cublaslt_fp8_rules(fake):
    """One deliberate misuse per FP8 rule the fake models, each caught with its reason; the
    controls (the executor's own GEMM, on sm_90 and sm_89) pass and compute the right numbers."""
    caught = fake.fp8_misuse_checks()
    assert set(caught) == set(FP8_MISUSES) | FP8_CONTROLS
    for name, keyword in FP8_MISUSES.items():
        assert keyword in caught[name], f"{name}: fake recorded {caught[name]!r}"
    for name in FP8_CONTROLS:
        assert caught[name] == "", f"{name}: fake recorded {caught[name]!r}"


def test_the_fp8_accumulator_truncates_and_promotes_as_documented(fake):
    """The fake's FP8 accumulator against values worked out by hand from its sources
    (``fp8_accumulator.h``): 128 * 128 with 31 ones in one block of 32 (Hopper) keeps 14 bits
    below 2^14, so the ones (below its last bit, 2) vanish — float32 would give 2^14 + 31; Ada's
    blocks of 16 lose them in both steps; Blackwell's 25 bits keep them. A promotion after 128
    elements restarts the tensor-core sum, so 128 more ones after it count (2^14 + 128). An
    aligned addend and a step's sum are truncated toward zero: 8192 + 1 + 0.5 gives 8193, and
    -8192 - 1.5 gives -8193."""
    e4m3 = ("float8_e4m3fn", "float8_e4m3fn")
    big = [128.0] + [1.0] * 31
    assert fake.fp8_dot(90, big, big, *e4m3) == 2.0**14
    assert fake.fp8_dot(89, big, big, *e4m3) == 2.0**14
    assert fake.fp8_dot(100, big, big, *e4m3) == 2.0**14 + 31
    window = [128.0] + [1.0] * 255
    assert fake.fp8_dot(90, window, window, *e4m3) == 2.0**14 + 128
    assert fake.fp8_dot(90, [64.0, 1.0, 0.5], [128.0, 1.0, 1.0], *e4m3) == 8193.0
    assert fake.fp8_dot(90, [-64.0, -1.5], [128.0, 1.0], *e4m3) == -8193.0


def test_the_selftest_bound_mirrors_the_fakes_fp8_accumulator(fake):
    """The selftest's FP8 term (``_selftest.fp8_accumulation``) is derived from the same model
    the fake computes with: the same block, fraction bits and promotion interval per compute
    capability."""
    for arch, (block, fraction_bits) in _selftest.FP8_TENSOR_CORES.items():
        assert fake.fp8_tensor_core(arch) == dict(block=block, fraction_bits=fraction_bits,
                                                  promotion=_selftest.FP8_PROMOTION)
    assert fake.fp8_tensor_core(120) == fake.fp8_tensor_core(100)  # Blackwell GeForce


def test_the_selftest_fp8_rows_need_the_fp8_accumulation_term(fake, monkeypatch):
    """The selftest's FP8 rows on the modelled accumulator pass their bound with at least 2x
    headroom; under the old bound, which took FP8 GEMMs for float32 accumulation
    (``8 sqrt(K) 2^-24 S``), every all-gather row and every row with a float32 output fails —
    what a first run on an H100 would have shown."""
    old = []
    for fp8 in _selftest.FP8_DTYPES:
        for i, op in enumerate(_selftest.FP8_OPS):
            chunks, bidi = _selftest.VARIANTS[1 + i % 2]
            ok, detail = _selftest._fake_row(fake, np, op, "p2p", fp8[2], _selftest.FP8_SHAPE,
                                             chunks, bidi, fp8)
            assert ok and float(detail.split("(")[1].split(" of")[0]) <= 0.5, (op, fp8, detail)
            with monkeypatch.context() as m:  # the old bound: float32 accumulation
                m.setattr(_selftest, "bound", lambda *args, fp8=False, **kw: bound(*args, **kw))
                ok, detail = _selftest._fake_row(fake, np, op, "p2p", fp8[2],
                                                 _selftest.FP8_SHAPE, chunks, bidi, fp8)
            if op == "ag_matmul" or fp8[2] == "float32":
                assert not ok and "of the bound" in detail, (op, fp8, detail)
            old.append(ok)
    assert old.count(False) == 5


# MXFP8 (block scales) on a B200-like fake device: the executor's cuBLASLt GEMMs in the
# VEC32_UE8M0 scale mode, the scales in cuBLAS's 128x4-tiled layout (cuda/gemm/gemm.h).
MX = ("float8_e4m3fn", "float8_e4m3fn", "bfloat16")


def tiled(scales):
    """A [rows, k/32] e8m0 matrix in cuBLAS's 1D block scaling factors layout
    (docs.nvidia.com/cuda/cublas/index.html#d-block-scaling-factors-layout): tiles of 128 rows by
    4 blocks in row-of-tiles order, a tile's rows r and r + 32, r + 64, r + 96 side by side in
    16 bytes. Written as reshapes here, apart from the fake's offset formula."""
    rows, blocks = scales.shape
    if rows % 128 or blocks % 4:  # not whole tiles: as they are (calls refused at prepare)
        return scales.reshape(-1)
    tiles = scales.reshape(rows // 128, 128, blocks // 4, 4).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(tiles.reshape(-1, 4, 32, 4).transpose(0, 2, 1, 3)).reshape(-1)


def mx_case(fake, op, transport, n, *, batch=1, rows=128, k=128, nw=128, chunks=1,
            bidirectional=False, seed=0, tile=None, **run):
    """One block-scaled call per rank: e4m3 x and w, per-rank random e8m0 block scales (x's one
    per row and 32 of k, w's one per 32 of k and column) handed over tiled (``tile``: a
    function of x's and w's uint8 scales in the ops' shapes giving the bytes to hand over;
    None: ``tiled``); returns the outcome and, per rank, the float64 factors of its exact
    result (each block dequantized)."""
    rng = np.random.default_rng(seed)
    x_rows = rows if op == "ag_matmul" else rows * n
    xs = [(rng.standard_normal((batch, x_rows, k)) * 3).astype(NP["float8_e4m3fn"])
          for _ in range(n)]
    ws = [(rng.standard_normal((k, nw)) * 3).astype(NP["float8_e4m3fn"]) for _ in range(n)]
    sx = [rng.integers(120, 135, (batch, x_rows, k // 32), dtype=np.uint8) for _ in range(n)]
    sw = [rng.integers(120, 135, (k // 32, nw), dtype=np.uint8) for _ in range(n)]
    p = problem(op, transport, n, batch=batch, rows=rows, k=k, nw=nw, dtype=MX[0], chunks=chunks,
                bidirectional=bidirectional, w_dtype=MX[1], out_dtype=MX[2], block_scaled=True)
    if tile is None:
        def tile(x_scale, w_scale):
            return (tiled(x_scale.reshape(-1, k // 32)).tobytes(),
                    tiled(np.ascontiguousarray(w_scale.T)).tobytes())
    handed = [tile(a, b) for a, b in zip(sx, sw, strict=True)]
    result = play(fake, p, xs, [np.ascontiguousarray(w.T) for w in ws],
                  x_block_scales=[h[0] for h in handed], w_block_scales=[h[1] for h in handed],
                  **run)
    xd = [x.astype(np.float64) * np.repeat(np.exp2(s.astype(np.float64) - 127), 32, axis=-1)
          for x, s in zip(xs, sx, strict=True)]
    wd = [w.astype(np.float64) * np.repeat(np.exp2(s.astype(np.float64) - 127), 32, axis=0)
          for w, s in zip(ws, sw, strict=True)]
    if op == "ag_matmul":
        gathered = np.concatenate(xd, axis=1)
        return result, [(gathered, w) for w in wd]
    xk, wk = np.concatenate(xd, axis=2), np.concatenate(wd, axis=0)
    return result, [(xk if op == "matmul_ar" else xk[:, r * rows:(r + 1) * rows], wk)
                    for r in range(n)]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_mxfp8_every_op_matches_the_dequantized_reference(fake, transport):
    """Block-scaled calls on a B200-like fake device (compute capability 10.0): each GEMM reads
    the tiled scale rows beside its rows (an all-gather's travelled with their shard), within
    the bound of the fake's Blackwell FP8 accumulator of the float64 product of the
    block-dequantized operands; matmul_ar's GEMMs read their scales in place (no scale moves;
    its reductions add bf16 partials as any call's do). Two batches not back to back (one
    cuBLASLt call each): ``test_lowering.py``'s case through JAX's tiling."""
    for op in ("ag_matmul", "matmul_rs", "matmul_ar"):
        fake.reset(fake.Config(**_selftest.FAKE_B200))
        out, factors = mx_case(fake, op, transport, 2, seed=len(op))
        try:
            check_fp8(fake, op, out, factors, MX, 2, 128)
        except AssertionError as e:
            e.add_note(f"in the case {(op, transport)}")
            raise
        assert fake.counters()["cublasLtMatmul"] > 0


@pytest.mark.slow
def test_mxfp8_all_gather_chunked_both_directions(fake):
    """Sub-chunks of 128 rows (256 per shard, 2 chunks), both ring directions (three ranks: one
    step each way), every transport: each sub-chunk's tiles travel and are read beside its
    rows."""
    for key, transport in enumerate(TRANSPORTS, 60):
        fake.reset(fake.Config(**_selftest.FAKE_B200, seed=key))
        out, factors = mx_case(fake, "ag_matmul", transport, 3, rows=256, chunks=2,
                               bidirectional=True, clique_key=key, seed=key)
        check_fp8(fake, "ag_matmul", out, factors, MX, 3, 128)


def test_mxfp8_several_tiles_along_k_and_n(fake):
    """K = 256 and W's n = 256 (two tiles of 4 blocks along K, two of 128 along n): the
    documented row-of-tiles order across tiles, through the executor on a B200-like fake."""
    fake.reset(fake.Config(**_selftest.FAKE_B200))
    out, factors = mx_case(fake, "matmul_rs", "p2p", 2, k=256, nw=256, seed=7)
    check_fp8(fake, "matmul_rs", out, factors, MX, 2, 256)


def test_mxfp8_scales_handed_over_row_major_miss_the_bound(fake):
    """The negative of the tiled layout: the same call with x's and w's scales handed over
    row-major (untiled) runs (the fake cannot tell bytes apart) but misses the bound by far,
    so the cases above would catch a lost tiling."""
    fake.reset(fake.Config(**_selftest.FAKE_B200))

    def row_major(x_scale, w_scale):
        return x_scale.tobytes(), np.ascontiguousarray(w_scale.T).tobytes()

    out, factors = mx_case(fake, "matmul_rs", "p2p", 2, tile=row_major, seed=3)
    with pytest.raises(AssertionError, match="of the bound") as missed:
        check_fp8(fake, "matmul_rs", out, factors, MX, 2, 128)
    times = float(re.search(r"\(([0-9.]+) of the bound\)", str(missed.value)).group(1))
    assert times > 10, str(missed.value)  # by far, not by a rounding


@pytest.mark.parametrize("device,rows,k,reason", [
    ({}, 128, 128, "Hopper has no block-scaled cuBLASLt GEMM"),
    (dict(_selftest.FAKE_B200), 64, 128, "multiples of 128"),
    (dict(_selftest.FAKE_B200), 128, 64, "multiples of 128"),
])
def test_mxfp8_gemms_the_gpu_or_layout_cannot_take_fail_at_prepare(fake, device, rows, k, reason):
    """Block scales on an H100-like device, or a GEMM that is not whole 128x4 tiles of scales
    (rows per sub-chunk, k): every rank gets an error naming the rule at prepare, before
    anything is enqueued; the fake sees no misuse."""
    fake.reset(fake.Config(**device))
    out, _ = mx_case(fake, "matmul_rs", "p2p", 2, rows=rows, k=k)
    assert all(s and reason in s for s in out["statuses"]), out["statuses"]
    assert fake.errors() == [] and fake.counters().get("cublasLtMatmul", 0) == 0
