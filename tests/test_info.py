"""jo.info() and `python -m jaxoverlap info`."""

from __future__ import annotations

import os
import subprocess
import sys

import jax

import jaxoverlap as jo


def test_info_reports_versions_and_devices():
    data = jo.info()
    assert data["jax"] == jax.__version__
    assert data["devices"] == 8 and data["platform"] == "cpu"
    assert data["impls"]["xla"] == "available" and data["impls"]["ring"] == "available"
    assert data["host_extension"]["version"] == jo.__version__
    assert data["config"]["timeout_s"] > 0


def test_cli_info():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "jaxoverlap", "info"], capture_output=True,
                         text=True, env=env, timeout=120, check=True).stdout
    assert "jaxoverlap: " + jo.__version__ in out
    assert "impls:" in out and "ring: available" in out and "host_extension:" in out
