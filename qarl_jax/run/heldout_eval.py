"""Held-out evaluation of the policy a run deploys.

Always: greedy pass@1 of the rollout engine, i.e. of the deployed (quantized) weights:
``eval/accuracy`` (mean reward) and ``eval/response_length``. With ``run.eval_samples = k``: k
samples per prompt at the rollout temperature, drawn under one seed fixed for the run (every eval
draws the same randomness, so a change between evals is the policy's, not the sampler's):
``eval/pass@k`` (the fraction of prompts with a correct sample) and ``eval/mean@k`` (the mean
reward of the samples). With ``run.eval_bf16``: the same figures under ``eval_bf16/`` for the
master weights in the unquantized bf16 format; the gap to ``eval/`` is what quantizing the
rollout costs.

With several processes each evaluates every P-th prompt, named by its index in the held-out set
(so its samples are the ones a single process would draw), and the per-prompt outcomes are
gathered back into order: the figures are those of one process evaluating every prompt.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from qarl_jax.config import Config, ConfigError
from qarl_jax.data.templates import cut_at_stop, stop_strings
from qarl_jax.models import Qwen3ForCausalLM
from qarl_jax.rewards import Grader
from qarl_jax.rollout import GREEDY, RolloutEngine, SamplingParams, layout, rollout
from qarl_jax.run import distributed


def eval_seed(seed: int) -> int:
    """The seed of the eval samples: the same at every eval of a run, apart from every step's."""
    return int(np.random.SeedSequence(seed, spawn_key=(1,)).generate_state(1)[0] >> 1)


def score(
    tokenizer, grader: Grader, kind: str, samples, answers: Sequence[str], stops: Sequence[str] = ()
) -> np.ndarray:
    """Rewards [prompts, samples] of the decoded responses, each read up to its template's first
    stop string (:func:`qarl_jax.data.templates.cut_at_stop`)."""
    flat = [s for group in samples for s in group]
    texts = [cut_at_stop(t, stops) for t in tokenizer.decode_batch([s.tokens for s in flat])]
    repeated = [a for a, group in zip(answers, samples, strict=True) for _ in group]
    return grader.grade(texts, repeated, kind).reshape(len(samples), -1)


def outcomes(
    engine: RolloutEngine,
    tokenizer,
    grader: Grader,
    kind: str,
    prompts: Sequence[Sequence[int]],
    answers: Sequence[str],
    max_new_tokens: int,
    samples: int = 0,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    prompt_ids: Sequence[int] | None = None,
    stops: Sequence[str] = (),
) -> dict[str, np.ndarray]:
    """Per prompt: ``greedy`` reward [P, 1], greedy ``length`` [P] and, when ``samples`` > 0, the
    ``sampled`` rewards [P, samples] drawn with ``sampling`` under ``seed``. ``prompt_ids`` name
    the prompts in the sample keys (see :func:`qarl_jax.rollout.rollout`); ``stops``: the
    template's stop strings, as the training rollouts have them."""
    ends = dict(stop_strings=stops, tokenizer=tokenizer, prompt_ids=prompt_ids, progress=False)
    greedy = rollout(engine, prompts, 1, max_new_tokens, GREEDY, 0, **ends)
    out = {
        "greedy": score(tokenizer, grader, kind, greedy, answers, stops),
        "length": np.asarray([s.length for group in greedy for s in group]),
    }
    if samples:
        drawn = rollout(engine, prompts, samples, max_new_tokens, sampling, seed, **ends)
        out["sampled"] = score(tokenizer, grader, kind, drawn, answers, stops)
    return out


