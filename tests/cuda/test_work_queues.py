"""Every program the CUDA executor enqueues completes with one hardware work queue per device.

CUDA multiplexes a device's streams onto ``CUDA_DEVICE_MAX_CONNECTIONS`` work queues (default 8;
Megatron-LM/TransformerEngine jobs set 1); a blocked wait at a queue's head blocks everything
behind it. The fake models exactly that (``Config(connections=...)``), and NCCL's serialisation of
a communicator's launches in issue order. This runs the executor itself (``CudaSite``, through
``_cuda_fake.run``: the order is the one the handlers enqueue, not a re-implementation of it) for
op x transport x N in 2..8 x chunks 1..4 x direction, with 1 queue and with the default 8, and
requires every call to complete with the right result and no misuse the fake recognises:

* each case on a fresh clique, the fake's queues interleaved in a seeded random order (a seed per
  case): N = 2, 3 and 8 every time, N = 4..7 ``slow``;
* the same grid, ``matmul_ar``'s one-shot included, with the ranks' host threads at uneven speeds
  (three seeds per case), every case of an N on one clique (needs grow and shrink);
* ``matmul_ar``'s one-shot programs on rows that split and rows that do not;
* the fused programs (``ag_matmul`` and ``matmul_rs`` over ``p2p`` and ``multicast``), N = 2, 3
  and 8 every time, N = 4..7 ``slow``.
"""

from __future__ import annotations

import itertools
import random

import pytest

from jaxoverlap import _kinds

from .fake_cases import OPS, TRANSPORTS, check, check_fused, run_case, run_fused

# The CUDA executor on its fake, driven directly: no JAX.
pytestmark = pytest.mark.jax_independent


@pytest.mark.parametrize("n", [n if n in (2, 3, 8) else pytest.param(n, marks=pytest.mark.slow)
                               for n in range(2, 9)])
@pytest.mark.parametrize("connections", [1, 8])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("op", OPS)
def test_every_program_completes_through_the_work_queues(fake, op, transport, connections, n):
    for chunks in range(1, 5):
        for bidirectional in (False, True):
            fake.reset(fake.Config(connections=connections,
                                   seed=1 + 8 * n + 2 * chunks + bidirectional))
            assert fake.connections() == connections
            out, xs, ws = run_case(fake, op, transport, n, batch=1, rows=2, k=4, nw=3,
                                   chunks=chunks, bidirectional=bidirectional)
            check(fake, out, op, xs, ws, 2, "float32")


@pytest.mark.parametrize("n", [n if n in (2, 3, 8) else pytest.param(n, marks=pytest.mark.slow)
                               for n in range(2, 9)])
@pytest.mark.parametrize("connections", [1, 8])
def test_every_fused_program_completes_through_the_work_queues(fake, connections, n):
    """The fused programs (docs/gpu-internals.md §5): the issue order puts everything the fused
    GEMM's flags depend on before it, on every rank (core/issue_order), so they complete with one
    work queue too; and the fake's fused GEMM holds every SM while it runs. Exact results (the
    emulation of test_fused_fake.py), op x transport x chunks 1..4 x direction, the gathered x
    returned (a copy on the kernel's stream behind it) for odd chunks."""
    for op, transport, chunks, bidirectional in itertools.product(
            ("ag_matmul", "matmul_rs"), ("p2p", "multicast"), range(1, 5), (False, True)):
        fake.reset(fake.Config(connections=connections,
                               seed=1 + 8 * n + 2 * chunks + bidirectional))
        gathered = op == "ag_matmul" and chunks % 2 == 1  # a copy behind the kernel
        out, xs, ws = run_fused(fake, op, transport, n, batch=1, rows=4, k=8, nw=8,
                                dtype="bfloat16", chunks=chunks, bidirectional=bidirectional,
                                gathered=gathered)
        try:
            check_fused(fake, out, op, transport, xs, ws, 4, "bfloat16", gathered)
        except AssertionError as e:
            e.add_note(f"in the case {(op, transport, chunks, bidirectional)}")
            raise


