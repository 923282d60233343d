"""Run directories for notebooks: a run's ``config.json`` and ``metrics.jsonl`` as numpy columns.

``metrics.jsonl`` (written by :mod:`qarl_jax.run.train`) holds one JSON object per line: the line of
step 0 holds only the eval before training, every later line one training step's metrics, plus the
held-out evals (``eval/...``, ``eval_bf16/...``) on eval steps. Keys come and go between versions
of the trainer, so a key a row lacks reads as NaN and a key no row has as an empty series.
:class:`MetricsLog` is the writer, beside its reader so the two agree on the format. Pure numpy +
json: no JAX, no pandas (the writer imports tensorboardX, or wandb, only when a run logs there).
A run directory may be in a bucket (``gs://``, :mod:`qarl_jax.storage`): reader and writer alike.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from etils import epath

from qarl_jax import storage
from qarl_jax.errors import ConfigError, RunLogError

EVAL_PREFIXES = ("eval/", "eval_bf16/")


def is_eval_key(key: str) -> bool:
    """Whether ``key`` is a held-out eval metric (logged on eval steps only)."""
    return key.startswith(EVAL_PREFIXES)


@dataclasses.dataclass(frozen=True)
class RunLog:
    """One run directory, read.

    ``rows`` are the lines of ``metrics.jsonl`` as parsed. ``metrics`` is the table of training
    steps (step >= 1): ``"step"`` and every non-eval key any of them logged, one float per step, NaN
    where a step lacks the key. ``evals`` is the table of the rows with eval keys (step 0: before
    training) in the same form.
    """

    path: epath.Path
    name: str  # label for plots: the directory's name (see load_runs for collisions)
    config: dict[str, Any]  # config.json; {} for a run directory without one
    rows: list[dict[str, float]]
    metrics: dict[str, np.ndarray]
    evals: dict[str, np.ndarray]

    def has(self, key: str) -> bool:
        """Whether any row logged ``key``."""
        return any(key in row for row in self.rows)

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of ``key`` on the steps that logged it (a logged NaN stays NaN); empty
        arrays when none did."""
        logged = [row for row in self.rows if key in row]
        return np.array([r["step"] for r in logged], np.int64), np.array([r[key] for r in logged], np.float64)


def _table(rows: Sequence[dict[str, float]], keys: Iterable[str]) -> dict[str, np.ndarray]:
    return {k: np.array([row.get(k, math.nan) for row in rows], np.float64) for k in ["step", *keys]}


def _read_metrics(path: epath.Path) -> list[dict[str, float]]:
    rows = []
    with path.open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise RunLogError(f"{where}: not valid JSON ({e.msg}); a run killed mid-write?") from e
            if not isinstance(row, dict):
                raise RunLogError(f"{where}: expected a JSON object, got {type(row).__name__}")
            if not isinstance(row.get("step"), int):
                raise RunLogError(f"{where}: no integer 'step' key")
            for key, value in row.items():
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise RunLogError(f"{where}: {key!r} is {value!r}, not a number")
            rows.append(row)
    return rows


def load_run(run_dir: str | pathlib.Path | epath.Path) -> RunLog:
    """Read one run directory (``config.json`` optional, ``metrics.jsonl`` required)."""
    path = storage.parse(run_dir, "run directory")
    if not path.is_dir():
        raise RunLogError(f"{path}: no such run directory (resolved: {_resolved(path)})")
    metrics_file = path / "metrics.jsonl"
    if not metrics_file.is_file():
        raise RunLogError(f"{path}: no metrics.jsonl (not a run directory, or the run has not started)")
    config: dict[str, Any] = {}
    config_file = path / "config.json"
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise RunLogError(f"{config_file}:{e.lineno}: not valid JSON ({e.msg})") from e
    rows = _read_metrics(metrics_file)
    keys = list(dict.fromkeys(k for row in rows for k in row if k != "step"))
    train_rows = [row for row in rows if row["step"] >= 1]
    eval_rows = [row for row in rows if any(is_eval_key(k) for k in row)]
    return RunLog(
        path=path,
        name=_resolved(path).name,
        config=config,
        rows=rows,
        metrics=_table(train_rows, [k for k in keys if not is_eval_key(k)]),
        evals=_table(eval_rows, [k for k in keys if is_eval_key(k)]),
    )


