"""The host executor through the FFI custom calls, inside jax.shard_map, against float64 NumPy."""

import contextlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import absent, dp_tp_mesh, f64, late, rand, spec_on, tp_mesh
from jax.sharding import PartitionSpec as P

from jaxoverlap import _kinds
from jaxoverlap._executors import capabilities

from . import native_shard

TRANSPORTS = _kinds.names(_kinds.TRANSPORTS)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
TOL = {"float32": dict(rtol=1e-5, atol=1e-5), "bfloat16": dict(rtol=2e-2, atol=2e-3),
       "float16": dict(rtol=2e-2, atol=2e-3)}


def ag(mesh, x, w, *, axis, gathered=False, **kw):
    def body(x, w):
        return native_shard.ag_matmul(x, w, axis_name="tp", axis=axis, return_gathered=gathered,
                                      **kw)

    out_specs = spec_on(x.ndim, x.ndim - 1)
    if gathered:  # every rank's copy of the gathered x, stacked along dim 0
        out_specs = (out_specs, spec_on(x.ndim, 0))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec_on(x.ndim, axis), spec_on(2, 1)),
                              out_specs=out_specs))
    return f(x, w)


def rs(mesh, x, w, *, axis, **kw):
    def body(x, w):
        return native_shard.matmul_rs(x, w, axis_name="tp", axis=axis, **kw)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec_on(x.ndim, -1), spec_on(2, 0)),
                              out_specs=spec_on(x.ndim, axis)))
    return f(x, w)


def ar(mesh, x, w, **kw):
    def body(x, w):
        return native_shard.matmul_ar(x, w, axis_name="tp", **kw)[None]

    # every rank's copy of y, stacked along a new dim 0 (the result is replicated)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec_on(x.ndim, -1), spec_on(2, 0)),
                              out_specs=P("tp"), check_vma=False))
    return f(x, w)


def x_shape(layout, n, k):
    # "batch": [2, n*3, k] gathered on dim 1 (dims before axis are a batch).
    # "post":  [n*3, 2, k] gathered on dim 0 (dims after axis join the rows).
    return ((2, n * 3, k), 1) if layout == "batch" else ((n * 3, 2, k), 0)


def check_ag(n, transport, dtype, chunks, bidir, layout, gathered, reverse=False, seed=0):
    mesh = tp_mesh(n, reverse=reverse)
    # With the concrete mesh set, the handler also checks the rank table.
    with jax.set_mesh(mesh) if reverse else contextlib.nullcontext():
        _check_ag(mesh, n, transport, dtype, chunks, bidir, layout, gathered, seed)


def _check_ag(mesh, n, transport, dtype, chunks, bidir, layout, gathered, seed):
    shape, axis = x_shape(layout, n, 8)
    x = rand(seed, shape, dtype, positive=True)
    x64 = f64(x)
    w = rand(seed + 1, (8, 4 * n), dtype, positive=True)
    w64 = f64(w)
    out = ag(mesh, x, w, axis=axis, gathered=gathered, transport=transport, chunks=chunks,
             bidirectional=bidir, timeout_s=60.0)
    y = out[0] if gathered else out
    assert y.dtype == x.dtype and y.shape == shape[:-1] + (4 * n,)
    np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), x64 @ w64, **TOL[dtype])
    if gathered:
        copies = np.asarray(out[1].astype(jnp.float32))
        np.testing.assert_array_equal(copies, np.concatenate([x64] * n, axis=0))


def check_rs(n, transport, dtype, chunks, bidir, layout, reverse=False, seed=0):
    mesh = tp_mesh(n, reverse=reverse)
    with jax.set_mesh(mesh) if reverse else contextlib.nullcontext():
        _check_rs(mesh, n, transport, dtype, chunks, bidir, layout, seed)


def _check_rs(mesh, n, transport, dtype, chunks, bidir, layout, seed):
    shape, axis = x_shape(layout, n, 4 * n)
    x = rand(seed, shape, dtype, positive=True)
    x64 = f64(x)
    w = rand(seed + 1, (4 * n, 5), dtype, positive=True)
    w64 = f64(w)
    y = rs(mesh, x, w, axis=axis, transport=transport, chunks=chunks, bidirectional=bidir,
           timeout_s=60.0)
    assert y.dtype == x.dtype and y.shape == shape[:-1] + (5,)
    np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), x64 @ w64, **TOL[dtype])


def check_ar(n, transport, dtype, chunks, bidir, layout, reverse=False, seed=0):
    mesh = tp_mesh(n, reverse=reverse)
    with jax.set_mesh(mesh) if reverse else contextlib.nullcontext():
        shape, _ = x_shape(layout, n, 4 * n)  # every dim but the last is a row
        x = rand(seed, shape, dtype, positive=True)
        x64 = f64(x)
        w = rand(seed + 1, (4 * n, 6), dtype, positive=True)
        w64 = f64(w)
        copies = ar(mesh, x, w, transport=transport, chunks=chunks, bidirectional=bidir,
                    timeout_s=60.0)
    assert copies.dtype == x.dtype and copies.shape == (n, *shape[:-1], 6)
    for y in np.asarray(copies.astype(jnp.float32)):
        np.testing.assert_allclose(y, x64 @ w64, **TOL[dtype])


