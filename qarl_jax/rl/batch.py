"""Rollout samples -> the padded training batch the train step consumes (one sequence per row)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def training_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    rollout_logprobs: Sequence[Sequence[float]],
    advantages: Sequence[float],
    length: int,
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """Row i is prompt_i + response_i, shifted for next-token prediction and right-padded to
    ``length`` inputs: tokens/targets/positions/segment_ids/mask/rollout_logp [N, length] and
    advantages [N]. ``mask`` is 1 where the target is a response token; ``rollout_logp`` sits at
    those positions, so it lines up with the training forward's log-probs token for token."""
    n = len(prompts)
    if not n == len(responses) == len(rollout_logprobs) == len(advantages):
        raise ValueError("prompts, responses, rollout_logprobs and advantages must have the same length")
    out = {
        "tokens": np.full((n, length), pad_id, np.int32),
        "targets": np.full((n, length), pad_id, np.int32),
        "positions": np.zeros((n, length), np.int32),
        "segment_ids": np.zeros((n, length), np.int32),
        "mask": np.zeros((n, length), np.float32),
        "rollout_logp": np.zeros((n, length), np.float32),
        "advantages": np.asarray(advantages, np.float32),
    }
    for i, (prompt, response, logp) in enumerate(zip(prompts, responses, rollout_logprobs, strict=True)):
        if len(response) != len(logp):
            raise ValueError(f"sample {i}: {len(response)} response tokens but {len(logp)} log-probs")
        seq = list(prompt) + list(response)
        if len(seq) - 1 > length:
            raise ValueError(f"sample {i}: {len(seq) - 1} input tokens exceed the batch length {length}")
        t = len(seq) - 1
        out["tokens"][i, :t] = seq[:-1]
        out["targets"][i, :t] = seq[1:]
        out["positions"][i, :t] = np.arange(t)
        out["segment_ids"][i, :t] = 1
        start = len(prompt) - 1
        out["mask"][i, start:t] = 1.0
        out["rollout_logp"][i, start:t] = logp
    return out
