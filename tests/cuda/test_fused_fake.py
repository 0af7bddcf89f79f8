"""The fused programs on the CUDA executor and the fake's tile-level fused GEMM.

The fake runs the kernel as docs/gpu-internals.md §5 and ``cpp/cuda/fake/fake_fused_gemm.cc``
describe: persistent CTAs taking their units of work in the stock scheduler's order, each tile
waiting for its blocks' flags and computed with the reference GEMM, rows read before their flag
poisoned (NaN, and a misuse recorded), the kernel holding the SMs of its launch while it runs
(every SM, but those a release-only kernel leaves to the reduction beside it). The results are
checked bit for bit against an emulation of the program's arithmetic in NumPy (each product in
float32, K in order, rounded once; the reduce-scatter's sum of every rank's partial in rank
order, in float32, rounded once), over a grid of shapes whose tiles straddle chunks and shards,
with several units of work per CTA, with one and with eight work queues. The reduce-scatter's
reduction runs beside the kernel, on the SMs it leaves, and reads no block of it before its
release (else the fake reports it).
"""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from .fake_cases import check_fused, run_fused

# The CUDA executor on its fake, driven directly: no JAX.
pytestmark = pytest.mark.jax_independent


# (n, batch, rows per shard, k, output columns, chunks, bidirectional): 96 or 160 rows per
# shard cut every 128-row tile across shards and sub-chunks; 264 columns are two N tiles.
GRID = [
    (2, 1, 96, 16, 16, 1, False),
    (2, 2, 160, 8, 264, 3, False),
    (3, 1, 96, 24, 16, 2, True),
    (4, 2, 96, 16, 16, 2, True),
    (4, 1, 160, 8, 24, 1, False),
    (8, 1, 96, 8, 16, 3, True),
]


@pytest.mark.parametrize("transport", ["p2p", "multicast"])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_the_fused_programs_are_exact_on_the_fake(fake, op, transport):
    """Every grid case, with 1 and 8 work queues and with 132, 6 and 4 SMs (several units of
    work per CTA: the static striding), both 16-bit types, and three calls back to back (both
    parities of the workspace and flags). No kernel runs beside a fused GEMM that waits (AG), nor
    a reduction sized to the whole device (the p2p reduce-scatter's one sub-chunk)."""
    for i, ((n, batch, rows, k, nw, chunks, bidi), connections) in enumerate(
            itertools.product(GRID, (1, 8))):
        dtype = ("bfloat16", "float16")[i % 2]
        sms = (132, 6, 4)[i % 3]
        fake.reset(fake.Config(connections=connections, sms=sms, seed=i + 1))
        gathered = op == "ag_matmul" and i % 2 == 0
        out, xs, ws = run_fused(fake, op, transport, n, batch=batch, rows=rows, k=k, nw=nw,
                                dtype=dtype, chunks=chunks, bidirectional=bidi,
                                gathered=gathered, calls=3, seed=i)
        try:
            check_fused(fake, out, op, transport, xs, ws, rows, dtype, gathered)
            assert fake.counters().get("cudaLaunchKernelEx") == 3 * n  # one kernel per call
            if op == "ag_matmul" or (transport == "p2p" and chunks == 1):
                assert fake.counters().get("kernels beside a persistent kernel") is None
        except AssertionError as e:
            e.add_note(f"in the case {(n, batch, rows, k, nw, chunks, bidi, connections, sms)}")
            raise


@pytest.mark.parametrize(("transport", "connections", "cc"),
                         [("p2p", 1, (9, 0)), ("p2p", 8, (9, 0)), ("multicast", 1, (9, 0)),
                          ("multicast", 8, (9, 0)), ("p2p", 1, (10, 0)), ("multicast", 8, (10, 0))])
def test_the_reduction_runs_beside_the_fused_gemm(fake, transport, connections, cc):
    """GEMM + RS with 4 sub-chunks of 4 M tiles each (the fake computes a tile per step): the
    reductions of the first rounds start while the kernel still computes later ones, on the SMs
    it left them (with 1 work queue too: core/issue_order issues a reduction before the copies
    that wait for the kernel's later blocks), and the result is exact. Both kernels (10.0: the
    sm100 one, each 2-SM pair releasing its halves' blocks)."""
    fake.reset(fake.Config(connections=connections, sms=8, seed=5, cc_major=cc[0],
                           cc_minor=cc[1]))
    args = dict(batch=1, rows=2048, k=8, nw=264, dtype="bfloat16", chunks=4, bidirectional=False)
    out, xs, ws = run_fused(fake, "matmul_rs", transport, 4, **args)
    check_fused(fake, out, "matmul_rs", transport, xs, ws, 2048, "bfloat16")
    assert fake.counters().get("kernels beside a persistent kernel", 0) > 0


