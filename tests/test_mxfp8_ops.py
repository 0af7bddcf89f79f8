"""The ops with block-scaled fp8 operands (MXFP8): exact against a numpy reference, on xla and ring.

MXFP8 (the OCP Microscaling format, v1.0): e4m3 (or e5m2) operands with one e8m0 scale, a power
of two, per 32 consecutive elements of the contraction dim K, laid out as
``jax.nn.scaled_matmul``'s scales: x_scale ``[..., rows, K/32]``, w_scale ``[K/32, N]``. The
reference is written here with numpy alone: the scales are made as raw e8m0 bytes (exponent +
127) and decoded as ``2.0 ** (byte - 127)``, repeated over their 32 elements, multiplied into
the operands in float64, then the product. Inside shard_map each rank passes its own shard's
block scales; AG+GEMM's scales travel with x's rows. On CPU the host executor takes them
(``impl="native"``, every transport and algorithm), exactly; the CUDA executor takes them on
compute capability 10.x in whole 128x4 tiles (refused otherwise, and on Hopper:
tests/cuda/test_lowering.py, tests/cuda/test_fp8.py), and ``impl="auto"`` picks among xla and
ring, as the model prices no native block-scaled call.
"""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_fp8_exact, put, rand, tp_mesh
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import jaxoverlap as jo

E4, E5 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)


def block_scales(key: int, shape) -> tuple[jax.Array, np.ndarray]:
    """Random e8m0 scales 2^-3..2^3 as the ops take them (raw bytes viewed as e8m0), and their
    float64 values decoded from the bytes by the format's rule (2^(byte - 127))."""
    exponents = np.random.default_rng(100 + key).integers(-3, 4, size=shape)
    raw = (exponents + 127).astype(np.uint8)
    return jnp.asarray(raw.view(ml_dtypes.float8_e8m0fnu)), 2.0 ** (raw.astype(np.float64) - 127)


def real(a, scale_values: np.ndarray, k_axis: int) -> np.ndarray:
    """The real value of a block-scaled operand in float64: each scale over its 32 elements."""
    values = np.asarray(a.astype(jnp.float32), np.float64)
    return values * np.repeat(scale_values, 32, axis=k_axis)


def sharded(fn, n: int, in_specs, out_specs, *args, check_vma: bool = True):
    return jax.jit(jax.shard_map(fn, mesh=tp_mesh(n), in_specs=in_specs, out_specs=out_specs,
                                 check_vma=check_vma))(*args)


# (impl, x dtype, w dtype, N, options): the first runs in the quick loop, the rest in make test.
CASES = [
    ("ring", E4, E4, 4, dict(chunks=2, bidirectional=True)),
    ("xla", E4, E4, 4, {}),
    ("ring", E5, E4, 2, dict(chunks=1, bidirectional=False)),
    ("native", E4, E4, 4, dict(transport="p2p", chunks=2, bidirectional=True)),
    ("native", E5, E4, 2, dict(transport="nccl")),
    ("native", E4, E5, 4, dict(transport="multicast", chunks=2)),
]


