"""Long-context memory and compile time, from XLA's compiled programs (nothing is allocated).

Sections (``--sections``, default memory,compile,rollout):

  memory   compiled temp memory of the differentiated forward, ``jax.grad`` of the sum of
           ``qarl_jax.rl.logprobs.policy_logprobs(model, params, tokens, positions, segment_ids,
           targets, temperature, remat=True)`` (B = 1, aligned ``--fmt``), at each ``--lengths``
           for the Qwen3-1.7B shape with 2 layers and the Qwen3-30B-A3B shape with 1 layer, with the
           growth per 4x of T. Targets: <= 5x per 4x of T; <= 8 GB at 16k (1.7B shape); <= 12 GB at
           32k (30B-A3B shape).
  compile  compile time of the full 36-layer Qwen3-8B train step (the trainer's update program:
           forward, straight-through backward, AdamW; one sequence of ``--compile-length``),
           scanned layers vs per-layer. Target: scanned >= 3x faster to compile.
  rollout  the engine on long prompts: the prefill program's temp memory for one prompt of
           ``--prefill-length`` tokens (1.7B shape, 2 layers) in chunks of 2,048 vs whole, and the
           decode step's wall time per token against each slot's filled length (a real engine,
           ``qwen3-tiny`` with a ``--decode-cache`` token cache) to check it grows with the filled
           length, not the cache length.
  rl_step  one CPU RL step of ``qwen3-tiny`` with ``--response-tokens`` responses (EOS ignored):
           rollout, old log-probs, update; wall time, peak RSS (run it at 2k and at 4k to compare)
           and the old-vs-rollout bitwise-equal fraction.

    python benchmarks/long_context.py [--sections memory,compile,rollout] [--lengths 2048,...]
        [--shapes qwen3-1.7b:2,qwen3-30b-a3b:1] [--fmt w4a16] [--per-layer] [--json OUT] [--tiny]

``--tiny`` runs every section at toy shapes (the test suite's smoke run). ``--per-layer`` runs the
memory section on the per-layer (unscanned) model. ``--json`` is rewritten after every figure, so
an interrupted run keeps what it measured. Imports only jax, numpy, flax, optax and qarl_jax.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from qarl_jax.models import Qwen3ForCausalLM, init_params, preset
from qarl_jax.quant import QuantSpec, quantize_params
from qarl_jax.rl.objectives import ObjectiveConfig
from qarl_jax.rl.train_step import OptimizerConfig, TrainConfig
from qarl_jax.rollout import EngineConfig, RolloutEngine
from qarl_jax.tools import compiled_memory

GB = 1e9


def forward_grad_temp(name: str, layers: int, length: int, fmt: str, scan: bool) -> dict:
    """Compiled temp bytes and compile seconds of grad(sum(policy_logprobs)) at [1, length]."""
    model = Qwen3ForCausalLM(preset(name, num_hidden_layers=layers, scan_layers=scan), QuantSpec(fmt))
    c = compiled_memory.differentiated_forward(model, length)
    return dict(shape=f"{name}:{layers}", length=length, temp_gb=c.temp / GB, compile_s=c.compile_s)


def train_step_compile(name: str, layers: int, length: int, fmt: str, scan: bool) -> dict:
    config = preset(name, num_hidden_layers=layers, scan_layers=scan)
    model = Qwen3ForCausalLM(config, QuantSpec(fmt))
    programs = compiled_memory.train_step_programs(
        model, ObjectiveConfig(), TrainConfig(remat=True), OptimizerConfig(), 1, length, mesh=None
    )
    update = next(p for p in programs if p.name == "update")
    return dict(scan=scan, layers=layers, length=length, compile_s=update.compile_s, temp_gb=update.temp / GB)


def prefill_temp(name: str, layers: int, length: int, fmt: str, chunk: int) -> dict:
    model = Qwen3ForCausalLM(preset(name, num_hidden_layers=layers, scan_layers=True), QuantSpec(fmt))
    engine = EngineConfig(slots=1, max_len=length + 1, max_prefill_batch=1, prefill_chunk=chunk)
    programs, kv = compiled_memory.engine_programs(model, model.quant, engine, length, mesh=None)
    prefill = next(p for p in programs if p.name == "prefill")
    return dict(length=length, chunk=chunk, temp_gb=prefill.temp / GB, kv_cache_gb=kv / GB)


def decode_step_ms(cache_len: int, fills: list[int], slots: int = 8, repeats: int = 5) -> list[dict]:
    """Median wall ms of one engine generate step with every slot filled to each of ``fills``."""
    model = Qwen3ForCausalLM(preset("qwen3-tiny", max_position_embeddings=cache_len), QuantSpec("w4a16"))
    frozen = quantize_params(init_params(model, jax.random.key(0)), model.quant)
    engine = RolloutEngine(model, frozen, EngineConfig(slots=slots, max_len=cache_len))
    out = []
    for fill in fills:
        times = []
        for _ in range(repeats + 1):
            state = engine.init_decode_state()
            budget = jnp.full((slots,), cache_len, jnp.int32)
            state = dataclasses.replace(
                state,
                positions=jnp.full((slots,), fill, jnp.int32),
                done=jnp.zeros((slots,), bool),
                settings=dataclasses.replace(state.settings, max_new=budget),
            )
            jax.block_until_ready(state)
            start = time.perf_counter()
            state, step = engine.generate(frozen, state)
            jax.block_until_ready(step.tokens)
            times.append(time.perf_counter() - start)
        out.append(dict(cache_len=cache_len, filled=fill, step_ms=1e3 * float(np.median(times[1:]))))
    return out


def rl_step(response_tokens: int, prompts: int = 2, samples: int = 2) -> dict:
    """One CPU RL step of ``qwen3-tiny`` (w4a16, aligned) on ``prompts`` x ``samples`` responses of
    exactly ``response_tokens`` tokens (EOS ignored): rollout, old log-probs, one update. Returns
    wall seconds, the process's peak RSS and the old-vs-rollout bitwise-equal fraction."""
    import resource

    from qarl_jax.rl.batch import training_batch
    from qarl_jax.rl.train_step import Trainer
    from qarl_jax.rollout import SamplingParams, rollout

    start = time.perf_counter()
    model = Qwen3ForCausalLM(preset("qwen3-tiny"), QuantSpec("w4a16"))
    params = init_params(model, jax.random.key(0))
    frozen = quantize_params(params, model.quant)
    rng = np.random.default_rng(0)
    prompt_ids = [rng.integers(0, model.config.vocab_size, 16).tolist() for _ in range(prompts)]
    length = 16 + response_tokens
    engine = RolloutEngine(model, frozen, EngineConfig(slots=prompts * samples, max_len=length))
    groups = rollout(
        engine, prompt_ids, samples, response_tokens, SamplingParams(1.0), ignore_eos=True, progress=False
    )
    flat = [s for group in groups for s in group]
    assert all(len(s.tokens) == response_tokens for s in flat)
    batch = training_batch(
        [prompt_ids[s.prompt_index] for s in flat],
        [s.tokens for s in flat],
        [s.sampling_logprobs for s in flat],
        rng.standard_normal(len(flat)).tolist(),
        length,
    )
    # recompute: the old-log-prob forward runs too (its program is the long batch's other peak)
    train = TrainConfig(remat=True, old_logprobs="recompute")
    trainer = Trainer(model, ObjectiveConfig(), train, OptimizerConfig())
    _, history = trainer.train_on_rollouts(trainer.init_state(params), batch)
    return dict(
        response_tokens=response_tokens,
        sequences=len(flat),
        wall_s=time.perf_counter() - start,
        peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB,
        frac_bitwise_equal=float(history[0]["mismatch_frac_bitwise_equal"]),
        loss=float(history[0]["loss"]),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default="memory,compile,rollout")
    parser.add_argument("--lengths", default="2048,4096,8192,16384,32768")
    parser.add_argument("--shapes", default="qwen3-1.7b:2,qwen3-30b-a3b:1")
    parser.add_argument("--fmt", default="w4a16")
    parser.add_argument("--per-layer", action="store_true", help="memory section without scanned layers")
    parser.add_argument("--compile-length", type=int, default=1024)
    parser.add_argument("--prefill-length", type=int, default=16384)
    parser.add_argument("--decode-cache", type=int, default=8192)
    parser.add_argument("--response-tokens", type=int, default=4096, help="rl_step section's responses")
    parser.add_argument("--json", help="write the results here (rewritten after every figure)")
    parser.add_argument("--tiny", action="store_true", help="toy shapes: a smoke run")
    args = parser.parse_args(argv)
    sections = args.sections.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    shapes = [(s.split(":")[0], int(s.split(":")[1])) for s in args.shapes.split(",")]
    compile_model, compile_len, prefill_shape = ("qwen3-8b", 36), args.compile_length, ("qwen3-1.7b", 2)
    decode_fills = [256, args.decode_cache // 4, args.decode_cache - 1]
    if args.tiny:
        lengths, shapes = [64, 256], [("qwen3-tiny", 1)]
        compile_model, compile_len, prefill_shape = ("qwen3-tiny", 2), 64, ("qwen3-tiny", 1)
        args.prefill_length, args.decode_cache = 256, 256
        decode_fills = [16, 255]
    results: dict = {"memory": [], "compile": [], "rollout": {"prefill": [], "decode": []}, "rl_step": None}

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    if "memory" in sections:
        print(
            f"differentiated forward, B=1, {args.fmt}, remat, {'per-layer' if args.per_layer else 'scanned'}"
        )
        print(f"{'shape':<20}{'T':>8}{'temp GB':>10}{'x per 4x T':>12}{'compile s':>11}", flush=True)
        for name, layers in shapes:
            for t in lengths:
                r = forward_grad_temp(name, layers, t, args.fmt, not args.per_layer)
                prev = [x for x in results["memory"] if x["shape"] == r["shape"] and x["length"] * 4 == t]
                r["growth_per_4x"] = r["temp_gb"] / prev[0]["temp_gb"] if prev else None
                results["memory"].append(r)
                growth = f"{r['growth_per_4x']:.2f}" if prev else "-"
                print(
                    f"{r['shape']:<20}{t:>8}{r['temp_gb']:>10.2f}{growth:>12}{r['compile_s']:>11.1f}",
                    flush=True,
                )
                save()
    if "compile" in sections:
        name, layers = compile_model
        print(f"train step compile, {name} {layers} layers, 1 x {compile_len} tokens, {args.fmt}")
        for scan in (True, False):
            r = train_step_compile(name, layers, compile_len, args.fmt, scan)
            results["compile"].append(r)
            print(f"  {'scanned' if scan else 'per-layer':<10} compile {r['compile_s']:.1f} s", flush=True)
            save()
    if "rollout" in sections:
        name, layers = prefill_shape
        for chunk in (2048 if not args.tiny else 64, args.prefill_length):
            r = prefill_temp(name, layers, args.prefill_length, args.fmt, chunk)
            results["rollout"]["prefill"].append(r)
            print(
                f"prefill {name}:{layers} T={r['length']} chunk {chunk}: temp {r['temp_gb']:.2f} GB "
                f"(KV cache {r['kv_cache_gb']:.2f} GB)",
                flush=True,
            )
            save()
        for r in decode_step_ms(args.decode_cache, decode_fills):
            results["rollout"]["decode"].append(r)
            print(
                f"decode step, cache {r['cache_len']}, filled {r['filled']}: {r['step_ms']:.2f} ms",
                flush=True,
            )
            save()
    if "rl_step" in sections:
        r = rl_step(args.response_tokens if not args.tiny else 64)
        results["rl_step"] = r
        print(
            f"RL step, qwen3-tiny, {r['sequences']} x {r['response_tokens']} response tokens: "
            f"{r['wall_s']:.0f} s, peak RSS {r['peak_rss_gb']:.2f} GB, "
            f"old == rollout bitwise {r['frac_bitwise_equal']:.4f}",
            flush=True,
        )
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
