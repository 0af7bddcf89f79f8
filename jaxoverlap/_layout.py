"""Global layouts: where each op's global arrays live on the mesh, and how to get them there.

The package's layout API: the ops on global arrays (``ops``, ``_global``, ``_partition``) and
the Flax layers lay out their arrays with these names (``__all__``) and nothing else.

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

``matmul`` is Megatron's f around a plain matmul (``_megatron``); ``matmul_ar`` (the GEMM fused
with Megatron's g) is its transpose. Mesh axes that x carries on its pass-through dims (data
parallel on a batch dim) stay there in the outputs; the parameters are gathered onto this
layout (an FSDP axis on their other dim).

The mesh comes from ``mesh=``, else ``jax.set_mesh``'s, else the inputs' ``NamedSharding``
(:func:`resolve_mesh`); its axis types decide how a call runs (:func:`uses_propagation`,
``_global``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxoverlap import _kinds
from jaxoverlap._compat import context_mesh
from jaxoverlap._fp8_dtypes import BLOCK
from jaxoverlap._plan import AG, AR, RS

__all__ = [
    "AG", "AR", "F", "RS", "TRANSPOSE", "Call", "PerDevice", "check_shapes", "entry_axes",
    "find_mesh", "free_dims", "is_explicit", "layouts", "local_shapes", "open_layouts", "place",
    "resolve_mesh", "spec_entries", "uses_propagation", "without_axis",
]

F = "matmul"  # Megatron's f around a plain matmul: the kind without an op of its own
# Where each kind's global arrays are split (the ops' rows of _kinds, and f's).
LAYOUTS = {**{o.name: o.layout for o in _kinds.OPS}, F: _kinds.Layout(x=None, w=1, y="last")}
# The kind that computes each kind's input gradient (AG+GEMM <-> GEMM+RS, f <-> g).
TRANSPOSE = {**{o.name: o.transpose for o in _kinds.OPS},
             F: next(o.name for o in _kinds.OPS if o.transpose == F)}


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


class PerDevice(Protocol):
    """What a call runs on each device, on its local shards (``_local.LocalOp``), handed down
    by the caller. Hashable: it travels in a static argument and may be traced later, when XLA
    partitions the program."""

    @property
    def precision(self) -> Any: ...

    @property
    def out_dtype(self) -> str | None: ...

    def __call__(self, x, w, want_gathered: bool = False, scales: tuple = ()) -> Any: ...

    def planned(self, mesh, x, w) -> PerDevice: ...

    def transposed(self) -> PerDevice: ...

    def weight_grad(self, a, b, dtype) -> Any: ...


@dataclasses.dataclass(frozen=True)
class Call:
    """One call on global arrays, static and hashable: its layout, and what runs on each device.

    ``axis`` is the row dim of ``ag_matmul`` / ``matmul_rs`` (None for f/g); ``local`` is the
    per-device function (None where only the layout is asked for).
    """

    kind: str
    axis_name: str
    ndim: int
    axis: int | None = None
    local: PerDevice | None = None

    def transposed(self) -> Call:
        """The call computing this one's input gradient."""
        return dataclasses.replace(
            self, kind=TRANSPOSE[self.kind],
            local=self.local.transposed() if self.local is not None else None)


def without_axis(entry: Any, name: Any) -> Any:
    """A spec entry with mesh axis ``name`` removed."""
    if isinstance(entry, tuple):
        rest = tuple(a for a in entry if a != name)
        return rest if len(rest) > 1 else (rest[0] if rest else None)
    return None if entry == name else entry


def free_dims(call: Call) -> tuple[int, ...]:
    """x's dims that do not pass through: the row dim (ag/rs) and the contraction dim."""
    last, layout = call.ndim - 1, LAYOUTS[call.kind]
    return (call.axis, last) if "row" in (layout.x, layout.y) else (last,)


