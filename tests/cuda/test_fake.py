"""The CUDA executor's host code, run in CI against the host-side fake.

``_cuda_fake`` links the executor (everything but the device kernels) against
cpp/cuda/fake: a model of exactly the CUDA runtime/driver, cuBLASLt and NCCL
calls it makes (see fake_runtime.h). ``run`` (fake_harness.h) drives ``CudaSite::Enqueue`` —
what the CUDA FFI handlers call — for every rank on its own host thread, then lets
the fake "GPU" execute the queues in a seeded random interleaving. Results
must match a float64 reference for every transport; the fake must have seen
no misuse (out-of-range pointer, missing peer access, unmodeled cuBLASLt
attribute, mismatched send/recv, deadlock, ...). The cases and the check are
``fake_cases``.
"""

from __future__ import annotations

import itertools

import pytest

from .fake_cases import OPS, TRANSPORTS, check, inputs, play, problem, run_case, spanning

# The CUDA executor on its fake, driven directly: no JAX.
pytestmark = pytest.mark.jax_independent

CASES = [
    # (n, batch, rows, k, nw, chunks, bidirectional)
    (1, 1, 4, 8, 6, 1, False),
    (2, 1, 4, 8, 6, 1, False),
    (2, 3, 5, 6, 4, 2, False),
    (3, 2, 3, 8, 6, 1, True),
    (4, 2, 3, 8, 6, 2, False),
    (4, 1, 6, 4, 10, 3, True),
    (8, 2, 2, 8, 4, 2, True),
]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "n{}b{}r{}k{}n{}c{}{}".format(
    *c[:6], "bi" if c[6] else ""))
def test_every_transport_matches_reference(fake, op, transport, case):
    n, batch, rows, k, nw, chunks, bidi = case
    out, xs, ws = run_case(fake, op, transport, n, batch=batch, rows=rows, k=k, nw=nw,
                           chunks=chunks, bidirectional=bidi)
    check(fake, out, op, xs, ws, rows, "float32")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("op", OPS)
def test_half_dtypes(fake, op, transport, dtype):
    out, xs, ws = run_case(fake, op, transport, 4, batch=2, rows=4, k=8, nw=6, dtype=dtype,
                           chunks=2, bidirectional=True)
    check(fake, out, op, xs, ws, 4, dtype)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_return_gathered(fake, transport):
    out, xs, ws = run_case(fake, "ag_matmul", transport, 4, chunks=2, return_gathered=True)
    check(fake, out, "ag_matmul", xs, ws, 3, "float32", return_gathered=True)


@pytest.mark.parametrize("seed", [2, 3, 4])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_other_interleavings_and_back_to_back_calls(fake, transport, seed):
    """Five calls queued before the GPU runs any: epochs, parities, flags, events reused."""
    fake.reset(fake.Config(seed=seed))
    for op in OPS:
        out, xs, ws = run_case(fake, op, transport, 4, chunks=2, bidirectional=True, calls=5)
        check(fake, out, op, xs, ws, 3, "float32")
    # matmul_ar one-shot, rows that do not split over the 4 ranks
    out, xs, ws = run_case(fake, "matmul_ar", transport, 4, rows=3, chunks=2, calls=5,
                           algorithm="one_shot")
    check(fake, out, "matmul_ar", xs, ws, 3, "float32")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_one_shot_half_dtypes(fake, dtype):
    """The one-shot GEMM + all-reduce in half types: every transport, a batch of one row."""
    for key, transport in enumerate(TRANSPORTS, 10):
        out, xs, ws = run_case(fake, "matmul_ar", transport, 4, batch=1, rows=1, k=8, nw=6,
                               dtype=dtype, algorithm="one_shot", clique_key=key)
        check(fake, out, "matmul_ar", xs, ws, 1, dtype)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_workspace_growth_keeps_old_buffers(fake, transport):
    """A larger call on a live clique gets a new buffer generation; both shapes stay right."""
    for rows in (2, 6, 3):
        out, xs, ws = run_case(fake, "matmul_rs", transport, 4, rows=rows, chunks=2)
        check(fake, out, "matmul_rs", xs, ws, rows, "float32")


def test_devices_out_of_order_and_two_groups(fake):
    """A rank table that is not 0..N-1 (a reversed mesh axis), and two cliques side by side."""
    out, xs, ws = run_case(fake, "ag_matmul", "p2p", 4, devices=[3, 1, 2, 0], clique_key=11)
    check(fake, out, "ag_matmul", xs, ws, 3, "float32")
    out, xs, ws = run_case(fake, "ag_matmul", "nccl", 4, devices=[4, 5, 6, 7], clique_key=12)
    check(fake, out, "ag_matmul", xs, ws, 3, "float32")


