"""The QaRL training step: old log-probs, minibatch policy-gradient updates, the NaN guard.

One rollout batch (one sequence per row, padded) gets its old-policy log-probs pi_old, then is split
into ``num_minibatches`` optimizer updates for ``ppo_epochs`` epochs, each accumulating gradients
over ``micro_batches``. Where pi_old comes from is ``TrainConfig.old_logprobs``:

  rollout    the engine's own log-probs. In aligned mode the training forward is the rollout's
             kernels on the rollout's weights, so scoring the batch again would return these very
             bits (the alignment tests prove it): the forward is skipped. The first update's forward
             runs at those weights, so it re-scores its minibatch (a random 1 / num_minibatches of
             the batch) for free, and its statistics are the step's alignment check.
  recompute  one more forward over the whole batch (the paper's baseline, and naive mode's only
             choice: its training forward is not the rollout's).
  auto       rollout when aligned, recompute otherwise (the default).

The master weights stay float; the forward is the one ``qarl_jax.rl.logprobs`` defines for the
model's spec (aligned: quantized kernels with a straight-through backward; naive: full precision).

Scoring runs in chunks of the update's micro-batch rows, so one chunk's logits and f32 log-softmax
are alive at a time, not the whole batch's (the memory peak otherwise); every kernel is
row-invariant, so the chunking changes no bit. The chunks go through the layers layer-major: each
layer's FSDP weights are gathered once a pass, not once a chunk (``qarl_jax.models.layer_major``).
With ``objective.kl_coef`` the state also holds a frozen copy of the initial weights, the
reference, scored the same way once per rollout batch for the loss's KL term; without it there is
no copy and no reference scoring.

Metrics, one flat dict per update, all computed on device. Per update: the objective's
(``loss``, ``policy_loss``, ``clip_frac``, ``band_mask_frac``, ``ratio_*``, ``is_weight_*``,
``correction_frac``, ``entropy`` when ``entropy_coef`` is set, ``kl_ref`` when ``kl_coef`` is),
``grad_norm``, ``update_ratio`` (|update| / |weights|), ``skipped`` (1: not applied, the loss or
gradient not finite or no response token in the minibatch's loss) and, with
``error_token_grad_share``, ``error_grad_share``. The loss's denominators are counted over the
whole minibatch before its micro-batches (:mod:`qarl_jax.rl.objectives`), whose losses, gradients
and metrics then add up (the extrema combine by max / min): the update is the same function of the
minibatch for any ``micro_batches`` and mesh. Per rollout batch (repeated in each of its updates'
dicts): ``response_len_mean``/``_max``, ``truncation_rate`` (when the batch holds ``truncated``), the
error-token fractions ``repetition_frac``, ``low_prob_token_frac``, ``error_seq_frac``
(:mod:`qarl_jax.rl.metrics` defines the rules) and, from a forward at the rollout's weights (the
old-log-prob forward's whole batch, or the first update's minibatch), ``policy_entropy``, the
alignment statistics ``mismatch_*`` (training vs rollout log-probs) and the ``implausible_*``
fractions (sampled tokens the training forward finds near impossible).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils

from qarl_jax import sharding
from qarl_jax.models import Qwen3ForCausalLM
from qarl_jax.rl import metrics as rl_metrics
from qarl_jax.rl.batch import RolloutBatch
from qarl_jax.rl.logprobs import policy_logprobs, policy_logprobs_and_entropy, scores_by_chunks
from qarl_jax.rl.objectives import (
    EXTREMA,
    Normalisers,
    ObjectiveConfig,
    compute_loss,
    loss_masks,
    normalisers,
)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adamw"  # adamw | muon (the paper's optimizer; Adam for non-matrix params)
    learning_rate: float = 1e-5
    warmup_steps: int = 0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    grad_clip: float = 1.0  # global-norm clip; 0 disables

    def __post_init__(self):
        if self.name not in ("adamw", "muon"):
            raise ValueError(f"optimizer.name={self.name!r}; expected 'adamw' or 'muon'")
        if self.learning_rate <= 0:
            raise ValueError(f"optimizer.learning_rate must be positive, got {self.learning_rate}")


OLD_LOGPROBS = ("auto", "rollout", "recompute")
# the rollout batch's metrics that need a forward: with old_logprobs=rollout, the first update's
SCORED_METRICS = (
    "policy_entropy",
    "mismatch_frac_bitwise_equal",
    "mismatch_max_abs_diff",
    "mismatch_mean_abs_diff",
    "mismatch_kl_k3",
    "implausible_token_frac",
    "implausible_seq_frac",
)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    num_minibatches: int = 1  # optimizer updates per rollout batch and epoch
    ppo_epochs: int = 1
    micro_batches: int = 1  # gradient accumulation inside one update
    temperature: float = 1.0  # the rollout's sampling temperature, applied to the logits in the loss
    remat: bool = False
    old_logprobs: str = "auto"  # auto | rollout | recompute: where pi_old comes from (module docstring)
    # the run loop cuts each rollout batch to the shortest of this many equal steps of
    # rollout.max_len that holds its longest row (1: always max_len); at most this many shapes compile
    length_buckets: int = 8
    # debug: the training forward must reproduce the rollout's log-probs bitwise, else raise (the whole
    # batch's with old_logprobs=recompute, the first update's minibatch's with rollout)
    assert_aligned: bool = False
    # error tokens (rules in qarl_jax.rl.metrics)
    low_prob_threshold: float = 1e-3  # a sampled token with rollout probability below this
    repeat_max_ngram: int = 4  # a response ending in an n-gram loop, n <= this, ...
    repeat_min_repeats: int = 3  # ... repeated at least this many times ...
    repeat_min_tokens: int = 12  # ... over at least this many tokens
    error_token_grad_share: bool = False  # one more backward per micro-batch for error_grad_share

    def __post_init__(self):
        counts = (
            "num_minibatches",
            "ppo_epochs",
            "micro_batches",
            "length_buckets",
            "repeat_max_ngram",
            "repeat_min_repeats",
        )
        for name in counts:
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature <= 0:
            raise ValueError(f"train.temperature must be positive, got {self.temperature}")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"train.old_logprobs must be one of {OLD_LOGPROBS}, got {self.old_logprobs!r}")
        if not 0 < self.low_prob_threshold < 1:
            raise ValueError(f"train.low_prob_threshold must be in (0, 1), got {self.low_prob_threshold}")

    def old_logprobs_from_rollout(self, quant_mode: str) -> bool:
        """Whether pi_old is the rollout's log-probs for a model in ``quant_mode`` (``auto``: when
        aligned); ``rollout`` in a mode whose training forward is not the rollout's is an error."""
        aligned = quant_mode == "aligned"
        if self.old_logprobs == "rollout" and not aligned:
            raise ValueError(
                f"train.old_logprobs=rollout needs the rollout's forward in training, but quant.mode="
                f"{quant_mode!r} trains another one: use recompute (or auto)"
            )
        return self.old_logprobs == "rollout" or (self.old_logprobs == "auto" and aligned)

    def error_flags(self, batch: RolloutBatch) -> dict[str, jax.Array]:
        """:func:`qarl_jax.rl.metrics.error_sequences` with this config's rules."""
        return rl_metrics.error_sequences(
            jnp.asarray(batch.targets),  # already jax arrays under jit, where this runs
            jnp.asarray(batch.mask),
            jnp.asarray(batch.rollout_logp),
            self.low_prob_threshold,
            self.repeat_max_ngram,
            self.repeat_min_repeats,
            self.repeat_min_tokens,
        )


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    lr = cfg.learning_rate
    if cfg.warmup_steps:
        lr = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
    if cfg.name == "adamw":
        opt = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay)
    else:
        opt = optax.contrib.muon(lr, weight_decay=cfg.weight_decay, adam_b1=cfg.b1, adam_b2=cfg.b2)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), opt) if cfg.grad_clip else opt


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    params: dict
    opt_state: optax.OptState
    step: jax.Array
    ref_params: dict | None = None  # the initial weights, never updated: the KL reference (kl_coef only)