def layouts(call: Call, x_entries: tuple[Any, ...]) -> tuple[P, P, tuple[P, ...]]:
    """(x, w, outputs) specs: x's pass-through entries kept, ``axis_name`` where the kind puts it.

    ``ag_matmul`` has two outputs, y and the gathered x.
    """
    tp, last, row = call.axis_name, call.ndim - 1, call.axis
    free = free_dims(call)
    entries = list(x_entries)[: call.ndim] + [None] * (call.ndim - len(x_entries))
    keep = [None if d in free else without_axis(e, tp) for d, e in enumerate(entries)]

    def spec(split: str | None = None) -> P:
        """``tp`` on the row dim (``"row"``), the last (``"last"``), or nowhere."""
        return P(*[tp if (d == row and split == "row") or (d == last and split == "last")
                   else None if d in (row, last) else keep[d] for d in range(call.ndim)])

    layout = LAYOUTS[call.kind]
    w_spec = P(None, tp) if layout.w == 1 else P(tp, None)
    gathered = (spec(),) if call.kind in _kinds.names(_kinds.OPS, gathered=True) else ()
    return spec(layout.x), w_spec, (spec(layout.y), *gathered)


def open_layouts(call: Call) -> tuple[P, tuple[P, ...]]:
    """x's and the outputs' layouts with the pass-through dims left to propagation."""
    u = P.UNCONSTRAINED
    x_spec, _, out_specs = layouts(call, (None,) * call.ndim)
    free = free_dims(call)

    def reopen(spec: P) -> P:
        return P(*[e if d in free else u for d, e in enumerate(spec)])

    return reopen(x_spec), tuple(reopen(s) for s in out_specs)


def local_shapes(call: Call, x, w, mesh,
                 x_entries: tuple[Any, ...] | None = None) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The shards of ``x`` and ``w`` on each device of ``mesh``: each dim divided by the mesh
    axes the layouts put on it — ``axis_name`` where the kind splits it, and the other axes of
    ``x_entries`` (x's spec, :func:`spec_entries`) that x keeps on its pass-through dims
    (None: none, as under Auto axes before propagation has placed them)."""
    x_spec, w_spec, _ = layouts(call, (None,) * call.ndim if x_entries is None else x_entries)

    def shard(a, spec: P) -> jax.ShapeDtypeStruct:
        shape = tuple(s // math.prod(mesh.shape[n] for n in entry_axes(e))
                      for s, e in zip(a.shape, spec, strict=True))
        return jax.ShapeDtypeStruct(shape, a.dtype)

    return shard(x, x_spec), shard(w, w_spec)


def entry_axes(entry: Any) -> tuple[Any, ...]:
    """The mesh axes of one spec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _check_divisible(op: str, name: str, size: int, n: int, axis_name: Any, what: str) -> None:
    if size % n:
        raise ValueError(
            f"{op}: {name} has {size} {what}, not divisible by the size {n} of mesh axis "
            f"{axis_name!r}. Pad it to a multiple of {n} or use a mesh axis that divides it."
        )


def check_shapes(call: Call, x, w, mesh, block_scaled: bool = False) -> None:
    """The global shapes split evenly over ``axis_name`` where the layouts split them;
    ``block_scaled``: K's slices hold whole blocks of block scales (MXFP8, 32 elements)."""
    op, n, tp = call.kind, mesh.shape[call.axis_name], call.axis_name
    layout = LAYOUTS[call.kind]
    if block_scaled and layout.w != 1 and x.shape[-1] % (BLOCK * n):
        raise ValueError(
            f"{op}: x.shape[-1]={x.shape[-1]} contraction features split over the {n} ranks of "
            f"mesh axis {tp!r} must give each rank whole blocks of {BLOCK} (one block scale each, "
            f"MXFP8): pad K to a multiple of {BLOCK * n} with zeros.")
    if "row" in (layout.x, layout.y):
        _check_divisible(op, f"x.shape[{call.axis}]", x.shape[call.axis], n, tp, "rows on `axis`")
    if layout.w == 1:
        _check_divisible(op, "w.shape[1]", w.shape[1], n, tp, "columns")
    else:
        _check_divisible(op, "x.shape[-1]", x.shape[-1], n, tp, "contraction features")


# ---------------------------------------------------------------- placing arrays


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
