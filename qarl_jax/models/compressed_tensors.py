"""The deployed policy as a ``compressed-tensors`` checkpoint (what vLLM, SGLang and transformers
load for int4 / int8 / FP8 weights), and such a checkpoint read back as float master weights.

Why this exists: QaRL's policy is the low-bit policy the rollouts ran. A bf16 export thrown to a
serving engine's own quantizer gives other integers; this writes the rollout's integers and scales
themselves (the frozen tree, :func:`qarl_jax.rollout.layout.freeze`), only moved into the layout
the format defines:

- torch's [out, in] layout (ours is [in, out]: the integers are transposed, not recomputed);
- ``w4a16``: ``pack-quantized``: ``weight_packed`` int32 [out, ceil(in / 8)], eight 4-bit values a
  word along the input dim, value i of a word in bits 4i..4i+3, stored as ``q + 8`` (unsigned);
  ``weight_scale`` [out, in / group] and ``weight_shape`` [out, in] (int64);
- ``w8a8``: ``int-quantized``: ``weight`` int8 [out, in] and ``weight_scale``; activations
  dynamic per token, symmetric int8;
- ``fp8``: ``float-quantized`` (the FP8_DYNAMIC scheme): ``weight`` float8_e4m3fn [out, in], one
  scale per channel; activations dynamic per token, e4m3;
- scales stay f32 (what our kernels multiply by); all symmetric (no zero points).
- only what a server runs (:func:`check_exportable`): no w4a8 (vLLM routes an int W4A8 checkpoint
  to its FP8-activation W4A8 scheme on sm90, which expects ``weight_packed`` and fp8 activations,
  and elsewhere to a scheme with CPU / XPU / NPU kernels only; SGLang has no int W4A8 scheme), and
  int4 groups only of the sizes vLLM's Marlin kernels take (``MARLIN_SUPPORTED_GROUP_SIZES`` in
  vLLM's ``quantization/utils/marlin_utils.py``: 32, 64, 128, or per channel).

Each distinct (strategy, group size) is one config group (8-bit: per channel; int4: groups of 128,
or all of K where K is smaller: tiny models only). Projections the run leaves unquantized (lm_head and
the MoE router by default) are written as they are and listed in ``ignore``.

Reading back (:class:`CompressedCheckpoint`, used by :func:`qarl_jax.models.hf_io.load_params`, which
imports this module; this module imports the file layer and the config translation, not the loader):
``model.path`` may name such a directory; every quantized weight comes back as f32 master weights
that freeze to the stored integers and scales bit for bit: ``q * scale``, with each group's abs-max
entries nudged by at most one ulp where the freeze would otherwise recompute a scale one ulp off
(see :func:`master`). That needs f32 master weights (``model.param_dtype=float32``, the default);
bf16 ones round the dequantized values.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterator

import jax
import numpy as np

from kernels_pallas.formats import E4M3_MAX, WEIGHT_BITS, QuantizedWeight, int_values
from qarl_jax.errors import CheckpointError, ConfigError
from qarl_jax.models.config import TransformerConfig
from qarl_jax.models.hf_config import config_to_hf
from qarl_jax.models.safetensors_io import (
    PathLike,
    as_path,
    host_array,
    param_location,
    save_tokenizer,
    tensor_layout,
    write_safetensors,
)
from qarl_jax.quant import QuantSpec

QUANT_METHOD = "compressed-tensors"
PACK_QUANTIZED = "pack-quantized"
INT_QUANTIZED = "int-quantized"
FLOAT_QUANTIZED = "float-quantized"
PACK_BITS = 4  # the packed format this module writes and reads: 4-bit values, 8 an int32
_INT_ACTIVATIONS = {
    "num_bits": 8,
    "type": "int",
    "symmetric": True,
    "strategy": "token",
    "dynamic": True,
}
_FP8_ACTIVATIONS = _INT_ACTIVATIONS | {"type": "float"}
# (weights' QuantizationType, num_bits) -> our format whose weights those are (its freeze is the
# one the master weights must round-trip through)
_WEIGHT_FORMATS: dict[tuple[object, object], str] = {
    ("int", 4): "w4a16",
    ("int", 8): "w8a8",
    ("float", 8): "fp8",
}


@dataclasses.dataclass(frozen=True)
class Scheme:
    """How one of our formats is written: compressed-tensors' ``format`` and its activation args."""

    format: str
    activations: dict | None
    weight_type: str = "int"  # compressed-tensors' QuantizationType of the weights


