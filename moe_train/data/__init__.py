"""Megatron-format indexed datasets, sampling, blending, tokenizers and prepare.

The public names below load lazily, so that `from moe_train.data import DataError` stays free of numpy and
torch (DataError and the .idx header reader live in config/data_files.py, for the login-node `validate`).
"""

from __future__ import annotations

import importlib
from typing import Any

from moe_train.config.data_files import DataError

_LAZY = {
    "Datasets": "moe_train.data.datasets",
    "build_datasets": "moe_train.data.datasets",
    "eod_id": "moe_train.data.datasets",
    "global_batch": "moe_train.data.batch",
    "position_ids": "moe_train.data.batch",
}

__all__ = ["DataError", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moe_train.data' has no attribute {name!r}")
