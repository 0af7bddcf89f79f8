"""Projected tables and Gantt charts (all model output, labelled so)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from jaxoverlap import _kinds
from jaxoverlap.sim import reduction
from jaxoverlap.sim.model import Shape
from jaxoverlap.sim.plan import SimResult, baseline_times, choose, programs
from jaxoverlap.sim.presets import FP8_DTYPES, PRESETS, Preset, canonical_dtype, load_preset

MODEL_LABEL = "MODEL PROJECTION (jaxoverlap.sim), not a measurement"


@dataclass(frozen=True)
class Case:
    """One problem of the projected table; ``ref`` names the peer number it mirrors."""

    label: str
    op: str
    m: int  # global rows (gathered / full sequence)
    k: int  # per rank: AG hidden; RS the local contraction slice
    n: int  # per rank: AG local output columns; RS hidden
    nranks: int = 8
    dtype: str = "bfloat16"
    ref: str = ""

    def published(self) -> str:
        """The published fused speedups at exactly this problem (``sim.published``), best
        first, with their machines ("—" when none)."""
        from jaxoverlap.sim import published

        if canonical_dtype(self.dtype) in FP8_DTYPES:
            return "— (no published FP8 row)"
        rows = sorted((r for r in published.CALLS
                       if (r.op, r.m, r.k, r.n, r.nranks) == (self.op, self.m, self.k, self.n,
                                                              self.nranks)),
                      key=lambda r: -r.published_speedup)
        return "; ".join(f"{r.published_speedup:.2f}x {r.id} ({r.machine}"
                         f"{', loss' if r.loss else ''})" for r in rows) or "—"

    @property
    def shape(self) -> Shape:
        if _kinds.op(self.op).rows == "all":  # AR's canonical shape has all the rows
            return Shape(1, self.m, self.k, self.n)
        return Shape.from_global(self.m, self.k, self.n, self.nranks)


STANDARD_CASES: tuple[Case, ...] = (
    Case("AG std", "ag_matmul", 8192, 8192, 3584,
         ref="P2/8192 (symm-mem, 8xH100 HBM2e): 1.36x published"),
    Case("RS std", "matmul_rs", 8192, 3584, 8192,
         ref="F8/8192 (Flux, 8xH100): 0.84x; TD-RS5 (Triton-distributed, 8xH800): 1.55x"),
    Case("AG M2048", "ag_matmul", 2048, 8192, 3584,
         ref="P4 (PyTorch PR #143160): multicast 1.09x, decomposed 0.85x"),
    Case("AG flux", "ag_matmul", 4096, 12288, 6144,
         ref="F1 (Flux, 8xH800): 1.49x; L1 (Flux, 8xL20 PCIe): 2.87x"),
    Case("RS flux", "matmul_rs", 4096, 6144, 12288,
         ref="F2 (Flux, 8xH800): 1.51x; L2 (Flux, 8xL20 PCIe): 3.08x"),
    Case("RS M32768", "matmul_rs", 32768, 3584, 8192,
         ref="F8/32768 (Flux, 8xH100): 0.80x (fused slower)"),
    Case("AG decode", "ag_matmul", 64, 8192, 3584, ref="tiny GEMM: unfused expected"),
)


# The standard cases with fp8 operands (e4m3, the output bfloat16): the GEMM at the FP8 peak;
# AG+GEMM gathers one byte per element, GEMM+RS reduces the bfloat16 partials as before.
FP8_CASES: tuple[Case, ...] = tuple(
    dataclasses.replace(c, label=f"{c.label} fp8", dtype="float8_e4m3fn",
                        ref=f"{c.label} with fp8 operands")
    for c in STANDARD_CASES if c.label in ("AG std", "RS std", "AG flux", "RS flux"))


# A tensor-parallel decode step's row-parallel GEMM + all-reduce (Megatron's g): M = the batch
# of one-token rows, K = a rank's slice of an 8192 FFN/attention width, N = the 8192 hidden.
DECODE_CASES: tuple[Case, ...] = tuple(
    Case(f"AR decode M{m}", "matmul_ar", m, 1024, 8192,
         ref="latency-bound: one-shot custom all-reduces (vLLM, TensorRT-LLM) win here")
    for m in (1, 16, 64, 256))


def decode_table(preset: str | Preset, cases: Sequence[Case] = DECODE_CASES
                 ) -> list[dict[str, object]]:
    """Decode shapes (M 1-256): latency, not bandwidth. Per case: the xla path (GEMM, then
    NCCL's ring all-reduce: 2(N-1) steps), the best two-shot and one-shot native plans (their
    plain programs), what the chooser picks with impl="auto" and with impl="native", and why;
    and what the fastest
    one-launch all-reduce kernel costs captured in a command buffer (``sim.allreduce``,
    ``sim.launch``), and the best of the executors' one-launch programs (GEMM + that kernel)."""
    from jaxoverlap.sim import allreduce, families, launch, model

    p = load_preset(preset)
    rows: list[dict[str, object]] = []
    for case in cases:
        auto = choose(case.op, case.shape, case.dtype, case.nranks, p)
        native = [r for r in auto.table if r.candidate.impl == "native"]
        # the plain programs, as the host enqueues them (their replayable twins are picked only
        # where these win: sim.choose)
        best_of = {alg: min((r for r in native if r.candidate.algorithm == alg
                             and not r.candidate.replayable),
                            key=lambda r: r.t_fused, default=None)
                   for alg in ("two_shot", "one_shot")}
        # the executors' one-launch programs (the GEMM, then one all-reduce kernel; captured)
        best_of["kernel"] = min((r for r in native
                                 if allreduce.base_algorithm(r.candidate.algorithm)),
                                key=lambda r: r.t_fused, default=None)
        fused = min(native, key=lambda r: r.t_fused)
        c = fused.candidate
        ranks = programs(case.op, c.transport or "nccl", case.nranks, case.shape,
                         case.dtype, c.chunks, c.bidirectional, False, c.algorithm)
        host = model.host_time(p, ranks)
        kernel_alg = allreduce.base_algorithm(c.algorithm)
        steps = 1 if c.algorithm == "one_shot" else 2 * (case.nranks - 1)
        if kernel_alg:
            why_native = (f"the GEMM and ONE {kernel_alg.replace('_', '-')} all-reduce kernel "
                          f"({_rounds(allreduce.flag_rounds(kernel_alg, c.transport))}), "
                          f"captured: no host enqueue per call")
        else:
            why_native = (f"{c.algorithm.replace('_', '-')}: {steps} transfer step(s)"
                          + (f" instead of {2 * (case.nranks - 1)}" if steps == 1 else
                             ", the bytes each rank moves 2(N-1)/N of y instead of N-1 "
                             "partials"))
        xla = auto.table[0]
        if not kernel_alg and fused.captured:  # a program built replayable (launch.replays)
            why_native += ", priced captured (its program replays: no host enqueue per call)"
        if auto.best.candidate.impl == "xla" and (kernel_alg or fused.captured):
            why = (f"xla: the best native plan ({c.label}, captured) costs "
                   f"{fused.t_fused * 1e6:.0f} µs against the GEMM and NCCL's all-reduce "
                   f"{xla.t_xla * 1e6:.0f} µs, less than the margin {auto.min_gain:.0%} below")
        elif auto.best.candidate.impl == "xla":
            why = (f"xla: the best fused plan costs {fused.t_fused * 1e6:.0f} µs, of which the "
                   f"host's enqueue of its {max(len(q['ops']) for q in ranks)} ops "
                   f"{host * 1e6:.0f} µs, against the GEMM and NCCL's all-reduce "
                   f"{xla.t_xla * 1e6:.0f} µs")
        else:
            why = f"{auto.best.candidate.label}: {1 - auto.best.t_fused / xla.t_xla:.0%} " \
                  f"below xla (margin {auto.min_gain:.0%})"
        nbytes = case.m * case.n * (4 if case.dtype == "float32" else 2)
        picked = auto.best.candidate
        if auto.best.candidate.impl == "native" and allreduce.base_algorithm(picked.algorithm):
            # the pick's all-reduce part: its kernel alone, captured, against NCCL's
            part = launch.call_time(p, allreduce.kernel_time(
                p, picked.algorithm, picked.transport, case.nranks, nbytes), 1,
                captured=True)
            why += (f", its all-reduce kernel {part * 1e6:.1f} µs = "
                    f"{part / xla.t_comm_xla:.2f}x NCCL's; the margin of "
                    f"{families.family(case.op, picked)} (docs/performance.md §5)")
        # the one-shot: the family the lean published kernels fit
        kernel, algorithm, transport = allreduce.best(p, case.nranks, nbytes,
                                                      algorithms=("one_shot",))
        rows.append({
            "preset": p.name, "case": case.label, "m": case.m,
            "bytes": nbytes,
            "t_one_launch_us": launch.call_time(p, kernel, 1, captured=True) * 1e6,
            "one_launch": f"{algorithm.replace('_', '-')} {transport}",
            "t_xla_us": xla.t_xla * 1e6, "t_comm_us": xla.t_comm_xla * 1e6,
            "t_two_shot_us": best_of["two_shot"].t_fused * 1e6 if best_of["two_shot"] else None,
            "t_one_shot_us": best_of["one_shot"].t_fused * 1e6 if best_of["one_shot"] else None,
            "t_kernel_us": best_of["kernel"].t_fused * 1e6 if best_of["kernel"] else None,
            "pick": auto.best.candidate.label, "native_pick": c.label,
            "why": why, "why_native": why_native, "outside": auto.outside,
        })
    return rows


