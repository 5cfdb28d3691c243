"""Render a recipe into what starts it: a torchrun command line, or an sbatch script (one job or a job array).

The script text lives in the jinja2 template slurm/job.sbatch.j2 (installed as moe_train.slurm); this module
decides every value that goes into it and quotes each for where it lands (see shell.py). Rendering never
imports torch: it runs on login nodes, once per sweep point.
"""

from __future__ import annotations

import functools
import importlib.resources
from collections.abc import Sequence
from pathlib import Path

import moe_train
from moe_train.config import Recipe
from moe_train.run_files import COMPLETE_FILE, LOGS_DIR, PREEMPT_FILE, RECIPE_FILE

from .shell import LaunchError, env_name_problems, one_line, sbatch_value, sh, sh_join, slurm_filename

TEMPLATE = "job.sbatch.j2"
DEFAULT_RDZV_PORT = 29500
PREFLIGHT_TIME = "00:10:00"
ENTRY_MODULE = "moe_train.entry"


@functools.lru_cache(maxsize=1)
def _environment():
    """The jinja2 environment, imported on first render: every other command skips jinja2's import time."""
    import jinja2

    def load(name: str) -> str:
        return importlib.resources.files("moe_train.slurm").joinpath(name).read_text()

    env = jinja2.Environment(
        loader=jinja2.FunctionLoader(load),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["sh"] = sh
    return env


def check_renderable(recipe: Recipe) -> list[str]:
    """Problems that would make a rendered job unsafe or unparseable (the loader's rules catch most first)."""
    launch, slurm = recipe.launch, recipe.launch.slurm
    problems = env_name_problems(launch.env)
    problems += one_line("run_dir", recipe.resolved_run_dir())
    for field in ("partition", "account", "time", "job_name", "qos", "constraint", "container_image"):
        value = getattr(slurm, field)
        if value is not None:
            problems += one_line(f"launch.slurm.{field}", value)
    for index, directive in enumerate(slurm.extra_sbatch):
        field = f"launch.slurm.extra_sbatch.{index}"
        problems += one_line(field, directive)
        if not directive.startswith("-"):
            problems.append(f"{field}: {directive!r} is not an sbatch option (write it as --name=value)")
    return problems


def _require_renderable(recipe: Recipe) -> None:
    problems = check_renderable(recipe)
    if problems:
        raise LaunchError(problems)


def torchrun_argv(
    recipe: Recipe,
    run_dir: Path,
    *,
    host: str = "localhost",
    port: int = DEFAULT_RDZV_PORT,
    rdzv_id: str | None = None,
    preflight: bool = False,
) -> list[str]:
    """The torchrun command that starts every rank of one node for this recipe (run it on each node)."""
    argv = [
        "torchrun",
        "--nnodes", str(recipe.launch.nodes),
        "--nproc-per-node", str(recipe.launch.gpus_per_node),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{host}:{port}",
        "--rdzv-id", rdzv_id or recipe.name,
        "-m", ENTRY_MODULE,
        "--recipe", str(run_dir / RECIPE_FILE),
    ]
    return [*argv, "--preflight"] if preflight else argv


def render_torchrun(
    recipe: Recipe,
    run_dir: Path,
    *,
    host: str = "localhost",
    port: int = DEFAULT_RDZV_PORT,
    preflight: bool = False,
) -> str:
    """A shell snippet: the recipe's env exports and setup lines, then the quoted torchrun command."""
    _require_renderable(recipe)
    lines = [f"export {name}={sh(value)}" for name, value in recipe.launch.env.items()]
    lines += list(recipe.launch.setup)
    lines.append(sh_join(torchrun_argv(recipe, run_dir, host=host, port=port, preflight=preflight)))
    return "\n".join(lines) + "\n"


def sbatch_directives(
    recipe: Recipe,
    output: str,
    *,
    preflight: bool = False,
    array: str | None = None,
) -> list[str]:
    """The #SBATCH options (without the prefix), each value quoted for sbatch's tokenizer; `output` is a SLURM
    filename pattern (literal parts escaped with slurm_filename)."""
    launch, slurm = recipe.launch, recipe.launch.slurm
    name = slurm.job_name or recipe.name
    if preflight:
        name += "-preflight"
    out = [f"--job-name={sbatch_value(name)}", f"--nodes={launch.nodes}", "--ntasks-per-node=1"]
    if launch.device == "cuda":
        out.append(f"--gpus-per-node={launch.gpus_per_node}")
    else:
        out.append(f"--cpus-per-task={launch.gpus_per_node}")
    for field in ("partition", "account", "qos", "constraint"):
        value = getattr(slurm, field)
        if value is not None:
            out.append(f"--{field}={sbatch_value(value)}")
    time = PREFLIGHT_TIME if preflight else slurm.time
    if time is not None:
        out.append(f"--time={sbatch_value(time)}")
    if slurm.exclusive:
        out.append("--exclusive")
    out.append(f"--output={sbatch_value(output)}")
    out.append("--open-mode=append")
    if array is not None:
        out.append(f"--array={array}")
    if preflight:
        out.append("--no-requeue")
    else:
        if slurm.signal_seconds > 0:
            out.append(f"--signal=B:USR1@{slurm.signal_seconds}")
        out.append("--requeue" if slurm.requeue else "--no-requeue")
    out.extend(slurm.extra_sbatch)
    return out


def _srun_args(recipe: Recipe, run_dirs: Sequence[Path]) -> list[str]:
    image = recipe.launch.slurm.container_image
    if image is None:
        return []
    mounts = ",".join(sorted({str(d) for d in run_dirs}))
    return [f"--container-image={image}", f"--container-mounts={mounts}"]


def _render(recipe: Recipe, *, title: str, directives: list[str], preflight: bool, run_dirs: Sequence[Path],
            **extra) -> str:
    _require_renderable(recipe)
    launch, slurm = recipe.launch, recipe.launch.slurm
    notice = not preflight and slurm.signal_seconds > 0
    return _environment().get_template(TEMPLATE).render(
        title=title,
        version=moe_train.__version__,
        directives=directives,
        env=list(launch.env.items()),
        setup=list(launch.setup),
        gpus_per_node=launch.gpus_per_node,
        entry_module=ENTRY_MODULE,
        srun_args=_srun_args(recipe, run_dirs),
        run_dirs=[str(d) for d in run_dirs],
        preflight=preflight,
        notice=notice,
        signal_seconds=slurm.signal_seconds,
        requeue=slurm.requeue,
        max_restarts=slurm.max_restarts,
        logs_dir=LOGS_DIR,
        recipe_file=RECIPE_FILE,
        notice_file=PREEMPT_FILE,
        complete_file=COMPLETE_FILE,
        **extra,
    )


def render_sbatch(recipe: Recipe, run_dir: Path, *, preflight: bool = False) -> str:
    """The batch script of one run; `preflight` makes a short job of the same shape that only checks the
    allocation (entry --preflight), with no preemption handling and no requeue."""
    log = slurm_filename(str(run_dir / LOGS_DIR)) + ("/preflight-%j.out" if preflight else "/slurm-%j.out")
    purpose = "preflight of" if preflight else "training job for"
    return _render(
        recipe,
        title=f"moe-train {purpose} recipe {recipe.name}",
        directives=sbatch_directives(recipe, log, preflight=preflight),
        preflight=preflight,
        run_dirs=[run_dir],
        array=False,
        run_dir=str(run_dir),
    )


def render_array(recipe: Recipe, run_dirs: Sequence[Path], sweep_dir: Path, *, max_parallel: int | None = None,
                 preflight: bool = False) -> str:
    """One job array over sweep points that share `recipe`'s launch section; task i runs `run_dirs[i]`."""
    if not run_dirs:
        raise LaunchError(["sweep: no valid points to submit"])
    array = f"0-{len(run_dirs) - 1}" + (f"%{max_parallel}" if max_parallel else "")
    log = slurm_filename(str(sweep_dir / LOGS_DIR)) + "/slurm-%A_%a.out"
    return _render(
        recipe,
        title=f"moe-train sweep of {len(run_dirs)} point(s) of recipe {recipe.name}",
        directives=sbatch_directives(recipe, log, preflight=preflight, array=array),
        preflight=preflight,
        run_dirs=run_dirs,
        array=True,
        sweep_dir=str(sweep_dir),
    )
