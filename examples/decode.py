"""Tensor-parallel decoding: Flax's own models, swapped to jaxoverlap's layers, generate what
the originals generate, token for token; time per token per impl.

    python examples/decode.py                          # Flax's lm1b (linen), greedy
    python examples/decode.py --model wmt              # Flax's WMT encoder-decoder
    python examples/decode.py --model lm1b-nnx --impls ring native
    python examples/decode.py --model wmt --search beam --beam-size 2

The models are Flax's, unmodified, in ``examples/third_party`` (github.com/google/flax,
Apache-2.0: see the README and LICENSE-flax there), each decoded as its example does:

* ``lm1b`` - examples/lm1b (decoder only, linen, logical axis names), as its
  ``predict_step``: ``init`` with ``decode=True`` makes the cache, then one token per step;
* ``lm1b-nnx`` - the former examples/lm1b_nnx (decoder only, nnx), as its ``predict_step``:
  ``init_cache`` on every module that has one, then one token per step;
* ``wmt`` - examples/wmt (encoder-decoder: cross-attention over the encoded input, with its
  padding mask), as its ``initialize_cache`` and ``predict_step``: the encoder once, then
  the decoder one token per step.

Greedy decoding (``greedy`` below) is what the lm1b examples' sampler does with ``topk=1``
(start from token 0, keep the prompt's tokens, pad after EOS), for a whole batch (Flax's
sampler takes one sequence: with several its loop's carry changes shape) and a fixed number
of steps. ``--search beam`` (wmt) runs the WMT example's own beam search instead.

Each model is swapped as ``examples/flax_lm1b.py`` swaps lm1b (its replacement lists; for
WMT, ``WMT_SWAP`` below), given the original's parameters (a checkpoint of the unparallel
model) placed on a ``data x fsdp x tensor`` mesh (``--mesh-shape``, default tensor = 4), and
run under ``jax.set_mesh``, once per impl. In a decode step each device runs the attention
on its heads and their cache; the projections run without sequence parallelism (one token
does not split) and the row-parallel ones end in ``jo.matmul_ar`` (one-shot when the batch per
device does not split over the tensor ranks, e.g. ``--batch 1``).

The script prints, per impl, the median time per decode step over ``--repeats`` runs (each
step makes one token for each of the ``--batch`` sequences; beam search: per position of
``--length``, as its loop may stop earlier), whether the tokens equal those of the original
model on one device and (greedy) how far every step's logits are from the original's, and
exits 1 if the tokens differ or the logits by more than ``--rtol``. On CPU host devices the
times show that everything runs, not a GPU's latency.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flax_lm1b  # noqa: E402 - the lm1b swap and the loading helpers, shared

THIRD_PARTY = flax_lm1b.THIRD_PARTY
MODELS = ("lm1b", "lm1b-nnx", "wmt")
BOS, EOS = 0, 2          # the examples' start (shifted-in 0) and SentencePiece end-of-sentence

# The replacements in Flax's WMT model (examples/wmt/models.py): the MLP's dense layers, the
# encoder's and decoder's self-attention, the cross-attention, and the logits layer.
WMT_SWAP = (
    ("    x = nn.Dense(\n        config.mlp_dim,",
     "    x = ColumnParallelDense(\n        config.mlp_dim,"),
    ("    output = nn.Dense(\n        actual_out_dim,",
     "    output = RowParallelDense(\n        actual_out_dim,"),
    ("(inputs)\n    x = nn.MultiHeadDotProductAttention(",
     "(inputs)\n    x = ParallelMultiHeadDotProductAttention("),
    ("(targets)\n    x = nn.MultiHeadDotProductAttention(",
     "(targets)\n    x = ParallelMultiHeadDotProductAttention("),
    ("    y = nn.MultiHeadDotProductAttention(",
     "    y = ParallelMultiHeadDotProductAttention("),
    ("      logits = nn.Dense(\n          config.output_vocab_size,",
     "      logits = ColumnParallelDense(\n          config.output_vocab_size,"),
)


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="lm1b", choices=MODELS)
    p.add_argument("--impls", nargs="+", default=["xla", "ring", "native"],
                   choices=["auto", "xla", "ring", "native"])
    p.add_argument("--mesh-shape", type=int, nargs=3, default=[1, 1, 4],
                   metavar=("DATA", "FSDP", "TENSOR"))
    p.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True,
                   help="the layers' sequence_parallel (decode steps run without it)")
    p.add_argument("--search", default="greedy", choices=["greedy", "beam"],
                   help="beam: the WMT example's beam search (--model wmt)")
    p.add_argument("--beam-size", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=4,
                   help="prompt tokens (lm1b), or the length of the input sentence (wmt)")
    p.add_argument("--length", type=int, default=16, help="the longest sequence decoded")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64, help="embedding and attention width")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rtol", type=float, default=1e-4,
                   help="largest difference of the logits accepted, relative to their largest")
    p.add_argument("--host-devices", type=int, default=8,
                   help="host devices to create when no accelerator is present")
    return p.parse_args(argv)


def _config_kwargs(args) -> dict:
    return dict(vocab_size=args.vocab, output_vocab_size=args.vocab, emb_dim=args.width,
                num_heads=args.heads, qkv_dim=args.width, mlp_dim=2 * args.width,
                num_layers=args.layers, max_len=max(args.length, args.prompt),
                dropout_rate=0.0, attention_dropout_rate=0.0)


def _layers(impl: str, sequence_parallel: bool, api) -> dict:
    """The names the swapped source refers to: jaxoverlap's layers with the tensor axis."""
    kw = dict(axis_name="tensor", sequence_parallel=sequence_parallel, impl=impl)
    if api.__name__.endswith("nnx"):
        names = ("ColumnParallelLinear", "RowParallelLinear", "ParallelMultiHeadAttention")
    else:
        names = ("ColumnParallelDense", "RowParallelDense", "ParallelMultiHeadDotProductAttention")
    return {n: functools.partial(getattr(api, n), **kw) for n in names}


