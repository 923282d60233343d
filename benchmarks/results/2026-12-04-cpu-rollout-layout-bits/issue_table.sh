#!/bin/bash
# Issue 37's table: random transformers Qwen3 / Qwen3-MoE checkpoints, check_alignment --json, training
# on data 2 x fsdp 4, the engine tensor-parallel (and expert-parallel for MoE), 8 fake CPU devices, in
# the compute dtype given.
# usage: bash issue_table.sh [bfloat16|float32] [DIR]  (from anywhere; default bfloat16; the checkpoints
#        are written to DIR, default a temporary one, and reused when DIR holds them)
# Raw outputs: issue_table.txt here (bfloat16, its first rows; named then bf16-f32, w8a8-f32, w4a16-f32
# for the tensor-2 rows of f32 masters, bf16-bf16 for bf16 masters, moe-w8a8) and
# ../2026-12-04-cpu-f32-compute-tensor-layouts/f32_table.txt (float32, run as f32_table.sh, this table
# in f32 compute before the two scripts became this one).
set -euo pipefail
COMPUTE=${1:-bfloat16}
case "$COMPUTE" in
  bfloat16 | float32) ;;
  *) echo "issue_table.sh: the compute dtype must be bfloat16 or float32, got '$COMPUTE'" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/../../.."
DIR=${2:-$(mktemp -d)}
export DIR
export XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu
if [ ! -d "$DIR/dense" ] || [ ! -d "$DIR/moe" ]; then
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
fi
run() {  # name, args...
  name=$1; shift
  echo "== $name: $*"
  python -m qarl_jax.tools.check_alignment "$@" mesh.data=2 mesh.fsdp=4 model.compute_dtype=$COMPUTE --json 2>&1 | tail -25
}
for fmt in bf16 w8a8 w4a16; do
  run $fmt-tensor2 model.path=$DIR/dense quant.fmt=$fmt rollout.mesh.data=4 rollout.mesh.tensor=2
done
run bf16-bf16-masters-tensor2 model.path=$DIR/dense quant.fmt=bf16 model.param_dtype=bfloat16 rollout.mesh.data=4 rollout.mesh.tensor=2
# tensor 4: the 2 kv heads replicated, one q head per device (in f32 refused from 1e0df49 until the CPU
# attention's one-block fix, 1455eac; before it: w4a16 0.9921, bf16 0.9955, w8a8 1.0: f32_table.txt)
for fmt in bf16 w4a16 w8a8 w4a8 fp8; do
  run $fmt-tensor4 model.path=$DIR/dense quant.fmt=$fmt rollout.mesh.data=2 rollout.mesh.tensor=4
done
run moe-w8a8-tensor2-expert2 model.path=$DIR/moe quant.fmt=w8a8 rollout.mesh.data=2 rollout.mesh.tensor=2 rollout.mesh.expert=2
run moe-w4a16-tensor4-expert2 model.path=$DIR/moe quant.fmt=w4a16 rollout.mesh.data=1 rollout.mesh.tensor=4 rollout.mesh.expert=2
