"""Typed config: YAML + key=value overrides, strict validation with errors naming the key."""

import pathlib

import pytest

from qarl_jax.config import Config, ConfigError, load_config, to_dict

CONFIGS = sorted((pathlib.Path(__file__).parents[1] / "configs").glob("*.yaml"))


def test_defaults_round_trip():
    assert load_config() == Config()
    assert load_config(None, [f"seed={Config().seed}"]) == Config()
    assert isinstance(to_dict(Config())["mesh"]["rules"][0], list)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_validate(path):
    assert isinstance(load_config(path), Config)


def test_file_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("quant:\n  fmt: w8a8\ndemo:\n  batch: 3\n")
    cfg = load_config(f, ["demo.batch=5", "mesh.tensor=2", "quant.quantized=[attention]"])
    assert (cfg.quant.fmt, cfg.demo.batch, cfg.mesh.tensor, cfg.quant.quantized) == (
        "w8a8",
        5,
        2,
        ("attention",),
    )


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["quant.fmtt=w8a8"],
            r"unknown config key quant.fmtt; valid keys here: \['fmt', 'group_size', 'quantized'\]",
        ),
        (
            ["nope=1"],
            r"unknown config key nope; valid keys here: \['demo', 'mesh', 'model', 'quant', 'seed'\]",
        ),
        (["demo.batch=many"], r"demo.batch: expected int, got str"),
        (["seed=true"], r"seed: expected int, got bool"),
        (["quant.fmt=w3a3"], r"quant: unknown quantization format 'w3a3'"),
        (["model.preset=gpt2"], r"model: unknown preset 'gpt2'"),
        (["model.compute_dtype=float16"], r"compute_dtype must be"),
        (["demo.new_tokens=0"], r"demo: new_tokens must be positive"),
        (["mesh.rules=[[embed, 7]]"], r"mesh.rules\[0\]\[1\]"),
        (["seed"], r"not of the form key=value"),
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
