"""Presets as data (JSON round trip, calibration), the projected table and the Gantt chart."""

import pytest

from jaxoverlap import sim


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
                    "multicast_gbps", "latencies"):
            assert p.sources.get(key), (p.name, key)
    assert sim.get_preset("h100").link_gbps == 450 and sim.get_preset("h100").nccl_gbps == 365
    assert "multicast" in sim.get_preset("h100").transports
    assert "multicast" not in sim.get_preset("a100").transports
    assert sim.get_preset("pcie8").transports == ("nccl", "p2p")


def test_calibrate_recovers_the_model_parameters():
    truth = sim.get_preset("h100").replace(gemm_efficiency=0.6, nccl_gbps=300.0,
                                           p2p_gbps=350.0)
    m, n, k = 4096, 4096, 8192
    s, nranks = 64 << 20, 8
    fitted = sim.calibrate(
        "h100", gemm=(m, n, k, sim.gemm_time(truth, "bf16", 1, m, n, k)),
        nccl_allgather=(s, nranks, sim.collective_time(truth, "nccl", nranks, s)),
        p2p_copy=(s, sim.collective_time(truth, "p2p", 2, 2 * s)))
    assert fitted.gemm_efficiency == pytest.approx(0.6)
    assert fitted.nccl_gbps == pytest.approx(300.0)
    assert fitted.p2p_gbps == pytest.approx(350.0)
    assert fitted.name == "h100-calibrated"


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
