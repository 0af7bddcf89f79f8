"""``python -m jaxoverlap selftest`` on a machine without a GPU (every CI machine)."""

from __future__ import annotations

import pytest

from jaxoverlap import _cuda_caps
from jaxoverlap._info import format_info, info
from jaxoverlap._selftest import main


@pytest.mark.slow
def test_selftest_runs_and_says_no_gpu(capsys):
    if _cuda_caps.capabilities().get("devices"):
        return  # a GPU machine: the command itself is the test there
    assert main(quick=True) == 0
    out = capsys.readouterr().out
    assert "NO GPU FOUND" in out and "does NOT test the CUDA executor" in out
    assert "FAIL " not in out
    for transport in ("nccl", "p2p", "multicast"):
        assert f"ag_matmul {transport}" in out and f"matmul_rs {transport}" in out
    if _cuda_caps.cuda_error() is None:
        assert "(CUDA executor on the host-side fake)  matches float64" in out


def test_info_prints_the_gpu_section():
    data = info()
    if not data.get("native", {}).get("available"):
        return  # no native extension at all: nothing to show
    text = format_info(data)
    assert "gpu:" in text
    if _cuda_caps.cuda_error() is None:
        assert "nccl: 2." in text and "cublas:" in text and "gpus:" in text


def test_selftest_on_the_fake_honours_the_work_queue_setting(capsys, monkeypatch):
    """``selftest --fake`` (quick): the executor on the fake with one work queue per device."""
    from .conftest import require_module

    fake = require_module("_cuda_fake")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    assert main(quick=True, fake=True) == 0
    out = capsys.readouterr().out
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in out and "FAIL " not in out
    for op in ("ag_matmul", "matmul_rs", "matmul_ar", "matmul_ar/one_shot"):
        for transport in ("nccl", "p2p", "multicast"):
            assert f"PASS  {op:9s} {transport:9s}" in out
    fake.reset()
    assert fake.connections() == 1  # the fake read the variable as the driver does
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    fake.reset()
    assert fake.connections() == 8
