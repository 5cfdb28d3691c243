"""Replacing a file so that readers (and a restart after a crash) see the old content or the new, never half.

One helper for both halves: the login-node side writes run folders, scripts and submission records with it, the
training side checkpoint pointers, converted weights and trimmed metrics. It lives at the package's top level,
beside nothing but `__init__` (which imports nothing), so importing it pulls in neither torch nor the config
or launch packages, and neither half depends on the other for it.

The new content goes to a uniquely named temporary file in the same folder (a rename is atomic only within one
file system), is flushed to disk, and is renamed over the target; the folder is then flushed so that the rename
itself survives a power loss. A failure leaves the target untouched and removes the temporary file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """A temporary path to write `path`'s new content to (by any writer that takes a path, e.g. safetensors);
    on leaving the block it replaces `path`. Parent folders are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        _fsync(tmp, os.O_RDONLY)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def write_atomic(path: Path | str, content: str | bytes) -> None:
    """Replace `path` with `content` (text is written as UTF-8)."""
    data = content.encode("utf-8") if isinstance(content, str) else content
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
