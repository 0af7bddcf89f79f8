"""``python -m jaxoverlap selftest`` on a machine without a GPU (every CI machine)."""

from __future__ import annotations

import re

import pytest

from jaxoverlap import _kinds, _selftest
from jaxoverlap._executors import capabilities, runtime
from jaxoverlap._info import format_info, info
from jaxoverlap._selftest import main


@pytest.mark.slow
def test_selftest_runs_and_says_no_gpu(capsys):
    if capabilities.gpu_table().get("devices"):
        return  # a GPU machine: the command itself is the test there
    assert main(quick=True) == 0
    out = capsys.readouterr().out
    assert "NO GPU FOUND" in out and "does NOT test the CUDA executor" in out
    assert "FAIL " not in out
    for transport in _kinds.names(_kinds.TRANSPORTS):
        for op in _kinds.names(_kinds.OPS):
            assert f"PASS  {op:9s} {transport}" in out
    if runtime.cuda_error() is None:
        assert "(CUDA executor on the host-side fake)  max |native - float64|" in out


def test_info_prints_the_gpu_section():
    data = info()
    if not data.get("native", {}).get("available"):
        return  # no native extension at all: nothing to show
    text = format_info(data)
    assert "gpu:" in text
    if runtime.cuda_error() is None:
        assert "nccl: 2." in text and "cublas:" in text and "gpus:" in text


def test_selftest_on_the_fake_honours_the_work_queue_setting(capsys, monkeypatch):
    """``selftest --fake`` (quick): the executor on the fake with one work queue per device."""
    from .conftest import require_module

    fake = require_module("_cuda_fake")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    assert main(quick=True, fake=True) == 0
    out = capsys.readouterr().out
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in out and "FAIL " not in out
    for op in _selftest.OPS:
        for transport in _kinds.names(_kinds.TRANSPORTS):
            assert f"PASS  {op:9s} {transport:9s}" in out
    # the fused GEMM's 2 ops x 2 transports, in bfloat16 and in FP8 (e4m3 x e4m3)
    assert out.count(" fused (CUDA executor on the host-side fake)") == 8
    for op in _selftest.FUSED_OPS:
        assert len(re.findall(rf"PASS  {op} +\w+ +e4m3 x e4m3 -> bfloat16 2x16x48 chunks=\d"
                              r"( bidi)? fused \(CUDA executor", out)) == 2, op
    # the sm100 kernel's rows (bfloat16) on a B200-like fake device
    assert out.count(" fused (CUDA executor on the host-side fake on a fake B200 (sm_100a))") == 4
    fake.reset()
    assert fake.connections() == 1  # the fake read the variable as the driver does
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    fake.reset()
    assert fake.connections() == 8


def test_selftest_report_on_the_fake(tmp_path, monkeypatch, capsys):
    """``selftest --fake --report FILE``: versions, topology, every row with its time; with rows
    made to fail (a bound of zero), the first error and the cliques as they were then."""
    import json

    from jaxoverlap import _selftest

    from .conftest import require_module

    require_module("_cuda_fake")
    path = tmp_path / "report.json"
    assert main(quick=True, fake=True, report=str(path)) == 0
    report = json.loads(path.read_text())
    assert report["versions"]["jax"] and report["versions"]["jaxoverlap"]
    assert "fake" in report["topology"]
    # quick: 4 ops (ag_matmul, matmul_rs, matmul_ar two-shot and one-shot) x 3 transports,
    # the FP8 rows: 3 ops x 3 transports of e4m3 x e4m3 -> bfloat16, the fused GEMM's
    # 2 ops x 2 transports (p2p, multicast) on a 9.0 and on a 10.0 (sm100 kernel) fake device,
    # its 2 FP8 ops x 2 transports (9.0), matmul_ar's 2 kernel algorithms x 2 transports (p2p,
    # multicast), captured and replayed, and the replayable programs (over p2p and multicast:
    # ag_matmul and matmul_rs chunked and fused, matmul_ar's two_shot and one_shot), captured
    # and replayed
    assert len(report["rows"]) == 49 and all(r["passed"] for r in report["rows"])
    assert sum("captured, 3 replays" in r["name"] for r in report["rows"]) == 16
    assert sum("e4m3 x e4m3 -> bfloat16" in r["name"] for r in report["rows"]) == 13
    assert sum(" fused " in r["name"] for r in report["rows"]) == 16  # 4 replayable ones too
    assert sum(" replayable " in r["name"] for r in report["rows"]) == 12
    assert sum(" fused replayable " in r["name"] for r in report["rows"]) == 4
    assert sum("fake B200 (sm_100a)" in r["name"] for r in report["rows"]) == 4
    assert all(r["seconds"] >= 0 and "of the bound" in r["detail"] for r in report["rows"])
    assert report["first_error"] is None
    monkeypatch.setattr(_selftest, "bound", lambda *a, **kw: 0.0)
    assert main(quick=True, fake=True, report=str(path)) == 1
    first = json.loads(path.read_text())["first_error"]
    assert first["row"].startswith("ag_matmul nccl") and "rank 0" in first["error"]
    assert any("nccl" in line and "clique" in line for line in first["cliques"]), first
    capsys.readouterr()


