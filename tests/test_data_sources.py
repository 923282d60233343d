"""Sources and config: synthetic task, JSONL (real GSM8K rows and broken rows), tokenizer, templates."""

import json
import pathlib

import numpy as np
import pytest

from qarl_jax.data import (
    BOXED_INSTRUCTION,
    DataConfig,
    JsonlSource,
    MalformedRowError,
    SyntheticArithmetic,
    SyntheticConfig,
    apply_template,
    build_arithmetic_tokenizer,
)
from qarl_jax.data.arith_tokenizer import UNK
from qarl_jax.data.synthetic import split_of
from qarl_jax.rewards import grade_number


def test_synthetic_is_deterministic_per_seed_and_index():
    cfg = SyntheticConfig(digits=3, steps=4, ops="+-*", size=50)
    a, b, c = SyntheticArithmetic(cfg, 7), SyntheticArithmetic(cfg, 7), SyntheticArithmetic(cfg, 8)
    assert [a[i] for i in range(50)] == [b[i] for i in range(50)]
    assert [a[i]["prompt"] for i in range(50)] != [c[i]["prompt"] for i in range(50)]
    assert a[3] == b[3] and a[3]["id"] == "synthetic:7:3"
    with pytest.raises(IndexError):
        a[50]


def test_synthetic_train_and_test_splits_are_disjoint_problem_sets():
    """One-digit, two-step problems number 4,000: the held-out split must never repeat a training one."""
    cfg = SyntheticConfig(digits=1, steps=2, ops="+-", size=3000)
    train = {SyntheticArithmetic(cfg, 0, "train")[i]["prompt"] for i in range(3000)}
    test = {SyntheticArithmetic(cfg, 1, "test")[i]["prompt"] for i in range(300)}
    assert train.isdisjoint(test) and len(train) > 1500 and len(test) > 100
    assert {split_of(p) for p in train} == {"train"} and {split_of(p) for p in test} == {"test"}
    with pytest.raises(ValueError, match="split must be one of"):
        SyntheticArithmetic(cfg, 0, "validation")
    with pytest.raises(ValueError, match="split: must be one of"):
        DataConfig(split="validation")


def test_synthetic_answers_match_an_independent_left_to_right_sum():
    src = SyntheticArithmetic(SyntheticConfig(digits=4, steps=5, ops="+-", size=200), 0)
    for i in range(200):
        record = src[i]
        tokens = record["prompt"].replace("-", " -").replace("+", " +").split()
        assert int(record["answer"]) == sum(int(t) for t in tokens)
        assert all(len(t.lstrip("+-")) <= 4 for t in tokens) and len(tokens) == 6


def test_synthetic_precedence_and_worked_solution():
    src = SyntheticArithmetic(SyntheticConfig(digits=2, steps=3, ops="*+", size=100), 1)
    saw_mixed = False
    for i in range(100):
        record = src[i]
        terms = record["prompt"].split("+")
        products = [product_of(t) for t in terms]
        assert int(record["answer"]) == sum(products)
        saw_mixed |= "*" in record["prompt"] and "+" in record["prompt"]
        lines = record["solution"].split("\n")
        assert len(lines) == 4 and lines[-1] == f"#### {record['answer']}"
        assert grade_number(record["solution"], record["answer"]) == 1.0
    assert saw_mixed


def product_of(term: str) -> int:
    value = 1
    for factor in term.split("*"):
        value *= int(factor)
    return value


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"source": "csv"}, "source"),
        ({"template": "chatml"}, "template"),
        ({"bad_rows": "ignore"}, "bad_rows"),
        ({"max_prompt_tokens": 0}, "max_prompt_tokens"),
        ({"batch_size": 2.5}, "batch_size"),
        ({"samples_per_prompt": 0}, "samples_per_prompt"),
        ({"num_epochs": 0}, "num_epochs"),
        ({"shuffle": "yes"}, "shuffle"),
        ({"source": "jsonl"}, "path"),
        ({"source": "tfds"}, "tfds_name"),
        ({"source": "tfds", "tfds_name": "gsm8k_local"}, "path"),
        ({"source": "tfds", "tfds_name": "gsm8k", "tfds_data_dir": "s3://b/tfds"}, "tfds_data_dir"),
        ({"answer_format": "latex"}, "answer_format"),
        ({"prompt_key": ""}, "prompt_key"),
        ({"synthetic": SyntheticConfig(digits=2)}, None),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    if field is None:
        DataConfig(**kwargs)
        return
    with pytest.raises(ValueError, match=rf"^{field}:"):
        DataConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"digits": 0}, "digits"), ({"digits": 19}, "digits"), ({"steps": 0}, "steps"), ({"ops": "+/"}, "ops")],
)
def test_synthetic_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=rf"^synthetic\.{field}:"):
        SyntheticConfig(**kwargs)


@pytest.mark.parametrize("split, rows", [("train", 7473), ("test", 1319)])
def test_jsonl_reads_real_gsm8k_rows(gsm8k_dir, split, rows):
    path = gsm8k_dir / f"{split}.jsonl"
    src = JsonlSource(path)
    assert len(src) == rows and not src.skipped
    first = json.loads(path.open().readline())
    assert src[0]["prompt"] == first["question"]
    assert src[0]["answer"] == first["answer"].split("####")[1].strip()
    assert src[rows - 1]["id"] == f"{path}:{rows}"
    assert all(src[i]["answer"].lstrip("-").replace(",", "").isdigit() for i in range(rows))


