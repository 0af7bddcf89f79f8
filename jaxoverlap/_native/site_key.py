"""A native call's site key: what the call is, computed where it lowers, the same in every process.

Processes of a multi-controller job find a call site's peers by its key (the host executor's
directory of call sites in shared memory, the agreement check of both executors,
``cpp/core/call.h`` ``CallSite``). A key taken from a per-process counter would follow the order
in which each process compiled things, so one process's extra compile (the chief alone lowering
an eval step to log its memory, a background thread, two functions compiled in another order)
would shift every later site. The key is a hash of

* the lowered module's name and the call's name stack (which program, where in it),
* the call's clique key (mesh, axis, transport, rank table) and its attributes,
* the types of x and w and of the results (y's dtype, an x_gathered),
* where w comes from (:func:`provenance`: the computation that makes it, op by op back to
  the program's parameters), so that calls alike in everything else — the Q, K and V
  projections of one input, whose kernels are different parameters, forward and backward —
  are told apart by the weight they multiply, not by the order a process traced them in (a
  loop over a ``set`` runs in another order in every process: Python's hash seed). Not x's:
  a backward pass builds the same cotangent differently when the forward pass added its
  terms in another order, so x's provenance would follow that order,
* and, where calls are alike in all of the above (one weight applied to several inputs),
  where x comes from too, and the call's ordinal among the calls with the same x (they compute
  the same thing). A module with such calls is keyed again once it is whole (``_settle``, on
  JAX's monitoring event that the module is lowered, before it compiles): while a function's
  body lowers, its caller does not exist yet, so a parameter of it is known only by its place,
  which for a ``shard_map``'s cotangents follows the trace; the whole module traces every
  value back to the program's parameters, whose places are the pytree's (a dict flattens in
  sorted key order), so a loop over a ``set`` pairs its calls by what they multiply. Where the
  event does not come (a module lowered outside ``jit``), the first alike call keeps the key
  of what it is and the next ones carry x's provenance as it was while they lowered,

none of which depends on what else a process compiled. The native primitive's lowering is not
cached by JAX (``cacheable=False`` where it is registered), so every call of a program gets its
own key. What JAX still lowers once and XLA repeats (a nested jit called twice) carries one
key; the C++ side tells those instances apart in the order XLA instantiates them.
"""

from __future__ import annotations

import hashlib
import re
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax._src.interpreters import mlir

from jaxoverlap._native.attributes import SCHEMA
from jaxoverlap._native.call_order import order_calls

ir = mlir.ir

_lock = threading.RLock()
# Per module being lowered (the MLIR module of its ModuleContext, which every rule context of
# that lowering shares): its native calls so far. Weakly keyed: they live and die with it.
_lowerings: weakref.WeakKeyDictionary[Any, _Lowering] = weakref.WeakKeyDictionary()
# Per module being lowered: the provenance digest of every value met so far.
_digests: weakref.WeakKeyDictionary[Any, dict[Any, bytes]] = weakref.WeakKeyDictionary()
# What a native call computes, of its backend config: not its site key or timeout.
_COMPUTES = frozenset(a.name for a in SCHEMA if a.names_site and a.value is not None)
_CALLERS = "callers"  # the memo's entry for: function name -> the func.call ops calling it
# JAX records it on the lowering thread once a program's module is whole, before it compiles
# (jax/_src/interpreters/pxla.py, around ``mlir.lower_jaxpr_to_module``).
_MODULE_DONE = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_thread = threading.local()  # .pending: the modules this thread lowers with alike calls


def _module_name(module_context: Any) -> str:
    attributes = module_context.module.operation.attributes
    if "sym_name" not in attributes:
        return ""
    return mlir.ir.StringAttr(attributes["sym_name"]).value


class _Lowering:
    """The native calls of one module being lowered: by the key each was lowered with, what
    names it (less w's provenance), the positions of its operands that name it, tell it
    apart and can be made to wait for another call, and whom to tell of a new key; how many
    calls each description and (description, input provenance) has had so far."""

    def __init__(self) -> None:
        self.calls: dict[int, tuple[tuple[Any, ...], Sequence[int], Sequence[int],
                                    int | None, Callable[[int], None]]] = {}
        self.seen: dict[tuple[bytes, bytes], int] = {}
        self.alike = False  # some description has several calls

    def keyed(self, digest: bytes, source: bytes) -> int:
        """The key of the next call of ``digest`` whose input's provenance is ``source``
        (b"": a lone call's): calls with the same input compute the same thing, told apart
        by their order."""
        ordinal = self.seen.get((digest, source), 0)
        self.seen[digest, source] = ordinal + 1
        return _key(digest, source, ordinal)


