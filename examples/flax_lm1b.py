"""Flax's own lm1b language models (linen and nnx), converted to jaxoverlap's layers by a swap.

    python examples/flax_lm1b.py                                  # linen
    python examples/flax_lm1b.py --api nnx --no-sequence-parallel --impl ring

The model files are Flax's, unmodified, in ``examples/third_party`` (from
github.com/google/flax, Apache-2.0: see the README and LICENSE-flax there):
``examples/lm1b`` (linen, logical axis names and rules) and the former
``examples/lm1b_nnx`` (nnx, mesh axis names from the config). The swap is the
list of replacements in ``LINEN_SWAP`` / ``NNX_SWAP`` below, applied to the
source when it is loaded, each exactly once:

* the MLP's two dense layers -> ``ColumnParallelDense`` / ``RowParallelDense``
  (nnx: ``ColumnParallelLinear`` / ``RowParallelLinear``);
* the attention -> ``ParallelMultiHeadDotProductAttention`` (nnx:
  ``ParallelMultiHeadAttention``), given its output projection's own names
  (``('kv', 'embed')``): the examples name all four projections alike, but the
  output projection is split on its input dim;
* the logits layer -> ``ColumnParallelDense`` (linen: vocabulary-parallel logits).

The layers get ``axis_name="tensor"`` (the examples' mesh axis),
``sequence_parallel`` and ``impl``; the linen rules get ``('kv', 'tensor')``.
Both models, the original and the swapped one, go through the same set-up (the
linen example's own ``utils.setup_initial_state``: abstract init without a mesh,
``nn.get_partition_spec``, ``nn.logical_to_mesh_sharding``, ``jit`` of the init;
for nnx the model built under the mesh, as the nnx example did) and train the
same steps on the same batches with dropout; the losses are printed side by
side and the script exits 1 if they differ by more than ``--rtol``.

The mesh has Auto axes, as the examples make it (``Mesh(devices, axes)``): the
original models do not run under Explicit axes (Flax's logical constraints are
assertions there, and their embedding lookups need an ``out_sharding``).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
import types
from pathlib import Path

THIRD_PARTY = Path(__file__).resolve().parent / "third_party"

LINEN_SWAP = (
    ("    x = nn.Dense(\n        config.mlp_dim,",
     "    x = ColumnParallelDense(\n        config.mlp_dim,"),
    ("    output = nn.Dense(\n        actual_out_dim,",
     "    output = RowParallelDense(\n        actual_out_dim,"),
    ("    x = nn.MultiHeadDotProductAttention(",
     "    x = ParallelMultiHeadDotProductAttention("),
    ("            config.kernel_init, ('embed', 'kv')\n        ),\n",
     "            config.kernel_init, ('embed', 'kv')\n        ),\n"
     "        out_kernel_init=nn.with_logical_partitioning(\n"
     "            config.kernel_init, ('kv', 'embed')\n        ),\n"),
    ("      logits = nn.Dense(\n          config.output_vocab_size,",
     "      logits = ColumnParallelDense(\n          config.output_vocab_size,"),
)

NNX_SWAP = (
    ("    self.linear1 = nnx.Linear(", "    self.linear1 = ColumnParallelLinear("),
    ("    self.linear2 = nnx.Linear(", "    self.linear2 = RowParallelLinear("),
    ("    self.attention = nnx.MultiHeadAttention(",
     "    self.attention = ParallelMultiHeadAttention("),
    ("        config.kernel_init, config.axis_rules('embed', 'kv')\n      ),\n",
     "        config.kernel_init, config.axis_rules('embed', 'kv')\n      ),\n"
     "      out_kernel_init=nnx.with_partitioning(\n"
     "        config.kernel_init, config.axis_rules('kv', 'embed')\n      ),\n"),
    ("      self.logitdense = nnx.Linear(", "      self.logitdense = ColumnParallelLinear("),
)

# The linen example's rules (examples/lm1b/configs/default.py), and the one the swap adds.
LINEN_RULES = (("mlp", "tensor"), ("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"))
SWAP_RULES = (("kv", "tensor"),)


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--api", default="linen", choices=["linen", "nnx"])
    p.add_argument("--mesh-shape", type=int, nargs=3, default=[2, 2, 2],
                   metavar=("DATA", "FSDP", "TENSOR"))
    p.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--impl", default="auto", choices=["auto", "xla", "ring", "native"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=4, help="global batch")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--layers", type=int, default=2, help="transformer blocks of the model")
    p.add_argument("--rtol", type=float, default=1e-4,
                   help="largest relative loss difference accepted (float32)")
    p.add_argument("--host-devices", type=int, default=8,
                   help="host devices to create when no accelerator is present")
    return p.parse_args(argv)


def load_third_party(directory: Path, names: tuple[str, ...]) -> dict[str, types.ModuleType]:
    """Imports Flax's files from ``directory`` under their own names, without leaving
    those generic names (``models``, ``utils``, ``configs``) in ``sys.modules``."""
    saved = {n: sys.modules.pop(n) for n in list(sys.modules)
             if n.split(".")[0] in {m.split(".")[0] for m in names}}
    sys.path.insert(0, str(directory))
    try:
        return {n: importlib.import_module(n) for n in names}
    finally:
        sys.path.remove(str(directory))
        for n in list(sys.modules):
            if n.split(".")[0] in {m.split(".")[0] for m in names}:
                del sys.modules[n]
        sys.modules.update(saved)


def swapped_module(source: Path, swaps, namespace: dict, name: str) -> types.ModuleType:
    """``source`` with each (old, new) of ``swaps`` replaced exactly once, run as a module
    whose globals also hold ``namespace`` (the jaxoverlap layers)."""
    text = source.read_text()
    for old, new in swaps:
        if text.count(old) != 1:
            raise RuntimeError(f"{source.name}: the swap expects {old!r} exactly once, found "
                               f"{text.count(old)} (has the file changed?)")
        text = text.replace(old, new)
    module = types.ModuleType(name)
    module.__dict__.update(namespace)
    module.__file__ = str(source)
    sys.modules[name] = module          # dataclasses (flax modules) look their module up
    saved = {n: sys.modules.pop(n) for n in list(sys.modules) if n.split(".")[0] == "configs"}
    sys.path.insert(0, str(source.parent))
    try:
        exec(compile(text, str(source), "exec"), module.__dict__)  # noqa: S102 - Flax's file
    finally:
        sys.path.remove(str(source.parent))
        for n in list(sys.modules):
            if n.split(".")[0] == "configs":
                del sys.modules[n]
        sys.modules.update(saved)
    return module


def make_mesh(args):
    """The examples' mesh (utils.create_device_mesh, on one host): Auto axes."""
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    devices = np.array(jax.devices()[: int(np.prod(args.mesh_shape))]).reshape(args.mesh_shape)
    return Mesh(devices, ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)


