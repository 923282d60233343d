"""``python -m qarl_jax.experiments.regime [--config FILE] [--out DIR] [--quick] [key=value ...]``:
where quantized rollouts hurt, measured at step 0 before any RL.

Each cell is a starting policy on its task (the response length) under one quantization format,
run as the quantized-rollout arm's first step (``quant.mode=naive``: the rollout decodes the
quantized weights, the training forward scores its samples at full precision) with
``run.eval_bf16``, so one ordinary one-step run measures everything:

- ``mismatch_kl``: k3 KL(rollout || full-precision training forward) over the first rollout batch,
  per token, and ``seq_mismatch_kl``: the same summed over each response, averaged over responses
  (per-token KL times the mean response length, exactly: both are means over the same batch), the
  mismatch a sequence-level ratio (TBPO's, GRPO's sequence weights) sees;
- ``error_seq_frac``, ``repetition_frac``, ``low_prob_token_frac``: the error-token rates
  (:mod:`qarl_jax.rl.metrics`) of those samples, and ``implausible_seq_frac`` /
  ``implausible_token_frac``: responses (tokens) the full-precision training forward gives a token
  below 1e-3, the error tokens quantization made the sampler draw;
- ``accuracy_quantized``, ``accuracy_bf16`` and their ``accuracy_drop``: held-out greedy accuracy of
  the policy as quantized against its bf16 weights (the same weights, the unquantized format).

Every cell lands in ``OUT/sweep.json`` (a finished cell is skipped next time: the sweep resumes;
cells an earlier call measured outside this call's grid stay), with the pick and why.

The pick. *Strong* cells are the quantized cells, other than the short-answer study's own regime
(:data:`REFERENCE`), whose mismatch is at least ``KL_FACTOR`` times that regime's measured the same
way, or whose error or implausible sequences exceed the same policy's in bf16 (the ``bf16`` cell:
sampling at temperature 1 draws some near-impossible tokens from any policy) by ``ERROR_FLOOR`` of
the responses. Of those whose quantized policy still solves at least ``MIN_ACCURACY`` of the
held-out problems (GRPO learns only from groups holding both outcomes), the one where quantization
costs the most accuracy: the study asks whether QaRL wins back what quantized rollouts lose, and
it can win back no more than that.
"""

from __future__ import annotations

import json
import pathlib
import sys

from qarl_jax import cli
from qarl_jax.config import load_config
from qarl_jax.run.runlog import load_run
from qarl_jax.run.train import train

REPO = pathlib.Path(__file__).resolve().parents[2]
SHORT_STUDY_KL = 2.4e-3  # the naive arm's mismatch in results/replication, mean over its 150 steps
# the short study's regime, measured here as every cell is: at step 0 its mismatch is ~20x its mean
# over training (measured: 5.2e-2 at step 1 of results/replication, then ~3e-3), so the floor is
# KL_FACTOR times this cell's when the sweep has it, and KL_FACTOR x SHORT_STUDY_KL only without
REFERENCE = ("steps4", "w4a16-g128")
KL_FACTOR, ERROR_FLOOR, MIN_ACCURACY = 10.0, 0.01, 0.3
# the task and policy of each response length (the 4-step policy answers in ~40 tokens, the
# 24-step chain policy in ~200), over the same base config's run settings. Not swept by default:
# steps12, where the chain policy (fine-tuned on 24-step chains only) runs past the twelfth step
# (measured: greedy accuracy 0.02, responses 164 tokens), so it says nothing of quantization
LENGTHS: dict[str, list[str]] = {
    "steps4": ["model.path=package:assets/policy_long", "data.synthetic.steps=4"],
    "steps12": ["model.path=package:assets/policy_chain", "data.synthetic.steps=12"],
    "steps24": ["model.path=package:assets/policy_chain", "data.synthetic.steps=24"],
}
FORMATS: dict[str, list[str]] = {  # mildest first; bf16: the policy's own error-token rate
    "bf16": ["quant.fmt=bf16"],
    "w8a8": ["quant.fmt=w8a8"],
    "w4a16-g32": ["quant.fmt=w4a16", "quant.group_size=32"],
    "w4a16-g128": ["quant.fmt=w4a16"],
    "w4a8-g128": ["quant.fmt=w4a8"],
}
STEP0 = ["quant.mode=naive", "objective.name=grpo", "run.steps=1", "run.eval_every=0", "run.eval_bf16=true"]
STEP0 += ["run.checkpoint_every=0", "run.tensorboard=false", "run.progress=false"]
QUICK = ["run.eval_prompts=8", "data.batch_size=2", "rollout.max_new_tokens=48"]


