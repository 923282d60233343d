"""Typed config: YAML + key=value overrides, strict validation with errors naming the key."""

import pathlib
import warnings

import pytest

from qarl_jax.config import Config, ConfigError, load_config, to_dict
from qarl_jax.sft import SftConfig

CONFIGS = sorted((pathlib.Path(__file__).parents[1] / "configs").glob("*.yaml"))


def test_defaults_round_trip():
    assert load_config() == Config()
    assert load_config(None, [f"seed={Config().seed}"]) == Config()
    assert isinstance(to_dict(Config())["mesh"]["rules"][0], list)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_validate(path):
    cls = SftConfig if path.name.startswith("sft_") else Config
    assert isinstance(load_config(path, cls=cls), cls)


def test_file_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("quant:\n  fmt: w8a8\nrun:\n  steps: 3\ndata:\n  synthetic:\n    digits: 3\n")
    cfg = load_config(
        f, ["run.steps=5", "mesh.tensor=2", "quant.quantized=[attention]", "objective.name=gspo"]
    )
    assert (cfg.quant.fmt, cfg.run.steps, cfg.mesh.tensor, cfg.quant.quantized) == (
        "w8a8",
        5,
        2,
        ("attention",),
    )
    assert (cfg.data.synthetic.digits, cfg.objective.name, cfg.optimizer.name) == (3, "gspo", "adamw")


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["quant.fmtt=w8a8"],
            r"unknown config key quant.fmtt; valid keys here: \['fmt', 'group_size', 'mode', 'quantized'\]",
        ),
        (
            ["nope=1"],
            r"unknown config key nope; valid keys here: \['alignment', 'data', 'mesh', 'model', "
            r"'objective', 'optimizer', 'quant', 'rewards', 'rollout', 'run', 'seed', 'train'\]",
        ),
        (["run.steps=many"], r"run.steps: expected int, got str"),
        (["data.synthetic.ops=/"], r"data.synthetic: synthetic.ops: must be a non-empty subset"),
        (["objective.name=ppo"], r"objective: objective.name='ppo'"),
        (["optimizer.learning_rate=0"], r"optimizer.learning_rate must be positive"),
        (["rewards.kind=regex"], r"rewards: kind 'regex' is not one of"),
        (["rollout.temperature=0.7"], r"train.temperature \(1.0\) must equal rollout.temperature \(0.7\)"),
        (["data.samples_per_prompt=4"], r"group size is rollout.samples_per_prompt"),
        (["rollout.max_len=40"], r"exceed rollout.max_len \(40\)"),
        (["model.path=/x", "model.num_hidden_layers=2"], r"model: num_hidden_layers overrides a preset"),
        (["seed=true"], r"seed: expected int, got bool"),
        (["quant.fmt=w3a3"], r"quant: unknown quantization format 'w3a3'"),
        (["model.path=null", "model.preset=gpt2"], r"model: unknown preset 'gpt2'"),
        (["model.compute_dtype=float16"], r"compute_dtype must be"),
        (["run.steps=0"], r"run: steps, log_every, eval_prompts and keep must be >= 1"),
        (["mesh.rules=[[embed, 7]]"], r"mesh.rules\[0\]\[1\]"),
        (["seed"], r"not of the form key=value"),
        (["rollout.advantage_std=biased"], r"rollout: advantage_std must be one of"),
        (["rollout.advantage=ppo"], r"rollout: advantage must be one of"),
        (["rollout.overlong_buffer=40"], r"overlong_buffer \(40\) must be in \[0, max_new_tokens=32\]"),
        (["rollout.max_resample_rounds=-1"], r"max_resample_rounds must be >= 0"),
        (
            ["objective.name=gspo", "objective.aggregation=token_mean"],
            r"aggregation='token_mean' aggregates tokens, but objective.name='gspo' is sequence-level",
        ),
    ],
)
def test_bad_values_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "bad.yaml").write_text("quant: {fmt: [\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(tmp_path / "bad.yaml")


def test_advantage_follows_the_objective_unless_set():
    """rollout.advantage=auto: Dr. GRPO's mean-only advantages for objective dr_grpo, std-normalised
    for the others; set explicitly it wins, with a warning when it contradicts the objective."""
    assert Config().advantage == "grpo" and Config().rollout.advantage_std == "sample"
    assert load_config(None, ["objective.name=dr_grpo"]).advantage == "dr_grpo"
    with pytest.warns(UserWarning, match="rollout.advantage='grpo' but objective.name='dr_grpo' implies"):
        assert load_config(None, ["objective.name=dr_grpo", "rollout.advantage=grpo"]).advantage == "grpo"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (
            load_config(None, ["objective.name=dr_grpo", "rollout.advantage=dr_grpo"]).advantage == "dr_grpo"
        )
