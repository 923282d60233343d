"""Asynchronous (one-step-off) rollouts on device groups of their own: the overlapped run equals its
sequential reference metric for metric, the behaviour log-probs stay exact, a SIGKILLed run resumes
exactly, the waiting batches survive their JSON round trip bit for bit, and bad layouts are one line."""

import json
import pathlib
import time

import jax
import numpy as np
import pytest
import stopped_cli

from qarl_jax.config import load_config
from qarl_jax.main import main
from qarl_jax.rollout.driver import Sample
from qarl_jax.rollout.groups import Groups
from qarl_jax.rollout.overlap import PhaseClock, Produced, run_phases
from qarl_jax.run.train import train

SMOKE = pathlib.Path(__file__).parents[1] / "configs" / "loop_smoke.yaml"
STEPS = 3
# 8 fake devices: 4 decode, 4 train; two updates per batch so the policy moves within a step
ASYNC = ["rollout.async_steps=1", "rollout.devices=4", "train.num_minibatches=2", f"run.steps={STEPS}"]
# evals before the first step and after the last (the smoke config's)
ASYNC += ["run.checkpoint_every=1", "train.assert_aligned=true"]
# the 4 layers as one scanned layer (the real-run configs' layout): the schedule, the exactness and
# the resume do not depend on the depth, and every program compiles one layer, not four
ASYNC += ["model.scan_layers=true"]


def metrics_without_timing(run_dir) -> list[dict]:
    lines = pathlib.Path(run_dir, "metrics.jsonl").read_text().splitlines()
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "grader/"))}
        for line in lines
    ]


@pytest.fixture(scope="module")
def overlapped(tmp_path_factory):
    out = tmp_path_factory.mktemp("overlapped")  # never resumed: its last checkpoint only
    return out, train(load_config(SMOKE, [f"run.output_dir={out}", *ASYNC, "run.checkpoint_every=0"]))


@pytest.fixture(scope="module")
def sequential(tmp_path_factory):
    """The sequential reference (``rollout.overlap=false``), run the hard way: the CLI run is killed
    as it starts checkpoint 2's save (checkpoint 1 committed, the batch rolled out for step 2
    waiting in it), and the same config again resumes it and finishes. One run serves both the
    overlap's reference and the SIGKILL resume."""
    out = tmp_path_factory.mktemp("sequential")
    args = [f"--config={SMOKE}", f"run.output_dir={out}", *ASYNC, "rollout.overlap=false"]
    stopped_cli.kill(stopped_cli.start_and_stop(args, 2, tmp_path_factory.mktemp("log") / "stderr"))
    return out, train(load_config(SMOKE, [f"run.output_dir={out}", *ASYNC, "rollout.overlap=false"]))


