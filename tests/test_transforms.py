"""The ops under JAX's transformations: jax.vmap (a batch of independent problems, e.g.
per-example gradients), every impl and native on every transport, against the float64
reference of each problem alone; second derivatives where an impl takes them, a clear error
where it does not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, f64, rand, spec_on, tp_mesh
from jax.sharding import AxisType

import jaxoverlap as jo
from jaxoverlap import _kinds

CASES = [("xla", None), ("ring", None),
         *(("native", t) for t in _kinds.names(_kinds.TRANSPORTS))]
OPS = {"ag_matmul": jo.ag_matmul, "matmul_rs": jo.matmul_rs, "matmul_ar": jo.matmul_ar}


def _kw(impl, transport):
    return dict(impl=impl) | ({"transport": transport} if transport else {})


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("impl,transport", CASES)
def test_vmap_on_global_arrays_is_each_problem_alone(op, impl, transport):
    """x batched (3 problems), w shared; then both batched, the batch dim of w not in front."""
    mesh = tp_mesh(4)
    x = rand(0, (3, 8, 16))
    w = rand(1, (16, 12))
    f = jax.jit(jax.vmap(lambda x: OPS[op](x, w, "tp", mesh=mesh, **_kw(impl, transport))))
    assert_close(f(x), np.einsum("bsk,kn->bsn", f64(x), f64(w)), jnp.float32)
    ws = rand(2, (16, 2, 12))  # two weights, batched on their middle dim
    g = jax.jit(jax.vmap(lambda x, w: OPS[op](x, w, "tp", mesh=mesh, **_kw(impl, transport)),
                         in_axes=(0, 1)))
    assert_close(g(x[:2], ws), np.einsum("bsk,kbn->bsn", f64(x[:2]), f64(ws)), jnp.float32)


@pytest.mark.parametrize("impl,transport", CASES)
def test_per_example_gradients_inside_shard_map(impl, transport):
    """vmap(grad) of an AG+GEMM -> GEMM+RS block inside the user's shard_map: each example's
    gradient of sum(y**2) / 2 is its own, d/dw1 = x^T (y w2^T), d/dw2 = h^T y."""
    n = 4
    mesh = tp_mesh(n)
    x = rand(3, (2, 8, 6))  # 2 examples of 8 rows, rows split over tp
    w1, w2 = rand(4, (6, 8)), rand(5, (8, 6))
    kw = _kw(impl, transport)

    def loss(w1, w2, x):
        h = jo.ag_matmul(x, w1, "tp", **kw)
        return 0.5 * jnp.sum(jo.matmul_rs(h, w2, "tp", **kw) ** 2)

    def per_example(w1, w2, x):  # each rank's gradients are of its own columns / rows
        return jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(None, None, 0))(w1, w2, x)

    f = jax.jit(jax.shard_map(
        per_example, mesh=mesh,
        in_specs=(spec_on(2, 1, "tp"), spec_on(2, 0, "tp"), spec_on(3, 1, "tp")),
        out_specs=(spec_on(3, 2, "tp"), spec_on(3, 1, "tp")), check_vma=False))
    g1, g2 = f(w1, w2, x)
    for b in range(2):
        xb = f64(x[b])
        h = xb @ f64(w1)
        y = h @ f64(w2)
        assert_close(g1[b], xb.T @ (y @ f64(w2).T), jnp.float32)
        assert_close(g2[b], h.T @ y, jnp.float32)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("impl", ["xla", "ring", "native"])
@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_second_derivatives_or_a_clear_error(op, impl, kind):
    """The Hessian of sum((x w)^2) / 2 in w is (x^T x) (x) I: from xla, and ring's AG and RS,
    over Explicit mesh axes; native's calls, ring's all-reduce and every call over Auto axes
    refuse it naming what takes it."""
    mesh = tp_mesh(4, kind=kind)
    x, w = rand(6, (8, 4)), rand(7, (4, 8))

    def f(w):
        return 0.5 * jnp.sum(OPS[op](x, w, "tp", mesh=mesh, impl=impl) ** 2)

    with jax.set_mesh(mesh):
        if kind == AxisType.Auto:
            with pytest.raises(NotImplementedError, match=rf"{op} on global arrays over Auto "
                               r"mesh axes is differentiable once .* over Explicit mesh axes"):
                jax.hessian(f)(w)
            return
        if impl == "native" or (impl == "ring" and op == "matmul_ar"):
            with pytest.raises(NotImplementedError, match=rf"{op} with impl='{impl}' is "
                               r"differentiable once .* use impl='xla'"):
                jax.hessian(f)(w)
            return
        h = jax.jit(jax.hessian(f))(w)
    want = np.einsum("ik,jl->ijkl", f64(x).T @ f64(x), np.eye(8))  # d2f / dw_ij dw_kl
    assert_close(h, want, jnp.float32)