def _split(batch: RolloutBatch, parts: int) -> RolloutBatch:
    """[N, ...] -> [parts, N / parts, ...] for every array of the batch."""
    n = batch.num_rows
    if n % parts:
        raise ValueError(f"a batch of {n} sequences does not split into {parts} equal parts")
    return batch.map(lambda v: v.reshape(parts, n // parts, *v.shape[1:]))


GradsFn = Callable[[object, RolloutBatch, Normalisers], tuple]


def accumulate(grads: GradsFn, params, batch: RolloutBatch, parts: int, norms: Normalisers) -> tuple:
    """``grads(params, micro_batch, norms) -> ((loss, metrics, gradients, extra gradients or None),
    rows)`` over the ``parts`` micro-batches of ``batch``, one at a time (the memory of one): the
    first element added up over the parts, ``rows`` (a pytree of per-row arrays, or None) put back
    in the batch's row order. With ``norms`` counted over the whole batch every term is already its
    share of the batch's, so the sums are the batch's loss and gradients; the metrics in
    ``EXTREMA`` combine by max/min. Returns (summed, rows)."""
    micro = _split(batch, parts)
    big = jnp.finfo(jnp.float32).max
    grads = jax.jit(grads)  # one trace (of the whole forward and backward) serves both uses below

    def combine(total, out):
        (loss, metrics, *gs), (loss_b, metrics_b, *gs_b) = total, out
        merged = {k: EXTREMA.get(k, jnp.add)(v, metrics_b[k]) for k, v in metrics.items()}
        return (loss + loss_b, merged, *jax.tree.map(jnp.add, gs, gs_b))

    def start(s: jax.ShapeDtypeStruct, fill=0.0):
        return jnp.full(s.shape, fill, s.dtype)

    shapes = jax.eval_shape(grads, params, jax.tree.map(lambda v: v[0], micro), norms)[0]
    loss, metrics, *gs = jax.tree.map(start, shapes)
    for key, op in EXTREMA.items():  # the identities of max and min
        if key in metrics:
            metrics[key] = start(shapes[1][key], -big if op is jnp.maximum else big)

    def body(total, mb):
        summed, rows = grads(params, mb, norms)
        return combine(total, summed), rows

    total, rows = jax.lax.scan(body, (loss, metrics, *gs), micro)
    return total, jax.tree.map(lambda v: v.reshape(batch.num_rows, *v.shape[2:]), rows)


def _host(x) -> np.ndarray:
    """All of ``x`` on this host (all-gathered when it spans other processes' devices: every
    process calls this together)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)


def optimizer_shardings(tx: optax.GradientTransformation, params, mesh: jax.sharding.Mesh):
    """Shardings of ``tx.init(params)``: a leaf whose dict-key path ends in a parameter's, with its
    shape (a moment), like that parameter; the rest (step counts, Muon's masked-out slots) replicated.
    ``jax.jit(tx.init)`` alone leaves the zeros' layout to XLA, which replicates them (they read no
    input's data): measured, every device held the whole AdamW state."""
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def names(path) -> tuple:
        return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))

    like = {names(path): p for path, p in jax.tree_util.tree_leaves_with_path(params)}

    def pick(path, leaf):  # the parameter path may sit under the optimizer's own keys ("adam")
        n = names(path)
        p = next((like[n[i:]] for i in range(len(n)) if n[i:] in like), None)
        return p.sharding if p is not None and p.shape == leaf.shape else rep

    return jax.tree_util.tree_map_with_path(pick, jax.eval_shape(tx.init, params))


class Trainer:
    """Owns the jitted functions of the training step for one model, objective and optimizer."""

    def __init__(
        self,
        model: Qwen3ForCausalLM,
        objective: ObjectiveConfig,
        train: TrainConfig,
        optimizer: OptimizerConfig,
        mesh: jax.sharding.Mesh | None = None,
        rules=sharding.DEFAULT_RULES,
    ):
        self.model, self.objective, self.train, self.mesh, self.rules = model, objective, train, mesh, rules
        self.tx = make_optimizer(optimizer)
        # the error sequences' share of the gradient: their policy-gradient terms alone
        self._pg_objective = dataclasses.replace(objective, kl_coef=0.0, entropy_coef=0.0)
        self._kl = bool(objective.kl_coef)
        # unquantized, the training forward is the rollout's too (the same kernels on the same weights)
        self.aligned = model.quant is None or model.quant.mode == "aligned"  # training forward = rollout's
        self._old_from_rollout = train.old_logprobs_from_rollout("aligned" if self.aligned else "naive")
        self._batch_metrics = jax.jit(self._batch_metrics_impl)
        self._old_logprobs = jax.jit(self._old_logprobs_impl)
        self._behaviour_check = jax.jit(self._behaviour_check_impl)
        self._ref_logprobs = jax.jit(self._ref_logprobs_impl) if self._kl else None
        self._update = jax.jit(self._update_impl, donate_argnums=(0,))

    def _forward(self, params, batch: RolloutBatch) -> tuple[jax.Array, jax.Array | None]:
        """(log-probs, entropy or None): the entropy when the loss uses it or the first update
        measures it (old_logprobs=rollout)."""
        args = batch.forward_inputs()
        t, remat = self.train.temperature, self.train.remat
        if self.objective.entropy_coef:
            return policy_logprobs_and_entropy(self.model, params, *args, t, remat=remat)
        if self._old_from_rollout:  # measured, not differentiated: its backward never runs
            logp, entropy = policy_logprobs_and_entropy(self.model, params, *args, t, remat=remat)
            return logp, jax.lax.stop_gradient(entropy)
        return policy_logprobs(self.model, params, *args, t, remat=remat), None

    @staticmethod
    def _loss(out, batch: RolloutBatch, objective: ObjectiveConfig, norms: Normalisers):
        logp, entropy = out
        return compute_loss(
            logp, batch, objective, norms, entropy=entropy if objective.entropy_coef else None
        )

    def _grads(self, params, batch: RolloutBatch, norms: Normalisers):
        """Loss, metrics and gradients of one micro-batch (over the minibatch's ``norms``); with
        ``error_token_grad_share`` also the gradient of the error sequences' policy-gradient terms
        alone (their advantages kept, the others zeroed: every objective's term is 0 with its
        gradient at A = 0, and the normalisers do not change), pulled back through the same
        forward: one more backward. Second: the forward's (log-probs, entropy) with
        old_logprobs=rollout (the first update's are the alignment check), else None."""
        out, pullback = jax.vjp(lambda p: self._forward(p, batch), params)
        loss_and_grad = jax.value_and_grad(self._loss, has_aux=True)
        (loss, metrics), d_out = loss_and_grad(out, batch, self.objective, norms)
        (grads,) = pullback(d_out)
        rows = jax.lax.stop_gradient(out) if self._old_from_rollout else None
        if not self.train.error_token_grad_share:
            return (loss, metrics, grads, None), rows
        error = self.train.error_flags(batch)["error"].astype(jnp.float32)
        flagged = batch.replace(advantages=batch.advantages * error)
        d_flagged, _ = jax.grad(self._loss, has_aux=True)(out, flagged, self._pg_objective, norms)
        return (loss, metrics, grads, pullback(d_flagged)[0]), rows

    def _context(self):
        return sharding.activate(self.mesh, self.rules) if self.mesh is not None else contextlib.nullcontext()

    def init_state(self, params) -> TrainState:
        """A fresh state on a copy of ``params`` (updates donate the state's buffers); with
        ``objective.kl_coef`` a second copy is the reference."""
        with self._context():
            params = jax.tree.map(lambda x: x.copy(), params)
            ref = jax.tree.map(lambda x: x.copy(), params) if self._kl else None
            shardings = None if self.mesh is None else optimizer_shardings(self.tx, params, self.mesh)
            opt_state = jax.jit(self.tx.init, out_shardings=shardings)(params)
        return TrainState(params=params, opt_state=opt_state, step=jnp.zeros((), jnp.int32), ref_params=ref)

    def shard_batch(self, batch: RolloutBatch) -> RolloutBatch:
        """Place a host batch with its sequences split over the mesh's batch axes."""
        mesh = self.mesh
        if mesh is None:
            return batch.map(jnp.asarray)
        return batch.map(lambda v: jax.device_put(v, sharding.batch_sharding(mesh, np.ndim(v), self.rules)))

    def _score_rows(self, n: int) -> int:
        """Sequences per scoring forward: the update's micro-batch, which must split over the mesh's
        batch axes (a chunk that does not would be replicated on every device)."""
        parts = self.train.num_minibatches * self.train.micro_batches
        if n % parts:
            raise ValueError(
                f"a rollout batch of {n} sequences does not split into train.num_minibatches x "
                f"train.micro_batches = {parts} micro-batches (old log-probs are scored per micro-batch)"
            )
        rows = n // parts
        ways = 1 if self.mesh is None else sharding.batch_ways(self.mesh, self.rules)
        if rows % ways:
            raise ValueError(
                f"micro-batches of {rows} sequences (scoring chunks) do not split over the {ways} devices "
                "of the mesh's batch axes"
            )
        return rows

    def _scored(self, params, batch: RolloutBatch, chunks: int | None = None, *, entropy: bool = True):
        """(log-probs, entropy or None) [N, T] of a forward-only pass over the batch in ``chunks``
        chunks of rows (default: of :meth:`_score_rows` rows), layer-major
        (:func:`qarl_jax.rl.logprobs.scores_by_chunks`: each layer's weights gathered once a pass,
        not once a chunk; the bits of scoring chunk after chunk)."""
        n = batch.num_rows
        chunks = chunks or n // self._score_rows(n)
        args = (*batch.forward_inputs(), self.train.temperature)
        return scores_by_chunks(self.model, params, *args, chunks=chunks, entropy=entropy)

    def _batch_metrics_impl(self, batch: RolloutBatch) -> dict:
        """The rollout batch's metrics that need no forward: response lengths, truncation, error tokens."""
        mask = jnp.asarray(batch.mask)  # already jax arrays under jit, where this runs
        truncated = None if batch.truncated is None else jnp.asarray(batch.truncated)
        return dict(
            **rl_metrics.response_length_stats(mask, truncated),
            **rl_metrics.error_token_stats(self.train.error_flags(batch), mask),
        )

    def _scored_metrics(self, logp: jax.Array, entropy: jax.Array, batch: RolloutBatch) -> dict:
        """The metrics of a forward over ``batch`` (:data:`SCORED_METRICS`) and its old log-probs."""
        mask = jnp.asarray(batch.mask)  # already jax arrays under jit, where this runs
        old = jax.lax.stop_gradient(logp) * mask
        return dict(
            policy_entropy=rl_metrics.entropy_mean(entropy, mask),
            **rl_metrics.mismatch_stats(old, jnp.asarray(batch.rollout_logp), mask),
            **rl_metrics.implausible_tokens(old, mask, self.train.low_prob_threshold),
        )

    def _old_logprobs_impl(self, params, batch):
        """Old log-probs and the rollout batch's metrics; the metrics over the reassembled batch, so
        they are those of one whole-batch forward, bit for bit."""
        logp, entropy = self._scored(params, batch)
        old = jax.lax.stop_gradient(logp) * batch.mask
        return old, {**self._scored_metrics(logp, entropy, batch), **self._batch_metrics_impl(batch)}

    def _behaviour_check_impl(self, frozen, batch):
        chunks = self.train.micro_batches  # the rows of one micro-batch at a time, as an update's
        logp, entropy = self._scored(frozen, batch, chunks)
        return self._scored_metrics(logp, entropy, batch)

    def behaviour_check(self, frozen, batch: RolloutBatch) -> dict[str, float]:
        """The alignment check of a batch rolled out by older weights (asynchronous rollouts): the
        :data:`SCORED_METRICS` of the training forward at those weights, ``frozen`` (the quantized
        tree the engine ran: the aligned forward reads it as it reads weights it quantizes itself,
        bit for bit), over the first minibatch's worth of rows, as the first update checks a batch
        of the current weights. Raises with ``train.assert_aligned`` on any differing bit."""
        if not self.aligned:
            raise ValueError("behaviour_check needs the aligned forward (the rollout's kernels in training)")
        rows = batch.num_rows // self.train.num_minibatches
        first = self.shard_batch(batch.map(_host).rows(np.arange(rows)))
        with self._context():
            scored = {k: float(v) for k, v in jax.device_get(self._behaviour_check(frozen, first)).items()}
        self._check_first_update_aligned(scored)
        return scored

    def _ref_logprobs_impl(self, ref_params, batch):
        # not masked: the loss's exp(ref - logp) stays finite on padding (0 there could overflow)
        return jax.lax.stop_gradient(self._scored(ref_params, batch, entropy=False)[0])

    def old_logprobs(self, params, batch: RolloutBatch) -> jax.Array:
        """Old-policy log-probs [N, T] (0 outside the mask)."""
        return self.old_logprobs_and_metrics(params, batch)[0]

    def old_logprobs_and_metrics(self, params, batch: RolloutBatch) -> tuple[jax.Array, dict]:
        """Old-policy log-probs [N, T] and the per-rollout-batch metrics (see the module doc)."""
        with self._context():
            return self._old_logprobs(params, batch)

    def ref_logprobs(self, state: TrainState, batch: RolloutBatch) -> jax.Array:
        """The reference policy's log-probs [N, T] (``objective.kl_coef`` only), scored like the old
        ones: at the initial weights bitwise equal to them on the response tokens."""
        if self._ref_logprobs is None:
            raise ValueError("reference log-probs exist only with objective.kl_coef set")
        if state.ref_params is None:
            raise ValueError("objective.kl_coef needs the reference weights: build the state with init_state")
        with self._context():
            return self._ref_logprobs(state.ref_params, batch)

    def _update_impl(self, state: TrainState, batch: RolloutBatch):
        norms = normalisers(batch, self.objective)  # over the whole minibatch, before the split
        total, rows = accumulate(self._grads, state.params, batch, self.train.micro_batches, norms)
        loss, metrics, grads, flagged_grads = total
        if rows is not None:  # old_logprobs=rollout: what this forward says of the rollout's log-probs
            logp, entropy = rows
            metrics = {**metrics, **self._scored_metrics(logp, entropy, batch)}

        grad_norm, weight_norm = rl_metrics.tree_norm(grads), rl_metrics.tree_norm(state.params)
        # a minibatch without a token in the loss has nothing to learn, yet its zero gradient would
        # still move the weights through the optimizer's momentum
        learns = jnp.any(loss_masks(batch, self.objective)[1] > 0)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & learns
        updates, new_opt = self.tx.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        new_state = dataclasses.replace(  # the reference (if any) passes through
            state,
            params=keep(new_params, state.params),
            opt_state=keep(new_opt, state.opt_state),
            step=state.step + finite.astype(jnp.int32),
        )
        metrics = dict(
            metrics,
            loss=loss,
            grad_norm=grad_norm,
            update_ratio=rl_metrics.tree_norm(updates) / jnp.maximum(weight_norm, 1e-12),
            skipped=1.0 - finite.astype(jnp.float32),
        )
        if flagged_grads is not None:
            metrics["error_grad_share"] = rl_metrics.tree_norm(flagged_grads) / jnp.maximum(grad_norm, 1e-30)
        return new_state, metrics

    def update(self, state: TrainState, batch: RolloutBatch) -> tuple[TrainState, dict]:
        """One optimizer update on one minibatch (which must hold ``old_logp``, and ``ref_logp`` with
        ``objective.kl_coef``: without it the loss would silently drop the KL term)."""
        if batch.old_logp is None:
            raise ValueError("the minibatch has no old_logp (see old_logprobs)")
        if self._kl and batch.ref_logp is None:
            raise ValueError("objective.kl_coef is set but the minibatch has no ref_logp (see ref_logprobs)")
        with self._context():
            return self._update(state, batch)

    def train_on_rollouts(
        self,
        state: TrainState,
        batch: RolloutBatch,
        rng: np.random.Generator | None = None,
        stale: bool = False,
    ):
        """Old log-probs (:data:`OLD_LOGPROBS`), then ppo_epochs x num_minibatches updates
        (minibatches reshuffled per epoch when ``rng`` is given). Returns the new state and the list
        of per-update metrics (each with the rollout batch's metrics too; with old_logprobs=rollout
        the :data:`SCORED_METRICS` among them are the first update's, over its minibatch).

        ``stale``: older weights rolled the batch out (asynchronous rollouts). pi_old is then the
        behaviour policy with old_logprobs=rollout (its log-probs are the engine's, exactly, in
        aligned mode) and the proximal policy, the current weights, with recompute (decoupled PPO:
        the correction weight w = pi_prox / pi_behaviour, capped, carries the staleness). Either way
        a forward at the current weights compares with the behaviour's log-probs: that is the
        staleness, reported as ``staleness_*`` in place of ``mismatch_*`` (the mismatch proper is
        :meth:`behaviour_check`'s)."""
        if not isinstance(batch, RolloutBatch):
            raise TypeError(f"train_on_rollouts takes a RolloutBatch (qarl_jax.rl.batch), got {type(batch)}")
        sharded = self.shard_batch(batch)
        if self._old_from_rollout:
            old_logp = sharded.rollout_logp * sharded.mask  # 0 off the mask, as the forward's
            with self._context():
                rollout_metrics = self._batch_metrics(sharded)
        else:
            old_logp, rollout_metrics = self.old_logprobs_and_metrics(state.params, sharded)
        batch = batch.replace(old_logp=old_logp)
        if self._kl:
            batch = batch.replace(ref_logp=self.ref_logprobs(state, sharded))
        batch = batch.map(_host)  # minibatches are cut on the host
        if self.train.assert_aligned and not self._old_from_rollout and not stale:
            mask = np.asarray(batch.mask) > 0
            old, rollout = np.asarray(batch.old_logp)[mask], np.asarray(batch.rollout_logp)[mask]
            if not np.array_equal(old, rollout):
                raise AssertionError(
                    f"aligned mode: {np.mean(old != rollout):.2%} of tokens have old log-probs different "
                    f"from the rollout's (max |diff| {np.max(np.abs(old - rollout)):.3g})"
                )
        n = batch.num_rows
        if n % self.train.num_minibatches:
            raise ValueError(f"{n} sequences do not split into {self.train.num_minibatches} minibatches")
        size = n // self.train.num_minibatches
        updates: list[dict] = []
        for _ in range(self.train.ppo_epochs):
            order = np.arange(n) if rng is None else rng.permutation(n)
            for i in range(self.train.num_minibatches):
                idx = order[i * size : (i + 1) * size]
                mb = self.shard_batch(batch.rows(idx))
                state, metrics = self.update(state, mb)
                if self._old_from_rollout:  # the first update's forward ran at the rollout's weights
                    scored = {k: metrics.pop(k) for k in SCORED_METRICS}
                    if not updates:
                        rollout_metrics = {**rollout_metrics, **scored}
                        if not stale:
                            self._check_first_update_aligned(scored)
                updates.append(metrics)
        if stale:
            rename = lambda k: k.replace("mismatch_", "staleness_", 1) if k.startswith("mismatch_") else k
            rollout_metrics = {rename(k): v for k, v in rollout_metrics.items()}
        return state, [{**rollout_metrics, **m} for m in updates]

    def _check_first_update_aligned(self, scored: dict) -> None:
        if self.train.assert_aligned and float(scored["mismatch_frac_bitwise_equal"]) != 1.0:
            raise AssertionError(
                f"aligned mode: {1 - float(scored['mismatch_frac_bitwise_equal']):.2%} of the first "
                f"minibatch's tokens score log-probs different from the rollout's (max |diff| "
                f"{float(scored['mismatch_max_abs_diff']):.3g})"
            )
