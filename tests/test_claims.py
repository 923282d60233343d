"""A guard for every claim: each row of the README's "Results" table maps to the tests that keep it
true, or says why none can (a figure measured on an H200, a benchmark's speed, a training study's
outcome). The check is static and fast: every README row is in the table and every table row in
the README, and every named test is a top-level ``test_*`` function of a ``tests/test_*.py``
module that the README's ``pytest`` command collects (not skipped by a decorator). A test renamed
or deleted, or a row added without its guard, fails here."""

from __future__ import annotations

import ast
import functools
import re

from conftest import REPO

# the README's claim text (its first column) -> the tests that guard it ("file::function"), or a
# string: why no test in this suite can (the figure's command is in the row)
CLAIMS: dict[str, list[str] | str] = {
    "Rollout == training on an H200, aligned": "measured on an H200 (benchmarks/device_check.sh --gpu); "
    "its CPU plumbing: tests/test_device_check.py; the CPU claims below",
    "Rollout == training on CPU, 1 and 8 devices": [
        "tests/test_tools_check_alignment.py::test_dense_aligned_bitwise_on_data_fsdp_mesh",
        "tests/test_tools_check_alignment.py::test_naive_mode_mismatches",
        "tests/test_families_alignment.py::test_aligned_rollout_is_bitwise_on_one_device",
        "tests/test_rl_train_step.py::test_aligned_old_logprobs_equal_rollout_and_one_update_is_unclipped",
        "tests/test_device_check.py::test_cpu_mode_aligned_cell_is_bitwise_in_the_summary",
    ],
    "Kernels exact and batch-invariant (H200)": [  # the figure is the H200's; the same checks in
        # the Pallas interpreter and on the CPU kernels
        "tests/test_pallas_gpu.py::test_float_formats_match_reference",
        "tests/test_pallas_gpu.py::test_w8a8_is_exact_int32_accumulation",
        "tests/test_pallas_gpu.py::test_rows_bitwise_invariant_to_m_and_neighbours",
        "tests/test_kernels_matmul.py::test_float_formats_within_k_ulp_of_float64",
        "tests/test_kernels_matmul.py::test_w8a8_equals_int64_numpy_exactly",
        "tests/test_kernels_matmul.py::test_rows_bitwise_invariant",
    ],
    "H200 decode matmul vs XLA bf16 (K=N=4096, M=16)": "an H200 speed (benchmarks/kernel_speed.py)",
    "H200 rollout, Qwen3-1.7B shape, batch 16": "an H200 speed (benchmarks/rollout.py --gpu-shape)",
    "CPU rollout vs HF `generate`": "a speed, host- and load-dependent (benchmarks/rollout.py)",
    "The default run learns (3 seeds, measured on an earlier tree)": "a 240-step training outcome "
    "(~3 minutes a seed); the loop that produces it: tests/test_train_loop.py, tests/test_main.py",
    "Qwen3 / Qwen3-MoE / Qwen2.5 / Llama 3 == `transformers`": [
        "tests/test_models_hf_parity.py::test_logits_match_transformers_on_padded_batches",
        "tests/test_models_config.py::test_llama3_frequencies_are_transformers",
        "tests/test_models_config.py::test_rope_frequencies_are_pinned",
    ],
    "Long sequences in O(T) memory": [
        "tests/test_memory_guard.py::test_differentiated_forward_memory_is_bounded_and_linear_in_t",
    ],
    "The rollout decodes on its own layout": [
        "tests/test_real_run_configs.py::test_the_engine_layout_stops_the_decode_step_gathering_the_weights",
        "tests/test_rollout_layout.py::test_bytes_received_hand_derived",
    ],
    "Rollout == training across layouts, real-run settings (CPU, 8 devices)": [
        "tests/test_rollout_matrix.py::test_tensor_layouts_give_the_training_bits_f32_masters_bf16_compute",
        "tests/test_rollout_matrix.py::test_f32_compute_keeps_the_bits_on_tensor_layouts",
        "tests/test_rollout_matrix.py::test_f32_compute_keeps_the_bits_with_replicated_kv_heads",
        "tests/test_rollout_matrix.py::test_qwen2_and_llama_keep_the_bits_on_tensor_layouts",
        "tests/test_rollout_matrix.py::test_the_cells_cover_every_pair",
    ],
    "Quantized export == what the rollouts ran": [
        "tests/test_export_compressed_tensors.py::test_library_decompresses_to_our_dequantized_weights",
        "tests/test_export_compressed_tensors.py::test_transformers_loads_the_export",
    ],
    "Rollout == training across rollout layouts (CPU, 8 devices)": [
        "tests/test_tools_check_alignment.py::test_moe_tensor_and_expert_parallel_rollout_bitwise_same_routing_padded_batches",
        "tests/test_tools_check_alignment.py::test_tensor_parallel_training_against_replicated_rollout",
        "tests/test_rollout_layout.py::test_engine_on_its_layout_samples_what_one_device_samples",
    ],
    "TPU floors of the real run, from the compiler (not timings)": [
        "tests/test_tpu_compile.py::test_program_cost_counts_loop_trips_slices_and_in_place_updates",
        "tests/test_tpu_compile.py::test_program_cost_reads_a_relaid_stack_by_the_layer",
        "tests/test_tpu_compile.py::test_the_run_compiles_for_a_v5p_slice",
        "tests/test_cost_estimate.py::test_matmul_estimate_is_what_its_blocks_move",
    ],
    "Real-run configs fit their HBM (XLA's compiled plan)": [
        "tests/test_real_run_configs.py::test_real_run_config_shards_and_fits",
        "tests/test_real_run_configs.py::test_cli_prints_the_table_and_fails_what_does_not_fit",
        "tests/test_tpu_compile.py::test_the_run_compiles_for_a_v5p_slice",
    ],
    "GSM8K grader == the authors' labels": [
        "tests/test_rewards_gsm8k_labels.py::test_exact_number_grader_agrees_with_every_label",
        "tests/test_rewards_gsm8k_labels.py::test_pool_gsm8k_grader_agrees_with_every_label",
    ],
    "Multi-host (2 processes) == 1 process": [
        "tests/test_multihost.py::test_two_processes_train_one_policy",
    ],
    "A pod run: run directory in a bucket, hosts that share no disk, preemption": [
        "tests/test_pod_hosts.py::test_sigterm_on_one_host_stops_both_at_one_step_and_the_rerun_resumes_exactly",
        "tests/test_pod_hosts.py::test_hosts_without_a_shared_run_directory_are_refused",
        "tests/test_storage_gcs.py::test_a_run_in_a_bucket_writes_checkpoints_metrics_and_events_there",
        "tests/test_storage_gcs.py::test_the_bucket_lock_refuses_a_second_holder_and_takes_over_from_a_gone_one",
    ],
    "Each host loads only its shards": [
        "tests/test_models_hf_io.py::test_sharded_load_reads_no_more_than_a_shard_at_once",
        "tests/test_models_gcs.py::test_gs_checkpoint_loads_sharded_bit_for_bit",
        "tests/test_real_run_configs.py::test_real_run_config_shards_and_fits",
    ],
    "One-step-off rollouts keep the behaviour log-probs exact": [
        "tests/test_async_rollouts.py::test_overlapped_run_equals_its_sequential_reference",
        "tests/test_async_rollouts.py::test_sigkill_mid_run_then_rerun_resumes_exactly",
    ],
    "QaRL vs quantized rollouts, tiny policy (2 studies)": [  # the committed runs' table and verdict
        "tests/test_replicate.py::test_committed_summary_matches_its_runs",
        "tests/test_replicate.py::test_intervals_and_paired_differences_by_hand",
    ],
    "Long quantized rollouts lose more (step-0 sweep)": "a measured sweep (python -m "
    "qarl_jax.experiments.regime); the cell it picks: tests/test_replicate.py",
}