# Full product over transport x N x chunks x bidirectional on small f32 shapes; the layout
# (axis position) and return_gathered alternate deterministically across the cases.
CASES = [(t, n, c, b) for t in TRANSPORTS for n in (1, 2, 4, 8) for c in (1, 4)
         for b in (False, True)]


@pytest.mark.parametrize("transport,n,chunks,bidir", CASES)
def test_ag_matmul_f32(transport, n, chunks, bidir):
    layout = "batch" if (n + chunks) % 2 else "post"
    check_ag(n, transport, "float32", chunks, bidir, layout, gathered=(chunks == 4) != bidir)


@pytest.mark.parametrize("transport,n,chunks,bidir", CASES)
def test_matmul_rs_f32(transport, n, chunks, bidir):
    layout = "post" if (n + chunks) % 2 else "batch"
    check_rs(n, transport, "float32", chunks, bidir, layout)


@pytest.mark.parametrize("transport,n,chunks,bidir", CASES)
def test_matmul_ar_f32(transport, n, chunks, bidir):
    check_ar(n, transport, "float32", chunks, bidir, "batch" if (n + chunks) % 2 else "post")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_matmul_ar_one_shot_f32(transport):
    """matmul_ar's one-shot on the host executor: N 1..8, sub-chunks, rows that split into N
    blocks and rows that do not (one: a decode step); every rank holds the same bits."""
    for n, chunks, rows in ((1, 1, 1), (2, 1, 1), (3, 3, 7), (4, 2, 8), (5, 1, 3), (8, 1, 1),
                            (8, 3, 9)):
        mesh = tp_mesh(n)
        x = rand(n + rows, (1, rows, 4 * n), "float32", positive=True)
        x64 = f64(x)
        w = rand(n + rows + 1, (4 * n, 6), "float32", positive=True)
        w64 = f64(w)
        copies = ar(mesh, x, w, transport=transport, chunks=chunks, algorithm="one_shot",
                    timeout_s=60.0)
        got = np.asarray(copies)
        assert got.shape == (n, 1, rows, 6)
        for r in range(n):
            np.testing.assert_array_equal(got[r], got[0], err_msg=f"N={n} rank {r}")
        np.testing.assert_allclose(got[0], x64 @ w64, **TOL["float32"], err_msg=f"N={n}")


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("n", [2, 8])
def test_low_precision(transport, dtype, n):
    check_ag(n, transport, dtype, 2, True, "batch", gathered=True, seed=n)
    check_rs(n, transport, dtype, 2, n == 8, "post", seed=n)
    check_ar(n, transport, dtype, 2, n == 8, "batch", seed=n)


# The fused programs (one FusedGemm per rank: docs/gpu-internals.md §5) on the host executor, which
# runs its semantics block by block: x's rows are whole 16-byte units (k, cols multiples of 8).
FUSED_CASES = [  # (op, transport, n, chunks, bidirectional, dtype, layout, gathered)
    ("ag_matmul", "p2p", 2, 1, False, "bfloat16", "batch", True),
    ("ag_matmul", "p2p", 4, 3, True, "float16", "post", False),
    ("ag_matmul", "p2p", 8, 2, True, "bfloat16", "batch", True),
    ("ag_matmul", "multicast", 3, 2, False, "float16", "post", True),
    ("ag_matmul", "multicast", 8, 1, False, "bfloat16", "batch", False),
    ("matmul_rs", "p2p", 2, 1, False, "bfloat16", "batch", False),
    ("matmul_rs", "p2p", 5, 3, True, "float16", "post", False),
    ("matmul_rs", "p2p", 8, 2, False, "bfloat16", "batch", False),
    ("matmul_rs", "multicast", 4, 2, False, "bfloat16", "post", False),
    ("matmul_rs", "multicast", 8, 3, False, "float16", "batch", False),
    ("ag_matmul", "p2p", 1, 2, False, "bfloat16", "batch", True),  # one rank: no waits
]


