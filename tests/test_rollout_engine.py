"""Rollout engine core and RL driver on a 2-layer qwen3-tiny (CPU): greedy and log-probs against the
full forward, continuous batching independence, stop conditions, weight updates without recompiling.
Two layers, not the preset's four: nothing here depends on depth, and XLA's compile time (most of
this module's) grows with the unrolled layers. The training forward runs on one [8, 48] batch, so it
compiles once per model. A quantized engine against the training forward on master weights: bitwise,
by tests/test_tools_check_alignment.py (w8a8 on qwen3-tiny, the engine check_alignment builds) and
the formats x layouts of tests/test_rollout_matrix.py."""

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qarl_jax.models import Qwen3ForCausalLM, init_params, preset
from qarl_jax.models.ops import token_logprobs
from qarl_jax.rollout import GREEDY, EngineConfig, RolloutEngine, SamplingParams, rollout
from qarl_jax.rollout.driver import _next_requests

EOS = 0
CONFIG = preset("qwen3-tiny", num_hidden_layers=2)
ROWS = 8  # the training forward's one batch size


@pytest.fixture(scope="module")
def model():
    return Qwen3ForCausalLM(CONFIG)


@pytest.fixture(scope="module")
def params(model):
    return init_params(model, jax.random.key(0))


@pytest.fixture(scope="module")
def engine(model, params):
    return RolloutEngine(
        model, params, EngineConfig(slots=4, max_len=48, max_prefill_batch=4, eos_ids=(EOS,))
    )


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(1, 128, size=n).tolist() for n in (5, 11, 3, 17, 8, 2)]


@functools.cache
def _forward(model):
    return jax.jit(model.apply)


def full_forward(model, params, prompts, continuations):
    """Per sequence: the argmax continuation and the log-probs of ``continuations`` under the
    training forward (one right-padded batch: causal, so padding changes nothing before it)."""
    seqs = [p + c for p, c in zip(prompts, continuations, strict=True)]
    assert len(seqs) <= ROWS
    tokens = np.zeros((ROWS, 48), np.int32)  # one shape: one compilation
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    logits = _forward(model)({"params": params}, tokens)
    argmax, lp = np.asarray(jnp.argmax(logits, -1)), np.asarray(token_logprobs(logits[:, :-1], tokens[:, 1:]))
    return [
        (argmax[i, len(p) - 1 : len(s) - 1], lp[i, len(p) - 1 : len(s) - 1])
        for i, (p, s) in enumerate(zip(prompts, seqs, strict=True))
    ]


def test_greedy_matches_full_forward(engine, model, params, prompts):
    out = rollout(engine, prompts, n=2, max_new_tokens=12, sampling=GREEDY, ignore_eos=True, progress=False)
    ref = full_forward(model, params, prompts, [s[0].tokens for s in out])
    for samples, (argmax, lp) in zip(out, ref, strict=True):
        s = samples[0]
        assert s.tokens == argmax.tolist()
        np.testing.assert_allclose(s.logprobs, lp, atol=1e-5)
        assert s.finish_reason == "length" and s.length == 12
        assert s.sampling == "greedy" and s.sampling_logprobs == [0.0] * 12
        assert samples[1].tokens == s.tokens


def test_sampled_logprobs_match_full_forward(engine, model, params, prompts):
    out = rollout(engine, prompts[:3], n=2, max_new_tokens=10, seed=1, ignore_eos=True, progress=False)
    flat = [s for samples in out for s in samples]
    ref = full_forward(model, params, [prompts[s.prompt_index] for s in flat], [s.tokens for s in flat])
    for s, (_, lp) in zip(flat, ref, strict=True):
        np.testing.assert_allclose(s.logprobs, lp, atol=1e-5)
        assert s.sampling == "policy" and s.sampling_logprobs == s.logprobs
    assert out[0][0].tokens != out[0][1].tokens  # two samples of one prompt differ


@pytest.mark.slow  # 9 s
def test_mid_flight_insertion_is_independent(engine, prompts):
    """A sample's tokens do not depend on its slot or on what else runs: 6 prompts x 3 samples
    through 4 slots (refilled mid-flight, different slots) against each prompt run alone."""
    sampling = SamplingParams(temperature=1.0, top_k=20)
    batched = rollout(engine, prompts, n=3, max_new_tokens=9, sampling=sampling, seed=7, progress=False)
    for i in (1, 4):
        alone = rollout(
            engine,
            [prompts[i]],
            n=3,
            max_new_tokens=9,
            sampling=sampling,
            seed=7,
            prompt_ids=[i],
            progress=False,
        )
        assert [s.tokens for s in alone[0]] == [s.tokens for s in batched[i]]
        for a, b in zip(alone[0], batched[i], strict=True):
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)
    again = rollout(engine, prompts, n=3, max_new_tokens=9, sampling=sampling, seed=8, progress=False)
    assert [s.tokens for s in again[1]] != [s.tokens for s in batched[1]]


