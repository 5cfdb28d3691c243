"""The expert-load heatmap: does balancing work? One panel per MoE layer, steps across, experts down, each
cell the expert's load relative to an even spread (its share of the step's assignments times the expert count),
so 1 (white) is perfect balance, red an overloaded expert and blue a starved one; below them the max/mean load
of each layer over steps, the figure that sets an expert-parallel step's pace.

Long runs are drawn with at most MAX_COLUMNS columns per panel, consecutive logged steps averaged, each column
as wide as the steps it covers (logging intervals and extra lines at skipped steps keep the step axis true).
"""

from __future__ import annotations

import math

import numpy as np
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .curves import MARKERS_UP_TO
from .history import RunHistory

MAX_COLUMNS = 400
MAX_LINES = 8  # layers drawn as lines of their own below the panels; more are drawn as a band


def load_matrix(history: RunHistory, layer: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps [n] and load relative to the mean [experts, n] of one layer, over the records that logged it."""
    steps, columns = [], []
    for record in history.train:
        load = (record.get("moe") or {}).get(layer, {}).get("load")
        if load:
            steps.append(record["step"])
            columns.append(np.asarray(load, dtype=float) * len(load))
    if not columns:
        return np.zeros(0, dtype=int), np.zeros((0, 0))
    return np.asarray(steps), np.stack(columns, axis=1)


def bin_columns(steps: np.ndarray, matrix: np.ndarray, max_columns: int = MAX_COLUMNS
                ) -> tuple[np.ndarray, np.ndarray]:
    """Column edges on the step axis [m+1] and the matrix averaged over groups of consecutive steps [rows, m].

    Edges fall halfway between the last step of one group and the first of the next, so the columns tile the
    step range without gaps however irregular the logged steps are.
    """
    n = len(steps)
    size = math.ceil(n / max_columns)
    starts = np.arange(0, n, size)
    binned = np.add.reduceat(matrix, starts, axis=1) / np.diff(np.append(starts, n))
    first_gap = steps[1] - steps[0] if n > 1 else 1
    last_gap = steps[-1] - steps[-2] if n > 1 else 1
    inner = (steps[starts[1:] - 1] + steps[starts[1:]]) / 2
    edges = np.concatenate([[steps[0] - first_gap / 2], inner, [steps[-1] + last_gap / 2]])
    return edges, binned


def _balance_panel(axes, history: RunHistory, layers: list[str]) -> None:
    series = {}
    for layer in layers:
        points = [(r["step"], r["moe"][layer].get("load_max_over_mean")) for r in history.train
                  if layer in (r.get("moe") or {})]
        points = [(step, math.nan if value is None else value) for step, value in points]
        series[layer] = np.asarray(points, dtype=float).reshape(-1, 2)
    if len(layers) <= MAX_LINES:
        for layer, points in series.items():
            axes.plot(points[:, 0], points[:, 1], marker="." if len(points) <= MARKERS_UP_TO else None,
                      label=f"layer {layer}")
    else:
        # Many layers: the spread over layers as a band, with the worst and the median layer as lines.
        steps = sorted({int(s) for points in series.values() for s in points[:, 0]})
        by_step = {s: [] for s in steps}
        for points in series.values():
            for step, value in points:
                by_step[int(step)].append(value)
        low, mid, high = (np.array([fn(by_step[s]) for s in steps]) for fn in (np.min, np.median, np.max))
        axes.fill_between(steps, low, high, alpha=0.25, color="C0", label=f"all {len(layers)} layers")
        axes.plot(steps, high, color="C3", label="worst layer")
        axes.plot(steps, mid, color="C0", label="median layer")
    axes.axhline(1.0, color="0.4", linestyle=":", linewidth=1, label="perfect balance")
    axes.set_xlabel("step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_ylabel("max / mean load")
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small", ncols=min(4, len(layers) + 1))


def expert_load_figure(history: RunHistory) -> Figure | None:
    """The heatmap figure of one run; None when it logged no MoE layer. Layers logged without per-expert
    shares (metrics written before `load` existed) get no panel, only their line in the balance plot."""
    layers = history.moe_layers
    if not layers:
        return None
    matrices = {layer: load_matrix(history, layer) for layer in layers}
    drawn = [layer for layer in layers if matrices[layer][1].size]
    cols = max(1, min(len(drawn), 4 if len(drawn) <= 16 else 8))
    rows = math.ceil(len(drawn) / cols)
    figure = Figure(figsize=(3.4 * cols + 1.4, 2.6 * rows + 3.0), layout="constrained")
    grid = figure.add_gridspec(rows + 1, cols, height_ratios=[1.0] * rows + [1.1])
    vmax = max([2.0] + [float(matrices[layer][1].max()) for layer in drawn])
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=vmax)
    panels, mesh = [], None
    for index, layer in enumerate(drawn):
        steps, matrix = matrices[layer]
        edges, binned = bin_columns(steps, matrix)
        axes = figure.add_subplot(grid[index // cols, index % cols])
        experts = np.arange(matrix.shape[0] + 1) - 0.5
        mesh = axes.pcolormesh(edges, experts, binned, cmap="RdBu_r", norm=norm)
        axes.invert_yaxis()
        axes.xaxis.set_major_locator(MaxNLocator(nbins=4, integer=True))
        axes.yaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_title(f"layer {layer}", fontsize="medium")
        if index % cols == 0:
            axes.set_ylabel("expert")
        if index // cols == rows - 1 or index + cols >= len(drawn):
            axes.set_xlabel("step")
        panels.append(axes)
    if mesh is not None:
        figure.colorbar(mesh, ax=panels, label="load / mean (1 = even)", shrink=0.9)
    _balance_panel(figure.add_subplot(grid[rows, :]), history, layers)
    figure.suptitle(f"expert load: {history.name}")
    return figure
