"""A new user's first commands, on a plain install in a fresh virtual environment.

The wheel is built once from this checkout (``pip wheel``, sharing the build directory of the
development install, so little is recompiled; it has the CUDA extension when this build does)
and installed with its dependencies alone into a new venv outside the source tree: no flax,
optax, matplotlib or rich, and no NCCL/cuBLAS wheels. Every command then either works or says
in one line what to install, never a traceback. jax is pinned to the version running here, so
pip takes the copy it already has rather than resolving a new one. The venv is made without a
pip of its own (this interpreter's pip installs into it: ``pip --python``) and the install
skips compiling every file to bytecode (Python compiles what a command imports): what is
installed is the same, in a quarter of the time.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jaxlib
import pytest

# Fresh virtual environments and installs: minutes.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    # As a new user's shell: no test-suite settings (XLA_FLAGS: each command sets up its own
    # host devices).
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "XLA_FLAGS")
           and not k.startswith("JAXOVERLAP_")}
    env["JAX_PLATFORMS"] = "cpu"
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # The flavour of the development build, so the shared build directory is reused as it is.
    cuda = "ON" if importlib.util.find_spec("jaxoverlap._cuda") else "OFF"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(REPO)],
                   env=dict(_env(), JAXOVERLAP_CUDA=cuda), check=True, timeout=1800)
    (built,) = out.glob("jaxoverlap-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True,
                   timeout=300)
    python = root / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-compile", str(wheel), f"jax=={jax.__version__}",
                    f"jaxlib=={jaxlib.__version__}"],
                   env=_env(), check=True, timeout=1200)
    return python


@pytest.fixture()
def elsewhere(tmp_path) -> Path:
    """A working directory outside the source tree."""
    return tmp_path


def _run(python: Path, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), *args], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def _one_line(run: subprocess.CompletedProcess) -> str:
    """The command's only line of complaint (stdout or stderr), checked to be no traceback."""
    text = (run.stdout + run.stderr).strip()
    assert "Traceback" not in text, text
    assert len(text.splitlines()) == 1, text
    return text


@pytest.mark.jax_independent  # what pip installed: no JAX runs
def test_the_plain_install_has_no_optional_packages(venv, elsewhere):
    code = "import importlib.util as u; print([m for m in ('flax', 'optax', 'matplotlib', " \
           "'rich', 'nvidia') if u.find_spec(m)])"
    assert _run(venv, "-c", code, cwd=elsewhere).stdout.strip() == "[]"


def test_info(venv, elsewhere):
    run = _run(venv, "-m", "jaxoverlap", "info", cwd=elsewhere)
    assert run.returncode == 0, run.stderr
    assert "native: available" in run.stdout and "host_extension:" in run.stdout
    cuda = next(line for line in run.stdout.splitlines() if line.startswith("cuda_extension:"))
    if importlib.util.find_spec("jaxoverlap._cuda"):
        # A GPU wheel on a machine without the CUDA libraries: it imports, and says what to add.
        assert "pip install 'jaxoverlap[cuda]'" in cuda, cuda
    else:
        assert "not built" in cuda, cuda


@pytest.mark.jax_independent  # the model and the install's extras: no JAX runs
def test_bench_model_prints_the_table_and_says_the_chart_needs_matplotlib(venv, elsewhere):
    run = _run(venv, "-m", "jaxoverlap", "bench", "--model", "h100", "--cases", "AG std",
               cwd=elsewhere)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "MODEL PROJECTION" in run.stdout and "<- pick" in run.stdout
    assert "Gantt chart skipped: matplotlib is not installed (pip install" in run.stdout
    assert "Traceback" not in run.stderr
    assert not list(elsewhere.rglob("*.png"))


def test_bench_measures(venv, elsewhere):
    run = _run(venv, "-m", "jaxoverlap", "bench", "--cases", "AG std", "--warmup", "0",
               "--repeats", "1", "--out", str(elsewhere), cwd=elsewhere)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (elsewhere / "bench.json").is_file()
    for impl in ("xla", "ring", "native"):
        assert f"  {impl} " in run.stdout, run.stdout


def test_a_tiny_ag_matmul_on_every_impl(venv, elsewhere):
    script = textwrap.dedent("""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
        import jax, numpy as np
        import jaxoverlap as jo
        mesh = jax.make_mesh((4,), ("tp",))
        rng = np.random.default_rng(0)
        x = rng.standard_normal((8, 16)).astype(np.float32)
        w = rng.standard_normal((16, 12)).astype(np.float32)
        want = x.astype(np.float64) @ w
        for impl in ("auto", "xla", "ring", "native"):
            y = jax.jit(lambda x, w: jo.ag_matmul(x, w, "tp", impl=impl, mesh=mesh))(x, w)
            np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4)
            print(impl, "ok")
    """)
    run = _run(venv, "-c", script, cwd=elsewhere)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split() == ["auto", "ok", "xla", "ok", "ring", "ok", "native", "ok"]


def test_selftest_passes_from_the_wheel(venv, elsewhere):
    run = _run(venv, "-m", "jaxoverlap", "selftest", "--quick", cwd=elsewhere, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "FAIL" not in run.stdout and "passed" in run.stdout


def test_from_the_source_tree_the_cause_and_the_two_fixes(venv):
    if list((REPO / "jaxoverlap").glob("_host*.so")):
        pytest.skip("this checkout has an extension built in place: it is not the unbuilt tree")
    run = _run(venv, "-m", "jaxoverlap", "info", cwd=REPO)
    assert run.returncode == 1
    line = _one_line(run)
    assert "imported from its source tree" in line
    assert "run from another directory" in line and "`pip install -e .`" in line
    run = _run(venv, "-c", "import jaxoverlap", cwd=REPO)
    assert "ImportError: jaxoverlap is being imported from its source tree" in run.stderr


@pytest.mark.parametrize("example, needs", [("scaling.py", "needs flax"),
                                            ("transformer_block.py", "needs flax and optax")])
def test_the_examples_name_the_extra_they_need(venv, elsewhere, example, needs):
    run = _run(venv, str(REPO / "examples" / example), cwd=elsewhere)
    assert run.returncode == 2
    line = _one_line(run)
    assert needs in line and "pip install 'jaxoverlap[examples]'" in line


def test_the_flax_layers_name_flax(venv, elsewhere):
    run = _run(venv, "-c", "import jaxoverlap.flax.linen", cwd=elsewhere)
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: jaxoverlap.flax needs Flax")
    assert "pip install 'jaxoverlap[flax]'" in last


@pytest.mark.jax_independent  # the model's CLI: no JAX runs
def test_the_model_cli(venv, elsewhere):
    run = _run(venv, "-m", "jaxoverlap.sim", "table", "--preset", "h100", cwd=elsewhere)
    assert run.returncode == 0 and "h100" in run.stdout, run.stdout + run.stderr
    run = _run(venv, "-m", "jaxoverlap.sim", "gantt", "--out", "plan.png", cwd=elsewhere)
    assert run.returncode == 2
    assert "gantt needs matplotlib" in _one_line(run)
