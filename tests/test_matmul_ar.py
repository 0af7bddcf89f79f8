"""jo.matmul_ar: GEMM + all-reduce, against psum(x @ w) — forward, types, autodiff, global
arrays, validation and config, as the other two ops are tested."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, dp_tp_mesh, f64, put, rand, spec_on, tp_mesh
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxoverlap as jo
from jaxoverlap import _kinds

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
NS = [1, 2, 4, 8]
# (impl, transport): every implementation, the native one on each transport.
IMPLS = [("xla", None), ("ring", None), ("native", "nccl"), ("native", "p2p"),
         ("native", "multicast")]
IMPL_IDS = ["xla", "ring", *_kinds.names(_kinds.TRANSPORTS)]


def _run(x, w, n, check_vma=True, **kw):
    """matmul_ar inside shard_map over 'tp' (x on its last dim, w on dim 0), y replicated."""
    fn = jax.jit(jax.shard_map(lambda x, w: jo.matmul_ar(x, w, "tp", **kw), mesh=tp_mesh(n),
                               in_specs=(spec_on(x.ndim, -1), P("tp", None)), out_specs=P(),
                               check_vma=check_vma))
    return fn(x, w)


def _case(n, dtype, rows=(2, 4), kf=4, nw=6, seed=0):
    x = rand(seed, (*rows, kf * n), dtype)
    w = rand(seed + 1, (kf * n, nw), dtype)
    return x, w


def _options(impl, transport):
    """The plans a fused impl is run with: one chunk one way, two chunks both ways."""
    if impl == "xla":
        return [{}]
    extra = {"transport": transport} if transport else {}
    return [dict(chunks=1, bidirectional=False, **extra),
            dict(chunks=2, bidirectional=True, **extra)]


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize("impl,transport", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_matches_psum_of_the_product(impl, transport, n, dtype):
    x, w = _case(n, dtype, rows=(2, 2 * n))
    for kw in _options(impl, transport):
        y = _run(x, w, n, impl=impl, **kw)
        assert y.dtype == dtype and y.shape == (2, 2 * n, 6), kw
        assert_close(y, f64(x) @ f64(w), dtype)


@pytest.mark.parametrize("impl,transport", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("rows", [(16,), (2, 8), (8, 2), (2, 2, 4)],
                         ids=["2d", "batch_first", "seq_first", "4d"])
def test_every_rank_of_x(impl, transport, rows):
    """Every dim of x but the last is a row, whatever x's rank."""
    n = 4
    x, w = _case(n, jnp.float32, rows=rows, seed=3)
    for kw in _options(impl, transport):
        assert_close(_run(x, w, n, impl=impl, **kw), f64(x) @ f64(w), jnp.float32)


@pytest.mark.parametrize("impl,transport", IMPLS[1:], ids=IMPL_IDS[1:])
def test_every_rank_holds_the_same_bits(impl, transport):
    """The result is replicated for real (what its invariant type claims): every rank's copy
    of y is bitwise the same."""
    n = 4
    x, w = _case(n, jnp.bfloat16, rows=(2, 8), seed=5)
    extra = {"transport": transport} if transport else {}
    fn = jax.jit(jax.shard_map(
        lambda x, w: jo.matmul_ar(x, w, "tp", impl=impl, chunks=2, bidirectional=True,
                                  **extra)[None],
        mesh=tp_mesh(n), in_specs=(spec_on(3, -1), P("tp", None)), out_specs=P("tp"),
        check_vma=False))
    copies = np.asarray(fn(x, w).astype(jnp.float32))
    assert copies.shape == (n, 2, 8, 6)
    for r in range(1, n):
        np.testing.assert_array_equal(copies[r], copies[0])


