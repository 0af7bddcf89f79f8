"""The examples run end to end in a short configuration (in-process: the 8 host devices exist)."""

from __future__ import annotations

import importlib.util
import json
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


def test_scaling_writes_table_json_and_plot(tmp_path, capsys):
    code = _load("scaling").main([
        "--tp", "2", "4", "16", "--rows", "16", "32", "--batch", "1", "--hidden", "8",
        "--ffn", "32", "--warmup", "1", "--repeats", "2", "--impls", "xla", "ring", "native",
        "--out", str(tmp_path), "--no-progress",
    ])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "median ms" in out and "speedup vs xla" in out
    report = json.loads((tmp_path / "scaling.json").read_text())
    timed = {(r["tp"], r["rows"], r["impl"]) for r in report["results"]}
    assert {(tp, rows, impl) for tp in (2, 4) for rows in (16, 32)
            for impl in ("xla", "ring")} <= timed
    for r in report["results"]:
        assert len(r["samples_ms"]) == 2 and r["median_ms"] > 0
        assert r["speedup_vs_xla"] == pytest.approx(
            next(b["median_ms"] for b in report["results"]
                 if (b["tp"], b["rows"], b["impl"]) == (r["tp"], r["rows"], "xla"))
            / r["median_ms"])
    # tp=16 has no devices here, and every impl is either timed or skipped with a reason.
    reasons = {(s["tp"], s["rows"], s["impl"]): s["reason"] for s in report["skipped"]}
    assert "only 8 devices" in reasons[(16, 16, "xla")]
    assert all((tp, rows, impl) in timed | set(reasons) for tp in (2, 4, 16)
               for rows in (16, 32) for impl in ("xla", "ring", "native"))
    png = (tmp_path / "scaling.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
