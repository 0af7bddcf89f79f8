"""Reading a compiled (SPMD-partitioned) HLO module: its matmul FLOPs and its collectives.

Used by the tests that check what runs on each device: the FLOPs of every
``dot`` (from its output shape and its operands' contracting dims), and, for
every collective, the mesh axes its replica groups span. Replica groups come in
three spellings in XLA's text: explicit ``{{0,1},{2,3}}``, iota
``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)``, and ``mesh['axis_0'=2,...] {'axis_1'}``.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

_SHAPE = r"[a-z0-9]+\[[0-9,]*\]"
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|" + _SHAPE + r")\S*\s+([\w\-]+)\(")
_PARAM = re.compile(r"([\w.\-]+):\s*(" + _SHAPE + ")")
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def _dims(shape: str) -> tuple[int, ...]:
    inside = shape[shape.index("[") + 1: shape.index("]")]
    return tuple(int(d) for d in inside.split(",") if d)


def _shapes(text: str) -> dict[str, str]:
    """Every instruction's (and computation parameter's) result shape, by name."""
    shapes: dict[str, str] = {}
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m:
            shapes[m.group(1)] = m.group(2)
        elif "->" in line and "(" in line:      # a computation's signature
            for name, shape in _PARAM.findall(line.split("->")[0]):
                shapes.setdefault(name, shape)
    return shapes


def dot_flops(text: str) -> int:
    """2·M·N·K summed over every ``dot`` of the module (per device, after partitioning)."""
    shapes = _shapes(text)
    total = 0
    for line in text.splitlines():
        m = _INSTR.match(line)
        if not m or m.group(3) != "dot":
            continue
        out = _dims(m.group(2))
        lhs = re.search(r"dot\(%?([\w.\-]+)", line).group(1)
        contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", line).group(1)
        lhs_dims = _dims(shapes[lhs])
        k = math.prod(lhs_dims[int(d)] for d in contracting.split(",") if d)
        total += 2 * math.prod(out) * k
    return total


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str
    shape: str
    groups: tuple[tuple[int, ...], ...]
    line: str


def _iota_groups(spec: str) -> tuple[tuple[int, ...], ...]:
    m = re.match(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", spec)
    group_shape = [int(d) for d in m.group(1).split(",")]
    reshape = [int(d) for d in m.group(2).split(",")]
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    if m.group(3):
        ids = ids.transpose([int(d) for d in m.group(3).split(",")])
    return tuple(tuple(int(i) for i in g) for g in ids.reshape(group_shape))


def _mesh_groups(spec: str) -> tuple[tuple[int, ...], ...]:
    axes = re.findall(r"'(\w+)'=(\d+)", spec[: spec.index("]") + 1])
    names = [a for a, _ in axes]
    sizes = [int(s) for _, s in axes]
    chosen = re.findall(r"'(\w+)'", spec[spec.index("]") + 1:])
    ids = np.arange(math.prod(sizes)).reshape(sizes)
    keep = [names.index(c) for c in chosen]
    rest = [d for d in range(len(names)) if d not in keep]
    ids = ids.transpose(rest + keep).reshape(-1, math.prod(sizes[d] for d in keep))
    return tuple(tuple(int(i) for i in g) for g in ids)


def collectives(text: str) -> list[Collective]:
    found = []
    for line in text.splitlines():
        m = _INSTR.match(line)
        if not m or m.group(3) not in COLLECTIVES:
            continue
        op = m.group(3)
        if op == "collective-permute":
            pairs = re.search(r"source_target_pairs=\{(.*?)\}\}?,", line).group(1)
            groups = tuple(tuple(int(i) for i in p.split(","))
                           for p in re.findall(r"\{?(\d+,\d+)\}?", pairs))
        else:
            spec = re.search(r"replica_groups=(\{\{.*?\}\}|\{\}|mesh\[.*?\]\s*\{[^}]*\}|\[[^ ]*)",
                             line).group(1)
            if spec.startswith("{{"):
                groups = tuple(tuple(int(i) for i in g.split(","))
                               for g in re.findall(r"\{([0-9,]+)\}", spec))
            elif spec.startswith("mesh"):
                groups = _mesh_groups(spec)
            elif spec == "{}":
                groups = ()
            else:
                groups = _iota_groups(spec)
        found.append(Collective(op, m.group(2), groups, line.strip()))
    return found


def axes_spanned(groups, mesh) -> frozenset[str]:
    """The mesh axes along which the devices of one group differ.

    Replica groups name logical devices: positions in the program's device
    assignment, which is the mesh's devices in row-major order.
    """
    shape = tuple(mesh.devices.shape)
    coords = {int(np.ravel_multi_index(c, shape)): c for c in np.ndindex(shape)}
    axes = set()
    for g in groups:
        for a, b in zip(g, g[1:], strict=False):
            ca, cb = coords[a], coords[b]
            axes |= {mesh.axis_names[d] for d in range(len(ca)) if ca[d] != cb[d]}
    return frozenset(axes)


def elements(shape: str) -> int:
    """Elements of an array shape, or of the largest member of a tuple shape."""
    return max((math.prod(_dims(s)) for s in re.findall(_SHAPE, shape)), default=0)
