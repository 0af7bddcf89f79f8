"""Times the Megatron MLP pair (AG+GEMM -> GEMM+RS), forward and backward, for each impl.

    python examples/scaling.py                 # host devices: tp in {2, 4, 8}
    python examples/scaling.py --tp 8 --rows 4096 --hidden 1024 --ffn 4096 --dtype bfloat16

Each configuration is timed side by side in one run (warm-up, then repeats;
the median is reported) and compared with the unfused ``"xla"`` impl, so the
ratios are meaningful even on a noisy machine. On a CPU-only machine the
devices are host devices sharing the cores: the numbers show the machinery
works, not the GPU gain.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8], help="tensor-parallel sizes")
    p.add_argument("--impls", nargs="+", default=["xla", "ring", "native"],
                   help="impls to time; those not available here are reported and skipped")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rows", type=int, default=512, help="sequence length (global)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--chunks", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--host-devices", type=int, default=8,
                   help="host devices to create when no accelerator is present")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.host_devices}")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxoverlap as jo

    dtype = jnp.dtype(args.dtype)
    devices = jax.devices()
    print(f"jaxoverlap {jo.__version__} on {len(devices)} {devices[0].platform} devices "
          f"(jax {jax.__version__}); dtype {dtype.name}; batch {args.batch}, rows {args.rows}, "
          f"hidden {args.hidden}, ffn {args.ffn}")

    def loss(x, w1, w2, mesh, impl):
        h = jo.ag_matmul(x, w1, "tp", axis=1, impl=impl, chunks=args.chunks, mesh=mesh)
        y = jo.matmul_rs(jax.nn.gelu(h), w2, "tp", axis=1, impl=impl, chunks=args.chunks,
                         mesh=mesh)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=(3, 4))
    rows = []
    for tp in args.tp:
        if tp > len(devices):
            print(f"tp={tp}: skipped, only {len(devices)} devices")
            continue
        mesh = Mesh(np.array(devices[:tp]), ("tp",), axis_types=(AxisType.Auto,))
        rng = np.random.default_rng(0)

        def put(shape, spec, rng=rng, mesh=mesh):
            a = jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[-1]), dtype)
            return jax.device_put(a, NamedSharding(mesh, spec))

        x = put((args.batch, args.rows, args.hidden), P(None, "tp", None))
        w1 = put((args.hidden, args.ffn), P(None, "tp"))
        w2 = put((args.ffn, args.hidden), P("tp", None))
        times = {}
        for impl in args.impls:
            try:
                for _ in range(args.warmup):
                    jax.block_until_ready(step(x, w1, w2, mesh, impl))
            except (ValueError, TypeError) as err:
                print(f"tp={tp} impl={impl}: skipped ({str(err).splitlines()[0]})")
                continue
            samples = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                jax.block_until_ready(step(x, w1, w2, mesh, impl))
                samples.append(time.perf_counter() - start)
            times[impl] = statistics.median(samples)
        base = times.get("xla")
        for impl, t in times.items():
            rows.append((tp, impl, t * 1e3, (base / t) if base else float("nan")))

    print()
    print(f"{'tp':>4} {'impl':>8} {'median ms':>10} {'speedup vs xla':>15}")
    for tp, impl, ms, ratio in rows:
        print(f"{tp:>4} {impl:>8} {ms:>10.2f} {ratio:>15.2f}")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
