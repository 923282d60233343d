"""DAPO's data side: dynamic sampling keeps only informative groups and stops at its bound; the
soft overlong punishment by hand; the padded training batch of the kept groups."""

import re

import numpy as np
import pytest

from qarl_jax.rl import dapo
from qarl_jax.rl.advantages import group_advantages
from qarl_jax.rl.batch import bucketed_length
from qarl_jax.rollout.driver import Sample
from qarl_jax.rollout.groups import Groups


def groups(rewards, first_prompt=0, length=3) -> Groups:
    rewards = np.asarray(rewards, np.float32)
    prompts = [[first_prompt + p, 7] for p in range(len(rewards))]
    sample = lambda p, g: Sample(p, g, [5] * length, [-0.5] * length, [-0.5] * length, "policy", "eos")
    samples = [[sample(p, g) for g in range(rewards.shape[1])] for p in range(len(rewards))]
    return Groups(prompts, samples, rewards, rewards)


def test_dynamic_sampling_refills_with_informative_groups_only():
    rounds = {
        0: [[1, 1, 1], [0, 1, 0], [0, 0, 0], [1, 0, 0]],  # 2 informative, 2 flat
        1: [[0.5, 0.5, 0.5], [0, 0, 1], [1, 1, 1], [1, 1, 1]],  # 1 informative
        2: [[1, 0, 1], [0, 0, 0], [0, 1, 1], [1, 0, 0]],  # 3 informative: 1 needed
    }
    drawn = []

    def draw(r):
        drawn.append(r)
        return groups(rounds[r], first_prompt=10 * r)

    out, stats = dapo.dynamic_sampling(groups(rounds[0]), draw, target=4, max_rounds=5)
    assert drawn == [1, 2]  # stops as soon as 4 are kept
    assert [p[0] for p in out.prompts] == [1, 3, 11, 20]  # in draw order, extras beyond 4 left out
    assert stats == {"dropped_groups": 2.0 + 3.0 + 1.0, "resample_rounds": 2.0, "missing_groups": 0.0}
    assert np.all(out.rewards.std(axis=1) > 0)


def test_dynamic_sampling_stops_at_its_bound():
    flat = lambda r: groups([[1, 1], [0, 0], [0.3, 0.3]], first_prompt=10 * r)
    drawn = []
    out, stats = dapo.dynamic_sampling(flat(0), lambda r: drawn.append(r) or flat(r), target=3, max_rounds=2)
    assert drawn == [1, 2] and len(out) == 0
    assert stats == {"dropped_groups": 9.0, "resample_rounds": 2.0, "missing_groups": 3.0}
    out, stats = dapo.dynamic_sampling(groups([[1, 0], [1, 1]]), flat, target=2, max_rounds=0)  # filter only
    assert len(out) == 1 and stats["resample_rounds"] == 0.0 and stats["missing_groups"] == 1.0


def test_dynamic_sampling_never_emits_a_zero_variance_group():
    rng = np.random.default_rng(0)
    for trial in range(200):
        target, bound = int(rng.integers(1, 6)), int(rng.integers(0, 4))
        draws = [
            rng.integers(0, 2, (target, 4)).astype(np.float32) * (rng.random() < 0.7)
            for _ in range(bound + 1)
        ]
        calls = []

        def draw(r, draws=draws, calls=calls):
            calls.append(r)
            return groups(draws[r])

        out, stats = dapo.dynamic_sampling(groups(draws[0]), draw, target, bound)
        assert len(calls) <= bound and stats["resample_rounds"] == len(calls)
        assert len(out) + stats["missing_groups"] == target
        assert np.all(np.asarray(group_advantages(out.rewards)) != 0), trial
        informative = sum(int(np.sum(np.ptp(d, axis=1) > 0)) for d in draws[: len(calls) + 1])
        assert stats["dropped_groups"] == target * (len(calls) + 1) - informative
    with pytest.raises(ValueError, match="max_rounds must be >= 0"):
        dapo.dynamic_sampling(groups([[1, 0]]), None, 1, -1)


def test_overlong_penalty_by_hand():
    lengths = np.asarray([10, 12, 13, 15, 16])
    # max_new_tokens 16, buffer 4: free up to 12, then -1/4 per token to -penalty at 16
    np.testing.assert_allclose(dapo.overlong_penalty(lengths, 16, 4, 1.0), [0, 0, -0.25, -0.75, -1.0])
    np.testing.assert_allclose(dapo.overlong_penalty(lengths, 16, 4, 0.5), [0, 0, -0.125, -0.375, -0.5])
    assert np.all(dapo.overlong_penalty(lengths, 16, 0, 1.0) == 0)
    with pytest.raises(ValueError, match="overlong buffer"):
        dapo.overlong_penalty(lengths, 16, 17, 1.0)


def test_groups_batch_pads_with_empty_rows():
    g = groups([[1, 0], [0, 1]])
    g.samples[1][0].finish_reason = "length"
    adv = np.asarray([[0.5, -0.5], [-0.5, 0.5]], np.float32)
    b = dapo.groups_batch(g, adv, rows=6, length=8, filler=[3, 4])
    assert b.num_rows == 6 and b.mask[:4].sum(axis=1).tolist() == [3, 3, 3, 3]
    assert np.all(b.mask[4:] == 0) and np.all(b.advantages[4:] == 0) and np.all(b.segment_ids[4:, 0] == 1)
    np.testing.assert_array_equal(b.advantages[:4], adv.reshape(-1))
    assert b.truncated.tolist() == [0, 0, 1, 0, 0, 0]
    with pytest.raises(ValueError, match="do not fit in 3 rows"):
        dapo.groups_batch(g, adv, rows=3, length=8, filler=[3])


def test_the_batch_is_cut_to_the_bucket_of_its_longest_row():
    """Prompts of 2 tokens and responses of 3: rows of 4 inputs; a 5-token filler prompt is 4 too,
    a 7-token one 6. Buckets of max_len 64 in 4 steps: 16, 32, 48, 64."""
    g = groups([[1, 0], [0, 1]])
    assert dapo.longest_inputs(g, filler=[3]) == 4
    assert dapo.longest_inputs(g, filler=[3] * 7) == 6
    b = dapo.groups_batch(g, np.zeros((2, 2), np.float32), 4, bucketed_length(4, 64, 4), [3])
    assert b.tokens.shape == (4, 16) and b.mask.sum() == 12
    cases = {(1, 64, 4): 16, (16, 64, 4): 16, (17, 64, 4): 32, (47, 64, 4): 48, (63, 64, 4): 64}
    cases |= {(64, 64, 4): 64, (5, 64, 1): 64, (10, 100, 3): 34, (35, 100, 3): 68, (69, 100, 3): 100}
    for args, length in cases.items():
        assert bucketed_length(*args) == length, args
    for args, message in [((0, 64, 4), "1..max_len=64"), ((65, 64, 4), "65 inputs"), ((8, 64, 0), ">= 1")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            bucketed_length(*args)
