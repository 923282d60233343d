"""The figures of an evaluation, from per-sample grades: pass@1, pass@k, maj@k, lengths, truncation,
and the paper-style markdown table.

With n samples of an item of which c are correct (grade 1):

* pass@1 is the mean over the n samples of the grade (c / n), averaged over items: "avg@n", what
  papers report as pass@1 when they sample (greedy: n = 1, the accuracy);
* pass@k is the unbiased estimator of Chen et al. 2021, ``1 - C(n - c, k) / C(n, k)``: the chance
  that k of the n samples, drawn without replacement, hold a correct one (k = n: whether any is);
* maj@n grades the most frequent final answer among the n samples (majority voting). A vote's key
  and the sample's grade come from one extraction (:func:`qarl_jax.rewards.final_answer`), and the
  key is the answer's canonical form (:meth:`qarl_jax.rewards.FinalAnswer.key`): a number as a
  rational (``\\frac12``, ``\\dfrac{1}{2}``, ``1/2`` and ``0.5`` are the vote ``1/2``; units,
  ``$``, thousands commas and a percent sign dropped), anything else normalised as Qwen2.5-Math's
  ``strip_string`` does where that changes no value (``\\dfrac{\\sqrt3}{2}`` and
  ``\\frac{\\sqrt{3}}{2}`` are one vote), the chosen letter for multiple choice. lighteval's
  maj@k likewise votes on normalised predictions. Ties: the tied answer given first (lowest
  sample index) wins, so the figure is the same on every run; samples without a final answer
  never win. The winner's grade is that of its first sample.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence

import numpy as np

from qarl_jax.rewards import extract_choice, final_answer


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of an item with ``c`` correct among ``n`` samples (``k <= n``)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def answer_key(kind: str, response: str) -> str | None:
    """The final answer a vote counts (see the module docstring), or None when there is none."""
    if kind == "choice":
        return extract_choice(response)
    final = final_answer(response)
    if final is None:
        return None
    if kind == "math":
        return final.key()
    number = final.number()  # the number graders read nothing else
    return None if number is None else str(number.value)


def majority(keys: Sequence[str | None], grades: Sequence[float]) -> float:
    """The grade of the most frequent answer among ``keys`` (ties: the one given first); 0 when no
    sample has an answer."""
    votes = collections.Counter(k for k in keys if k is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    winner = next(k for k in keys if k is not None and votes[k] == top)  # the first of the tied
    return float(grades[list(keys).index(winner)])


def figures(
    grades: np.ndarray,
    keys: Sequence[Sequence[str | None]],
    lengths: np.ndarray,
    truncated: np.ndarray,
    pass_ks: Sequence[int],
) -> dict[str, float | int]:
    """One benchmark's figures from [items, n] grades, answer keys, response lengths (tokens) and
    truncation flags (ended at the token limit, not on a stop token)."""
    items, n = grades.shape
    correct = (grades >= 1.0).sum(axis=1)
    out: dict[str, float | int] = {"items": items, "samples": n, "pass@1": float(np.mean(grades))}
    for k in pass_ks:
        out[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct]))
    out[f"maj@{n}"] = float(np.mean([majority(k, g) for k, g in zip(keys, grades, strict=True)]))
    out["mean_length"] = float(np.mean(lengths))
    out["truncation_rate"] = float(np.mean(truncated))
    return out


def table(rows: dict[str, dict[str, dict]], metric: str) -> str:
    """The markdown table: one row per weights variant, one column per benchmark (``metric`` in
    percent, one decimal), then their unweighted average, as the paper's table has it."""
    names = list(next(iter(rows.values())))
    lines = [
        f"| {metric} | " + " | ".join(names) + " | avg |",
        "|---|" + "---:|" * (len(names) + 1),
    ]
    for variant, benches in rows.items():
        values = [100.0 * benches[b][metric] for b in names]
        cells = [f"{v:.1f}" for v in values] + [f"{float(np.mean(values)):.1f}"]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
