"""Training-step time: the aligned w4a16 forward+backward+update against the bf16 step, same model and batch.

One :class:`qarl_jax.rl.train_step.Trainer` update per format (forward with the format's kernels,
straight-through backward, AdamW on f32 master weights), timed back to back in one process on the
same initial weights and the same batch (random prompt + response tokens, TBPO, one micro-batch):

  w4a16   QaRL aligned: int4 weights quantized on the fly, the rollout engine's kernels
  bf16    the unquantized format through the same batch-invariant kernels (the bf16 QaRL run)
  xla     (``--xla``) naive mode: plain XLA matmuls on the master weights (a stock trainer's step)

Prints a table (median ms per update, tokens/s) and the w4a16/bf16 ratio (the paper reports the
QaRL step ~1.3x faster than bf16 end to end; on a GPU the target here is a step <= 1.3x the bf16
one). Imports only jax, numpy, flax, optax, qarl_jax and aqtp (through the quantizer), so it runs
unchanged on the GPU machine.

    python benchmarks/train_step.py [--preset qwen3-small] [--batch 16] [--length 256]
        [--dtype bfloat16] [--repeats 5] [--xla] [--json OUT] [--set hidden_size=2048 ...]

``--set KEY=VALUE`` overrides any field of the preset's TransformerConfig (a larger model from a small
preset); ``--json`` is rewritten after every format, so a run killed at a time limit keeps those.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import numpy as np

from qarl_jax import quant
from qarl_jax.models import Qwen3ForCausalLM, init_params, preset
from qarl_jax.rl.batch import RolloutBatch
from qarl_jax.rl.objectives import ObjectiveConfig
from qarl_jax.rl.train_step import OptimizerConfig, TrainConfig, Trainer


def _batch(vocab: int, n: int, length: int, prompt: int, seed: int = 0) -> RolloutBatch:
    """Full rows: ``prompt`` prompt targets, then response targets (masked in) to the end."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (n, length + 1), dtype=np.int32)
    mask = np.zeros((n, length), np.float32)
    mask[:, prompt - 1 :] = 1.0
    return RolloutBatch(
        tokens=tokens[:, :-1],
        targets=tokens[:, 1:],
        positions=np.broadcast_to(np.arange(length, dtype=np.int32), (n, length)).copy(),
        segment_ids=np.ones((n, length), np.int32),
        mask=mask,
        rollout_logp=np.zeros((n, length), np.float32),  # replaced by the old log-probs (aligned)
        advantages=rng.standard_normal(n).astype(np.float32),
    )


def _time_updates(model, params, batch, repeats: int) -> tuple[float, float]:
    """(compile + first update s, median update ms) of one Trainer update on ``batch``."""
    trainer = Trainer(model, ObjectiveConfig(), TrainConfig(), OptimizerConfig(learning_rate=1e-5))
    state = trainer.init_state(params)
    old = trainer.old_logprobs(state.params, trainer.shard_batch(batch))
    mb = trainer.shard_batch(batch.replace(rollout_logp=np.asarray(old), old_logp=np.asarray(old)))
    t = time.perf_counter()
    state, m = trainer.update(state, mb)
    jax.block_until_ready(m)
    first = time.perf_counter() - t
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        state, m = trainer.update(state, mb)  # the state is donated: feed the new one back
        jax.block_until_ready((state.params, m))
        times.append(time.perf_counter() - t)
    if float(m["skipped"]):
        raise RuntimeError("the timed update was skipped (non-finite loss or gradient)")
    return first, 1e3 * float(np.median(times))


def _override(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` with VALUE read as JSON (numbers, true/false), else kept as a string."""
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _write(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-tiny")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--dtype", default="float32", help="compute dtype (bfloat16 on a GPU)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--xla", action="store_true", help="also time the naive (plain XLA) step")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--set", type=_override, action="append", default=[], help="KEY=VALUE config override")
    args = ap.parse_args(argv)

    overrides = {"dtype": args.dtype, **dict(args.set)}
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
    config = preset(args.preset, **overrides)
    params = init_params(Qwen3ForCausalLM(config, None), jax.random.key(0))
    batch = _batch(config.vocab_size, args.batch, args.length, args.prompt)
    specs = {"w4a16": quant.QuantSpec(fmt="w4a16"), "bf16": quant.QuantSpec(fmt="bf16")}
    if args.xla:
        specs["xla"] = quant.QuantSpec(fmt="bf16", mode="naive")
    rows = {}
    result = {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "preset": args.preset,
        "overrides": dict(args.set),
        "layers": config.num_hidden_layers,
        "batch": args.batch,
        "length": args.length,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "steps": rows,
    }
    for name, spec in specs.items():
        first, ms = _time_updates(Qwen3ForCausalLM(config, spec), params, batch, args.repeats)
        rows[name] = {
            "compile_s": first,
            "update_ms": ms,
            "tokens_per_s": args.batch * args.length / ms * 1e3,
        }
        _write(result, args.json)
    result["w4a16_over_bf16"] = rows["w4a16"]["update_ms"] / rows["bf16"]["update_ms"]
    print(
        f"jax {result['jax']} on {result['backend']} ({result['device']}), {args.preset}, "
        f"{config.num_hidden_layers} layers, batch {args.batch} x {args.length}, {args.dtype}, "
        f"median of {args.repeats}"
    )
    print(f"| {'step':<6} | {'update ms':>10} | {'tokens/s':>10} | {'compile+1st s':>13} |")
    print(f"| {'-' * 6} | {'-' * 10} | {'-' * 10} | {'-' * 13} |")
    for name, r in rows.items():
        print(
            f"| {name:<6} | {r['update_ms']:>10.1f} | {r['tokens_per_s']:>10.0f} | {r['compile_s']:>13.1f} |"
        )
    print(f"w4a16 / bf16 step time: {result['w4a16_over_bf16']:.2f}x")
    _write(result, args.json)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