def greedy(prompts, cache, tokens_to_logits, vocab: int):
    """Greedy decoding of ``prompts [batch, length]`` (0 where a token is to be made): one
    token per step, fed the previous one (first BOS), the prompt's tokens kept, the argmax
    elsewhere, padding (0) after EOS. Returns the tokens and every step's logits."""
    import jax.numpy as jnp
    from jax import lax

    batch, length = prompts.shape

    def step(i, state):
        sequences, all_logits, cache, token, ended = state
        logits, cache = tokens_to_logits(token, cache)
        given = sequences[:, i]
        new = jnp.where(given != 0, given, jnp.argmax(logits, axis=-1).astype(jnp.int32))
        new = jnp.where(ended, 0, new)
        sequences = sequences.at[:, i].set(new)
        all_logits = all_logits.at[:, i].set(logits.astype(jnp.float32))
        return sequences, all_logits, cache, new[:, None], ended | (new == EOS)

    start = (prompts, jnp.zeros((batch, length, vocab), jnp.float32), cache,
             jnp.full((batch, 1), BOS, jnp.int32), jnp.zeros(batch, bool))
    return lax.fori_loop(0, length, step, start)[:2]


# ---------------------------------------------------------------- the models
#
# Each returns (generate, params, logical rules or None): generate(params, inputs) -> (tokens,
# every step's logits or None), jitted; params are the original's (placed on the mesh for
# the swapped model).


def lm1b_linen(args, impl: str | None, mesh):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from jaxoverlap.flax import linen as jl

    original = flax_lm1b.load_third_party(THIRD_PARTY / "flax_lm1b", ("models",))["models"]
    config = original.TransformerConfig(**_config_kwargs(args), deterministic=True)
    shape = (args.batch, args.length)
    params = nn.unbox(original.TransformerLM(config).init(jax.random.key(0),
                                                          jnp.ones(shape, jnp.int32)))["params"]
    models, rules = original, flax_lm1b.LINEN_RULES
    if impl is not None:
        models = flax_lm1b.swapped_module(
            THIRD_PARTY / "flax_lm1b" / "models.py", flax_lm1b.LINEN_SWAP,
            _layers(impl, args.sequence_parallel, jl), "decode_lm1b_models_tp")
        rules = flax_lm1b.LINEN_RULES + flax_lm1b.SWAP_RULES
    decode_config = config.replace(decode=True)

    def predict(params, prompts):          # examples/lm1b/train.py's predict_step, greedy
        cache = models.TransformerLM(decode_config).init(
            jax.random.key(0), jnp.ones(prompts.shape, config.dtype))["cache"]

        def tokens_ids_to_logits(flat_ids, flat_cache):
            flat_logits, new_vars = models.TransformerLM(decode_config).apply(
                {"params": params, "cache": flat_cache}, flat_ids, mutable=["cache"])
            return flat_logits.squeeze(axis=1), new_vars["cache"]

        return greedy(prompts, cache, tokens_ids_to_logits, args.vocab)

    if impl is None:
        return jax.jit(predict), params, None
    abstract = jax.eval_shape(models.TransformerLM(config).init, jax.random.key(0),
                              jax.ShapeDtypeStruct(shape, jnp.int32))
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
    placed = jax.device_put(params, shardings["params"])
    return jax.jit(predict), placed, rules


