"""``python -m qarl_jax.evaluate`` on the session's reference smoke run (the shipped tiny policy after
4 RL steps) and its export, and benchmark files generated here (arithmetic problems with known
answers, in the MATH-500, AIME, GSM8K and ARC layouts).

Checked: every figure equals the one computed here by hand from the samples the JSON records
(re-graded here too); the run directory on 8 devices (in process) and its exported Hugging Face
copy on 1 device (a subprocess) give the same table, figures and samples; malformed rows are
counted and named; every bad input is one line and its exit code. And the estimators, the
multiple-choice grader and the layouts by hand."""

from __future__ import annotations

import collections
import itertools
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import smoke_run

from qarl_jax.config import load_config
from qarl_jax.data.config import SyntheticConfig
from qarl_jax.data.synthetic import SyntheticArithmetic
from qarl_jax.errors import ConfigError, DataError
from qarl_jax.evaluate.benchmarks import parse_spec, read_benchmark
from qarl_jax.evaluate.command import main
from qarl_jax.evaluate.metrics import majority, pass_at_k
from qarl_jax.evaluate.run import variants
from qarl_jax.rewards import extract_choice, grade_choice, grade_math, grade_number

REPO = pathlib.Path(__file__).parents[1]
SMOKE = REPO / "configs" / "loop_smoke.yaml"
K = 4
# The engine's shapes are the reference run's (configs/loop_smoke.yaml: 16 slots, a 64-token cache;
# its rollouts prefill 4 prompts of <= 32 tokens and insert their 16 samples at once), so the run
# directory's evaluation loads the reference run's compiled programs: ITEMS prompts x K samples fill
# the 16 slots in one prefill and one insert (no refills of odd sizes, each its own program), every
# prompt is <= 32 tokens (the ARC items' 32: one-step questions, two one-digit choices) and the
# cache is the longest prompt + MAX_TOKENS = 64 tokens.
MAX_TOKENS = 32
SAMPLED = [
    "--k",
    str(K),
    "--temperature",
    "1.0",
    "--pass-k",
    "1,2,4",
    "--max-tokens",
    str(MAX_TOKENS),
    "rollout.slots=16",
]


def problems(n: int) -> list[dict]:
    source = SyntheticArithmetic(SyntheticConfig(digits=1, steps=2), seed=5, split="test")
    return [source[i] for i in range(n)]


def one_step_problems(n: int) -> list[dict]:
    """The first ``n`` one-operation test problems with a one-digit answer (the ARC items: their
    prompts, with two one-digit choices, are 32 tokens)."""
    source = SyntheticArithmetic(SyntheticConfig(digits=1, steps=1), seed=5, split="test")
    rows = (source[i] for i in itertools.count())
    return list(itertools.islice((r for r in rows if 0 <= int(r["answer"]) <= 9), n))


ITEMS = 4  # per layout: every figure and layout is checked at this size (see K above)


def write_benches(where: pathlib.Path) -> list[str]:
    """ITEMS items per layout; the MATH-500 file also holds two malformed rows."""
    rows = problems(ITEMS)
    rng = np.random.default_rng(0)
    files = {
        "math500": [{"problem": r["prompt"], "answer": r["answer"]} for r in rows],
        "aime": [{"question": r["prompt"], "answer": int(r["answer"])} for r in rows],
        "gsm8k": [{"question": r["prompt"], "answer": r["solution"]} for r in rows],
        "arc": [],
    }
    for r in one_step_problems(ITEMS):
        value = int(r["answer"])
        options, order = [value, (value + 3) % 10], rng.permutation(2)
        files["arc"].append(
            {
                "question": r["prompt"],
                "choices": {"text": [str(options[i]) for i in order], "label": ["1", "2"]},
                "answerKey": str(int(np.flatnonzero(order == 0)[0]) + 1),
            }
        )
    for name, lines in files.items():
        text = "".join(json.dumps(x) + "\n" for x in lines)
        if name == "math500":
            text += '{"problem": "1+1"}\nnot json\n'
        (where / f"{name}.jsonl").write_text(text)
    return [f"{where}/math500.jsonl:math500", f"{where}/aime.jsonl:aime", f"{where}/gsm8k.jsonl:gsm8k"] + [
        f"{where}/arc.jsonl:arc"
    ]


