"""Documents from tables: parquet files and Hugging Face `datasets` folders (`save_to_disk`), one row a document.

`data prepare` streams them as it streams JSONL: rows are read in batches (a parquet row group at a time, or
ROWS_PER_BATCH rows of a dataset), never the whole table, and progress is the share of rows read times the
input's bytes on disk, so one progress bar covers JSONL, text and tables alike. A null cell is an empty
document (skipped and counted, as an empty JSONL text is). pyarrow and datasets are imported only for such
inputs, so JSONL users need neither.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from moe_train.config.data_files import DataError

PARQUET_SUFFIX = ".parquet"
ROWS_PER_BATCH = 4096
# What save_to_disk leaves in a folder: state.json for one Dataset, dataset_dict.json for several splits.
DATASET_MARKERS = ("state.json", "dataset_dict.json")


def is_dataset_folder(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, name)) for name in DATASET_MARKERS)


def folder_bytes(path: str) -> int:
    return sum(file.stat().st_size for file in Path(path).rglob("*") if file.is_file())


def _check_text(path: str, row: int, column: str, value: object) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(f'{path}: row {row}: column "{column}" is {type(value).__name__}, not a string')
    return value


def _missing_column(path: str, column: str, columns: list[str]) -> DataError:
    return DataError(f'{path}: no "{column}" column (columns: {", ".join(columns)}; choose it with --text-field)')


def parquet_texts(path: str, column: str) -> Iterator[tuple[str, int]]:
    """Each row's text with the bytes of the file read so far (row groups' share of the file size)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    try:
        handle = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises ArrowInvalid (not an OSError) for a file that is not parquet
        raise DataError(f"{path}: not a readable parquet file ({str(error).splitlines()[0]})") from None
    columns = handle.schema_arrow.names
    if column not in columns:
        raise _missing_column(path, column, columns)
    size, total, row = os.path.getsize(path), max(handle.metadata.num_rows, 1), 0
    for batch in handle.iter_batches(batch_size=ROWS_PER_BATCH, columns=[column]):
        for value in batch.column(0).to_pylist():
            row += 1
            yield _check_text(path, row, column, value), size * row // total


def dataset_texts(path: str, column: str) -> Iterator[tuple[str, int]]:
    """Each row's text of a `save_to_disk` folder (read with `datasets.load_from_disk`), with bytes so far."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: reading a datasets folder needs datasets (pip install datasets)") from None
    try:
        dataset = datasets.load_from_disk(path)
    except Exception as error:  # a folder whose state.json or arrow files are damaged
        raise DataError(f"{path}: not a readable datasets folder ({str(error).splitlines()[0]})") from None
    if isinstance(dataset, datasets.DatasetDict):
        first = next(iter(dataset))
        raise DataError(f"{path}: holds the splits {', '.join(dataset)}; give one split's folder, e.g. {path}/{first}")
    if column not in dataset.column_names:
        raise _missing_column(path, column, dataset.column_names)
    size, total, row = folder_bytes(path), max(len(dataset), 1), 0
    for batch in dataset.select_columns([column]).with_format(None).iter(batch_size=ROWS_PER_BATCH):
        for value in batch[column]:
            row += 1
            yield _check_text(path, row, column, value), size * row // total
