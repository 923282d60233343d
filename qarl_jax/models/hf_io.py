"""Hugging Face checkpoint import/export: config.json + (sharded) safetensors + tokenizer.json.

Tensors are streamed one at a time (read, transpose to the Flax [in, out] layout, cast, place on
devices, drop), so peak host memory stays near the size of the parameters themselves. Experts are
stored per expert on the Hub (``mlp.experts.{j}.gate_proj.weight``) and stacked [E, in, out] here.
A scanned model (``TransformerConfig.scan_layers``) stacks each run's layers on a leading axis too: a
stacked parameter is assembled on the host from its layers' tensors, then placed.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
from collections.abc import Iterable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.typing import DTypeLike
from safetensors.numpy import save_file

from qarl_jax.errors import CheckpointError
from qarl_jax.models.config import TransformerConfig, dtype_name
from qarl_jax.models.qwen3 import Qwen3ForCausalLM
from qarl_jax.models.stacking import layer_location

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class SafetensorsReader:
    """Reads one tensor at a time with ``pread`` into a fresh array.

    safetensors' own ``safe_open`` memory-maps the file, and every page it touches stays resident
    until the file is closed: loading a one-file checkpoint that way costs twice its size in RSS.
    Reading by offsets keeps only the parameters and the tensor in flight."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        size = os.fstat(self._fd).st_size
        try:
            head = os.pread(self._fd, 8, 0)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= size - 8:
                raise CheckpointError(f"{path}: not a safetensors file (header size {n}, file size {size})")
            header = json.loads(os.pread(self._fd, n, 8))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            os.close(self._fd)
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from e
        except CheckpointError:
            os.close(self._fd)
            raise
        header.pop("__metadata__", None)
        self._base, self._size, self.tensors = 8 + n, size, header

    def keys(self) -> list[str]:
        return list(self.tensors)

    def read(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        begin, end = info["data_offsets"]
        if info["dtype"] not in _DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        if self._base + end > self._size:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} ends at byte {self._base + end} but the file has "
                f"{self._size} bytes; the file is truncated"
            )
        out = np.empty(info["shape"], dtype=_DTYPES[info["dtype"]])
        if out.nbytes != end - begin:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has {end - begin} bytes for shape {info['shape']}"
            )
        view = out.reshape(-1).view(np.uint8).data  # a writable memoryview of the array's buffer
        done = 0
        while done < out.nbytes:
            got = os.preadv(self._fd, [view[done:]], self._base + begin + done)
            if got <= 0:
                raise CheckpointError(f"{self.path}: short read of tensor {name!r}")
            done += got
        return out

    def close(self) -> None:
        os.close(self._fd)


def tensor_layout(
    config: TransformerConfig,
) -> Iterator[tuple[tuple[str, ...], str | list[str], tuple[int, ...]]]:
    """(param path, HF tensor name(s), our shape) for every parameter; experts list one name each."""
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


def _is_kernel(path: tuple[str, ...]) -> bool:
    return path[-1] == "kernel"


def param_location(config: TransformerConfig, path: tuple[str, ...]) -> tuple[tuple[str, ...], int | None]:
    """Where a :func:`tensor_layout` path lives in ``config``'s params: (path, index on the stacked
    layer axis, or None when the leaf is not stacked)."""
    if not path[0].startswith("layers_"):
        return path, None
    key, index = layer_location(config, int(path[0].removeprefix("layers_")))
    return (key, *path[1:]), index


