"""Times the tensor-parallel MLP block, forward and backward, per impl, tp size and problem size.

    python examples/scaling.py                       # the `make demo` run: host devices, short
    python examples/scaling.py --tp 2 4 8 --rows 1024 4096 --hidden 1024 --ffn 4096 \\
        --dtype bfloat16 --repeats 20 --out results/gpu
    python examples/scaling.py --no-sequence-parallel  # the MLP ending in GEMM+AR

The block is ``jaxoverlap.flax.linen.ParallelMLP`` (AG+GEMM -> gelu -> GEMM+RS)
on ``[batch, rows, hidden]`` inputs sharded on the rows. With
``--no-sequence-parallel`` it is the MLP with ``sequence_parallel=False``: a
replicated input, a local GEMM -> gelu -> GEMM+AR (``jaxoverlap.matmul_ar``),
a replicated output. Every configuration
is timed side by side in one run (warm-up, then repeats; the median is
reported) and compared with the unfused ``"xla"`` impl, so the ratios mean
something even on a noisy machine. Results go to ``--out`` (default
``results/``): ``scaling.json`` with every sample and ``scaling.png``.

Devices: the accelerators when JAX finds some (GPUs), else ``--host-devices``
CPU devices. On a CPU the host devices share the cores, so the table shows
that everything runs, not the GPU gain. Next to it, labelled as such, the
performance model's projection of the same block (same shapes, dtype, tp and
impls) on 8-GPU H100 and B200 machines (``--project``; ``jaxoverlap.sim``,
``sim.mlp_block``), and of one block of a 70B-parameter model's size for scale:
what to expect on GPUs, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8], help="tensor-parallel sizes")
    p.add_argument("--rows", type=int, nargs="+", default=[256, 1024],
                   help="problem sizes: sequence lengths (global rows)")
    p.add_argument("--impls", nargs="+", default=["xla", "ring", "native"],
                   help="impls to time; those that cannot run here are reported and skipped")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--chunks", type=int, default=None, help="sub-chunks per shard (jo.config)")
    p.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                   help="time the MLP with sequence_parallel=False (replicated input, GEMM + "
                        "all-reduce in the row-parallel layer)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("results"),
                   help="directory for scaling.json and scaling.png")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--project", nargs="*", default=["h100", "b200"], metavar="PRESET",
                   help="hardware presets to project the same block on (the performance "
                        "model; none: --project with no value)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--host-devices", type=int, default=8,
                   help="host devices to create when no accelerator is present")
    args = p.parse_args(argv)
    for name in ("tp", "rows"):
        if any(v < 1 for v in getattr(args, name)):
            p.error(f"--{name} values must be positive")
    if args.warmup < 0 or args.repeats < 1:
        p.error("--warmup must be >= 0 and --repeats >= 1")
    return args


class _Progress:
    """A rich progress bar when rich is installed and wanted, else one line per configuration."""

    def __init__(self, total: int, enabled: bool):
        self._bar = None
        if enabled:
            try:
                from rich.progress import Progress
            except ImportError:
                Progress = None
            if Progress is not None:
                self._bar = Progress(transient=True)
                self._task = self._bar.add_task("timing", total=total)
        self._done, self._total = 0, total

    def __enter__(self):
        if self._bar is not None:
            self._bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def step(self, label: str) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=label)
        else:
            print(f"[{self._done}/{self._total}] {label}", flush=True)


def _plot(results: list[dict], rows_list: list[int], meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows_list), figsize=(4.5 * len(rows_list), 3.8),
                             squeeze=False)
    for ax, rows in zip(axes[0], rows_list, strict=True):
        for impl in sorted({r["impl"] for r in results}):
            pts = sorted((r["tp"], r["median_ms"]) for r in results
                         if r["rows"] == rows and r["impl"] == impl)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=impl)
        ax.set_title(f"rows={rows}, hidden={meta['hidden']}, ffn={meta['ffn']}")
        ax.set_xlabel("tensor-parallel size")
        ax.set_ylabel("median fwd+bwd time (ms)")
        ax.set_xscale("log", base=2)
        tps = sorted({r["tp"] for r in results})
        ax.set_xticks(tps, [str(t) for t in tps])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend()
    kind = "" if meta["sequence_parallel"] else ", no sequence parallelism: GEMM+AR"
    fig.suptitle(f"jaxoverlap ParallelMLP on {meta['devices']} x {meta['platform']} "
                 f"({meta['dtype']}{kind})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# For scale: one MLP block of a 70B-parameter model (Llama 2 70B's hidden and ffn widths)
# over a sequence of 8192 tokens in bfloat16, tp 8.
_GPU_SIZED = dict(tp=8, batch=1, rows=8192, hidden=8192, ffn=28672, dtype="bfloat16")


def _project(args, configs: list[tuple[int, int]], impls: list[str]) -> list[dict]:
    """The model's projection of the timed block on each ``--project`` preset, printed under
    the measured table and returned for the JSON (empty without presets)."""
    if not args.project or not configs or not impls:
        return []
    from jaxoverlap import sim

    presets = [sim.load_preset(name) for name in args.project]
    block = dict(batch=args.batch, hidden=args.hidden, ffn=args.ffn, dtype=args.dtype,
                 sequence_parallel=args.sequence_parallel)
    rows: list[dict] = []
    for preset in presets:
        for tp, n in sorted(set(configs)):
            for impl in impls:
                p = sim.mlp_block(preset, impl, tp=tp, rows=n, **block)
                rows.append(dict(preset=preset.name, tp=tp, rows=n, impl=impl,
                                 ms=p.seconds * 1e3, calls=[list(c) for c in p.calls]))
    sized = dict(_GPU_SIZED, sequence_parallel=args.sequence_parallel)
    big = [dict(preset=preset.name, impl=impl, gpu_sized=sized,
                ms=sim.mlp_block(preset, impl, **sized).seconds * 1e3)
           for preset in presets for impl in impls]
    for r in rows + big:
        base = next(b["ms"] for b in rows + big if b["preset"] == r["preset"]
                    and b.get("tp") == r.get("tp") and b.get("rows") == r.get("rows")
                    and b["impl"] == "xla") if "xla" in impls else None
        r["speedup_vs_xla"] = base / r["ms"] if base else None

    def table(entries: list[dict], label) -> None:
        names = [p.name for p in presets]
        print("".join(f"{n + ' ms':>12} {'vs xla':>7}" for n in names))
        keys = sorted({label(e) for e in entries}, key=lambda k: (k[0], k[1], impls.index(k[2])))
        for key in keys:
            cells = []
            for name in names:
                e = next(e for e in entries if label(e) == key and e["preset"] == name)
                ratio = f"{e['speedup_vs_xla']:.2f}" if e["speedup_vs_xla"] else "-"
                cells.append(f"{e['ms']:>12.3f} {ratio:>7}")
            print(f"{key[0]:>4} {key[1]:>7} {key[2]:>8}" + "".join(cells))

    print(f"\n{sim.MODEL_LABEL}: the same block (shapes, {args.dtype}, tp, impls) on "
          + " and ".join(f"8x {p.name} ({p.gpu})" for p in presets)
          + "; native: the model's plan per call")
    print(f"{'tp':>4} {'rows':>7} {'impl':>8}", end="")
    table(rows, lambda e: (e["tp"], e["rows"], e["impl"]))
    print(f"\nfor scale, {sim.MODEL_LABEL}: one block of a 70B model's size (batch 1, rows "
          f"{_GPU_SIZED['rows']}, hidden {_GPU_SIZED['hidden']}, ffn {_GPU_SIZED['ffn']}, "
          f"bfloat16, tp 8)")
    print(f"{'tp':>4} {'rows':>7} {'impl':>8}", end="")
    table(big, lambda e: (8, _GPU_SIZED["rows"], e["impl"]))
    print("At the demo's sizes each call is a few microseconds of work: latency decides, and "
          "the unfused path wins; the gain comes with size (docs/performance.md).")
    return rows + big


def _missing(*modules: str) -> list[str]:
    """The optional packages among ``modules`` that are not installed."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def main(argv=None) -> int:
    args = _parse(argv)
    if _missing("flax"):
        print("examples/scaling.py needs flax (its block is jaxoverlap.flax.linen.ParallelMLP): "
              "pip install 'jaxoverlap[examples]'")
        return 2
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.host_devices}")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxoverlap as jo
    from jaxoverlap.flax.linen import ParallelMLP

    dtype = jnp.dtype(args.dtype)
    devices = jax.devices()
    platform = devices[0].platform
    meta = dict(
        jaxoverlap=jo.__version__, jax=jax.__version__, platform=platform,
        devices=len(devices), device_kind=devices[0].device_kind, dtype=dtype.name,
        batch=args.batch, hidden=args.hidden, ffn=args.ffn, chunks=args.chunks,
        sequence_parallel=args.sequence_parallel,
        warmup=args.warmup, repeats=args.repeats,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    print(f"jaxoverlap {jo.__version__} on {len(devices)} {platform} devices "
          f"(jax {jax.__version__}); dtype {dtype.name}; batch {args.batch}, hidden "
          f"{args.hidden}, ffn {args.ffn}; tp {args.tp}, rows {args.rows}; impls {args.impls}; "
          + ("sequence parallel (AG+GEMM, GEMM+RS)" if args.sequence_parallel
             else "no sequence parallelism (GEMM+AR)"))

    def make_step(model):
        def loss(params, x):
            return jnp.sum(model.apply(params, x).astype(jnp.float32) ** 2)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    results: list[dict] = []
    skipped: list[dict] = []
    configs = [(tp, rows) for tp in args.tp for rows in args.rows]
    with _Progress(len(configs) * len(args.impls), not args.no_progress) as progress:
        for tp, rows in configs:
            reason = None
            if tp > len(devices):
                reason = f"only {len(devices)} devices"
            elif (rows if args.sequence_parallel else args.batch * rows) % tp or args.ffn % tp:
                what = "rows" if args.sequence_parallel else "batch * rows"
                reason = f"{what} and ffn={args.ffn} must be multiples of tp={tp}"
            if reason is not None:
                for impl in args.impls:
                    skipped.append(dict(tp=tp, rows=rows, impl=impl, reason=reason))
                    progress.step(f"tp={tp} rows={rows} {impl}: skipped")
                continue
            mesh = Mesh(np.array(devices[:tp]), ("tp",), axis_types=(AxisType.Auto,))
            rng = np.random.default_rng(0)
            x = jax.device_put(
                jnp.asarray(rng.standard_normal((args.batch, rows, args.hidden)), dtype),
                NamedSharding(mesh, P(None, "tp" if args.sequence_parallel else None, None)))
            times: dict[str, list[float]] = {}
            for impl in args.impls:
                model = ParallelMLP(args.ffn, dtype=dtype, param_dtype=dtype, impl=impl,
                                    sequence_parallel=args.sequence_parallel, mesh=mesh)
                try:
                    with jo.config(chunks=args.chunks):
                        params = jax.jit(model.init)(jax.random.key(0), x)
                        step = make_step(model)
                        for _ in range(args.warmup):
                            jax.block_until_ready(step(params, x))
                        samples = []
                        for _ in range(args.repeats):
                            start = time.perf_counter()
                            jax.block_until_ready(step(params, x))
                            samples.append((time.perf_counter() - start) * 1e3)
                except (ValueError, TypeError) as err:
                    skipped.append(dict(tp=tp, rows=rows, impl=impl,
                                        reason=str(err).splitlines()[0]))
                    progress.step(f"tp={tp} rows={rows} {impl}: skipped")
                    continue
                times[impl] = samples
                progress.step(f"tp={tp} rows={rows} {impl}")
            base = statistics.median(times["xla"]) if "xla" in times else None
            for impl, samples in times.items():
                median = statistics.median(samples)
                results.append(dict(tp=tp, rows=rows, impl=impl, median_ms=median,
                                    min_ms=min(samples), samples_ms=samples,
                                    speedup_vs_xla=(base / median) if base else None))

    print()
    print(f"{'tp':>4} {'rows':>7} {'impl':>8} {'median ms':>10} {'speedup vs xla':>15}")
    for r in results:
        ratio = f"{r['speedup_vs_xla']:.2f}" if r["speedup_vs_xla"] is not None else "-"
        print(f"{r['tp']:>4} {r['rows']:>7} {r['impl']:>8} {r['median_ms']:>10.2f} {ratio:>15}")
    reasons = sorted({(s["impl"], s["reason"]) for s in skipped})
    for impl, reason in reasons:
        print(f"skipped {impl}: {reason}")

    timed = {r["impl"] for r in results}
    projection = _project(args, [(r["tp"], r["rows"]) for r in results],
                          [i for i in args.impls if i in timed and i in ("xla", "ring", "native")])

    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "scaling.json"
    json_path.write_text(json.dumps(dict(meta=meta, results=results, skipped=skipped,
                                         projection=projection), indent=2) + "\n")
    print(f"\nwrote {json_path}")
    if results and not args.no_plot and _missing("matplotlib"):
        print("scaling.png skipped: matplotlib is not installed (pip install matplotlib)")
    elif results and not args.no_plot:
        png_path = args.out / "scaling.png"
        _plot(results, sorted({r["rows"] for r in results}), meta, png_path)
        print(f"wrote {png_path}")
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
