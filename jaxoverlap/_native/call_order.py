"""Native calls of one block start in one order in every process: by their site keys.

Calls over the same ranks must start in one order everywhere when a rank runs them one at a
time: XLA:CPU runs a program whose buffers are all small one thunk at a time, in the order of
its schedule, waiting for each asynchronous call before the next (and XLA:GPU enqueues a
device's calls in program order). The schedule follows the module, and the module follows the
order a process traced its calls in. A loop over a ``set`` traces them in another order in
every process (Python's hash seed): in the backward pass of one kernel applied to the results
of a set's kernels, each process feeds the alike calls' results to the next calls in its own
order, its schedule starts another one of those first, and each process waits there for peers
that wait in another.

So, in a module with alike calls (keyed by their input's provenance, ``site_key._settle``),
the host calls of each block are put in one order: by their *depth* (the most native calls on
a path of data into them, the same in every process: every process computes the same values)
and then by site key (the same in every process for the same call; calls alike in their input
too compute the same thing). Each call's ``coords`` operand is made to depend on the previous
call's result without changing a bit of it (:func:`_after`), so no schedule starts it first,
and the block's ops are sorted again so that every value is defined before it is used. A call's
depth exceeds that of every call it depends on, so the order extends the data's and makes no
cycle; ops with side effects keep their order. GPU calls have no ``coords`` operand and are
left in the order of the trace (docs/native.md §7).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax._src.interpreters import mlir
from jax._src.lib.mlir.dialects import hlo

ir = mlir.ir

_EFFECTS = ("stablehlo.send", "stablehlo.recv", "stablehlo.infeed", "stablehlo.outfeed",
            "stablehlo.after_all")


def order_calls(calls: Sequence[tuple[Any, int, int | None]]) -> None:
    """Chains the native calls ``calls`` ((op, site key, the position of its coords operand,
    or None), all in one block) in the order of (depth, key), and sorts their block so that it
    holds. Calls without coords (GPU calls): left as they are. Coords (int32[2]) are made to
    depend on the call before: x and w carry the provenance that names calls, and two integers
    cost nothing to pass on."""
    if len(calls) < 2 or any(after is None for _, _, after in calls):
        return
    block = calls[0][0].operation.block
    *ops, terminator = list(block.operations)   # the terminator stays last
    index = {op.operation: i for i, op in enumerate(ops)}
    producers = [_producers(op, index) for op in ops]
    # Ops with side effects keep their order: an edge from each to the next, counted as data
    # in the depth too, so that the chain below follows every path between calls (a call
    # feeding a print that precedes a callback feeding another call) and makes no cycle.
    effects = [i for i, op in enumerate(ops) if _has_effects(op)]
    for a, b in zip(effects, effects[1:], strict=False):
        producers[b] = sorted({*producers[b], a})
    native = {op.operation for op, _, _ in calls}
    level: list[int] = []                       # native calls on the longest path to op
    depth: dict[Any, int] = {}
    for i, op in enumerate(ops):                # SSA order: producers come first
        before = max((level[p] for p in producers[i]), default=0)
        if op.operation in native:
            depth[op.operation] = before
        level.append(before + (1 if op.operation in native else 0))
    # A call can wait only on a result with an element in it: a call whose results are all
    # empty is passed over as the one to wait on (the next call waits on the one before it).
    chain = sorted(calls, key=lambda c: (depth[c[0].operation], c[1]))
    pairs = []                                  # (call, the result the next call waits on)
    last = None
    for op, _, coords in chain:
        if last is not None:
            pairs.append((last, op, coords))
        filled = next((r for r in op.results if _size(r) > 0), None)
        if filled is not None:
            last = (op, filled)
    after: dict[int, list[int]] = {}            # extra edges: op -> ops that must follow it
    for (first, _), then, _ in pairs:
        after.setdefault(index[first.operation], []).append(index[then.operation])
    for i in _sorted(len(ops), producers, after):
        ops[i].operation.move_before(terminator)
    for (_, result), then, coords in pairs:
        with ir.InsertionPoint(then), then.location:
            gated = _after(list(then.operands)[coords], result)
        then.operands[coords] = gated


def _after(coords: Any, result: Any) -> Any:
    """``coords`` (int32[2]), bit for bit, but made from ``result`` (not empty) too: picked out
    of two copies of itself at offset 0 or 2, chosen by a bit of ``result``'s first element. XLA
    cannot fold this away (coords come from the device's partition id, not from a constant;
    x_scale, a constant, would be folded), and an ``optimization_barrier`` would not do:
    XLA:CPU removes barriers before it schedules (``OptimizationBarrierExpander``, early in its
    HLO pipeline)."""
    out = ir.RankedTensorType(result.type)
    rank = len(out.shape)
    i32 = ir.RankedTensorType.get([], ir.IntegerType.get_signless(32))
    element = hlo.SliceOp(result, [0] * rank, [1] * rank, [1] * rank).result
    scalar = hlo.ReshapeOp(ir.RankedTensorType.get([], out.element_type), element).result
    width = ir.FloatType(out.element_type).width
    bits = hlo.BitcastConvertOp(ir.RankedTensorType.get([], ir.IntegerType.get_signless(width)),
                                scalar).result
    one = hlo.ConstantOp(ir.DenseElementsAttr.get(np.array(1, np.int32), type=i32.element_type,
                                                  shape=[])).result
    bit = hlo.AndOp(hlo.ConvertOp(i32, bits).result, one).result
    offset = hlo.AddOp(bit, bit).result                # 0 or 2
    pair = hlo.ConcatenateOp([coords, coords], 0).result
    return hlo.DynamicSliceOp(pair, [offset], [2]).result


def _size(value: Any) -> int:
    return int(np.prod(ir.RankedTensorType(value.type).shape, dtype=np.int64))


def _producers(op: Any, index: dict[Any, int]) -> list[int]:
    """The ops of the block (by index) whose results ``op`` uses, in its own regions too."""
    found: set[int] = set()
    stack = [op.operation]
    while stack:
        o = stack.pop()
        for value in o.operands:
            owner = value.owner
            if isinstance(owner, ir.Block):     # a block argument: here or nested
                continue
            i = index.get(_in_block(owner.operation, index))
            if i is not None and index[op.operation] != i:
                found.add(i)
        for region in o.regions:
            for block in region.blocks:
                stack.extend(b.operation for b in block.operations)
    return sorted(found)


def _in_block(op: Any, index: dict[Any, int]) -> Any:
    """``op`` or the op of the block that holds it."""
    while op is not None and op not in index:
        parent = op.parent
        op = parent.operation if parent is not None else None
    return op


def _has_effects(op: Any) -> bool:
    name = op.operation.name
    if name in _EFFECTS:
        return True
    attributes = op.operation.attributes
    return (name == "stablehlo.custom_call" and "has_side_effect" in attributes
            and ir.BoolAttr(attributes["has_side_effect"]).value)


def _sorted(count: int, producers: list[list[int]], after: dict[int, list[int]]) -> list[int]:
    """A topological order of the block's ops: each after its producers and after the ops
    ``after`` puts before it; otherwise in the block's order."""
    needs = [len(p) for p in producers]
    users: list[list[int]] = [[] for _ in range(count)]
    for i, ps in enumerate(producers):
        for p in ps:
            users[p].append(i)
    for a, bs in after.items():
        for b in bs:
            users[a].append(b)
            needs[b] += 1
    ready = [i for i in range(count) if needs[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users[i]:
            needs[u] -= 1
            if needs[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != count:
        raise AssertionError("jaxoverlap: ordering the native calls of a block made a cycle")
    return order
