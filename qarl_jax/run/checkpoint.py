"""Run checkpoints with orbax: train state, data-iterator position and run metadata, saved together,
and verified on the way back.

One orbax step directory holds three items: ``state`` (params, optimizer state, update count; the
arrays, restored onto the live state's shardings), ``data`` (the prompt iterator's JSON state) and
``meta`` (the loop step, the seed every per-step random stream is derived from, the full config,
and a fingerprint of every array and of the data state). Orbax writes each step to a temporary
directory and renames it when complete (atomic), runs the write in the background (async) and
deletes old steps only after a new one is committed (keep-N), so a crash or failed save never
destroys the last good checkpoint.

What orbax does not do is notice a file changed after the commit (a disk error, a bad copy): the
bytes decode to other numbers, and a run resumed from them carries on with NaN moments or silently
different weights. So every saved array gets a fingerprint computed on its devices (a reduction
over its bits, :func:`fingerprints`: a big sharded state costs one pass over memory, not a copy to
the host), stored in ``meta``, recomputed on the restored arrays and compared. A checkpoint that
does not match, or does not read, is damaged: the run says which array (or file) and falls back to
the newest intact checkpoint, setting the damaged one aside (``checkpoints_damaged/``), and stops
with :class:`CheckpointError` only when none is intact. A checkpoint written under a different
config (anything outside the ``run`` section), or for a state of other shapes, is not damage but a
mismatch: the run stops naming the keys, since continuing it would not reproduce the run the
command describes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import re
import sys
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax import lax

from qarl_jax import storage
from qarl_jax.errors import CheckpointError
from qarl_jax.rl.train_step import TrainState

FORMAT_VERSION = 2  # 2: meta holds the arrays' fingerprints
ITEMS = ("state", "data", "meta")
RESUMABLE_SECTIONS = ("run",)  # config sections that may change between a run and its resumption
_SEEDS = (0x9E3779B9, 0x7F4A7C15)  # one per 32-bit lane of a fingerprint


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files no longer hold what was saved (unreadable, or a fingerprint differs)."""


@dataclasses.dataclass(frozen=True)
class Restored:
    step: int  # loop steps completed
    state: TrainState
    data_state: dict[str, Any]
    meta: dict[str, Any]


def array_name(path) -> str:
    """A leaf's path as orbax names the array (``opt_state.1.0.mu.w``), whatever the containers."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return ".".join(parts)


def _mix(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: a bijection in which every input bit moves every output bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The array's bits as uint32 words (narrower elements widened, wider ones split)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    bits = x.dtype.itemsize * 8
    if bits >= 32:
        return lax.bitcast_convert_type(x, jnp.uint32)
    return lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}")).astype(jnp.uint32)


def _fingerprint(x: jax.Array) -> jax.Array:
    """uint32[2]: per lane, the wrapping sum over elements of mix(word ^ mix(index + seed)). A
    zeroed block, a flipped bit or two swapped elements change a lane unless 2^-32 odds cancel it
    (both lanes: 2^-64); integer sums are exact in any order, so the sharding does not matter."""
    w = _words(x)
    index = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(w.ndim)):
        index = index + lax.broadcasted_iota(jnp.uint32, w.shape, d) * jnp.uint32(stride % 2**32)
        stride *= w.shape[d]
    return jnp.stack([jnp.sum(_mix(w ^ _mix(index + jnp.uint32(s))), dtype=jnp.uint32) for s in _SEEDS])


@jax.jit
def _fingerprint_all(leaves: list[jax.Array]) -> list[jax.Array]:
    return [_fingerprint(x) for x in leaves]


def _host(x: jax.Array) -> np.ndarray:
    """A replicated result as numpy, also where the array spans other processes' devices."""
    return np.asarray(x.addressable_shards[0].data if isinstance(x, jax.Array) else x)


def fingerprints(tree) -> dict[str, dict[str, Any]]:
    """Per array of ``tree`` (by :func:`array_name`): shape, dtype and a 16-hex-digit fingerprint,
    computed on the arrays' devices; only the 8-byte results reach the host."""
    pairs = jax.tree_util.tree_leaves_with_path(tree)
    prints = _fingerprint_all([jnp.asarray(x) for _, x in pairs])
    return {
        array_name(path): {
            "shape": list(np.shape(x)),
            "dtype": str(jnp.asarray(x).dtype),
            "fingerprint": "".join(f"{int(v):08x}" for v in _host(fp)),
        }
        for (path, x), fp in zip(pairs, prints, strict=True)
    }


