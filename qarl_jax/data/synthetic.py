"""A verifiable multi-step arithmetic task for the tiny policies trained here.

Problem ``i`` is drawn from a generator seeded by ``(seed, i)``, so the source is random access and
deterministic: shuffling, sharding and iterator restore need no stored state. The answer is computed
by reducing the expression ourselves (products first, then left to right), never by ``eval``.

Small settings have few distinct problems (one-digit, two steps: 4,000), so a held-out set drawn from
another seed would mostly repeat training problems. The problem space is therefore split by content:
a problem is in ``test`` when a hash of its text falls in one of ``TEST_BUCKETS`` of ``BUCKETS``
buckets, and record ``i`` of a split is the first draw of ``(seed, i, attempt)`` that lands in it.
"""

from __future__ import annotations

import hashlib

import numpy as np

from qarl_jax.data.config import SyntheticConfig
from qarl_jax.data.records import Record

SPLITS = ("train", "test")
BUCKETS, TEST_BUCKETS = 16, 1  # 1/16 of the problem space is held out
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _reduce_once(nums: list[int], ops: list[str]) -> str:
    """Apply the next operation in place (first ``*``, else the leftmost); return the step's line."""
    k = ops.index("*") if "*" in ops else 0
    a, op, b = nums[k], ops[k], nums[k + 1]
    nums[k : k + 2] = [_APPLY[op](a, b)]
    del ops[k]
    return f"{a}{op}{b}={nums[k]}"


def solve(nums: list[int], ops: list[str]) -> tuple[int, str]:
    """The value of ``n0 op0 n1 op1 ...`` with the usual precedence, and a worked solution."""
    nums, ops = list(nums), list(ops)
    lines = [_reduce_once(nums, ops) for _ in range(len(ops))]
    return nums[0], "\n".join([*lines, f"#### {nums[0]}"])


class SyntheticArithmetic:
    """Random-access source of ``{prompt, answer, id, solution}`` arithmetic records of one split."""

    def __init__(self, config: SyntheticConfig, seed: int, split: str = "train"):
        if split not in SPLITS:
            raise ValueError(f"synthetic split must be one of {SPLITS}, got {split!r}")
        self.config = config
        self.seed = seed
        self.split = split

    def __len__(self) -> int:
        return self.config.size

    def __getitem__(self, index: int) -> Record:
        if not 0 <= index < len(self):
            raise IndexError(f"synthetic index {index} out of range [0, {len(self)})")
        cfg = self.config
        for attempt in range(64 * BUCKETS):
            rng = np.random.default_rng((self.seed, index, attempt))
            nums = [int(x) for x in rng.integers(0, 10**cfg.digits, size=cfg.steps + 1)]
            ops = [cfg.ops[int(j)] for j in rng.integers(0, len(cfg.ops), size=cfg.steps)]
            prompt = "".join(f"{n}{op}" for n, op in zip(nums, [*ops, ""], strict=True))
            if split_of(prompt) == self.split:
                break
        else:  # only a problem space of a handful of problems, all in the other split, gets here
            raise ValueError(f"synthetic {cfg}: no {self.split} problem found for record {index}")
        value, solution = solve(nums, ops)
        return {
            "prompt": prompt,
            "answer": str(value),
            "id": f"synthetic:{self.seed}:{index}",
            "solution": solution,
        }


def split_of(prompt: str) -> str:
    """The split a problem belongs to, from a stable hash of its text (not Python's salted ``hash``)."""
    bucket = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=2).digest(), "little") % BUCKETS
    return "test" if bucket < TEST_BUCKETS else "train"
