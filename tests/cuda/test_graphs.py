"""The fake's stream capture of several streams and its graph replay (cpp/cuda/fake/fake_graphs.cc):
a stream that waits on an event recorded in a capture joins it, the capture's records and waits
are the graph's edges, every joined stream must be joined back before the capture ends, and a
launch runs each captured stream's nodes on a stream of its own, so that the branches run
concurrently as they did when captured (CUDA programming guide, "CUDA Graphs", "Cross-stream
Dependencies and Events"). Then a program of three streams (the fused all-gather over p2p)
captured through the CUDA executor and replayed: right once, and, with its host-side epochs baked
in, wrong from its second replay — why only a program without them may be captured
(docs/gpu-internals.md §8); then every replayable program (ag_matmul and matmul_rs over p2p,
chunked and fused) captured and replayed right, and a dead peer at its waits reported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from .fake_cases import NP, inputs, play, problem

pytestmark = pytest.mark.jax_independent

GRAPH_CHECKS = {
    # s1 copies and raises a flag, s0 (which waits for the flag, recorded ahead of it) copies on:
    # three launches, each with new data, each right; a one-stream replay would wait forever
    "a graph of two streams launched three times (control)": "",
    "a forked stream not joined back before the capture ends":
        "was not joined back into the origin stream",
    # the replay enqueues the nodes in their recorded order, as the capture's streams would have
    # been: with one work queue the wait blocks the queue ahead of its write, as uncaptured
    "one work queue, a wait recorded ahead of its write":
        "deadlock: no work queue can progress (CUDA_DEVICE_MAX_CONNECTIONS=1",
}


def test_graph_checks(fake):
    got = fake.graph_checks()
    assert set(got) == set(GRAPH_CHECKS)
    for name, want in GRAPH_CHECKS.items():
        if want:
            assert want in got[name], (name, got[name])
        else:
            assert got[name] == "", (name, got[name])


def _fused_ag_replays(fake, connections):
    fake.reset(fake.Config(connections=connections))
    n = 4
    p = problem("ag_matmul", "p2p", n, batch=1, rows=8, k=16, nw=16, dtype="bfloat16",
                fused=True, chunks=2, bidirectional=True)
    xs, ws = inputs(p, 0)
    ws = [ws[0]] * n  # one w, so that every rank's y is the gathered x times it
    replay_xs = [inputs(p, seed)[0] for seed in (1, 2, 3)]
    out = play(fake, p, xs, ws, calls=1, capture=True, replays=3,
               replay_xs=[[x.tobytes() for x in r] for r in replay_xs], replay_late_rank=1,
               capture_any=True)
    w = ws[0].astype(np.float64)
    right = []
    for ys, x in zip(out["replay_ys"], replay_xs, strict=True):
        want = np.concatenate([s[0] for s in x]).astype(np.float64) @ w
        right.append([np.allclose(np.frombuffer(y, NP["bfloat16"]).astype(np.float64)
                                  .reshape(want.shape), want, rtol=2e-2, atol=2e-2) for y in ys])
    return out, right


@pytest.mark.parametrize("connections", [1, 8])
def test_a_captured_three_stream_call_with_host_side_epochs_is_wrong_from_its_second_replay(
        fake, connections):
    """The fused all-gather over p2p (compute stream and two comm streams, forked from and joined
    into XLA's stream) recorded into a graph on every rank through the test seam that lets any
    call be captured, then launched three times with new inputs, rank 1 last. The first replay
    is right on every rank: the graph's three streams run as recorded, with their flags between
    the ranks. From the second on its waits are satisfied by the flags of the first (the epoch
    baked in) and the ranks multiply stale shards. Without the seam the handler refuses it."""
    out, right = _fused_ag_replays(fake, connections)
    assert out["statuses"] == [None] * 4 and out["replay_drained"] == [True] * 3
    assert right[0] == [True] * 4, right
    assert not any(right[1]) and not any(right[2]), right
    fake.reset()
    p = problem("ag_matmul", "p2p", 2, batch=1, rows=8, k=16, nw=16, dtype="bfloat16",
                fused=True)
    xs, ws = inputs(p, 0)
    refused = play(fake, p, xs, ws, calls=1, capture=True, replays=1)
    assert all("this program's host side would not replay" in s for s in refused["statuses"])


# Every replayable program (docs/gpu-internals.md §8): (op[/algorithm], transport, fused).
REPLAYABLE = [(op, transport, fused) for transport in ("p2p", "multicast")
              for op, fused in (("ag_matmul", True), ("ag_matmul", False), ("matmul_rs", False),
                                ("matmul_rs", True), ("matmul_ar/two_shot", False),
                                ("matmul_ar/one_shot", False))]
IDS = [f"{op}-{transport}-{'fused' if fused else 'chunked'}" for op, transport, fused in REPLAYABLE]


def _replayable_problem(op, fused, n, transport="p2p", **fields):
    op, _, algorithm = op.partition("/")
    return problem(op, transport, n, batch=fields.pop("batch", 1), rows=8, k=16, nw=16,
                   dtype="bfloat16", fused=fused, replayable=True,
                   algorithm=algorithm or "two_shot", **fields)


def _right(op, ys, x, w):
    """Per rank, whether its y is its inputs' product, computed here in float64: x [batch, rows,
    k] per rank; the all-gather's y is every rank's rows times w, the reduce-scatter's rank r's
    block of the sum over ranks of x_i times w, the all-reduce's all of that sum."""
    if op == "ag_matmul":
        wants = [np.concatenate(x, axis=1).astype(np.float64) @ w] * len(ys)
    elif op.startswith("matmul_ar"):
        wants = [sum(xi.astype(np.float64) for xi in x) @ w] * len(ys)
    else:
        rows = x[0].shape[1] // len(x)
        total = sum(xi.astype(np.float64) for xi in x)  # every rank's w is the one w
        wants = [total[:, r * rows:(r + 1) * rows] @ w for r in range(len(ys))]
    # bf16 partials rounded at each ring step: an error of a few ulps of the largest output
    return [np.allclose(np.frombuffer(y, NP["bfloat16"]).astype(np.float64)
                        .reshape(want.shape), want, rtol=2e-2,
                        atol=1.5e-2 * np.abs(want).max())
            for y, want in zip(ys, wants, strict=True)]


