"""Automatic choices by the performance model, wired into the ops (issue: performance model).

Only tracing happens here: the standard shape is far too big to run on the CPU,
but the choice is made at trace time, so lowering with abstract inputs shows it.
"""

from __future__ import annotations

import json
import logging

import jax
import jax.numpy as jnp
import pytest
from helpers import spec_on, tp_mesh

import jaxoverlap as jo
from jaxoverlap import _plan as planning
from jaxoverlap import sim
from jaxoverlap._executors import capabilities, runtime


def _plan(op, x_shape, w_shape, dtype=jnp.bfloat16, axis=0, **kw):
    """The plan the op picks for these global shapes on a tp=8 mesh (traced, not run)."""
    seen = []
    real = planning.make

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    mesh = tp_mesh(8)
    ndim = len(x_shape)
    if op is jo.ag_matmul:
        specs = (spec_on(ndim, axis, "tp"), spec_on(2, 1, "tp"))
        out = spec_on(ndim, ndim - 1, "tp")
    else:
        specs = (spec_on(ndim, ndim - 1, "tp"), spec_on(2, 0, "tp"))
        out = spec_on(ndim, axis, "tp")
    f = jax.jit(jax.shard_map(lambda x, w: op(x, w, "tp", axis=axis, **kw), mesh=mesh,
                              in_specs=specs, out_specs=out))
    planning.make = spy
    try:
        f.lower(jax.ShapeDtypeStruct(x_shape, dtype), jax.ShapeDtypeStruct(w_shape, dtype))
    finally:
        planning.make = real
    return seen[0]


# The standard shape: TP=8, M=8192, K=8192, N=3584 per rank.
AG_STD = ((8192, 8192), (8192, 8 * 3584))
RS_STD = ((8192, 8 * 3584), (8 * 3584, 8192))


def test_no_preset_on_host_devices_keeps_the_simple_defaults(monkeypatch):
    monkeypatch.delenv("JAXOVERLAP_PRESET", raising=False)
    plan = _plan(jo.ag_matmul, *AG_STD)
    assert (plan.impl, plan.chunks) == ("xla", 1)