def lower_keyed(ctx: Any, naming: dict[str, Any], operands: Sequence[Any],
                names: Sequence[int], tells: Sequence[int], after: int | None,
                emit: Callable[[int], Sequence[Any]],
                note: Callable[[int], None]) -> Sequence[Any]:
    """Lowers the native call in ``ctx`` with its site key (a nonzero signed 64-bit int):
    ``emit(key)`` makes the custom call and returns its results.

    ``naming``: everything the call is besides where it lowers and its types, its clique key
    among them (``attributes.naming``: op, axis, transport, chunks, ...; not its timeout, which
    a process may set differently); ``operands``: the custom call's MLIR operands; ``names``:
    the positions of those whose provenance names the call (the native lowering gives w's);
    ``tells``: of those whose provenance tells apart calls alike in all of that (x's);
    ``after``: the position of an operand that can be made to depend on another call, to put
    the calls of a block in one order (``call_order``; the host calls' coords), or None;
    ``note(key)``: told of every key the call is given.

    A lone call is keyed by what it is, and so is the first of alike calls (one weight on
    several inputs) while it lowers; the next ones also by their input's provenance. Once the
    whole module is lowered, a module with alike calls is keyed again (:func:`_settle`).
    """
    avals = tuple((tuple(a.shape), str(a.dtype)) for a in (*ctx.avals_in[:2], *ctx.avals_out))
    described = (_module_name(ctx.module_context), str(ctx.name_stack), avals,
                 sorted((k, repr(v)) for k, v in naming.items()))
    digest = _describe(described, provenance(ctx, [operands[i] for i in names]))
    module = ctx.module_context.module
    with _lock:
        lowering = _lowerings.setdefault(module, _Lowering())
        key = lowering.keyed(digest, b"")
        if key != _key(digest, b"", 0):  # a second or later alike call
            key = lowering.keyed(digest, provenance(ctx, [operands[i] for i in tells]))
            if not lowering.alike:
                lowering.alike = True
                pending = getattr(_thread, "pending", None)
                if pending is None:
                    pending = _thread.pending = weakref.WeakSet()
                pending.add(module)
        lowering.calls[key] = (described, names, tells, after, note)
    note(key)
    return emit(key)


def _settle(module: Any) -> None:
    """Keys again every native call of ``module``, now whole: by what it is, and where several
    calls are alike (one weight on several inputs), by their input's provenance too — through
    every function's caller, which is made only after the function's body lowered, and through
    the functions JAX inlined. The same in every process, whatever order each traced the calls
    in: a ``shard_map``'s cotangents come in the trace's order, and only the caller says which
    is which."""
    with _lock:
        lowering = _lowerings.pop(module, None)
        _digests.pop(module, None)  # the callers are all made now: walk afresh
    if lowering is None:
        return
    found = []  # (op, *its entry in lowering.calls) of every native call of the module, in order
    stack = [module.operation]
    while stack:
        op = stack.pop()
        for region in reversed(op.regions):
            for block in reversed(list(region.blocks)):
                stack.extend(reversed(list(block.operations)))
        if "mhlo.backend_config" in op.attributes and "call_target_name" in op.attributes:
            config = op.attributes["mhlo.backend_config"]
            if _is(config, ir.DictAttr) and "site_key" in ir.DictAttr(config):
                key = ir.IntegerAttr(ir.DictAttr(config)["site_key"]).value
                if key in lowering.calls:
                    found.append((op, *lowering.calls[key]))
    def of(op: Any, positions: Sequence[int]) -> bytes:
        return _provenance(module, [list(op.operands)[i] for i in positions])

    digests = [_describe(described, of(op, names)) for op, described, names, _, _, _ in found]
    counts: dict[bytes, int] = {}
    for digest in digests:
        counts[digest] = counts.get(digest, 0) + 1
    settled = _Lowering()
    blocks: list[tuple[Any, list[tuple[Any, int, int | None]]]] = []  # each block's calls
    for (op, _, _, tells, after, note), digest in zip(found, digests, strict=True):
        source = of(op, tells) if counts[digest] > 1 else b""
        key = settled.keyed(digest, source)
        _set_key(op, key)
        note(key)
        block = op.operation.block
        mine = next((calls for b, calls in blocks if b == block), None)
        if mine is None:
            blocks.append((block, mine := []))
        mine.append((op, key, after))
    for _, calls in blocks:
        order_calls(calls)


