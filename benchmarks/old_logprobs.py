"""A step's training phase with pi_old scored again (``train.old_logprobs=recompute``) against pi_old
taken from the rollout (``auto``: aligned, the training forward would return the same bits).

The default run's rollout batch (the shipped policy's shapes: qwen3-tiny widths, 4 layers; 64
sequences x 48 tokens, w4a16 aligned, TBPO, 4 minibatch updates) goes through
``Trainer.train_on_rollouts`` for each mode, alternately (A B A B ...), in one process, from the same
initial weights each time, so a drifting machine favours neither. The batch's ``rollout_logp`` are
the training forward's own log-probs (bitwise the engine's when aligned: ``tests/test_alignment_*``).
Prints the median seconds per rollout batch of each mode, their ratio, and whether the two modes'
updated weights are bitwise equal.

    python benchmarks/old_logprobs.py [--repeats 7] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

from qarl_jax import quant
from qarl_jax.models import Qwen3ForCausalLM, init_params, preset
from qarl_jax.rl.objectives import ObjectiveConfig
from qarl_jax.rl.train_step import OptimizerConfig, TrainConfig, Trainer

sys.path.insert(0, os.path.dirname(__file__))
from train_step import _batch  # noqa: E402

from qarl_jax.cli import plain

MODES = ("recompute", "auto")


def main() -> None:
    parser = argparse.ArgumentParser(description=plain(__doc__.split("\n\n")[0]))
    parser.add_argument("--repeats", type=int, default=7, help="rollout batches per mode (after a warm-up)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    config = preset("qwen3-tiny", dtype="float32")  # the shipped policy's widths and depth
    model = Qwen3ForCausalLM(config, quant.QuantSpec(fmt="w4a16", mode="aligned"))
    params = init_params(model, jax.random.key(0))
    objective = ObjectiveConfig(loss_norm=64.0)
    optimizer = OptimizerConfig(learning_rate=3e-5)
    trainers = {
        m: Trainer(model, objective, TrainConfig(num_minibatches=4, old_logprobs=m), optimizer) for m in MODES
    }
    batch = _batch(config.vocab_size, 64, 48, 16)
    scorer = trainers["recompute"]
    batch = batch.replace(rollout_logp=np.asarray(scorer.old_logprobs(params, scorer.shard_batch(batch))))

    def step(mode: str) -> tuple[float, dict]:
        trainer = trainers[mode]
        state = trainer.init_state(params)
        start = time.perf_counter()
        state, history = trainer.train_on_rollouts(state, batch, np.random.default_rng(0))
        jax.block_until_ready((state.params, history))
        return time.perf_counter() - start, jax.device_get(state.params)

    final = {m: step(m)[1] for m in MODES}  # warm-up: compiles every program
    equal = all(jax.tree.leaves(jax.tree.map(np.array_equal, final["recompute"], final["auto"])))
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(args.repeats):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            times[mode].append(step(mode)[0])
    median = {m: float(np.median(t)) for m, t in times.items()}
    ratio = median["auto"] / median["recompute"]
    pairs = [a / r for a, r in zip(times["auto"], times["recompute"], strict=True)]
    print(f"train phase per rollout batch (64 x 48 tokens, 4 updates), median of {args.repeats}:")
    for mode in MODES:
        print(f"  old_logprobs={mode:<9} {1e3 * median[mode]:7.1f} ms")
    print(f"  auto / recompute {ratio:.2f}x (pairs {', '.join(f'{p:.2f}' for p in pairs)})")
    print(f"  updated weights bitwise equal: {equal}")
    if args.json:
        out = {"median_s": median, "times_s": times, "ratio": ratio, "weights_bitwise_equal": equal}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
