"""A run's logged history: the train and eval records of its metrics.jsonl, and where to find them.

A report may be asked for while the run still writes, so the last line may be cut short mid-write: such a line
is skipped, never an error. A folder without metrics.jsonl of its own is read as a sweep: every folder under it
that holds one is a point, named by its path relative to the sweep folder.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_train.run_files import CHECKPOINTS_DIR, COMPLETE_FILE, LOGS_DIR, METRICS_FILE, REPORT_DIR

# A run folder's own subfolders hold no points; the report's default output folder holds none either.
NOT_POINTS = {CHECKPOINTS_DIR, LOGS_DIR, REPORT_DIR}


class ReportError(Exception):
    """Bad input for a report (no such folder, no metrics): one line for the user, exit 2."""


@dataclass
class RunHistory:
    """One run's records in file order. `unreadable` counts lines that were not JSON records, the last line
    excluded (a half-written last line is expected while the run writes)."""

    name: str
    folder: Path
    complete: bool
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    unreadable: int = 0

    @property
    def moe_layers(self) -> list[str]:
        """The MoE layer keys seen in any train record, in layer order ("0", "1", ..., MTP blocks last)."""
        keys = {key for record in self.train for key in (record.get("moe") or {})}
        return sorted(keys, key=lambda key: (0, int(key), "") if key.isdigit() else (1, 0, key))


def _record(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    ok = isinstance(record, dict) and record.get("kind") in ("train", "eval") and isinstance(record.get("step"), int)
    return record if ok else None


def read_history(folder: Path, name: str) -> RunHistory:
    """The records of `folder/metrics.jsonl`, skipping a half-written last line."""
    history = RunHistory(name=name, folder=folder, complete=(folder / COMPLETE_FILE).exists())
    lines = (folder / METRICS_FILE).read_text(encoding="utf-8", errors="replace").splitlines()
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        record = _record(line)
        if record is None:
            if index < len(lines) - 1:
                history.unreadable += 1
        elif record["kind"] == "train":
            history.train.append(record)
        else:
            history.evals.append(record)
    return history


def find_metrics(root: Path) -> list[Path]:
    """`root` when it holds metrics.jsonl; otherwise every folder under it that does (sweep points), sorted."""
    if (root / METRICS_FILE).is_file():
        return [root]
    found = []
    for folder, dirs, files in os.walk(root):
        if METRICS_FILE in files:
            found.append(Path(folder))
            dirs[:] = []  # a run's subfolders are its own, not further points
        else:
            dirs[:] = sorted(d for d in dirs if d not in NOT_POINTS and not d.startswith("."))
    return sorted(found)


def load_histories(root: Path) -> tuple[list[RunHistory], list[str]]:
    """The histories to report on and a note per point that has nothing to show yet.

    Raises ReportError when there is nothing to report: no folder, no metrics.jsonl, or no train record at all.
    """
    if not root.exists():
        raise ReportError(f"{root}: no such folder")
    if not root.is_dir():
        raise ReportError(f"{root}: not a folder (give the run folder that holds {METRICS_FILE}, or a sweep folder)")
    folders = find_metrics(root)
    if not folders:
        raise ReportError(f"{root}: no {METRICS_FILE} here or in any sweep point under it (has the run started?)")
    histories, notes = [], []
    for folder in folders:
        name = folder.name if folder == root else folder.relative_to(root).as_posix()
        history = read_history(folder, name)
        if history.train:
            histories.append(history)
        else:
            notes.append(f"{folder / METRICS_FILE}: no training step logged yet, left out")
    if not histories:
        where = folders[0] / METRICS_FILE if len(folders) == 1 else f"{root} (all {len(folders)} points)"
        raise ReportError(f"{where}: no training step logged yet")
    return histories, notes
