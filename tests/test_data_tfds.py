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


@pytest.mark.parametrize("process", [0, 1])
def test_process_0_prepares_first_the_others_after_the_barrier(
    tfds_dir, gsm8k_dir, tmp_path, monkeypatch, process
):
    """Two processes, seen from each (a real two-process run costs minutes here): JAX's process
    index and count and its barrier are stood in for; TFDS is real. Process 0 runs TFDS's
    ``download_and_prepare`` before the barrier; process 1 only after it, and then on a shared
    ``data_dir`` reuses process 0's copy (no file rewritten), on its own disk prepares its own."""
    import jax
    from jax.experimental import multihost_utils

    from qarl_jax.data.tfds_source import PREPARED_BARRIER, tfds_source

    events = _recorded_prepares(monkeypatch)
    monkeypatch.setattr(jax, "process_index", lambda: process)
    monkeypatch.setattr(multihost_utils, "sync_global_devices", lambda name: events.append(name))
    files = lambda d: {p: p.stat().st_mtime_ns for p in d.rglob("*") if p.is_file()}  # noqa: E731
    shared = files(tfds_dir)
    source = tfds_source("gsm8k_local", "test", str(tfds_dir), "question", "answer", "gsm8k", str(gsm8k_dir))
    assert events.index(PREPARED_BARRIER) == (len(events) - 1 if process == 0 else 0)
    assert "download_and_prepare" in events and files(tfds_dir) == shared
    questions = {json.loads(line)["question"] for line in (gsm8k_dir / "test.jsonl").open()}
    assert len(source) == 1319 and {source[i]["prompt"] for i in range(1319)} == questions
    if process == 1:  # a host's own data_dir: nothing there yet, so it prepares its own copy
        (tmp_path / "src").mkdir()
        (tmp_path / "src" / "test.jsonl").write_bytes((gsm8k_dir / "test.jsonl").read_bytes())
        own = tfds_source(
            "gsm8k_local", "test", str(tmp_path / "own"), "question", "answer", "gsm8k", str(tmp_path / "src")
        )
        assert len(own) == 1319 and files(tmp_path / "own")


def test_a_bucket_data_dir_is_prepared_once_and_read_from_each_hosts_disk(
    gsm8k_dir, gcs_bucket, tmp_path, monkeypatch
):
    """``tfds_data_dir=gs://...`` on two hosts, seen from each in turn (JAX's process index and
    count and its barrier stood in for; TFDS and the GCS API server real): process 0 prepares into
    its own disk's mirror and uploads the prepared copy before the barrier; process 1, another
    host's disk, prepares nothing and reads the copy it downloads after the barrier; a later run on
    a fresh host prepares nothing either."""
    import fsspec
    import jax
    import tensorflow_datasets as tfds
    from jax.experimental import multihost_utils

    from qarl_jax.data.tfds_source import INFO, PREPARED_BARRIER, local_mirror, tfds_source

    events = _recorded_prepares(monkeypatch)
    monkeypatch.setattr(multihost_utils, "sync_global_devices", lambda name: events.append(name))
    (tmp_path / "src").mkdir()  # the test split alone: a quick prepare
    (tmp_path / "src" / "test.jsonl").write_bytes((gsm8k_dir / "test.jsonl").read_bytes())
    data_dir = f"{gcs_bucket}/tfds-{tmp_path.name}"
    questions = {json.loads(line)["question"] for line in (gsm8k_dir / "test.jsonl").open()}

    def host(process: int, disk: str):
        events.clear()
        monkeypatch.setattr(jax, "process_index", lambda: process)
        monkeypatch.setattr(tfds.core.constants, "DATA_DIR", str(tmp_path / disk))
        source = tfds_source(
            "gsm8k_local", "test", data_dir, "question", "answer", "gsm8k", str(tmp_path / "src")
        )
        assert len(source) == 1319 and {source[i]["prompt"] for i in range(1319)} == questions
        assert str(local_mirror(data_dir)).startswith(str(tmp_path / disk))
        return list(events)

    assert host(0, "host0") == ["download_and_prepare", PREPARED_BARRIER]
    bucket, prefix = fsspec.core.url_to_fs(data_dir)
    uploaded = sorted(key.rsplit("/", 1)[-1] for key in bucket.find(prefix))
    assert INFO in uploaded and any(".array_record-" in n for n in uploaded)
    assert host(1, "host1") == [PREPARED_BARRIER]  # no prepare: the bucket's copy, downloaded

    def dataset(disk: str) -> dict:
        root = tmp_path / disk / "gs" / data_dir.removeprefix("gs://") / "gsm8k_local"
        return {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}

    assert host(0, "fresh") == [PREPARED_BARRIER]  # a later run's process 0: the bucket has it
    assert len(dataset("host0")) == len(uploaded)
    assert dataset("host1") == dataset("host0") and dataset("fresh") == dataset("host0")


def _recorded_prepares(monkeypatch) -> list[str]:
    """Two processes as far as the source can tell; each real ``download_and_prepare`` (and, by the
    caller's patch, each barrier) appended to the returned list in order."""
    import jax
    import tensorflow_datasets as tfds

    events: list[str] = []
    real_prepare = tfds.core.DatasetBuilder.download_and_prepare

    def prepare(builder, *args, **kwargs):
        events.append("download_and_prepare")
        return real_prepare(builder, *args, **kwargs)

    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", prepare)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    return events