def measure(base: pathlib.Path, out: pathlib.Path, length: str, fmt: str, extra: list[str]) -> dict:
    """One cell's figures (run once; read back from its run directory afterwards)."""
    directory = out / "sweep" / f"{length}-{fmt}"
    if not (directory / "metrics.jsonl").exists() or len(load_run(directory).rows) < 2:
        overrides = [*LENGTHS[length], *FORMATS[fmt], *STEP0, f"run.output_dir={directory}"]
        train(load_config(base, [*overrides, "run.overwrite=true", *extra]))
    run = load_run(directory)
    before, first = run.rows[:2]
    return {
        "length": length,
        "format": fmt,
        "eval_prompts": run.config["run"]["eval_prompts"],
        "rollouts": run.config["data"]["batch_size"] * run.config["rollout"]["samples_per_prompt"],
        "response_length": first["response_length"],
        "truncated_frac": first["truncated_frac"],
        "mismatch_kl": first["train/mismatch_kl_k3"],
        "seq_mismatch_kl": first["train/mismatch_kl_k3"] * first["response_length"],
        "error_seq_frac": first["train/error_seq_frac"],
        "repetition_frac": first["train/repetition_frac"],
        "low_prob_token_frac": first["train/low_prob_token_frac"],
        "implausible_seq_frac": first["train/implausible_seq_frac"],
        "implausible_token_frac": first["train/implausible_token_frac"],
        "accuracy_quantized": before["eval/accuracy"],
        "accuracy_bf16": before["eval_bf16/accuracy"],
        "accuracy_drop": before["eval_bf16/accuracy"] - before["eval/accuracy"],
        "step_s": first["time/step_s"],
    }


def excess_errors(cells: list[dict]) -> None:
    """Each quantized cell's error- and implausible-sequence rates above its length's bf16 cell's
    (sampling at temperature 1 draws some tokens under 1e-3 from any policy: only the excess is
    quantization's), as ``error_seq_excess`` and ``implausible_seq_excess``; the rates themselves
    where that length has no bf16 cell."""
    for key in ("error_seq", "implausible_seq"):
        own = {c["length"]: c[f"{key}_frac"] for c in cells if c["format"] == "bf16"}
        for c in cells:
            c[f"{key}_excess"] = c[f"{key}_frac"] - own.get(c["length"], 0.0)


def reference_kl(cells: list[dict]) -> tuple[float, str]:
    """The mismatch the floor multiplies, and what it is (see :data:`REFERENCE`)."""
    ref = next((c for c in cells if (c["length"], c["format"]) == REFERENCE), None)
    if ref is None:
        return SHORT_STUDY_KL, "the short study's mean over training"
    return ref["mismatch_kl"], f"the short study's regime ({' '.join(REFERENCE)}) at step 0"


