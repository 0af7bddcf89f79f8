"""Every test (and doctest) runs on 8 host devices; the flag must be set before JAX starts."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
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


def pytest_collection_modifyitems(config, items):
    seen: set[tuple[str, str]] = set()
    for item in items:
        if getattr(item, "callspec", None) is None:
            continue
        function = (item.nodeid.split("::")[0], getattr(item, "originalname", item.name))
        if function in seen:
            item.add_marker(pytest.mark.slow)
        seen.add(function)