def _weight_files(ckpt: pathlib.Path) -> dict[str, pathlib.Path]:
    """Map every tensor name to the safetensors file holding it (index file, one file, or a glob)."""
    index = ckpt / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        files = {name: ckpt / f for name, f in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.exists():
                raise CheckpointError(f"{index} lists {f.name}, which is missing from {ckpt}")
        return files
    candidates = [ckpt / SINGLE_FILE] if (ckpt / SINGLE_FILE).exists() else sorted(ckpt.glob("*.safetensors"))
    if not candidates:
        raise CheckpointError(f"{ckpt}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors file")
    files = {}
    for f in candidates:
        reader = SafetensorsReader(f)
        files.update({name: f for name in reader.keys()})
        reader.close()
    return files


def _read(handles: dict, files: dict, name: str, shape: tuple[int, ...] | None, quantized=None) -> np.ndarray:
    """Tensor ``name`` of shape ``shape`` (None: any); ``quantized`` (a compressed-tensors checkpoint's
    :class:`~qarl_jax.models.compressed_tensors.CompressedCheckpoint`) dequantizes what it holds."""
    if quantized is not None and quantized.holds(name):
        arr = quantized.dequantize(name, lambda stored: _read(handles, files, stored, None))
        if arr.shape != shape:
            raise CheckpointError(
                f"quantized tensor {name!r} has shape {arr.shape}, the config implies {shape}"
            )
        return arr
    if name not in files:
        where = sorted({p.name for p in files.values()})
        raise CheckpointError(f"tensor {name!r} is missing from the checkpoint (files: {where})")
    f = files[name]
    if f not in handles:
        handles[f] = SafetensorsReader(f)
    if name not in handles[f].tensors:
        raise CheckpointError(f"{f}: the index places tensor {name!r} here, but the file does not hold it")
    arr = handles[f].read(name)
    if shape is not None and arr.shape != shape:
        raise CheckpointError(f"{f}: tensor {name!r} has shape {arr.shape}, the config implies {shape}")
    return arr


def _place(arr: np.ndarray, dtype, sharding) -> jax.Array:
    arr = np.asarray(arr, dtype=dtype)
    if sharding is None:
        return jax.device_put(arr)
    return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])


def load_params(ckpt: str | os.PathLike, config: TransformerConfig, shardings: dict | None = None) -> dict:
    """Stream the checkpoint's tensors into a params tree (optionally placed with ``shardings``,
    a tree of ``jax.sharding.Sharding`` matching the params)."""
    from qarl_jax.models.compressed_tensors import open_compressed  # it imports this module

    ckpt = pathlib.Path(ckpt)
    files = _weight_files(ckpt)
    quantized = open_compressed(ckpt, set(files))  # None unless config.json has a quantization_config
    dtype = jnp.dtype(config.param_dtype)
    params: dict = {}
    handles: dict = {}
    expected = set()
    layout = list(tensor_layout(config))
    layers_of = collections.Counter(param_location(config, path)[0] for path, _, _ in layout)
    stacks: dict[tuple[str, ...], np.ndarray] = {}  # stacked leaves being assembled on the host
    try:
        for path, names, shape in layout:
            if isinstance(names, list):  # experts: stack [out, in] per expert into [E, in, out]
                expected.update(names)
                arr = np.empty(shape, dtype=dtype)
                for j, name in enumerate(names):
                    arr[j] = _read(handles, files, name, (shape[2], shape[1]), quantized).T
            else:
                expected.add(names)
                hf_shape = (shape[1], shape[0]) if _is_kernel(path) else shape
                arr = _read(handles, files, names, hf_shape, quantized)
                arr = arr.T if _is_kernel(path) else arr
            path, index = param_location(config, path)
            if index is not None:  # one layer of a stacked leaf: place the stack after its last layer
                if path not in stacks:
                    stacks[path] = np.empty((layers_of[path], *arr.shape), dtype=dtype)
                stacks[path][index] = arr
                layers_of[path] -= 1
                if layers_of[path]:
                    continue
                arr = stacks.pop(path)
            sharding = None
            if shardings is not None:
                sharding = shardings
                for key in path:
                    sharding = sharding[key]
            node = params
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = _place(arr, dtype, sharding)
            del arr
    finally:
        for handle in handles.values():
            handle.close()
    if quantized is not None:
        expected |= quantized.consumed
    unexpected = sorted(set(files) - expected - {"lm_head.weight"})
    if unexpected:
        raise CheckpointError(
            f"{ckpt}: {len(unexpected)} tensors do not belong to a {config.architecture} with this "
            f"config, e.g. {unexpected[:5]}"
        )
    return params


def load_config(ckpt: str | os.PathLike, **overrides) -> TransformerConfig:
    f = pathlib.Path(ckpt) / "config.json"
    if not f.exists():
        raise CheckpointError(f"{ckpt}: config.json is missing (not a Hugging Face model directory?)")
    try:
        raw = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: invalid JSON ({e})") from e
    try:
        return TransformerConfig.from_hf(raw, source=str(f), **overrides)
    except (TypeError, ValueError) as e:  # an architecture or setting this package does not run
        raise CheckpointError(str(e)) from e


