"""``python -m qarl_jax.tools.check_alignment [--config FILE] [key=value ...] [--json]``

Measures a policy's training-inference mismatch where RL meets it. The rollout engine samples
``alignment.prompts`` random prompts of mixed lengths x ``rollout.samples_per_prompt`` on
``rollout.slots`` decode slots (continuous batching: slots are refilled as samples end on EOS or
length) at ``rollout.temperature``, and records each token's log-prob under the distribution it
was drawn from (what the trainer stores as the rollout log-prob). Every sampled token is then
re-scored by the loss the trainer differentiates (``logprob_loss`` under ``jax.value_and_grad``;
the log-probs are its auxiliary output) on training batches of ``alignment.train_rows`` rows,
packed or padded, on the configured mesh (``mesh.*``; the engine on its own layout,
``rollout.mesh.*``, as in training). With no arguments it checks the embedded tiny model;
``model.path=DIR`` checks a Hugging Face checkpoint.

Report (d = training log-prob - rollout log-prob of a sampled token, nats):
  n_tokens              sampled tokens compared
  frac_bitwise_equal    fraction of tokens with d == 0 (identical float32 bits)
  max_abs_logp_diff     max |d|;  mean_abs_logp_diff: mean |d|
  kl_k3                 mean of exp(d) - d - 1: the k3 estimate, from the rollout's own samples, of
                        KL(rollout || train) (>= 0; 0 when aligned)
  seq_ratio_quantiles   p0/p1/p50/p99/p100 over sequences of exp(mean of d over the sequence): the
                        per-token geometric-mean importance ratio train / rollout (1 when aligned)
  frac_same_experts     MoE: fraction of the tokens both forwards processed (prompt and sampled,
                        all but each sequence's last) routed to the same top-k experts, in the same
                        order, in every MoE layer; null for dense models
  format, mode          quant.fmt and quant.mode
  group_sizes           4-bit formats: the int4 group size each quantized projection ran with (the
                        default is chosen per K: 128, or the power of two that divides a K 128 does
                        not, e.g. 64 for a hidden size of 192); null for the other formats
``--json`` prints these as one JSON object, the only thing on stdout (as ``--json`` does in every
command).
"""

from __future__ import annotations

import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from qarl_jax import cli, sharding
from qarl_jax.config import Config, ConfigError, load_config
from qarl_jax.rl.alignment import generated_logprobs, pack
from qarl_jax.rl.batch import training_batch
from qarl_jax.rl.logprobs import logprob_loss, training_model
from qarl_jax.rollout import EngineConfig, RolloutEngine, Sample, SamplingParams, layout, rollout
from qarl_jax.run.build import build_policy, build_tokenizer, engine_layout, eos_ids, quant_group_sizes
from qarl_jax.tools.routing import RouteRecorder, routed_experts

KEYS = (
    "n_tokens",
    "frac_bitwise_equal",
    "max_abs_logp_diff",
    "mean_abs_logp_diff",
    "kl_k3",
    "seq_ratio_quantiles",
    "frac_same_experts",
    "format",
    "mode",
    "group_sizes",
)
QUANTILES = (0, 1, 50, 99, 100)
BATCH_KEYS = ("tokens", "positions", "segment_ids", "targets")


def mismatch(train: list[np.ndarray], rollout_lp: list[np.ndarray]) -> dict:
    """The token and sequence statistics of the report (see the module docstring)."""
    t, r = np.concatenate(train), np.concatenate(rollout_lp)
    d = t.astype(np.float64) - r.astype(np.float64)
    ratios = [math.exp(np.mean(a.astype(np.float64) - b)) for a, b in zip(train, rollout_lp, strict=True)]
    return {
        "n_tokens": int(d.size),
        "frac_bitwise_equal": float(np.mean(t == r)),
        "max_abs_logp_diff": float(np.max(np.abs(d))),
        "mean_abs_logp_diff": float(np.mean(np.abs(d))),
        "kl_k3": float(np.mean(np.expm1(d) - d)),
        "seq_ratio_quantiles": {f"p{q}": float(np.percentile(ratios, q)) for q in QUANTILES},
    }


def _mesh(mesh_cfg: sharding.MeshConfig, what: str) -> Mesh:
    try:
        return sharding.make_mesh(mesh_cfg)
    except ValueError as e:
        raise ConfigError(f"{what}: {e}") from e


