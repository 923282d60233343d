"""Hugging Face checkpoint import/export: config.json + (sharded) safetensors + tokenizer.json, from
a local directory or ``gs://``. The config translation is :mod:`qarl_jax.models.hf_config`, the file
layer and the tensor names <-> parameter paths :mod:`qarl_jax.models.safetensors_io`.

Loading (:func:`load_params`): each parameter leaf is built shard by shard with
``jax.make_array_from_callback``; a host reads, by ranged reads, only the rows of each stored tensor
that its devices' shards need (a run of rows is one contiguous byte range), in runs of at most
:data:`~qarl_jax.models.safetensors_io.CHUNK_BYTES`, and copies each run into the shards it touches.
Kernels are stored [out, in] and used [in, out]; experts are stored per expert on the Hub
(``mlp.experts.{j}.gate_proj.weight``) and stacked [E, in, out] here; a scanned model
(``TransformerConfig.scan_layers``) stacks each run's layers on a leading axis: these are read per
layer and per expert, never as a whole leaf.

**Host memory bound while loading**: the host's share of the parameters (its devices' shards,
replicated leaves once per device holding them) plus a working set of: the host's shards of the one
leaf being built (for a scanned model one stacked leaf: all its layers of one projection), one read
run (at most ``CHUNK_BYTES`` = 64 MiB and at most one device's shard of that tensor, or one row
where a row is larger), and for a compressed-tensors checkpoint one stored projection (one
layer's, one expert's) dequantized to f32. No whole leaf is read or built where the host holds a
part (``tests/test_models_hf_io.py::test_sharded_load_reads_no_more_than_a_shard_at_once``); each
stored byte a host needs is read once.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from qarl_jax.errors import CheckpointError
from qarl_jax.models.compressed_tensors import CompressedCheckpoint, open_compressed
from qarl_jax.models.config import TransformerConfig, dtype_name
from qarl_jax.models.hf_config import config_from_hf, config_to_hf, load_config
from qarl_jax.models.qwen3 import Qwen3ForCausalLM
from qarl_jax.models.safetensors_io import (
    CHUNK_BYTES,
    INDEX_FILE,
    SINGLE_FILE,
    PathLike,
    SafetensorsReader,
    as_path,
    host_array,
    is_kernel,
    param_location,
    save_tokenizer,
    tensor_layout,
    weight_files,
    write_safetensors,
)

Block = tuple[tuple[int, int], ...]  # a shard's [start, stop) per leaf dimension
_ALIGN = 64  # bytes: the alignment at which JAX's CPU client takes a host buffer without a copy


@dataclasses.dataclass
class _Leaf:
    """One parameter leaf and the stored tensors it is made of: ``names[l][j]`` is layer ``l``'s
    (stacked leaves; else one entry) expert ``j``'s (expert leaves; else one entry) tensor."""

    path: tuple[str, ...]
    shape: tuple[int, ...]  # the leaf's global shape
    kernel: bool
    stacked: bool
    experts: bool
    names: list[list[str]]


def _leaves(config: TransformerConfig) -> Iterator[_Leaf]:
    """The params' leaves in :func:`tensor_layout` order (a stacked leaf where its first layer is)."""
    leaves: dict[tuple[str, ...], _Leaf] = {}
    for path, names, shape in tensor_layout(config):
        where, index = param_location(config, path)
        listed = names if isinstance(names, list) else [names]
        if where not in leaves:
            leaves[where] = _Leaf(
                where, shape, is_kernel(path), index is not None, isinstance(names, list), []
            )
        leaves[where].names.append(listed)
    for leaf in leaves.values():
        if leaf.stacked:
            leaf.shape = (len(leaf.names), *leaf.shape)
        yield leaf


def _block(index: tuple[slice, ...], shape: tuple[int, ...]) -> Block:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