@pytest.fixture(scope="module")
def checkpoints(reference_run, tmp_path_factory) -> dict:
    """A run directory and its Hugging Face export: the session's reference smoke run (trained 4
    steps, so not the shipped weights; tests/smoke_run.py) and what its ``--export-hf`` wrote, read
    in place (evaluate writes only under ``--out``). The benchmark files are written here."""
    benches = tmp_path_factory.mktemp("benches")
    return {"run": reference_run.run, "hf": reference_run.hf, "specs": write_benches(benches)}


def run_main(argv: list[str]) -> int:
    """The command's exit code, also where argparse exits on a usage error."""
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code or 0)


@pytest.fixture(scope="module")
def run_report(checkpoints, tmp_path_factory) -> tuple[str, dict]:
    out = tmp_path_factory.mktemp("run_eval")
    argv = ["--checkpoint", str(checkpoints["run"]), "--out", str(out), *SAMPLED]
    assert main([*argv, *(a for s in checkpoints["specs"] for a in ("--bench", s))]) == 0
    return (out / "eval.md").read_text(), json.loads((out / "eval.json").read_text())


def regrade(kind: str, response: str, reference: str) -> float:
    if kind == "choice":
        return float(extract_choice(response) == reference)
    return grade_math(response, reference) if kind == "math" else grade_number(response, reference)


@pytest.mark.slow
def test_figures_equal_hand_computed_from_the_recorded_samples(run_report):
    table, report = run_report
    assert report["checkpoint"]["kind"] == "run" and report["checkpoint"]["step"] == smoke_run.STEPS
    sampling = {"k": K, "temperature": 1.0, "top_p": 1.0, "max_tokens": MAX_TOKENS, "seed": 0}
    assert report["sampling"] == sampling
    assert report["config"]["rollout"]["max_len"] == 64  # the reference run's cache (see K above)
    (variant,) = report["results"]
    assert variant == "w4a16 (deployed)"
    by_hand_pass2 = {0: 0.0, 1: 1 - 3 / 6, 2: 1 - 1 / 6, 3: 1.0, 4: 1.0}  # 1 - C(4-c, 2) / C(4, 2)
    averages = []
    for name, info in report["benchmarks"].items():
        records = report["samples"][variant][name]
        assert [r["index"] for r in records] == list(range(info["items"]))
        grades, n_correct, maj, tokens, truncated = [], [], [], [], []
        for r in records:
            assert len(r["samples"]) == K
            g = [s["grade"] for s in r["samples"]]
            assert g == [regrade(info["grader"], s["response"], r["reference"]) for s in r["samples"]]
            grades += g
            n_correct.append(sum(x == 1.0 for x in g))
            votes = collections.Counter(s["answer"] for s in r["samples"] if s["answer"] is not None)
            order = [s["answer"] for s in r["samples"]]
            best = sorted(votes, key=lambda a: (-votes[a], order.index(a)))
            maj.append(g[order.index(best[0])] if best else 0.0)
            tokens += [s["tokens"] for s in r["samples"]]
            truncated += [s["finish"] == "length" for s in r["samples"]]
        figures = report["results"][variant][name]
        assert figures["items"] == info["items"] and figures["samples"] == K
        assert figures["pass@1"] == pytest.approx(sum(grades) / len(grades), abs=1e-12)
        assert figures["pass@2"] == pytest.approx(np.mean([by_hand_pass2[c] for c in n_correct]), abs=1e-12)
        assert figures["pass@4"] == pytest.approx(np.mean([c > 0 for c in n_correct]), abs=1e-12)
        assert figures["maj@4"] == pytest.approx(np.mean(maj), abs=1e-12)
        assert figures["mean_length"] == pytest.approx(np.mean(tokens), abs=1e-12)
        assert figures["truncation_rate"] == pytest.approx(np.mean(truncated), abs=1e-12)
        averages.append(100 * figures["pass@1"])
    # the policy solves some arithmetic, not all (a test that cannot fail would not show it)
    assert 0 < report["results"][variant]["math500"]["pass@1"] < 1
    assert 0 < report["results"][variant]["gsm8k"]["pass@4"] <= 1
    header, rule, row = table.splitlines()
    assert header == "| pass@1 | math500 | aime | gsm8k | arc | avg |" and rule.count("---") == 6
    cells = [f"{v:.1f}" for v in averages] + [f"{np.mean(averages):.1f}"]
    assert row == f"| {variant} | " + " | ".join(cells) + " |"
    # the two malformed rows: counted, named, not evaluated
    math500 = report["benchmarks"]["math500"]
    assert math500["items"] == ITEMS and math500["skipped"] == {"missing_field": 1, "bad_json": 1}
    assert [r.split(": ")[1] for r in math500["skipped_rows"]] == ["missing_field", "bad_json"]
    assert math500["skipped_rows"][0].split(": ")[0].endswith(f"math500.jsonl:{ITEMS + 1}")


