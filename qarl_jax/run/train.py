"""The QaRL training loop.

Per step: a batch of prompts -> G samples each from the rollout engine (frozen quantized weights)
-> grading -> group-relative advantages -> the training batch (padded to the shortest of
``train.length_buckets`` lengths that holds every row) -> ``train_on_rollouts`` (old
log-probs, minibatch updates on the float master weights) -> quantize once and hand the new frozen
weights to the engine. Every step appends one flat metrics dict to ``metrics.jsonl`` in the run
directory (and its numbers to TensorBoard event files in ``tb/``); held-out evals
(:mod:`qarl_jax.run.heldout_eval`) run before the first step, every ``run.eval_every`` steps and after the
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
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from qarl_jax import sharding, storage
from qarl_jax.config import Config, to_dict
from qarl_jax.data import build_pipeline
from qarl_jax.data.templates import stop_strings
from qarl_jax.errors import CheckpointError, ConfigError, Interrupted, Preempted
from qarl_jax.models import Qwen3ForCausalLM
from qarl_jax.rewards import GRADER_COUNTS, Grader
from qarl_jax.rl import dapo
from qarl_jax.rl.advantages import group_advantages
from qarl_jax.rl.batch import RolloutBatch, bucketed_length
from qarl_jax.rl.train_step import Trainer, TrainState
from qarl_jax.rollout import RolloutEngine, SamplingParams, layout, rollout
from qarl_jax.rollout.overlap import PhaseClock, Produced, device_groups, run_phases
from qarl_jax.run import distributed, hosts, preemption, rundir, runlog
from qarl_jax.run.build import (
    build_engine,
    build_policy,
    build_tokenizer,
    check_model_files,
    engine_layout,
    eval_set,
    training_data,
)
from qarl_jax.run.checkpoint import Checkpointer
from qarl_jax.run.heldout_eval import Evaluator, score
from qarl_jax.run.progress import StepReport
from qarl_jax.run.runlog import MetricsLog


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
        numbered from ``first`` in the sample keys. A sample ends on EOS, the token limit, or its
        template's stop string (:data:`qarl_jax.data.templates.STOP_STRINGS`: ``plain`` stops at a
        made-up next "Question:")."""
        lists = [p.tolist() for p in prompts]
        max_new = self.config.rollout.max_new_tokens
        ids = range(first, first + len(lists))
        stops = stop_strings(self.config.data.template)
        return rollout(
            self.engine,
            lists,
            n,
            max_new,
            sampling,
            seed,
            stops,
            self.tokenizer,
            prompt_ids=ids,
            progress=False,
        )

    def score(self, samples, answers: Sequence[str]) -> np.ndarray:
        stops = stop_strings(self.config.data.template)
        return score(self.tokenizer, self.grader, self.config.rewards.kind, samples, answers, stops)

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

    def produce(self, batch: dict, step: int, more: Callable[[], dict] | None, version: int) -> Produced:
        """Step ``step``'s rolled-out, graded batch from the engine's current weights (those of
        update ``version``): the first draw and, with dynamic sampling, its refills (``more()``: the
        next prompt batch)."""
        c = self.config
        seed = step_seed(c.seed, step)
        timing: list[tuple[float, int]] = []  # (seconds generating, tokens generated) per draw
        drawn = self.draw(batch, seed, timing=timing)
        groups, dynamic = drawn, dict[str, float]()
        if c.rollout.dynamic_sampling:
            if more is None:
                raise ValueError("rollout.dynamic_sampling needs more prompt batches to refill from")
            refill = lambda r: self.draw(more(), seed, r, timing)
            groups, dynamic = dapo.dynamic_sampling(drawn, refill, len(drawn), c.rollout.max_resample_rounds)
        rollout_s, tokens = np.sum(timing, axis=0)
        return Produced(drawn, groups, dynamic, version, float(rollout_s), int(tokens))

    def training_batch(self, produced: Produced) -> tuple[RolloutBatch, int]:
        """The produced groups as this step's (global) training batch, and its padded length."""
        c, groups = self.config, produced.groups
        adv = np.asarray(group_advantages(groups.rewards, c.advantage, std=c.rollout.advantage_std))
        rows = len(produced.drawn) * c.rollout.samples_per_prompt
        filler = produced.drawn.prompts[0]
        # one length on every host (their rows form one global batch)
        longest = int(distributed.gather(np.asarray([dapo.longest_inputs(groups, filler)], np.int32)).max())
        length = bucketed_length(longest, c.rollout.max_len, c.train.length_buckets)
        train_batch = dapo.groups_batch(groups, adv, rows, length, filler)
        return distributed.global_batch(train_batch, self.trainer.mesh, self.trainer.rules), length

    def learn(self, state, produced: Produced, step: int):
        """The updates on one produced batch: (new state, per-update metrics, padded length)."""
        train_batch, length = produced.batch or self.training_batch(produced)
        produced.batch = None  # trained on: its arrays go
        rng = np.random.default_rng(step_seed(self.config.seed, step))
        stale = produced.version < step
        state, history = self.trainer.train_on_rollouts(state, train_batch, rng, stale=stale)
        return state, jax.device_get(history), length

    def check(self, produced: Produced, frozen, step: int) -> None:
        """Asynchronous rollouts, aligned: the alignment check of a batch that step ``step`` will
        train on, made now, at the weights that rolled it out (``frozen``, training layout)."""
        if produced.version < step and self.trainer.aligned:
            produced.batch = self.training_batch(produced)
            produced.check = self.trainer.behaviour_check(frozen, produced.batch[0])

    def step(self, state, batch: dict, step: int, more: Callable[[], dict] | None = None):
        """One RL step on this process's prompt batch (``more()``: the next one, for dynamic
        sampling's refills), rolled out with the current weights; returns the new state and the
        step's metrics (over every process's samples; rewards, lengths and truncation are those of
        the step's first draw, as without dynamic sampling)."""
        start, clock = time.perf_counter(), PhaseClock()
        produced = clock.timed("rollout", lambda: self.produce(batch, step, more, version=step))
        self.engine.release_params()  # the old frozen weights are dead: their memory goes to the update
        state, history, length = clock.timed("train", lambda: self.learn(state, produced, step))
        self.engine.update_params(self.place(self.quantize(state.params)), donate=True)
        return state, self.metrics(produced, history, length, step, start, clock)

    def async_step(self, state, pending: deque[Produced], frozen, step: int, next_batch: Callable[[], dict]):
        """One step of k-step-off training (:mod:`qarl_jax.rollout.overlap`): train on the oldest
        of the ``pending`` batches while the engine rolls out batch ``step + k`` with the weights it
        holds (update ``step``'s; ``frozen``: the same, on the training layout, for the alignment
        check), then swap in the new weights. Returns (state, metrics, the new weights' frozen tree
        on the training layout)."""
        c = self.config
        start, clock = time.perf_counter(), PhaseClock()
        target = step + c.rollout.async_steps
        produce = None
        if target < c.run.steps:
            produce = lambda: self.produce(next_batch(), target, next_batch, version=step)
        trained = pending.popleft()
        separate = c.rollout.devices > 0

        def train():
            new_state, history, length = self.learn(state, trained, step)
            new_frozen = self.quantize(new_state.params)
            staged = None
            if separate:  # on their own devices the new weights travel while the engine still decodes
                staged = self.engine.stage_params(self.place(new_frozen), donate=not self.trainer.aligned)
            return new_state, history, length, new_frozen, staged

        produced, (state, history, length, new_frozen, staged) = run_phases(
            produce, train, c.rollout.overlap, clock
        )
        if produced is not None:
            self.check(produced, frozen, target)
            pending.append(produced)
        if staged is not None:
            self.engine.update_params(staged)
        else:
            self.engine.update_params(self.place(new_frozen), donate=not self.trainer.aligned)
        metrics = self.metrics(trained, history, length, step, start, clock)
        return state, metrics | {"rollout/staleness": step - trained.version}, new_frozen

    def metrics(self, produced: Produced, history, length: int, step: int, start: float, clock) -> dict:
        """The step's metrics (see :meth:`step`) from the batch it trained on and its updates."""
        seconds = time.perf_counter() - start
        drawn, dynamic = produced.drawn, produced.dynamic
        flat = [s for group in drawn.samples for s in group]
        local = {
            "rewards": drawn.scores,
            "lengths": np.asarray([s.length for s in flat]),
            "truncated": np.asarray([s.finish_reason == "length" for s in flat]),
            "seconds": np.asarray([[produced.rollout_s, seconds]]),
            "tokens": np.asarray([produced.tokens]),
            "grader": np.asarray([list(self.grader.counts_since_last_call().values())]),
        }
        if dynamic:
            local["dynamic"] = np.asarray([[dynamic[k] for k in sorted(dynamic)]], np.float32)
        every_host = distributed.gather(local)
        rewards, lengths, truncated = (every_host[k] for k in ("rewards", "lengths", "truncated"))
        rollout_s, seconds = every_host["seconds"].max(axis=0)  # the slowest host's
        # graded, retries, timeouts, crashes, errors: every host's since the last step's metrics
        grading = dict(zip(GRADER_COUNTS, every_host["grader"].sum(axis=0).tolist(), strict=True))
        # groups dropped / missing: every host's; rounds: the most any host drew
        reduce = {"resample_rounds": np.max}
        if dynamic:
            columns = zip(sorted(dynamic), every_host["dynamic"].T, strict=True)
            dynamic = {k: float(reduce.get(k, np.sum)(v)) for k, v in columns}
        return {
            "step": step + 1,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "accuracy": float(np.mean(rewards >= 1.0)),
            "solved_groups": float(np.mean(rewards.max(axis=1) >= 1.0)),
            "response_length": float(lengths.mean()),
            "truncated_frac": float(np.mean(truncated)),
            "batch_length": length,  # the training batch's padded length (train.length_buckets)
            **{f"train/{k}": float(np.mean([h[k] for h in history])) for k in history[0]},
            **{f"train/{k}": v for k, v in produced.check.items()},  # a stale batch's alignment check
            **{f"dynamic/{k}": v for k, v in dynamic.items()},
            "time/step_s": float(seconds),
            "time/rollout_tokens_per_s": float(every_host["tokens"].sum() / rollout_s),
            # samples a busy host's grader cut short: graded again, or scored 0 for time
            **{f"grader/{k}": grading[k] for k in GRADER_COUNTS[1:]},
            **clock.metrics(float(seconds)),
            **self.engine.sync.metrics(),  # the move of the new frozen weights to the engine's layout
        }


