"""Builders of a run's parts from its config: the policy and its weights, the tokenizer, the rollout
engine and the held-out prompts.

The training loop (:mod:`qarl_jax.run.train`), the alignment check and the SFT script build the same
parts the same way; they live here, apart from the loop, so a tool that only needs a policy does not
import the loop's logging and checkpointing.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
from etils import epath
from jax.sharding import Mesh

from kernels_pallas.gpu_support import check_gpu_format
from kernels_pallas.shapes import check_shapes
from qarl_jax import sharding
from qarl_jax.config import Config, ModelConfig, load_config, to_dict
from qarl_jax.data import DataConfig, build_arithmetic_tokenizer, build_pipeline
from qarl_jax.errors import CheckpointError, ConfigError, DataError
from qarl_jax.models import Qwen3ForCausalLM, init_sharded, load_tokenizer, preset
from qarl_jax.models.config import TransformerConfig
from qarl_jax.models.hf_io import load_config as hf_config
from qarl_jax.models.hf_io import load_params
from qarl_jax.quant import QuantSpec
from qarl_jax.rollout import EngineConfig, RolloutEngine, layout

EOS_TOKENS = ("<|endoftext|>", "<|im_end|>")
PACKAGE_DIR = pathlib.Path(__file__).parents[1]  # qarl_jax/ (the shipped assets)


def model_dir(path: str) -> epath.Path:
    """``package:REL`` names a directory shipped in the package (the default policy); others as is
    (a local directory or ``gs://bucket/...``)."""
    return epath.Path(PACKAGE_DIR / path.removeprefix("package:") if path.startswith("package:") else path)


def architecture(config: Config) -> TransformerConfig:
    """The policy's architecture: the preset's, or the checkpoint's config.json (no weights read),
    computing in the column blocks a tensor-parallel rollout of ``rollout.mesh.tensor`` needs."""
    m = config.model
    layout = dict(
        scan_layers=m.scan_layers, remat_policy=m.remat_policy, tensor_blocks=config.rollout.mesh.tensor
    )
    if m.path is None:
        depth = {} if m.num_hidden_layers is None else {"num_hidden_layers": m.num_hidden_layers}
        return preset(m.preset, param_dtype=m.param_dtype, dtype=m.compute_dtype, **depth, **layout)
    return hf_config(model_dir(m.path), param_dtype=m.param_dtype, dtype=m.compute_dtype, **layout)


def build_policy(config: Config, mesh) -> tuple[Qwen3ForCausalLM, dict]:
    """The policy model (with the run's quant spec) and its float master weights on ``mesh``. A
    format or a shape this host's GPU or TPU kernels cannot run, and a group size a projection's K
    cannot take, are refused here in one line, before a checkpoint loads."""
    try:
        check_gpu_format(config.quant.fmt)
    except ValueError as e:
        raise ConfigError(f"quant.fmt: {e}") from None
    m = config.model
    arch = architecture(config)  # the checkpoint's config.json, read once
    groups = quant_group_sizes(config.quant, arch)
    try:
        check_shapes(arch.head_dim, groups.values())
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None
    model = Qwen3ForCausalLM(arch, config.quant)
    if m.path is None:
        return model, init_sharded(model, jax.random.key(config.seed), mesh, config.mesh.rules)
    shardings = sharding.param_shardings(model, mesh, config.mesh.rules)
    return model, load_params(model_dir(m.path), arch, shardings)  # each host reads its shards


def quant_group_sizes(spec: QuantSpec, arch: TransformerConfig) -> dict[str, int]:
    """The int4 group size of each quantized projection of ``arch`` (empty for the other formats),
    or a :class:`ConfigError` in one line naming the projection whose K the spec cannot take and
    what to set: refused when the config is checked, not in a kernel's trace."""
    try:
        return spec.group_sizes(arch.projections())
    except ValueError as e:
        raise ConfigError(f"quant: {e}") from None


def is_hf_dir(path: epath.Path | pathlib.Path) -> bool:
    """Whether ``path`` holds a Hugging Face model's config.json."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and ("architectures" in config or "model_type" in config)


def run_checkpoint(path: epath.Path) -> tuple[epath.Path, int | None] | None:
    """(run directory, step or None for the newest) when ``path`` is a training run's directory or
    one step of it (``RUN/checkpoints/23``); None for anything else."""
    if path.name.isdigit() and path.parent.name == "checkpoints":
        return path.parent.parent, int(path.name)
    if (path / "checkpoints").is_dir() and (path / "config.json").is_file():
        return path, None
    return None


def restore_policy(run_dir: epath.Path, step: int | None) -> tuple[Config, Qwen3ForCausalLM, dict, int]:
    """The run's config, policy and master weights of checkpoint ``step`` (None: the newest
    intact), restored (fingerprints checked) onto a mesh of every device JAX sees instead of the
    run's (a run's weights are evaluated or exported on whatever machine is at hand); and the step."""
    from qarl_jax.rl.train_step import Trainer
    from qarl_jax.run.checkpoint import (
        Checkpointer,  # orbax, the optimizer: only tools reading runs need them
    )

    config = load_config(run_dir / "config.json")  # JSON is YAML
    here = dataclasses.replace(config, mesh=sharding.MeshConfig())
    mesh = sharding.make_mesh(here.mesh)
    ckpt = Checkpointer(run_dir / "checkpoints", config.run.keep, to_dict(config))
    with sharding.activate(mesh, here.mesh.rules):
        model, params = build_policy(here, mesh)
        trainer = Trainer(model, here.objective, here.train, here.optimizer, mesh, here.mesh.rules)
        restored = ckpt.restore(trainer.init_state(params), step=step)
    ckpt.close()
    if restored is None:
        raise CheckpointError(f"{run_dir}: the run has no checkpoint yet")
    return here, model, restored.state.params, restored.step


def check_model_files(model: ModelConfig) -> None:
    """Fail before any work on a ``model.path`` that is not a model this package can load: empty,
    no such directory, no config.json, an architecture it does not run."""
    if model.path is None:
        return
    if not model.path.strip():
        raise ConfigError(
            "model.path is empty: name a Hugging Face model directory, or null for model.preset"
        )
    path = model_dir(model.path)
    if not path.is_dir():
        where = path if "://" in model.path else path.absolute()
        raise ConfigError(f"model.path {model.path}: no such directory ({where})")
    hf_config(path)


def build_tokenizer(config: Config):
    """The checkpoint's tokenizer.json, or the arithmetic character tokenizer for presets."""
    if config.model.path is None:
        return build_arithmetic_tokenizer()
    tokenizer = load_tokenizer(model_dir(config.model.path))
    if tokenizer is None:
        raise CheckpointError(f"{config.model.path}: no tokenizer.json (the loop needs one to grade)")
    return tokenizer


