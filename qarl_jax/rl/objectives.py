"""Policy-gradient objectives, registered by name, as pure functions of per-token log-probs.

An objective is one function under ``@register(name, ...)``: it maps log-ratios and advantages to
the surrogate to maximise (per token for token-level objectives, per sequence for sequence-level
ones) and to boolean flags reported as fractions (``clip_frac``, ...). Everything else is shared
and lives here once: the safe log-ratio, the mismatch correction (TIS / MIS), the aggregation over
tokens and sequences, the KL and entropy terms and the diagnostics. Adding an objective is adding
one registered function; ``objective.name`` accepts it at once.

Symbols (the method note's): for response y_i of |y_i| tokens with advantage A_i,
r_it = pi_theta(y_it) / pi_old(y_it) the token ratio, rho_i = exp(mean_t log r_it) the sequence
(geometric-mean) ratio, w the stop-gradient mismatch weight pi_old / pi_rollout (exactly 1 when the
rollout is aligned, old == rollout bitwise) and C its cap.

Normalisers. Every denominator (tokens for ``token_mean``, sequences for the sequence modes and the
sequence-level objectives) is a :class:`Normalisers` counted over the whole minibatch before the
Trainer splits it into micro-batches; each micro-batch's loss is its share of the minibatch loss,
so the accumulated gradient is the same function of the minibatch for any ``train.micro_batches``
and any device layout. :func:`compute_loss` without ``norms`` counts them over the batch it gets.

Safe ratios. A log-ratio is selected with ``where`` on the mask before any ``exp`` (padding may hold
anything: -200, -inf) and clamped to +-``log_ratio_clamp`` (20, as verl), so a masked position or an
extreme ratio gives a finite loss and gradient; a clamped ratio has no gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from qarl_jax.rl.batch import BatchArray, RolloutBatch

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
CORRECTIONS = ("none", "tis", "mis")
# metrics that combine over micro-batches by max / min (all others are shares of the minibatch: sums)
EXTREMA = {"ratio_max": jnp.maximum, "ratio_min": jnp.minimum, "is_weight_max": jnp.maximum}


@dataclasses.dataclass(frozen=True)
class Objective:
    """A registered objective. ``fn(log_ratio, adv, cfg) -> (surrogate, flags)``: token level,
    log_ratio [B, T] and adv [B, 1]; sequence level, log rho [B] and adv [B]. ``surrogate`` is
    what to maximise, per unit; ``flags`` maps metric names to booleans per unit, reported as the
    fraction of the loss's units where they hold."""

    fn: Callable
    level: str  # token | sequence
    eps: tuple[float, float]  # default (eps_low, eps_high)
    correction: str = "none"  # what objective.correction=auto means
    aggregation: str = "token_mean"  # what objective.aggregation=auto means (token level)
    advantage: str = "grpo"  # what rollout.advantage=auto means (qarl_jax.rl.advantages)


OBJECTIVES: dict[str, Objective] = {}


