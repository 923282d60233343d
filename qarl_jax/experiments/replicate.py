"""``python -m qarl_jax.experiments.replicate [--config FILE] [--arms A,B] [--seeds 0,1,2] [--quick]``

The paper's central comparison at a size that runs on two CPU cores: the same starting policy
(``qarl_jax/assets/policy_long``, fine-tuned in full precision, never quantized), the same data and
the same number of RL steps, with several minibatch updates per rollout batch, under six arms:

- ``bf16``: bf16 rollouts, bf16 training, GRPO (the upper reference);
- ``quantized-rollout``: quantized rollouts, full-precision training forward, GRPO;
- ``quantized-rollout+tis``: the same with token-level truncated importance sampling (FlashRL);
- ``quantized-rollout+mis``: the same with token-level masked importance sampling (a token whose
  weight pi_train / pi_rollout exceeds C = 2 is dropped from the loss, not truncated);
- ``qarl-grpo``: the aligned quantized forward (rollout and training log-probs bitwise equal), GRPO;
- ``qarl-tbpo``: the aligned quantized forward, TBPO (the paper's method).

The quantized format is the study's (its config's ``quant`` section: w4a16 unless it says otherwise).

Each (arm, seed) is one ordinary training run (the study's config, default
``configs/replication.yaml``; ``configs/replication_long.yaml`` is the long-response study, plus the
arm's overrides) in ``OUT/runs/<arm>/seed<k>/``; a finished run leaves ``run_summary.json`` there and is
skipped next time, an interrupted one resumes from its checkpoint, so the grid can be completed
across sessions. After every run ``OUT/summary.json`` and ``OUT/summary.md`` are rewritten from all
finished runs (``--summarize`` recomputes them without training). Without ``--out`` the folder is
the committed study, ``results/<config name>``: its table is reprinted, and a run it lacks is
refused in one line (nothing trains into the repository's results unless named by ``--out``).
``--quick``: one seed, a few steps, into ``results/replication-quick`` (a smoke test, git-ignored).
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

from qarl_jax import cli
from qarl_jax.config import load_config
from qarl_jax.experiments.summary import run_summary, write_summary
from qarl_jax.run.train import train

ARMS: dict[str, list[str]] = {
    "bf16": ["quant.fmt=bf16", "quant.group_size=null", "objective.name=grpo"],
    "quantized-rollout": ["quant.mode=naive", "objective.name=grpo"],
    "quantized-rollout+tis": [
        "quant.mode=naive",
        "objective.name=grpo",
        "objective.correction=tis",
        "objective.correction_level=token",
    ],
    "quantized-rollout+mis": [
        "quant.mode=naive",
        "objective.name=grpo",
        "objective.correction=mis",
        "objective.correction_level=token",
        "objective.correction_low=0",
    ],
    "qarl-grpo": ["objective.name=grpo"],
    "qarl-tbpo": ["objective.name=tbpo"],
}
BASE_CONFIG = pathlib.Path(__file__).resolve().parents[2] / "configs" / "replication.yaml"
QUICK = ["run.steps=3", "run.eval_every=0", "run.eval_prompts=16", "run.checkpoint_every=0"]


def run_dir(out: pathlib.Path, arm: str, seed: int) -> pathlib.Path:
    return out / "runs" / arm / f"seed{seed}"


def resummarize(out: pathlib.Path) -> None:
    """Recompute every finished run's ``run_summary.json`` from its metrics (keeping its wall time),
    after the figures in :mod:`qarl_jax.experiments.summary` change."""
    for done in sorted(out.glob("runs/*/seed*/run_summary.json")):
        old = json.loads(done.read_text())
        fresh = run_summary(done.parent, old["arm"], old["seed"]) | {"wall_s": old["wall_s"]}
        done.write_text(json.dumps(fresh, indent=2) + "\n")


def run_one(
    out: pathlib.Path, arm: str, seed: int, extra: list[str], base: pathlib.Path = BASE_CONFIG
) -> dict:
    """Train one (arm, seed) of the study ``base`` unless its summary exists; return its summary."""
    directory = run_dir(out, arm, seed)
    done = directory / "run_summary.json"
    if done.exists():
        return json.loads(done.read_text())
    overrides = [*ARMS[arm], f"seed={seed}", f"run.output_dir={directory}", *extra]
    config = load_config(base, overrides)
    start = time.perf_counter()
    train(config)
    summary = run_summary(directory, arm, seed) | {"wall_s": time.perf_counter() - start}
    done.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    intro = cli.plain(__doc__.split("\n\n")[1]).rstrip(":")
    parser = cli.ArgumentParser(
        prog="python -m qarl_jax.experiments.replicate", description=f"{intro}: {', '.join(ARMS)}."
    )
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {list(ARMS)}")
    parser.add_argument(
        "--seeds", default="0,1,2", help="comma-separated integers (the long study ran 0,1,2,3,4)"
    )
    parser.add_argument("--quick", action="store_true", help="one seed, 3 steps: a smoke test")
    parser.add_argument("--config", default=str(BASE_CONFIG), help="the study's shared settings")
    parser.add_argument(
        "--out",
        help="results folder (default results/<config name>[-quick]); finished runs in it are reused, "
        "not retrained: the default holds the committed studies and is only reprinted (a run it "
        "lacks is refused: name --out to train)",
    )
    parser.add_argument("--summarize", action="store_true", help="only recompute the summaries (no training)")
    parser.add_argument("overrides", nargs="*", help="key=value applied to every arm, e.g. run.steps=50")
    args = parser.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"unknown arm {unknown[0]!r}; available: {list(ARMS)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"argument --seeds: expected comma-separated integers, got {args.seeds!r}")
    if not seeds or min(seeds) < 0:
        parser.error(f"argument --seeds: expected integers >= 0, got {args.seeds!r}")
    if args.quick:
        seeds = seeds[:1]
    base = pathlib.Path(args.config)
    out = pathlib.Path(args.out or f"results/{base.stem}{'-quick' if args.quick else ''}")
    if args.summarize:
        if not any(out.glob("runs/*/seed*/run_summary.json")):
            parser.error(f"--summarize: no finished runs under {out}/runs")
        return cli.run(lambda: _resummarize(out))
    grid = [(arm, seed) for seed in seeds for arm in arms]
    missing = [(a, s) for a, s in grid if not (run_dir(out, a, s) / "run_summary.json").exists()]
    if args.out is None and not args.quick and missing:
        # the default folder is the repository's committed study: it is reprinted, never trained into
        arm, seed = missing[0]
        parser.error(
            f"{out} (the default --out, the committed study) has no {arm} seed {seed} run and is never "
            f"trained into: name where to train with --out DIR, e.g. --out runs/{base.stem}"
        )
    extra = [*(QUICK if args.quick else []), *args.overrides]
    return cli.run(lambda: _grid(out, base, grid, extra))


def _resummarize(out: pathlib.Path) -> int:
    resummarize(out)
    print(write_summary(out, list(ARMS))["verdict"]["text"])
    return 0


def _grid(out: pathlib.Path, base: pathlib.Path, grid: list[tuple[str, int]], extra: list[str]) -> int:
    """Train the grid's missing runs (every run's config checked before any trains: a bad override
    is one line now, not after hours of training), then print the summary table."""
    cli.writable_dir(out, "--out")
    for arm, seed in grid:
        load_config(base, [*ARMS[arm], f"seed={seed}", f"run.output_dir={run_dir(out, arm, seed)}", *extra])
    finished = [(a, s) for a, s in grid if (run_dir(out, a, s) / "run_summary.json").exists()]
    if finished:
        print(
            f"{len(finished)} of {len(grid)} runs already finished under {out} (their summaries are "
            "reused, not retrained; --out elsewhere trains afresh)",
            file=sys.stderr,
            flush=True,
        )
    for i, (arm, seed) in enumerate(grid, 1):
        print(f"[{i}/{len(grid)}] arm={arm} seed={seed} -> {run_dir(out, arm, seed)}", flush=True)
        summary = run_one(out, arm, seed, extra, base)
        print(json.dumps({k: summary[k] for k in ("final_accuracy", "best_accuracy", "reward_gain")}))
        write_summary(out, list(ARMS))
    print((out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
