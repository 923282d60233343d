"""The safetensors file layer: a reader with ranged reads (local files and ``gs://`` through
:class:`etils.epath.Path`), the writer, and the tensor layout (HF tensor names <-> our parameter
paths and shapes).

Why ranged reads: a host of a pod slice holds only its devices' shards of each parameter. A
safetensors file is a JSON header giving each tensor's byte range, then the raw bytes; a run of
rows of a tensor (a slice of its leading axis) is one contiguous byte range, so a host reads the
rows its shards need and never the whole file: no download of the checkpoint on every host, no
whole tensor in memory where a host holds a part (:func:`qarl_jax.models.hf_io.load_params`).

``gs://`` goes through etils' fsspec/gcsfs backend (``EPATH_USE_TF=false``, set by :mod:`qarl_jax.storage`
unless the environment says otherwise): TensorFlow's gfile backend ignores ``STORAGE_EMULATOR_HOST`` and pulls
TensorFlow into every process that reads a checkpoint.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qarl_jax.errors import CheckpointError
from qarl_jax.models.config import TransformerConfig
from qarl_jax.models.stacking import layer_location
from qarl_jax.storage import epath, move

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# the most bytes one ranged read fetches: the loader reads a tensor's rows in runs of at most this
# many bytes (at least one row), so its working set beyond the shards it builds is one such run
CHUNK_BYTES = 64 * 1024**2

DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,  # fp8 weights of a compressed-tensors checkpoint
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}

PathLike: TypeAlias = str | os.PathLike[str] | epath.Path


def as_path(path: PathLike) -> epath.Path:
    """``path`` as the project's path type: a local path, or ``gs://bucket/...``."""
    return epath.Path(path)


def _is_local(path: epath.Path) -> bool:
    return "://" not in os.fspath(path)