def test_next_requests_fill_the_free_slots_from_at_most_max_prompts():
    work = collections.deque((p, s) for p in range(3) for s in range(4))
    assert _next_requests(work, 8, 2) == [(p, s) for p in (0, 1) for s in range(4)]
    assert _next_requests(work, 3, 2) == [(2, 0), (2, 1), (2, 2)]  # as many as the free slots
    assert _next_requests(work, 8, 2) == [(2, 3)] and not work


def test_a_prompts_samples_share_one_prefill(model, params, engine, prompts):
    """4 samples of 2 prompts in 8 slots: one prefill of both prompts and one insert (not one
    prefill per 2 requests), and the same samples as through the 4-slot engine."""
    config = EngineConfig(slots=8, max_len=48, max_prefill_batch=2, eos_ids=(EOS,))
    wide = RolloutEngine(model, params, config)
    calls = []
    prefill = wide.prefill
    wide.prefill = lambda p, rows: calls.append(len(rows)) or prefill(p, rows)
    sampling = SamplingParams(temperature=1.0)
    out = rollout(wide, prompts[:2], n=4, max_new_tokens=5, sampling=sampling, seed=3, progress=False)
    assert calls == [2]
    ref = rollout(engine, prompts[:2], n=4, max_new_tokens=5, sampling=sampling, seed=3, progress=False)
    assert [[s.tokens for s in g] for g in out] == [[s.tokens for s in g] for g in ref]


def test_stop_conditions(engine, prompts):
    ref = rollout(engine, prompts[:2], max_new_tokens=12, sampling=GREEDY, ignore_eos=True, progress=False)
    tokens = ref[0][0].tokens
    config = dataclasses.replace(engine.config, eos_ids=(tokens[4],))  # the same prefill programs
    eos_engine = RolloutEngine(engine.model, engine.params, config)
    out = rollout(eos_engine, prompts[:1], max_new_tokens=12, sampling=GREEDY, progress=False)
    first = tokens.index(tokens[4])
    assert out[0][0].finish_reason == "eos" and out[0][0].tokens == tokens[: first + 1]

    class Chars:
        def decode(self, ids):
            return "".join(chr(33 + i % 90) for i in ids)

    stop = Chars().decode(tokens[5:7])
    out = rollout(
        engine, prompts[:2], max_new_tokens=12, sampling=GREEDY, ignore_eos=True,
        stop_strings=[stop], tokenizer=Chars(), progress=False,
    )  # fmt: skip
    cut = next(j for j in range(1, 13) if stop in Chars().decode(tokens[:j]))
    assert out[0][0].finish_reason == "stop_string" and out[0][0].tokens == tokens[:cut]
    assert len(out[0][0].logprobs) == cut
    assert out[1][0].tokens == ref[1][0].tokens[: out[1][0].length]

    short = rollout(engine, prompts[:1], max_new_tokens=1, sampling=GREEDY, ignore_eos=True, progress=False)
    assert short[0][0].tokens == tokens[:1] and short[0][0].finish_reason == "length"
    with pytest.raises(ValueError, match="longer than"):
        rollout(engine, [[1] * 48], progress=False)


def test_update_params_without_recompilation(engine, model, params, prompts):
    before = rollout(engine, prompts[:3], max_new_tokens=6, sampling=GREEDY, ignore_eos=True, progress=False)
    compiled = engine.compilations()
    other = init_params(model, jax.random.key(42))
    engine.update_params(other)
    after = rollout(engine, prompts[:3], max_new_tokens=6, sampling=GREEDY, ignore_eos=True, progress=False)
    assert engine.compilations() == compiled
    assert [s[0].tokens for s in after] != [s[0].tokens for s in before]
    ((argmax, _),) = full_forward(model, other, prompts[:1], [after[0][0].tokens])
    assert after[0][0].tokens == argmax.tolist()

    engine.release()  # the trainer's phase: cache freed, then reallocated by the next rollout
    assert engine.state is None
    engine.update_params(params)
    again = rollout(engine, prompts[:3], max_new_tokens=6, sampling=GREEDY, ignore_eos=True, progress=False)
    assert [s[0].tokens for s in again] == [s[0].tokens for s in before]
    assert engine.compilations() == compiled
    with pytest.raises(ValueError, match="update_params"):
        engine.update_params(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