@dataclasses.dataclass(frozen=True)
class Result:
    summary: dict  # JSON-ready: run dir, resume step, evals, the last step's metrics
    state: TrainState
    model: Qwen3ForCausalLM


def train(config: Config) -> Result:
    """Run (or resume) the configured training, on this process and any others that joined with
    ``jax.distributed`` (:mod:`qarl_jax.run.distributed` describes the split; every process returns the
    same summary, process 0 writes the logs).

    Everything that can be checked without the model is checked first (mesh, model files, data
    files, the run directory, the checkpoint's config), and nothing is written to the run directory
    before the resume decision (:mod:`qarl_jax.run.rundir`) but the hosts' check that they share it
    (:mod:`qarl_jax.run.hosts`). A preemption notice stops every process at one step, saved
    (:mod:`qarl_jax.run.preemption`)."""
    primary = distributed.is_primary()
    run_dir = storage.parse(config.run.output_dir, "run.output_dir")  # local or gs://
    rundir.check_output_dir(run_dir)
    hosts.check_shared(run_dir)
    training_devices, rollout_devices = device_groups(config.rollout.devices)
    mesh = _mesh(config, training_devices)
    _check_batch_split(config, mesh)
    check_model_files(config.model)
    engine_mesh = engine_layout(config, rollout_devices)
    tokenizer = build_tokenizer(config)
    host_data = distributed.host_data(training_data(config.data))
    data = build_pipeline(host_data, tokenizer, jax.process_index(), jax.process_count())
    held_out = eval_set(config.data, config.run.eval_prompts, tokenizer)
    lock = rundir.run_lock(run_dir) if primary else contextlib.nullcontext()
    with lock, preemption.Watch() as watch:
        ckpt = Checkpointer(run_dir / "checkpoints", config.run.keep, to_dict(config))
        latest = ckpt.check_resumable()
        if primary:
            rundir.decide(run_dir, latest, config.run.overwrite)
            (run_dir / "config.json").write_text(json.dumps(to_dict(config), indent=2))
            begin = f"resuming from {ckpt.directory / str(latest)}" if latest else "starting at step 0"
            rundir.say(f"{run_dir}: {begin}; building the policy and compiling (the first step is slow)")
        try:
            meshes = (mesh, engine_mesh)
            return _train(config, run_dir, meshes, tokenizer, data, held_out, ckpt, primary, watch)
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