def pick(cells: list[dict]) -> dict:
    """The regime for the arms, and why (see the module docstring)."""
    base, source = reference_kl(cells)
    floor = KL_FACTOR * base
    excess_errors(cells)
    quantized = [c for c in cells if c["format"] != "bf16"]
    if not quantized:
        return {"found": False, "why": "no quantized cell measured yet"}
    errors = lambda c: max(c["error_seq_excess"], c["implausible_seq_excess"])
    candidates = [c for c in quantized if (c["length"], c["format"]) != REFERENCE]
    strong = [c for c in candidates if c["mismatch_kl"] >= floor or errors(c) >= ERROR_FLOOR]
    learnable = [c for c in strong if c["accuracy_quantized"] >= MIN_ACCURACY]
    if not learnable:
        worst = max(quantized, key=lambda c: c["mismatch_kl"])
        return {
            "found": False,
            "why": f"no quantized cell beyond {' '.join(REFERENCE)} reaches KL >= {floor:.1e} or error "
            f"(implausible) sequences {ERROR_FLOOR:.0%} above the bf16 policy's with quantized "
            f"accuracy >= {MIN_ACCURACY}; the largest mismatch is {worst['length']} "
            f"{worst['format']} (KL {worst['mismatch_kl']:.2e})",
        }
    best = max(learnable, key=lambda c: (c["accuracy_drop"], c["mismatch_kl"]))
    return {
        "found": True,
        "length": best["length"],
        "format": best["format"],
        "why": f"{len(strong)} of {len(candidates)} quantized cells beyond {' '.join(REFERENCE)} reach "
        f"KL >= {floor:.1e} or error (implausible) sequences {ERROR_FLOOR:.0%} above the bf16 "
        f"policy's, {len(learnable)} with quantized accuracy >= {MIN_ACCURACY}; of those "
        f"{best['length']} {best['format']} loses the most accuracy to quantization "
        f"({best['accuracy_quantized']:.3f}, bf16 {best['accuracy_bf16']:.3f}) with KL "
        f"{best['mismatch_kl']:.2e} "
        f"({best['mismatch_kl'] / base:.2g}x {source}) and error sequences "
        f"{best['error_seq_frac']:.1%} ({best['error_seq_excess']:+.1%} over bf16), implausible "
        f"sequences {best['implausible_seq_frac']:.1%} ({best['implausible_seq_excess']:+.1%})",
    }


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(
        prog="python -m qarl_jax.experiments.regime", description=cli.plain(__doc__.split("\n\n")[0])
    )
    parser.add_argument("--config", default=str(REPO / "configs" / "replication_long.yaml"))
    parser.add_argument(
        "--out",
        help="results folder (default results/<config name>[-quick]); measured cells in it are "
        "reused: the default holds the committed sweep, never measured into (name --out)",
    )
    parser.add_argument("--lengths", default="steps4,steps24", help=f"comma-separated, from {list(LENGTHS)}")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, from {list(FORMATS)}")
    parser.add_argument("--quick", action="store_true", help="few prompts, short answers: a smoke test")
    parser.add_argument("overrides", nargs="*", help="key=value for every cell, e.g. run.eval_prompts=256")
    args = parser.parse_args(argv)
    lengths, formats = args.lengths.split(","), args.formats.split(",")
    for option, given, known in (("--lengths", lengths, LENGTHS), ("--formats", formats, FORMATS)):
        if unknown := sorted(set(given) - set(known)):
            parser.error(f"argument {option}: unknown {unknown[0]!r}; available: {list(known)}")
    base = pathlib.Path(args.config)
    out = pathlib.Path(args.out or f"results/{base.stem}{'-quick' if args.quick else ''}")
    grid = [(length, fmt) for length in lengths for fmt in formats]
    unmeasured = [c for c in grid if not (out / "sweep" / "-".join(c) / "metrics.jsonl").exists()]
    if args.out is None and not args.quick and unmeasured:
        # the default folder is the repository's committed sweep: never measured into unless named
        parser.error(
            f"{out} (the default --out, the committed sweep) has no {'-'.join(unmeasured[0])} run and "
            f"is never measured into: name where to measure with --out DIR, e.g. --out runs/{base.stem}"
        )
    extra = [*(QUICK if args.quick else []), *args.overrides]
    return cli.run(lambda: _sweep(base, out, grid, extra))


def _sweep(base: pathlib.Path, out: pathlib.Path, grid: list[tuple[str, str]], extra: list[str]) -> int:
    """Measure the grid's missing cells (every cell's config checked first), rewriting
    ``sweep.json`` after each; print the pick."""
    cli.writable_dir(out, "--out")
    for length, fmt in grid:
        load_config(base, [*LENGTHS[length], *FORMATS[fmt], *STEP0, *extra])
    record_file = out / "sweep.json"
    # the cells an earlier call measured outside this grid stay in the record
    earlier = json.loads(record_file.read_text())["cells"] if record_file.exists() else []
    cells = [c for c in earlier if (c["length"], c["format"]) not in grid]
    order = lambda c: (int(c["length"].removeprefix("steps")), list(FORMATS).index(c["format"]))
    record: dict = {}
    for i, (length, fmt) in enumerate(grid, 1):
        print(f"[{i}/{len(grid)}] {length} {fmt}", flush=True)
        cells = sorted([*cells, measure(base, out, length, fmt, extra)], key=order)
        record = {"cells": cells, "pick": pick(cells), "kl_floor": KL_FACTOR * reference_kl(cells)[0]}
        record_file.write_text(json.dumps(record, indent=2) + "\n")
        print(json.dumps(next(c for c in cells if (c["length"], c["format"]) == (length, fmt))), flush=True)
    print(record["pick"]["why"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