def _replayable_case(fake, connections, n, chunks, bidirectional, late, op="ag_matmul",
                     fused=True, transport="p2p"):
    p = _replayable_problem(op, fused, n, transport, batch=2, chunks=chunks,
                            bidirectional=bidirectional, return_gathered=op == "ag_matmul")
    return replayed(fake, p, connections, late)


def replayed(fake, p, connections, late):
    """A problem ``p`` (bfloat16, one w) played on a fresh fake: two ordinary calls back to
    back, then captured on every rank and launched three times with new inputs, rank ``late``
    last. (What the fake gave back, every rank's eager y right, per replay every rank's y
    right.)"""
    n, op = p["nranks"], p["op"]
    fake.reset(fake.Config(connections=connections, seed=10 * n + p["chunks"]))
    xs, ws = inputs(p, 0)
    ws = [ws[0]] * n
    replay_xs = [inputs(p, seed)[0] for seed in (1, 2, 3)]
    out = play(fake, p, xs, ws, calls=2, capture=True, replays=3,
               replay_xs=[[x.tobytes() for x in r] for r in replay_xs], replay_late_rank=late)
    w = ws[0].astype(np.float64)
    return out, _right(op, out["ys"], xs, w), [_right(op, ys, x, w) for ys, x in
                                               zip(out["replay_ys"], replay_xs, strict=True)]


def _check_replays(fake, connections, op, fused, cases, transport="p2p"):
    for n, chunks, bidir in cases:
        out, eager, replays = _replayable_case(fake, connections, n, chunks, bidir, late=n - 1,
                                               op=op, fused=fused, transport=transport)
        case = (op, transport, fused, n, chunks, bidir)
        assert out["statuses"] == [None] * n, (case, out["statuses"])
        assert out["drained"] and out["replay_drained"] == [True] * 3, case
        assert fake.errors() == [], (case, fake.errors())
        assert eager == [True] * n, case
        assert replays == [[True] * n] * 3, (case, replays)