def lm1b_nnx(args, impl: str | None, mesh):
    import jax
    from flax import nnx

    from jaxoverlap.flax import nnx as jn

    loaded = flax_lm1b.load_third_party(THIRD_PARTY / "flax_lm1b_nnx",
                                        ("configs.default", "models"))
    original, default = loaded["models"], loaded["configs.default"]
    config = original.TransformerConfig(**_config_kwargs(args),
                                        axis_rules=default.Config().axis_rules)
    with nnx.use_eager_sharding(False):      # the original, on one device
        params = nnx.state(original.TransformerLM(config, rngs=nnx.Rngs(0)), nnx.Param)
    models = original
    if impl is not None:
        models = flax_lm1b.swapped_module(
            THIRD_PARTY / "flax_lm1b_nnx" / "models.py", flax_lm1b.NNX_SWAP,
            _layers(impl, args.sequence_parallel, jn), "decode_lm1b_nnx_models_tp")
        with jax.set_mesh(mesh):             # params placed as they are made; then the
            model = models.TransformerLM(config, rngs=nnx.Rngs(0))   # original's values
            own = nnx.state(model, nnx.Param)
            nnx.replace_by_pure_dict(own, jax.tree.map(
                lambda o, v: jax.device_put(v, o.sharding), nnx.to_pure_dict(own),
                nnx.to_pure_dict(params)))
            params = own
    else:
        with nnx.use_eager_sharding(False):
            model = models.TransformerLM(config, rngs=nnx.Rngs(0))
    graphdef, _ = nnx.split(model, nnx.Param)

    def predict(params, prompts):          # examples/lm1b_nnx/train.py's predict_step, greedy
        module = nnx.merge(graphdef, params)
        for _path, m in nnx.iter_modules(module):
            if hasattr(m, "init_cache"):
                m.init_cache((prompts.shape[0], prompts.shape[1], config.emb_dim),
                             dtype=config.dtype)
        graphdef_c, params, cache = nnx.split(module, nnx.Param, nnx.Cache)

        def tokens_ids_to_logits(flat_ids, cache):
            module = nnx.merge(graphdef_c, params, cache)
            module.set_attributes(deterministic=True, decode=True)
            logits = module(flat_ids)
            return logits.squeeze(axis=1), nnx.state(module, nnx.Cache)

        return greedy(prompts, cache, tokens_ids_to_logits, args.vocab)

    return jax.jit(predict), params, None


def wmt(args, impl: str | None, mesh):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from jaxoverlap.flax import linen as jl

    loaded = flax_lm1b.load_third_party(THIRD_PARTY / "flax_wmt", ("models", "decode"))
    original, beam = loaded["models"], loaded["decode"]
    config = original.TransformerConfig(**_config_kwargs(args), deterministic=True)
    inputs_shape, targets_shape = (args.batch, args.prompt), (args.batch, args.length)
    params = original.Transformer(config).init(jax.random.key(0),
                                               jnp.ones(inputs_shape, jnp.int32),
                                               jnp.ones(targets_shape, jnp.int32))["params"]
    models = original
    if impl is not None:
        models = flax_lm1b.swapped_module(
            THIRD_PARTY / "flax_wmt" / "models.py", WMT_SWAP,
            _layers(impl, args.sequence_parallel, jl), "decode_wmt_models_tp")
    predict_config = config.replace(decode=True)
    beam_size = args.beam_size if args.search == "beam" else 1

    def predict(params, inputs):           # examples/wmt/train.py's predict_step
        cache = models.Transformer(predict_config).init(      # its initialize_cache
            jax.random.key(0), jnp.ones(inputs.shape, config.dtype),
            jnp.ones((inputs.shape[0], args.length), config.dtype))["cache"]
        encoded_inputs = beam.flat_batch_beam_expand(
            models.Transformer(predict_config).apply({"params": params}, inputs,
                                                     method=models.Transformer.encode),
            beam_size)
        raw_inputs = beam.flat_batch_beam_expand(inputs, beam_size)

        def tokens_ids_to_logits(flat_ids, flat_cache):
            flat_logits, new_vars = models.Transformer(predict_config).apply(
                {"params": params, "cache": flat_cache}, encoded_inputs, raw_inputs, flat_ids,
                mutable=["cache"], method=models.Transformer.decode)
            return flat_logits.squeeze(axis=1), new_vars["cache"]

        if args.search == "beam":
            beam_seqs, _ = beam.beam_search(inputs, cache, tokens_ids_to_logits,
                                            beam_size=beam_size, alpha=0.6, eos_id=EOS,
                                            max_decode_len=args.length)
            return beam_seqs[:, -1, 1:], None
        return greedy(jnp.zeros((inputs.shape[0], args.length), jnp.int32), cache,
                      tokens_ids_to_logits, args.vocab)

    if impl is None:
        return jax.jit(predict), params, None
    abstract_inputs = (jax.ShapeDtypeStruct(inputs_shape, jnp.int32),
                       jax.ShapeDtypeStruct(targets_shape, jnp.int32))
    specs = jl.partition_specs(models.Transformer(config), jax.random.key(0),  # the layers'
                               *abstract_inputs)["params"]                    # own layout
    placed = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    return jax.jit(predict), placed, None


