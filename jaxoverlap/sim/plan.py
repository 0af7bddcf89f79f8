"""Projections of whole calls and the model-driven choice among plans.

``simulate`` builds every rank's program with ``_host.build_program`` (no
planning path of its own) and runs the event engine; ``choose`` predicts each
candidate plan and picks the fastest, keeping the unfused path (``impl="xla"``:
NCCL collective, then one GEMM) unless a plan beats it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from jaxoverlap import _kinds
from jaxoverlap.sim import allreduce, families, model, reduction
from jaxoverlap.sim import fused as fused_path
from jaxoverlap.sim.confidence import outside_calibrated
from jaxoverlap.sim.engine import COMPUTE_KINDS, Span, cyclic_gc_paused, simulate_programs
from jaxoverlap.sim.model import Shape
from jaxoverlap.sim.presets import (
    FP8_DTYPES,
    Preset,
    canonical_dtype,
    load_preset,
    output_dtype,
)

OPS = tuple(model.OPS)
IMPLS = ("xla", "ring", "native")
ALGORITHMS = _kinds.AR_ALGORITHMS  # matmul_ar's (docs/native.md §3)
# The pure-JAX ring (impl="ring") runs the NCCL ring schedule through XLA's
# collective-permute; each step also writes its GEMM output into the result with a
# dynamic-update-slice (one read + one write of the output block) — modelled as
# this many extra HBM passes over every GEMM's output.
RING_EXTRA_PASSES = 2


@dataclass(frozen=True)
class Candidate:
    """One way to run the call: impl, and for native the transport, chunks, direction, and
    whether the compute stream runs ONE persistent fused GEMM waiting on per-block flags
    (``fused``, ``sim.fused``; chunks then set the flags' row blocks) instead of a GEMM
    per block; ``replayable``: its program built replayable (docs/gpu-internals.md §8: flags
    of value 1 reset by their reader, an acknowledgement per writer, bounded wait kernels), the
    call routed to the command-buffer compatible target and priced captured (``sim.launch``),
    where the plain program is priced as the host enqueues it. Which of the two runs is the
    plan's (the chooser prices both where the program builder builds the replayable one, which
    stays the gate: :func:`replay_refusal`)."""

    impl: str = "native"
    transport: str | None = "nccl"
    chunks: int = 1
    bidirectional: bool = False
    algorithm: str = "two_shot"  # matmul_ar: "two_shot" or "one_shot"
    fused: bool = False
    replayable: bool = False

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise ValueError(f"impl: expected one of {IMPLS}, got {self.impl!r}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm: expected one of {ALGORITHMS}, got {self.algorithm!r}")
        if self.fused and (self.impl != "native" or self.transport not in fused_path.TRANSPORTS
                           or self.algorithm != "two_shot"):
            raise ValueError(
                f"fused=True needs impl='native', algorithm='two_shot' and a transport in "
                f"{fused_path.TRANSPORTS} (got impl={self.impl!r}, transport="
                f"{self.transport!r}, algorithm={self.algorithm!r}); never nccl: a persistent "
                "kernel holding every SM while an NCCL kernel waits for SMs can deadlock "
                "(docs/gpu-internals.md §5)")
        if self.replayable and (self.impl != "native" or self.transport == "nccl"
                                or allreduce.base_algorithm(self.algorithm)):
            raise ValueError(
                f"replayable=True needs impl='native' over a transport other than nccl and no "
                f"one-launch kernel algorithm (got impl={self.impl!r}, transport="
                f"{self.transport!r}, algorithm={self.algorithm!r}): NCCL programs never "
                "replay, and the kernel algorithms replay as they are (docs/gpu.md §6)")

    @property
    def plain(self) -> Candidate:
        """This plan with its plain program (the host enqueues it), the one its margin is
        judged on."""
        return dataclasses.replace(self, replayable=False)

    @property
    def label(self) -> str:
        if self.impl == "xla":
            return "xla (unfused)"
        bidi = " bidi" if self.bidirectional else ""
        shot = {"one_shot": " one-shot", "one_shot_kernel": " one-launch one-shot",
                "two_shot_kernel": " one-launch two-shot"}.get(self.algorithm, "")
        if self.impl == "ring":
            return f"ring{shot}{bidi}"
        fused = " fused" if self.fused else ""
        replay = " replayable" if self.replayable else ""
        return f"native {self.transport}{fused}{shot} chunks={self.chunks}{bidi}{replay}"


@dataclass
class SimResult:
    """A projected call. A model, not a measurement.

    t_gemm: the unchunked GEMM alone; t_comm: the standalone (unfused) collective
    on the plan's transport; t_comm_xla: the NCCL collective of the ``xla`` path;
    t_compute: the plan's own compute ops alone; t_wire: the bytes each rank must move,
    at the transport's rate (no schedule beats it); t_fused: the simulated call.
    """

    op: str
    shape: Shape
    dtype: str
    nranks: int
    preset: str
    candidate: Candidate
    t_fused: float
    t_gemm: float
    t_comm: float
    t_comm_xla: float
    t_compute: float
    t_wire: float = 0.0
    spans: list[Span] = field(default_factory=list, repr=False)
    num_streams: int = 1
    # priced captured in a command buffer: its program replays, so XLA may capture the call
    # (sim.launch; docs/gpu.md §6), no host enqueue per call
    captured: bool = False

    @property
    def t_unfused(self) -> float:
        """The unfused sequence on the plan's transport: collective, then GEMM."""
        return self.t_gemm + self.t_comm

    @property
    def t_xla(self) -> float:
        """The ``xla`` baseline: NCCL collective, then the GEMM."""
        return self.t_gemm + self.t_comm_xla

    @property
    def overlap_efficiency(self) -> float:
        """(T_gemm + T_comm - T_fused) / T_comm: 1 = communication fully hidden."""
        return (self.t_gemm + self.t_comm - self.t_fused) / self.t_comm if self.t_comm else 0.0

    @property
    def speedup(self) -> float:
        """Over the unfused sequence on the same transport."""
        return self.t_unfused / self.t_fused

    @property
    def speedup_vs_xla(self) -> float:
        return self.t_xla / self.t_fused

    @property
    def ideal_speedup(self) -> float:
        """(T_gemm + T_comm) / max(T_gemm, T_wire): perfect overlap, free chunking, and every
        start-up cost of the transfers hidden too."""
        return self.t_unfused / max(self.t_gemm, self.t_wire, 1e-30)

    def row(self) -> dict[str, object]:
        return {
            "plan": self.candidate.label,
            "t_us": round(self.t_fused * 1e6, 1),
            "vs_xla": round(self.speedup_vs_xla, 3),
            "overlap_eff": round(self.overlap_efficiency, 3),
            "t_gemm_us": round(self.t_gemm * 1e6, 1),
            "t_comm_us": round(self.t_comm * 1e6, 1),
        }


