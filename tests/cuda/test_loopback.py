"""The loopback (cpp/cuda/loopback.h): N ranks' programs on ONE GPU, run on the host-side fake.

Each rank keeps its own buffers, flags, streams and pool and reaches its peers as the same
device's memory; the ranks' threads issue their units in the issue order's global order (the
play's rounds), which completes through shared work queues, one included; a fused GEMM takes its
share of the SMs. The same runner runs on a GPU (``selftest --loopback N``); here, through the
fake, every op (FP8 and the fused GEMM's programs included) against float64, with one and eight
work queues.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from jaxoverlap import _selftest
from jaxoverlap._fused_gemm import FUSED_OPS

from .fake_cases import OPS, inputs, problem, reference

pytestmark = pytest.mark.jax_independent

TOL = 3e-2  # bfloat16's results


def loopback(fake, op, n=4, *, dtype="bfloat16", rows=8, chunks=2, bidirectional=True,
             fused=False, transport="p2p", calls=2, **kwargs):
    p = problem(op, transport, n, batch=2, rows=rows, k=16, nw=16, dtype=dtype, chunks=chunks,
                bidirectional=bidirectional, fused=fused)
    xs, ws = inputs(p)
    out = fake.loopback_run(p, [x.tobytes() for x in xs], [w.tobytes() for w in ws],
                            calls=calls, **kwargs)
    return out, xs, ws


@pytest.mark.parametrize("connections", [1, 8])
def test_the_loopback_runs_every_op_on_one_gpu(fake, connections):
    """Four ranks on fake GPU 0, two calls each, every op and the fused programs: the results
    match float64, the fake sees no misuse, every rank's work completes — through one work queue
    shared by all four ranks' streams, and through eight."""
    for op, fused in [*((op, False) for op in OPS), *((op, True) for op in FUSED_OPS)]:
        fake.reset(fake.Config(devices=1, connections=connections))
        out, xs, ws = loopback(fake, op, fused=fused)
        assert out["statuses"] == [None] * 4 and out["completed"], (op, fused, out["statuses"])
        assert fake.drain() and fake.errors() == [], fake.errors()
        assert fake.pending_watches() == 0  # the watchdog dropped the calls (and their buffers)
        refs, _ = reference(op, xs, ws, 8)
        for r, (y, ref) in enumerate(zip(out["ys"], refs, strict=True)):
            got = np.frombuffer(y, ml_dtypes.bfloat16).reshape(ref.shape).astype(np.float64)
            np.testing.assert_allclose(got, ref, rtol=TOL, atol=TOL,
                                       err_msg=f"{op} fused={fused} rank {r}")


def test_the_loopback_needs_the_global_issue_order(fake):
    """With one work queue shared by every rank's streams, ranks that issue their own orders at
    will — here the extreme of uneven speeds, one rank's call after the other's — put a rank's
    flag wait ahead of the peer's signal it waits for: the fake reports the deadlock. Issued in
    the play's global order (the control) the same calls complete."""
    fake.reset(fake.Config(devices=1, connections=1))
    out, _, _ = loopback(fake, "ag_matmul", calls=1, timeout_ms=300, ordered=False)
    assert not out["completed"]
    assert not fake.drain()
    assert any("deadlock: no work queue can progress" in e for e in fake.errors()), fake.errors()
    fake.reset(fake.Config(devices=1, connections=1))
    out, _, _ = loopback(fake, "ag_matmul", calls=1, timeout_ms=300)
    assert out["completed"] and fake.drain() and fake.errors() == [], fake.errors()


@pytest.mark.parametrize("transport", ["nccl", "multicast"])
def test_the_loopback_refuses_transports_that_need_a_gpu_per_rank(fake, transport):
    """NCCL puts one rank of a communicator on a GPU and a multicast object binds one memory per
    GPU: a clique whose ranks share a GPU is refused for them at its first call, with the reason
    and nothing enqueued."""
    fake.reset(fake.Config(devices=1))
    out, _, _ = loopback(fake, "ag_matmul", transport=transport, calls=1)
    assert all(s and "needs every rank on a GPU of its own" in s for s in out["statuses"]), \
        out["statuses"]
    assert fake.errors() == [] and fake.counters().get("cuStreamWaitValue32", 0) == 0