@pytest.mark.parametrize("impl,transport", IMPLS, ids=IMPL_IDS)
def test_result_is_typed_invariant_over_the_axis(impl, transport):
    """As psum's: out_specs=P() passes check_vma=True, and the type keeps the other axes."""
    mesh = dp_tp_mesh()
    x = rand(7, (4, 4, 8), jnp.float32)
    w = rand(8, (8, 6), jnp.float32)
    extra = {"transport": transport} if transport else {}
    seen = []

    def body(x, w):
        y = jo.matmul_ar(x, w, "tp", impl=impl, **extra)
        seen.append(jax.typeof(y))
        return y

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("dp", None, "tp"), P("tp", None)),
                               out_specs=P("dp")))
    assert_close(fn(x, w), f64(x) @ f64(w), jnp.float32)
    from jaxoverlap._compat import varying_axes

    assert varying_axes(seen[0]) == {"dp"}


def test_one_row_block_per_rank_at_the_smallest():
    """Rows equal to N: one row per rank's block (and chunks clamp to it)."""
    n = 4
    x, w = _case(n, jnp.float32, rows=(4,), seed=9)
    for impl, transport in IMPLS[1:]:
        extra = {"transport": transport} if transport else {}
        y = _run(x, w, n, impl=impl, bidirectional=True, **extra)
        assert_close(y, f64(x) @ f64(w), jnp.float32)


# ---------------------------------------------------------------- autodiff


def _reference_loss(n, dp=False):
    """sum((psum(x @ w)) ** 2) in plain JAX (dot + psum, differentiated by JAX)."""
    return _loss(n, lambda x, w: lax.psum(x @ w, "tp"), dp=dp)


def _loss(n, op, dp=False, check_vma=True):
    if dp:
        mesh = dp_tp_mesh()
        specs, out = (P("dp", None, "tp"), P("tp", None)), P("dp")
    else:
        mesh = tp_mesh(n)
        specs, out = (P(None, None, "tp"), P("tp", None)), P()
    fn = jax.shard_map(op, mesh=mesh, in_specs=specs, out_specs=out, check_vma=check_vma)
    return lambda x, w: jnp.sum(jnp.tanh(fn(x, w).astype(jnp.float32)) ** 2)


