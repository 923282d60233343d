#!/usr/bin/env bash
# Issue #10's GPU evidence in one call: correctness first, speed after, a summary table last.
#
#   bash benchmarks/device_check.sh [--cpu | --gpu] [--stages kernels,alignment,...]
#        [--cells MODEL:FMT,...] [--naive-budget-s S]
#
# Stages, in this order (on a GPU kernels and alignment side by side), each under a time limit (and
# a global deadline: about 7.5 minutes on the H200), each writing its JSON to $OUT as soon as it has a part:
#   kernels      a_kernels.json     kernel accuracy + row invariance (bf16/w8a8/w4a16/w4a8, dense and
#                                   grouped MoE), AQT quantizer == formats, AQT TRAIN == SERVE
#   alignment    b_alignment.json   check_alignment, tiny dense + MoE presets: every aligned cell,
#                                   then naive ones (reported, no target) while a budget lasts
#                                   (--naive-budget-s; --cells picks the model:format cells)
#   kernel_speed c_kernels.json     benchmarks/kernel_speed.py at decode shapes (M = 1, 16)
#   rollout      c_rollout.json     benchmarks/rollout.py sweep: bf16/w8a8/w4a16 at batch 16/64/256
#   hf           c_hf.json          the same sweep with Hugging Face generate (PyTorch), if present
#   train_step   c_train_step.json  benchmarks/train_step.py: aligned w4a16 step vs bf16 step
#   layouts      d_layouts.json     2+ devices (CPU: 8 fake ones): tensor-2 rollout == FSDP training
#                                   bitwise; decode step, replicated layout vs the training layout
# then log.txt (everything printed) and summary.txt (one line per target: measured, target, met).
# With no GPU backend (or --cpu) every stage runs at CPU sizes with CPU budgets: a proof run.
# OUT defaults to a new temporary folder. PYTHON (default python3) runs the stages; the repo root
# is put on PYTHONPATH. Exit status: the summary's (1 when a correctness target is not met).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
ALL_STAGES=kernels,alignment,kernel_speed,rollout,hf,train_step,layouts
mode=auto
stages=$ALL_STAGES
cells=
naive_budget=

usage() { sed -n '2,21p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while (($#)); do
    case $1 in
        --cpu) mode=cpu ;;
        --gpu) mode=gpu ;;
        --stages) stages=${2:?--stages needs a list}; shift ;;
        --cells) cells=${2:?--cells needs MODEL:FMT,...}; shift ;;
        --naive-budget-s) naive_budget=${2:?--naive-budget-s needs seconds}; shift ;;
        -h | --help) usage; exit 0 ;;
        *) echo "device_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