def _mesh(config: Config, devices: list):
    try:
        return sharding.make_mesh(config.mesh, devices)
    except ValueError as e:
        others = (
            f", {config.rollout.devices} of them decoding (rollout.devices)" if config.rollout.devices else ""
        )
        raise ConfigError(f"mesh: {e} ({jax.device_count()} device(s) here{others})") from e


def _check_batch_split(config: Config, mesh: Mesh) -> None:
    """Every micro-batch of the step's rows must split over the trainer's batch axes: say so before
    any work, not as a sharding error at the first update."""
    rows = config.data.batch_size * config.rollout.samples_per_prompt
    parts = config.train.num_minibatches * config.train.micro_batches
    ways = sharding.batch_ways(mesh, config.mesh.rules)
    if rows % (parts * ways):
        raise ConfigError(
            f"data.batch_size x rollout.samples_per_prompt = {rows} rows a step do not split into "
            f"train.num_minibatches x train.micro_batches = {parts} micro-batches over the {ways} "
            f"devices of the trainer's batch axes"
        )


def _save(ckpt: Checkpointer, step: int, state, data, pending: deque[Produced] | None, seed: int) -> None:
    """A checkpoint after ``step`` steps; with asynchronous rollouts this process's data item holds
    the batches already rolled out for the next steps beside the iterator."""
    local = data.get_state()
    if pending is not None:
        local = {"iterator": local, "pending": [p.to_json() for p in pending]}
    ckpt.save(step, state, distributed.data_state_to_save(local), seed)


