"""Optional packages: which are missing, and the one line that says what to install.

The base install (``pip install jaxoverlap``) needs only jax, numpy and the BLAS wheel. The
Flax layers, the examples and the charts need more; what uses them asks here first and
says in one line which extra brings them, instead of failing with a traceback.
"""

from __future__ import annotations

import importlib.util


def missing(*modules: str) -> list[str]:
    """The modules among ``modules`` that cannot be imported here."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def install_hint(modules: list[str], extra: str) -> str:
    """What to say when ``modules`` (e.g. ``['matplotlib']``) are missing: the extra that brings
    them (an extra of pyproject.toml) or the packages themselves."""
    return (f"{', '.join(modules)} {'is' if len(modules) == 1 else 'are'} not installed "
            f"(pip install 'jaxoverlap[{extra}]', or pip install {' '.join(modules)})")
