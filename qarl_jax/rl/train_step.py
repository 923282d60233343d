"""The QaRL training step: old log-probs, minibatch policy-gradient updates, the NaN guard.

One rollout batch (one sequence per row, padded) is scored once by the training forward to get the
old-policy log-probs (in aligned mode bitwise the rollout's), then split into ``num_minibatches``
optimizer updates for ``ppo_epochs`` epochs, each accumulating gradients over ``micro_batches``.
The master weights stay float; the forward is the one ``qarl_jax.rl.logprobs`` defines for the
model's spec (aligned: quantized kernels with a straight-through backward; naive: full precision).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from qarl_jax import sharding
from qarl_jax.models import Qwen3ForCausalLM
from qarl_jax.rl.logprobs import logprob_loss, policy_logprobs
from qarl_jax.rl.objectives import ObjectiveConfig, compute_loss

Batch = Mapping[str, jax.Array]
BATCH_KEYS = ("tokens", "positions", "segment_ids", "targets", "mask", "rollout_logp", "advantages")


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


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    num_minibatches: int = 1  # optimizer updates per rollout batch and epoch
    ppo_epochs: int = 1
    micro_batches: int = 1  # gradient accumulation inside one update
    temperature: float = 1.0  # the rollout's sampling temperature, applied to the logits in the loss
    remat: bool = False
    assert_aligned: bool = False  # debug: old log-probs must equal the rollout's bitwise (aligned mode)

    def __post_init__(self):
        for name in ("num_minibatches", "ppo_epochs", "micro_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature <= 0:
            raise ValueError(f"train.temperature must be positive, got {self.temperature}")


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


def _tree_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def _split(batch: Batch, parts: int) -> Batch:
    """[N, ...] -> [parts, N / parts, ...] for every array of the batch."""
    n = batch["tokens"].shape[0]
    if n % parts:
        raise ValueError(f"a batch of {n} sequences does not split into {parts} equal parts")
    return {k: v.reshape(parts, n // parts, *v.shape[1:]) for k, v in batch.items()}


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
        scored = logprob_loss(model, self._objective_loss, train.temperature, remat=train.remat)
        self._grad_fn = jax.value_and_grad(lambda p, b: scored(p, b)[0], has_aux=True)
        self._old_logprobs = jax.jit(self._old_logprobs_impl)
        self._update = jax.jit(self._update_impl, donate_argnums=(0,))

    def _objective_loss(self, logp: jax.Array, batch: Batch):
        return compute_loss(
            logp, batch["old_logp"], batch["rollout_logp"], batch["advantages"], batch["mask"], self.objective
        )

    def _context(self):
        return sharding.activate(self.mesh, self.rules) if self.mesh is not None else contextlib.nullcontext()

    def init_state(self, params) -> TrainState:
        """A fresh state on a copy of ``params`` (updates donate the state's buffers)."""
        with self._context():
            params = jax.tree.map(lambda x: x.copy(), params)
            opt_state = jax.jit(self.tx.init)(params)
        return TrainState(params=params, opt_state=opt_state, step=jnp.zeros((), jnp.int32))

    def shard_batch(self, batch: Batch) -> Batch:
        """Place a host batch with its sequences split over the mesh's batch axes."""
        if self.mesh is None:
            return {k: jnp.asarray(v) for k, v in batch.items()}
        axes = dict(self.rules)["batch"]
        spec = lambda v: PartitionSpec(axes, *([None] * (np.ndim(v) - 1)))  # noqa: E731
        return {k: jax.device_put(v, NamedSharding(self.mesh, spec(v))) for k, v in batch.items()}

    def _old_logprobs_impl(self, params, batch):
        logp = policy_logprobs(
            self.model,
            params,
            batch["tokens"],
            batch["positions"],
            batch["segment_ids"],
            batch["targets"],
            self.train.temperature,
        )
        return jax.lax.stop_gradient(logp) * batch["mask"]

    def old_logprobs(self, params, batch: Batch) -> jax.Array:
        with self._context():
            return self._old_logprobs(params, batch)

    def _update_impl(self, state: TrainState, batch: Batch):
        micro = _split(batch, self.train.micro_batches)

        def accumulate(carry, mb):
            (loss, metrics), grads = self._grad_fn(state.params, mb)
            acc_grads, acc_loss, acc_metrics = carry
            acc_grads = jax.tree.map(jnp.add, acc_grads, grads)
            acc_metrics = jax.tree.map(jnp.add, acc_metrics, metrics)
            return (acc_grads, acc_loss + loss, acc_metrics), None

        first = jax.tree.map(lambda v: v[0], micro)
        (_, metric_shape), _ = jax.eval_shape(self._grad_fn, state.params, first)
        zeros = (
            jax.tree.map(jnp.zeros_like, state.params),
            jnp.zeros((), jnp.float32),
            jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shape),
        )
        (grads, loss, metrics), _ = jax.lax.scan(accumulate, zeros, micro)
        k = self.train.micro_batches
        grads = jax.tree.map(lambda g: g / k, grads)
        loss, metrics = loss / k, jax.tree.map(lambda m: m / k, metrics)

        grad_norm = _tree_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, new_opt = self.tx.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        new_state = TrainState(
            params=keep(new_params, state.params),
            opt_state=keep(new_opt, state.opt_state),
            step=state.step + finite.astype(jnp.int32),
        )
        metrics = dict(
            metrics,
            loss=loss,
            grad_norm=grad_norm,
            update_ratio=_tree_norm(updates) / jnp.maximum(_tree_norm(state.params), 1e-12),
            skipped=1.0 - finite.astype(jnp.float32),
        )
        return new_state, metrics

    def update(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        """One optimizer update on one minibatch (which must hold ``old_logp``)."""
        with self._context():
            return self._update(state, batch)

    def train_on_rollouts(self, state: TrainState, batch: Batch, rng: np.random.Generator | None = None):
        """Old log-probs once, then ppo_epochs x num_minibatches updates (minibatches reshuffled per
        epoch when ``rng`` is given). Returns the new state and the list of per-update metrics."""
        missing = [k for k in BATCH_KEYS if k not in batch]
        if missing:
            raise ValueError(f"rollout batch lacks {missing}; it needs {BATCH_KEYS}")
        batch = dict(batch, old_logp=self.old_logprobs(state.params, self.shard_batch(batch)))
        if self.train.assert_aligned:
            mask = np.asarray(batch["mask"]) > 0
            old, rollout = np.asarray(batch["old_logp"])[mask], np.asarray(batch["rollout_logp"])[mask]
            if not np.array_equal(old, rollout):
                raise AssertionError(
                    f"aligned mode: {np.mean(old != rollout):.2%} of tokens have old log-probs different "
                    f"from the rollout's (max |diff| {np.max(np.abs(old - rollout)):.3g})"
                )
        n = batch["tokens"].shape[0]
        if n % self.train.num_minibatches:
            raise ValueError(f"{n} sequences do not split into {self.train.num_minibatches} minibatches")
        size = n // self.train.num_minibatches
        history = []
        for _ in range(self.train.ppo_epochs):
            order = np.arange(n) if rng is None else rng.permutation(n)
            for i in range(self.train.num_minibatches):
                idx = order[i * size : (i + 1) * size]
                mb = self.shard_batch({k: np.asarray(v)[idx] for k, v in batch.items()})
                state, metrics = self.update(state, mb)
                history.append(metrics)
        return state, history