@pytest.mark.slow  # eleven calls compiled and run: seconds
def test_fused_programs_on_the_host_executor():
    for op, transport, n, chunks, bidir, dtype, layout, gathered in FUSED_CASES:
        mesh = tp_mesh(n)
        shape, axis = x_shape(layout, n, 8 if op == "ag_matmul" else 8 * n)
        x = rand(n + chunks, shape, dtype, positive=True)
        x64 = f64(x)
        w_shape = (8, 8 * n) if op == "ag_matmul" else (8 * n, 16)
        w = rand(n + chunks + 1, w_shape, dtype, positive=True)
        w64 = f64(w)
        kw = dict(axis=axis, transport=transport, chunks=chunks, bidirectional=bidir,
                  fused=True, timeout_s=60.0)
        where = f"{op} {transport} N={n} chunks={chunks} bidi={bidir} {dtype} {layout}"
        if op == "ag_matmul":
            out = ag(mesh, x, w, gathered=gathered, **kw)
            y = out[0] if gathered else out
            if gathered:
                np.testing.assert_array_equal(np.asarray(out[1].astype(jnp.float32)),
                                              np.concatenate([x64] * n, axis=0), err_msg=where)
        else:
            y = rs(mesh, x, w, **kw)
        np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), x64 @ w64, **TOL[dtype],
                                   err_msg=where)
    # The executor builds the fused program (the chunked one would give the same values): the
    # first case with k = 12, which the chunked path runs, is refused by the fused GEMM's rule.
    shape, axis = x_shape("batch", 2, 12)
    x = rand(0, shape, "bfloat16", positive=True)
    w = rand(1, (12, 16), "bfloat16", positive=True)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"k \(12\) .* must be multiples of 8"):
        ag(tp_mesh(2), x, w, axis=axis, transport="p2p", fused=True,
           timeout_s=60.0).block_until_ready()


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_any_axis_of_a_4d_input(axis):
    n = 4
    mesh = tp_mesh(n)
    shape = [2, 3, 2, 8]
    shape[axis] *= n
    x = rand(axis, tuple(shape), "float32", positive=True)
    x64 = f64(x)
    w = rand(7, (8, 8), "float32", positive=True)
    w64 = f64(w)
    y, g = ag(mesh, x, w, axis=axis, gathered=True, transport="p2p", chunks=2)
    np.testing.assert_allclose(np.asarray(y), x64 @ w64, **TOL["float32"])
    np.testing.assert_array_equal(np.asarray(g), np.concatenate([x64] * n, axis=0))
    y = rs(mesh, x, w, axis=axis, transport="nccl", chunks=2, bidirectional=True)
    np.testing.assert_allclose(np.asarray(y), x64 @ w64, **TOL["float32"])
    y = ar(mesh, x, w, transport="multicast", chunks=2)[axis]
    np.testing.assert_allclose(np.asarray(y), x64 @ w64, **TOL["float32"])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_reversed_mesh_places_ranks_by_the_rank_table(transport):
    check_ag(4, transport, "float32", 2, False, "batch", gathered=True, reverse=True)
    check_rs(4, transport, "float32", 2, True, "batch", reverse=True)
    check_ar(4, transport, "float32", 2, True, "post", reverse=True)


