"""Training on several processes (hosts) with ``jax.distributed``; every helper is a no-op, or
returns its input, on one process, so a single-process run takes exactly its old path.

The design, per step:

* Rollouts are embarrassingly parallel, so each host draws its own share of the prompts
  (:func:`host_data`: ``data.batch_size`` is the global count; the pipeline shards records by
  host) and rolls them out with an engine over its *local* devices, on the layout ``rollout.mesh``
  states (:mod:`qarl_jax.rollout.layout`, the same rule as on one process). The frozen weights reach
  it through :func:`local_replica` (all-gathered to a replicated layout on the global mesh, then this
  host's copies re-wrapped as local arrays, without a copy when they are replicated already) and the
  engine's one resharding into its layout. No collective crosses hosts during a rollout, so hosts
  may decode different numbers of steps.
* Grading and group advantages are local (a prompt's samples never leave its host); sample keys
  name prompts by their global index (host * per-host batch + row), so hosts share no randomness.
* The hosts' rows form one global training batch (:func:`global_batch`) on the global mesh, so the
  Trainer's jitted step runs once over all devices. (Minibatches are cut on the host, so the
  trainer all-gathers the batch to every host once per step: small next to the rollouts.)
* Host-side figures (rewards, lengths, timings) are all-gathered (:func:`gather`) and computed over
  every host's samples, so every host logs the same numbers; only process 0 writes logs.
* Checkpoints: every process takes part in orbax's save and restore (each writes its shards); the
  data item holds every host's iterator position (:func:`data_state_to_save`).

Eval: each host evaluates every P-th held-out prompt under its index in the held-out set and the
per-prompt outcomes are gathered back into order: the figures are those of one process
evaluating them all, while every host's engine does 1/P of the work.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import urllib.request
from collections.abc import Callable, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from qarl_jax import sharding
from qarl_jax.data import DataConfig
from qarl_jax.errors import CheckpointError, ConfigError, DistributedError

ENV = {
    "coordinator": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
}


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"{name}={raw!r} is not an integer") from None


# where a Cloud TPU slice lists its hosts: GKE's variables (what JAX's GKE detection reads), else
# the GCE metadata attribute of a TPU VM (what JAX's GCE detection reads), comma-separated
TPU_HOSTS_ENV = ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES")
TPU_HOSTS_METADATA = "worker-network-endpoints"


def tpu_slice_hosts(environ: Mapping[str, str], metadata: Callable[[str], str | None]) -> int:
    """How many hosts the Cloud TPU slice(s) of this VM hold, from what the VM states: the host list
    of $TPU_PROCESS_ADDRESSES / $TPU_WORKER_HOSTNAMES (GKE) or else ``metadata`` (the TPU VM's
    metadata server: ``worker-network-endpoints``), times $MEGASCALE_NUM_SLICES (multislice). 1 for
    one host, or when nothing lists any."""
    hosts = next((environ[k] for k in TPU_HOSTS_ENV if environ.get(k)), None) or metadata(TPU_HOSTS_METADATA)
    if not hosts or not hosts.strip():
        return 1
    slices = environ.get("MEGASCALE_NUM_SLICES") or "1"
    if not slices.isdigit():
        raise DistributedError(f"MEGASCALE_NUM_SLICES={slices!r} is not an integer")
    return len(hosts.strip().split(",")) * int(slices)


def gce_metadata(key: str) -> str | None:
    """An instance attribute from the GCE metadata server (at $GCE_METADATA_IP when set, as JAX
    reads it); None when there is none or the server cannot be reached."""
    host = os.environ.get("GCE_METADATA_IP", "metadata.google.internal")
    url = f"http://{host}/computeMetadata/v1/instance/attributes/{key}"
    request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.read().decode()
    except (OSError, ValueError):  # HTTPError (no such attribute) and URLError are OSErrors
        return None


def on_cloud_tpu_vm() -> bool:
    """Whether this is a Cloud TPU VM that JAX will use: ``import jax`` found TPU chips on the PCI
    bus and libtpu (its own test, kept in ``jax._src.cloud_tpu_init``), and JAX_PLATFORMS allows
    TPUs."""
    from jax._src import cloud_tpu_init

    platforms = getattr(jax.config, "jax_platforms", None) or "tpu"  # untyped in JAX's stubs
    return bool(getattr(cloud_tpu_init, "running_in_cloud_tpu_vm", False)) and "tpu" in platforms


def slice_hosts() -> int:
    """:func:`tpu_slice_hosts` of this machine: 1 anywhere but a Cloud TPU VM (no network asked)."""
    return tpu_slice_hosts(os.environ, gce_metadata) if on_cloud_tpu_vm() else 1


def maybe_initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    auto: bool = False,
) -> None:
    """Join the process group the arguments (else $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES,
    $JAX_PROCESS_ID) describe; ``auto``: let JAX detect it (Cloud TPU, SLURM, Open MPI,
    Kubernetes). With nothing given on a Cloud TPU VM of a multi-host slice (:func:`slice_hosts`),
    ``auto`` is implied: every host of a slice must join, and a flag is easy to forget. Nothing to
    do for one process. Must run before anything touches a device."""
    coordinator = coordinator or os.environ.get(ENV["coordinator"])
    if num_processes is None:
        num_processes = _env_int(ENV["num_processes"])
    if process_id is None:
        process_id = _env_int(ENV["process_id"])
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    if not auto and all(v is None for v in given.values()) and (hosts := slice_hosts()) > 1:
        print(f"qarl: a Cloud TPU slice of {hosts} hosts: joining them (jax.distributed)", file=sys.stderr)
        auto = True
    if not auto:
        if num_processes == 1 or all(v is None for v in given.values()):
            return
        missing = [f"--{k.replace('_', '-')} (or ${ENV[k]})" for k, v in given.items() if v is None]
        if missing:
            raise DistributedError(f"a multi-process run needs {', '.join(missing)} as well")
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id)
    except (RuntimeError, ValueError, TypeError) as e:
        raise DistributedError(f"jax.distributed.initialize({given}) failed: {e}") from e


def is_primary() -> bool:
    """Process 0: the one that writes the run's logs and exports."""
    return jax.process_index() == 0


