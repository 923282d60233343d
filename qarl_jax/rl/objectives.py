"""Policy-gradient objectives as pure functions of per-token log-probs.

Every objective takes the current policy's log-probs ``logp`` (differentiated), the old policy's
``old_logp`` (the forward before the first update), the rollout engine's ``rollout_logp``, one
advantage per sequence and a response mask, and returns ``(loss, metrics)``.

- ``tbpo`` (QaRL, the default): sequence geometric-mean ratio rho; PPO clip for positive
  advantages; for negative advantages a two-sided trust band: inside it the term is rho * A,
  outside it the sequence is dropped (mask 0), so error-token sequences with extreme ratios cannot
  dominate the gradient. Multiplied by the truncated sequence mismatch weight (old vs rollout).
- ``gspo``: the sequence ratio with a PPO clip on both signs.
- ``grpo``: token-level PPO clip with separate low/high epsilons; ``dr_grpo``: the same with
  sequence-mean-token-sum aggregation over a constant normaliser (use mean-only advantages).
- ``dual_clip_ppo``: token PPO clip plus a lower bound c * A for negative advantages.

Mismatch corrections (``correction``): ``tis`` truncates the importance weight
exp(old - rollout) at C, ``mis`` masks what exceeds C; per token or per sequence (length-normalised).
In aligned QaRL old == rollout bitwise, so the weight is exactly 1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

OBJECTIVES = ("tbpo", "gspo", "grpo", "dr_grpo", "dual_clip_ppo")
SEQUENCE_LEVEL = ("tbpo", "gspo")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
_DEFAULT_EPS = {"tbpo": (3e-4, 4e-4), "gspo": (3e-4, 4e-4), "grpo": (0.2, 0.2), "dr_grpo": (0.2, 0.2),
                "dual_clip_ppo": (0.2, 0.2)}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    name: str = "tbpo"
    eps_low: float | None = None  # None: the objective's default (3e-4 sequence level, 0.2 token level)
    eps_high: float | None = None  # None: 4e-4 sequence level, 0.2 token level (DAPO uses 0.28)
    eps_neg_low: float = 3e-4  # TBPO trust band for negative advantages: [1 - low, 1 + high]
    eps_neg_high: float = 7e-4
    dual_clip: float = 3.0
    correction: str = "auto"  # auto (tbpo: tis; others: none) | none | tis | mis
    correction_level: str = "sequence"  # token | sequence
    correction_cap: float = 2.0  # C
    aggregation: str = "auto"  # auto | token_mean | seq_mean_token_mean | seq_mean_token_sum
    loss_norm: float | None = None  # constant normaliser of seq_mean_token_sum (default: padded length)
    kl_coef: float = 0.0
    kl_estimator: str = "k3"  # k1 | k3
    entropy_coef: float = 0.0

    def __post_init__(self):
        checks = [
            ("name", self.name, OBJECTIVES),
            ("correction", self.correction, ("auto", "none", "tis", "mis")),
            ("correction_level", self.correction_level, ("token", "sequence")),
            ("aggregation", self.aggregation, ("auto",) + AGGREGATIONS),
            ("kl_estimator", self.kl_estimator, ("k1", "k3")),
        ]
        for field, value, allowed in checks:
            if value not in allowed:
                raise ValueError(f"objective.{field}={value!r}; expected one of {allowed}")
        if (
            self.name in SEQUENCE_LEVEL
            and self.resolved_correction != "none"
            and self.correction_level != "sequence"
        ):
            raise ValueError(f"{self.name} is sequence-level: its mismatch correction must be sequence-level")
        if self.correction_cap <= 0 or self.dual_clip <= 1:
            raise ValueError("correction_cap must be > 0 and dual_clip > 1")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(
                f"kl_coef and entropy_coef must be >= 0, got {self.kl_coef}, {self.entropy_coef}"
            )

    @property
    def eps(self) -> tuple[float, float]:
        low, high = _DEFAULT_EPS[self.name]
        return (
            low if self.eps_low is None else self.eps_low,
            high if self.eps_high is None else self.eps_high,
        )

    @property
    def resolved_correction(self) -> str:
        if self.correction == "auto":
            return "tis" if self.name == "tbpo" else "none"
        return self.correction

    @property
    def resolved_aggregation(self) -> str:
        if self.aggregation != "auto":
            return self.aggregation
        return {"dr_grpo": "seq_mean_token_sum"}.get(self.name, "token_mean")


def _safe_len(mask: jax.Array) -> jax.Array:
    return jnp.maximum(jnp.sum(mask, axis=1), 1.0)


def aggregate(values: jax.Array, mask: jax.Array, mode: str, loss_norm: float | None = None) -> jax.Array:
    """Reduce per-token values [B, T] over response tokens to a scalar."""
    if mode == "token_mean":
        return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    seqs = jnp.maximum(jnp.sum(jnp.any(mask > 0, axis=1)), 1.0)
    if mode == "seq_mean_token_mean":
        return jnp.sum(jnp.sum(values * mask, axis=1) / _safe_len(mask)) / seqs
    if mode == "seq_mean_token_sum":
        norm = mask.shape[1] if loss_norm is None else loss_norm
        return jnp.sum(values * mask) / (seqs * norm)
    raise ValueError(f"unknown aggregation {mode!r}; expected one of {AGGREGATIONS}")


def _mismatch_weight(old_logp, rollout_logp, mask, cfg: ObjectiveConfig):
    """Stop-gradient importance weight old/rollout, [B, T] (token) or [B, 1] (sequence), and the
    fraction of weights the correction changed (truncated or masked)."""
    diff = (old_logp - rollout_logp) * mask
    if cfg.correction_level == "token":
        w = jnp.exp(diff)
    else:
        w = jnp.exp(jnp.sum(diff, axis=1, keepdims=True) / _safe_len(mask)[:, None])
    kind, cap = cfg.resolved_correction, cfg.correction_cap
    if kind == "none":
        corrected = jnp.ones_like(w)
    elif kind == "tis":
        corrected = jnp.minimum(w, cap)
    else:
        corrected = jnp.where(w <= cap, w, 0.0)
    changed = (corrected != w).astype(jnp.float32) if kind != "none" else jnp.zeros_like(w)
    return jax.lax.stop_gradient(corrected), w, changed


def compute_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    rollout_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    cfg: ObjectiveConfig,
    ref_logp: jax.Array | None = None,
    entropy: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Loss to minimise and its diagnostics. logp/old/rollout/ref/entropy/mask: [B, T]; advantages [B]."""
    mask = mask.astype(jnp.float32)
    old_logp, rollout_logp = jax.lax.stop_gradient(old_logp), jax.lax.stop_gradient(rollout_logp)
    adv = jax.lax.stop_gradient(advantages.astype(jnp.float32))
    eps_low, eps_high = cfg.eps
    weight, raw_weight, changed = _mismatch_weight(old_logp, rollout_logp, mask, cfg)
    valid = (jnp.sum(mask, axis=1) > 0).astype(jnp.float32)
    n_valid = jnp.maximum(jnp.sum(valid), 1.0)
    metrics: dict[str, jax.Array] = {}

    if cfg.name in SEQUENCE_LEVEL:
        log_rho = jnp.sum((logp - old_logp) * mask, axis=1) / _safe_len(mask)
        rho = jnp.exp(log_rho)
        clipped = jnp.clip(rho, 1.0 - eps_low, 1.0 + eps_high)
        surrogate = jnp.minimum(rho * adv, clipped * adv)
        keep = jnp.ones_like(rho)
        if cfg.name == "tbpo":
            in_band = (rho >= 1.0 - cfg.eps_neg_low) & (rho <= 1.0 + cfg.eps_neg_high)
            surrogate = jnp.where(adv >= 0, surrogate, jnp.where(in_band, rho * adv, 0.0))
            keep = jnp.where(adv >= 0, 1.0, in_band.astype(jnp.float32))
            metrics["band_mask_frac"] = jnp.sum((1.0 - keep) * valid) / n_valid
        per_seq = -surrogate * weight[:, 0] * valid
        policy_loss = jnp.sum(per_seq) / n_valid
        clip_active = (jnp.where(adv >= 0, rho * adv > clipped * adv, False) if cfg.name == "tbpo"
                       else rho * adv > clipped * adv)  # fmt: skip
        metrics["clip_frac"] = jnp.sum(clip_active * keep * valid) / n_valid
        ratio, ratio_mask = rho[:, None], valid[:, None]
        aggregation = "token_mean"
    else:
        ratio = jnp.exp(logp - old_logp)
        a = adv[:, None]
        clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
        surrogate = jnp.minimum(ratio * a, clipped * a)
        if cfg.name == "dual_clip_ppo":
            lower = cfg.dual_clip * a
            metrics["dual_clip_frac"] = jnp.sum((a < 0) * (surrogate < lower) * mask) / jnp.maximum(
                jnp.sum(mask), 1
            )
            surrogate = jnp.where(a < 0, jnp.maximum(surrogate, lower), surrogate)
        aggregation = cfg.resolved_aggregation
        policy_loss = aggregate(-surrogate * weight, mask, aggregation, cfg.loss_norm)
        metrics["clip_frac"] = jnp.sum((ratio * a > clipped * a) * mask) / jnp.maximum(jnp.sum(mask), 1.0)
        ratio_mask = mask

    loss = policy_loss
    if ref_logp is not None and cfg.kl_coef:
        log_r = jax.lax.stop_gradient(ref_logp) - logp
        kl = log_r * -1.0 if cfg.kl_estimator == "k1" else jnp.exp(log_r) - log_r - 1.0
        metrics["kl_ref"] = aggregate(kl, mask, aggregation, cfg.loss_norm)
        loss = loss + cfg.kl_coef * metrics["kl_ref"]
    if entropy is not None:
        metrics["entropy"] = aggregate(entropy, mask, aggregation, cfg.loss_norm)
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * metrics["entropy"]

    big = jnp.finfo(jnp.float32).max
    weight_mask = mask if cfg.correction_level == "token" else valid[:, None]
    n_w = jnp.maximum(jnp.sum(weight_mask), 1.0)
    metrics.update(
        policy_loss=policy_loss,
        ratio_mean=jnp.sum(ratio * ratio_mask) / jnp.maximum(jnp.sum(ratio_mask), 1.0),
        ratio_max=jnp.max(jnp.where(ratio_mask > 0, ratio, -big)),
        ratio_min=jnp.min(jnp.where(ratio_mask > 0, ratio, big)),
        is_weight_mean=jnp.sum(raw_weight * weight_mask) / n_w,
        is_weight_max=jnp.max(jnp.where(weight_mask > 0, raw_weight, -big)),
        correction_frac=jnp.sum(changed * weight_mask) / n_w,
    )
    return loss, metrics