def _kernel_fits(transport: str, algorithm: str, nranks: int, shape: Shape,
                 dtype: str | None) -> bool:
    """Whether a one-launch all-reduce of the call's y fits the kernel's fixed area (the
    executors refuse the rest: ``_one_launch.fits``)."""
    from jaxoverlap._one_launch import fits

    out = _kinds.dtype(output_dtype(canonical_dtype(dtype or "bfloat16"))).bytes
    return fits(transport, algorithm, nranks, shape.batch * shape.rows * shape.n * out)


def _problem(op: str, nranks: int, shape: Shape, dtype: str, chunks: int, bidirectional: bool,
             return_gathered: bool, algorithm: str, fused: bool) -> tuple[int, str, dict]:
    """The program's problem as the executors make it: (rows of a block, the GEMMs' dtype, the
    other fields of ``_host.build_program``)."""
    dtype = canonical_dtype(dtype)
    rows = shape.rows
    if _kinds.op(op).rows == "all" and algorithm == "two_shot":
        if rows % nranks:
            raise ValueError(f"the two-shot {op} splits its {rows} rows into {nranks} "
                             "blocks: they do not divide")
        rows //= nranks  # the program's problem: rows per block
    # fp8: x and w of the GEMMs' dtype, y bfloat16 (output_dtype): what the executors run,
    # the fp8 shards and their scales moved by AG+GEMM, the bfloat16 partials reduced
    return rows, dtype, dict(w_dtype=dtype, out_dtype=output_dtype(dtype), chunks=chunks,
                             bidirectional=bidirectional, return_gathered=return_gathered,
                             algorithm=algorithm, fused=fused)


