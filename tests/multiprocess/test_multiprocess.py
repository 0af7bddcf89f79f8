"""Real processes joined by jax.distributed on loopback (see harness.py and worker.py)."""

from __future__ import annotations

import os
import time

import pytest

from . import harness


@pytest.mark.parametrize("nprocs,devices", [(2, 2)])
def test_portable_impls_across_processes(nprocs, devices):
    procs = harness.run("portable", nprocs, devices, params={"impls": ["xla", "ring"]})
    for p in procs:
        assert len(p.result()["checked"]) == 8, p.stdout


def test_harness_kills_children_at_its_deadline():
    start = time.monotonic()
    with pytest.raises(harness.HarnessError, match="hard timeout after 8 s") as info:
        harness.run("hang", 2, timeout_s=8)
    assert time.monotonic() - start < 20
    assert "process 1: exit None" in str(info.value)


def test_harness_reports_failures_and_removes_leftover_segments():
    with pytest.raises(harness.HarnessError, match="a process failed") as info:
        harness.run("fail", 2)
    assert "Not equal to tolerance" in str(info.value)
    with pytest.raises(harness.HarnessError, match="segments left behind"):
        harness.run("leak_shm", 1)
    assert not harness.shm_segments(f"jotest{os.getpid()}x")