@pytest.mark.slow
def test_the_export_on_one_device_gives_the_runs_table_and_samples(run_report, checkpoints, tmp_path):
    """The run's Hugging Face export, evaluated in a subprocess on 1 device, against the run
    directory evaluated in process on 8: the same table, figures and samples. Either difference
    alone (the export's weights, or the layout) would show here."""
    table, report = run_report
    same = lambda r: (r["results"], r["samples"], r["benchmarks"])
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    argv = [sys.executable, "-m", "qarl_jax.evaluate", "--checkpoint", str(checkpoints["hf"])]
    argv += [
        "--out",
        str(tmp_path / "one"),
        *SAMPLED,
        *(a for s in checkpoints["specs"] for a in ("--bench", s)),
    ]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == table == (tmp_path / "one" / "eval.md").read_text()
    hf_report = json.loads((tmp_path / "one" / "eval.json").read_text())
    assert same(hf_report) == same(report) and hf_report["checkpoint"]["kind"] == "huggingface"


def test_bad_inputs_are_one_line(checkpoints, tmp_path, capsys):
    math500 = checkpoints["specs"][0].split(":")[0]
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"prompt": "1+1", "solution": "2"}\n')
    cases = [
        ([f"{math500}:nope"], 2, "unknown preset 'nope'"),
        ([f"{math500}:math:colour=x"], 2, "'colour=x' is not FIELD=KEY"),
        ([str(tmp_path / "missing.jsonl")], 4, "does not exist"),
        ([str(empty)], 4, "no row has the fields preset 'math' reads"),
        ([math500, "--k", "2"], 2, "greedy samples are all the same"),
        ([math500, "--k", "2", "--temperature", "1", "--pass-k", "4"], 2, "pass@4 needs at least"),
        ([math500, "--table", "pass@8"], 2, "'pass@8' is not a computed figure"),
        ([math500, "--top-p", "1.5"], 2, "must be in (0, 1]"),
        ([math500, "--checkpoint", str(tmp_path)], 3, "neither a Hugging Face model directory"),
        ([math500, "model.param_dtype=bfloat16"], 2, "a run's model section describes its weights"),
        ([math500, "--out", str(empty)], 5, "exists and is not a directory"),
    ]
    for extra, code, message in cases:
        bench, *rest = extra
        argv = [
            "--checkpoint",
            str(checkpoints["run"]),
            "--out",
            str(tmp_path / "o"),
            "--bench",
            bench,
            *rest,
        ]
        assert run_main(argv) == code, (extra, capsys.readouterr().err)
        err = capsys.readouterr().err.strip().splitlines()
        assert message in err[-1] and "Traceback" not in "".join(err), (extra, err)
    assert run_main(["--bench", math500, "--out", str(tmp_path)]) == 2  # --checkpoint is required
    assert "--checkpoint" in capsys.readouterr().err


