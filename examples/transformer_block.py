"""Trains a GPT-style block with jaxoverlap layers next to the same block in plain Flax.

    python examples/transformer_block.py                     # dp=2 x tp=4 on 8 host devices
    python examples/transformer_block.py --steps 20 --impl ring --no-sequence-parallel

The block is pre-LayerNorm attention (QKV column-parallel, output row-parallel)
and a ``ParallelMLP``, with sequence-parallel layer norms: between the
tensor-parallel layers the activations stay sharded on the sequence dim. Both
blocks start from the same parameters (the plain one's, loaded unchanged into
the parallel one) and take the same optax steps; the loss of each step is
printed side by side, and the script exits non-zero if they diverge.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dp", type=int, default=2, help="data-parallel size")
    p.add_argument("--tp", type=int, default=4, help="tensor-parallel size")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--impl", default="auto", choices=["auto", "xla", "ring", "native"])
    p.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--rtol", type=float, default=1e-3,
                   help="largest relative loss difference accepted (float32)")
    p.add_argument("--host-devices", type=int, default=8,
                   help="host devices to create when no accelerator is present")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    missing = [m for m in ("flax", "optax") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"examples/transformer_block.py needs {' and '.join(missing)}: "
              "pip install 'jaxoverlap[examples]'")
        return 2
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.host_devices}")
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxoverlap as jo
    from jaxoverlap.flax.linen import (
        ColumnParallelDense,
        ParallelMLP,
        RowParallelDense,
        partition_specs,
    )

    if args.hidden % args.heads:
        print(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
        return 2
    if len(jax.devices()) < args.dp * args.tp:
        print(f"need {args.dp * args.tp} devices for dp={args.dp} x tp={args.tp}, "
              f"have {len(jax.devices())}")
        return 2

    class Mlp(nn.Module):
        """The plain MLP, with ParallelMLP's parameter names (up, down)."""

        ffn: int

        @nn.compact
        def __call__(self, x):
            h = nn.Dense(self.ffn, name="up")(x)
            return nn.Dense(x.shape[-1], name="down")(nn.gelu(h))

    class Block(nn.Module):
        """Pre-LN causal self-attention + MLP. ``parallel`` swaps in the jaxoverlap layers."""

        heads: int
        ffn: int
        parallel: bool

        @nn.compact
        def __call__(self, x):                      # [B, S, H], sharded on S when parallel
            b, s, hidden = x.shape
            hd = hidden // self.heads
            kw = dict(sequence_parallel=args.sequence_parallel, impl=args.impl)
            if self.parallel:
                qkv_layer = ColumnParallelDense(3 * hidden, name="qkv", **kw)
                out_layer = RowParallelDense(hidden, name="out", **kw)
                mlp = ParallelMLP(self.ffn, name="mlp", **kw)
            else:
                qkv_layer = nn.Dense(3 * hidden, name="qkv")
                out_layer = nn.Dense(hidden, name="out")
                mlp = Mlp(self.ffn, name="mlp")
            # Features are laid out head-major ([heads, 3, hd]), so a column shard
            # of QKV holds whole heads and attention needs no communication.
            qkv = qkv_layer(nn.LayerNorm(name="ln1")(x)).reshape(b, s, self.heads, 3, hd)
            q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
            scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
            att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
            x = x + out_layer(att.reshape(b, s, hidden))
            return x + mlp(nn.LayerNorm(name="ln2")(x))

    rng = np.random.default_rng(0)
    shape = (args.batch, args.seq, args.hidden)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    target = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    reference = Block(args.heads, args.ffn, parallel=False)
    parallel = Block(args.heads, args.ffn, parallel=True)
    params = reference.init(jax.random.key(0), x)            # the one checkpoint both load

    def train(model, params, x, target):
        optimizer = optax.adam(args.lr)

        @jax.jit
        def step(params, opt_state, x, target):
            def loss_fn(params):
                return jnp.mean((model.apply(params, x) - target) ** 2)

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        opt_state, losses = optimizer.init(params), []
        for _ in range(args.steps):
            params, opt_state, loss = step(params, opt_state, x, target)
            losses.append(float(loss))
        return losses

    mesh = jax.make_mesh((args.dp, args.tp), ("dp", "tp"))
    with jax.set_mesh(mesh):
        # Place the checkpoint (the plain model's tree) in the layers' own layout.
        specs = partition_specs(parallel, jax.random.key(0), x)
        placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
                              params, specs)
        x_spec = P("dp", "tp" if args.sequence_parallel else None, None)
        put = lambda a: jax.device_put(a, NamedSharding(mesh, x_spec))
        ours = train(parallel, placed, put(x), put(target))
    plain = train(reference, jax.device_get(params), x, target)

    print(f"jaxoverlap {jo.__version__}, jax {jax.__version__}: GPT block, dp={args.dp} x "
          f"tp={args.tp} on {jax.devices()[0].platform}, impl={args.impl}, sequence_parallel="
          f"{args.sequence_parallel}; batch {args.batch}, seq {args.seq}, hidden {args.hidden}, "
          f"heads {args.heads}, ffn {args.ffn}")
    print(f"{'step':>4} {'jaxoverlap':>12} {'plain flax':>12} {'rel diff':>10}")
    worst = 0.0
    for i, (a, b) in enumerate(zip(ours, plain, strict=True)):
        rel = abs(a - b) / max(abs(b), 1e-12)
        worst = max(worst, rel)
        print(f"{i:>4} {a:>12.6f} {b:>12.6f} {rel:>10.2e}")
    if not worst <= args.rtol or not np.all(np.isfinite(ours)):
        print(f"DIVERGED: largest relative difference {worst:.2e} > {args.rtol:.0e}")
        return 1
    if not plain[-1] < plain[0]:
        print("the loss did not decrease; raise --steps or --lr")
        return 1
    print(f"OK: the losses agree within {args.rtol:.0e} (largest difference {worst:.2e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
