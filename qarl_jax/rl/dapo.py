"""DAPO's data side: dynamic sampling and the soft overlong punishment (its overlong filtering is a
loss option, ``objective.overlong_filter``).

- **Dynamic sampling**: a group whose rewards are all equal has all-zero advantages and carries no
  gradient, yet it dilutes the batch. Such groups are dropped and the batch refilled with the
  informative groups of more prompts, one more round of ``rollout.samples_per_prompt`` samples
  per prompt of a fresh prompt batch at a time, for at most ``rollout.max_resample_rounds``
  rounds. The batch keeps its shape: if the bound is hit first, the missing groups are empty rows
  (no token in the loss, no weight anywhere), never a zero-variance group.
- **Soft overlong punishment**: a response longer than ``max_new_tokens - buffer`` tokens loses
  ``penalty x (excess / buffer)`` of reward, up to ``penalty`` at the length limit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from qarl_jax.rl.advantages import informative_groups
from qarl_jax.rl.batch import RolloutBatch, training_batch
from qarl_jax.rollout.groups import Groups


def overlong_penalty(lengths: np.ndarray, max_new_tokens: int, buffer: int, penalty: float) -> np.ndarray:
    """DAPO's length penalty (<= 0) of responses of ``lengths`` tokens: 0 up to
    ``max_new_tokens - buffer``, then linear to ``-penalty`` at ``max_new_tokens``; 0 when
    ``buffer`` is 0 (off)."""
    lengths = np.asarray(lengths, np.float32)
    if buffer == 0:
        return np.zeros_like(lengths)
    if not 0 < buffer <= max_new_tokens:
        raise ValueError(f"the overlong buffer ({buffer}) must be in [0, max_new_tokens={max_new_tokens}]")
    excess = np.clip(lengths - (max_new_tokens - buffer), 0.0, None)
    return -penalty * np.minimum(excess, buffer) / buffer


def dynamic_sampling(
    first: Groups, draw: Callable[[int], Groups], target: int, max_rounds: int
) -> tuple[Groups, dict[str, float]]:
    """The first ``target`` informative groups of ``first``, then of ``draw(1)``, ``draw(2)``, ...
    (at most ``max_rounds`` more rounds, none once ``target`` are kept), and the statistics:
    ``dropped_groups`` (zero-variance groups dropped), ``resample_rounds`` (rounds drawn beyond
    the first) and ``missing_groups`` (``target`` minus the groups kept: the bound was hit)."""
    if max_rounds < 0 or target < 1:
        raise ValueError(f"max_rounds must be >= 0 and target >= 1, got {max_rounds}, {target}")
    kept, dropped, rounds, group = [], 0, 0, first
    while True:
        informative = np.asarray(informative_groups(group.rewards))
        dropped += int(np.sum(~informative))
        kept.append(group.select(informative))
        if sum(map(len, kept)) >= target or rounds == max_rounds:
            break
        rounds += 1
        group = draw(rounds)
    out = Groups.concat(kept)
    out = out.select(np.arange(min(len(out), target)))
    stats = {"dropped_groups": dropped, "resample_rounds": rounds, "missing_groups": target - len(out)}
    return out, {k: float(v) for k, v in stats.items()}


def longest_inputs(groups: Groups, filler: Sequence[int]) -> int:
    """The inputs of the longest row :func:`groups_batch` makes (prompt + response - 1; the
    padding rows hold the ``filler`` prompt)."""
    pairs = zip(groups.prompts, groups.samples, strict=True)
    rows = (len(p) + len(s.tokens) for p, group in pairs for s in group)
    return max(max(rows, default=0), len(filler)) - 1


def groups_batch(
    groups: Groups, advantages: np.ndarray, rows: int, length: int, filler: Sequence[int]
) -> RolloutBatch:
    """The training batch of ``groups`` (advantages [P, G], the samples' sampling log-probs and
    truncation flags), padded to ``rows`` rows with empty rows on the prompt ``filler`` (a real
    prompt, so the padding rows' forward is an ordinary one)."""
    flat = [s for group in groups.samples for s in group]
    prompts = [p for p, group in zip(groups.prompts, groups.samples, strict=True) for _ in group]
    pad = rows - len(flat)
    if pad < 0:
        raise ValueError(f"{len(flat)} samples do not fit in {rows} rows")
    return training_batch(
        prompts + [list(filler)] * pad,
        [s.tokens for s in flat] + [[]] * pad,
        # the log-probs of the distribution sampled from: the policy at the rollout's temperature
        [s.sampling_logprobs for s in flat] + [[]] * pad,
        np.asarray(advantages, np.float32).reshape(-1).tolist() + [0.0] * pad,
        length,
        truncated=[s.finish_reason == "length" for s in flat] + [False] * pad,
    )
