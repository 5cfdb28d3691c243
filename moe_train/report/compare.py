"""`moe-train report --compare RUN_DIR...`: several runs' loss and throughput overlaid in one picture.

A sweep's report already draws its points side by side; comparing is for runs that live apart (two recipes,
two clusters, before and after a change). Each run keeps one colour in both panels, so a loss curve and its
throughput read together. Runs are named by their folder's name, or by the path given when two names clash.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .curves import MARKERS_UP_TO, save
from .history import METRICS_FILE, ReportError, RunHistory, read_history

COMPARE_FILE = "compare.png"


def load_compared(run_dirs: Sequence[Path]) -> list[RunHistory]:
    """One history per folder given; ReportError (one line) for a folder that is missing, holds no
    metrics.jsonl of its own, or has no train step yet."""
    if len(run_dirs) < 2:
        raise ReportError("--compare: give at least two run folders")
    names = [folder.name for folder in run_dirs]
    histories = []
    for folder, name in zip(run_dirs, names, strict=True):
        if not folder.is_dir():
            raise ReportError(f"{folder}: no such folder")
        if not (folder / METRICS_FILE).is_file():
            raise ReportError(f"{folder}: no {METRICS_FILE} (--compare takes run folders, not sweep folders)")
        history = read_history(folder, str(folder) if names.count(name) > 1 else name)
        if not history.train:
            raise ReportError(f"{folder / METRICS_FILE}: no training step logged yet")
        histories.append(history)
    return histories


def compare_figure(histories: Sequence[RunHistory]) -> Figure:
    """Train loss (eval losses as dots) above tokens/s, one colour per run, sharing the step axis."""
    figure = Figure(figsize=(8, 7), layout="constrained")
    loss_axes, tokens_axes = figure.subplots(2, 1, sharex=True)
    for index, history in enumerate(histories):
        color = f"C{index % 10}"
        steps = [r["step"] for r in history.train]
        loss_axes.plot(steps, [float("nan") if r.get("loss") is None else r["loss"] for r in history.train],
                       color=color, label=history.name)
        if history.evals:
            loss_axes.plot([r["step"] for r in history.evals], [r["loss"] for r in history.evals], color=color,
                           marker="o", linestyle="none", markersize=5)
        marker = "." if len(history.train) <= MARKERS_UP_TO else None
        tokens_axes.plot(steps, [float("nan") if r.get("tokens_per_s") is None else r["tokens_per_s"]
                                 for r in history.train], color=color, marker=marker, label=history.name)
    loss_axes.set_ylabel("loss")
    loss_axes.set_title(f"{len(histories)} runs compared")
    loss_axes.legend(fontsize="small")
    tokens_axes.set_ylabel("tokens/s")
    tokens_axes.set_xlabel("step")
    tokens_axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    tokens_axes.set_ylim(0, tokens_axes.get_ylim()[1] * 1.05)
    for axes in (loss_axes, tokens_axes):
        axes.grid(alpha=0.3)
    return figure


def write_comparison(histories: Sequence[RunHistory], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    return save(compare_figure(histories), out_dir / COMPARE_FILE)
