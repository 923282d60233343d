"""The QaRL training loop.

Per step: a batch of prompts -> G samples each from the rollout engine (frozen quantized weights)
-> grading -> group-relative advantages -> the training batch (padded to the shortest of
``train.length_buckets`` lengths that holds every row) -> ``train_on_rollouts`` (old
log-probs, minibatch updates on the float master weights) -> quantize once and hand the new frozen
weights to the engine. Every step appends one flat metrics dict to ``metrics.jsonl`` in the run
directory (and its numbers to TensorBoard event files in ``tb/``); held-out evals
(:mod:`qarl_jax.evaluation`) run before the first step, every ``run.eval_every`` steps and after the
last; checkpoints every ``run.checkpoint_every`` steps and at the end.

Every random stream is derived from ``(seed, step)`` (rollout keys, minibatch order) and the data
iterator's position is checkpointed, so a run resumed from a checkpoint makes exactly the updates an
uninterrupted run makes. Timing figures are the only metrics that differ; they live under ``time/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from qarl_jax import distributed, rundir, sharding
from qarl_jax.build import (
    build_engine,
    build_policy,
    build_tokenizer,
    check_model_files,
    engine_layout,
    eval_set,
    training_data,
)
from qarl_jax.checkpoint import Checkpointer
from qarl_jax.config import Config, to_dict
from qarl_jax.data import build_pipeline
from qarl_jax.errors import ConfigError, Interrupted
from qarl_jax.evaluation import Evaluator, score
from qarl_jax.models import Qwen3ForCausalLM
from qarl_jax.rewards import Grader
from qarl_jax.rl import dapo
from qarl_jax.rl.advantages import group_advantages
from qarl_jax.rl.batch import bucketed_length
from qarl_jax.rl.train_step import Trainer, TrainState
from qarl_jax.rollout import RolloutEngine, SamplingParams, layout, rollout
from qarl_jax.runlog import MetricsLog


def step_seed(seed: int, step: int) -> int:
    """A 31-bit seed for step ``step``'s random streams, independent of every other step's."""
    return int(np.random.SeedSequence([seed, step]).generate_state(1)[0] >> 1)


@dataclasses.dataclass
class Loop:
    """What one run's steps use: trainer, engine, tokenizer, grader, evals, built from the config."""

    config: Config
    trainer: Trainer
    engine: RolloutEngine
    tokenizer: object
    grader: Grader
    quantize: Callable[[Any], Any]  # jitted params -> frozen weights
    place: Callable[[Any], Any]  # frozen weights -> the engine's layout (distributed.local_replica)
    evaluate: Evaluator

    def generate(
        self, prompts: Sequence[np.ndarray], n: int, sampling: SamplingParams, seed: int, first: int = 0
    ):
        """samples[prompt][sample] from the engine's current frozen weights; the prompts are
        numbered from ``first`` in the sample keys."""
        lists = [p.tolist() for p in prompts]
        max_new = self.config.rollout.max_new_tokens
        ids = range(first, first + len(lists))
        return rollout(self.engine, lists, n, max_new, sampling, seed, prompt_ids=ids, progress=False)

    def score(self, samples, answers: Sequence[str]) -> np.ndarray:
        return score(self.tokenizer, self.grader, self.config.rewards.kind, samples, answers)

    def draw(self, batch: dict, seed: int, round_: int = 0, timing: list | None = None) -> dapo.Groups:
        """G samples of each prompt of ``batch``, graded; ``rewards`` add the soft overlong
        punishment when ``rollout.overlong_buffer`` is set. Round r > 0 (dynamic sampling's
        refills) numbers its prompts after every earlier round's on every host. Appends (seconds
        generating, tokens generated) to ``timing``."""
        r = self.config.rollout
        prompts = batch["prompt_ids"]
        first = (round_ * jax.process_count() + jax.process_index()) * len(prompts)  # no two share keys
        start = time.perf_counter()
        samples = self.generate(prompts, r.samples_per_prompt, SamplingParams(r.temperature), seed, first)
        if timing is not None:
            timing.append((time.perf_counter() - start, sum(s.length for group in samples for s in group)))
        scores = self.score(samples, batch["answer"])
        lengths = np.asarray([[s.length for s in group] for group in samples])
        rewards = scores + dapo.overlong_penalty(
            lengths, r.max_new_tokens, r.overlong_buffer, r.overlong_penalty
        )
        return dapo.Groups([p.tolist() for p in prompts], samples, scores, rewards)

    def step(self, state, batch: dict, step: int, more: Callable[[], dict] | None = None):
        """One RL step on this process's prompt batch (``more()``: the next one, for dynamic
        sampling's refills); returns the new state and the step's metrics (over every process's
        samples; rewards, lengths and truncation are those of the step's first draw, as without
        dynamic sampling)."""
        c = self.config
        seed = step_seed(c.seed, step)
        start = time.perf_counter()
        timing: list[tuple[float, int]] = []  # (seconds generating, tokens generated) per draw
        drawn = self.draw(batch, seed, timing=timing)
        groups = drawn
        dynamic: dict[str, float] = {}
        if c.rollout.dynamic_sampling:
            if more is None:
                raise ValueError("rollout.dynamic_sampling needs more prompt batches to refill from")
            refill = lambda r: self.draw(more(), seed, r, timing)
            groups, dynamic = dapo.dynamic_sampling(drawn, refill, len(drawn), c.rollout.max_resample_rounds)
        rollout_s, tokens = np.sum(timing, axis=0)
        adv = np.asarray(group_advantages(groups.rewards, c.advantage, std=c.rollout.advantage_std))
        rows = len(drawn) * c.rollout.samples_per_prompt
        filler = drawn.prompts[0]
        # one length on every host (their rows form one global batch)
        longest = int(distributed.gather(np.asarray([dapo.longest_inputs(groups, filler)], np.int32)).max())
        length = bucketed_length(longest, c.rollout.max_len, c.train.length_buckets)
        train_batch = dapo.groups_batch(groups, adv, rows, length, filler)
        train_batch = distributed.global_batch(train_batch, self.trainer.mesh, self.trainer.rules)
        self.engine.release_params()  # the old frozen weights are dead: their memory goes to the update
        state, history = self.trainer.train_on_rollouts(state, train_batch, np.random.default_rng(seed))
        self.engine.update_params(self.place(self.quantize(state.params)), donate=True)
        history = jax.device_get(history)
        seconds = time.perf_counter() - start
        flat = [s for group in drawn.samples for s in group]
        local = {
            "rewards": drawn.scores,
            "lengths": np.asarray([s.length for s in flat]),
            "truncated": np.asarray([s.finish_reason == "length" for s in flat]),
            "seconds": np.asarray([[rollout_s, seconds]]),
            "tokens": np.asarray([tokens]),
        }
        if dynamic:
            local["dynamic"] = np.asarray([[dynamic[k] for k in sorted(dynamic)]], np.float32)
        every_host = distributed.gather(local)
        rewards, lengths, truncated = (every_host[k] for k in ("rewards", "lengths", "truncated"))
        rollout_s, seconds = every_host["seconds"].max(axis=0)  # the slowest host's
        # groups dropped / missing: every host's; rounds: the most any host drew
        reduce = {"resample_rounds": np.max}
        if dynamic:
            columns = zip(sorted(dynamic), every_host["dynamic"].T, strict=True)
            dynamic = {k: float(reduce.get(k, np.sum)(v)) for k, v in columns}
        metrics = {
            "step": step + 1,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "accuracy": float(np.mean(rewards >= 1.0)),
            "solved_groups": float(np.mean(rewards.max(axis=1) >= 1.0)),
            "response_length": float(lengths.mean()),
            "truncated_frac": float(np.mean(truncated)),
            "batch_length": length,  # the training batch's padded length (train.length_buckets)
            **{f"train/{k}": float(np.mean([h[k] for h in history])) for k in history[0]},
            **{f"dynamic/{k}": v for k, v in dynamic.items()},
            "time/step_s": float(seconds),
            "time/rollout_tokens_per_s": float(every_host["tokens"].sum() / rollout_s),
            **self.engine.sync.metrics(),  # the move of the new frozen weights to the engine's layout
        }
        return state, metrics


