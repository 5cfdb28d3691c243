"""GPT samples, epochs, the validation split, blending, global batches by data-parallel rank, position ids,
the mock source, the builtin corpus and the tokenizers."""

from __future__ import annotations

import json
import multiprocessing
import os
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import write_tokenizer

from moe_train.config.schema import Recipe
from moe_train.data import DataError, build_datasets, eod_id, global_batch, position_ids
from moe_train.data.builtin import builtin_prefix, corpus_files
from moe_train.data.indexed import IndexedDataset, IndexedDatasetWriter
from moe_train.data.tokenizer import ByteTokenizer, JsonTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOD = 256  # the byte tokenizer's
SEQ = 32


def make_recipe(data: dict, **train) -> Recipe:
    with open(os.path.join(ROOT, "recipes", "qwen3-tiny.yaml")) as f:
        raw = yaml.safe_load(f)
    raw["data"] = data
    raw["model"]["vocab_size"] = 60000
    raw["train"].update({"seq_length": SEQ, **train})
    return Recipe.model_validate(raw)


def traceable_dataset(prefix: str, count: int, base: int = 0, seed: int = 0) -> list[np.ndarray]:
    """Documents whose tokens name their position: document d holds base + 1000*d + 1, +2, ... then EOD.
    Every non-EOD token occurs once in the dataset, so samples can be traced back to where they came from."""
    rng = np.random.default_rng(seed)
    docs = [np.append(base + 1000 * d + 1 + np.arange(rng.integers(1, 200)), EOD) for d in range(count)]
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for doc in docs:
            writer.add_document(doc)
    return docs


def check_contiguous(sample: np.ndarray) -> None:
    """Consecutive tokens continue a document, or an EOD is followed by the start of a document."""
    for a, b in zip(sample[:-1], sample[1:], strict=True):
        assert (a != EOD and b in (a + 1, EOD)) or (a == EOD and b % 1000 == 1), (a, b)


@pytest.fixture
def dataset(tmp_path):
    prefix = str(tmp_path / "docs")
    return prefix, traceable_dataset(prefix, 60)


def test_windows_cover_each_epoch_once_and_reshuffle(dataset):
    prefix, docs = dataset
    source = build_datasets(make_recipe({"source": "indexed", "paths": [prefix]})).train
    total = sum(len(d) for d in docs)
    assert len(source) == (total - 1) // SEQ
    epochs = []
    for epoch in range(2):
        samples = [source.sample(epoch * len(source) + i) for i in range(len(source))]
        for s in samples:
            assert s.dtype == np.int64 and s.shape == (SEQ + 1,)
            check_contiguous(s)
        inputs = np.concatenate([s[:-1] for s in samples])
        words = inputs[inputs != EOD]
        assert len(np.unique(words)) == len(words)  # no token read twice within an epoch
        assert len(inputs) == len(source) * SEQ and total - len(inputs) <= SEQ  # only the tail is dropped
        epochs.append(samples)
    assert not all(np.array_equal(a, b) for a, b in zip(*epochs, strict=True))  # a new shuffle per epoch


def test_same_seed_same_samples_other_seed_other_order(dataset):
    prefix, _ = dataset
    data = {"source": "indexed", "paths": [prefix]}
    first = build_datasets(make_recipe(data)).train
    again = build_datasets(make_recipe(data)).train
    other = build_datasets(make_recipe(data, seed=7)).train
    indices = [0, 5, 17, len(first) + 3, 10 * len(first) + 1]  # resume far into later epochs, out of order
    assert all(np.array_equal(first.sample(i), again.sample(i)) for i in reversed(indices))
    assert not all(np.array_equal(first.sample(i), other.sample(i)) for i in indices)