def test_rank_table_attribute_matches_the_mesh():
    mesh = tp_mesh(4, reverse=True)
    x = jnp.ones((8, 4), jnp.float32)
    w = jnp.ones((4, 4), jnp.float32)
    f = jax.jit(jax.shard_map(
        lambda x, w: native_shard.ag_matmul(x, w, axis_name="tp", transport="p2p"),
        mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")))
    # The shard_map's concrete mesh is known where the call lowers (no jax.set_mesh needed):
    # the table lists the global device ids in (group, rank) order, and the handler finds its
    # rank there from the device it runs on.
    text = f.lower(x, w).as_text()
    assert "device_ids = dense<[3, 2, 1, 0]> : tensor<4xi64>" in text, text
    assert "processes = dense<0> : tensor<4xi64>" in text, text
    assert "coords" not in text
    np.testing.assert_allclose(np.asarray(f(x, w)), np.full((8, 4), 4.0))


def test_2d_mesh_two_cliques_run_concurrently():
    mesh = dp_tp_mesh()
    x = rand(11, (4, 16, 8), "float32", positive=True)
    x64 = f64(x)
    w = rand(12, (8, 12), "float32", positive=True)
    w64 = f64(w)
    w2 = rand(13, (12, 8), "float32", positive=True)
    w2_64 = f64(w2)

    def body(x, w, w2):
        y = native_shard.ag_matmul(x, w, axis_name="tp", axis=1, transport="p2p", chunks=2)
        z = native_shard.matmul_rs(y, w2, axis_name="tp", axis=1, transport="multicast")
        a = native_shard.matmul_ar(y, w2, axis_name="tp", transport="nccl", chunks=2)
        return y, z, a

    f = jax.jit(jax.shard_map(body, mesh=mesh,
                              in_specs=(P("dp", "tp", None), P(None, "tp"), P("tp", None)),
                              out_specs=(P("dp", None, "tp"), P("dp", "tp", None), P("dp"))))
    y, z, a = f(x, w, w2)
    np.testing.assert_allclose(np.asarray(y), x64 @ w64, **TOL["float32"])
    np.testing.assert_allclose(np.asarray(z), np.asarray(y, np.float64) @ w2_64, rtol=1e-5,
                               atol=1e-4)
    np.testing.assert_allclose(np.asarray(a), np.asarray(y, np.float64) @ w2_64, rtol=1e-5,
                               atol=1e-4)


def test_two_call_sites_with_different_shapes_in_one_program():
    mesh = tp_mesh(4)
    x1 = rand(21, (2, 8, 8), "float32", positive=True)
    x1_64 = f64(x1)
    w1 = rand(22, (8, 12), "float32", positive=True)
    w1_64 = f64(w1)
    x2 = rand(23, (12, 16), "float32", positive=True)
    x2_64 = f64(x2)
    w2 = rand(24, (16, 4), "float32", positive=True)
    w2_64 = f64(w2)

    def body(x1, w1, x2, w2):
        y1 = native_shard.ag_matmul(x1, w1, axis_name="tp", axis=1, transport="nccl")
        y2 = native_shard.matmul_rs(x2, w2, axis_name="tp", axis=0, transport="nccl", chunks=3)
        return y1, y2

    f = jax.jit(jax.shard_map(body, mesh=mesh,
                              in_specs=(P(None, "tp", None), P(None, "tp"), P(None, "tp"),
                                        P("tp", None)),
                              out_specs=(P(None, None, "tp"), P("tp", None))))
    for _ in range(3):
        y1, y2 = f(x1, w1, x2, w2)
        np.testing.assert_allclose(np.asarray(y1), x1_64 @ w1_64, **TOL["float32"])
        np.testing.assert_allclose(np.asarray(y2), x2_64 @ w2_64, **TOL["float32"])


@pytest.mark.parametrize("transport", ["p2p", "multicast"])
def test_200_back_to_back_calls_with_changing_shapes(transport):
    """Epoch parity and workspace growth: results stay right while shapes grow and shrink."""
    n = 4
    mesh = tp_mesh(n)

    def body(x, w1, w2):
        h = native_shard.ag_matmul(x, w1, axis_name="tp", axis=1, transport=transport, chunks=2)
        y = native_shard.matmul_rs(h, w2, axis_name="tp", axis=1, transport=transport)
        # GEMM+AR on the same h (its own call site), compared with the reduce-scatter's result;
        # and one-shot on its first row per batch (2 rows on 4 ranks: no split)
        return (y, native_shard.matmul_ar(h, w2, axis_name="tp", transport=transport),
                native_shard.matmul_ar(h[:, :1], w2, axis_name="tp", transport=transport,
                                       algorithm="one_shot"))

    f = jax.jit(jax.shard_map(body, mesh=mesh,
                              in_specs=(P(None, "tp", None), P(None, "tp"), P("tp", None)),
                              out_specs=(P(None, "tp", None), P(), P()), check_vma=False))
    inputs = []
    for i, s in enumerate((4, 16, 8, 32, 4)):
        x = rand(100 + i, (2, s, 8), "float32", positive=True)
        x64 = f64(x)
        w1 = rand(200 + i, (8, 8), "float32", positive=True)
        w1_64 = f64(w1)
        w2 = rand(300 + i, (8, 8), "float32", positive=True)
        w2_64 = f64(w2)
        inputs.append(((x, w1, w2), (x64 @ w1_64) @ w2_64))
    outs = [f(*inputs[i % len(inputs)][0]) for i in range(200)]
    for i, (y, a, one) in enumerate(outs):
        want = inputs[i % len(inputs)][1]
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(np.asarray(a), want, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(np.asarray(one), want[:, :1], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_missing_peer_times_out_with_a_clear_error(transport):
    mesh = tp_mesh(4)
    x = jnp.ones((2, 8, 8), jnp.float32)
    w = jnp.ones((8, 4), jnp.float32)
    stall = {"on": False}
    f = jax.jit(jax.shard_map(
        lambda x, w: native_shard.ag_matmul(absent(x, 2, lambda: stall["on"]), w,
                                            axis_name="tp", axis=1, transport=transport,
                                            timeout_s=0.5),
        mesh=mesh, in_specs=(P(None, "tp", None), P(None, "tp")), out_specs=P(None, None, "tp")))
    f(x, w).block_until_ready()  # compile and run once with every rank present
    stall["on"] = True  # rank 2 reaches the next call only after its peers' 0.5 s timeout
    with pytest.raises(Exception, match=r"missing peer rank\(s\) 2 did not arrive") as info:
        f(x, w).block_until_ready()
    message = str(info.value)
    assert "ag_matmul" in message and "clique 0x" in message and "epoch 2" in message


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["two_shot", "one_shot"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_matmul_ar_missing_peer_times_out_with_a_clear_error(transport, algorithm):
    """Two-shot on 16 rows, one-shot on a decode step's single row, on 4 ranks."""
    mesh = tp_mesh(4)
    rows = (2, 8) if algorithm == "two_shot" else (1, 1)
    x = jnp.ones((*rows, 8), jnp.float32)
    w = jnp.ones((8, 4), jnp.float32)
    stall = {"on": False}
    f = jax.jit(jax.shard_map(
        lambda x, w: native_shard.matmul_ar(absent(x, 1, lambda: stall["on"]), w,
                                            axis_name="tp", transport=transport,
                                            algorithm=algorithm, timeout_s=0.5),
        mesh=mesh, in_specs=(P(None, None, "tp"), P("tp", None)), out_specs=P()))
    np.testing.assert_allclose(np.asarray(f(x, w)), np.full((*rows, 4), 8.0))
    stall["on"] = True  # rank 1 reaches the next call only after its peers' 0.5 s timeout
    with pytest.raises(Exception, match=r"missing peer rank\(s\) 1 did not arrive") as info:
        f(x, w).block_until_ready()
    assert "matmul_ar" in str(info.value) and "epoch 2" in str(info.value)


def test_debug_log_prints_the_plan():
    code = (
        "import jax, jax.numpy as jnp\n"
        "from jax.sharding import PartitionSpec as P, AxisType\n"
        "import native_shard\n"
        "mesh = jax.make_mesh((2,), ('tp',), axis_types=(AxisType.Auto,))\n"
        "f = jax.shard_map(lambda x, w: native_shard.matmul_rs(x, w, axis_name='tp',"
        " transport='p2p'), mesh=mesh, in_specs=(P(None, 'tp'), P('tp')), out_specs=P('tp'))\n"
        "jax.jit(f)(jnp.ones((4, 4)), jnp.ones((4, 2))).block_until_ready()\n"
    )
    env = dict(os.environ, JAXOVERLAP_LOG="debug",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, cwd=os.path.dirname(os.path.abspath(__file__)))
    assert proc.returncode == 0, proc.stderr
    assert "plan:" in proc.stderr and "matmul_rs transport=p2p" in proc.stderr


def test_info_and_transports():
    assert capabilities.available()
    assert capabilities.transports() == TRANSPORTS
    info = capabilities.info()
    assert info["available"] and info["backends"]["cpu"]["transports"] == list(TRANSPORTS)
    assert "blas" in info["build"]


def test_partially_manual_shard_map_is_an_error_not_a_corruption():
    """Leaving dp automatic would give the two dp slices the same (rank, group)."""
    mesh = dp_tp_mesh()
    x = jnp.ones((4, 16, 8), jnp.float32)
    w = jnp.ones((8, 8), jnp.float32)

    def body(x, w):
        return native_shard.ag_matmul(x, w, axis_name="tp", axis=1, transport="p2p")

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp", None), P(None, "tp")),
                              out_specs=P(None, None, "tp"), axis_names={"tp"}))
    with pytest.raises(ValueError, match=r"mesh axes \['dp'\] are not"):
        f(x, w)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_conversion_is_exact_and_rounds_to_nearest_even(dtype):
    """x @ I returns every finite value bit for bit; x @ (I/2) rounds like XLA (subnormals too)."""
    jdt = DTYPES[dtype]
    bits = np.arange(1 << 16, dtype=np.uint16)
    values = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(bits), jdt))
    finite = values[np.isfinite(values.astype(np.float32))]
    k = 16
    finite = finite[: finite.size // k * k].reshape(-1, k)
    mesh = tp_mesh(1)
    x = jnp.asarray(finite, jdt)
    for scale in (1.0, 0.5):
        w = jnp.asarray(np.eye(k, dtype=np.float32) * scale, jdt)
        y = ag(mesh, x, w, axis=0, transport="p2p")
        want = (x.astype(jnp.float32) * scale).astype(jdt)
        # Values, not bits: the GEMM sums -0 with +0 terms, so -0 comes back as +0.
        np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)),
                                      np.asarray(want.astype(jnp.float32)))