def register(name: str, *, level: str, eps: tuple[float, float], **defaults) -> Callable:
    """Decorator: register ``fn`` as objective ``name`` (see :class:`Objective` for the rest)."""
    if level not in ("token", "sequence"):
        raise ValueError(f"objective {name!r}: level must be 'token' or 'sequence', got {level!r}")

    def add(fn: Callable) -> Callable:
        if name in OBJECTIVES:
            raise ValueError(f"objective {name!r} is already registered")
        OBJECTIVES[name] = Objective(fn, level, eps, **defaults)
        return fn

    return add


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """The loss. Defaults are TBPO's (QaRL); the conventions the ecosystem disagrees on are options.

    Attributes:
      name: a registered objective: tbpo | gspo | grpo | dr_grpo | dual_clip_ppo.
      eps_low, eps_high: the PPO clip range [1 - eps_low, 1 + eps_high] of r (token level) or rho
        (sequence level); None: the objective's own (3e-4 / 4e-4 sequence level, GSPO's scale;
        0.2 / 0.2 token level; DAPO's clip-higher is eps_high = 0.28).
      eps_neg_low, eps_neg_high: TBPO's trust band for A < 0: inside [1 - eps_neg_low,
        1 + eps_neg_high] the term is rho * A, outside it the sequence is dropped (mask 0).
      dual_clip: c of dual-clip PPO, the lower bound c * A on the term for A < 0 (> 1).
      correction: the mismatch correction w: auto (tbpo: tis, others: none) | none | tis (min(w, C))
        | mis (w if it lies in [correction_low, C], else 0: the unit is rejected).
      correction_level: token (w per token) | sequence (one w per response; the sequence-level
        objectives need it).
      correction_cap: C.
      correction_low: MIS's lower bound; None: 1 / C (verl's default); 0: reject only above C.
      correction_seq_weight: the sequence weight from the token weights: geometric (exp of the
        mean log weight, length-normalised, the method note's) | product (exp of the sum, verl's
        current "sequence" level).
      mis_normaliser: where MIS-rejected units count: all (in every denominator, their term 0: the
        step shrinks as rejections grow) | kept (removed from the loss's mask, as verl does).
      aggregation: auto (the objective's) | token_mean (sum / tokens of the minibatch) |
        seq_mean_token_mean (mean over sequences of per-sequence token means) | seq_mean_token_sum
        (sum / (sequences x loss_norm), Dr. GRPO's). Token-level objectives only: a sequence-level
        objective has one term per sequence, averaged over sequences (its KL and entropy terms are
        token means).
      loss_norm: seq_mean_token_sum's constant per-sequence normaliser; None: the batch's length T
        (the run loop sets rollout.max_len, so cutting a batch's padding does not change it).
      log_ratio_clamp: |log r|, |log rho| and |log w| are clamped to this before exp.
      overlong_filter: DAPO's overlong filtering: responses the rollout truncated at the length
        limit (the batch's ``truncated``) leave the loss and every denominator.
      kl_coef, kl_estimator: a KL(pi_theta || pi_ref) penalty to the initial weights, estimated by
        k1 (log pi_theta / pi_ref) or k3 (r - log r - 1 with r = pi_ref / pi_theta).
      entropy_coef: an entropy bonus.
    """

    name: str = "tbpo"
    eps_low: float | None = None
    eps_high: float | None = None
    eps_neg_low: float = 3e-4
    eps_neg_high: float = 7e-4
    dual_clip: float = 3.0
    correction: str = "auto"
    correction_level: str = "sequence"
    correction_cap: float = 2.0
    correction_low: float | None = None
    correction_seq_weight: str = "geometric"
    mis_normaliser: str = "all"
    aggregation: str = "auto"
    loss_norm: float | None = None
    log_ratio_clamp: float = 20.0
    overlong_filter: bool = False
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0

    def __post_init__(self):
        checks = [
            ("name", self.name, tuple(OBJECTIVES)),
            ("correction", self.correction, ("auto",) + CORRECTIONS),
            ("correction_level", self.correction_level, ("token", "sequence")),
            ("correction_seq_weight", self.correction_seq_weight, ("geometric", "product")),
            ("mis_normaliser", self.mis_normaliser, ("all", "kept")),
            ("aggregation", self.aggregation, ("auto",) + AGGREGATIONS),
            ("kl_estimator", self.kl_estimator, ("k1", "k3")),
        ]
        for field, value, allowed in checks:
            if value not in allowed:
                raise ValueError(f"objective.{field}={value!r}; expected one of {allowed}")
        sequence_level = self.spec.level == "sequence"
        if sequence_level and self.resolved_correction != "none" and self.correction_level != "sequence":
            raise ValueError(f"{self.name} is sequence-level: its mismatch correction must be sequence-level")
        if sequence_level and self.aggregation != "auto":
            raise ValueError(
                f"objective.aggregation={self.aggregation!r} aggregates tokens, but objective.name="
                f"{self.name!r} is sequence-level (one term per sequence, averaged over sequences): "
                "leave objective.aggregation at 'auto'"
            )
        if self.correction_cap <= 0 or self.dual_clip <= 1:
            raise ValueError("correction_cap must be > 0 and dual_clip > 1")
        mis = self.resolved_correction == "mis"
        if self.correction_low is not None and not (mis and 0 <= self.correction_low < self.correction_cap):
            raise ValueError(
                f"objective.correction_low={self.correction_low} needs objective.correction='mis' and a "
                f"value in [0, correction_cap={self.correction_cap})"
            )
        if self.mis_normaliser == "kept" and not mis:
            raise ValueError("objective.mis_normaliser='kept' needs objective.correction='mis'")
        if self.correction_seq_weight != "geometric" and self.correction_level != "sequence":
            raise ValueError("objective.correction_seq_weight applies to correction_level='sequence' only")
        if self.log_ratio_clamp <= 0 or (self.loss_norm is not None and self.loss_norm <= 0):
            raise ValueError(
                f"objective.log_ratio_clamp ({self.log_ratio_clamp}) and loss_norm ({self.loss_norm}) "
                "must be > 0"
            )
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(
                f"kl_coef and entropy_coef must be >= 0, got {self.kl_coef}, {self.entropy_coef}"
            )

    @property
    def spec(self) -> Objective:
        return OBJECTIVES[self.name]

    @property
    def eps(self) -> tuple[float, float]:
        low, high = self.spec.eps
        return (
            low if self.eps_low is None else self.eps_low,
            high if self.eps_high is None else self.eps_high,
        )

    @property
    def resolved_correction(self) -> str:
        return self.spec.correction if self.correction == "auto" else self.correction

    @property
    def resolved_aggregation(self) -> str:
        """The aggregation of the token terms (policy terms of token-level objectives, KL, entropy)."""
        if self.spec.level == "sequence":
            return "token_mean"
        return self.spec.aggregation if self.aggregation == "auto" else self.aggregation

    @property
    def mis_low(self) -> float:
        return 1.0 / self.correction_cap if self.correction_low is None else self.correction_low


