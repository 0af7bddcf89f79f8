"""Compile time of a converted model against the stock one: Flax's WMT model, one train step.

    python examples/compile_time.py                       # 2 and 8 layers, every impl, both axes
    python examples/compile_time.py --layers 8 --impls native --axes auto --repeats 5

The model is Flax's WMT encoder-decoder, unmodified in ``examples/third_party``, swapped to
jaxoverlap's layers as ``examples/decode.py`` swaps it (``decode.WMT_SWAP``: the MLPs' dense
layers, the self- and cross-attention, the logits). Each program is one train step — the
forward pass, the loss (the WMT example's one-hot cross entropy), its gradient and an SGD
update — on a data x tensor mesh (``--mesh-shape``, default 2 x 4), lowered (``jit(...).lower``
on abstract, sharded inputs) and compiled (``.compile()``), after ``jax.clear_caches()``.
The stock program and the converted one of every impl are compiled side by side, round after
round (``--repeats``), in a rotating order; the table gives each one's median lower and
compile times and the ratio of its lower + compile to the stock program's.

The layouts are the same for both programs where the stock layers can run them:

* Auto mesh axes: the parameters in the converted layers' layout
  (``jaxoverlap.flax.linen.partition_specs``; the trees are the same, so the stock program
  gets the same shardings: XLA partitions its dense layers over the tensor axis itself), the
  batch over ``data``;
* Explicit mesh axes: the stock model does not run with parameters split over the tensor
  axis there (its dense layers' contractions over a sharded dim need an ``out_sharding``) nor
  with a batch split over ``data`` (its embedding lookup needs one): its parameters and
  inputs are replicated, the converted model's parameters in its layers' layout.

Times are CPU time of this process (every thread; what ``time.process_time`` counts) and
wall time. The ratio is taken on CPU time: on a machine shared with other work, wall time
also counts the other processes. ``--json`` writes every sample.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode  # noqa: E402 - the WMT swap
import flax_lm1b  # noqa: E402 - loading Flax's files

STOCK = "stock"


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    p.add_argument("--impls", nargs="+", default=["xla", "ring", "native"],
                   choices=["xla", "ring", "native"])
    p.add_argument("--axes", nargs="+", default=["auto", "explicit"],
                   choices=["auto", "explicit"])
    p.add_argument("--repeats", type=int, default=3, help="rounds; medians are reported")
    p.add_argument("--mesh-shape", type=int, nargs=2, default=[2, 4], metavar=("DATA", "TENSOR"))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=32)
    p.add_argument("--width", type=int, default=64, help="embedding and attention width")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--json", type=Path, default=None, help="write every sample here")
    p.add_argument("--host-devices", type=int, default=8,
                   help="host devices to create when no accelerator is present")
    args = p.parse_args(argv)
    if args.repeats < 1 or min(args.layers) < 1:
        p.error("--repeats and --layers must be positive")
    return args


def _models(impls: list[str]) -> dict:
    """The stock WMT module and, per impl, the swapped one."""
    from jaxoverlap.flax import linen as jl

    source = flax_lm1b.THIRD_PARTY / "flax_wmt"
    models = {STOCK: flax_lm1b.load_third_party(source, ("models",))["models"]}
    for impl in impls:
        models[impl] = flax_lm1b.swapped_module(
            source / "models.py", decode.WMT_SWAP,
            decode._layers(impl, True, jl), f"compile_time_wmt_{impl}")
    return models


def _config(args, module, layers: int):
    return module.TransformerConfig(
        vocab_size=args.vocab, output_vocab_size=args.vocab, emb_dim=args.width,
        num_heads=args.heads, qkv_dim=args.width, mlp_dim=2 * args.width, num_layers=layers,
        max_len=args.length, dropout_rate=0.0, attention_dropout_rate=0.0, deterministic=True)


def _program(args, module, layers: int, mesh, specs, explicit: bool):
    """(the jitted train step, its abstract arguments) of one model."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    model = module.Transformer(_config(args, module, layers))
    tokens = jax.ShapeDtypeStruct((args.batch, args.length), jnp.int32, sharding=NamedSharding(
        mesh, P(None if explicit else "data")))
    abstract = jax.eval_shape(model.init, jax.random.key(0), tokens, tokens)["params"]
    params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
        abstract, specs)

    def step(params, inputs, targets):           # the WMT example's loss, and SGD
        def loss(params):
            logits = model.apply({"params": params}, inputs, targets)
            onehot = jax.nn.one_hot(targets, logits.shape[-1])
            return -jnp.mean(jnp.sum(onehot * jax.nn.log_softmax(logits), axis=-1))

        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), value

    return jax.jit(step), (params, tokens, tokens)


