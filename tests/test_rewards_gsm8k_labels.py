"""Agreement with the GSM8K authors' own labels on real model solutions (example_model_solutions.jsonl)."""

import json

import numpy as np
import pytest

from qarl_jax.rewards import Grader, grade


@pytest.fixture(scope="module")
def labelled(gsm8k_dir):
    """(solution, reference answer from test.jsonl, is_correct) for every model's solution."""
    solutions = [json.loads(line) for line in (gsm8k_dir / "example_model_solutions.jsonl").open()]
    tests = [json.loads(line) for line in (gsm8k_dir / "test.jsonl").open()]
    rows = []
    for sol, test in zip(solutions, tests, strict=True):
        assert sol["question"] == test["question"]
        for model in ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification"):
            rows.append(
                (sol[model]["solution"], test["answer"].split("####")[1].strip(), sol[model]["is_correct"])
            )
    return rows


def test_file_structure(labelled):
    assert len(labelled) == 5276
    labels = np.array([r[2] for r in labelled])
    assert 0.2 < labels.mean() < 0.8  # both classes well represented: agreement is not trivial


def test_exact_number_grader_agrees_with_every_label(labelled):
    responses, answers, labels = zip(*labelled, strict=True)
    scores = grade(list(responses), list(answers), "synthetic")
    disagree = [i for i, (s, y) in enumerate(zip(scores, labels, strict=True)) if bool(s) != y]
    assert not disagree, [labelled[i] for i in disagree[:5]]


def test_pool_gsm8k_grader_agrees_with_every_label(labelled):
    responses, answers, labels = zip(*labelled, strict=True)
    with Grader(num_workers=2, time_limit_s=5.0) as grader:
        scores = grader.grade(list(responses), list(answers), "gsm8k")
        assert dict(grader.stats) == {"graded": 5276}
    np.testing.assert_array_equal(scores.astype(bool), np.array(labels))
