"""Importing jaxoverlap from an unbuilt source checkout says why it fails and the two fixes.

The checkout is copied (without any built extension) and run with ``python -S``: no
site-packages, so neither an installed nor an editable jaxoverlap can answer instead.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture()
def checkout(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "jaxoverlap", tmp_path / "jaxoverlap",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__", "_build_config.py"))
    for name in ("pyproject.toml", "CMakeLists.txt"):
        shutil.copy(REPO / name, tmp_path / name)
    return tmp_path


def _python(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-S", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60)


def test_import_names_the_cause_and_both_fixes(checkout):
    run = _python(checkout, "-c", "import jaxoverlap")
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: jaxoverlap is being imported from its source tree")
    assert str(checkout) in last and "jaxoverlap._host" in last
    assert "run from another directory" in last and "`pip install -e .`" in last


def test_the_command_prints_one_line_not_a_traceback(checkout):
    run = _python(checkout, "-m", "jaxoverlap", "info")
    assert run.returncode == 1
    assert "Traceback" not in run.stderr
    assert run.stderr.strip().count("\n") == 0
    assert "source tree" in run.stderr and "pip install -e ." in run.stderr


def test_an_installed_layout_is_not_mistaken_for_a_source_tree(checkout):
    (checkout / "pyproject.toml").unlink()      # site-packages has no pyproject.toml beside it
    run = _python(checkout, "-c", "import jaxoverlap")
    assert "source tree" not in run.stderr
    # It gets past the check and on to its dependencies, which -S hides.
    assert "No module named 'jax'" in run.stderr
