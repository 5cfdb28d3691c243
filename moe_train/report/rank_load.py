"""The rank-load picture, beside the expert-load heatmap: under expert parallelism the most loaded rank sets
the step, so this draws what each ep rank's experts received (metrics.jsonl `moe_ranks`). One panel per MoE
layer, steps across, ranks down, each cell the rank's rows relative to the mean (1, white: even); below them
each layer's max/mean rank load over steps. A run without expert parallelism (one rank) or logged before
`moe_ranks` existed gets no picture.
"""

from __future__ import annotations

import math

import numpy as np
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .curves import MARKERS_UP_TO
from .expert_load import bin_columns
from .history import RunHistory


def rank_matrix(history: RunHistory, layer: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps [n] and each rank's rows over the mean [ranks, n] of one layer."""
    steps, columns = [], []
    for record in history.train:
        ranks = (record.get("moe_ranks") or {}).get(layer, {}).get("rank_tokens")
        if ranks and sum(ranks):
            steps.append(record["step"])
            columns.append(np.asarray(ranks, dtype=float) * len(ranks) / sum(ranks))
    if not columns:
        return np.zeros(0, dtype=int), np.zeros((0, 0))
    return np.asarray(steps), np.stack(columns, axis=1)


def rank_load_figure(history: RunHistory) -> Figure | None:
    layers = [layer for layer in history.moe_layers if rank_matrix(history, layer)[1].shape[0] > 1]
    if not layers:
        return None
    cols = max(1, min(len(layers), 4 if len(layers) <= 16 else 8))
    rows = math.ceil(len(layers) / cols)
    figure = Figure(figsize=(3.4 * cols + 1.4, 1.8 * rows + 3.0), layout="constrained")
    grid = figure.add_gridspec(rows + 1, cols, height_ratios=[1.0] * rows + [1.3])
    matrices = {layer: rank_matrix(history, layer) for layer in layers}
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max([2.0] + [float(m.max()) for _, m in matrices.values()]))
    panels, mesh = [], None
    for index, layer in enumerate(layers):
        steps, matrix = matrices[layer]
        edges, binned = bin_columns(steps, matrix)
        axes = figure.add_subplot(grid[index // cols, index % cols])
        mesh = axes.pcolormesh(edges, np.arange(matrix.shape[0] + 1) - 0.5, binned, cmap="RdBu_r", norm=norm)
        axes.invert_yaxis()
        axes.xaxis.set_major_locator(MaxNLocator(nbins=4, integer=True))
        axes.yaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_title(f"layer {layer}", fontsize="medium")
        if index % cols == 0:
            axes.set_ylabel("ep rank")
        panels.append(axes)
    figure.colorbar(mesh, ax=panels, label="rows / mean (1 = even)", shrink=0.9)
    axes = figure.add_subplot(grid[rows, :])
    for layer in layers:
        steps, matrix = matrices[layer]
        axes.plot(
            steps, matrix.max(axis=0), marker="." if len(steps) <= MARKERS_UP_TO else None, label=f"layer {layer}"
        )
    axes.axhline(1.0, color="0.4", linestyle=":", linewidth=1, label="even")
    axes.set_xlabel("step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_ylabel("max / mean rank load")
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small", ncols=min(4, len(layers) + 1))
    figure.suptitle(f"rank load (the slowest rank sets the step): {history.name}")
    return figure
