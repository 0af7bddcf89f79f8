"""Fitting a preset to measured points: ``sim.calibrate``.

Five kinds of points, each fitting the parameters only it can see, in this order:

* ``CollectivePoint`` (one collective alone, by size): per transport the
  asymptotic bandwidth and the per-hop ramp. ``model.collective_time`` is linear
  in the square roots: sqrt(t - fixed) = sqrt(ramp) sqrt(steps) + sqrt(bus_bytes / B),
  so this is a non-negative linear least-squares fit (relative errors); with NCCL
  rings of two step counts (all-reduces next to all-gathers), the fixed part —
  a per-call latency and a per-step one — is searched around it.
* ``GemmPoint`` (one GEMM alone) and ``SerialPoint`` (an unfused call, whose
  collective is now known): the fastest GEMM point becomes the best shape; the
  efficiency there, ``gemm_k_half`` and ``gemm_overhead_us`` are fitted to all of them.
* ``ConcurrentPoint`` (a GEMM next to an independent collective): ``interference``
  from copy-engine points, then ``nccl_sms`` from NCCL points.
* ``FusedPoint`` (a call of our own native program): one scale on the host's enqueue
  costs (``FUSED_PATH_COSTS``: what a call on the host bound measures), then the
  margins per op (``margin``) from the errors left.

Every parameter the points do not reach stays the base preset's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from jaxoverlap import _kinds
from jaxoverlap.sim import allreduce, confidence, families, model
from jaxoverlap.sim.engine import simulate_programs
from jaxoverlap.sim.families import margin  # noqa: F401  (the margin rule, re-exported)
from jaxoverlap.sim.model import Shape
from jaxoverlap.sim.plan import Candidate, baseline_times, simulate
from jaxoverlap.sim.presets import FP8_TILES, GEMM_CLASSES, Preset, gemm_class, load_preset

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
    block_scaled: bool = False  # fp8 operands with 1x32 block scales (MXFP8)

    @property
    def cls(self) -> str:
        """The operand class it measures (``presets.GEMM_CLASSES``)."""
        return gemm_class(self.dtype, self.block_scaled)


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
    return 2.0 * g.batch * g.m * g.n * g.k / busy / (p.peak(g.dtype) * 1e12)


def _gemm_seconds(p: Preset, g: GemmPoint | SerialPoint) -> float:
    if isinstance(g, GemmPoint):
        return model.gemm_time(p, g.dtype, g.batch, g.m, g.n, g.k, block_scaled=g.block_scaled)
    t_gemm, t_comm = baseline_times(g.op, g.shape, g.dtype, g.nranks, p, g.transport)
    return t_gemm + t_comm


def fit_gemm(p: Preset, points: Sequence[GemmPoint], serial: Sequence[SerialPoint] = ()
             ) -> Preset:
    """Per operand class (``presets.GEMM_CLASSES``) of the points: best shape = the class's
    fastest point; then the efficiency there and the K curve (``k_half``) fitted to every point
    of the class — for 16-bit GEMMs also ``gemm_overhead_us``, with the unfused calls whose
    collective is already fitted — as many parameters as the points can tell apart. A class
    other than 16-bit keeps its tiles (FP8: ``presets.FP8_TILES`` when it had no fit) and the
    16-bit per-kernel cost.

    The fit minimises the sum of the fourth powers of the log errors: close to the
    worst error, which is what the model is held to (and what its margin derives
    from), yet smooth.
    """
    # 16-bit first (the others keep its per-kernel cost), the rest in GEMM_CLASSES' order (so
    # the fitted preset's gemm_classes do not follow the process's hash seed).
    for cls in sorted({g.cls for g in points}, key=GEMM_CLASSES.index):
        mine = [g for g in points if g.cls == cls]
        for _ in range(3):  # the best shape depends on the per-kernel cost the fit moves
            best = max(mine, key=lambda g: _achieved(p, g))
            p = _fit_gemm_class(p, cls, mine, serial if cls == "16bit" else ())
            if max(mine, key=lambda g: _achieved(p, g)) == best:
                break
    return p


def _fit_gemm_class(p: Preset, cls: str, points: Sequence[GemmPoint],
                    serial: Sequence[SerialPoint]) -> Preset:
    best = max(points, key=lambda g: _achieved(p, g))
    tiles = p.gemm_fit(cls).tiles if cls == "16bit" or cls in p.gemm_classes else FP8_TILES
    p = p.with_gemm_fit(cls, efficiency=_achieved(p, best), best_shape=(best.m, best.n, best.k),
                        tiles=tiles)
    every: list[GemmPoint | SerialPoint] = [*points, *serial]
    # One parameter per ~2 points: the efficiency always, the K curve from 3 points, the
    # per-kernel cost from 5 (fewer points cannot tell them apart); 16-bit only for the last.
    names = ("efficiency", "k_half", "overhead")[
        :1 + (len(every) >= 3) + (len(every) >= 5 and cls == "16bit")]
    from scipy.optimize import minimize

    def preset(x: Sequence[float]) -> Preset:
        values = dict(zip(names, (float(v) for v in x), strict=False))
        q = p.with_gemm_fit(cls, **{k: v for k, v in values.items() if k != "overhead"})
        return q.replace(gemm_overhead_us=values["overhead"]) if "overhead" in values else q

    def cost(x: Sequence[float]) -> float:
        q = preset(x)
        return sum(_log_error(_gemm_seconds(q, g), g.seconds) ** 4 for g in every)

    now = p.gemm_fit(cls)
    current = {"efficiency": now.efficiency, "k_half": now.k_half,
               "overhead": p.gemm_overhead_us}
    bounds = [(1e-6, 1.0), (0.0, 16384.0), (0.0, 1000.0)][:len(names)]
    start = [min(max(current[n], lo), hi) for n, (lo, hi) in zip(names, bounds, strict=True)]
    x = minimize(cost, start, method="Nelder-Mead", bounds=bounds,
                 options={"xatol": 1e-4, "fatol": 1e-16, "maxiter": 4000}).x
    digits = {"efficiency": 4, "k_half": 1, "overhead": 2}
    return preset([round(float(v), digits[n]) for n, v in zip(names, x, strict=True)])


def fit_one_shot(p: Preset, points: Sequence[tuple[int, float]]) -> Preset:
    """``mc_latency_us`` fitted to (bytes, seconds) of one-shot all-reduces alone
    (``model.one_shot_all_reduce_time``), in log error."""
    if not points:
        return p

    def cost(latency_us: float) -> float:
        q = p.replace(mc_latency_us=latency_us)
        return sum(_log_error(model.one_shot_all_reduce_time(q, b), t) ** 2 for b, t in points)

    return p.replace(mc_latency_us=round(_minimize(cost, 0.0, 50.0), 2))


def _fit_ramp_and_rate(p: Preset, pts: Sequence[CollectivePoint], transport: str,
                       fixed_s: Callable[[CollectivePoint], float]
                       ) -> tuple[float, float] | None:
    """(ramp seconds per hop, bytes/s) of ``pts`` given each point's unhidden fixed seconds:
    sqrt(t - fixed) = sqrt(ramp) sqrt(steps) + sqrt(bus_bytes / B) is linear in the two
    square roots (non-negative least squares in relative error). None: one size only."""
    from scipy.optimize import nnls

    rows, rhs = [], []
    for c in pts:
        bus = model.op_spec(c.op).bus_factor(c.nranks) * c.nbytes
        y = math.sqrt(max(c.seconds - fixed_s(c), 1e-12))
        w = 1.0 / y  # relative error in sqrt(t) ~ half the relative error in t
        rows.append([w * math.sqrt(model.ring_steps(c.op, c.nranks)), w * math.sqrt(bus)])
        rhs.append(1.0)
    sizes = {(model.ring_steps(c.op, c.nranks), model.op_spec(c.op).bus_factor(c.nranks) * c.nbytes)
             for c in pts}
    if len(sizes) < 2:
        return None
    a, b = nnls(np.array(rows), np.array(rhs))[0]
    return (a * a, 1.0 / (b * b)) if b > 0 else None


def fit_one_launch(p: Preset, points: Sequence[tuple[allreduce.Mechanism, int, int, float]]
                   ) -> Preset:
    """``ar_start_us`` and ``ar_flag_us`` fitted to (``sim.allreduce.Mechanism``, nranks, bytes,
    seconds) of one-launch all-reduces (``sim.allreduce.mechanism_time``), in log error. Kernels
    of one barrier count cannot tell a start from a flag round; kernels of one round and of two
    can."""
    from scipy.optimize import minimize

    if not points:
        return p

    def cost(x: Sequence[float]) -> float:
        if min(x) < 0:
            return 1e9
        q = p.replace(ar_start_us=float(x[0]), ar_flag_us=float(x[1]))
        return sum(_log_error(allreduce.mechanism_time(q, m, n, b), s) ** 2
                   for m, n, b, s in points)

    x = min((minimize(cost, x0, method="Nelder-Mead",
                      options={"xatol": 1e-5, "fatol": 1e-14, "maxiter": 4000})
             for x0 in ([2.0, 1.5], [0.5, 3.0])), key=lambda r: r.fun).x
    return p.replace(ar_start_us=round(float(x[0]), 2), ar_flag_us=round(float(x[1]), 2))


def _fit_nccl_fixed(p: Preset, pts: Sequence[CollectivePoint], lat: float, step: float
                    ) -> tuple[float, float]:
    """(per-call, per-step) seconds of NCCL's unhidden latency: an outer search over the two,
    the linear ramp-and-rate fit inside, minimising the 4th power of the log errors."""
    from scipy.optimize import minimize

    def cost(x: Sequence[float]) -> float:
        got = (_fit_ramp_and_rate(
            p, pts, "nccl", lambda c: (x[0] + x[1] * model.ring_steps(c.op, c.nranks)) * US)
            if min(x) >= 0 else None)
        if got is None:
            return 1e9
        ramp, rate = got
        q = p.replace(nccl_latency_us=x[0], nccl_step_us=x[1], nccl_ramp_us=ramp / US,
                      nccl_gbps=rate / 1e9)
        return sum(_log_error(model.collective_time(q, "nccl", c.nranks, c.nbytes, c.op),
                              c.seconds) ** 4 for c in pts)

    x = minimize(cost, [lat / US, max(step / US, 0.5)], method="Nelder-Mead",
                 options={"xatol": 1e-4, "fatol": 1e-14, "maxiter": 4000}).x
    return float(x[0]) * US, float(x[1]) * US


def fit_collectives(p: Preset, points: Sequence[CollectivePoint]) -> Preset:
    """Per transport, the asymptotic bandwidth and the per-hop ramp (``_fit_ramp_and_rate``);
    for NCCL, when the points have rings of different step counts (all-gathers or
    reduce-scatters of N-1 steps and all-reduces of 2(N-1)), also the per-call latency and
    the unhidden latency per step (``model.transport_step``), which only such points tell
    apart: an outer search over the two, the linear fit inside, minimising the 4th power of
    the log errors (close to the worst error)."""
    changes: dict[str, float] = {}
    for transport in sorted({c.transport for c in points}):
        pts = [c for c in points if c.transport == transport]
        keys = _kinds.transport(transport).preset
        ramp_key, bw_key = keys.ramp_us, keys.gbps
        lat, step = model.transport_latency(p, transport), model.transport_step(p, transport)
        if transport == "nccl" and len({model.ring_steps(c.op, c.nranks) for c in pts}) > 1:
            lat, step = _fit_nccl_fixed(p, pts, lat, step)
            changes["nccl_latency_us"] = round(lat / US, 3)
            changes["nccl_step_us"] = round(step / US, 3)
        got = _fit_ramp_and_rate(
            p, pts, transport,
            lambda c: lat + step * model.ring_steps(c.op, c.nranks))  # noqa: B023
        if got is None:  # one size: keep the ramp, solve the bandwidth (geometric mean)
            rates = []
            for c in pts:
                steps = model.ring_steps(c.op, c.nranks)
                ramp = getattr(p, ramp_key) * US * steps
                left = max(c.seconds - lat - step * steps, 1e-12)
                x = (math.sqrt(left) - math.sqrt(ramp)) ** 2
                rates.append(model.op_spec(c.op).bus_factor(c.nranks) * c.nbytes / max(x, 1e-12))
            changes[bw_key] = round(float(np.exp(np.mean(np.log(rates)))) / 1e9, 1)
            continue
        ramp, rate = got
        changes[ramp_key] = round(float(ramp) / US, 3)
        changes[bw_key] = round(float(rate) / 1e9, 1)
    if "nccl_gbps" in changes and p.nccl_p2p_gbps:  # send/recv keeps its ratio to the ring
        changes["nccl_p2p_gbps"] = round(p.nccl_p2p_gbps * changes["nccl_gbps"] / p.nccl_gbps, 1)
    return p.replace(**changes)


def concurrent_programs(point: ConcurrentPoint) -> list[dict]:
    """Every rank's program for a ``ConcurrentPoint``: the GEMM on the compute stream and
    the collective as one transfer of its bus bytes to the next rank on a comm stream
    (what every rank's ports carry during the collective: the ring's N-1 hops for NCCL's
    kernels; one hop for the copy engine's all-gather, which PyTorch PR #172714 runs through
    NCCL's zero-CTA path, pytorch/pytorch PR #176613)."""
    n = point.nranks
    bus = int(model.op_spec(point.op).bus_factor(n) * point.nbytes)
    programs = []
    for r in range(n):
        gemm = {"kind": "Gemm", "stream": 0, "batch": 1, "m": point.m, "n": point.n,
                "k": point.k, "accumulate": False, "bytes": 0, "text": "Gemm"}
        # NCCL's kernels run a ring (N-1 hops); its copy-engine all-gather writes the own shard
        # straight into every peer (NVIDIA/nccl src/ce_coll.cc, ncclCeAllGather: one batch of
        # copies, no forwarding), one hop whatever N
        ring = {"stream": 1, "bytes": bus, "hops": n - 1 if point.transport == "nccl" else 1}
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


# What a chunked call measured on the host bound determines: the host's enqueue of its ops (one
# scale on the two, their ratio an assumption). Its device-side costs (a copy's start, a flag,
# an event) lie below that bound and are not seen in it: they come from device measurements
# (presets.DEVICE_COSTS, docs/performance.md §2.5).
FUSED_PATH_COSTS = ("host_op_us", "host_call_us")


def fused_error(p: Preset, points: Sequence[FusedPoint]) -> list[tuple[float, float | None]]:
    """Per fused point: (measured / model of the call, model / measured - 1 of its serial
    path or None)."""
    out = []
    for f in points:
        r = simulate(f.op, f.shape, f.dtype, f.nranks, p, f.candidate)
        out.append((f.seconds / r.t_fused,
                    r.t_xla / f.serial_seconds - 1 if f.serial_seconds else None))
    return out


def fit_fused(p: Preset, points: Sequence[FusedPoint]) -> Preset:
    if not points:
        return p
    base = {k: getattr(p, k) for k in FUSED_PATH_COSTS}

    def scaled(s: float) -> Preset:
        return p.replace(**{k: v * s for k, v in base.items()})

    def cost(s: float) -> float:
        return sum(math.log(r) ** 2 for r, _ in fused_error(scaled(s), points))

    best = _minimize(cost, 0.0, 20.0)
    if cost(1.0) <= cost(best) + 1e-12:  # the calls do not see these costs (the GPU bounds them)
        best = 1.0
    p = scaled(best)
    p = p.replace(**{k: round(getattr(p, k), 2) for k in FUSED_PATH_COSTS})
    ratios = fused_error(p, points)
    serial = [s for _, s in ratios if s is not None]
    by_family: dict[str, list[float]] = {}
    for (ratio, _), f in zip(ratios, points, strict=True):
        by_family.setdefault(families.family(f.op, f.candidate), []).append(ratio)
    own = families.derived(serial, by_family)
    gains = {**p.min_gain, **own}
    measured = {f.op for f in points}
    for op in measured:  # the op's fallback: the largest of its measured families
        gains[op] = max(m for fam, m in own.items() if fam.startswith(op + ":"))
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
