"""Loss and throughput over steps: one curve per run (a sweep's points side by side), eval losses as points.

Figures are built with matplotlib's object API (no pyplot), so drawing touches no global state and needs no
display. A skipped step's null loss becomes a gap in its curve, not a point at zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .history import RunHistory

DPI = 110
MARKERS_UP_TO = 50  # logged points drawn as dots too; more would blur the line


def _series(records: list[dict], key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    steps = [r["step"] for r in records]
    values = [float("nan") if r.get(key) is None else r[key] * scale for r in records]
    return steps, values


def _label(history: RunHistory, single: bool, what: str) -> str:
    return what if single else history.name


def loss_figure(histories: Sequence[RunHistory]) -> Figure:
    """Train loss per run; for a single MoE run also the language-model part, whose gap to the loss is the
    balancing (and MTP) terms; eval losses as markers in the run's colour."""
    single = len(histories) == 1
    figure = Figure(figsize=(8, 4.8), layout="constrained")
    axes = figure.add_subplot()
    for index, history in enumerate(histories):
        color = f"C{index % 10}"
        axes.plot(*_series(history.train, "loss"), color=color, label=_label(history, single, "train loss"))
        if single and any(r.get("lm_loss") != r.get("loss") for r in history.train):
            axes.plot(*_series(history.train, "lm_loss"), color=color, linestyle="--", alpha=0.7,
                      label="train lm_loss")
        if history.evals:
            axes.plot(*_series(history.evals, "loss"), color=color, marker="o", linestyle="none", markersize=5,
                      label="eval loss" if single else None)
    if not single and any(h.evals for h in histories):
        axes.plot([], [], color="0.3", marker="o", linestyle="none", label="eval loss (dots)")
    axes.set_xlabel("step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_ylabel("loss")
    axes.set_title("loss" if not single else f"loss: {histories[0].name}")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    return figure


def throughput_figure(histories: Sequence[RunHistory]) -> Figure:
    """Tokens/s and MFU per logged step, one curve per run."""
    single = len(histories) == 1
    figure = Figure(figsize=(8, 6), layout="constrained")
    tokens_axes, mfu_axes = figure.subplots(2, 1, sharex=True)
    for index, history in enumerate(histories):
        color = f"C{index % 10}"
        marker = "." if len(history.train) <= MARKERS_UP_TO else None
        tokens_axes.plot(*_series(history.train, "tokens_per_s"), color=color, marker=marker,
                         label=_label(history, single, "tokens/s"))
        mfu_axes.plot(*_series(history.train, "mfu", 100.0), color=color, marker=marker,
                      label=_label(history, single, "MFU"))
    tokens_axes.set_ylabel("tokens/s")
    tokens_axes.set_title("throughput" if not single else f"throughput: {histories[0].name}")
    mfu_axes.set_ylabel("MFU (%)")
    mfu_axes.set_xlabel("step")
    mfu_axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    for axes in (tokens_axes, mfu_axes):
        axes.grid(alpha=0.3)
        axes.set_ylim(0, axes.get_ylim()[1] * 1.05)  # from zero, with headroom above the highest point
    if not single:
        tokens_axes.legend(fontsize="small")
    return figure


def save(figure: Figure, path: Path) -> Path:
    figure.savefig(path, dpi=DPI)
    return path
