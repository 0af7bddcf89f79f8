"""Every test (and doctest) runs on 8 host devices; the flag must be set before JAX starts."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


# ---- the quick developer loop ---------------------------------------------------------------
#
# `pytest` alone runs the quick loop (pyproject's addopts deselect `slow`); `make test` and CI run
# everything (`-m "slow or not slow"`). Marked slow here, besides tests marked by hand:
# * every test of the modules below (real processes, fresh environments, whole examples and
#   models), and the test functions listed after them;
# * of a parametrized test, every case but the first: the quick loop runs each test function
#   once, the whole grid runs in `make test`.
import pytest  # noqa: E402

SLOW_MODULES = ("tests/multiprocess/", "tests/test_examples.py", "tests/test_first_contact.py",
                "tests/flax/test_adoption.py")
# Test functions that take seconds even alone: whole models, attention against Flax's,
# compiled-HLO checks, real timeouts, the calibration sweep, bench runs.
SLOW_FUNCTIONS = {
    "jaxoverlap/flax/linen.py::jaxoverlap.flax.linen.ColumnParallelDense",
    "jaxoverlap/flax/linen.py::jaxoverlap.flax.linen.ParallelMLP",
    "jaxoverlap/flax/linen.py::jaxoverlap.flax.linen.ParallelMultiHeadDotProductAttention",
    "tests/cuda/test_selftest.py::test_selftest_runs_and_says_no_gpu",
    "tests/flax/test_attention.py::test_linen_attention_matches_flax",
    "tests/flax/test_attention.py::test_linen_cross_attention_and_normalize_qk",
    "tests/flax/test_attention.py::test_linen_general_layers_match_dense_general",
    "tests/flax/test_attention.py::test_nnx_general_layers_match_linear_general",
    "tests/flax/test_linen.py::test_bfloat16_within_its_tolerance",
    "tests/flax/test_linen.py::test_check_fails_on_a_transposed_kernel",
    "tests/flax/test_linen.py::test_init_under_jit_places_parameters_from_flax_metadata",
    "tests/flax/test_linen.py::test_mlp_matches_dense_on_global_arrays",
    "tests/flax/test_nnx.py::test_nnx_and_linen_agree_with_copied_params",
    "tests/flax/test_nnx.py::test_partition_specs_and_placement",
    "tests/native/test_executor.py::test_exit_while_workers_still_run_is_clean",
    "tests/native/test_executor.py::test_matmul_ar_missing_peer_times_out_with_a_clear_error",
    "tests/native/test_ordering.py::test_flax_mlp_forward_backward_with_bias_at_tp8",
    "tests/native/test_ordering.py::test_missing_peer_still_times_out_quickly_and_cleanly",
    "tests/native/test_ordering.py::test_native_calls_next_to_independent_xla_collectives",
    "tests/native/test_ordering.py::test_three_independent_calls_with_identical_shapes",
    "tests/sim/test_model.py::test_chooser_follows_the_model",
    "tests/sim/test_published.py::test_docs_show_the_generated_tables",
    "tests/sim/test_published.py::test_serial_times_and_their_parts_are_within_10_percent",
    "tests/test_bench.py::test_bench_calibrate_writes_a_loadable_preset",
    "tests/test_bench.py::test_bench_measures_every_impl_side_by_side",
    "tests/test_bench.py::test_bench_model_prints_the_projection_and_a_gantt_chart",
    "tests/test_config.py::test_argument_beats_config_beats_environment",
    "tests/test_matmul_ar.py::test_global_mesh_from_set_mesh_and_from_inputs",
    "tests/test_matmul_ar.py::test_grads_under_checkpoint_and_two_calls_in_flight",
    "tests/test_propagation.py::test_fsdp_gathers_kernels_per_layer_and_reduce_scatters_their_gradients",
    "tests/test_propagation.py::test_layers_split_the_flops_over_data_and_tensor",
    "tests/test_propagation.py::test_self_attention_is_one_gather_and_one_scatter_each_way",
}


def pytest_collection_modifyitems(config, items):
    seen: set[tuple[str, str]] = set()
    for item in items:
        path = item.nodeid.split("::")[0]
        function = (path, getattr(item, "originalname", item.name))
        if path.startswith(SLOW_MODULES) or "::".join(function) in SLOW_FUNCTIONS:
            item.add_marker(pytest.mark.slow)
            continue
        if getattr(item, "callspec", None) is None:
            continue
        if function in seen:
            item.add_marker(pytest.mark.slow)
        seen.add(function)
