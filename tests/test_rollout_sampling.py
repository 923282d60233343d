"""On-device sampling: greedy, temperature, top-k, top-p and the two log-probs each token carries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qarl_jax.rollout.sampling import SamplingParams, sample

V = 16


def draw(logits, temperature, top_p, top_k, n=1, seed=0):
    rows = logits.shape[0]
    keys = jax.random.split(jax.random.key(seed), rows * n)
    rep = lambda x: jnp.repeat(jnp.asarray(x), n, axis=0)
    return jax.jit(sample)(
        rep(logits),
        keys,
        rep(jnp.full((rows,), temperature, jnp.float32)),
        rep(jnp.full((rows,), top_p, jnp.float32)),
        rep(jnp.full((rows,), top_k, jnp.int32)),
    )


@pytest.fixture(scope="module")
def logits():
    return jax.random.normal(jax.random.key(3), (2, V)) * 2


def test_greedy_and_policy_logprobs(logits):
    tokens, lp, slp = draw(logits, 0.0, 1.0, 0)
    np.testing.assert_array_equal(tokens, jnp.argmax(logits, -1))
    np.testing.assert_allclose(lp, jax.nn.log_softmax(logits)[jnp.arange(2), tokens], atol=1e-6)
    assert (np.asarray(slp) == 0).all()


def test_temperature_logprob_is_of_the_scaled_distribution(logits):
    tokens, lp, slp = draw(logits, 0.5, 1.0, 0, n=4)
    rows = jnp.repeat(logits, 4, axis=0)
    want = jax.nn.log_softmax(rows / 0.5)[jnp.arange(8), tokens]
    np.testing.assert_allclose(slp, want, atol=1e-5)
    np.testing.assert_allclose(lp, jax.nn.log_softmax(rows)[jnp.arange(8), tokens], atol=1e-6)


def test_top_k_and_top_p_truncate(logits):
    tokens, _, slp = draw(logits, 1.0, 1.0, 3, n=200)
    top3 = np.asarray(jax.lax.top_k(logits, 3)[1])
    rows = np.repeat(np.arange(2), 200)
    assert all(t in top3[r] for t, r in zip(np.asarray(tokens), rows, strict=True))
    restricted = jnp.where(logits >= jax.lax.top_k(logits, 3)[0][:, -1:], logits, -jnp.inf)
    want = jax.nn.log_softmax(restricted)[rows, tokens]
    np.testing.assert_allclose(slp, want, atol=1e-5)
    assert len(set(np.asarray(tokens)[:200].tolist())) > 1

    tokens, _, _ = draw(logits, 1.0, 1e-3, 0, n=20)  # tiny nucleus: only the top token
    top1 = np.broadcast_to(np.asarray(jnp.argmax(logits, -1))[:, None], (2, 20))
    np.testing.assert_array_equal(np.asarray(tokens).reshape(2, 20), top1)
    probs = np.asarray(jax.nn.softmax(logits[0]))
    order = np.argsort(-probs)
    nucleus = set(order[: np.searchsorted(np.cumsum(probs[order]), 0.8) + 1].tolist())
    tokens, _, _ = draw(logits[:1], 1.0, 0.8, 0, n=300)
    assert set(np.asarray(tokens).tolist()) <= nucleus


def test_mixed_rows_and_validation():
    logits = jnp.stack([jnp.arange(V, dtype=jnp.float32)] * 2)
    keys = jax.random.split(jax.random.key(0), 2)
    tokens, _, slp = sample(logits, keys, jnp.array([0.0, 1.0]), jnp.array([1.0, 1.0]), jnp.array([0, 1]))
    assert np.asarray(tokens).tolist() == [V - 1, V - 1]
    assert np.asarray(slp).tolist() == [0.0, 0.0]  # greedy row; top-1 row (a point mass)
    assert SamplingParams(0.7, 0.9).describe() == "temperature=0.7,top_p=0.9,top_k=0"
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_k=-1)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
