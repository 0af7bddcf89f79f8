"""Shared pieces of the Flax layer tests: their meshes and shapes, and the equivalence check
(the meshes, inputs and placement themselves are ``helpers``').

The check compares a tensor-parallel model with the same model built from
``nn.Dense`` / ``nnx.Linear`` without any parallelism: outputs, loss, and the
gradients with respect to every parameter *and the input* (a missing all-reduce
in the backward pass of Megatron's f only shows in the input's gradient).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from helpers import dp_tp_mesh, f64, tp_mesh
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

B, S, H, F = 4, 8, 8, 32   # batch, sequence, model width, hidden width (F/4 = 8 per tp rank)

TOLERANCE = {
    jnp.dtype(jnp.float32): 1e-5,
    jnp.dtype(jnp.bfloat16): 2e-2,
}

MESHES = ("dp2_tp4_explicit", "tp4_auto")


def mesh_named(name: str) -> Mesh:
    """The mesh a test case names: dp=2 x tp=4 with Explicit axes (jax.make_mesh's default in
    jax 0.12) or Auto ones, or tp=4 Auto."""
    if name == "dp2_tp4_explicit":
        return dp_tp_mesh(AxisType.Explicit)
    if name == "dp2_tp4_auto":
        return dp_tp_mesh()
    if name == "tp4_auto":
        return tp_mesh(4)
    raise ValueError(name)


def x_spec(mesh: Mesh, sequence_parallel: bool) -> P:
    """How a batch-first input [B, S, H] arrives: dp on B if the mesh has it, tp on S if SP."""
    dp = "dp" if "dp" in mesh.axis_names else None
    return P(dp, "tp" if sequence_parallel else None, None)


def loss_of(y, target):
    """A loss that weights every output differently, so no error can cancel out."""
    return jnp.mean((y.astype(jnp.float32) - target) ** 2)


def to_numpy(tree: Any) -> Any:
    return jax.tree.map(f64, tree)


def assert_tree_close(actual: Any, expected: Any, dtype, what: str) -> None:
    """Leaf-wise comparison with the dtype's tolerance, scaled by each leaf's magnitude."""
    actual, expected = to_numpy(actual), to_numpy(expected)
    a_leaves, a_def = jax.tree.flatten(actual)
    e_leaves, e_def = jax.tree.flatten(expected)
    assert a_def == e_def, f"{what}: tree structures differ: {a_def} vs {e_def}"
    tol = TOLERANCE[jnp.dtype(dtype)]
    for path, a, e in zip(jax.tree_util.tree_flatten_with_path(expected)[0], a_leaves, e_leaves,
                          strict=True):
        assert a.shape == e.shape, f"{what} {jax.tree_util.keystr(path[0])}: shape {a.shape} " \
                                   f"!= {e.shape}"
        atol = tol * max(1.0, float(np.abs(e).max(initial=0.0)))
        np.testing.assert_allclose(a, e, rtol=tol, atol=atol,
                                   err_msg=f"{what} {jax.tree_util.keystr(path[0])}")


def assert_equivalent(parallel: tuple, reference: tuple, dtype=jnp.float32) -> None:
    """``(y, loss, grads)`` of the parallel model against those of the reference."""
    y, loss, grads = parallel
    y_ref, loss_ref, grads_ref = reference
    assert_tree_close(y, y_ref, dtype, "output")
    assert_tree_close(loss, loss_ref, dtype, "loss")
    assert_tree_close(grads, grads_ref, dtype, "gradient")