@pytest.mark.parametrize("impl,transport", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
@pytest.mark.parametrize("dp", [False, True], ids=["tp", "dp_tp"])
def test_grads_match_jax_grad_of_dot_plus_psum(impl, transport, check_vma, dp):
    """dx = dy @ wᵀ, dw = xᵀ·dy through the replicated cotangent, under both check_vma
    settings; with a data-parallel axis the replicated w gets the sum of its parts."""
    n = 4
    x = rand(11, (4, 4, 8), jnp.float32)
    w = rand(12, (8, 6), jnp.float32) * 0.5
    extra = {"transport": transport} if transport else {}
    ours = _loss(n, lambda x, w: jo.matmul_ar(x, w, "tp", impl=impl, chunks=2, **extra),
                 dp=dp, check_vma=check_vma)
    got = jax.jit(jax.grad(ours, argnums=(0, 1)))(x, w)
    want = jax.jit(jax.grad(_reference_loss(n, dp), argnums=(0, 1)))(x, w)
    for g, e, p in zip(got, want, (x, w), strict=True):
        assert g.shape == p.shape and g.dtype == p.dtype
        assert_close(g, f64(e), jnp.float32)
    # and against float64 NumPy
    xf, wf = f64(x), f64(w)
    y = xf @ wf
    dy = 2 * np.tanh(y) * (1 - np.tanh(y) ** 2)
    assert_close(got[0], dy @ wf.T, jnp.float32)
    assert_close(got[1], np.einsum("bsk,bsn->kn", xf, dy), jnp.float32)


@pytest.mark.parametrize("impl,transport", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
def test_megatron_mlp_grads(impl, transport, check_vma):
    """The f/g pair: a replicated x, a column GEMM on its shard, gelu, then GEMM+AR (what
    RowParallelDense(sequence_parallel=False) runs); gradients of x, w1, w2 against float64."""
    n = 4
    x = rand(13, (2, 8, 8), jnp.float32)
    w1 = rand(14, (8, 16), jnp.float32) * 0.4
    w2 = rand(15, (16, 8), jnp.float32) * 0.4
    extra = {"transport": transport} if transport else {}

    def block(x, w1, w2):
        if check_vma:
            x = lax.pcast(x, ("tp",), to="varying")   # Megatron f
        h = jnp.tanh(x @ w1)
        return jo.matmul_ar(h, w2, "tp", impl=impl, bidirectional=True, **extra)

    fn = jax.shard_map(block, mesh=tp_mesh(n), in_specs=(P(), P(None, "tp"), P("tp", None)),
                       out_specs=P(), check_vma=check_vma)
    loss = lambda x, w1, w2: jnp.sum(fn(x, w1, w2) ** 2)
    dx, dw1, dw2 = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w1, w2)
    xf, w1f, w2f = f64(x), f64(w1), f64(w2)
    h = np.tanh(xf @ w1f)
    dy = 2 * (h @ w2f)
    dh = dy @ w2f.T * (1 - h**2)
    assert_close(dw2, np.einsum("bsf,bsn->fn", h, dy), jnp.float32)
    assert_close(dw1, np.einsum("bsh,bsf->hf", xf, dh), jnp.float32)
    assert_close(dx, dh @ w1f.T, jnp.float32)


@pytest.mark.slow
@pytest.mark.parametrize("impl,transport", [("ring", None), ("native", "p2p")])
def test_grads_under_checkpoint_and_two_calls_in_flight(impl, transport):
    """Two independent GEMM+AR calls in one program, forward and backward, under remat."""
    n = 4
    x = rand(16, (2, 4, 8), jnp.float32)
    w1 = rand(17, (8, 6), jnp.float32)
    w2 = rand(18, (8, 6), jnp.float32)
    extra = {"transport": transport} if transport else {}

    def two(x, w1, w2):
        return (jo.matmul_ar(x, w1, "tp", impl=impl, **extra)
                * jo.matmul_ar(x, w2, "tp", impl=impl, chunks=2, **extra))

    def loss_of(body):
        fn = jax.shard_map(body, mesh=tp_mesh(n),
                           in_specs=(P(None, None, "tp"), P("tp", None), P("tp", None)),
                           out_specs=P())
        return lambda *a: jnp.sum(fn(*a) ** 2)

    got = jax.jit(jax.grad(loss_of(jax.checkpoint(two)), argnums=(0, 1, 2)))(x, w1, w2)
    ref = jax.grad(loss_of(lambda x, w1, w2: lax.psum(x @ w1, "tp") * lax.psum(x @ w2, "tp")),
                   argnums=(0, 1, 2))(x, w1, w2)
    for g, e in zip(got, ref, strict=True):
        assert_close(g, f64(e), jnp.float32)


# ---------------------------------------------------------------- global arrays


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("impl,transport", IMPLS, ids=IMPL_IDS)
def test_global_arrays(kind, impl, transport):
    axis_type = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    mesh = dp_tp_mesh(axis_type)
    x = put(rand(20, (4, 8, 12), jnp.float32), mesh, P("dp", None, "tp"))
    w = put(rand(21, (12, 6), jnp.float32), mesh, P("tp", None))
    extra = {"transport": transport} if transport else {}
    f = jax.jit(lambda x, w: jo.matmul_ar(x, w, "tp", impl=impl, mesh=mesh, **extra))
    y = f(x, w)
    assert y.shape == (4, 8, 6)
    assert_close(y, f64(x) @ f64(w), jnp.float32)
    if kind == "explicit":  # dp passes through; y is replicated over tp
        assert y.sharding.spec == P("dp", None, None)
    dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) ** 2), argnums=(0, 1)))(x, w)
    y64 = f64(x) @ f64(w)
    assert_close(dx, 2 * y64 @ f64(w).T, jnp.float32)
    assert_close(dw, np.einsum("bsk,bsn->kn", f64(x), 2 * y64), jnp.float32)


