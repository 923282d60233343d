"""Loading the policy to evaluate, and sampling and grading every benchmark with it.

The checkpoint is a training run's directory (its newest intact checkpoint), one of its steps, or a
Hugging Face directory. A run brings its own config: the format its rollouts ran (the deployed
weights), its template, tokenizer and graders' limits; a Hugging Face directory gets the embedded
default config with ``model.path`` set. ``key=value`` overrides change either (for a run, only the
sections that do not describe the weights: ``quant``, ``rollout``, ``data``, ``rewards``).

The weights are frozen into each variant's format on a mesh of every device and moved to the
rollout engine's own layout (``rollout.mesh``, this process's devices), as the training loop does.
Each process samples every P-th item; a sample's randomness is keyed by (the benchmark's seed, the
item's index in the file, the sample's index), never by device, slot or process, so the samples
are the same on any number of devices and processes. The graded records are gathered in item order
on every process.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from qarl_jax import sharding, storage
from qarl_jax.config import Config, load_config, parse_overrides
from qarl_jax.data.templates import apply_template, cut_at_stop, stop_strings
from qarl_jax.errors import CheckpointError, ConfigError
from qarl_jax.evaluate.benchmarks import Benchmark
from qarl_jax.evaluate.metrics import answer_key
from qarl_jax.models import Qwen3ForCausalLM
from qarl_jax.quant import QuantSpec
from qarl_jax.rewards import Grader
from qarl_jax.rollout import GREEDY, SamplingParams, layout, rollout
from qarl_jax.run import distributed
from qarl_jax.run.build import (
    architecture,
    build_engine,
    build_policy,
    check_model_files,
    engine_layout,
    is_hf_dir,
    restore_policy,
    run_checkpoint,
)
from qarl_jax.run.rundir import say

RUN_OVERRIDABLE = ("quant", "rollout", "data", "rewards")  # a run's other sections describe its weights
ALL_DEVICES = sharding.MeshConfig()  # the master weights' mesh, whatever mesh a run trained on


@dataclasses.dataclass
class Policy:
    """What is evaluated: the config, the master weights on ``mesh``, and where they came from."""

    config: Config
    params: Any
    mesh: jax.sharding.Mesh
    source: dict[str, Any]


def load_policy(checkpoint: str, overrides: Sequence[str]) -> Policy:
    """The run, run step or Hugging Face directory ``checkpoint`` names (see the module docstring)."""
    path = storage.parse(checkpoint, "--checkpoint")  # local or gs://
    if not path.exists():
        raise CheckpointError(f"--checkpoint {path}: no such file or directory")
    mesh = sharding.make_mesh(ALL_DEVICES)
    if is_hf_dir(path):
        config = dataclasses.replace(load_config(None, [f"model.path={path}", *overrides]), mesh=ALL_DEVICES)
        check_model_files(config.model)
        with sharding.activate(mesh, config.mesh.rules):
            _, params = build_policy(config, mesh)
        return Policy(config, params, mesh, {"checkpoint": str(path), "kind": "huggingface", "step": None})
    run = run_checkpoint(path)
    if run is None:
        raise CheckpointError(
            f"--checkpoint {path}: neither a Hugging Face model directory (config.json + safetensors) nor "
            "a training run directory or one of its steps (RUN/checkpoints/N)"
        )
    fixed = sorted(set(parse_overrides(list(overrides))) - set(RUN_OVERRIDABLE))
    if fixed:
        raise ConfigError(
            f"{fixed[0]}.*: a run's {fixed[0]} section describes its weights; evaluate overrides only "
            f"{', '.join(s + '.*' for s in RUN_OVERRIDABLE)} (export it with --export-hf to change more)"
        )
    run_dir, step = run
    _, _, params, step = restore_policy(run_dir, step)
    config = dataclasses.replace(load_config(run_dir / "config.json", list(overrides)), mesh=ALL_DEVICES)
    return Policy(config, params, mesh, {"checkpoint": str(path), "kind": "run", "step": step})


def variants(config: Config, weights: str) -> dict[str, QuantSpec]:
    """Row name -> the format its weights are frozen in: the deployed format (the config's), bf16
    (the master weights unquantized), or both; one row when the deployed format is bf16."""
    deployed = {f"{config.quant.fmt} (deployed)": config.quant}
    bf16 = {"bf16": dataclasses.replace(config.quant, fmt="bf16")}
    if weights == "deployed" or (weights == "both" and config.quant.fmt == "bf16"):
        return deployed
    return bf16 if weights == "bf16" else deployed | bf16


def bench_seed(seed: int, name: str) -> int:
    """A benchmark's sample seed: the run's ``seed`` and the benchmark's name, so adding a file to
    the command changes no other benchmark's samples."""
    state = np.random.SeedSequence([seed, zlib.crc32(name.encode())]).generate_state(1)[0]
    return int(state >> 1)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the responses are drawn: k per item, greedy when temperature is 0."""

    k: int
    temperature: float
    top_p: float
    max_tokens: int
    seed: int

    @property
    def params(self) -> SamplingParams:
        return GREEDY if self.temperature == 0 else SamplingParams(self.temperature, self.top_p)


def encode(config: Config, tokenizer, benches: Sequence[Benchmark]) -> list[list[list[int]]]:
    """Every item's prompt (the config's template around the question) as token ids."""
    render = lambda q: tokenizer.encode(apply_template(config.data.template, q), add_special_tokens=False).ids
    return [[render(item.question) for item in b.items] for b in benches]


def engine_config(config: Config, prompts: Sequence[Sequence[Sequence[int]]], max_tokens: int) -> Config:
    """The config with the engine's cache long enough for the longest prompt and ``max_tokens``."""
    longest = max(len(p) for b in prompts for p in b)
    rollout_cfg = dataclasses.replace(
        config.rollout, max_new_tokens=max_tokens, max_len=longest + max_tokens, overlong_buffer=0
    )
    data = dataclasses.replace(config.data, max_prompt_tokens=longest)
    return dataclasses.replace(config, rollout=rollout_cfg, data=data)