class SafetensorsReader:
    """Reads tensors, or runs of a tensor's rows, by byte range into fresh arrays.

    Local files are read with ``pread``: safetensors' own ``safe_open`` memory-maps the file, and
    every page it touches stays resident until the file is closed (a one-file checkpoint loaded that
    way costs twice its size in RSS). Remote files (``gs://``) are read through the path's fsspec
    filesystem (gcsfs), each read one ranged request."""

    def __init__(self, path: PathLike):
        self.path = as_path(path)
        self._fd: int | None = None
        self._fs: Any = None
        if _is_local(self.path):
            self._fd = os.open(os.fspath(self.path), os.O_RDONLY)
            size = os.fstat(self._fd).st_size
        else:  # one ranged GET a read (fsspec's file objects read ahead and cache: not wanted here)
            import fsspec

            self._fs, self._key = fsspec.core.url_to_fs(os.fspath(self.path))
            size = self._fs.size(self._key)
        self._size = size
        try:
            head = self._bytes(0, min(8, size))
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= size - 8:
                raise CheckpointError(f"{path}: not a safetensors file (header size {n}, file size {size})")
            header = json.loads(self._bytes(8, n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            self.close()
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from e
        except CheckpointError:
            self.close()
            raise
        header.pop("__metadata__", None)
        self._base, self.tensors = 8 + n, header

    def _bytes(self, offset: int, n: int) -> bytes:
        out = bytearray(n)
        self._read_into(memoryview(out), offset)
        return bytes(out)

    def _read_into(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` with the file's bytes from ``offset`` on: the one place bytes are read."""
        done, n = 0, len(view)
        while done < n:
            if self._fd is not None:
                got = os.preadv(self._fd, [view[done:]], offset + done)
            else:
                data = self._fs.cat_file(self._key, start=offset + done, end=offset + n)
                got = len(data)
                view[done : done + got] = data
            if not got:
                raise CheckpointError(f"{self.path}: short read at byte {offset + done}")
            done += got

    def keys(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        return self._info(name)[1]

    def _info(self, name: str) -> tuple[int, np.dtype, tuple[int, ...]]:
        """(first byte in the file, dtype, shape) of ``name``, its byte range checked."""
        info = self.tensors[name]
        begin, end = info["data_offsets"]
        if info["dtype"] not in DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        if self._base + end > self._size:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} ends at byte {self._base + end} but the file has "
                f"{self._size} bytes; the file is truncated"
            )
        dtype, shape = np.dtype(DTYPES[info["dtype"]]), tuple(info["shape"])
        if int(np.prod(shape)) * dtype.itemsize != end - begin:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has {end - begin} bytes for shape {list(shape)}"
            )
        return self._base + begin, dtype, shape

    def read(self, name: str) -> np.ndarray:
        """The whole tensor ``name``."""
        shape = self.shape(name)
        return self.read_rows(name, 0, shape[0]) if shape else self._read_rows(name, None)

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` (a slice of the leading axis) of ``name``: one contiguous range."""
        return self._read_rows(name, (start, stop))

    def _read_rows(self, name: str, rows: tuple[int, int] | None) -> np.ndarray:
        first, dtype, shape = self._info(name)
        if rows is None:  # a 0-d tensor
            out = np.empty(shape, dtype)
        else:
            start, stop = rows
            if not 0 <= start <= stop <= shape[0]:
                raise ValueError(f"rows [{start}, {stop}) of {name!r} with {shape[0]} rows")
            out = np.empty((stop - start, *shape[1:]), dtype)
            first += start * (out.nbytes // max(stop - start, 1))
        if out.nbytes:
            self._read_into(out.reshape(-1).view(np.uint8).data, first)
        return out

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._fs = None


def weight_files(ckpt: PathLike) -> dict[str, epath.Path]:
    """Map every tensor name to the safetensors file holding it (index file, one file, or a glob)."""
    root = as_path(ckpt)
    index = root / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        files = {name: root / f for name, f in weight_map.items()}
        for f in sorted(set(files.values()), key=os.fspath):
            if not f.exists():
                raise CheckpointError(f"{index} lists {f.name}, which is missing from {root}")
        return files
    single = root / SINGLE_FILE
    candidates = [single] if single.exists() else sorted(root.glob("*.safetensors"), key=os.fspath)
    if not candidates:
        raise CheckpointError(f"{root}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors file")
    files = {}
    for f in candidates:
        reader = SafetensorsReader(f)
        files.update({name: f for name in reader.keys()})
        reader.close()
    return files


def host_array(x: Any, *, wanted: bool = True) -> np.ndarray | None:
    """``x`` (one tensor: a leaf, one layer of a stacked leaf) whole on this host as NumPy, or None
    where not ``wanted``. Collective for a global array that this host does not hold whole: every
    process calls it, in the same order, ``wanted`` only where the tensor is used (process 0 of
    the exports, which writes; the others take part and get None).

    The exports (:func:`qarl_jax.models.hf_io.save_pretrained`,
    :func:`qarl_jax.models.compressed_tensors.save_compressed`) gather one tensor at a time with it,
    so no host ever holds the whole model. How a tensor reaches a host: where the host's devices
    hold all of it already (one process; replicated across hosts), each distinct shard is copied
    once into one NumPy buffer. Otherwise one XLA reshard (``jax.device_put``) first makes it whole
    on every host's devices exactly once (split over the host's devices on the axis the tensor is
    split on most, padded to a multiple of their count, replicated across hosts): XLA's own
    collectives move each host's part to the others (ICI / DCN on a pod), and the host then copies
    its devices' distinct pieces into the buffer. So a host holds the tensor once across its devices
    (plus the reshard's buffers: XLA moves each device's shard once, then all-gathers across hosts)
    and, where wanted, once in RAM. On CPU devices, whose memory is host RAM, that measured 2.8x
    the tensor where wanted (the 64 MiB embedding of benchmarks/host_ram.py, 4 CPU devices a
    process) and ~1.5x where not; ``multihost_utils.process_allgather``, used before, replicates it
    on every device: 7-8x (benchmarks/RESULTS.md, 2026-12-06). On an accelerator only the host
    buffer is host RAM.
    Not taken: each process writing its own rows (a safetensors file is one object, and a bucket
    object cannot be written in parts by several writers)."""
    if not isinstance(x, jax.Array):
        return np.asarray(x) if wanted else None
    pieces = _distinct_shards(x)
    if sum(int(np.prod(a.shape)) for _, a in pieces) == x.size:  # this host holds all of it
        return _assemble(x.shape, x.dtype, pieces) if wanted else None
    axis, sharding = _whole_on_each_host(x)
    pad = -x.shape[axis] % sharding.mesh.shape["local"]
    if pad:
        x = jnp.pad(x, [(0, pad if i == axis else 0) for i in range(x.ndim)])
    y = jax.device_put(x, sharding)
    if not wanted:
        y.block_until_ready()  # no run-ahead: one gathered tensor at a time on the devices
        return None
    shape = tuple(n - pad if i == axis else n for i, n in enumerate(y.shape))
    return _assemble(shape, y.dtype, _distinct_shards(y))


def _distinct_shards(x: jax.Array) -> list[tuple[tuple[slice, ...], jax.Array]]:
    """(index, data) of each distinct shard this host holds of ``x`` (replicas once)."""
    pieces: dict[tuple, tuple[tuple[slice, ...], jax.Array]] = {}
    for shard in x.addressable_shards:
        index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(shard.index, x.shape, strict=True))
        pieces.setdefault(tuple((s.start, s.stop) for s in index), (index, shard.data))
    return list(pieces.values())


def _assemble(shape: tuple[int, ...], dtype: Any, pieces: list) -> np.ndarray:
    """One host buffer of ``shape`` from ``pieces`` (index, data), each clipped to ``shape`` (a
    padded axis' tail dropped)."""
    out = np.empty(shape, dtype)
    for index, data in pieces:
        clipped = tuple(slice(s.start, min(s.stop, n)) for s, n in zip(index, shape, strict=True))
        if all(s.start < s.stop for s in clipped):
            part = np.asarray(data)
            out[clipped] = part[tuple(slice(0, s.stop - s.start) for s in clipped)]
    return out


def _whole_on_each_host(x: jax.Array) -> tuple[int, NamedSharding]:
    """(axis, sharding): ``x``'s devices as a (hosts, local) mesh, the tensor split over ``local``
    on the axis ``x`` is split on most (where the reshard is an all-gather across hosts; another
    axis made XLA replicate the tensor on every device first, measured) and replicated across
    ``hosts``. Hosts holding different numbers of ``x``'s devices: one device a row, replicated."""
    devices: list[Any] = list(x.sharding.device_set)
    hosts: dict[int, list[Any]] = {}
    for device in sorted(devices, key=lambda d: (d.process_index, d.id)):
        hosts.setdefault(device.process_index, []).append(device)
    if len({len(ds) for ds in hosts.values()}) == 1:
        grid = np.array(list(hosts.values()), dtype=object)
    else:
        grid = np.array([[d] for ds in hosts.values() for d in ds], dtype=object)
    split = [n // max(m, 1) for n, m in zip(x.shape, x.sharding.shard_shape(x.shape), strict=True)]
    axis = max(range(x.ndim), key=lambda i: (split[i], -i))
    spec = P(*([None] * axis), "local")
    return axis, NamedSharding(Mesh(grid, ("hosts", "local")), spec)


# the numpy dtype -> the safetensors dtype name (DTYPES read the other way)
DTYPE_NAMES: dict[np.dtype, str] = {np.dtype(v): k for k, v in DTYPES.items()}


class _SpooledFile:
    """One safetensors file written a tensor at a time. A safetensors file opens with a header that
    gives every tensor's byte range, so it can only be written once all of its tensors are known;
    the tensors' bytes go to a local spool file as they come (the host holds one tensor, never the
    file), then the header is written and the spool copied behind it in ``CHUNK_BYTES`` pieces
    (to a local file or a ``gs://`` object alike, each streamed)."""

    def __init__(self) -> None:
        self.spool = tempfile.TemporaryFile()  # noqa: SIM115 (closed by write_to)
        self.header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        self.size = 0

    def add(self, name: str, arr: np.ndarray) -> None:
        if arr.dtype not in DTYPE_NAMES:
            raise CheckpointError(f"tensor {name}: dtype {arr.dtype} has no safetensors name")
        data = np.ascontiguousarray(arr)
        self.header[name] = {
            "dtype": DTYPE_NAMES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [self.size, self.size + data.nbytes],
        }
        self.spool.write(data.reshape(-1).view(np.uint8).data)
        self.size += data.nbytes

    def write_to(self, f: epath.Path) -> None:
        header = json.dumps(self.header, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned, as safetensors pads it
        self.spool.seek(0)
        with f.open("wb") as out:
            out.write(len(header).to_bytes(8, "little") + header)
            while piece := self.spool.read(CHUNK_BYTES):
                out.write(piece)
        self.spool.close()


def write_safetensors(
    ckpt: PathLike, tensors: Iterable[tuple[str, np.ndarray]], max_shard_bytes: int = 2 * 1024**3
) -> None:
    """Write named host arrays as ``ckpt``'s safetensors: one file, or shards of at most
    ``max_shard_bytes`` with an index; replaces the directory's old weight files.

    Streams: ``tensors`` is consumed one at a time, each tensor's bytes spooled to a local
    temporary file and dropped (:class:`_SpooledFile`), each shard written (under a temporary name,
    renamed once the shard count is known) as soon as the next tensor would overflow it. Host
    memory: the one tensor being added plus a ``CHUNK_BYTES`` copy buffer; local disk: one shard's
    spool (``max_shard_bytes``, or one larger tensor)."""
    root = as_path(ckpt)
    root.mkdir(parents=True, exist_ok=True)
    for old in list(root.glob("*.safetensors")) + list(root.glob("*.safetensors.part")) + [root / INDEX_FILE]:
        if old.exists():
            old.unlink()

    written: list[tuple[epath.Path, list[str], int]] = []  # (temporary file, names, bytes) a shard
    shard, names = _SpooledFile(), list[str]()

    def flush() -> None:
        part = root / f"shard-{len(written) + 1:05d}.safetensors.part"
        shard.write_to(part)
        written.append((part, names, shard.size))

    for name, arr in tensors:
        if shard.size and shard.size + arr.nbytes > max_shard_bytes:
            flush()
            shard, names = _SpooledFile(), list[str]()
        shard.add(name, arr)
        names.append(name)
        del arr
    flush()
    if len(written) == 1:
        move(written[0][0], root / SINGLE_FILE)
        return
    weight_map = {}
    for i, (part, shard_names, _) in enumerate(written):
        fname = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        move(part, root / fname)
        weight_map.update(dict.fromkeys(shard_names, fname))
    listing = {"metadata": {"total_size": sum(n for *_, n in written)}, "weight_map": weight_map}
    (root / INDEX_FILE).write_text(json.dumps(listing, indent=2))


def tensor_layout(
    config: TransformerConfig,
) -> Iterator[tuple[tuple[str, ...], str | list[str], tuple[int, ...]]]:
    """(param path, HF tensor name(s), our shape) for every parameter; experts list one name each.
    Kernels are [in, out] here and [out, in] in the file; experts stack as [E, in, out]."""
    c = config
    h, kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    yield ("embed_tokens", "embedding"), "model.embed_tokens.weight", (c.vocab_size, c.hidden_size)
    for i in range(c.num_hidden_layers):
        pre, hf = (f"layers_{i}",), f"model.layers.{i}."
        attn = (
            ("q_proj", c.hidden_size, h * d),
            ("k_proj", c.hidden_size, kv * d),
            ("v_proj", c.hidden_size, kv * d),
            ("o_proj", h * d, c.hidden_size),
        )
        for name, k_in, n_out in attn:
            yield pre + ("self_attn", name, "kernel"), f"{hf}self_attn.{name}.weight", (k_in, n_out)
            if c.spec.qkv_bias and name != "o_proj":
                yield pre + ("self_attn", name, "bias"), f"{hf}self_attn.{name}.bias", (n_out,)
        if c.spec.qk_norm:
            for name in ("q_norm", "k_norm"):
                yield pre + ("self_attn", name, "scale"), f"{hf}self_attn.{name}.weight", (d,)
        for name in ("input_layernorm", "post_attention_layernorm"):
            yield pre + (name, "scale"), f"{hf}{name}.weight", (c.hidden_size,)
        if c.is_moe_layer(i):
            e, inter = c.num_experts, c.moe_intermediate_size
            yield pre + ("mlp", "router", "kernel"), f"{hf}mlp.gate.weight", (c.hidden_size, e)
            for name, k_in, n_out in (
                ("gate_proj", c.hidden_size, inter),
                ("up_proj", c.hidden_size, inter),
                ("down_proj", inter, c.hidden_size),
            ):
                names = [f"{hf}mlp.experts.{j}.{name}.weight" for j in range(e)]
                yield pre + ("mlp", "experts", name, "kernel"), names, (e, k_in, n_out)
        else:
            inter = c.intermediate_size
            for name, k_in, n_out in (
                ("gate_proj", c.hidden_size, inter),
                ("up_proj", c.hidden_size, inter),
                ("down_proj", inter, c.hidden_size),
            ):
                yield pre + ("mlp", name, "kernel"), f"{hf}mlp.{name}.weight", (k_in, n_out)
    yield ("norm", "scale"), "model.norm.weight", (c.hidden_size,)
    if not c.tie_word_embeddings:
        yield ("lm_head", "kernel"), "lm_head.weight", (c.hidden_size, c.vocab_size)


def is_kernel(path: tuple[str, ...]) -> bool:
    """Whether ``path`` is a kernel: stored transposed ([out, in]) in the file."""
    return path[-1] == "kernel"


def param_location(config: TransformerConfig, path: tuple[str, ...]) -> tuple[tuple[str, ...], int | None]:
    """Where a :func:`tensor_layout` path lives in ``config``'s params: (path, index on the stacked
    layer axis, or None when the leaf is not stacked)."""
    if not path[0].startswith("layers_"):
        return path, None
    key, index = layer_location(config, int(path[0].removeprefix("layers_")))
    return (key, *path[1:]), index


def save_tokenizer(ckpt: PathLike, tokenizer) -> None:
    """``tokenizer`` (a ``tokenizers.Tokenizer``) as ``ckpt``'s tokenizer.json, local or remote."""
    f = as_path(ckpt) / "tokenizer.json"
    if _is_local(f):
        tokenizer.save(os.fspath(f))
    else:
        f.write_text(tokenizer.to_str(pretty=True))