@pytest.mark.parametrize(("rows", "sms", "cc"),
                         [(512, 48, (9, 0)), (4096, 62, (9, 0)), (512, 48, (10, 0))])
def test_the_fused_gemm_leaves_the_reduction_the_sms_that_cost_it_no_wave(fake, rows, sms, cc):
    """On a 64-SM device the executor leaves the reduction beside the fused GEMM + RS at most 16
    SMs (a quarter of 64), as many as cost the persistent grid no wave (fused_tiles.h SpareSms).
    N = 2, 264 columns (2 N tiles): 512 rows a block are 8 M tiles, 16 units of work, one wave on
    any 48 SMs: it leaves 16; 4096 rows are 64 M tiles, 128 units, 2 waves on 64 SMs (64 CTAs)
    but 3 on 60 or fewer (at most 60 CTAs): it leaves the least, 2. The sm_100a kernel (10.0)
    strides the same grid of 128 x 256 CTA tiles, each CTA a half of a 2-SM MMA tile
    (fused_tiles.h kSm100Tile). The FP8 kernel's own tile: test_fused_fp8_fake.py."""
    fake.reset(fake.Config(sms=64, seed=7, cc_major=cc[0], cc_minor=cc[1]))
    out, xs, ws = run_fused(fake, "matmul_rs", "p2p", 2, batch=1, rows=rows, k=8, nw=264,
                            dtype="bfloat16", chunks=2, bidirectional=False)
    check_fused(fake, out, "matmul_rs", "p2p", xs, ws, rows, "bfloat16")
    launched = {k: v for k, v in fake.counters().items() if k.startswith("fused GEMM on")}
    assert launched == {f"fused GEMM on {sms} SMs": 2}, launched


