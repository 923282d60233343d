"""The grain pipeline: restore, sharding, epochs, groups, over-long prompts, GSM8K with a BPE tokenizer."""

import collections
import json
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from qarl_jax.data import (
    DataConfig,
    MalformedRowError,
    SyntheticConfig,
    build_arithmetic_tokenizer,
    build_pipeline,
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def arith_tok():
    return build_arithmetic_tokenizer()


@pytest.fixture(scope="module")
def bpe_tok(gsm8k_dir):
    """A small BPE trained on GSM8K questions (what a real policy tokenizer looks like to the pipeline)."""
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=[*SPECIALS, "[UNK]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    questions = (json.loads(line)["question"] for line in (gsm8k_dir / "train.jsonl").open())
    tok.train_from_iterator(questions, trainer)
    return tok


def take(it, n):
    return [next(it) for _ in range(n)]


def ids_of(batches):
    return [i for b in batches for i in b["id"]]


def flat_tokens(batches):
    return [t.tolist() for b in batches for t in b["prompt_ids"]]


@pytest.mark.parametrize("shuffle", [True, False])
def test_restored_iterator_continues_with_the_same_records(arith_tok, shuffle):
    cfg = DataConfig(
        batch_size=5, samples_per_prompt=2, seed=3, shuffle=shuffle, synthetic=SyntheticConfig(size=13)
    )
    it = build_pipeline(cfg, arith_tok)
    take(it, 4)  # crosses the first epoch boundary (13 prompts)
    state = json.loads(json.dumps(it.get_state()))
    expected = take(it, 6)
    restored = build_pipeline(cfg, arith_tok)
    restored.set_state(state)
    got = take(restored, 6)
    assert ids_of(got) == ids_of(expected)
    assert flat_tokens(got) == flat_tokens(expected)
    fresh = take(build_pipeline(cfg, arith_tok), 6)
    assert ids_of(fresh) != ids_of(expected)  # the state really moved the stream


def test_restore_carries_skip_counts_and_rejects_other_versions(tmp_path, arith_tok, gsm8k_dir):
    path = tmp_path / "mixed.jsonl"
    lines = (gsm8k_dir / "test.jsonl").read_text().splitlines()[:20]
    lines[3] = '{"question": 1, "answer": "#### 1"}'
    path.write_text("\n".join(lines))
    cfg = DataConfig(source="jsonl", path=str(path), batch_size=4, max_prompt_tokens=200, seed=1)
    it = build_pipeline(cfg, arith_tok)
    take(it, 3)
    state = json.loads(json.dumps(it.get_state()))
    assert state["skipped"]["too_long"] > 0
    expected = take(it, 3)
    restored = build_pipeline(cfg, arith_tok)
    restored.set_state(state)
    assert ids_of(take(restored, 3)) == ids_of(expected)
    assert restored.stats() == it.stats() and it.stats()["wrong_type"] == 1
    with pytest.raises(ValueError, match="version"):
        restored.set_state({**state, "version": 0})


@pytest.mark.parametrize("shuffle", [True, False])
def test_host_shards_cover_every_record_exactly_once(arith_tok, gsm8k_dir, shuffle):
    base = dict(source="jsonl", path=str(gsm8k_dir / "test.jsonl"), batch_size=64, num_epochs=1)
    cfg = DataConfig(**base, shuffle=shuffle, max_prompt_tokens=4096)
    seen = collections.Counter()
    for shard in range(3):
        seen.update(ids_of(list(build_pipeline(cfg, arith_tok, shard_index=shard, shard_count=3))))
    expected = {f"{gsm8k_dir / 'test.jsonl'}:{line}" for line in range(1, 1320)}
    assert set(seen) == expected and set(seen.values()) == {1}
    with pytest.raises(ValueError, match="shard_index"):
        build_pipeline(cfg, arith_tok, shard_index=3, shard_count=3)


def test_epochs_reshuffle_and_end(arith_tok):
    cfg = DataConfig(batch_size=4, num_epochs=2, seed=0, synthetic=SyntheticConfig(size=10))
    ids = ids_of(list(build_pipeline(cfg, arith_tok)))
    assert len(ids) == 20 and collections.Counter(ids) == {f"synthetic:0:{i}": 2 for i in range(10)}
    assert ids[:10] != ids[10:] and sorted(ids[:10]) == sorted(ids[10:])
    ordered = DataConfig(batch_size=4, num_epochs=1, shuffle=False, synthetic=SyntheticConfig(size=10))
    assert ids_of(list(build_pipeline(ordered, arith_tok))) == [f"synthetic:0:{i}" for i in range(10)]


def test_samples_per_prompt_groups(arith_tok):
    cfg = DataConfig(batch_size=3, samples_per_prompt=4)
    batch = next(build_pipeline(cfg, arith_tok))
    assert len(batch["id"]) == 12
    np.testing.assert_array_equal(batch["group"], np.repeat(np.arange(3), 4))
    for g in range(3):
        rows = slice(4 * g, 4 * g + 4)
        assert len(set(batch["id"][rows])) == 1 and len(set(batch["answer"][rows])) == 1
        assert all(np.array_equal(t, batch["prompt_ids"][4 * g]) for t in batch["prompt_ids"][rows])
    assert batch["prompt_ids"][0].dtype == np.int32
    assert arith_tok.decode(batch["prompt_ids"][0].tolist()) == batch["text"][0]


def test_over_long_prompts_skip_or_raise(arith_tok):
    cfg = DataConfig(batch_size=8, max_prompt_tokens=25, synthetic=SyntheticConfig(size=200))
    it = build_pipeline(cfg, arith_tok)
    batches = take(it, 5)
    assert all(len(t) <= 25 for b in batches for t in b["prompt_ids"])
    assert it.stats()["too_long"] > 0
    strict = build_pipeline(DataConfig(**{**cfg.__dict__, "bad_rows": "error"}), arith_tok)
    with pytest.raises(MalformedRowError, match=r"synthetic:0:\d+: too_long: prompt has \d+ tokens"):
        take(strict, 5)
    nothing_fits = DataConfig(max_prompt_tokens=4, synthetic=SyntheticConfig(size=50))
    with pytest.raises(ValueError, match="whole epoch of rows was rejected"):
        next(build_pipeline(nothing_fits, arith_tok))


def test_real_gsm8k_with_chat_template_and_bpe(bpe_tok, gsm8k_dir):
    cfg = DataConfig(
        source="jsonl", path=str(gsm8k_dir / "train.jsonl"), template="qwen3_chat", batch_size=16
    )
    it = build_pipeline(cfg, bpe_tok)
    batch = next(it)
    assert len(batch["id"]) == 16 and not it.stats()
    start, end = bpe_tok.token_to_id("<|im_start|>"), bpe_tok.token_to_id("<|im_end|>")
    for ids, text in zip(batch["prompt_ids"], batch["text"], strict=True):
        assert ids[0] == start and list(ids).count(end) == 1
        assert bpe_tok.decode(ids.tolist(), skip_special_tokens=False) == text
        assert text.endswith("<|im_start|>assistant\n")


def test_package_import_does_not_load_tensorflow():
    code = (
        "import sys, qarl_jax.data, qarl_jax.rewards\n"
        "print([m for m in sys.modules if m.startswith('tensorflow')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
