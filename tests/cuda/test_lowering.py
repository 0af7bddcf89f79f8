"""The GPU lowering of the native primitive (``_native/primitive.py``), on a CPU-only machine.

JAX can lower for a platform it does not have (``lowering_platforms=("cuda",)``); the native
primitive's lowering rule then emits the CUDA custom calls. With the capability table
injected, the HLO must carry the rank table and the attributes the handler binds (names and
element types), the scale operands and no ``coords`` operand; an fp8 w is asked of XLA in
K-major layout, and GEMMs the GPUs cannot run are refused when the call lowers.

The global-array calls use Explicit mesh axes: their per-device code is then a
``shard_map`` traced while lowering. Under Auto axes it is traced when XLA
partitions the program (``_partition``), i.e. while compiling, which needs the
platform itself.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tp_mesh
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoverlap as jo
from jaxoverlap import _kinds
from jaxoverlap._executors import capabilities
from jaxoverlap._native import primitive
from jaxoverlap._plan import OpPlan

from .test_caps import table


@pytest.fixture()
def gpu_lowering(monkeypatch, cuda):
    monkeypatch.setattr(capabilities, "gpu_table", lambda: table(n=8))


def _lower(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("transport", _kinds.names(_kinds.TRANSPORTS))
def test_ag_matmul_lowers_to_the_cuda_target(gpu_lowering, transport):
    devices = np.array(jax.devices()[:8]).reshape(2, 4)[:, ::-1]  # dp=2, tp=4, reversed tp
    mesh = Mesh(devices, ("dp", "tp"), axis_types=(AxisType.Explicit, AxisType.Explicit))
    x = jax.device_put(jnp.ones((8, 16, 32), jnp.bfloat16), NamedSharding(mesh, P("dp", "tp")))
    w = jax.device_put(jnp.ones((32, 24), jnp.bfloat16), NamedSharding(mesh, P(None, "tp")))
    text = _lower(lambda a, b: jo.ag_matmul(a, b, "tp", axis=1, impl="native",
                                            transport=transport, mesh=mesh), x, w)
    call = next(line for line in text.splitlines() if "jaxoverlap_cuda_ag_matmul" in line)
    assert "jaxoverlap_ag_matmul\"" not in text  # not the CPU target
    # Operands x, w and their scales (no coords) in the call's type signature.
    signature = call.split(":")[-1]
    assert signature.count("tensor<") == 5, call  # x, w, x_scale, w_scale -> y
    assert signature.count("tensor<f32>") == 2, call
    ids = [d.id for d in np.moveaxis(devices, 1, -1).reshape(-1)]
    # i64 arrays, the handler's Span<const int64_t> (the rank table in (group, rank) order).
    assert f"device_ids = dense<[{', '.join(map(str, ids))}]> : tensor<8xi64>" in call, call
    assert f"ordinals = dense<[{', '.join(map(str, ids))}]> : tensor<8xi64>" in call, call
    assert "processes = dense<0> : tensor<8xi64>" in call, call
    assert "op = 0 : i32" in call, call
    assert f"transport = {('nccl', 'p2p', 'multicast').index(transport)} : i32" in call
    for attr in ("axis = 1 : i64", "axis_size = 4 : i64", "chunks =", "timeout_ms =",
                 "clique_key =", "bidirectional ="):
        assert attr in call, (attr, call)


def test_matmul_rs_and_the_backward_pass_lower_too(gpu_lowering):
    mesh = tp_mesh(4, kind=AxisType.Explicit)
    x = jax.device_put(jnp.ones((16, 32), jnp.float32), NamedSharding(mesh, P(None, "tp")))
    w = jax.device_put(jnp.ones((32, 8), jnp.float32), NamedSharding(mesh, P("tp", None)))

    def loss(a, b):
        return jo.matmul_rs(a, b, "tp", impl="native", transport="p2p", mesh=mesh).sum()

    text = _lower(jax.value_and_grad(loss, argnums=(0, 1)), x, w)
    assert "jaxoverlap_cuda_matmul_rs" in text
    assert "jaxoverlap_cuda_ag_matmul" in text  # the backward of matmul_rs is an ag_matmul


# XLA FFI's XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE (xla/ffi/api/c_api.h).
COMMAND_BUFFER_COMPATIBLE = 1


REPLAYABLE_TARGET = "jaxoverlap_cuda_replayable"


def _builder_replays(problem: dict) -> bool:
    """The program builder's word: does it build this problem replayable (core/build.cc)?"""
    from jaxoverlap._executors.runtime import load_host

    return load_host().replay_refusal(problem) == ""