def _rounds(n: int) -> str:
    return f"{n} flag round{'s' if n != 1 else ''}"


def _one_shot_checks(rows: Sequence[dict[str, object]]) -> list[str]:
    """Our one-shot kernel against the published one-stage kernel at its sizes (TP8), priced
    alike (alone, on a running stream)."""
    from jaxoverlap.sim import allreduce, published

    names = {str(r["preset"]) for r in rows}
    out = []
    for row in published.ONE_LAUNCH_ALL_REDUCES:
        if row.design != "vllm-one-stage" or row.nranks != 8 or row.machine not in names:
            continue
        p = load_preset(row.machine)
        ours = allreduce.kernel_time(p, "one_shot", "p2p", 8, row.nbytes) * 1e6
        theirs = published.one_launch_time(row) * 1e6
        out.append(f"one-shot p2p kernel at {row.nbytes >> 10} KiB, 8 GPUs: ours {ours:.1f} µs, "
                   f"vLLM's one-stage {theirs:.1f} µs by the model, {row.us:.1f} published "
                   f"({row.id})")
    return out


def format_decode_table(rows: Sequence[dict[str, object]]) -> str:
    """The decode table as text, every line labelled a model."""
    def us(v: object) -> str:
        return "—" if v is None else f"{v:.1f}"

    lines = [MODEL_LABEL, f"{'case':<16} {'y bytes':>9} {'xla µs':>8} {'AR µs':>7} "
             f"{'2-shot µs':>10} {'1-shot µs':>10} {'1-launch µs':>12} "
             f"{'1-launch 1-shot':>15}  pick (auto) / pick (native)"]
    for r in rows:
        lines.append(f"{r['case']:<16} {r['bytes']:>9} {us(r['t_xla_us']):>8} "
                     f"{us(r['t_comm_us']):>7} {us(r['t_two_shot_us']):>10} "
                     f"{us(r['t_one_shot_us']):>10} {us(r['t_kernel_us']):>12} "
                     f"{us(r['t_one_launch_us']):>15}  {r['pick']} / {r['native_pick']}")
    for r in rows:
        lines.append(f"  {r['case']}: {r['why']}; native: {r['why_native']}"
                     + (" (outside the calibrated range)" if r["outside"] else ""))
    lines.append("  1-launch: the best of the executors' one-launch programs (GEMM + one "
                 "all-reduce kernel, algorithm one_shot_kernel / two_shot_kernel), captured in a "
                 "command buffer; compiled and run on the CUDA fake, never on a GPU")
    lines.append("  1-launch 1-shot: the one-shot all-reduce kernel alone, captured ("
                 + ", ".join(f"{r['case'].split()[-1]} {r['one_launch']}" for r in rows)
                 + "; docs/performance.md)")
    lines.extend(f"  {line}" for line in _one_shot_checks(rows))
    return "\n".join(lines)


