"""Run directories: the resolved recipe with provenance, written before anything launches.

The ranks read only `{run_dir}/recipe.yaml`, so what ran is always on disk next to its logs and checkpoints.
A folder is reused (and the run resumes from it) only when the recipe there describes the same run; two
different runs sharing a folder would mix their checkpoints, so that is refused, naming the folder.
"""

from __future__ import annotations

import copy
import functools
import os
import socket
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import moe_train
from moe_train.atomic import write_atomic
from moe_train.config import Recipe, dump_recipe
from moe_train.config.yaml_source import load_value
from moe_train.run_files import CHECKPOINTS_DIR, LOGS_DIR, METRICS_FILE, RECIPE_FILE

from .shell import LaunchError

# Fields that may differ between two launches of the same run: where the recipe came from, how it was
# written down, whether to resume, where this launch stops early, and the layout: how the same math is spread
# over devices (`parallel.*`, `launch.*`, `train.micro_batch_size`), since checkpoints reshard on load
# (docs/interfaces.md, run directory). recipe.yaml then records the latest launch's layout.
# Everything else must match.
IGNORED_FIELDS: tuple[tuple[str, ...], ...] = (
    ("provenance",),
    ("extends",),
    ("run_dir",),
    ("checkpoint", "resume"),
    ("train", "exit_at_step"),
    ("parallel",),
    ("launch",),
    ("train", "micro_batch_size"),
    ("train", "deterministic"),  # which kernels run, not what they compute (moe_train/train/determinism.py)
    ("checkpoint", "async_save"),  # how checkpoints are written and where metrics are mirrored, not the run
    ("logging", "wandb"),
    ("train", "compile"),  # compiled blocks compute what eager ones do (moe_train/parallel/compile.py)
    ("model", "moe", "dispatcher"),  # how tokens travel to their experts, not what the experts compute
    ("model", "moe", "placement"),  # which rank holds which expert: a layout (checkpoints keep global ids)
    ("logging", "routing_trace"),  # a record of the routing, not a change to it
    ("train", "fp8", "saved_inputs"),  # what fp8 GEMMs keep for backward: memory, the same numbers bit for bit
)


@functools.lru_cache(maxsize=1)
def git_sha() -> str | None:
    """The commit of the moe-train checkout in use, when it is a git checkout (None for installed wheels)."""
    source = Path(moe_train.__file__).resolve().parent.parent
    if not (source / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def provenance() -> dict[str, Any]:
    """What produced a resolved recipe: tool version, commit, time and host."""
    return {
        "moe_train_version": moe_train.__version__,
        "git_sha": git_sha(),
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
    }


def run_dir_path(recipe: Recipe) -> Path:
    """The run folder as an absolute path: the job's working directory may differ from the submitter's."""
    return Path(os.path.abspath(Path(recipe.resolved_run_dir()).expanduser()))


def resolved_for_run(recipe: Recipe) -> Recipe:
    """The recipe as the ranks will read it: absolute run_dir, fresh provenance."""
    return recipe.model_copy(update={"run_dir": str(run_dir_path(recipe)), "provenance": provenance()})


def _comparable(data: dict[str, Any]) -> dict[str, Any]:
    data = copy.deepcopy(data)  # ignored fields sit at any depth (model.moe.dispatcher)
    for path in IGNORED_FIELDS:
        node = data
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(path[-1], None)
    return data


def _differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            out.extend(_differences(old.get(key), new.get(key), f"{prefix}{key}."))
        return out
    return [] if old == new else [prefix.rstrip(".")]


def recipe_differences(existing: Recipe, recipe: Recipe) -> list[str]:
    """Dotted fields in which two recipes describe different runs (ignoring IGNORED_FIELDS)."""
    return _differences(_comparable(existing.model_dump(mode="json")), _comparable(recipe.model_dump(mode="json")))


def read_run_recipe(run_dir: Path) -> Recipe:
    """The resolved recipe stored in a run folder, validated against the schema only (it is already resolved);
    its YAML read as the ranks' loader reads it (no base-60 numbers: an unquoted `time: 4:00:00` stays text)."""
    path = run_dir / RECIPE_FILE
    try:
        return Recipe.model_validate(load_value(path.read_text()))
    except Exception as error:  # any unreadable file is reported as one line
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise LaunchError([f"{path}: not a readable resolved recipe ({reason})"]) from None


def check_reusable(recipe: Recipe, run_dir: Path) -> None:
    """Raise LaunchError naming the folder when it already holds a different run."""
    if (run_dir / RECIPE_FILE).exists():
        differing = recipe_differences(read_run_recipe(run_dir), recipe)
        if differing:
            shown = ", ".join(differing[:4]) + (f" and {len(differing) - 4} more" if len(differing) > 4 else "")
            raise LaunchError([f"{run_dir}: holds a different run (recipe.yaml differs in {shown}); "
                               "set another run_dir or remove the folder"])
    elif (run_dir / CHECKPOINTS_DIR).exists() or (run_dir / METRICS_FILE).exists():
        raise LaunchError([f"{run_dir}: holds checkpoints or metrics but no recipe.yaml; set another run_dir"])


def prepare_run_dir(recipe: Recipe) -> Path:
    """Create or reuse the run folder and write the resolved recipe into it; returns the absolute folder.

    Raises LaunchError (one line naming the folder) when the folder belongs to a different run.
    """
    check_reusable(recipe, run_dir_path(recipe))
    return write_run_dir(recipe)


def write_run_dir(recipe: Recipe) -> Path:
    """`prepare_run_dir` for a recipe whose folder `check_reusable` has already passed (sweep points are checked
    when they are listed): create the folder and write the resolved recipe, without reading the old one again."""
    run_dir = run_dir_path(recipe)
    if run_dir.exists() and not run_dir.is_dir():
        raise LaunchError([f"{run_dir}: run_dir exists and is not a folder"])
    (run_dir / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / RECIPE_FILE, dump_recipe(resolved_for_run(recipe)))
    return run_dir