def test_only_the_calls_that_replay_are_command_buffer_compatible(gpu_lowering, cuda):
    """matmul_ar's kernel algorithms lower to jaxoverlap_cuda_replayable, whose execute
    handler reports XLA FFI's command-buffer trait in its metadata (what XLA reads when it
    decides to capture a custom call); the one-shot program of separate ops goes there only if
    its plan asks for the replayable program (the model's pick, OpPlan.replayable) and the
    program builder builds it so: here no preset applies (host devices lowered for cuda), so no
    plan asks and it goes to the op's own target, which reports none, though the builder
    would build it replayable (docs/gpu.md §6)."""
    traits = cuda.handler_traits()
    assert traits[REPLAYABLE_TARGET] & COMMAND_BUFFER_COMPATIBLE
    for op in _kinds.names(_kinds.OPS):
        assert not traits[f"jaxoverlap_cuda_{op}"] & COMMAND_BUFFER_COMPATIBLE, op
    mesh = tp_mesh(4)
    x = jnp.ones((1, 32), jnp.bfloat16)  # a decode step: one row
    w = jnp.ones((32, 8), jnp.bfloat16)
    one_shot = dict(op="matmul_ar", transport="p2p", nranks=4, batch=1, rows=1, k=8, n=8,
                    dtype="bfloat16", algorithm="one_shot")
    assert _builder_replays(one_shot)  # the plan's word decides, not the builder's alone
    for algorithm, transport, target in (
            ("one_shot_kernel", "p2p", REPLAYABLE_TARGET),
            ("two_shot_kernel", "multicast", REPLAYABLE_TARGET),
            ("one_shot", "p2p", "jaxoverlap_cuda_matmul_ar")):
        text = _lower(jax.shard_map(
            lambda a, b, algorithm=algorithm, transport=transport: jo.matmul_ar(
                a, b, "tp", impl="native", transport=transport, algorithm=algorithm),
            mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P()), x, w)
        calls = [line for line in text.splitlines() if "custom_call @jaxoverlap" in line]
        assert len(calls) == 1 and f"@{target}(" in calls[0], (algorithm, calls)
        ids = _kinds.AR_ALGORITHMS.index(algorithm)
        assert f"algorithm = {ids} : i32" in calls[0], calls[0]


def test_a_call_of_one_rank_never_goes_to_the_command_buffer_compatible_target(gpu_lowering):
    """A call of one rank takes the executor's ordinary path whatever it asks (its program is its
    own GEMM: CudaSite::Enqueue), and that path refuses capture: so it lowers to its op's own
    target, never to jaxoverlap_cuda_replayable, a kernel algorithm's or a replayable plan's."""
    mesh = tp_mesh(1)
    x = jnp.ones((1, 32), jnp.bfloat16)
    w = jnp.ones((32, 8), jnp.bfloat16)
    for algorithm, transport in (("one_shot_kernel", "p2p"), ("two_shot_kernel", "multicast")):
        text = _lower(jax.shard_map(
            lambda a, b, algorithm=algorithm, transport=transport: jo.matmul_ar(
                a, b, "tp", impl="native", transport=transport, algorithm=algorithm),
            mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P()), x, w)
        calls = [line for line in text.splitlines() if "custom_call @jaxoverlap" in line]
        assert len(calls) == 1 and "@jaxoverlap_cuda_matmul_ar(" in calls[0], (algorithm, calls)


def _value(text: str):
    """One attribute of the lowered custom call (MLIR text) as Python: bool, int, str, or the
    list of an i64 array (a splat ``dense<v> : tensor<Nxi64>`` repeated N times)."""
    if text in ("true", "false"):
        return text == "true"
    if text.startswith('"'):
        return text[1:-1]
    array = re.fullmatch(r"dense<(.*)> : tensor<(\d+)xi64>", text)
    if array:
        body, size = array.group(1), int(array.group(2))
        if body.startswith("["):
            return [int(v) for v in body[1:-1].split(",")]
        return [int(body)] * size
    return int(re.fullmatch(r"(-?\d+) : i(?:32|64)", text).group(1))


