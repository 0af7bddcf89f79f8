"""jaxoverlap.sim: a performance model of the native programs (a model, not a measurement).

It simulates the programs the executors run (``_host.build_program``) on a
hardware preset, to project speedups where no GPU is at hand and to make the
automatic choices (impl, transport, chunks, direction, and the fallback to the
unfused path). ``sim.published`` checks it against published measurements and
``sim.calibrate`` fits a preset to measured points. See docs/performance.md.
"""

from jaxoverlap.sim import allreduce, families, launch, reduction
from jaxoverlap.sim.block import BlockProjection, mlp_block
from jaxoverlap.sim.confidence import outside_calibrated
from jaxoverlap.sim.engine import SimulationError, Span, Timeline, simulate_programs
from jaxoverlap.sim.fit import (
    CollectivePoint,
    ConcurrentPoint,
    FusedPoint,
    GemmPoint,
    SerialPoint,
    calibrate,
)
from jaxoverlap.sim.model import (
    OPS,
    Shape,
    collective_time,
    gemm_efficiency,
    gemm_time,
    pipelined_time,
)
from jaxoverlap.sim.plan import (
    Candidate,
    Choice,
    SimResult,
    baseline_times,
    candidates,
    choose,
    simulate,
)
from jaxoverlap.sim.presets import PRESETS, Preset, get_preset, load_preset
from jaxoverlap.sim.report import (
    DECODE_CASES,
    FP8_CASES,
    MODEL_LABEL,
    STANDARD_CASES,
    Case,
    decode_table,
    format_decode_table,
    format_overlapped_table,
    format_table,
    gantt,
    markdown_decode_table,
    overlapped_table,
    projection_table,
)

__all__ = [
    "BlockProjection",
    "allreduce",
    "families",
    "launch",
    "reduction",
    "MODEL_LABEL",
    "OPS",
    "PRESETS",
    "DECODE_CASES",
    "FP8_CASES",
    "STANDARD_CASES",
    "decode_table",
    "format_decode_table",
    "format_overlapped_table",
    "markdown_decode_table",
    "overlapped_table",
    "Candidate",
    "Case",
    "Choice",
    "CollectivePoint",
    "ConcurrentPoint",
    "FusedPoint",
    "GemmPoint",
    "Preset",
    "SerialPoint",
    "Shape",
    "SimResult",
    "SimulationError",
    "Span",
    "Timeline",
    "baseline_times",
    "calibrate",
    "candidates",
    "choose",
    "collective_time",
    "format_table",
    "gantt",
    "mlp_block",
    "gemm_efficiency",
    "gemm_time",
    "get_preset",
    "load_preset",
    "outside_calibrated",
    "pipelined_time",
    "projection_table",
    "simulate",
    "simulate_programs",
]
