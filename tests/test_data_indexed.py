"""The indexed dataset format against Megatron-Core's own reader and writer, and every way the files can be bad."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import yaml

from moe_train.config.data_files import read_index_header
from moe_train.config.schema import Recipe
from moe_train.data import DataError, build_datasets
from moe_train.data.indexed import IndexedDataset, IndexedDatasetWriter

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core warns that transformer-engine and apex are absent
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronDataset
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder as MegatronBuilder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def documents(count: int, seed: int, high: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, rng.integers(0, 50)) for _ in range(count)]


def write(prefix: str, docs: list[np.ndarray], dtype=np.uint16) -> None:
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in docs:
            writer.add_document(doc)


def recipe_with_data(**data) -> Recipe:
    with open(os.path.join(ROOT, "recipes", "qwen3-tiny.yaml")) as f:
        raw = yaml.safe_load(f)
    raw["data"] = data
    return Recipe.model_validate(raw)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_our_writer_reads_in_megatron(tmp_path, dtype):
    prefix = str(tmp_path / "ours")
    docs = documents(40, seed=1, high=60000)
    write(prefix, docs, dtype)
    theirs = MegatronDataset(prefix)
    assert len(theirs) == len(docs)
    assert theirs.index.dtype == dtype
    assert list(theirs.document_indices) == list(range(len(docs) + 1))
    for i, doc in enumerate(docs):
        assert np.array_equal(theirs[i], doc)
    # and our own reader agrees
    ours = IndexedDataset(prefix)
    assert ours.num_documents == len(docs) and ours.num_tokens == sum(len(d) for d in docs)
    assert all(np.array_equal(ours[i], doc) for i, doc in enumerate(docs))


@pytest.mark.parametrize("multimodal", [False, True])
def test_megatron_writer_reads_here(tmp_path, multimodal):
    """Megatron's builder, including documents of several sequences (sentence split) and sequence modes."""
    prefix = str(tmp_path / "theirs")
    builder = MegatronBuilder(prefix + ".bin", dtype=np.uint16, multimodal=multimodal)
    sequences, boundaries, modes = [], [0], []
    for d, doc in enumerate(documents(25, seed=2, high=65535)):
        parts = np.array_split(doc, 1 + d % 3)  # 1-3 sequences per document
        for p, part in enumerate(parts):
            builder.add_item(torch.from_numpy(part.astype(np.int64)), mode=p % 2)
            sequences.append(part)
            modes.append(p % 2)
        builder.end_document()
        boundaries.append(len(sequences))
    builder.finalize(prefix + ".idx")

    ours = IndexedDataset(prefix)
    assert len(ours) == len(sequences)
    assert list(ours.document_indices) == boundaries
    assert ours.dtype == np.uint16
    for i, sequence in enumerate(sequences):
        assert np.array_equal(ours[i], sequence)
    if multimodal:
        assert list(ours.sequence_modes) == modes
    else:
        assert ours.sequence_modes is None
    header = read_index_header(prefix)
    assert (header.dtype, header.sequence_count, header.document_count) == ("uint16", len(sequences), 25)


def test_missing_files_name_the_file(tmp_path):
    prefix = str(tmp_path / "x")
    with pytest.raises(DataError, match=r"x\.idx: index file not found"):
        IndexedDataset(prefix)
    write(prefix, documents(3, 0, 100))
    os.remove(prefix + ".bin")
    with pytest.raises(DataError, match=r"x\.bin: data file not found"):
        read_index_header(prefix)


def test_truncated_bin(tmp_path):
    prefix = str(tmp_path / "x")
    write(prefix, [np.arange(100)])
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(150)
    with pytest.raises(DataError, match=r"x\.bin: truncated data file \(150 bytes; the index promises 200\)"):
        IndexedDataset(prefix)


@pytest.mark.parametrize("size", [0, 20, 60])
def test_truncated_idx(tmp_path, size):
    prefix = str(tmp_path / "x")
    write(prefix, documents(5, 0, 100))
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(size)
    with pytest.raises(DataError, match=r"x\.idx: truncated"):
        IndexedDataset(prefix)


