"""jaxoverlap.sim: a performance model of the native programs (a model, not a measurement).

It simulates the programs the executors run (``_host.build_program``) on a
hardware preset, to project speedups where no GPU is at hand and to make the
automatic choices (impl, transport, chunks, direction). See docs/performance.md.
"""

from jaxoverlap.sim.engine import SimulationError, Span, Timeline, simulate_programs
from jaxoverlap.sim.model import collective_time, gemm_efficiency, gemm_time
from jaxoverlap.sim.plan import (
    Candidate,
    Choice,
    Shape,
    SimResult,
    baseline_times,
    candidates,
    choose,
    simulate,
)
from jaxoverlap.sim.presets import PRESETS, Preset, get_preset, load_preset
from jaxoverlap.sim.report import (
    MODEL_LABEL,
    STANDARD_CASES,
    Case,
    calibrate,
    format_table,
    gantt,
    projection_table,
)

__all__ = [
    "MODEL_LABEL",
    "PRESETS",
    "STANDARD_CASES",
    "Case",
    "Candidate",
    "Choice",
    "Preset",
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
    "gemm_efficiency",
    "gemm_time",
    "get_preset",
    "load_preset",
    "projection_table",
    "simulate",
    "simulate_programs",
]
