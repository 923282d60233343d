#!/bin/bash
# The CPU engine's speed, replicated layout: BEFORE (a worktree of 8dec0ef, the tree before issue 37's
# work) against this tree, one process per tree and round, interleaved; each process times 15 rollouts
# a format (benchmarks/rollout.py's CPU shape and engine runner: batch 32, prompt 32, 64 new tokens,
# greedy) and prints the medians [tokens/s wall, CPU ms a rollout]. Then: python ratios.py OUT.
# usage: bash pairs.sh BEFORE_TREE > OUT   (git worktree add BEFORE_TREE 8dec0ef)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); after=$(cd "$here/../../.." && pwd); before=$1
export JAX_PLATFORMS=cpu
for i in 1 2 3 4 5; do
  for t in "$after" "$before"; do
    name=after; [ "$t" = "$before" ] && name=before
    echo "$name $i $(cd "$t" && PYTHONPATH=$t python "$here/engine_cpu.py" "$t" bf16,w8a8,w4a16 15 2>/dev/null | tail -1)"
  done
done
