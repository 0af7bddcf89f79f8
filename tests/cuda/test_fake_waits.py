"""The fake's rules about host calls that wait for the GPU (cpp/cuda/fake/fake_waits.cc).

cudaMalloc / cudaFree, cudaMallocHost and the VMM unmap / release calls wait for every queue of
their device, and a device-to-host copy into pageable memory returns only once it has completed;
with lazy loading (CUDA's default, ``CUDA_MODULE_LOADING=EAGER`` turns it off) the first use of a
kernel or cuBLASLt algorithm on a device waits for it too; ``ncclCommAbort`` frees memory, so it
waits for other communicators' kernels on its device; NCCL's first send/recv to a peer connects
to it, allocating device memory, which waits for the device too. A host thread that waits so
while the GPU waits for work only it (or another waiting thread) would enqueue is a deadlock: the
fake reports it with the queues' state and fails the call instead of hanging. One deliberate
misuse per rule, with a control doing the same in an order that completes.
"""

from __future__ import annotations

import pytest

from .fake_cases import OPS, TRANSPORTS, check, inputs, play, problem, run_case

pytestmark = pytest.mark.jax_independent

MISUSES = {
    "cudaFree behind a wait only this thread would satisfy": "cudaFree on device 0",
    "cudaMalloc behind a wait only this thread would satisfy": "cudaMalloc on device 0",
    "cudaMallocHost behind a wait only this thread would satisfy": "cudaMallocHost on device 0",
    # with peer access on, device 0's memory is mapped into device 1: its allocations and frees
    # wait for device 1's work too (cuCtxEnablePeerAccess: all allocations accessible)
    "cudaMalloc of memory a peer maps, behind the peer's wait only this thread would satisfy":
        "cudaMalloc on device 0 (it waits for every work queue of the device and of device 1, "
        "which maps its memory: peer access) would wait forever",
    "cudaFree of memory a peer maps, behind the peer's wait only this thread would satisfy":
        "cudaFree on device 0 (it waits for every work queue of the device and of device 1, "
        "which maps its memory: peer access) would wait forever",
    "cudaFreeHost behind a wait only this thread would satisfy": "cudaFreeHost on device 0",
    "device-to-host copy into pageable memory behind a wait only this thread would satisfy":
        "cudaMemcpyAsync device-to-host into pageable memory on device 0 (it returns only once "
        "the copy has completed)",
    "cuMemUnmap behind a wait only this thread would satisfy": "cuMemUnmap on device 0",
    "cuMemRelease behind a wait only this thread would satisfy": "cuMemRelease on device 1",
    "first launch of a kernel not loaded (lazy loading)":
        "cudaLaunchKernel loading AddBlock<f32, 16 bytes> (lazy loading) on device 0",
    "first cuBLASLt matmul of an algorithm (lazy loading)": "cublasLtMatmul loading cuBLASLt",
    "ncclCommAbort while another communicator's kernel runs on the device":
        "ncclCommAbort (rank 0, freeing its device memory) on device 0",
    "first send/recv to a peer behind a wait only this thread would satisfy":
        "NCCL connecting rank 0 to peer 1 on device 0",
    "polling a non-blocking connection behind a wait only this thread would satisfy":
        "NCCL connecting rank 0 to peer 1 on device 0",
    # The executor's old order: past buffers freed by the first rank to reserve, while a peer's
    # call already enqueued waits for that rank's next enqueue.
    "cudaFree of a peer's buffer while the peer waits for this thread": "cudaFree on device 1",
}
CONTROLS = {
    "cudaFree after the write the wait needs (control)",
    "cudaMalloc after the write the wait needs (control)",
    "cudaMallocHost after the write the wait needs (control)",
    "cudaMalloc of memory no peer maps, behind another device's wait (control)",
    "cudaFree of memory no peer maps, behind another device's wait (control)",
    "cudaFreeHost after the write the wait needs (control)",
    "device-to-host copy into page-locked memory behind the same wait (control)",
    "cuMemUnmap after the write the wait needs (control)",
    "cuMemRelease after the write the wait needs (control)",
    "first launch with CUDA_MODULE_LOADING=EAGER (control)",
    "first cuBLASLt matmul with CUDA_MODULE_LOADING=EAGER (control)",
    "ncclCommAbort of the stuck communicator first (control)",
    "cudaFree of a peer's buffer after this thread's signal (control)",
    "send/recv to a connected peer behind the same wait (control)",
}
# The rule of the enqueue path (docs/gpu-internals.md §1): between a handler's first enqueue on
# XLA's stream and its return only calls that enqueue or poll run; the fake refuses any other.
ENQUEUE_PATH = {
    "cudaMalloc between a handler's first enqueue and its return":
        "cudaMalloc called between a handler's first enqueue and its return",
    "first send/recv to a peer between a handler's first enqueue and its return":
        "ncclGroupEnd connecting to a new peer (NCCL allocates the connection's device memory) "
        "called between a handler's first enqueue and its return",
    # cuBLASLt's kernel is taken to depend on the call's form (fake_cublaslt.cc): a warm-up in
    # another form leaves it to load there
    "cuBLASLt matmul less aligned than its warm-up on the enqueue path":
        "lazy loading of cuBLASLt kernel compute 68 type 0 in place, alignments 16 256 256 256 "
        "called between a handler's first enqueue and its return",
    "cuBLASLt matmul out of place after an in-place warm-up on the enqueue path":
        "lazy loading of cuBLASLt kernel compute 68 type 0 out of place, alignments 256 256 256 "
        "256 called between a handler's first enqueue and its return",
}
# Deny by default: every entry point of the fake checks the enqueue path, so calls the rule does
# not list are refused there even where the fake does not make them wait (a sample).
REFUSED = ("cudaStreamCreateWithFlags", "cudaEventCreateWithFlags", "cudaEventDestroy",
           "cudaStreamDestroy", "cudaStreamSynchronize", "cublasLtCreate", "cuMemAddressFree",
           "cuMulticastUnbind")
