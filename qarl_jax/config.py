"""Typed run configuration: dataclass defaults are the embedded default; a YAML file and then
``key=value`` overrides (MaxText style, dotted keys) change it.

Validation is strict: an unknown key lists the valid ones, a wrong type names the key.
"""

from __future__ import annotations

import dataclasses
import pathlib
import types
import typing
from typing import Any

import yaml

from qarl_jax.models.config import PRESETS
from qarl_jax.quant import QuantSpec
from qarl_jax.sharding import MeshConfig


class ConfigError(ValueError):
    """A configuration value or key that cannot be used; the message names the key."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    preset: str = "qwen3-tiny"  # a name from qarl_jax.models.PRESETS, used when `path` is None
    path: str | None = None  # a local Hugging Face directory (config.json + safetensors)
    param_dtype: str = "float32"
    compute_dtype: str = "float32"

    def __post_init__(self):
        if self.path is None and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; available: {sorted(PRESETS)}")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16"):
                raise ValueError(f"{name} must be 'float32' or 'bfloat16', got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """The pre-training-loop job: greedy rollout over a KV cache, then the training forward."""

    batch: int = 8
    prompt_len: int = 16
    new_tokens: int = 48

    def __post_init__(self):
        for name in ("batch", "prompt_len", "new_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    model: ModelConfig = ModelConfig()
    quant: QuantSpec = QuantSpec(fmt="w4a16")  # the format of rollout and training together
    mesh: MeshConfig = MeshConfig()
    demo: DemoConfig = DemoConfig()


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: {value!r} matches none of {tp}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return _build(tp, value, key + ".")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise ConfigError(f"{key}: expected {len(args)} items, got {value!r}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{key}: expected null, got {value!r}")
        return None
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def _build(cls, values: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(f"unknown config key {prefix}{unknown[0]}; valid keys here: {sorted(fields)}")
    kwargs = {name: _coerce(v, hints[name], prefix + name) for name, v in values.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {e}") from e


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def to_dict(config) -> dict:
    """Plain dict (lists for tuples) that ``load_config`` reads back to an equal config."""

    def plain(v):
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(dataclasses.asdict(config))


def parse_overrides(overrides: list[str]) -> dict:
    """``["a.b=1", "c=[x, y]"]`` -> nested dict, values parsed as YAML scalars/lists."""
    out: dict = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(raw) if raw else ""
    return out


def load_config(path: str | pathlib.Path | None = None, overrides: list[str] = (), cls=Config):
    """Embedded defaults <- YAML file <- overrides, validated into ``cls``."""
    values = to_dict(cls())
    if path is not None:
        path = pathlib.Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        try:
            from_file = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML ({e})") from e
        if not isinstance(from_file, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        values = _merge(values, from_file)
    values = _merge(values, parse_overrides(list(overrides)))
    return _build(cls, values)