@pytest.mark.parametrize("connections", [1, 8])
def test_a_captured_replayable_fused_ag_replayed_k_times_gives_k_right_answers(fake,
                                                                              connections):
    """The replayable fused all-gather (docs/gpu-internals.md §8: flag values 1, reset by their
    reader, each rank's shard pushed straight to every peer, an acknowledgement per writer,
    buffers of its own) through the CUDA executor: two ordinary calls back to back, then the
    call captured into a graph on every rank and launched three times with new inputs, the last
    rank launching last — every call and every replay right, N 2-8, chunks 1-4, both
    directions, two batches, the gathered x returned, with one and eight work queues. The epoch
    program in the same case (above) is wrong from its second replay."""
    _check_replays(fake, connections, "ag_matmul", True,
                   [(n, c, b) for n in range(2, 9) for c in (1, 2, 3, 4) for b in (False, True)])


@pytest.mark.parametrize("connections", [1, 8])
@pytest.mark.parametrize("op, transport, fused", REPLAYABLE[1:], ids=IDS[1:])
def test_every_replayable_program_replayed_k_times_gives_k_right_answers(fake, connections, op,
                                                                         transport, fused):
    """The other replayable programs, the same way: over p2p the all-gather's ring (its
    forwarding waits bounded kernels), the reduce-scatter's ring and its fused GEMM (its comm
    streams waiting for the kernel's own releases, then for peers' flags); over multicast both
    ops chunked and fused (stores through the multicast object, load-reduces of every rank's
    workspace); matmul_ar's two_shot and one_shot programs over both — N 2-5, chunks 1-2, both
    directions, every call and replay right, with one and eight work queues."""
    _check_replays(fake, connections, op, fused,
                   [(n, c, b) for n in (2, 3, 4, 5) for c in (1, 2) for b in (False, True)],
                   transport)


def test_a_replayable_calls_first_execution_under_capture_is_refused(fake):
    """Its set-up allocates its buffers, which a capture cannot hold: refused with the reason
    (XLA runs an executable once before it records it)."""
    p = problem("ag_matmul", "p2p", 2, batch=1, rows=8, k=16, nw=16, dtype="bfloat16",
                fused=True, replayable=True)
    xs, ws = inputs(p, 0)
    out = play(fake, p, xs, ws, calls=0, capture=True, replays=1)
    assert all("under CUDA-graph capture" in s for s in out["statuses"]), out["statuses"]


def _dead_peer(fake, replayed, timeout_ms=1000):
    """N 2, the replayable program; rank 1 never makes the call (eager), or does not launch its
    graph in the second replay (replayed)."""
    fake.reset(fake.Config(grace_ms=6000))
    p = problem("ag_matmul", "p2p", 2, batch=1, rows=8, k=16, nw=16, dtype="bfloat16",
                fused=True, replayable=True)
    xs, ws = inputs(p, 0)
    if replayed:
        return play(fake, p, xs, ws, calls=1, capture=True, replays=2, replay_skip_rank=1,
                    timeout_ms=timeout_ms)
    return play(fake, p, xs, ws, calls=1, skip_rank=1, timeout_ms=timeout_ms)


