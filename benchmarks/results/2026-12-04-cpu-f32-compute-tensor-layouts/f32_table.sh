#!/bin/bash
# Issue 37's table with float32 compute (refused before the CPU RoPE became a loop of its own):
# random transformers Qwen3 / Qwen3-MoE checkpoints (issue_table.sh's), check_alignment --json,
# training on data 2 x fsdp 4, the engine tensor-parallel, 8 fake CPU devices.
# usage: bash f32_table.sh [DIR]  (DIR: where issue_table.sh wrote its checkpoints, default a new one)
set -euo pipefail
cd "$(dirname "$0")/../../.."
DIR=${1:-$(mktemp -d)}
if [ ! -d "$DIR/dense" ]; then  # the same checkpoints as issue_table.sh
  sed -n '/^python - <<.PY.$/,/^PY$/p' benchmarks/results/2026-12-04-cpu-rollout-layout-bits/issue_table.sh \
    | sed '1d;$d' | DIR=$DIR python -
  cp qarl_jax/assets/policy/tokenizer.json "$DIR/dense/" && cp qarl_jax/assets/policy/tokenizer.json "$DIR/moe/"
fi
export XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu
run() {  # name, args...
  name=$1; shift
  echo "== $name: $*"
  python -m qarl_jax.tools.check_alignment "$@" mesh.data=2 mesh.fsdp=4 model.compute_dtype=float32 --json 2>&1 | tail -25
}
run bf16-tensor2 model.path=$DIR/dense quant.fmt=bf16 rollout.mesh.data=4 rollout.mesh.tensor=2
run w8a8-tensor2 model.path=$DIR/dense quant.fmt=w8a8 rollout.mesh.data=4 rollout.mesh.tensor=2
run w4a16-tensor2 model.path=$DIR/dense quant.fmt=w4a16 rollout.mesh.data=4 rollout.mesh.tensor=2
# tensor 4 (the 2 kv heads replicated, one q head per device): refused in f32 from 1e0df49 until the
# CPU attention's one-block fix (1455eac); before it: w4a16 0.9921 (samples 64, 65), bf16 0.9955
# (sample 64), w8a8 1.0 (raw in f32_table.txt)
for fmt in bf16 w4a16 w8a8 w4a8 fp8; do
  run $fmt-tensor4 model.path=$DIR/dense quant.fmt=$fmt rollout.mesh.data=2 rollout.mesh.tensor=4
done
run moe-w8a8-tensor2-expert2 model.path=$DIR/moe quant.fmt=w8a8 rollout.mesh.data=2 rollout.mesh.tensor=2 rollout.mesh.expert=2
# MoE with its 2 kv heads replicated (2026-12-05)
run moe-w4a16-tensor4-expert2 model.path=$DIR/moe quant.fmt=w4a16 rollout.mesh.data=1 rollout.mesh.tensor=4 rollout.mesh.expert=2
