"""Tokenize .jsonl, .txt, .parquet files and `datasets` folders into one Megatron indexed dataset, streaming
(`moe-train data prepare`).

Inputs:
- `.jsonl`: one document per line, a JSON object whose `text_field` (default "text") holds the text; blank
  lines are skipped.
- `.txt`: one document per file (a book, a source file). Long files are read and tokenized in pieces of whole
  lines, so memory stays bounded whatever the file size; the pieces join into one document.
- `.parquet` and folders written by Hugging Face `datasets`' save_to_disk: one document per row, its
  `text_field` column (data/sources_tables.py).

Each document is one sequence and, with append_eod (the default, as Megatron's --append-eod), ends in the
tokenizer's EOD. Empty documents are skipped and counted; input with no document at all is refused (DataError)
rather than written as a 0-document dataset that no run can sample from. Input is read in batches of about
BATCH_BYTES and never held whole; the output is written under temporary names and renamed into place only on
success.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from moe_train.config.data_files import DataError
from moe_train.data.indexed import IndexedDatasetWriter, dtype_for_vocab
from moe_train.data.sources_tables import PARQUET_SUFFIX, dataset_texts, folder_bytes, is_dataset_folder, parquet_texts
from moe_train.data.tokenizer import load_tokenizer

BATCH_BYTES = 1 << 20
SUFFIXES = (".jsonl", ".txt", PARQUET_SUFFIX)


@dataclass(frozen=True)
class PrepareSummary:
    documents: int
    empty_documents: int  # skipped
    tokens: int
    input_bytes: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


@dataclass(frozen=True)
class _Piece:
    """Text of one document, or of a part of one; `ends` marks its last piece."""

    text: str
    ends: bool


def check_inputs(inputs: Sequence[str]) -> int:
    """Raise DataError for a missing or unsupported input; return the inputs' total size in bytes."""
    if not inputs:
        raise DataError("INPUT: give at least one .jsonl, .txt or .parquet file or datasets folder")
    for path in inputs:
        if is_dataset_folder(path):
            continue
        if os.path.isdir(path):
            raise DataError(f"{path}: a folder but not one written by datasets' save_to_disk (no state.json)")
        if not path.endswith(SUFFIXES):
            raise DataError(f"{path}: unsupported input (expected a .jsonl, .txt or .parquet file or a datasets "
                            "folder)")
        if not os.path.isfile(path):
            raise DataError(f"{path}: input file not found")
    return sum(_input_bytes(path) for path in inputs)


def _input_bytes(path: str) -> int:
    return folder_bytes(path) if os.path.isdir(path) else os.path.getsize(path)


def _pieces(path: str, text_field: str) -> Iterator[tuple[_Piece, int]]:
    if os.path.isdir(path):
        return ((_Piece(text, True), done) for text, done in dataset_texts(path, text_field))
    if path.endswith(PARQUET_SUFFIX):
        return ((_Piece(text, True), done) for text, done in parquet_texts(path, text_field))
    return _jsonl_pieces(path, text_field) if path.endswith(".jsonl") else _txt_pieces(path)


def prepare(
    inputs: Sequence[str],
    output_prefix: str,
    *,
    tokenizer: str = "byte",
    text_field: str = "text",
    append_eod: bool = True,
    on_progress: Callable[[int], None] = lambda done: None,
) -> PrepareSummary:
    """Tokenize `inputs` into `output_prefix`.bin/.idx; on_progress receives the input bytes read so far."""
    started = time.perf_counter()
    total_bytes = check_inputs(inputs)
    tok = load_tokenizer(tokenizer)
    eod = [tok.eod] if append_eod else []
    done_before, empty = 0, 0
    with IndexedDatasetWriter(output_prefix, dtype_for_vocab(tok.vocab_size)) as writer:
        for path in inputs:
            pieces = _pieces(path, text_field)
            document_tokens = 0
            for batch, done in _batches(pieces):
                for piece, ids in zip(batch, tok.encode_batch([p.text for p in batch]), strict=True):
                    writer.append(ids)
                    document_tokens += len(ids)
                    if not piece.ends:
                        continue
                    if document_tokens:
                        writer.append(eod)
                        writer.end_document()
                    else:
                        empty += 1
                    document_tokens = 0
                on_progress(done_before + done)
            done_before += _input_bytes(path)
        documents, tokens = writer.num_documents, writer.num_tokens
        if not documents:  # raised inside the writer: it drops its temporary files, the prefix stays as it was
            skipped = f" ({empty} empty skipped)" if empty else ""
            raise DataError(f"{', '.join(inputs)}: no documents{skipped}, so no dataset was written to "
                            f"{output_prefix}.bin/.idx (a 0-document dataset cannot be trained on)")
    return PrepareSummary(documents, empty, tokens, total_bytes, time.perf_counter() - started)


def _batches(pieces: Iterator[tuple[_Piece, int]]) -> Iterator[tuple[list[_Piece], int]]:
    """Group pieces into batches of about BATCH_BYTES of text (one encode_batch call each)."""
    batch, size, done = [], 0, 0
    for piece, done in pieces:
        batch.append(piece)
        size += len(piece.text)
        if size >= BATCH_BYTES:
            yield batch, done
            batch, size = [], 0
    if batch:
        yield batch, done


def _jsonl_pieces(path: str, text_field: str) -> Iterator[tuple[_Piece, int]]:
    """Each non-blank line's text (a whole document), with the bytes of the file read so far."""
    done = 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            done += len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{number}: invalid JSON ({error.msg})") from None
            except UnicodeDecodeError:
                raise DataError(f"{path}:{number}: not UTF-8 text") from None
            if not isinstance(record, dict) or text_field not in record:
                raise DataError(f'{path}:{number}: no "{text_field}" field (choose it with --text-field)')
            text = record[text_field]
            if not isinstance(text, str):
                raise DataError(f'{path}:{number}: field "{text_field}" is {type(text).__name__}, not a string')
            yield _Piece(text, True), done


def _txt_pieces(path: str) -> Iterator[tuple[_Piece, int]]:
    """The file as one document, in pieces of whole lines of about BATCH_BYTES."""
    done, lines, size = 0, [], 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            done += len(line)
            try:
                lines.append(line.decode("utf-8"))
            except UnicodeDecodeError:
                raise DataError(f"{path}:{number}: not UTF-8 text") from None
            size += len(line)
            if size >= BATCH_BYTES:
                yield _Piece("".join(lines), False), done
                lines, size = [], 0
    yield _Piece("".join(lines), True), done
