"""The few JAX internals whose spelling moved between the releases we support (>= 0.10.2)."""

from __future__ import annotations

import jax
from jax import lax
from jax.sharding import AbstractMesh, Mesh


def varying_axes(x) -> frozenset[str]:
    """The manual mesh axes along which ``x`` (a value or an abstract value) varies (empty
    outside shard_map or unchecked)."""
    aval = x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def with_varying(aval, axes: frozenset):
    """``aval`` varying over exactly ``axes`` (a primitive's result type under check_vma)."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return aval.update(manual_axis_type=mat.update(varying=frozenset(axes)))
    return aval.update(vma=frozenset(axes))


def check_vma_active() -> bool:
    """True while tracing the body of a shard_map with ``check_vma=True`` (JAX then tracks
    which values vary over which manual axes, and transposes collectives accordingly)."""
    from jax._src import config

    return bool(config._check_vma.value)


def match_varying(ct, primal_axes: frozenset):
    """Gives a cotangent the varying-axes type of its primal (``check_vma=True`` demands it).

    A cotangent varying over more axes than its primal is summed over the extra
    ones (a replicated weight's gradient is the sum of the per-device parts);
    one varying over fewer is marked varying, which moves no data.
    """
    extra = tuple(sorted(varying_axes(ct) - primal_axes))
    if extra:
        ct = lax.psum(ct, extra)
    missing = tuple(sorted(primal_axes - varying_axes(ct)))
    if missing:
        ct = lax.pcast(ct, missing, to="varying")
    return ct


def bound_axis_size(axis_name) -> int | None:
    """The size of ``axis_name`` if it is bound here (inside shard_map), else None."""
    try:
        return int(lax.axis_size(axis_name))
    except NameError:
        return None


def context_mesh() -> Mesh | AbstractMesh | None:
    """The mesh set with ``jax.set_mesh`` (concrete if possible), or None."""
    from jax._src import mesh as mesh_lib

    concrete = mesh_lib.get_concrete_mesh()
    if concrete is not None and not concrete.empty:
        return concrete
    abstract = mesh_lib.get_abstract_mesh()
    if abstract is not None and not abstract.empty:
        return abstract
    return None
