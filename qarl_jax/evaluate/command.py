"""``python -m qarl_jax.evaluate --checkpoint PATH --bench FILE[:PRESET] [--bench ...] --out DIR
[--weights deployed|bf16|both] [--k N] [--temperature T] [--top-p P] [--max-tokens N]
[--pass-k K,...] [--table METRIC] [--seed N] [--strict] [key=value ...] [multi-host flags]``

Evaluates a policy the way the paper's table does: a checkpoint (a training run's directory, one
of its steps ``RUN/checkpoints/N``, or a Hugging Face directory) x benchmark files (JSONL; the
presets name their layouts: ``math500``, ``aime``, ``amc``, ``minerva``, ``olympiadbench`` /
``math``, ``gsm8k``, ``arc``, ``mmlu_pro`` / ``choice``, ``gpqa``; ``FILE:PRESET:question=KEY``
renames a field). Per benchmark: pass@1 (the mean over k samples), pass@k (unbiased), maj@k, mean
response length and truncation rate, for the deployed quantized weights (the run's format), the
bf16 master weights, or both.

Writes ``DIR/eval.md`` (the markdown table, also printed: one row per weights variant, one column
per benchmark, the average last) and ``DIR/eval.json`` (every figure, the config, and every
sample with its grade). Greedy by default (``--temperature 0``, one sample); the paper's sampled
figures take ``--temperature 0.6 --top-p 0.95 --k 16`` or the like. ``key=value`` overrides change
the config (``data.template=qwen3_chat``, ``rollout.slots=256``, ``rollout.mesh.tensor=2``). On N
hosts, the same command on each with the multi-host flags: every host samples 1/N of the items.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from qarl_jax import cli

WEIGHTS = ("deployed", "bf16", "both")


def _ks(text: str) -> list[int]:
    """An argparse ``type``: ``1,4,16`` -> [1, 4, 16]."""
    return [cli.at_least(1)(part) for part in text.split(",")]


def _parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(
        prog="python -m qarl_jax.evaluate", description=cli.plain(__doc__.split("\n\n")[1])
    )
    parser.add_argument(
        "--checkpoint", required=True, help="a run directory, RUN/checkpoints/N, or a HF directory"
    )
    parser.add_argument(
        "--bench",
        action="append",
        required=True,
        metavar="FILE[:PRESET[:FIELD=KEY,...]]",
        help="a benchmark JSONL file (repeat for more); preset default: math",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="where eval.md and eval.json go")
    parser.add_argument(
        "--weights", choices=WEIGHTS, default="deployed", help="which weights (default: deployed)"
    )
    parser.add_argument("--k", type=cli.at_least(1), default=1, help="samples per item (default 1)")
    parser.add_argument(
        "--temperature", type=cli.at_least(0.0, float), default=0.0, help="0: greedy (the default)"
    )
    parser.add_argument("--top-p", type=cli.at_least(0.0, float, strict=True), default=1.0)
    parser.add_argument(
        "--max-tokens",
        type=cli.at_least(1),
        help="response tokens (default: the config's rollout.max_new_tokens)",
    )
    parser.add_argument("--pass-k", type=_ks, metavar="K,...", help="the pass@k figures (default: k)")
    parser.add_argument(
        "--table", default="pass@1", metavar="METRIC", help="the table's figure (default pass@1)"
    )
    parser.add_argument("--seed", type=cli.at_least(0), default=0, help="the samples' seed (default 0)")
    parser.add_argument(
        "--strict", action="store_true", help="a malformed row is an error, not a counted skip"
    )
    parser.add_argument(
        "overrides", nargs="*", help="key=value config overrides, e.g. data.template=qwen3_chat"
    )
    cli.add_multihost(parser)
    return parser


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """What the arguments alone decide, before any file is read."""
    if args.top_p > 1:
        parser.error(f"argument --top-p: must be in (0, 1], got {args.top_p}")
    if args.temperature == 0 and args.k > 1:
        parser.error(
            f"--k {args.k} with --temperature 0: greedy samples are all the same; give a temperature"
        )
    args.pass_k = args.pass_k or [args.k]
    if max(args.pass_k) > args.k:
        parser.error(
            f"argument --pass-k: pass@{max(args.pass_k)} needs at least that many samples (--k {args.k})"
        )
    known = ["pass@1", *(f"pass@{k}" for k in args.pass_k), f"maj@{args.k}", "mean_length", "truncation_rate"]
    if args.table not in known:
        parser.error(f"argument --table: {args.table!r} is not a computed figure; one of {', '.join(known)}")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_intermixed_args(argv)
    _check(args, parser)
    return cli.run(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    from qarl_jax.evaluate.benchmarks import read_benchmarks

    out = cli.writable_dir(args.out, "--out")
    benches = read_benchmarks(args.bench, args.strict)  # bad files: one line, before JAX starts
    for bench in benches:
        if line := bench.skipped_line():
            print(f"qarl: {line}", file=sys.stderr, flush=True)
    print("qarl: importing JAX and loading the checkpoint", file=sys.stderr, flush=True)
    from qarl_jax.run import distributed

    distributed.maybe_initialize(args.coordinator, args.num_processes, args.process_id, args.distributed)
    report = _evaluate(args, benches)
    if distributed.is_primary():
        text = report.pop("table")
        (out / "eval.md").write_text(text)
        (out / "eval.json").write_text(json.dumps(report, indent=1))
        print(text, end="")
        print(f"qarl: wrote {out / 'eval.md'} and {out / 'eval.json'}", file=sys.stderr)
    return 0


def _evaluate(args: argparse.Namespace, benches) -> dict:
    """The report: figures per weights variant and benchmark, the table, and every sample."""
    from qarl_jax.config import to_dict
    from qarl_jax.evaluate import metrics
    from qarl_jax.evaluate.run import Sampling, encode, engine_config, evaluate_variant, load_policy, variants
    from qarl_jax.rewards import Grader
    from qarl_jax.run import distributed
    from qarl_jax.run.build import build_tokenizer
    from qarl_jax.run.progress import grader_warning

    policy = load_policy(args.checkpoint, args.overrides)
    tokenizer = build_tokenizer(policy.config)
    max_tokens = args.max_tokens or policy.config.rollout.max_new_tokens
    sampling = Sampling(args.k, args.temperature, args.top_p, max_tokens, args.seed)
    prompts = encode(policy.config, tokenizer, benches)
    results: dict[str, dict] = {}
    samples: dict[str, dict] = {}
    grading: dict[str, dict] = {}
    r = policy.config.rewards
    with Grader(r.num_workers, r.time_limit_s) as grader:
        for label, spec in variants(policy.config, args.weights).items():
            records = evaluate_variant(policy, spec, benches, prompts, sampling, tokenizer, grader, label)
            # every process's grading (each graded its own share of the items), summed
            counts = distributed.gather_json(grader.counts_since_last_call())
            grading[label] = {k: sum(c[k] for c in counts) for k in counts[0]}
            warning = grader_warning({f"grader/{k}": v for k, v in grading[label].items()})
            if warning and distributed.is_primary():
                print(f"qarl: {label}: {warning}", file=sys.stderr)
            samples[label] = records
            results[label] = {name: _figures(recs, args.pass_k) for name, recs in records.items()}
    return {
        "table": metrics.table(results, args.table),
        "checkpoint": policy.source,
        "sampling": dataclasses.asdict(sampling),
        "table_metric": args.table,
        "results": results,
        "benchmarks": {
            b.name: {
                "file": str(b.path),
                "preset": b.preset,
                "grader": b.kind,
                "items": len(b.items),
                "skipped": b.skipped,
                "skipped_rows": [f"{x.origin}: {x.reason}: {x.detail}" for x in b.rejected],
            }
            for b in benches
        },
        "grader": grading,
        "config": to_dict(engine_config(policy.config, prompts, max_tokens)),
        "samples": samples,
    }


def _figures(records: list[dict], pass_ks: list[int]) -> dict:
    """One benchmark's figures from its graded records (:func:`qarl_jax.evaluate.metrics.figures`)."""
    import numpy as np

    from qarl_jax.evaluate import metrics

    groups = [r["samples"] for r in records]
    column = lambda key: np.asarray([[s[key] for s in group] for group in groups])
    keys = [[s["answer"] for s in group] for group in groups]
    return metrics.figures(column("grade"), keys, column("tokens"), column("finish") == "length", pass_ks)
