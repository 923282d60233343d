"""Throughput of the prompt pipeline (prompts/s) and of each grader (gradings/s), plus label agreement.

    python benchmarks/data.py [--gsm8k-dir DIR] [--math-samples 1000]

Pipelines: the synthetic task with the arithmetic tokenizer, and GSM8K train (JSONL) with the Qwen3
chat template and a byte-level BPE trained here on the questions. Graders: ``synthetic`` in-process,
``gsm8k`` and ``math`` in a 2-worker pool, on the real model solutions of example_model_solutions.jsonl.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from qarl_jax.cli import plain
from qarl_jax.data import (
    DataConfig,
    SyntheticArithmetic,
    SyntheticConfig,
    build_arithmetic_tokenizer,
    build_pipeline,
)
from qarl_jax.rewards import Grader, grade

REPO = pathlib.Path(__file__).resolve().parents[1]
MODELS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")


def bpe_tokenizer(questions: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=4096, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(questions, trainer)
    return tok


def prompts_per_second(config: DataConfig, tokenizer: Tokenizer, batches: int) -> float:
    it = build_pipeline(config, tokenizer)
    next(it)  # warm-up
    start = time.perf_counter()
    prompts = sum(len(next(it)["id"]) for _ in range(batches))
    return prompts / (time.perf_counter() - start)


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gsm8k-dir", type=pathlib.Path, default=REPO.parent / "shared" / "data" / "gsm8k")
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--math-samples", type=int, default=1000, help="solutions graded by math-verify")
    args = parser.parse_args()

    train = args.gsm8k_dir / "train.jsonl"
    questions = [json.loads(line)["question"] for line in train.open()]
    synthetic = DataConfig(batch_size=64, synthetic=SyntheticConfig(digits=3, steps=3, ops="+-*"))
    gsm8k = DataConfig(source="jsonl", path=str(train), template="qwen3_chat", batch_size=64)
    print("pipeline (prompts/s, batch 64, 1 sample per prompt):")
    rate = prompts_per_second(synthetic, build_arithmetic_tokenizer(), args.batches)
    print(f"  synthetic + arithmetic tokenizer : {rate:9.0f}")
    rate = prompts_per_second(gsm8k, bpe_tokenizer(questions), args.batches)
    print(f"  gsm8k jsonl + qwen3_chat + BPE   : {rate:9.0f}")

    rows = [json.loads(line) for line in (args.gsm8k_dir / "example_model_solutions.jsonl").open()]
    tests = [json.loads(line) for line in (args.gsm8k_dir / "test.jsonl").open()]
    responses = [r[m]["solution"] for r in rows for m in MODELS]
    answers = [t["answer"].split("####")[1].strip() for t in tests for _ in MODELS]
    labels = np.array([r[m]["is_correct"] for r in rows for m in MODELS])
    src = SyntheticArithmetic(SyntheticConfig(digits=3, steps=3, ops="+-*", size=20_000), 0)
    synth = [src[i] for i in range(len(src))]

    print("graders (gradings/s):")
    _, seconds = timed(grade, [r["solution"] for r in synth], [r["answer"] for r in synth], "synthetic")
    print(f"  synthetic (in-process)           : {len(synth) / seconds:9.0f}")
    with Grader(num_workers=2, time_limit_s=5.0) as grader:
        grader.grade(["1"], ["1"], "math")  # start the workers
        scores, seconds = timed(grader.grade, responses, answers, "gsm8k")
        agree = (scores.astype(bool) == labels).mean()
        rate = len(responses) / seconds
        print(
            f"  gsm8k (2 workers)                : {rate:9.0f}   label agreement {agree:.2%} of {len(labels)}"
        )
        n = min(args.math_samples, len(responses))
        scores, seconds = timed(grader.grade, responses[:n], answers[:n], "math")
        agree = (scores.astype(bool) == labels[:n]).mean()
        print(f"  math / math-verify (2 workers)   : {n / seconds:9.0f}   label agreement {agree:.2%} of {n}")
        print(f"  pool events: {dict(grader.stats)}")


if __name__ == "__main__":
    main()