def _restore_data(config: Config, data, saved: dict, where: str) -> deque[Produced] | None:
    """Set the iterator from a checkpoint's data item; the pending batches of an asynchronous run."""
    local = distributed.own_data_state(saved, where)
    if not config.rollout.async_steps:
        data.set_state(local)
        return None
    if "pending" not in local:
        raise CheckpointError(f"{where} has no pending batches: it was not written by an asynchronous run")
    data.set_state(local["iterator"])
    return deque(Produced.from_json(p) for p in local["pending"])


def _train(
    config: Config, run_dir, meshes, tokenizer, data, held_out, ckpt, primary: bool, watch: preemption.Watch
) -> Result:
    mesh, engine_mesh = meshes  # the trainer's (global) and the rollout engine's (this process's)
    place = functools.partial(distributed.local_replica, global_mesh=mesh, mesh=distributed.local_mesh(mesh))
    k = config.rollout.async_steps
    with (
        sharding.activate(mesh, config.mesh.rules),
        Grader(config.rewards.num_workers, config.rewards.time_limit_s) as grader,
    ):
        model, params = build_policy(config, mesh)
        trainer = Trainer(model, _objective(config), config.train, config.optimizer, mesh, config.mesh.rules)
        state = trainer.init_state(params)
        del params
        restored = ckpt.restore(state)
        start, pending = 0, deque[Produced]() if k else None
        if restored is not None:
            state, start = restored.state, restored.step
            pending = _restore_data(config, data, restored.data_state, str(ckpt.directory / str(start)))
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
        report = StepReport(start, config.run.steps, config.run.log_every, config.run.progress and primary)
        metrics: dict = {}
        if start >= config.run.steps:  # a rerun of a finished run: say so, and show how it ended
            metrics = _finished(run_dir, start, config.run.steps, primary)
        frozen = quantize(state.params) if k else None  # the engine's weights, on the training layout
        while pending is not None and len(pending) < min(k, config.run.steps - start):  # the first k
            produced = loop.produce(next(data), start + len(pending), lambda: next(data), version=start)
            loop.check(produced, frozen, start + len(pending))
            pending.append(produced)
        try:
            for step in steps:
                if pending is None:
                    state, metrics = loop.step(state, next(data), step, more=lambda: next(data))
                else:
                    state, metrics, frozen = loop.async_step(state, pending, frozen, step, lambda: next(data))
                metrics.update({f"data/skipped_{k}": n for k, n in data.skipped_by_category().items()})
                metrics.update({f"data/eval_skipped_{k}": n for k, n in held_out["skipped"].items()})
                done = step + 1
                every = config.run.eval_every
                if done == config.run.steps or (every and done % every == 0):
                    metrics.update(loop.evaluate(state.params))
                if log is not None:
                    log.write(metrics)
                report.step(done, metrics)
                every = config.run.checkpoint_every
                # every process asks after every step (the sync point counts them); the last step ends anyway
                preempted = watch.reached(done) and done < config.run.steps
                if done == config.run.steps or (every and done % every == 0) or preempted:
                    _save(ckpt, done, state, data, pending, config.seed)
                if preempted:
                    ckpt.close()  # committed before the message says so
                    raise Preempted(
                        f"preempted: every process stopped after step {done} and saved it in "
                        f"{ckpt.directory / str(done)}; run the same command again to resume from there"
                    )
            ckpt.close()
        finally:
            report.close()
            if log is not None:
                log.close()
    return Result(summary | {"final": metrics}, state, model)


def _finished(run_dir: storage.Path, start: int, steps: int, primary: bool) -> dict:
    """The last logged step's metrics of a run whose checkpoint is at ``start`` >= run.steps,
    after a line saying nothing is left to train (a rerun printed ``"final": {}`` and nothing else)."""
    rows = [r for r in runlog.load_run(run_dir).rows if r["step"] == start] if primary else []
    if primary:
        more = f"run.steps={steps}" if start == steps else f"run.steps={steps} < {start}"
        rundir.say(
            f"{run_dir}: already finished at step {start} ({more}); nothing to train. Its final "
            "metrics follow; give a larger run.steps to go on, or another run.output_dir to start afresh"
        )
    return rows[-1] if rows else {}