def test_pass_at_k_and_majority_by_hand():
    assert pass_at_k(4, 1, 2) == 0.5  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is c / n
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 1, 8) == 1.0 and pass_at_k(8, 6, 3) == 1.0
    assert pass_at_k(16, 4, 4) == pytest.approx(1 - math.comb(12, 4) / math.comb(16, 4))
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)
    assert majority(["1", "2", "2", None], [1.0, 0.0, 0.0, 0.0]) == 0.0  # "2" has two votes
    assert majority(["3", "4", "4", "3"], [1.0, 0.0, 0.0, 1.0]) == 1.0  # a tie: the first given wins
    assert majority([None, "5", None, None], [0.0, 1.0, 0.0, 0.0]) == 1.0  # no answer never wins
    assert majority([None, None], [0.0, 0.0]) == 0.0


def test_multiple_choice_grader():
    chosen = {
        "so \\boxed{B}": "B",
        "\\boxed{(C)} since": "C",
        "\\boxed{\\text{D}}": "D",
        "The answer is (A).": "A",
        "answer: J because": "J",
        "I think so.\nB": "B",
        "(E)": "E",
        "I think it is 4": None,  # a letter in a word is no choice
        "the answer is Bob": None,
        "\\boxed{K}": None,  # not among A-J
        "": None,
    }
    for response, letter in chosen.items():
        assert extract_choice(response) == letter, response
    assert grade_choice("The answer is (B)", "B") == 1.0 and grade_choice("\\boxed{A}", "B") == 0.0