@pytest.mark.parametrize("transport", _kinds.names(_kinds.TRANSPORTS, fused=True))
def test_the_fused_rs_with_ranks_at_uneven_speeds(fake, transport):
    """The fused GEMM + reduce-scatter (its reduction beside the kernel, on the SMs it leaves: 8
    SMs a device, so it leaves 2) with the ranks' host threads at uneven speeds (``host_jitter``,
    two seeds), 1 and 8 work queues, N 2, 3 and 8, chunks 1..4, two calls each back to back on
    one clique: exact every time, no misuse reported, and reductions ran beside the kernels."""
    beside = 0
    for n, connections, seed in itertools.product((2, 3, 8), (1, 8), (1, 2)):
        fake.reset(fake.Config(connections=connections, seed=seed, host_jitter=seed, sms=8))
        # N = 2: two N tiles and 8 M tiles a block, long enough for a reduction to start beside
        # the kernel (the fake computes a tile per step); the others small, for their orders
        rows, nw = (512, 264) if n == 2 else (64, 8)
        for chunks in random.Random(10 * seed + n).sample(range(1, 5), 4):
            out, xs, ws = run_fused(fake, "matmul_rs", transport, n, batch=1, rows=rows, k=8,
                                    nw=nw, dtype="bfloat16", chunks=chunks, bidirectional=False,
                                    calls=2, seed=seed)
            try:
                check_fused(fake, out, "matmul_rs", transport, xs, ws, rows, "bfloat16")
            except AssertionError as e:
                e.add_note(f"N={n}, {connections} work queue(s), seed {seed}, chunks={chunks}")
                raise
        beside += fake.counters().get("kernels beside a persistent kernel", 0)
    assert beside > 0


# The same grid with the ranks' host threads at uneven speeds (``host_jitter``: seeded pauses at
# the fake's calls), three seeds per case, i.e. three orders of the ranks' threads, and one clique
# per N, queue count and seed that every chunks x direction case runs on, two calls each, in a
# seeded order: needs grow and shrink, so buffer generations are made and past ones freed, new
# cuBLASLt plans warmed up and kernels loaded, while other ranks enqueue. The fake's host calls
# wait as the GPU's do (cudaMalloc/cudaFree, VMM unmap/release, lazy loading, NCCL's connection
# to a new peer, ncclCommAbort: fake_waits.cc), so a rank that waits for the GPU while the GPU
# waits for that rank's next enqueue is reported as a deadlock. About 40 s in all.
CHUNKS_AND_DIRECTIONS = [(chunks, bidirectional) for chunks in range(1, 5)
                         for bidirectional in (False, True)]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("op", [*OPS, "matmul_ar/one_shot"])
def test_every_program_with_ranks_at_uneven_speeds(fake, op, transport):
    op, _, algorithm = op.partition("/")
    for n, connections, seed in itertools.product(range(2, 9), (1, 8), (1, 2, 3)):
        fake.reset(fake.Config(connections=connections, seed=seed, host_jitter=seed))
        order = random.Random(100 * seed + n).sample(CHUNKS_AND_DIRECTIONS, 8)
        for chunks, bidirectional in order:
            out, xs, ws = run_case(fake, op, transport, n, batch=1, rows=4, k=4, nw=3,
                                   chunks=chunks, bidirectional=bidirectional, calls=2,
                                   algorithm=algorithm or "two_shot")
            try:
                check(fake, out, op, xs, ws, 4, "float32")
            except AssertionError as e:
                e.add_note(f"N={n}, {connections} work queue(s), seed {seed}, order {order}: "
                           f"at chunks={chunks}, bidirectional={bidirectional}")
                raise


@pytest.mark.parametrize("connections", [1, 8])
def test_every_one_shot_program_completes_through_the_work_queues(fake, connections):
    """matmul_ar's one-shot programs, N 2..8: rows that split into N blocks and rows that do
    not (1: a decode step's batch of one), with and without sub-chunks."""
    for transport, n, rows, chunks in itertools.product(TRANSPORTS,
                                                        range(2, 9), (1, 5, 8), (1, 3)):
        fake.reset(fake.Config(connections=connections, seed=1 + 8 * n + 2 * chunks + rows))
        out, xs, ws = run_case(fake, "matmul_ar", transport, n, batch=1, rows=rows, k=4, nw=3,
                               chunks=chunks, algorithm="one_shot")
        try:
            check(fake, out, "matmul_ar", xs, ws, rows, "float32")
        except AssertionError as e:
            e.add_note(f"in the case {(transport, n, rows, chunks)}")
            raise
