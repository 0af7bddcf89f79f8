"""``python -m jaxoverlap bench``: measured ratios on the devices present, or the model's.

Measured mode times every impl side by side in one run (warm-up, repeats,
median, ratio to ``"xla"``) for the standard cases of ``jaxoverlap.sim`` —
TP=8, M=8192, K=8192, N=3584 per rank and friends — scaled down on host
devices, and writes a JSON and a table; then runs the native calls again under
``jo.profile`` and prints the overlap report (``--no-profile`` skips it).
``--model PRESET`` prints the simulator's projection for the same cases, for decode shapes
(GEMM + all-reduce, M 1-256: latency, which plan it picks and why), and a
Gantt chart of one plan (when matplotlib is installed), labelled as a model,
with projections outside the preset's calibrated range marked. ``--calibrate``
also times GEMMs, all-gathers and reduce-scatters by size and our native calls,
and writes a preset fitted to them with ``sim.calibrate`` (meaningful on GPUs).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxoverlap import _kinds, _optional


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--impls", nargs="+", default=["xla", "ring", "native"],
                   choices=["xla", "ring", "native", "auto"])
    p.add_argument("--tp", type=_count(1), default=None,
                   help="tensor-parallel size (default: the largest power of two of the devices)")
    p.add_argument("--cases", nargs="+", default=None,
                   help="labels of jaxoverlap.sim.STANDARD_CASES (default: all)")
    p.add_argument("--scale", type=_count(1), default=None,
                   help="divide M, K and N by this (default: 32 on host devices, 1 on GPUs)")
    p.add_argument("--dtype", default=None, choices=_kinds.names(_kinds.DTYPES, fp8=False),
                   help="default: bfloat16 on GPUs, float32 on CPU")
    p.add_argument("--warmup", type=_count(0), default=2)
    p.add_argument("--repeats", type=_count(1), default=5)
    p.add_argument("--out", default="results", help="directory for bench.json / the Gantt PNG")
    p.add_argument("--model", default=None, metavar="PRESET",
                   help="print the model's projection on PRESET (name or JSON) instead of timing")
    p.add_argument("--calibrate", default=None, metavar="BASE_PRESET",
                   help="also fit BASE_PRESET to this machine; writes OUT/preset-calibrated.json")
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help="skip the overlap report: by default the native calls run REPEATS more "
                        "times under jo.profile after the timing (OUT/profile/trace.json)")


def _count(least: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``least`` (argparse names the flag when it raises)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"must be an integer >= {least}, got {text}")
        return value

    parse.__name__ = "integer"  # argparse's message: "invalid integer value: 'x'"
    return parse


def median_seconds(fn: Callable[[], Any], warmup: int, repeats: int) -> float:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _model(args: argparse.Namespace) -> int:
    from jaxoverlap import sim

    try:
        preset = sim.load_preset(args.model)
    except (ValueError, OSError) as err:
        raise SystemExit(f"bench: --model {args.model}: {err}") from None
    cases = _cases(args.cases)
    print(f"{sim.MODEL_LABEL} — preset {preset.name} ({preset.gpu})")
    rows = sim.projection_table([preset], cases)
    print(sim.format_table(rows, markdown=False))
    for nranks in sorted({c.nranks for c in cases}):
        for transport, need in preset.transport_needs(nranks).items():
            print(f"TP{nranks} spans {preset.name}'s nodes: {transport} needs {need}.")
    if any(r["fused"] for r in rows):
        print("A plan named `fused` runs ONE persistent GEMM waiting on per-block flags "
              "(docs/performance.md §2.6, docs/gpu-internals.md §5): the executors' own fused "
              "programs, which the ops pick on compute capability 9.0 (sm_90a) and 10.0 (sm_100a) "
              "GPUs; the kernels are compiled and checked without a GPU, never run on one.")
    overlapped = sim.overlapped_table(preset, cases)
    if overlapped:
        print(f"\nGEMM + reduce-scatter as the copy-engine designs run it (Triton-distributed, "
              f"kraken: docs/performance.md §2.8; a check of the parts our overlapped program "
              f"is priced with, not a plan the chooser picks), and under each case Flux's "
              f"Hopper design by its mechanism (§2.8, the program §4 compares Flux's rows "
              f"with):\n"
              f"{sim.format_overlapped_table(overlapped)}")
    fp8_rows = sim.projection_table([preset], sim.FP8_CASES)
    print(f"\nFP8 (e4m3 operands, bfloat16 output; the GEMM at its FP8 fit, AG moves one byte "
          f"per element; the reasons under the table say what is measured, what "
          f"extrapolated):\n{sim.format_table(fp8_rows, markdown=False)}\n"
          "The native FP8 plans need the executors' FP8 GEMMs (jo.info(); on GPUs "
          "compiled-only here); without them the ops pick among xla and ring.")
    print(f"\nDecode shapes, GEMM + all-reduce (latency, not bandwidth):\n"
          f"{sim.format_decode_table(sim.decode_table(preset))}")
    case = cases[0]
    choice = sim.choose(case.op, case.shape, case.dtype, case.nranks, preset)
    print(f"\n{case.label}: candidates ({sim.MODEL_LABEL})\n{choice.format()}")
    absent = _optional.missing("matplotlib")
    if absent:
        print(f"Gantt chart skipped: {_optional.install_hint(absent, 'examples')}")
        return 0
    os.makedirs(args.out, exist_ok=True)
    path = sim.gantt(choice.best, os.path.join(args.out, f"gantt-{preset.name}.png"))
    print(f"Gantt chart of the chosen plan (model): {path}")
    return 0


def _cases(labels: Sequence[str] | None):
    from jaxoverlap import sim

    if not labels:
        return list(sim.STANDARD_CASES)
    known = {c.label: c for c in sim.STANDARD_CASES}
    missing = [label for label in labels if label not in known]
    if missing:
        raise SystemExit(f"bench: unknown case(s) {missing}; known: {sorted(known)}")
    return [known[label] for label in labels]


def _round(value: int, multiple: int) -> int:
    return max(multiple, value // multiple * multiple)


def _measure(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxoverlap as jo

    devices = jax.devices()
    platform = devices[0].platform
    tp = args.tp or 2 ** (len(devices).bit_length() - 1)
    if tp > len(devices):
        raise SystemExit(f"bench: --tp {tp} but only {len(devices)} devices")
    scale = args.scale or (1 if platform == "gpu" else 32)
    dtype = jnp.dtype(args.dtype or ("bfloat16" if platform == "gpu" else "float32"))
    mesh = Mesh(np.array(devices[:tp]), ("tp",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(0)

    def put(shape, spec):
        a = rng.standard_normal(shape).astype(np.float32) / np.sqrt(shape[-1])
        return jax.device_put(jnp.asarray(a, dtype), NamedSharding(mesh, spec))

    print(f"jaxoverlap bench: {tp} {platform} devices, {dtype.name}, shapes / {scale} "
          f"(measured, medians of {args.repeats})")
    rows: list[dict[str, Any]] = []
    profiled: list[Callable[[], Any]] = []  # the native calls, run again under jo.profile
    for case in _cases(args.cases):
        m = _round(case.m // scale, tp * 8)
        k, n = _round(case.k // scale, 8), _round(case.n // scale, 8)
        if case.op == "ag_matmul":
            x, w = put((m, k), P("tp", None)), put((k, n * tp), P(None, "tp"))
        else:
            x, w = put((m, k * tp), P(None, "tp")), put((k * tp, n), P("tp", None))
        op = getattr(jo, case.op)
        times: dict[str, float] = {}
        for impl in args.impls:
            fn = jax.jit(lambda x, w, impl=impl, op=op: op(x, w, "tp", impl=impl, mesh=mesh))
            try:
                times[impl] = median_seconds(functools.partial(fn, x, w), args.warmup,
                                             args.repeats)
            except (ValueError, TypeError) as err:
                print(f"  {case.label} impl={impl}: skipped ({str(err).splitlines()[0]})")
            else:
                if impl == "native":
                    profiled.append(functools.partial(fn, x, w))
        for impl, t in times.items():
            rows.append({"case": case.label, "op": case.op, "tp": tp, "m": m, "k": k, "n": n,
                         "dtype": dtype.name, "impl": impl, "median_ms": t * 1e3,
                         "vs_xla": times["xla"] / t if "xla" in times else None})
            print(f"  {case.label:<10} M{m} K{k} N{n}  {impl:<7} {t * 1e3:9.3f} ms  "
                  f"x{rows[-1]['vs_xla'] or float('nan'):.2f} vs xla")
    os.makedirs(args.out, exist_ok=True)
    result = {"platform": platform, "devices": len(devices), "tp": tp, "scale": scale,
              "dtype": dtype.name, "jax": jax.__version__, "jaxoverlap": jo.__version__,
              "rows": rows}
    if args.profile and profiled:
        result["profile"] = _profile(args, profiled)
    if args.calibrate:
        result["calibrated_preset"] = _calibrate(args, mesh, tp, scale, dtype, put, rows)
    path = os.path.join(args.out, "bench.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
    return 0 if rows else 1


def _profile(args: argparse.Namespace, calls: Sequence[Callable[[], Any]]) -> dict[str, Any]:
    """Runs the native calls again under jo.profile (not timed above: recording costs a little)
    and prints the overlap report; returns what bench.json keeps of it."""
    import jax

    import jaxoverlap as jo

    print(f"\noverlap report: the native calls again, {args.repeats} times each, recorded")
    with jo.profile(os.path.join(args.out, "profile")) as prof:
        for call in calls:
            for _ in range(args.repeats):
                jax.block_until_ready(call())
    return {"preset": prof.preset, "emulation": prof.emulation, "trace": prof.trace_path,
            "sites": prof.sites}


def _calibrate(args, mesh, tp: int, scale: int, dtype, put, rows) -> str:
    """Times GEMMs alone, collectives by size and native calls; fits the base preset."""
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    import jaxoverlap as jo
    from jaxoverlap import sim

    def timed(fn) -> float:
        return median_seconds(fn, args.warmup, args.repeats)

    gemm = []
    for m, n, k in ((8192, 3584, 8192), (2048, 2048, 13312), (1024, 3584, 8192)):
        m, n, k = _round(m // scale, 8), _round(n // scale, 8), _round(k // scale, 8)
        a, b = put((m, k), P()), put((k, n), P())
        gemm.append(sim.GemmPoint(m, n, k, timed(jax.jit(lambda a=a, b=b: a @ b)), dtype.name))
    collectives = []
    for mib in (2, 8, 32, 128):  # S of nccl-tests: AG the gathered array, RS each rank's input
        rows_ = _round((mib << 20) // scale // (dtype.itemsize * 1024), tp * tp)
        nbytes = rows_ * 1024 * dtype.itemsize
        for op, body, global_rows, out in (
                ("ag_matmul", lambda v: lax.all_gather(v, "tp", tiled=True), rows_,
                 P(None, None)),
                ("matmul_rs", lambda v: lax.psum_scatter(v, "tp", tiled=True), rows_ * tp,
                 P("tp", None))):
            x = put((global_rows, 1024), P("tp", None))
            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp", None), out_specs=out,
                                      check_vma=False))
            collectives.append(sim.CollectivePoint(op, tp, nbytes, timed(lambda f=f, x=x: f(x))))
    serial, fused = [], []
    for case in _cases(args.cases):
        m = _round(case.m // scale, tp * 8)
        k, n = _round(case.k // scale, 8), _round(case.n // scale, 8)
        shape = sim.Shape.from_global(m, k, n, tp)
        if case.op == "ag_matmul":
            x, w = put((m, k), P("tp", None)), put((k, n * tp), P(None, "tp"))
        else:
            x, w = put((m, k * tp), P(None, "tp")), put((k * tp, n), P("tp", None))
        op = getattr(jo, case.op)
        plan = sim.Candidate("native", "nccl", 1, tp > 2)  # this exact plan, not the model's
        t_xla = next((r["median_ms"] * 1e-3 for r in rows
                      if r["case"] == case.label and r["impl"] == "xla"), None)
        fn = jax.jit(lambda x, w, op=op, plan=plan: op(
            x, w, "tp", impl="native", transport=plan.transport, chunks=plan.chunks,
            bidirectional=plan.bidirectional, mesh=mesh))
        fused.append(sim.FusedPoint(case.op, shape, dtype.name, tp, plan,
                                    timed(lambda fn=fn, x=x, w=w: fn(x, w)), t_xla))
        if t_xla is not None:
            serial.append(sim.SerialPoint(case.op, shape, dtype.name, tp, t_xla))
    preset = sim.calibrate(args.calibrate, gemm=gemm, collectives=collectives, serial=serial,
                           fused=fused)
    path = os.path.join(args.out, "preset-calibrated.json")
    preset.to_json(path)
    print(f"calibrated {args.calibrate} on {len(gemm)} GEMMs, {len(collectives)} collectives, "
          f"{len(serial)} unfused and {len(fused)} native calls -> {path} "
          f"(use JAXOVERLAP_PRESET={path}); margins {preset.min_gain}")
    return path


def run(args: argparse.Namespace) -> int:
    return _model(args) if args.model else _measure(args)
