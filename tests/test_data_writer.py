"""The indexed-dataset writer's refusals and the reader's size check, at their exact boundaries."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from moe_train.data import DataError
from moe_train.data.indexed import IndexedDataset, IndexedDatasetWriter


@pytest.mark.parametrize(("dtype", "largest"), [(np.uint16, 65535), (np.int32, 2**31 - 1)])
def test_token_ids_at_the_dtype_limits(tmp_path: Path, dtype, largest: int) -> None:
    prefix = str(tmp_path / "ok")
    with IndexedDatasetWriter(prefix, dtype=dtype) as writer:
        writer.add_document([0, largest, 7])
    assert IndexedDataset(prefix)[0].tolist() == [0, largest, 7]
    for bad in (largest + 1, -1):
        with pytest.raises(ValueError, match=f"token ids out of range for {np.dtype(dtype)}"), \
                IndexedDatasetWriter(str(tmp_path / "bad"), dtype=dtype) as writer:
            writer.add_document([1, bad])
    assert sorted(os.listdir(tmp_path)) == ["ok.bin", "ok.idx"]  # the refused writes left nothing


def test_a_document_beyond_int32_tokens_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    prefix = str(tmp_path / "big")
    huge = np.broadcast_to(np.uint16(1), (2**31,))  # 2^31 tokens that take no memory
    start = time.monotonic()
    with pytest.raises(DataError, match=r"big: a document of 2147483648 tokens is beyond the format's int32 length"), \
            IndexedDatasetWriter(prefix) as writer:
        writer.add_document([1, 2])
        writer.append(huge)
    assert time.monotonic() - start < 5  # refused up front, not after writing 4 GiB
    assert os.listdir(tmp_path) == []


def test_a_bin_larger_than_its_index_promises(tmp_path: Path) -> None:
    prefix = str(tmp_path / "x")
    with IndexedDatasetWriter(prefix) as writer:
        writer.add_document(np.arange(100))
    with open(prefix + ".bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(DataError, match=r"x\.bin: corrupt data file \(202 bytes; the index promises 200\)"):
        IndexedDataset(prefix)
