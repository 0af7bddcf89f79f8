"""Where a projection stands relative to the measurements its preset was checked against.

A preset records the ranges it was calibrated on (``Preset.calibrated``: the GEMM
FLOPs of one call, the collective's bytes, and per op the GEMM FLOPs of the fused
calls checked). A projection outside them is an extrapolation of the formulas;
``bench --model`` and the chooser's debug log say so.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from jaxoverlap.sim import model
from jaxoverlap.sim.model import Shape
from jaxoverlap.sim.presets import FP8_DTYPES, Preset, canonical_dtype, gemm_class

# A projection this close to a calibrated range's ends still counts as inside it.
_SLACK = 1.25


def ranges(gemm_flops: Iterable[float], collective_bytes: Iterable[float],
           fused_flops: Mapping[str, Iterable[float]]) -> dict[str, tuple[float, float]]:
    """The ``Preset.calibrated`` of a set of measurements: min and max of each kind."""
    out: dict[str, tuple[float, float]] = {}
    for key, values in (("gemm_flop", gemm_flops), ("collective_bytes", collective_bytes),
                        *fused_flops.items()):
        values = [float(v) for v in values]
        if values:
            out[key] = (min(values), max(values))
    return out


def _check(ranges: dict[str, tuple[float, float]], key: str, value: float, what: str,
           unit: str) -> list[str]:
    if key not in ranges:
        return [f"no measured {what} on this machine"]
    lo, hi = ranges[key]
    if value < lo / _SLACK:
        return [f"{what} {value:.3g} {unit} below the measured {lo:.3g}"]
    if value > hi * _SLACK:
        return [f"{what} {value:.3g} {unit} above the measured {hi:.3g}"]
    return []


def low_precision(p: Preset, dtype: str, block_scaled: bool = False,
                  dequantized: bool = False) -> list[str]:
    """What is measured and what extrapolated in a projection with ``dtype`` operands other
    than 16-bit ([] for 16-bit): the GEMM alone (fitted to that class's published GEMMs, or the
    16-bit fit at the class's peak) and the call (no published FP8 serial or fused call).
    ``dequantized``: block-scaled operands as the xla and ring impls multiply them, dequantized
    to float32 (``model.dequantized_gemm_time``)."""
    if canonical_dtype(dtype) not in FP8_DTYPES:
        return []
    if dequantized:
        return ["block-scaled fp8 (MXFP8) on the xla and ring impls: each GEMM dequantizes its "
                "operands and multiplies in float32, priced as a TF32 GEMM (the 16-bit fit at "
                "the float32 peak) after a memory pass; no published call of that kind"]
    cls = gemm_class(dtype, block_scaled)
    if p.gemm_fit(cls).measured:
        gemm = (f"{cls} GEMM alone measured (fitted to published {cls} GEMMs on this GPU: the "
                "preset's gemm_classes source)")
    else:
        gemm = (f"{cls} GEMM alone extrapolated (no {cls} GEMM measured on {p.name}: the "
                "16-bit fit at the FP8 peak)")
    return [f"{gemm}; the {cls} call extrapolated (no published {cls} serial or overlapped "
            "call: the BF16 mechanisms with the bytes and GEMM of fp8 operands)"]


def outside_calibrated(p: Preset, op: str, shape: Shape, dtype: str, nranks: int,
                       block_scaled: bool = False) -> list[str]:
    """Why this call's projection is outside the preset's calibrated range ([] = inside);
    ``block_scaled``: fp8 operands with block scales, dequantized by the xla and ring impls."""
    if not p.calibrated:
        return [f"preset {p.name!r} has no published or measured point: every number is "
                "extrapolated from its sources"]
    flop = 2.0 * shape.batch * nranks * shape.rows * shape.n * shape.k
    nbytes = model.collective_bytes(op, nranks, shape.batch, shape.rows, shape.k, shape.n, dtype)
    return (low_precision(p, dtype, dequantized=block_scaled)
            + _check(p.calibrated, "gemm_flop", flop, "GEMM", "FLOP")
            + _check(p.calibrated, "collective_bytes", nbytes, "collective", "bytes")
            + _check(p.calibrated, op, flop, f"fused {op}", "FLOP"))
