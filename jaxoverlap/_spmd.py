"""Global-array entry: runs an op on global arrays when it is called outside ``shard_map``.

Global layouts (``r`` the row dim ``axis``, ``..`` the pass-through dims,
``tp`` = ``axis_name``):

==================  ======================  ==============  =========================
kind                x                       w               y
==================  ======================  ==============  =========================
``ag_matmul``       ``[.., r:tp, k]``       ``[k, n:tp]``   ``[.., r, n:tp]``
``matmul_rs``       ``[.., r, f:tp]``       ``[f:tp, n]``   ``[.., r:tp, n]``
``matmul`` (f)      ``[.., k]``             ``[k, n:tp]``   ``[.., n:tp]``
``matmul_ar`` (g)   ``[.., f:tp]``          ``[f:tp, n]``   ``[.., n]``
==================  ======================  ==============  =========================

``matmul`` is Megatron's f around a plain matmul (``_megatron``); ``matmul_ar``
(the GEMM fused with Megatron's g) is its transpose. Mesh
axes that x carries on its pass-through dims (data parallel on a batch dim)
stay there in the outputs; the parameters are gathered onto this layout
(an FSDP axis on their other dim).

Two mechanisms, picked by the mesh's axis types:

* **Auto axes** (no Explicit or Manual axis; Shardy, JAX's default
  partitioner): the op is a ``custom_partitioning`` primitive (``_partition``)
  that takes part in sharding propagation, so a data or FSDP axis that only
  XLA knows about passes through.
* **Otherwise** (Explicit axes, whose types carry every layout): one
  ``shard_map`` whose specs come from x's type; the inputs are resharded to
  them first (``shard_map`` checks rather than reshards there).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxoverlap._compat import context_mesh
from jaxoverlap._config import Settings, current_config

AG, RS, F, G = "ag_matmul", "matmul_rs", "matmul", "matmul_ar"
# The kind that computes each kind's input gradient (AG+GEMM <-> GEMM+RS, f <-> g).
_TRANSPOSE = {AG: RS, RS: AG, F: G, G: F}


# ---------------------------------------------------------------- the mesh


def resolve_mesh(op: str, axis_name: Any, mesh: Any, *arrays: Any) -> Mesh | AbstractMesh:
    """The mesh to run on: ``mesh=``, then ``jax.set_mesh``'s, then the inputs' own."""
    found = find_mesh(op, mesh, *arrays)
    if found is None:
        raise ValueError(
            f"{op}: axis_name {axis_name!r} is not bound here and no mesh is known. Call {op} "
            f"inside jax.shard_map over {axis_name!r}, pass mesh=..., set one with "
            "jax.set_mesh(mesh), or give inputs placed with a NamedSharding."
        )
    if axis_name not in found.axis_names:
        raise ValueError(
            f"{op}: axis_name {axis_name!r} is not an axis of the mesh (its axes: "
            f"{tuple(found.axis_names)}). Pass the name of the tensor-parallel mesh axis."
        )
    return found


def find_mesh(op: str, mesh: Any, *arrays: Any) -> Mesh | AbstractMesh | None:
    """``mesh=``, else ``jax.set_mesh``'s, else the first input's NamedSharding mesh, else None."""
    if mesh is not None and not isinstance(mesh, (Mesh, AbstractMesh)):
        raise TypeError(f"{op}: mesh={mesh!r} must be a jax.sharding.Mesh (or None).")
    if mesh is None:
        mesh = context_mesh()
    if mesh is None:
        for a in arrays:
            sharding = _sharding_of(a)
            if isinstance(sharding, NamedSharding) and not sharding.mesh.empty:
                return sharding.mesh
    return mesh


def _sharding_of(a: Any):
    if isinstance(a, jax.core.Tracer):
        try:
            return jax.typeof(a).sharding
        except Exception:  # noqa: BLE001 - a tracer without a sharding type
            return None
    return getattr(a, "sharding", None)


def is_explicit(mesh) -> bool:
    types = getattr(mesh, "axis_types", ())
    return bool(types) and all(t == AxisType.Explicit for t in types)


def uses_propagation(mesh) -> bool:
    """Whether the op joins sharding propagation: every mesh axis Auto, Shardy on."""
    types = tuple(getattr(mesh, "axis_types", ()))
    return bool(jax.config.jax_use_shardy_partitioner) and all(t == AxisType.Auto for t in types)


# ---------------------------------------------------------------- the call and its layouts


@dataclasses.dataclass(frozen=True)
class Call:
    """One call on global arrays, static and hashable: what runs on each device, and the layout.

    ``axis`` is the row dim of ``ag_matmul`` / ``matmul_rs`` (None for f/g);
    ``op_args`` the op's own keyword arguments (impl, chunks, ...);
    ``precision`` the dot precision of f; ``settings`` and
    ``matmul_precision`` the ``jo.config`` and ``jax.default_matmul_precision``
    in force when the call was traced (the per-device function may be traced
    later, when XLA partitions the program).
    """

    kind: str
    axis_name: str
    ndim: int
    axis: int | None = None
    op_args: tuple[tuple[str, Any], ...] = ()
    precision: Any = None
    settings: Settings | None = None
    matmul_precision: str | None = None

    def transposed(self) -> Call:
        """The call computing this one's input gradient."""
        return dataclasses.replace(self, kind=_TRANSPOSE[self.kind])


def make_call(kind: str, axis_name: str, ndim: int, axis: int | None = None,
              precision: Any = None, **op_args: Any) -> Call:
    """A :class:`Call` that carries the settings in force now (trace time)."""
    if isinstance(precision, list):
        precision = tuple(precision)
    return Call(kind=kind, axis_name=axis_name, ndim=ndim, axis=axis,
                op_args=tuple(sorted(op_args.items())), precision=precision,
                settings=current_config(),
                matmul_precision=jax.config.jax_default_matmul_precision)