def eval_metrics(out: dict[str, np.ndarray], prefix: str = "eval") -> dict[str, float]:
    """The logged figures of :func:`outcomes` (a correct sample is one with reward 1)."""
    metrics = {
        f"{prefix}/accuracy": float(out["greedy"].mean()),
        f"{prefix}/response_length": float(np.mean(out["length"])),
    }
    if "sampled" in out:
        k = out["sampled"].shape[1]
        metrics[f"{prefix}/pass@{k}"] = float(np.mean(out["sampled"].max(axis=1) >= 1.0))
        metrics[f"{prefix}/mean@{k}"] = float(out["sampled"].mean())
    return metrics


def evaluate(engine, tokenizer, grader, kind, prompts, answers, max_new_tokens: int) -> dict:
    """Greedy pass@1 of the engine's (deployed, quantized) policy on held-out prompts."""
    prompts = [p.tolist() for p in prompts]
    return eval_metrics(outcomes(engine, tokenizer, grader, kind, prompts, answers, max_new_tokens))


class Evaluator:
    """A run's held-out evals (see the module docstring). The bf16 engine is built once, over the
    master weights themselves (the bf16 format quantizes nothing, so on one process it holds no copy
    of its own; on several, this host's replica), and gets the current ones only when it evaluates;
    its KV cache is freed between evals."""

    def __init__(
        self,
        config: Config,
        engine: RolloutEngine,
        tokenizer,
        grader: Grader,
        held_out: dict,
        params,
        place: Callable = lambda tree: tree,
    ):
        """``engine``: the run's rollout engine (kept in sync by the loop); ``params``: the master
        weights; ``place``: master-format weights -> the engines' layout."""
        self.config, self.engine, self.place = config, engine, place
        self.tokenizer, self.grader = tokenizer, grader
        prompts, answers = held_out["prompt_ids"], held_out["answer"]
        n, count = len(prompts), jax.process_count()
        if n < count:
            raise ConfigError(f"run.eval_prompts ({n}) must be >= the {count} processes sharing them")
        self.ids = list(range(jax.process_index(), n, count))  # this process's share
        self.prompts = [prompts[i].tolist() for i in self.ids]
        self.answers = [answers[i] for i in self.ids]
        # every process's share padded to `rows`, gathered process-major: prompt i is row
        # (i % count) * rows + i // count
        self.rows = -(-n // count)
        self.order = [(i % count) * self.rows + i // count for i in range(n)]
        self.bf16_spec = dataclasses.replace(config.quant, fmt="bf16")
        self.bf16_engine = None
        if config.run.eval_bf16:
            model = Qwen3ForCausalLM(engine.model.config, self.bf16_spec)
            frozen = place(layout.freeze(params, self.bf16_spec, model))
            self.bf16_engine = RolloutEngine(model, frozen, engine.config, engine.mesh, engine.rules)

    def _outcomes(self, engine: RolloutEngine) -> dict[str, np.ndarray]:
        """Every held-out prompt's outcomes, in order (this process's share, gathered)."""
        c = self.config
        sampling = SamplingParams(c.rollout.temperature)
        args = (self.tokenizer, self.grader, c.rewards.kind, self.prompts, self.answers)
        out = outcomes(
            engine,
            *args,
            c.rollout.max_new_tokens,
            c.run.eval_samples,
            sampling,
            eval_seed(c.seed),
            self.ids,
            stop_strings(c.data.template),
        )
        pad = lambda v: np.concatenate([v, np.zeros((self.rows - len(v), *v.shape[1:]), v.dtype)])
        return {k: v[self.order] for k, v in distributed.gather({k: pad(v) for k, v in out.items()}).items()}

    def __call__(self, params) -> dict[str, float]:
        """The eval figures of the engine's current weights and, with ``eval_bf16``, of ``params``."""
        metrics = eval_metrics(self._outcomes(self.engine), "eval")
        if self.bf16_engine is not None:
            frozen = layout.freeze(params, self.bf16_spec, self.bf16_engine.model)
            self.bf16_engine.update_params(self.place(frozen))
            metrics |= eval_metrics(self._outcomes(self.bf16_engine), "eval_bf16")
            self.bf16_engine.release()
        return metrics