SCHEMES = {
    "w4a16": Scheme(PACK_QUANTIZED, None),
    "w8a8": Scheme(INT_QUANTIZED, _INT_ACTIVATIONS),
    "fp8": Scheme(FLOAT_QUANTIZED, _FP8_ACTIVATIONS, "float"),
}


SERVED = ", ".join(SCHEMES)  # what vLLM and SGLang load and run from a compressed-tensors checkpoint
MARLIN_GROUP_SIZES = (32, 64, 128)  # vLLM's Marlin int4 groups (and per channel: K < 128 here)


def check_exportable(spec: QuantSpec) -> Scheme:
    """The scheme of ``spec``'s format, or a one-line :class:`ConfigError` when no server would run
    the export (module docstring): a format without a scheme (bf16), w4a8, an int4 group size that
    vLLM's Marlin kernels do not take. Called before any work (main, the export tool)."""
    if spec.fmt == "w4a8":
        raise ConfigError(
            "quant.fmt='w4a8': no GPU server runs a W4A8-int compressed-tensors checkpoint (vLLM's int "
            f"W4A8 kernels are CPU / XPU / NPU only, SGLang has none); the export writes {SERVED}, which "
            "vLLM and SGLang serve (the master weights: --export-hf)"
        )
    if spec.fmt not in SCHEMES:
        raise ConfigError(
            f"quant.fmt={spec.fmt!r} has no compressed-tensors scheme; the compressed-tensors export "
            f"writes {SERVED}, which vLLM and SGLang serve (a bf16 policy: --export-hf)"
        )
    if WEIGHT_BITS[spec.fmt] == 4 and spec.group_size not in (None, *MARLIN_GROUP_SIZES):
        raise ConfigError(
            f"quant.group_size={spec.group_size}: vLLM's Marlin int4 kernels take groups of "
            f"{', '.join(map(str, MARLIN_GROUP_SIZES))} or per channel only; a {spec.fmt} export needs "
            "one of them"
        )
    return SCHEMES[spec.fmt]


def _module(name: str) -> str:
    return name.removesuffix(".weight")


def _host_leaf(tree: dict, config: TransformerConfig, path: tuple[str, ...], wanted: bool):
    """The leaf (a :class:`QuantizedWeight` or an array) at ``path``, one layer of a stacked leaf,
    gathered whole onto this host, or None where not ``wanted`` (collective: every process calls
    it, in the same order; :func:`host_array`). An unquantized kernel comes [out, in] as stored,
    transposed on the devices (written without a copy)."""
    where, index = param_location(config, path)
    node = tree
    for key in where:
        node = node[key]
    transpose = path[-1] == "kernel" and not isinstance(node, QuantizedWeight)

    def gather(a: jax.Array) -> np.ndarray | None:
        a = a if index is None else a[index]
        return host_array(jax.numpy.swapaxes(a, -1, -2) if transpose else a, wanted=wanted)

    leaf = jax.tree.map(gather, node)
    return leaf if wanted else None


