"""The custom call's attributes: one schema, and the one function that makes them.

Every attribute the handlers bind is one entry of :data:`SCHEMA`, in the order of the C++
list that declares and decodes them (``JO_CALL_ATTRS`` in ``cpp/ffi/ffi_call.h``): its name,
its C++ type (the attribute is made with exactly that type: the decoding checks it) and how its
value comes from the call's plan (``_plan.OpPlan``), its description
(``_executors.call.NativeCall``: the transport decided and whether the call runs fused, the
clique key and the rank table) and x's abstract value — but for the site key, which the
lowering rule computes where the call lowers (``site_key``, from :func:`naming` and the
lowering context) and hands in. :func:`attributes` is the only place a value is made;
``tests/native/test_attributes.py`` holds the C++ list (``JO_CALL_ATTRS``) and docs/native.md
§6 to this schema. Adding an attribute is one entry here and one row of ``JO_CALL_ATTRS``.

A serialized program may be run by another version of the library: the first two attributes
say which schema the others were made with (:func:`schema_id`, a fingerprint of this list and
of the kinds whose ids they carry, ``_kinds``) and which version made them; the handlers check
the schema before they decode anything else (``ffi_call.h`` ``CheckSchema``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxoverlap import _kinds, _precision
from jaxoverlap._config import timeout_ms
from jaxoverlap._executors.call import NativeCall
from jaxoverlap._plan import OpPlan
from jaxoverlap._version import __version__

# The C++ member types an attribute may have, and how its Python value is made exactly so.
ENCODERS: dict[str, Callable[[Any], Any]] = {
    "int32_t": np.int32,
    "int64_t": np.int64,
    "bool": bool,
    "ffi::Span<const int64_t>": lambda v: np.asarray(v, np.int64),
    "std::string_view": str,
}


@dataclasses.dataclass(frozen=True)
class Attribute:
    """One attribute: its name, its C++ type in ``CallAttrs``, what it means (docs/native.md
    §6 says the same), and its value for a call (None: the site key, given).
    ``names_site``: part of what the call is, which its site key hashes — not the timeout, which
    a process may set differently, nor the rank table: the clique key names it, and a device of
    another process has no local ordinal here (JAX gives it none on CPU)."""

    name: str
    ctype: str
    meaning: str
    value: Callable[[OpPlan, NativeCall, Any], Any] | None
    names_site: bool = True


def _tf32(plan: OpPlan, x) -> bool:
    """May float32 GEMMs use TF32? The plan's precision allows it (the primitive is bound with
    its precision resolved, so JAX's default where the program lowers does not count) and x is
    float32."""
    return _precision.allows_tf32(plan.precision) and jnp.dtype(x.dtype) == jnp.float32


SCHEMA: tuple[Attribute, ...] = (
    Attribute("schema", "int64_t", "the schema the attributes were made with: a fingerprint of "
              "this list and of the kinds their values index (never another layout's)",
              lambda plan, call, x: schema_id(), names_site=False),
    Attribute("jaxoverlap", "std::string_view", "the version that lowered the call (the "
              "schema check's error names it)", lambda plan, call, x: __version__,
              names_site=False),
    Attribute("op", "int32_t", "the op: its id in the kinds' table (§8)",
              lambda plan, call, x: _kinds.op(plan.op).id),
    Attribute("clique_key", "int64_t", "the call's clique, the same in every process",
              lambda plan, call, x: call.clique_key),
    Attribute("site_key", "int64_t", "the call site: what the call is and where in its program, "
              "the same in every process (§4); never 0", None),
    Attribute("axis", "int64_t", "x's sharded row dim (matmul_ar: 0; its rows are all dims "
              "but the last)", lambda plan, call, x: plan.axis),
    Attribute("axis_size", "int64_t", "N, the number of ranks of the mesh axis",
              lambda plan, call, x: plan.axis_size),
    Attribute("transport", "int32_t", "the resolved transport: its id in the kinds' table",
              lambda plan, call, x: _kinds.transport(call.transport).id),
    Attribute("chunks", "int64_t", "sub-chunks per shard (matmul_ar: per block)",
              lambda plan, call, x: plan.chunks),
    Attribute("bidirectional", "bool", "both directions of the ring",
              lambda plan, call, x: plan.bidirectional),
    Attribute("tf32", "bool", "float32 GEMMs may use TF32 (the precision allows it; false "
              "for half types)", lambda plan, call, x: _tf32(plan, x)),
    Attribute("algorithm", "int32_t", "matmul_ar's algorithm as the call runs it (a kernel one "
              "only over a transport with peer memory): its id in the kinds' table (two-shot, "
              "0, for the ops without one-shot)",
              lambda plan, call, x: _kinds.AR_ALGORITHMS.index(
                  call.algorithm if plan.op == "matmul_ar" else plan.algorithm)),
    Attribute("fused", "bool", "one persistent GEMM waiting on per-block flags (the fused "
              "column of the ops and transports; docs/gpu-internals.md §5)",
              lambda plan, call, x: call.fused),
    Attribute("replayable", "bool", "the program is built replayable: the same work every "
              "call, no host-side epoch (as the program builder accepts it where the GPU call "
              "lowers; never on CPU); the call then comes through jaxoverlap_cuda_replayable "
              "(docs/gpu.md §6)", lambda plan, call, x: call.replayable),
    Attribute("timeout_ms", "int64_t", "milliseconds any wait of the call may take",
              lambda plan, call, x: timeout_ms(plan.timeout_s), names_site=False),
    Attribute("processes", "ffi::Span<const int64_t>", "the rank table, in (group, rank) "
              "order: each rank's process", lambda plan, call, x: [r.process for r in call.ranks],
              names_site=False),
    Attribute("device_ids", "ffi::Span<const int64_t>", "each rank's global device id (JAX's)",
              lambda plan, call, x: [r.device_id for r in call.ranks], names_site=False),
    Attribute("ordinals", "ffi::Span<const int64_t>", "each rank's local device ordinal",
              lambda plan, call, x: [r.ordinal for r in call.ranks], names_site=False),
)


# Bump when an attribute's meaning changes while the list and the kinds stay (the handlers'
# kSchemaRevision, ffi_call.h, is the same number).
SCHEMA_REVISION = 1


def schema_text() -> str:
    """What :func:`schema_id` hashes, as ``ffi_call.h`` ``SchemaText`` writes it: the revision,
    every attribute (name and C++ type) in order, and the kinds' names in id order."""
    text = f"jaxoverlap attributes {SCHEMA_REVISION}:"
    text += "".join(f" {a.name} {a.ctype};" for a in SCHEMA)
    for kind, rows in (("ops", _kinds.OPS), ("transports", _kinds.TRANSPORTS),
                       ("algorithms", _kinds.ALGORITHMS)):
        text += f" {kind}:" + "".join(f" {r.name}" for r in rows) + ";"
    return text


