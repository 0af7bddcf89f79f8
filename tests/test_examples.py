"""The examples run end to end in a short configuration (in-process: the 8 host devices exist)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module       # dataclasses (flax modules) look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flags", [[], ["--no-sequence-parallel", "--impl", "ring"]])
def test_transformer_block_trains_like_plain_flax(flags, capsys):
    code = _load("transformer_block").main(["--steps", "3", *flags])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "OK: the losses agree" in out
    assert len([line for line in out.splitlines() if line.strip()[:1].isdigit()]) == 3


def test_transformer_block_reports_divergence(capsys):
    # A tolerance no float32 run can meet: the comparison must be able to fail.
    code = _load("transformer_block").main(["--steps", "2", "--rtol", "-1"])
    assert code == 1
    assert "DIVERGED" in capsys.readouterr().out
