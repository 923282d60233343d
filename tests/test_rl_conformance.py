"""Each convention of the objectives on small fixed inputs (unequal lengths, empty rows) against
loss and gradient computed by hand from the formulas; the gradient the Trainer's accumulation
gives for micro_batches 1, 2 and 4 for every objective x aggregation x correction; finite loss and
gradient whatever padding holds."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qarl_jax.rl.batch import RolloutBatch
from qarl_jax.rl.objectives import AGGREGATIONS, OBJECTIVES, ObjectiveConfig, compute_loss, normalisers
from qarl_jax.rl.train_step import accumulate

MASK = np.asarray([[1, 1, 1], [1, 0, 0], [0, 0, 0]], np.float32)  # lengths 3, 1 and an empty row


def batch(old, adv, mask=MASK, rollout=None, ref=None, truncated=None, rows=None) -> RolloutBatch:
    """The loss's fields; ``tokens[:, 0]`` numbers the rows (the toy forward of the micro-batch test)."""
    mask = jnp.asarray(mask, jnp.float32)
    index = jnp.broadcast_to(jnp.arange(mask.shape[0] if rows is None else rows)[:, None], mask.shape)
    old = jnp.asarray(old, jnp.float32)
    return RolloutBatch(index.astype(jnp.int32), index, index, index, mask,
                        old if rollout is None else jnp.asarray(rollout, jnp.float32),
                        jnp.asarray(adv, jnp.float32), truncated, old, ref)  # fmt: skip


def loss_and_grad(logp, b, cfg, **kwargs):
    (loss, metrics), grad = jax.value_and_grad(lambda lp: compute_loss(lp, b, cfg, **kwargs), has_aux=True)(
        jnp.asarray(logp, jnp.float32)
    )
    return float(loss), metrics, np.asarray(grad)


@pytest.mark.parametrize(
    "aggregation, loss, grad_rows",
    [
        # terms at r = 1 are A per token: row 0 three of 1, row 1 one of -2, row 2 nothing
        ("token_mean", -(3 - 2) / 4, [-1 / 4, 2 / 4]),  # over the 4 tokens
        ("seq_mean_token_mean", -(1 + -2) / 2, [-1 / (3 * 2), 2 / (1 * 2)]),  # 2 non-empty rows
        ("seq_mean_token_sum", -(3 - 2) / (2 * 3), [-1 / 6, 2 / 6]),  # rows x T
    ],
)
def test_aggregations_unequal_lengths_and_an_empty_row(aggregation, loss, grad_rows):
    old = -np.ones((3, 3))
    cfg = ObjectiveConfig(name="grpo", aggregation=aggregation)
    got, _, grad = loss_and_grad(old, batch(old, [1.0, -2.0, 5.0]), cfg)
    np.testing.assert_allclose(got, loss, rtol=1e-6)
    expected = np.zeros((3, 3))
    expected[0], expected[1, 0] = grad_rows[0], grad_rows[1]
    np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-7)