@pytest.mark.slow
def test_global_mesh_from_set_mesh_and_from_inputs():
    mesh = dp_tp_mesh(AxisType.Explicit)
    x = put(rand(22, (8, 8), jnp.float32), mesh, P(None, "tp"))
    w = put(rand(23, (8, 4), jnp.float32), mesh, P("tp", None))
    with jax.set_mesh(mesh):
        y = jax.jit(lambda x, w: jo.matmul_ar(x, w, "tp", impl="ring"))(x, w)
    assert_close(y, f64(x) @ f64(w), jnp.float32)
    assert_close(jo.matmul_ar(x, w, "tp", impl="ring"), f64(x) @ f64(w), jnp.float32)  # eager


# ---------------------------------------------------------------- plan, config, HLO


def _hlo(impl, **kw):
    x, w = _case(4, jnp.float32, rows=(8,))
    fn = jax.jit(jax.shard_map(lambda x, w: jo.matmul_ar(x, w, "tp", impl=impl, **kw),
                               mesh=tp_mesh(4), in_specs=(P(None, "tp"), P("tp", None)),
                               out_specs=P()))
    return fn.lower(x, w).compile().as_text()


@pytest.mark.parametrize("bidirectional", [False, True])
def test_ring_lowers_to_collective_permutes_only(bidirectional):
    text = _hlo("ring", chunks=2, bidirectional=bidirectional)
    assert "collective-permute" in text
    for collective in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all"):
        assert collective not in text


def test_xla_is_an_all_reduce_and_native_a_custom_call():
    text = _hlo("xla")
    assert "all-reduce" in text and "collective-permute" not in text
    text = _hlo("native", transport="p2p")
    assert "jaxoverlap_matmul_ar" in text and "all-reduce" not in text


def test_config_and_environment_pick_the_impl(monkeypatch):
    with jo.config(impl="ring"):
        assert "collective-permute" in _hlo("auto")
    monkeypatch.setenv("JAXOVERLAP_IMPL", "native")
    assert "jaxoverlap_matmul_ar" in _hlo("auto")
    assert "all-reduce" in _hlo("xla")                      # the argument wins
    monkeypatch.setenv("JAXOVERLAP_CHUNKS", "3")
    with pytest.raises(ValueError, match=r"chunks \(from jo.config / JAXOVERLAP_CHUNKS\)=3 "
                                         "does not divide the 2 rows of each rank's block"):
        _hlo("auto")


def test_auto_on_cpu_is_the_unfused_path():
    assert "all-reduce" in _hlo("auto")


# ---------------------------------------------------------------- misuse


def _inside(fn, x, w, n=4):
    f = jax.jit(jax.shard_map(fn, mesh=tp_mesh(n), in_specs=(spec_on(x.ndim, -1), P("tp", None)),
                              out_specs=P(), check_vma=False))
    return f(x, w)


X = rand(30, (8, 16), jnp.float32)
W = rand(31, (16, 4), jnp.float32)


def test_rows_that_do_not_split_into_n_blocks():
    x = rand(32, (3, 2, 16), jnp.float32)   # 6 rows, 4 ranks
    # every impl takes any number of rows: the fused ones run one-shot ...
    assert_close(_run(x, W, 4), f64(x) @ f64(W), jnp.float32)
    assert_close(_run(x, W, 4, impl="xla", chunks=3), f64(x) @ f64(W), jnp.float32)
    for kw in (dict(impl="ring"), dict(impl="native"), dict(transport="p2p"),
               dict(impl="native", chunks=3)):
        assert_close(_run(x, W, 4, **kw), f64(x) @ f64(W), jnp.float32)
    # ... two-shot asked for names the shape and the fix
    with pytest.raises(ValueError, match=r"algorithm='two_shot' splits the rows of x \(every dim "
                                         r"but the last: 6 for shape \(3, 2, 4\)\) into one block "
                                         r"per rank of 'tp' \(4\).*algorithm='one_shot'"):
        _run(x, W, 4, impl="ring", algorithm="two_shot")
    with pytest.raises(ValueError, match=r"chunks=4 does not divide the 6 rows of x \(every dim "
                                         r"but the last; one-shot"):
        _run(x, W, 4, impl="native", chunks=4)