def test_selftest_loopback_on_the_fake(fake, tmp_path):
    """``selftest --fake --loopback 4`` (quick): every p2p row passes, FP8 and fused included,
    and the report says what one GPU cannot cover."""
    path = tmp_path / "loopback.json"
    assert _selftest.main(quick=True, fake=True, loopback=4, report=str(path)) == 0
    report = json.loads(path.read_text())
    rows = report["rows"]
    assert rows and all(r["passed"] for r in rows), [r for r in rows if not r["passed"]]
    assert all(" p2p " in r["name"] and "loopback: 4 ranks on GPU 0" in r["name"] for r in rows)
    # the fused GEMM's 2 ops in bfloat16 and in FP8 (e4m3 x e4m3 -> bfloat16), on p2p
    assert sum(" fused" in r["name"] for r in rows) == 4
    assert sum(" fused" in r["name"] and "e4m3 x e4m3" in r["name"] for r in rows) == 2
    assert sum("e4m3 x e4m3" in r["name"] for r in rows) == 5  # 3 ops chunked, 2 fused
    assert set(report["loopback"]["not_covered"]) == {"nccl", "multicast", "between GPUs"}
    with pytest.raises(ValueError, match="at least 2 ranks"):
        _selftest.main(fake=True, loopback=1)


def test_selftest_loopback_on_a_b200_leaves_the_fused_fp8_rows_out(fake, monkeypatch, tmp_path):
    """``selftest --loopback 4`` (quick) on a compute capability 10.0 GPU, played by the fake:
    its fused GEMM is the sm_100a kernel, built for the 16-bit dtypes only, so the fused FP8
    rows are left out with the reason in the report, while the fused bfloat16 and the cuBLASLt
    FP8 rows run. Before, they ran and failed at prepare (the first breaking the clique for
    the second): a first contact on a B200 reported two FAILs that were no fault."""
    from jaxoverlap._executors import capabilities, runtime

    caps = {"devices": [{"ordinal": 0, "name": "B200 (the fake)", "compute_capability": [10, 0]}],
            "peer_access": [[True]]}
    fake.reset(fake.Config(devices=1, **_selftest.FAKE_B200))
    monkeypatch.setattr(capabilities, "gpu_table", lambda: caps)
    monkeypatch.setattr(runtime, "load_cuda", lambda: fake)
    path = tmp_path / "loopback.json"
    assert _selftest.loopback_main(4, quick=True, report=str(path)) == 0
    report = json.loads(path.read_text())
    rows = report["rows"]
    assert rows and all(r["passed"] for r in rows), [r for r in rows if not r["passed"]]
    assert sum(" fused" in r["name"] for r in rows) == 2  # both ops in bfloat16, sm_100a
    assert not any(" fused" in r["name"] and "e4m3" in r["name"] for r in rows)
    assert sum("e4m3 x e4m3" in r["name"] for r in rows) == 3  # cuBLASLt's, every op
    assert "sm_100a" in report["loopback"]["not_covered"]["fused FP8"]


def test_the_gpu_module_runs_the_same_loopback(cuda):
    """``_cuda.loopback_run`` is the same runner with a GPU's hooks (cudaMemcpy for the bytes);
    without a GPU it fails with CUDA's error, cleanly."""
    p = problem("ag_matmul", "p2p", 2, batch=1, rows=4, k=16, nw=16)
    xs, ws = inputs(p)
    if cuda.capabilities().get("devices"):
        pytest.skip("a GPU is present: selftest --loopback runs it there")
    with pytest.raises(RuntimeError, match="cudaSetDevice"):
        cuda.loopback_run(p, [x.tobytes() for x in xs], [w.tobytes() for w in ws])
    with pytest.raises(ValueError, match="op"):
        cuda.loopback_run(dict(p, op="gemm"), [], [])
