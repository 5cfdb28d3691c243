"""`moe-train validate`: check a recipe on the login node and summarise the job it describes."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from moe_train.config import Recipe, unsupported
from moe_train.config.fp8_auto import with_fp8_resolved
from moe_train.config.hardware import hardware_table
from moe_train.plan.fit import check_fit
from moe_train.plan.params import count_parameters

from .common import RecipeArgument, SetOption, fail, load_or_exit


def format_count(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e8 else f"{count / 1e6:.2f}M"


def summary_table(recipe: Recipe) -> Table:
    m, p, t, launch = recipe.model, recipe.parallel, recipe.train, recipe.launch
    params = count_parameters(m)
    table = Table(title=f"{recipe.name}: valid", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    size = f"{format_count(params.total)} total, {format_count(params.active)} active per token"
    if params.mtp:
        size += f" (+{format_count(params.mtp)} in {m.mtp_layers} MTP module)"
    table.add_row("model", f"{m.family}, {m.num_layers} layers, hidden {m.hidden_size}")
    table.add_row("parameters", size)
    if m.moe is not None:
        table.add_row(
            "experts",
            f"{m.moe.num_experts} routed, top-{m.moe.top_k}, {m.moe.router.score_function} router, "
            f"balancing {m.moe.router.load_balancing}" + (" + expert bias" if m.moe.router.expert_bias else ""),
        )
    layout = f"pp {p.pp} x dp {recipe.dp} x cp {p.cp} x tp {p.tp}"
    if p.vpp > 1:
        layout += f" (vpp {p.vpp})"
    if p.dp_replicate > 1:
        layout += f" (HSDP: dpr {p.dp_replicate} x dps {recipe.dp // p.dp_replicate})"
    if m.moe is not None:
        layout += f" | experts: edp {recipe.edp} x ep {p.ep} x etp {p.etp}"
    extras = [name for name, on in (("sequence parallel", p.sequence_parallel),) if on]
    if p.recompute.granularity != "none":
        extras.append(f"{p.recompute.granularity} recompute ({', '.join(p.recompute.modules)})")
    table.add_row("layout", layout + (f"; {', '.join(extras)}" if extras else ""))
    hardware = hardware_table()[launch.gpu]
    table.add_row(  # a hardware file's name and the run dir are the user's text, not rich markup
        "world size", f"{recipe.world_size} = {launch.nodes} node(s) x {launch.gpus_per_node} ({escape(hardware.name)})"
    )
    tokens = t.global_batch_size * t.seq_length
    micro_batches = t.global_batch_size // (t.micro_batch_size * recipe.dp)
    table.add_row(
        "batch",
        f"{tokens:,} tokens per step = {t.global_batch_size} x {t.seq_length}; "
        f"{micro_batches} micro-batch(es) of {t.micro_batch_size} per rank",
    )
    scaling = with_fp8_resolved(recipe).train.fp8.recipe
    scaling += f" (auto on {launch.gpu})" if t.fp8.recipe == "auto" else ""
    precision = (f"fp8 {scaling} ({t.fp8.backend}: {', '.join(t.fp8.modules)})" if t.precision == "fp8"
                 else t.precision)
    table.add_row("training", f"{t.steps:,} steps, {precision}, lr {t.lr:g} ({t.lr_schedule})")
    table.add_row("run dir", escape(recipe.resolved_run_dir()))
    missing = unsupported(recipe)
    table.add_row(
        "engine",
        "can train this" if not missing else "[yellow]valid, but run/submit refuse it: " + "; ".join(missing),
    )
    return table


def validate(recipe: RecipeArgument, set: SetOption = None) -> None:
    """Check RECIPE (a file or built-in name) and print a one-screen summary; exit 2 listing every problem.

    Examples:

        moe-train validate recipes/qwen3-30b-a3b.yaml

        moe-train validate qwen3-30b-a3b --set parallel.ep=16 --set launch.nodes=8
    """
    loaded = load_or_exit(recipe, set)
    Console().print(summary_table(loaded))
    fit = check_fit(loaded)
    if fit.warning:
        print(f"warning: {fit.warning}", file=sys.stderr)
    if fit.error:
        fail([fit.error])
