"""The mismatch tool end to end, in process, on 8 fake CPU devices: the real rollout engine (4
prompts of mixed lengths, 2 samples each on 4 slots, so the slots are refilled) against the trainer's
loss on 8-row batches, for the default policy (the embedded qwen3-tiny checkpoint) and qwen3-moe-tiny.
Aligned w4a16 is bitwise with the same routing; naive is not; --json's last line has exactly the
documented keys; bad configuration exits 2.

The sizes keep the engine's programs few (XLA:CPU compiles are these tests' time): every prompt
fits the first prefill length bucket and each fill takes 2 whole prompts' samples into 4 slots, so
one prefill, one insert and one generate program serve both rounds (the MoE case's one sample
ending on EOS adds a refill of one slot: a prefill and an insert more). 3 prompts x 3 samples
compiled 3 prefills and 3 inserts."""

from __future__ import annotations

import json

import pytest

from qarl_jax.tools.check_alignment import KEYS, main

SMALL = [
    "alignment.prompts=4",
    "alignment.min_prompt_len=3",
    "alignment.max_prompt_len=12",
    "alignment.train_rows=8",
    "rollout.samples_per_prompt=2",
    "rollout.max_new_tokens=8",
    "rollout.slots=4",
]


def check(capsys, *overrides: str) -> dict:
    assert main([*SMALL, *overrides, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert tuple(report) == KEYS
    return report


def assert_bitwise(report: dict) -> None:
    assert 4 * 2 <= report["n_tokens"] <= 4 * 2 * 8
    assert report["frac_bitwise_equal"] == 1.0 and report["max_abs_logp_diff"] == 0.0, report
    assert report["mean_abs_logp_diff"] == 0.0 and report["kl_k3"] == 0.0
    assert set(report["seq_ratio_quantiles"].values()) == {1.0}


@pytest.mark.slow  # 19 s; the fast tier's rollout-vs-trainer guards: test_rl_train_step's aligned step
# (the engine's samples scored by the RL step), test_alignment_model (8-device training forwards)
def test_dense_aligned_bitwise_on_data_fsdp_mesh(capsys):
    report = check(capsys, "mesh.data=2", "mesh.fsdp=4")
    assert_bitwise(report)
    assert report["frac_same_experts"] is None
    assert (report["format"], report["mode"]) == ("w4a16", "aligned")


@pytest.mark.slow  # naive's mismatch in the fast tier: test_alignment_model's
def test_naive_mode_mismatches(capsys):
    report = check(capsys, "mesh.data=2", "mesh.fsdp=4", "quant.mode=naive")
    assert report["mode"] == "naive"
    assert report["frac_bitwise_equal"] < 1.0 and report["max_abs_logp_diff"] > 0.0
    assert report["kl_k3"] > 0.0 and report["seq_ratio_quantiles"]["p0"] != 1.0


@pytest.mark.slow
def test_moe_tensor_and_expert_parallel_rollout_bitwise_same_routing_padded_batches(capsys):
    """The engine on tensor 2 x expert 2 x data 2 (every projection's columns and the heads split
    2 ways, each device owning 4 of the 8 experts), the trainer on FSDP in the engine's column
    blocks: bitwise, every token routed the same (bf16 compute: what tensor parallel needs). The
    preset cut to 2 layers (dense layer 0 feeding MoE layer 1): the layouts are per layer, and each
    layer more only added to the compiles of the engine's and the trainer's programs."""
    moe = (
        "model.path=null",
        "model.preset=qwen3-moe-tiny",
        "model.num_hidden_layers=2",
        "model.compute_dtype=bfloat16",
    )
    layout = ("rollout.mesh.data=2", "rollout.mesh.tensor=2", "rollout.mesh.expert=2")
    report = check(capsys, *moe, "mesh.data=2", "mesh.fsdp=4", *layout, "alignment.packing=false")
    assert_bitwise(report)
    assert report["frac_same_experts"] == 1.0


def test_bad_configuration_exits_2(capsys):
    assert main(["alignment.promptz=3", "--json"]) == 2
    assert "unknown config key alignment.promptz" in capsys.readouterr().err
    assert main(["alignment.max_prompt_len=64"]) == 2  # no room left for the response
    assert "alignment.max_prompt_len" in capsys.readouterr().err
    assert main(["mesh.data=3"]) == 2
    assert "mesh" in capsys.readouterr().err


@pytest.mark.slow
def test_tensor_parallel_training_against_replicated_rollout(capsys):
    """Training on tensor=2, the engine on its default layout (every device a replica): w4a16 stays
    bitwise (so do bf16 and w8a8, measured: the matmul kernels gather each weight whole per device,
    so no sum is split across devices). The default format: the engine's programs are the dense
    test's (the engine's layout does not depend on the training mesh), compiled once."""
    report = check(capsys, "mesh.data=4", "mesh.tensor=2")
    assert_bitwise(report)