@pytest.mark.parametrize("timeout_s", [1e10, float("inf")])
def test_a_huge_timeout_means_wait_long_not_fail_at_once(timeout_s):
    """1e10 s is 1e19 ns, past the clock's int64 range: the deadline must saturate, not wrap
    around into the past (which failed every wait at once)."""
    mesh = tp_mesh(4)
    shape, axis = x_shape("batch", 4, 8)
    x = rand(3, shape, "float32", positive=True)
    x64 = f64(x)
    w = rand(4, (8, 16), "float32", positive=True)
    w64 = f64(w)
    for transport in TRANSPORTS:
        y = ag(mesh, x, w, axis=axis, transport=transport, chunks=2, timeout_s=timeout_s)
        np.testing.assert_allclose(np.asarray(y), x64 @ w64, **TOL["float32"])


@pytest.mark.slow
def test_exit_while_workers_still_run_is_clean():
    """A process may exit while host workers still run calls (a peer is late): they must not
    touch process-wide state that exit destroys. A worker busy with that state (sizing cache,
    clique registry, call-site ids) while the interpreter exits: the exit must be clean, every
    time (it crashed or aborted while that state was destroyed at exit)."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = f"""
import sys
sys.path.insert(0, {tests!r})
from jaxoverlap._executors.runtime import load_host
load_host()  # its BLAS, which the testing module's executor code links
import testing_ext
testing_ext.load().busy_worker(3.0)
print("leaving", flush=True)
sys.exit(0)
"""
    for _ in range(5):
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=120)
        assert "leaving" in run.stdout, run.stderr
        assert run.returncode == 0, (run.returncode, run.stderr[-2000:])


# ---- fp8: operands with per-rank scales, x moved as fp8 with each shard's scale ---------------

# (x, w, y) dtypes: both fp8 (every pairing), and an fp8 operand with a 16-bit one.
FP8_DTYPES = [("float8_e4m3fn", "float8_e4m3fn", "bfloat16"),
              ("float8_e4m3fn", "float8_e5m2", "float32"),
              ("float8_e5m2", "float8_e4m3fn", "float16"),
              ("float8_e4m3fn", "bfloat16", "bfloat16"),
              ("bfloat16", "float8_e5m2", "float32"),
              ("float8_e5m2", "float8_e5m2", "bfloat16")]


@contextlib.contextmanager
def case_note(*values):
    """Adds the case to the failure raised in its body."""
    try:
        yield
    except Exception as e:
        e.add_note(f"in the case {values}")
        raise


def rank_scales(dtype, n, base):
    """One float32 scale per rank, all different; 1.0 where `dtype` is not fp8 (what the ops
    pass for an operand without a scale)."""
    s = np.asarray([base * (1.0 + 0.37 * r) if capabilities.is_fp8(dtype) else 1.0
                    for r in range(n)], np.float32)
    return jnp.asarray(s), s


def dequantized(values64, scale):
    """The float32 dequantized operand (value * scale, in float32), as float64."""
    return (values64.astype(np.float32) * np.float32(scale)).astype(np.float64)


def within_bound(op, got, ref, out_dtype, n, k, a, b):
    from jaxoverlap._selftest import _compare, bound

    ok, detail = _compare(np, got, ref, bound(op, out_dtype, n, k, a, b))
    assert ok, detail


def check_fp8(n, transport, dtypes, chunks, bidir, seed=0):
    """ag_matmul (with return_gathered), matmul_rs and matmul_ar of fp8 operands on `n` ranks,
    each rank with its own scales, against the float64 product of the float32 dequantized
    operands (selftest's bound: one rounding to y's dtype; reductions in y's dtype)."""
    x_dtype, w_dtype, out = dtypes
    mesh = tp_mesh(n)
    sx, sx_np = rank_scales(x_dtype, n, 0.5)
    sw, sw_np = rank_scales(w_dtype, n, 1.25)
    fields = dict(transport=transport, chunks=chunks, bidirectional=bidir, timeout_s=60.0,
                  out_dtype=out)
    k, rows = 32, 2 * chunks

    def scales_in(body):  # this rank's own scales
        def wrapped(x, w, sx, sw):
            return body(x, w, sx[0], sw[0])
        return wrapped

    scale_specs = (P("tp"), P("tp"))

    # all-gather: rank r's y columns = concat_j (x_j * sx_j) @ (w_r * sw_r)
    x = rand(seed, (2, n * rows, k), x_dtype, scale=3)
    x64 = f64(x)
    w = rand(seed + 1, (k, 16 * n), w_dtype, scale=3)
    w64 = f64(w)
    f = jax.jit(jax.shard_map(
        scales_in(lambda x, w, sx, sw: native_shard.ag_matmul(
            x, w, axis=1, return_gathered=True, x_scale=sx, w_scale=sw, **fields)),
        mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), *scale_specs),
        out_specs=(P(None, None, "tp"), P("tp"))))
    y, gathered = f(x, w, sx, sw)
    assert y.dtype == jnp.dtype(out) and gathered.dtype == x.dtype
    x_deq = np.concatenate([dequantized(x64[:, j * rows:(j + 1) * rows], sx_np[j])
                            for j in range(n)], axis=1)
    got = np.asarray(y.astype(jnp.float32), np.float64)
    for r in range(n):
        w_deq = dequantized(w64[:, r * 16:(r + 1) * 16], sw_np[r])
        within_bound("ag_matmul", got[..., r * 16:(r + 1) * 16], x_deq @ w_deq, out, n, k,
                     x_deq, w_deq)
    # x_gathered: the fp8 bits of every shard, on every rank
    np.testing.assert_array_equal(
        np.asarray(jax.lax.bitcast_convert_type(gathered, jnp.uint8 if x.dtype.itemsize == 1
                                                else jnp.uint16)),
        np.tile(np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint8 if x.dtype.itemsize == 1
                                                        else jnp.uint16)), (n, 1, 1)))

    # reduce-scatter / all-reduce: sum_r (x_r * sx_r) @ (w_r * sw_r), x_r and w_r the rank's
    # slices of the contraction
    x = rand(seed + 2, (n * rows, 2, k * n), x_dtype, scale=3)
    x64 = f64(x)
    w = rand(seed + 3, (k * n, 24), w_dtype, scale=3)
    w64 = f64(w)
    x_deq = np.concatenate([dequantized(x64[..., r * k:(r + 1) * k], sx_np[r])
                            for r in range(n)], axis=-1)
    w_deq = np.concatenate([dequantized(w64[r * k:(r + 1) * k], sw_np[r]) for r in range(n)])
    ref = x_deq @ w_deq
    rs = jax.jit(jax.shard_map(
        scales_in(lambda x, w, sx, sw: native_shard.matmul_rs(
            x, w, axis=0, x_scale=sx, w_scale=sw, **fields)),
        mesh=mesh, in_specs=(P(None, None, "tp"), P("tp"), *scale_specs), out_specs=P("tp")))
    y = rs(x, w, sx, sw)
    assert y.dtype == jnp.dtype(out)
    within_bound("matmul_rs", np.asarray(y.astype(jnp.float32), np.float64), ref, out, n, k,
                 x_deq, w_deq)
    ar = jax.jit(jax.shard_map(
        scales_in(lambda x, w, sx, sw: native_shard.matmul_ar(
            x, w, x_scale=sx, w_scale=sw, **fields)[None]),
        mesh=mesh, in_specs=(P(None, None, "tp"), P("tp"), *scale_specs), out_specs=P("tp"),
        check_vma=False))
    copies = np.asarray(ar(x, w, sx, sw).astype(jnp.float32), np.float64)
    for r in range(n):
        np.testing.assert_array_equal(copies[r], copies[0])
        within_bound("matmul_ar", copies[r], ref, out, n, k, x_deq, w_deq)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fp8_every_op_with_per_rank_scales(transport):
    """fp8 operands (every pairing of e4m3 and e5m2, and with a 16-bit operand), y in
    bfloat16, float16 or float32, scales that differ per rank, N 2..8, chunks and both ring
    directions: exact to one rounding of y (reductions in y's dtype), x_gathered the fp8 bits."""
    cases = [(2, 1, False), (4, 2, True), (3, 1, True), (8, 2, False)]
    for i, (n, chunks, bidir) in enumerate(cases):  # every pairing twice over the transports
        dtypes = FP8_DTYPES[(i + 4 * TRANSPORTS.index(transport)) % len(FP8_DTYPES)]
        with case_note(transport, n, chunks, bidir, dtypes):
            check_fp8(n, transport, dtypes, chunks, bidir, seed=i)