def load_tokenizer(ckpt: str | os.PathLike):
    """The checkpoint's ``tokenizer.json`` through ``tokenizers``, or None if it has none."""
    from tokenizers import Tokenizer

    f = pathlib.Path(ckpt) / "tokenizer.json"
    if not f.exists():
        return None
    try:
        return Tokenizer.from_file(str(f))
    except Exception as e:
        raise CheckpointError(f"{f}: cannot load tokenizer ({e})") from e


def from_pretrained(
    ckpt: str | os.PathLike,
    dtype: DTypeLike = "float32",
    compute_dtype: DTypeLike | None = None,
    quant=None,
    shardings: dict | None = None,
    **overrides,
):
    """Load a local Hugging Face Qwen3 / Qwen3-MoE directory -> ``(model, params, tokenizer)``.

    ``model.apply({"params": params}, tokens)`` gives logits. ``dtype`` is the parameter dtype,
    ``compute_dtype`` the matmul dtype (default: ``dtype``), each a name or a JAX/NumPy dtype;
    ``shardings`` places each tensor directly with its sharding (see
    ``qarl_jax.sharding.param_shardings``); ``overrides`` are further :class:`TransformerConfig` fields
    (``scan_layers=True``: the stacked layout)."""
    dtype = dtype_name(dtype, "from_pretrained dtype")
    compute_dtype = dtype if compute_dtype is None else dtype_name(compute_dtype, "compute_dtype")
    config = load_config(ckpt, param_dtype=dtype, dtype=compute_dtype, **overrides)
    model = Qwen3ForCausalLM(config, quant)
    return model, load_params(ckpt, config, shardings), load_tokenizer(ckpt)


def _host_array(x) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def write_safetensors(
    ckpt: str | os.PathLike, tensors: Iterable[tuple[str, np.ndarray]], max_shard_bytes: int = 2 * 1024**3
) -> None:
    """Write named host arrays as ``ckpt``'s safetensors: one file, or shards of at most
    ``max_shard_bytes`` with an index; replaces the directory's old weight files."""
    ckpt = pathlib.Path(ckpt)
    ckpt.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors:
        if size and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = np.ascontiguousarray(arr)
        size += arr.nbytes
    for old in list(ckpt.glob("*.safetensors")) + [ckpt / INDEX_FILE]:
        old.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(ckpt / SINGLE_FILE), metadata={"format": "pt"})
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(ckpt / fname), metadata={"format": "pt"})
            weight_map.update({name: fname for name in shard})
            total += sum(a.nbytes for a in shard.values())
        listing = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (ckpt / INDEX_FILE).write_text(json.dumps(listing, indent=2))


def save_pretrained(
    ckpt: str | os.PathLike,
    config: TransformerConfig,
    params: dict,
    tokenizer=None,
    max_shard_bytes: int = 2 * 1024**3,
) -> None:
    """Write ``params`` as a Hugging Face directory transformers loads (safetensors, sharded with an
    index past ``max_shard_bytes``), plus config.json and tokenizer.json if given."""
    ckpt = pathlib.Path(ckpt)

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        layout = list(tensor_layout(config))
        uses = collections.Counter(param_location(config, path)[0] for path, _, _ in layout)
        fetched: dict[tuple[str, ...], np.ndarray] = {}  # stacked leaves, dropped after their last layer
        for path, names, _ in layout:
            path, index = param_location(config, path)
            if path not in fetched:
                node = params
                for key in path:
                    node = node[key]
                fetched[path] = _host_array(node)
            arr = fetched[path] if index is None else fetched[path][index]
            uses[path] -= 1
            if not uses[path]:
                del fetched[path]
            if isinstance(names, list):
                for j, name in enumerate(names):
                    yield name, arr[j].T
            else:
                yield names, arr.T if _is_kernel(path) else arr

    write_safetensors(ckpt, tensors(), max_shard_bytes)
    hf = config.to_hf()
    hf.pop("quantization_config", None)  # dense weights, even from a compressed starting checkpoint
    (ckpt / "config.json").write_text(json.dumps(hf, indent=2))
    if tokenizer is not None:
        tokenizer.save(str(ckpt / "tokenizer.json"))