for s in ${stages//,/ }; do
    [[ ,$ALL_STAGES, == *,$s,* ]] || { echo "device_check.sh: unknown stage $s; stages: $ALL_STAGES" >&2; exit 2; }
done

OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/device_check.XXXXXX")}
mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/device_check_work.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$ROOT"

# stage(name, limit_s, command...): run under min(limit, time left to the deadline); record
# "name<TAB>rc<TAB>seconds<TAB>limit" for the summary. rc 124: killed at its limit.
stage() {
    local name=$1 limit=$2 left rc=0 t0=$SECONDS
    shift 2
    [[ ,$stages, == *,$name,* ]] || return 0
    left=$((DEADLINE - SECONDS))
    ((limit <= left)) || limit=$left
    if ((limit < 10)); then
        echo "== $name: skipped (global deadline)"
        printf '%s\tskipped\t0\t0\n' "$name" >>"$WORK/stages.tsv"
        return 0
    fi
    echo "== $name (limit ${limit} s, at ${SECONDS} s): $*"
    timeout -k 5 "$limit" "$@" || rc=$?
    echo "== $name: rc=$rc after $((SECONDS - t0)) s"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" >>"$WORK/stages.tsv"
}

main() {
    echo "== device check: OUT=$OUT, $(date -u +%FT%TZ), $("$PY" --version 2>&1)"
    if [[ $mode == cpu ]]; then
        export JAX_PLATFORMS=cpu
    fi
    local backend
    backend=$("$PY" -c 'import jax; print(jax.default_backend(), jax.__version__, jax.devices()[0].device_kind)')
    echo "== jax: $backend"
    backend=${backend%% *}
    if [[ $mode == gpu && $backend != gpu ]]; then
        echo "device_check.sh: --gpu asked, but JAX's backend is $backend" >&2
        return 2
    fi
    if [[ $mode == auto ]]; then
        mode=$([[ $backend == gpu ]] && echo gpu || echo cpu)
    fi
    local rollout_mode b_budget k_budget r_budget h_budget
    local -a small=() kshapes=() cell_args=() train=() limits=()
    if [[ $mode == gpu ]]; then
        # 2026-12-04 on the H200: stage a took ~110 s, the 9 aligned cells ~20-50 s each (compiles),
        # the rollout's Qwen3-1.7B init 110 s: a and b run side by side (16 host cores compile)
        DEADLINE=450
        limits=(170 280 30 130 40 90 60) # per stage, in the order they run
        b_budget=0 k_budget=15 r_budget=90 h_budget=15
        export XLA_PYTHON_CLIENT_PREALLOCATE=false # two processes share the GPU's memory
        kshapes=(--shapes 4096x4096,8192x8192)
        rollout_mode=--gpu-shape
        [[ -z $cells ]] || cell_args=(--cells "$cells") # default: all six cells
        # Qwen3-1.7B's layer shapes, 4 layers, a 32k vocabulary (the lm_head stays a minor share)
        train=(--preset qwen3-1.7b --layers 4 --set vocab_size=32768
            --batch 8 --length 512 --prompt 128 --dtype bfloat16 --repeats 3)
    else
        DEADLINE=540
        limits=(120 170 60 90 60 90 180)
        b_budget=90 k_budget=20 r_budget=40 h_budget=20
        small=(--small)
        kshapes=(--shapes 256x256)
        rollout_mode=--small-sweep
        cell_args=(--cells "${cells:-qwen3-tiny:w4a16,qwen3-moe-tiny:w4a16}")
        train=(--preset qwen3-tiny --layers 2 --batch 4 --length 64 --prompt 16 --repeats 2)
    fi
    DEADLINE=$((SECONDS + DEADLINE))
    b_budget=${naive_budget:-$b_budget}
    stage kernels "${limits[0]}" "$PY" benchmarks/device_check.py kernels \
        --out "$OUT/a_kernels.json" "${small[@]}" &
    [[ $mode == gpu ]] || wait # CPU: one stage at a time (2 cores)
    stage alignment "${limits[1]}" "$PY" benchmarks/device_check.py alignment \
        --out "$OUT/b_alignment.json" "${small[@]}" --budget-s "$b_budget" "${cell_args[@]}"
    wait # the speed stages time alone
    stage kernel_speed "${limits[2]}" "$PY" benchmarks/kernel_speed.py "${small[@]}" "${kshapes[@]}" --ms 1,16 \
        --formats bf16,w8a8,w4a16,w4a8 --budget-s "$k_budget" --json "$OUT/c_kernels.json"
    stage rollout "${limits[3]}" "$PY" benchmarks/rollout.py "$rollout_mode" --batches 16,64,256 \
        --formats bf16,w4a16,w8a8 --budget-s "$r_budget" --json "$OUT/c_rollout.json"
    stage hf "${limits[4]}" "$PY" benchmarks/rollout.py "$rollout_mode" --hf --batches 16,64,256 \
        --budget-s "$h_budget" --json "$OUT/c_hf.json"
    stage train_step "${limits[5]}" "$PY" benchmarks/train_step.py "${train[@]}" \
        --json "$OUT/c_train_step.json"
    local -a fake=()
    [[ $mode == gpu ]] || fake=(env "XLA_FLAGS=${XLA_FLAGS:-} --xla_force_host_platform_device_count=8")
    stage layouts "${limits[6]}" "${fake[@]}" "$PY" benchmarks/device_check.py layouts \
        --out "$OUT/d_layouts.json" "${small[@]}"
    echo "== done at ${SECONDS} s"
    "$PY" benchmarks/device_check.py summary --dir "$OUT" --mode "$mode" --stages "$WORK/stages.tsv"
}

main 2>&1 | tee "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