class _Source:
    """The checkpoint's stored tensors: open files, the quantized ones, what each name should be."""

    def __init__(self, files: dict, quantized: CompressedCheckpoint | None):
        self.files, self.quantized = files, quantized
        self.handles: dict = {}

    def reader(self, name: str) -> SafetensorsReader:
        if name not in self.files:
            where = sorted({p.name for p in self.files.values()})
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint (files: {where})")
        f = self.files[name]
        if f not in self.handles:
            self.handles[f] = SafetensorsReader(f)
        if name not in self.handles[f].tensors:
            raise CheckpointError(
                f"{f}: the index places tensor {name!r} here, but the file does not hold it"
            )
        return self.handles[f]

    def check(self, name: str, hf_shape: tuple[int, ...]) -> None:
        """Refuse a stored tensor whose shape is not the config's (from its header: nothing read)."""
        if self.quantized is not None and self.quantized.holds(name):
            return  # checked once dequantized
        reader = self.reader(name)
        if reader.shape(name) != hf_shape:
            raise CheckpointError(
                f"{reader.path}: tensor {name!r} has shape {reader.shape(name)}, "
                f"the config implies {hf_shape}"
            )

    def runs(self, name: str, hf_shape: tuple[int, ...], rows: list[tuple[int, int]], shard: int):
        """(first row, array of the stored layout) runs covering ``rows`` (merged intervals) of
        ``name``, each at most ``CHUNK_BYTES`` and at most ``shard`` elements (the smallest shard of
        it a device holds), or one row where a row is larger; a quantized tensor comes
        dequantized whole."""
        q = self.quantized
        if q is not None and q.holds(name):
            arr = q.dequantize(name, lambda stored: self.reader(stored).read(stored))
            if arr.shape != hf_shape:
                raise CheckpointError(
                    f"quantized tensor {name!r} has shape {arr.shape}, the config implies {hf_shape}"
                )
            yield 0, arr
            return
        reader = self.reader(name)
        row = max(1, int(np.prod(hf_shape[1:])))
        step = max(1, min(CHUNK_BYTES // (row * reader.dtype(name).itemsize), shard // row))
        for start, stop in rows:
            for r0 in range(start, stop, step):
                yield r0, reader.read_rows(name, r0, min(r0 + step, stop))

    def close(self) -> None:
        for handle in self.handles.values():
            handle.close()


def _merged(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _fill(leaf: _Leaf, source: _Source, buffers: dict[Block, np.ndarray]) -> None:
    """Fill the shard ``buffers`` (keyed by their block of ``leaf``) from the stored tensors, each
    read once, only the rows some block needs."""
    p = int(leaf.stacked) + int(leaf.experts)  # leading axes: layer, expert
    tshape = leaf.shape[p:]
    hf_shape = (tshape[1], tshape[0]) if leaf.kernel else tshape

    def rows_cols(block: Block) -> tuple[tuple[int, int], tuple[slice, ...]]:
        t = block[p:]
        if leaf.kernel:
            return t[1], (slice(*t[0]),)
        return t[0], tuple(slice(*c) for c in t[1:])

    for li, layer in enumerate(leaf.names):
        for j, name in enumerate(layer):
            source.check(name, hf_shape)
            lead = ((li,) if leaf.stacked else ()) + ((j,) if leaf.experts else ())
            users = [b for b in buffers if all(a <= x < z for x, (a, z) in zip(lead, b, strict=False))]
            if not users:
                continue
            rows = _merged([rows_cols(b)[0] for b in users])
            shard = min(int(np.prod([z - a for a, z in b[p:]])) for b in users)
            for r0, data in source.runs(name, hf_shape, rows, shard):
                r1 = r0 + data.shape[0]
                for b in users:
                    (a, z), cols = rows_cols(b)
                    lo, hi = max(a, r0), min(z, r1)
                    if lo >= hi:
                        continue
                    piece = data[(slice(lo - r0, hi - r0), *cols)]
                    at = tuple(x - s for x, (s, _) in zip(lead, b, strict=False))
                    dest: tuple[Any, ...] = (*at, slice(None)) if leaf.kernel else at
                    buffers[b][(*dest, slice(lo - a, hi - a))] = piece.T if leaf.kernel else piece


def _aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary: JAX's CPU client then adopts
    it as the device buffer instead of copying it (so a CPU host does not hold a leaf twice while
    placing it); other backends copy it to the device either way."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(n + _ALIGN, np.uint8)
    skip = -raw.ctypes.data % _ALIGN
    return raw[skip : skip + n].view(dtype).reshape(shape)


def _build(leaf: _Leaf, source: _Source, dtype, sharding) -> jax.Array:
    """``leaf`` as a ``jax.Array`` placed with ``sharding`` (None: whole, on the default device),
    holding on the host only this host's shards of it, each dropped once placed."""
    if sharding is None:
        whole = tuple((0, n) for n in leaf.shape)
        buffers = {whole: np.empty(leaf.shape, dtype)}
        _fill(leaf, source, buffers)
        return jax.device_put(buffers.pop(whole))
    blocks = [_block(i, leaf.shape) for i in sharding.addressable_devices_indices_map(leaf.shape).values()]
    uses = collections.Counter(blocks)
    buffers = {b: _aligned_empty(tuple(z - a for a, z in b), dtype) for b in uses}
    _fill(leaf, source, buffers)

    def shard(index: tuple[slice, ...] | None) -> np.ndarray:
        b = _block(index or (), leaf.shape)
        uses[b] -= 1
        return buffers[b] if uses[b] else buffers.pop(b)

    return jax.make_array_from_callback(leaf.shape, sharding, shard)


def load_params(ckpt: PathLike, config: TransformerConfig, shardings: dict | None = None) -> dict:
    """The checkpoint's parameters as a params tree, each leaf placed with ``shardings`` (a tree of
    ``jax.sharding.Sharding`` matching the params; None: whole arrays on the default device). Each
    host reads only its shards' rows: see the module docstring for the host-memory bound.
    ``config`` is the checkpoint's (:func:`load_config`): a compressed-tensors checkpoint's
    ``quantization_config`` comes from it, so config.json is not read again."""
    ckpt = as_path(ckpt)
    files = weight_files(ckpt)
    quantized = open_compressed(str(ckpt / "config.json"), config, set(files))
    dtype = jnp.dtype(config.param_dtype)
    params: dict = {}
    expected: set[str] = set()
    source = _Source(files, quantized)
    try:
        for leaf in _leaves(config):
            sharding = None
            if shardings is not None:
                sharding = shardings
                for key in leaf.path:
                    sharding = sharding[key]
            node = params
            for key in leaf.path[:-1]:
                node = node.setdefault(key, {})
            node[leaf.path[-1]] = _build(leaf, source, dtype, sharding)
            for names in leaf.names:
                for name in names:
                    held = quantized is not None and quantized.holds(name)
                    expected |= quantized.stored(name) if held else {name}  # type: ignore[union-attr]
    finally:
        source.close()
    # a tied checkpoint may still hold lm_head.weight; older exports hold RoPE's frequency buffers
    unexpected = sorted(n for n in set(files) - expected - {"lm_head.weight"} if "rotary_emb." not in n)
    if unexpected:
        raise CheckpointError(
            f"{ckpt}: {len(unexpected)} tensors do not belong to a {config.architecture} with this "
            f"config, e.g. {unexpected[:5]}"
        )
    return params


def load_tokenizer(ckpt: PathLike):
    """The checkpoint's ``tokenizer.json`` through ``tokenizers`` (local or ``gs://``), or None if it
    has none."""
    from tokenizers import Tokenizer

    f = as_path(ckpt) / "tokenizer.json"
    if not f.exists():
        return None
    try:
        return Tokenizer.from_str(f.read_text())
    except Exception as e:
        raise CheckpointError(f"{f}: cannot load tokenizer ({e})") from e


def from_pretrained(
    ckpt: PathLike,
    dtype: DTypeLike = "float32",
    compute_dtype: DTypeLike | None = None,
    quant=None,
    shardings: dict | None = None,
    **overrides,
):
    """Load a Hugging Face directory (local or ``gs://``) of one of the :data:`FAMILIES` (Qwen3,
    Qwen3-MoE, Qwen2/Qwen2.5, Llama 3) -> ``(model, params, tokenizer)``.

    ``model.apply({"params": params}, tokens)`` gives logits. ``dtype`` is the parameter dtype,
    ``compute_dtype`` the matmul dtype (default: ``dtype``), each a name or a JAX/NumPy dtype;
    ``shardings`` places each tensor directly with its sharding (see
    ``qarl_jax.sharding.param_shardings``), each host reading only its shards; ``overrides`` are
    further :class:`TransformerConfig` fields (``scan_layers=True``: the stacked layout)."""
    dtype = dtype_name(dtype, "from_pretrained dtype")
    compute_dtype = dtype if compute_dtype is None else dtype_name(compute_dtype, "compute_dtype")
    config = load_config(ckpt, param_dtype=dtype, dtype=compute_dtype, **overrides)
    model = Qwen3ForCausalLM(config, quant)
    return model, load_params(ckpt, config, shardings), load_tokenizer(ckpt)


def save_pretrained(
    ckpt: PathLike,
    config: TransformerConfig,
    params: dict,
    tokenizer=None,
    max_shard_bytes: int = 2 * 1024**3,
) -> None:
    """Write ``params`` as a Hugging Face directory transformers loads (safetensors, sharded with an
    index past ``max_shard_bytes``), plus config.json and tokenizer.json if given.

    With several processes every process calls it (collective) with the global arrays: each leaf,
    and each layer of a stacked leaf, is gathered one at a time (:func:`host_array`), and process 0
    alone writes. **Host peak** beyond the run's own: the tensor being gathered (one layer's leaf,
    all experts of an MoE projection) across each host's devices (host RAM only on CPU devices) and,
    on process 0, once in RAM, plus a 64 MiB copy piece: :func:`write_safetensors` spools each
    tensor to local disk as it comes (one file's worth of local disk, not RAM). Measured on two
    hosts of CPU devices (256 MiB files, largest tensor 0.071x): 0.36x the f32 model on process 0,
    0.28x on the other, which writes nothing (the reshard on its devices)
    (``benchmarks/host_ram.py --export``, benchmarks/RESULTS.md)."""
    ckpt = as_path(ckpt)
    primary = jax.process_index() == 0

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        for path, names, _ in tensor_layout(config):
            where, index = param_location(config, path)
            node: Any = params
            for key in where:
                node = node[key]
            leaf = node if index is None else node[index]  # one layer of a stack
            if is_kernel(path):  # [out, in] as stored, transposed on the devices: written without a copy
                leaf = jnp.swapaxes(leaf, -1, -2)
            arr = host_array(leaf, wanted=primary)
            if arr is None:
                continue
            if isinstance(names, list):
                for j, name in enumerate(names):
                    yield name, arr[j]
            else:
                yield names, arr
            del arr  # the writer holds what it has not written yet; the rest goes before the next gather

    if not primary:
        for _ in tensors():  # the gathers are collective: take part, write nothing
            pass
        return
    write_safetensors(ckpt, tensors(), max_shard_bytes)
    hf = config_to_hf(config)
    hf.pop("quantization_config", None)  # dense weights, even from a compressed starting checkpoint
    (ckpt / "config.json").write_text(json.dumps(hf, indent=2))
    if tokenizer is not None:
        save_tokenizer(ckpt, tokenizer)


__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "CheckpointError",
    "config_from_hf",
    "config_to_hf",
    "from_pretrained",
    "load_config",
    "load_params",
    "load_tokenizer",
    "param_location",
    "save_pretrained",
    "tensor_layout",
    "write_safetensors",
]