def data_digest(data_state: Any) -> str:
    return hashlib.sha256(json.dumps(data_state, sort_keys=True).encode()).hexdigest()


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


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def read_failure(e: BaseException, where: epath.Path) -> DamagedCheckpoint:
    """A failed orbax read as a one-line report naming the array whose data did not decode (from
    TensorStore's spec in the message: its key inside the OCDBT store) and the state directory."""
    chain: list[str] = []
    cause: BaseException | None = e
    while cause is not None and len(chain) < 8:
        chain.append(str(cause))
        cause = cause.__cause__ or cause.__context__
    # the array's key in the OCDBT store; not the state directory's own key in a bucket's kvstore
    found = re.findall(r"'path': '([^'/][^']*)/'", "\n".join(chain))
    arrays = [a for a in found if not f"{where}/state".endswith(a)]
    if arrays:
        return DamagedCheckpoint(
            f"{where}/state: array {arrays[0]} cannot be read back (its data file under {where}/state is "
            f"damaged: {first_line(e)[:80]})"
        )
    return DamagedCheckpoint(f"{where}: cannot restore the train state or data state ({first_line(e)})")


def _is_late_read_callback(unraisable) -> bool:
    """Whether an unraisable error is a read of a failed restore finishing after orbax closed its
    event loop: TensorStore completes each outstanding read with ``loop.call_soon_threadsafe``
    from its own thread, which raises "Event loop is closed" there; Python reports each through
    ``sys.unraisablehook``, by default as a bare traceback (measured: 234 of them, 700 lines, after
    one damaged checkpoint of the smoke run)."""
    error = unraisable.exc_value
    if not isinstance(error, RuntimeError) or str(error) != "Event loop is closed":
        return False
    frames = [frame.f_code.co_name for frame, _ in traceback.walk_tb(unraisable.exc_traceback)]
    return "call_soon_threadsafe" in frames


def quiet_late_read_callbacks() -> None:
    """Drop those reports from now on (only those: every other unraisable error still reaches the
    previous hook). Installed before a restore, since a failed one reports them while it unwinds
    and after; the fallback itself says in one line what was damaged and where the run resumes."""
    previous = sys.unraisablehook
    if getattr(previous, "quiets_late_reads", False):
        return

    def hook(unraisable) -> None:
        if not _is_late_read_callback(unraisable):
            previous(unraisable)

    hook.quiets_late_reads = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _say(message: str) -> None:
    if jax.process_index() == 0:
        print(message, file=sys.stderr, flush=True)


def compare(saved: dict[str, dict], restored: dict[str, dict], where: epath.Path) -> None:
    """Raise :class:`DamagedCheckpoint` naming the arrays whose fingerprints differ."""
    bad = [name for name, info in saved.items() if restored.get(name) != info]
    if bad:
        shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise DamagedCheckpoint(
            f"{where}/state: {len(bad)} of {len(saved)} arrays differ from what was saved ({shown}): "
            "the checkpoint's files were damaged after it was written"
        )


