"""``python -m qarl_jax.tools.verify_checkpoint DIR``: is a run's checkpoint intact?

``DIR`` is a run directory, its ``checkpoints`` directory (every step is checked) or one step
(``RUN/checkpoints/23``), on a disk or in a bucket (``gs://BUCKET/RUN``). Each step's arrays are
read back onto this host's first device, their fingerprints recomputed and compared with those
saved beside them (:mod:`qarl_jax.run.checkpoint`), and the data state's digest checked. Prints one
line per step; exits 1 when any is damaged (naming the array or file), 3 (a checkpoint error, as
in every command) when ``DIR`` holds no checkpoint. Nothing is written or moved.
"""

from __future__ import annotations

import sys

import jax
import orbax.checkpoint as ocp
from etils import epath

from qarl_jax import cli, storage
from qarl_jax.errors import CheckpointError
from qarl_jax.run.checkpoint import (
    DamagedCheckpoint,
    compare,
    data_digest,
    fingerprints,
    first_line,
    read_failure,
)


def _steps(path: epath.Path) -> tuple[epath.Path, list[int]]:
    if path.name.isdigit() and (path / "meta").is_dir():  # one step
        return path.parent, [int(path.name)]
    directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = sorted((int(p.name) for p in directory.iterdir() if p.name.isdigit()), reverse=True)
    return directory, steps


def verify_step(manager: ocp.CheckpointManager, directory: epath.Path, step: int) -> None:
    """Raise :class:`CheckpointError` unless step ``step`` reads back as it was saved."""
    where = directory / str(step)
    try:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:
        raise DamagedCheckpoint(f"{where}/meta: cannot read the metadata ({first_line(e)})") from e
    if not isinstance(meta, dict) or "arrays" not in meta:
        raise CheckpointError(f"{where}/meta: no fingerprints (not a run checkpoint of this version)")
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    try:
        tree = ocp.StandardCheckpointHandler().metadata(where / "state").tree
    except Exception as e:
        raise DamagedCheckpoint(f"{where}/state: cannot read the arrays' metadata ({first_line(e)})") from e
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree)
    args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore())
    try:
        restored = manager.restore(step, args=args)
    except Exception as e:
        raise read_failure(e, where) from e
    compare(meta["arrays"], fingerprints(restored.state), where)
    if data_digest(restored.data) != meta.get("data_sha256"):
        raise DamagedCheckpoint(f"{where}/data: the data-iterator state differs from what was saved")


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(
        prog="python -m qarl_jax.tools.verify_checkpoint", description=cli.plain(__doc__)
    )
    parser.add_argument("dir", help="a run directory, its checkpoints/ or one step (local or gs://)")
    args = parser.parse_args(argv)
    return cli.run(lambda: _verify(storage.parse(args.dir, "DIR")))


def _verify(path: epath.Path) -> int:
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such directory")
    directory, steps = _steps(path)
    if not steps:
        raise CheckpointError(f"{path}: no checkpoint steps (not a run directory, or the run has saved none)")
    directory = storage.absolute(directory)
    manager = ocp.CheckpointManager(directory, item_names=("state", "data", "meta"))
    damaged = 0
    for step in steps:
        try:
            verify_step(manager, directory, step)
        except CheckpointError as e:
            damaged += 1
            print(f"DAMAGED {e}")
        else:
            print(f"ok      {directory / str(step)}")
    manager.close()
    return 1 if damaged else 0


if __name__ == "__main__":
    sys.exit(main())