# ---- the shared pieces -----------------------------------------------------------------------------


def safe_log_ratio(num: BatchArray, den: BatchArray, mask: jax.Array, clamp: float) -> jax.Array:
    """log(num / den) of log-probs where ``mask``, 0 elsewhere, in [-clamp, clamp]: selected before
    any exp, so whatever padding holds never reaches the loss or its gradient."""
    return jnp.clip(jnp.where(mask > 0, num - den, 0.0), -clamp, clamp)


def row_lengths(mask: jax.Array) -> jax.Array:
    """Tokens per row, at least 1 (an empty row divides nothing by zero)."""
    return jnp.maximum(jnp.sum(mask, axis=1), 1.0)


def nonempty_rows(mask: jax.Array) -> jax.Array:
    return jnp.any(mask > 0, axis=1).astype(jnp.float32)


def sequence_log_ratio(log_ratio: jax.Array, mask: jax.Array, kind: str = "geometric") -> jax.Array:
    """[B, T] token log-ratios (0 off the mask) -> [B]: their mean (geometric) or sum (product)."""
    total = jnp.sum(log_ratio, axis=1)
    return total / row_lengths(mask) if kind == "geometric" else total


def ppo_clip(ratio: jax.Array, adv: jax.Array, eps_low: float, eps_high: float):
    """PPO's min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A) and where the clip binds."""
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    return jnp.minimum(ratio * adv, clipped * adv), ratio * adv > clipped * adv


def dual_clip_bound(surrogate: jax.Array, adv: jax.Array, c: float):
    """Dual-clip: for A < 0 the term is at least c * A (a huge ratio cannot make it unbounded)."""
    active = (adv < 0) & (surrogate < c * adv)
    return jnp.where(active, c * adv, surrogate), active


def trust_band(rho: jax.Array, adv: jax.Array, low: float, high: float):
    """TBPO for A < 0: rho * A inside [1 - low, 1 + high], 0 (the sequence dropped) outside."""
    inside = (rho >= 1.0 - low) & (rho <= 1.0 + high)
    return jnp.where(inside, rho * adv, 0.0), inside


class Correction(NamedTuple):
    """The mismatch correction, per token [B, T] or per sequence [B]."""

    weight: jax.Array  # what multiplies the surrogate (stop-gradient)
    raw: jax.Array  # the importance weight w = pi_old / pi_rollout before truncation or rejection
    changed: jax.Array  # 1 where truncation or rejection changed it
    keep: jax.Array  # 0 where MIS rejected the unit


