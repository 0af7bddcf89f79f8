"""The build's decisions about the CUDA extension.

* The build backend adds the NCCL/cuBLAS wheels of nvcc's CUDA major to the build
  requirements unless ``JAXOVERLAP_CUDA`` is ``OFF`` (wherever it is set) or nvcc is absent.
* CMake, configured for real (marked slow): in ``AUTO`` mode each missing piece is one line of
  the output, not an error, and the same reason is recorded in ``_build_config.py``; ``ON``
  makes it an error.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# The build's decisions (the backend's, CMake's when a piece is missing) run no JAX: the build
# against a jaxlib's XLA FFI headers is each CI leg's own install, which fails if it breaks.
pytestmark = pytest.mark.jax_independent


@pytest.fixture()
def backend(monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "jaxoverlap_backend", REPO / "build_backend" / "jaxoverlap_backend.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("JAXOVERLAP_CUDA", "CMAKE_ARGS", "SKBUILD_CMAKE_ARGS", "SKBUILD_CMAKE_DEFINE",
                 "CUDACXX"):
        monkeypatch.delenv(name, raising=False)
    return module


@pytest.fixture()
def nvcc_release(backend, monkeypatch):
    """Pretends nvcc is on PATH and reports the given CUDA release."""
    def pretend(release):
        monkeypatch.setattr(backend.shutil, "which", lambda name: f"/opt/cuda/bin/{name}")
        monkeypatch.setattr(backend, "nvcc_major", lambda nvcc: release)
    return pretend


def test_wheels_follow_nvccs_cuda_major(backend, nvcc_release):
    nvcc_release(13)
    assert backend.cuda_requirements(None) == ["nvidia-nccl-cu13", "nvidia-cublas>=13,<14",
                                               "nvidia-cutlass==4.2.0.0"]
    nvcc_release(12)
    assert backend.cuda_requirements(None) == ["nvidia-nccl-cu12", "nvidia-cublas-cu12",
                                               "nvidia-cutlass==4.2.0.0"]
    nvcc_release(11)               # no wheels we link: CMake then says what is missing
    assert backend.cuda_requirements(None) == []


def test_no_nvcc_no_wheels(backend, monkeypatch):
    monkeypatch.setattr(backend.shutil, "which", lambda name: None)
    assert backend.find_nvcc() is None
    assert backend.cuda_requirements(None) == []


@pytest.mark.parametrize("how", ["env", "define", "cmake_args", "config_args", "skbuild_define"])
def test_off_wherever_it_is_said_means_no_wheels(backend, nvcc_release, monkeypatch, how):
    nvcc_release(13)
    settings: dict = {}
    if how == "env":
        monkeypatch.setenv("JAXOVERLAP_CUDA", "off")
    elif how == "define":
        settings = {"cmake.define.JAXOVERLAP_CUDA": "OFF"}
    elif how == "cmake_args":
        monkeypatch.setenv("CMAKE_ARGS", '-DFOO=1 -DJAXOVERLAP_CUDA:STRING="0"')
    elif how == "config_args":
        settings = {"cmake.args": ["-DJAXOVERLAP_CUDA=FALSE"]}
    else:
        monkeypatch.setenv("SKBUILD_CMAKE_DEFINE", "A=1;JAXOVERLAP_CUDA=NO")
    assert backend.cuda_setting(settings) == "OFF"
    assert backend.cuda_requirements(settings) == []


def test_a_later_source_wins(backend, monkeypatch):
    monkeypatch.setenv("JAXOVERLAP_CUDA", "OFF")
    assert backend.cuda_setting({"cmake.define.JAXOVERLAP_CUDA": "ON"}) == "ON"
    monkeypatch.setenv("CMAKE_ARGS", "-DJAXOVERLAP_CUDA=OFF")   # -D is read last by CMake
    assert backend.cuda_setting({"cmake.define.JAXOVERLAP_CUDA": "ON"}) == "OFF"


def test_real_nvcc_version_is_read(backend):
    nvcc = backend.find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc on PATH here")
    assert backend.nvcc_major(nvcc) in (12, 13)


# ---------------------------------------------------------------- CMake configure (slow)


def _configure(tmp_path: Path, define: str, env_change: dict[str, str] | None = None):
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("no cmake on PATH")
    env = dict(os.environ, **(env_change or {}))
    build = tmp_path / "build"
    run = subprocess.run(
        [cmake, "-S", str(REPO), "-B", str(build), f"-DJAXOVERLAP_CUDA={define}",
         f"-DPython_EXECUTABLE={sys.executable}", "-DSKBUILD_PROJECT_NAME=jaxoverlap",
         "-DSKBUILD_PROJECT_VERSION=0.1.0"],
        capture_output=True, text=True, env=env, timeout=600)
    record = build / "_build_config.py"
    return run, (record.read_text() if record.exists() else "")


def _cuda_lines(run) -> list[str]:
    return [line for line in (run.stdout + run.stderr).splitlines()
            if "jaxoverlap: CUDA extension" in line]


def _without_nvcc() -> dict[str, str]:
    nvcc = shutil.which("nvcc")
    dirs = os.environ.get("PATH", "").split(os.pathsep)
    keep = [d for d in dirs if not (nvcc and Path(d) == Path(nvcc).parent)]
    return {"PATH": os.pathsep.join(keep), "CUDACXX": ""}


@pytest.mark.slow
def test_cmake_off_is_one_line(tmp_path):
    run, record = _configure(tmp_path, "OFF")
    assert run.returncode == 0, run.stderr
    assert _cuda_lines(run) == ["-- jaxoverlap: CUDA extension (_cuda) not built: "
                                "JAXOVERLAP_CUDA=OFF"]
    assert 'CUDA_EXTENSION = "not built: the build was asked not to (JAXOVERLAP_CUDA=OFF)"' \
        in record


@pytest.mark.slow
def test_cmake_auto_without_nvcc_is_one_line_not_an_error(tmp_path):
    env = _without_nvcc()
    if shutil.which("nvcc", path=env["PATH"]):
        pytest.skip("nvcc is in a directory the compiler needs too; cannot hide it")
    run, record = _configure(tmp_path, "AUTO", env)
    assert run.returncode == 0, run.stderr
    (line,) = _cuda_lines(run)
    assert "not built: no CUDA compiler: nvcc is not on PATH" in line
    assert "no CUDA compiler" in record
    run, _ = _configure(tmp_path / "on", "ON", env)
    assert run.returncode != 0
    assert "JAXOVERLAP_CUDA=ON but no CUDA compiler" in run.stderr


@pytest.mark.slow
def test_cmake_auto_with_nvcc_but_no_wheels_is_one_line(tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc on PATH here")
    # A regular package named `nvidia` first on the path hides the wheels' namespace package.
    fake = tmp_path / "fake"
    (fake / "nvidia").mkdir(parents=True)
    (fake / "nvidia" / "__init__.py").write_text("")
    run, record = _configure(tmp_path, "AUTO", {"PYTHONPATH": str(fake)})
    assert run.returncode == 0, run.stderr
    (line,) = _cuda_lines(run)
    assert "not built: nvcc was found but not the NCCL/cuBLAS wheels" in line
    assert "pip install nvidia-nccl-cu13 nvidia-cublas" in line
    assert "nvcc was found but not the NCCL/cuBLAS wheels" in record


@pytest.mark.slow
def test_cmake_auto_without_the_pinned_cutlass_headers_is_one_line(tmp_path):
    """The fused GEMM's CUTLASS headers: missing, or of another version than the pin."""
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc on PATH here")
    # A regular package named `cutlass_library` first on the path hides the wheel's.
    fake = tmp_path / "fake" / "cutlass_library"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    run, record = _configure(tmp_path / "missing", "AUTO", {"PYTHONPATH": str(fake.parent)})
    assert run.returncode == 0, run.stderr
    (line,) = _cuda_lines(run)
    assert "not built: nvcc and the NCCL/cuBLAS wheels were found but not CUTLASS's headers" \
        in line
    assert "pip install --no-deps nvidia-cutlass==4.2.0.0" in line
    assert "not CUTLASS's headers" in record
    version = fake / "source" / "include" / "cutlass" / "version.h"
    version.parent.mkdir(parents=True)
    version.write_text("".join(f"#define CUTLASS_{part} {number}\n"
                               for part, number in (("MAJOR", 4), ("MINOR", 1), ("PATCH", 0))))
    run, _ = _configure(tmp_path / "old", "AUTO", {"PYTHONPATH": str(fake.parent)})
    assert run.returncode == 0, run.stderr
    (line,) = _cuda_lines(run)
    assert "CUTLASS 4.1.0 was found" in line and "built against 4.2.0" in line
