"""What the login half knows of data files: the data layer's one error type, and the header of a Megatron
indexed dataset's .idx file, read with the standard library only.

The login-node `validate` checks data paths with this in well under a second, so it imports neither torch nor
numpy, and config/ never imports moe_train.data (the reader of the rest of the files, data/indexed.py, builds
on this). Layout of the header (little endian), as Megatron-Core writes it:

    9 bytes  magic b"MMIDIDX\\x00\\x00"
    u64      version (1)
    u8       dtype code of the tokens in the .bin (see DTYPE_CODES)
    u64      sequence count S
    u64      document-index count D + 1 (the document indices start with a leading 0)

followed by int32 sequence lengths [S], int64 byte pointers [S], int64 document indices [D + 1] and,
for multimodal datasets only, int8 sequence modes [S].
"""

from __future__ import annotations

import os
import struct
from typing import NamedTuple


class DataError(Exception):
    """A problem with the recipe's data (missing, truncated or corrupt files, token ids beyond the vocab).

    The message is one line and names the file or field, so that the CLI can print it as is and exit 2.
    """


MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_FORMAT = "<9sQBQQ"
HEADER_SIZE = struct.calcsize(HEADER_FORMAT)  # 34 bytes

# Megatron-Core's DType enum: code -> (numpy dtype name, item size in bytes).
DTYPE_CODES: dict[int, tuple[str, int]] = {
    1: ("uint8", 1),
    2: ("int8", 1),
    3: ("int16", 2),
    4: ("int32", 4),
    5: ("int64", 8),
    6: ("float64", 8),
    7: ("float32", 4),
    8: ("uint16", 2),
}


class IndexHeader(NamedTuple):
    """What the .idx header says about a dataset.

    `document_count` is the number of documents (one less than the header's count of document indices).
    """

    dtype: str
    sequence_count: int
    document_count: int


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def read_index_header(prefix: str) -> IndexHeader:
    """Read and check the header of `prefix`.idx (and that `prefix`.bin exists); raise DataError if bad."""
    path = idx_path(prefix)
    if not os.path.isfile(path):
        raise DataError(f"{path}: index file not found")
    if not os.path.isfile(bin_path(prefix)):
        raise DataError(f"{bin_path(prefix)}: data file not found")
    with open(path, "rb") as f:
        raw = f.read(HEADER_SIZE)
    if len(raw) < HEADER_SIZE:
        raise DataError(f"{path}: truncated index header ({len(raw)} of {HEADER_SIZE} bytes)")
    magic, version, code, sequence_count, document_indices = struct.unpack(HEADER_FORMAT, raw)
    if magic != MAGIC:
        raise DataError(f"{path}: not a Megatron indexed dataset index (bad magic bytes)")
    if version != VERSION:
        raise DataError(f"{path}: unsupported index version {version} (expected {VERSION})")
    if code not in DTYPE_CODES:
        raise DataError(f"{path}: unknown token dtype code {code}")
    if document_indices < 1:
        raise DataError(f"{path}: corrupt header: no document indices")
    return IndexHeader(DTYPE_CODES[code][0], sequence_count, document_indices - 1)