def test_the_fake_was_really_used(fake):
    run_case(fake, "ag_matmul", "nccl", 4, chunks=2)
    nccl = fake.counters()
    # Non-blocking communicators, one per rank in one group, awaited until all joined.
    assert nccl["ncclCommInitRankConfig"] == 4 and nccl["ncclCommGetAsyncError"] >= 4
    assert nccl["ncclSend"] == nccl["ncclRecv"] > 0
    assert nccl["cublasLtMatmul"] > 0
    fake.reset()
    run_case(fake, "matmul_rs", "p2p", 4, chunks=2)
    p2p = fake.counters()
    assert p2p["cuStreamWriteValue32"] > 0 and p2p["cuStreamWaitValue32"] > 0
    assert p2p.get("cudaMemcpyAsync", 0) + p2p.get("cudaMemcpy2DAsync", 0) > 0
    assert p2p["cudaDeviceEnablePeerAccess"] == 12  # 4 GPUs: every ordered pair once
    fake.reset()
    run_case(fake, "matmul_rs", "multicast", 4)
    mc = fake.counters()
    assert mc["cuMulticastCreate"] == 1 and mc["cuMulticastBindMem"] == 4
    assert mc["McReduce"] > 0


# ---------------------------------------------------------------- errors


MISUSES = {
    "unmodeled cuBLASLt attribute": "not modeled",
    "row-major layout": "ORDER other than COL",
    "leading dim below rows": "leading dimension smaller",
    "misaligned pointer": "less aligned",
    "leading dim less aligned than promised": "leading dimension is less aligned",
    "batch stride less aligned than promised": "batch stride is less aligned",
    "C != D with different layouts": "out-of-place rule",
    "copy out of range": "not inside one device allocation",
    "peer copy without peer access": "without peer access enabled",
    "wait on an event never recorded": "never recorded",
    "flag never raised (deadlock)": "deadlock",
    "wait with FLUSH where remote writes cannot be flushed": "CAN_FLUSH_REMOTE_WRITES",
    "mismatched send/recv sizes": "mismatched",
    "multicast address outside a multimem kernel": "multicast address outside a multimem kernel",
    "IPC mapping touched by a device that did not open it": "opened on device 1",
    "cuMemMap mapping touched without cuMemSetAccess": "not given access",
    # The documented rules of the GPU path (fake_queues.cc, fake_nccl.cc, fake_runtime.cc cite
    # them): one work queue shared by two streams, where the wait enqueued first holds up the
    # write behind it that would satisfy it;
    "blocked wait holds up its work queue":
        "behind it in this queue: device 0 stream",
    # NCCL serialising one communicator used from two streams;
    "one communicator on two streams": "blocked at ncclGroup",
    # a handler whose forked stream is not joined back into XLA's stream;
    "handler returns with a forked stream not joined": "neither joined into XLA's stream",
    # a communicator used after ncclCommAbort freed it (a watchdog firing under an enqueue);
    "communicator used after ncclCommAbort": "already freed by ncclCommAbort",
    # a non-blocking communicator destroyed before its finalization completed;
    "non-blocking communicator destroyed without finalize": "not finalized",
    # the host querying work recorded into a stream capture;
    "host query of an event recorded in a stream capture": "during stream capture",
    # an unbounded host synchronisation behind work that never completes.
    "device synchronisation behind a wait that never ends": "would block forever",
    # TF32 compute asked for matrices that are not float32 (cuBLAS docs, cublasComputeType_t).
    "cublasLt tf32 with bf16": "FAST_TF32",
    # The fused GEMM (docs/gpu-internals.md §5): enqueued, with work that waits for it, before the
    # rank's own outgoing copy, on one work queue (the issue order's rule);
    "fused GEMM enqueued before its own outgoing copy": "behind it in this queue",
    # a kernel the fused GEMM's peers wait for queued behind it: the fused GEMM holds every SM
    # (rule 1; why it never runs with nccl), however many work queues.
    "a kernel the fused GEMM waits for, queued behind it": "a persistent kernel holds every SM",
    # ... and CUDA documents no copy engine for a 2-D copy: refused behind it
    "a 2-D peer copy behind the fused GEMM": "documents no copy engine for a 2-D copy",
    # its dynamic shared memory (> 48 KB) granted on another device only (cudaFuncSetAttribute's
    # cudaFuncAttributeMaxDynamicSharedMemorySize is per device); the controls above launch it
    # after PrepareFusedGemm granted it on each device.
    "fused GEMM launched on a device without its shared memory grant":
        "never got cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize)",
    "a trapping fused GEMM's fault record in device memory":
        "a trapping launch's fault record is not in page-locked host memory",
}
# The same wait/write pair, each stream with a work queue of its own: no misuse (so the rule above
# is about sharing a queue, not about the pair). The fused GEMM after its outgoing copy, and
# after the kernel that makes what it sends: no misuse.
CONTROLS = {"blocked wait, one work queue per stream (control)",
            "a trapping fused GEMM's fault record in page-locked host memory (control)",
            "fused GEMM after its own outgoing copy (control)",
            "a kernel the fused GEMM waits for, before it (control)",
            "a 1-D peer copy behind the fused GEMM (control)",
            "a kernel the fused GEMM waits for, queued behind it on SMs it leaves free (control)"}


def test_the_fake_fails_loudly_on_misuse(fake):
    """Without this the executor tests would prove little: every misuse must be caught."""
    caught = fake.misuse_checks()
    assert set(caught) == set(MISUSES) | CONTROLS
    for name, keyword in MISUSES.items():
        assert keyword in caught[name], f"{name}: fake recorded {caught[name]!r}"
    for name in CONTROLS:
        assert caught[name] == "", f"{name}: fake recorded {caught[name]!r}"