def _native_call(text: str) -> tuple[str, dict]:
    """The one native custom call of a lowered program: its target and its attributes."""
    calls = [line for line in text.splitlines() if "custom_call @jaxoverlap" in line]
    assert len(calls) == 1, calls
    target = re.search(r"custom_call @(\w+)\(", calls[0]).group(1)
    config = re.search(r"mhlo\.backend_config = \{(.*?)\}, operand_layouts", calls[0]).group(1)
    entries = (entry.split(" = ", 1) for entry in re.split(r", (?=\w+ = )", config))
    return target, {name: _value(value) for name, value in entries}


# Every op over every transport, chunked and (where it runs) fused, on 4 ranks: (op, local x,
# local w, x's and w's specs, y's spec, matmul_ar's algorithm).
_OPS = {
    "ag_matmul": ((8, 32), (32, 16), (P("tp"), P(None, "tp")), P(None, "tp")),
    "matmul_rs": ((32, 32), (32, 16), (P(None, "tp"), P("tp", None)), P("tp")),
    "matmul_ar": ((16, 32), (32, 16), (P(None, "tp"), P("tp", None)), P()),
}
_ROUTED = [(op, t, fused) for op in _OPS for t in _kinds.names(_kinds.TRANSPORTS)
           for fused in (False, True)
           if not fused or (_kinds.op(op).fused and _kinds.transport(t).fused)]


def _lower_plan(op: str, transport: str, fused: bool, chunks: int = 2,
                bidirectional: bool = False, return_gathered: bool = False,
                replayable: bool = True):
    """The GPU lowering of one native call of ``op`` through the primitive (4 ranks, bf16,
    the shapes of ``_OPS`` per rank; ``replayable``: the plan asks for the replayable program):
    (its target, its attributes, its canonical problem as the handler makes it from its
    operands)."""
    x_shape, w_shape, specs, out = _OPS[op]
    mesh = tp_mesh(4)
    plan = OpPlan(op=op, impl="native", axis_name="tp", axis=0, axis_size=4, chunks=chunks,
                  bidirectional=bidirectional, transport=transport, fused=fused,
                  replayable=replayable)
    run = {"ag_matmul": lambda a, b: primitive.ag_matmul(a, b, plan, return_gathered),
           "matmul_rs": lambda a, b: primitive.matmul_rs(a, b, plan),
           "matmul_ar": lambda a, b: primitive.matmul_ar(a, b, plan)}[op]
    outs = (out, P("tp")) if return_gathered else out
    fn = jax.shard_map(run, mesh=mesh, in_specs=specs, out_specs=outs)
    global_x = tuple(d * 4 if s == "tp" else d for d, s in
                     zip(x_shape, tuple(specs[0]) + (None,) * 2, strict=False))
    global_w = tuple(d * 4 if s == "tp" else d for d, s in
                     zip(w_shape, tuple(specs[1]) + (None,) * 2, strict=False))
    target, attrs = _native_call(_lower(fn, jnp.ones(global_x, jnp.bfloat16),
                                        jnp.ones(global_w, jnp.bfloat16)))
    shapes = _kinds.canonical_problem(op, x_shape, w_shape, 0, 4)
    problem = dict(op=op, transport=transport, nranks=4, batch=shapes.batch, rows=shapes.rows,
                   k=shapes.k, n=shapes.n, dtype="bfloat16", chunks=chunks,
                   bidirectional=bidirectional, return_gathered=return_gathered,
                   fused=fused and transport in ("p2p", "multicast"))
    return target, attrs, problem


