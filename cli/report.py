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
    run_dirs: Annotated[list[Path], typer.Argument(
        help="A run folder (it holds metrics.jsonl) or a sweep folder (its points each hold one); with "
             "--compare, two or more run folders.", metavar="RUN_DIR...", show_default=False)],
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Folder for the PNGs (default RUN_DIR/report; with --compare ./report).",
        show_default=False)] = None,
    compare: Annotated[bool, typer.Option(
        "--compare", help="Overlay the loss and tokens/s of the RUN_DIRs in one PNG (OUT/compare.png).")] = False,
) -> None:
    """Plot loss, throughput and expert load of a run, and print its summary. Works while the run still writes
    (a half-written last line is skipped), and on a sweep folder: one curve per point.

    Examples:

        moe-train report runs/qwen3-moe-tiny

        moe-train report runs/my-sweep -o /tmp/sweep-report

        moe-train report --compare runs/baseline runs/fp8 -o /tmp/compare
    """
    try:
        import matplotlib
    except ImportError:
        fail(["moe-train report draws with matplotlib: pip install 'moe-train[report]'"])
    matplotlib.use("Agg")  # files only, never a window (login nodes have no display)
    from moe_train.report.write import write_report

    if compare:
        _compare(run_dirs, out if out is not None else Path(REPORT_DIR))
        return
    if len(run_dirs) != 1:
        fail(["RUN_DIR: give one run or sweep folder, or several with --compare"])
    run_dir = run_dirs[0]
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


def _compare(run_dirs: list[Path], out_dir: Path) -> None:
    from moe_train.report.compare import load_compared, write_comparison

    try:
        histories = load_compared(run_dirs)
        if out_dir.exists() and not out_dir.is_dir():
            raise ReportError(f"--out {out_dir}: exists and is not a folder")
    except ReportError as error:
        fail([str(error)])
    print("\n".join(sweep_table([summarize(history) for history in histories])))
    print(f"plot: {write_comparison(histories, out_dir)}")