def test_work_queues_follow_the_environment(fake, monkeypatch):
    """The fake reads CUDA_DEVICE_MAX_CONNECTIONS as the driver does: 1..32, default 8."""
    for value, expected in (("1", 1), ("4", 4), (None, 8), ("0", 8), ("junk", 8)):
        if value is None:
            monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
        else:
            monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", value)
        fake.reset()
        assert fake.connections() == expected, value
    fake.reset(fake.Config(connections=2))
    assert fake.connections() == 2


def test_p2p_without_peer_access_says_so(fake):
    peer = [[a == b or {a, b} != {0, 1} for b in range(4)] for a in range(4)]
    fake.reset(fake.Config(peer=peer))
    out, *_ = run_case(fake, "ag_matmul", "p2p", 4)
    status = next(s for s in out["statuses"] if s)
    assert "peer access from GPU 0 to GPU 1" in status and "transport='nccl'" in status


def test_multicast_needs_sm90(fake):
    fake.reset(fake.Config(cc_major=8))
    out, *_ = run_case(fake, "ag_matmul", "multicast", 2)
    assert any(s and "sm_90" in s for s in out["statuses"]), out["statuses"]


def test_multicast_needs_the_driver_api(fake):
    fake.reset(fake.Config(multicast=False))
    out, *_ = run_case(fake, "matmul_rs", "multicast", 2)
    assert any(s and "cuMulticastCreate" in s for s in out["statuses"]), out["statuses"]


def test_multicast_half_needs_even_width(fake):
    out, *_ = run_case(fake, "ag_matmul", "multicast", 2, k=7, dtype="bfloat16")
    assert any(s and "even row width" in s for s in out["statuses"]), out["statuses"]


@pytest.mark.parametrize("processes,devices,process,device,expected", [
    ([0, 0, 0, 0], [0, 1, 2, 3], 0, 2, "rank 2 group 0"),
    ([0, 0, 0, 0], [3, 2, 1, 0], 0, 3, "rank 0 group 0"),
    ([0, 0, 0, 0], [0, 1, 2, 3], 0, 5, "does not contain"),
    ([0, 0, 0, 0], [0, 1, 1, 3], 0, 1, "twice"),
    # A clique spanning processes: the rank is found; ranks elsewhere are remote (device -1).
    ([0, 0, 1, 1], [0, 1, 0, 1], 1, 1, "rank 3 group 0"),
])
def test_rank_table_lookup(fake, processes, devices, process, device, expected):
    got = fake.place(4, processes, devices, process, device)
    assert expected in got


def test_rank_table_groups(fake):
    # mesh (dp=2, tp=2) along tp: groups [0, 1] and [2, 3].
    assert fake.place(2, [0] * 4, [0, 1, 2, 3], 0, 3) == "rank 1 group 1"


@pytest.mark.parametrize("transport", ["nccl", "p2p"])
def test_ranks_disagreeing_on_the_call(fake, transport):
    """Rank 2 asks for other chunks: the later of the disagreeing ranks gets an error naming
    both calls and the clique is broken (later calls fail fast). Peers that had already
    enqueued the call wait on the "GPU" (a deadlock in the fake): no GPU-side timeout yet. With
    nccl, peers still connecting at set-up give up when the clique breaks (their connecting
    groups released by aborting the communicators); those already past it wait likewise."""
    p = problem("ag_matmul", transport, 4, batch=1, rows=4, k=8, nw=6)
    xs, ws = inputs(p)
    args = (p, xs, ws, [0, 1, 2, 3])
    out = play(fake, *args, clique_key=5, skew_rank=2)
    failed = [s for s in out["statuses"] if s]
    assert failed and all("ranks disagree on call 1" in s for s in failed), out["statuses"]
    assert "chunks=2" in failed[0] and "chunks=1" in failed[0]
    if transport != "nccl":
        assert not out["drained"] and "deadlock" in fake.errors()[-1]
    assert all(e.startswith("deadlock: no work queue") for e in fake.errors()), fake.errors()
    again = play(fake, *args, clique_key=5)
    assert all(s and "aborted by an earlier failure" in s for s in again["statuses"])


def test_nccl_peers_aborted_by_a_disagreement_name_it(fake):
    """A disagreement breaks the clique and aborts its NCCL communicators (a peer's connecting
    group may be on the GPU): a peer whose lease or connection then finds them aborted names the
    disagreement, not only the abort. Which peer gets there first is a race, so the calls are
    played many times (before the fix about one run in four had a peer fail without naming it)."""
    p = problem("ag_matmul", "nccl", 4, batch=1, rows=4, k=8, nw=6)
    xs, ws = inputs(p)
    args = (p, xs, ws, [0, 1, 2, 3])
    for _ in range(50):
        fake.reset()
        out = play(fake, *args, clique_key=5, skew_rank=2)
        failed = [s for s in out["statuses"] if s]
        assert failed and all("ranks disagree on call 1" in s for s in failed), out["statuses"]


