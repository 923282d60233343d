"""The typed training batch: rollout samples -> one padded sequence per row, as a dataclass pytree.

:class:`RolloutBatch` is what passes from the loop to the Trainer and from the Trainer to the loss:
a pytree (``jax.tree.map`` over it maps every array, ``None`` fields are empty subtrees), so it
shards, splits into micro-batches and crosses ``jit`` as one value, and a missing field is an
attribute error at the line that reads it, not a ``KeyError`` deep in a traced function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

# host arrays from :func:`training_batch`, device arrays once the Trainer has placed the batch
BatchArray: TypeAlias = jax.Array | np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """N sequences of length T, one per row (``[N, T]`` unless noted).

    The forward's inputs: ``tokens``, ``positions``, ``segment_ids`` (1 on real tokens, 0 on
    padding) and ``targets`` (the next tokens). The loss's: ``mask`` (1 where the target is a
    response token, contiguous per row; an all-zero row is empty and counts nowhere), the rollout
    engine's log-probs ``rollout_logp`` at those positions and one ``advantages`` value per row
    ``[N]``. Optional: ``truncated`` ``[N]`` (1 where the rollout stopped at the length limit),
    and what the Trainer fills in before its updates: ``old_logp`` (the training forward before
    the first update, 0 outside the mask) and ``ref_logp`` (the frozen reference, KL only)."""

    tokens: BatchArray
    positions: BatchArray
    segment_ids: BatchArray
    targets: BatchArray
    mask: BatchArray
    rollout_logp: BatchArray
    advantages: BatchArray
    truncated: BatchArray | None = None
    old_logp: BatchArray | None = None
    ref_logp: BatchArray | None = None

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    def forward_inputs(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """(tokens, positions, segment_ids, targets): the arguments of the log-prob forward, as jax
        arrays (as they already are under ``jit``, where the forward runs)."""
        t, p, s, g = (jnp.asarray(v) for v in (self.tokens, self.positions, self.segment_ids, self.targets))
        return t, p, s, g

    def replace(self, **fields) -> RolloutBatch:
        return dataclasses.replace(self, **fields)

    def map(self, fn: Callable) -> RolloutBatch:
        """``fn`` applied to every array (the absent optional fields stay absent)."""
        return jax.tree.map(fn, self)

    def rows(self, index) -> RolloutBatch:
        """The rows ``index`` selects (an integer array, a slice or a boolean mask), every field."""
        return self.map(lambda v: v[index])


def bucketed_length(inputs: int, max_len: int, buckets: int) -> int:
    """The length of a training batch whose longest row has ``inputs`` inputs: the shortest of
    ``buckets`` equal steps up to ``max_len`` (the last step is ``max_len``) that holds it. Why:
    the forward and backward cost grows with the padded length, and rollouts rarely fill it; a few
    fixed lengths keep the compiled shapes to at most ``buckets``. Cutting padding changes no
    token's log-prob: every kernel's rows are independent of the padding and of the length."""
    if buckets < 1:
        raise ValueError(f"buckets must be >= 1, got {buckets}")
    if not 0 < inputs <= max_len:
        raise ValueError(f"the longest row has {inputs} inputs; expected 1..max_len={max_len}")
    step = -(-max_len // buckets)
    return min(max_len, -(-inputs // step) * step)


def training_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    rollout_logprobs: Sequence[Sequence[float]],
    advantages: Sequence[float],
    length: int,
    pad_id: int = 0,
    truncated: Sequence[bool] | None = None,
) -> RolloutBatch:
    """Row i is prompt_i + response_i, shifted for next-token prediction and right-padded to
    ``length`` inputs. ``rollout_logp`` sits at the mask's positions, so it lines up with the
    training forward's log-probs token for token. An empty response gives an empty row (the
    prompt's tokens, mask 0): the padding that keeps a batch's shape when it has fewer samples."""
    n = len(prompts)
    if not n == len(responses) == len(rollout_logprobs) == len(advantages):
        raise ValueError("prompts, responses, rollout_logprobs and advantages must have the same length")
    if truncated is not None and len(truncated) != n:
        raise ValueError(f"{len(truncated)} truncated flags for {n} samples")
    tokens = np.full((n, length), pad_id, np.int32)
    targets = np.full((n, length), pad_id, np.int32)
    positions = np.zeros((n, length), np.int32)
    segment_ids = np.zeros((n, length), np.int32)
    mask = np.zeros((n, length), np.float32)
    rollout_logp = np.zeros((n, length), np.float32)
    for i, (prompt, response, logp) in enumerate(zip(prompts, responses, rollout_logprobs, strict=True)):
        if len(response) != len(logp):
            raise ValueError(f"sample {i}: {len(response)} response tokens but {len(logp)} log-probs")
        seq = list(prompt) + list(response)
        if len(seq) - 1 > length:
            raise ValueError(f"sample {i}: {len(seq) - 1} input tokens exceed the batch length {length}")
        t = len(seq) - 1
        tokens[i, :t] = seq[:-1]
        targets[i, :t] = seq[1:]
        positions[i, :t] = np.arange(t)
        segment_ids[i, :t] = 1
        start = len(prompt) - 1
        mask[i, start:t] = 1.0
        rollout_logp[i, start:t] = logp
    return RolloutBatch(
        tokens=tokens,
        positions=positions,
        segment_ids=segment_ids,
        targets=targets,
        mask=mask,
        rollout_logp=rollout_logp,
        advantages=np.asarray(advantages, np.float32),
        truncated=None if truncated is None else np.asarray(truncated, np.float32),
    )
