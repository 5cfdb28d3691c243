"""The `builtin` source: a real corpus that needs no download, the running Python's standard library sources.

The .py files under sysconfig's stdlib path (site-packages and test suites left out, sorted by path, the first
MAX_BYTES of them) are byte-tokenized once, one document per file ending in EOD, into an indexed dataset in the
cache folder (MOE_TRAIN_CACHE, else ~/.cache/moe-train). Ranks that start together take a lock so one builds
while the others wait; the dataset is built in a temporary folder and renamed into place, so even without the
lock (e.g. on a file system without flock) nobody ever reads a half-built corpus.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sysconfig
import tempfile

import numpy as np

from moe_train.config.data_files import DataError
from moe_train.data.indexed import IndexedDatasetWriter
from moe_train.data.tokenizer import ByteTokenizer

MAX_BYTES = 16 * 2**20
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_FORMAT = "v1"  # bump when what goes into the corpus changes


def cache_root(cache_dir: str | None = None) -> str:
    default = os.path.join(os.path.expanduser("~"), ".cache", "moe-train")
    return cache_dir or os.environ.get("MOE_TRAIN_CACHE") or default


def corpus_files(max_bytes: int = MAX_BYTES) -> list[str]:
    """The stdlib .py files that form the corpus, in sorted path order, up to max_bytes in total."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS]
        found += [os.path.join(directory, n) for n in names if n.endswith(".py")]
    found.sort(key=lambda path: os.path.relpath(path, root))
    chosen, total = [], 0
    for path in found:
        size = os.path.getsize(path)
        if chosen and total + size > max_bytes:
            break
        chosen.append(path)
        total += size
    return chosen


def builtin_prefix(cache_dir: str | None = None, max_bytes: int = MAX_BYTES) -> str:
    """The indexed-dataset prefix of the builtin corpus, building it first if this cache does not have it."""
    files = corpus_files(max_bytes)
    # The key changes with the Python installation's files, so a cache shared by several Pythons stays right.
    key = hashlib.sha256(_FORMAT.encode())
    for path in files:
        key.update(f"{path}\0{os.path.getsize(path)}\0".encode())
    folder = os.path.join(cache_root(cache_dir), "builtin", key.hexdigest()[:16])
    prefix = os.path.join(folder, "stdlib")
    if os.path.isdir(folder):
        return prefix
    parent = os.path.dirname(folder)
    try:
        os.makedirs(parent, exist_ok=True)
        with open(folder + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.isdir(folder):
                _build(files, folder, parent)
    except OSError as error:
        reason = error.strerror or str(error)
        raise DataError(f"{parent}: cannot build the builtin corpus here ({reason}); set MOE_TRAIN_CACHE") from None
    return prefix


def _build(files: list[str], folder: str, parent: str) -> None:
    staging = tempfile.mkdtemp(prefix=".building-", dir=parent)
    try:
        eod = np.array([ByteTokenizer.eod], dtype=np.uint16)
        with IndexedDatasetWriter(os.path.join(staging, "stdlib"), np.uint16) as writer:
            for path in files:
                with open(path, "rb") as f:
                    writer.append(np.frombuffer(f.read(), dtype=np.uint8))
                writer.append(eod)
                writer.end_document()
        os.rename(staging, folder)
    except OSError:
        if not os.path.isdir(folder):  # a real failure, not another process that renamed first
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
