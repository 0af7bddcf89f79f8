"""One attribute schema: the C++ list that declares and decodes the custom call's attributes,
the table of docs/native.md §6 and what the lowering emits all agree with
``_native/attributes.SCHEMA``; and the schema's fingerprint, which every call carries, is the
same on both sides.

The handlers decode the attributes by name, each of the type the list (``JO_CALL_ATTRS`` in
``ffi_call.h``, which also makes the struct ``CallAttrs``) gives it: names and types must match
exactly. The schema keeps the list's order too, so that the three read alike.
"""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from helpers import tp_mesh
from jax.sharding import PartitionSpec as P

import jaxoverlap as jo
from jaxoverlap._executors import runtime
from jaxoverlap._native import attributes
from jaxoverlap._native.attributes import ENCODERS, SCHEMA

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADER = ROOT / "cpp" / "ffi" / "ffi_call.h"
DOC = ROOT / "docs" / "native.md"
# How docs/native.md and the MLIR text spell each C++ type.
DOC_TYPES = {"int32_t": "i32", "int64_t": "i64", "bool": "bool",
             "ffi::Span<const int64_t>": "i64[]", "std::string_view": "str"}


def _ctype(text: str) -> str:
    """A C++ type as the schema spells it (``ffi`` is ``xla::ffi``'s alias in the header)."""
    return " ".join(text.split()).replace("::xla::ffi::", "ffi::").replace("xla::ffi::", "ffi::")


def listed_members(header: str) -> list[tuple[str, str]]:
    """(name, type) of every row ``X(type, name)`` of ``JO_CALL_ATTRS``, in order."""
    body = re.search(r"#define JO_CALL_ATTRS\(X\)((?:[^\n]*\\\n)*[^\n]*\n)", header)
    assert body, "no #define JO_CALL_ATTRS(X)"
    return [(name, _ctype(ctype))
            for ctype, name in re.findall(r"X\(([^()]+?),\s*(\w+)\)", body.group(1))]


def doc_rows(doc: str) -> list[tuple[str, str, str]]:
    """(name, type, meaning) of the rows of docs/native.md's attribute table."""
    table = re.search(r"^\| attribute \| type \| meaning \|\n\|[-|]+\|\n((?:\|.*\|\n)+)", doc,
                      re.M)
    assert table, "docs/native.md has no table | attribute | type | meaning |"
    rows = []
    for line in table.group(1).splitlines():
        name, ctype, meaning = (cell.strip() for cell in line.strip("|").split("|"))
        rows.append((name.strip("`"), ctype, meaning))
    return rows


SCHEMA_MEMBERS = [(a.name, a.ctype) for a in SCHEMA]


def test_the_cpp_list_is_the_schema():
    assert listed_members(HEADER.read_text()) == SCHEMA_MEMBERS


def test_both_sides_make_one_fingerprint():
    """What the lowering emits as ``schema`` is what the handlers compare it with."""
    host = runtime.load_host()
    assert attributes.schema_text() == host.ATTRIBUTE_SCHEMA_TEXT
    assert attributes.schema_id() == host.ATTRIBUTE_SCHEMA


def test_the_docs_table_is_the_schema():
    assert doc_rows(DOC.read_text()) == [(a.name, DOC_TYPES[a.ctype], a.meaning) for a in SCHEMA]


def test_every_schema_type_has_an_encoder_and_a_spelling():
    assert {a.ctype for a in SCHEMA} <= set(ENCODERS) == set(DOC_TYPES)


def test_the_parsers_see_a_drift():
    """A member renamed, retyped or moved, and a docs row lost, are each seen."""
    header = HEADER.read_text()
    assert "X(bool, tf32)" in header and "X(int32_t, algorithm)" in header
    renamed = header.replace("X(bool, tf32)", "X(bool, tf_32)")
    assert listed_members(renamed) != SCHEMA_MEMBERS
    retyped = header.replace("X(int32_t, algorithm)", "X(int64_t, algorithm)")
    assert listed_members(retyped) != SCHEMA_MEMBERS
    moved = header.replace("X(bool, bidirectional)", "X(bool, TMP)").replace(
        "X(bool, tf32)", "X(bool, bidirectional)").replace("X(bool, TMP)", "X(bool, tf32)")
    assert moved != header and listed_members(moved) != SCHEMA_MEMBERS
    doc = DOC.read_text()
    lost = "\n".join(line for line in doc.splitlines() if not line.startswith("| `tf32` |")) + "\n"
    assert doc_rows(lost) != doc_rows(doc)


MLIR_TYPE = {"int32_t": r"-?\d+ : i32", "int64_t": r"-?\d+ : i64", "bool": r"true|false",
             "ffi::Span<const int64_t>": r"dense<[^>]*> : tensor<\d+xi64>",
             "std::string_view": r'"[^"]*"'}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_lowered_call_carries_exactly_the_schema(dtype):
    """What the lowering emits: every attribute of the schema, of its type, and no other."""
    mesh = tp_mesh(4)
    f = jax.jit(jax.shard_map(lambda x, w: jo.ag_matmul(x, w, "tp", impl="native"), mesh=mesh,
                              in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")))
    text = f.lower(jnp.ones((8, 4), dtype), jnp.ones((4, 8), dtype)).as_text()
    config = re.search(r"custom_call @jaxoverlap_ag_matmul\(.*?mhlo\.backend_config = \{(.*?)\}, "
                       r"operand_layouts", text)
    assert config, text
    entries = dict(entry.split(" = ", 1) for entry in re.split(r", (?=\w+ = )", config.group(1)))
    assert sorted(entries) == sorted(a.name for a in SCHEMA)
    for a in SCHEMA:
        assert re.fullmatch(MLIR_TYPE[a.ctype], entries[a.name]), (a.name, entries[a.name])
    assert entries["tf32"] == ("true" if dtype == jnp.float32 else "false")
    assert entries["replayable"] == "false"  # CPU calls: no command buffers, never replayable