def test_ranks_in_different_call_sites_disagree_naming_both_sites(fake):
    """Each rank calls through a call site of its own, instantiated from its site key (as each
    process does when it compiles its program): ranks whose sites have the same key run as one
    site, whatever else was instantiated before; ranks that reach the group's clique from two
    different sites at the same epoch fail naming both sites, never exchange data."""
    p = problem("ag_matmul", "nccl", 4, batch=1, rows=4, k=8, nw=6)
    xs, ws = inputs(p)
    args = (p, xs, ws, [0, 1, 2, 3])
    same = play(fake, *args, clique_key=11, site_keys=[0x5EED] * 4)
    check(fake, same, "ag_matmul", xs, ws, 4, "float32")
    fake.reset(fake.Config(devices=4))
    other = play(fake, *args, clique_key=12, site_keys=[0x5EED, 0x5EED, 0xF00D, 0x5EED])
    failed = [s for s in other["statuses"] if s]
    assert failed and all("ranks disagree on call 1" in s for s in failed), other["statuses"]
    assert "site 0x0000000000005eed" in failed[0] and "site 0x000000000000f00d" in failed[0]


def test_rank_table_membership_errors_are_clean(fake):
    p = problem("ag_matmul", "nccl", 2, batch=1, rows=3, k=8, nw=6)
    xs, ws = inputs(p)
    out = play(fake, p, xs, ws, [0, 0], clique_key=3, calls=1)
    assert all(s and "twice" in s for s in out["statuses"])


def test_case_table_covers_every_op_kind(fake):
    """The cases above exercise every op of the program IR at least once."""
    from jaxoverlap._executors import runtime

    host = runtime.load_host()
    kinds = set()
    for op, transport, case in itertools.product(("ag_matmul", "matmul_rs"),
                                                 TRANSPORTS, CASES):
        n, batch, rows, k, nw, chunks, bidi = case
        program = host.build_program(op, transport, n, 0, batch, rows, k, nw, "float32", chunks,
                                     bidi, op == "ag_matmul")
        kinds |= {o["kind"] for o in program["ops"]}
    assert kinds >= {"Gemm", "Add", "Copy", "Send", "Recv", "McStore", "McReduce", "Signal",
                     "Wait", "Record", "StreamWait"}, kinds


def _released(fake, out, transport):
    """Whether the watchdog released the waiting streams, as it can. An NCCL wait is released by
    ncclCommAbort (no work queue needed). A flag wait (cuStreamWaitValue32) is released by
    writing the flag on a stream of the same device; with one work queue per device
    (CUDA_DEVICE_MAX_CONNECTIONS=1) that write queues behind the blocked wait and never runs: the
    call is still reported and the clique broken, but that GPU stays blocked until the peer comes
    (docs/gpu-internals.md §1)."""
    if transport == "nccl" or fake.connections() > 1:
        assert out["drained"], fake.errors()  # released: the process does not hang
        assert fake.errors() == []
        return
    assert not out["drained"]
    errors = fake.errors()
    assert errors and all(e.startswith("deadlock") and "CUDA_DEVICE_MAX_CONNECTIONS=1" in e
                          for e in errors), errors
    assert "the flags could not be read" in fake.last_warning(), fake.last_warning()


@pytest.mark.parametrize("connections", [8, 1])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("op", OPS)
def test_watchdog_turns_a_missing_peer_into_an_error(fake, op, transport, connections):
    """Rank 2 never makes the second call: its peers' streams wait on the "GPU". The watchdog
    reports who waits for what, releases the streams where it can (_released) and breaks the
    clique. (The first call sets the clique up: with nccl, a peer missing then is found at
    set-up, test_failure_paths.py.)"""
    fake.reset(fake.Config(grace_ms=10000, connections=connections))
    p = problem(op, transport, 4, batch=1, rows=4, k=8, nw=6, chunks=2)
    xs, ws = inputs(p)
    args = (p, xs, ws, [0, 1, 2, 3])
    assert play(fake, *args, clique_key=9, timeout_ms=200)["statuses"] == [None] * 4
    out = play(fake, *args, clique_key=9, skip_rank=2, timeout_ms=200)
    _released(fake, out, transport)
    warning = fake.last_warning()
    assert "not finished on GPU" in warning and "epoch 2" in warning, warning
    assert ("inside NCCL" if transport == "nccl" else "waiting for flag") in warning, warning
    again = play(fake, *args, clique_key=9)
    assert all(s and "aborted by an earlier failure" in s and "not finished" in s
               for s in again["statuses"]), again["statuses"]


def test_the_watchdog_runs_on_the_fakes_virtual_clock(fake):
    """The watchdog's time is virtual: it passes only while the fake GPU cannot progress, up to
    reset's grace_ms. With less grace than the call's timeout the watchdog never fires and the
    stuck GPU is a deadlock; with more, a ten-minute timeout fires without ten minutes passing."""
    p = problem("ag_matmul", "nccl", 4, batch=1, rows=4, k=8, nw=6, chunks=2)
    xs, ws = inputs(p)
    args = (p, xs, ws,
            [0, 1, 2, 3])
    fake.reset(fake.Config(grace_ms=150, connections=8))
    assert play(fake, *args, clique_key=30, timeout_ms=200)["statuses"] == [None] * 4  # set-up
    before = fake.last_warning()
    out = play(fake, *args, clique_key=30, skip_rank=2, timeout_ms=200)
    assert not out["drained"] and fake.errors()[-1].startswith("deadlock"), fake.errors()
    assert fake.last_warning() == before  # nothing fired
    fake.reset(fake.Config(grace_ms=11 * 60_000, connections=8))
    assert play(fake, *args, clique_key=31, timeout_ms=10 * 60_000)["statuses"] == [None] * 4
    out = play(fake, *args, clique_key=31, skip_rank=2, timeout_ms=10 * 60_000)
    assert out["drained"] and fake.errors() == [], fake.errors()
    assert "not finished on GPU" in fake.last_warning()
    assert "after 600.0 s" in fake.last_warning(), fake.last_warning()


