"""Draw every picture of a report into one folder and say which files were written."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from .curves import loss_figure, save, throughput_figure
from .expert_load import expert_load_figure
from .history import RunHistory
from .rank_load import rank_load_figure


def _file_part(name: str) -> str:
    """A sweep point's name as part of a file name (point names are already safe; nested ones hold '/')."""
    return re.sub(r"[^A-Za-z0-9._~=+-]", "_", name)


def write_report(histories: Sequence[RunHistory], out_dir: Path) -> list[Path]:
    """loss.png and throughput.png for all runs together; expert_load.png (and rank_load.png under expert
    parallelism) for a single MoE run, or expert_load-POINT.png (rank_load-POINT.png) per MoE point of a sweep."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [save(loss_figure(histories), out_dir / "loss.png"),
               save(throughput_figure(histories), out_dir / "throughput.png")]
    for history in histories:
        for stem, figure in (("expert_load", expert_load_figure(history)), ("rank_load", rank_load_figure(history))):
            if figure is not None:
                name = f"{stem}.png" if len(histories) == 1 else f"{stem}-{_file_part(history.name)}.png"
                written.append(save(figure, out_dir / name))
    return written
