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

# `--oldest-jax` (CI's oldest-jax leg, .ci/run) keeps what can differ between jax versions at
# what it costs once: of a parametrized test, only the cases that bring a parameter value no
# earlier case of that test had (every impl, transport, dtype, shape... still runs at least once,
# not every combination of them a second time). Of a test its author marked `slow` (an end-to-end
# run: an example, a model trained or decoded, processes), the first case, and only where the
# test is also marked `jax_api`: it crosses a JAX interface the quick tests do not reach (processes
# joined through jax.distributed's key-value store, call sites matched across processes, the
# persistent compilation cache, Flax's own training and decoding loops, checkpoints).
# The other slow tests run JAX through the interfaces the quick tests run: the newest-jax leg runs
# them.


def pytest_addoption(parser):
    parser.addoption("--oldest-jax", action="store_true",
                     help="CI's oldest-jax leg: of a parametrized test, only the cases that bring "
                          "a parameter value its earlier cases did not have; of a slow test, its "
                          "first case if it is marked jax_api, else none")


def _function(item) -> tuple[str, str]:
    return item.nodeid.split("::")[0], getattr(item, "originalname", item.name)


def _values(item) -> frozenset[tuple[str, str]]:
    """The case's parameter values, each alone (one value of a row of several parameters counts
    for itself), told apart by their repr."""
    return frozenset((name, repr(value)) for name, value in item.callspec.params.items())


def oldest_jax_cases(cases) -> list[bool]:
    """Of ``cases`` ((function, values, slow, jax_api) in collection order; values None: not
    parametrized; slow: marked so by its author; jax_api: marked so), which to keep: a case whose
    values all appeared in earlier kept cases of its function is dropped; of a slow test, the
    first case is kept if the test is marked jax_api, and no case otherwise."""
    covered: dict = {}
    keep = []
    for function, values, slow, jax_api in cases:
        first = function not in covered
        had = covered.setdefault(function, set())
        if slow:
            keep.append(first and jax_api)
        else:
            keep.append(values is None or not values <= had)
        had |= values or set()
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
    if config.getoption("oldest_jax"):
        keep = oldest_jax_cases((_function(i), _values(i) if hasattr(i, "callspec") else None,
                                 slow, i.get_closest_marker("jax_api") is not None)
                                for i, slow in zip(items, authored_slow, strict=True))
        config.hook.pytest_deselected(items=[i for i, k in zip(items, keep, strict=True) if not k])
        items[:] = [i for i, k in zip(items, keep, strict=True) if k]