def test_the_bound_covers_a_ring_reduction_in_bf16_and_catches_a_lost_rank():
    """The selftest's bound (docs/gpu.md §5) against a model of what the GPU computes for a bf16
    ``matmul_rs``/``matmul_ar``: each rank's partial product accumulated in float32 and rounded
    to bf16, then summed around a ring with a rounding to bf16 at every step. Every seed passes
    (a tolerance not derived from N and K failed 2 of 10 such seeds); a sum that lost one rank's
    partial fails."""
    import ml_dtypes
    import numpy as np

    from jaxoverlap._selftest import bound

    bf16 = ml_dtypes.bfloat16
    n, rows, k, nw = 8, 16, 64, 24
    for seed in range(10):
        rng = np.random.default_rng(seed)
        xs = [rng.standard_normal((rows, k)).astype(bf16) for _ in range(n)]
        ws = [rng.standard_normal((k, nw)).astype(bf16) for _ in range(n)]
        partials = [(x.astype(np.float32) @ w.astype(np.float32)).astype(bf16)
                    for x, w in zip(xs, ws, strict=True)]
        ring = partials[0]
        for p in partials[1:]:
            ring = (ring.astype(np.float32) + p.astype(np.float32)).astype(bf16)
        x64 = np.concatenate(xs, axis=1).astype(np.float64)
        w64 = np.concatenate(ws, axis=0).astype(np.float64)
        allowed = bound("matmul_rs", "bfloat16", n, k, x64, w64)
        ref = x64 @ w64
        assert np.all(np.abs(ring.astype(np.float64) - ref) <= allowed), seed
        lost = ring.astype(np.float64) - partials[3].astype(np.float64)
        assert not np.all(np.abs(lost - ref) <= allowed), seed


@pytest.mark.slow  # a subprocess that imports jax and waits for a 2 s deadline
def test_selftest_report_is_written_when_a_row_hangs(tmp_path):
    """The report is rewritten after every row, and a row still running after the row deadline
    is taken for a hang: recorded as failed with every thread's stack and the cliques, the report
    written, the process ended (status 1). Here the second row of ``--fake`` never returns."""
    import json
    import subprocess
    import sys
    import textwrap

    from .conftest import require_module

    require_module("_cuda_fake")
    path = tmp_path / "report.json"
    script = textwrap.dedent(f"""
        import time
        from jaxoverlap import _selftest
        real, calls = _selftest._fake_row, []
        def row(*args, **kw):
            calls.append(args)
            if len(calls) == 2:
                time.sleep(600)  # hangs
            return real(*args, **kw)
        _selftest._fake_row = row
        raise SystemExit(_selftest.main(quick=True, fake=True, report={str(path)!r},
                                        row_deadline=2.0))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(path.read_text())
    first, second = report["rows"]
    assert first["passed"] and first["name"].startswith("ag_matmul nccl"), first
    assert not second["passed"] and "did not finish within 2 s" in second["detail"], second
    hung = report["first_error"]
    assert hung["row"] == second["name"] and "in row" in hung["traceback"], hung  # the sleep
    assert any("clique" in line for line in hung["cliques"]), hung
    assert report["versions"]["jaxoverlap"] and report["running"] is None


@pytest.mark.parametrize("connections", ["1", "8"])
def test_selftest_graph_on_the_fake_replays_every_kernel_row(capsys, monkeypatch, connections):
    """``selftest --fake --graph`` (quick): every row whose call replays (matmul_ar's kernel
    algorithms over p2p and multicast, and every row over p2p and multicast — chunked, fused,
    fp8, the B200 fake, matmul_ar's two_shot and one_shot — built replayable) captured and
    replayed with new inputs, each launch checked; the nccl rows skipped with their reason (no
    bound on a dead peer under replay); 1 and 8 work queues."""
    from .conftest import require_module

    require_module("_cuda_fake")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", connections)
    assert main(quick=True, fake=True, graph=True) == 0
    out = capsys.readouterr().out
    for op in _selftest.KERNEL_OPS:
        for transport in ("p2p", "multicast"):
            assert any(line.startswith(f"  PASS  {op:9s} {transport:9s}")
                       and "captured, 3 replays" in line for line in out.splitlines()), (op,
                                                                                         transport)
    for op in ("ag_matmul", "matmul_rs"):
        for transport in ("p2p      ", "multicast"):
            for kind in (" replayable", " fused replayable"):
                assert any(line.startswith(f"  PASS  {op} {transport} ")
                           and f"{kind} captured, 3 replays" in line
                           for line in out.splitlines()), (op, transport, kind, out)
    for op in ("matmul_ar ", "matmul_ar/one_shot"):
        for transport in ("p2p", "multicast"):
            assert any(line.startswith(f"  PASS  {op}") and f" {transport} " in line
                       and " replayable captured, 3 replays" in line
                       for line in out.splitlines()), (op, transport, out)
    assert not any(line.startswith("  PASS") and "nccl" in line for line in out.splitlines())
    assert "7 rows skipped: their programs do not replay yet: nccl: " in out
    assert out.count("rows skipped") == 1
    assert "30/30 passed" in out and "FAIL " not in out
    with pytest.raises(ValueError, match="add --fake"):
        main(quick=True, graph=True)