# ---- cliques spanning processes, played in one process -------------------------------------
#
# ``processes`` gives each rank's (played) process: every played process gets its own clique
# object holding only its ranks (the others are device -1), exactly as in separate processes; the
# NCCL unique id is made once (ncclGetUniqueId, "in the process of rank 0") and registered for
# every process, as the native lowering's bootstrap does after moving it through the
# jax.distributed store. The fake's ncclCommInitRank joins the ranks that give the same id; its
# send/recv then run between them.
# What is real here: the executor's multi-process code path (placement with remote ranks,
# per-process cliques, ncclCommInitRank in a group, local-only buffers and signature checks).
# What is modelled: all played processes share one fake "GPU" world and one NCCL rendezvous.
# tests/multiprocess/test_cuda_multiprocess.py moves the id between real processes.


@pytest.mark.parametrize("processes,devices", [
    ([0, 1], [0, 0]),              # one process per GPU, each its GPU 0 (SLURM style)
    ([0, 1, 2, 3], [0, 0, 0, 0]),
    ([0, 0, 1, 1], [0, 1, 0, 1]),  # two processes with two GPUs each
    ([1, 0, 0, 1], [0, 0, 1, 1]),  # ranks interleaved across processes
])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_clique_spanning_processes_nccl(fake, op, processes, devices):
    n = len(processes)
    fake.reset()
    spanning(fake, 11, processes)
    p = problem(op, "nccl", n, batch=2, rows=3, k=8, nw=6, chunks=2, bidirectional=n > 2,
                return_gathered=op == "ag_matmul")
    xs, ws = inputs(p)
    out = play(fake, p, xs, ws, devices, clique_key=11, calls=2, processes=processes)
    check(fake, out, op, xs, ws, 3, "float32", return_gathered=op == "ag_matmul")
    counters = fake.counters()
    assert counters.get("ncclCommInitRankConfig") == n, counters
    cliques = fake.cliques() if hasattr(fake, "cliques") else None
    assert cliques is None or cliques.count("remote") >= n


@pytest.mark.parametrize("processes,devices", [
    ([0, 1], [0, 0]),              # one process per GPU, each its GPU 0
    ([0, 1, 2], [0, 1, 2]),        # distinct GPUs: the IPC mapping enables peer access
    ([3, 1, 0, 2], [0, 0, 0, 0]),
])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_clique_spanning_processes_p2p(fake, op, processes, devices):
    """p2p, one GPU per process: each buffer generation's workspace and flags go out as CUDA IPC
    handles through the clique's exchange (played here) and peers' are opened; a bigger second
    shape may grow the buffers: a new generation is exchanged the same way."""
    n = len(processes)
    fake.reset()
    for rows in (3, 5):
        p = problem(op, "p2p", n, batch=2, rows=rows, k=8, nw=6, chunks=2, bidirectional=n > 2)
        xs, ws = inputs(p)
        out = play(fake, p, xs, ws, devices, clique_key=15, calls=2, processes=processes)
        check(fake, out, op, xs, ws, rows, "float32")
    counters = fake.counters()
    # Per generation, every rank exports 2 buffers and opens its n - 1 peers' 2 buffers.
    generations, rest = divmod(counters["cudaIpcGetMemHandle"], 2 * n)
    assert rest == 0 and generations >= 1, counters
    assert counters["cudaIpcOpenMemHandle"] == 2 * n * (n - 1) * generations, counters
    cliques = fake.cliques()
    fake.reset()
    assert fake.counters() == {} and "remote" in cliques


def test_clique_spanning_processes_p2p_closes_its_mappings(fake):
    p = problem("ag_matmul", "p2p", 2, batch=1, rows=3, k=8, nw=6)
    xs, ws = inputs(p)
    out = play(fake, p, xs, ws, [0, 0], clique_key=16, processes=[0, 1])
    check(fake, out, "ag_matmul", xs, ws, 3, "float32")
    fake._reset_cliques()
    counters = fake.counters()
    assert counters["cudaIpcCloseMemHandle"] == counters["cudaIpcOpenMemHandle"] == 4, counters
    assert fake.errors() == []


@pytest.mark.parametrize("transport,devices,key", [("p2p", [0, 0], 17),
                                                 ("multicast", [0, 1], 19)])
def test_clique_spanning_processes_silent_process(fake, transport, devices, key):
    """Process 1 never calls: process 0's first exchange (agreeing on the kind of buffer handle;
    for multicast, process 0 is the owner) names it (the store's exchange after its timeout; the
    played one as soon as process 1 has returned)."""
    p = problem("ag_matmul", transport, 2, batch=1, rows=3, k=8, nw=6)
    xs, ws = inputs(p)
    out = play(fake, p, xs, ws, devices, clique_key=key, skip_rank=1, processes=[0, 1])
    assert out["statuses"][0] and "process 1 did not answer" in out["statuses"][0], out
    assert "'handles'" in out["statuses"][0]