ENQUEUE_PATH |= {f"{api} on the enqueue path":
                 f"{api} called between a handler's first enqueue and its return"
                 for api in REFUSED}
CONTROLS.add("error strings, ncclGroupStart/End and the current device on the enqueue path "
             "(control)")
CONTROLS.add("cuBLASLt matmul in its warm-up's form on the enqueue path (control)")


def test_host_calls_that_wait_for_the_gpu_report_deadlocks(fake):
    caught = fake.wait_misuse_checks()
    assert set(caught) == set(MISUSES) | CONTROLS | set(ENQUEUE_PATH)
    for name, keyword in MISUSES.items():
        assert keyword in caught[name], f"{name}: fake recorded {caught[name]!r}"
        assert "would wait forever: deadlock" in caught[name], caught[name]
    for name in CONTROLS:
        assert caught[name] == "", f"{name}: fake recorded {caught[name]!r}"
    for name, keyword in ENQUEUE_PATH.items():
        assert keyword in caught[name], f"{name}: fake recorded {caught[name]!r}"


@pytest.mark.parametrize("setting, lazy", [(None, True), ("LAZY", True), ("EAGER", False)])
def test_module_loading_follows_the_environment(fake, monkeypatch, setting, lazy):
    if setting is None:
        monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    else:
        monkeypatch.setenv("CUDA_MODULE_LOADING", setting)
    fake.reset()
    assert fake.lazy_loading() == lazy
    fake.reset(fake.Config(module_loading=2))
    assert not fake.lazy_loading()


@pytest.mark.parametrize("op", ["matmul_rs", "ag_matmul"])
def test_the_watchdog_aborts_a_devices_communicators_concurrently(fake, op):
    """Bidirectional nccl with a rank that never calls: every other rank has kernels of both
    ring directions' communicators stuck on its GPU. ncclCommAbort frees memory, which waits for
    the device, so aborting one direction's communicator before the other's waits forever (the
    fake reports it: test above); the watchdog aborts them all at once, on threads of their own,
    and the streams are released."""
    fake.reset(fake.Config(grace_ms=10000))
    p = problem(op, "nccl", 4, batch=1, rows=4, k=8, nw=6, chunks=2, bidirectional=True)
    xs, ws = inputs(p)
    args = (p, xs,
            ws, [0, 1, 2, 3])
    assert play(fake, *args, clique_key=11, timeout_ms=200)["statuses"] == [None] * 4  # set-up
    out = play(fake, *args, clique_key=11, skip_rank=2, timeout_ms=200)
    assert out["drained"], fake.errors()
    assert fake.errors() == []
    assert "inside NCCL" in fake.last_warning(), fake.last_warning()


@pytest.mark.parametrize("transport", ["nccl", "p2p"])
def test_the_watchdog_clock_starts_when_the_gpu_gets_to_the_call(fake, transport):
    """The host runs far ahead of the GPU: three more calls per rank are queued behind earlier work
    that keeps the GPU busy for five times the calls' timeout (``hold_ms``, on the watchdog's
    virtual clock). A call's clock starts when the GPU gets to it (its ``started`` event), so
    the healthy clique is not broken; with the clock started at the host's enqueue it was."""
    fake.reset(fake.Config(grace_ms=10000))
    p = problem("matmul_rs", transport, 4, batch=1, rows=4, k=8, nw=6, chunks=2)
    xs, ws = inputs(p)
    args = (p, xs, ws,
            [0, 1, 2, 3])
    # Set-up first (allocation and loading wait for the GPU: never behind the held work).
    assert play(fake, *args, clique_key=13, timeout_ms=200)["statuses"] == [None] * 4
    out = play(fake, *args, clique_key=13, calls=3, timeout_ms=200, hold_ms=1000)
    assert out["drained"] and fake.errors() == [], fake.errors()
    assert out["statuses"] == [None] * 4, out["statuses"]
    assert "BROKEN" not in fake.cliques(), fake.cliques()
    again = play(fake, *args, clique_key=13)
    assert again["statuses"] == [None] * 4, again["statuses"]


