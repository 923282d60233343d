"""Hugging Face checkpoint import/export: config.json + (sharded) safetensors + tokenizer.json. The
whole translation lives here: config.json <-> :class:`TransformerConfig` (per family, by the data in
:data:`qarl_jax.models.config.FAMILIES`), tensor names and shapes <-> parameter paths.

Tensors are streamed one at a time (read, transpose to the Flax [in, out] layout, cast, place on
devices, drop), so peak host memory stays near the size of the parameters themselves. Experts are
stored per expert on the Hub (``mlp.experts.{j}.gate_proj.weight``) and stacked [E, in, out] here.
A scanned model (``TransformerConfig.scan_layers``) stacks each run's layers on a leading axis too: a
stacked parameter is assembled on the host from its layers' tensors, then placed.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.typing import DTypeLike
from safetensors.numpy import save_file

from qarl_jax.errors import CheckpointError
from qarl_jax.models.config import FAMILIES, Llama3RopeScaling, TransformerConfig, dtype_name
from qarl_jax.models.qwen3 import Qwen3ForCausalLM
from qarl_jax.models.stacking import layer_location

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# config.json keys we read; anything else in the file is carried through untouched on export
_HF_KEYS = {
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "tie_word_embeddings",
    "max_position_embeddings",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
    "use_sliding_window",
    "layer_types",
    "architectures",
    "model_type",
}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope(cfg: dict[str, Any], arch: str, source: str) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, llama3 scaling or None) from ``rope_parameters`` (transformers 5) or the older
    top-level ``rope_theta`` + ``rope_scaling``."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in FAMILIES[arch].rope_types:
        raise ValueError(f"{source}: rope type {rope_type!r} is not supported for {arch}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor={rope['partial_rotary_factor']} is not supported")
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    missing = [k for k in _LLAMA3_KEYS if k not in rope]
    if missing:
        raise ValueError(f"{source}: the llama3 rope scaling lacks {missing}")
    factor, low, high, original = (rope[k] for k in _LLAMA3_KEYS)
    return theta, Llama3RopeScaling(float(factor), float(low), float(high), int(original))


def config_from_hf(cfg: dict[str, Any], *, source: str = "config.json", **overrides) -> TransformerConfig:
    """A parsed ``config.json`` -> :class:`TransformerConfig` (``overrides``: further fields);
    raises one line naming ``source`` and the setting on what this package does not run."""
    archs = cfg.get("architectures") or []
    by_type = {f.model_type: name for name, f in FAMILIES.items()}
    arch = archs[0] if archs else by_type.get(cfg.get("model_type", ""))
    if arch not in FAMILIES:
        raise ValueError(
            f"{source}: unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"qarl_jax runs {sorted(FAMILIES)}"
        )
    family = FAMILIES[arch]
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act={cfg['hidden_act']!r} is not supported ({arch} uses silu)")
    for key in ("attention_bias", "mlp_bias"):  # Qwen2's q/k/v biases are its architecture's, not these
        if cfg.get(key, False):
            raise ValueError(f"{source}: {key}=true is not supported")
    if cfg.get("use_sliding_window", False):
        raise ValueError(f"{source}: use_sliding_window=true is not supported (sliding-window attention)")
    sliding = sorted({t for t in cfg.get("layer_types") or () if t != "full_attention"})
    if sliding:
        raise ValueError(f"{source}: layer_types {sliding} are not supported (only full_attention)")
    missing = [
        k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") if k not in cfg
    ]
    if missing:
        raise ValueError(f"{source}: missing required keys {missing}")
    rope_theta, rope_scaling = _rope(cfg, arch, source)
    heads = cfg["num_attention_heads"]
    fields: dict[str, Any] = dict(
        family=family.family,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg.get("intermediate_size", 0),
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=cfg.get("tie_word_embeddings", family.tie_default),
        max_position_embeddings=cfg.get("max_position_embeddings", 40960),
    )
    if family.moe:
        fields.update(
            num_experts=cfg.get("num_experts", cfg.get("num_local_experts", 0)),
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0),
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
            norm_topk_prob=cfg.get("norm_topk_prob", True),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        )
    extra = tuple(sorted((k, v) for k, v in cfg.items() if k not in _HF_KEYS and k != "dtype"))
    return TransformerConfig(**fields, extra_hf=extra, **overrides)


def config_to_hf(c: TransformerConfig) -> dict[str, Any]:
    """The ``config.json`` dict transformers reads back: its family's class, model_type and keys."""
    family = c.spec
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": c.rope_theta, **dataclasses.asdict(c.rope_scaling)}
    out: dict[str, Any] = dict(c.extra_hf)
    out.update(
        architectures=[c.architecture],
        model_type=family.model_type,
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        hidden_act="silu",
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        rope_parameters=rope,
        tie_word_embeddings=c.tie_word_embeddings,
        max_position_embeddings=c.max_position_embeddings,
        dtype=c.param_dtype,
    )
    if not family.qkv_bias:  # the classes whose attention biases are a setting (we run none)
        out.update(attention_bias=False)
    if c.family == "llama":
        out.update(mlp_bias=False)
    else:
        out.update(use_sliding_window=False)
    if c.is_moe:
        out.update(
            num_experts=c.num_experts,
            num_experts_per_tok=c.num_experts_per_tok,
            moe_intermediate_size=c.moe_intermediate_size,
            norm_topk_prob=c.norm_topk_prob,
            decoder_sparse_step=c.decoder_sparse_step,
            mlp_only_layers=list(c.mlp_only_layers),
        )
    return out


_DTYPES = {
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
    # a tied checkpoint may still hold lm_head.weight; older exports hold RoPE's frequency buffers
    unexpected = sorted(n for n in set(files) - expected - {"lm_head.weight"} if "rotary_emb." not in n)
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
        return config_from_hf(raw, source=str(f), **overrides)
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
    """Load a local Hugging Face directory of one of the :data:`FAMILIES` (Qwen3, Qwen3-MoE,
    Qwen2/Qwen2.5, Llama 3) -> ``(model, params, tokenizer)``.

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
    hf = config_to_hf(config)
    hf.pop("quantization_config", None)  # dense weights, even from a compressed starting checkpoint
    (ckpt / "config.json").write_text(json.dumps(hf, indent=2))
    if tokenizer is not None:
        tokenizer.save(str(ckpt / "tokenizer.json"))