@functools.lru_cache(maxsize=4096)
def replay_refusal(op: str, transport: str, nranks: int, shape: Shape, dtype: str, chunks: int,
                   bidirectional: bool, return_gathered: bool, algorithm: str = "two_shot",
                   fused: bool = False) -> str:
    """Why the program builder does not build this plan's program replayable (``""``: it
    does), asked as the lowering asks it (``_executors.replay``): the gate of a replayable
    candidate."""
    from jaxoverlap._executors import replay

    if nranks < 2:
        return "a call of one rank takes the ordinary path"
    rows, dtype, fields = _problem(op, nranks, shape, dtype, chunks, bidirectional,
                                   return_gathered, algorithm, fused)
    return replay.refusal(op, transport, nranks, shape.batch, rows, shape.k, shape.n, dtype,
                          **fields)


@functools.lru_cache(maxsize=512)
def programs(op: str, transport: str, nranks: int, shape: Shape, dtype: str, chunks: int,
             bidirectional: bool, return_gathered: bool,
             algorithm: str = "two_shot", fused: bool = False,
             replayable: bool = False) -> tuple[dict, ...]:
    """Every rank's program (cached: the simulator only reads them); ``fused``: the fused
    programs, whose compute stream runs one persistent GEMM (``sim.fused``); ``replayable``:
    the replayable programs (refused with the builder's reason where it does not build them:
    :func:`replay_refusal`), priced as built (their acknowledgements, resets and wait kernels)
    and captured (``launch.replays``); else the plain programs, whose host enqueue is priced."""
    from jaxoverlap._executors.runtime import load_host

    if replayable and (why := replay_refusal(op, transport, nranks, shape, dtype, chunks,
                                             bidirectional, return_gathered, algorithm, fused)):
        raise ValueError(f"not built replayable: {why}")
    rows, dtype, fields = _problem(op, nranks, shape, dtype, chunks, bidirectional,
                                   return_gathered, algorithm, fused)
    host = load_host()
    return tuple(host.build_program(op, transport, nranks, r, shape.batch, rows, shape.k,
                                    shape.n, dtype=dtype, replayable=replayable, **fields)
                 for r in range(nranks))


def baseline_times(op: str, shape: Shape, dtype: str, nranks: int,
                   preset: Preset, transport: str = "nccl",
                   block_scaled: bool = False) -> tuple[float, float]:
    """(T_gemm of the whole unchunked GEMM, T_comm of the standalone collective);
    ``block_scaled``: the GEMM is the xla impl's dequantize-then-multiply."""
    # AG: gathered rows; RS: full rows of the local x; AR: all rows
    m = shape.rows if _kinds.op(op).rows == "all" else nranks * shape.rows
    t_gemm = (model.dequantized_gemm_time(preset, shape.batch, m, shape.n, shape.k)
              if block_scaled else model.gemm_time(preset, dtype, shape.batch, m, shape.n,
                                                   shape.k))
    s = model.collective_bytes(op, nranks, shape.batch, shape.rows, shape.k, shape.n, dtype)
    return t_gemm, model.collective_time(preset, transport, nranks, s, op)


