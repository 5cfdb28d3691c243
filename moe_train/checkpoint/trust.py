"""Checkpoints are trusted input; this module narrows what one the run did not write itself can do when read.

A DCP checkpoint's index, `.metadata`, is a pickle, and DCP's FileSystemReader reads it with Python's full
unpickler, which runs whatever code a crafted file names. (Its tensors are read with torch.load(weights_only=True),
and our checkpoints hold no pickled byte items.) So:
- a run's own checkpoints (in its checkpoint folder, checked against their manifest first) are read with DCP's
  reader: a torch upgrade that adds a class to DCP's metadata never stops a run from resuming itself;
- every other checkpoint (`checkpoint.init_from`, a `checkpoint.resume` path outside the run's folder, the input
  of `convert to-hf`) goes through `RestrictedReader`, whose unpickler resolves only the classes DCP's metadata is
  made of (an allowlist, the Python documentation's "restricting globals" recipe) and refuses any other global
  with a CheckpointError naming it, before anything is constructed from the file.
This is a narrowing, not a sandbox: load only checkpoints from sources you trust (docs/interfaces.md).
"""

from __future__ import annotations

import collections
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from moe_train.checkpoint.layout import CheckpointError

_DCP_METADATA = (
    "Metadata", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
    "ChunkStorageMetadata", "MetadataIndex", "_MEM_FORMAT_ENCODING",
)
_ALLOWED: dict[tuple[str, str], Any] = {
    **{(dcp_metadata.__name__, name): getattr(dcp_metadata, name) for name in _DCP_METADATA},
    (dcp_filesystem.__name__, "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # looks a name up in torch's layouts
    ("collections", "OrderedDict"): collections.OrderedDict,
    **{("pathlib", name): getattr(pathlib, name) for name in ("PosixPath", "WindowsPath", "PurePosixPath",
                                                                "PureWindowsPath", "Path")},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


class RestrictedReader(FileSystemReader):
    """DCP's file reader, with `.metadata` unpickled through the allowlist above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = _MetadataUnpickler(stream).load()
            except pickle.UnpicklingError as error:
                raise CheckpointError(
                    f"{path}: refers to {error}, which a DCP checkpoint's metadata never holds; not loaded "
                    "(checkpoints are trusted input: load only checkpoints from sources you trust)"
                ) from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata; not loaded")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def reader_for(path: pathlib.Path, *, own: bool) -> FileSystemReader:
    """DCP's reader for this run's own checkpoints, the restricted one for every other."""
    return FileSystemReader(str(path)) if own else RestrictedReader(str(path))