def _ids(case) -> str:
    impl, xd, wd, n, opts = case
    return f"{impl}-{xd.name}-{wd.name}-N{n}" + "".join(
        f"-{v}" if isinstance(v, str) else f"-{k}{int(v)}" for k, v in opts.items())


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_ag_matmul(case):
    """Two independent calls in flight in one program; each shard's block scales travel with
    its rows, and the gathered x is x's fp8 bytes."""
    impl, x_dtype, w_dtype, n, opts = case
    rows, k, cols = 4, 64, 2                    # per rank: x rows, contraction, w columns
    x = rand(0, (2, n * rows, k), x_dtype, scale=3.0)
    w = rand(1, (k, n * cols), w_dtype, scale=3.0)
    h = rand(2, (2, n * rows, k), x_dtype, scale=3.0)
    xs, xv = block_scales(0, (2, n * rows, k // 32))
    hs, hv = block_scales(1, (2, n * rows, k // 32))
    ws, wv = block_scales(2, (k // 32, n * cols))

    def f(x, h, w, xs, hs, ws):
        y, gathered = jo.ag_matmul(x, w, "tp", axis=1, impl=impl, x_scale=xs, w_scale=ws,
                                   return_gathered=True, preferred_element_type=F32, **opts)
        z = jo.ag_matmul(h, w, "tp", axis=1, impl=impl, x_scale=hs, w_scale=ws, **opts)
        return y, gathered, z

    x_spec, w_spec = P(None, "tp"), P(None, "tp")
    y, gathered, z = sharded(f, n, (x_spec, x_spec, w_spec, x_spec, x_spec, w_spec),
                             (P(None, None, "tp"), P(), P(None, None, "tp")), x, h, w, xs, hs,
                             ws, check_vma=False)
    wd = real(w, wv, 0)
    for got, a, av, out in ((y, x, xv, F32), (z, h, hv, BF16)):
        ad = real(a, av, 2)
        assert_fp8_exact(got, ad @ wd, np.abs(ad) @ np.abs(wd), out, k=k)
    assert gathered.dtype == x.dtype and np.array_equal(np.asarray(gathered, np.float32),
                                                        np.asarray(x, np.float32))


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_matmul_rs_and_ar(case):
    """GEMM+RS and GEMM+AR (two-shot, and one-shot on the ring) in flight in one program; each
    rank's partial is dequantized by its own slice of K's block scales."""
    impl, x_dtype, w_dtype, n, opts = case
    kf, cols, rows = 64, 6, 2 * n               # per rank: K slice (two blocks), w columns
    x = rand(3, (2, rows, n * kf), x_dtype, scale=3.0)
    w = rand(4, (n * kf, cols), w_dtype, scale=3.0)
    xs, xv = block_scales(3, (2, rows, n * kf // 32))
    ws, wv = block_scales(4, (n * kf // 32, cols))

    def f(x, w, xs, ws):
        common = dict(impl=impl, x_scale=xs, w_scale=ws, preferred_element_type=F32, **opts)
        ys = [jo.matmul_rs(x, w, "tp", axis=1, **common), jo.matmul_ar(x, w, "tp", **common)]
        if impl != "xla":
            ys.append(jo.matmul_ar(x, w, "tp", algorithm="one_shot", **common))
        return tuple(ys)

    k_spec = P(None, None, "tp")
    outs = sharded(f, n, (k_spec, P("tp"), k_spec, P("tp")),
                   (P(None, "tp"),) + (P(),) * (1 if impl == "xla" else 2), x, w, xs, ws)
    xd, wd = real(x, xv, 2), real(w, wv, 0)
    for got in outs:
        assert_fp8_exact(got, xd @ wd, np.abs(xd) @ np.abs(wd), F32, k=n * kf)


@pytest.mark.slow
def test_global_arrays():
    """Outside shard_map, under Explicit and Auto mesh axes with data parallel on the batch: the
    block scales are split as their operands (x's rows or K's blocks, w's columns or K's
    blocks); several calls in one jitted program, the AG+GEMM on the host executor too."""
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    k = 128                                       # 32 per rank of tp: one block each for RS/AR
    x, h = rand(5, (4, 8, k), E4, scale=3.0), rand(6, (4, 8, k), E4, scale=3.0)
    w = rand(7, (k, 8), E4, scale=3.0)
    xs, xv = block_scales(5, (4, 8, k // 32))
    hs, hv = block_scales(6, (4, 8, k // 32))
    ws, wv = block_scales(7, (k // 32, 8))
    xd, hd, wd = real(x, xv, 2), real(h, hv, 2), real(w, wv, 0)
    for types in (AxisType.Explicit, AxisType.Auto):
        mesh = Mesh(devices, ("dp", "tp"), axis_types=(types, types))

        def f(x, xs, h, hs, wc, wcs, wr, wrs):
            common = dict(preferred_element_type=F32)
            return (jo.ag_matmul(x, wc, "tp", axis=1, impl="ring", x_scale=xs, w_scale=wcs,
                                 **common),
                    jo.matmul_rs(h, wr, "tp", axis=1, impl="xla", x_scale=hs, w_scale=wrs,
                                 **common),
                    jo.matmul_ar(h, wr, "tp", impl="ring", x_scale=hs, w_scale=wrs, **common),
                    jo.ag_matmul(x, wc, "tp", axis=1, impl="native", x_scale=xs, w_scale=wcs,
                                 **common))

        rows, feats = P("dp", "tp"), P("dp", None, "tp")
        with jax.set_mesh(mesh):
            y, z, a, yn = jax.jit(f)(put(x, mesh, rows), put(xs, mesh, rows), put(h, mesh, feats),
                                 put(hs, mesh, feats), put(w, mesh, P(None, "tp")),
                                 put(ws, mesh, P(None, "tp")), put(w, mesh, P("tp", None)),
                                 put(ws, mesh, P("tp", None)))
        for got in (y, yn):
            assert_fp8_exact(got, xd @ wd, np.abs(xd) @ np.abs(wd), F32, k=k)
        for got in (z, a):
            assert_fp8_exact(got, hd @ wd, np.abs(hd) @ np.abs(wd), F32, k=k)


# ---------------------------------------------------------------- the host executor, exactly


def _integers(key: int, shape, dtype) -> jax.Array:
    """fp8 values that are small integers (|v| <= 8): with scales 2^0..2^2 every product and
    every partial sum of a GEMM with K <= 128 is an integer below 2^24, exact in float32 in
    any order, so the dequantize-then-multiply reference has one answer, bit for bit."""
    values = np.random.default_rng(200 + key).integers(-8, 9, size=shape).astype(np.float32)
    return jnp.asarray(values).astype(dtype)


def _small_scales(key: int, shape) -> tuple[jax.Array, np.ndarray]:
    raw = (np.random.default_rng(300 + key).integers(0, 3, size=shape) + 127).astype(np.uint8)
    return jnp.asarray(raw.view(ml_dtypes.float8_e8m0fnu)), 2.0 ** (raw.astype(np.float64) - 127)


def _late(x, seconds: tuple[float, ...]):
    """Exactly ``x``, after a host callback sleeping ``seconds[rank]`` on the rank's thread:
    the ranks reach the calls that follow at uneven speeds."""
    import time

    def nap(value, r):
        time.sleep(seconds[int(r)])
        return value

    return jax.pure_callback(nap, jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                             jax.lax.axis_index("tp"))


@pytest.mark.parametrize("transport", ["p2p", "nccl", "multicast"])
def test_native_calls_equal_the_reference_exactly(transport):
    """The host executor (impl="native"): AG+GEMM (chunked, bidirectional, the gathered x
    returned), GEMM+RS, and GEMM+AR with every algorithm the transport runs, all in flight in
    one program, the ranks reaching them at uneven speeds (a different rank late each run):
    each y is the numpy dequantize-then-multiply reference, bit for bit."""
    n, rows, k, cols = 4, 4, 64, 2
    x = _integers(0, (2, n * rows, k), E4)
    w = _integers(1, (k, n * cols), E5)
    xs, xv = _small_scales(0, (2, n * rows, k // 32))
    ws, wv = _small_scales(1, (k // 32, n * cols))
    xk = _integers(2, (2, 2 * n, n * k), E4)                  # RS / AR: K split over the ranks
    wk = _integers(3, (n * k, cols), E4)
    xks, xkv = _small_scales(2, (2, 2 * n, n * k // 32))
    wks, wkv = _small_scales(3, (n * k // 32, cols))
    algorithms = ["two_shot", "one_shot"] + (
        ["one_shot_kernel", "two_shot_kernel"] if transport != "nccl" else [])

    def program(seconds):
        def f(x, w, xs, ws, xk, wk, xks, wks):
            x, xk = _late(x, seconds), _late(xk, seconds)
            common = dict(impl="native", transport=transport)
            y, gathered = jo.ag_matmul(x, w, "tp", axis=1, x_scale=xs, w_scale=ws, chunks=2,
                                       bidirectional=True, return_gathered=True,
                                       preferred_element_type=F32, **common)
            z = jo.matmul_rs(xk, wk, "tp", axis=1, x_scale=xks, w_scale=wks, chunks=2,
                             preferred_element_type=F32, **common)
            ars = [jo.matmul_ar(xk, wk, "tp", x_scale=xks, w_scale=wks, algorithm=a,
                                preferred_element_type=F32, **common) for a in algorithms]
            return y, gathered, z, *ars

        rows_spec, k_spec = P(None, "tp"), P(None, None, "tp")
        return jax.jit(jax.shard_map(
            f, mesh=tp_mesh(n), check_vma=False,
            in_specs=(rows_spec, P(None, "tp"), rows_spec, P(None, "tp"), k_spec, P("tp"),
                      k_spec, P("tp")),
            out_specs=(P(None, None, "tp"), P(), P(None, "tp")) + (P(),) * len(algorithms)))

    want_y = real(x, xv, 2) @ real(w, wv, 0)
    want_k = real(xk, xkv, 2) @ real(wk, wkv, 0)
    for late in range(2):
        seconds = tuple(0.03 if r == late else 0.002 * r for r in range(n))
        y, gathered, z, *ars = program(seconds)(x, w, xs, ws, xk, wk, xks, wks)
        np.testing.assert_array_equal(np.asarray(y, np.float64), want_y)
        assert gathered.dtype == x.dtype
        np.testing.assert_array_equal(np.asarray(gathered, np.float32), np.asarray(x, np.float32))
        np.testing.assert_array_equal(np.asarray(z, np.float64), want_k)
        for a, got in zip(algorithms, ars, strict=True):
            np.testing.assert_array_equal(np.asarray(got, np.float64), want_k, err_msg=a)


# ---------------------------------------------------------------- on the wire


def _permuted(text: str) -> list[str]:
    return re.findall(r'"stablehlo\.collective_permute".*?\)\s*->\s*(tensor<[^>]*>)', text, re.S)


def test_ring_moves_fp8_rows_with_their_e8m0_scales():
    """The lowered ring AG+GEMM permutes x's fp8 pieces and their e8m0 block scales, never a
    dequantized copy."""
    x, w = rand(0, (8, 64), E4, scale=3.0), rand(1, (64, 8), E4, scale=3.0)
    xs, _ = block_scales(0, (8, 2))
    ws, _ = block_scales(1, (2, 8))
    fn = jax.jit(jax.shard_map(
        lambda x, w, xs, ws: jo.ag_matmul(x, w, "tp", impl="ring", x_scale=xs, w_scale=ws),
        mesh=tp_mesh(4), in_specs=(P("tp"), P(None, "tp"), P("tp"), P(None, "tp")),
        out_specs=P(None, "tp")))
    moved = _permuted(fn.lower(x, w, xs, ws).as_text())
    assert sorted(set(moved)) == ["tensor<2x2xf8E8M0FNU>", "tensor<2x64xf8E4M3FN>"], moved


# ---------------------------------------------------------------- misuse and the native path


def _call(op=jo.ag_matmul, x=None, w=None, **kwargs):
    x = rand(0, (4, 64), E4) if x is None else x
    w = rand(1, (64, 8), E4) if w is None else w
    kwargs.setdefault("x_scale", block_scales(0, (4, 2))[0])
    kwargs.setdefault("w_scale", block_scales(1, (2, 8))[0])
    fn = jax.shard_map(lambda x, w: op(x, w, "tp", **kwargs), mesh=tp_mesh(2),
                       in_specs=(P(), P()), out_specs=P(), check_vma=False)
    return jax.jit(fn).lower(x, w)


E8 = jnp.float8_e8m0fnu


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(x_scale=jnp.ones((4, 2), jnp.float16)), TypeError,
     r"x_scale\.dtype=float16 must be float8_e8m0fnu .* or float32"),
    (dict(x_scale=jnp.ones((4, 2), jnp.float16), w_scale=jnp.ones((2, 8), jnp.float16)),
     TypeError, r"x_scale\.dtype=float16 must be float32 .* or float8_e8m0fnu"),
    (dict(w_scale=jnp.ones((2, 4), E8)), ValueError,
     r"w_scale has shape \(2, 4\) but block scales of w \(64, 8\) must have shape \(2, 8\)"),
    (dict(x_scale=jnp.ones((4, 64), E8)), ValueError,
     r"x_scale has shape \(4, 64\) .* must have shape \(4, 2\)"),
    (dict(x=rand(0, (4, 48), E4), w=rand(1, (48, 8), E4), x_scale=jnp.ones((4, 1), E8),
          w_scale=jnp.ones((1, 8), E8)), ValueError,
     r"x\.shape\[-1\]=48 is not a multiple of 32\. Pad K"),
    (dict(w=rand(1, (64, 8), BF16)), TypeError,
     r"block scales .* dequantize fp8 operands only, but w is bfloat16"),
    (dict(w_scale=jnp.float32(1.0)), TypeError,
     r"w_scale is float32: block and per-tensor scales do not mix"),
    (dict(w_scale=None), TypeError, r"w_scale is missing: block and per-tensor"),
])
@pytest.mark.parametrize("impl", ["auto", "native"])
def test_misuse_is_a_clear_error(kwargs, error, match, impl):
    """The ops check block scales before any impl is picked: the native path (the host
    executor) refuses misshapen ones with the same errors as the others."""
    with pytest.raises(error, match=match):
        _call(impl=impl, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(impl="native"), r"impl='native' .* block scales .* VEC32_UE8M0 mode, on compute "
     r"capability 10.x only .* Use impl='ring' or impl='xla'"),
    (dict(transport="p2p"), r"transport='p2p' asks for the native"),
])
def test_the_cuda_executor_is_not_asked_for_block_scales(monkeypatch, kwargs, match):
    """On a GPU the native path is the CUDA executor, whose block-scaled GEMMs need compute
    capability 10.x (none known here): asking for it is a clear error before lowering.
    (No GPU here: the plan is made for a traced GPU platform.)"""
    from jaxoverlap._executors import capabilities

    monkeypatch.setattr(capabilities, "current_platform", lambda: "cuda")
    with pytest.raises(jo.NativeUnavailableError, match=match):
        _call(**kwargs)


def test_auto_leaves_the_native_path_out(monkeypatch, caplog):
    """Where the h100 preset's model picks the native path for per-tensor fp8 (GEMM+RS, 8192³
    over 8 ranks), block scales make it pick among xla and ring (the model prices no native
    block-scaled GEMM), saying why in the debug log, where the model says it priced their
    dequantize-then-multiply; fused=True is an error naming why no fused GEMM takes them."""
    monkeypatch.setenv("JAXOVERLAP_PRESET", "h100")
    monkeypatch.setenv("JAXOVERLAP_LOG", "debug")
    m = k = 8192
    shapes = (jax.ShapeDtypeStruct((m, k), E4), jax.ShapeDtypeStruct((k, k), E4))
    blocks = (jax.ShapeDtypeStruct((m, k // 32), E8), jax.ShapeDtypeStruct((k // 32, k), E8))
    tensor = (jax.ShapeDtypeStruct((), F32),) * 2

    def lowered(op, scales):
        fn = jax.shard_map(lambda x, w, xs, ws: op(x, w, "tp", x_scale=xs, w_scale=ws),
                           mesh=tp_mesh(8), in_specs=(P(),) * 4, out_specs=P(),
                           check_vma=False)
        return jax.jit(fn).lower(*shapes, *scales).as_text()

    for op in (jo.matmul_rs,):  # (one op: the rule is the plan's, the same for every op)
        assert "custom_call @jaxoverlap_" in lowered(op, tensor)   # per tensor: native
        with caplog.at_level(logging.DEBUG, logger="jaxoverlap"):
            assert "custom_call @jaxoverlap_" not in lowered(op, blocks)
        assert any(op.__name__ in r.message and "prices no native block-scaled GEMM"
                   in r.message for r in caplog.records)
        # the model is told: it prices the xla and ring GEMMs as they dequantize (float32)
        assert any("dequantizes its operands and multiplies in float32" in r.message
                   for r in caplog.records)
    x, w = rand(0, (64, 64), E4), rand(1, (64, 64), E4)
    with jo.config(fused=True), pytest.raises(jo.NativeUnavailableError,
                                              match="fused=True.*16-bit and per-tensor FP8"):
        _call(jo.matmul_rs, x, w, x_scale=jnp.ones((64, 2), E8), w_scale=jnp.ones((2, 64), E8))


@pytest.mark.slow
def test_global_k_split_into_whole_blocks():
    mesh = tp_mesh(4)
    x, w = rand(0, (8, 64), E4), rand(1, (64, 8), E4)
    with pytest.raises(ValueError, match=r"whole blocks of 32 .* multiple of 128"):
        jo.matmul_rs(x, w, "tp", mesh=mesh, x_scale=jnp.ones((8, 2), E8),
                     w_scale=jnp.ones((2, 8), E8))


@pytest.mark.slow
def test_not_differentiable_as_per_tensor_fp8():
    """As with per-tensor scales: the forward runs, jax.grad raises naming jaxoverlap.fp8."""
    x, w = rand(0, (4, 64), E4), rand(1, (64, 8), BF16)
    xs, ws = jnp.ones((4, 2), E8), jnp.ones((2, 8), E8)

    def loss(w):
        y = jax.shard_map(lambda x, w: jo.matmul_ar(x, w.astype(E4), "tp", impl="ring",
                                                     x_scale=xs, w_scale=ws),
                          mesh=tp_mesh(2), in_specs=(P(), P()), out_specs=P(),
                          check_vma=False)(x, w)
        return jnp.sum(y.astype(jnp.float32))

    assert jax.jit(loss)(w).shape == ()
    with pytest.raises(TypeError, match=r"jaxoverlap\.fp8\.matmul_ar"):
        jax.jit(jax.grad(loss))(w)
