"""Every program the CUDA executor enqueues completes with one hardware work queue per device.

CUDA multiplexes a device's streams onto ``CUDA_DEVICE_MAX_CONNECTIONS`` work queues (default 8;
Megatron-LM/TransformerEngine jobs set 1); a blocked wait at a queue's head blocks everything
behind it. The fake models exactly that (``Config(connections=...)``), and NCCL's serialisation of
a communicator's launches in issue order. This runs the executor itself (``CudaCall``, through
``_cuda_fake.run``: the order is the one the handlers enqueue, not a re-implementation of it) for
op x transport x N in 2..8 x chunks 1..4 x direction, with 1 queue and with the default 8, and
requires every call to complete with the right result and no misuse the fake recognises. The
fake interleaves the queues in a seeded random order; each case uses its own seed. N = 2, 3 and
8 run every time; N = 4..7 are ``slow`` (the whole grid takes minutes). ``matmul_ar``'s one-shot
programs have a grid of their own (every N: they are cheap).
"""

from __future__ import annotations

import itertools

import pytest

from .test_fake import check, run_case

# The CUDA executor on its fake, driven directly: no JAX.
pytestmark = pytest.mark.jax_independent


@pytest.mark.parametrize("n", [n if n in (2, 3, 8) else pytest.param(n, marks=pytest.mark.slow)
                               for n in range(2, 9)])
@pytest.mark.parametrize("connections", [1, 8])
@pytest.mark.parametrize("transport", ["nccl", "p2p", "multicast"])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs", "matmul_ar"])
def test_every_program_completes_through_the_work_queues(fake, op, transport, connections, n):
    for chunks in range(1, 5):
        for bidirectional in (False, True):
            fake.reset(fake.Config(connections=connections,
                                   seed=1 + 8 * n + 2 * chunks + bidirectional))
            assert fake.connections() == connections
            out, xs, ws = run_case(fake, op, transport, n, batch=1, rows=2, k=4, nw=3,
                                   chunks=chunks, bidirectional=bidirectional)
            check(fake, out, op, xs, ws, 2, "float32")


# Calls whose needs grow on one clique, as the selftest's rows do (more chunks: more flags, a
# bigger workspace), so buffer generations are made and past ones freed while other ranks
# enqueue; two calls per step; the ranks' host threads at uneven speeds (``host_jitter``: seeded
# pauses at the fake's calls), several seeds per case, i.e. several orders of the ranks' threads.
# The fake's host calls wait as the GPU's do (cudaMalloc/cudaFree, VMM unmap/release, lazy
# loading, ncclCommAbort: fake_waits.cc), so a rank that waits for the GPU while the GPU waits
# for that rank's next enqueue is reported as a deadlock.
GROWTH = ((1, False), (2, False), (4, True), (3, True), (4, False))


@pytest.mark.parametrize("transport", ["nccl", "p2p", "multicast"])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs", "matmul_ar"])
def test_growing_calls_with_ranks_at_uneven_speeds(fake, op, transport):
    for n in (2, 3, 4):
        for connections in (1, 8):
            for seed in (1, 2, 3):
                fake.reset(fake.Config(connections=connections, seed=seed, host_jitter=seed))
                for chunks, bidirectional in GROWTH:
                    out, xs, ws = run_case(fake, op, transport, n, batch=1, rows=4, k=4, nw=3,
                                           chunks=chunks, bidirectional=bidirectional, calls=2)
                    check(fake, out, op, xs, ws, 4, "float32")


@pytest.mark.parametrize("connections", [1, 8])
def test_every_one_shot_program_completes_through_the_work_queues(fake, connections):
    """matmul_ar's one-shot programs, N 2..8: rows that split into N blocks and rows that do
    not (1: a decode step's batch of one), with and without sub-chunks."""
    for transport, n, rows, chunks in itertools.product(("nccl", "p2p", "multicast"),
                                                        range(2, 9), (1, 5, 8), (1, 3)):
        fake.reset(fake.Config(connections=connections, seed=1 + 8 * n + 2 * chunks + rows))
        out, xs, ws = run_case(fake, "matmul_ar", transport, n, batch=1, rows=rows, k=4, nw=3,
                               chunks=chunks, algorithm="one_shot")
        try:
            check(fake, out, "matmul_ar", xs, ws, rows, "float32")
        except AssertionError as e:
            e.add_note(f"in the case {(transport, n, rows, chunks)}")
            raise
