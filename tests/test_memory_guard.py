"""Memory guard: XLA's compiled temp bytes of the trainer's programs, compile-only (nothing runs),
under recorded bounds. Why: the fused per-token chains once took the differentiated forward from
O(T) back to 3.3x its memory (a619a06: every intermediate of a layer's chain alive for all T tokens
in the backward) and nothing noticed. A change that brings memory back fails here.

Each figure fails at more than ``SLACK`` x its recorded value, and the forward's growth per 4x of
T must stay linear. When a change lowers a figure for good, record the new one: ``python
tests/test_memory_guard.py`` prints every figure as this file records it.
"""

from __future__ import annotations

import pathlib

import jax
import pytest

from qarl_jax.config import load_config
from qarl_jax.models import Qwen3ForCausalLM, preset
from qarl_jax.quant import QuantSpec
from qarl_jax.tools import compiled_memory, memory_plan
from qarl_jax.tools.memory_plan import architecture

SLACK = 1.25
MAX_GROWTH_PER_4X = 4.2  # O(T): the per-token tensors (residuals, cotangents) grow 4x, the rest less

# temp bytes, XLA:CPU (jax 0.10.2), recorded 2026-12-02 by ``python tests/test_memory_guard.py``
FORWARD_SHAPE = ("qwen3-1.7b", 2)  # the real widths, 2 scanned layers, w4a16, B = 1, remat
RECORDED_FORWARD = {4096: 1_764_215_128, 16384: 2_698_811_992}  # a619a06: 4.37 / 16.87 GB
REAL_RUN = ("qwen3_8b_8gpu.yaml", 2)  # its update program on its 8-device mesh, 2 layers
RECORDED_UPDATE = 10_210_048_920  # a619a06: 17.99 GB

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def forward_temp(length: int) -> int:
    name, layers = FORWARD_SHAPE
    model = Qwen3ForCausalLM(preset(name, num_hidden_layers=layers, scan_layers=True), QuantSpec("w4a16"))
    return compiled_memory.differentiated_forward(model, length).temp


def update_temp() -> int:
    """The update program (one minibatch, its micro-batches accumulated) of the real-run config
    at reduced depth, on its mesh of fake CPU devices."""
    from qarl_jax import sharding

    name, layers = REAL_RUN
    config = load_config(CONFIGS / name, ["model.path=null", f"model.num_hidden_layers={layers}"])
    c, _ = architecture(config)
    model = Qwen3ForCausalLM(c, config.quant)
    m = config.mesh
    mesh = sharding.make_mesh(m, jax.devices()[: m.data * m.fsdp * m.tensor * m.expert])
    r = config.rollout
    programs = compiled_memory.train_step_programs(
        model,
        config.objective,
        config.train,
        config.optimizer,
        config.data.batch_size * r.samples_per_prompt,
        r.max_len,
        mesh,
        m.rules,
    )
    return next(p for p in programs if p.name == "update").temp


def _within(figure: int, recorded: int, what: str) -> None:
    assert figure <= SLACK * recorded, (
        f"{what}: {figure / 1e9:.3f} GB temp, over {SLACK} x the recorded {recorded / 1e9:.3f} GB"
    )


@pytest.mark.slow  # two compiles of the scanned, rematerialized backward: ~9 s of CPU each, at any width
def test_differentiated_forward_memory_is_bounded_and_linear_in_t():
    short, long = sorted(RECORDED_FORWARD)
    temps = {t: forward_temp(t) for t in (short, long)}
    for t, temp in temps.items():
        _within(temp, RECORDED_FORWARD[t], f"{FORWARD_SHAPE} differentiated forward at T={t}")
    assert long == 4 * short
    growth = temps[long] / temps[short]
    assert growth <= MAX_GROWTH_PER_4X, f"temp grows {growth:.2f}x per 4x of T (bound {MAX_GROWTH_PER_4X})"


@pytest.mark.slow
def test_real_run_update_memory_is_bounded(capsys):
    """``memory_plan --compiled`` on the real-run config at reduced depth, on its mesh of 8 fake CPU
    devices: the run's four programs compile and their figures print beside the estimate, and the
    update's temp bytes (the table's, in GB to 2 decimals: what :func:`update_temp` compiles) stay
    under the recorded bound."""
    if jax.device_count() < 8:
        pytest.fail("the memory guard needs 8 devices (tests/conftest.py sets 8 fake CPU devices)")
    name, layers = REAL_RUN
    args = ["--config", str(CONFIGS / name), "--compiled", "--platform", "h100", "model.path=null"]
    assert memory_plan.main([*args, f"model.num_hidden_layers={layers}"]) == 0
    out = capsys.readouterr().out
    assert "compiled (XLA memory_analysis per device, GB)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  ")}
    for program in ("old_logprobs", "update", "prefill", "decode_step"):  # name and 8 figures
        assert len(rows[program]) == 9, rows[program]
    assert "compiled total" in out and "fits" in out
    temp = float(rows["update"][4]) * 1e9  # args, out, alias, temp, ...
    _within(round(temp - 0.005e9), RECORDED_UPDATE, f"{name} update at {layers} layers")


if __name__ == "__main__":  # print the figures as this file records them
    import os

    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    print(f"RECORDED_FORWARD = {{{', '.join(f'{t}: {forward_temp(t)}' for t in sorted(RECORDED_FORWARD))}}}")
    print(f"RECORDED_UPDATE = {update_temp()}")
