"""What a training run shows per step on stderr: a progress bar on a terminal, plain lines in a log.

A bar redraws itself with carriage returns; redirected to a file (a batch job on a pod, ``nohup``,
CI) that is one unreadable line of ``\\r`` frames. So where stderr is not a terminal each logged
step (every ``run.log_every``) is one line a person can read and ``grep`` can parse::

    qarl: step 12/240  reward 0.531  acc 0.500  mismatch 0.000  123 tok/s  0.84 s/step

``run.progress=false`` shows neither. A step whose grader scored samples 0 for want of time or a
crashed worker (``grader/timeouts``, ``grader/crashes``: a busy host turns correct answers into
reward 0) always gets a warning line, progress or not.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm

# (label, metrics key, format) of what a step shows, in order
SHOWN = (
    ("reward", "reward_mean", ".3f"),
    ("acc", "accuracy", ".3f"),
    ("mismatch", "train/mismatch_mean_abs_diff", ".3f"),
)


def fields(metrics: dict[str, Any]) -> dict[str, str]:
    """The step's figures as text, by label (keys a step lacks are left out)."""
    out = {label: format(metrics[key], fmt) for label, key, fmt in SHOWN if key in metrics}
    if "time/rollout_tokens_per_s" in metrics:
        out["tok/s"] = f"{metrics['time/rollout_tokens_per_s']:.0f}"
    if "time/step_s" in metrics:
        out["s/step"] = f"{metrics['time/step_s']:.2f}"
    return out


def grader_warning(metrics: dict[str, Any]) -> str | None:
    """What the step's grading lost, in words, or None where it lost nothing."""
    timeouts, crashes = int(metrics.get("grader/timeouts", 0)), int(metrics.get("grader/crashes", 0))
    lost = []
    if timeouts:
        lost.append(f"{timeouts} ran out of time twice (raise rewards.time_limit_s or lower the load)")
    if crashes:
        lost.append(f"{crashes} crashed their grading worker")
    return f"samples scored 0 without a verdict: {'; '.join(lost)}" if lost else None


class StepReport:
    """Steps ``start..total`` of a run, shown as the module docstring says."""

    def __init__(self, start: int, total: int, log_every: int, show: bool, stream=None):
        self.stream = sys.stderr if stream is None else stream
        self.total, self.log_every, self.show = total, log_every, show
        self.bar = None
        if show and self.stream.isatty():
            self.bar = tqdm(total=total, initial=start, desc="qarl", file=self.stream)

    def step(self, done: int, metrics: dict[str, Any]) -> None:
        """Step ``done`` (1-based) finished with ``metrics``."""
        if warning := grader_warning(metrics):
            line = f"qarl: step {done}: {warning}"
            if self.bar is not None:
                self.bar.write(line, file=self.stream)
            else:
                print(line, file=self.stream, flush=True)
        logged = done % self.log_every == 0 or done == self.total
        if self.bar is not None:
            if logged:
                self.bar.set_postfix(fields(metrics), refresh=False)
            self.bar.update(1)
        elif self.show and logged:
            # rates read as "12.3 tok/s", figures as "reward 0.531"
            shown = "  ".join(f"{v} {k}" if "/" in k else f"{k} {v}" for k, v in fields(metrics).items())
            print(f"qarl: step {done}/{self.total}  {shown}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