def mismatch_correction(old_logp, rollout_logp, mask, cfg: ObjectiveConfig) -> Correction:
    """TIS truncates w at C; MIS keeps w inside [correction_low, C] and rejects the rest (weight 0)."""
    log_w = safe_log_ratio(old_logp, rollout_logp, mask, cfg.log_ratio_clamp)
    if cfg.correction_level == "sequence":
        log_w = sequence_log_ratio(log_w, mask, cfg.correction_seq_weight)
        log_w = jnp.clip(log_w, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    w = jax.lax.stop_gradient(jnp.exp(log_w))
    kind, cap = cfg.resolved_correction, cfg.correction_cap
    ones, zeros = jnp.ones_like(w), jnp.zeros_like(w)
    if kind == "none":
        return Correction(ones, w, zeros, ones)
    if kind == "tis":
        truncated = jnp.minimum(w, cap)
        return Correction(truncated, w, (truncated != w).astype(jnp.float32), ones)
    keep = (w <= cap) & (w >= cfg.mis_low)
    return Correction(jnp.where(keep, w, 0.0), w, (~keep).astype(jnp.float32), keep.astype(jnp.float32))


def loss_masks(batch: RolloutBatch, cfg: ObjectiveConfig) -> tuple[jax.Array, jax.Array, Correction]:
    """(response mask the loss sees, the mask it counts, the correction). The first drops truncated
    responses under ``overlong_filter``; the second also drops MIS-rejected units under
    ``mis_normaliser=kept``."""
    if batch.old_logp is None:
        raise ValueError("the batch has no old_logp: the loss's ratios need the old policy's log-probs")
    mask = jnp.asarray(batch.mask, jnp.float32)
    if cfg.overlong_filter:
        if batch.truncated is None:
            raise ValueError("objective.overlong_filter needs the batch's truncated flags")
        mask = mask * (1.0 - batch.truncated.astype(jnp.float32))[:, None]
    old, rollout = jax.lax.stop_gradient(batch.old_logp), jax.lax.stop_gradient(batch.rollout_logp)
    correction = mismatch_correction(old, rollout, mask, cfg)
    counted = mask
    if cfg.mis_normaliser == "kept":
        keep = correction.keep if cfg.correction_level == "token" else correction.keep[:, None]
        counted = mask * keep
    return mask, counted, correction


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Normalisers:
    """The loss's denominators, counted once over the whole minibatch (each at least 1)."""

    tokens: jax.Array  # response tokens the loss counts
    sequences: jax.Array  # non-empty rows the loss counts
    weights: jax.Array  # units of the mismatch weight statistics (tokens or rows, before MIS)

    @classmethod
    def of(cls, mask: jax.Array, weight_units: jax.Array | None = None) -> Normalisers:
        weight_units = mask if weight_units is None else weight_units
        count = lambda x: jnp.maximum(jnp.sum(x), 1.0)
        return cls(count(mask), count(nonempty_rows(mask)), count(weight_units))


def normalisers(batch: RolloutBatch, cfg: ObjectiveConfig) -> Normalisers:
    """The denominators of ``cfg``'s loss over ``batch`` (the Trainer: over the whole minibatch)."""
    mask, counted, _ = loss_masks(batch, cfg)
    return Normalisers.of(counted, mask if cfg.correction_level == "token" else nonempty_rows(mask))


def aggregate(
    values: jax.Array,
    mask: jax.Array,
    mode: str,
    norms: Normalisers | None = None,
    loss_norm: float | None = None,
) -> jax.Array:
    """Reduce per-token values [B, T] over the mask to a scalar, over ``norms`` (default: counted
    over ``mask``); values off the mask are never read."""
    norms = Normalisers.of(mask) if norms is None else norms
    values = jnp.where(mask > 0, values, 0.0)
    if mode == "token_mean":
        return jnp.sum(values) / norms.tokens
    if mode == "seq_mean_token_mean":
        return jnp.sum(jnp.sum(values, axis=1) / row_lengths(mask)) / norms.sequences
    if mode == "seq_mean_token_sum":
        return jnp.sum(values) / (norms.sequences * (mask.shape[1] if loss_norm is None else loss_norm))
    raise ValueError(f"unknown aggregation {mode!r}; expected one of {AGGREGATIONS}")


# ---- the objectives --------------------------------------------------------------------------------


@register("grpo", level="token", eps=(0.2, 0.2))
def grpo(log_ratio, adv, cfg: ObjectiveConfig):
    """GRPO: PPO's clipped surrogate per token, min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)."""
    surrogate, clipped = ppo_clip(jnp.exp(log_ratio), adv, *cfg.eps)
    return surrogate, {"clip_frac": clipped}


@register("dr_grpo", level="token", eps=(0.2, 0.2), aggregation="seq_mean_token_sum", advantage="dr_grpo")
def dr_grpo(log_ratio, adv, cfg: ObjectiveConfig):
    """Dr. GRPO: GRPO's surrogate over a constant normaliser (no length normalisation) with
    mean-only advantages (no std normalisation)."""
    return grpo(log_ratio, adv, cfg)


@register("dual_clip_ppo", level="token", eps=(0.2, 0.2))
def dual_clip_ppo(log_ratio, adv, cfg: ObjectiveConfig):
    """Dual-clip PPO: GRPO's surrogate, bounded below by c * A for A < 0."""
    surrogate, flags = grpo(log_ratio, adv, cfg)
    surrogate, bound = dual_clip_bound(surrogate, adv, cfg.dual_clip)
    return surrogate, {**flags, "dual_clip_frac": bound}


@register("gspo", level="sequence", eps=(3e-4, 4e-4))
def gspo(log_rho, adv, cfg: ObjectiveConfig):
    """GSPO: PPO's clip on the sequence ratio rho, both signs of A."""
    surrogate, clipped = ppo_clip(jnp.exp(log_rho), adv, *cfg.eps)
    return surrogate, {"clip_frac": clipped}


@register("tbpo", level="sequence", eps=(3e-4, 4e-4), correction="tis")
def tbpo(log_rho, adv, cfg: ObjectiveConfig):
    """TBPO (QaRL): for A >= 0, min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A); for A < 0 the
    trust band, so an error-token sequence with an extreme ratio leaves the update instead of
    dominating it. The loop multiplies by the truncated sequence weight min(w, C) (TIS)."""
    rho = jnp.exp(log_rho)
    positive = adv >= 0
    clipped_term, clipped = ppo_clip(rho, adv, *cfg.eps)
    band_term, inside = trust_band(rho, adv, cfg.eps_neg_low, cfg.eps_neg_high)
    surrogate = jnp.where(positive, clipped_term, band_term)
    return surrogate, {"clip_frac": positive & clipped, "band_mask_frac": ~positive & ~inside}


# ---- the loss --------------------------------------------------------------------------------------


def compute_loss(
    logp: jax.Array,
    batch: RolloutBatch,
    cfg: ObjectiveConfig,
    norms: Normalisers | None = None,
    entropy: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Loss to minimise and its diagnostics: ``logp`` [B, T] the current policy's (differentiated),
    the rest from ``batch`` (``old_logp`` required, ``ref_logp`` for the KL term), ``entropy``
    [B, T] for the entropy term. Every sum is over ``batch`` and every denominator from ``norms``,
    so the losses and metrics of a minibatch's micro-batches add up to the minibatch's (the
    :data:`EXTREMA` combine by max / min)."""
    spec = cfg.spec
    norms = normalisers(batch, cfg) if norms is None else norms
    mask, counted, correction = loss_masks(batch, cfg)
    assert batch.old_logp is not None  # loss_masks raised otherwise
    old = jax.lax.stop_gradient(batch.old_logp)
    adv = jax.lax.stop_gradient(batch.advantages.astype(jnp.float32))
    clamp = cfg.log_ratio_clamp
    log_ratio = safe_log_ratio(logp, old, counted, clamp)
    if spec.level == "sequence":
        log_ratio = jnp.clip(sequence_log_ratio(log_ratio, counted), -clamp, clamp)
        units, count = nonempty_rows(counted), norms.sequences
        surrogate, flags = spec.fn(log_ratio, adv, cfg)
        weight = correction.weight if cfg.correction_level == "sequence" else 1.0  # token: only "none"
        policy_loss = -jnp.sum(jnp.where(units > 0, surrogate * weight, 0.0)) / count
    else:
        units, count = counted, norms.tokens
        weight = correction.weight if cfg.correction_level == "token" else correction.weight[:, None]
        surrogate, flags = spec.fn(log_ratio, adv[:, None], cfg)
        policy_loss = aggregate(-surrogate * weight, counted, cfg.resolved_aggregation, norms, cfg.loss_norm)
    metrics = {name: jnp.sum(jnp.where(units > 0, flag, False)) / count for name, flag in flags.items()}

    loss = policy_loss
    term = lambda v: aggregate(v, counted, cfg.resolved_aggregation, norms, cfg.loss_norm)
    if batch.ref_logp is not None and cfg.kl_coef:
        log_r = safe_log_ratio(jax.lax.stop_gradient(batch.ref_logp), logp, counted, clamp)
        metrics["kl_ref"] = term(-log_r if cfg.kl_estimator == "k1" else jnp.exp(log_r) - log_r - 1.0)
        loss = loss + cfg.kl_coef * metrics["kl_ref"]
    if entropy is not None:
        metrics["entropy"] = term(entropy)
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * metrics["entropy"]

    big = jnp.finfo(jnp.float32).max
    ratio = jnp.exp(log_ratio)
    weight_units = mask if cfg.correction_level == "token" else nonempty_rows(mask)
    on_units, on_weights = units > 0, weight_units > 0
    metrics.update(
        policy_loss=policy_loss,
        ratio_mean=jnp.sum(jnp.where(on_units, ratio, 0.0)) / count,
        ratio_max=jnp.max(jnp.where(on_units, ratio, -big)),
        ratio_min=jnp.min(jnp.where(on_units, ratio, big)),
        is_weight_mean=jnp.sum(jnp.where(on_weights, correction.raw, 0.0)) / norms.weights,
        is_weight_max=jnp.max(jnp.where(on_weights, correction.raw, -big)),
        correction_frac=jnp.sum(jnp.where(on_weights, correction.changed, 0.0)) / norms.weights,
    )
    return loss, metrics
