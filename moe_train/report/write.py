"""Draw every picture of a report into one folder and say which files were written."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from .curves import loss_figure, save, throughput_figure
from .expert_load import expert_load_figure
from .history import RunHistory


def _file_part(name: str) -> str:
    """A sweep point's name as part of a file name (point names are already safe; nested ones hold '/')."""
    return re.sub(r"[^A-Za-z0-9._~=+-]", "_", name)


def write_report(histories: Sequence[RunHistory], out_dir: Path) -> list[Path]:
    """loss.png and throughput.png for all runs together; expert_load.png for a single MoE run, or
    expert_load-POINT.png per MoE point of a sweep."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [save(loss_figure(histories), out_dir / "loss.png"),
               save(throughput_figure(histories), out_dir / "throughput.png")]
    for history in histories:
        figure = expert_load_figure(history)
        if figure is not None:
            name = "expert_load.png" if len(histories) == 1 else f"expert_load-{_file_part(history.name)}.png"
            written.append(save(figure, out_dir / name))
    return written