def _check(config: Config) -> None:
    """Cross-section constraints the sections cannot check alone."""
    a, r = config.alignment, config.rollout
    if a.max_prompt_len > r.max_len - r.max_new_tokens:
        raise ConfigError(
            f"alignment.max_prompt_len ({a.max_prompt_len}) exceeds rollout.max_len - rollout.max_new_tokens "
            f"({r.max_len - r.max_new_tokens})"
        )


def _prompts(config: Config, vocab_size: int) -> list[list[int]]:
    """Random token prompts of lengths drawn in [min_prompt_len, max_prompt_len]."""
    a = config.alignment
    rng = np.random.default_rng(config.seed)
    lengths = rng.integers(a.min_prompt_len, a.max_prompt_len + 1, a.prompts)
    return [rng.integers(0, vocab_size, n).tolist() for n in lengths]


def _rollout(config: Config, model, params, meshes, prompts, stops: tuple[int, ...], progress: bool):
    """Samples from the engine on its own layout (frozen weights quantized on the training mesh,
    then moved, as the training loop does) and, for MoE, the decode path's routing per sample."""
    train_mesh, engine_mesh = meshes
    rules, r = config.mesh.rules, config.rollout
    with sharding.activate(train_mesh, rules):
        frozen = jax.jit(lambda p: layout.freeze(p, config.quant, model))(params)
    recorder = RouteRecorder() if model.config.is_moe else None
    engine = RolloutEngine(
        model,
        frozen,
        EngineConfig(slots=r.slots, max_len=r.max_len, eos_ids=stops),
        mesh=engine_mesh,
        rules=layout.ENGINE_RULES,
        hook=recorder,
    )
    samples = rollout(
        engine,
        prompts,
        r.samples_per_prompt,
        r.max_new_tokens,
        SamplingParams(r.temperature),
        seed=config.seed,
        progress=progress,
    )
    flat = [s for group in samples for s in group]
    if recorder is None:  # not an MoE model
        return flat, None
    lengths = {(s.prompt_index, s.sample_index): len(prompts[s.prompt_index]) + s.length - 1 for s in flat}
    routes = recorder.routes(lengths)
    return flat, [routes[(s.prompt_index, s.sample_index)] for s in flat]


def _batches(config: Config, prompts: list[list[int]], samples: list[Sample]):
    """Training batches of ``train_rows`` rows, each with ``where``: every sequence's (row, offset).

    Packed: 2 x rows sequences per batch in rows twice the longest sequence (first fit always finds
    room: a row refuses a sequence only when it holds two). Padded: the trainer's batch."""
    a = config.alignment
    seqs = [np.asarray(prompts[s.prompt_index] + s.tokens, np.int32) for s in samples]
    per_batch = 2 * a.train_rows if a.packing else a.train_rows
    length = 2 * max(len(s) - 1 for s in seqs)
    for start in range(0, len(samples), per_batch):
        idx = range(start, min(start + per_batch, len(samples)))
        if a.packing:
            batch = pack([seqs[i] for i in idx], a.train_rows, length)
        else:
            group = [samples[i] for i in idx]
            padded = training_batch(
                [prompts[s.prompt_index] for s in group],
                [s.tokens for s in group],
                [s.sampling_logprobs for s in group],
                [0.0] * len(group),
                config.rollout.max_len,
            )
            pad = ((0, a.train_rows - len(group)), (0, 0))
            batch = {k: np.pad(getattr(padded, k), pad) for k in BATCH_KEYS} | {
                "where": [(j, 0) for j in range(len(group))]
            }
        yield list(idx), batch


def _objective(logp: jax.Array, batch) -> jax.Array:
    """A stand-in loss (mean log-prob of the real tokens): only its auxiliary log-probs are used."""
    real = batch["segment_ids"] > 0
    return -jnp.sum(jnp.where(real, logp, 0.0)) / jnp.maximum(jnp.sum(real), 1)


