"""XLA:CPU's per-call allocations with glibc's default malloc thresholds against ``qarl_jax.run.heap``'s.

The training update (the default run's shape: qwen3-tiny, 16 rows x 48 tokens, w4a16 aligned)
runs in child processes started alternately without and with ``GLIBC_TUNABLES`` set as
``python -m qarl_jax.main`` sets it (A B A B ...), so a drifting machine favours neither. Each child
warms up, then times ``--calls`` updates and reports per update: wall ms, user and system CPU ms
(``getrusage``), and minor page faults. Prints the medians over the children and the ratios.

    python benchmarks/heap.py [--pairs 3] [--calls 20] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

from qarl_jax.cli import plain


def child(calls: int) -> dict:
    import jax

    from qarl_jax import quant
    from qarl_jax.models import Qwen3ForCausalLM, init_params, preset
    from qarl_jax.rl.objectives import ObjectiveConfig
    from qarl_jax.rl.train_step import OptimizerConfig, TrainConfig, Trainer

    sys.path.insert(0, os.path.dirname(__file__))
    from train_step import _batch

    config = preset("qwen3-tiny", dtype="float32")
    params = init_params(Qwen3ForCausalLM(config, None), jax.random.key(0))
    model = Qwen3ForCausalLM(config, quant.QuantSpec(fmt="w4a16", mode="aligned"))
    objective = ObjectiveConfig(loss_norm=64.0)
    trainer = Trainer(model, objective, TrainConfig(), OptimizerConfig(learning_rate=1e-5))
    batch = _batch(config.vocab_size, 16, 48, 23)
    state = trainer.init_state(params)
    mb = trainer.shard_batch(batch.replace(old_logp=batch.rollout_logp))
    for _ in range(3):
        state, metrics = trainer.update(state, mb)
        jax.block_until_ready((state.params, metrics))
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(calls):
        state, metrics = trainer.update(state, mb)
        jax.block_until_ready((state.params, metrics))
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    return {
        "wall_ms": 1e3 * wall / calls,
        "user_ms": 1e3 * (after.ru_utime - before.ru_utime) / calls,
        "sys_ms": 1e3 * (after.ru_stime - before.ru_stime) / calls,
        "minor_faults": (after.ru_minflt - before.ru_minflt) / calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=plain(__doc__.split("\n\n")[0]))
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.calls)))
        return
    from qarl_jax.run.heap import TUNABLES, tuned_environ

    default = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    tuned = tuned_environ(default)
    if tuned is None:
        sys.exit("heap.py: glibc's tunables do not apply here (not Linux with glibc)")
    runs: dict[str, list[dict]] = {"glibc default": [], "qarl_jax.run.heap": []}
    cmd = [sys.executable, __file__, "--child", f"--calls={args.calls}"]
    for i in range(args.pairs):
        for name, env in (("glibc default", default), ("qarl_jax.run.heap", tuned)):
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"pair {i + 1}/{args.pairs} {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    keys = ("wall_ms", "user_ms", "sys_ms", "minor_faults")
    medians = {name: {k: float(np.median([r[k] for r in rs])) for k in keys} for name, rs in runs.items()}
    print(f"update (qwen3-tiny w4a16, 16 x 48 tokens), median of {args.pairs} processes x {args.calls} calls")
    print(f"{'':16s}" + "".join(f"{k:>14s}" for k in keys))
    for name, m in medians.items():
        print(f"{name:16s}" + "".join(f"{m[k]:14.1f}" for k in keys))
    a, b = medians["glibc default"], medians["qarl_jax.run.heap"]
    print(f"wall ratio (heap / default): {b['wall_ms'] / a['wall_ms']:.3f}   GLIBC_TUNABLES={TUNABLES}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "medians": medians, "tunables": TUNABLES}, f, indent=2)


if __name__ == "__main__":
    main()
