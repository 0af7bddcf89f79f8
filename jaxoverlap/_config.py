"""Scoped defaults for the ops: arguments > ``jo.config(...)`` > ``JAXOVERLAP_*`` variables.

The values are resolved at trace time, so a ``jo.config`` block must enclose the
*tracing* of a program (its first call under ``jit``), not only a later call.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import numbers
import os
from collections.abc import Iterator
from typing import Any

from jaxoverlap import _kinds

IMPLS = ("auto", "xla", "ring", "native")
TRANSPORTS = ("auto", *_kinds.names(_kinds.TRANSPORTS))
# matmul_ar's algorithm= (the kernel ones: docs/gpu-internals.md §7)
AR_ALGORITHMS = ("auto", *sorted(_kinds.AR_ALGORITHMS))
LOG_LEVELS = ("warning", "info", "debug")
DEFAULT_TIMEOUT_S = 120.0

logger = logging.getLogger("jaxoverlap")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Effective settings; ``None`` means "not set here, look further down"."""

    impl: str | None = None
    transport: str | None = None
    chunks: int | None = None
    bidirectional: bool | None = None
    timeout_s: float | None = None
    preset: str | None = None
    fused: bool | None = None


_UNSET = Settings()
_scoped: contextvars.ContextVar[Settings] = contextvars.ContextVar(
    "jaxoverlap_config", default=_UNSET
)


def check_impl(impl: Any, where: str = "impl") -> str:
    # a str first: `in` compares an array elementwise, whose truth value numpy refuses
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"{where}={impl!r} is not an implementation; use one of {IMPLS}.")
    return impl


def check_transport(transport: Any, where: str = "transport") -> str | None:
    if transport is not None and (not isinstance(transport, str) or transport not in TRANSPORTS):
        raise ValueError(f"{where}={transport!r} is not a transport; use one of {TRANSPORTS}.")
    return transport


def check_chunks(chunks: Any, where: str = "chunks") -> int | None:
    if chunks is None:
        return None
    # any integer type (numpy's are numbers.Integral, its bool_ is not), never a bool
    if isinstance(chunks, bool) or not isinstance(chunks, numbers.Integral) or chunks < 1:
        raise ValueError(f"{where}={chunks!r} must be a positive int (or None for automatic).")
    return int(chunks)


def check_bidirectional(bidirectional: Any, where: str = "bidirectional") -> bool | None:
    if bidirectional is not None and not isinstance(bidirectional, bool):
        raise TypeError(f"{where}={bidirectional!r} must be True, False or None (automatic).")
    return bidirectional


def check_algorithm(algorithm: Any, where: str = "algorithm") -> str | None:
    if algorithm is not None and algorithm not in AR_ALGORITHMS:
        raise ValueError(f"{where}={algorithm!r} is not a GEMM + all-reduce algorithm; use one of "
                         f"{AR_ALGORITHMS} or None (automatic).")
    return None if algorithm == "auto" else algorithm


def timeout_ms(timeout_s: float) -> int:
    """A timeout in whole milliseconds for the C++ side: at least 1; ``inf`` and anything past
    ~146 years are "forever" (the C++ deadlines saturate, they never wrap around)."""
    return int(min(max(1.0, timeout_s * 1000.0), 2.0**62))


def check_timeout(timeout_s: Any, where: str = "timeout_s") -> float | None:
    if timeout_s is None:
        return None
    try:
        value = float(timeout_s)
    except (TypeError, ValueError):
        raise ValueError(f"{where}={timeout_s!r} must be a number of seconds > 0.") from None
    if not value > 0:  # also refuses nan
        raise ValueError(f"{where}={timeout_s!r} must be a number of seconds > 0 (inf: wait "
                         "forever).")
    return value


def check_preset(preset: Any, where: str = "preset") -> str | None:
    """A built-in preset name or a preset JSON file (checked when first used)."""
    if preset is not None and (not isinstance(preset, str) or not preset):
        raise TypeError(f"{where}={preset!r} must be a preset name (e.g. 'h100') or a JSON path.")
    return preset


def check_fused(fused: Any, where: str = "fused") -> bool | None:
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(f"{where}={fused!r} must be True (the fused GEMM: Hopper, p2p or "
                        "multicast), False (never) or None (the performance model decides).")
    return fused


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value.strip() if value is not None and value.strip() else None