def batches(args, vocab: int, steps: int):
    import numpy as np

    rng = np.random.default_rng(0)
    for _ in range(steps):
        tokens = rng.integers(1, vocab, size=(args.batch, args.seq), dtype=np.int32)
        tokens[:, -3:] = 0                                   # padding, masked in the loss
        yield {"inputs": tokens}


def cross_entropy(logits, inputs):
    """The examples' weighted cross entropy (label smoothing 0): padding has weight 0."""
    import jax.numpy as jnp
    import optax

    weights = jnp.where(inputs > 0, 1.0, 0.0)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, inputs) * weights
    return loss.sum() / weights.sum()


# ---------------------------------------------------------------- linen


def linen_losses(args, swap: bool) -> list[float]:
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxoverlap.flax import linen as jl

    flax_lm1b = load_third_party(THIRD_PARTY / "flax_lm1b", ("models", "utils"))
    models, utils = flax_lm1b["models"], flax_lm1b["utils"]
    rules = LINEN_RULES
    if swap:
        layers = dict(axis_name="tensor", sequence_parallel=args.sequence_parallel,
                      impl=args.impl)
        models = swapped_module(THIRD_PARTY / "flax_lm1b" / "models.py", LINEN_SWAP, {
            "ColumnParallelDense": functools.partial(jl.ColumnParallelDense, **layers),
            "RowParallelDense": functools.partial(jl.RowParallelDense, **layers),
            "ParallelMultiHeadDotProductAttention": functools.partial(
                jl.ParallelMultiHeadDotProductAttention, **layers),
        }, "flax_lm1b_models_tp")
        rules = LINEN_RULES + SWAP_RULES
    config = models.TransformerConfig(
        vocab_size=64, output_vocab_size=64, emb_dim=32, num_heads=4, qkv_dim=32,
        mlp_dim=64, num_layers=args.layers, max_len=args.seq, dropout_rate=0.1,
        attention_dropout_rate=0.1, deterministic=False)
    # The fields utils.setup_initial_state reads from the training config.
    train_config = types.SimpleNamespace(per_device_batch_size=args.batch,
                                         max_target_length=args.seq, logical_axis_rules=rules)
    mesh = make_mesh(args)
    optimizer = optax.adamw(1e-3, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)
    state, annotations = utils.setup_initial_state(
        models.TransformerLM(config.replace(deterministic=True)), optimizer, train_config,
        jax.random.key(0), mesh)
    data_sharding = NamedSharding(mesh, P("data"))

    def train_step(state, batch, dropout_rng):          # as examples/lm1b/train.py's
        dropout_rng = jax.random.fold_in(dropout_rng, state.step)

        def loss_fn(params):
            logits = models.TransformerLM(config).apply(
                {"params": params}, batch["inputs"], rngs={"dropout": dropout_rng})
            return cross_entropy(logits, batch["inputs"])

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    step = jax.jit(train_step, in_shardings=(annotations, data_sharding, None),
                   out_shardings=(annotations, None), donate_argnums=0)
    losses = []
    for batch in batches(args, config.vocab_size, args.steps):
        state, loss = step(state, jax.device_put(batch, data_sharding), jax.random.key(1))
        losses.append(float(loss))
    return losses


