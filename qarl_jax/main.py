"""``python -m qarl_jax.main [--config FILE.yaml] [key=value ...]``

Until the RL training loop lands, the job is the smallest real piece of QaRL end to end: build (or
load) a Qwen3 policy on a device mesh, freeze it into the configured quantized format, roll out
greedily with the rollout engine (frozen weights), then score the same tokens with the training
forward (master weights, same format) and report how far the two log-probabilities are apart.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import numpy as np

from qarl_jax import quant, sharding
from qarl_jax.config import Config, ConfigError, load_config
from qarl_jax.models import Qwen3ForCausalLM, from_pretrained, preset
from qarl_jax.models.ops import token_logprobs
from qarl_jax.rollout import GREEDY, EngineConfig, RolloutEngine, rollout


def build_policy(config: Config, mesh) -> tuple[Qwen3ForCausalLM, dict]:
    m = config.model
    if m.path is not None:
        model_cfg_model, _, _ = from_pretrained(m.path, dtype=m.param_dtype, compute_dtype=m.compute_dtype)
        model = Qwen3ForCausalLM(model_cfg_model.config, config.quant)
        _, params, _ = from_pretrained(
            m.path,
            dtype=m.param_dtype,
            compute_dtype=m.compute_dtype,
            shardings=sharding.param_shardings(model, mesh, config.mesh.rules),
        )
        return model, params
    model = Qwen3ForCausalLM(preset(m.preset, param_dtype=m.param_dtype, dtype=m.compute_dtype), config.quant)
    return model, sharding.init_sharded(model, jax.random.key(config.seed), mesh, config.mesh.rules)


def engine_rollout(engine: RolloutEngine, prompts: np.ndarray, new_tokens: int):
    """Greedy rollout through the engine; returns (tokens [B, T+N], rollout log-probs [B, N])."""
    out = rollout(engine, prompts.tolist(), max_new_tokens=new_tokens, sampling=GREEDY, ignore_eos=True)
    generated = np.asarray([s[0].tokens for s in out], np.int32)
    return np.concatenate([prompts, generated], axis=1), np.asarray([s[0].logprobs for s in out])


def training_logprobs(model, params, tokens: jax.Array, prompt_len: int) -> jax.Array:
    """Log-probs of the generated tokens under the full-sequence (training) forward."""
    logits = jax.jit(model.apply)({"params": params}, tokens[:, :-1])
    return token_logprobs(logits, tokens[:, 1:])[:, prompt_len - 1 :]


def run(config: Config) -> dict:
    mesh = sharding.make_mesh(config.mesh)
    with sharding.activate(mesh, config.mesh.rules):
        model, params = build_policy(config, mesh)
        frozen = jax.jit(lambda p: quant.quantize_params(p, config.quant))(params)
        d = config.demo
        prompts = np.asarray(
            jax.random.randint(
                jax.random.key(config.seed + 1), (d.batch, d.prompt_len), 0, model.config.vocab_size
            )
        )
        engine = RolloutEngine(
            model, frozen, EngineConfig(slots=d.batch, max_len=d.prompt_len + d.new_tokens), mesh=mesh
        )
        engine_rollout(engine, prompts, 2)  # compile outside the timing
        start = time.perf_counter()
        tokens, rollout_lp = engine_rollout(engine, prompts, d.new_tokens)
        seconds = time.perf_counter() - start
        train_lp = training_logprobs(model, params, tokens, d.prompt_len)
        naive = Qwen3ForCausalLM(model.config, None)
        naive_lp = training_logprobs(naive, params, tokens, d.prompt_len)
    diff = np.abs(np.asarray(train_lp) - np.asarray(rollout_lp))
    return {
        "model": model.config.architecture,
        "params": int(sum(x.size for x in jax.tree.leaves(params))),
        "format": config.quant.fmt,
        "devices": jax.device_count(),
        "mesh": dict(mesh.shape),
        "rollout_tokens_per_s": round(d.batch * d.new_tokens / seconds, 1),
        "aligned_frac_bitwise_equal": float(np.mean(diff == 0)),
        "aligned_max_abs_logprob_diff": float(diff.max()),
        "naive_max_abs_logprob_diff": float(np.abs(np.asarray(naive_lp) - np.asarray(rollout_lp)).max()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qarl_jax.main", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="YAML file of overrides (see configs/)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. quant.fmt=w8a8 mesh.tensor=2")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(run(config), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
