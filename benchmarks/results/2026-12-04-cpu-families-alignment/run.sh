#!/bin/bash
# check_alignment for Qwen2 and Llama 3 (tests/test_families_alignment.py's random transformers
# checkpoints): bf16 and fp8 at T=1 and 0.7 on one device; w4a16 / w8a8 / fp8 at T=0.7 with training on
# data 2 x fsdp 4 and the engine replicated over 8 fake CPU devices. usage: bash run.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/../../.."
DIR=${1:-$(mktemp -d)}
export DIR
export JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8
python - <<'PY'
import os, sys, shutil
sys.path.insert(0, "tests")
import test_families_alignment as t
for name, make in t.MODELS.items():
    make().save_pretrained(os.environ["DIR"] + f"/{name}")
    shutil.copy(t.TOKENIZER, os.environ["DIR"] + f"/{name}/tokenizer.json")
PY
S="alignment.prompts=4 alignment.min_prompt_len=3 alignment.max_prompt_len=8 alignment.train_rows=4 rollout.samples_per_prompt=4 rollout.max_new_tokens=8 rollout.slots=8"
for fam in qwen2 llama; do
  for cell in "bf16 1.0" "fp8 1.0" "bf16 0.7" "fp8 0.7"; do
    set -- $cell
    echo "== $fam $1 T=$2 one device: $(XLA_FLAGS=--xla_force_host_platform_device_count=1 python -m qarl_jax.tools.check_alignment model.path=${DIR}/$fam quant.fmt=$1 rollout.temperature=$2 train.temperature=$2 $S --json 2>&1 | tail -1)"
  done
  for fmt in w4a16 w8a8 fp8; do
    echo "== $fam $fmt T=0.7 train data2 x fsdp4, engine data 8: $(python -m qarl_jax.tools.check_alignment model.path=${DIR}/$fam quant.fmt=$fmt rollout.temperature=0.7 train.temperature=0.7 mesh.data=2 mesh.fsdp=4 $S --json 2>&1 | tail -1)"
  done
done
