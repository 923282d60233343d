"""Typed run configuration: dataclass defaults are the embedded default; a YAML file and then
``key=value`` overrides (MaxText style, dotted keys) change it.

Validation is strict: an unknown key lists the valid ones, a wrong type names the key.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
import warnings
from typing import Any

import yaml

from qarl_jax import storage
from qarl_jax.data import DataConfig, SyntheticConfig
from qarl_jax.errors import ConfigError
from qarl_jax.models.config import PRESETS, REMAT_POLICIES
from qarl_jax.quant import QuantSpec
from qarl_jax.rewards import GRADERS
from qarl_jax.rl.advantages import ADVANTAGES, STDS
from qarl_jax.rl.objectives import ObjectiveConfig
from qarl_jax.rl.train_step import OptimizerConfig, TrainConfig
from qarl_jax.rollout.layout import RolloutMesh
from qarl_jax.sharding import MeshConfig


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    preset: str = "qwen3-tiny"  # a name from qarl_jax.models.PRESETS, used when `path` is None
    path: str | None = None  # a local Hugging Face directory (config.json + safetensors)
    num_hidden_layers: int | None = None  # overrides the preset's depth (tests use shallow models)
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    scan_layers: bool = False  # one nn.scan per run of identical layers over stacked parameters
    remat_policy: str = "full"  # with train.remat: full | save_dots (keep matmul outputs) | none

    def __post_init__(self):
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"remat_policy must be one of {REMAT_POLICIES}, got {self.remat_policy!r}")
        if self.path is None and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; available: {sorted(PRESETS)}")
        if self.num_hidden_layers is not None and (self.path is not None or self.num_hidden_layers < 1):
            raise ValueError("num_hidden_layers overrides a preset: >= 1, and only without `path`")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16"):
                raise ValueError(f"{name} must be 'float32' or 'bfloat16', got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class RewardsConfig:
    kind: str = "synthetic"  # a grader from qarl_jax.rewards.GRADERS
    num_workers: int = 2  # grading processes (kinds graded in-process never start them)
    time_limit_s: float = 5.0  # per sample; one past it is graded again with 2x, then scores 0

    def __post_init__(self):
        if self.kind not in GRADERS:
            raise ValueError(f"kind {self.kind!r} is not one of {sorted(GRADERS)}")
        if self.num_workers < 1 or self.time_limit_s <= 0:
            raise ValueError("num_workers must be >= 1 and time_limit_s > 0")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Sampling of the G completions per prompt (a GRPO group) through the rollout engine."""

    samples_per_prompt: int = 8
    max_new_tokens: int = 32
    temperature: float = 1.0  # must equal train.temperature (the loss scores the same distribution)
    # auto (the objective's: dr_grpo for objective dr_grpo, else grpo) | grpo (r - mean) / std |
    # dr_grpo (r - mean); see qarl_jax.rl.advantages
    advantage: str = "auto"
    advantage_std: str = "sample"  # sample (divides by G - 1, as verl / Tunix) | population (by G)
    slots: int = 64  # engine decode slots
    max_len: int = 64  # prompt + response tokens per slot; the training batch's longest length
    # DAPO's data side (qarl_jax.rl.dapo), each off by default:
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal, refill with new prompts
    max_resample_rounds: int = 3  # at most this many more prompt batches per step (dynamic_sampling)
    overlong_buffer: int = 0  # soft overlong punishment over the last this-many tokens; 0: off
    overlong_penalty: float = 1.0  # the reward lost at max_new_tokens (overlong_buffer)
    # the engine's own layout over this process's devices (qarl_jax.rollout.layout): data (slots on
    # replicated frozen weights; default: every device) x expert (MoE experts split) x tensor (1)
    mesh: RolloutMesh = RolloutMesh()
    # k-step-off rollouts (qarl_jax.rollout.overlap): 0 rolls each batch out with the weights it
    # trains from; k >= 1 trains step s on a batch the weights of update max(0, s - k) rolled out,
    # while the engine decodes the next one
    async_steps: int = 0
    # devices of the run that decode, the rest train (0: every device does both, in turns); split
    # evenly over the processes, the first of each process's devices; needs async_steps >= 1
    devices: int = 0
    overlap: bool = True  # false: the async schedule without concurrency (the exactness reference)

    def __post_init__(self):
        if self.async_steps < 0 or self.devices < 0:
            raise ValueError(f"async_steps and devices must be >= 0, got {self.async_steps}, {self.devices}")
        if self.devices and not self.async_steps:
            raise ValueError(
                f"devices={self.devices} with async_steps=0: the two device groups would only take "
                "turns (each idle while the other works); set async_steps >= 1, or devices=0"
            )
        for name in ("samples_per_prompt", "max_new_tokens", "slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_resample_rounds < 0:
            raise ValueError(f"max_resample_rounds must be >= 0, got {self.max_resample_rounds}")
        if not 0 <= self.overlong_buffer <= self.max_new_tokens or self.overlong_penalty < 0:
            raise ValueError(
                f"overlong_buffer ({self.overlong_buffer}) must be in [0, max_new_tokens="
                f"{self.max_new_tokens}] and overlong_penalty ({self.overlong_penalty}) >= 0"
            )
        if self.advantage_std not in STDS:
            raise ValueError(f"advantage_std must be one of {STDS}, got {self.advantage_std!r}")
        if self.max_len <= self.max_new_tokens:
            raise ValueError(f"max_len ({self.max_len}) must exceed max_new_tokens ({self.max_new_tokens})")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.advantage not in ("auto",) + ADVANTAGES:
            raise ValueError(f"advantage must be one of {('auto',) + ADVANTAGES}, got {self.advantage!r}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Length, cadence and where the run directory (metrics, checkpoints, config) lives."""

    steps: int = 240  # reward +0.17..0.20 (first vs last 20%) in seeds 0-2, four updates per batch
    output_dir: str = "runs/default"
    overwrite: bool = False  # replace a run directory that has logs but no checkpoint to resume
    log_every: int = 1  # progress-bar refresh; every step is written to metrics.jsonl
    eval_every: int = 40  # 0: only before the first and after the last step
    eval_prompts: int = 64  # held-out prompts (the test split; see qarl_jax.run.train.eval_set), greedy
    eval_samples: int = 0  # k > 0: also k samples per held-out prompt at the rollout temperature (pass@k)
    eval_bf16: bool = False  # also evaluate the master weights in the unquantized bf16 format
    checkpoint_every: int = 20  # 0: only at the end
    keep: int = 2  # checkpoints kept
    progress: bool = True
    tensorboard: bool = True  # metrics also as TensorBoard scalars in <output_dir>/tb
    wandb: bool = False  # metrics also to Weights & Biases (the optional `wandb` extra)
    wandb_project: str = "qarl-jax"
    wandb_name: str | None = None  # None: the run directory's name
    # XLA's persistent compilation cache for `python -m qarl_jax.main` (a rerun or a resume loads
    # its programs instead of compiling them); None: off; $JAX_COMPILATION_CACHE_DIR wins when set
    compilation_cache_dir: str | None = "~/.cache/qarl_jax/xla"

    def __post_init__(self):
        if not self.output_dir.strip():
            raise ValueError("output_dir is empty: name the run directory")
        if self.steps < 1 or self.log_every < 1 or self.eval_prompts < 1 or self.keep < 1:
            raise ValueError("steps, log_every, eval_prompts and keep must be >= 1")
        if self.eval_every < 0 or self.checkpoint_every < 0 or self.eval_samples < 0:
            raise ValueError("eval_every, eval_samples and checkpoint_every must be >= 0")


@dataclasses.dataclass(frozen=True)
class AlignmentConfig:
    """``python -m qarl_jax.tools.check_alignment``: the random prompts it rolls out (with the
    rollout section's samples, slots, temperature and lengths) and the training batches it
    re-scores them in (on the configured mesh; the rollout on ``rollout.mesh``)."""

    prompts: int = 16
    min_prompt_len: int = 4
    max_prompt_len: int = 32  # at most rollout.max_len - rollout.max_new_tokens
    train_rows: int = 8  # rows per training batch (the rollout batches rollout.slots)
    packing: bool = True  # several sequences per row; False: one per row, padded (the trainer's batch)

    def __post_init__(self):
        for name in ("prompts", "min_prompt_len", "train_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_len < self.min_prompt_len:
            raise ValueError(
                f"max_prompt_len ({self.max_prompt_len}) < min_prompt_len ({self.min_prompt_len})"
            )


@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    # the shipped SFT'd starting policy (python -m qarl_jax.sft --config configs/sft_arith.yaml)
    model: ModelConfig = ModelConfig(path="package:assets/policy")
    quant: QuantSpec = QuantSpec(fmt="w4a16")  # the format of rollout and training together
    mesh: MeshConfig = MeshConfig()
    data: DataConfig = DataConfig(batch_size=8, max_prompt_tokens=32, synthetic=SyntheticConfig(digits=1))
    rewards: RewardsConfig = RewardsConfig()
    rollout: RolloutConfig = RolloutConfig()
    objective: ObjectiveConfig = ObjectiveConfig()
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=3e-5)  # 3e-4 collapses the SFT policy
    # four updates per rollout batch: the policy moves within the batch, so TBPO's clip and trust band
    # act (with one update rho == 1 exactly and they never do)
    train: TrainConfig = TrainConfig(num_minibatches=4)
    run: RunConfig = RunConfig()
    alignment: AlignmentConfig = AlignmentConfig()

    def __post_init__(self):
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.data.samples_per_prompt != 1:
            raise ValueError(
                "data.samples_per_prompt must be 1: the group size is rollout.samples_per_prompt"
            )
        if self.data.max_prompt_tokens + self.rollout.max_new_tokens > self.rollout.max_len:
            raise ValueError(
                f"data.max_prompt_tokens ({self.data.max_prompt_tokens}) + rollout.max_new_tokens "
                f"({self.rollout.max_new_tokens}) exceed rollout.max_len ({self.rollout.max_len})"
            )
        if self.train.temperature != self.rollout.temperature:
            raise ValueError(
                f"train.temperature ({self.train.temperature}) must equal rollout.temperature "
                f"({self.rollout.temperature}): the loss scores the distribution the rollout sampled"
            )
        self.train.old_logprobs_from_rollout(self.quant.mode)  # raises for rollout in naive mode
        implied = self.objective.spec.advantage
        if self.rollout.advantage not in ("auto", implied):
            warnings.warn(
                f"rollout.advantage={self.rollout.advantage!r} but objective.name={self.objective.name!r} "
                f"implies {implied!r} advantages (rollout.advantage=auto follows the objective)",
                stacklevel=2,
            )

    @property
    def advantage(self) -> str:
        """The advantage estimator: rollout.advantage, or with ``auto`` the objective's."""
        return self.objective.spec.advantage if self.rollout.advantage == "auto" else self.rollout.advantage


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
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
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
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 3e-5 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
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
        for i, p in enumerate(parents):
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                section = ".".join(parents[: i + 1])
                raise ConfigError(f"override {item!r}: {section} was given a value, not keys, earlier")
        try:
            node[leaf] = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({yaml_problem(e)})") from e
    return out


def yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error on one line: what is wrong and where (PyYAML's own text spans five lines, the
    offending line reprinted with a caret under it)."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


def load_config(
    path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = (), cls=Config
):
    """Embedded defaults <- YAML file (local or gs://, :mod:`qarl_jax.storage`) <- overrides,
    validated into ``cls``."""
    values = to_dict(cls())
    if path is not None:
        source = storage.parse(path, "config file")
        if not source.exists():
            raise ConfigError(f"config file {source} does not exist")
        if source.is_dir():
            raise ConfigError(f"config file {source} is a directory; name a YAML file")
        try:
            from_file = yaml.safe_load(source.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{source}: invalid YAML ({yaml_problem(e)})") from e
        except (OSError, UnicodeDecodeError) as e:
            reason = getattr(e, "strerror", None) or "not a text file"
            raise ConfigError(f"config file {source} cannot be read ({reason})") from e
        if not isinstance(from_file, dict):
            raise ConfigError(f"{source}: the top level must be a mapping")
        values = _merge(values, from_file)
    values = _merge(values, parse_overrides(list(overrides)))
    return _build(cls, values)
