"""Graded prompt groups: a batch's prompts, the G samples drawn for each, and their scores and
rewards. What the rollout's overlap thread hands the trainer (and writes into a checkpoint) and
what DAPO's dynamic sampling filters; it lives here, below both."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from qarl_jax.rollout.driver import Sample


@dataclasses.dataclass
class Groups:
    """Prompt groups: ``prompts[p]`` (token ids), ``samples[p][g]``, the grader's ``scores``
    [P, G] and the ``rewards`` [P, G] the advantages see (scores plus any length penalty)."""

    prompts: list[list[int]]
    samples: list[list[Sample]]
    scores: np.ndarray
    rewards: np.ndarray

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, index: Sequence[int] | np.ndarray) -> Groups:
        index = np.flatnonzero(index) if np.asarray(index).dtype == bool else np.asarray(index, int)
        return Groups(
            [self.prompts[i] for i in index],
            [self.samples[i] for i in index],
            self.scores[index],
            self.rewards[index],
        )

    @staticmethod
    def concat(parts: Sequence[Groups]) -> Groups:
        return Groups(
            [p for g in parts for p in g.prompts],
            [s for g in parts for s in g.samples],
            np.concatenate([g.scores for g in parts]),
            np.concatenate([g.rewards for g in parts]),
        )