@pytest.mark.parametrize("replayed", [False, True], ids=["eager", "replayed"])
def test_a_peer_that_never_comes_makes_the_rank_trap_and_is_reported(fake, replayed):
    """A replayable call's waits for a peer give up, record why in page-locked host memory and
    trap (docs/gpu-internals.md §8, "A dead peer"): rank 1 never comes, so rank 0's fused GEMM,
    waiting for rank 1's shard, gives up on its own bound (twice the timeout plus a second, on
    the fake GPUs' clock), writes the replay area's fused record and traps — a sticky error: no
    later work of rank 0 runs, so no later replay pushes into a peer that may still read — or
    its acknowledgement wait (the call's timeout) does the same first; the watchdog's standing
    watch reports the record and breaks the clique: no hang, eagerly and in a replay (which runs
    no host code).
    Control: the same calls with rank 1 present — nothing reported, the clique whole."""
    out = _dead_peer(fake, replayed)
    assert out["statuses"] == [None, None], out["statuses"]
    # Which wait gives up first depends on whether the wait kernel found an SM beside the fused
    # GEMM; on the fake it is the fused GEMM (bound 3 s) for the eager call, the acknowledgement
    # wait (1 s, after rank 0 pushed its shard) in the replay. The one that gives up traps once
    # its record is written: device 0's sticky error, its later work dropped.
    gemm = ("sticky error on device 0: FusedGemm<bf16> (16 x 16 x 16, batch 1) on device 0: a "
            "wait gave up after its timeout (block 1), recorded why and trapped",
            "its fused GEMM's wait for row block 1 did not see its flag reach 1 within 3.0 s "
            "(it is 0)")
    # flag N*C + 1: rank 1's acknowledgement of rank 0 (core/build_internal.h Acknowledge)
    ack = ("sticky error on device 0: FlagWait (flag 3 from rank 1) on device 0 gave up after "
           "its timeout, recorded why and trapped",
           "its wait for flag 3 from rank 1 (its acknowledgement) did not see 1 within 1.0 s "
           "(it is 0)")
    error, reported = ack if replayed else gemm
    assert out["drained"] and fake.errors() == [error], fake.errors()
    if replayed:
        assert out["replay_drained"] == [True, True], out["replay_drained"]
    warning = fake.last_warning()
    assert "replayable ag_matmul, rank 0" in warning, warning
    assert reported in warning, warning
    assert "gave up and trapped: the GPU's context has a sticky error" in warning, warning
    assert "BROKEN" in fake.cliques()
    # control: every rank present
    fake.reset(fake.Config(grace_ms=6000))
    p = problem("ag_matmul", "p2p", 2, batch=1, rows=8, k=16, nw=16, dtype="bfloat16",
                fused=True, replayable=True)
    xs, ws = inputs(p, 0)
    before = fake.last_warning()
    out = play(fake, p, xs, ws, calls=1, capture=replayed, replays=2 if replayed else 0,
               timeout_ms=1000)
    assert out["drained"] and fake.errors() == [] and out["statuses"] == [None, None]
    assert fake.last_warning() == before
    assert "BROKEN" not in fake.cliques()


@pytest.mark.parametrize("replayed, connections", [(False, 8), (True, 8), (False, 1)],
                         ids=["eager", "replayed", "eager-1-queue"])
@pytest.mark.parametrize("op, transport, fused", REPLAYABLE, ids=IDS)
def test_every_peer_wait_of_every_replayable_program_is_bounded(fake, op, transport, fused,
                                                                replayed, connections):
    """N 4 one way (the rings forward), rank 2 never calls (eager) or never launches its graph
    (its second replay): every wait of the others for a flag a peer raises — the data waits,
    the all-gather ring's forwarding waits, the acknowledgements — is the bounded flag-wait
    kernel and the fused all-gather's block waits have the GEMM's own bound, so each gives up on
    the GPUs' clock, records why and traps (the fake poisons the device: its queued work
    dropped); the watchdog reports a wait that gave up and breaks the clique, and every stream
    drains: no hang — with the driver's default 8 work queues and with one, where a wait the
    work queue serializes before another stream's work would otherwise hold it. (The fused
    all-gather pushes each shard straight to every peer: it has no forwarding wait.)"""
    fake.reset(fake.Config(grace_ms=6000, connections=connections))
    p = _replayable_problem(op, fused, 4, transport)
    xs, ws = inputs(p, 0)
    if replayed:
        out = play(fake, p, xs, ws, calls=1, capture=True, replays=2, replay_skip_rank=2,
                   timeout_ms=1000)
        assert out["replay_drained"] == [True, True], out["replay_drained"]
    else:
        out = play(fake, p, xs, ws, calls=1, skip_rank=2, timeout_ms=1000)
    assert out["statuses"] == [None] * 4, out["statuses"]
    errors = fake.errors()
    assert out["drained"] and errors, errors
    # every error is a device that trapped after recording why; none is a deadlock
    assert all(e.startswith("sticky error on device ") and "recorded why and trapped" in e
               for e in errors), errors
    warning = fake.last_warning()
    assert f"replayable {op.partition('/')[0]}, rank " in warning, warning
    assert "did not see" in warning and "gave up and trapped" in warning, warning
    assert "the clique is broken" in warning, warning
    assert "BROKEN" in fake.cliques()


