"""Automatic choices by the performance model (``jaxoverlap.sim``), per call site.

When a hardware preset applies — named with ``jo.config(preset=...)`` /
``JAXOVERLAP_PRESET`` (a built-in name or a JSON file), or recognised from the
GPU's device kind — whatever the caller left open (``impl="auto"``,
``chunks=None``, ``bidirectional=None``, ``transport="auto"``) is picked by
simulating every candidate plan the machine supports, the unfused ``"xla"``
path included: a fused plan must be predicted faster by more than the preset's
margin for the op (derived from the model's measured error,
docs/performance.md §5) to be chosen, so the model does not make a call slower by
choice. The debug log marks projections outside the preset's calibrated range.

Host devices (CPU) have no preset by default: there the ops keep the simple
defaults (``"xla"``, one chunk), since host devices share the cores and
nothing overlaps.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from jaxoverlap._config import logger

# Device-kind substrings of the GPUs that have a built-in preset.
_DEVICE_PRESETS = (("H200", "h200"), ("H100", "h100"), ("H800", "h800"), ("B200", "b200"),
                   ("A100", "a100"), ("A800", "a800"))
_CHUNK_OPTIONS = (1, 2, 4, 8)


def machine_preset(configured: str | None, device_kind: str | None) -> str | None:
    """The preset that applies: the configured one, else the GPU's, else None."""
    if configured:
        return configured
    for needle, name in _DEVICE_PRESETS:
        if device_kind and needle in device_kind.upper():
            return name
    return None


def canonical_shape(op: str, x_shape: tuple, w_shape: tuple, axis: int, n: int):
    """The per-rank problem of docs/native.md §1: (batch, rows, k, n)."""
    from jaxoverlap.sim import Shape

    if op == "matmul_ar":  # every dim of x but the last is a row (all of them)
        return Shape(1, math.prod(x_shape[:-1]), x_shape[-1], w_shape[1])
    batch = math.prod(x_shape[:axis])
    rows = math.prod(x_shape[axis:-1])
    if op == "matmul_rs":
        rows //= n
    return Shape(batch, rows, x_shape[-1], w_shape[1])


@functools.lru_cache(maxsize=512)
def choose(op: str, shape: Any, dtype: str, n: int, preset: str, impls: tuple,
           transports: tuple, chunks: tuple, bidirectional: tuple,
           algorithms: tuple = ("two_shot",)):
    """The model's pick among the allowed plans (cached per call-site signature);
    ``algorithms``: matmul_ar's allowed algorithms."""
    from jaxoverlap import sim

    # fused=False: the executors do not run the fused GEMM yet (docs/gpu.md §10)
    cands = [
        c for c in sim.candidates(preset, n, shape, chunk_options=_CHUNK_OPTIONS, impls=impls,
                                  transports=transports or None, op=op, algorithms=algorithms,
                                  fused=False)
        if c.impl == "xla"
        or (c.chunks in chunks and c.bidirectional in bidirectional)
    ]
    # impl="native" (or a transport) asked for: pick among the native plans only
    choice = sim.choose(op, shape, dtype, n, preset, cands, unfused="xla" in impls)
    logger.debug("%s %s on %s, N=%d (model, not a measurement):\n%s", op, shape, preset, n,
                 choice.format())
    return choice.candidate