def _score(config: Config, model, params, mesh: Mesh, prompts, samples: list[Sample]):
    """Training log-probs of every sample's response tokens and, for MoE, the training forward's
    routing of its tokens (a forward of the same model and batch, with intermediates)."""
    rules, temperature = config.mesh.rules, config.rollout.temperature
    loss = logprob_loss(model, _objective, temperature, remat=config.train.remat)
    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    trainer_model = training_model(model, remat=config.train.remat)
    forward = jax.jit(
        lambda p, b: trainer_model.apply(
            {"params": p}, b["tokens"], b["positions"], b["segment_ids"], mutable=["intermediates"]
        )[1]["intermediates"]
    )
    rows = sharding.batch_sharding(mesh, 2, rules, rows=config.alignment.train_rows)
    logps, routes = [None] * len(samples), [None] * len(samples)
    with sharding.activate(mesh, rules):
        for idx, batch in _batches(config, prompts, samples):
            arrays = {k: jax.device_put(batch[k], rows) for k in BATCH_KEYS}
            (_, logp), _ = step(params, arrays)
            own = [prompts[samples[i].prompt_index] for i in idx]
            seqs = [p + samples[i].tokens for p, i in zip(own, idx, strict=True)]
            for i, lp in zip(idx, generated_logprobs(np.asarray(logp), batch, own, seqs), strict=True):
                logps[i] = lp
            if model.config.is_moe:
                experts = np.asarray(routed_experts(forward(params, arrays)))
                for i, (row, off), s in zip(idx, batch["where"], seqs, strict=True):
                    routes[i] = experts[row, off : off + len(s) - 1]
    return logps, routes if model.config.is_moe else None


def run(config: Config, progress: bool = True) -> dict:
    """Roll out, re-score and compare; returns the report (``KEYS``, in order)."""
    _check(config)
    train_mesh = _mesh(config.mesh, "mesh")
    engine_mesh = engine_layout(config)
    with sharding.activate(train_mesh, config.mesh.rules):
        model, params = build_policy(config, train_mesh)
    tokenizer = build_tokenizer(config)
    prompts = _prompts(config, model.config.vocab_size)
    stops = eos_ids(tokenizer)
    samples, rollout_routes = _rollout(
        config, model, params, (train_mesh, engine_mesh), prompts, stops, progress
    )
    train_lp, train_routes = _score(config, model, params, train_mesh, prompts, samples)
    report = mismatch(train_lp, [np.asarray(s.sampling_logprobs, np.float32) for s in samples])
    same = None
    if rollout_routes is not None:
        pairs = zip(train_routes, rollout_routes, strict=True)
        same = float(np.mean(np.concatenate([np.all(t == r, axis=(1, 2)) for t, r in pairs])))
    groups = quant_group_sizes(config.quant, model.config) or None
    return report | {
        "frac_same_experts": same,
        "format": config.quant.fmt,
        "mode": config.quant.mode,
        "group_sizes": groups,
    }


def _layout_text(mesh: layout.RolloutMesh) -> str:
    sizes = mesh.mesh_config().shape(jax.local_device_count())
    return " ".join(f"{a}={sizes[a]}" for a in ("data", "tensor", "expert"))


def _describe(config: Config, report: dict) -> str:
    r, a = config.rollout, config.alignment
    lines = [
        f"model {config.model.path or config.model.preset}, {config.quant.fmt} {config.quant.mode}, "
        f"{jax.device_count()} device(s), training mesh {config.mesh.shape(jax.device_count())}",
        f"rollout: {a.prompts} prompts x {r.samples_per_prompt} samples on {r.slots} slots, "
        f"temperature {r.temperature}, rollout.mesh {_layout_text(r.mesh)}; "
        f"training batches of {a.train_rows} rows, "
        f"{'packed' if a.packing else 'padded'}",
    ]
    if report["group_sizes"]:
        sizes = sorted(set(report["group_sizes"].values()), reverse=True)
        lines.append(f"  int4 groups of {' / '.join(map(str, sizes))} rows: {report['group_sizes']}")
    for key in KEYS[:-3]:
        value = report[key]
        if isinstance(value, dict):
            value = "  ".join(f"{k} {v:.6g}" for k, v in value.items())
        lines.append(f"  {key:<20} {value}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(
        prog="python -m qarl_jax.tools.check_alignment",
        description=cli.plain(__doc__.split("\n\n")[1].split(". ")[0]) + ".",
    )
    parser.add_argument("--config", help="YAML file of overrides (see configs/)")
    cli.add_json(parser, "the report")
    parser.add_argument(
        "overrides", nargs="*", help="key=value overrides, e.g. quant.mode=naive alignment.prompts=4"
    )
    args = parser.parse_args(argv)

    def check() -> int:
        config = load_config(args.config, args.overrides)
        report = run(config, progress=not args.json)
        print(json.dumps(report) if args.json else _describe(config, report))
        return 0

    return cli.run(check)


if __name__ == "__main__":
    sys.exit(main())