@pytest.mark.parametrize("transport", ["p2p", "multicast"])
def test_fp8_fused_with_per_shard_and_per_rank_scales(transport):
    """The fused FP8 all-gather (one FusedGemm reading every shard's scale slot; the own scale
    copied into its slot on p2p) and GEMM + reduce-scatter (every row of a rank's x takes its
    one scale; the partials in y's dtype, summed in float32) on the host executor, each FP8
    instantiation, per-rank scales, N 2..8, chunks, both directions: within one rounding of y
    (the reduction's too) of the float64 product of the dequantized operands, as the chunked
    program (a wrong shard's scale misses it: below)."""
    from jaxoverlap import _kinds

    cases = [(2, 1, False), (4, 2, True), (8, 1, True)]
    offset = len(cases) * ["p2p", "multicast"].index(transport)  # every instantiation is run
    for i, (n, chunks, bidir) in enumerate(cases):
        t = _kinds.FUSED_FP8[(i + offset) % len(_kinds.FUSED_FP8)]
        x_dtype, w_dtype, out = t.x, t.w, t.y
        with case_note(transport, n, chunks, bidir, (x_dtype, w_dtype, out)):
            mesh = tp_mesh(n)
            sx, sx_np = rank_scales(x_dtype, n, 0.5)
            sw, sw_np = rank_scales(w_dtype, n, 1.25)
            k, rows = 32, 2 * chunks
            x = rand(i, (1, n * rows, k), x_dtype, scale=3)
            w = rand(i + 1, (k, 16 * n), w_dtype, scale=3)
            fields = dict(transport=transport, chunks=chunks, bidirectional=bidir, fused=True,
                          timeout_s=60.0, out_dtype=out)

            def body(x, w, sx, sw, fields=fields):
                return native_shard.ag_matmul(x, w, axis=1, x_scale=sx[0], w_scale=sw[0],
                                              **fields)

            f = jax.jit(jax.shard_map(
                body, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), P("tp"), P("tp")),
                out_specs=P(None, None, "tp")))
            y = f(x, w, sx, sw)
            assert y.dtype == jnp.dtype(out)
            x64, w64 = f64(x), f64(w)
            x_deq = np.concatenate([dequantized(x64[:, j * rows:(j + 1) * rows], sx_np[j])
                                    for j in range(n)], axis=1)
            got = np.asarray(y.astype(jnp.float32), np.float64)
            for r in range(n):
                w_deq = dequantized(w64[:, r * 16:(r + 1) * 16], sw_np[r])
                within_bound("ag_matmul", got[..., r * 16:(r + 1) * 16], x_deq @ w_deq, out, n,
                             k, x_deq, w_deq)

            # GEMM + reduce-scatter: sum_r (x_r * sx_r) @ (w_r * sw_r), x_r and w_r the rank's
            # slices of the contraction
            x = rand(i + 2, (1, n * rows, k * n), x_dtype, scale=3)
            w = rand(i + 3, (k * n, 16), w_dtype, scale=3)
            x64, w64 = f64(x), f64(w)
            x_deq = np.concatenate([dequantized(x64[..., r * k:(r + 1) * k], sx_np[r])
                                    for r in range(n)], axis=-1)
            w_deq = np.concatenate([dequantized(w64[r * k:(r + 1) * k], sw_np[r])
                                    for r in range(n)])

            def rs_body(x, w, sx, sw, fields=fields):
                return native_shard.matmul_rs(x, w, axis=1, x_scale=sx[0], w_scale=sw[0],
                                              **fields)

            rs = jax.jit(jax.shard_map(
                rs_body, mesh=mesh, in_specs=(P(None, None, "tp"), P("tp"), P("tp"), P("tp")),
                out_specs=P(None, "tp")))
            y = rs(x, w, sx, sw)
            assert y.dtype == jnp.dtype(out)
            within_bound("matmul_rs", np.asarray(y.astype(jnp.float32), np.float64),
                         x_deq @ w_deq, out, n, k, x_deq, w_deq)