OVERLAPPED_LABEL = ("PROJECTION of a published design's mechanism, not of our program "
                    "(sim.reduction.overlapped: copy-engine copies beside the persistent GEMM, "
                    "the reduction beside or after it, the host ops of Triton-distributed's "
                    "call), not a measurement")
# The design whose host-issued ops (``reduction.HOST_OPS``) the table's projection counts: of
# the two copy-engine designs, the one that issues more per call.
OVERLAPPED_DESIGN = "triton-dist-rs"


def overlapped_table(preset: str | Preset, cases: Sequence[Case] = STANDARD_CASES
                     ) -> list[dict[str, object]]:
    """The GEMM+RS cases (16-bit, over p2p) priced as the design of
    ``sim.reduction.overlapped`` (Triton-distributed's and kraken's copy-engine GEMM+RS when
    its reduction runs after the GEMM: the parts the overlapped program is built from, checked
    against their published calls): xla's time, the projection's, its parts and its design."""
    p = load_preset(preset)
    rows: list[dict[str, object]] = []
    if not p.p2p_gbps:
        return rows
    for case in cases:
        if case.op != "matmul_rs" or canonical_dtype(case.dtype) in FP8_DTYPES:
            continue
        t_gemm, t_comm = baseline_times(case.op, case.shape, case.dtype, case.nranks, p)
        o = reduction.overlapped(p, case.dtype, 1, case.m, case.n, case.k, case.nranks,
                                 design=OVERLAPPED_DESIGN)
        xla = t_gemm + t_comm
        design = (f"{o.chunks} sub-chunk(s), reduction on {o.sms} SMs beside the GEMM" if o.sms
                  else f"{o.chunks} sub-chunk(s), copies beside the GEMM, one reduction after")
        # Flux's Hopper design (pulls by the GEMM kernel's warps, then ATen's stacked sum) where
        # its persistent GEMM runs, at the middle and the ends of the sum's published efficiency
        flux = tuple(xla / reduction.pulled(p, case.dtype, 1, case.m, case.n, case.k,
                                            case.nranks, e).seconds
                     for e in (None, *reduction.STACKED_SUM_HBM)) if p.fused_gemm else ()
        rows.append({"preset": p.name, "case": case.label, "t_xla_us": xla * 1e6,
                     "t_us": o.seconds * 1e6, "vs_xla": xla / o.seconds,
                     "ideal": xla / max(t_gemm, t_comm), "gemm_us": o.gemm * 1e6,
                     "copies_us": o.copies * 1e6, "tail_us": o.tail * 1e6, "design": design,
                     "flux": flux, "published": case.published()})
    return rows


