"""The ops' ``precision``: JAX's dot precision semantics on every impl, forward and backward.

What is checked is what each impl hands its compiler: the dots' precision in the lowered
program (xla, ring; both directions of autodiff), and the native call's ``tf32`` attribute
(whether the CUDA executor's float32 GEMMs may use TF32: at DEFAULT yes, at HIGHEST never).
What TF32 does to a float32 result is checked on the CUDA fake (tests/cuda/test_precision.py).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from helpers import rand, tp_mesh
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxoverlap as jo

N = 2
OPS = {  # op -> (x spec, w spec, out spec, x shape, w shape)
    "ag_matmul": (P("tp", None), P(None, "tp"), P(None, "tp"), (8, 6), (6, 4)),
    "matmul_rs": (P(None, "tp"), P("tp", None), P("tp", None), (8, 6), (6, 4)),
    "matmul_ar": (P(None, "tp"), P("tp", None), P(), (8, 6), (6, 4)),
}


def _lowered(op, impl, grad=False, **kw):
    xs, ws, out, xshape, wshape = OPS[op]
    fn = getattr(jo, op)
    extra = {"transport": "nccl"} if impl == "native" else {}
    body = jax.shard_map(lambda x, w: fn(x, w, "tp", impl=impl, **extra, **kw),
                         mesh=tp_mesh(N), in_specs=(xs, ws), out_specs=out)
    x, w = rand(0, xshape, jnp.float32), rand(1, wshape, jnp.float32)
    if grad:
        forward = body
        body = jax.grad(lambda x, w: jnp.sum(forward(x, w) ** 2), argnums=(0, 1))
    return jax.jit(body).lower(x, w).as_text()


def _dot_precisions(text: str) -> set[str]:
    """The precision of every dot in StableHLO text ("DEFAULT" where none is given)."""
    found = set()
    for line in text.splitlines():
        if "stablehlo.dot_general" in line:
            m = re.search(r"precision = \[(\w+), (\w+)\]", line)
            found.add(m.group(1) if m else "DEFAULT")
    return found


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("impl", ["xla", "ring"])
@pytest.mark.parametrize("precision", [lax.Precision.HIGHEST, "highest", "float32",
                                       (lax.Precision.HIGHEST, lax.Precision.HIGHEST)])
def test_every_dot_forward_and_backward_runs_at_the_precision_asked(op, impl, precision):
    for grad in (False, True):
        got = _dot_precisions(_lowered(op, impl, grad=grad, precision=precision))
        assert got == {"HIGHEST"}, (grad, got)


@pytest.mark.parametrize("op", list(OPS))
def test_none_defers_to_jax_default_matmul_precision(op):
    assert _dot_precisions(_lowered(op, "ring")) == {"DEFAULT"}
    with jax.default_matmul_precision("highest"):
        assert _dot_precisions(_lowered(op, "ring", grad=True)) == {"HIGHEST"}


def _tf32(text: str) -> set[bool]:
    return {v == "true" for v in re.findall(r"tf32 = (true|false)", text)}


@pytest.mark.parametrize("op", list(OPS))
def test_the_native_call_may_use_tf32_only_below_highest(op):
    assert _tf32(_lowered(op, "native")) == {True}  # DEFAULT: as XLA's own f32 dots on GPU
    assert _tf32(_lowered(op, "native", precision=lax.Precision.HIGH)) == {True}
    assert _tf32(_lowered(op, "native", precision="highest")) == {False}
    assert _tf32(_lowered(op, "native", grad=True, precision="highest")) == {False}
    with jax.default_matmul_precision("float32"):
        assert _tf32(_lowered(op, "native", grad=True)) == {False}


def test_tf32_is_never_asked_for_half_types():
    xs, ws, out, xshape, wshape = OPS["ag_matmul"]
    body = jax.shard_map(lambda x, w: jo.ag_matmul(x, w, "tp", impl="native", transport="nccl"),
                         mesh=tp_mesh(N), in_specs=(xs, ws), out_specs=out)
    text = jax.jit(body).lower(rand(0, xshape, jnp.bfloat16), rand(1, wshape, jnp.bfloat16))
    assert _tf32(text.as_text()) == {False}


def test_global_arrays_carry_the_precision():
    """Under Auto axes the per-device code is made while XLA compiles: read the compiled HLO."""
    mesh = tp_mesh(N)
    x = jax.device_put(rand(0, (8, 6), jnp.float32), jax.NamedSharding(mesh, P("tp", None)))
    w = jax.device_put(rand(1, (6, 4), jnp.float32), jax.NamedSharding(mesh, P(None, "tp")))
    for precision, want in (("highest", "{highest,highest}"), (None, None)):
        fn = jax.jit(lambda x, w, p=precision: jo.ag_matmul(x, w, "tp", impl="ring",
                                                             precision=p, mesh=mesh))
        dots = [line for line in fn.lower(x, w).compile().as_text().splitlines()
                if re.search(r"= \S+ dot\(", line)]
        assert dots
        for line in dots:
            got = re.search(r"operand_precision=(\{\w+,\w+\})", line)
            assert (got.group(1) if got else None) == want, line


@pytest.mark.parametrize("bad", ["tf64", 3, (lax.Precision.HIGHEST, lax.Precision.DEFAULT)])
def test_a_bad_precision_names_the_argument(bad):
    with pytest.raises(ValueError, match=r"ag_matmul: precision="):
        _lowered("ag_matmul", "xla", precision=bad)