def _on_event(event: str, duration: float, **kwargs: Any) -> None:
    """JAX's monitoring hook: a module was lowered on this thread; its alike calls settle."""
    if event != _MODULE_DONE:
        return
    pending = getattr(_thread, "pending", None)
    while pending:
        _settle(pending.pop())


jax.monitoring.register_event_duration_secs_listener(_on_event)


def _describe(described: tuple[Any, ...], source: bytes) -> bytes:
    return hashlib.blake2b(repr((*described, source.hex())).encode(), digest_size=16).digest()


def _key(digest: bytes, source: bytes, ordinal: int) -> int:
    key_bytes = hashlib.blake2b(digest + source + ordinal.to_bytes(8, "little"),
                                digest_size=8).digest()
    return int.from_bytes(key_bytes, "little", signed=True) or 1


def _set_key(op: Any, key: int) -> None:
    """Sets the site key in the backend config of the custom call ``op``."""
    config = ir.DictAttr(op.attributes["mhlo.backend_config"])
    entries = {config[i].name: config[i].attr for i in range(len(config))}
    entries["site_key"] = ir.IntegerAttr.get(ir.IntegerAttr(entries["site_key"]).type, key)
    op.attributes["mhlo.backend_config"] = ir.DictAttr.get(entries, context=op.context)


# ---------------------------------------------------------------- where a value comes from


def provenance(ctx: Any, values: Sequence[Any]) -> bytes:
    """A digest of the computation that makes ``values`` (MLIR values of the module ``ctx``
    lowers), the same in every process that lowers the same program, whatever order it traced
    it in.

    A value is digested from how it is made: an op's name, its attributes and the digests of
    its operands; a parameter of a function by its place. Where the order of a list follows
    the trace (the operands and results of a ``shard_map``, which autodiff fills with
    residuals in the order it met them), the place in the list does not count: an argument of
    a region is the operand it brings in, a result of a ``shard_map`` or of a function call
    the value its body returns there. Locations are left out, and so is whatever a process
    numbers or names for itself: the id in a ``custom_partitioning`` call's backend config, the
    counter in a function's name, a native call's timeout (only its site key counts). Digests
    are kept per module, so the program is walked once however many calls ask.
    """
    return _provenance(ctx.module_context.module, values)


def _provenance(module: Any, values: Sequence[Any]) -> bytes:
    with _lock:
        memo = _digests.setdefault(module, {})
        return hashlib.blake2b(b"".join(_digest(v, memo, module) for v in values),
                               digest_size=16).digest()


def _digest(value: Any, memo: dict[Any, bytes], module: Any) -> bytes:
    stack = [value]
    while stack:
        v = stack[-1]
        if v in memo:
            stack.pop()
            continue
        node, deps = _node(v, module)
        missing = [d for d in deps if d not in memo]
        if missing:
            stack.extend(missing)
            continue
        stack.pop()
        memo[v] = hashlib.blake2b(node + b"".join(memo[d] for d in deps),
                                  digest_size=16).digest()
    return memo[value]