@pytest.mark.parametrize("processes,devices", [
    ([0, 1], [0, 1]),              # one process per GPU
    ([1, 0], [0, 1]),              # rank 0 (the multicast object's owner) in process 1
    ([0, 1, 2, 3], [0, 1, 2, 3]),
])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_clique_spanning_processes_multicast(fake, op, processes, devices):
    """multicast, one GPU per process: rank 0's process creates the multicast object, exports it
    as a POSIX fd, the clique's exchange (played) duplicates it into the others, which import it;
    everyone adds its device, binds its own memory and maps; flags go over CUDA IPC. A bigger
    second shape makes a new generation, shared the same way. (The played processes share one
    fake GPU world, so their GPUs are distinct ordinals here.)"""
    n = len(processes)
    fake.reset()
    for rows in (3, 5):
        p = problem(op, "multicast", n, batch=2, rows=rows, k=8, nw=6, chunks=2)
        xs, ws = inputs(p)
        out = play(fake, p, xs, ws, devices, clique_key=18, calls=2, processes=processes)
        check(fake, out, op, xs, ws, rows, "float32")
    counters = fake.counters()
    generations = counters["cuMulticastCreate"]
    assert generations >= 1, counters
    assert counters["cuMemExportToShareableHandle"] == generations, counters
    assert counters["cuMemImportFromShareableHandle"] == (n - 1) * generations, counters
    assert counters["cuMulticastBindMem"] == n * generations, counters
    # Flags only (the workspace is the multicast object): one handle per rank and generation.
    assert counters["cudaIpcGetMemHandle"] == n * generations, counters
    assert counters["cudaIpcOpenMemHandle"] == n * (n - 1) * generations, counters
    fake._reset_cliques()
    assert fake.errors() == []


def test_clique_spanning_processes_multicast_unshareable(fake):
    """A driver that cannot export POSIX-fd handles: the owner's export fails naming the call;
    the other process, never getting the fd, names the owner's process."""
    fake.reset(fake.Config(shareable=False))
    p = problem("matmul_rs", "multicast", 2, batch=1, rows=3, k=8, nw=6)
    xs, ws = inputs(p)
    out = play(fake, p, xs, ws, [0, 1], clique_key=20, processes=[0, 1])
    assert "cuMemExportToShareableHandle" in out["statuses"][0], out
    assert "process 0 did not answer" in out["statuses"][1], out


def _run_spanning(fake, op, transport, processes, devices, rows, *, key, hosts=None, calls=2,
                  timeout_ms=120000):
    n = len(processes)
    p = problem(op, transport, n, batch=2, rows=rows, k=8, nw=6, chunks=2, bidirectional=n > 2)
    xs, ws = inputs(p)
    out = play(fake, p, xs, ws, devices, clique_key=key, calls=calls, timeout_ms=timeout_ms,
               processes=processes, hosts=hosts)
    return out, xs, ws


def _local_remote_pairs(processes):
    """Sum over processes of (its ranks) x (other processes' ranks): IPC opens per buffer."""
    n = len(processes)
    return sum(processes.count(p) * (n - processes.count(p)) for p in set(processes))


@pytest.mark.parametrize("transport,processes,devices", [
    ("p2p", [0, 0, 1, 1], [0, 1, 2, 3]),        # one process per pair of GPUs
    ("p2p", [1, 0, 0, 1], [0, 1, 2, 3]),        # ranks interleaved across processes
    ("p2p", [0, 0, 1, 1], [0, 1, 0, 1]),        # each process its GPUs 0 and 1 (one per node)
    ("p2p", [0, 0, 0, 1], [0, 1, 2, 3]),        # uneven
    ("multicast", [0, 0, 1, 1], [0, 1, 2, 3]),
    ("multicast", [1, 1, 0, 0], [0, 1, 2, 3]),  # rank 0 (the owner) in process 1
])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_clique_spanning_processes_several_gpus_per_process(fake, op, transport, processes,
                                                            devices):
    """Several GPUs of one clique in each process, CUDA IPC: local peers reach each other with
    peer access; every local GPU opens its own mapping of each remote rank's buffers (a mapping
    belongs to the device that opened it: the fake rejects any other device touching it). Two
    shapes: the second may grow the buffers, exchanged again."""
    fake.reset()
    for rows in (3, 5):
        out, xs, ws = _run_spanning(fake, op, transport, processes, devices, rows, key=21)
        check(fake, out, op, xs, ws, rows, "float32")
    counters = fake.counters()
    buffers = 2 if transport == "p2p" else 1  # multicast: flags only
    n = len(processes)
    generations, rest = divmod(counters["cudaIpcGetMemHandle"], buffers * n)
    assert rest == 0 and generations >= 1, counters
    assert counters["cudaIpcOpenMemHandle"] == \
        buffers * _local_remote_pairs(processes) * generations, counters
    assert counters["cudaDeviceEnablePeerAccess"] > 0, counters
    assert "peers through CUDA IPC" in fake.cliques()
    # A generation every local rank is past may be freed while the clique lives (its mappings
    # closed), never the newest.
    per_generation = buffers * _local_remote_pairs(processes)
    assert counters.get("cudaIpcCloseMemHandle", 0) <= per_generation * (generations - 1)
    fake._reset_cliques()
    assert fake.counters()["cudaIpcCloseMemHandle"] == counters["cudaIpcOpenMemHandle"]
    assert fake.errors() == []