def test_the_fused_gemm_agrees_with_the_chunked_gemms_bit_for_bit(fake):
    """AG + GEMM: the same products with the same arithmetic, tile by tile or block by block."""
    fake.reset(fake.Config())
    args = dict(batch=2, rows=96, k=16, nw=16, dtype="bfloat16", chunks=2, bidirectional=True)
    fused, _, _ = run_fused(fake, "ag_matmul", "p2p", 4, **args)
    assert fused["statuses"] == [None] * 4 and fused["drained"], fused["statuses"]
    assert fake.errors() == []
    assert fake.counters().get("cudaLaunchKernelEx") == 4  # the fused run: one kernel per rank
    fake.reset(fake.Config())
    chunked, _, _ = run_fused(fake, "ag_matmul", "p2p", 4, fused=False, **args)
    assert chunked["statuses"] == [None] * 4 and chunked["drained"], chunked["statuses"]
    assert fake.errors() == []
    assert fused["ys"] == chunked["ys"]
    assert fake.counters().get("cudaLaunchKernelEx") is None  # the chunked run: no fused GEMM


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_the_sm100_kernel_on_a_fake_b200_is_exact(fake, op):
    """A B200-like fake device (10.0, 148 SMs, and fewer: several units of work per cluster)
    runs the sm_100a build: its tile order over 256-row MMA tiles, each cluster's two CTAs the
    two halves of one, neither computed before both halves' rows arrived. Its two instantiations
    alternating (bfloat16, float16), p2p and multicast, 1 and 8 work queues, three calls back to
    back."""
    for i, (case, transport) in enumerate(itertools.product(GRID, ("p2p", "multicast"))):
        n, batch, rows, k, nw, chunks, bidi = case
        sms = (148, 6, 4)[i % 3]
        fake.reset(fake.Config(cc_major=10, cc_minor=0, connections=(1, 8)[i % 2], sms=sms,
                               seed=i + 1))
        gathered = op == "ag_matmul" and i % 2 == 0
        dtype = ("bfloat16", "float16")[i // 2 % 2]
        out, xs, ws = run_fused(fake, op, transport, n, batch=batch, rows=rows, k=k, nw=nw,
                                dtype=dtype, chunks=chunks, bidirectional=bidi,
                                gathered=gathered, calls=3, seed=i)
        try:
            check_fused(fake, out, op, transport, xs, ws, rows, dtype, gathered)
            assert fake.counters().get("cudaLaunchKernelEx") == 3 * n
        except AssertionError as e:
            e.add_note(f"in the case {(case, transport, dtype, sms)}")
            raise


@pytest.mark.parametrize("cc", [(8, 0), (10, 3), (12, 0)])
def test_a_gpu_other_than_compute_capability_9_0_or_10_0_refuses_the_fused_call_at_prepare(
        fake, cc):
    """Neither the sm_90a nor the sm_100a kernel has an image for it: the call fails before
    anything is enqueued, naming the GPU and the way out; the clique is broken, nothing is left
    on the GPU."""
    fake.reset(fake.Config(cc_major=cc[0], cc_minor=cc[1]))
    out, _, _ = run_fused(fake, "ag_matmul", "p2p", 2, batch=1, rows=8, k=8, nw=8,
                          dtype="bfloat16", chunks=1, bidirectional=False)
    for status in out["statuses"]:
        assert status is not None and "compute capability 9.0" in status, status
        assert f"is {cc[0]}.{cc[1]}" in status and "chunked path" in status
    assert out["drained"]
    assert fake.counters().get("cudaLaunchKernelEx") is None


@pytest.mark.parametrize("cc", [(9, 0), (10, 0)])
def test_the_fused_flags_are_checked_by_the_poison(fake, cc):
    """A kernel waiting for the flag of the next block instead of its own (an off-by-one mapping,
    Config.fused_flag_shift) reads rows before they arrived: they are poisoned, the result has
    NaN and the fake names the read. With the right mapping: exact (the control). Both
    kernels (10.0: the sm100 one, waiting per half of a 2-SM pair)."""
    args = dict(batch=1, rows=96, k=16, nw=16, dtype="bfloat16", chunks=2, bidirectional=False)
    fake.reset(fake.Config(fused_flag_shift=1, seed=3, cc_major=cc[0], cc_minor=cc[1]))
    out, xs, ws = run_fused(fake, "ag_matmul", "p2p", 4, **args)
    errors = fake.errors()
    assert any("read rows of block" in e and "before its flag" in e for e in errors), errors
    assert any(np.isnan(np.frombuffer(y, ml_dtypes.bfloat16).astype(np.float32)).any()
               for y in out["ys"])
    fake.reset(fake.Config(seed=3, cc_major=cc[0], cc_minor=cc[1]))
    out, xs, ws = run_fused(fake, "ag_matmul", "p2p", 4, **args)
    check_fused(fake, out, "ag_matmul", "p2p", xs, ws, 96, "bfloat16")


def test_a_2sm_pair_whose_peer_does_not_wait_is_caught(fake):
    """The both-halves rule of the sm100 kernel's 2-SM pairs: each CTA of a pair loads its own
    128 rows of the 256-row MMA tile, so each must wait for its own rows. A kernel waiting in
    the leader CTA only (Config.fused_pair_leader_waits_only) lets the peer read its half before
    it arrived: poisoned rows, NaN in the result, and the fake names the read. 96 rows per
    shard: the leader's rows 0-127 are shards 0 and 1, the peer's 128-255 shards 1 and 2, so a
    rank receiving shard 2 last reads it early. With both waiting: exact (the control)."""
    args = dict(batch=1, rows=96, k=16, nw=16, dtype="bfloat16", chunks=2, bidirectional=False)
    b200 = dict(cc_major=10, cc_minor=0, sms=8, seed=3)
    fake.reset(fake.Config(fused_pair_leader_waits_only=True, **b200))
    out, _, _ = run_fused(fake, "ag_matmul", "p2p", 4, **args)
    errors = fake.errors()
    assert any("read rows of block" in e and "before its flag" in e for e in errors), errors
    assert any(np.isnan(np.frombuffer(y, ml_dtypes.bfloat16).astype(np.float32)).any()
               for y in out["ys"])
    fake.reset(fake.Config(**b200))
    out, xs, ws = run_fused(fake, "ag_matmul", "p2p", 4, **args)
    check_fused(fake, out, "ag_matmul", "p2p", xs, ws, 96, "bfloat16")


def test_the_fake_fails_loudly_on_a_misused_reduction(fake):
    """The reduction beside a fused GEMM that releases its output (docs/gpu-internals.md §5):
    reading a block before its release — by a kernel or by the copy engine — and a reduction
    sized to SMs the kernel does not leave (launched on every SM) are reported; after the
    release, on the SMs the kernel leaves, nothing is (the control)."""
    caught = fake.reduce_misuse_checks()
    assert caught == {
        "a reduction beside the fused GEMM, after its release, on the SMs it leaves (control)": "",
        "a block reduced before its release": caught["a block reduced before its release"],
        "a block copied out before its release": caught["a block copied out before its release"],
        "a reduction sized to SMs the fused GEMM does not leave":
            caught["a reduction sized to SMs the fused GEMM does not leave"],
    }
    for name in ("a block reduced before its release", "a block copied out before its release"):
        assert "whose release flag is not at the epoch yet" in caught[name], caught[name]
    assert "kernel Reduce<bf16" in caught["a block reduced before its release"]
    assert "cudaMemcpyAsync read" in caught["a block copied out before its release"]
    sms = caught["a reduction sized to SMs the fused GEMM does not leave"]
    assert "is sized to 2 SMs" in sms and "leaves 0 of the device's 8 free" in sms, sms