@cyclic_gc_paused()
def simulate(op: str, shape: Shape, dtype: str, nranks: int, preset: Preset | str,
             candidate: Candidate | None = None, return_gathered: bool = False,
             block_scaled: bool = False) -> SimResult:
    """Projects one call of ``candidate`` (default: native nccl, 1 chunk) on ``preset``.

    ``block_scaled``: the fp8 operands carry 1x32 block scales (MXFP8). The model prices them
    on the xla and ring impls only, whose GEMMs dequantize and multiply in float32
    (``model.dequantized_gemm_time``) and whose transfers move what the fp8 call moves; a
    native block-scaled call (the host executor's, or the CUDA executor's cuBLASLt GEMMs on
    compute capability 10.x in whole 128x4 tiles) is not priced, so it is refused here."""
    if op not in OPS:
        raise ValueError(f"op: expected one of {OPS}, got {op!r}")
    p = load_preset(preset)
    p.check_group(nranks)
    dtype = canonical_dtype(dtype)
    c = candidate or Candidate()
    if block_scaled and (dtype not in FP8_DTYPES or c.impl == "native"):
        raise ValueError(f"block_scaled: block scales are for fp8 operands, and the model "
                         f"prices them on the xla and ring impls only (no native block-scaled "
                         f"call); got dtype {dtype!r}, candidate {c.label!r}")
    t_gemm, t_comm_xla = baseline_times(op, shape, dtype, nranks, p, block_scaled=block_scaled)
    s = model.collective_bytes(op, nranks, shape.batch, shape.rows, shape.k, shape.n, dtype)
    if c.impl == "xla":
        return SimResult(op, shape, dtype, nranks, p.name, c, t_gemm + t_comm_xla, t_gemm,
                         t_comm_xla, t_comm_xla, t_gemm,
                         model.collective_floor(p, "nccl", nranks, s, op))
    transport = "nccl" if c.impl == "ring" else (c.transport or "nccl")
    p.transport_gbps(transport)  # raises when the machine lacks it
    if c.fused and (why := fused_path.why_not(p, op, transport, c.algorithm, dtype=dtype,
                                              k=shape.k, n=shape.n)):
        raise ValueError(f"candidate {c.label!r}: {why}")
    chunks = 1 if c.impl == "ring" else c.chunks
    ranks = programs(op, transport, nranks, shape, dtype, chunks, c.bidirectional,
                     return_gathered, c.algorithm, c.fused, c.replayable)
    extra = RING_EXTRA_PASSES if c.impl == "ring" else 0
    timeline = simulate_programs(ranks, p, gemm_extra_passes=extra, block_scaled=block_scaled)
    _, t_comm = baseline_times(op, shape, dtype, nranks, p, transport)
    gemms: dict[tuple[int, ...], float] = {}  # the ranks' GEMMs share shapes: priced once

    def alone(o: dict) -> float:  # one compute op with every SM, as the engine costs it
        if o["kind"] == "Add":
            return model.elementwise_time(p, o["bytes"], 3)
        if o["kind"] == "FusedGemm":
            return fused_path.tile_plan(p, dtype, o).alone
        if o["kind"] == "Reduce":
            return reduction.reduction_time(p, len(o["sources"]), o["bytes"], o.get("sms"))
        shape = (o["batch"], o["m"], o["n"], o["k"], bool(o["accumulate"]))
        t = gemms.get(shape)
        if t is None:
            t = gemms[shape] = (model.dequantized_gemm_time(p, *shape, dequantize_w=False)
                                if block_scaled else model.gemm_time(p, dtype, *shape))
        return t + (model.elementwise_time(p, o["bytes"], extra) if extra else 0.0)

    def rank_alone(pr: dict) -> float:
        gemm = [o for o in pr["ops"] if o["kind"] == "Gemm"]
        w_once = 0.0  # block scales: the rank's first GEMM also dequantizes w (the engine's)
        if block_scaled and gemm:
            o = gemm[0]
            args = (o["batch"], o["m"], o["n"], o["k"], bool(o["accumulate"]))
            w_once = (model.dequantized_gemm_time(p, *args)
                      - model.dequantized_gemm_time(p, *args, dequantize_w=False))
        return w_once + sum(alone(o) for o in pr["ops"] if o["kind"] in COMPUTE_KINDS)

    t_compute = max(rank_alone(pr) for pr in ranks)
    return SimResult(op, shape, dtype, nranks, p.name, c, timeline.total, t_gemm, t_comm,
                     t_comm_xla, t_compute, model.collective_floor(p, transport, nranks, s, op),
                     timeline.spans, max(pr["num_streams"] for pr in ranks),
                     timeline.captured)


