"""Serialized programs say which attribute schema they were made with.

A program exported (``jax.export``) by one version of jaxoverlap and run by another must fail
when XLA initializes it, naming both versions and schemas, and never have its attributes read
in another layout (``ffi_call.h`` ``CheckSchema``; docs/native.md §6). Here the other version
is played by lowering under a changed schema — its fingerprint, one more attribute, or none at
all (a version from before schemas) — then running the exported program with this one. (A
serialized executable goes through the same check when it is loaded; it cannot be made here
under another schema: this process's handlers refuse to compile it.) A program of this schema
whose attribute holds an id outside its kind's table is refused too, naming the table.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoverlap as jo
from jaxoverlap import _kinds
from jaxoverlap._executors import runtime
from jaxoverlap._native import attributes


def _program(mesh):
    return jax.jit(jax.shard_map(lambda x, w: jo.ag_matmul(x, w, "tp", impl="native"),
                                 mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                                 out_specs=P(None, "tp")))


def _exported(mesh, x, w):
    """The native AG+GEMM exported as it lowers now: its StableHLO, serialized, with the custom
    call's attributes as they were made (``.call`` compiles it afresh, as after a
    ``jax.export.deserialize``)."""
    checks = [jax.export.DisabledSafetyCheck.custom_call("jaxoverlap_ag_matmul")]
    return jax.export.export(_program(mesh), disabled_checks=checks)(x, w)


@pytest.fixture(scope="module")
def call():
    mesh = Mesh(jax.devices()[:4], ("tp",), axis_types=(AxisType.Auto,))
    x = jax.device_put(np.arange(8 * 4, dtype=np.float32).reshape(8, 4) / 7,
                       NamedSharding(mesh, P("tp")))
    w = jax.device_put(np.arange(4 * 8, dtype=np.float32).reshape(4, 8) / 5,
                       NamedSharding(mesh, P(None, "tp")))
    return mesh, x, w


def _run(exported, x, w):
    return exported.call(x, w)


def test_a_program_of_this_schema_runs(call):
    """The control: exported and run by the same version, it gives the product."""
    mesh, x, w = call
    y = _run(_exported(mesh, x, w), x, w)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x) @ np.asarray(w), rtol=1e-6)


def _another_fingerprint(monkeypatch):
    monkeypatch.setattr(attributes, "schema_id", lambda: 0x0123456789ABCDEF)
    return "0x0123456789abcdef"


def _one_more_attribute(monkeypatch):
    extra = dataclasses.replace(attributes.SCHEMA[-1], name="sm_count", ctype="int64_t",
                                value=lambda plan, call, x: 132)
    monkeypatch.setattr(attributes, "SCHEMA", (*attributes.SCHEMA, extra))
    attributes.schema_id.cache_clear()
    monkeypatch.setattr(attributes, "schema_id", attributes.schema_id.__wrapped__)
    return f"0x{attributes.schema_id() % (1 << 64):016x}"


def _before_schemas(monkeypatch):
    monkeypatch.setattr(attributes, "SCHEMA", attributes.SCHEMA[2:])
    return None


@pytest.mark.parametrize("lowered_under", [_another_fingerprint, _one_more_attribute,
                                           _before_schemas])
def test_a_program_of_another_schema_fails_naming_both_versions(call, monkeypatch,
                                                                 lowered_under):
    mesh, x, w = call
    ours = f"0x{runtime.load_host().ATTRIBUTE_SCHEMA % (1 << 64):016x}"
    with monkeypatch.context() as patched:
        patched.setattr(attributes, "__version__", "0.0.9")
        theirs = lowered_under(patched)
        blob = _exported(mesh, x, w)
    attributes.schema_id.cache_clear()
    assert theirs != ours
    if theirs is None:
        lowered_by = "a jaxoverlap whose native calls carry no attribute schema (older)"
    else:
        lowered_by = f"jaxoverlap 0.0.9 with attribute schema {theirs}"
    expected = (f"this program's native call was lowered by {lowered_by}; this is jaxoverlap "
                f"{jo.__version__}, whose native calls have attribute schema {ours}")
    with pytest.raises(Exception, match=re.escape(expected)) as failed:
        _run(blob, x, w)
    assert "lower it again with this version" in str(failed.value)



def test_an_attribute_outside_its_table_is_refused_naming_the_table(call, monkeypatch):
    """Of this schema but with a transport id no row has: the handler's range check names the
    table's ids and names (``DecodeDesc``), when XLA initializes the program."""
    mesh, x, w = call
    schema = list(attributes.SCHEMA)
    i = next(k for k, a in enumerate(schema) if a.name == "transport")
    schema[i] = dataclasses.replace(schema[i], value=lambda plan, call, x: len(_kinds.TRANSPORTS))
    with monkeypatch.context() as patched:
        patched.setattr(attributes, "SCHEMA", tuple(schema))  # the same names and types
        exported = _exported(mesh, x, w)
    ids = [f"{t.id} ({t.name})" for t in _kinds.TRANSPORTS]
    expected = (f"attribute transport expected {', '.join(ids[:-1])} or {ids[-1]}, got "
                f"{len(_kinds.TRANSPORTS)}")
    with pytest.raises(Exception, match=re.escape(expected)):
        _run(exported, x, w)