@pytest.mark.parametrize("asked", [True, False], ids=["asked", "plain"])
@pytest.mark.parametrize(("op", "transport", "fused"), _ROUTED)
def test_a_call_replays_where_the_program_builder_builds_it_so(gpu_lowering, op, transport,
                                                                fused, asked):
    """The `replayable` attribute follows the plan (``OpPlan.replayable``, the model's pick
    between the plain and the replayable program) gated by the program builder's acceptance of
    the call's problem (core/build.cc; never a list of the lowering's): a plan that does not
    ask for it lowers the plain program wherever the builder would build the replayable one,
    and a plan that asks for it gets it only where the builder builds it. A call built
    replayable comes through
    jaxoverlap_cuda_replayable, every other through its op's target. Fixed by design: a call
    over nccl never replays (NCCL's own calls capture, ours take host-side epochs); the fused
    all-gather over p2p does (its replayable program, docs/gpu-internals.md §8). The rest
    follow the builder, so they stay true as it learns more programs. The handlers' decoding of
    the lowered attributes (ffi_call.h DecodeDesc, CheckTarget) gives the problem the attribute
    says, takes the target the call lowered to and refuses the other one, naming both."""
    from jaxoverlap._executors.runtime import load_host

    target, attrs, problem = _lower_plan(op, transport, fused, replayable=asked)
    builds = _builder_replays(problem)
    if transport == "nccl":
        assert not builds
    if (op, transport, fused) == ("ag_matmul", "p2p", True):
        assert builds
    expected = asked and builds
    assert attrs["replayable"] is expected, (attrs, problem)
    assert target == (REPLAYABLE_TARGET if expected else f"jaxoverlap_cuda_{op}"), target
    host = load_host()
    decoded = host.decode_call(attrs, target == REPLAYABLE_TARGET)
    assert decoded["replayable"] is expected and decoded["fused"] == problem["fused"]
    assert (decoded["op"], decoded["transport"], decoded["nranks"]) == (op, transport, 4)
    with pytest.raises(ValueError, match="(?i)lower the program again") as refused:
        host.decode_call(attrs, target != REPLAYABLE_TARGET)
    assert REPLAYABLE_TARGET in str(refused.value) and f"jaxoverlap_cuda_{op}" in str(
        refused.value)


@pytest.mark.parametrize("connections", [1, 8])
def test_a_call_routed_replayable_is_right_eager_captured_and_replayed_on_the_fake(
        gpu_lowering, fake, connections):
    """End to end on the fake: the fused all-gather over p2p as it lowers (4 ranks, 2 chunks,
    both directions, the gathered x returned) comes through jaxoverlap_cuda_replayable; its
    attributes decoded as its handler decodes them, through that target, give the problem it
    runs, which the CUDA executor plays as test_graphs plays the replayable program (CudaSite::
    Enqueue, what the handler calls): two calls, then captured on every rank and launched three
    times with new inputs, the last rank last — every call and every replay right, with one
    and eight work queues."""
    from jaxoverlap._executors.runtime import load_host

    from .fake_cases import problem
    from .test_graphs import replayed

    target, attrs, lowered = _lower_plan("ag_matmul", "p2p", True, chunks=2,
                                         bidirectional=True, return_gathered=True)
    assert target == REPLAYABLE_TARGET and attrs["replayable"] is True
    runs = load_host().decode_call(attrs, True)
    p = problem(runs["op"], runs["transport"], runs["nranks"], batch=lowered["batch"],
                rows=lowered["rows"], k=lowered["k"], nw=lowered["n"], dtype="bfloat16",
                chunks=runs["chunks"], bidirectional=runs["bidirectional"], fused=runs["fused"],
                replayable=runs["replayable"], return_gathered=True)
    assert p["replayable"] and p["fused"] and p["bidirectional"] and p["chunks"] == 2
    out, eager, replays = replayed(fake, p, connections, late=3)
    assert out["statuses"] == [None] * 4, out["statuses"]
    assert out["drained"] and out["replay_drained"] == [True] * 3 and fake.errors() == []
    assert eager == [True] * 4 and replays == [[True] * 4] * 3, (eager, replays)


def test_explicit_transport_the_gpus_lack_is_an_error_when_lowering(monkeypatch, cuda):
    monkeypatch.setattr(capabilities, "gpu_table", lambda: table(n=8, multicast=False))
    mesh = tp_mesh(4, kind=AxisType.Explicit)
    x = jnp.ones((16, 32), jnp.float32)
    w = jnp.ones((32, 8), jnp.float32)
    with pytest.raises(ValueError, match="Fabric Manager"):
        _lower(lambda a, b: jo.ag_matmul(a, b, "tp", impl="native", transport="multicast",
                                         mesh=mesh), x, w)