def candidates(preset: Preset | str, nranks: int, shape: Shape,
               chunk_options: Sequence[int] = (1, 2, 4, 8),
               impls: Iterable[str] = IMPLS,
               transports: Iterable[str] | None = None, op: str | None = None,
               algorithms: Iterable[str] = ALGORITHMS, fused: bool = True,
               dtype: str | None = None, replayable: bool = True) -> list[Candidate]:
    """Every plan the machine supports, simplest first (ties keep the simplest).

    For ``op="matmul_ar"`` also every allowed algorithm: two-shot where the rows split
    into N blocks; one-shot unchunked and in one direction (a latency-bound call gains
    nothing from pipelining, and it has no ring). ``fused``: also the fused plans
    (``sim.fused``) where they run — AG+GEMM and GEMM+RS (``op`` None: either), ``p2p``
    and ``multicast``, compute capability 9.0, 16-bit ``dtype`` (when given) and rows of
    whole 16-byte units — after the chunked ones. Over ``multicast``, and for GEMM+RS (whose
    fused program scatters every partial straight to its owner), in one direction only.
    ``replayable`` (with ``op``): each native plan also with its replayable program, right after
    the plain one, where the program builder builds it so (:func:`replay_refusal`, on the
    problem ``simulate`` prices: y alone), so the chooser prices what either would run.
    """
    p = load_preset(preset)
    impls = tuple(impls)
    allowed = tuple(t for t in (transports or p.transports) if t in p.transports)
    directions = (False, True) if nranks > 2 else (False,)
    row = _kinds.op(op) if op is not None else None  # None: the plans of every op
    all_rows = row is not None and row.rows == "all"  # the shape has every row; two-shot splits
    algorithms = tuple(algorithms) if row is not None and row.one_shot else ("two_shot",)
    two_shot = "two_shot" in algorithms and (not all_rows or shape.rows % nranks == 0)
    rows = shape.rows // nranks if all_rows else shape.rows
    out: list[Candidate] = []
    if "xla" in impls:
        out.append(Candidate("xla", None))
    if "ring" in impls:
        if two_shot:
            out += [Candidate("ring", None, 1, b) for b in directions]
        if "one_shot" in algorithms:
            out.append(Candidate("ring", None, 1, False, "one_shot"))
    if "native" in impls:
        for t in allowed:
            if two_shot:
                for c in sorted({min(max(1, c), rows) for c in chunk_options}):
                    for b in (directions if _kinds.transport(t).ring else (False,)):
                        out.append(Candidate("native", t, c, b))
            if "one_shot" in algorithms:
                out.append(Candidate("native", t, 1, False, "one_shot"))
            # matmul_ar's one-launch kernels: the GEMM and ONE all-reduce kernel, replayed from
            # a command buffer (sim.allreduce, sim.launch), where y fits the kernel's area
            out += [Candidate("native", t, 1, False, a) for a in algorithms
                    if allreduce.base_algorithm(a) and t in allreduce.TRANSPORTS
                    and _kernel_fits(t, a, nranks, shape, dtype)]
        for t in allowed if fused else ():
            ops = (op,) if op else fused_path.OPS
            if any(fused_path.why_not(p, o, t, dtype=dtype, k=shape.k, n=shape.n) for o in ops):
                continue
            ring = _kinds.transport(t).ring and op != "matmul_rs"  # fused RS scatters
            for c in sorted({min(max(1, c), rows) for c in chunk_options}):
                for b in (directions if ring else (False,)):
                    out.append(Candidate("native", t, c, b, fused=True))
    if replayable and op is not None and "native" in impls:
        twins: list[Candidate] = []
        for c in out:
            twins.append(c)
            if (c.impl == "native" and c.transport != "nccl"
                    and not allreduce.base_algorithm(c.algorithm)
                    and not replay_refusal(op, c.transport, nranks, shape,
                                           dtype or "bfloat16", c.chunks, c.bidirectional,
                                           False, c.algorithm, c.fused)):
                twins.append(dataclasses.replace(c, replayable=True))
        out = twins
    return out


@dataclass
class Choice:
    """The pick and every candidate's projection (for a debug log).

    ``outside``: why this projection lies outside the range the preset was checked
    against measurements (empty when inside); ``min_gain``: the margin applied.
    """

    best: SimResult
    table: list[SimResult]
    outside: list[str] = field(default_factory=list)
    min_gain: float = 0.0  # the margin that decided: the pick's family's, or (xla kept) the
    # fastest plan's
    unfused: bool = True  # the unfused path was allowed to win
    margins: dict[str, float] = field(default_factory=dict)  # per family in the table

    @property
    def candidate(self) -> Candidate:
        return self.best.candidate

    def __iter__(self) -> Iterator[object]:
        """``pick, table = sim.choose(...)``: the chosen Candidate and every SimResult."""
        return iter((self.candidate, self.table))

    def format(self) -> str:
        lines = [f"{'plan':<36} {'t_us':>9} {'vs_xla':>7} {'overlap':>8}"]
        for r in sorted(self.table, key=lambda r: r.t_fused):
            mark = "  <- pick" if r is self.best else ""
            lines.append(f"{r.candidate.label:<36} {r.t_fused * 1e6:>9.1f} "
                         f"{r.speedup_vs_xla:>7.3f} {r.overlap_efficiency:>8.3f}{mark}")
        if self.unfused:
            lines.append(f"fallback margin: a plan must be predicted {self.min_gain:.0%} "
                         "faster than xla (the model's measured error)")
            if len(set(self.margins.values())) > 1:
                lines.append("  per family: " + ", ".join(
                    f"{f} {m:.0%}" for f, m in sorted(self.margins.items())))
        else:
            lines.append("a fused impl was asked for: the fastest fused plan, even if slower "
                         "than xla")
        if self.outside:
            lines.append("OUTSIDE THE CALIBRATED RANGE (extrapolated): " + "; ".join(self.outside))
        return "\n".join(lines)