# ---------------------------------------------------------------- nnx


def nnx_losses(args, swap: bool) -> list[float]:
    import jax
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxoverlap.flax import nnx as jn

    flax_lm1b = load_third_party(THIRD_PARTY / "flax_lm1b_nnx", ("configs.default", "models"))
    models, default = flax_lm1b["models"], flax_lm1b["configs.default"]
    if swap:
        layers = dict(axis_name="tensor", sequence_parallel=args.sequence_parallel,
                      impl=args.impl)
        models = swapped_module(THIRD_PARTY / "flax_lm1b_nnx" / "models.py", NNX_SWAP, {
            "ColumnParallelLinear": functools.partial(jn.ColumnParallelLinear, **layers),
            "RowParallelLinear": functools.partial(jn.RowParallelLinear, **layers),
            "ParallelMultiHeadAttention": functools.partial(jn.ParallelMultiHeadAttention,
                                                            **layers),
        }, "flax_lm1b_nnx_models_tp")
    config = models.TransformerConfig(
        vocab_size=64, output_vocab_size=64, emb_dim=32, num_heads=4, qkv_dim=32,
        mlp_dim=64, num_layers=args.layers, max_len=args.seq, dropout_rate=0.1,
        attention_dropout_rate=0.1, axis_rules=default.Config().axis_rules)
    mesh = make_mesh(args)
    data_sharding = NamedSharding(mesh, P("data"))
    with jax.set_mesh(mesh):                 # params placed as they are created (eager sharding)
        model = models.TransformerLM(config, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(model, nnx.Param)
        optimizer = optax.adamw(1e-3, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)
        opt_state = optimizer.init(params)

    def train_step(params, opt_state, batch, step, dropout_rng):   # as lm1b_nnx/train.py's
        dropout_rng = jax.random.fold_in(dropout_rng, step)

        def loss_fn(params):
            module = nnx.merge(graphdef, params)
            module.set_attributes(deterministic=False, decode=False)
            logits = module(batch["inputs"], rngs=nnx.Rngs(dropout=dropout_rng))
            return cross_entropy(logits, batch["inputs"])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    param_sharding = nnx.get_named_sharding(params, mesh)
    step_fn = jax.jit(train_step, in_shardings=(param_sharding, None, data_sharding, None, None),
                      out_shardings=(param_sharding, None, None))
    losses = []
    for i, batch in enumerate(batches(args, config.vocab_size, args.steps)):
        params, opt_state, loss = step_fn(params, opt_state, jax.device_put(batch, data_sharding),
                                          i, jax.random.key(1))
        losses.append(float(loss))
    return losses


def main(argv=None) -> int:
    args = _parse(argv)
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.host_devices}")
    import jax

    needed = args.mesh_shape[0] * args.mesh_shape[1] * args.mesh_shape[2]
    if len(jax.devices()) < needed:
        print(f"--mesh-shape {args.mesh_shape} needs {needed} devices; "
              f"{len(jax.devices())} are present")
        return 2
    run = linen_losses if args.api == "linen" else nnx_losses
    original, swapped = run(args, swap=False), run(args, swap=True)
    print(f"lm1b ({args.api}), mesh data x fsdp x tensor = {' x '.join(map(str, args.mesh_shape))}"
          f", sequence_parallel={args.sequence_parallel}, impl={args.impl}")
    print(f"{'step':>4}  {'Flax':>12}  {'jaxoverlap':>12}  {'rel. diff':>10}")
    worst = 0.0
    for i, (a, b) in enumerate(zip(original, swapped, strict=True)):
        diff = abs(a - b) / max(abs(a), 1e-30)
        worst = max(worst, diff)
        print(f"{i:>4}  {a:>12.6f}  {b:>12.6f}  {diff:>10.2e}")
    if not worst <= args.rtol:
        print(f"DIVERGED: relative difference {worst:.2e} > --rtol {args.rtol}")
        return 1
    print(f"OK: the losses agree within {args.rtol}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