def _resolved(path: epath.Path) -> epath.Path:
    return path if storage.is_remote(path) else path.resolve()


def load_runs(run_dirs: Iterable[str | pathlib.Path | epath.Path]) -> list[RunLog]:
    """Read several run directories. Runs whose directory names collide are named by as many
    trailing path components as it takes to tell them apart (``a/default``, ``b/default``)."""
    runs = [load_run(d) for d in run_dirs]
    parts = [_resolved(r.path).parts for r in runs]
    named = []
    for run, own in zip(runs, parts, strict=True):
        depth = 1
        while depth < len(own) and any(p != own and p[-depth:] == own[-depth:] for p in parts):
            depth += 1
        named.append(dataclasses.replace(run, name="/".join(own[-depth:])))
    return named


class MetricsLog:
    """``metrics.jsonl`` in the run directory: one JSON object per step; on resume, lines past the
    checkpoint are dropped (the resumed run writes them again) and a torn last line (a run killed
    mid-write) is cut. With ``tensorboard``, every numeric metric also goes to ``tb/`` as a scalar at
    its step (tags allow no "@": eval/pass@4 is written as eval/pass_4); a resumed run's event file
    starts by purging the steps past the checkpoint, so TensorBoard shows each step once too. Events
    are flushed every step, so a killed run loses none that its checkpoint covers. With ``wandb``
    (``{"project": ..., "name": ...}``) the numbers also go to a Weights & Biases run (files under
    ``wandb/``; ``WANDB_MODE=offline`` keeps them local), whose id is derived from the run directory
    so a resumed run continues the same W&B run; wandb is imported only then.

    In a bucket (``gs://``) objects are immutable: nothing can be appended. This log keeps the
    run's lines and rewrites the whole object at every step (chosen over one object per chunk: the
    run directory keeps the one ``metrics.jsonl`` every reader, ``gcloud storage cat`` included,
    reads as it is, and a rewrite is atomic, so a crash loses no line written before it and tears
    none; the cost, about 3 KB a line re-sent per step, is nothing beside a pod step's minutes).
    TensorBoard's event file is written to a local temporary directory and uploaded to ``tb/`` the
    same way at each step: tensorboardX's own ``gs://`` writer re-uploads its buffer again when it
    is garbage-collected after ``close`` (at exit, with retries for two minutes when the bucket is
    out of reach: measured here once the server had stopped)."""

    def __init__(
        self, run_dir: epath.Path, resume_step: int, tensorboard: bool = True, wandb: dict | None = None
    ):
        self.path = run_dir / "metrics.jsonl"
        kept = kept_lines(self.path, resume_step) if resume_step and self.path.exists() else []
        # in a bucket: every line so far, rewritten as one object at each step (see above)
        self._lines = [line + "\n" for line in kept] if storage.is_remote(run_dir) else None
        self.path.write_text("".join(line + "\n" for line in kept))
        self.tensorboard = None
        # in a bucket: (the local directory written, the tb/ it is uploaded to)
        self._tb_upload = (
            (tempfile.mkdtemp(prefix="qarl-tb-"), run_dir / "tb") if storage.is_remote(run_dir) else None
        )
        if tensorboard:
            from tensorboardX import SummaryWriter  # only runs that log to TensorBoard import it (and torch)

            # the file name's time has 1 s resolution; the resume step in it keeps a quickly resumed
            # run from overwriting the previous file and sorts the files in run order
            purge = resume_step + 1 if resume_step else None
            suffix = f".{resume_step:09d}"
            tb = self._tb_upload[0] if self._tb_upload else str(run_dir / "tb")
            self.tensorboard = SummaryWriter(tb, purge_step=purge, filename_suffix=suffix)
        self.wandb = None
        if wandb is not None:
            self.wandb = _wandb_run(run_dir, wandb["project"], wandb.get("name"))

    def write(self, metrics: dict) -> None:
        line = json.dumps(metrics) + "\n"
        if self._lines is None:
            with self.path.open("a") as f:
                f.write(line)
        else:
            self._lines.append(line)
            self.path.write_text("".join(self._lines))
        if self.tensorboard is not None:
            for key, value in metrics.items():
                if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(key, value, metrics["step"])
            self.tensorboard.flush()
            if self._tb_upload is not None:
                storage.upload_tree(*self._tb_upload)
        if self.wandb is not None:
            numbers = {
                k: v for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)
            }
            self.wandb.log({k: v for k, v in numbers.items() if k != "step"}, step=metrics["step"])

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self._tb_upload is not None:
            if self.tensorboard is not None:
                storage.upload_tree(*self._tb_upload)
            shutil.rmtree(self._tb_upload[0])
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_run(run_dir: epath.Path, project: str, name: str | None):
    try:
        import wandb
    except ImportError as e:
        raise ConfigError("run.wandb=true needs the wandb package: pip install 'qarl-jax[wandb]'") from e
    run_id = hashlib.blake2b(str(_resolved(run_dir)).encode(), digest_size=8).hexdigest()
    local = None if storage.is_remote(run_dir) else str(run_dir)  # wandb writes local files: ./wandb then
    return wandb.init(
        project=project, name=name or _resolved(run_dir).name, id=run_id, resume="allow", dir=local
    )


