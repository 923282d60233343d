"""Training metrics: hand-computed values for each rule, and the entropy from the scoring forward."""

import jax
import jax.numpy as jnp
import numpy as np

from qarl_jax import quant
from qarl_jax.models import Qwen3ForCausalLM, init_params, preset
from qarl_jax.rl import metrics
from qarl_jax.rl.logprobs import policy_logprobs, policy_logprobs_and_entropy


def _rows(*responses, prompt=2, length=20):
    """Targets/mask [B, length]: each response after ``prompt`` positions of prompt targets (token 99)."""
    targets = np.full((len(responses), length), 99, np.int32)
    mask = np.zeros((len(responses), length), np.float32)
    for i, r in enumerate(responses):
        targets[i, prompt : prompt + len(r)] = r
        mask[i, prompt : prompt + len(r)] = 1.0
    return jnp.asarray(targets), jnp.asarray(mask)


def test_repetition_loop_rule():
    responses = [
        [5, 6] + [7] * 12,  # unigram x12 at the end: caught
        [5, 6] + [7] * 11,  # x11 covers 11 < 12 tokens: not caught
        [1, 2, 3, 4] * 3 + [9],  # loop escaped before the end: not caught
        [9] + [1, 2, 3, 4] * 3,  # 4-gram x3 = 12 tokens: caught
        [9] + [1, 2, 3, 4, 5] * 3,  # a 5-gram is beyond max_ngram: not caught
        [8, 1, 2] * 4 + [8],  # trigram loop ending mid-period (13 tokens of period 3): caught
        [],  # empty row: never caught
    ]
    targets, mask = _rows(*responses)
    got = np.asarray(metrics.repetition_loop(targets, mask))
    np.testing.assert_array_equal(got, [True, False, False, True, False, True, False])
    # the prompt's own repeated 99s never count: a response of one 99 after them is not a loop
    t, m = _rows([99], prompt=15)
    assert not bool(metrics.repetition_loop(t, m)[0])
    # tighter rule: a bigram repeated 3 times over >= 6 tokens
    t, m = _rows([4, 5, 4, 5, 4, 5], [4, 5, 4, 5, 4])
    np.testing.assert_array_equal(metrics.repetition_loop(t, m, min_tokens=6), [True, False])


def test_error_tokens_lengths_and_mismatch_by_hand():
    targets, mask = _rows([3, 4, 5], [6] * 12, [7])
    rollout = jnp.where(mask > 0, -1.0, 0.0).at[0, 3].set(-7.0).at[2, 2].set(np.log(2e-3))  # p < 1e-3 once
    flags = metrics.error_sequences(targets, mask, rollout)
    np.testing.assert_array_equal(flags["low_prob"], [True, False, False])
    np.testing.assert_array_equal(flags["repetition"], [False, True, False])
    stats = metrics.error_token_stats(flags, mask)
    np.testing.assert_allclose(stats["low_prob_token_frac"], 1 / 16)
    np.testing.assert_allclose(stats["repetition_frac"], 1 / 3)
    np.testing.assert_allclose(stats["error_seq_frac"], 2 / 3)
    assert bool(metrics.error_sequences(targets, mask, rollout, low_prob_threshold=3e-3)["low_prob"][2])

    lengths = metrics.response_length_stats(mask, jnp.asarray([0.0, 1.0, 0.0]))
    np.testing.assert_allclose(lengths["response_len_mean"], 16 / 3)
    assert float(lengths["response_len_max"]) == 12
    np.testing.assert_allclose(lengths["truncation_rate"], 1 / 3)
    assert "truncation_rate" not in metrics.response_length_stats(mask)

    old = rollout.at[1, 5].add(0.5).at[1, 0].add(9.0)  # one response token off; the prompt's change is masked
    mm = metrics.mismatch_stats(old * mask, rollout * mask, mask)
    np.testing.assert_allclose(mm["mismatch_frac_bitwise_equal"], 15 / 16)
    assert float(mm["mismatch_max_abs_diff"]) == 0.5
    np.testing.assert_allclose(mm["mismatch_mean_abs_diff"], 0.5 / 16)
    np.testing.assert_allclose(mm["mismatch_kl_k3"], (np.expm1(0.5) - 0.5) / 16, rtol=1e-6)
    aligned = metrics.mismatch_stats(rollout, rollout, mask)
    assert [float(v) for v in aligned.values()] == [1.0, 0.0, 0.0, 0.0]

    # implausible under the training forward: the rollout's own p < 1e-3 token (row 0) and one the
    # rollout drew at p = e^-1 that the training forward gives 5e-4 (row 1); the prompt never counts
    train = rollout.at[1, 5].set(np.log(5e-4)).at[2, 0].set(-30.0)  # row 2: in its prompt only
    got = metrics.implausible_tokens(train, mask)
    np.testing.assert_allclose(got["implausible_token_frac"], 2 / 16)
    np.testing.assert_allclose(got["implausible_seq_frac"], 2 / 3)
    looser = metrics.implausible_tokens(train, mask, threshold=3e-3)  # row 2's 2e-3 token too
    np.testing.assert_allclose(looser["implausible_seq_frac"], 1.0)
    same = metrics.implausible_tokens(rollout * mask, mask)  # aligned: exactly the low-probability rate
    assert float(same["implausible_token_frac"]) == float(stats["low_prob_token_frac"])


def test_logprobs_and_entropy_from_one_forward():
    """The log-probs are bitwise policy_logprobs'; the entropy is -sum p log p of the same logits
    (at the sampling temperature)."""
    temperature = 0.7
    model = Qwen3ForCausalLM(preset("qwen3-tiny", num_hidden_layers=1), quant.QuantSpec(fmt="w8a8"))
    params = init_params(model, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 7), 0, 128)
    targets = jnp.roll(tokens, -1, axis=1)
    args = (model, params, tokens, None, None, targets, temperature)
    logp, entropy = jax.jit(policy_logprobs_and_entropy, static_argnums=(0, 6))(*args)
    np.testing.assert_array_equal(logp, jax.jit(policy_logprobs, static_argnums=(0, 6))(*args))
    spec = model.quant.training_spec()
    logits = model.clone(quant=spec).apply({"params": params}, tokens) / temperature
    ref = -jnp.sum(jax.nn.softmax(logits) * jax.nn.log_softmax(logits), axis=-1)
    np.testing.assert_allclose(entropy, ref, rtol=1e-5)
    assert 0 < float(entropy.min()) and float(entropy.max()) <= np.log(128) + 1e-5