@pytest.mark.parametrize("transport,processes,devices", [
    ("p2p", [0, 1], [0, 1]),
    ("p2p", [0, 0, 1, 1], [0, 1, 2, 3]),
    ("multicast", [0, 1], [0, 1]),
    ("multicast", [1, 0, 0, 1], [0, 1, 2, 3]),
])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_clique_spanning_hosts_with_fabric_handles(fake, op, transport, processes, devices):
    """Multi-node NVLink: when every process's GPUs support fabric handles (and an IMEX channel
    lets them be used), buffers are cuMemCreate'd with a fabric handle, exported as bytes and
    mapped once per process for all its GPUs; the multicast object goes as a fabric handle too.
    No fd and no CUDA IPC: so processes on different hosts work."""
    fake.reset(fake.Config(fabric=True))
    hosts = {p: f"node-{p}" for p in set(processes)}
    for rows in (3, 5):
        out, xs, ws = _run_spanning(fake, op, transport, processes, devices, rows, key=22,
                                    hosts=hosts)
        check(fake, out, op, xs, ws, rows, "float32")
    counters = fake.counters()
    assert "cudaIpcOpenMemHandle" not in counters and "cudaIpcGetMemHandle" not in counters
    buffers = 2 if transport == "p2p" else 1
    procs = len(set(processes))
    n = len(processes)
    imports = counters["cuMemImportFromShareableHandle"]
    generations = counters.get("cuMulticastCreate", 0)
    if transport == "multicast":
        # Per generation: (procs - 1) imports of the object, and each process maps each remote
        # rank's flags once.
        per_generation = (procs - 1) + sum(n - processes.count(p) for p in set(processes))
        assert imports == per_generation * generations, counters
    else:
        per_generation = buffers * sum(n - processes.count(p) for p in set(processes))
        assert imports % per_generation == 0 and imports >= per_generation, counters
    assert "peers through fabric handles" in fake.cliques()
    fake._reset_cliques()
    assert fake.errors() == []


@pytest.mark.parametrize("transport", ["p2p", "multicast"])
def test_clique_spanning_hosts_without_fabric_handles_says_so(fake, transport):
    """Processes on two hosts, GPUs without fabric support: CUDA IPC cannot cross hosts, so every
    process gets an error naming the hosts, the reason and the way out, instead of a failed
    mapping later."""
    fake.reset(fake.Config(fabric=False))
    out, _, _ = _run_spanning(fake, "ag_matmul", transport, [0, 1], [0, 1], 3, key=23,
                              hosts={0: "node-a", 1: "node-b"}, calls=1)
    for status in out["statuses"]:
        assert status and "between hosts" in status, out["statuses"]
        assert "processes 0 on node-a" in status and "processes 1 on node-b" in status
        assert "does not support fabric handles" in status and "transport='nccl'" in status
    assert fake.errors() == []


def test_fabric_without_an_imex_channel_falls_back_on_one_host(fake):
    """The GPUs support fabric handles but this user has no IMEX channel: creating one fails
    (the probe finds out), so processes on one host use CUDA IPC; across hosts the error says
    what is missing."""
    fake.reset(fake.Config(fabric=True, imex_channel=False))
    out, xs, ws = _run_spanning(fake, "matmul_rs", "p2p", [0, 1], [0, 1], 3, key=24)
    check(fake, out, "matmul_rs", xs, ws, 3, "float32")
    assert "peers through CUDA IPC" in fake.cliques()
    fake.reset(fake.Config(fabric=True, imex_channel=False))
    out, _, _ = _run_spanning(fake, "matmul_rs", "p2p", [0, 1], [0, 1], 3, key=25,
                              hosts={0: "a", 1: "b"}, calls=1)
    assert all(s and "IMEX channel" in s for s in out["statuses"]), out["statuses"]


def test_clique_spanning_processes_without_peer_access_between_local_gpus(fake):
    """Two GPUs of one process that cannot reach each other: a clear error naming them; the
    process tells its peers at the first exchange, so they fail at once naming it (not after
    the timeout: then they would name no cause), and their clique stays broken."""
    peer = [[True] * 4 for _ in range(4)]
    peer[0][1] = peer[1][0] = False
    fake.reset(fake.Config(peer=peer))
    out, xs, ws = _run_spanning(fake, "ag_matmul", "p2p", [0, 0, 1, 1], [0, 1, 2, 3], 3, key=26,
                                calls=1, timeout_ms=60000)
    statuses = out["statuses"]
    assert statuses[0] and "peer access from GPU 0 to GPU 1" in statuses[0], statuses
    assert statuses[2] and "process 0 could not set up its GPUs" in statuses[2], statuses
    assert "peer access from GPU 0 to GPU 1" in statuses[2], statuses
    again, _, _ = _run_spanning(fake, "ag_matmul", "p2p", [0, 0, 1, 1], [0, 1, 2, 3], 3, key=26,
                                calls=1, timeout_ms=60000)
    assert all(s and "aborted by an earlier failure" in s for s in again["statuses"]), again


def test_clique_spanning_processes_without_the_id(fake):
    """A process that never traced the call (no id registered) gets a clear error, not a hang."""
    p = problem("matmul_rs", "nccl", 2, batch=1, rows=3, k=8, nw=6)
    xs, ws = inputs(p)
    out = play(fake, p, xs, ws, [0, 0], clique_key=13, processes=[0, 1])
    assert all(s and "has no NCCL unique id" in s and "jax.distributed" in s
               for s in out["statuses"]), out["statuses"]


