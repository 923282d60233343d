"""fp8 on a GPU below compute capability 8.9 (an A100) is refused in one line, naming the GPU's
capability and the formats that run, where the GPU kernels are chosen and before a checkpoint
loads. The check is a pure function of the capability; the entry points are driven by an A100's
(capability, kind) in place of the device query, since no GPU is attached here."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import kernels_pallas as kp
from kernels_pallas import gpu_support
from kernels_pallas.gpu_support import unsupported
from qarl_jax.config import load_config
from qarl_jax.errors import CheckpointError, ConfigError
from qarl_jax.run.build import build_policy

A100 = ("8.0", "NVIDIA A100-SXM4-80GB")
A100_LINE = (
    "format 'fp8' needs a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell: Triton "
    "converts float8_e4m3fn only there); NVIDIA A100-SXM4-80GB is 8.0: use one of bf16, w8a8, w4a16, w4a8"
)


def test_fp8_on_an_a100_is_one_line_naming_its_capability_and_the_formats_that_run():
    assert unsupported("fp8", *A100) == A100_LINE


@pytest.mark.parametrize("capability", ["7.0", "7.5", "8.0", "8.6", "8.7"])
def test_below_8_9_refuses_fp8_only(capability):
    assert unsupported("fp8", capability) is not None
    assert all(unsupported(fmt, capability) is None for fmt in kp.FORMATS if fmt != "fp8")


@pytest.mark.parametrize("capability", ["8.9", "9.0", "10.0", "12.0"])  # "10.0" < "8.9" as strings
def test_from_8_9_every_format_runs(capability):
    assert all(unsupported(fmt, capability) is None for fmt in kp.FORMATS)


def test_bad_input_is_one_line():
    with pytest.raises(
        ValueError, match=r"^compute capability must be 'major.minor' \(e.g. '9.0'\), got 'sm_80'$"
    ):
        unsupported("fp8", "sm_80")
    with pytest.raises(ValueError, match="fp4"):
        unsupported("fp4", "9.0")


def _operands(experts: int = 0):
    shape = (experts, 128, 128) if experts else (128, 128)
    w = kp.quantize(jax.random.normal(jax.random.key(0), shape), "fp8")
    return jnp.ones((8, 128), jnp.bfloat16), w


def test_the_gpu_kernels_refuse_fp8_on_an_a100(monkeypatch):
    monkeypatch.setattr(gpu_support, "first_gpu", lambda: A100)
    x, w = _operands()
    with pytest.raises(ValueError) as dense:
        kp.quantized_matmul(x, w, backend="gpu")
    x, we = _operands(experts=2)
    with pytest.raises(ValueError) as grouped:
        kp.grouped_matmul(x, we, jnp.array([5, 3], jnp.int32), backend="gpu")
    assert str(dense.value) == str(grouped.value) == A100_LINE


def test_a_run_refuses_fp8_on_an_a100_before_its_checkpoint_loads(monkeypatch):
    monkeypatch.setattr(gpu_support, "first_gpu", lambda: A100)
    config = load_config(None, ["quant.fmt=fp8", "model.path=/nonexistent"])
    with pytest.raises(ConfigError, match=f"^{re.escape('quant.fmt: ' + A100_LINE)}$"):
        build_policy(config, None)
    monkeypatch.setattr(gpu_support, "first_gpu", lambda: ("9.0", "NVIDIA H200"))
    with pytest.raises(CheckpointError, match="/nonexistent"):  # past the check: no checkpoint there
        build_policy(config, None)
