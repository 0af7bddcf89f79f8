"""The oldest-jax CI leg's case selection (conftest.py ``--each-value-once``)."""

from __future__ import annotations

import itertools

import pytest

from conftest import each_value_once

pytestmark = pytest.mark.jax_independent


def test_each_value_once_keeps_every_value_and_drops_repeated_combinations():
    grid = list(itertools.product(["xla", "ring", "native"], ["f32", "bf16"], [1, 2, 4, 8]))
    cases = [(("t.py", "f"), frozenset({("impl", i), ("dtype", d), ("n", repr(n))}), False)
             for i, d, n in grid]
    keep = each_value_once(cases)
    kept = [c for c, k in zip(grid, keep, strict=True) if k]
    # in collection order, a case is kept when it brings a value: 7 of the grid's 24
    assert kept == [("xla", "f32", 1), ("xla", "f32", 2), ("xla", "f32", 4), ("xla", "f32", 8),
                    ("xla", "bf16", 1), ("ring", "f32", 1), ("native", "f32", 1)]


def test_each_value_once_counts_per_test_function_and_keeps_unparametrized_tests():
    values = frozenset({("impl", "xla")})
    cases = [(("a.py", "f"), values, False), (("a.py", "f"), values, False),
             (("a.py", "g"), values, False), (("a.py", "h"), None, False),
             (("a.py", "h"), None, False)]
    assert each_value_once(cases) == [True, False, True, True, True]


def test_each_value_once_keeps_the_first_case_of_a_test_its_author_marked_slow():
    cases = [(("e.py", "lm1b"), frozenset({("api", "linen")}), True),
             (("e.py", "lm1b"), frozenset({("api", "nnx")}), True),
             (("e.py", "quick"), frozenset({("api", "linen")}), False),
             (("e.py", "quick"), frozenset({("api", "nnx")}), False),
             (("e.py", "whole"), None, True)]
    assert each_value_once(cases) == [True, False, True, True, True]
