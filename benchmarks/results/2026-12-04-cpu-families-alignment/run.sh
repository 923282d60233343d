#!/bin/bash
# check_alignment for Qwen2 and Llama 3 (tests/test_families_alignment.py's random transformers
# checkpoints) in every format at T=1 and 0.7, on one device and with training on data 2 x fsdp 4 (the
# engine replicated over 8 fake CPU devices). usage: bash run.sh [DIR]
# out.txt: the 34 cells run on 2026-12-04 (the other 6, w4a16 / w8a8 at T=1 and w4a8 at 0.7 on one
# device, beside them in tests/test_families_alignment.py)
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
  for fmt in bf16 w8a8 w4a16 w4a8 fp8; do
    for t in 1.0 0.7; do
      T="quant.fmt=$fmt rollout.temperature=$t train.temperature=$t"
      echo "== $fam $fmt T=$t one device: $(XLA_FLAGS=--xla_force_host_platform_device_count=1 python -m qarl_jax.tools.check_alignment model.path=${DIR}/$fam $T $S --json 2>&1 | tail -1)"
      echo "== $fam $fmt T=$t train data2 x fsdp4, engine data 8: $(python -m qarl_jax.tools.check_alignment model.path=${DIR}/$fam $T mesh.data=2 mesh.fsdp=4 $S --json 2>&1 | tail -1)"
    done
  done
done