def test_valid_split_is_disjoint(dataset):
    prefix, docs = dataset
    sets = build_datasets(make_recipe({"source": "indexed", "paths": [prefix], "valid_fraction": 0.1}))

    def documents_seen(source) -> set[int]:
        tokens = np.concatenate([source.sample(i) for i in range(len(source))])
        return set((tokens[tokens != EOD] // 1000).tolist())

    train, valid = documents_seen(sets.train), documents_seen(sets.valid)
    assert not train & valid
    assert len(valid) in (5, 6)  # 6 held-out documents; the epoch's dropped tail may hide at most one
    assert len(train | valid) >= len(docs) - 2


def test_no_valid_split_without_valid_fraction(dataset):
    prefix, _ = dataset
    assert build_datasets(make_recipe({"source": "indexed", "paths": [prefix]})).valid is None


def test_too_few_tokens_or_documents(tmp_path):
    prefix = str(tmp_path / "small")
    traceable_dataset(prefix, 1)
    with pytest.raises(DataError, match="too few to hold out data.valid_fraction"):
        build_datasets(make_recipe({"source": "indexed", "paths": [prefix], "valid_fraction": 0.5}))
    with pytest.raises(DataError, match=r"small: 1 documents, \d+ tokens: fewer than train.seq_length \+ 1"):
        build_datasets(make_recipe({"source": "indexed", "paths": [prefix]}, seq_length=4096))


def from_first(sample: np.ndarray) -> bool:
    """Whether a sample of two blended traceable datasets comes from the first (base 0) or the second."""
    return bool(sample[sample != EOD][0] < 30000)


def test_blending_follows_the_weights(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    traceable_dataset(a, 20, base=0)
    traceable_dataset(b, 20, base=30000, seed=1)
    source = build_datasets(make_recipe({"source": "indexed", "paths": [a, b], "weights": [0.7, 0.3]})).train

    picks = np.array([from_first(source.sample(i)) for i in range(3000)])
    assert picks.sum() == 2100
    # interleaved, not in runs: every 10 consecutive samples hold 7 from a
    assert set(picks.reshape(-1, 10).sum(axis=1)) == {7}


def test_blending_without_weights_follows_sizes(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    traceable_dataset(a, 30, base=0)
    traceable_dataset(b, 10, base=30000, seed=1)
    sets = build_datasets(make_recipe({"source": "indexed", "paths": [a, b]}))
    size_a = len(build_datasets(make_recipe({"source": "indexed", "paths": [a]})).train)
    share = np.mean([from_first(sets.train.sample(i)) for i in range(2000)])
    assert abs(share - size_a / len(sets.train)) < 0.02


def test_blended_weights_must_match_paths(dataset):
    prefix, _ = dataset
    with pytest.raises(DataError, match="data.weights: 1 weights for 2 data.paths"):
        build_datasets(make_recipe({"source": "indexed", "paths": [prefix, prefix], "weights": [1.0]}))


@pytest.mark.parametrize("dp_size", [2, 4, 8])
def test_dp_slices_concatenate_to_the_global_batch(dataset, dp_size):
    prefix, _ = dataset
    source = build_datasets(make_recipe({"source": "indexed", "paths": [prefix]})).train
    for step in (0, 3, 40):
        whole = global_batch(source, step=step, global_batch_size=16)
        assert whole.dtype == torch.int64 and whole.shape == (16, SEQ + 1)
        expected = np.stack([source.sample(i) for i in range(16 * step, 16 * (step + 1))])
        assert np.array_equal(whole.numpy(), expected)
        slices = [
            global_batch(source, step=step, global_batch_size=16, dp_rank=r, dp_size=dp_size) for r in range(dp_size)
        ]
        assert all(s.shape == (16 // dp_size, SEQ + 1) for s in slices)
        assert torch.equal(torch.cat(slices), whole)


def test_position_ids_restart_after_eod():
    tokens = torch.tensor([5, EOD, 7, 8, EOD, EOD, 9])
    assert position_ids(tokens, EOD).tolist() == [0, 1, 0, 1, 2, 0, 0]
    batch = torch.randint(0, 257, (3, 200))
    batch[batch > 240] = EOD
    positions = position_ids(batch, EOD)
    for row, pos in zip(batch.tolist(), positions.tolist(), strict=True):
        expected, p = [], 0
        for token in row:
            expected.append(p)
            p = 0 if token == EOD else p + 1
        assert pos == expected


def test_mock_source_is_seeded_and_in_vocab():
    data = {"source": "mock", "tokenizer": "byte", "valid_fraction": 0.01}
    sets = build_datasets(make_recipe(data, seq_length=2048))
    again = build_datasets(make_recipe(data, seq_length=2048))
    assert np.array_equal(sets.train.sample(12345), again.train.sample(12345))
    samples = np.stack([sets.train.sample(i) for i in range(8)])
    assert samples.min() >= 0 and samples.max() < 60000 and (samples == EOD).sum() > 0
    assert not np.array_equal(sets.train.sample(0), sets.train.sample(1))
    assert not np.array_equal(sets.train.sample(0), sets.valid.sample(0))
    assert build_datasets(make_recipe({"source": "mock"})).valid is None


def test_builtin_corpus_is_the_stdlib_and_cached(tmp_path):
    prefix = builtin_prefix(str(tmp_path), max_bytes=300_000)
    files = corpus_files(300_000)
    stdlib = sysconfig.get_paths()["stdlib"]
    assert all(f.startswith(stdlib) and "site-packages" not in f for f in files)
    assert sum(os.path.getsize(f) for f in files) <= 300_000
    dataset = IndexedDataset(prefix)
    assert dataset.num_documents == len(files)
    with open(files[0], "rb") as f:
        assert dataset[0].tolist() == list(f.read()) + [EOD]
    mtime = os.path.getmtime(prefix + ".bin")
    assert builtin_prefix(str(tmp_path), max_bytes=300_000) == prefix
    assert os.path.getmtime(prefix + ".bin") == mtime  # not rebuilt


@pytest.mark.slow
def test_builtin_concurrent_builders_agree(tmp_path):
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        prefixes = pool.starmap(builtin_prefix, [(str(tmp_path), 2_000_000)] * 4)
    assert len(set(prefixes)) == 1
    assert IndexedDataset(prefixes[0]).num_tokens > 1_000_000
    leftovers = [n for n in os.listdir(tmp_path / "builtin") if n.startswith(".building")]
    assert leftovers == []
    serial = builtin_prefix(str(tmp_path / "serial"), 2_000_000)  # one builder alone: the same bytes
    for suffix in (".bin", ".idx"):
        assert Path(prefixes[0] + suffix).read_bytes() == Path(serial + suffix).read_bytes(), suffix


def test_builtin_recipe_end_to_end(tmp_path):
    with open(os.path.join(ROOT, "recipes", "qwen3-tiny.yaml")) as f:
        recipe = Recipe.model_validate(yaml.safe_load(f))
    sets = build_datasets(recipe, cache_dir=str(tmp_path))
    assert eod_id(recipe) == EOD == sets.eod
    batch = global_batch(sets.train, step=0, global_batch_size=recipe.train.global_batch_size)
    assert batch.shape == (recipe.train.global_batch_size, recipe.train.seq_length + 1)
    assert batch.max() <= EOD
    corpus = b"".join(Path(path).read_bytes() for path in corpus_files())
    for row in batch.numpy():
        pieces = np.split(row, np.flatnonzero(row == EOD) + 1)  # each document's part, EOD last
        longest = max((piece[piece != EOD] for piece in pieces), key=len)
        assert len(longest) >= 64 and bytes(longest.astype(np.uint8)) in corpus
    assert len(sets.valid) > 0


def test_builtin_needs_the_byte_tokenizer(tmp_path):
    path = write_tokenizer(tmp_path)
    with pytest.raises(DataError, match="the builtin corpus is byte-tokenized"):
        build_datasets(make_recipe({"source": "builtin", "tokenizer": path}), cache_dir=str(tmp_path))


def test_tokenizers(tmp_path):
    byte = ByteTokenizer()
    assert byte.encode("aé") == [97, 195, 169] and (byte.eod, byte.vocab_size) == (256, 257)
    tok = JsonTokenizer(write_tokenizer(tmp_path))
    assert tok.eod == 1 and tok.vocab_size <= 500
    ids = tok.encode("import os\nprint(os.getcwd())")
    assert len(ids) < 28 and max(ids) < tok.vocab_size and tok.eod not in ids
    assert tok.encode_batch(["import os", "x = 1"]) == [tok.encode("import os"), tok.encode("x = 1")]


def test_tokenizer_eod_from_config_or_missing(tmp_path):
    path = write_tokenizer(tmp_path, special="<my_eos>")
    with pytest.raises(DataError, match="tokenizer.json: no end-of-document token"):
        JsonTokenizer(path)
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "<my_eos>"}, f)
    assert JsonTokenizer(path).eod == 1
    with pytest.raises(DataError, match="nope.json: tokenizer file not found"):
        JsonTokenizer(str(tmp_path / "nope.json"))


def test_builtin_cache_that_cannot_be_written(tmp_path):
    (tmp_path / "file").write_text("in the way")
    with pytest.raises(DataError, match="cannot build the builtin corpus here .*; set MOE_TRAIN_CACHE"):
        builtin_prefix(str(tmp_path / "file" / "cache"), max_bytes=10_000)