def _host(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


def pack_int32(q: np.ndarray) -> np.ndarray:
    """int4 values [out, in] (int8, in [-8, 7]) -> compressed-tensors' int32 words [out, ceil(in/8)]:
    value j of a row lands in word j // 8, bits 4 (j % 8) .. +3, offset by 8 to be unsigned; a
    ragged tail is padded with zeros (``weight_shape`` says where the row ends)."""
    out, k = q.shape
    per_word = 32 // PACK_BITS
    u = (q.astype(np.int64) + (1 << (PACK_BITS - 1))).astype(np.uint32)
    u = np.pad(u, ((0, 0), (0, -k % per_word))).reshape(out, -1, per_word)
    shifts = np.arange(per_word, dtype=np.uint32) * PACK_BITS
    return np.bitwise_or.reduce(u << shifts, axis=-1).astype(np.uint32).view(np.int32)


def unpack_int32(packed: np.ndarray, k: int) -> np.ndarray:
    """Inverse of :func:`pack_int32`: int32 words [out, W] -> int8 values [out, k]."""
    per_word = 32 // PACK_BITS
    shifts = np.arange(per_word, dtype=np.uint32) * PACK_BITS
    nibbles = (packed.view(np.uint32)[..., None] >> shifts) & ((1 << PACK_BITS) - 1)
    values = nibbles.reshape(packed.shape[0], -1)[:, :k].astype(np.int16) - (1 << (PACK_BITS - 1))
    return values.astype(np.int8)


def _module_tensors(module: str, w: QuantizedWeight, scheme: Scheme) -> Iterator[tuple[str, np.ndarray]]:
    """One quantized projection's tensors (``w`` one matrix: [K(/2), N] values, [K/G, N] scales)."""
    q = _host(int_values(w)).T  # [out, in] int8 (fp8: float8_e4m3fn)
    scales = np.ascontiguousarray(_host(w.scales).T.astype(np.float32))  # [out, in / group]
    if scheme.format == PACK_QUANTIZED:
        yield f"{module}.weight_packed", pack_int32(q)
        yield f"{module}.weight_scale", scales
        yield f"{module}.weight_shape", np.array(q.shape, dtype=np.int64)
    else:
        yield f"{module}.weight", np.ascontiguousarray(q)
        yield f"{module}.weight_scale", scales


def _group_key(w: QuantizedWeight) -> tuple[str, int | None]:
    """int8 weights are per channel; int4 ones are groups of ``group_size`` even where that is all
    of K (a 128-row K): real models then need one config group, which transformers' dequantizing
    loader requires (it applies the first group to every dense layer)."""
    return ("channel", None) if WEIGHT_BITS[w.fmt] == 8 else ("group", w.group_size)


def _host_leaves(config: TransformerConfig, frozen: dict, wanted: bool = True):
    """(param path, HF name(s), host leaf) in :func:`tensor_layout` order, one leaf (one layer of a
    stacked leaf) gathered at a time (collective; the leaf None where not ``wanted``)."""
    for path, names, _ in tensor_layout(config):
        yield path, names, _host_leaf(frozen, config, path, wanted)


def _tensors(config: TransformerConfig, leaves, scheme: Scheme, groups: dict, ignore: list[str]):
    """Every tensor of the export, in :func:`tensor_layout` order, from :func:`_host_leaves`; fills
    ``groups`` (strategy key -> module names) and ``ignore`` (the linear modules left unquantized)
    on the way."""
    for path, names, leaf in leaves:
        is_kernel = path[-1] == "kernel"
        listed = names if isinstance(names, list) else [names]
        for j, name in enumerate(listed):
            one = jax.tree.map(lambda a: a[j], leaf) if isinstance(names, list) else leaf  # noqa: B023
            if isinstance(one, QuantizedWeight):
                groups.setdefault(_group_key(one), []).append(_module(name))
                yield from _module_tensors(_module(name), one, scheme)
                continue
            if is_kernel:
                ignore.append(_module(name))
            yield name, _host(one)  # a kernel [out, in] already (_host_leaf)
    if config.tie_word_embeddings:
        ignore.append("lm_head")  # transformers' head Linear, sharing the (unquantized) embedding


def quantization_config(spec: QuantSpec, groups: dict, ignore: list[str]) -> dict:
    """config.json's ``quantization_config``: one config group per (strategy, group size); with
    more than one, each lists its modules by name (else it targets every ``Linear``)."""
    scheme = check_exportable(spec)
    bits = WEIGHT_BITS[spec.fmt]
    config_groups = {}
    for i, ((strategy, group_size), modules) in enumerate(sorted(groups.items(), key=str)):
        weights = {
            "num_bits": bits,
            "type": scheme.weight_type,
            "symmetric": True,
            "strategy": strategy,
            "group_size": group_size,
            "dynamic": False,
        }
        config_groups[f"group_{i}"] = {
            "targets": ["Linear"] if len(groups) == 1 else sorted(modules),
            "weights": weights,
            "input_activations": scheme.activations,
            "output_activations": None,
            "format": scheme.format,
        }
    return {
        "quant_method": QUANT_METHOD,
        "format": scheme.format,
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }


def save_compressed(
    ckpt: PathLike,
    config: TransformerConfig,
    frozen: dict,
    spec: QuantSpec,
    tokenizer=None,
    max_shard_bytes: int = 2 * 1024**3,
) -> None:
    """Write the rollout's frozen weights ``frozen`` (:func:`qarl_jax.rollout.layout.freeze` of the
    master weights under ``spec``) as a compressed-tensors checkpoint in ``ckpt`` (local or
    ``gs://``): sharded safetensors, config.json with its ``quantization_config``, tokenizer.json
    if given.

    With several processes every process calls it (collective) with the global arrays: each leaf,
    and each layer of a stacked leaf, is gathered one at a time (:func:`host_array`), and process 0
    alone converts and writes. **Host peak** beyond the run's own: the frozen leaf being gathered
    (one layer's, all experts of an MoE projection; int8 / fp8 values, packed int4, f32 scales)
    across each host's devices (host RAM only on CPU devices) and, on process 0, once in RAM with
    its converted tensors, plus a 64 MiB copy piece: :func:`write_safetensors` spools each tensor
    to local disk as it comes. Measured on two hosts of CPU devices (w4a16, 256 MiB files): 0.31x
    the f32 model on process 0, 0.19x on the other
    (``benchmarks/host_ram.py --export``, benchmarks/RESULTS.md)."""
    scheme = check_exportable(spec)
    is_quantized = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731
    if not any(is_quantized(x) for x in jax.tree.leaves(frozen, is_leaf=is_quantized)):
        raise ConfigError(f"{spec}: the frozen weights hold no {spec.fmt} projection (nothing to export)")
    if jax.process_index() != 0:
        for _ in _host_leaves(config, frozen, wanted=False):  # collective: take part, write nothing
            pass
        return
    leaves = _host_leaves(config, frozen)
    groups: dict[tuple[str, int | None], list[str]] = {}
    ignore: list[str] = []
    write_safetensors(ckpt, _tensors(config, leaves, scheme, groups, ignore), max_shard_bytes)
    hf = config_to_hf(config)
    hf.pop("quantization_config", None)  # one carried from a compressed starting checkpoint goes last
    hf["quantization_config"] = quantization_config(spec, groups, ignore)
    (as_path(ckpt) / "config.json").write_text(json.dumps(hf, indent=2))
    if tokenizer is not None:
        save_tokenizer(ckpt, tokenizer)


class CompressedCheckpoint:
    """A compressed-tensors checkpoint's quantized weights, read as dense f32 ``[out, in]`` master
    weights under their plain names (``...q_proj.weight``), so the loader reads it as any checkpoint."""

    def __init__(self, source: str, qconfig: dict, names: set[str]):
        self.source = source
        self.names = names
        self.groups: list[tuple[list[str], str | None]] = []  # (targets, our weight format) a group
        if qconfig.get("quant_method") != QUANT_METHOD:
            raise CheckpointError(
                f"{source}: quantization_config.quant_method={qconfig.get('quant_method')!r}; this "
                f"package reads {QUANT_METHOD!r} checkpoints"
            )
        for name, group in (qconfig.get("config_groups") or {}).items():
            weights = group.get("weights") or {}
            fmt = group.get("format", qconfig.get("format"))
            key = (weights.get("type", "int"), weights.get("num_bits"))
            problem = (
                "asymmetric weights (zero points)"
                if not weights.get("symmetric", True)
                else f"{weights.get('num_bits')}-bit {weights.get('type')} weights"
                if key not in _WEIGHT_FORMATS
                else f"{weights.get('num_bits')}-bit packed weights"
                if fmt == PACK_QUANTIZED and weights.get("num_bits") != PACK_BITS
                else f"format {fmt!r}"
                if fmt not in (PACK_QUANTIZED, INT_QUANTIZED, FLOAT_QUANTIZED, "naive-quantized")
                else None
            )
            if problem:
                raise CheckpointError(
                    f"{source}: config group {name} has {problem}; this package reads symmetric "
                    f"int4 / int8 / float8 weights in {PACK_QUANTIZED}, {INT_QUANTIZED} or {FLOAT_QUANTIZED}"
                )
            self.groups.append((list(group.get("targets") or []), _WEIGHT_FORMATS[key]))

    def holds(self, name: str) -> bool:
        """Whether ``name`` (``<module>.weight``) is stored quantized here."""
        return name.endswith(".weight") and f"{_module(name)}.weight_scale" in self.names

    def stored(self, name: str) -> set[str]:
        """The stored tensors that quantized ``name`` is made of (the loader's expected names)."""
        module = _module(name)
        if f"{module}.weight_packed" in self.names:
            return {f"{module}.{t}" for t in ("weight_packed", "weight_scale", "weight_shape")}
        return {name, f"{module}.weight_scale"}

    def _format(self, module: str) -> str | None:
        """Our weight format (w4a16 / w8a8 / fp8) of the config group targeting ``module`` (by name,
        ``re:`` pattern or the ``Linear`` class, as compressed-tensors matches), None if none does."""
        for targets, fmt in self.groups:
            for t in targets:
                if t == "Linear" or t == module or (t.startswith("re:") and re.match(t[3:], module)):
                    return fmt
        return None

    def dequantize(self, name: str, read: Callable[[str], np.ndarray]) -> np.ndarray:
        """The master weight [out, in] f32 of a stored module (``read``: a stored tensor by name):
        ``q * scale`` per group of the input dim, the library's own dequantization, with the
        abs-max entries of each group set so that freezing gives ``scale`` back (:func:`master`)."""
        module = _module(name)
        scale = read(f"{module}.weight_scale").astype(np.float32)
        if f"{module}.weight_packed" in self.names:
            out, k = (int(v) for v in read(f"{module}.weight_shape"))
            q = unpack_int32(read(f"{module}.weight_packed"), k)
            fmt: str | None = "w4a16"
        else:
            q = read(name)
            fmt = self._format(module)
        out, k = q.shape
        if scale.ndim != 2 or scale.shape[0] != out or k % scale.shape[1]:
            raise CheckpointError(
                f"{self.source}: {module}.weight_scale has shape {scale.shape}, not [{out}, groups of {k}]"
            )
        return master(q, scale, fmt)


def master(q: np.ndarray, scale: np.ndarray, fmt: str | None) -> np.ndarray:
    """Float master weights [out, in] f32 whose freezing gives back ``q`` [out, in] and ``scale``
    [out, groups] bit for bit (``fmt``: our format holding such weights: w4a16, w8a8 or fp8).

    ``q * scale`` alone is not enough: the freeze computes a group's scale as its abs-max over qmax,
    and XLA computes that division by a constant as a multiplication by the rounded reciprocal
    (on CPU at least), so ``fl(fl(qmax * s) * fl(1 / qmax))`` misses ``s`` by one ulp for about half
    of int4 and ~6% of int8 scales (a true division would always give ``s`` back). So each
    group's abs-max entries (those at +-qmax) are set to the f32 next to ``qmax * s`` (0 or +-1
    ulp, tried in that order) for which this backend's freeze (:func:`qarl_jax.quant.aqt.quantize`,
    what :func:`qarl_jax.rollout.layout.freeze` runs) returns ``s``; every other entry is
    ``q * s``. Checkpoints whose values are not this package's (an entry below -qmax, a group
    without a +-qmax entry, grouped 8-bit weights) come back as ``q * scale``."""
    out, k = q.shape
    groups = scale.shape[1]
    g = k // groups
    qf = q.astype(np.float32).reshape(out, groups, g)
    deq = qf * scale[:, :, None]
    qmax = {"w4a16": 7.0, "w8a8": 127.0, "fp8": E4M3_MAX}.get(fmt or "")
    if fmt is None or qmax is None:
        return deq.reshape(out, k)
    at_max = np.abs(qf) == qmax
    ours = (groups == 1 or fmt == "w4a16") and not (qf < -qmax).any()
    if not (ours and bool((at_max.any(-1) | (qf == 0).all(-1)).all())):
        return deq.reshape(out, k)
    from qarl_jax.quant import aqt

    x0 = (scale * np.float32(qmax)).astype(np.float32)
    best, found = deq, np.zeros(scale.shape, bool)
    for step in (0, -1, 1):
        peak = (x0.view(np.int32) + np.int32(step)).view(np.float32)
        cand = np.where(at_max, np.sign(qf) * peak[:, :, None], deq)
        frozen = aqt.quantize(jax.numpy.asarray(cand.reshape(out, k).T), fmt, g)
        q2 = _host(int_values(frozen)).T.astype(np.float32).reshape(out, groups, g)
        s2 = _host(frozen.scales).T
        ok = ~found & (s2.view(np.uint32) == scale.view(np.uint32)) & (q2 == qf).all(-1)
        best = np.where(ok[:, :, None], cand, best)
        found |= ok
        if found.all():
            break
    return best.reshape(out, k)


def open_compressed(source: str, config: TransformerConfig, names: set[str]) -> CompressedCheckpoint | None:
    """The checkpoint's :class:`CompressedCheckpoint` if its config (``config``, read from
    ``source``) has a ``quantization_config``, else None (``names``: the tensor names it stores)."""
    qconfig = dict(config.extra_hf).get("quantization_config")
    return None if qconfig is None else CompressedCheckpoint(source, qconfig, names)


__all__ = [
    "SCHEMES",
    "CompressedCheckpoint",
    "Scheme",
    "check_exportable",
    "open_compressed",
    "master",
    "pack_int32",
    "quantization_config",
    "save_compressed",
    "unpack_int32",
]