def kept_lines(path: epath.Path, resume_step: int) -> list[str]:
    """The lines of ``path`` up to step ``resume_step``. A last line that is not JSON is what a run
    killed mid-write leaves: it is cut (and said so); a bad line before the last is damage nobody
    should paper over, a :class:`RunLogError` naming file and line."""
    lines = path.read_text().splitlines()
    kept = []
    for lineno, line in enumerate(lines, start=1):
        try:
            step = json.loads(line)["step"]
        except (json.JSONDecodeError, TypeError, KeyError) as e:
            if lineno == len(lines):
                print(f"{path}:{lineno}: cutting a torn last line (a run stopped mid-write)", file=sys.stderr)
                break
            raise RunLogError(f"{path}:{lineno}: not a metrics line ({e}); fix or remove it to resume") from e
        if step <= resume_step:
            kept.append(line)
    return kept


def rolling_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    csum = np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (csum[ends] - csum[starts]) / (ends - starts)


def summary(run: RunLog, frac: float = 0.2) -> dict[str, Any]:
    """One row for a run table: quant format/mode, steps, mean reward over the first and the last
    ``frac`` of the steps, eval accuracy before/after training (NaN where not logged), and the largest
    |log-prob mismatch| seen (exactly 0 for an aligned run)."""
    _, reward = run.series("reward_mean")
    k = max(1, math.ceil(frac * len(reward)))
    quant = run.config.get("quant", {})

    def last(key: str) -> float:
        values = run.series(key)[1]
        return float(values[-1]) if len(values) else math.nan

    def first_eval() -> float:
        steps, values = run.series("eval/accuracy")
        return float(values[0]) if len(steps) and steps[0] == 0 else math.nan

    mismatch = run.series("train/mismatch_max_abs_diff")[1]
    return {
        "run": run.name,
        "quant": f"{quant.get('fmt', '?')} {quant.get('mode', '?')}",
        "steps": len(run.metrics["step"]),
        "reward_first": float(reward[:k].mean()) if len(reward) else math.nan,
        "reward_last": float(reward[-k:].mean()) if len(reward) else math.nan,
        "eval_before": first_eval(),
        "eval_final": last("eval/accuracy"),
        "eval_bf16_final": last("eval_bf16/accuracy"),
        "mismatch_max": float(mismatch.max()) if len(mismatch) else math.nan,
    }