def _node(value: Any, module: Any) -> tuple[bytes, list[Any]]:
    """What makes ``value`` locally, and the values it is made from."""
    if isinstance(value, ir.BlockArgument):
        number = value.arg_number
        parent = value.owner.owner
        kind = parent.operation.name
        if kind == "func.func":
            name = ir.StringAttr(parent.attributes["sym_name"]).value
            callers = _callers(module).get(name, [])
            if len(callers) == 1:  # a function called once is its caller's operands
                return b"in a function called once", [list(callers[0].operands)[number]]
            return f"arg {_symbol(name)} {number}".encode(), []
        operands = list(parent.operands)
        brought = [operands[number]] if number < len(operands) else []
        return f"in {kind}".encode(), brought
    op = value.owner
    kind = op.operation.name
    result = ir.OpResult(value).result_number
    if kind == "sdy.manual_computation":
        returned = _returned(op, result)
        if returned is not None:
            return b"out sdy.manual_computation", [returned]
    if kind == "func.call":
        callee = _callee(module, op)
        returned = _returned(callee, result) if callee is not None else None
        if returned is not None:
            return f"call {_symbol(op.attributes['callee'])}".encode(), [returned,
                                                                         *op.operands]
    return f"{kind} {result} {_attributes(op)}".encode(), list(op.operands)


def _callers(module: Any) -> dict[str, list[Any]]:
    """Every function of ``module`` by name: the ``func.call`` ops that call it (walked once
    per module, then kept with its digests)."""
    memo = _digests.setdefault(module, {})
    if _CALLERS not in memo:
        found: dict[str, list[Any]] = {}
        stack = [module.operation]
        while stack:
            op = stack.pop()
            if op.operation.name == "func.call":
                found.setdefault(ir.FlatSymbolRefAttr(op.attributes["callee"]).value,
                                 []).append(op)
            for region in op.regions:
                for block in region.blocks:
                    stack.extend(block.operations)
        memo[_CALLERS] = found
    return memo[_CALLERS]


def _returned(op: Any, result: int) -> Any:
    """The value the body of ``op`` (a function, a shard_map) returns as its ``result``."""
    try:
        terminator = list(op.regions[0].blocks[0].operations)[-1]
        return list(terminator.operands)[result]
    except (IndexError, AttributeError):
        return None


def _callee(module: Any, call: Any) -> Any:
    try:
        name = ir.FlatSymbolRefAttr(call.attributes["callee"]).value
        return ir.SymbolTable(module.operation)[name]
    except (KeyError, ValueError, TypeError):
        return None


def _attributes(op: Any) -> str:
    target = ""
    if "call_target_name" in op.attributes:
        target = ir.StringAttr(op.attributes["call_target_name"]).value
    parts = []
    attributes = op.attributes
    for i in range(len(attributes)):
        named = attributes[i]          # a NamedAttribute (iteration gives names or pairs)
        name, attr = named.name, named.attr
        if name == "backend_config" and target.startswith("CustomSPMDPartitioning"):
            continue  # the id of a per-process Python object (JAX's target or _partitioner's)
        if target.startswith("jaxoverlap") and name == "mhlo.backend_config":
            config = ir.DictAttr(attr)  # what the call computes: not its site key or timeout
            parts.extend(f"{config[i].name}={config[i].attr}" for i in range(len(config))
                         if config[i].name in _COMPUTES)
            continue
        if name in ("callee", "sym_name"):
            parts.append(f"{name}={_symbol(attr)}")
        elif _is(attr, ir.DenseResourceElementsAttr):
            parts.append(f"{name}={attr.type}")  # the resource's name is a counter's
        elif _is(attr, ir.DenseElementsAttr):    # a constant's values: by digest
            parts.append(f"{name}={attr.type}:{_data_digest(attr)}")
        else:
            parts.append(f"{name}={attr}")
    return ";".join(parts)


def _is(attr: Any, kind: Any) -> bool:
    """Whether ``attr`` is a ``kind`` (MLIR's Python bindings downcast attributes, or offer
    ``kind.isinstance``, depending on their version)."""
    if isinstance(attr, kind):
        return True
    test = getattr(kind, "isinstance", None)
    return bool(test(attr)) if test is not None else False


def _data_digest(attr: Any) -> str:
    try:
        data = np.asarray(ir.DenseElementsAttr(attr)).tobytes()
    except (TypeError, ValueError, RuntimeError):  # a type NumPy lacks: its text
        data = str(attr).encode()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _symbol(attr: Any) -> str:
    """A function's name without the number JAX appends to tell same-named functions apart
    (``_where_3``): it counts what this process lowered first."""
    text = str(attr).strip('"@')
    return re.sub(r"_\d+$", "", text)
