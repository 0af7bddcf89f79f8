"""Bad fp8 input: each a clear error naming the argument and the fix, raised at trace time."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_close, rand, tp_mesh
from jax.sharding import PartitionSpec as P

import jaxoverlap as jo
from jaxoverlap import _plan, fp8
from jaxoverlap._executors import capabilities

E4 = jnp.float8_e4m3fn
ONE = jnp.float32(1.0)


@pytest.fixture(scope="module")
def arrays():
    return (rand(0, (8, 16), E4, scale=3.0), rand(1, (16, 8), E4, scale=3.0),
            rand(2, (16, 8), jnp.bfloat16, scale=3.0))


def _ag(x, w, **kw):
    return jo.ag_matmul(x, w, "tp", mesh=tp_mesh(2), impl="xla", **kw)


def test_a_missing_scale_is_named(arrays):
    x, w, w16 = arrays
    with pytest.raises(TypeError, match=r"x is float8_e4m3fn but x_scale is missing.*x_scale="):
        _ag(x, w, w_scale=ONE)
    with pytest.raises(TypeError, match=r"w is float8_e4m3fn but w_scale is missing"):
        _ag(x, w, x_scale=ONE)
    with pytest.raises(TypeError, match=r"w_scale is given but w is bfloat16"):
        _ag(x, w16, x_scale=ONE, w_scale=ONE)
    with pytest.raises(TypeError, match=r"x_scale is given but neither x nor w is fp8"):
        _ag(w16.T, w16, x_scale=ONE)


def test_a_scale_of_the_wrong_shape_or_dtype_is_named(arrays):
    x, w, _ = arrays
    with pytest.raises(TypeError, match=r"x_scale.dtype=bfloat16 must be float32.*astype"):
        _ag(x, w, x_scale=jnp.bfloat16(1), w_scale=ONE)
    with pytest.raises(ValueError, match=r"w_scale has shape \(2,\) but must be a scalar"):
        _ag(x, w, x_scale=ONE, w_scale=jnp.ones((2,), jnp.float32))
    with pytest.raises(TypeError, match=r"x_scale must be a float32 scalar array"):
        _ag(x, w, x_scale="1", w_scale=ONE)
    assert _ag(x, w, x_scale=1.0, w_scale=jnp.ones((1,), jnp.float32)).dtype == jnp.bfloat16


@pytest.mark.parametrize("bad", [2.0**200, float("inf"), float("nan"), -(10**40), 10**400])
def test_a_python_scale_float32_cannot_hold_is_named(arrays, bad):
    """A Python number beyond float32's range would become inf (nan: stays nan) without a
    word: refused by name."""
    x, w, _ = arrays
    with pytest.raises(ValueError, match=r"x_scale=.* is not a finite float32"):
        _ag(x, w, x_scale=bad, w_scale=ONE)


def test_precision_highest_and_output_dtypes(arrays):
    x, w, w16 = arrays
    with pytest.raises(ValueError, match=r"precision=HIGHEST.*fp8"):
        _ag(x, w, x_scale=ONE, w_scale=ONE, precision=jax.lax.Precision.HIGHEST)
    with pytest.raises(TypeError, match=r"preferred_element_type=.*float32, bfloat16 or "):
        _ag(x, w, x_scale=ONE, w_scale=ONE, preferred_element_type=E4)
    with pytest.raises(TypeError, match=r"preferred_element_type=float32 differs from x's "):
        _ag(w16.T, w16, preferred_element_type=jnp.float32)
    with pytest.raises(TypeError, match=r"float8_e4m3fnuz is not supported"):
        _ag(x.astype(jnp.float8_e4m3fnuz), w, x_scale=ONE, w_scale=ONE)
    with pytest.raises(TypeError, match=r"x.dtype=float32 and w.dtype=bfloat16 differ"):
        _ag(w16.T.astype(jnp.float32), w16)


def test_the_training_functions_say_what_they_take(arrays):
    x, w, w16 = arrays
    mesh = tp_mesh(2)
    with pytest.raises(TypeError, match=r"jaxoverlap.fp8.ag_matmul: x must be a float32, "
                                        r"bfloat16 or float16 array"):
        fp8.ag_matmul(x, w, "tp", mesh=mesh)
    with pytest.raises(TypeError, match=r"scaling=dict must be a jaxoverlap.fp8.DelayedScaling"):
        fp8.matmul_rs(w16.T, w16, "tp", scaling={}, mesh=mesh)
    bad = fp8.DelayedScaling.init(4)._replace(kernel_scale=jnp.ones((3,), jnp.float32))
    with pytest.raises(ValueError, match=r"scaling.kernel_scale has shape \(3,\)"):
        fp8.matmul_rs(w16.T, w16, "tp", scaling=bad, mesh=mesh)


def test_where_the_native_path_runs_fp8():
    """The host executor runs every fp8 pairing; on GPUs the CUDA executor's cuBLASLt FP8 GEMMs
    take two fp8 operands, not both e5m2, on sm_89+ (tested here on injected tables)."""
    E5, BF16 = jnp.float8_e5m2, jnp.bfloat16
    for x_dtype, w_dtype in ((E4, E4), (E4, BF16), (BF16, E4), (E5, E5), (E4, None)):
        assert capabilities.unavailable_reason("cpu", x_dtype, w_dtype) is None
    assert jo.info()["fp8"]["native"] == "available"
    hopper = {"devices": [{"ordinal": 0, "compute_capability": [9, 0]},
                          {"ordinal": 1, "compute_capability": [8, 9]}]}
    assert capabilities.gpu_fp8_reason(hopper, E4, E4) is None
    assert capabilities.gpu_fp8_reason(hopper, E5, E4) is None
    assert capabilities.gpu_fp8_reason(hopper, BF16, BF16) is None       # not fp8: no question
    mixed = capabilities.gpu_fp8_reason(hopper, E4, BF16)
    assert "two fp8 operands" in mixed and "bfloat16" in mixed and "impl='xla'" in mixed
    assert "two fp8 operands" in capabilities.gpu_fp8_reason(hopper, BF16, E5)
    assert "float8_e5m2 x float8_e5m2" in capabilities.gpu_fp8_reason(hopper, E5, E5)
    ampere = {"devices": [{"ordinal": 0, "compute_capability": [8, 0]},
                          {"ordinal": 1, "compute_capability": [9, 0]}]}
    reason = capabilities.gpu_fp8_reason(ampere, E4, E4)
    assert "GPU(s) [0] (sm_80)" in reason and "8.9" in reason and "impl='xla'" in reason
    assert capabilities.gpu_fp8_reason(ampere, E4, E4, devices=[1]) is None
    assert capabilities.gpu_fp8_reason({"devices": [], "error": "no GPU"}, E4) is None


def test_a_gpu_without_fp8_gemms_says_once_that_xla_dequantizes(monkeypatch, caplog, arrays):
    x, w, _ = arrays
    monkeypatch.setattr(capabilities, "current_platform", lambda: "cuda")
    monkeypatch.setattr(capabilities, "gpu_table", lambda: {
        "devices": [{"ordinal": 0, "compute_capability": [8, 0]}]})
    monkeypatch.setattr(_plan, "_fp8_dequantized_said", False)
    mesh = tp_mesh(2)

    def traced():
        jax.eval_shape(jax.shard_map(
            lambda x, w: jo.ag_matmul(x, w, "tp", impl="xla", x_scale=ONE, w_scale=ONE),
            mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")), x, w)

    with caplog.at_level(logging.WARNING, logger="jaxoverlap"):
        traced()
        traced()
    said = [r.getMessage() for r in caplog.records if "compute capability 8.9" in r.getMessage()]
    assert len(said) == 1 and "XLA dequantizes" in said[0], said


def test_the_fused_gemm_asked_for_with_fp8_names_what_it_is_compiled_for(arrays):
    """jo.config(fused=True) with fp8 operands: the fused GEMM is compiled for bfloat16 and
    float16 alike in x and w, for e4m3 x e4m3 with a bfloat16, float16 or float32 y and for
    e5m2 x e4m3 with a bfloat16 y (``_kinds.FUSED_FP8``), on rows of whole 16-byte units; every
    other call's error says what is compiled and names the way out (the chunked path)."""
    x, w, w16 = arrays
    w5 = w.astype(jnp.float8_e5m2)
    with jo.config(fused=True):
        with pytest.raises(jo.NativeUnavailableError,
                           match=r"compiled for .*e4m3fn -> bfloat16.*e4m3fn -> float16.*"
                                 r"e4m3fn -> float32.*not x float8_e4m3fn with "
                                 r"w float8_e5m2.*Drop fused"):
            jo.ag_matmul(x, w5, "tp", mesh=tp_mesh(2), impl="native", transport="p2p",
                         x_scale=ONE, w_scale=ONE)
        with pytest.raises(jo.NativeUnavailableError,
                           match=r"not x float8_e5m2 with w float8_e4m3fn and y float32"):
            jo.ag_matmul(x.astype(jnp.float8_e5m2), w, "tp", mesh=tp_mesh(2), impl="native",
                         transport="p2p", x_scale=ONE, w_scale=ONE,
                         preferred_element_type=jnp.float32)
        # e4m3 x e4m3 to float16 and float32 are built: y's 4 columns per rank are half a
        # float16 unit, refused as the rows' units only; a float32 unit, so that call runs the
        # fused program, the xla impl's result within float32's tolerance
        with pytest.raises(jo.NativeUnavailableError, match=r"must be multiples of 16 and 8"):
            jo.ag_matmul(x, w, "tp", mesh=tp_mesh(2), impl="native", transport="p2p",
                         x_scale=ONE, w_scale=ONE, preferred_element_type=jnp.float16)
        f32 = jax.jit(lambda x, w: jo.ag_matmul(
            x, w, "tp", mesh=tp_mesh(2), impl="native", transport="p2p", x_scale=ONE,
            w_scale=ONE, preferred_element_type=jnp.float32))
        assert "fused = true" in f32.lower(x, w).compile().as_text()
        y = f32(x, w)
    assert y.dtype == jnp.float32
    assert_close(y, _ag(x, w, x_scale=ONE, w_scale=ONE, preferred_element_type=jnp.float32),
                 jnp.float32)
    with jo.config(fused=True):
        # a built pairing, but x's rows (16 fp8 elements) are one 16-byte unit and w's 4
        # columns of bfloat16 y are not
        with pytest.raises(jo.NativeUnavailableError, match=r"must be multiples of 16 and 8"):
            jo.ag_matmul(x, w, "tp", mesh=tp_mesh(2), impl="native", transport="p2p",
                         x_scale=ONE, w_scale=ONE)
        with pytest.raises(jo.NativeUnavailableError, match=r"not x bfloat16 with w float8"):
            jo.ag_matmul(w16.T.astype(jnp.bfloat16), w, "tp", mesh=tp_mesh(2), impl="native",
                         transport="p2p", w_scale=ONE)