def test_clique_spanning_processes_missing_peer_times_out(fake):
    """After a first call together, process 1 skips one: process 0's rank waits inside NCCL on
    the GPU; the watchdog reports it."""
    fake.reset(fake.Config(grace_ms=10000))
    spanning(fake, 14, [0, 1])
    p = problem("ag_matmul", "nccl", 2, batch=1, rows=4, k=8, nw=6)
    xs, ws = inputs(p)
    args = (p, xs, ws, [0, 0])
    first = play(fake, *args, clique_key=14, processes=[0, 1])
    assert first["statuses"] == [None, None], first
    out = play(fake, *args, clique_key=14, processes=[0, 1], skip_rank=1, timeout_ms=200)
    assert out["drained"], fake.errors()
    warning = fake.last_warning()
    assert "not finished on GPU" in warning and "inside NCCL" in warning, warning


def test_nccl_communicator_creation_has_a_deadline(fake):
    """Process 1 never makes its first call: process 0's communicator creation (which needs
    every rank to join) does not wait forever: after the call's timeout it fails saying so, and
    the half-made communicator is aborted. The process goes on (a later call fails fast)."""
    spanning(fake, 28, [0, 1])
    p = problem("matmul_rs", "nccl", 2, batch=1, rows=4, k=8, nw=6)
    xs, ws = inputs(p)
    args = (p, xs, ws, [0, 0])
    out = play(fake, *args, clique_key=28, processes=[0, 1], skip_rank=1, timeout_ms=300)
    status = out["statuses"][0]
    assert status and status.startswith("timeout") and "NCCL communicator creation" in status, out
    assert "every process's ranks must join" in status, status
    assert fake.counters()["ncclCommAbort"] >= 1
    assert fake.errors() == []
    again = play(fake, *args, clique_key=28, processes=[0, 1], skip_rank=1, timeout_ms=300)
    assert "aborted by an earlier failure" in again["statuses"][0], again


def test_watchdog_names_the_process_of_a_missing_peer(fake):
    """A p2p clique over two processes is set up (first call), then process 1's rank skips a
    call: process 0's watchdog says which flag, from which rank, in which process."""
    fake.reset(fake.Config(grace_ms=10000))
    out, xs, ws = _run_spanning(fake, "ag_matmul", "p2p", [0, 1], [0, 1], 3, key=27, calls=1)
    check(fake, out, "ag_matmul", xs, ws, 3, "float32")
    out = play(fake, problem("ag_matmul", "p2p", 2, batch=2, rows=3, k=8, nw=6, chunks=2), xs, ws,
               [0, 1], clique_key=27, skip_rank=1, timeout_ms=200, processes=[0, 1])
    warning = fake.last_warning()
    _released(fake, out, "p2p")
    assert "waiting for flag" in warning and "from rank 1 (process 1)" in warning, warning


def test_nccl_ids_are_checked(fake):
    with pytest.raises(ValueError, match="128 bytes"):
        fake.set_nccl_id(1, 0, 0, b"short")


def test_nvtx_ranges_named_when_a_tool_is_attached(fake):  # fake: skip/fail as the others
    """With NVTX_INJECTION64_PATH set (as Nsight sets it) the executor builds a range name for
    every call and op it enqueues; here the "tool" does not exist, so NVTX stays a no-op, and
    every transport still computes the right result. (What Nsight shows is not checked here.)"""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, sys.argv[1])
        from conftest import require_module
        from fake_cases import OPS, TRANSPORTS, check, run_case
        fake = require_module("_cuda_fake")
        for op in OPS:
            for transport in TRANSPORTS:
                fake.reset()
                out, xs, ws = run_case(fake, op, transport, 4, chunks=2, bidirectional=True)
                check(fake, out, op, xs, ws, 3, "float32")
        print("ok")
    """)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, NVTX_INJECTION64_PATH=os.path.join(here, "no-such-nvtx-tool.so"))
    done = subprocess.run([sys.executable, "-c", script, here], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_watchdog_aborts_leased_communicators_only_when_the_enqueue_lets_go(fake):
    """Item 5 of the GPU rules, with the watchdog on another thread: while an enqueue holds its
    rank's lease, the watchdog's Abort takes down only the other rank's communicators; the
    enqueue's NCCL calls after the abort still find theirs alive, and dropping the lease aborts
    them. A new Acquire after Abort is refused."""
    got = fake.lease_race(hold_lease=True)
    assert got["errors"] == [], got["errors"]
    assert got["aborts_when_abort_returned"] == 2   # rank 1's two; rank 0's are leased
    assert got["aborts_at_end"] == 4                # rank 0's when the lease was dropped
    assert "abort" in got["acquire_after_abort"].lower()


def test_without_the_lease_the_same_race_is_a_use_after_abort(fake):
    """Deliberate misuse: the enqueue keeps the communicators but drops the lease, so the
    watchdog's Abort frees them under it; the fake reports the use after abort."""
    got = fake.lease_race(hold_lease=False)
    assert got["aborts_when_abort_returned"] == 4
    assert any("already freed by ncclCommAbort" in e for e in got["errors"]), got["errors"]
