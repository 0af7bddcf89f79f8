"""What a process learns about the CUDA extension: jo.info(), and the one warning on GPUs.

No GPU here: the GPU platform is injected (``capabilities.current_platform``) and so is the
extension's state (``runtime.cuda_error``), so the decision logic runs for real on host
devices; what a real GPU process prints is not observed here.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from helpers import rand, tp_mesh

import jaxoverlap as jo
from jaxoverlap import _plan
from jaxoverlap._executors import capabilities, runtime

MISSING = "jaxoverlap._cuda was not built: no CUDA compiler; to get it, rebuild (test)"


@pytest.fixture()
def gpu_without_extension(monkeypatch):
    monkeypatch.setattr(capabilities, "current_platform", lambda: "gpu")
    monkeypatch.setattr(runtime, "cuda_error", lambda: MISSING)
    monkeypatch.setattr(_plan, "_gpu_fallback_warned", False)


def _fallbacks(record) -> list[str]:
    return [str(w.message) for w in record if "falls back to the unfused path" in str(w.message)]


def test_auto_on_gpus_without_the_extension_warns_once_naming_the_fix(gpu_without_extension):
    mesh = tp_mesh(4)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for rows in (8, 16):              # two traces, two ops: still one warning
            x, w = rand(0, (rows, 8), jnp.float32), rand(1, (8, 8), jnp.float32)
            jax.jit(lambda x, w: jo.ag_matmul(x, w, "tp", mesh=mesh))(x, w)
            jax.jit(lambda x, w: jo.matmul_rs(x, w, "tp", mesh=mesh))(x, w)
    messages = _fallbacks(record)
    assert len(messages) == 1, messages
    assert "impl='auto'" in messages[0] and MISSING in messages[0]


def test_an_impl_asked_for_does_not_warn(gpu_without_extension):
    x, w = rand(0, (8, 4), jnp.float32), rand(1, (4, 8), jnp.float32)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        jo.ag_matmul(x, w, "tp", impl="ring", mesh=tp_mesh(4))
        jo.ag_matmul(x, w, "tp", impl="xla", mesh=tp_mesh(4))
    assert _fallbacks(record) == []


def test_no_warning_on_host_devices(monkeypatch):
    monkeypatch.setattr(runtime, "cuda_error", lambda: MISSING)
    monkeypatch.setattr(_plan, "_gpu_fallback_warned", False)
    x, w = rand(0, (8, 4), jnp.float32), rand(1, (4, 8), jnp.float32)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        jo.ag_matmul(x, w, "tp", mesh=tp_mesh(4))
    assert _fallbacks(record) == []


def test_info_says_what_the_build_made_of_the_cuda_extension():
    summary = jo.info()["cuda_extension"]
    error = runtime.cuda_error()
    if error is None:
        assert summary.startswith("built with CUDA") and summary.endswith("loads")
    else:
        assert summary == f"unavailable: {error}"
        assert "to get it" in error or "pip install" in error   # the fix is named


def test_info_warns_when_jax_sees_gpus_without_the_extension(monkeypatch):
    class FakeGpu:
        platform = "gpu"

    monkeypatch.setattr(runtime, "cuda_error", lambda: MISSING)
    monkeypatch.setattr(jax, "devices", lambda *a: [FakeGpu()] * 2)
    from jaxoverlap import _info

    assert "JAX sees 2 GPUs but jaxoverlap has no CUDA extension" in _info.info()["warning"]