def test_chunks_must_divide_each_ranks_block():
    with pytest.raises(ValueError, match=r"chunks=3 does not divide the 2 rows of each rank's "
                                         r"block \(x's 8 rows, every dim but the last, over the "
                                         r"4 ranks of 'tp'\)"):
        _run(X, W, 4, impl="ring", chunks=3)
    with pytest.raises(ValueError, match="chunks=0 must be a positive int"):
        _run(X, W, 4, impl="ring", chunks=0)


def test_operand_errors_name_the_argument():
    mesh = tp_mesh(4)
    with pytest.raises(ValueError, match=r"contraction dims differ: x.shape\[-1\]=16 but "
                                         r"w.shape\[0\]=5"):
        jo.matmul_ar(X, rand(33, (5, 4), jnp.float32), "tp", mesh=mesh)
    with pytest.raises(ValueError, match="x must have rank >= 2"):
        jo.matmul_ar(jnp.ones((16,)), W, "tp", mesh=mesh)
    with pytest.raises(ValueError, match="w must have rank 2"):
        jo.matmul_ar(X, jnp.ones((16, 4, 1)), "tp", mesh=mesh)
    with pytest.raises(TypeError, match="x must be an array, got list"):
        jo.matmul_ar([[1.0]], W, "tp", mesh=mesh)
    with pytest.raises(TypeError, match="x.dtype=int32 is not supported; use float32"):
        jo.matmul_ar(X.astype(jnp.int32), W.astype(jnp.int32), "tp", mesh=mesh)
    with pytest.raises(TypeError, match="x.dtype=float32 and w.dtype=bfloat16 differ"):
        jo.matmul_ar(X, W.astype(jnp.bfloat16), "tp", mesh=mesh)
    with pytest.raises(ValueError, match=r"x.shape\[-1\] has 6 contraction features, not "
                                         r"divisible by the size 4"):
        jo.matmul_ar(rand(34, (8, 6), jnp.float32), rand(35, (6, 4), jnp.float32), "tp",
                     mesh=mesh)


def test_argument_errors_name_the_argument():
    mesh = tp_mesh(4)
    with pytest.raises(ValueError, match="impl='fast' is not an implementation"):
        jo.matmul_ar(X, W, "tp", impl="fast", mesh=mesh)
    with pytest.raises(ValueError, match="transport='nvlink' is not a transport"):
        jo.matmul_ar(X, W, "tp", transport="nvlink", mesh=mesh)
    with pytest.raises(ValueError, match="transport='p2p' applies to impl='native' only"):
        jo.matmul_ar(X, W, "tp", impl="ring", transport="p2p", mesh=mesh)
    with pytest.raises(TypeError, match="bidirectional='yes' must be True, False or None"):
        jo.matmul_ar(X, W, "tp", impl="ring", bidirectional="yes", mesh=mesh)
    with pytest.raises(TypeError, match="mesh=.* must be a jax.sharding.Mesh"):
        jo.matmul_ar(X, W, "tp", mesh="tp")
    with pytest.raises(TypeError, match="must be a single mesh axis name"):
        jo.matmul_ar(X, W, ("dp", "tp"), mesh=mesh)
    with pytest.raises(TypeError, match=r"axis_name=3 must be a mesh axis name \(a str"):
        jo.matmul_ar(X, W, 3, mesh=mesh)
    with pytest.raises(ValueError, match="axis_name 'model' is not an axis of the mesh"):
        jo.matmul_ar(X, W, "model", mesh=mesh)
    with pytest.raises(ValueError, match="axis_name 'model' is not an axis of the mesh"):
        _inside(lambda x, w: jo.matmul_ar(x, w, "model"), X, W)
    with pytest.raises(ValueError, match="no mesh is known.*mesh="):
        jo.matmul_ar(np.ones((8, 16), np.float32), np.ones((16, 4), np.float32), "tp")
    with pytest.raises(TypeError, match="axis"):
        jo.matmul_ar(X, W, "tp", axis=0, mesh=mesh)  # no axis: every dim but the last is a row
    with pytest.raises(ValueError, match=r"algorithm='three_shot' is not a GEMM \+ all-reduce "
                                         r"algorithm; use one of \('auto', 'one_shot', "
                                         r"'one_shot_kernel', 'two_shot', 'two_shot_kernel'\)"):
        jo.matmul_ar(X, W, "tp", algorithm="three_shot", mesh=mesh)
    with pytest.raises(ValueError, match=r"algorithm='one_shot' applies to the fused impls "
                                         r"\('ring', 'native'\), but impl='xla'"):
        jo.matmul_ar(X, W, "tp", impl="xla", algorithm="one_shot", mesh=mesh)