@functools.cache
def schema_id() -> int:
    """The schema fingerprint every native call carries (FNV-1a, 64 bits, as a signed i64)."""
    h = 0xcbf29ce484222325
    for byte in schema_text().encode():
        h = ((h ^ byte) * 0x100000001b3) % (1 << 64)
    return h - (1 << 64) if h >= 1 << 63 else h


def naming(plan: OpPlan, call: NativeCall, x) -> dict[str, Any]:
    """What the call is, as its site key hashes it besides where it lowers and its types: the
    attributes that name the site (:attr:`Attribute.names_site`) and the axis name."""
    made = {a.name: ENCODERS[a.ctype](a.value(plan, call, x)) for a in SCHEMA
            if a.value is not None and a.names_site}
    return {**made, "axis_name": plan.axis_name}


def attributes(plan: OpPlan, call: NativeCall, x, site_key: int) -> dict[str, Any]:
    """The custom call's attributes for ``plan``, described by ``call``, on operand ``x``, with
    the call's ``site_key`` (``site_key.lower_keyed`` where it lowers; nonzero): one per
    :data:`SCHEMA` entry, in its order, each of its exact C++ type."""
    return {a.name: ENCODERS[a.ctype](site_key if a.value is None else a.value(plan, call, x))
            for a in SCHEMA}
