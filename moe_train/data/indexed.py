"""Megatron's indexed dataset (.bin + .idx, "MMIDIDX" version 1): a memory-mapped reader and a streaming writer.

The .bin file is every sequence's tokens back to back; the .idx file (layout in config/data_files.py) says where each
sequence starts and which sequences form a document. Data preprocessed for Megatron-LM reads here unchanged, and
what the writer produces reads in Megatron-Core's own IndexedDataset. The reader checks the files' structure up
front (sizes, pointers, document indices) so that a truncated or corrupt dataset fails before training, with a
DataError naming the file, instead of as garbage tokens or a crash mid-run.
"""

from __future__ import annotations

import array
import os
import struct
from types import TracebackType

import numpy as np

from moe_train.config.data_files import (
    DTYPE_CODES,
    HEADER_FORMAT,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    DataError,
    bin_path,
    idx_path,
    read_index_header,
)

_CODE_OF_DTYPE = {np.dtype(name): code for code, (name, _) in DTYPE_CODES.items()}
_SCAN_TOKENS = 1 << 24  # tokens per chunk of check_token_range: each chunk's pages serve its max and its min


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The token dtype Megatron's preprocessing picks: uint16 below 65500 tokens, int32 otherwise."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


class IndexedDataset:
    """Read-only view of `prefix`.bin/.idx: sequences as numpy arrays over a memory map of the .bin."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        header = read_index_header(prefix)
        self.dtype = np.dtype(header.dtype)
        sequences, documents = header.sequence_count, header.document_count + 1
        index_file, data_file = idx_path(prefix), bin_path(prefix)

        arrays_size = sequences * (4 + 8) + documents * 8
        index_size = os.path.getsize(index_file)
        if index_size == HEADER_SIZE + arrays_size:
            has_modes = False
        elif index_size == HEADER_SIZE + arrays_size + sequences:
            has_modes = True
        else:
            raise DataError(
                f"{index_file}: truncated or corrupt index ({index_size} bytes; the header promises "
                f"{HEADER_SIZE + arrays_size} for {sequences} sequences and {documents - 1} documents)"
            )
        index = np.memmap(index_file, dtype=np.uint8, mode="r")
        offset = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(index, np.int32, sequences, offset)
        offset += 4 * sequences
        self.sequence_pointers = np.frombuffer(index, np.int64, sequences, offset)
        offset += 8 * sequences
        self.document_indices = np.frombuffer(index, np.int64, documents, offset)
        offset += 8 * documents
        self.sequence_modes = np.frombuffer(index, np.int8, sequences, offset) if has_modes else None

        # Token offset of every sequence start, plus the total at the end: sequences are stored back to back.
        if np.any(self.sequence_lengths < 0):
            raise DataError(f"{index_file}: corrupt index (negative sequence length)")
        self.sequence_starts = np.zeros(sequences + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, out=self.sequence_starts[1:])
        if not np.array_equal(self.sequence_pointers, self.sequence_starts[:-1] * self.dtype.itemsize):
            raise DataError(f"{index_file}: corrupt index (sequence pointers disagree with sequence lengths)")
        docs = self.document_indices
        if docs[0] != 0 or docs[-1] != sequences or np.any(np.diff(docs) < 0):
            raise DataError(f"{index_file}: corrupt index (document indices are not 0..{sequences} ascending)")

        expected = int(self.sequence_starts[-1]) * self.dtype.itemsize
        actual = os.path.getsize(data_file)
        if actual != expected:
            raise DataError(
                f"{data_file}: {'truncated' if actual < expected else 'corrupt'} data file "
                f"({actual} bytes; the index promises {expected})"
            )
        # np.memmap refuses empty files; an empty dataset has no tokens to map.
        self.tokens = np.memmap(data_file, dtype=self.dtype, mode="r") if expected else np.zeros(0, dtype=self.dtype)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.tokens[self.sequence_starts[index] : self.sequence_starts[index + 1]]

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_starts[-1])

    def document_token_starts(self) -> np.ndarray:
        """Token offset of each document's first token, plus the total at the end ([num_documents + 1])."""
        return self.sequence_starts[self.document_indices]

    def check_token_range(self, vocab_size: int) -> None:
        """Raise DataError if any token id is negative or >= vocab_size.

        One pass of numpy max (and min, for signed dtypes) over the memory map in chunks, so a .bin larger than
        memory is read from disk once, not once for the max and again for the min.
        """
        if self.num_tokens == 0:
            return
        info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        if info is None:
            raise DataError(f"{bin_path(self.prefix)}: token dtype {self.dtype} is not an integer type")
        # A dtype that cannot hold an out-of-range id needs no scan (e.g. uint16 tokens, vocab >= 65536).
        if info.min >= 0 and info.max < vocab_size:
            return
        high, low = 0, 0
        for start in range(0, self.num_tokens, _SCAN_TOKENS):
            chunk = self.tokens[start : start + _SCAN_TOKENS]
            high = max(high, int(chunk.max()))
            if info.min < 0:
                low = min(low, int(chunk.min()))
        if high >= vocab_size:
            raise DataError(
                f"{bin_path(self.prefix)}: token id {high} is beyond the vocabulary (model.vocab_size {vocab_size})"
            )
        if low < 0:
            raise DataError(f"{bin_path(self.prefix)}: negative token id {low}")


