"""`moe-train measure`: count what one training step of one rank does (FLOPs, activations, collectives, memory).

Login-node module: torch is imported inside the command only. docs/measure.md explains every figure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from moe_train.config import Recipe, dump_recipe, unsupported
from moe_train.run_files import RECIPE_FILE

from .common import RecipeArgument, SetOption, fail, load_or_exit
from .run import _free_port


def parse_layers(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        fail([f"--layers: {text!r} is not a comma-separated list of layer indices (e.g. 0,3)"])


def _problems(recipe: Recipe, *, fake: bool, rank: int, nproc: int | None, layers: tuple[int, ...] | None) -> list:
    from moe_train.measure.targets import fake_problems, layer_problems  # torch-free

    problems = unsupported(recipe)
    if not 0 <= rank < recipe.world_size:
        problems.append(f"--rank: {rank} is not a rank of the recipe's world size {recipe.world_size}")
    elif layers is not None:
        problems += layer_problems(recipe, layers, rank)
    if fake and nproc is not None:
        problems.append("--fake and --nproc exclude each other: --fake plays one rank of the recipe's world size")
    if fake:
        problems += fake_problems(recipe)
    if not fake and recipe.launch.nodes > 1:
        problems.append(f"launch.nodes: {recipe.launch.nodes} nodes; a real measurement runs on this machine only "
                        "(use --fake, or --nproc N)")
    return problems


def _measure_with_torchrun(recipe: Recipe, *, rank: int, layers: tuple[int, ...] | None) -> dict:
    """Start every rank with torchrun on this machine; rank `rank` writes the report, read back here."""
    with tempfile.TemporaryDirectory(prefix="moe-train-measure-") as folder:
        recipe_file, out = Path(folder) / RECIPE_FILE, Path(folder) / "report.json"
        recipe_file.write_text(dump_recipe(recipe), encoding="utf-8")
        argv = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "1", "--nproc-per-node", str(recipe.launch.gpus_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
            "-m", "moe_train.measure.rank", "--recipe", str(recipe_file), "--out", str(out), "--rank", str(rank),
        ]
        if layers is not None:
            argv += ["--layers", ",".join(map(str, layers))]
        env = {**os.environ, **recipe.launch.env}
        env.setdefault("OMP_NUM_THREADS", "1")
        code = subprocess.run(argv, env=env, check=False, stdout=subprocess.DEVNULL).returncode
        if code != 0 or not out.exists():
            raise typer.Exit(1)
        return json.loads(out.read_text(encoding="utf-8"))


def _bytes(value: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:,.2f} {unit}"
    return f"{value} B"


def _flops(value: int) -> str:
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if value >= size:
            return f"{value / size:,.2f} {unit}"
    return f"{value} FLOP"


def report_table(recipe: Recipe, report: dict) -> Table:
    how = "fake tensors, fake process group, even routing" if report["fake"] else "real tensors"
    table = Table(title=f"{recipe.name}: one training step of rank {report['rank']} of {report['world_size']} "
                  f"({how})", title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_column()
    table.add_row("step", f"{report['tokens']:,} tokens", f"{report['micro_batches']} micro-batch(es) on this rank")
    flops = report["flops"]
    for phase in ("forward", "backward", "recompute", "total"):
        table.add_row(f"FLOPs {phase}", _flops(flops[phase]), "executed, matmuls and attention")
    if flops["optimizer"]:
        table.add_row("FLOPs optimizer", _flops(flops["optimizer"]), "Muon's Newton-Schulz products, not in total")
    for layer, value in report["activation_bytes_per_layer"].items():
        if layer == "other":
            table.add_row("activations other", _bytes(value), "shared tables, embedding, head, loss")
        else:
            table.add_row(f"activations layer {layer}", _bytes(value), "saved for backward, one micro-batch")
    table.add_row("activations total", _bytes(report["activation_bytes_total"]), "one micro-batch")
    table.add_row("parameters", _bytes(report["param_bytes"]), "this rank's shards")
    table.add_row("gradients", _bytes(report["grad_bytes"]), "before the update")
    table.add_row("optimizer state", _bytes(report["optimizer_bytes"]), "AdamW moments and steps; Muon momentum")
    table.add_row("peak memory", _bytes(report["peak_memory_bytes"]), "live tensor bytes")
    for key, value in report["comm_bytes"].items():
        table.add_row(f"comm {key}", _bytes(value), f"{report['comm_calls'][key]} call(s), payload sent")
    if not report["comm_bytes"]:
        table.add_row("comm", "0", "no collective over more than one rank")
    for key, value in report["fp8_gemms"].items():
        table.add_row(f"fp8 GEMMs {key}", f"{value:,}", "emulated: quantised, dequantised, bf16 GEMM"
                      if key.endswith("/emulated") else "torch._scaled_mm")
    return table


def measure(
    recipe: RecipeArgument,
    set: SetOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
    fake: Annotated[
        bool,
        typer.Option("--fake", help="Fake tensors and a fake process group at the recipe's world size, even "
                     "routing: full-size layers on this machine, no memory or peers needed."),
    ] = False,
    nproc: Annotated[
        int | None,
        typer.Option("--nproc", min=1, help="Ranks on this machine (launch.nodes=1, launch.gpus_per_node=N), "
                     "started with torchrun.", show_default=False),
    ] = None,
    rank: Annotated[int, typer.Option("--rank", help="The rank whose step is reported.")] = 0,
    layers: Annotated[
        str | None,
        typer.Option("--layers", help="Layers to keep, e.g. 0,3 (indices from num_layers on: MTP modules). "
                     "Default: all; under --fake one layer of each kind.", show_default=False),
    ] = None,
) -> None:
    """Measure one training step of one rank: FLOPs, activation bytes per layer, bytes per collective, memory.

    Examples:

        moe-train measure qwen3-moe-tiny --json

        moe-train measure qwen3-tiny --nproc 2 --rank 1

        moe-train measure deepseek-v3 --fake --set parallel.pp=1 ... (see docs/measure.md)
    """
    overrides = list(set or [])
    if nproc is not None:
        overrides += ["launch.nodes=1", f"launch.gpus_per_node={nproc}"]
    resolved = load_or_exit(recipe, overrides, check_files=not fake)
    picked = parse_layers(layers)
    problems = _problems(resolved, fake=fake, rank=rank, nproc=nproc, layers=picked)
    if problems:
        fail(problems)
    if resolved.world_size > 1 and not fake:
        report = _measure_with_torchrun(resolved, rank=rank, layers=picked)
    else:
        report = _measure_here(resolved, fake=fake, rank=rank, layers=picked)
    if as_json:
        print(json.dumps(report))
    else:
        Console().print(report_table(resolved, report))


def _measure_here(recipe: Recipe, *, fake: bool, rank: int, layers: tuple[int, ...] | None) -> dict:
    from moe_train.measure.driver import Target
    from moe_train.measure.driver import measure as measure_in_process
    from moe_train.measure.targets import layer_kinds
    from moe_train.train import input_errors

    if fake and layers is None:
        layers = layer_kinds(recipe, rank)
    try:
        return measure_in_process(recipe, Target(rank=rank, layers=layers, fake=fake))
    except input_errors() as error:
        fail(getattr(error, "problems", None) or str(error).splitlines()[:1])
    except Exception as error:  # a runtime failure: one line, exit 1
        reason = str(error).splitlines()[0] if str(error) else ""
        fail([f"{type(error).__name__}: {reason}"], code=1)