def test_fp8_p2p_all_gathers_are_exact_with_ranks_late():
    """The p2p FP8 all-gather, chunked and fused, one- and bidirectional, 1 and 3 chunks, its
    scales on the shards' own streams ahead of their data (core/build_ag.cc): four calls in one
    program, each late on different ranks (a GEMM chain before it), twice. Small integers under
    power-of-two scales distinct per shard make every product and sum exact, so each row must
    be its own shard's, scaled by its own shard's scale, bit for bit."""
    from jax import lax

    n, rows, k = 8, 6, 32
    calls = [(False, 3, False), (False, 1, True), (True, 1, False), (True, 3, True)]
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.integers(-2, 3, (1, n * rows, k)), jnp.float8_e4m3fn)
    w = jnp.asarray(rng.integers(-2, 3, (k, 16 * n)), jnp.float8_e4m3fn)
    sx_np = np.asarray([2.0 ** (r - 3) for r in range(n)], np.float32)
    sw_np = np.asarray([2.0 ** -(r % 3) for r in range(n)], np.float32)
    big = rand(21, (192, 192)) / 16

    def body(x, w, sx, sw):
        r = lax.axis_index("tp")
        return tuple(native_shard.ag_matmul(
            late(x, r, j, big), w, axis=1, x_scale=sx[0], w_scale=sw[0], transport="p2p",
            chunks=chunks, bidirectional=bidir, fused=fused, timeout_s=60.0,
            out_dtype="bfloat16") for j, (fused, chunks, bidir) in enumerate(calls))

    f = jax.jit(jax.shard_map(body, mesh=tp_mesh(n),
                              in_specs=(P(None, "tp"), P(None, "tp"), P("tp"), P("tp")),
                              out_specs=(P(None, None, "tp"),) * len(calls)))
    x64, w64 = f64(x), f64(w)
    gathered = np.concatenate([x64[:, j * rows:(j + 1) * rows] * sx_np[j] for j in range(n)],
                              axis=1)
    want = np.concatenate([gathered @ (w64[:, r * 16:(r + 1) * 16] * sw_np[r])
                           for r in range(n)], axis=-1)
    for i in range(2):
        for (fused, chunks, bidir), y in zip(calls, f(x, w, jnp.asarray(sx_np),
                                                        jnp.asarray(sw_np)), strict=True):
            assert y.dtype == jnp.bfloat16
            np.testing.assert_array_equal(f64(y), want,
                                          err_msg=f"run {i}, fused={fused} chunks={chunks} "
                                                  f"bidirectional={bidir}")