def test_native_request_is_never_silently_replaced(monkeypatch):
    from jaxoverlap._executors import runtime

    monkeypatch.setattr(runtime, "host_error", lambda: "no native extension here")
    with pytest.raises(jo.NativeUnavailableError, match="impl='native' was requested.*no native"):
        jo.matmul_ar(X, W, "tp", impl="native", mesh=tp_mesh(4))


# ---------------------------------------------------------------- one-shot


@pytest.mark.parametrize("impl,transport", IMPLS[1:], ids=IMPL_IDS[1:])
def test_one_shot_matches_psum_on_every_rank_bit_for_bit(impl, transport):
    """algorithm='one_shot': N 2..8, rows that split into N blocks and rows that do not (a
    decode step: one row), sub-chunks; every rank's y is the same bits."""
    extra = {"transport": transport} if transport else {}
    for n, rows, dtype, chunks in ((2, (1,), jnp.float32, 1), (3, (2, 3), jnp.bfloat16, 3),
                                   (5, (1, 1), jnp.float16, 1), (8, (1,), jnp.float32, 1),
                                   (8, (2, 8), jnp.bfloat16, 2)):
        x, w = _case(n, dtype, rows=rows, seed=n)
        fn = jax.jit(jax.shard_map(
            lambda x, w, chunks=chunks: jo.matmul_ar(x, w, "tp", impl=impl, chunks=chunks,
                                                     algorithm="one_shot", **extra)[None],
            mesh=tp_mesh(n), in_specs=(spec_on(x.ndim, -1), P("tp", None)), out_specs=P("tp"),
            check_vma=False))
        copies = np.asarray(fn(x, w).astype(jnp.float32))
        for r in range(n):
            np.testing.assert_array_equal(copies[r], copies[0], err_msg=f"N={n} rank {r}")
        assert_close(copies[0].astype(dtype), f64(x) @ f64(w), dtype)


@pytest.mark.slow
@pytest.mark.parametrize("impl,transport", [("ring", None), ("native", "nccl"),
                                            ("native", "p2p"), ("native", "multicast")])
