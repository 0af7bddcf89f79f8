"""Fitting a preset to measured points: ``sim.calibrate``.

Five kinds of points, each fitting the parameters only it can see, in this order:

* ``CollectivePoint`` (one collective alone, by size): per transport the
  asymptotic bandwidth and the per-hop ramp. ``model.collective_time`` is linear
  in the square roots: sqrt(t - latency) = sqrt(ramp) sqrt(N-1) + sqrt(bus_bytes / B),
  so this is a non-negative linear least-squares fit (relative errors).
* ``GemmPoint`` (one GEMM alone) and ``SerialPoint`` (an unfused call, whose
  collective is now known): the fastest GEMM point becomes the best shape; the
  efficiency there, ``gemm_k_half`` and ``gemm_overhead_us`` are fitted to all of them.
* ``ConcurrentPoint`` (a GEMM next to an independent collective): ``interference``
  from copy-engine points, then ``nccl_sms`` from NCCL points.
* ``FusedPoint`` (a call of our own native program): one scale on the fused path's
  own costs (copy-engine start and ramp, flags, events, host enqueue), then the
  margins per op (``margin``) from the errors left.

Every parameter the points do not reach stays the base preset's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from jaxoverlap import _kinds
from jaxoverlap.sim import confidence, model
from jaxoverlap.sim.engine import simulate_programs
from jaxoverlap.sim.model import Shape
from jaxoverlap.sim.plan import Candidate, baseline_times, simulate
from jaxoverlap.sim.presets import Preset, canonical_dtype, load_preset

US = model.US


@dataclass(frozen=True)
class GemmPoint:
    """d = a @ w of [batch, m, k] x [k, n] alone took ``seconds``."""

    m: int
    n: int
    k: int
    seconds: float
    dtype: str = "bfloat16"
    batch: int = 1


@dataclass(frozen=True)
class CollectivePoint:
    """The unfused collective of ``op`` over ``nranks`` moving S = ``nbytes`` took ``seconds``.

    S as in nccl-tests: the whole gathered (all-gather) or pre-reduction
    (reduce-scatter) array.
    """

    op: str
    nranks: int
    nbytes: int
    seconds: float
    transport: str = "nccl"


@dataclass(frozen=True)
class SerialPoint:
    """The unfused path of one call (the collective, then the whole GEMM) took ``seconds``."""

    op: str
    shape: Shape
    dtype: str
    nranks: int
    seconds: float
    transport: str = "nccl"


@dataclass(frozen=True)
class ConcurrentPoint:
    """A GEMM and an independent collective of ``op`` started together; both done after
    ``seconds`` (the collective on ``transport``: "nccl" takes SMs, "p2p" is the copy
    engine)."""

    m: int
    n: int
    k: int
    op: str
    nranks: int
    nbytes: int
    seconds: float
    transport: str = "nccl"
    dtype: str = "bfloat16"


@dataclass(frozen=True)
class FusedPoint:
    """One call of our native program (``candidate``) took ``seconds``; ``serial_seconds``
    is the unfused path (collective then GEMM) of the same call when measured."""

    op: str
    shape: Shape
    dtype: str
    nranks: int
    candidate: Candidate
    seconds: float
    serial_seconds: float | None = None


# ---- one kind of point at a time ------------------------------------------------------------


def _log_error(pred: float, meas: float) -> float:
    return math.log(pred / meas)


def _minimize(f: Callable[[float], float], lo: float, hi: float) -> float:
    from scipy.optimize import minimize_scalar

    return float(minimize_scalar(f, bounds=(lo, hi), method="bounded",
                                 options={"xatol": 1e-4 * (hi - lo)}).x)


def _achieved(p: Preset, g: GemmPoint) -> float:
    """Fraction of peak the point reached while busy (its per-kernel cost removed)."""
    busy = max(g.seconds - p.gemm_overhead_us * US, 1e-12)
    return (2.0 * g.batch * g.m * g.n * g.k / busy
            / (p.peak_tflops[canonical_dtype(g.dtype)] * 1e12))


def _gemm_seconds(p: Preset, g: GemmPoint | SerialPoint) -> float:
    if isinstance(g, GemmPoint):
        return model.gemm_time(p, g.dtype, g.batch, g.m, g.n, g.k)
    t_gemm, t_comm = baseline_times(g.op, g.shape, g.dtype, g.nranks, p, g.transport)
    return t_gemm + t_comm


def fit_gemm(p: Preset, points: Sequence[GemmPoint], serial: Sequence[SerialPoint] = ()
             ) -> Preset:
    """Best shape = the fastest GEMM point; then the efficiency there, ``gemm_k_half`` and
    ``gemm_overhead_us`` fitted to every point (GEMMs alone, and unfused calls whose
    collective is already fitted), as many of the three as there are points.

    The fit minimises the sum of the fourth powers of the log errors: close to the
    worst error, which is what the model is held to (and what its margin derives
    from), yet smooth.
    """
    if not points:
        return p
    best = max(points, key=lambda g: _achieved(p, g))
    p = p.replace(gemm_efficiency=_achieved(p, best), gemm_best_shape=(best.m, best.n, best.k))
    every: list[GemmPoint | SerialPoint] = [*points, *serial]
    # One parameter per ~2 points: the efficiency always, the K curve from 3 points, the
    # per-kernel cost from 5 (fewer points cannot tell them apart).
    names = ("gemm_efficiency", "gemm_k_half", "gemm_overhead_us")[
        :1 + (len(every) >= 3) + (len(every) >= 5)]
    from scipy.optimize import minimize

    def preset(x: Sequence[float]) -> Preset:
        return p.replace(**dict(zip(names, (float(v) for v in x), strict=False)))

    def cost(x: Sequence[float]) -> float:
        q = preset(x)
        return sum(_log_error(_gemm_seconds(q, g), g.seconds) ** 4 for g in every)

    bounds = [(1e-6, 1.0), (0.0, 16384.0), (0.0, 1000.0)][:len(names)]
    start = [min(max(getattr(p, n), lo), hi) for n, (lo, hi) in zip(names, bounds, strict=True)]
    x = minimize(cost, start, method="Nelder-Mead", bounds=bounds,
                 options={"xatol": 1e-4, "fatol": 1e-16, "maxiter": 4000}).x
    digits = {"gemm_efficiency": 4, "gemm_k_half": 1, "gemm_overhead_us": 2}
    return p.replace(**{n: round(float(v), digits[n]) for n, v in zip(names, x, strict=True)})


def fit_one_shot(p: Preset, points: Sequence[tuple[int, float]]) -> Preset:
    """``mc_latency_us`` fitted to (bytes, seconds) of one-shot all-reduces alone
    (``model.one_shot_all_reduce_time``), in log error."""
    if not points:
        return p

    def cost(latency_us: float) -> float:
        q = p.replace(mc_latency_us=latency_us)
        return sum(_log_error(model.one_shot_all_reduce_time(q, b), t) ** 2 for b, t in points)

    return p.replace(mc_latency_us=round(_minimize(cost, 0.0, 50.0), 2))


def fit_collectives(p: Preset, points: Sequence[CollectivePoint]) -> Preset:
    from scipy.optimize import nnls

    changes: dict[str, float] = {}
    for transport in sorted({c.transport for c in points}):
        pts = [c for c in points if c.transport == transport]
        lat = model.transport_latency(p, transport)
        rows, rhs = [], []
        for c in pts:
            bus = model.op_spec(c.op).bus_factor(c.nranks) * c.nbytes
            y = math.sqrt(max(c.seconds - lat, 1e-12))
            w = 1.0 / y  # relative error in sqrt(t) ~ half the relative error in t
            rows.append([w * math.sqrt(c.nranks - 1), w * math.sqrt(bus)])
            rhs.append(1.0)
        sizes = {(c.nranks, model.op_spec(c.op).bus_factor(c.nranks) * c.nbytes) for c in pts}
        a, b = nnls(np.array(rows), np.array(rhs))[0] if len(sizes) > 1 else (None, None)
        keys = _kinds.transport(transport).preset
        ramp_key, bw_key = keys.ramp_us, keys.gbps
        if a is None or b <= 0:  # one size: keep the ramp, solve the bandwidth (mean)
            rates = []
            for c in pts:
                ramp = getattr(p, ramp_key) * US * (c.nranks - 1)
                x = (math.sqrt(max(c.seconds - lat, 1e-12)) - math.sqrt(ramp)) ** 2
                rates.append(model.op_spec(c.op).bus_factor(c.nranks) * c.nbytes / max(x, 1e-12))
            changes[bw_key] = round(float(np.exp(np.mean(np.log(rates)))) / 1e9, 1)
            continue
        changes[ramp_key] = round(float(a * a) / US, 3)
        changes[bw_key] = round(float(1.0 / (b * b)) / 1e9, 1)
    if "nccl_gbps" in changes and p.nccl_p2p_gbps:  # send/recv keeps its ratio to the ring
        changes["nccl_p2p_gbps"] = round(p.nccl_p2p_gbps * changes["nccl_gbps"] / p.nccl_gbps, 1)
    return p.replace(**changes)


def concurrent_programs(point: ConcurrentPoint) -> list[dict]:
    """Every rank's program for a ``ConcurrentPoint``: the GEMM on the compute stream and
    the collective as one transfer of its bus bytes to the next rank on a comm stream
    (what every rank's ports carry during a ring collective)."""
    n = point.nranks
    bus = int(model.op_spec(point.op).bus_factor(n) * point.nbytes)
    programs = []
    for r in range(n):
        gemm = {"kind": "Gemm", "stream": 0, "batch": 1, "m": point.m, "n": point.n,
                "k": point.k, "accumulate": False, "bytes": 0, "text": "Gemm"}
        ring = {"stream": 1, "bytes": bus, "hops": n - 1}  # a ring collective, not a send/recv
        if point.transport == "nccl":
            comm = [{**ring, "kind": "Send", "peer": (r + 1) % n, "id": 0, "bundle": 0,
                     "text": "Send"},
                    {**ring, "kind": "Recv", "peer": (r - 1) % n, "id": 0, "bundle": 0,
                     "text": "Recv"}]
        else:
            comm = [{**ring, "kind": "Copy", "text": "Copy",
                     "d": {"buf": "WORKSPACE", "rank": (r + 1) % n}}]
        programs.append({"rank": r, "nranks": n, "num_streams": 2, "dtype": point.dtype,
                         "elem_bytes": 2, "ops": [gemm, *comm]})
    return programs


def simulate_concurrent(p: Preset, point: ConcurrentPoint) -> float:
    """Seconds until the GEMM and the collective of ``point`` are both done (model)."""
    return simulate_programs(concurrent_programs(point), p).total


def fit_concurrent(p: Preset, points: Sequence[ConcurrentPoint]) -> Preset:
    ce = [c for c in points if c.transport != "nccl"]
    nccl = [c for c in points if c.transport == "nccl"]
    if ce:
        def cost(kappa: float) -> float:
            q = p.replace(interference=kappa)
            return sum(_log_error(simulate_concurrent(q, c), c.seconds) ** 2 for c in ce)

        p = p.replace(interference=round(_minimize(cost, 0.0, 5.0), 3))
    if nccl:
        def cost_sms(sms: float) -> float:
            q = p.replace(nccl_sms=int(round(sms)))
            return sum(_log_error(simulate_concurrent(q, c), c.seconds) ** 2 for c in nccl)

        sms = int(round(_minimize(cost_sms, 0.0, p.sms / 2)))
        p = p.replace(nccl_sms=min((sms - 1, sms, sms + 1), key=cost_sms))
    return p


# The fused path's per-step costs: what a fused call pays that the unfused path does not.
FUSED_PATH_COSTS = ("ce_latency_us", "ce_ramp_us", "signal_latency_us", "event_latency_us",
                    "host_op_us", "host_call_us")


def fused_error(p: Preset, points: Sequence[FusedPoint]) -> list[tuple[float, float | None]]:
    """Per fused point: (measured / model of the call, model / measured - 1 of its serial
    path or None)."""
    out = []
    for f in points:
        r = simulate(f.op, f.shape, f.dtype, f.nranks, p, f.candidate)
        out.append((f.seconds / r.t_fused,
                    r.t_xla / f.serial_seconds - 1 if f.serial_seconds else None))
    return out


def margin(serial_errors: Sequence[float], fused_ratios: Sequence[float]) -> float:
    """The fallback margin from the model's measured errors.

    ``serial_errors``: model / measured - 1 of unfused calls (what the model can be
    checked against); ``fused_ratios``: measured / model of fused calls (> 1: the model
    was optimistic). A plan must be predicted faster than the unfused path by more than
    the model's worst serial error, and by more than its worst optimism on fused calls
    (1 - 1/ratio: how much slower the fused call really was, relative to its
    prediction), so that a predicted gain inside the model's error is not acted on.
    """
    worst_serial = max((abs(e) for e in serial_errors), default=0.0)
    worst_fused = max(fused_ratios, default=1.0)
    return round(max(worst_serial, 1.0 - 1.0 / max(worst_fused, 1.0)), 3)


def fit_fused(p: Preset, points: Sequence[FusedPoint]) -> Preset:
    if not points:
        return p
    base = {k: getattr(p, k) for k in FUSED_PATH_COSTS}

    def scaled(s: float) -> Preset:
        return p.replace(**{k: v * s for k, v in base.items()})

    def cost(s: float) -> float:
        return sum(math.log(r) ** 2 for r, _ in fused_error(scaled(s), points))

    p = scaled(_minimize(cost, 0.0, 20.0))
    p = p.replace(**{k: round(getattr(p, k), 2) for k in FUSED_PATH_COSTS})
    ratios = fused_error(p, points)
    serial = [s for _, s in ratios if s is not None]
    gains = dict(p.min_gain)
    measured = {f.op for f in points}
    for op in sorted(measured):
        gains[op] = margin(serial, [r for (r, _), f in zip(ratios, points, strict=True)
                                    if f.op == op])
    if "matmul_ar" not in measured:  # the GEMM+RS ring then an all-gather: the larger margin
        gains["matmul_ar"] = max(gains.get("ag_matmul", 0.0), gains.get("matmul_rs", 0.0))
    return p.replace(min_gain=gains)


def calibrate(base: str | Preset, *, name: str | None = None,
              gemm: Sequence[GemmPoint] = (), collectives: Sequence[CollectivePoint] = (),
              serial: Sequence[SerialPoint] = (), concurrent: Sequence[ConcurrentPoint] = (),
              fused: Sequence[FusedPoint] = ()) -> Preset:
    """A preset fitted to measured points, starting from ``base`` (a name, path or Preset).

    The fits run in order (collectives; GEMM with the unfused calls; concurrency;
    fused calls), each on the result of the previous; see the module docstring.
    """
    p = load_preset(base)
    p = p.replace(name=name or f"{p.name}-calibrated")
    p = fit_collectives(p, collectives)
    p = fit_gemm(p, gemm, serial)
    p = fit_concurrent(p, concurrent)
    p = fit_fused(p, fused)
    calls = [*serial, *fused]
    measured = confidence.ranges(
        [2.0 * g.batch * g.m * g.n * g.k for g in gemm] + [_flop(c) for c in calls],
        [c.nbytes for c in collectives]
        + [model.collective_bytes(c.op, c.nranks, c.shape.batch, c.shape.rows, c.shape.k,
                                  c.shape.n, c.dtype) for c in calls],
        {op: [_flop(f) for f in fused if f.op == op] for op in model.OPS})
    return p.replace(calibrated=measured) if measured else p


def _flop(c: SerialPoint | FusedPoint) -> float:
    return 2.0 * c.shape.batch * c.nranks * c.shape.rows * c.shape.k * c.shape.n
