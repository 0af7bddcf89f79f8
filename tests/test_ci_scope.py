"""The oldest-jax CI leg's case selection (conftest.py ``--each-value-once``)."""

from __future__ import annotations

import itertools

import pytest

from conftest import each_value_once

pytestmark = pytest.mark.jax_independent


def test_each_value_once_keeps_every_value_and_drops_repeated_combinations():
    grid = list(itertools.product(["xla", "ring", "native"], ["f32", "bf16"], [1, 2, 4, 8]))
    cases = [(("t.py", "f"), frozenset({("impl", i), ("dtype", d), ("n", repr(n))}))
             for i, d, n in grid]
    keep = each_value_once(cases)
    kept = [c for c, k in zip(grid, keep, strict=True) if k]
    # in collection order, a case is kept when it brings a value: 7 of the grid's 24
    assert kept == [("xla", "f32", 1), ("xla", "f32", 2), ("xla", "f32", 4), ("xla", "f32", 8),
                    ("xla", "bf16", 1), ("ring", "f32", 1), ("native", "f32", 1)]


def test_each_value_once_counts_per_test_function_and_keeps_unparametrized_tests():
    values = frozenset({("impl", "xla")})
    cases = [(("a.py", "f"), values), (("a.py", "f"), values), (("a.py", "g"), values),
             (("a.py", "h"), None), (("a.py", "h"), None)]
    assert each_value_once(cases) == [True, False, True, True, True]
