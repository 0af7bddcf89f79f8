"""Every misuse raises at trace time, naming the argument and the fix (README)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import put, rand, tp_mesh
from jax.sharding import PartitionSpec as P

import jaxoverlap as jo

AG_SPECS = (P("tp"), P(None, "tp"))


def _inside(fn, n=4, in_specs=AG_SPECS):
    """Traces ``fn`` inside shard_map over a 'tp' axis of size n (only tracing matters here)."""
    mesh = tp_mesh(n)
    out_specs = P()
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=False))


X = rand(0, (8, 4), jnp.float32)
W = rand(1, (4, 8), jnp.float32)


@pytest.mark.parametrize("op", [jo.ag_matmul, jo.matmul_rs])
def test_unknown_axis_name_inside_shard_map(op):
    with pytest.raises(ValueError, match="axis_name 'model' is not an axis of the mesh"):
        _inside(lambda x, w: op(x, w, "model"))(X, W)


@pytest.mark.parametrize("op", [jo.ag_matmul, jo.matmul_rs])
def test_axis_name_not_in_mesh(op):
    mesh = tp_mesh(4)
    with pytest.raises(ValueError, match=r"axis_name 'model' is not an axis of the mesh.*'tp'"):
        op(X, W, "model", mesh=mesh)


def test_no_mesh_outside_shard_map():
    with pytest.raises(ValueError, match="no mesh is known.*mesh="):
        jo.ag_matmul(np.ones((8, 4), np.float32), np.ones((4, 8), np.float32), "tp")


@pytest.mark.parametrize("op", [jo.ag_matmul, jo.matmul_rs])
def test_contraction_mismatch(op):
    with pytest.raises(ValueError, match=r"contraction dims differ: x.shape\[-1\]=4 but "
                                         r"w.shape\[0\]=5"):
        op(X, rand(2, (5, 8), jnp.float32), "tp", mesh=tp_mesh(4))


@pytest.mark.parametrize("op", [jo.ag_matmul, jo.matmul_rs])
def test_axis_is_the_last_dim(op):
    with pytest.raises(ValueError, match="axis=1 is x's last dim"):
        op(X, W, "tp", axis=1, mesh=tp_mesh(4))
    with pytest.raises(ValueError, match="axis=-1 is out of range|axis=1 is x's last dim"):
        op(X, W, "tp", axis=-1, mesh=tp_mesh(4))


def test_axis_out_of_range_and_wrong_type():
    with pytest.raises(ValueError, match="axis=5 is out of range"):
        jo.ag_matmul(X, W, "tp", axis=5, mesh=tp_mesh(4))
    with pytest.raises(TypeError, match="axis=0.5 must be an int"):
        jo.ag_matmul(X, W, "tp", axis=0.5, mesh=tp_mesh(4))


@pytest.mark.parametrize("op", [jo.ag_matmul, jo.matmul_rs])
def test_rank_errors(op):
    with pytest.raises(ValueError, match="x must have rank >= 2"):
        op(jnp.ones((8,)), W, "tp", mesh=tp_mesh(4))
    with pytest.raises(ValueError, match="w must have rank 2"):
        op(X, jnp.ones((4, 8, 1)), "tp", mesh=tp_mesh(4))


def test_not_an_array():
    with pytest.raises(TypeError, match="x must be an array, got list"):
        jo.ag_matmul([[1.0]], W, "tp", mesh=tp_mesh(4))


def test_rows_not_divisible_global():
    with pytest.raises(ValueError, match=r"x.shape\[0\] has 6 rows.*not divisible by the size 4"):
        jo.ag_matmul(rand(3, (6, 4), jnp.float32), W, "tp", mesh=tp_mesh(4))
    with pytest.raises(ValueError, match=r"w.shape\[1\] has 6 columns.*size 4"):
        jo.ag_matmul(X, rand(4, (4, 6), jnp.float32), "tp", mesh=tp_mesh(4))
    with pytest.raises(ValueError, match=r"x.shape\[-1\] has 6 contraction features"):
        jo.matmul_rs(rand(5, (8, 6), jnp.float32), rand(6, (6, 4), jnp.float32), "tp",
                     mesh=tp_mesh(4))


def test_rows_not_divisible_inside_shard_map():
    with pytest.raises(ValueError, match=r"x.shape\[0\]=6 rows are not divisible by the size 4"):
        _inside(lambda x, w: jo.matmul_rs(x, w, "tp"),
                in_specs=(P(None, "tp"), P("tp", None)))(
            rand(7, (6, 16), jnp.float32), rand(8, (16, 4), jnp.float32))


def test_chunks_must_divide_rows():
    with pytest.raises(ValueError, match="chunks=3 does not divide the 2 rows"):
        jo.ag_matmul(X, W, "tp", impl="ring", chunks=3, mesh=tp_mesh(4))
    with pytest.raises(ValueError, match="chunks=0 must be a positive int"):
        jo.ag_matmul(X, W, "tp", impl="ring", chunks=0, mesh=tp_mesh(4))
    for bad in (np.bool_(True), 2.0, np.int64(0)):
        with pytest.raises(ValueError, match="must be a positive int"):
            jo.ag_matmul(X, W, "tp", impl="ring", chunks=bad, mesh=tp_mesh(4))


def test_chunks_may_be_a_numpy_integer():
    y = jo.ag_matmul(X, W, "tp", impl="ring", chunks=np.int64(2), mesh=tp_mesh(2))
    np.testing.assert_allclose(np.asarray(y), np.asarray(X) @ np.asarray(W), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("op", [jo.ag_matmul, jo.matmul_rs])
def test_unsupported_dtype(op):
    xi = jnp.ones((8, 4), jnp.int32)
    with pytest.raises(TypeError, match="x.dtype=int32 is not supported; use float32"):
        op(xi, xi.T, "tp", mesh=tp_mesh(4))


def test_mixed_dtypes():
    with pytest.raises(TypeError, match="x.dtype=float32 and w.dtype=bfloat16 differ"):
        jo.ag_matmul(X, W.astype(jnp.bfloat16), "tp", mesh=tp_mesh(4))


def test_unknown_impl_and_transport():
    with pytest.raises(ValueError, match="impl='fast' is not an implementation"):
        jo.ag_matmul(X, W, "tp", impl="fast", mesh=tp_mesh(4))
    with pytest.raises(ValueError, match="transport='nvlink' is not a transport"):
        jo.ag_matmul(X, W, "tp", transport="nvlink", mesh=tp_mesh(4))
    # not a str: named too, not numpy's "truth value of an array is ambiguous"
    with pytest.raises(ValueError, match=r"impl=array\(\['xla', 'ring'\].* is not an impl"):
        jo.ag_matmul(X, W, "tp", impl=np.array(["xla", "ring"]), mesh=tp_mesh(4))
    with pytest.raises(ValueError, match=r"transport=\['p2p'\] is not a transport"):
        jo.ag_matmul(X, W, "tp", impl="native", transport=["p2p"], mesh=tp_mesh(4))


def test_transport_with_portable_impl():
    with pytest.raises(ValueError, match="transport='p2p' applies to impl='native' only"):
        jo.ag_matmul(X, W, "tp", impl="ring", transport="p2p", mesh=tp_mesh(4))


def test_bad_flags():
    with pytest.raises(TypeError, match="bidirectional='yes' must be True, False or None"):
        jo.ag_matmul(X, W, "tp", impl="ring", bidirectional="yes", mesh=tp_mesh(4))
    with pytest.raises(TypeError, match="return_gathered=1 must be True or False"):
        jo.ag_matmul(X, W, "tp", return_gathered=1, mesh=tp_mesh(4))
    with pytest.raises(TypeError, match="mesh=.* must be a jax.sharding.Mesh"):
        jo.ag_matmul(X, W, "tp", mesh="tp")
    with pytest.raises(TypeError, match="must be a single mesh axis name"):
        jo.ag_matmul(X, W, ("dp", "tp"), mesh=tp_mesh(4))


def test_native_request_is_never_silently_replaced(monkeypatch):
    """Asking for native where it cannot run is an error, not a quiet fallback."""
    from jaxoverlap._executors import runtime

    # an installation whose native extension does not load
    monkeypatch.setattr(runtime, "host_error", lambda: "no native extension here")
    with pytest.raises(jo.NativeUnavailableError, match="impl='native' was requested.*no native"):
        jo.ag_matmul(X, W, "tp", impl="native", mesh=tp_mesh(4))
    with pytest.raises(jo.NativeUnavailableError, match=r"\(transport='p2p'\)"):
        jo.matmul_rs(X, W, "tp", transport="p2p", mesh=tp_mesh(4))


def test_transport_the_machine_lacks(monkeypatch):
    """An explicit transport that cannot serve the call is an error when the program lowers
    (only there is it known whether the clique spans processes), never a silent fallback."""
    from jaxoverlap._executors import capabilities

    monkeypatch.setattr(capabilities, "transport_reasons", lambda platform, ordinals, spans: {
        "nccl": None, "p2p": None, "multicast": "this machine has no NVSwitch"})
    with pytest.raises(jo.NativeUnavailableError,
                       match=r"transport='multicast' is not available on cpu: this machine has no "
                             r"NVSwitch. Available: \['p2p', 'nccl'\]"):
        jo.ag_matmul(X, W, "tp", impl="native", transport="multicast", mesh=tp_mesh(4))


def test_errors_raise_before_any_device_work():
    """Misuse under jit fails while tracing: nothing is compiled or run."""
    mesh = tp_mesh(4)
    x = put(rand(9, (6, 4), jnp.float32), mesh, P())
    f = jax.jit(lambda x, w: jo.ag_matmul(x, w, "tp", mesh=mesh))
    with pytest.raises(ValueError, match="not divisible"):
        f.trace(x, W) if hasattr(f, "trace") else f.lower(x, W)


@pytest.mark.parametrize("op", [jo.ag_matmul, jo.matmul_rs])
@pytest.mark.parametrize("bad", [3, None, b"tp", 1.5])
def test_axis_name_of_the_wrong_type_is_named(op, bad):
    # jo.ag_matmul(x, w, 3) once failed deep inside JAX with "axis 3 is out of bounds".
    with pytest.raises(TypeError, match=rf"axis_name={bad!r} must be a mesh axis name \(a str"):
        op(X, W, bad, mesh=tp_mesh(4))
    with pytest.raises(TypeError, match=rf"axis_name={bad!r} must be a mesh axis name"):
        op(X, W, bad)


@pytest.mark.parametrize("op", [jo.ag_matmul, jo.matmul_rs])
def test_mesh_of_the_wrong_type_is_named_inside_shard_map_too(op):
    with pytest.raises(TypeError, match="mesh='tp' must be a jax.sharding.Mesh"):
        op(X, W, "tp", mesh="tp")
    with pytest.raises(TypeError, match="mesh='tp' must be a jax.sharding.Mesh"):
        _inside(lambda x, w: op(x, w, "tp", mesh="tp"))(X, W)


@pytest.mark.parametrize("op", [jo.ag_matmul, jo.matmul_rs, jo.matmul_ar])
@pytest.mark.parametrize("x_shape,w_shape", [((0, 4), (4, 8)), ((8, 0), (0, 8)),
                                             ((4, 0, 4), (4, 8)), ((0, 0), (0, 8))],
                         ids=["no_rows", "no_k", "empty_batch", "nothing"])
def test_an_empty_operand_gives_the_empty_sum_on_every_impl(op, x_shape, w_shape):
    """No rows (or no batch): an empty y; K = 0: y of zeros (the empty sum), as x @ w gives;
    not XLA's verifier error (xla), a ZeroDivisionError (ring) or a runtime error (native).
    Global arrays, and inside shard_map (each rank's rows by the op's rule)."""
    x, w = jnp.ones(x_shape), jnp.ones(w_shape)
    want = np.ones(x_shape) @ np.ones(w_shape)
    n = 4
    local_rows = {"ag_matmul": n, "matmul_rs": 1, "matmul_ar": 1}[op.__name__]
    for impl in ("xla", "ring", "native"):
        y = op(x, w, "tp", mesh=tp_mesh(n), impl=impl)
        assert y.shape == want.shape and not np.asarray(y).any()
        inside = jax.jit(jax.shard_map(lambda x, w, impl=impl: op(x, w, "tp", impl=impl),
                                       mesh=tp_mesh(n),
                                       in_specs=(P(), P()), out_specs=P(), check_vma=False))
        y = inside(x, w)
        rows = list(want.shape[:-1])
        rows[0] = rows[0] * local_rows if op is not jo.matmul_rs else rows[0] // n
        assert y.shape == (*rows, want.shape[-1]) and not np.asarray(y).any()


def test_a_zero_size_operand_is_named_before_fp8_scaling():
    """jaxoverlap.fp8 names it before computing a scale (the amax of nothing)."""
    from jaxoverlap import fp8

    with pytest.raises(ValueError, match=r"jaxoverlap.fp8.ag_matmul: x has a zero-size dim"):
        fp8.ag_matmul(jnp.ones((0, 64)), jnp.ones((64, 8)), "tp", mesh=tp_mesh(4))


def test_a_mesh_that_is_not_the_shard_maps_is_named():
    """Inside shard_map the op runs over the shard_map's mesh; a mesh= whose axis differs
    (another size, or no such axis) was ignored without a word."""
    for other in (tp_mesh(2), tp_mesh(4, name="model")):
        with pytest.raises(ValueError, match=r"mesh= has .* inside this shard_map axis_name "
                                             r"'tp' has 4 devices.*Drop mesh="):
            _inside(lambda x, w, other=other: jo.ag_matmul(x, w, "tp", mesh=other))(X, W)
    _inside(lambda x, w: jo.ag_matmul(x, w, "tp", mesh=tp_mesh(4)))(X, W)  # its own: fine
