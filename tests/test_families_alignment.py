"""check_alignment on one device for the families beside Qwen3: a Qwen2 checkpoint (q/k/v biases,
tied embeddings, an unused sliding_window as Qwen2.5's configs carry) and a Llama 3 one (llama3 RoPE
scaling, untied), both random and saved by transformers. The rollout engine's log-probs must be the
trainer's bit for bit in w4a16 and w8a8 at temperature 1 and in w4a8 at 0.7 (logits / T, where T
is a constant in the trainer's program and a per-row array in the engine's): the biases and the
scaled frequencies run in the same fused per-token chains on both sides. One process runs every
family's cells (one JAX start-up). The Qwen2 checkpoint has a hidden size of 192 (6 heads of 32, 2
kv heads): 128 does not divide K, so its 4-bit cells run in the default groups chosen per K (64
here, 128 for the down projection) with the bits kept (a Qwen2 checkpoint of its own for that cell,
at hidden 128, was one family's programs compiled twice). Llama's fp8 and both families'
tensor-parallel engines are test_rollout_matrix's."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from hf_reference import LLAMA3_ROPE, random_model
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

REPO = pathlib.Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "qarl_jax" / "assets" / "policy" / "tokenizer.json"  # 128 tokens
COMMON = dict(
    vocab_size=128,
    hidden_size=128,  # Llama's: int4 groups of 128 divide every K (Qwen2's 192 does not)
    intermediate_size=256,
    num_hidden_layers=1,
    max_position_embeddings=64,
    num_attention_heads=4,
    num_key_value_heads=2,
)
MODELS = {
    "qwen2": lambda: random_model(
        Qwen2ForCausalLM,
        Qwen2Config(
            **dict(COMMON, hidden_size=192, num_attention_heads=6, intermediate_size=512),
            tie_word_embeddings=True,
            use_sliding_window=False,
            sliding_window=64,
        ),
        scale=0.05,
    ),
    "llama": lambda: random_model(
        LlamaForCausalLM,
        LlamaConfig(**COMMON, head_dim=32, tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE),
        scale=0.05,
    ),
}
SMALL = [
    "alignment.prompts=2",
    "alignment.min_prompt_len=3",
    "alignment.max_prompt_len=8",
    "alignment.train_rows=4",
    "rollout.samples_per_prompt=2",
    "rollout.max_new_tokens=4",
    "rollout.slots=4",
]
# (format, temperature): dividing by 1 is exact whatever a compiler makes of it, by 0.7 is not
CELLS = (("w4a16", 1.0), ("w8a8", 1.0), ("w4a8", 0.7))
SCRIPT = """
import sys
from qarl_jax.tools.check_alignment import main
checkpoints, small = sys.argv[1].split(";"), sys.argv[2:]
for checkpoint in checkpoints:
    path, cells = checkpoint.split("=")
    for cell in cells.split(","):
        fmt, t = cell.split("@")
        temps = [f"rollout.temperature={t}", f"train.temperature={t}"]
        args = [f"model.path={path}", f"quant.fmt={fmt}", *temps, *small, "--json"]
        assert main(args) == 0, (path, cell)
"""


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the two families' 6 cells in one process (7 cells: ~75 s on 2 quiet cores)
def test_aligned_rollout_is_bitwise_on_one_device(tmp_path):
    """Every family's cells in one process on one device (one JAX start-up for all of them)."""
    cells = {family: CELLS for family in sorted(MODELS)}
    for family in cells:
        MODELS[family]().save_pretrained(tmp_path / family)
        shutil.copy(TOKENIZER, tmp_path / family / "tokenizer.json")
    arg = ";".join(f"{tmp_path / f}=" + ",".join(f"{fmt}@{t}" for fmt, t in c) for f, c in cells.items())
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, arg, *SMALL],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    reports = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["format"] for r in reports] == [fmt for c in cells.values() for fmt, _ in c]
    for r in reports:
        assert r["mode"] == "aligned" and r["n_tokens"] >= 2 * 2
        assert r["frac_bitwise_equal"] == 1.0 and r["max_abs_logp_diff"] == 0.0, r
    groups = {"llama": {128}, "qwen2": {64, 128}}  # 4-bit cells: Qwen2's K of 192 takes groups of 64
    for family, r in zip([f for f in cells for _ in cells[f]], reports, strict=True):
        want = groups[family] if r["format"].startswith("w4") else set()
        assert set((r["group_sizes"] or {}).values()) == want, (family, r)
