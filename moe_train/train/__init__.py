"""The trainer loop, optimizer and LR schedules, metrics and preemption.

`run_from_recipe` is the one entry: `moe-train run` calls it in-process at world size 1, and entry.py calls it
on every rank under torchrun/srun with the context it bootstrapped. It raises RecipeError, DataError or
CheckpointError for bad input (exit 2) and TrainingError for a runtime failure (exit 1); `input_errors()` lists
the former for callers to map.
`train_and_report` wraps it for command lines: one `error:` line per problem, the summary, an exit code.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from moe_train.run_files import FAILED_FILE

if TYPE_CHECKING:
    from moe_train.config.schema import Recipe
    from moe_train.parallel.context import ParallelContext
    from moe_train.train.loop import Summary


def input_errors() -> tuple[type[Exception], ...]:
    """The exception types that mean bad input (exit 2, one line, no traceback)."""
    from moe_train.checkpoint.layout import CheckpointError
    from moe_train.config import RecipeError
    from moe_train.data import DataError

    return (RecipeError, DataError, CheckpointError)


def run_from_recipe(recipe: Recipe, ctx: ParallelContext | None = None) -> Summary:
    """Train `recipe` on this process's rank. Without a context (the entry passes its own), this goes through
    the one start-up path, `parallel.bootstrap`: launch checks, the process group and the meshes. The process
    group is destroyed at the end when bootstrap made it."""
    from moe_train.parallel.bootstrap import bootstrap, shutdown
    from moe_train.train.loop import Trainer

    ctx = ctx or bootstrap(recipe)
    try:
        return Trainer(recipe, ctx).train()
    finally:
        shutdown(ctx)


def train_and_report(recipe: Recipe, ctx: ParallelContext | None = None) -> int:
    """Run `recipe`, print the summary (rank 0) or the error (one line, no traceback); return the exit code.

    0: trained (complete, exit_at_step or a clean stop on preemption); 2: bad input; 1: runtime failure,
    naming the rank and the reason.
    """
    from moe_train.parallel.bootstrap import LauncherEnv, LaunchMismatch
    from moe_train.train.errors import TrainingError

    rank = ctx.rank if ctx is not None else LauncherEnv().rank  # errors may come before a context exists
    failed = Path(recipe.resolved_run_dir()) / FAILED_FILE
    if rank == 0:
        failed.unlink(missing_ok=True)  # this attempt's outcome, not an earlier one's
    try:
        summary = run_from_recipe(recipe, ctx)
    except input_errors() as error:
        for line in getattr(error, "problems", None) or str(error).splitlines()[:1]:
            print(f"error: {line}", file=sys.stderr, flush=True)
        return 2
    except TrainingError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return _failed(failed, str(error))
    except LaunchMismatch as error:
        print(f"error: rank {rank}: {error}", file=sys.stderr, flush=True)
        return _failed(failed, f"rank {rank}: {error}")
    except Exception as error:  # a failed collective, out of memory...: one line naming the rank
        reason = str(error).splitlines()[0] if str(error) else ""
        print(f"error: rank {rank}: {type(error).__name__}: {reason}", file=sys.stderr, flush=True)
        line = f"rank {rank}: {type(error).__name__}: {reason}"
        from moe_train.train.hang_report import last_collective

        if (collective := last_collective()) is not None:
            print(f"note: rank {rank}: the last collective it entered: {collective}", file=sys.stderr, flush=True)
            line += f" (last collective: {collective})"
        return _failed(failed, line)
    if summary.logs:
        print(summary.describe(total_steps=recipe.train.steps), flush=True)
    return 0


def _failed(path: Path, reason: str) -> int:
    """Record a runtime failure's reason line in the run folder (`moe-train runs` shows it); exit code 1.
    Several failing ranks each write theirs; the last one written stays."""
    from moe_train.atomic import write_atomic

    if path.parent.is_dir():
        with contextlib.suppress(OSError):  # a read-only or vanished folder must not hide the error itself
            write_atomic(path, reason + "\n")
    return 1
