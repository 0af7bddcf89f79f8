"""Named ranges and the overlap report: named scopes in HLO, the host executor's spans,
the Chrome/Perfetto trace, the report's arithmetic, and JAXOVERLAP_PROFILE."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from helpers import rand, tp_mesh
from jax.sharding import PartitionSpec as P

import jaxoverlap as jo
from jaxoverlap import _kinds, _profile
from jaxoverlap._executors.runtime import load_host

OPS = _kinds.names(_kinds.OPS)
MOVERS = {"Copy", "Send", "Recv", "McStore"}  # the ops that move data to or from a peer


def _fn(op: str, mesh, **kw):
    """A jitted shard_map of one op on 4 ranks, and its operands."""
    if op == "ag_matmul":
        x, w = rand(0, (16, 8), jnp.float32), rand(1, (8, 16), jnp.float32)
        specs, out = (P("tp"), P(None, "tp")), P(None, "tp")
    elif op == "matmul_rs":
        x, w = rand(0, (16, 16), jnp.float32), rand(1, (16, 8), jnp.float32)
        specs, out = (P(None, "tp"), P("tp", None)), P("tp")
    else:
        x, w = rand(0, (16, 16), jnp.float32), rand(1, (16, 8), jnp.float32)
        specs, out = (P(None, "tp"), P("tp", None)), P()
    f = jax.jit(jax.shard_map(lambda x, w: getattr(jo, op)(x, w, "tp", **kw), mesh=mesh,
                              in_specs=specs, out_specs=out))
    return f, x, w


# ---------------------------------------------------------------- named scopes


@pytest.mark.parametrize("impl", ["xla", "ring", "native"])
@pytest.mark.parametrize("op", OPS)
def test_every_op_and_impl_is_under_its_named_scope_in_hlo(op, impl):
    f, x, w = _fn(op, tp_mesh(4), impl=impl)
    text = f.lower(x, w).compile().as_text()
    names = re.findall(r'op_name="([^"]*)"', text)
    assert any(f"jaxoverlap.{op}" in n for n in names), names[:10]
    if impl == "native":  # the custom call itself carries the scope
        calls = [line for line in text.splitlines()
                 if "custom-call" in line and f"jaxoverlap_{op}" in line]
        assert calls and all(f"jaxoverlap.{op}" in line for line in calls)


def test_the_backward_pass_runs_under_the_other_ops_scope():
    mesh = tp_mesh(4)
    x, w = rand(0, (16, 8), jnp.float32), rand(1, (8, 16), jnp.float32)
    f = jax.jit(jax.grad(lambda x, w: jax.shard_map(  # dw needs the forward's gathered x
        lambda x, w: jo.ag_matmul(x, w, "tp", impl="native"), mesh=mesh,
        in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))(x, w).sum(),
        argnums=(0, 1)))
    text = f.lower(x, w).compile().as_text()
    assert "jaxoverlap.ag_matmul" in text and "jaxoverlap.matmul_rs" in text


# ---------------------------------------------------------------- spans


def _record(op: str, transport: str, executions: int = 2, **kw):
    f, x, w = _fn(op, tp_mesh(4), impl="native", transport=transport, chunks=2,
                  bidirectional=True, **kw)
    jax.block_until_ready(f(x, w))  # compile and warm up outside the recording
    with jo.profile(show=False) as prof:
        for _ in range(executions):
            jax.block_until_ready(f(x, w))
    return prof


@pytest.mark.parametrize("transport", _kinds.names(_kinds.TRANSPORTS))
@pytest.mark.parametrize("op", OPS)
def test_host_executor_records_every_ops_spans_inside_its_call(op, transport):
    prof = _record(op, transport)
    calls = prof.calls
    assert len(calls) == 2 * 4  # every rank, every execution
    assert {c["rank"] for c in calls} == {0, 1, 2, 3}
    assert len({c["epoch"] for c in calls}) == 2
    host = load_host()
    for call in calls:
        assert (call["op"], call["transport"], call["executor"]) == (op, transport, "host")
        assert call["ok"] and call["nranks"] == 4 and call["chunks"] == 2
        program = host.build_program(op, transport, 4, call["rank"], call["batch"],
                                     call["rows"], call["k"], call["n"], chunks=2,
                                     bidirectional=True)
        # One span per op of the rank's program, each inside the call's span.
        assert sorted(s["index"] for s in call["ops"]) == list(range(len(program["ops"])))
        for span in call["ops"]:
            assert span["kind"] == program["ops"][span["index"]]["kind"]
            assert span["stream"] == program["ops"][span["index"]]["stream"]
            assert call["start_ns"] <= span["start_ns"] <= span["ready_ns"] <= span["end_ns"]
            assert span["end_ns"] <= call["end_ns"]
        # Compute and communication on distinct streams: every GEMM on stream 0, every op
        # moving data on another stream (one-stream programs have no such op).
        kinds = {s["kind"] for s in call["ops"]}
        assert "Gemm" in kinds
        assert {s["stream"] for s in call["ops"] if s["kind"] == "Gemm"} == {0}
        movers = [s for s in call["ops"] if s["kind"] in MOVERS]
        assert all(s["stream"] != 0 for s in movers)
        if program["num_streams"] > 1:
            assert movers
        # A p2p push names the rank whose workspace it writes.
        for s in call["ops"]:
            d = program["ops"][s["index"]]["d"]
            if s["kind"] == "Copy" and d["buf"] == "WORKSPACE" and d["rank"] != call["rank"]:
                assert s["peer"] == d["rank"]
    row, = prof.sites
    assert row["op"] == op and row["calls"] == 8 and row["executions"] == 2
    assert row["t_call"] > 0 and row["t_gemm"] > 0


def test_recording_is_off_by_default_and_after_the_block():
    host = load_host()
    assert not host.recording()
    f, x, w = _fn("ag_matmul", tp_mesh(4), impl="native", transport="p2p")
    jax.block_until_ready(f(x, w))
    assert host.take_calls() == []  # nothing logged while off
    with jo.profile(show=False) as prof:
        assert host.recording()
        jax.block_until_ready(f(x, w))
    assert not host.recording()
    assert len(prof.calls) == 4
    jax.block_until_ready(f(x, w))
    assert host.take_calls() == []


def test_nested_profiles_both_see_the_calls():
    host = load_host()
    f, x, w = _fn("matmul_rs", tp_mesh(4), impl="native", transport="nccl")
    with jo.profile(show=False) as outer:
        jax.block_until_ready(f(x, w))
        with jo.profile(show=False) as inner:
            jax.block_until_ready(f(x, w))
        assert host.recording()  # the outer block still records
    assert len(inner.calls) == 4 and len(outer.calls) == 8


# ---------------------------------------------------------------- trace and report


def test_trace_json_has_a_track_per_rank_and_stream(tmp_path):
    f, x, w = _fn("ag_matmul", tp_mesh(4), impl="native", transport="nccl", chunks=2,
                  bidirectional=True)
    with jo.profile(tmp_path, show=False) as prof:
        jax.block_until_ready(f(x, w))
    assert prof.trace_path == str(tmp_path / "trace.json")
    data = json.loads((tmp_path / "trace.json").read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    ops = [e for e in spans if e["cat"] != "call"]
    assert len([e for e in spans if e["cat"] == "call"]) == 4
    assert len(ops) == sum(len(c["ops"]) for c in prof.calls)
    assert len({e["pid"] for e in spans}) == 4
    assert {e["tid"] for e in ops} == {0, 1, 2}
    assert {e["tid"] for e in ops if e["cat"] == "gemm"} == {0}
    gemm = next(e for e in ops if e["cat"] == "gemm")
    assert re.fullmatch(r"ag_matmul Gemm shard \d+ sub \d+", gemm["name"])
    recv = next(e for e in ops if e["name"].startswith("ag_matmul Recv"))
    assert recv["args"]["transport"] == "nccl" and recv["args"]["bytes"] > 0
    assert recv["args"]["peer"] in (0, 1, 2, 3) and recv["args"]["wait_us"] >= 0
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    names = {e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    assert "stream 0 (compute)" in names
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["emulation"] is True and "emulation" in report["note"]
    assert report["sites"][0]["calls"] == 4


def _op(kind, stream, start, end, ready=None):
    return {"index": 0, "stream": stream, "kind": kind, "shard": 0, "sub": 0, "peer": 1,
            "bytes": 64, "start_ns": start, "ready_ns": start if ready is None else ready,
            "end_ns": end}


def _call(rank, ops, start, end, epoch=1):
    return {"executor": "host", "clique": "clique 0x1/site 1/group 0", "epoch": epoch,
            "op": "ag_matmul", "transport": "nccl", "nranks": 2, "rank": rank, "batch": 1,
            "rows": 8, "k": 8, "n": 8, "dtype": "float32", "chunks": 1,
            "bidirectional": False, "return_gathered": False, "start_ns": start,
            "end_ns": end, "ok": True, "ops": ops}


def test_efficiency_from_hand_built_spans():
    # Rank 0: call 0..100 µs; GEMMs 0..40 and 40..90 (T_gemm 90); a Recv on stream 1 that
    # starts at 0, has its message at 20 and ends at 50 (30 µs of communication, 20 of
    # waiting); a Wait on stream 0 from 90 to 100 (all waiting). T_comm = 30.
    # Efficiency = (90 + 30 - 100) / min(90, 30) = 20 / 30.
    us = 1000
    rank0 = _call(0, [_op("Gemm", 0, 0, 40 * us), _op("Gemm", 0, 40 * us, 90 * us),
                      _op("Recv", 1, 0, 50 * us, ready=20 * us),
                      _op("Wait", 0, 90 * us, 100 * us, ready=100 * us)], 0, 100 * us)
    times = _profile.call_times(rank0)
    assert times["t_call"] == pytest.approx(100e-6)
    assert times["t_gemm"] == pytest.approx(90e-6)
    assert times["t_comm"] == pytest.approx(30e-6)
    assert times["t_wait"] == pytest.approx(30e-6)
    # Rank 1: call 0..60; GEMM 10..50 (40); Send 0..40 (40). (40 + 40 - 60) / 40 = 0.5.
    rank1 = _call(1, [_op("Gemm", 0, 10 * us, 50 * us), _op("Send", 1, 0, 40 * us)],
                  0, 60 * us)
    row, = _profile.site_report([rank0, rank1], preset=None)
    assert row["calls"] == 2 and row["executions"] == 1
    assert row["efficiency"] == pytest.approx((20 / 30 + 0.5) / 2)  # median of two
    assert row["t_call"] == pytest.approx(80e-6)  # median of 100 and 60
    assert row["t_gemm"] == pytest.approx(65e-6) and row["t_comm"] == pytest.approx(35e-6)
    assert row["t_unfused"] == pytest.approx(100e-6)
    assert "preset" not in row and "model_t_fused" not in row
    # No communication (or no GEMM): no efficiency, rather than a division by zero.
    assert _profile.overlap_efficiency(1.0, 0.0, 1.0) is None


def test_report_has_the_model_on_a_named_preset_and_says_it_is_an_emulation(capsys):
    from jaxoverlap import sim

    call = _call(0, [_op("Gemm", 0, 0, 40_000), _op("Send", 1, 0, 30_000)], 0, 50_000)
    row, = _profile.site_report([call], preset="h100")
    expected = sim.simulate("ag_matmul", sim.Shape(1, 8, 8, 8), "float32", 2, "h100",
                            sim.Candidate("native", "nccl", 1, False))
    assert row["preset"] == "h100"
    assert row["model_t_fused"] == expected.t_fused
    assert row["model_t_unfused"] == expected.t_gemm + expected.t_comm
    _profile.print_report([row], "h100", emulation=True)
    out = capsys.readouterr().out
    assert "emulation" in out and "not a GPU" in out and "'h100'" in out
    assert "measured" in out and "unfused" in out and "efficiency" in out
    text = _profile.format_report([row], "h100", emulation=True)
    assert "emulation" in text and "h100" in text
    assert "no native calls" in _profile.format_report([], "h100", emulation=True)


def test_jaxoverlap_profile_env_var_writes_the_trace_at_exit(tmp_path):
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import AxisType, Mesh, PartitionSpec as P
        import jaxoverlap as jo
        mesh = Mesh(np.array(jax.devices()[:2]), ("tp",), axis_types=(AxisType.Auto,))
        f = jax.jit(jax.shard_map(
            lambda x, w: jo.matmul_ar(x, w, "tp", impl="native", transport="p2p"),
            mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P()))
        jax.block_until_ready(f(jnp.ones((8, 8)), jnp.ones((8, 4))))
    """)
    env = dict(os.environ, JAXOVERLAP_PROFILE=str(tmp_path / "prof"), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=300, check=True).stdout
    data = json.loads((tmp_path / "prof" / "trace.json").read_text())
    calls = [e for e in data["traceEvents"] if e["ph"] == "X" and e["cat"] == "call"]
    assert len(calls) == 2 and calls[0]["name"] == "jaxoverlap.matmul_ar (p2p)"
    assert (tmp_path / "prof" / "report.json").exists()
    assert "emulation" in out and "matmul_ar" in out