@pytest.mark.slow
def test_overlapped_run_equals_its_sequential_reference(overlapped, sequential):
    ref_dir, ref = overlapped
    lines = [json.loads(line) for line in (ref_dir / "metrics.jsonl").read_text().splitlines()]
    steps = lines[1:]
    # batch 0 and batch 1 were both rolled out by the initial weights; each later batch by the
    # weights one update old
    assert [m["rollout/staleness"] for m in steps] == [0, 1, 1]
    for m in steps:  # the behaviour log-probs are exact: the training forward at those weights
        assert m["train/mismatch_frac_bitwise_equal"] == 1.0 and m["train/mismatch_kl_k3"] == 0.0
        assert m["train/skipped"] == 0.0 and m["time/train_busy"] > 0
    # the current weights are not the behaviour's: the staleness is measured, and not zero
    assert all(m["train/staleness_kl_k3"] > 0 for m in steps[1:]) and "train/staleness_kl_k3" not in steps[0]
    # the engine ran while the trainer trained, except in the last step: nothing is left to roll out
    assert all(m["time/overlap_frac"] > 0 and m["time/rollout_busy"] > 0 for m in steps[:-1])
    assert steps[-1]["time/rollout_busy"] == 0.0
    seq_dir, seq = sequential
    assert metrics_without_timing(seq_dir) == metrics_without_timing(ref_dir)
    jax.tree.map(np.testing.assert_array_equal, seq.state.params, ref.state.params)
    seq_lines = [json.loads(line) for line in (seq_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(m["time/overlap_frac"] == 0.0 for m in seq_lines[1:])


@pytest.mark.slow
def test_sigkill_mid_run_then_rerun_resumes_exactly(overlapped, sequential):
    """The killed run (the ``sequential`` fixture) resumed from a checkpoint and finished with
    every step's metrics and the final weights of the uninterrupted (overlapped) run's."""
    (ref_dir, ref), (seq_dir, seq) = overlapped, sequential
    assert seq.summary["resumed_from"] in (1, 2)
    assert metrics_without_timing(seq_dir) == metrics_without_timing(ref_dir)
    jax.tree.map(np.testing.assert_array_equal, seq.state.params, ref.state.params)


def test_a_waiting_batch_survives_its_json_round_trip_bit_for_bit():
    rng = np.random.default_rng(0)
    logps = rng.normal(size=5).astype(np.float32) * 3  # f32 values, as the engine records them
    sample = Sample(
        3, 1, [5, 6, 7, 8, 0], [float(v) for v in logps], [float(v) for v in logps], "policy", "eos"
    )
    scores = np.asarray([[1.0, 0.0]])
    rewards = np.asarray([[1.0, -0.1 / 3]])  # a penalty with every bit of an f64 in use
    groups = Groups([[1, 2, 3]], [[sample, sample]], scores, rewards)
    produced = Produced(groups, groups, {"dropped": 1.0}, 7, 0.25, 10, {"mismatch_kl_k3": 0.0})
    back = Produced.from_json(json.loads(json.dumps(produced.to_json())))
    assert back.version == 7 and back.tokens == 10 and back.check == produced.check
    assert back.groups.samples[0][1] == sample and back.groups.prompts == [[1, 2, 3]]
    for a, b in ((back.groups.rewards, rewards), (back.drawn.scores, scores)):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    assert np.asarray(back.groups.samples[0][0].logprobs, np.float32).tobytes() == logps.tobytes()


def test_phase_clock_counts_overlap_and_idle_time():
    clock = PhaseClock(rollout=(10.0, 14.0), train=(11.0, 13.0))  # training hidden inside the rollout
    m = clock.metrics(step_s=4.5)
    assert m == {
        "time/rollout_busy": 4.0,
        "time/train_busy": 2.0,
        "time/idle_rollout": 0.5,
        "time/idle_train": 2.5,
        "time/overlap_frac": 1.0,
    }
    assert PhaseClock(rollout=(0.0, 2.0), train=(1.0, 4.0)).metrics(4.0)["time/overlap_frac"] == 0.5
    # sequential: rollout then train, no overlap; a failing phase still joins the other
    clock = PhaseClock()
    assert run_phases(lambda: 1, lambda: 2, False, clock) == (1, 2)
    assert clock.rollout[1] <= clock.train[0] and clock.metrics(1.0)["time/overlap_frac"] == 0.0

    def boom():
        raise RuntimeError("trainer failed")

    with pytest.raises(RuntimeError, match="trainer failed"):
        run_phases(lambda: time.sleep(0.05), boom, True, PhaseClock())


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["rollout.devices=2"], ["devices=2 with async_steps=0", "take turns"]),
        (
            ["rollout.async_steps=1", "rollout.devices=8"],
            ["rollout.devices (8) leaves no device to train on"],
        ),
        (["rollout.async_steps=1", "rollout.devices=3"], ["16 rows a step", "over the 5 devices"]),
        (["rollout.async_steps=1", "rollout.devices=4", "mesh.fsdp=8"], ["mesh:", "4 of them decoding"]),
        (["rollout.async_steps=1", "rollout.devices=4", "rollout.mesh.data=8"], ["rollout.mesh", "4"]),
        (["rollout.async_steps=-1"], ["async_steps and devices must be >= 0"]),
    ],
)
def test_bad_async_layouts_are_one_line_before_any_work(overrides, words, tmp_path, capsys):
    assert main(["--config", str(SMOKE), f"run.output_dir={tmp_path}/run", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err) and all(w in err[-1] for w in words), err[-1]
    assert not (tmp_path / "run").exists()