BUILDERS: dict[str, Callable] = {"lm1b": lm1b_linen, "lm1b-nnx": lm1b_nnx, "wmt": wmt}


# ---------------------------------------------------------------- running and timing


def inputs_of(args):
    """lm1b: prompts of ``--prompt`` tokens, zero-padded to ``--length``; wmt: sentences of
    ``--prompt`` tokens, the last of each padded. No EOS among them."""
    import numpy as np

    rng = np.random.default_rng(0)
    if args.model == "wmt":
        tokens = rng.integers(EOS + 1, args.vocab, size=(args.batch, args.prompt))
        tokens[1::2, -1] = 0                    # padding, masked by the cross-attention
        return tokens.astype(np.int32)
    tokens = np.zeros((args.batch, args.length), np.int32)
    tokens[:, : args.prompt] = rng.integers(EOS + 1, args.vocab, size=(args.batch, args.prompt))
    return tokens


def run(args, impl: str | None, mesh) -> tuple[tuple, list[float]]:
    """Generates with the original (impl None) or the swapped model: ((tokens, logits or
    None), seconds)."""
    import contextlib

    import flax.linen as nn
    import jax

    generate, params, rules = BUILDERS[args.model](args, impl, mesh)
    scope = contextlib.ExitStack()
    if impl is not None:
        scope.enter_context(jax.set_mesh(mesh))
        if rules is not None:
            scope.enter_context(nn.logical_axis_rules(rules))
    with scope:
        inputs = jax.numpy.asarray(inputs_of(args))
        result = jax.block_until_ready(generate(params, inputs))       # compiles
        samples = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(generate(params, inputs))
            samples.append(time.perf_counter() - start)
    return result, samples


def main(argv=None) -> int:
    args = _parse(argv)
    if args.search == "beam" and args.model != "wmt":
        print("--search beam runs the WMT example's beam search: use it with --model wmt")
        return 2
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.host_devices}")
    import jax
    import numpy as np

    needed = int(np.prod(args.mesh_shape))
    if len(jax.devices()) < needed:
        print(f"--mesh-shape {args.mesh_shape} needs {needed} devices; "
              f"{len(jax.devices())} are present")
        return 2
    mesh = flax_lm1b.make_mesh(args)
    (want, want_logits), base = run(args, None, mesh)
    steps = args.length
    print(f"{args.model}, {args.search} decoding, batch {args.batch}, length {args.length}, "
          f"mesh data x fsdp x tensor = {' x '.join(map(str, args.mesh_shape))}, "
          f"sequence_parallel={args.sequence_parallel}; {steps} decode steps")
    print(f"the original's first sequence: {np.asarray(want)[0].tolist()}")
    print(f"{'model':>22}  {'ms / step':>10}  {'tokens':>10}  {'logits rel. diff':>16}")
    print(f"{'original (1 device)':>22}  {statistics.median(base) / steps * 1e3:>10.3f}  "
          f"{'-':>10}  {'-':>16}")
    different = []
    for impl in args.impls:
        (tokens, logits), samples = run(args, impl, mesh)
        same = np.array_equal(np.asarray(tokens), np.asarray(want))
        diff = "-"
        if logits is not None:         # greedy: every step's logits against the original's
            rel = float(np.abs(np.asarray(logits) - np.asarray(want_logits)).max()
                        / np.abs(np.asarray(want_logits)).max())
            same = same and rel <= args.rtol
            diff = f"{rel:.2e}"
        if not same:
            different.append(impl)
        print(f"{'swapped, ' + impl:>22}  {statistics.median(samples) / steps * 1e3:>10.3f}  "
              f"{'equal' if np.array_equal(tokens, want) else 'DIFFERENT':>10}  {diff:>16}")
    if different:
        print(f"DIFFERENT: the tokens or logits (--rtol {args.rtol}) of {', '.join(different)} "
              "differ from the original's")
        return 1
    print("OK: every impl generates the original model's tokens"
          + (f", its logits within {args.rtol}" if want_logits is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