GOOD = {"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}


def write_broken_file(path: pathlib.Path) -> pathlib.Path:
    lines = [
        json.dumps(GOOD).encode(),  # 1
        json.dumps({"question": "no answer"}).encode(),  # 2 missing_field
        json.dumps({"question": 3, "answer": "#### 3"}).encode(),  # 3 wrong_type
        b'{"question": "caf\xe9 \xff", "answer": "#### 1"}',  # 4 bad_utf8
        b'{"question": "unterminated", "answer": ',  # 5 bad_json
        b"",  # 6 blank line: not a row
        json.dumps(["a", "list"]).encode(),  # 7 not_object
        json.dumps({"question": "q", "answer": "no marker"}).encode(),  # 8 bad_answer
        json.dumps({"question": "q", "answer": ["#### 1"]}).encode(),  # 9 wrong_type
        json.dumps({**GOOD, "question": "What is 3+3?"}).encode(),  # 10
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_jsonl_skips_and_counts_broken_rows(tmp_path):
    src = JsonlSource(write_broken_file(tmp_path / "broken.jsonl"))
    assert len(src) == 2 and [src[0]["answer"], src[1]["answer"]] == ["4", "4"]
    assert src[1]["id"].endswith("broken.jsonl:10")
    expected = {"missing_field": 1, "wrong_type": 2, "bad_utf8": 1, "bad_json": 1, "not_object": 1}
    assert dict(src.skipped) == {**expected, "bad_answer": 1}


def test_jsonl_error_policy_names_file_and_line(tmp_path):
    path = write_broken_file(tmp_path / "broken.jsonl")
    with pytest.raises(MalformedRowError, match=rf"{path}:2: missing_field"):
        JsonlSource(path, bad_rows="error")


def test_jsonl_all_rows_bad_is_an_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"not json\n\xff\n")
    with pytest.raises(ValueError, match="no valid rows"):
        JsonlSource(path)


def test_jsonl_generic_prompt_answer_form(tmp_path):
    path = tmp_path / "generic.jsonl"
    rows = [
        {"prompt": "1/2 + 1/4?", "answer": "\\frac{3}{4}"},
        {"prompt": "6*7?", "answer": 42},
        {"prompt": "x"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    src = JsonlSource(path, prompt_key="prompt", answer_key="answer", answer_format="plain")
    assert [src[i]["answer"] for i in range(len(src))] == ["\\frac{3}{4}", "42"]
    assert dict(src.skipped) == {"missing_field": 1}


def test_arithmetic_tokenizer_round_trips_and_saves(tmp_path):
    from tokenizers import Tokenizer

    tok = build_arithmetic_tokenizer()
    assert tok.get_vocab_size() == 128
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    record = SyntheticArithmetic(SyntheticConfig(ops="+-*", steps=3), 0)[5]
    for template in ("plain", "qwen3_chat"):
        text = apply_template(template, record["prompt"]) + record["solution"] + "<|im_end|>"
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.token_to_id(UNK) not in ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert loaded.encode(text).ids == ids
    assert tok.encode("é").ids == [tok.token_to_id(UNK)]


def test_templates():
    assert apply_template("plain", "2+2") == "Question: 2+2\nAnswer:"
    chat = apply_template("qwen3_chat", "2+2")
    assert chat == f"<|im_start|>user\n2+2\n{BOXED_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    assert "\\boxed{}" in BOXED_INSTRUCTION
    with pytest.raises(ValueError, match="template"):
        apply_template("chatml", "2+2")


def test_jsonl_in_a_bucket_is_read_by_the_pipeline_as_from_disk(gsm8k_dir, gcs_bucket):
    """``data.path`` on ``gs://`` (every host of a pod reads one copy): the pipeline's batches equal
    those of the same file on disk (ids aside: they name the file); a missing bucket file, and a
    URL that lost a slash, are one line naming them."""
    from qarl_jax.data import build_pipeline
    from qarl_jax.errors import ConfigError, DataError
    from qarl_jax.storage import epath

    disk = gsm8k_dir / "test.jsonl"
    remote = f"{gcs_bucket}/data/test.jsonl"
    epath.Path(remote).write_bytes(disk.read_bytes())
    tok = build_arithmetic_tokenizer()

    def batches(path) -> list[dict]:
        cfg = DataConfig(source="jsonl", path=str(path), batch_size=64, max_prompt_tokens=4096, seed=3)
        it = build_pipeline(cfg, tok)
        return [next(it) for _ in range(3)]

    def plain(v):  # a batch (dict of lists / arrays of arrays) as comparable Python values
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)) or (isinstance(v, np.ndarray) and v.dtype == object):
            return [plain(x) for x in v]
        return np.asarray(v).tolist()

    local, bucket = batches(disk), batches(remote)
    for a, b in zip(local, bucket, strict=True):
        assert [i.replace(str(disk), remote) for i in a.pop("id")] == list(b.pop("id"))
        assert plain(a) == plain(b)
    assert len(JsonlSource(remote)) == 1319
    with pytest.raises(DataError, match=rf"^data file {gcs_bucket}/data/missing.jsonl does not exist$"):
        JsonlSource(f"{gcs_bucket}/data/missing.jsonl")
    with pytest.raises(ConfigError, match=r"^data file gs:/qarl-tests/x.jsonl: gs:/ is not a storage"):
        JsonlSource("gs:/qarl-tests/x.jsonl")
