"""Objectives against hand-computed values on small fixed inputs, one branch at a time, and their
gradients against finite differences; advantages never NaN."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qarl_jax.rl.advantages import group_advantages
from qarl_jax.rl.batch import RolloutBatch
from qarl_jax.rl.objectives import ObjectiveConfig, aggregate, compute_loss

jax.config.update("jax_enable_x64", False)


def loss_batch(old, rollout, adv, mask, ref=None, truncated=None) -> RolloutBatch:
    """The loss's fields of a batch (the forward's, unused by the loss, zero)."""
    zeros = jnp.zeros(jnp.shape(mask), jnp.int32)
    return RolloutBatch(zeros, zeros, zeros, zeros, jnp.asarray(mask, jnp.float32), jnp.asarray(rollout),
                        jnp.asarray(adv, jnp.float32), truncated, jnp.asarray(old), ref)  # fmt: skip


def _loss(logp, old, rollout, adv, mask, cfg, ref=None, entropy=None, **kwargs):
    return compute_loss(logp, loss_batch(old, rollout, adv, mask, ref), cfg, entropy=entropy, **kwargs)


def _seq_inputs(log_rhos, advs, length=2, rollout_shift=None):
    """One sequence per entry with `length` tokens whose mean log-ratio is log_rho."""
    b = len(log_rhos)
    old = jnp.full((b, length), -1.0)
    logp = old + jnp.asarray(log_rhos, jnp.float32)[:, None]
    rollout = old if rollout_shift is None else old - jnp.asarray(rollout_shift, jnp.float32)[:, None]
    return logp, old, rollout, jnp.asarray(advs, jnp.float32), jnp.ones((b, length))


TB = ObjectiveConfig(name="tbpo", eps_low=0.1, eps_high=0.2, eps_neg_low=0.1, eps_neg_high=0.3)


@pytest.mark.parametrize(
    "log_rho, adv, expected_term, masked",
    [
        (math.log(1.05), 1.0, 1.05, False),  # positive, inside the clip: rho * A
        (math.log(1.5), 1.0, 1.2, False),  # positive, above 1 + eps_high: clipped
        (math.log(0.5), 1.0, 0.5, False),  # positive, below: min keeps rho * A
        (math.log(1.2), -1.0, -1.2, False),  # negative inside the band [0.9, 1.3]: rho * A
        (math.log(0.95), -2.0, -1.9, False),
        (math.log(1.4), -1.0, 0.0, True),  # negative above the band: dropped
        (math.log(0.8), -1.0, 0.0, True),  # negative below the band: dropped
    ],
)
def test_tbpo_branches(log_rho, adv, expected_term, masked):
    loss, m = _loss(*_seq_inputs([log_rho], [adv]), TB)
    np.testing.assert_allclose(float(loss), -expected_term, rtol=1e-6)
    assert float(m["band_mask_frac"]) == float(masked)


def test_tbpo_mismatch_weight_truncated_at_c():
    # old - rollout = log 3 per token -> sequence weight 3, truncated to C = 2
    inputs = _seq_inputs([0.0, 0.0], [1.0, -1.0], rollout_shift=[math.log(3.0), math.log(1.5)])
    loss, m = _loss(*inputs, TB)
    np.testing.assert_allclose(float(loss), -(2.0 * 1.0 + 1.5 * -1.0) / 2, rtol=1e-6)
    np.testing.assert_allclose(float(m["is_weight_max"]), 3.0, rtol=1e-6)
    assert float(m["correction_frac"]) == 0.5


def test_aligned_single_update_is_plain_policy_gradient():
    """old == rollout == logp bitwise: rho = 1, weight = 1, nothing clipped or masked."""
    logp = jnp.asarray([[-0.3, -2.0, -1.1], [-0.7, -0.2, -5.0]])
    mask = jnp.asarray([[1, 1, 1], [1, 1, 0]], jnp.float32)
    loss, m = _loss(logp, logp, logp, jnp.asarray([0.5, -0.5]), mask, ObjectiveConfig())
    assert float(loss) == 0.0 and float(m["clip_frac"]) == 0.0 and float(m["band_mask_frac"]) == 0.0
    assert float(m["is_weight_mean"]) == 1.0 and float(m["ratio_max"]) == 1.0


def test_mis_masks_sequences_above_cap():
    cfg = ObjectiveConfig(name="gspo", eps_low=0.5, eps_high=0.5, correction="mis")
    loss, m = _loss(*_seq_inputs([0.0, 0.0], [1.0, 1.0], rollout_shift=[math.log(3.0), 0.0]), cfg)
    np.testing.assert_allclose(float(loss), -(0.0 + 1.0) / 2, rtol=1e-6)
    assert float(m["correction_frac"]) == 0.5


def test_grpo_token_clip_and_aggregations():
    logp = jnp.log(jnp.asarray([[1.5, 1.0, 0.5], [1.0, 0.7, 1.0]]))
    old = jnp.zeros((2, 3))
    mask = jnp.asarray([[1, 1, 1], [1, 1, 0]], jnp.float32)
    adv = jnp.asarray([1.0, -1.0])
    # per-token surrogate: seq0 (A=1): min(r, clip(r,.8,1.2)) = [1.2, 1.0, 0.5]
    # seq1 (A=-1): min(-r, -clip(r)) = [-1.0, -0.8] (0.7 clipped up to 0.8)
    terms = np.array([[1.2, 1.0, 0.5], [-1.0, -0.8, 0.0]])
    cfg = ObjectiveConfig(name="grpo")
    loss, m = _loss(logp, old, old, adv, mask, cfg)
    np.testing.assert_allclose(float(loss), -terms.sum() / 5, rtol=1e-6)
    np.testing.assert_allclose(float(m["clip_frac"]), 2 / 5, rtol=1e-6)
    loss, _ = _loss(
        logp, old, old, adv, mask, ObjectiveConfig(name="grpo", aggregation="seq_mean_token_mean")
    )
    np.testing.assert_allclose(float(loss), -(2.7 / 3 + -1.8 / 2) / 2, atol=1e-6)  # 0.9 - 0.9
    loss_w, _ = _loss(logp, old, old, adv * 2, mask, ObjectiveConfig(name="grpo"))
    np.testing.assert_allclose(float(loss_w), 2 * -terms.sum() / 5, rtol=1e-6)
    loss, _ = _loss(logp, old, old, adv, mask, ObjectiveConfig(name="dr_grpo", loss_norm=10.0))
    np.testing.assert_allclose(float(loss), -terms.sum() / (2 * 10.0), rtol=1e-6)


def test_dual_clip_bounds_negative_advantages():
    logp = jnp.log(jnp.asarray([[5.0]]))
    old = jnp.zeros((1, 1))
    cfg = ObjectiveConfig(name="dual_clip_ppo", dual_clip=3.0)
    loss, m = _loss(logp, old, old, jnp.asarray([-1.0]), jnp.ones((1, 1)), cfg)
    np.testing.assert_allclose(float(loss), 3.0, rtol=1e-6)  # max(min(-5, -1.2), -3) = -3
    assert float(m["dual_clip_frac"]) == 1.0


def test_token_tis_and_kl_entropy_terms():
    logp = jnp.asarray([[-1.0, -2.0]])
    old = logp
    rollout = jnp.asarray([[-1.0 - math.log(4.0), -2.0]])  # token weights 4 -> C=2, and 1
    ref = jnp.asarray([[-1.5, -2.0]])
    entropy = jnp.asarray([[0.4, 0.2]])
    cfg = ObjectiveConfig(
        name="grpo", correction="tis", correction_level="token", kl_coef=0.1, entropy_coef=0.01
    )
    loss, m = _loss(logp, old, rollout, jnp.asarray([1.0]), jnp.ones((1, 2)), cfg, ref, entropy)
    k3 = np.exp(-0.5) + 0.5 - 1.0
    np.testing.assert_allclose(float(m["kl_ref"]), k3 / 2, rtol=1e-6)
    np.testing.assert_allclose(float(m["policy_loss"]), -(2.0 + 1.0) / 2, rtol=1e-6)
    np.testing.assert_allclose(float(loss), -1.5 + 0.1 * k3 / 2 - 0.01 * 0.3, rtol=1e-6)


@pytest.mark.parametrize("name", ["tbpo", "gspo", "grpo", "dr_grpo", "dual_clip_ppo"])
def test_gradients_match_finite_differences(name):
    rng = np.random.RandomState(0)
    old = jnp.asarray(-rng.uniform(0.1, 3.0, (4, 5)), jnp.float32)
    mask = jnp.asarray((np.arange(5)[None] < np.array([[5], [3], [4], [2]])).astype(np.float32))
    adv = jnp.asarray([1.0, -0.5, 0.7, -1.2])
    delta = jnp.asarray(rng.uniform(-0.01, 0.01, (4, 5)), jnp.float32)  # inside clip/band: smooth region
    cfg = ObjectiveConfig(name=name, eps_low=0.05, eps_high=0.05, eps_neg_low=0.05, eps_neg_high=0.05)

    def f(lp):
        return _loss(lp, old, old, adv, mask, cfg)[0]

    x0 = old + delta
    grad = np.asarray(jax.grad(f)(x0))
    direction = jnp.asarray(rng.standard_normal((4, 5)), jnp.float32) * mask
    h = 1e-3
    fd = (float(f(x0 + h * direction)) - float(f(x0 - h * direction))) / (2 * h)
    np.testing.assert_allclose(np.sum(grad * np.asarray(direction)), fd, rtol=2e-2, atol=1e-5)
    assert np.all(grad[np.asarray(mask) == 0] == 0)


def test_band_masked_sequence_gets_no_gradient():
    logp, old, rollout, adv, mask = _seq_inputs([math.log(1.4), math.log(1.1)], [-1.0, -1.0])
    grad = jax.grad(lambda lp: _loss(lp, old, rollout, adv, mask, TB)[0])(logp)
    assert np.all(np.asarray(grad[0]) == 0) and np.all(np.asarray(grad[1]) != 0)


def test_aggregate_rejects_unknown_mode():
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(jnp.ones((1, 1)), jnp.ones((1, 1)), "sum")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="ppo"), "objective.name='ppo'"),
        (dict(correction="is"), "objective.correction"),
        (dict(name="tbpo", correction_level="token"), "sequence-level"),
        (dict(aggregation="mean"), "objective.aggregation"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ObjectiveConfig(**kwargs)


def test_group_advantages():
    rewards = jnp.asarray([[1.0, 0.0, 1.0, 0.0], [0.7, 0.7, 0.7, 0.7], [0.0, 0.0, 0.0, 1.0]])
    adv = np.asarray(group_advantages(rewards, std="population"))
    np.testing.assert_allclose(adv[0], [1, -1, 1, -1], rtol=1e-5)
    assert np.all(adv[1] == 0.0) and np.isfinite(adv).all()
    np.testing.assert_allclose(adv[2], np.array([-1, -1, -1, 3]) / math.sqrt(3), rtol=1e-5)
    dr = np.asarray(group_advantages(rewards, "dr_grpo"))
    np.testing.assert_allclose(dr[2], [-0.25, -0.25, -0.25, 0.75], rtol=1e-6)
    assert np.all(dr[1] == 0.0)
    with pytest.raises(ValueError, match="prompts, samples_per_prompt"):
        group_advantages(jnp.ones(4))
    with pytest.raises(ValueError, match="unknown advantage mode"):
        group_advantages(rewards, "ppo")
    # the default divides by the sample std (G - 1): sqrt(3 / 4) of the population-std advantages
    sample = np.asarray(group_advantages(rewards))
    np.testing.assert_allclose(sample[0], np.array([1, -1, 1, -1]) * math.sqrt(3 / 4), rtol=1e-5)
    np.testing.assert_allclose(sample[2], np.array([-1, -1, -1, 3]) / 2, rtol=1e-5)
    assert np.all(sample[1] == 0.0)
    with pytest.raises(ValueError, match="unknown advantage std"):
        group_advantages(rewards, std="biased")