@pytest.mark.parametrize("op,shapes,sim_op,preset,impl", [
    (jo.ag_matmul, AG_STD, "ag_matmul", "h100", "native"),
    # on 8xH100 the fused GEMM+RS reducing beside the kernel gains more than its family's
    # margin (from the copy-engine designs it is built from, Triton-distributed PR #166:
    # 1.23x at nearly this shape); on 8xH800 published GEMM+RS gains too
    (jo.matmul_rs, RS_STD, "matmul_rs", "h100", "native"),
    (jo.matmul_rs, RS_STD, "matmul_rs", "h800", "native"),
])
def test_standard_shape_picks_the_models_plan(monkeypatch, op, shapes, sim_op, preset, impl):
    monkeypatch.setenv("JAXOVERLAP_PRESET", preset)
    plan = _plan(op, *shapes)
    assert plan.impl == impl
    # The pick is the model's: the same as asking the simulator directly, among the plans the
    # executors run here (the host executor runs the fused programs too).
    shape = sim.Shape(1, 1024, shapes[1][0] // (8 if sim_op == "matmul_rs" else 1),
                      shapes[1][1] // (8 if sim_op == "ag_matmul" else 1))
    cands = sim.candidates(preset, 8, shape, impls=("xla", "ring", "native"),
                           transports=capabilities.offered_transports("cpu"), op=sim_op,
                           dtype="bfloat16")
    best = sim.choose(sim_op, shape, "bfloat16", 8, preset, cands).candidate
    assert plan.impl == best.impl
    if best.impl == "native":
        assert (plan.preferred, plan.chunks, plan.bidirectional, plan.fused) == (
            best.transport, best.chunks, best.bidirectional, best.fused)


def test_the_ops_pick_the_fused_plan_where_the_model_does(monkeypatch):
    """AG std on 8xH100: the model's pick is a fused plan (bench --model shows it), and so is
    the op's, with the transport left to the call (a clique spanning processes resolves to nccl
    and runs the chunked program: _native/attributes.py); jo.config(fused=False) keeps the
    fastest chunked plan."""
    monkeypatch.setenv("JAXOVERLAP_PRESET", "h100")
    shape = sim.Shape(1, 1024, 8192, 3584)
    best = sim.choose("ag_matmul", shape, "bfloat16", 8, "h100").candidate
    assert best.fused
    plan = _plan(jo.ag_matmul, *AG_STD)
    assert (plan.impl, plan.fused, plan.preferred, plan.transport, plan.chunks) == (
        "native", True, best.transport, "auto", best.chunks)
    assert "transport=auto fused" in plan.describe()
    # its backward pass (GEMM + RS) runs under the same plan: fused too
    assert plan.for_op("matmul_rs").fused
    chunked = sim.choose("ag_matmul", shape, "bfloat16", 8, "h100",
                         sim.candidates("h100", 8, shape, fused=False,
                                        transports=capabilities.offered_transports("cpu")))
    with jo.config(fused=False):
        plan = _plan(jo.ag_matmul, *AG_STD)
    assert (plan.impl, plan.fused, plan.preferred, plan.chunks, plan.bidirectional) == (
        "native", False, chunked.candidate.transport, chunked.candidate.chunks,
        chunked.candidate.bidirectional)
    # float32 (not a dtype of the kernel): the chunked plan
    assert not _plan(jo.ag_matmul, *AG_STD, dtype=jnp.float32).fused


def test_fused_asked_for_takes_a_fused_plan_or_says_why_not(monkeypatch):
    """jo.config(fused=True): with a preset, the fastest fused plan even where the model would
    stay unfused, its transport pinned; without one, the native plan over the best transport
    offered; and a clear error where the fused GEMM cannot run."""
    monkeypatch.setenv("JAXOVERLAP_PRESET", "h100")
    with jo.config(fused=True):
        plan = _plan(jo.matmul_rs, *RS_STD)
        assert (plan.impl, plan.fused) == ("native", True)
        assert plan.transport in ("p2p", "multicast")
        tiny = _plan(jo.ag_matmul, (64, 32), (32, 64))
        assert (tiny.impl, tiny.fused) == ("native", True)
    monkeypatch.delenv("JAXOVERLAP_PRESET")
    with jo.config(fused=True):
        plan = _plan(jo.ag_matmul, (64, 32), (32, 64))
        assert (plan.impl, plan.fused, plan.transport) == ("native", True, "multicast")
        assert _plan(jo.ag_matmul, (64, 32), (32, 64), transport="p2p").transport == "p2p"
        with pytest.raises(ValueError, match="never runs with nccl"):
            _plan(jo.ag_matmul, (64, 32), (32, 64), transport="nccl")
        with pytest.raises(jo.NativeUnavailableError, match="bfloat16.*float32"):
            _plan(jo.ag_matmul, (64, 32), (32, 64), dtype=jnp.float32)
        with pytest.raises(jo.NativeUnavailableError, match="multiples of 8"):
            _plan(jo.ag_matmul, (64, 36), (36, 64))
        with pytest.raises(ValueError, match="impl='xla'"):
            _plan(jo.ag_matmul, (64, 32), (32, 64), impl="xla")
    monkeypatch.setenv("JAXOVERLAP_FUSED", "1")
    assert _plan(jo.ag_matmul, (64, 32), (32, 64)).fused
    monkeypatch.setenv("JAXOVERLAP_FUSED", "maybe")
    with pytest.raises(ValueError, match="JAXOVERLAP_FUSED='maybe'"):
        _plan(jo.ag_matmul, (64, 32), (32, 64))


def test_fused_asked_for_on_a_gpu_other_than_hopper_or_b200_is_refused(monkeypatch):
    """The device check itself (the CUDA executor refuses the same GPUs when it prepares):
    9.0 runs the sm_90a kernel, 10.0 the sm_100a one (16-bit only), 10.3 and 8.0 neither."""
    def gpus(*ccs):
        monkeypatch.setattr(capabilities, "gpu_table", lambda: {"devices": [
            {"ordinal": i, "compute_capability": list(cc)} for i, cc in enumerate(ccs)]})
    gpus((9, 0), (10, 3))
    reason = capabilities.fused_device_reason("cuda")
    assert reason is not None and "[1]" in reason and "10.0" in reason
    gpus((9, 0), (10, 0))
    assert capabilities.fused_device_reason("cuda") is None
    assert capabilities.fused_device_reason("cuda", "bfloat16") is None
    assert capabilities.fused_device_reason("cuda", "float16") is None
    reason = capabilities.fused_device_reason("cuda", "float8_e4m3fn")
    assert reason is not None and "[1]" in reason and "bfloat16 and float16 only" in reason
    gpus((8, 0))
    assert "[0]" in capabilities.fused_device_reason("cuda")
    assert capabilities.fused_device_reason("cpu") is None


def test_tiny_gemm_falls_back_to_unfused(monkeypatch):
    monkeypatch.setenv("JAXOVERLAP_PRESET", "h100")
    assert _plan(jo.ag_matmul, (64, 32), (32, 64)).impl == "xla"
    assert _plan(jo.matmul_rs, (64, 64), (64, 32)).impl == "xla"


def test_the_choice_follows_the_model_not_a_rule(tmp_path):
    """Same shape, two machines: free communication -> unfused; slow links -> overlapped."""
    h100 = sim.get_preset("h100")
    free = h100.replace(name="free-comm", link_gbps=1e9, nccl_gbps=1e9, p2p_gbps=1e9,
                        multicast_gbps=1e9, nccl_latency_us=0.0, ce_latency_us=0.0,
                        mc_latency_us=0.0, signal_latency_us=0.0, nccl_sms=0, mc_sms=0)
    path = tmp_path / "free.json"
    free.to_json(path)
    assert json.loads(path.read_text())["name"] == "free-comm"
    with jo.config(preset=str(path)):
        assert _plan(jo.ag_matmul, *AG_STD).impl == "xla"
    with jo.config(preset="h100"):
        assert _plan(jo.ag_matmul, *AG_STD).impl == "native"


def test_user_arguments_constrain_the_model(monkeypatch):
    monkeypatch.setenv("JAXOVERLAP_PRESET", "h100")
    plan = _plan(jo.ag_matmul, *AG_STD, chunks=4, bidirectional=True)
    assert (plan.chunks, plan.bidirectional) == (4, True)
    plan = _plan(jo.ag_matmul, *AG_STD, impl="native", transport="nccl")
    assert (plan.impl, plan.transport) == ("native", "nccl")
    assert _plan(jo.ag_matmul, *AG_STD, impl="ring").impl == "ring"


def test_debug_log_lists_candidates_with_predicted_times(monkeypatch, caplog):
    monkeypatch.setenv("JAXOVERLAP_PRESET", "h100")
    monkeypatch.setenv("JAXOVERLAP_LOG", "debug")
    with caplog.at_level(logging.DEBUG, logger="jaxoverlap"):
        _plan(jo.ag_matmul, (4096, 4096), (4096, 8 * 2048))
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "model, not a measurement" in text
    assert "xla (unfused)" in text and "native" in text and "t_us" in text
    assert "fallback margin" in text
    # this call's GEMM is smaller than any fused AG+GEMM published on H100: marked
    assert "OUTSIDE THE CALIBRATED RANGE" in text and "fused ag_matmul" in text


def test_unknown_preset_is_a_clear_error():
    with jo.config(preset="tpu-v9"):
        with pytest.raises(ValueError, match="preset='tpu-v9'.*not a built-in"):
            _plan(jo.ag_matmul, *AG_STD)


def _ar_plan(x_shape, w_shape, **kw):
    """matmul_ar's plan on a tp=8 mesh for these global shapes (traced, not run)."""
    mesh = tp_mesh(8)
    specs = (spec_on(len(x_shape), len(x_shape) - 1, "tp"), spec_on(2, 0, "tp"))
    seen = []
    real = planning.make

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    f = jax.jit(jax.shard_map(lambda x, w: jo.matmul_ar(x, w, "tp", **kw), mesh=mesh,
                              in_specs=specs, out_specs=jax.sharding.PartitionSpec()))
    planning.make = spy
    try:
        f.lower(jax.ShapeDtypeStruct(x_shape, jnp.bfloat16),
                jax.ShapeDtypeStruct(w_shape, jnp.bfloat16))
    finally:
        planning.make = real
    return seen[0]


def test_matmul_ar_algorithm_is_the_models_pick(monkeypatch):
    """Decode shapes on 8xH100: impl='auto' takes the model's pick, a one-launch program (the
    GEMM and one all-reduce kernel, captured: the host-enqueued plans are host-bound there);
    impl='native' takes the model's fastest native plan, a one-launch kernel for small M and
    the two-shot ring for large; an explicit algorithm is kept."""
    monkeypatch.setenv("JAXOVERLAP_PRESET", "h100")
    transports = capabilities.offered_transports("cpu")
    plan = _ar_plan((8, 8 * 1024), (8 * 1024, 8192), impl="auto")
    pick = sim.choose("matmul_ar", sim.Shape(1, 8, 1024, 8192), "bfloat16", 8, "h100").best
    assert pick.candidate.algorithm.endswith("_kernel"), pick.candidate.label
    assert (plan.impl, plan.algorithm, plan.preferred) == (
        "native", pick.candidate.algorithm, pick.candidate.transport)
    for m, want in ((8, "_kernel"), (65536, "two_shot"), (1, "_kernel")):
        plan = _ar_plan((m, 8 * 1024), (8 * 1024, 8192), impl="native")
        shape = sim.Shape(1, m, 1024, 8192)
        algorithms = planning._rows(planning.Request.now("matmul_ar", "tp"),
                                 jax.ShapeDtypeStruct((m, 1024), "bfloat16"), 8)[2]
        cands = sim.candidates("h100", 8, shape, impls=("native",), transports=transports,
                               op="matmul_ar", algorithms=algorithms)
        cands = [c for c in cands if c.chunks in (1, 2, 4, 8)]
        best = sim.choose("matmul_ar", shape, "bfloat16", 8, "h100", cands,
                          unfused=False).candidate
        assert (plan.impl, plan.algorithm, plan.preferred) == ("native", best.algorithm,
                                                               best.transport)
        assert best.algorithm.endswith(want), m
    plan = _ar_plan((8, 8 * 1024), (8 * 1024, 8192), impl="native", algorithm="two_shot")
    assert plan.algorithm == "two_shot"


@pytest.mark.slow
def test_fp8_picks_follow_the_model_among_what_the_executors_run(monkeypatch):
    """fp8 operands: the model's FP8 pick (the executors' own FP8 programs) among the plans
    whose executor runs the call's pairing: on host devices every pairing; on GPUs (an
    injected sm_90 table) two fp8 operands, never native for fp8 with a bfloat16 operand or
    e5m2 x e5m2 (the CUDA executor refuses them: auto falls back, native raises)."""
    monkeypatch.setenv("JAXOVERLAP_PRESET", "h100")
    e4, e5, bf16 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16

    def plan(x_dtype, w_dtype, rows=4096, out_dtype="bfloat16", k=8192, n=3584, **request):
        """AG+GEMM's plan for x [rows, k] per rank, w [k, n], over 8 ranks."""
        r = planning.Request.now("ag_matmul", "tp", out_dtype=out_dtype, **request)
        return planning.make(r, jax.ShapeDtypeStruct((rows, k), x_dtype),
                             jax.ShapeDtypeStruct((k, n), w_dtype), 8)

    shape = sim.Shape(1, 4096, 8192, 3584)          # M = 32768: FP8 leaves room to overlap
    best = sim.choose("ag_matmul", shape, "float8_e4m3fn", 8, "h100",
                      sim.candidates("h100", 8, shape, op="ag_matmul", fused=False,
                                     transports=capabilities.offered_transports("cpu"))
                      ).candidate
    assert best.impl == "native"
    for dtypes in ((e4, e4), (e4, bf16), (bf16, e4), (e5, e5)):
        p = plan(*dtypes)
        assert (p.impl, p.preferred, p.chunks, p.bidirectional) == (
            "native", best.transport, best.chunks, best.bidirectional), dtypes
    flux = dict(rows=512, k=12288, n=6144)          # AG flux fp8: docs/performance.md's row
    assert (plan(e4, e4, **flux).impl, plan(e4, e4, **flux).fused) == ("native", True)
    assert plan(e4, e4, out_dtype="float32", **flux).fused      # the e4m3 -> f32 kernel
    assert not plan(e5, e4, out_dtype="float32", **flux).fused  # no e5m2 x e4m3 -> f32 one
    # On Hopper GPUs (injected): the CUDA executor's pairings only.
    monkeypatch.setattr(runtime, "cuda_error", lambda: None)
    monkeypatch.setattr(capabilities, "current_platform", lambda: "cuda")
    monkeypatch.setattr(capabilities, "gpu_table", lambda: {
        "devices": [{"ordinal": i, "compute_capability": [9, 0]} for i in range(8)]})
    monkeypatch.setattr(capabilities, "offered_transports", lambda platform: ("nccl", "p2p"))
    assert plan(e4, e4).impl == "native" and plan(e5, e4).impl == "native"
    for dtypes in ((e4, bf16), (bf16, e4), (e5, e5)):
        assert plan(*dtypes).impl == "xla", dtypes
    with pytest.raises(capabilities.NativeUnavailableError, match="two fp8 operands"):
        plan(e4, bf16, impl="native")
    with pytest.raises(capabilities.NativeUnavailableError, match="e5m2 x float8_e5m2"):
        plan(e5, e5, impl="native")