@pytest.mark.parametrize(
    ("offset", "data", "message"),
    [
        (0, b"XXIDIDX", "bad magic"),
        (9, b"\x02", "unsupported index version 2"),
        (17, b"\x63", "unknown token dtype code 99"),
        (34 + 4 * 5 + 8, b"\x07", "sequence pointers disagree"),  # the second sequence pointer
        (34 + 12 * 5 + 8, b"\x09", "document indices"),  # the second document index
    ],
)
def test_corrupt_idx(tmp_path, offset, data, message):
    prefix = str(tmp_path / "x")
    write(prefix, [np.arange(n + 1) for n in range(5)])
    with open(prefix + ".idx", "r+b") as f:
        f.seek(offset)
        f.write(data)
    with pytest.raises(DataError, match=rf"x\.idx: .*{message}"):
        IndexedDataset(prefix)


def test_token_beyond_vocab_fails_in_build_datasets(tmp_path):
    prefix = str(tmp_path / "x")
    write(prefix, [np.arange(200), np.array([5, 300, 7, 256])])
    recipe = recipe_with_data(source="indexed", paths=[prefix], tokenizer="byte")
    with pytest.raises(DataError, match=r"x\.bin: token id 300 is beyond the vocabulary \(model.vocab_size 257\)"):
        build_datasets(recipe)


def test_missing_path_fails_in_build_datasets(tmp_path):
    recipe = recipe_with_data(source="indexed", paths=[str(tmp_path / "nope.bin")], tokenizer="byte")
    with pytest.raises(DataError, match=r"nope\.idx: index file not found"):
        build_datasets(recipe)


def test_writer_leaves_nothing_on_failure(tmp_path):
    prefix = str(tmp_path / "x")
    with pytest.raises(RuntimeError), IndexedDatasetWriter(prefix) as writer:
        writer.add_document([1, 2, 3])
        raise RuntimeError("input went bad")
    assert os.listdir(tmp_path) == []


def test_header_reader_imports_neither_numpy_nor_torch():
    code = (
        "import sys; from moe_train.config.data_files import read_index_header; from moe_train.data import DataError;"
        "print(sorted(m for m in ('numpy', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_negative_token_ids_are_refused(tmp_path):
    prefix = str(tmp_path / "signed")
    builder = MegatronBuilder(prefix + ".bin", dtype=np.int32)
    builder.add_item(torch.tensor([3, -5, 7]))
    builder.end_document()
    builder.finalize(prefix + ".idx")
    with pytest.raises(DataError, match=r"signed\.bin: negative token id -5"):
        IndexedDataset(prefix).check_token_range(257)


def test_sampling_megatron_data_keeps_multi_sequence_documents_whole(tmp_path):
    """Megatron data with sentence-split documents: a document's sequences stay together, in the same split."""
    prefix = str(tmp_path / "split_docs")
    builder = MegatronBuilder(prefix + ".bin", dtype=np.uint16)
    for d in range(40):
        doc = np.append(1000 * d + 1 + np.arange(150), 256)  # tokens name their document and position
        for part in np.array_split(doc, 3):
            builder.add_item(torch.from_numpy(part.astype(np.int64)))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    raw = recipe_with_data(source="indexed", paths=[prefix], valid_fraction=0.1).model_dump()
    raw["model"]["vocab_size"] = 60000
    sets = build_datasets(Recipe.model_validate(raw))

    def documents_of(source) -> set[int]:
        seen = set()
        for i in range(len(source)):
            sample = source.sample(i)
            words = sample[sample != 256]
            steps = np.diff(sample)
            # within a document tokens count up by one; a jump happens only right after an EOD
            assert all(s == 1 or a == 256 or b == 256 for s, a, b in zip(steps, sample[:-1], sample[1:], strict=True))
            seen |= set((words // 1000).tolist())
        return seen

    train, valid = documents_of(sets.train), documents_of(sets.valid)
    assert not train & valid and len(valid) >= 3 and len(train) >= 34