def eos_ids(tokenizer) -> tuple[int, ...]:
    """The ids of Qwen3's end tokens that ``tokenizer`` has."""
    return tuple(i for t in EOS_TOKENS if (i := tokenizer.token_to_id(t)) is not None)


def engine_layout(config: Config, devices: list | None = None) -> Mesh:
    """The rollout engine's mesh (``rollout.mesh`` over ``devices``, default this process's), checked
    against the architecture before any weight is loaded or the run directory written (see
    :func:`qarl_jax.rollout.layout.check_layout`), as the quantization's group sizes are
    (:func:`quant_group_sizes`)."""
    r = config.rollout
    devices = jax.local_devices() if devices is None else devices
    arch = architecture(config)
    quant_group_sizes(config.quant, arch)
    layout.check_layout(r.mesh, arch, len(devices))
    return layout.engine_mesh(r.mesh, devices)


def build_engine(config: Config, model: Qwen3ForCausalLM, frozen, tokenizer, mesh: Mesh) -> RolloutEngine:
    """The rollout engine over frozen weights on its own layout ``mesh`` (:func:`engine_layout`), with
    the run's slots, cache length and stop tokens."""
    r = config.rollout
    engine_cfg = EngineConfig(slots=r.slots, max_len=r.max_len, eos_ids=eos_ids(tokenizer))
    return RolloutEngine(model, frozen, engine_cfg, mesh=mesh, rules=layout.ENGINE_RULES)


def training_data(data: DataConfig) -> DataConfig:
    """The data the loop trains on: a JSONL file without ``eval_path`` gives up the held-out side
    of its content-hash split (:func:`eval_set` evaluates on it)."""
    if data.source == "jsonl" and data.eval_path is None and data.hash_split is None:
        return dataclasses.replace(data, hash_split="train")
    return data


def eval_set(data: DataConfig, size: int, tokenizer) -> dict:
    """The held-out prompts, in order, never rows the loop trains on: the test split of synthetic
    and TFDS sources; for JSONL the file ``data.eval_path``, else the held-out side of the
    content-hash split of ``data.path``. A batch of the pipeline (``prompt_ids``, ``answer``, ...)
    plus ``skipped``: the held-out rows skipped on the way, by category, which the loop reports
    as ``data/eval_skipped_*`` (as it reports the training data's as ``data/skipped_*``)."""
    held_out = dataclasses.replace(data, seed=data.seed + 1, batch_size=size, shuffle=False)
    if data.source in ("synthetic", "tfds"):
        held_out = dataclasses.replace(held_out, split="test")
    elif data.eval_path is not None:
        held_out = dataclasses.replace(held_out, path=data.eval_path, hash_split=None)
    else:
        held_out = dataclasses.replace(held_out, hash_split="test")
    try:
        pipeline = build_pipeline(held_out, tokenizer)
        return next(pipeline) | {"skipped": pipeline.skipped_by_category()}
    except DataError as e:
        if data.source != "jsonl" or data.eval_path is not None:
            raise
        raise DataError(f"held-out rows: {e}; give a held-out file as data.eval_path") from e
