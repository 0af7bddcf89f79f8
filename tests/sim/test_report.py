"""Presets as data (JSON round trip, sources), the projected table and the Gantt chart."""

import pathlib

import pytest

from jaxoverlap import sim

# The performance model: no JAX.
pytestmark = pytest.mark.jax_independent


def test_preset_json_round_trip_and_base(tmp_path):
    p = sim.get_preset("h100")
    path = tmp_path / "h100.json"
    p.to_json(path)
    assert sim.load_preset(str(path)) == p
    partial = tmp_path / "mine.json"
    partial.write_text('{"base": "h100", "name": "mine", "nccl_gbps": 300.0}')
    mine = sim.load_preset(partial)
    assert mine.name == "mine" and mine.nccl_gbps == 300.0 and mine.sms == p.sms
    bad = tmp_path / "bad.json"
    bad.write_text('{"base": "h100", "nccl_gbs": 1}')
    with pytest.raises(ValueError, match="unknown keys"):
        sim.load_preset(bad)
    with pytest.raises(ValueError, match="not a built-in"):
        sim.load_preset("h900")


def test_every_preset_cites_its_numbers():
    for p in sim.PRESETS.values():
        for key in ("peak_tflops", "gemm_efficiency", "link_gbps", "nccl_gbps",
                    "multicast_gbps", "latencies", "min_gain", "nccl_step_us", "graph_node_us",
                    "ar_start_us", "ar_flag_us", "reduce_sm_gbps", "reduce_efficiency",
                    "gpus_per_node", "nvlink_domain"):
            assert p.sources.get(key), (p.name, key)
        # a margin per program family, and per op for a family a preset does not list
        assert set(p.min_gain) == set(sim.families.FAMILIES) | set(sim.OPS), p.name
    for p in sim.PRESETS.values():  # the repository stands alone: no private paths
        assert not any("shared/" in v or "brief" in v for v in p.sources.values()), p.name
    h100 = sim.get_preset("h100")
    assert h100.link_gbps == 450 and 360 <= h100.nccl_gbps <= 400
    assert "multicast" in h100.transports
    assert "multicast" not in sim.get_preset("a100").transports
    assert sim.get_preset("pcie8").transports == ("nccl", "p2p")
    assert sim.get_preset("h800").link_gbps == 200 and sim.get_preset("h800").sms == 132


def test_json_keeps_tuples_and_margins(tmp_path):
    p = sim.get_preset("h100")
    path = tmp_path / "h100.json"
    p.to_json(path)
    back = sim.load_preset(str(path))
    assert back.gemm_tiles == p.gemm_tiles and back.calibrated == p.calibrated
    assert back.margin("matmul_rs") == p.margin("matmul_rs")
    # an op without its own margin gets the largest one known
    assert p.replace(min_gain={"ag_matmul": 0.1}).margin("matmul_ar") == 0.1


def test_projection_table_and_gantt(tmp_path):
    cases = [c for c in sim.STANDARD_CASES if c.label in ("AG std", "AG decode")]
    rows = sim.projection_table(["h100"], cases)
    assert [r["case"] for r in rows] == ["AG std", "AG decode"]
    assert rows[0]["plan"].startswith("native") and rows[1]["plan"] == "xla (unfused)"
    text = sim.format_table(rows, markdown=False)
    assert sim.MODEL_LABEL in text
    r = sim.simulate("ag_matmul", cases[0].shape, "bf16", 8, "h100",
                     sim.Candidate("native", "nccl", 2, True))
    out = sim.gantt(r, tmp_path / "plan.png", ranks=[0])
    data = open(out, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_docs_show_the_decode_table():
    doc = pathlib.Path(__file__).resolve().parents[2] / "docs" / "performance.md"
    h100 = sim.get_preset("h100")
    rows = sim.decode_table(h100)
    assert sim.markdown_decode_table(h100, rows) in doc.read_text()
    # its one-launch column: the one-shot kernel captured in a command buffer (sim.allreduce,
    # sim.launch), under 0.6x NCCL's all-reduce at 16 KiB
    for r in rows:
        t = sim.allreduce.best(h100, 8, r["bytes"], algorithms=("one_shot",))[0]
        assert r["t_one_launch_us"] == pytest.approx((t + h100.graph_node_us * 1e-6) * 1e6)
    assert rows[0]["t_one_launch_us"] < 0.6 * rows[0]["t_comm_us"]
