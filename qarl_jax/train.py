"""The QaRL training loop.

Per step: a batch of prompts -> G samples each from the rollout engine (frozen quantized weights)
-> grading -> group-relative advantages -> the padded training batch -> ``train_on_rollouts`` (old
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

import dataclasses
import functools
import json
import pathlib
import time
from collections.abc import Sequence

import jax
import numpy as np
from tqdm import tqdm

from qarl_jax import distributed, quant, sharding
from qarl_jax.checkpoint import Checkpointer
from qarl_jax.config import Config, to_dict
from qarl_jax.data import DataConfig, build_arithmetic_tokenizer, build_pipeline
from qarl_jax.evaluation import Evaluator, score
from qarl_jax.models import CheckpointError, Qwen3ForCausalLM, from_pretrained, load_tokenizer, preset
from qarl_jax.models.hf_io import load_config as hf_config
from qarl_jax.rewards import Grader
from qarl_jax.rl.advantages import group_advantages
from qarl_jax.rl.batch import training_batch
from qarl_jax.rl.train_step import Trainer, TrainState
from qarl_jax.rollout import EngineConfig, RolloutEngine, SamplingParams, rollout

EOS_TOKENS = ("<|endoftext|>", "<|im_end|>")


PACKAGE_DIR = pathlib.Path(__file__).parent


def model_dir(path: str) -> pathlib.Path:
    """``package:REL`` names a directory shipped in the package (the default policy); others as is."""
    return PACKAGE_DIR / path.removeprefix("package:") if path.startswith("package:") else pathlib.Path(path)


def build_policy(config: Config, mesh) -> tuple[Qwen3ForCausalLM, dict]:
    """The policy model (with the run's quant spec) and its float master weights on ``mesh``."""
    m = config.model
    layout = dict(scan_layers=m.scan_layers, remat_policy=m.remat_policy)
    if m.path is None:
        depth = {} if m.num_hidden_layers is None else {"num_hidden_layers": m.num_hidden_layers}
        cfg = preset(m.preset, param_dtype=m.param_dtype, dtype=m.compute_dtype, **depth, **layout)
        model = Qwen3ForCausalLM(cfg, config.quant)
        return model, sharding.init_sharded(model, jax.random.key(config.seed), mesh, config.mesh.rules)
    path = model_dir(m.path)
    cfg = hf_config(path, param_dtype=m.param_dtype, dtype=m.compute_dtype, **layout)
    model = Qwen3ForCausalLM(cfg, config.quant)
    shardings = sharding.param_shardings(model, mesh, config.mesh.rules)
    _, params, _ = from_pretrained(
        path, dtype=m.param_dtype, compute_dtype=m.compute_dtype, shardings=shardings, **layout
    )
    return model, params


def build_tokenizer(config: Config):
    """The checkpoint's tokenizer.json, or the arithmetic character tokenizer for presets."""
    if config.model.path is None:
        return build_arithmetic_tokenizer()
    tokenizer = load_tokenizer(model_dir(config.model.path))
    if tokenizer is None:
        raise CheckpointError(f"{config.model.path}: no tokenizer.json (the loop needs one to grade)")
    return tokenizer


def build_engine(config: Config, model: Qwen3ForCausalLM, frozen, tokenizer, mesh) -> RolloutEngine:
    """The rollout engine over frozen weights, with the run's slots, cache length and stop tokens."""
    r = config.rollout
    engine_cfg = EngineConfig(slots=r.slots, max_len=r.max_len, eos_ids=eos_ids(tokenizer))
    return RolloutEngine(model, frozen, engine_cfg, mesh=mesh, rules=config.mesh.rules)


def step_seed(seed: int, step: int) -> int:
    """A 31-bit seed for step ``step``'s random streams, independent of every other step's."""
    return int(np.random.SeedSequence([seed, step]).generate_state(1)[0] >> 1)


class MetricsLog:
    """``metrics.jsonl`` in the run directory: one JSON object per step; on resume, lines past the
    checkpoint are dropped (the resumed run writes them again). With ``tensorboard``, every numeric
    metric also goes to ``tb/`` as a scalar at its step (tags allow no "@": eval/pass@4 is written as
    eval/pass_4); a resumed run's event file starts by purging the steps past the checkpoint, so
    TensorBoard shows each step once too. Events are flushed every step, so a killed run loses none
    that its checkpoint covers."""

    def __init__(self, run_dir: pathlib.Path, resume_step: int, tensorboard: bool = True):
        self.path = run_dir / "metrics.jsonl"
        kept = []
        if resume_step and self.path.exists():
            lines = self.path.read_text().splitlines()
            kept = [line for line in lines if json.loads(line)["step"] <= resume_step]
        self.path.write_text("".join(line + "\n" for line in kept))
        self.tensorboard = None
        if tensorboard:
            from tensorboardX import SummaryWriter  # only runs that log to TensorBoard import it (and torch)

            # the file name's time has 1 s resolution; the resume step in it keeps a quickly resumed
            # run from overwriting the previous file and sorts the files in run order
            purge = resume_step + 1 if resume_step else None
            suffix = f".{resume_step:09d}"
            self.tensorboard = SummaryWriter(str(run_dir / "tb"), purge_step=purge, filename_suffix=suffix)

    def write(self, metrics: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.tensorboard is not None:
            for key, value in metrics.items():
                if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(key, value, metrics["step"])
            self.tensorboard.flush()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()


@dataclasses.dataclass
class Loop:
    """What one run's steps use: trainer, engine, tokenizer, grader, evals, built from the config."""

    config: Config
    trainer: Trainer
    engine: RolloutEngine
    tokenizer: object
    grader: Grader
    quantize: object  # jitted params -> frozen weights
    place: object  # frozen weights -> the engine's layout (distributed.local_replica)
    evaluate: Evaluator

    def generate(
        self, prompts: Sequence[np.ndarray], n: int, sampling: SamplingParams, seed: int, first: int = 0
    ):
        """samples[prompt][sample] from the engine's current frozen weights; the prompts are
        numbered from ``first`` in the sample keys."""
        prompts = [p.tolist() for p in prompts]
        max_new = self.config.rollout.max_new_tokens
        ids = range(first, first + len(prompts))
        return rollout(self.engine, prompts, n, max_new, sampling, seed, prompt_ids=ids, progress=False)

    def score(self, samples, answers: Sequence[str]) -> np.ndarray:
        return score(self.tokenizer, self.grader, self.config.rewards.kind, samples, answers)

    def step(self, state, batch: dict, step: int):
        """One RL step on this process's prompt batch; returns the new state and the step's metrics
        (over every process's samples)."""
        c = self.config
        seed = step_seed(c.seed, step)
        start = time.perf_counter()
        prompts, answers = batch["prompt_ids"], batch["answer"]
        sampling = SamplingParams(c.rollout.temperature)
        first = jax.process_index() * len(prompts)  # global prompt numbers: no two hosts share keys
        samples = self.generate(prompts, c.rollout.samples_per_prompt, sampling, seed, first)
        rollout_s = time.perf_counter() - start
        rewards = self.score(samples, answers)
        adv = np.asarray(group_advantages(rewards, c.rollout.advantage)).reshape(-1)
        flat = [s for group in samples for s in group]
        repeated = [p for p, group in zip(prompts, samples, strict=True) for _ in group]
        # the log-probs of the distribution sampled from: the policy at the rollout's temperature
        logp = [s.sampling_logprobs for s in flat]
        train_batch = training_batch(repeated, [s.tokens for s in flat], logp, adv, c.rollout.max_len)
        train_batch = distributed.global_batch(train_batch, self.trainer.mesh, self.trainer.rules)
        state, history = self.trainer.train_on_rollouts(state, train_batch, np.random.default_rng(seed))
        self.engine.update_params(self.place(self.quantize(state.params)))
        history = jax.device_get(history)
        seconds = time.perf_counter() - start
        every_host = distributed.gather(
            {
                "rewards": rewards,
                "lengths": np.asarray([s.length for s in flat]),
                "truncated": np.asarray([s.finish_reason == "length" for s in flat]),
                "seconds": np.asarray([[rollout_s, seconds]]),
            }
        )
        rewards, lengths, truncated = (every_host[k] for k in ("rewards", "lengths", "truncated"))
        rollout_s, seconds = every_host["seconds"].max(axis=0)  # the slowest host's
        metrics = {
            "step": step + 1,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "accuracy": float(np.mean(rewards >= 1.0)),
            "solved_groups": float(np.mean(rewards.max(axis=1) >= 1.0)),
            "response_length": float(lengths.mean()),
            "truncated_frac": float(np.mean(truncated)),
            **{f"train/{k}": float(np.mean([h[k] for h in history])) for k in history[0]},
            "time/step_s": float(seconds),
            "time/rollout_tokens_per_s": float(lengths.sum() / rollout_s),
        }
        return state, metrics


def eval_set(data: DataConfig, size: int, tokenizer) -> dict:
    """The held-out prompts, in order: the test split of synthetic and TFDS sources (problems the
    training split never holds), for a JSONL file the same file under seed ``data.seed + 1``."""
    split = "test" if data.source in ("synthetic", "tfds") else data.split
    held_out = dataclasses.replace(data, seed=data.seed + 1, batch_size=size, shuffle=False, split=split)
    return next(build_pipeline(held_out, tokenizer))


def eos_ids(tokenizer) -> tuple[int, ...]:
    return tuple(i for t in EOS_TOKENS if (i := tokenizer.token_to_id(t)) is not None)


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
    same summary, process 0 writes the logs)."""
    primary = distributed.is_primary()
    run_dir = pathlib.Path(config.run.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if primary:
        (run_dir / "config.json").write_text(json.dumps(to_dict(config), indent=2))
    mesh = sharding.make_mesh(config.mesh)
    engine_mesh = distributed.local_mesh(config.mesh, mesh)
    place = functools.partial(distributed.local_replica, global_mesh=mesh, mesh=engine_mesh)
    host_data = distributed.host_data(config.data)
    tokenizer = build_tokenizer(config)
    ckpt = Checkpointer(run_dir / "checkpoints", config.run.keep, to_dict(config))
    with (
        sharding.activate(mesh, config.mesh.rules),
        Grader(config.rewards.num_workers, config.rewards.time_limit_s) as grader,
    ):
        model, params = build_policy(config, mesh)
        trainer = Trainer(model, config.objective, config.train, config.optimizer, mesh, config.mesh.rules)
        state = trainer.init_state(params)
        del params
        data = build_pipeline(host_data, tokenizer, jax.process_index(), jax.process_count())
        restored = ckpt.restore(state)
        start = 0
        if restored is not None:
            state, start = restored.state, restored.step
            data.set_state(distributed.own_data_state(restored.data_state, str(ckpt.directory / str(start))))
        quantize = jax.jit(lambda p: quant.quantize_params(p, config.quant))
        engine = build_engine(config, model, place(quantize(state.params)), tokenizer, engine_mesh)
        held_out = eval_set(config.data, config.run.eval_prompts, tokenizer)
        evaluator = Evaluator(config, engine, tokenizer, grader, held_out, state.params, place)
        loop = Loop(config, trainer, engine, tokenizer, grader, quantize, place, evaluator)
        log = MetricsLog(run_dir, start, config.run.tensorboard) if primary else None
        summary = {"run_dir": str(run_dir), "resumed_from": start, "steps": config.run.steps}
        if start == 0:
            summary["eval_before"] = loop.evaluate(state.params)
            if log is not None:
                log.write({"step": 0, **summary["eval_before"]})
        steps = range(start, config.run.steps)
        show = config.run.progress and primary
        bar = tqdm(steps, initial=start, total=config.run.steps, desc="qarl", disable=not show)
        metrics: dict = {}
        for step in bar:
            state, metrics = loop.step(state, next(data), step)
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
        if log is not None:
            log.close()
    return Result(summary | {"final": metrics}, state, model)
