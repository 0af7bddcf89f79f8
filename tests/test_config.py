"""jo.config, the JAXOVERLAP_* variables and their precedence (README, "Configuration")."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import pytest
from helpers import dp_tp_mesh, put, rand, tp_mesh
from jax.sharding import PartitionSpec as P

import jaxoverlap as jo
from jaxoverlap import _local, _plan


def _plan_for(**kw):
    """The plan ag_matmul runs on each device, captured while the program is lowered and
    compiled (on global arrays it is made at trace time, for the shards of the devices)."""
    seen = []
    real = _plan.make

    def spy(*args, **kwargs):
        plan = real(*args, **kwargs)
        seen.append(plan)
        return plan

    _plan.make = spy
    try:
        mesh = tp_mesh(4)
        x, w = rand(0, (8, 4), jnp.float32), rand(1, (4, 8), jnp.float32)
        jax.jit(lambda x, w: jo.ag_matmul(x, w, "tp", mesh=mesh, **kw)).lower(x, w).compile()
    finally:
        _plan.make = real
    return seen[-1]


def test_settings_of_the_trace_reach_the_partitioned_program(monkeypatch):
    """Traced inside a jo.config block, compiled after it (under Auto axes the per-device code
    is traced when XLA partitions the program): the block's settings still apply, to the plan
    made at trace time that the devices run, and to the plan a device makes for other shards
    than the trace knew (a data axis that propagation puts on the batch)."""
    ran, made = [], []
    real_run, real_make = _local.run, _plan.make
    monkeypatch.setattr(_local, "run", lambda plan, *a: ran.append(plan) or real_run(plan, *a))

    def make(*args, **kwargs):
        made.append(real_make(*args, **kwargs))
        return made[-1]

    meshes = (tp_mesh(4), dp_tp_mesh())
    for mesh, x_spec, remade in ((meshes[0], P(None, "tp", None), False),
                                 (meshes[1], P("dp", "tp", None), True)):
        x = put(rand(0, (2, 8, 4), jnp.float32), mesh, x_spec)
        w = put(rand(1, (4, 8), jnp.float32), mesh, P(None, "tp"))
        with jo.config(impl="ring", chunks=2):
            lowered = jax.jit(functools.partial(jo.ag_matmul, axis_name="tp", axis=1,
                                                mesh=mesh)).lower(x, w)
        ran.clear()
        monkeypatch.setattr(_plan, "make", make)
        lowered.compile()
        monkeypatch.setattr(_plan, "make", real_make)
        assert ran and all((p.impl, p.chunks) == ("ring", 2) for p in ran), ran
        assert bool(made) == remade, made
        assert all((p.impl, p.chunks) == ("ring", 2) for p in made), made


def test_defaults(monkeypatch):
    for var in ("JAXOVERLAP_IMPL", "JAXOVERLAP_CHUNKS", "JAXOVERLAP_TRANSPORT"):
        monkeypatch.delenv(var, raising=False)
    settings = jo.current_config()
    assert settings.impl == "auto" and settings.transport == "auto"
    assert settings.timeout_s == 120.0 and settings.chunks is None


def test_config_block_sets_and_restores():
    with jo.config(impl="ring", chunks=2, bidirectional=False):
        plan = _plan_for()
        assert (plan.impl, plan.chunks, plan.bidirectional) == ("ring", 2, False)
        with jo.config(chunks=1):
            assert jo.current_config().impl == "ring"      # inherited from the outer block
            assert jo.current_config().chunks == 1
    assert jo.current_config().chunks is None


@pytest.mark.slow
def test_argument_beats_config_beats_environment(monkeypatch):
    monkeypatch.setenv("JAXOVERLAP_IMPL", "ring")
    monkeypatch.setenv("JAXOVERLAP_CHUNKS", "2")
    assert _plan_for().impl == "ring" and _plan_for().chunks == 2
    with jo.config(impl="xla"):
        assert _plan_for().impl == "xla"
        assert _plan_for(impl="ring").impl == "ring"
    assert _plan_for(impl="ring", chunks=1).chunks == 1


def test_bad_environment_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("JAXOVERLAP_IMPL", "fastest")
    with pytest.raises(ValueError, match="JAXOVERLAP_IMPL='fastest'"):
        jo.current_config()
    monkeypatch.setenv("JAXOVERLAP_IMPL", "ring")
    monkeypatch.setenv("JAXOVERLAP_CHUNKS", "two")
    with pytest.raises(ValueError, match="JAXOVERLAP_CHUNKS='two'"):
        jo.current_config()
    monkeypatch.delenv("JAXOVERLAP_CHUNKS")
    monkeypatch.setenv("JAXOVERLAP_TIMEOUT_S", "-1")
    with pytest.raises(ValueError, match="JAXOVERLAP_TIMEOUT_S='-1'"):
        jo.current_config()


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="impl='gpu'"):
        with jo.config(impl="gpu"):
            pass
    with pytest.raises(ValueError, match="timeout_s=0"):
        with jo.config(timeout_s=0):
            pass
    with pytest.raises(TypeError, match="fused='yes'"):
        with jo.config(fused="yes"):
            pass


def test_fused_setting_nests_and_reads_the_environment(monkeypatch):
    monkeypatch.delenv("JAXOVERLAP_FUSED", raising=False)
    assert jo.current_config().fused is None
    monkeypatch.setenv("JAXOVERLAP_FUSED", "0")
    assert jo.current_config().fused is False
    with jo.config(fused=True):
        assert jo.current_config().fused is True
        with jo.config(chunks=2):
            assert jo.current_config().fused is True  # inherited from the outer block
    assert jo.current_config().fused is False


def test_configured_chunks_must_divide(monkeypatch):
    monkeypatch.setenv("JAXOVERLAP_CHUNKS", "3")
    with pytest.raises(ValueError, match=r"chunks \(from jo.config / JAXOVERLAP_CHUNKS\)=3"):
        _plan_for(impl="ring")


def test_timeout_reaches_the_plan(monkeypatch):
    monkeypatch.setenv("JAXOVERLAP_TIMEOUT_S", "7.5")
    assert _plan_for().timeout_s == 7.5
    with jo.config(timeout_s=3):
        assert _plan_for().timeout_s == 3.0


def test_auto_impl_on_cpu_is_the_unfused_path():
    """On CPU native is an emulator, not a speed-up: auto keeps the unfused path."""
    assert _plan.native_reason(jnp.float32) is None     # native can run here...
    assert _plan_for().impl == "xla"                    # ...but auto does not pick it


def test_auto_transport_prefers_multicast_then_p2p_then_nccl(monkeypatch):
    """transport="auto" stays "auto" in the plan and is resolved once, when the call lowers:
    the best transport that can serve, nccl for a clique spanning processes."""
    from jaxoverlap._executors import capabilities

    assert _plan_for(impl="native").transport == "auto"
    resolve = functools.partial(capabilities.resolve_transport, "cpu", "auto", None,
                                local_ordinals=[0, 1])
    assert resolve(spans_processes=False) == "multicast"
    assert resolve(spans_processes=True) == "nccl"
    lacking = {"multicast": "no NVSwitch", "p2p": None, "nccl": None}
    monkeypatch.setattr(capabilities, "transport_reasons", lambda *a: dict(lacking))
    assert resolve(spans_processes=False) == "p2p"
    lacking["p2p"] = "no peer access"
    assert resolve(spans_processes=False) == "nccl"
    monkeypatch.setenv("JAXOVERLAP_TRANSPORT", "nccl")
    assert _plan_for(impl="native").transport == "nccl"


def test_the_call_s_description_decides_its_transport_and_fused_bit(monkeypatch):
    """One decision (``_executors.call.describe``, through ``resolve_transport``): a fused plan
    runs fused only over a transport the fused GEMM runs with (nccl for a clique spanning
    processes is not one), and ``among`` keeps auto to the fused GEMM's transports there."""
    from jaxoverlap._executors import capabilities
    from jaxoverlap._executors.call import describe

    mesh = tp_mesh(2)
    call = describe(mesh, "tp", "cpu", "auto", "p2p", 0, fused=True)
    assert (call.transport, call.fused) == ("p2p", True)
    assert not describe(mesh, "tp", "cpu", "nccl", None, 0, fused=True).fused
    assert not describe(mesh, "tp", "cpu", "auto", None, 0).fused
    resolve = functools.partial(capabilities.resolve_transport, "cpu", "auto", None,
                                local_ordinals=[0, 1], among=("p2p", "multicast"))
    assert resolve(spans_processes=True) == "multicast"   # not nccl: not among
    monkeypatch.setattr(capabilities, "transport_reasons", lambda *a: {
        "multicast": "no NVSwitch", "p2p": "no peer access", "nccl": None})
    with pytest.raises(capabilities.NativeUnavailableError, match="none of .*no peer access"):
        resolve(spans_processes=False)


def test_debug_log_prints_the_plan(monkeypatch, caplog):
    monkeypatch.setenv("JAXOVERLAP_LOG", "debug")
    with caplog.at_level(logging.DEBUG, logger="jaxoverlap"):
        _plan_for(impl="ring", chunks=2)
    assert any("ag_matmul" in r.message and "impl=ring" in r.message and "chunks=2" in r.message
               for r in caplog.records)