class Checkpointer:
    """Owns the run's ``CheckpointManager`` (``<output_dir>/checkpoints``), local or ``gs://``
    (orbax writes a bucket through TensorStore; :mod:`qarl_jax.storage`)."""

    def __init__(self, directory: str | pathlib.Path | epath.Path, keep: int, config: dict):
        self.directory = storage.absolute(epath.Path(directory))
        self.config = config
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=True)
        try:
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
        except Exception as e:
            raise CheckpointError(f"{self.directory}: not a usable checkpoint directory ({e})") from e

    @property
    def damaged_directory(self) -> epath.Path:
        """Where damaged checkpoints are moved (beside the checkpoints, out of orbax's sight)."""
        return self.directory.with_name(self.directory.name + "_damaged")

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def steps(self) -> list[int]:
        """Saved steps, newest first."""
        return sorted(self._manager.all_steps(), reverse=True)

    def save(self, step: int, state: TrainState, data_state: dict, seed: int) -> None:
        """Start saving (fingerprints and device-to-host copies happen now, the file writes in the
        background)."""
        meta = {
            "version": FORMAT_VERSION,
            "step": step,
            "seed": seed,
            "config": self.config,
            "arrays": fingerprints(state),
            "data_sha256": data_digest(data_state),
        }
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state),
            meta=ocp.args.JsonSave(meta),
        )
        self._manager.save(step, args=args)

    def read_meta(self, step: int) -> dict:
        """Step ``step``'s metadata, checked to be this format's and compatible with the config."""
        where = self.directory / str(step)
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception as e:
            raise DamagedCheckpoint(
                f"{where}/meta: cannot read the checkpoint's metadata ({first_line(e)})"
            ) from e
        if not isinstance(meta, dict) or meta.get("step") != step or "arrays" not in meta:
            raise DamagedCheckpoint(f"{where}/meta: not the metadata of a run checkpoint of step {step}")
        if meta.get("version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{where}: a version-{meta.get('version')} checkpoint; this version reads version "
                f"{FORMAT_VERSION} (use another run.output_dir to start afresh)"
            )
        diff = config_diff(meta.get("config", {}), self.config)
        if diff:
            raise CheckpointError(
                f"{where} was written by a different config, so resuming would not reproduce this run: "
                + "; ".join(diff[:8])
                + " (use another run.output_dir to start afresh)"
            )
        return meta

    def check_resumable(self) -> int | None:
        """The latest step if its metadata allows this config to resume (raises if it does not);
        None without checkpoints. Cheap (JSON only): runs before anything is written."""
        step = self.latest_step()
        if step is not None:
            try:
                self.read_meta(step)
            except DamagedCheckpoint:
                pass  # restore() reports it and falls back
        return step

    def _restore_step(self, step: int, like: TrainState) -> Restored:
        where = self.directory / str(step)
        meta = self.read_meta(step)
        shapes = {n: (tuple(x.shape), str(x.dtype)) for n, x in _named_leaves(like).items()}
        saved = {n: (tuple(i["shape"]), i["dtype"]) for n, i in meta["arrays"].items()}
        if saved != shapes:
            name = (sorted(set(saved) ^ set(shapes)) or [n for n in saved if saved[n] != shapes[n]])[0]
            raise CheckpointError(
                f"{where}: cannot restore the train state: {name} is {saved.get(name, 'absent')} in the "
                f"checkpoint, {shapes.get(name, 'absent')} in this run (a different model or optimizer)"
            )
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore())
        quiet_late_read_callbacks()
        try:
            restored = self._manager.restore(step, args=args)
        except Exception as e:
            raise read_failure(e, where) from e
        compare(meta["arrays"], fingerprints(restored.state), where)
        if data_digest(restored.data) != meta["data_sha256"]:
            raise DamagedCheckpoint(f"{where}/data: the data-iterator state differs from what was saved")
        return Restored(step=step, state=restored.state, data_state=restored.data, meta=meta)

    def restore(self, like: TrainState, step: int | None = None) -> Restored | None:
        """The newest intact checkpoint restored onto ``like``'s structure and shardings; None if
        there is none. Damaged ones are reported and set aside; raises :class:`CheckpointError`
        when every checkpoint is damaged, or one is incompatible with the run. With ``step``: that
        checkpoint, or the error saying why not."""
        if step is not None:
            if step not in self.steps():
                raise CheckpointError(f"{self.directory}: no checkpoint {step} (there are {self.steps()})")
            return self._restore_step(step, like)
        damaged: list[tuple[int, DamagedCheckpoint]] = []
        for step in self.steps():
            try:
                restored = self._restore_step(step, like)
            except DamagedCheckpoint as e:
                _say(f"damaged checkpoint: {e}")
                damaged.append((step, e))
                continue
            if damaged:
                self._set_aside([s for s, _ in damaged])
                _say(
                    f"resuming from {self.directory / str(step)}, the newest intact checkpoint "
                    f"(damaged ones moved to {self.damaged_directory})"
                )
            return restored
        if damaged:
            raise CheckpointError(
                f"{self.directory}: every checkpoint is damaged ({damaged[0][1]}); move the directory "
                "away to start afresh"
            )
        return None

    def _set_aside(self, steps: list[int]) -> None:
        if jax.process_index() == 0:
            self.damaged_directory.mkdir(exist_ok=True)
            for step in steps:
                target = self.damaged_directory / str(step)
                if target.exists():
                    target.rmtree()
                storage.move(self.directory / str(step), target)
        self._manager.reload()

    def close(self) -> None:
        """Wait for pending saves to be committed, then release the manager."""
        self._manager.wait_until_finished()
        self._manager.close()


def _named_leaves(tree) -> dict[str, Any]:
    return {array_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}
