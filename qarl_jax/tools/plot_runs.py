"""``python -m qarl_jax.tools.plot_runs RUN_DIR [RUN_DIR ...] --out FILE.png [--smooth N]``

One figure of training runs, overlaid: the rollout reward per step (faint) under its rolling mean,
and the held-out accuracy of the policy as deployed at each eval. For a quick look without a
notebook (``notebooks/explore_run.ipynb`` has every metric); the README's default-run figure is
made with it.
"""

from __future__ import annotations

import pathlib
import sys

from qarl_jax import cli
from qarl_jax.run.runlog import load_runs, rolling_mean

# what matplotlib's savefig writes from an Agg canvas, by file name ending
FORMATS = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def plot(run_dirs: list[str], out: pathlib.Path, smooth: int = 20) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = load_runs(run_dirs)
    fig, (reward_ax, eval_ax) = plt.subplots(1, 2, figsize=(11, 3.8))
    for run in runs:
        steps, reward = run.series("reward_mean")
        line = reward_ax.plot(steps, rolling_mean(reward, smooth), label=run.name)[0]
        reward_ax.plot(steps, reward, color=line.get_color(), alpha=0.15, linewidth=0.8)
        eval_steps, accuracy = run.series("eval/accuracy")
        eval_ax.plot(eval_steps, accuracy, "o-", color=line.get_color(), label=run.name)
    reward_ax.set(title=f"rollout reward (rolling mean, {smooth} steps)", xlabel="RL step")
    eval_ax.set(title="held-out greedy accuracy, policy as deployed", xlabel="RL step", ylim=(0, 1))
    reward_ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(
        prog="python -m qarl_jax.tools.plot_runs", description=cli.plain(__doc__.split("\n\n")[1])
    )
    parser.add_argument("run_dirs", nargs="+", help="run directories (each with a metrics.jsonl)")
    parser.add_argument(
        "--out", required=True, type=pathlib.Path, help=f"the figure to write ({', '.join(FORMATS)})"
    )
    parser.add_argument(
        "--smooth", type=cli.at_least(1), default=20, help="rolling-mean window in steps, >= 1"
    )
    args = parser.parse_args(argv)

    def run() -> int:
        out = cli.writable_file(args.out, "--out", FORMATS)  # before reading and plotting
        plot(args.run_dirs, out, args.smooth)
        print(f"wrote {out}")
        return 0

    return cli.run(run)


if __name__ == "__main__":
    sys.exit(main())