def without_axis(entry: Any, name: Any) -> Any:
    """A spec entry with mesh axis ``name`` removed."""
    if isinstance(entry, tuple):
        rest = tuple(a for a in entry if a != name)
        return rest if len(rest) > 1 else (rest[0] if rest else None)
    return None if entry == name else entry


def free_dims(call: Call) -> tuple[int, ...]:
    """x's dims that do not pass through: the row dim (ag/rs) and the contraction dim."""
    last = call.ndim - 1
    return (call.axis, last) if call.kind in (AG, RS) else (last,)


def layouts(call: Call, x_entries: tuple[Any, ...]) -> tuple[P, P, tuple[P, ...]]:
    """(x, w, outputs) specs: x's pass-through entries kept, ``axis_name`` where the kind puts it.

    ``ag_matmul`` has two outputs, y and the gathered x.
    """
    tp, last, row = call.axis_name, call.ndim - 1, call.axis
    free = free_dims(call)
    entries = list(x_entries)[: call.ndim] + [None] * (call.ndim - len(x_entries))
    keep = [None if d in free else without_axis(e, tp) for d, e in enumerate(entries)]

    def spec(at_row: Any = None, at_last: Any = None) -> P:
        return P(*[at_row if d == row else (at_last if d == last else keep[d])
                   for d in range(call.ndim)])

    if call.kind == AG:
        return spec(at_row=tp), P(None, tp), (spec(at_last=tp), spec())
    if call.kind == RS:
        return spec(at_last=tp), P(tp, None), (spec(at_row=tp),)
    if call.kind == F:
        return spec(), P(None, tp), (spec(at_last=tp),)
    return spec(at_last=tp), P(tp, None), (spec(),)


def _check_divisible(op: str, name: str, size: int, n: int, axis_name: Any, what: str) -> None:
    if size % n:
        raise ValueError(
            f"{op}: {name} has {size} {what}, not divisible by the size {n} of mesh axis "
            f"{axis_name!r}. Pad it to a multiple of {n} or use a mesh axis that divides it."
        )


def check_shapes(call: Call, x, w, mesh) -> None:
    """The global shapes split evenly over ``axis_name`` where the layouts split them."""
    op, n, tp = call.kind, mesh.shape[call.axis_name], call.axis_name
    if call.kind in (AG, RS):
        _check_divisible(op, f"x.shape[{call.axis}]", x.shape[call.axis], n, tp, "rows on `axis`")
    if call.kind in (AG, F):
        _check_divisible(op, "w.shape[1]", w.shape[1], n, tp, "columns")
    else:
        _check_divisible(op, "x.shape[-1]", x.shape[-1], n, tp, "contraction features")


# ---------------------------------------------------------------- the two mechanisms


def run(call: Call, mesh, x, w, *, want_gathered: bool = False):
    """``call`` on global ``x``, ``w`` over ``mesh``.

    Returns y, or (y, gathered x) for ``ag_matmul`` with ``want_gathered``.
    """
    check_shapes(call, x, w, mesh)
    if uses_propagation(mesh):
        from jaxoverlap import _partition

        return _partition.call(call, mesh, x, w, want_gathered=want_gathered)
    return _shard_mapped(call, mesh, x, w, want_gathered)


def local_op(call: Call, want_gathered: bool) -> Callable:
    """The op on local shards (``axis_name`` bound), as both mechanisms run it per device."""
    from jaxoverlap import _megatron, ops

    kw = dict(call.op_args, precision=call.precision)
    if call.kind == AG:
        return functools.partial(ops.ag_matmul, axis_name=call.axis_name, axis=call.axis,
                                 return_gathered=want_gathered, **kw)
    if call.kind == RS:
        return functools.partial(ops.matmul_rs, axis_name=call.axis_name, axis=call.axis, **kw)
    if call.kind == G:
        return functools.partial(ops.matmul_ar, axis_name=call.axis_name, **kw)
    # f (also the transpose of g, whose op_args it does not take): only the precision.
    return functools.partial(_megatron.copy_matmul, axis_name=call.axis_name,
                             precision=call.precision)


def spec_entries(a: Any, mesh: Mesh | AbstractMesh) -> tuple[Any, ...]:
    """a's partition spec as one entry per dim (None where unknown or replicated)."""
    sharding = _sharding_of(a)
    if isinstance(sharding, NamedSharding) and set(sharding.mesh.axis_names) == set(
        mesh.axis_names
    ):
        spec = tuple(sharding.spec)[: a.ndim]
        return spec + (None,) * (a.ndim - len(spec))
    return (None,) * a.ndim


def place(a: Any, mesh, spec: P):
    """``a`` laid out as ``spec``: resharded under Explicit axes, unchanged otherwise."""
    if is_explicit(mesh):
        return jax.reshard(a, NamedSharding(mesh, spec))
    return a


def _shard_mapped(call: Call, mesh, x, w, want_gathered: bool):
    x_spec, w_spec, out_specs = layouts(call, spec_entries(x, mesh))
    out = out_specs if want_gathered else out_specs[0]
    # The gathered x is the same on every rank of `axis_name`, but the type
    # system cannot prove it for a gather built from ppermutes or a custom call,
    # so that output is declared replicated with the check off.
    fn = jax.shard_map(local_op(call, want_gathered), mesh=mesh, in_specs=(x_spec, w_spec),
                       out_specs=out, check_vma=not want_gathered)
    return fn(place(x, mesh, x_spec), place(w, mesh, w_spec))