@pytest.mark.parametrize("module_loading", [1, 2], ids=["lazy", "eager"])
def test_every_op_and_transport_with_lazy_and_eager_loading(fake, module_loading):
    """The executor loads every kernel and cuBLASLt algorithm a call uses at set-up: with lazy
    loading nothing is loaded on the enqueue path (the fake would refuse it), with eager loading
    there is nothing to load; both give the right results."""

    for op in OPS:
        for transport in TRANSPORTS:
            fake.reset(fake.Config(module_loading=module_loading))
            out, xs, ws = run_case(fake, op, transport, 4, chunks=2, bidirectional=True,
                                   dtype="bfloat16", calls=2)
            check(fake, out, op, xs, ws, 3, "bfloat16")


def test_a_gemm_enqueue_does_not_wait_for_another_threads_gemm_set_up(fake):
    """cuda/gemm/gemm.cc's cache lock: the enqueue path takes it for its plan look-up, so it must
    never be held across a set-up call that waits for the device (a warm-up that loads a
    kernel). Here a set-up's warm-up waits for a flag that only the enqueuing thread raises,
    after its GEMM: with the lock held across that load, the enqueue would wait for the set-up,
    and the set-up for the enqueue (the check gives up after 20 s and says so)."""
    out = fake.gemm_set_up_race()
    assert not out["enqueue_waited"], out
    assert out["enqueue"] == "" and out["set_up"] == "", out
    assert out["errors"] == [], out


# Each path on which the executor allocated or freed device memory at a rank's own set-up,
# while its peers' calls — already enqueued — waited on the GPU for that rank: with peer access
# on, a rank's device memory is mapped into its peers, so allocating or freeing it waits for their
# queues too (the rule above), which wait for this rank. Each scenario runs the calls before
# the last with every rank on time, then the last with rank 0 late (its peers enqueue first).
# (runs: [(op, rows, chunks, fused)], the last with rank 0 late)
POOL_PATHS = {
    # RankResources::Reserve: the scratch of a reduce-scatter's first call
    "scratch cudaMalloc": [("matmul_rs", 4, 2, False)],
    # RankResources::Reserve: the fused GEMM's fault record and counters
    "fused-state cudaMalloc": [("ag_matmul", 16, 2, True)],
    # RankResources::Reserve: a scratch outgrown (chunks 4 -> 1: larger slots) freed later
    "retired-scratch cudaFree": [("matmul_rs", 4, 4, False), ("matmul_rs", 4, 1, False),
                                 ("matmul_rs", 4, 1, False)],
    # PrepareLtMatmul: the cuBLASLt workspace of XLA's stream at a rank's first GEMM
    "cuBLASLt workspace cudaMalloc": [("ag_matmul", 4, 1, False)],
    # PrepareLtMatmul: the warm-up buffer outgrown by a larger GEMM (freed, then allocated)
    "warm-up buffer cudaFree/cudaMalloc": [("ag_matmul", 4, 1, False),
                                           ("ag_matmul", 32, 1, False)],
}


@pytest.mark.parametrize("path", POOL_PATHS)
def test_no_allocation_or_free_a_peer_can_wait_on(fake, path):
    """The rank's pool (clique_state.h): scratch, fused state, cuBLASLt workspaces and warm-up
    buffers grow only at the first local rank's reservation of an epoch, for every rank, while
    the others wait before they reserve it, and are freed only with the clique. So a rank that
    sets a call up after its peers enqueued theirs allocates nothing, and every call completes.
    The executor before this allocated (or freed) each of these at the rank's own set-up: on each
    path here the fake reported it ("cudaMalloc on device 0 (... and of device 1, ..., which maps
    its memory: peer access) would wait forever")."""
    runs = POOL_PATHS[path]
    fake.reset()
    for i, (op, rows, chunks, fused) in enumerate(runs):
        p = problem(op, "p2p", 4, batch=2, rows=rows, k=16, nw=8, dtype="bfloat16",
                    chunks=chunks, fused=fused)
        xs, ws = inputs(p, seed=i)
        late = i == len(runs) - 1
        out = play(fake, p, xs, ws, clique_key=60, late_rank=0 if late else -1)
        try:
            check(fake, out, op, xs, ws, rows, "bfloat16")
        except AssertionError as e:
            e.add_note(f"run {i} ({'rank 0 late' if late else 'every rank on time'})")
            raise
