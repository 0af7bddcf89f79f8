"""Global-array entry: wraps an op in ``shard_map`` when it is called outside one.

Global layouts (README, "The API on one screen"):

* ``ag_matmul``: x ``[.., S, .., K]`` sharded on ``axis`` over ``axis_name``,
  w ``[K, N]`` sharded on dim 1 -> y ``[.., S, .., N]`` sharded on its last dim.
* ``matmul_rs``: x ``[.., S, .., F]`` sharded on its last dim, w ``[F, N]``
  sharded on dim 0 -> y ``[.., S, .., N]`` sharded on ``axis``.
* ``matmul_ar``: x ``[.., S, .., F]`` sharded on its last dim, w ``[F, N]``
  sharded on dim 0 -> y ``[.., S, .., N]`` replicated over ``axis_name``.

Mesh axes that x carries on its other dims (data parallel on a batch dim) pass
through to y. Under ``Explicit`` mesh axes the inputs are resharded to these
layouts first (``shard_map`` checks rather than reshards there); under ``Auto``
axes ``shard_map`` reshards by itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxoverlap._compat import context_mesh


def resolve_mesh(op: str, axis_name: Any, mesh: Any, *arrays: Any) -> Mesh | AbstractMesh:
    """The mesh to run on: ``mesh=``, then ``jax.set_mesh``'s, then the inputs' own."""
    if mesh is not None and not isinstance(mesh, (Mesh, AbstractMesh)):
        raise TypeError(f"{op}: mesh={mesh!r} must be a jax.sharding.Mesh (or None).")
    if mesh is None:
        mesh = context_mesh()
    if mesh is None:
        for a in arrays:
            sharding = _sharding_of(a)
            if isinstance(sharding, NamedSharding) and not sharding.mesh.empty:
                mesh = sharding.mesh
                break
    if mesh is None:
        raise ValueError(
            f"{op}: axis_name {axis_name!r} is not bound here and no mesh is known. Call {op} "
            f"inside jax.shard_map over {axis_name!r}, pass mesh=..., set one with "
            "jax.set_mesh(mesh), or give inputs placed with a NamedSharding."
        )
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"{op}: axis_name {axis_name!r} is not an axis of the mesh (its axes: "
            f"{tuple(mesh.axis_names)}). Pass the name of the tensor-parallel mesh axis."
        )
    return mesh


def _sharding_of(a: Any):
    if isinstance(a, jax.core.Tracer):
        try:
            return jax.typeof(a).sharding
        except Exception:  # noqa: BLE001 - a tracer without a sharding type
            return None
    return getattr(a, "sharding", None)


def _entries(a: Any, mesh: Mesh | AbstractMesh) -> list[Any]:
    """x's partition spec as one entry per dim (None where unknown or replicated)."""
    entries: list[Any] = [None] * a.ndim
    sharding = _sharding_of(a)
    if isinstance(sharding, NamedSharding) and set(sharding.mesh.axis_names) == set(
        mesh.axis_names
    ):
        for i, e in enumerate(tuple(sharding.spec)[: a.ndim]):
            entries[i] = e
    return entries


def _mentions(entry: Any, name: Any) -> bool:
    return entry == name or (isinstance(entry, tuple) and name in entry)


def _batch_entries(op: str, x: Any, mesh, axis_name, axis: int) -> list[Any]:
    """Keeps the other mesh axes x has on its pass-through dims; frees ``axis`` and the last."""
    entries = _entries(x, mesh)
    for d, e in enumerate(entries):
        if d in (axis, x.ndim - 1):
            entries[d] = None
        elif _mentions(e, axis_name):
            entries[d] = None  # resharded onto `axis` / the last dim below
    return entries


def _is_explicit(mesh) -> bool:
    types = getattr(mesh, "axis_types", ())
    return bool(types) and all(t == AxisType.Explicit for t in types)


def _place(a: Any, mesh, spec: P):
    if _is_explicit(mesh):
        return jax.reshard(a, NamedSharding(mesh, spec))
    return a


def _check_divisible(op: str, name: str, size: int, n: int, axis_name: Any, what: str) -> None:
    if size % n:
        raise ValueError(
            f"{op}: {name} has {size} {what}, not divisible by the size {n} of mesh axis "
            f"{axis_name!r}. Pad it to a multiple of {n} or use a mesh axis that divides it."
        )


def ag_matmul_global(local_op: Callable, x, w, axis_name, axis: int, return_gathered: bool, mesh):
    op = "ag_matmul"
    n = mesh.shape[axis_name]
    _check_divisible(op, f"x.shape[{axis}]", x.shape[axis], n, axis_name, "rows on `axis`")
    _check_divisible(op, "w.shape[1]", w.shape[1], n, axis_name, "columns")
    batch = _batch_entries(op, x, mesh, axis_name, axis)
    x_spec = P(*[axis_name if d == axis else e for d, e in enumerate(batch)])
    w_spec = P(None, axis_name)
    y_spec = P(*batch[:-1], axis_name)
    g_spec = P(*batch)
    out_specs = (y_spec, g_spec) if return_gathered else y_spec
    # The gathered x is the same on every rank of `axis_name`, but the type
    # system cannot prove it for a gather built from ppermutes or a custom call,
    # so that output is declared replicated with the check off.
    fn = jax.shard_map(local_op, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_specs,
                       check_vma=not return_gathered)
    return fn(_place(x, mesh, x_spec), _place(w, mesh, w_spec))


def matmul_rs_global(local_op: Callable, x, w, axis_name, axis: int, mesh):
    op = "matmul_rs"
    n = mesh.shape[axis_name]
    _check_divisible(op, f"x.shape[{axis}]", x.shape[axis], n, axis_name, "rows on `axis`")
    _check_divisible(op, "x.shape[-1]", x.shape[-1], n, axis_name, "contraction features")
    batch = _batch_entries(op, x, mesh, axis_name, axis)
    x_spec = P(*batch[:-1], axis_name)
    w_spec = P(axis_name, None)
    y_spec = P(*[axis_name if d == axis else e for d, e in enumerate(batch)])
    fn = jax.shard_map(local_op, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=y_spec)
    return fn(_place(x, mesh, x_spec), _place(w, mesh, w_spec))


def matmul_ar_global(local_op: Callable, x, w, axis_name, mesh):
    op = "matmul_ar"
    n = mesh.shape[axis_name]
    _check_divisible(op, "x.shape[-1]", x.shape[-1], n, axis_name, "contraction features")
    batch = _batch_entries(op, x, mesh, axis_name, x.ndim - 1)
    x_spec = P(*batch[:-1], axis_name)
    w_spec = P(axis_name, None)
    y_spec = P(*batch)  # the last dim free: y is the same on every rank of axis_name
    fn = jax.shard_map(local_op, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=y_spec)
    return fn(_place(x, mesh, x_spec), _place(w, mesh, w_spec))