@cyclic_gc_paused()
def choose(op: str, shape: Shape, dtype: str, nranks: int, preset: Preset | str,
           cands: Sequence[Candidate] | None = None, min_gain: float | None = None,
           unfused: bool = True, block_scaled: bool = False) -> Choice:
    """Predicts each candidate and picks the fastest.

    The unfused ``xla`` path is always among the candidates and wins unless a
    plan is predicted at least ``min_gain`` faster (a fraction; default the
    preset's margin for the plan's family, ``sim.families``, derived from the model's
    measured error against the published designs closest to that family,
    ``sim.published.fallback_margins``): never slower by choice. Ties keep the earlier
    (simpler) candidate. A replayable twin (priced captured) is picked only where its plain
    program clears the margin too: the margins were derived on host-enqueued runs, and a
    capture's saving is checked by no published measurement, so it chooses how a plan that
    wins runs, never whether a plan wins. ``unfused=False``: the caller
    has fixed a fused impl, so the fastest of ``cands`` is picked (the xla path is
    still simulated, for the log, but never picked). ``block_scaled``: fp8 operands with
    block scales (MXFP8), which the model prices on the xla and ring impls only (``simulate``);
    by default their plans are the candidates.
    """
    p = load_preset(preset)
    cands = (list(cands) if cands is not None
             else candidates(p, nranks, shape, op=op, dtype=dtype,
                             impls=("xla", "ring") if block_scaled else IMPLS))
    if not any(c.impl == "xla" for c in cands):
        cands.insert(0, Candidate("xla", None))
    table = [simulate(op, shape, dtype, nranks, p, c, block_scaled=block_scaled)
             for c in cands]
    xla = next(r for r in table if r.candidate.impl == "xla")
    outside = outside_calibrated(p, op, shape, dtype, nranks, block_scaled)
    if not unfused:
        fused = [r for r in table if r.candidate.impl != "xla"]
        if not fused:
            raise ValueError("choose(unfused=False) needs at least one fused candidate")
        best = min(fused, key=lambda r: r.t_fused)
        return Choice(best, table, outside, 0.0, unfused=False)
    margins = {f: (p.margin(op, f) if min_gain is None else min_gain)
               for f in {families.family(op, r.candidate) for r in table} - {""}}
    def clears(r: SimResult) -> bool:
        f = families.family(op, r.candidate)
        return bool(f) and r.t_fused <= xla.t_fused * (1 - margins[f])

    # Whether a plan beats xla is decided on its plain program, enqueued by the host: the price
    # the margins were derived with (the published designs' runs, sim.published). A replayable
    # twin, priced captured, only picks how a plan that wins so runs: a capture's saving is
    # checked by no published measurement of a GEMM with its communication.
    plain_clears = {r.candidate for r in table if not r.candidate.replayable and clears(r)}
    best = xla
    for r in table:
        if r.t_fused < best.t_fused and clears(r) and (
                not r.candidate.replayable
                or r.candidate.plain in plain_clears):
            best = r
    plans = [r for r in table if r.candidate.impl != "xla"]
    decider = best if best is not xla else min(plans, key=lambda r: r.t_fused, default=None)
    applied = (margins[families.family(op, decider.candidate)] if decider is not None
               else (p.margin(op) if min_gain is None else min_gain))
    return Choice(best, table, outside, applied, margins=margins)
