"""The session's reference smoke run: one CLI training run (``configs/loop_smoke.yaml``, 4 steps,
checkpoints at steps 2 and 4, evals at steps 0, 2 and 4) with its Hugging Face and
compressed-tensors exports, built once per test session and read by every test that only reads a
run (tests/conftest.py's ``reference_run`` fixture). Why: the checkpoint, CLI, notebook and export
tests each trained a smoke run of their own (five runs of the same few steps, each ~20-80 s on two
loaded cores) only to read it.

Under pytest-xdist the workers share it (tests/once.py): the first to ask builds it, the others
wait and read it. A test must not write into it: copy it first (``shutil.copytree``).

The run directory was made the way ``run.overwrite=true`` meets an earlier run's logs (a stale
TensorBoard event file and metrics rows, no checkpoint), so that tests/test_main.py reads the
replacement off it as well. Imported as a plain module (``import smoke_run``).
"""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
from dataclasses import dataclass

REPO = pathlib.Path(__file__).resolve().parents[1]
SMOKE = REPO / "configs" / "loop_smoke.yaml"
STEPS = 4
# what the run was given beyond the smoke config (a resume of a copy passes the same)
OVERRIDES = (f"run.steps={STEPS}", "run.checkpoint_every=2", "run.eval_every=2")
STALE_EVENTS = "events.out.tfevents.old"  # the earlier run's TensorBoard file the overwrite removes


@dataclass(frozen=True)
class Reference:
    """Where the reference run and its exports are, and the summary ``main`` printed."""

    run: pathlib.Path  # the run directory, named "aligned" (the notebook labels runs by name)
    hf: pathlib.Path  # --export-hf
    ct: pathlib.Path  # --export-compressed-tensors
    summary: dict


def argv(run: pathlib.Path, *more: str) -> list[str]:
    """The CLI arguments of the reference run for run directory ``run`` (``more`` appended)."""
    return ["--config", str(SMOKE), f"run.output_dir={run}", *OVERRIDES, *more]


def build(root: pathlib.Path) -> None:
    """Train the reference run under ``root`` (in this process, through ``main``)."""
    from qarl_jax.main import main

    run = root / "aligned"
    (run / "tb").mkdir(parents=True)
    (run / "tb" / STALE_EVENTS).write_text("old")
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    out = io.StringIO()
    exports = ["--export-hf", str(root / "hf"), "--export-compressed-tensors", str(root / "ct")]
    with contextlib.redirect_stdout(out):
        code = main(argv(run, "run.overwrite=true", *exports))
    assert code == 0, f"the reference run failed ({code})"
    (root / "summary.json").write_text(out.getvalue())


def shared(base: pathlib.Path) -> Reference:
    """The session's reference run, built once for all the session's workers (tests/once.py);
    ``base`` is this process's pytest temporary root."""
    import once

    root = once.built_once(base, "reference-run", build)
    return Reference(
        root / "aligned", root / "hf", root / "ct", json.loads((root / "summary.json").read_text())
    )


def final_state(ref: Reference):
    """The run's last checkpoint (step 4) restored whole: parameters, optimizer state, step."""
    from qarl_jax import sharding
    from qarl_jax.config import load_config, to_dict
    from qarl_jax.rl.train_step import Trainer
    from qarl_jax.run.build import build_policy
    from qarl_jax.run.checkpoint import Checkpointer

    config = load_config(ref.run / "config.json")  # JSON is YAML
    mesh = sharding.make_mesh(config.mesh)
    ckpt = Checkpointer(ref.run / "checkpoints", config.run.keep, to_dict(config))
    with sharding.activate(mesh, config.mesh.rules):
        model, params = build_policy(config, mesh)
        trainer = Trainer(model, config.objective, config.train, config.optimizer, mesh, config.mesh.rules)
        restored = ckpt.restore(trainer.init_state(params))
    ckpt.close()
    assert restored is not None and restored.step == STEPS
    return restored.state
