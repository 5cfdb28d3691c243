"""`moe-train report`: a run's (or a sweep's) loss and throughput curves, expert-load heatmap and summary.

Torch-free like every login-node command. matplotlib (the `report` extra) and numpy are imported only when the
command runs, so the rest of the CLI neither needs nor loads them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from moe_train.report.history import ReportError, load_histories
from moe_train.report.summary import describe, summarize, sweep_table
from moe_train.run_files import REPORT_DIR

from .common import fail


def report(
    run_dir: Annotated[Path, typer.Argument(
        help="A run folder (it holds metrics.jsonl) or a sweep folder (its points each hold one).")],
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Folder for the PNGs (default RUN_DIR/report).", show_default=False)] = None,
) -> None:
    """Plot loss, throughput and expert load of a run, and print its summary. Works while the run still writes
    (a half-written last line is skipped), and on a sweep folder: one curve per point.

    Examples:

        moe-train report runs/qwen3-moe-tiny

        moe-train report runs/my-sweep -o /tmp/sweep-report
    """
    try:
        import matplotlib
    except ImportError:
        fail(["moe-train report draws with matplotlib: pip install 'moe-train[report]'"])
    matplotlib.use("Agg")  # files only, never a window (login nodes have no display)
    from moe_train.report.write import write_report

    out_dir = out if out is not None else run_dir / REPORT_DIR
    try:
        histories, notes = load_histories(run_dir)
        if out_dir.exists() and not out_dir.is_dir():
            raise ReportError(f"--out {out_dir}: exists and is not a folder")
    except ReportError as error:
        fail([str(error)])
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    summaries = [summarize(history) for history in histories]
    lines = describe(summaries[0]) if len(summaries) == 1 else sweep_table(summaries)
    print("\n".join(lines))
    written = write_report(histories, out_dir)
    print("plots: " + ", ".join(str(path) for path in written))