def test_tbpo_sequence_ratio_band_and_gradient_by_hand():
    """rho_0 = exp(mean(0.02, 0.01, 0)) inside the clip (A = 1): term rho_0, d/d logp_t = rho_0 / |y_0|;
    rho_1 = e^0.5 above the band (A = -1): dropped; the empty row counts nowhere: J / 2 sequences."""
    old = -np.ones((3, 3))
    logp = old + np.asarray([[0.02, 0.01, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    cfg = ObjectiveConfig(name="tbpo", eps_low=0.1, eps_high=0.2, eps_neg_low=0.1, eps_neg_high=0.3)
    loss, m, grad = loss_and_grad(logp, batch(old, [1.0, -1.0, 1.0]), cfg)
    rho = math.exp(0.01)
    np.testing.assert_allclose(loss, -rho / 2, rtol=1e-6)
    np.testing.assert_allclose(grad[0], [-rho / (3 * 2)] * 3, rtol=1e-6)
    assert np.all(grad[1:] == 0)
    assert float(m["band_mask_frac"]) == 0.5 and float(m["clip_frac"]) == 0.0


def test_sequence_objective_without_correction_at_either_level():
    """correction=none leaves correction_level free: the token setting gives the sequence one's loss."""
    old = -np.ones((3, 3))
    logp = old + np.asarray([[0.02, 0.01, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    b = batch(old, [1.0, -1.0, 1.0])
    losses = [loss_and_grad(logp, b, ObjectiveConfig(correction="none", correction_level=level))[0]
              for level in ("token", "sequence")]  # fmt: skip
    assert losses[0] == losses[1]


@pytest.mark.parametrize(
    "kwargs, loss, frac, kept",
    [
        # token weights w = old / rollout: row 0 [3, 1, 0.25, 1.5] (A = 1), row 1 [1] (A = -1); C = 2
        ({}, -(1 + 1.5 - 1) / 5, 2 / 5, [1, 3]),  # 3 > C and 0.25 < 1/C rejected, all 5 counted
        (dict(mis_normaliser="kept"), -(1 + 1.5 - 1) / 3, 2 / 5, [1, 3]),  # only the 3 kept counted
        (dict(correction_low=0.0), -(1 + 0.25 + 1.5 - 1) / 5, 1 / 5, [1, 2, 3]),  # rejects only above C
    ],
)
def test_mis_lower_bound_and_normaliser(kwargs, loss, frac, kept):
    mask = np.asarray([[1, 1, 1, 1], [1, 0, 0, 0]], np.float32)
    old = -np.ones((2, 4))
    w = np.asarray([[3.0, 1.0, 0.25, 1.5], [1.0, 1.0, 1.0, 1.0]])
    cfg = ObjectiveConfig(name="grpo", correction="mis", correction_level="token", **kwargs)
    b = batch(old, [1.0, -1.0], mask, rollout=old - np.log(w))
    got, m, grad = loss_and_grad(old, b, cfg)
    np.testing.assert_allclose(got, loss, rtol=1e-6)
    np.testing.assert_allclose(float(m["correction_frac"]), frac, rtol=1e-6)
    tokens = 3 if kwargs.get("mis_normaliser") == "kept" else 5
    expected = np.zeros((2, 4))
    expected[0, kept] = -w[0, kept] / tokens
    expected[1, 0] = 1.0 / tokens
    np.testing.assert_allclose(grad, expected, rtol=1e-6)


@pytest.mark.parametrize("kind, w0, changed", [("geometric", 2.0, 0.0), ("product", 3.0, 0.5)])
def test_sequence_weight_geometric_or_product(kind, w0, changed):
    """Row 0's token weights 2 and 2: geometric mean 2, product 4 (truncated at C = 3); row 1's one
    token 1.5 either way. GSPO at rho = 1, A = 1: J = mean_i w_i."""
    mask = np.asarray([[1, 1], [1, 0]], np.float32)
    old = -np.ones((2, 2))
    rollout = old - np.log([[2.0, 2.0], [1.5, 1.0]])
    cfg = ObjectiveConfig(name="gspo", correction="tis", correction_cap=3.0, correction_seq_weight=kind)
    loss, m, _ = loss_and_grad(old, batch(old, [1.0, 1.0], mask, rollout=rollout), cfg)
    np.testing.assert_allclose(loss, -(w0 + 1.5) / 2, rtol=1e-6)
    assert float(m["correction_frac"]) == changed


def test_overlong_filter_gives_truncated_samples_zero_weight():
    """Row 0 was truncated: with the filter it leaves the loss and its denominator (token_mean over
    row 1's single token), its gradient exactly 0; without it, it counts like any other row."""
    old = -np.ones((3, 3))
    truncated = jnp.asarray([1.0, 0.0, 0.0])
    b = batch(old, [1.0, -2.0, 5.0], truncated=truncated)
    loss, _, grad = loss_and_grad(old, b, ObjectiveConfig(name="grpo", overlong_filter=True))
    np.testing.assert_allclose(loss, 2.0, rtol=1e-6)
    assert np.all(grad[0] == 0) and grad[1, 0] == 2.0
    loss, _, grad = loss_and_grad(old, b, ObjectiveConfig(name="grpo"))
    np.testing.assert_allclose(loss, -(3 - 2) / 4, rtol=1e-6)
    assert np.all(grad[0] != 0)
    tb, _, grad = loss_and_grad(old, b, ObjectiveConfig(overlong_filter=True))  # TBPO: 1 valid row
    np.testing.assert_allclose(tb, 2.0, rtol=1e-6)
    assert np.all(grad[0] == 0)
    with pytest.raises(ValueError, match="overlong_filter needs the batch's truncated"):
        compute_loss(jnp.asarray(old), batch(old, [1.0, 1.0, 1.0]), ObjectiveConfig(overlong_filter=True))


def test_clamped_log_ratio_has_no_gradient():
    old = -np.ones((1, 1))
    cfg = ObjectiveConfig(name="grpo", eps_low=0.9, eps_high=1e6, log_ratio_clamp=1.0)
    loss, _, grad = loss_and_grad(old - 3.0, batch(old, [-1.0], [[1.0]]), cfg)  # log r = -3 -> -1
    np.testing.assert_allclose(loss, math.exp(-1.0), rtol=1e-6)
    assert grad[0, 0] == 0.0


CORRECTIONS = [
    {},
    dict(correction="tis", correction_level="sequence", correction_seq_weight="product"),
    dict(correction="mis", correction_level="sequence", mis_normaliser="kept"),
    dict(correction="tis", correction_level="token"),
    dict(correction="mis", correction_level="token", mis_normaliser="kept"),
]
# every objective as configured by default; GRPO (whose aggregation and correction code every
# token-level objective shares) under every aggregation x correction; the sequence-level ones and
# dual-clip under the corrections that change their denominators or weights
CASES = (
    [(name, "auto", {}) for name in OBJECTIVES]
    + [("grpo", agg, corr) for agg in AGGREGATIONS for corr in CORRECTIONS if agg != "token_mean" or corr]
    + [(name, "auto", corr) for name in ("tbpo", "gspo") for corr in CORRECTIONS[1:3]]
    + [("dual_clip_ppo", "auto", CORRECTIONS[4])]
)


def _inputs(seed=0, b=8, t=7):
    """Rows of response lengths 1..T and one empty row, log-ratios wide enough that clips, bands,
    dual clips and MIS rejections all act; -200 at padding."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray([5, 1, 7, 0, 3, 6, 2, 4])[:b]
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    old = np.where(mask > 0, -rng.uniform(0.1, 3.0, (b, t)), -200.0)
    rollout = np.where(mask > 0, old + rng.normal(0, 0.4, (b, t)), 0.0)
    ref = old + rng.normal(0, 0.1, (b, t))
    theta = old + rng.normal(0, 0.3, (b, t))
    theta[0, :2] += 2.0  # ratios above e^2 where A < 0: the dual clip's bound and the band act
    adv = np.asarray([-1.0, 0.5, 1.2, 0.3, -0.7, 0.9, -1.5, 0.4])[:b]
    truncated = jnp.asarray(lengths == lengths.max(), jnp.float32)
    return theta, batch(old, adv, mask, rollout, jnp.asarray(ref, jnp.float32), truncated)


@pytest.mark.parametrize("name, aggregation, correction", CASES)
def test_micro_batches_give_the_same_gradient(name, aggregation, correction):
    """The Trainer's accumulation over micro_batches 1, 2 and 4 of one minibatch (normalisers
    counted over it first): the same loss, gradient and metrics; the toy forward reads row i's
    log-probs from parameter row i (tokens[:, 0] numbers the rows), with KL and entropy terms."""
    theta, b = _inputs()
    cfg = ObjectiveConfig(name=name, aggregation=aggregation, kl_coef=0.1, entropy_coef=0.01,
                          eps_low=0.05, eps_high=0.05, eps_neg_low=0.05, eps_neg_high=0.05,
                          overlong_filter=True, **correction)  # fmt: skip

    def grads(params, mb, norms):
        def loss(p):
            logp = p[mb.tokens[:, 0]]
            return compute_loss(logp, mb, cfg, norms, entropy=-0.5 * logp)

        (value, metrics), g = jax.value_and_grad(loss, has_aux=True)(params)
        return (value, metrics, g, None), params[mb.tokens[:, 0]]

    norms = normalisers(b, cfg)
    with jax.disable_jit():  # op by op: far quicker than compiling three programs per case
        results = [accumulate(grads, jnp.asarray(theta), b, parts, norms) for parts in (1, 2, 4)]
    for _, rows in results:  # the per-row outputs come back in the minibatch's row order
        np.testing.assert_array_equal(rows, theta.astype(np.float32)[np.asarray(b.tokens)[:, 0]])
    (loss, metrics, grad, _), *others = [summed for summed, _ in results]
    assert np.isfinite(float(loss)) and np.all(np.isfinite(grad)) and np.any(grad != 0)
    for other_loss, other_metrics, other_grad, _ in others:
        np.testing.assert_allclose(float(other_loss), float(loss), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(other_grad, grad, rtol=1e-5, atol=1e-7)
        for key, value in metrics.items():
            np.testing.assert_allclose(
                float(other_metrics[key]), float(value), rtol=1e-5, atol=1e-7, err_msg=key
            )
    if not correction:  # the inputs exercise the branches: clip, and the band / dual clip where they exist
        assert float(metrics["clip_frac"]) > 0
        for key in ("band_mask_frac", "dual_clip_frac"):
            assert float(metrics.get(key, 1.0)) > 0, key


@pytest.mark.parametrize("name", list(OBJECTIVES))
@pytest.mark.parametrize("correction", CORRECTIONS[:3])
def test_extreme_inputs_give_finite_loss_and_gradient(name, correction):
    """-200 old log-probs and -inf rollout log-probs at padding; +-100 log-ratios on response tokens
    (exp(100) overflows float32): finite loss, metrics and gradient."""
    theta, b = _inputs(1)
    mask = np.asarray(b.mask)
    sign = np.where(np.arange(mask.shape[1]) % 2 == 0, 100.0, -100.0)
    logp = jnp.asarray(np.where(mask > 0, np.asarray(b.old_logp) + sign, 0.0), jnp.float32)
    rollout = jnp.asarray(np.where(mask > 0, np.asarray(b.old_logp) - sign, -np.inf), jnp.float32)
    b = b.replace(rollout_logp=rollout, ref_logp=rollout)
    cfg = ObjectiveConfig(name=name, kl_coef=0.1, **correction)
    loss, metrics, grad = loss_and_grad(logp, b, cfg, entropy=jnp.zeros_like(logp))
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    assert all(np.isfinite(float(v)) for v in metrics.values()), metrics


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(name="gspo", aggregation="token_mean"),
            r"objective.aggregation='token_mean'.*objective.name='gspo'",
        ),
        (dict(name="tbpo", aggregation="seq_mean_token_sum"), "is sequence-level"),
        (dict(name="grpo", correction_low=0.5), "correction_low=0.5 needs objective.correction='mis'"),
        (dict(name="grpo", correction="mis", correction_low=2.0), r"in \[0, correction_cap=2.0\)"),
        (dict(name="grpo", mis_normaliser="kept"), "mis_normaliser='kept' needs"),
        (dict(name="grpo", correction_level="token", correction_seq_weight="product"), "sequence' only"),
        (dict(correction_seq_weight="arithmetic"), "objective.correction_seq_weight"),
        (dict(log_ratio_clamp=0.0), "log_ratio_clamp"),
    ],
)
def test_convention_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ObjectiveConfig(**kwargs)
