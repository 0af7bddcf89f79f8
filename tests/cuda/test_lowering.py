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


def test_only_the_calls_that_replay_are_command_buffer_compatible(gpu_lowering, cuda):
    """matmul_ar's kernel algorithms lower to jaxoverlap_cuda_replayable, whose execute
    handler reports XLA FFI's command-buffer trait in its metadata (what XLA reads when it
    decides to capture a custom call); every other program goes to the op's own target, which
    reports none (docs/gpu.md §6)."""
    traits = cuda.handler_traits()
    assert traits["jaxoverlap_cuda_replayable"] & COMMAND_BUFFER_COMPATIBLE
    for op in _kinds.names(_kinds.OPS):
        assert not traits[f"jaxoverlap_cuda_{op}"] & COMMAND_BUFFER_COMPATIBLE, op
    mesh = tp_mesh(4)
    x = jnp.ones((1, 32), jnp.bfloat16)  # a decode step: one row
    w = jnp.ones((32, 8), jnp.bfloat16)
    for algorithm, transport, target in (
            ("one_shot_kernel", "p2p", "jaxoverlap_cuda_replayable"),
            ("two_shot_kernel", "multicast", "jaxoverlap_cuda_replayable"),
            ("one_shot", "p2p", "jaxoverlap_cuda_matmul_ar")):
        text = _lower(jax.shard_map(
            lambda a, b, algorithm=algorithm, transport=transport: jo.matmul_ar(
                a, b, "tp", impl="native", transport=transport, algorithm=algorithm),
            mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P()), x, w)
        calls = [line for line in text.splitlines() if "custom_call @jaxoverlap" in line]
        assert len(calls) == 1 and f"@{target}(" in calls[0], (algorithm, calls)
        ids = _kinds.AR_ALGORITHMS.index(algorithm)
        assert f"algorithm = {ids} : i32" in calls[0], calls[0]


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
