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
* and the call's ordinal among the native calls with all of the above in this lowering
  (the Q, K and V projections of one input differ only there),

none of which depends on what else a process compiled. The native primitive's lowering is not
cached by JAX (``cacheable=False`` where it is registered), so every call of a program gets its
own ordinal. What JAX still lowers once and XLA repeats (a nested jit called twice) carries one
key; the C++ side tells those instances apart in the order XLA instantiates them.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from typing import Any

from jax._src.interpreters import mlir

_lock = threading.Lock()
# Per module being lowered (the MLIR module of its ModuleContext, which every rule context of
# that lowering shares): how many calls with each description it has had so far. Weakly keyed,
# so the counts live and die with the module.
_ordinals: weakref.WeakKeyDictionary[Any, dict[bytes, int]] = weakref.WeakKeyDictionary()


def _module_name(module_context: Any) -> str:
    attributes = module_context.module.operation.attributes
    if "sym_name" not in attributes:
        return ""
    return mlir.ir.StringAttr(attributes["sym_name"]).value


def site_key(ctx: Any, naming: dict[str, Any]) -> int:
    """The site key of the native call lowering in ``ctx`` (a nonzero signed 64-bit int).

    ``naming``: everything the call is besides where it lowers and its types, its clique key
    among them (``attributes.naming``: op, axis, transport, chunks, ...; not its timeout, which
    a process may set differently).
    """
    avals = tuple((tuple(a.shape), str(a.dtype)) for a in (*ctx.avals_in[:2], *ctx.avals_out))
    described = repr((_module_name(ctx.module_context), str(ctx.name_stack), avals,
                      sorted((k, repr(v)) for k, v in naming.items())))
    digest = hashlib.blake2b(described.encode(), digest_size=16).digest()
    with _lock:
        counts = _ordinals.setdefault(ctx.module_context.module, {})
        ordinal = counts.get(digest, 0)
        counts[digest] = ordinal + 1
    key_bytes = hashlib.blake2b(digest + ordinal.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(key_bytes, "little", signed=True) or 1
