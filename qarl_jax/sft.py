"""``python -m qarl_jax.sft [--config configs/sft_arith.yaml] [key=value ...]``: the starting policy.

RL from a random policy on the arithmetic task gets no reward to learn from, so the embedded default
starts from a policy fine-tuned here (from a preset's random weights, or, with ``model.path``, from
an earlier policy: a curriculum) on worked solutions (``12+34=46\\n46-5=41\\n#### 41<eos>``).
It trains the same model code through the same training forward the RL step uses (for w4a16: the
quantized kernels with a straight-through backward), so the deployed quantized policy is the one
that was trained. It stops at the first held-out greedy eval reaching ``target_accuracy`` (a partial
accuracy leaves RL something to improve) and writes a Hugging Face directory with ``save_pretrained``
plus the tokenizer.json, at every eval (a run cut short goes on from its last one with ``model.path``).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import optax

from qarl_jax import cli, quant, storage
from qarl_jax.config import ModelConfig, load_config
from qarl_jax.data import DataConfig, build_arithmetic_tokenizer, build_dataset, make_source
from qarl_jax.models import Qwen3ForCausalLM, from_pretrained, init_params, preset, save_pretrained
from qarl_jax.rewards import Grader
from qarl_jax.rl.batch import training_batch
from qarl_jax.rl.logprobs import policy_logprobs
from qarl_jax.rollout import EngineConfig, RolloutEngine
from qarl_jax.run.build import check_model_files, eos_ids, eval_set, model_dir
from qarl_jax.run.heldout_eval import evaluate


@dataclasses.dataclass(frozen=True)
class SftConfig:
    seed: int = 0
    model: ModelConfig = ModelConfig()
    quant: quant.QuantSpec = quant.QuantSpec(fmt="w4a16")
    data: DataConfig = DataConfig(batch_size=64, max_prompt_tokens=32)
    steps: int = 3000
    learning_rate: float = 1e-3
    warmup_steps: int = 100
    max_len: int = 64  # prompt + solution tokens (longer examples are an error)
    eval_every: int = 100
    eval_prompts: int = 256
    target_accuracy: float = 1.0  # stop at the first eval at or above this
    # never the package's own assets by default (a run from the repo root replaced the policy `main`
    # ships); the configs/sft_*.yaml that made the shipped policies name their own run directories
    output_dir: str = "runs/sft"

    def __post_init__(self):
        if min(self.steps, self.eval_every, self.eval_prompts, self.warmup_steps + 1) < 1:
            raise ValueError("steps, eval_every and eval_prompts must be >= 1, warmup_steps >= 0")
        if not self.output_dir.strip():
            raise ValueError("output_dir is empty: name the directory the policy is written to")
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be below steps ({self.steps})")


def examples(config: SftConfig, tokenizer):
    """Endless (prompt ids, solution ids + EOS) pairs from the configured synthetic source."""
    eos = tokenizer.token_to_id("<|endoftext|>")
    for record in build_dataset(config.data, make_source(config.data), tokenizer):
        solution = tokenizer.encode(" " + record["solution"], add_special_tokens=False).ids
        yield record["prompt_ids"].tolist(), [*solution, eos]


def batches(config: SftConfig, tokenizer):
    """Padded next-token batches whose mask covers the solution tokens only."""
    stream = examples(config, tokenizer)
    n = config.data.batch_size
    while True:
        prompts, responses = zip(*(next(stream) for _ in range(n)), strict=True)
        zeros = [[0.0] * len(r) for r in responses]
        yield training_batch(prompts, responses, zeros, [0.0] * n, config.max_len - 1)


def make_step(model: Qwen3ForCausalLM, tx: optax.GradientTransformation):
    def loss_fn(params, batch):
        logp = policy_logprobs(model, params, batch.tokens, batch.positions, batch.segment_ids, batch.targets)
        return -jnp.sum(logp * batch.mask) / jnp.sum(batch.mask)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def sft(config: SftConfig) -> dict:
    tokenizer = build_arithmetic_tokenizer()
    m = config.model
    if m.path is None:
        depth = {} if m.num_hidden_layers is None else {"num_hidden_layers": m.num_hidden_layers}
        model = Qwen3ForCausalLM(
            preset(m.preset, param_dtype=m.param_dtype, dtype=m.compute_dtype, **depth), config.quant
        )
        params = init_params(model, jax.random.key(config.seed))
    else:  # a curriculum: go on from a policy fine-tuned on an easier task (same tokenizer)
        model, params, _ = from_pretrained(
            model_dir(m.path), dtype=m.param_dtype, compute_dtype=m.compute_dtype, quant=config.quant
        )
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, config.warmup_steps, config.steps
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))
    opt_state, step = tx.init(params), make_step(model, tx)
    quantize = jax.jit(lambda p: quant.quantize_params(p, config.quant))
    engine_cfg = EngineConfig(slots=64, max_len=config.max_len, eos_ids=eos_ids(tokenizer))
    engine = RolloutEngine(model, quantize(params), engine_cfg)
    held_out = eval_set(config.data, config.eval_prompts, tokenizer)
    max_new = config.max_len - config.data.max_prompt_tokens
    history, data = [], batches(config, tokenizer)
    with Grader() as grader:
        for i in range(1, config.steps + 1):
            params, opt_state, loss = step(params, opt_state, next(data))
            if i % config.eval_every and i != config.steps:
                continue
            engine.update_params(quantize(params))
            ev = evaluate(
                engine, tokenizer, grader, "synthetic", held_out["prompt_ids"], held_out["answer"], max_new
            )
            history.append({"step": i, "loss": float(loss), **ev})
            print(json.dumps(history[-1]), flush=True)
            # the policy so far, at every eval: a long fine-tune cut short goes on from it (model.path)
            with storage.staged(storage.parse(config.output_dir, "output_dir")) as out:  # local or gs://
                save_pretrained(out, model.config, jax.device_get(params), tokenizer)
            if ev["eval/accuracy"] >= config.target_accuracy:
                break
    return {"output_dir": config.output_dir, **history[-1]}


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(
        prog="python -m qarl_jax.sft",
        description=cli.plain(__doc__.split("\n\n")[1]),
        epilog=f"Writes the policy to output_dir (default {SftConfig.output_dir}; each configs/sft_*.yaml "
        "names its own), checked writable before training starts.",
    )
    parser.add_argument("--config", help="YAML file (see configs/sft_arith.yaml)")
    parser.add_argument(
        "overrides", nargs="*", help="key=value overrides, e.g. steps=500 output_dir=runs/mine"
    )
    args = parser.parse_args(argv)

    def run() -> int:
        config = load_config(args.config, args.overrides, cls=SftConfig)
        check_model_files(config.model)  # an empty or missing model.path: one line now, not minutes in
        where = cli.writable_dir(config.output_dir, "output_dir")  # written at the first eval, minutes in
        print(f"sft: writing the policy to {storage.absolute(where)}", file=sys.stderr, flush=True)
        print(json.dumps(sft(config), indent=2))
        return 0

    return cli.run(run)


if __name__ == "__main__":
    sys.exit(main())