def test_layouts(tmp_path):
    path = tmp_path / "b.jsonl"
    rows = [
        {"question": "Q1", "options": ["a", "b", "c"], "answer": "C"},  # MMLU-Pro: a letter
        {"question": "Q2", "options": ["a", "b"], "answer": 1},  # an index
        {"question": "Q3", "choices": {"text": ["x", "y"], "label": ["1", "2"]}, "answerKey": "2"},  # ARC
        {"question": "Q4", "options": ["a", "b"], "answer": "Z"},
        {"question": "Q5", "options": ["a"], "answer": "A"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bench = read_benchmark(f"{path}:mmlu_pro")
    assert [(i.answer, i.question.splitlines()[-1]) for i in bench.items] == [
        ("C", "C. c"),
        ("B", "B. b"),
        ("B", "B. y"),
    ]
    assert bench.skipped == {"bad_answer": 1, "bad_choices": 1} and bench.kind == "choice"
    assert bench.items[0].question == "Q1\n\nA. a\nB. b\nC. c"
    gpqa = {"Question": "Q", "Correct Answer": "r", **{f"Incorrect Answer {i}": f"w{i}" for i in (1, 2, 3)}}
    path.write_text(json.dumps(gpqa) + "\n" + json.dumps(gpqa | {"Question": "Other"}) + "\n")
    items = read_benchmark(f"{path}:gpqa").items
    assert items == read_benchmark(f"{path}:gpqa").items  # the same order every time
    for item in items:
        assert f"{item.answer}. r" in item.question.splitlines()
    path.write_text('{"problem": "p", "final_answer": ["$\\\\frac{1}{2}$"]}\n{"q": "x", "sol": "#### 7"}\n')
    assert [(i.question, i.answer) for i in read_benchmark(f"{path}:olympiadbench").items] == [
        ("p", "$\\frac{1}{2}$")
    ]
    renamed = read_benchmark(f"{path}:gsm8k:question=q,answer=sol")
    assert [(i.question, i.answer) for i in renamed.items] == [("x", "7")] and renamed.skipped == {
        "missing_field": 1
    }
    with pytest.raises(DataError, match="b.jsonl:1: missing_field"):
        read_benchmark(f"{path}:gsm8k:question=q,answer=sol", strict=True)
    with pytest.raises(ConfigError, match="not multiple choice"):
        parse_spec(f"{path}:math:choices=x")


def test_a_benchmark_file_in_a_bucket_reads_as_from_disk(tmp_path, gcs_bucket):
    """``--bench gs://BUCKET/FILE:PRESET:FIELD=KEY``: the scheme's colon is not a separator; the items,
    rejections and name are the disk copy's (origins name the file); a missing one, or another
    scheme, is one line."""
    from qarl_jax.storage import epath

    text = '{"q": "x", "sol": "#### 7"}\n{"problem": "p"}\n{"q": "y", "sol": "#### -2"}\n'
    (tmp_path / "b.jsonl").write_text(text)
    epath.Path(f"{gcs_bucket}/bench/b.jsonl").write_text(text)
    disk = read_benchmark(f"{tmp_path}/b.jsonl:gsm8k:question=q,answer=sol")
    remote = read_benchmark(f"{gcs_bucket}/bench/b.jsonl:gsm8k:question=q,answer=sol")
    assert str(remote.path) == f"{gcs_bucket}/bench/b.jsonl" and remote.name == disk.name == "b"
    assert [(i.question, i.answer) for i in remote.items] == [("x", "7"), ("y", "-2")]
    assert [(i.question, i.answer) for i in remote.items] == [(i.question, i.answer) for i in disk.items]
    assert remote.items[1].id == f"{gcs_bucket}/bench/b.jsonl:3" and remote.skipped == disk.skipped
    assert parse_spec(f"{gcs_bucket}/bench/b.jsonl")[1] == "math"  # no preset: the default
    with pytest.raises(DataError, match=f"^benchmark file {gcs_bucket}/bench/none.jsonl does not exist$"):
        read_benchmark(f"{gcs_bucket}/bench/none.jsonl:aime")
    with pytest.raises(ConfigError, match="^--bench s3://b/f.jsonl: s3:// is not a storage"):
        parse_spec("s3://b/f.jsonl:aime")


def test_weights_variants():
    config = load_config(SMOKE)
    assert list(variants(config, "both")) == ["w4a16 (deployed)", "bf16"]
    assert variants(config, "bf16")["bf16"].fmt == "bf16"
    bf16_run = load_config(SMOKE, ["quant.fmt=bf16"])
    assert list(variants(bf16_run, "both")) == ["bf16 (deployed)"]


def test_a_made_up_next_question_is_not_graded(tmp_path):
    """The plain template's stop string (lm-eval's GSM8K ``until: ["Question:"]``): a response that
    went on to a made-up "Question:" and answered it is read up to the stop, so its own answer (5)
    is graded and voted, not the made-up one (7) the last anchor would otherwise give."""
    from qarl_jax.data import build_arithmetic_tokenizer
    from qarl_jax.data.templates import cut_at_stop, stop_strings
    from qarl_jax.evaluate.benchmarks import Benchmark, Item
    from qarl_jax.evaluate.run import _records
    from qarl_jax.rewards import Grader
    from qarl_jax.rollout.driver import Sample

    assert stop_strings("plain") == ("Question:",) and stop_strings("qwen3_chat") == ()
    assert cut_at_stop("#### 5\nQuestion: 2+2\nQuestion:", ("Question:",)) == "#### 5\n"
    tokenizer = build_arithmetic_tokenizer()
    texts = [" 2+3=5\n#### 5\nQuestion:", " 2+3=5\n#### 5\nQuestion: 3+4\nAnswer: #### 7"]
    samples = [[Sample(0, i, tokenizer.encode(t).ids, [], [], "greedy", f) for i, (t, f) in
                enumerate(zip(texts, ("stop_string", "length"), strict=True))]]  # fmt: skip
    bench = Benchmark("b", tmp_path / "b.jsonl", "gsm8k", "synthetic", [Item("b:1", "2+3", "5")], [])
    with Grader() as grader:  # "synthetic" grades in-process
        (cut,) = _records(bench, [0], samples, tokenizer, grader, stop_strings("plain"))
        (uncut,) = _records(bench, [0], samples, tokenizer, grader, ())
    assert [(s["response"], s["answer"], s["grade"]) for s in cut["samples"]] == [
        (" 2+3=5\n#### 5\n", "5", 1.0),
        (" 2+3=5\n#### 5\n", "5", 1.0),
    ]
    assert [(s["answer"], s["grade"]) for s in uncut["samples"]] == [("5", 1.0), ("7", 0.0)]
