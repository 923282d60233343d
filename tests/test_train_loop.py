"""The training loop on the smoke config: metrics per step, evals, weight sync to the engine, the
DAPO data side and a JSONL run's skipped rows. Two runs serve every loop test: the session's
reference run (tests/smoke_run.py) and one step of a JSONL run with every data-side option on."""

import json
import pathlib
import struct
from typing import Any

import numpy as np
import pytest
import smoke_run
from tensorboardX.proto.event_pb2 import Event, SessionLog

from qarl_jax import quant, sharding
from qarl_jax.config import load_config
from qarl_jax.rewards import Grader
from qarl_jax.run.build import PACKAGE_DIR, build_engine, build_policy, build_tokenizer, eval_set, model_dir
from qarl_jax.run.heldout_eval import Evaluator, eval_seed
from qarl_jax.run.runlog import MetricsLog
from qarl_jax.run.train import _objective, step_seed, train

SMOKE = pathlib.Path(__file__).parents[1] / "configs" / "loop_smoke.yaml"


def events(run_dir: pathlib.Path) -> list[Event]:
    """The events of the run's TensorBoard files, file by file (TFRecord: length, its CRC, the
    serialized Event, its CRC)."""
    out = []
    for f in sorted((run_dir / "tb").glob("events.out.tfevents.*")):
        data, pos = f.read_bytes(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            out.append(Event.FromString(data[pos + 12 : pos + 12 + n]))
            pos += 12 + n + 4
    return out


def scalars(run_dir: pathlib.Path) -> dict[tuple[int, str], float]:
    return {(e.step, v.tag): v.simple_value for e in events(run_dir) for v in e.summary.value}


def test_loop_logs_every_step_and_keeps_the_engine_in_sync(reference_run):
    """The session's reference run (tests/smoke_run.py: 4 steps, evals every 2): every step logged,
    in metrics.jsonl and TensorBoard alike; the engine kept in sync: each step's first update
    scores the rollout's log-probs bit for bit (the statistic train.assert_aligned raises on),
    which after the first update holds only if the engine got the updated weights."""
    run = reference_run.run
    config = load_config(run / "config.json")  # JSON is YAML
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = smoke_run.STEPS
    assert [m["step"] for m in lines] == list(range(steps + 1)) and config.run.steps == steps
    evals = ["eval/accuracy", "eval/response_length"]
    for m in lines[:: config.run.eval_every]:  # steps 0, 2, 4
        assert 0.0 <= m["eval/accuracy"] <= 1.0 and m["eval/response_length"] > 0
    assert not any(k in m for m in lines[1::2] for k in evals)
    for m in lines[1:]:
        assert 0.0 <= m["reward_mean"] <= 1.0 and m["train/skipped"] == 0.0
        assert m["train/mismatch_frac_bitwise_equal"] == 1.0 and m["train/mismatch_max_abs_diff"] == 0.0
        assert m["train/is_weight_mean"] == 1.0 and m["response_length"] > 0
        # cut to the shortest of train.length_buckets steps of rollout.max_len holding the longest
        # row, and still aligned (the smoke run's rows are well short of rollout.max_len)
        step, longest = config.rollout.max_len // config.train.length_buckets, m["train/response_len_max"]
        assert m["batch_length"] % step == 0 and longest < m["batch_length"] < config.rollout.max_len
        assert all(np.isfinite(v) for v in m.values())
    assert any(m["train/grad_norm"] > 0 for m in lines[1:])
    # TensorBoard holds every number of every line, at its step (as float32; tags allow no "@")
    expected = {
        (m["step"], k.replace("@", "_")): np.float32(v) for m in lines for k, v in m.items() if k != "step"
    }
    assert scalars(run) == expected
    # one optimizer update per step with the default train config
    assert int(smoke_run.final_state(reference_run).step) == steps


def _write(path: pathlib.Path, rows: list) -> pathlib.Path:
    path.write_bytes(b"\n".join(r if isinstance(r, bytes) else json.dumps(r).encode() for r in rows) + b"\n")
    return path


@pytest.fixture(scope="module")
def jsonl_run(tmp_path_factory) -> tuple[pathlib.Path, Any]:
    """One step of a JSONL run with a held-out file (``data.eval_path``) and the DAPO data side
    on (dynamic sampling refilling from the data iterator, at most 2 more rounds; the soft overlong
    punishment; overlong filtering), aligned (train.assert_aligned raises on a differing bit), with
    pass@2 and bf16 evals: its directory and config. The files lose rows of every category."""
    tmp = tmp_path_factory.mktemp("jsonl_run")
    row = lambda a, b: {"question": f"{a}+{b}=", "answer": f"#### {a + b}"}
    train_file = _write(tmp / "train.jsonl", [row(a, b) for a in range(4) for b in range(4)] + [b"nope"])
    long = {"question": "1+" * 20 + "1=", "answer": "#### 21"}  # 42 tokens > data.max_prompt_tokens
    bad = [b"{broken", {"q": 1}, [1], b"\xff\xfe", {"question": " ", "answer": "#### 1"}]
    eval_file = _write(tmp / "eval.jsonl", [row(5, 1), row(6, 2), long, row(7, 3), *bad, row(8, 4)])
    config = load_config(SMOKE, [f"run.output_dir={tmp / 'run'}", "run.steps=1", "run.eval_prompts=4",
                                 "run.tensorboard=false", "data.source=jsonl", f"data.path={train_file}",
                                 f"data.eval_path={eval_file}", "rollout.dynamic_sampling=true",
                                 "rollout.max_resample_rounds=2", "rollout.overlong_buffer=16",
                                 "objective.overlong_filter=true", "train.assert_aligned=true",
                                 "run.eval_samples=2", "run.eval_bf16=true"])  # fmt: skip
    result = train(config)
    assert json.loads((tmp / "run" / "metrics.jsonl").read_text().splitlines()[1]) == result.summary["final"]
    return tmp / "run", config


def _lines(run: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_loop_with_dapo_data_side(jsonl_run):
    """Dynamic sampling, the soft overlong punishment and overlong filtering, all on: the loop runs,
    logs the dynamic-sampling counts and keeps the rewards it reports the grader's (in [0, 1], the
    penalty only in the advantages)."""
    run, config = jsonl_run
    for m in _lines(run)[1:]:
        assert all(np.isfinite(v) for v in m.values())
        assert 0.0 <= m["reward_mean"] <= 1.0 and m["dynamic/resample_rounds"] <= 2
        assert 0 <= m["dynamic/missing_groups"] <= config.data.batch_size
        if m["dynamic/dropped_groups"] > 0 and m["dynamic/missing_groups"] == 0:
            assert m["dynamic/resample_rounds"] >= 1  # the first draw alone could not fill the batch
        assert "train/truncation_rate" in m


@pytest.mark.slow
def test_skipped_rows_of_training_and_held_out_files_are_both_in_the_metrics(jsonl_run):
    """The rows each file loses are counted by category, the training file's as
    ``data/skipped_*``, the held-out file's as ``data/eval_skipped_*`` (the too-long prompt is met
    while the held-out batch is drawn)."""
    step = _lines(jsonl_run[0])[1]
    assert {k: v for k, v in step.items() if k.startswith("data/")} == {
        "data/skipped_malformed": 1,
        "data/skipped_too_long": 0,
        "data/skipped_empty": 0,
        "data/skipped_undecodable": 0,
        "data/eval_skipped_malformed": 3,
        "data/eval_skipped_too_long": 1,
        "data/eval_skipped_empty": 1,
        "data/eval_skipped_undecodable": 1,
    }


@pytest.mark.slow
def test_the_loop_logs_pass_at_k_and_the_bf16_eval_before_and_after(jsonl_run):
    """run.eval_samples and run.eval_bf16: the evals before the first step and after the last log
    greedy accuracy, length, pass@2 and mean@2 of the deployed policy and of its bf16 masters."""
    lines = _lines(jsonl_run[0])
    evals = ["eval/accuracy", "eval/response_length", "eval/pass@2", "eval/mean@2"]
    evals += [k.replace("eval/", "eval_bf16/") for k in evals]
    for m in lines:
        assert all(0.0 <= m[k] <= 1.0 for k in evals if "length" not in k) and m["eval/response_length"] > 0
        assert m["eval/mean@2"] <= m["eval/pass@2"] and m["eval_bf16/mean@2"] <= m["eval_bf16/pass@2"]


def test_evals_repeat_and_bf16_eval_of_a_bf16_run_equals_the_deployed_eval():
    # the run's format is bf16, so the deployed engine and the eval_bf16 engine (built apart, over
    # the master weights as they are) run the same weights in the same format: equal figures
    config = load_config(SMOKE, ["quant.fmt=bf16", "run.eval_samples=3", "run.eval_bf16=true",
                                 "run.eval_prompts=4"])  # fmt: skip
    mesh = sharding.make_mesh(config.mesh)
    tokenizer = build_tokenizer(config)
    with sharding.activate(mesh, config.mesh.rules), Grader(1) as grader:
        model, params = build_policy(config, mesh)
        engine = build_engine(config, model, quant.quantize_params(params, config.quant), tokenizer, mesh)
        held_out = eval_set(config.data, config.run.eval_prompts, tokenizer)
        evaluate = Evaluator(config, engine, tokenizer, grader, held_out, params)
        first, again = evaluate(params), evaluate(params)
    assert first == again  # a fixed sampling seed: the same weights give the same pass@k
    deployed = {k: v for k, v in first.items() if k.startswith("eval/")}
    assert set(deployed) == {"eval/accuracy", "eval/response_length", "eval/pass@3", "eval/mean@3"}
    assert deployed == {
        k.replace("eval_bf16/", "eval/"): v for k, v in first.items() if k.startswith("eval_bf16/")
    }
    assert 0.0 <= first["eval/mean@3"] <= first["eval/pass@3"] <= 1.0


def test_metrics_log_resume_truncates_jsonl_and_purges_tensorboard(tmp_path):
    log = MetricsLog(tmp_path, 0)
    for step in range(4):
        log.write({"step": step, "loss": float(step), "note": "text is not a scalar"})
    log.close()
    log = MetricsLog(tmp_path, 2)  # resumed from the step-2 checkpoint: steps 3.. are written again
    log.write({"step": 3, "loss": 30.0})
    log.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["loss"]) for m in lines] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]
    assert set(scalars(tmp_path)) == {(step, "loss") for step in range(4)}
    # the resumed file starts with a restart at step 3: TensorBoard drops the first file's step 3
    restarts = [e.step for e in events(tmp_path) if e.session_log.status == SessionLog.START]
    assert restarts == [3]
    (tmp_path / "off").mkdir()
    assert MetricsLog(tmp_path / "off", 0, tensorboard=False).tensorboard is None
    assert not (tmp_path / "off" / "tb").exists()


def test_step_seeds_differ_and_repeat():
    seeds = {step_seed(0, s) for s in range(100)} | {step_seed(1, s) for s in range(100)}
    assert len(seeds) == 200 and step_seed(3, 7) == step_seed(3, 7) and max(seeds) < 2**31
    assert eval_seed(0) not in seeds and eval_seed(0) == eval_seed(0) != eval_seed(1)


def test_package_paths_resolve_inside_the_package():
    assert model_dir("package:assets/policy") == PACKAGE_DIR / "assets" / "policy"
    assert model_dir("/ckpt/qwen") == pathlib.Path("/ckpt/qwen")


def test_the_loop_pins_seq_mean_token_sum_to_max_len():
    """The loop cuts its batches to their rows' length (train.length_buckets), so Dr. GRPO's
    per-sequence normaliser, the batch's length by default, is pinned to rollout.max_len; a
    configured one is kept."""
    config = load_config(None, ["objective.name=dr_grpo", "rollout.max_len=96"])
    assert config.objective.loss_norm is None and _objective(config).loss_norm == 96.0
    config = load_config(None, ["objective.name=dr_grpo", "objective.loss_norm=10"])
    assert _objective(config).loss_norm == 10.0
