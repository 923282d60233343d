"""Two processes (2 CPU devices each, gloo collectives) train one policy through the CLI, with
one-step-off rollouts on each host's first device and training on the other two (fsdp across the
hosts): the session's two-host run (tests/hosts.py), read by tests/test_pod_hosts.py as well.

What a broken split would get wrong, and what is checked here: both processes log the same
numbers (reduced over hosts); the training batch holds both hosts' rows (the host-side mean
response length, gathered, equals the one the jitted step computes over the global batch); the
behaviour log-probs of the batches rolled out a step ahead stay exact; the eval, split over the
hosts, equals one process evaluating every prompt; the checkpoint both processes wrote holds the
weights process 0 exported; process 0 alone writes the logs; and a single process refuses to resume
the two-process run. (Each host's waiting batch in a checkpoint: tests/test_pod_hosts.py, whose
preempted run resumes from them.)
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from hosts import RUN, SMOKE, STEPS, without_time

from qarl_jax import quant, sharding
from qarl_jax.config import load_config, to_dict
from qarl_jax.main import main
from qarl_jax.models import from_pretrained
from qarl_jax.rewards import Grader
from qarl_jax.rl.train_step import Trainer
from qarl_jax.rollout.overlap import device_groups
from qarl_jax.run.build import build_engine, build_policy, build_tokenizer, engine_layout, eval_set
from qarl_jax.run.checkpoint import Checkpointer
from qarl_jax.run.heldout_eval import Evaluator

OVERRIDES = RUN  # tests/hosts.py: 4 steps, one-step-off rollouts, fsdp across both hosts


@pytest.fixture(scope="module")
def two_process_run(two_host_run):
    """The session's two-host run (built once, read by tests/test_pod_hosts.py as well)."""
    return two_host_run.run, two_host_run.export, two_host_run.summaries


@pytest.mark.slow
def test_two_processes_train_one_policy(two_process_run):
    run, export, (first, second) = two_process_run
    # the same reduced figures on both processes
    assert first["eval_before"] == second["eval_before"]
    assert without_time(first["final"]) == without_time(second["final"])
    # process 0 alone writes the logs: each step once, one event file
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(STEPS + 1))
    assert without_time(lines[-1]) == without_time(first["final"])
    assert len(list((run / "tb").glob("events.out.tfevents.*"))) == 1
    # one step off: step 1 trains on the batch rolled out before it, every later one on a batch
    # rolled out a step ahead, with the weights of the step before (exact behaviour log-probs)
    assert [m.get("rollout/staleness") for m in lines] == [None, 0, *[1] * (STEPS - 1)]
    # host-side lengths (gathered from both hosts) = the jitted step's over the global batch
    for m in lines[1:]:
        assert m["response_length"] == m["train/response_len_mean"]
        # each host's engine got the new weights; a batch rolled out a step ahead is checked at the
        # weights that rolled it out (the train/ check of a stale batch is its behaviour check)
        assert m["train/mismatch_frac_bitwise_equal"] == 1.0

    config = load_config(SMOKE, [f"run.output_dir={run}", *OVERRIDES])
    # this process's 8 devices split as the run's on one process: the trainer's 4 split the batch
    training, decoding = device_groups(4)
    mesh = sharding.make_mesh(config.mesh, training)
    tokenizer = build_tokenizer(config)
    with sharding.activate(mesh, config.mesh.rules), Grader(1) as grader:
        model, params = build_policy(config, mesh)
        # the eval split over two hosts = this single process evaluating every prompt
        frozen = jax.jit(lambda p: quant.quantize_params(p, config.quant))(params)
        engine = build_engine(config, model, frozen, tokenizer, engine_layout(config, decoding))
        held_out = eval_set(config.data, config.run.eval_prompts, tokenizer)
        assert Evaluator(config, engine, tokenizer, grader, held_out, params)(params) == first["eval_before"]
        # the checkpoint both processes wrote = the weights process 0 gathered and exported
        trainer = Trainer(model, config.objective, config.train, config.optimizer, mesh, config.mesh.rules)
        ckpt = Checkpointer(run / "checkpoints", config.run.keep, to_dict(config))
        restored = ckpt.restore(trainer.init_state(params))
        ckpt.close()
    assert restored.step == STEPS and len(restored.data_state["processes"]) == 2
    _, exported, _ = from_pretrained(export)
    saved, initial = (jax.tree.leaves(jax.device_get(t)) for t in (restored.state.params, params))
    assert all(np.array_equal(a, b) for a, b in zip(saved, jax.tree.leaves(exported), strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(saved, initial, strict=True))  # it trained


@pytest.mark.slow
def test_one_process_refuses_to_resume_a_two_process_run(two_process_run):
    """The two hosts' command on one process of as many devices (4; this process's 8 would split
    the batch over 6 training devices, a config error first): refused in one line, exit 3."""
    run, _, _ = two_process_run
    argv = [sys.executable, "-m", "qarl_jax.main", "--config", SMOKE, f"run.output_dir={run}", *OVERRIDES]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    done = subprocess.run([*argv, f"run.steps={STEPS + 1}"], env=env, capture_output=True, text=True)
    assert done.returncode == 3, done.stderr[-3000:]
    assert "was written by 2 process(es), this run has 1" in done.stderr
    assert "Traceback" not in done.stderr


def test_incomplete_multihost_flags_name_what_is_missing(capsys):
    assert main(["--config", SMOKE, "--coordinator", "localhost:1", "--num-processes", "2"]) == 2
    assert "needs --process-id (or $JAX_PROCESS_ID) as well" in capsys.readouterr().err
