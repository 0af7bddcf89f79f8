"""The examples run end to end in a short configuration (in-process: the 8 host devices exist)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

# Whole examples: seconds to a minute each.
pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module       # dataclasses (flax modules) look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flags", [[], ["--no-sequence-parallel", "--impl", "ring"]])
def test_transformer_block_trains_like_plain_flax(flags, capsys):
    code = _load("transformer_block").main(["--steps", "3", *flags])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "OK: the losses agree" in out
    assert len([line for line in out.splitlines() if line.strip()[:1].isdigit()]) == 3


def test_transformer_block_reports_divergence(capsys):
    # A tolerance no float32 run can meet: the comparison must be able to fail.
    code = _load("transformer_block").main(["--steps", "2", "--rtol", "-1"])
    assert code == 1
    assert "DIVERGED" in capsys.readouterr().out


def test_scaling_writes_table_json_and_plot(tmp_path, capsys):
    code = _load("scaling").main([
        "--tp", "2", "4", "16", "--rows", "16", "32", "--batch", "1", "--hidden", "8",
        "--ffn", "32", "--warmup", "1", "--repeats", "2", "--impls", "xla", "ring", "native",
        "--out", str(tmp_path), "--no-progress", "--project", "h100",
    ])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "median ms" in out and "speedup vs xla" in out
    # Next to the measured table, the same block projected on a GPU, labelled as a model.
    assert "MODEL PROJECTION (jaxoverlap.sim), not a measurement: the same block" in out
    report = json.loads((tmp_path / "scaling.json").read_text())
    timed = {(r["tp"], r["rows"], r["impl"]) for r in report["results"]}
    assert {(tp, rows, impl) for tp in (2, 4) for rows in (16, 32)
            for impl in ("xla", "ring")} <= timed
    for r in report["results"]:
        assert len(r["samples_ms"]) == 2 and r["median_ms"] > 0
        assert r["speedup_vs_xla"] == pytest.approx(
            next(b["median_ms"] for b in report["results"]
                 if (b["tp"], b["rows"], b["impl"]) == (r["tp"], r["rows"], "xla"))
            / r["median_ms"])
    # tp=16 has no devices here, and every impl is either timed or skipped with a reason.
    reasons = {(s["tp"], s["rows"], s["impl"]): s["reason"] for s in report["skipped"]}
    assert "only 8 devices" in reasons[(16, 16, "xla")]
    assert all((tp, rows, impl) in timed | set(reasons) for tp in (2, 4, 16)
               for rows in (16, 32) for impl in ("xla", "ring", "native"))
    projected = {(r["tp"], r["rows"], r["impl"]): r for r in report["projection"]
                 if r["preset"] == "h100" and "tp" in r}
    assert timed <= set(projected)
    for (tp, rows, _), r in projected.items():
        assert r["ms"] > 0 and len(r["calls"]) == 4, r      # AG, RS forward; RS, AG backward
        xla = projected[(tp, rows, "xla")]["ms"]
        assert r["speedup_vs_xla"] == pytest.approx(xla / r["ms"])
    assert any("gpu_sized" in r for r in report["projection"])
    png = (tmp_path / "scaling.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000


def test_compile_time_compiles_stock_and_converted_side_by_side(tmp_path, capsys):
    """The benchmark runs and reports a ratio per program (its numbers are not checked here:
    performance targets live in the benchmark, not in tests)."""
    path = tmp_path / "compile.json"
    code = _load("compile_time").main(["--layers", "1", "--impls", "native", "--repeats", "1",
                                       "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads(path.read_text())["results"]
    assert {(r["axes"], r["program"]) for r in report} == {
        (axes, p) for axes in ("auto", "explicit") for p in ("stock", "native")}
    for r in report:
        assert r["lower_cpu_s"] > 0 and r["compile_cpu_s"] > 0, r
        assert (r["ratio"] == 1.0) == (r["program"] == "stock"), r
    assert "largest ratio to stock" in out


@pytest.fixture(scope="module")
def flax_lm1b():
    """The example, its original model's losses computed once per configuration: they depend
    on the API, the mesh, the steps and the data, not on the swapped layers' flags
    (``--sequence-parallel``, ``--impl``, ``--rtol``), so every swapped variant is compared
    with the same stock run rather than one trained again for it."""
    example = _load("flax_lm1b")
    originals: dict[tuple, list[float]] = {}

    def once(real):
        def losses(args, swap: bool) -> list[float]:
            if swap:
                return real(args, swap=True)
            key = (args.api, tuple(args.mesh_shape), args.steps, args.batch, args.seq,
                   args.layers)
            if key not in originals:
                originals[key] = real(args, swap=False)
            return originals[key]
        return losses

    example.linen_losses = once(example.linen_losses)
    example.nnx_losses = once(example.nnx_losses)
    return example


@pytest.mark.parametrize("flags", [
    ["--api", "linen"],
    ["--api", "linen", "--no-sequence-parallel", "--impl", "ring"],
    ["--api", "nnx", "--impl", "ring"],
    ["--api", "nnx", "--no-sequence-parallel"],
], ids=["linen-sp", "linen-ring", "nnx-sp-ring", "nnx"])
@pytest.mark.jax_api
def test_flax_lm1b_trains_like_flax_after_the_swap(flags, flax_lm1b, capsys):
    """Flax's own lm1b models, original and swapped, through the same set-up and steps.

    One transformer block: it holds every layer the swap replaces (the attention, the MLP's
    column and row layers, the vocabulary-parallel logits) and the layout between them (with
    sequence parallelism: embedding -> attention -> MLP -> logits), so a wrong gradient of any
    of them moves the losses of steps 1 and 2; a second block adds the same layers again."""
    code = flax_lm1b.main([*flags, "--steps", "3", "--layers", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "OK: the losses agree" in out
    assert len([line for line in out.splitlines() if line.strip()[:1].isdigit()]) == 3


def test_flax_lm1b_swap_puts_jaxoverlap_layers_in_the_models():
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxoverlap.flax import linen as jl
    from jaxoverlap.flax import nnx as jn

    example = _load("flax_lm1b")
    models = example.swapped_module(
        example.THIRD_PARTY / "flax_lm1b" / "models.py", example.LINEN_SWAP, {
            "ColumnParallelDense": jl.ColumnParallelDense,
            "RowParallelDense": jl.RowParallelDense,
            "ParallelMultiHeadDotProductAttention": jl.ParallelMultiHeadDotProductAttention,
        }, "flax_lm1b_models_check")
    config = models.TransformerConfig(vocab_size=8, output_vocab_size=8, emb_dim=8, num_heads=2,
                                      qkv_dim=8, mlp_dim=16, num_layers=1, max_len=4,
                                      deterministic=True)
    seen = []

    def record(next_fun, args, kwargs, context):
        seen.append(type(context.module).__name__)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(models.TransformerLM(config).init, jax.random.key(0),
                       jnp.ones((1, 4), jnp.int32))
    assert {"ColumnParallelDense", "RowParallelDense",
            "ParallelMultiHeadDotProductAttention"} <= set(seen)
    assert "Dense" not in seen and "MultiHeadDotProductAttention" not in seen   # all swapped
    nnx_models = example.swapped_module(
        example.THIRD_PARTY / "flax_lm1b_nnx" / "models.py", example.NNX_SWAP, {
            "ColumnParallelLinear": jn.ColumnParallelLinear,
            "RowParallelLinear": jn.RowParallelLinear,
            "ParallelMultiHeadAttention": jn.ParallelMultiHeadAttention,
        }, "flax_lm1b_nnx_models_check")
    with nnx.use_eager_sharding(False):      # no mesh here: the params are not placed
        model = nnx.eval_shape(lambda: nnx_models.TransformerLM(nnx_models.TransformerConfig(
            vocab_size=8, output_vocab_size=8, emb_dim=8, num_heads=2, qkv_dim=8, mlp_dim=16,
            num_layers=1, max_len=4), rngs=nnx.Rngs(0)))
    block = model.decoder.encoderdecoderblock_0
    assert isinstance(block.mlp.linear1, jn.ColumnParallelLinear)
    assert isinstance(block.mlp.linear2, jn.RowParallelLinear)
    assert isinstance(block.attention, jn.ParallelMultiHeadAttention)
    assert isinstance(model.decoder.logitdense, jn.ColumnParallelLinear)


def test_flax_lm1b_reports_divergence(flax_lm1b, capsys):
    # The nnx cases' steps: their original's losses are reused.
    code = flax_lm1b.main(["--api", "nnx", "--steps", "3", "--layers", "1", "--rtol", "-1"])
    assert code == 1
    assert "DIVERGED" in capsys.readouterr().out


@pytest.mark.parametrize("model,impls,batch,search", [
    ("lm1b", ["xla", "ring", "native"], "4", "greedy"),
    ("wmt", ["xla", "ring", "native"], "4", "greedy"),
    ("wmt", ["xla", "native"], "4", "beam"),
    ("lm1b-nnx", ["ring"], "4", "greedy"), ("lm1b", ["ring", "native"], "1", "greedy")])
@pytest.mark.jax_api
def test_decode_generates_the_original_models_tokens(model, impls, batch, search, capsys):
    """Flax's own models (the decoder-only lm1b, linen and nnx; the WMT encoder-decoder),
    swapped, decode token for token as the originals do: greedily, and with the WMT example's
    own beam search (a batch of one on 4 ranks, one layer: the all-reduces run one-shot)."""
    layers = ["--layers", "1"] if batch == "1" else []
    code = _load("decode").main(["--model", model, "--length", "10", "--repeats", "1",
                                 "--batch", batch, *layers, "--search", search,
                                 "--impls", *impls])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "OK: every impl generates the original model's tokens" in out
    for impl in impls:
        assert re.search(rf"swapped, {impl}\s+[0-9.]+\s+equal\s+[0-9.e-]+\n", out), out
    first = re.search(r"first sequence: \[([0-9, ]+)\]", out).group(1).split(", ")
    assert len(set(first)) > 2, out             # a sequence, not one token over and over


def test_decode_steps_run_the_fused_all_reduce():
    """The decode steps of the swapped lm1b call the native GEMM + all-reduce: one per
    row-parallel layer (attention output, MLP down-projection) of each layer; two-shot for a
    batch of 4 on 4 ranks, one-shot for a batch of 1 (its rows do not split)."""
    import flax.linen as nn
    import jax

    example = _load("decode")
    for batch, algorithm in (("4", 0), ("1", 1)):
        args = example._parse(["--model", "lm1b", "--length", "8", "--batch", batch,
                               "--layers", "1"])
        mesh = example.flax_lm1b.make_mesh(args)
        generate, params, rules = example.BUILDERS["lm1b"](args, "native", mesh)
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            text = generate.lower(params, jax.numpy.asarray(example.inputs_of(args))).compile()
        calls = [line for line in text.as_text().splitlines()
                 if 'custom_call_target="jaxoverlap_matmul_ar"' in line]
        assert len(calls) == 2 * args.layers, batch
        assert all(f"algorithm = {algorithm} : i32" in line for line in calls), batch


def test_decode_reports_different_tokens(capsys, monkeypatch):
    """A cache step that does not attend to its own token (a bug put in on purpose) changes
    the tokens: the example says so and exits 1."""
    import jax

    from jaxoverlap.flax import _common

    real = _common.decode_step

    def own_token_masked(*args, **kwargs):
        query, key, value, index, mask = real(*args, **kwargs)
        written = jax.numpy.arange(key.shape[-3]) < index - 1
        return query, key, value, index, mask * written

    monkeypatch.setattr(_common, "decode_step", own_token_masked)
    code = _load("decode").main(["--model", "lm1b", "--impls", "xla", "--length", "8",
                                 "--repeats", "1"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert re.search(r"swapped, xla\s+[0-9.]+\s+DIFFERENT", out), out
    assert "DIFFERENT: the tokens or logits (--rtol 0.0001) of xla differ" in out


def test_decode_with_a_gpu_preset_runs_the_one_launch_all_reduce(capsys, monkeypatch):
    """With an H100 preset the model picks matmul_ar's one-launch one-shot program (the GEMM
    and one all-reduce kernel: algorithm 2) for the decode steps' GEMM + all-reduce; the host
    executor runs its semantics, and the swapped lm1b still decodes the original's tokens."""
    import flax.linen as nn
    import jax

    monkeypatch.setenv("JAXOVERLAP_PRESET", "h100")
    example = _load("decode")
    code = example.main(["--model", "lm1b", "--length", "8", "--repeats", "1", "--batch", "4",
                         "--layers", "1", "--impls", "native"])
    out = capsys.readouterr().out
    assert code == 0 and "OK: every impl generates the original model's tokens" in out, out
    assert re.search(r"swapped, native\s+[0-9.]+\s+equal\s+[0-9.e-]+\n", out), out
    args = example._parse(["--model", "lm1b", "--length", "8", "--batch", "4", "--layers", "1"])
    mesh = example.flax_lm1b.make_mesh(args)
    generate, params, rules = example.BUILDERS["lm1b"](args, "native", mesh)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        text = generate.lower(params, jax.numpy.asarray(example.inputs_of(args))).compile()
    calls = [line for line in text.as_text().splitlines()
             if 'custom_call_target="jaxoverlap_matmul_ar"' in line]
    assert len(calls) == 2 and all("algorithm = 2 : i32" in line for line in calls), calls