def format_overlapped_table(rows: Sequence[dict[str, object]]) -> str:
    """The overlapped GEMM+RS projections as text, labelled a projection; under each case,
    Flux's Hopper design priced by its own mechanism where its GEMM runs."""
    lines = [OVERLAPPED_LABEL,
             f"{'case':<12} {'xla µs':>8} {'proj. µs':>9} {'vs xla':>7} {'ideal':>6} "
             f"{'GEMM µs':>8} {'copies µs':>10} {'tail µs':>8}  design"]
    for r in rows:
        lines.append(f"{r['case']:<12} {r['t_xla_us']:>8.0f} {r['t_us']:>9.0f} "
                     f"{r['vs_xla']:>7.2f} {r['ideal']:>6.2f} {r['gemm_us']:>8.0f} "
                     f"{r['copies_us']:>10.0f} {r['tail_us']:>8.0f}  {r['design']}")
    for r in rows:
        lines.append(f"  {r['case']}: published fused at this shape: {r['published']}")
        if flux := r.get("flux"):
            mid, slow, fast = flux  # type: ignore[misc]
            lo, hi = (f"{e:.0%}" for e in reduction.STACKED_SUM_HBM)
            lines.append(f"    Flux's Hopper design (sim.reduction.pulled): {mid:.2f}x "
                         f"({slow:.2f}-{fast:.2f}x with its stacked sum at {lo}-{hi} of HBM)")
    return "\n".join(lines)