def test_fp8_a_wrong_shard_scale_would_be_caught():
    """The check above is sensitive to the scales' travel: every rank using its own x scale
    for every shard (what a program that did not move them would do) misses the bound."""
    n, rows, k = 4, 2, 32
    sx = np.asarray([0.5 * (1.0 + 0.37 * r) for r in range(n)], np.float32)
    x = rand(7, (1, n * rows, k), "float8_e4m3fn", scale=3)
    x64 = f64(x)
    w = rand(8, (k, 16), "float8_e4m3fn", scale=3)
    w64 = f64(w)
    right = np.concatenate([dequantized(x64[:, j * rows:(j + 1) * rows], sx[j])
                            for j in range(n)], axis=1)
    own = dequantized(x64, sx[1])  # rank 1's scale for every shard
    with pytest.raises(AssertionError, match="of the bound"):
        within_bound("ag_matmul", own @ w64, right @ w64, "bfloat16", n, k, right, w64)


def _custom_call(x, w, x_scale, w_scale, y_dtype, n=2):
    """The CPU custom call of ag_matmul made by hand (what the primitive's lowering emits),
    so that operands the primitive would never pass reach the handler's checks."""
    from jax import lax

    from jaxoverlap._executors import runtime
    from jaxoverlap._executors.call import describe
    from jaxoverlap._native.attributes import attributes
    from jaxoverlap._plan import OpPlan

    runtime.register("cpu")
    mesh = tp_mesh(n)
    plan = OpPlan(op="ag_matmul", impl="native", axis_name="tp", axis=0, axis_size=n,
                  transport="p2p")
    attrs = attributes(plan, describe(mesh, "tp", "cpu", "p2p", None, jax.process_index()), x,
                       site_key=1)
    rows, cols = x.shape[0] // n * n, w.shape[1] // n

    def body(x, w):
        coords = jnp.stack([lax.axis_index("tp"), 0]).astype(jnp.int32)
        call = jax.ffi.ffi_call("jaxoverlap_ag_matmul",
                                jax.ShapeDtypeStruct((rows, cols), y_dtype))
        return call(x, w, x_scale, w_scale, coords, **attrs)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                              out_specs=P(None, "tp"), check_vma=False))
    return f(x, w).block_until_ready()  # the handler's error surfaces with the result


def test_the_handler_refuses_bad_dtypes_and_scales_naming_them():
    """The custom call's operand checks (cpp/ffi/ffi_call.h): a scale that is not a float32
    scalar, x and w of two non-fp8 dtypes, an fp8 or mismatched y — each an error naming the
    operand and what it expected; the same operands with good scales run."""
    e4 = jnp.float8_e4m3fn
    x, w = jnp.ones((4, 16), e4), jnp.ones((16, 4), e4)
    one = jnp.ones((), jnp.float32)
    y = _custom_call(x, w, one * 0.5, one * 2.0, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), np.full((4, 4), 16.0))
    for args, message in [
            ((x, w, jnp.ones((2,), jnp.float32), one, jnp.bfloat16),
             r"operand x_scale expected a float32 scalar \(shape \(\) or \(1,\)\), got shape "
             r"\[2\]"),
            ((x, w, one, jnp.ones((), jnp.bfloat16), jnp.bfloat16),
             "operand w_scale expected a float32 scalar"),
            ((x.astype(jnp.bfloat16), w.astype(jnp.float16), one, one, jnp.bfloat16),
             "x and w must have the same dtype unless one of them is float8"),
            ((x, w, one, one, e4), "result y expected dtype float32, bfloat16 or float16"),
            ((x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), one, one, jnp.float16),
             "the output dtype must be x's or float32")]:
        with pytest.raises(Exception, match=message):
            _custom_call(*args)