def test_a_users_shard_map_needs_no_set_mesh(monkeypatch, cuda):
    """The concrete mesh of a plain jit(shard_map(mesh=...)) is known where the call lowers."""
    monkeypatch.setattr(capabilities, "gpu_table", lambda: table(n=8))
    mesh = tp_mesh(4)

    def local(a, b):
        return jo.ag_matmul(a, b, "tp", impl="native", transport="nccl")

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                       out_specs=P(None, "tp"))
    text = _lower(fn, jnp.ones((16, 32)), jnp.ones((32, 8)))
    assert "jaxoverlap_cuda_ag_matmul" in text and "device_ids = dense<[0, 1, 2, 3]>" in text


def test_an_abstract_mesh_on_gpu_gets_an_error_saying_what_to_do(monkeypatch, cuda):
    monkeypatch.setattr(capabilities, "gpu_table", lambda: table(n=8))
    abstract = tp_mesh(4).abstract_mesh

    def local(a, b):
        return jo.ag_matmul(a, b, "tp", impl="native", transport="nccl")

    fn = jax.shard_map(local, mesh=abstract, in_specs=(P("tp"), P(None, "tp")),
                       out_specs=P(None, "tp"))
    with pytest.raises(ValueError, match="need the concrete mesh where the program lowers"):
        _lower(fn, jnp.ones((16, 32)), jnp.ones((32, 8)))


