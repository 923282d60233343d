"""The TFDS path: GSM8K prepared offline into a temp data_dir, read through tfds.data_source and the pipeline.

All TFDS tests live here (TensorFlow Datasets is slow to import).
"""

import json
import socket

import pytest

from qarl_jax.data import DataConfig, build_arithmetic_tokenizer, build_pipeline
from qarl_jax.data.records import Rejected


@pytest.fixture(scope="module")
def tfds_dir(gsm8k_dir, tmp_path_factory):
    """GSM8K prepared once, with every network connection refused."""
    from qarl_jax.data.tfds_source import prepare_gsm8k_local

    data_dir = tmp_path_factory.mktemp("tfds")
    real_connect = socket.socket.connect

    def no_network(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            raise OSError(f"network disabled in this test: {address}")
        return real_connect(sock, address)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", no_network)
        prepare_gsm8k_local(gsm8k_dir, data_dir)
    return data_dir


def test_offline_gsm8k_has_tfds_features_and_every_row(tfds_dir, gsm8k_dir):
    import tensorflow_datasets as tfds
    from tensorflow_datasets.text.gsm8k import gsm8k as stock

    from qarl_jax.data.tfds_source import Gsm8kLocal

    ours = Gsm8kLocal(data_dir=str(tfds_dir)).info
    assert ours.features.to_json() == stock.Gsm8k(data_dir=str(tfds_dir / "stock")).info.features.to_json()
    assert {s: ours.splits[s].num_examples for s in ours.splits} == {
        "train": 7473,
        "test": 1319,
        "test_socratic": 1319,
    }
    data = tfds.data_source("gsm8k_local", split="test", data_dir=str(tfds_dir))
    rows = {(data[i]["question"].decode(), data[i]["answer"].decode()) for i in range(len(data))}
    jsonl = {(r["question"], r["answer"]) for r in map(json.loads, (gsm8k_dir / "test.jsonl").open())}
    assert rows == jsonl
    row = data[0]
    assert row["short_answer"].decode() == row["answer"].decode().split("#### ")[1]


def test_tfds_pipeline_batches_and_restores(tfds_dir, gsm8k_dir):
    tok = build_arithmetic_tokenizer()
    base = dict(source="tfds", tfds_name="gsm8k_local", path=str(gsm8k_dir), tfds_data_dir=str(tfds_dir))
    cfg = DataConfig(**base, split="test", batch_size=8, max_prompt_tokens=4096, seed=5)
    it = build_pipeline(cfg, tok)
    first = next(it)
    assert first["id"][0].startswith("gsm8k_local/test:") and all(
        a.lstrip("-").isdigit() for a in first["answer"]
    )
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it)["id"] for _ in range(3)]
    restored = build_pipeline(cfg, tok)
    restored.set_state(state)
    assert [next(restored)["id"] for _ in range(3)] == expected
    short = DataConfig(**base, answer_key="short_answer", answer_format="plain", num_epochs=1, batch_size=512)
    everything = build_pipeline(short, tok)
    assert sum(len(b["id"]) for b in everything) + everything.stats().get("too_long", 0) == 7473
    assert set(everything.stats()) == {"too_long"}  # a 512-character cap with a character tokenizer


def test_tfds_source_rejects_broken_rows():
    from qarl_jax.data.tfds_source import TfdsSource

    rows = [
        {"question": b"ok?", "answer": b"#### 3"},
        {"question": b"\xff\xfe", "answer": b"#### 3"},
        {"answer": b"#### 3"},
        {"question": b"q", "answer": b"no marker"},
    ]
    src = TfdsSource(rows, "fake", "train", "question", "answer", "gsm8k")
    assert src[0] == {"prompt": "ok?", "answer": "3", "id": "fake/train:0"}
    assert [src[i].reason for i in range(1, 4)] == ["bad_utf8", "missing_field", "bad_answer"]
    assert all(isinstance(src[i], Rejected) for i in range(1, 4))
