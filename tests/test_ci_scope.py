"""The oldest-jax CI leg's case selection (conftest.py ``--oldest-jax``)."""

from __future__ import annotations

import itertools

import pytest

from conftest import oldest_jax_cases

pytestmark = pytest.mark.jax_independent


def test_each_value_once_keeps_every_value_and_drops_repeated_combinations():
    grid = list(itertools.product(["xla", "ring", "native"], ["f32", "bf16"], [1, 2, 4, 8]))
    cases = [(("t.py", "f"), frozenset({("impl", i), ("dtype", d), ("n", repr(n))}), False,
              False) for i, d, n in grid]
    keep = oldest_jax_cases(cases)
    kept = [c for c, k in zip(grid, keep, strict=True) if k]
    # in collection order, a case is kept when it brings a value: 7 of the grid's 24
    assert kept == [("xla", "f32", 1), ("xla", "f32", 2), ("xla", "f32", 4), ("xla", "f32", 8),
                    ("xla", "bf16", 1), ("ring", "f32", 1), ("native", "f32", 1)]


def test_each_value_once_counts_per_test_function_and_keeps_unparametrized_tests():
    values = frozenset({("impl", "xla")})
    cases = [(("a.py", "f"), values, False, False), (("a.py", "f"), values, False, False),
             (("a.py", "g"), values, False, False), (("a.py", "h"), None, False, False),
             (("a.py", "h"), None, False, False)]
    assert oldest_jax_cases(cases) == [True, False, True, True, True]


def test_a_slow_test_runs_its_first_case_if_marked_jax_api_and_none_otherwise():
    linen, nnx = frozenset({("api", "linen")}), frozenset({("api", "nnx")})
    cases = [(("e.py", "lm1b"), linen, True, True), (("e.py", "lm1b"), nnx, True, True),
             (("e.py", "block"), linen, True, False), (("e.py", "block"), nnx, True, False),
             (("e.py", "quick"), linen, False, False), (("e.py", "quick"), nnx, False, False),
             (("e.py", "store"), None, True, True), (("e.py", "whole"), None, True, False)]
    assert oldest_jax_cases(cases) == [True, False, False, False, True, True, True, False]