def test_one_shot_grads_and_calls_in_flight(impl, transport):
    """A decode-sized batch (rows that do not split): two one-shot calls and a two-shot one in
    one program, forward and backward under remat, typed invariant (check_vma=True)."""
    n = 4
    x = rand(40, (1, 3, 8), jnp.float32)     # 3 rows on 4 ranks: one-shot
    x2 = rand(41, (2, 4, 8), jnp.float32)    # 8 rows: two-shot by default
    w1, w2 = rand(42, (8, 6), jnp.float32), rand(43, (8, 6), jnp.float32)
    extra = {"transport": transport} if transport else {}

    def three(x, x2, w1, w2):
        a = jo.matmul_ar(x, w1, "tp", impl=impl, **extra)
        b = jo.matmul_ar(x, w2, "tp", impl=impl, **extra)
        c = jo.matmul_ar(x2, w1, "tp", impl=impl, **extra)
        return jnp.sum(a * b) + jnp.sum(c ** 2)

    def loss_of(body):
        fn = jax.shard_map(body, mesh=tp_mesh(n),
                           in_specs=(P(None, None, "tp"), P(None, None, "tp"), P("tp", None),
                                     P("tp", None)), out_specs=P())
        return fn

    got = jax.jit(jax.grad(loss_of(jax.checkpoint(three)), argnums=(0, 1, 2, 3)))(x, x2, w1, w2)
    ref = jax.grad(loss_of(lambda x, x2, w1, w2: jnp.sum(lax.psum(x @ w1, "tp")
                                                         * lax.psum(x @ w2, "tp"))
                           + jnp.sum(lax.psum(x2 @ w1, "tp") ** 2)),
                   argnums=(0, 1, 2, 3))(x, x2, w1, w2)
    for g, e in zip(got, ref, strict=True):
        assert_close(g, f64(e), jnp.float32)


def test_one_shot_on_global_arrays_and_its_plan():
    """Outside shard_map (one row on 4 ranks) and what the plan says (the debug log)."""
    mesh = tp_mesh(4)
    x = rand(44, (1, 16), jnp.float32)
    w = rand(45, (16, 4), jnp.float32)
    y = jax.jit(lambda x, w: jo.matmul_ar(x, w, "tp", impl="native", transport="p2p",
                                          mesh=mesh))(x, w)
    assert_close(y, f64(x) @ f64(w), jnp.float32)
    from jaxoverlap import _plan

    request = _plan.Request.now("matmul_ar", "tp", impl="native")
    plan = _plan.make(request, jax.ShapeDtypeStruct((1, 4), jnp.float32),
                      jax.ShapeDtypeStruct((4, 4), jnp.float32), 4)
    assert plan.algorithm == "one_shot" and "algorithm=one_shot" in plan.describe()
    plan = _plan.make(request, jax.ShapeDtypeStruct((8, 4), jnp.float32),
                      jax.ShapeDtypeStruct((4, 4), jnp.float32), 4)
    assert plan.algorithm == "two_shot"
    # the custom call carries the algorithm
    hlo = jax.jit(jax.shard_map(
        lambda x, w: jo.matmul_ar(x, w, "tp", impl="native", algorithm="one_shot"),
        mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P())).lower(
            x, w).as_text()
    assert "jaxoverlap_matmul_ar" in hlo and "algorithm = 1 : i32" in hlo


# ---------------------------------------------------------------- the kernel algorithms
# (one GEMM + ONE all-reduce kernel on GPUs, docs/gpu-internals.md §7; the host executor runs
# the kernel's semantics: the same program, an AllReduce op)

KERNELS = _kinds.names(_kinds.ALGORITHMS, kernel=True)
KERNEL_CASES = [(t, a) for t in ("p2p", "multicast") for a in KERNELS]


@pytest.mark.parametrize("transport,algorithm", KERNEL_CASES)
def test_kernel_algorithms_match_psum_on_every_rank_bit_for_bit(transport, algorithm):
    """N 2..8, rows that split into N blocks and rows that do not (one: a decode step), every
    dtype; every rank's y is the same bits."""
    for n, rows, dtype in ((2, (1,), jnp.float32), (3, (2, 3), jnp.bfloat16),
                           (5, (1, 1), jnp.float16), (8, (1,), jnp.float32),
                           (8, (2, 8), jnp.bfloat16)):
        x, w = _case(n, dtype, rows=rows, seed=n)
        fn = jax.jit(jax.shard_map(
            lambda x, w: jo.matmul_ar(x, w, "tp", impl="native", transport=transport,
                                      algorithm=algorithm)[None],
            mesh=tp_mesh(n), in_specs=(spec_on(x.ndim, -1), P("tp", None)), out_specs=P("tp"),
            check_vma=False))
        copies = np.asarray(fn(x, w).astype(jnp.float32))
        for r in range(n):
            np.testing.assert_array_equal(copies[r], copies[0], err_msg=f"N={n} rank {r}")
        assert_close(copies[0].astype(dtype), f64(x) @ f64(w), dtype)


