"""One table per kind: ``jaxoverlap/_kinds.py`` and ``cpp/core/kinds.h`` hold the same rows.

The executors export their tables (``_host.kinds()``); every column both sides know (each row
class's ``native`` columns) must be equal, row by row in id order, with no row on one side
only. The check is shown to fail against a deliberately unbalanced table on either side: the
testing module exports the build's tables with a dtype row added in C++ only, and a row added
to the Python tables only is refused the same way.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest
import testing_ext

from jaxoverlap import _kinds
from jaxoverlap._executors import runtime

ROOT = pathlib.Path(__file__).resolve().parents[1]
KINDS = {"ops": _kinds.OPS, "transports": _kinds.TRANSPORTS, "dtypes": _kinds.DTYPES,
         "algorithms": _kinds.ALGORITHMS, "fused_fp8": _kinds.FUSED_FP8}


def python_tables(kinds=None) -> dict[str, list[dict]]:
    """The Python rows as the extension exports them: their native columns, in id order."""
    return {kind: [{c: getattr(row, c) for c in type(row).native} for row in rows]
            for kind, rows in (kinds or KINDS).items()}


def differences(python: dict[str, list[dict]], native: dict[str, list[dict]]) -> list[str]:
    """Every way the two sides' tables differ (empty: they are one table)."""
    found = []
    for kind in sorted(set(python) | set(native)):
        ours, theirs = python.get(kind), native.get(kind)
        if ours is None or theirs is None:
            found.append(f"{kind}: a table on the {'C++' if ours is None else 'Python'} side only")
            continue
        for i in range(max(len(ours), len(theirs))):
            a = ours[i] if i < len(ours) else None
            b = theirs[i] if i < len(theirs) else None
            if a != b:
                found.append(f"{kind} row {i}: Python {a}, C++ {b}")
    return found


@pytest.fixture(scope="module")
def host():
    if runtime.host_error() is not None:
        pytest.fail(f"the host extension does not load: {runtime.host_error()}")
    return runtime.load_host()


def test_the_python_and_cpp_tables_are_one(host):
    native = host.kinds()
    assert differences(python_tables(), native) == []
    # ... and the ids are the row order on both sides (the attributes' values).
    for kind, rows in native.items():
        if kind != "fused_fp8":  # triples, not ids
            assert [r["id"] for r in rows] == list(range(len(rows)))


def test_a_row_added_in_cpp_only_is_refused():
    unbalanced = testing_ext.load().unbalanced_kinds()
    found = differences(python_tables(), unbalanced)
    assert len(found) == 1 and found[0].startswith("dtypes row 5: Python None"), found
    assert "'name': 'float64'" in found[0]


def test_a_row_added_in_python_only_is_refused(host):
    extra = dataclasses.replace(_kinds.TRANSPORTS[1], id=3, name="p2p_ring", auto_rank=3)
    tables = python_tables({**KINDS, "transports": (*_kinds.TRANSPORTS, extra)})
    found = differences(tables, host.kinds())
    assert found == [f"transports row 3: Python {tables['transports'][3]}, C++ None"]


def test_a_column_that_differs_is_refused(host):
    swapped = tuple(dataclasses.replace(o, fused=not o.fused) if o.name == "matmul_ar" else o
                    for o in _kinds.OPS)
    found = differences(python_tables({**KINDS, "ops": swapped}), host.kinds())
    assert len(found) == 1 and found[0].startswith("ops row 2"), found


def test_lookups_name_what_they_expect():
    assert _kinds.names(_kinds.OPS, fused=True) == ("ag_matmul", "matmul_rs")
    assert _kinds.auto_order() == ("multicast", "p2p", "nccl")
    assert _kinds.dtype("bf16") is _kinds.dtype("bfloat16") is _kinds.DTYPES[1]
    with pytest.raises(ValueError, match="transport: expected one of nccl, p2p, multicast"):
        _kinds.transport("nvshmem")


def _grid():
    """Calls of every op on x of rank 1 to 4 (dims that split over the ranks and dims that do
    not), every axis (out of range too), w that fits and w that does not, over 1 to 4 ranks,
    both algorithms."""
    for op in _kinds.names(_kinds.OPS):
        for x_shape in ((6,), (4, 8), (6, 8), (2, 4, 8), (3, 2, 8), (2, 6, 3, 8), (1, 4, 1, 8)):
            for axis in range(-1, len(x_shape)):
                for w_shape in ((8, 5), (x_shape[-1], 5), (7, 5), (8,)):
                    for n in (1, 2, 3, 4):
                        for algorithm in _kinds.AR_ALGORITHMS:
                            yield op, x_shape, w_shape, axis, n, algorithm


def test_the_model_and_the_executors_make_one_canonical_problem(host):
    """``_kinds.canonical_problem`` (the model's rule where the extension does not load) and
    the executors' ``CanonicalProblem`` give the same problem, or the same error, on every
    shape of the grid; ``_plan.canonical_shape`` (what the model prices) is the executors'."""
    from jaxoverlap import _plan

    seen = {"ok": 0, "error": 0}
    for op, x_shape, w_shape, axis, n, algorithm in _grid():
        try:
            native = host.canonical_problem(op, list(x_shape), list(w_shape), axis, n, algorithm)
        except ValueError as e:
            with pytest.raises(ValueError) as mirrored:
                _kinds.canonical_problem(op, x_shape, w_shape, axis, n, algorithm)
            assert str(mirrored.value) == str(e), (op, x_shape, w_shape, axis, n, algorithm)
            seen["error"] += 1
            continue
        ours = _kinds.canonical_problem(op, x_shape, w_shape, axis, n, algorithm)
        assert dataclasses.asdict(ours) == native, (op, x_shape, w_shape, axis, n, algorithm)
        seen["ok"] += 1
        if algorithm == ("one_shot" if _kinds.op(op).one_shot else "two_shot"):
            shape = _plan.canonical_shape(op, x_shape, w_shape, axis, n)
            assert (shape.batch, shape.rows, shape.k, shape.n) == (
                native["batch"], native["rows"], native["k"], native["n"])
    assert seen["ok"] > 100 and seen["error"] > 100, seen


# docs/native.md §8: where each list of the files a new member touches starts and ends, and how
# many files it may name (a new member is meant to cost a row, not a tour of the tree).
HOW_TO_ADD = {"a transport": ("**How to add a transport.**", "With a mechanism of its own", 10),
              "an op": ("**How to add an op**", "The builder's declaration", 14),
              "a dtype": ("**How to add a dtype:**", "Its size, names", 6)}


def how_to_add(text: str) -> dict[str, list[str]]:
    """The file each numbered item of each list names (its first quoted path)."""
    out = {}
    for kind, (start, end, _) in HOW_TO_ADD.items():
        section = text[text.index(start):]
        out[kind] = re.findall(r"^\d+\. `([^`]+)`", section[:section.index(end)], flags=re.M)
    return out


def test_the_how_to_add_lists_name_files_of_the_tree_within_their_bounds():
    """Each list names at most its bound of files, every one in the tree (a placeholder's
    folder), so that a file moved or renamed leaves no list naming what is gone. That every
    file such a change touched is on its list, or no longer needed, §8 checks against the
    history."""
    lists = how_to_add((ROOT / "docs" / "native.md").read_text())
    for kind, (_, _, bound) in HOW_TO_ADD.items():
        files = lists[kind]
        assert 0 < len(files) <= bound, (kind, files)
        gone = [f for f in files if not (ROOT / f).parent.is_dir()
                or ("<" not in f and not (ROOT / f).is_file())]
        assert gone == [], (kind, gone)