def _specs(args, models: dict, layers: int, mesh, explicit: bool) -> dict:
    """name -> the parameters' partition specs (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jaxoverlap.flax.linen import partition_specs

    tokens = jax.ShapeDtypeStruct((args.batch, args.length), jnp.int32)
    out = {}
    for name, module in models.items():
        if name != STOCK:
            out[name] = partition_specs(module.Transformer(_config(args, module, layers)),
                                        jax.random.key(0), tokens, tokens)["params"]
    layout = next(iter(out.values()))
    out[STOCK] = jax.tree.map(lambda s: P(), layout) if explicit else layout
    return out


def _time(fn, abstract) -> tuple[float, float, float, float]:
    """(lower CPU s, compile CPU s, lower wall s, compile wall s), caches cleared first."""
    import jax

    jax.clear_caches()
    c0, w0 = time.process_time(), time.perf_counter()
    lowered = fn.lower(*abstract)
    c1, w1 = time.process_time(), time.perf_counter()
    lowered.compile()
    c2, w2 = time.process_time(), time.perf_counter()
    return c1 - c0, c2 - c1, w1 - w0, w2 - w1


def main(argv=None) -> int:
    args = _parse(argv)
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.host_devices}")
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    import jaxoverlap as jo

    needed = int(np.prod(args.mesh_shape))
    if len(jax.devices()) < needed:
        print(f"--mesh-shape {args.mesh_shape} needs {needed} devices; "
              f"{len(jax.devices())} are present")
        return 2
    models = _models(args.impls)
    names = [STOCK, *args.impls]
    print(f"jaxoverlap {jo.__version__}, jax {jax.__version__}: Flax's WMT model, one train "
          f"step, data x tensor = {' x '.join(map(str, args.mesh_shape))} on "
          f"{jax.devices()[0].platform}; width {args.width}, batch {args.batch}, length "
          f"{args.length}; medians of {args.repeats} rounds (CPU s of this process; wall s)")
    header = (f"{'layers':>6} {'axes':>8} {'program':>8} {'lower':>7} {'compile':>8} "
              f"{'total':>7} {'ratio':>6} {'wall':>7} {'ratio':>6}")
    print(header)
    report = []
    for layers in args.layers:
        for axes in args.axes:
            explicit = axes == "explicit"
            kind = AxisType.Explicit if explicit else AxisType.Auto
            devices = np.array(jax.devices()[:needed]).reshape(args.mesh_shape)
            mesh = Mesh(devices, ("data", "tensor"), axis_types=(kind, kind))
            with jax.set_mesh(mesh):
                specs = _specs(args, models, layers, mesh, explicit)
                programs = {n: _program(args, models[n], layers, mesh, specs[n], explicit)
                            for n in names}
                samples: dict[str, list[tuple]] = {n: [] for n in names}
                for r in range(args.repeats):
                    for n in names[r % len(names):] + names[:r % len(names)]:  # rotate
                        samples[n].append(_time(*programs[n]))
            medians = {n: [statistics.median(s[i] for s in samples[n]) for i in range(4)]
                       for n in names}
            base_cpu = medians[STOCK][0] + medians[STOCK][1]
            base_wall = medians[STOCK][2] + medians[STOCK][3]
            for n in names:
                lo, co, lw, cw = medians[n]
                ratio, wall_ratio = (lo + co) / base_cpu, (lw + cw) / base_wall
                print(f"{layers:>6} {axes:>8} {n:>8} {lo:>7.2f} {co:>8.2f} {lo + co:>7.2f} "
                      f"{ratio:>6.2f} {lw + cw:>7.2f} {wall_ratio:>6.2f}", flush=True)
                report.append(dict(layers=layers, axes=axes, program=n, lower_cpu_s=lo,
                                   compile_cpu_s=co, ratio=ratio, lower_wall_s=lw,
                                   compile_wall_s=cw, wall_ratio=wall_ratio,
                                   samples=samples[n]))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()},
                                             jax=jax.__version__, results=report), indent=2))
        print(f"wrote {args.json}")
    worst = max(r["ratio"] for r in report if r["program"] != STOCK)
    print(f"largest ratio to stock (lower + compile, CPU time): {worst:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
