#!/bin/bash
# Re-run of issue 37's table: random transformers Qwen3 checkpoints, check_alignment --json, 8 fake devices.
# usage: bash issue_table.sh [DIR]  (from anywhere; the checkpoints are written to DIR, default a temporary one)
set -euo pipefail
cd "$(dirname "$0")/../../.."
DIR=${1:-$(mktemp -d)}
export DIR
export XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu
python - <<'PY'
import os, sys
sys.path.insert(0, "tests")
from hf_reference import random_model
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
d = dict(vocab_size=512, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
         intermediate_size=768, num_hidden_layers=2, max_position_embeddings=512)
random_model(Qwen3ForCausalLM, Qwen3Config(**d, tie_word_embeddings=True), seed=0, scale=0.02).save_pretrained(os.environ["DIR"] + "/dense")
random_model(Qwen3MoeForCausalLM, Qwen3MoeConfig(**d, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=128), seed=0, scale=0.02).save_pretrained(os.environ["DIR"] + "/moe")
PY
cp qarl_jax/assets/policy/tokenizer.json "$DIR/dense/" && cp qarl_jax/assets/policy/tokenizer.json "$DIR/moe/"
run() {  # name, args...
  name=$1; shift
  echo "== $name: $*"
  python -m qarl_jax.tools.check_alignment "$@" mesh.data=2 mesh.fsdp=4 model.compute_dtype=bfloat16 --json 2>&1 | tail -25
}
run bf16-f32 model.path=$DIR/dense quant.fmt=bf16 rollout.mesh.data=4 rollout.mesh.tensor=2
run w8a8-f32 model.path=$DIR/dense quant.fmt=w8a8 rollout.mesh.data=4 rollout.mesh.tensor=2
run w4a16-f32 model.path=$DIR/dense quant.fmt=w4a16 rollout.mesh.data=4 rollout.mesh.tensor=2
run bf16-bf16 model.path=$DIR/dense quant.fmt=bf16 model.param_dtype=bfloat16 rollout.mesh.data=4 rollout.mesh.tensor=2
run w8a8-tensor4 model.path=$DIR/dense quant.fmt=w8a8 rollout.mesh.data=2 rollout.mesh.tensor=4
run moe-w8a8 model.path=$DIR/moe quant.fmt=w8a8 rollout.mesh.data=2 rollout.mesh.tensor=2 rollout.mesh.expert=2
