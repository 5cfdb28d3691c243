"""Sweeps: the Cartesian product of `--grid path=v1,v2` axes, one validated recipe and run folder per point.

Every point is loaded exactly as `--set` overrides on the base recipe would be, so a point is invalid for the
same reasons (and with the same messages) as the equivalent single run; invalid points are listed and skipped
rather than failing the sweep. Point folders are named from their overrides (`lr-3e-4_ep-8`), deterministic so
that re-running a sweep reuses (and resumes) the same folders. Points sharing a launch section go into one
SLURM job array whose task i reads the resolved recipe of point i.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from moe_train.atomic import write_atomic
from moe_train.config import Recipe, RecipeError, load_recipe, parse_override
from moe_train.run_files import LOGS_DIR

from .render import check_renderable, render_array
from .rundir import check_reusable, run_dir_path, write_run_dir
from .shell import LaunchError
from .submit import memory_problems, record_submission, sbatch, submittable_problems

SWEEP_FILE = "sweep.json"
MAX_NAME = 96
UNSAFE = re.compile(r"[^A-Za-z0-9._+=-]+")
UNSWEEPABLE = {"run_dir", "name", "extends", "provenance"}


@dataclass(frozen=True)
class Axis:
    """One `--grid` option: a dotted field path and the values it takes, as YAML text."""

    path: str
    values: tuple[str, ...]


@dataclass
class Point:
    index: int
    overrides: tuple[str, ...]
    name: str
    recipe: Recipe | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return self.recipe is not None and not self.problems


def _split_values(text: str) -> list[str]:
    """Split on commas outside brackets and quotes, so `[1,2],[3,4]` is two list values."""
    values, depth, quote, current = [], 0, "", []
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            values.append("".join(current).strip())
            current = []
            continue
        current.append(char)
    values.append("".join(current).strip())
    return values


def parse_axis(spec: str) -> Axis:
    """`train.lr=1e-4,3e-4` -> Axis; raises LaunchError with one line naming the option."""
    path, sep, raw = spec.partition("=")
    path = path.strip()
    if not sep or not raw.strip():
        raise LaunchError([f"--grid {spec}: expected dotted.path=value1,value2,..."])
    try:
        parse_override(f"{path}=0")
    except ValueError:
        raise LaunchError([f"--grid {spec}: '{path}' is not a dotted field path"]) from None
    if path.split(".")[0] in UNSWEEPABLE:
        raise LaunchError([f"--grid {spec}: {path} cannot be swept (each point gets its own run_dir)"])
    values = _split_values(raw)
    if any(not v for v in values):
        raise LaunchError([f"--grid {spec}: empty value"])
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise LaunchError([f"--grid {spec}: value(s) {', '.join(repeated)} repeated"])
    return Axis(path, tuple(values))


def parse_axes(specs: Sequence[str]) -> list[Axis]:
    axes, problems = [], []
    for spec in specs:
        try:
            axes.append(parse_axis(spec))
        except LaunchError as error:
            problems += error.problems
    paths = [a.path for a in axes]
    problems += [f"--grid {p}: given twice" for p in sorted({p for p in paths if paths.count(p) > 1})]
    if not specs:
        problems.append("--grid: at least one axis is needed (e.g. --grid train.lr=1e-4,3e-4)")
    if problems:
        raise LaunchError(problems)
    return axes


def _short_hash(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:8]


def point_name(overrides: Sequence[tuple[str, str]], keys: Sequence[str]) -> str:
    """`lr-3e-4_ep-8` from (train.lr, 3e-4), (parallel.ep, 8) with keys (lr, ep); a hash of the exact overrides
    is appended when making the name filesystem-safe changed a value, or when it grew too long."""
    parts = [f"{key}-{value}" for key, (_, value) in zip(keys, overrides, strict=True)]
    name = "_".join(UNSAFE.sub("~", part) for part in parts)
    exact = ",".join(f"{path}={value}" for path, value in overrides)
    if name != "_".join(parts) or len(name) > MAX_NAME:
        name = name[:MAX_NAME].rstrip("~_") + "_h" + _short_hash(exact)
    return name


def axis_keys(axes: Sequence[Axis]) -> list[str]:
    """The last component of each path, or the whole dotted path where two axes share a last component."""
    last = [a.path.split(".")[-1] for a in axes]
    return [a.path if last.count(k) > 1 else k for a, k in zip(axes, last, strict=True)]


def expand(recipe_ref: str, sets: Sequence[str], axes: Sequence[Axis], *, preflight: bool = False,
           for_submit: bool = False) -> tuple[Path, list[Point]]:
    """The sweep folder (the base recipe's run_dir) and every point, each validated.

    Raises RecipeError when the base recipe itself is invalid: then no point could be.
    """
    base = load_recipe(recipe_ref, sets)
    sweep_dir = run_dir_path(base)
    keys = axis_keys(axes)
    points = []
    for index, combo in enumerate(itertools.product(*(a.values for a in axes))):
        pairs = [(a.path, v) for a, v in zip(axes, combo, strict=True)]
        overrides = tuple(f"{p}={v}" for p, v in pairs)
        point = Point(index, overrides, point_name(pairs, keys))
        try:
            recipe = load_recipe(recipe_ref, [*sets, *overrides])
        except RecipeError as error:
            point.problems = list(error.problems)
        else:
            recipe = recipe.model_copy(update={"run_dir": str(sweep_dir / point.name)})
            point.recipe = recipe
            point.problems = check_renderable(recipe)
            if for_submit:
                point.problems += submittable_problems(recipe, preflight=preflight)
            elif not preflight:
                point.problems += memory_problems(recipe)
            try:
                check_reusable(recipe, sweep_dir / point.name)
            except LaunchError as error:
                point.problems += error.problems
        points.append(point)
    return sweep_dir, points


def write_sweep(recipe_ref: str, sets: Sequence[str], axes: Sequence[Axis], sweep_dir: Path,
                points: Sequence[Point]) -> None:
    """Create each valid point's run folder (`expand` checked that it may be reused), the sweep's logs/ (SLURM
    does not create --output folders), and record the whole sweep in {sweep_dir}/sweep.json."""
    (sweep_dir / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    for point in points:
        if point.valid:
            write_run_dir(point.recipe)
    record = {
        "recipe": recipe_ref,
        "sets": list(sets),
        "grid": {a.path: list(a.values) for a in axes},
        "points": [
            {"index": p.index, "name": p.name, "overrides": list(p.overrides), "valid": p.valid,
             "run_dir": str(sweep_dir / p.name) if p.valid else None, "problems": p.problems}
            for p in points
        ],
    }
    write_atomic(sweep_dir / SWEEP_FILE, json.dumps(record, indent=2) + "\n")


def launch_groups(points: Sequence[Point]) -> list[list[Point]]:
    """Valid points grouped by identical launch sections (one job array each), in point order."""
    groups: dict[str, list[Point]] = {}
    for point in points:
        if point.valid:
            groups.setdefault(point.recipe.launch.model_dump_json(), []).append(point)
    return list(groups.values())


@dataclass(frozen=True)
class ArrayJob:
    script: Path
    points: tuple[Point, ...]
    job_id: str | None


def submit_arrays(sweep_dir: Path, points: Sequence[Point], *, max_parallel: int | None = None,
                  preflight: bool = False, dry_run: bool = False) -> list[ArrayJob]:
    """Render one job array per launch group into the sweep folder and sbatch each (unless `dry_run`)."""
    jobs = []
    groups = launch_groups(points)
    for number, group in enumerate(groups):
        suffix = "" if len(groups) == 1 else f"-{number}"
        script = sweep_dir / f"{'preflight' if preflight else 'sweep'}{suffix}.sbatch"
        text = render_array(group[0].recipe, [sweep_dir / p.name for p in group], sweep_dir,
                            max_parallel=max_parallel, preflight=preflight)
        write_atomic(script, text)
        script.chmod(0o755)
        job_id = None
        if not dry_run:
            job_id = sbatch(script)
            for task, point in enumerate(group):
                record_submission(sweep_dir / point.name, f"{job_id}_{task}", "preflight" if preflight else "train",
                                  script)
        jobs.append(ArrayJob(script, tuple(group), job_id))
    return jobs


def format_table(points: Sequence[Point]) -> str:
    """The points as aligned text: index, folder name, status, overrides or the reasons it is invalid."""
    width = max([len(p.name) for p in points] + [5])
    lines = [f"{'#':>4}  {'point':<{width}}  status   overrides / problems"]
    for p in points:
        lines.append(f"{p.index:>4}  {p.name:<{width}}  {'ok' if p.valid else 'invalid':<7}  {' '.join(p.overrides)}")
        lines += [f"{'':>4}  {'':<{width}}  {'':<7}    {problem}" for problem in p.problems]
    valid = sum(p.valid for p in points)
    lines.append(f"{valid} of {len(points)} point(s) valid")
    return "\n".join(lines)