def _postfix(metrics: dict) -> dict:
    keys = {"reward": "reward_mean", "acc": "accuracy", "mismatch": "train/mismatch_mean_abs_diff"}
    out = {k: f"{metrics[v]:.3f}" for k, v in keys.items() if v in metrics}
    out["tok/s"] = f"{metrics['time/rollout_tokens_per_s']:.0f}"
    return out


@dataclasses.dataclass(frozen=True)
class Result:
    summary: dict  # JSON-ready: run dir, resume step, evals, the last step's metrics
    state: TrainState
    model: Qwen3ForCausalLM


def train(config: Config) -> Result:
    """Run (or resume) the configured training, on this process and any others that joined with
    ``jax.distributed`` (:mod:`qarl_jax.distributed` describes the split; every process returns the
    same summary, process 0 writes the logs).

    Everything that can be checked without the model is checked first (mesh, model files, data
    files, the run directory, the checkpoint's config), and nothing is written to the run directory
    before the resume decision (:mod:`qarl_jax.rundir`)."""
    primary = distributed.is_primary()
    run_dir = pathlib.Path(config.run.output_dir)
    rundir.check_output_dir(run_dir)
    mesh = _mesh(config)
    check_model_files(config)
    engine_mesh = engine_layout(config)
    tokenizer = build_tokenizer(config)
    host_data = distributed.host_data(training_data(config.data))
    data = build_pipeline(host_data, tokenizer, jax.process_index(), jax.process_count())
    held_out = eval_set(config.data, config.run.eval_prompts, tokenizer)
    lock = rundir.RunLock(run_dir) if primary else contextlib.nullcontext()
    with lock:
        ckpt = Checkpointer(run_dir / "checkpoints", config.run.keep, to_dict(config))
        latest = ckpt.check_resumable()
        if primary:
            rundir.decide(run_dir, latest, config.run.overwrite)
            (run_dir / "config.json").write_text(json.dumps(to_dict(config), indent=2))
            begin = f"resuming from {ckpt.directory / str(latest)}" if latest else "starting at step 0"
            rundir.say(f"{run_dir}: {begin}; building the policy and compiling (the first step is slow)")
        try:
            return _train(config, run_dir, (mesh, engine_mesh), tokenizer, data, held_out, ckpt, primary)
        except KeyboardInterrupt:
            ckpt.close()  # the saves already started are committed
            step = ckpt.latest_step()
            resume = (
                f"rerun the same command to resume from {ckpt.directory / str(step)}"
                if step is not None
                else "no checkpoint was written: rerun with run.overwrite=true to start again"
            )
            raise Interrupted(f"interrupted; {resume}") from None


