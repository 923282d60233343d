"""A verifiable multi-step arithmetic task for the tiny policies trained here.

Problem ``i`` is drawn from a generator seeded by ``(seed, i)``, so the source is random access and
deterministic: shuffling, sharding and iterator restore need no stored state. The answer is computed
by reducing the expression ourselves (products first, then left to right), never by ``eval``.
"""

from __future__ import annotations

import numpy as np

from qarl_jax.data.config import SyntheticConfig
from qarl_jax.data.records import Record

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
    """Random-access source of ``{prompt, answer, id, solution}`` arithmetic records."""

    def __init__(self, config: SyntheticConfig, seed: int):
        self.config = config
        self.seed = seed

    def __len__(self) -> int:
        return self.config.size

    def __getitem__(self, index: int) -> Record:
        if not 0 <= index < len(self):
            raise IndexError(f"synthetic index {index} out of range [0, {len(self)})")
        cfg = self.config
        rng = np.random.default_rng((self.seed, index))
        nums = [int(x) for x in rng.integers(0, 10**cfg.digits, size=cfg.steps + 1)]
        ops = [cfg.ops[int(j)] for j in rng.integers(0, len(cfg.ops), size=cfg.steps)]
        value, solution = solve(nums, ops)
        prompt = "".join(f"{n}{op}" for n, op in zip(nums, [*ops, ""], strict=True))
        return {
            "prompt": prompt,
            "answer": str(value),
            "id": f"synthetic:{self.seed}:{index}",
            "solution": solution,
        }