class IndexedDatasetWriter:
    """Write `prefix`.bin/.idx one document at a time, streaming tokens to disk; atomic on `close()`.

    Both files are written under temporary names and renamed into place at the end (.bin first, .idx last),
    so a reader never sees a half-written file, and a failure (an exception inside `with`) leaves nothing.
    Each document is stored as one sequence, as Megatron's preprocessing does without sentence splitting.
    """

    def __init__(self, prefix: str, dtype: np.dtype | type = np.uint16) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF_DTYPE:
            raise ValueError(f"unsupported token dtype {self.dtype}")
        directory = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(directory, exist_ok=True)
        suffix = f".tmp-{os.getpid()}"
        self._bin_tmp, self._idx_tmp = bin_path(prefix) + suffix, idx_path(prefix) + suffix
        self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115 (held across calls; closed by close/abort)
        self._lengths = array.array("i")  # 4 bytes a document, not a Python int's 28+: corpora have 1e8 of them
        self._open_length = 0  # tokens appended to the document not yet ended
        self.num_tokens = 0

    def append(self, tokens: np.ndarray | list[int]) -> None:
        """Add tokens to the current document (a long document can arrive in pieces)."""
        values = np.asarray(tokens)
        length = self._open_length + values.size
        if length > np.iinfo(np.int32).max:  # checked before writing: no gigabytes written to be thrown away
            raise DataError(f"{self.prefix}: a document of {length} tokens is beyond the format's int32 length")
        if values.size and (values.min() < 0 or values.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token ids out of range for {self.dtype}")
        self._bin.write(values.astype(self.dtype, copy=False).tobytes())
        self._open_length = length
        self.num_tokens += values.size

    def end_document(self) -> None:
        self._lengths.append(self._open_length)
        self._open_length = 0

    def add_document(self, tokens: np.ndarray | list[int]) -> None:
        self.append(tokens)
        self.end_document()

    @property
    def num_documents(self) -> int:
        return len(self._lengths)

    def close(self) -> None:
        """Write the index and move both files into place."""
        if self._open_length:
            self.end_document()
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], out=pointers[1:])
        pointers *= self.dtype.itemsize
        document_indices = np.arange(len(lengths) + 1, dtype=np.int64)
        with open(self._idx_tmp, "wb") as f:
            count = len(lengths)
            f.write(struct.pack(HEADER_FORMAT, MAGIC, VERSION, _CODE_OF_DTYPE[self.dtype], count, count + 1))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(document_indices.tobytes())
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(self._idx_tmp, idx_path(self.prefix))

    def abort(self) -> None:
        """Drop the temporary files; the prefix is left as it was."""
        self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
