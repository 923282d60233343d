"""Per-run and per-arm figures of the replication experiments, from the runs' ``metrics.jsonl``.

Per run: held-out greedy accuracy of the policy as deployed (final, best, and the mean over the
evals after step 0, which shows how fast it learned; the bf16 accuracy of the same weights beside
it), reward gain (mean of the last 20% of steps minus the first 20%), rollout-vs-training mismatch
(k3 KL, mean over steps), policy entropy, error- and implausible-sequence rates
(:mod:`qarl_jax.rl.metrics`; the second from runs that logged it), collapse (the deployed accuracy
ending more than 50% below its peak), stability (``reward_drawdown``: the largest fall of the
10-step rolling mean reward below its running peak; ``grad_spikes``: updates whose gradient norm
exceeds ``SPIKE_FACTOR`` times the run's median) and seconds per step. Per arm: mean, standard
deviation and a 95% Student-t interval of the mean over the finished seeds. Paired: each arm minus
``quantized-rollout`` on the seeds both finished (the same data and rollout keys), mean difference
with its 95% interval. The verdict compares the arms the paper compares.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from qarl_jax.run import runlog
from qarl_jax.run.runlog import RunLog, load_run

# Average pass@1 on math benchmarks as secondary accounts of the paper report them
PAPER = {
    "Qwen3-8B-Base (GRPO)": {"bf16": 51.8, "quantized-rollout": 43.9, "qarl-tbpo": 48.9},
    "Qwen3-30B-A3B-Base (GSPO)": {"bf16": 52.1, "quantized-rollout": 45.7, "qarl-tbpo": 51.2},
    "Qwen2.5-Math-7B": {"bf16": 43.3, "quantized-rollout": 40.9, "qarl-tbpo": 43.5},
    "Qwen2.5-Math-1.5B": {"bf16": 34.5, "quantized-rollout": 29.3, "qarl-tbpo": 33.9},
}
FIGURES = (
    "final_accuracy",
    "best_accuracy",
    "mean_accuracy",
    "final_accuracy_bf16",
    "reward_gain",
    "mismatch_kl",
    "entropy",
    "error_seq_frac",
    "implausible_seq_frac",
    "collapsed",
    "reward_drawdown",
    "grad_spikes",
    "step_s",
)
COLLAPSE_FRACTION = 0.5
SPIKE_FACTOR = 5.0
BASELINE = "quantized-rollout"  # the arm the paired comparisons subtract
PAIRED = ("final_accuracy", "mean_accuracy")


def interval95(values: list[float]) -> float | None:
    """Half-width of the 95% Student-t interval of the mean of ``values`` (None below 2 values)."""
    from scipy import stats

    n = len(values)
    if n < 2:
        return None
    return float(stats.t.ppf(0.975, n - 1) * np.std(values, ddof=1) / np.sqrt(n))


def _drawdown(values: np.ndarray, window: int = 10) -> float:
    """The largest fall of the rolling mean below its running peak."""
    if not len(values):
        return 0.0
    smooth = runlog.rolling_mean(values, window)
    return float(np.max(np.maximum.accumulate(smooth) - smooth))


def _mean(run: RunLog, key: str) -> float | None:
    values = run.series(key)[1]
    return float(np.nanmean(values)) if len(values) else None


def run_summary(directory: pathlib.Path, arm: str, seed: int) -> dict:
    """The figures of one finished run."""
    run = load_run(directory)
    base = runlog.summary(run)
    eval_steps, accuracy = run.series("eval/accuracy")
    bf16 = base["eval_bf16_final"]
    peak = float(accuracy.max())
    grads = run.series("train/grad_norm")[1]
    return {
        "arm": arm,
        "seed": seed,
        "steps": base["steps"],
        "initial_accuracy": float(accuracy[0]),
        "final_accuracy": float(accuracy[-1]),
        "best_accuracy": peak,
        "mean_accuracy": float(accuracy[1:].mean()) if len(accuracy) > 1 else float(accuracy[0]),
        "final_accuracy_bf16": None if np.isnan(bf16) else bf16,
        "eval_curve": [[int(s), float(a)] for s, a in zip(eval_steps, accuracy, strict=True)],
        "reward_first": base["reward_first"],
        "reward_last": base["reward_last"],
        "reward_gain": base["reward_last"] - base["reward_first"],
        "mismatch_kl": _mean(run, "train/mismatch_kl_k3"),
        "entropy": _mean(run, "train/policy_entropy"),
        "error_seq_frac": _mean(run, "train/error_seq_frac"),
        "implausible_seq_frac": _mean(run, "train/implausible_seq_frac"),
        "collapsed": bool(peak > 0 and accuracy[-1] < (1 - COLLAPSE_FRACTION) * peak),
        "reward_drawdown": _drawdown(run.series("reward_mean")[1]),
        "grad_spikes": int(np.sum(grads > SPIKE_FACTOR * np.median(grads))) if len(grads) else 0,
        "step_s": _mean(run, "time/step_s"),
    }


def arm_table(runs: list[dict], arms: list[str]) -> dict[str, dict]:
    """Mean and standard deviation over seeds of every figure, per arm with finished runs."""
    table = {}
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        if not mine:
            continue
        row: dict = {"seeds": sorted(r["seed"] for r in mine)}
        for key in FIGURES:
            values = [float(r[key]) for r in mine if r.get(key) is not None]
            if values:
                row[key] = {"mean": float(np.mean(values)), "std": float(np.std(values))}
                row[key]["ci95"] = interval95(values)
        table[arm] = row
    return table


def paired(runs: list[dict], arms: list[str]) -> dict[str, dict]:
    """Each arm minus :data:`BASELINE` on their common seeds: per figure of :data:`PAIRED`, the mean
    difference, its 95% interval, the seeds and how many of them the arm won."""
    base = {r["seed"]: r for r in runs if r["arm"] == BASELINE}
    out = {}
    for arm in arms:
        mine = {r["seed"]: r for r in runs if r["arm"] == arm}
        seeds = sorted(set(mine) & set(base))
        if arm == BASELINE or not seeds:
            continue
        row: dict = {"seeds": seeds}
        for key in PAIRED:
            diffs = [float(mine[s][key]) - float(base[s][key]) for s in seeds]
            row[key] = {
                "mean": float(np.mean(diffs)),
                "ci95": interval95(diffs),
                "wins": int(sum(d > 0 for d in diffs)),
            }
        out[arm] = row
    return out


def verdict(table: dict[str, dict], pairs: dict[str, dict] | None = None) -> dict:
    """The paper's ordering, bf16 ~ qarl-tbpo > quantized-rollout, tested on final deployed accuracy;
    with ``pairs`` (:func:`paired`) also whether qarl-tbpo's paired gain's 95% interval excludes 0."""
    acc = {arm: row["final_accuracy"]["mean"] for arm, row in table.items() if "final_accuracy" in row}
    needed = ("bf16", "quantized-rollout", "qarl-tbpo")
    if not all(a in acc for a in needed):
        return {"complete": False, "text": f"not enough arms finished for the comparison (need {needed})"}
    gain = acc["qarl-tbpo"] - acc["quantized-rollout"]
    gap = acc["bf16"] - acc["qarl-tbpo"]
    recovered = (
        gain / (acc["bf16"] - acc["quantized-rollout"]) if acc["bf16"] != acc["quantized-rollout"] else None
    )
    reproduced = gain > 0 and acc["bf16"] > acc["quantized-rollout"] and gap < gain
    spread = max(table[a]["final_accuracy"]["std"] for a in needed)
    resolved = min(abs(gain), abs(gap)) > spread
    text = (
        f"final deployed accuracy: bf16 {acc['bf16']:.3f}, quantized-rollout {acc['quantized-rollout']:.3f}, "
        f"qarl-tbpo {acc['qarl-tbpo']:.3f} (qarl-tbpo {gain:+.3f} over quantized-rollout, "
        f"{gap:+.3f} below bf16). "
        + (
            "The paper's ordering was reproduced."
            if reproduced
            else "The paper's ordering was NOT reproduced."
        )
        + f" The seed spread (std) of these arms' final accuracy is up to {spread:.3f}: the differences "
        + ("exceed it." if resolved else "are within it, so these seeds do not resolve them.")
    )
    tbpo = (pairs or {}).get("qarl-tbpo", {}).get("final_accuracy")
    significant = None
    if tbpo is not None and tbpo["ci95"] is not None:
        low, high = tbpo["mean"] - tbpo["ci95"], tbpo["mean"] + tbpo["ci95"]
        significant = low > 0 or high < 0
        n = len(pairs["qarl-tbpo"]["seeds"])  # type: ignore[index]
        text += (
            f" Paired over {n} seeds, qarl-tbpo minus quantized-rollout is {tbpo['mean']:+.3f} "
            f"(95% interval {low:+.3f} to {high:+.3f}, qarl-tbpo ahead on {tbpo['wins']} of {n}): "
            + ("the interval excludes 0." if significant else "the interval includes 0.")
        )
    return {
        "complete": True,
        "reproduced": reproduced,
        "paired_significant": significant,
        "qarl_tbpo_minus_quantized_rollout": gain,
        "bf16_minus_qarl_tbpo": gap,
        "fraction_of_gap_recovered": recovered,
        "seed_spread": spread,
        "resolved_by_seeds": resolved,
        "text": text,
    }


def _cell(row: dict, key: str, fmt: str) -> str:
    if key not in row:
        return "-"
    m, s = row[key]["mean"], row[key]["std"]
    return f"{m:{fmt}} ± {s:{fmt.lstrip('+')}}" if len(row["seeds"]) > 1 else f"{m:{fmt}}"


def markdown(table: dict[str, dict], result: dict, pairs: dict[str, dict] | None = None) -> str:
    head = (
        "| arm | seeds | final acc. (deployed) | best acc. | mean acc. over evals | final acc. bf16 weights "
        "| reward gain | mismatch KL (k3) | entropy | error seqs | implausible seqs | collapsed runs "
        "| reward drawdown | grad spikes | s/step |"
    )
    lines = [head, "| " + " | ".join(["---"] * 15) + " |"]
    for arm, row in table.items():
        collapsed = f"{row['collapsed']['mean'] * len(row['seeds']):.0f}/{len(row['seeds'])}"
        cells = [
            arm,
            ",".join(map(str, row["seeds"])),
            _cell(row, "final_accuracy", ".3f"),
            _cell(row, "best_accuracy", ".3f"),
            _cell(row, "mean_accuracy", ".3f"),
            _cell(row, "final_accuracy_bf16", ".3f"),
            _cell(row, "reward_gain", "+.3f"),
            _cell(row, "mismatch_kl", ".2e"),
            _cell(row, "entropy", ".3f"),
            _cell(row, "error_seq_frac", ".3f"),
            _cell(row, "implausible_seq_frac", ".3f"),
            collapsed,
            _cell(row, "reward_drawdown", ".3f"),
            _cell(row, "grad_spikes", ".1f"),
            _cell(row, "step_s", ".2f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if pairs:
        title = f"Paired against `{BASELINE}` (same seeds), mean difference [95% interval], seeds won:"
        lines += ["", title, ""]
        lines += ["| arm | seeds | final acc. | mean acc. over evals |", "| --- | --- | --- | --- |"]
        for arm, row in pairs.items():
            cells = [arm, ",".join(map(str, row["seeds"]))]
            for key in PAIRED:
                d, ci = row[key]["mean"], row[key]["ci95"]
                band = "" if ci is None else f" [{d - ci:+.3f}, {d + ci:+.3f}]"
                cells.append(f"{d:+.3f}{band}, {row[key]['wins']}/{len(row['seeds'])}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + result["text"] + "\n"


def write_summary(out: pathlib.Path, arms: list[str]) -> dict:
    """Rewrite ``summary.json`` and ``summary.md`` from every finished run under ``out/runs``."""
    runs = [json.loads(p.read_text()) for p in sorted(out.glob("runs/*/seed*/run_summary.json"))]
    table = arm_table(runs, arms)
    pairs = paired(runs, arms)
    result = verdict(table, pairs)
    summary = {"arms": table, "paired": pairs, "verdict": result, "runs": runs, "paper": PAPER}
    if (out / "sweep.json").exists():  # the regime sweep's records (qarl_jax.experiments.regime)
        summary["sweep"] = json.loads((out / "sweep.json").read_text())
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(markdown(table, result, pairs))
    plot(out, [a for a in arms if a in table], runs)
    return summary


def arm_curves(out: pathlib.Path, arm: str, runs: list[dict], key: str, smooth: int = 1):
    """Steps [S] and per-seed values [seeds, S] of ``key`` for one arm's finished ``runs`` (cut to the
    shortest run; rolling mean over ``smooth`` steps); ``(None, None)`` when no run logged ``key``."""
    series = []
    for r in runs:
        if r["arm"] == arm:
            steps, values = load_run(out / "runs" / arm / f"seed{r['seed']}").series(key)
            if len(steps):
                series.append((steps, runlog.rolling_mean(values, smooth) if smooth > 1 else values))
    if not series:
        return None, None
    n = min(len(s) for s, _ in series)
    return series[0][0][:n], np.stack([v[:n] for _, v in series])


def plot(out: pathlib.Path, arms: list[str], runs: list[dict]) -> None:
    """``summary.png``: deployed held-out accuracy, reward, mismatch and implausible sequences (the
    runs that logged them) per arm (mean, seed range)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("eval/accuracy", "held-out accuracy, policy as deployed", 1),
        ("reward_mean", "rollout reward (rolling mean, 10 steps)", 10),
        ("train/mismatch_kl_k3", "rollout vs training mismatch, KL k3", 1),
        ("train/implausible_seq_frac", "implausible sequences (rolling mean, 5 steps)", 5),
    ]
    curves = {key: {arm: arm_curves(out, arm, runs, key, n) for arm in arms} for key, _, n in panels}
    panels = [p for p in panels if any(v is not None for _, v in curves[p[0]].values())]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    axes = axes[0]
    for ax, (key, title, _) in zip(axes, panels, strict=True):
        for arm, (steps, values) in curves[key].items():
            if values is None:  # logged by none of this arm's runs
                continue
            line = ax.plot(steps, values.mean(0), label=f"{arm} ({len(values)} seeds)")[0]
            if len(values) > 1:
                ax.fill_between(steps, values.min(0), values.max(0), color=line.get_color(), alpha=0.15)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        if key == "train/mismatch_kl_k3":
            ax.set_yscale("symlog", linthresh=1e-6)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "summary.png", dpi=90)
    plt.close(fig)