def _from_env() -> Settings:
    """Reads the environment each time, so a test or a user can change it at run time."""
    impl = _env("JAXOVERLAP_IMPL")
    transport = _env("JAXOVERLAP_TRANSPORT")
    chunks = _env("JAXOVERLAP_CHUNKS")
    timeout = _env("JAXOVERLAP_TIMEOUT_S")
    fused = _env("JAXOVERLAP_FUSED")
    if fused is not None and fused.lower() not in ("1", "true", "0", "false"):
        raise ValueError(f"JAXOVERLAP_FUSED={fused!r} must be 1/true or 0/false; unset it to let "
                         "the performance model decide.")
    if chunks is not None:
        try:
            chunks_value: int | None = int(chunks)
        except ValueError:
            raise ValueError(
                f"JAXOVERLAP_CHUNKS={chunks!r} must be a positive integer; unset it for automatic."
            ) from None
    else:
        chunks_value = None
    return Settings(
        impl=check_impl(impl, "JAXOVERLAP_IMPL") if impl is not None else None,
        transport=check_transport(transport, "JAXOVERLAP_TRANSPORT"),
        chunks=check_chunks(chunks_value, "JAXOVERLAP_CHUNKS"),
        timeout_s=check_timeout(timeout, "JAXOVERLAP_TIMEOUT_S"),
        preset=_env("JAXOVERLAP_PRESET"),
        fused=None if fused is None else fused.lower() in ("1", "true"),
    )


@contextlib.contextmanager
def config(
    *,
    impl: str | None = None,
    transport: str | None = None,
    chunks: int | None = None,
    bidirectional: bool | None = None,
    timeout_s: float | None = None,
    preset: str | None = None,
    fused: bool | None = None,
) -> Iterator[Settings]:
    """Sets default op arguments for the ops traced inside the block.

    Arguments given to an op win over these, and these win over the
    ``JAXOVERLAP_*`` environment variables. ``preset`` names the hardware model
    (``jaxoverlap.sim``) that makes the automatic choices. ``fused`` asks for the fused GEMM
    of ``ag_matmul`` and ``matmul_rs`` (``True``: one persistent GEMM waiting on per-block
    flags; Hopper GPUs, or the host executor on CPU; transports ``p2p`` and ``multicast``,
    never ``nccl``; ``False``: never; ``None``: where the performance model picks it,
    docs/gpu-internals.md §5). Blocks nest; an argument left as ``None`` keeps the value of the
    enclosing block.

    >>> import jaxoverlap as jo
    >>> with jo.config(impl="ring", chunks=2):
    ...     jo.current_config().impl
    'ring'
    """
    outer = _scoped.get()
    inner = Settings(
        impl=check_impl(impl) if impl is not None else outer.impl,
        transport=check_transport(transport) if transport is not None else outer.transport,
        chunks=check_chunks(chunks) if chunks is not None else outer.chunks,
        bidirectional=(
            check_bidirectional(bidirectional) if bidirectional is not None
            else outer.bidirectional
        ),
        timeout_s=check_timeout(timeout_s) if timeout_s is not None else outer.timeout_s,
        preset=check_preset(preset) if preset is not None else outer.preset,
        fused=check_fused(fused) if fused is not None else outer.fused,
    )
    token = _scoped.set(inner)
    try:
        yield inner
    finally:
        _scoped.reset(token)


def current_config() -> Settings:
    """The settings in force here: the innermost ``jo.config`` over the environment."""
    scoped, env = _scoped.get(), _from_env()
    return Settings(
        impl=scoped.impl or env.impl or "auto",
        transport=scoped.transport or env.transport or "auto",
        chunks=scoped.chunks if scoped.chunks is not None else env.chunks,
        bidirectional=scoped.bidirectional,
        timeout_s=scoped.timeout_s or env.timeout_s or DEFAULT_TIMEOUT_S,
        preset=scoped.preset or env.preset,
        fused=scoped.fused if scoped.fused is not None else env.fused,
    )


def configure_logging() -> None:
    """Applies ``JAXOVERLAP_LOG`` (info|debug) to the ``jaxoverlap`` logger."""
    level = _env("JAXOVERLAP_LOG")
    if level is None:
        return
    if level.lower() not in LOG_LEVELS:
        raise ValueError(f"JAXOVERLAP_LOG={level!r} must be one of {LOG_LEVELS}.")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("jaxoverlap %(levelname)s: %(message)s"))
        logger.addHandler(handler)