def _fp8_lowering(x_dtype, w_dtype, caps):
    """The custom call of an fp8 ag_matmul through the native primitive, lowered for CUDA."""
    mesh = tp_mesh(4)

    def local(a, b):
        plan = OpPlan(op="ag_matmul", impl="native", axis_name="tp", axis=0, axis_size=4,
                      transport="nccl", out_dtype="bfloat16")
        fp8 = capabilities.is_fp8
        return primitive.ag_matmul(a, b, plan, x_scale=jnp.float32(0.5) if fp8(a.dtype) else None,
                                   w_scale=jnp.float32(2.0) if fp8(b.dtype) else None)

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                       out_specs=P(None, "tp"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(capabilities, "gpu_table", lambda: caps)
        return _lower(fn, jnp.ones((16, 32), x_dtype), jnp.ones((32, 16), w_dtype))


def test_fp8_lowers_with_a_k_major_w_and_both_scales(cuda):
    """cuBLASLt's FP8 GEMMs take both operands K-major: XLA is asked for w as [n, k] in
    memory (minor-to-major (0, 1)); x stays row-major; y is the plan's out_dtype."""
    text = _fp8_lowering(jnp.float8_e4m3fn, jnp.float8_e5m2, table(n=8))
    call = next(line for line in text.splitlines() if "jaxoverlap_cuda_ag_matmul" in line)
    assert ("operand_layouts = [dense<[1, 0]> : tensor<2xindex>, dense<[0, 1]> : "
            "tensor<2xindex>, dense<> : tensor<0xindex>, dense<> : tensor<0xindex>]") in call
    signature = call.split(":")[-1]
    assert ("(tensor<4x32xf8E4M3FN>, tensor<32x4xf8E5M2>, tensor<f32>, tensor<f32>) -> "
            "tensor<16x4xbf16>") in signature, call


def test_fp8_the_gpus_cannot_run_is_refused_when_lowering(cuda):
    """Before sm_89 there is no FP8 GEMM; cuBLASLt has no fp8 x bf16 and no e5m2 x e5m2 GEMM:
    a clear error naming the reason when the call lowers, never a crash on the GPU."""
    for x_dtype, w_dtype, caps, reason in [
            (jnp.float8_e4m3fn, jnp.float8_e4m3fn, table(n=8, cc=(8, 0), name="A100"),
             "compute capability 8.9"),
            (jnp.float8_e4m3fn, jnp.bfloat16, table(n=8), "take two fp8 operands"),
            (jnp.float8_e5m2, jnp.float8_e5m2, table(n=8), "no float8_e5m2 x float8_e5m2")]:
        with pytest.raises(capabilities.NativeUnavailableError, match=reason):
            _fp8_lowering(x_dtype, w_dtype, caps)
    # Ada (sm_89) has FP8 GEMMs.
    assert "jaxoverlap_cuda_ag_matmul" in _fp8_lowering(jnp.float8_e4m3fn, jnp.float8_e4m3fn,
                                                        table(n=8, cc=(8, 9), name="L40S"))


def _mx_lowering(caps, rows=256, k=128, cols=128, chunks=1):
    """The custom call of a block-scaled (MXFP8) ag_matmul asked for natively, lowered for
    CUDA on GPUs of ``caps``: 4 ranks, ``rows`` per shard, w ``[k, cols]`` per rank."""
    mesh = tp_mesh(4)
    e4, e8 = jnp.float8_e4m3fn, jnp.float8_e8m0fnu

    def local(a, b, sa, sb):
        return jo.ag_matmul(a, b, "tp", x_scale=sa, w_scale=sb, impl="native", transport="nccl",
                            chunks=chunks, preferred_element_type=jnp.bfloat16)

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp"), P(None, "tp")),
                       out_specs=P(None, "tp"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(capabilities, "gpu_table", lambda: caps)
        patch.setattr(capabilities, "current_platform", lambda: "cuda")
        return _lower(fn, jnp.ones((4 * rows, k), e4), jnp.ones((k, 4 * cols), e4),
                      jnp.ones((4 * rows, k // 32), e8), jnp.ones((k // 32, 4 * cols), e8))


def test_mxfp8_lowers_on_compute_capability_10_with_tiled_scales(cuda):
    """On B200-like GPUs a block-scaled call lowers to the CUDA custom call with its e8m0 scale
    operands in their own shapes, rearranged into cuBLAS's tiled layout before it (the CPU
    lowering leaves them as they are: the host executor's layout)."""
    text = _mx_lowering(table(n=8, cc=(10, 0), name="B200"))
    call = next(line for line in text.splitlines() if "jaxoverlap_cuda_ag_matmul" in line)
    assert ("(tensor<256x128xf8E4M3FN>, tensor<128x128xf8E4M3FN>, tensor<256x4xf8E8M0FNU>, "
            "tensor<4x128xf8E8M0FNU>) -> tensor<1024x128xbf16>") in call.split(":")[-1], call
    tiling = [line for line in text.splitlines() if "transpose" in line and "E8M0" in line]
    assert len(tiling) >= 3, tiling  # x's two swaps, w's transpose and swaps


def test_mxfp8_the_gpus_or_shapes_cannot_take_are_refused_when_planned(cuda):
    """Block scales on H100s (no block-scaled cuBLASLt GEMM), or GEMMs that are not whole 128x4
    tiles of scales (a sub-chunk of 64 rows; k 64): a clear error naming the rule before the
    call lowers, never the executor's refusal on the GPU."""
    b200 = table(n=8, cc=(10, 0), name="B200")
    for caps, kwargs, reason in [(table(n=8), {}, r"compute capability 10.x only .*sm_90"),
                                 (b200, dict(chunks=4), r"multiples of 128.*\(64, 128, 128\)"),
                                 (b200, dict(k=64), r"multiples of 128.*\(256, 128, 64\)")]:
        with pytest.raises(capabilities.NativeUnavailableError, match=reason):
            _mx_lowering(caps, **kwargs)


def test_mxfp8_scales_tiled_by_the_lowering_give_the_reference_on_the_fake(fake):
    """The lowering's rearrangement (``primitive.tiled_block_scales``, run by JAX here) hands
    the CUDA executor scales it reads right: on a B200-like fake, an all-gather over two batches
    with them, and a reduce-scatter with K = 256 and w's n = 256 (two tiles along K and along
    n: JAX's cross-tile order against the fake's own reading), equal the block-dequantized
    reference within the FP8 bound."""
    from jaxoverlap import _selftest

    from .test_fp8 import MX, check_fp8, mx_case

    def tile(sx, sw):
        tx, tw = primitive.tiled_block_scales(jnp.asarray(sx).view(jnp.float8_e8m0fnu),
                                              jnp.asarray(sw).view(jnp.float8_e8m0fnu))
        return np.asarray(tx).view(np.uint8).tobytes(), np.asarray(tw).view(np.uint8).tobytes()

    fake.reset(fake.Config(**_selftest.FAKE_B200))
    out, factors = mx_case(fake, "ag_matmul", "p2p", 2, batch=2, tile=tile)
    check_fp8(fake, "ag_matmul", out, factors, MX, 2, 128)
    fake.reset(fake.Config(**_selftest.FAKE_B200))
    out, factors = mx_case(fake, "matmul_rs", "p2p", 2, k=256, nw=256, tile=tile, seed=7)
    check_fp8(fake, "matmul_rs", out, factors, MX, 2, 256)


def _mx_lowering_3d(caps, op, x_shape, k=128, cols=128, n=2, platform="cuda"):
    """A block-scaled ``op`` on x of per-rank shape ``x_shape`` (axis 0 sharded, trailing dims
    kept) asked for natively, lowered for CUDA on GPUs of ``caps`` (two-shot for matmul_ar);
    ``platform``: where the call is planned (a CPU plan makes no tile check of its own)."""
    mesh = tp_mesh(n)
    e4, e8 = jnp.float8_e4m3fn, jnp.float8_e8m0fnu
    call = {"ag_matmul": jo.ag_matmul, "matmul_rs": jo.matmul_rs, "matmul_ar": jo.matmul_ar}[op]
    w_spec = P(None, "tp") if op == "ag_matmul" else P("tp", None)

    def local(a, b, sa, sb):
        return call(a, b, "tp", x_scale=sa, w_scale=sb, impl="native", transport="nccl",
                    preferred_element_type=jnp.bfloat16)

    x_spec = P("tp") if op == "ag_matmul" else P(None, *[None] * (len(x_shape) - 2), "tp")
    out_spec = {"ag_matmul": P(None, *[None] * (len(x_shape) - 2), "tp"), "matmul_rs": P("tp"),
                "matmul_ar": P()}[op]
    fn = jax.shard_map(local, mesh=mesh, in_specs=(x_spec, w_spec, x_spec, w_spec),
                       out_specs=out_spec)
    if op == "ag_matmul":
        xg = (n * x_shape[0], *x_shape[1:-1], k)
        wg = (k, n * cols)
    else:
        xg = (*x_shape[:-1], n * k)
        wg = (n * k, cols)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(capabilities, "gpu_table", lambda: caps)
        patch.setattr(capabilities, "current_platform", lambda: platform)
        return _lower(fn, jnp.ones(xg, e4), jnp.ones(wg, e4),
                      jnp.ones((*xg[:-1], xg[-1] // 32), e8),
                      jnp.ones((wg[0] // 32, wg[1]), e8))


def test_mxfp8_scales_of_a_3d_x_are_tiled_over_the_programs_rows(cuda):
    """x with more than two dims (its last but one not a multiple of 128, the rows a GEMM takes
    whole tiles: matmul_ar's every dim but the last, split in two; an all-gather's or
    reduce-scatter's s * prod(post)): x's scales are tiled too, not only w's."""
    for op, x_shape in [("matmul_ar", (4, 64, 128)), ("ag_matmul", (64, 2, 128)),
                        ("matmul_rs", (128, 2, 128))]:
        text = _mx_lowering_3d(table(n=8, cc=(10, 0), name="B200"), op, x_shape)
        assert f"jaxoverlap_cuda_{op}" in text
        tiling = [line for line in text.splitlines() if "transpose" in line and "E8M0" in line]
        assert len(tiling) >= 5, (op, tiling)  # x's two swaps, w's transpose and two swaps


def test_mxfp8_scales_that_cannot_be_tiled_are_refused_when_lowering_for_cuda(cuda):
    """A call planned where no tile check runs (on the CPU) but lowered for CUDA, whose GEMMs
    take 64 rows (matmul_ar [2, 64, 128] per rank, two-shot on two ranks): a clear error when it
    lowers, never row-major scales the executor would read as tiles."""
    with pytest.raises(capabilities.NativeUnavailableError,
                       match=r"rows per GEMM \(as the program splits x\) 64"):
        _mx_lowering_3d(table(n=8, cc=(10, 0), name="B200"), "matmul_ar", (2, 64, 128),
                        platform="cpu")


def test_mxfp8_scales_of_a_3d_x_tiled_by_the_lowering_give_the_reference_on_the_fake(fake):
    """x with more than two dims whose last but one is not a multiple of 128 (matmul_ar's
    [4, 64, K] per rank, two-shot on two ranks; an all-gather's and a reduce-scatter's
    [s, 2, K] on axis 0): the lowering tiles the scales over the program's rows (the executor's
    GEMMs take 128 of them, batches merged), so the CUDA executor reads them right on a
    B200-like fake."""
    from jaxoverlap import _selftest

    from .test_fp8 import MX, check_fp8, mx_case

    for op, x_shape in [("matmul_ar", (4, 64)), ("ag_matmul", (64, 2)), ("matmul_rs", (128, 2))]:
        def tile(sx, sw, x_shape=x_shape):
            tx, tw = primitive.tiled_block_scales(
                jnp.asarray(sx.reshape(*x_shape, -1)).view(jnp.float8_e8m0fnu),
                jnp.asarray(sw).view(jnp.float8_e8m0fnu))
            return (np.asarray(tx).view(np.uint8).tobytes(),
                    np.asarray(tw).view(np.uint8).tobytes())

        fake.reset(fake.Config(**_selftest.FAKE_B200))
        out, factors = mx_case(fake, op, "p2p", 2, tile=tile, seed=len(op))
        try:
            check_fp8(fake, op, out, factors, MX, 2, 128)
        except AssertionError as e:
            e.add_note(f"in the case {(op, x_shape)}")
            raise


def _plan_traced(monkeypatch, op_fn, x_shape, w_shape, specs, out_spec) -> OpPlan:
    """The plan a call of 8 ranks gets where it is traced (``_plan.make``, spied on)."""
    from jaxoverlap import _plan as planning

    seen: list[OpPlan] = []
    real = planning.make
    monkeypatch.setattr(planning, "make", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    fn = jax.shard_map(op_fn, mesh=tp_mesh(8), in_specs=specs, out_specs=out_spec)
    jax.jit(fn).trace(jax.ShapeDtypeStruct(x_shape, jnp.bfloat16),
                      jax.ShapeDtypeStruct(w_shape, jnp.bfloat16))
    return seen[0]


@pytest.mark.parametrize("cc", [(9, 0), (10, 0), (12, 0)], ids=["sm_90", "sm_100", "sm_120"])
def test_auto_offers_the_clock_bounded_kernels_only_where_the_gpus_run_their_cubins(
        monkeypatch, cuda, caplog, cc):
    """A decode step's matmul_ar with a preset (h100): the model picks a one-launch all-reduce
    kernel where the GPUs have a cubin of it (the build's sm_90 and sm_100 ones, an sm_100
    cubin running on 10.x), and where they would JIT-compile it from PTX (sm_120: the executor
    refuses a kernel bounded by %globaltimer there) it picks among the other plans, saying why,
    and asks for no replayable program either (its flag wait is such a kernel)."""
    monkeypatch.setattr(capabilities, "gpu_table", lambda: table(n=8, cc=cc, name="GPU"))
    monkeypatch.setattr(capabilities, "current_platform", lambda: "cuda")
    monkeypatch.setattr(capabilities, "offered_transports",
                        lambda platform: _kinds.names(_kinds.TRANSPORTS))
    monkeypatch.setenv("JAXOVERLAP_PRESET", "h100")
    monkeypatch.setenv("JAXOVERLAP_LOG", "debug")
    runs_cubins = cc != (12, 0)
    assert (capabilities.clocked_kernel_reason("cuda", "add") is None) == runs_cubins
    with caplog.at_level("DEBUG", logger="jaxoverlap"):
        plan = _plan_traced(
            monkeypatch, lambda a, b: jo.matmul_ar(a, b, "tp"), (8, 8 * 1024),
            (8 * 1024, 8192), (P(None, "tp"), P("tp", None)), P())
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert (plan.algorithm in ("one_shot_kernel", "two_shot_kernel")) == runs_cubins, plan
    assert ("sm_120 have no cubin of the add kernels" in text) == (not runs_cubins), text
    if not runs_cubins:
        assert not plan.replayable and "JIT-compiled from PTX" in text
        # asked for by name, the kernel stays the call's: the executor refuses it at set-up,
        # naming the cause (test_one_launch.py, the sm_120 refusal)
        asked = _plan_traced(
            monkeypatch, lambda a, b: jo.matmul_ar(a, b, "tp", algorithm="one_shot_kernel"),
            (8, 8 * 1024), (8 * 1024, 8192), (P(None, "tp"), P("tp", None)), P())
        assert asked.algorithm == "one_shot_kernel", asked