def _objective(config: Config):
    """The objective with seq_mean_token_sum's length normaliser fixed at rollout.max_len: the
    batches are cut to their rows' length (train.length_buckets), the normaliser stays put."""
    o = config.objective
    return o if o.loss_norm is not None else dataclasses.replace(o, loss_norm=float(config.rollout.max_len))


def _mesh(config: Config):
    try:
        return sharding.make_mesh(config.mesh)
    except ValueError as e:
        raise ConfigError(f"mesh: {e} ({jax.device_count()} device(s) here)") from e


def _train(config: Config, run_dir, meshes, tokenizer, data, held_out, ckpt, primary: bool) -> Result:
    mesh, engine_mesh = meshes  # the trainer's (global) and the rollout engine's (this process's)
    place = functools.partial(distributed.local_replica, global_mesh=mesh, mesh=engine_mesh)
    with (
        sharding.activate(mesh, config.mesh.rules),
        Grader(config.rewards.num_workers, config.rewards.time_limit_s) as grader,
    ):
        model, params = build_policy(config, mesh)
        trainer = Trainer(model, _objective(config), config.train, config.optimizer, mesh, config.mesh.rules)
        state = trainer.init_state(params)
        del params
        restored = ckpt.restore(state)
        start = 0
        if restored is not None:
            state, start = restored.state, restored.step
            data.set_state(distributed.own_data_state(restored.data_state, str(ckpt.directory / str(start))))
        quantize = jax.jit(lambda p: layout.freeze(p, config.quant, model))
        engine = build_engine(config, model, place(quantize(state.params)), tokenizer, engine_mesh)
        evaluator = Evaluator(config, engine, tokenizer, grader, held_out, state.params, place)
        loop = Loop(config, trainer, engine, tokenizer, grader, quantize, place, evaluator)
        r = config.run
        sink = {"project": r.wandb_project, "name": r.wandb_name} if r.wandb else None
        log = MetricsLog(run_dir, start, r.tensorboard, sink) if primary else None
        summary: dict[str, Any] = {"run_dir": str(run_dir), "resumed_from": start, "steps": config.run.steps}
        if start == 0:
            summary["eval_before"] = loop.evaluate(state.params)
            if log is not None:
                log.write({"step": 0, **summary["eval_before"]})
        steps = range(start, config.run.steps)
        show = config.run.progress and primary
        bar = tqdm(steps, initial=start, total=config.run.steps, desc="qarl", disable=not show)
        metrics: dict = {}
        try:
            for step in bar:
                state, metrics = loop.step(state, next(data), step, more=lambda: next(data))
                metrics.update({f"data/skipped_{k}": n for k, n in data.skipped_by_category().items()})
                metrics.update({f"data/eval_skipped_{k}": n for k, n in held_out["skipped"].items()})
                done = step + 1
                every = config.run.eval_every
                if done == config.run.steps or (every and done % every == 0):
                    metrics.update(loop.evaluate(state.params))
                if log is not None:
                    log.write(metrics)
                if done % config.run.log_every == 0:
                    bar.set_postfix(_postfix(metrics), refresh=False)
                every = config.run.checkpoint_every
                if done == config.run.steps or (every and done % every == 0):
                    data_state = distributed.data_state_to_save(data.get_state())
                    ckpt.save(done, state, data_state, config.seed)
            ckpt.close()
        finally:
            if log is not None:
                log.close()
    return Result(summary | {"final": metrics}, state, model)