def _readme_claims() -> list[str]:
    """The first column of every row of the README's "Results" table."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| claim |") and set(rows[1]) <= set("|- "), rows[:2]
    return [row[2:].split(" | ", 1)[0].strip() for row in rows[2:]]


@functools.cache
def _tests_of(module: str) -> dict[str, list[str]]:
    """Top-level ``test_*`` functions of a test module -> the names of their decorators."""
    tree = ast.parse((REPO / module).read_text())
    return {
        node.name: [ast.unparse(d) for d in node.decorator_list]
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }


def test_every_readme_result_row_is_in_the_claim_table():
    rows = _readme_claims()
    assert len(rows) >= 15 and len(set(rows)) == len(rows), rows
    assert not set(rows) - set(CLAIMS), f"README rows with no entry here: {sorted(set(rows) - set(CLAIMS))}"
    assert not set(CLAIMS) - set(rows), f"entries no README row has: {sorted(set(CLAIMS) - set(rows))}"


def test_every_guard_named_is_a_test_the_readme_command_collects():
    """The README's command (``pytest -q -n 2 --dist loadfile``, testpaths ``tests``) collects
    ``tests/test_*.py`` and their top-level ``test_*`` functions; none named here is skipped."""
    assert re.search(r"^\s*testpaths = \[\"tests\"\]", (REPO / "pyproject.toml").read_text(), re.M)
    problems = []
    for claim, guards in CLAIMS.items():
        if isinstance(guards, str):
            assert guards, claim  # a reason, not an empty string
            continue
        assert guards, f"{claim}: no test and no reason"
        for guard in guards:
            module, _, name = guard.partition("::")
            if not re.fullmatch(r"tests/test_\w+\.py", module) or not (REPO / module).is_file():
                problems.append(f"{claim}: {module} is not a test module")
            elif name not in _tests_of(module):
                problems.append(f"{claim}: {guard} does not exist")
            elif any("skip" in d for d in _tests_of(module)[name]):
                problems.append(f"{claim}: {guard} is skipped")
    assert not problems, "\n".join(problems)