def _late(x, seconds: tuple[float, ...]):
    """Exactly ``x``, after a host callback that sleeps ``seconds[rank]`` on the rank's own
    thread: the ranks reach the next call at uneven speeds (call inside shard_map)."""
    import time

    def nap(value, r):
        time.sleep(seconds[int(r)])
        return value

    held = lax.stop_gradient(x)
    napped = jax.pure_callback(nap, jax.ShapeDtypeStruct(x.shape, x.dtype), held,
                               lax.axis_index("tp"))
    return x + (napped - held)


@pytest.mark.parametrize("transport", ["p2p", "multicast"])
def test_kernel_calls_in_flight_at_uneven_speeds_forward_and_backward(transport):
    """A decode step's program: two kernel calls (one of each algorithm) and a one-shot one in
    one program, run three times back to back, the ranks reaching them at uneven speeds (a
    different rank late each time), forward and backward under remat, typed invariant."""
    n = 4
    x = rand(50, (1, 3, 8), jnp.float32)  # 3 rows on 4 ranks
    w1, w2 = rand(51, (8, 6), jnp.float32), rand(52, (8, 6), jnp.float32)

    def program(seconds):
        def three(x, w1, w2):
            x = _late(x, seconds)
            a = jo.matmul_ar(x, w1, "tp", impl="native", transport=transport,
                             algorithm="one_shot_kernel")
            b = jo.matmul_ar(x, w2, "tp", impl="native", transport=transport,
                             algorithm="two_shot_kernel")
            c = jo.matmul_ar(x, w1, "tp", impl="native", transport=transport,
                             algorithm="one_shot")
            return jnp.sum(a * b) + jnp.sum(c ** 2)

        return jax.jit(jax.value_and_grad(jax.shard_map(
            jax.checkpoint(three), mesh=tp_mesh(n),
            in_specs=(P(None, None, "tp"), P("tp", None), P("tp", None)), out_specs=P()),
            argnums=(0, 1, 2)))

    ref = jax.value_and_grad(jax.shard_map(
        lambda x, w1, w2: jnp.sum(lax.psum(x @ w1, "tp") * lax.psum(x @ w2, "tp"))
        + jnp.sum(lax.psum(x @ w1, "tp") ** 2), mesh=tp_mesh(n),
        in_specs=(P(None, None, "tp"), P("tp", None), P("tp", None)), out_specs=P()),
        argnums=(0, 1, 2))(x, w1, w2)
    for late in range(3):
        seconds = tuple(0.03 if r == late else 0.002 * r for r in range(n))
        value, grads = program(seconds)(x, w1, w2)
        assert_close(value, f64(ref[0]), jnp.float32)
        for g, e in zip(grads, ref[1], strict=True):
            assert_close(g, f64(e), jnp.float32)


def test_kernel_algorithms_are_refused_where_they_cannot_run():
    x, w = _case(4, jnp.float32, rows=(1,))
    for kw, match in ((dict(impl="xla"), "impl='xla'"), (dict(impl="ring"), "impl='ring'"),
                      (dict(impl="native", transport="nccl"), "not nccl")):
        with pytest.raises(ValueError, match=match):
            _run(x, w, 4, algorithm="one_shot_kernel", **kw)
    # One-shot over p2p: 8 slots of y in one 8 MiB half; 2 MiB of f32 y per rank do not fit
    # (the executor refuses the same: cpp/core/allreduce_layout.h).
    x, w = _case(8, jnp.float32, rows=(64,), nw=8192)
    with pytest.raises(ValueError, match=r"2097152 bytes per rank.*Use algorithm='two_shot'"):
        _run(x, w, 8, impl="native", transport="p2p", algorithm="one_shot_kernel")
