"""Every test (and doctest) runs on 8 host devices; the flag must be set before JAX starts."""

import os

# The suite compiles thousands of small programs on XLA:CPU and runs each on a few rows: LLVM's
# optimizer is most of their compile time and buys nothing at that size. At LLVM -O0 (XLA's own
# HLO passes unchanged) the suite takes a quarter less. What can change is rounding where LLVM
# would fuse a multiply and an add into one FMA (XLA:CPU's target options allow it: xla/service/
# cpu/cpu_compiler.cc, CompilerTargetOptions): the tests' bounds are for rounding, and a program
# compared with another was compiled alike. Processes the tests start inherit it (the examples,
# multi-process runs), except where a test stands for a user's shell (tests/test_first_contact.py).
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    (_flags, "" if "--xla_backend_optimization_level" in _flags else TEST_XLA_FLAGS,
     "--xla_force_host_platform_device_count=8")
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


# ---- the quick developer loop ---------------------------------------------------------------
#
# `pytest` alone runs the quick loop (pyproject's addopts deselect `slow`); `make test` and CI run
# everything (`-m "slow or not slow"`). A test that takes seconds is marked `slow` where it is
# written (`@pytest.mark.slow`, or `pytestmark` for a whole module); and of a parametrized test,
# every case but the first is marked here: the quick loop runs each test function once, the whole
# grid runs in `make test`.
import pytest  # noqa: E402

# `--each-value-once` (CI's oldest-jax leg, .ci/run) keeps, of a parametrized test, only the cases
# that bring a parameter value no earlier case of that test had: every impl, transport, dtype,
# shape... still runs at least once, not every combination of them a second time. Of a test its
# author marked `slow` (an end-to-end run: an example, a model trained or decoded, processes), it
# keeps the first case only: the quick tests there run each value those cases would select.


def pytest_addoption(parser):
    parser.addoption("--each-value-once", action="store_true",
                     help="of a parametrized test, run only the cases that bring a parameter "
                          "value its earlier cases did not have")


def _function(item) -> tuple[str, str]:
    return item.nodeid.split("::")[0], getattr(item, "originalname", item.name)


def _values(item) -> frozenset[tuple[str, str]]:
    """The case's parameter values, each alone (one value of a row of several parameters counts
    for itself), told apart by their repr."""
    return frozenset((name, repr(value)) for name, value in item.callspec.params.items())


def each_value_once(cases) -> list[bool]:
    """Of ``cases`` ((function, values, slow) in collection order; values None: not
    parametrized; slow: marked so by its author), which to keep: a case whose values all
    appeared in earlier kept cases of its function is dropped, and so is every case of a slow
    test but its first."""
    covered: dict = {}
    keep = []
    for function, values, slow in cases:
        if values is None:
            keep.append(True)
            continue
        first = function not in covered
        had = covered.setdefault(function, set())
        keep.append(first if slow else not values <= had)
        had |= values
    return keep


def pytest_collection_modifyitems(config, items):
    authored_slow = [i.get_closest_marker("slow") is not None for i in items]
    seen: set[tuple[str, str]] = set()
    for item in items:
        if getattr(item, "callspec", None) is None:
            continue
        function = _function(item)
        if function in seen:
            item.add_marker(pytest.mark.slow)
        seen.add(function)
    if config.getoption("each_value_once"):
        keep = each_value_once((_function(i), _values(i) if hasattr(i, "callspec") else None,
                                slow) for i, slow in zip(items, authored_slow, strict=True))
        config.hook.pytest_deselected(items=[i for i, k in zip(items, keep, strict=True) if not k])
        items[:] = [i for i, k in zip(items, keep, strict=True) if k]