def markdown_decode_table(preset: str | Preset = "h100",
                          rows: Sequence[dict[str, object]] | None = None) -> str:
    """The decode table of docs/performance.md (the same numbers as ``bench --model``);
    ``rows``: ``decode_table(preset)`` when already computed."""
    def us(v: object) -> str:
        return "—" if v is None else f"{v:.1f}"

    lines = ["| M | y bytes | xla µs | NCCL all-reduce µs | best two-shot µs | best one-shot µs "
             "| best one-launch program µs (captured) | one-launch one-shot kernel µs "
             "| auto picks | native picks |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows if rows is not None else decode_table(preset):
        lines.append(f"| {r['m']} | {r['bytes']} | {us(r['t_xla_us'])} | {us(r['t_comm_us'])} "
                     f"| {us(r['t_two_shot_us'])} | {us(r['t_one_shot_us'])} "
                     f"| {us(r['t_kernel_us'])} "
                     f"| {us(r['t_one_launch_us'])} ({r['one_launch']}) | {r['pick']} "
                     f"| {r['native_pick']} |")
    return "\n".join(lines)


def projection_table(presets: Iterable[str | Preset] = tuple(PRESETS),
                     cases: Sequence[Case] = STANDARD_CASES) -> list[dict[str, object]]:
    """One row per (preset, case): the xla baseline, the chosen plan and its metrics."""
    rows: list[dict[str, object]] = []
    for spec in presets:
        p = load_preset(spec)
        for case in cases:
            choice = choose(case.op, case.shape, case.dtype, case.nranks, p)
            b = choice.best
            rows.append({
                "preset": p.name, "case": case.label, "op": case.op,
                "shape": f"TP{case.nranks} M{case.m} K{case.k} N{case.n}",
                "t_gemm_us": b.t_gemm * 1e6, "t_comm_us": b.t_comm_xla * 1e6,
                "t_xla_us": b.t_xla * 1e6, "plan": b.candidate.label,
                "t_plan_us": b.t_fused * 1e6, "vs_xla": b.speedup_vs_xla,
                "speedup": b.speedup, "overlap_eff": b.overlap_efficiency,
                "ideal": b.ideal_speedup, "fused": b.candidate.fused,
                "priced": _priced(b),
                "published": case.published(), "ref": case.ref,
                "outside": choice.outside,
            })
    return rows


def _priced(r: SimResult) -> str:
    """How a pick's call is priced: ``captured`` (its program replays, so XLA may capture it in
    a command buffer: no host enqueue per call, ``sim.launch``), ``eager`` (the host enqueues
    its every op, which may bound it), or ``xla`` (XLA's own ops)."""
    if r.candidate.impl != "native":
        return "xla" if r.candidate.impl == "xla" else "eager"
    return "captured" if r.captured else "eager"


def format_table(rows: Sequence[dict[str, object]], markdown: bool = True) -> str:
    """The projection table; a case outside its preset's calibrated range is marked "*"
    (text: with the reasons under the table)."""
    cols = [("preset", "preset"), ("case", "case"), ("shape", "shape (per-rank K/N)"),
            ("t_xla_us", "xla µs"), ("plan", "chosen plan"), ("priced", "priced³"),
            ("t_plan_us", "plan µs"),
            ("vs_xla", "vs xla"), ("speedup", "speedup¹"), ("overlap_eff", "overlap eff¹"),
            ("ideal", "ideal¹"), ("outside", "calibrated"),
            ("published", "published fused, same shape²")]

    def fmt(key: str, v: object) -> str:
        if key == "outside":
            return "no*" if v else "yes"
        if isinstance(v, float):
            return f"{v:.0f}" if key.endswith("_us") else f"{v:.2f}"
        return str(v)

    lines = []
    if markdown:
        lines.append("| " + " | ".join(h for _, h in cols) + " |")
        lines.append("|" + "---|" * len(cols))
        for r in rows:
            lines.append("| " + " | ".join(fmt(k, r[k]) for k, _ in cols) + " |")
    else:
        cols = cols[:-1]  # the published speedups go under the table
        lines.append(MODEL_LABEL)
        lines.append("  ".join(f"{h:>14}" for _, h in cols))
        for r in rows:
            lines.append("  ".join(f"{fmt(k, r[k]):>14}" for k, _ in cols))
        for r in rows:
            lines.append(f"² {r['preset']} {r['case']}: {r['plan']} projects "
                         f"{r['vs_xla']:.2f}x vs xla{_PRICED_WHY[str(r['priced'])]}; published "
                         f"fused at this shape: {r['published']}")
        lines.append("³ captured: the pick's program replays, so XLA may capture its call in a "
                     "command buffer (its default set holds custom calls; a run of at least 5 "
                     "commands): priced with no host enqueue, a replayed node per op "
                     "(docs/gpu.md §6); eager: the host enqueues every op")
        for r in rows:
            if r["outside"]:
                lines.append(f"* {r['preset']} {r['case']}: outside the calibrated range "
                             f"(extrapolated): {'; '.join(r['outside'])}")
    return "\n".join(lines)


_PRICED_WHY = {"captured": ", priced captured (its program replays)",
               "eager": ", priced eager (the host enqueues its ops)", "xla": ""}


def preset_table(presets: Iterable[str | Preset] = tuple(PRESETS)) -> str:
    """The presets' main numbers as a markdown table (docs/performance.md §3)."""
    lines = ["| preset | GPU / fabric | dense BF16 TFLOP/s | best-shape eff | FP8 eff | HBM | "
             "link | NCCL ring | NCCL send/recv | CE p2p | multicast | fused GEMM (CC) | "
             "margin AG chunked / fused, RS chunked / fused |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    def rate(v: float | None, none: str) -> str:
        return f"{v:g}" if v else none

    for spec in presets:
        p = load_preset(spec)
        shape = "x".join(map(str, p.gemm_best_shape))
        cc = ".".join(map(str, p.compute_capability)) if p.compute_capability else "?"
        fused = f"{p.fused_gemm_rate:g}x cuBLAS ({cc})" if p.fused_gemm else f"no ({cc})"
        fp8 = p.gemm_fit("fp8")
        fp8_eff = (f"{fp8.efficiency:.3f} (fitted)" if fp8.measured and "float8" in p.peak_tflops
                   else "16-bit's (extrapolated)" if "float8" in p.peak_tflops else "— (no FP8)")
        margins = " / ".join(f"{p.margin(op, f'{op}:{kind}'):.1%}"
                             for op in ("ag_matmul", "matmul_rs") for kind in ("chunked", "fused"))
        lines.append(
            f"| `{p.name}` | {p.gpu} | {p.peak_tflops['bfloat16']:g} | "
            f"{p.gemm_efficiency:.3f} at {shape} | {fp8_eff} | {p.hbm_gbps:g} | "
            f"{p.link_gbps:g} | {p.nccl_gbps:g} | {rate(p.nccl_p2p_gbps, '—')} | "
            f"{rate(p.p2p_gbps, 'no')} | {rate(p.multicast_gbps, 'no')} | {fused} | "
            f"{margins} |")
    return "\n".join(lines)


def gantt(result: SimResult, path: str | os.PathLike[str], ranks: Sequence[int] | None = None,
          title: str | None = None) -> str:
    """Draws one plan's per-stream timeline (one row per rank x stream) to a PNG.

    Blocking (Wait / StreamWait) is drawn light grey so the exposed communication
    shows; labelled as a model. Returns the path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"Gemm": "tab:blue", "FusedGemm": "tab:blue", "Add": "tab:cyan",
              "Copy": "tab:orange", "Send": "tab:red", "Recv": "tab:pink", "McStore": "tab:purple",
              "McReduce": "tab:purple", "Wait": "0.85", "StreamWait": "0.85"}
    ranks = list(ranks) if ranks is not None else sorted({s.rank for s in result.spans})
    rows = sorted({(s.rank, s.stream) for s in result.spans if s.rank in ranks})
    y = {key: i for i, key in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.8))
    for s in result.spans:
        if (s.rank, s.stream) not in y or s.end <= s.start or s.kind not in colors:
            continue
        if s.kind == "Recv":  # same transfer as the Send drawn on the peer's row
            continue
        ax.barh(y[(s.rank, s.stream)], (s.end - s.start) * 1e6, left=s.start * 1e6,
                height=0.7, color=colors[s.kind], edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r} {'compute' if st == 0 else f'comm {st}'}" for r, st in rows])
    ax.invert_yaxis()
    ax.set_xlabel("µs")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[k])
               for k in ("Gemm", "Add", "Copy", "Send", "McStore", "Wait")]
    ax.legend(handles, ["Gemm (fused: one)", "Add", "Copy (CE)", "Send/Recv (NCCL)", "Multicast",
                        "waiting"],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    shape = result.shape
    ax.set_title(title or (
        f"{MODEL_LABEL}\n{result.preset}: {result.op} TP{result.nranks} rows/rank={shape.rows} "
        f"K={shape.k} N={shape.n} {result.dtype}, {result.candidate.label}: "
        f"{result.t_fused * 1e6:.0f} µs vs xla {result.t_xla * 1e6:.0f} µs, "
        f"overlap eff {result.overlap_efficiency:.2f}"), fontsize=9)
    fig.tight_layout()
    out = os.fspath(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
