"""Run checkpoints with orbax: train state, data-iterator position and run metadata, saved together.

One orbax step directory holds three items: ``state`` (params, optimizer state, update count; the
arrays, restored onto the live state's shardings), ``data`` (the prompt iterator's JSON state) and
``meta`` (the loop step, the seed every per-step random stream is derived from, and the full
config). Orbax writes each step to a temporary directory and renames it when complete (atomic), runs
the write in the background (async) and deletes old steps only after a new one is committed
(keep-N), so a crash or failed save never destroys the last good checkpoint.

Resuming is strict: the latest checkpoint is restored or the run stops with :class:`CheckpointError`
naming the directory; a checkpoint is never silently skipped. A checkpoint written under a different
config (anything outside the ``run`` section) is refused, since continuing it would not reproduce
the run the command describes.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

from qarl_jax.rl.train_step import TrainState

FORMAT_VERSION = 1
ITEMS = ("state", "data", "meta")
RESUMABLE_SECTIONS = ("run",)  # config sections that may change between a run and its resumption


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be resumed from; the message names it and says why."""


@dataclasses.dataclass(frozen=True)
class Restored:
    step: int  # loop steps completed
    state: TrainState
    data_state: dict[str, Any]
    meta: dict[str, Any]


def config_diff(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dicts (sections in RESUMABLE_SECTIONS
    excepted at the top level)."""
    out = []
    for key in sorted(set(saved) | set(current)):
        if not prefix and key in RESUMABLE_SECTIONS:
            continue
        a, b = saved.get(key, "<missing>"), current.get(key, "<missing>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: checkpoint {a!r}, now {b!r}")
    return out


class Checkpointer:
    """Owns the run's ``CheckpointManager`` (``<output_dir>/checkpoints``)."""

    def __init__(self, directory: str | pathlib.Path, keep: int, config: dict):
        self.directory = pathlib.Path(directory).absolute()
        self.config = config
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=True)
        try:
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
        except Exception as e:
            raise CheckpointError(f"{self.directory}: not a usable checkpoint directory ({e})") from e

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: TrainState, data_state: dict, seed: int) -> None:
        """Start saving (device-to-host copies happen now, the file writes in the background)."""
        meta = {"version": FORMAT_VERSION, "step": step, "seed": seed, "config": self.config}
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state),
            meta=ocp.args.JsonSave(meta),
        )
        self._manager.save(step, args=args)

    def restore(self, like: TrainState) -> Restored | None:
        """The latest checkpoint restored onto ``like``'s structure and shardings; None if there is
        none. Raises :class:`CheckpointError` for a corrupt or incompatible one."""
        step = self.latest_step()
        if step is None:
            return None
        where = self.directory / str(step)
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception as e:
            raise CheckpointError(f"{where}: cannot read the checkpoint's metadata ({e})") from e
        if not isinstance(meta, dict) or meta.get("version") != FORMAT_VERSION or meta.get("step") != step:
            raise CheckpointError(f"{where}: metadata is not a version-{FORMAT_VERSION} run checkpoint")
        diff = config_diff(meta.get("config", {}), self.config)
        if diff:
            raise CheckpointError(
                f"{where} was written by a different config, so resuming would not reproduce this run: "
                + "; ".join(diff[:8])
                + " (use another run.output_dir to start afresh)"
            )
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore())
        try:
            restored = self._manager.restore(step, args=args)
        except Exception as e:
            raise CheckpointError(f"{where}: cannot restore the train state or data state ({e})") from e
        return Restored(step=step, state=restored.state, data_state=restored.data, meta=meta)

    def close(self) -> None:
        """Wait for pending saves to be committed, then release the manager."""
        self._manager.wait_until_finished()
        self._manager.close()