def test_the_fake_flag_wait_kernel_and_its_misuse(fake):
    """The bounded flag-wait kernel on the fake (cpp/cuda/kernels/flag_wait_body.h): a flag
    raised on another stream ends the wait, the record untouched (control); a flag never raised
    ends it after its timeout on the GPUs' clock with the record written (flag, writer, value
    seen, value waited for); launches it cannot run as built are refused — a fault record not in
    page-locked host memory (the watchdog reads it with host loads while the kernel runs), a
    launch that is not one thread, a timeout of 0 (it would give up at once), a flag no device
    reaches, a device that would JIT-compile it (%globaltimer is unspecified there). A wait that
    gives up traps once its record is written: the device's sticky error, the write queued
    behind it never runs; two waits of one rank giving up together leave one record, one trap."""
    got = fake.flag_wait_misuse_checks()
    assert got["a flag raised on another stream (control)"] == "after: 5", got
    trapped = ("sticky error on device 0: FlagWait (flag {}) on device 0 gave up after its "
               "timeout, recorded why and trapped")
    assert got["a flag never raised"] == (
        trapped.format("7 from rank 3") +
        "; record: code 1 flag 7 writer 3 seen 0 value 1; after: 0"), got
    assert "not in page-locked host memory" in got["a fault record in device memory"], got
    assert "one block of one thread" in got["a launch of two threads"], got
    assert "timeout_ns <= 0" in got["a timeout of 0"], got
    assert "not inside one device allocation" in got["a flag in pageable host memory"], got
    two = got["two waits of one rank that give up together"]
    assert two.count("sticky error") == 1 and two.endswith("after: 0"), two
    assert any(two.startswith(trapped.format(f"{f} from rank 3"))
               and f"record: code 1 flag {f} " in two for f in (7, 9)), two
    jit = got["a device that would JIT-compile it"]
    assert "the bounded flag wait bounds its waits with the GPU's %globaltimer" in jit, jit
    assert "sm_120" in jit and "compute_90" in jit and "build for this GPU" in jit, jit


_ONE_HALF = """
import jaxoverlap._cuda_fake as fake
from tests.cuda.fake_cases import inputs, play, problem
fake.reset(fake.Config())
for replayable in (False, True):
    p = problem("ag_matmul", "p2p", 2, batch=1, rows=8, k=16, nw=16, dtype="bfloat16",
                fused=True, replayable=replayable)
    xs, ws = inputs(p, 0)
    out = play(fake, p, xs, ws, calls=1, clique_key=5 + replayable)
    assert out["statuses"] == [None, None], out["statuses"]
"""


def test_the_replay_area_is_one_half():
    """A replayable program runs at epoch 0 only, so its own buffers are one half (the plain
    program's generations are two, by epoch parity): the set-up's log line says how many halves
    it allocated (JAXOVERLAP_LOG=info, read once per process: a process of its own)."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _ONE_HALF], cwd=root, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "JAXOVERLAP_LOG": "info"})
    assert done.returncode == 0, done.stderr
    made = [line for line in done.stderr.splitlines() if "new buffers from epoch" in line]
    assert len(made) == 2, done.stderr
    assert "clique 0x0000000000000005" in made[0] and "workspace 2 x 512 bytes" in made[0]
    assert "clique 0x0000000000000006" in made[1] and "workspace 1 x 512 bytes" in made[1]