def host_data(config: DataConfig) -> DataConfig:
    """This process's prompt stream: an even share of ``data.batch_size`` (global) per batch. Several
    processes need an endless stream: their shards would run out at different steps."""
    count = jax.process_count()
    if config.batch_size % count:
        raise ConfigError(f"data.batch_size ({config.batch_size}) must divide evenly over {count} processes")
    if count > 1 and config.num_epochs is not None:
        raise ConfigError(f"data.num_epochs must be null with {count} processes (hosts' shards end apart)")
    return dataclasses.replace(config, batch_size=config.batch_size // count)


def local_mesh(mesh: Mesh) -> Mesh:
    """``mesh``'s devices of this process, as a one-axis mesh (where a host's replica of the
    weights is assembled before its move to the rollout engine: :func:`local_replica`)."""
    mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    return Mesh(np.asarray(mine), ("local",))


def local_replica(tree, global_mesh: Mesh, mesh: Mesh):
    """Arrays on ``global_mesh`` -> full copies replicated over the local ``mesh`` (collective: every
    process calls it, with the same tree); the tree as is on one process (the engine moves it)."""
    if jax.process_count() == 1:
        return tree
    replicated = NamedSharding(mesh, PartitionSpec())

    def local(x: jax.Array) -> jax.Array:
        if not x.is_fully_replicated:
            x = _replicate(global_mesh)(x)
        return jax.make_array_from_single_device_arrays(
            x.shape, replicated, [s.data for s in x.addressable_shards]
        )

    return jax.tree.map(local, tree)


@functools.cache
def _replicate(mesh: Mesh):
    """The all-gather to a layout replicated over ``mesh``; one jitted function per mesh, so each
    weight shape compiles once."""
    return jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))


def global_batch(batch, mesh: Mesh | None, rules):
    """Every process's rows of the training batch (a pytree of host arrays, rows first) -> one
    global array per leaf, rows over the mesh's batch axes (process-major). One process: the host
    batch as is (the trainer places it)."""
    if jax.process_count() == 1:
        return batch
    if mesh is None:
        raise DistributedError("global_batch: a multi-process run needs the trainer's mesh, got None")
    return jax.tree.map(
        lambda v: jax.make_array_from_process_local_data(sharding.batch_sharding(mesh, v.ndim, rules), v),
        batch,
    )


def gather(tree):
    """On every process (collective): host arrays, the same shape on every process -> all of them,
    concatenated on axis 0 in process order; global arrays -> their whole value, on the host. Goes
    through the devices, so 64-bit values arrive as 32-bit."""
    if jax.process_count() == 1:
        return tree
    return multihost_utils.process_allgather(tree, tiled=True)


def gather_json(obj) -> list:
    """Every process's JSON-serialisable ``obj``, in process order (collective)."""
    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = gather(np.asarray([raw.size], np.int32))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: raw.size] = raw
    rows = gather(padded[None]).reshape(len(sizes), -1)
    return [json.loads(row[:size].tobytes()) for row, size in zip(rows, sizes, strict=True)]


def data_state_to_save(state: dict) -> dict:
    """The data item of a checkpoint: one process's iterator state as is; several processes'
    states in process order (each host's shard is at its own position)."""
    return state if jax.process_count() == 1 else {"processes": gather_json(state)}


def own_data_state(saved: dict, where: str) -> dict:
    """This process's iterator state from a checkpoint's data item (see :func:`data_state_to_save`);
    a checkpoint of another process count cannot continue the same per-host shards."""
    states = saved["processes"] if "processes" in saved else [saved]
    if len(states) != jax.process_count():
        raise CheckpointError(
            f"{where} was written by {len(states)} process(es), this run has {jax.process_count()}: "
            "the data shards differ, so it cannot resume this run (use another run.output_dir)"
        )
    return states[jax.process_index()]