def evaluate_variant(
    policy: Policy,
    spec: QuantSpec,
    benches: Sequence[Benchmark],
    prompts: Sequence[Sequence[Sequence[int]]],
    sampling: Sampling,
    tokenizer,
    grader: Grader,
    label: str,
) -> dict[str, list[dict]]:
    """Benchmark name -> every item's graded record (in item order), for the weights in ``spec``."""
    config = engine_config(policy.config, prompts, sampling.max_tokens)
    model = Qwen3ForCausalLM(architecture(config), spec)
    with sharding.activate(policy.mesh, config.mesh.rules):
        frozen = jax.jit(lambda p: layout.freeze(p, spec, model))(policy.params)
    place = functools.partial(
        distributed.local_replica, global_mesh=policy.mesh, mesh=distributed.local_mesh(policy.mesh)
    )
    engine = build_engine(config, model, place(frozen), tokenizer, engine_layout(config))
    count, index = jax.process_count(), jax.process_index()
    stops = stop_strings(config.data.template)
    out = {}
    for bench, bench_prompts in zip(benches, prompts, strict=True):
        if distributed.is_primary():
            say(f"{label}: {bench.name} ({len(bench.items)} items x {sampling.k} samples)")
        ids = list(range(index, len(bench.items), count))  # this process's share
        samples = rollout(
            engine,
            [bench_prompts[i] for i in ids],
            sampling.k,
            sampling.max_tokens,
            sampling.params,
            bench_seed(sampling.seed, bench.name),
            stop_strings=stops,
            tokenizer=tokenizer,
            prompt_ids=ids,
            progress=distributed.is_primary(),
        )
        mine = _records(bench, ids, samples, tokenizer, grader, stops)
        gathered = [r for share in distributed.gather_json(mine) for r in share]
        out[bench.name] = sorted(gathered, key=lambda r: r["index"])
    engine.release()
    return out


def _records(
    bench: Benchmark, ids: Sequence[int], samples, tokenizer, grader: Grader, stops: tuple[str, ...]
) -> list[dict]:
    """Items ``ids``' graded records: per sample the response (up to the template's stop string,
    where it stopped on one), its length in tokens, how it ended, the answer a vote counts and the
    grade."""
    flat = [s for group in samples for s in group]
    texts = [cut_at_stop(t, stops) for t in tokenizer.decode_batch([s.tokens for s in flat])]
    answers = [bench.items[i].answer for i, group in zip(ids, samples, strict=True) for _ in group]
    grades = grader.grade(texts, answers, bench.kind).tolist()
    records, at = [], 0
    for i, group in zip(ids, samples, strict=True):
        graded: list[dict] = []
        records.append(
            {"index": i, "id": bench.items[i].id, "reference": bench.items[i].answer, "samples": graded}
        )
        for s in group:
            text = texts[at]
            graded.append(
                {
                    "response": text,
                    "tokens": s.length,
                    "finish": s.finish_reason,
                    "answer": answer_key(bench.kind, text),
                    "grade": grades[at],
                }
            )
            at += 1
    return records
