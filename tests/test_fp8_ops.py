"""The ops with fp8 operands: exact against the formula, every impl and transport, fp8 on the wire.

The formula (issue 25): an fp8 operand's real value is ``a.astype(float32) * a_scale``; inside
shard_map each rank passes its own shard's scales (here they differ from rank to rank and are
not powers of two), y is the float64 product of the dequantized operands up to one rounding to
the output dtype (and one per add of a reduction in the output dtype), plus float32
accumulation. The lowered StableHLO of the ``xla`` and ``ring`` impls carries fp8
collectives (XLA:CPU may widen them when it compiles; the lowered program keeps the type); the
``native`` impl's custom call receives the fp8 operands and this rank's scales, and its
executor (the host executor here) moves the fp8 shards and their scales on every transport.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_fp8_exact, dequantized, native_calls, put, rand, tp_mesh
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import jaxoverlap as jo

E4, E5 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
BF16, F32, F16 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float16)
X_SCALES = np.array([0.37, 1.9, 0.053, 3.3, 0.71, 1.13, 0.29, 2.6], np.float32)
W_SCALES = np.array([1.7, 0.43, 2.9, 0.61, 1.21, 0.093, 3.7, 0.87], np.float32)

# (impl, x dtype, w dtype, preferred_element_type, N, options): the first of each list runs in
# the quick loop, the rest in `make test`. The native cases (the host executor) cover every
# transport, N 2..8, chunks and both ring directions, every fp8 pairing (e5m2 x e5m2 and fp8
# with a 16- or 32-bit operand included: the host executor runs them, the CUDA executor refuses
# them, docs/gpu-internals.md §6), and ag_matmul with and without the gathered x.
CASES = [
    ("xla", E4, E4, None, 4, {}),
    ("ring", E4, E4, None, 4, dict(chunks=2, bidirectional=True)),
    ("ring", E5, E4, F32, 2, dict(chunks=1, bidirectional=False)),
    ("xla", E4, BF16, F16, 8, {}),
    ("ring", BF16, E4, None, 8, dict(chunks=2, bidirectional=False)),
    ("ring", E4, F32, F32, 4, dict(chunks=1, bidirectional=True)),
    ("native", E4, E4, None, 4, dict(transport="p2p", chunks=2, bidirectional=True)),
    ("native", E5, E4, F32, 2, dict(transport="nccl", return_gathered=False)),
    ("native", E4, BF16, F16, 8, dict(transport="multicast", chunks=2)),
    ("native", BF16, E4, None, 8, dict(transport="nccl", chunks=2, bidirectional=True,
                                       return_gathered=False)),
    ("native", E4, F32, F32, 4, dict(transport="p2p", bidirectional=False)),
    ("native", E4, E5, None, 3, dict(transport="multicast", return_gathered=False)),
    ("native", E5, E5, BF16, 4, dict(transport="nccl", chunks=2, bidirectional=False)),
]


def _ids(case) -> str:
    impl, xd, wd, out, n, opts = case
    extra = "".join(f"-{v}" if k == "transport" else f"-{k}{int(v)}" for k, v in opts.items())
    return f"{impl}-{xd.name}-{wd.name}-{out.name if out else 'default'}-N{n}{extra}"


def _scale_args(a, scales, n: int):
    """The per-rank scales, as an operand split over the ranks (or None: ``a`` is not fp8)."""
    return jnp.asarray(scales[:n]) if jnp.dtype(a.dtype) in (E4, E5) else None


def _sharded(fn, n: int, specs: tuple, out_specs, *args, check_vma: bool = True):
    """``fn(*args)`` in a shard_map over N ranks; None arguments stay out of it (a scale an
    operand that is not fp8 must not get)."""
    given = [i for i, a in enumerate(args) if a is not None]

    def body(*present):
        full = [None] * len(args)
        for i, a in zip(given, present, strict=True):
            full[i] = a
        return fn(*full)

    mapped = jax.shard_map(body, mesh=tp_mesh(n), in_specs=tuple(specs[i] for i in given),
                           out_specs=out_specs, check_vma=check_vma)
    return jax.jit(mapped)(*(args[i] for i in given))


def _per_block(values, n: int, size: int) -> np.ndarray:
    """One scale per element of a dim split in n blocks of ``size``: block r gets values[r]."""
    return np.repeat(values[:n], size).astype(np.float32)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_ag_matmul(case):
    impl, x_dtype, w_dtype, out, n, opts = case
    opts = dict(opts)
    want_gathered = opts.pop("return_gathered", True)
    rows, k, cols = 4, 16, 2                      # per rank: x rows, contraction, w columns
    x = rand(0, (2, n * rows, k), x_dtype, scale=3.0)  # batch-first, split on the sequence (axis 1)
    w = rand(1, (k, n * cols), w_dtype, scale=3.0)
    xs, ws = _scale_args(x, X_SCALES, n), _scale_args(w, W_SCALES, n)

    def f(x, w, xs, ws):
        return jo.ag_matmul(x, w, "tp", axis=1, impl=impl, return_gathered=want_gathered,
                            x_scale=xs, w_scale=ws, preferred_element_type=out, **opts)

    y_spec = P(None, None, "tp")
    out_specs = (y_spec, P()) if want_gathered else y_spec
    y = _sharded(f, n, (P(None, "tp"), P(None, "tp"), P("tp"), P("tp")), out_specs, x, w, xs,
                 ws, check_vma=False)
    y, gathered = y if want_gathered else (y, None)
    # Shard r's rows carry x_scale_r, rank c's columns its w_scale_c.
    xd = dequantized(x, 1.0) * (_per_block(X_SCALES, n, rows)[None, :, None]
                                if xs is not None else 1.0)
    wd = dequantized(w, 1.0) * (_per_block(W_SCALES, n, cols)[None, :]
                                if ws is not None else 1.0)
    assert_fp8_exact(y, xd @ wd, np.abs(xd) @ np.abs(wd), out or BF16, k=k)
    if want_gathered:
        assert gathered.dtype == x.dtype and np.array_equal(np.asarray(gathered, np.float32),
                                                            np.asarray(x, np.float32))


def _reduction_inputs(n: int, x_dtype, w_dtype, rows: int):
    kf, cols = 8, 6                               # per rank: contraction slice, w columns
    x = rand(2, (2, rows, n * kf), x_dtype, scale=3.0)
    w = rand(3, (n * kf, cols), w_dtype, scale=3.0)
    xs, ws = _scale_args(x, X_SCALES, n), _scale_args(w, W_SCALES, n)
    xd = dequantized(x, 1.0) * (_per_block(X_SCALES, n, kf)[None, None, :]
                                if xs is not None else 1.0)
    wd = dequantized(w, 1.0) * (_per_block(W_SCALES, n, kf)[:, None] if ws is not None else 1.0)
    return x, w, xs, ws, xd, wd, kf


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_matmul_rs_and_ar(case):
    impl, x_dtype, w_dtype, out, n, opts = case
    opts = {k: v for k, v in opts.items() if k != "return_gathered"}
    x, w, xs, ws, xd, wd, kf = _reduction_inputs(n, x_dtype, w_dtype, rows=2 * n)
    out_dtype = out or BF16
    # A reduction in a 16-bit output rounds after each add; in float32 its adds are float32's.
    reductions = 0 if out_dtype == F32 else n
    specs = (P(None, None, "tp"), P("tp"), P("tp"), P("tp"))
    for op, out_spec, extra in ((jo.matmul_rs, P(None, "tp"), dict(axis=1)),
                                (jo.matmul_ar, P(), {}),
                                (jo.matmul_ar, P(), dict(algorithm="one_shot"))):
        if impl == "xla" and "algorithm" in extra:
            continue

        def f(x, w, xs, ws, op=op, extra=extra):
            return op(x, w, "tp", impl=impl, x_scale=xs, w_scale=ws,
                      preferred_element_type=out, **extra, **opts)

        y = _sharded(f, n, specs, out_spec, x, w, xs, ws)
        assert_fp8_exact(y, xd @ wd, np.abs(xd) @ np.abs(wd), out_dtype, k=n * kf,
                         reductions=reductions)


@pytest.mark.slow
def test_global_arrays_take_per_tensor_scales():
    """Outside shard_map: Explicit and Auto mesh axes, data parallel on the batch, every op
    and impl; the scales are per-tensor scalars."""
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    x = rand(4, (4, 8, 16), E4, scale=3.0)
    w = rand(5, (16, 8), E4, scale=3.0)
    h = rand(6, (4, 8, 16), E5, scale=3.0)
    xd, wd, hd = dequantized(x, 0.37), dequantized(w, 1.9), dequantized(h, 0.61)
    for types in (AxisType.Explicit, AxisType.Auto):
        mesh = Mesh(devices, ("dp", "tp"), axis_types=(types, types))
        xg, hg = put(x, mesh, P("dp", "tp")), put(h, mesh, P("dp", None, "tp"))
        with jax.set_mesh(mesh):
            y, gathered = jax.jit(lambda x, w: jo.ag_matmul(
                x, w, "tp", axis=1, impl="ring", x_scale=jnp.float32(0.37),
                w_scale=jnp.float32(1.9), return_gathered=True))(xg, put(w, mesh, P(None, "tp")))
            z = jax.jit(lambda h, w: jo.matmul_rs(
                h, w, "tp", axis=1, impl="xla", x_scale=jnp.float32(0.61),
                w_scale=jnp.float32(1.9), preferred_element_type=jnp.float32))(
                    hg, put(w.reshape(16, 8), mesh, P("tp", None)))
            y_native = jax.jit(lambda x, w: jo.ag_matmul(
                x, w, "tp", axis=1, impl="native", transport="p2p", x_scale=jnp.float32(0.37),
                w_scale=jnp.float32(1.9)))(xg, put(w, mesh, P(None, "tp")))
            z_native = jax.jit(lambda h, w: jo.matmul_ar(
                h, w, "tp", impl="native", x_scale=jnp.float32(0.61),
                w_scale=jnp.float32(1.9), preferred_element_type=jnp.float32))(
                    hg, put(w.reshape(16, 8), mesh, P("tp", None)))
        assert tuple(y.sharding.spec)[:3] == ("dp", None, "tp"), y.sharding
        for got in (y, y_native):
            assert_fp8_exact(got, xd @ wd, np.abs(xd) @ np.abs(wd), BF16, k=16)
        assert gathered.dtype == E4
        for got in (z, z_native):
            assert_fp8_exact(got, hd @ wd, np.abs(hd) @ np.abs(wd), F32, k=16)


# ---------------------------------------------------------------- fp8 on the wire


def _collectives(text: str) -> list[tuple[str, str]]:
    """(collective, its result type) of every collective of a lowered StableHLO module."""
    return re.findall(r'"stablehlo\.(all_gather|collective_permute|reduce_scatter|all_reduce)"'
                      r'.*?\)\s*->\s*(tensor<[^>]*>)', text, re.S)


@pytest.mark.parametrize("impl", ["xla", "ring", "native"])
def test_the_lowered_program_moves_fp8(impl):
    """AG+GEMM gathers the fp8 x (its N float32 scales alongside), never a dequantized copy;
    GEMM+RS reduces the bfloat16 partials, never fp8. The native executors receive the fp8 x
    and w themselves, with this rank's float32 scales (and move them: tests/native)."""
    mesh = tp_mesh(4)
    x, w = rand(0, (8, 16), E4, scale=3.0), rand(1, (16, 8), E4, scale=3.0)
    scales = jnp.asarray(X_SCALES[:4])

    def lowered(op, x_spec, w_spec, out_spec):
        fn = jax.jit(jax.shard_map(lambda x, w, s: op(x, w, "tp", impl=impl, x_scale=s,
                                                      w_scale=s), mesh=mesh,
                                   in_specs=(x_spec, w_spec, P("tp")), out_specs=out_spec))
        return fn.lower(x, w, scales).as_text()

    ag = lowered(jo.ag_matmul, P("tp"), P(None, "tp"), P(None, "tp"))
    rs = lowered(jo.matmul_rs, P(None, "tp"), P("tp"), P("tp"))
    if impl == "native":
        assert not _collectives(ag) and not _collectives(rs)
        assert native_calls(ag) == [("ag_matmul", "tensor<2x16xf8E4M3FN>, tensor<16x2xf8E4M3FN>, "
                                      "tensor<f32>, tensor<f32>, tensor<2xi32>",
                                      "tensor<8x2xbf16>")]
        assert native_calls(rs) == [("matmul_rs", "tensor<8x4xf8E4M3FN>, tensor<4x8xf8E4M3FN>, "
                                      "tensor<f32>, tensor<f32>, tensor<2xi32>",
                                      "tensor<2x8xbf16>")]
        return
    moved = _collectives(ag)
    big = [t for _, t in moved if "x16x" in t or t.endswith("x16xf8E4M3FN>")]
    assert big and all("f8E4M3FN" in t for t in big), moved   # x moves as fp8 ...
    assert not any("x16xf32" in t or "x16xbf16" in t for _, t in moved), moved  # ... only
    assert any(t == "tensor<4xf32>" or t == "tensor<f32>" for _, t in moved), moved  # scales
    reduced = _collectives(rs)
    assert reduced and all("bf16" in t for _, t in reduced), reduced


@pytest.mark.slow
def test_bare_ops_with_fp8_are_not_differentiable():
    mesh = tp_mesh(2)
    x, w = rand(0, (4, 8), E4, scale=3.0), rand(1, (8, 4), BF16, scale=3.0)
    scale = jnp.float32(0.5)

    def loss(w):
        y = jax.shard_map(lambda x, w: jo.matmul_ar(x, w, "tp", impl="ring", x_scale=scale),
                          mesh=mesh, in_specs=(P(None, "tp"), P("tp")), out_specs=P())(x, w)
        return jnp.sum(y.astype(jnp.float32))

    assert jax.jit(loss)(w).shape == ()           # the forward runs
    with pytest.raises(TypeError, match=r"jaxoverlap\.fp8\.matmul_ar"):
        jax.jit(jax.grad(loss))(w)
    with pytest.raises(TypeError, match=r"jaxoverlap\.fp8\.ag_matmul"):
        jax.grad(lambda w: jnp.sum(jo.ag_matmul(x, w, "tp", x_scale=scale, mesh=mesh)
                                   .astype(jnp.float32)))(w)
