"""``python -m qarl_jax.main [--config FILE.yaml] [key=value ...]``

Until the RL training loop lands, the job is the smallest real piece of QaRL end to end: build (or
load) a Qwen3 policy on a device mesh, freeze it into the configured quantized format, roll out
greedily over a KV cache with the frozen weights, then score the same tokens with the training
forward (master weights, same format) and report how far the two log-probabilities are apart.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from qarl_jax import quant, sharding
from qarl_jax.config import Config, ConfigError, load_config
from qarl_jax.models import KVCache, Qwen3ForCausalLM, from_pretrained, preset
from qarl_jax.models.ops import token_logprobs


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


def greedy_rollout(model, frozen, prompts: jax.Array, new_tokens: int):
    """Prefill then greedy decoding over a KV cache; returns (tokens [B, T+N], rollout log-probs [B, N])."""
    b, t = prompts.shape
    cache = KVCache.init(model.config, b, t + new_tokens)

    @jax.jit
    def step(cache, tokens, positions):
        logits, cache = model.apply({"params": frozen}, tokens, positions, cache, method="decode")
        last = logits[:, -1]
        nxt = jnp.argmax(last, axis=-1)
        return cache, nxt, token_logprobs(last, nxt)

    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    cache, nxt, lp = step(cache, prompts, positions)
    out, lps = [nxt], [lp]
    for i in tqdm(range(1, new_tokens), desc="rollout", unit="step", leave=False):
        cache, nxt, lp = step(cache, nxt[:, None], jnp.full((b, 1), t + i - 1))
        out.append(nxt)
        lps.append(lp)
    return jnp.concatenate([prompts, jnp.stack(out, 1)], axis=1), jnp.stack(lps, 1)


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
        prompts = jax.random.randint(
            jax.random.key(config.seed + 1), (d.batch, d.prompt_len), 0, model.config.vocab_size
        )
        greedy_rollout(model, frozen, prompts, 2)  # compile outside the timing
        start = time.perf_counter()
        tokens, rollout_lp = greedy_rollout(model, frozen, prompts, d.new_tokens)
        rollout_lp.block_until_ready()
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
