"""Device mesh and logical-axis rules. (Custom kernels run per device through
``qarl_jax.models.ops.per_device``, a ``shard_map`` over the batch rows.)

Parameters and activations are annotated with logical axis names (``embed``, ``mlp``, ``batch``,
...). Rules map them onto the mesh axes ``data``, ``fsdp``, ``tensor`` and ``expert``; changing the
parallelism is a config change, not a code change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# logical name -> mesh axis (or axes, or None = replicated)
Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]
DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp", "expert")),
    ("length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("experts", "expert"),
    ("expert_mlp", "tensor"),
    ("norm", None),
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape; one axis may be -1 to take the remaining devices."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1
    rules: Rules = DEFAULT_RULES

    def shape(self, num_devices: int) -> dict[str, int]:
        sizes = {a: getattr(self, a) for a in MESH_AXES}
        free = [a for a, s in sizes.items() if s == -1]
        bad = [a for a, s in sizes.items() if s == 0 or s < -1]
        if bad or len(free) > 1:
            raise ValueError(f"mesh axes must be positive with at most one -1, got {sizes}")
        known = math.prod(s for s in sizes.values() if s != -1)
        if free:
            if num_devices % known:
                raise ValueError(
                    f"cannot fill mesh axis {free[0]!r}: {num_devices} devices, fixed axes {sizes}"
                )
            sizes[free[0]] = num_devices // known
        if math.prod(sizes.values()) != num_devices:
            raise ValueError(
                f"mesh {sizes} needs {math.prod(sizes.values())} devices, {num_devices} available"
            )
        known_axes = set(MESH_AXES)
        for logical, axes in self.rules:
            for a in (axes,) if isinstance(axes, str) else axes or ():
                if a not in known_axes:
                    raise ValueError(f"sharding rule {logical!r} -> {axes!r} names unknown mesh axis {a!r}")
        return sizes


def mesh_axis_names(axes: str | Sequence[str] | None) -> tuple[str, ...]:
    """One entry of a PartitionSpec (None, an axis name or a tuple of names) as a tuple of names."""
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def axis_ways(axes: str | Sequence[str] | None, mesh: Mesh | AbstractMesh | Mapping[str, int]) -> int:
    """Into how many shards a PartitionSpec entry splits a dimension on ``mesh`` (a mesh, an
    abstract mesh or a mapping of axis sizes)."""
    shape = mesh if isinstance(mesh, Mapping) else mesh.shape
    return math.prod(shape[a] for a in mesh_axis_names(axes))


def batch_axes(rules: Rules | None = None) -> tuple[str, ...]:
    """The mesh axes the logical "batch" axis maps to (``rules`` None: Flax's active rules)."""
    spec = nn.logical_to_mesh_axes(("batch",), rules)
    assert spec is not None, "a spec is None only for None axis names"
    return mesh_axis_names(spec[0])


def batch_ways(mesh: Mesh | AbstractMesh | Mapping[str, int], rules: Rules | None = None) -> int:
    """How many devices split the batch rows: the product of the batch axes' sizes. Every place
    that shards sequences (kernels per device, the trainer's batch, the engine's slots, the memory
    plan) counts it here, so they agree on which row lands where."""
    return axis_ways(batch_axes(rules), mesh)


def batch_sharding(
    mesh: Mesh, ndim: int, rules: Rules | None = None, rows: int | None = None
) -> NamedSharding:
    """Rows (the leading axis of an ``ndim``-dimensional array) over the batch axes, the rest
    replicated; replicated whole when ``rows`` is given and does not split evenly."""
    names = batch_axes(rules)
    if rows is not None and rows % axis_ways(names, mesh):
        return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, PartitionSpec(names or None, *([None] * (ndim - 1))))


def fitting_spec(
    shape: Sequence[int],
    logical: Sequence[str | None],
    mesh: Mesh | AbstractMesh | Mapping[str, int],
    rules: Rules | None = None,
) -> PartitionSpec:
    """The PartitionSpec of ``logical`` axis names under ``rules``, with every dimension its mesh
    axes do not divide evenly left replicated (no padding shards)."""
    spec = nn.logical_to_mesh_axes(tuple(logical), rules)
    assert spec is not None, "a spec is None only for None axis names"
    return PartitionSpec(
        *(axes if d % axis_ways(axes, mesh) == 0 else None for d, axes in zip(shape, spec, strict=True))
    )


def make_mesh(config: MeshConfig = MeshConfig(), devices: Sequence[jax.Device] | None = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    sizes = config.shape(len(devices))
    arr = np.asarray(devices).reshape([sizes[a] for a in MESH_AXES])
    return Mesh(arr, MESH_AXES)


@contextlib.contextmanager
def activate(mesh: Mesh, rules=DEFAULT_RULES):
    """Make ``mesh`` and the logical rules current, so the models' activation constraints apply."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


def logical_to_sharding(tree, mesh: Mesh | AbstractMesh, rules=DEFAULT_RULES):
    """Boxed (logically partitioned) tree -> matching tree of NamedSharding (unboxed structure)."""
    specs = nn.get_partition_spec(tree)
    return nn.logical_to_mesh_sharding(specs, mesh, rules)  # type: ignore[arg-type]  # flax takes AbstractMesh too


def abstract_variables(model: nn.Module) -> dict:
    """``model``'s variables as shape structs, still boxed with their logical axes. The key and
    tokens are made inside the traced function, so nothing runs: not even under a mesh of TPU
    device descriptions (a topology with no chip attached), where an eager op has nowhere to run."""
    return jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))


def param_shardings(model: nn.Module, mesh: Mesh, rules=DEFAULT_RULES) -> dict:
    """NamedSharding for every parameter of ``model`` (for init, loading and the train step)."""
    return logical_to_sharding(abstract_variables(model), mesh, rules)["params"]


def place(tree, shardings):
    """Device-put a host tree with a matching tree of shardings."""
    return jax.tree.map(lambda x, s: jax.device_put(x, s), tree, shardings)
