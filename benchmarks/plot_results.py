"""Draw the README figure from recorded device results (run as a script, never imported).

    python benchmarks/plot_results.py [--out benchmarks/results/h200_summary.png]

Left: share of sampled tokens whose rollout log-prob equals the training forward's bit for bit,
aligned (QaRL) vs naive, per format and model, on the H200. Right: decode-shaped matmul time
relative to XLA's bf16 dot (K = N = 4096), per format and rows M, after the tuning sweep.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
ALIGNMENT = RESULTS / "2026-11-30-h200-alignment" / "gpu_alignment.json"
SPEED = RESULTS / "2026-11-30-h200-tuned" / "speed.json"
FORMATS = ("bf16", "w8a8", "w4a16", "w4a8")


def plot_alignment(ax) -> None:
    cells = json.loads(ALIGNMENT.read_text())
    labels = [f"{c['format']}\n{c['model'].replace('qwen3-', '')}" for c in cells]
    x = np.arange(len(cells))
    ax.bar(x - 0.2, [c["aligned_frac_bitwise_equal"] for c in cells], 0.4, label="aligned (QaRL)")
    naive = [c["naive_frac_bitwise_equal"] for c in cells]
    ax.bar(x + 0.2, naive, 0.4, label="naive (full-precision training)")
    for xi, frac, c in zip(x, naive, cells, strict=True):  # how far apart the naive log-probs are
        ax.text(xi + 0.2, frac + 0.02, f"max|d|\n{c['naive_max_abs_logp_diff']:.1g}", ha="center", fontsize=7)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("tokens with bitwise-equal log-prob")
    ax.set_title(f"H200: rollout vs training log-probs ({cells[0]['n_tokens']} tokens per cell)")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_ylim(0, 1.25)


def plot_speed(ax) -> None:
    speed = json.loads(SPEED.read_text())
    rows = [m for m in (1, 16, 64) if f"K=4096,N=4096,M={m}" in speed]
    x = np.arange(len(FORMATS))
    width = 0.8 / len(rows)
    for i, m in enumerate(rows):
        cell = speed[f"K=4096,N=4096,M={m}"]
        ratios = [cell[f]["speedup_vs_xla_bf16"] for f in FORMATS]
        ax.bar(x + (i - (len(rows) - 1) / 2) * width, ratios, width, label=f"M={m}")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(x, FORMATS)
    ax.set_ylabel("speed-up vs XLA bf16 dot (higher is faster)")
    ax.set_title("H200: invariant Pallas-Triton matmuls, K=N=4096")
    ax.legend(fontsize=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "h200_summary.png"))
    args = parser.parse_args()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2))
    plot_alignment(left)
    plot_speed(right)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
