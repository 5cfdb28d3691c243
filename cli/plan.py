"""`moe-train plan`: will the recipe fit its GPUs, and how fast will it train? Login node, no torch."""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from moe_train.config.hardware import HardwareError, hardware_table
from moe_train.plan.assumptions import Assumptions
from moe_train.plan.estimate import Plan, estimate, plan_json
from moe_train.plan.fit import memory_line

from .common import RecipeArgument, SetOption, fail, load_or_exit

GB = 1e9



def _offload_term(t: dict) -> str:
    return f" + exposed offload copies {t['offload_exposed']:.2f}" if t["offload_exposed"] else ""


def _offload_line(off: dict) -> str:
    """parallel.offload: what the host pool holds and whether the layers' copies hide behind their compute."""
    text = f"{', '.join(off['modules'])}: {off['host_bytes'] / GB:.1f} GB in the host pool at the peak"
    if off["host_link_bytes_per_s"] is None:
        return text + "; copies not priced (no host_link_bytes_per_s in the hardware table)"
    worst = max(off["per_layer"].values(), key=lambda v: v["copy_s"] - v["forward_s"], default=None)
    if worst is None:
        return text
    hidden = "hidden behind" if worst["copy_s"] <= worst["forward_s"] else "exposed past"
    return (text + f"; a layer's copy {worst['copy_s'] * 1e3:.2f} ms each way at "
            f"{off['host_link_bytes_per_s'] / GB:.0f} GB/s, {hidden} its forward {worst['forward_s'] * 1e3:.2f} ms "
            f"(backward {worst['backward_s'] * 1e3:.2f} ms): {off['exposed_s']:.2f} s a step exposed")

def _assumptions(specs: list[str] | None) -> Assumptions:
    """`--assume name=value` over the defaults; one error line per bad spec."""
    known = {f.name: f.type for f in fields(Assumptions)}
    values, problems = {}, []
    for spec in specs or []:
        name, sep, raw = spec.partition("=")
        name = name.strip()
        if not sep or name not in known:
            problems.append(f"--assume {spec}: expected NAME=VALUE, NAME one of {', '.join(known)}")
            continue
        default = getattr(Assumptions(), name)
        try:
            if isinstance(default, bool):
                if raw.strip().lower() not in ("true", "false"):
                    raise ValueError
                values[name] = raw.strip().lower() == "true"
            else:
                values[name] = type(default)(float(raw)) if isinstance(default, int) else float(raw)
        except ValueError:
            problems.append(f"--assume {spec}: {name} takes a {type(default).__name__}")
    if problems:
        fail(problems)
    return replace(Assumptions(), **values)


def _layout_text(plan: Plan) -> str:
    lay = plan.layout
    text = f"tp {lay.tp} pp {lay.pp}" + (f" vpp {lay.vpp}" if lay.vpp > 1 else "") + f" dp {lay.dp}"
    if lay.cp > 1:
        text += f" cp {lay.cp} ({plan.recipe.parallel.cp_exchange(plan.recipe.model.family)})"
    if lay.dpr > 1:
        text += f" (HSDP dpr {lay.dpr} x dps {lay.dps})"
    if plan.recipe.model.moe is not None:
        text += f" | ep {lay.ep} etp {lay.etp} edp {lay.edp}, {plan.recipe.model.moe.dispatcher} dispatch"
    if lay.sequence_parallel:
        text += ", SP"
    if plan.recipe.train.precision == "fp8":
        text += f"; fp8 {plan.recipe.train.fp8.recipe}" + (" (auto)" if plan.fp8_auto else "")
    rc = lay.recompute
    text += f"; recompute {rc.granularity}" + (f" ({', '.join(rc.modules)})" if rc.granularity == "selective" else "")
    return text + f"; micro-batch {lay.micro_batch} x {lay.micro_batches}"


def _table(plan: Plan) -> Table:
    data = plan_json(plan)
    mem = data["memory_bytes"]
    status = "[green]fits" if plan.fits and not plan.tight else "[yellow]fits within the margin" if plan.fits \
        else "[red]does not fit"
    table = Table(title=f"{plan.recipe.name} on {plan.layout.world_size} x {plan.hardware.name}: {status}",
                  show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("layout", _layout_text(plan))
    table.add_row("memory", memory_line(plan))
    budget = plan.device_memory * (1 - plan.assumptions.memory_margin)
    table.add_row("", f"margin {plan.assumptions.memory_margin:.0%}: comfortable up to {budget / GB:.1f} GB; "
                      f"total {mem['total'] / GB:.1f} GB")
    t = data["time_s"]
    slowest = f" (the slowest: pipeline rank {plan.time_rank})" if plan.layout.pp > 1 else ""
    table.add_row("step time", f"{t['step']:.2f} s{slowest} = compute {t['compute']:.2f} + memory-bound "
                               f"{t['elementwise']:.2f} + exposed comm {t['comm_exposed']:.2f} + MoE syncs "
                               f"{t['moe_sync']:.2f}{_offload_term(t)} + bubble "
                               f"{t['bubble']:.2f} + optimizer {t['optimizer']:.2f}")
    if plan.recipe.parallel.ep_overlap:
        shown = ", ".join(f"{key} {c['exposed_fraction']:.2f} of {c['own_s']:.2f} s"
                          for key, c in data["exposed_comm"].items())
        table.add_row("ep_overlap", f"the overlapped pairs hide {t['ep_comm_hidden']:.2f} s of EP comm; exposed: "
                                    f"{shown or 'none'}")
    if data["offload"]:
        table.add_row("offload", _offload_line(data["offload"]))
    table.add_row("throughput", f"{data['tokens_per_s']:,.0f} tokens/s, {data['tflops_per_gpu']:.0f} TFLOP/s per GPU "
                                f"({data['tflops_per_gpu_megatron']:.0f} in Megatron-Core's convention, causal "
                                f"attention over half of s x s), MFU {data['mfu']:.1%}")
    routing = data["routing"]
    if routing and routing["nodes"] > 1:
        table.add_row("routing", f"a token needs {routing['expected_nodes']:.2f} of {routing['nodes']} nodes "
                                 f"({routing['expected_ranks']:.2f} ranks) under its router, in expectation")
    share = data["flops"]["recompute"] / data["flops"]["total"]
    table.add_row("FLOPs", f"model {data['model_flops_per_step']:.3e} per step; executed "
                           f"{data['executed_flops_per_step']:.3e} (recompute {share:.1%})"
                           + (f"; optimizer {data['flops']['optimizer']:.3e} on this rank (Muon's Newton-Schulz)"
                              if data["flops"]["optimizer"] else ""))
    for key, value in data["comm_bytes"].items():
        table.add_row(f"comm {key}", f"{value / GB:.2f} GB per step over {data['comm_links'][key]}")
    return table


def plan(
    recipe: RecipeArgument,
    gpu: Annotated[str | None, typer.Option("--gpu", help="Plan on this GPU (an id of the hardware table).")] = None,
    nodes: Annotated[int | None, typer.Option("--nodes", min=1, help="Plan on this many nodes.")] = None,
    set: SetOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as one JSON object.")] = False,
    search: Annotated[
        bool, typer.Option("--search", help="Rank every valid layout that fits the GPUs by estimated throughput.")
    ] = False,
    top: Annotated[int, typer.Option("--top", min=1, help="With --search: how many layouts to show.")] = 5,
    assume: Annotated[
        list[str] | None,
        typer.Option("--assume", help="Change a model assumption: NAME=VALUE (docs/plan.md lists them).",
                     show_default=False),
    ] = None,
    routing: Annotated[
        Path | None,
        typer.Option("--routing", help="Price the step with a run's measured routing (its routing.jsonl): the "
                     "most loaded rank's expert rows and all-to-all bytes per MoE layer, moe_imbalance measured.",
                     show_default=False, metavar="RUN_DIR"),
    ] = None,
) -> None:
    """Estimate memory per GPU, step time, tokens/s and MFU for RECIPE on its launch target (or --gpu/--nodes).

    Exit 2 when the recipe is invalid. A plan that does not fit is reported, not an error (validate fails it).

    Examples:

        moe-train plan recipes/qwen3-30b-a3b.yaml --gpu h100 --nodes 4

        moe-train plan deepseek-v3 --search --json

        moe-train plan qwen3-moe-tiny --gpu h100 --routing runs/qwen3-moe-tiny
    """
    sets = list(set or [])
    try:
        table = hardware_table()
    except HardwareError as error:
        fail([str(error)])
    if gpu is not None:
        if gpu not in table or gpu == "cpu":
            fail([f"--gpu: unknown '{gpu}'; allowed: {', '.join(k for k in table if k != 'cpu')}"])
        sets += ["launch.device=cuda", f"launch.gpu={gpu}", f"launch.gpus_per_node={table[gpu].gpus_per_node}"]
    if nodes is not None:
        sets.append(f"launch.nodes={nodes}")
    loaded = load_or_exit(recipe, sets, check_files=False)
    if loaded.launch.device == "cpu" or loaded.launch.gpu == "cpu":
        fail(["launch.device: plan needs a GPU target: give --gpu (e.g. --gpu h100) or launch.device cuda"])
    hardware = table[loaded.launch.gpu]
    assumptions = _assumptions(assume)
    loads = None if routing is None else _trace_or_exit(loaded, routing)
    if search:
        _search(loaded, hardware, assumptions, top=top, as_json=as_json, loads=loads)
        return
    result = estimate(loaded, hardware, assumptions)
    routed = None if loads is None else _routed(loaded, hardware, assumptions, loads)
    if as_json:
        data = plan_json(result)
        if routed is not None:
            data["routing"] = {**routed[0].to_json(), "all_to_all_extra_s": routed[2],
                               **{f"routed_{k}": v for k, v in _speed(routed[1], routed[2]).items()}}
        print(json.dumps(data))
        return
    console = Console(width=None if sys.stdout.isatty() else 140)
    console.print(_table(result))
    if routed is not None:
        console.print(_routing_table(result, *routed, run_dir=routing))


def _trace_or_exit(recipe, run_dir: Path):
    from moe_train.plan.routing import TraceError, read_trace, routing_plan

    if recipe.model.moe is None:
        fail(["--routing: the recipe has no MoE layers"])
    try:
        loads = read_trace(run_dir)
        routing_plan(recipe, loads)  # the trace fits the recipe
    except (TraceError, ValueError) as error:
        fail([f"--routing: {error}"])
    return loads


def _routed(recipe, hardware, assumptions: Assumptions, loads, *, every_rank: bool = True):
    """(the trace's RoutingPlan on the recipe's layout, the plan with its measured moe_imbalance, the seconds
    the slowest ranks' all-to-alls add to that plan's step)."""
    from moe_train.plan.routing import all_to_all_seconds, routing_plan

    routing = routing_plan(recipe, loads)
    planned = replace(assumptions, moe_imbalance=routing.imbalance)
    routed = estimate(recipe, hardware, planned, every_rank=every_rank)
    return routing, routed, all_to_all_seconds(routing, recipe, hardware, planned, routed.ep_phases)


def _speed(plan: Plan, extra_s: float = 0.0) -> dict:
    """Step time, tokens/s and MFU, with `extra_s` seconds added to the step (the routed all-to-alls')."""
    step = plan.step_time + extra_s
    return {"step_time_s": step, "tokens_per_s": plan.tokens_per_s * plan.step_time / step,
            "mfu": plan.mfu * plan.step_time / step}


def _routing_table(balanced: Plan, routing, routed: Plan, extra_s: float, *, run_dir: Path) -> Table:
    table = Table(title=f"measured routing of {run_dir} ({routing.steps} steps) on ep {routing.ep}, "
                        f"{routing.placement} placement", title_justify="left")
    for column in ("MoE layer", "slowest rank", "expert rows", "even share", "max/mean", "all-to-all MB max",
                   "balanced MB"):
        table.add_column(column, justify="right")
    for layer in routing.layers:
        table.add_row(str(layer.layer), str(layer.straggler_rank), f"{layer.rows_max:,.0f}",
                      f"{layer.rows_mean:,.0f}", f"{layer.imbalance:.3f}", f"{layer.all_to_all_bytes_max / 1e6:.3f}",
                      f"{layer.all_to_all_bytes_balanced / 1e6:.3f}")
    speed = _speed(routed, extra_s)
    table.caption = (f"moe_imbalance measured {routing.imbalance:.3f}: slowest rank's step "
                     f"{speed['step_time_s']:.3f} s ({speed['tokens_per_s']:,.0f} tokens/s, MFU {speed['mfu']:.1%}; "
                     f"the all-to-alls {extra_s * 1e3:+.3f} ms) against {balanced.step_time:.3f} s balanced "
                     f"({balanced.tokens_per_s:,.0f} tokens/s)")
    return table


def _search(recipe, hardware, assumptions: Assumptions, *, top: int, as_json: bool, loads=None) -> None:
    from moe_train.plan.search import search

    imbalance, routed_speed = None, {}
    if loads is not None:
        from moe_train.plan.routing import all_to_all_seconds, routing_plan

        def traced(candidate):
            """The candidate with the recipe's placement where it is for that ep, else contiguous."""
            if candidate.parallel.ep != recipe.parallel.ep:
                moe = candidate.model.moe.model_copy(update={"placement": "contiguous"})
                candidate = candidate.model_copy(update={"model": candidate.model.model_copy(update={"moe": moe})})
            return candidate

        def imbalance(candidate) -> float:
            return routing_plan(traced(candidate), loads).imbalance

    best, valid, fitting = search(recipe, hardware, assumptions, top=top if loads is None else 1 << 30,
                                  imbalance=imbalance)
    if loads is not None:  # ranked by the slowest rank's step: the measured imbalance and the routed all-to-alls
        for c in best:
            candidate = traced(c.plan.recipe)
            routing = routing_plan(candidate, loads)
            extra = all_to_all_seconds(routing, candidate, hardware, c.plan.assumptions, c.plan.ep_phases)
            routed_speed[id(c)] = _speed(c.plan, extra)
        best = sorted(best, key=lambda c: -routed_speed[id(c)]["tokens_per_s"])[:top]
    if as_json:
        print(json.dumps({"valid": valid, "fitting": fitting, "best": [
            {"overrides": c.overrides, **plan_json(c.plan),
             **({"routed": routed_speed[id(c)]} if loads is not None else {})} for c in best]}))
        return
    table = Table(title=f"{recipe.name} on {recipe.world_size} x {hardware.name}: {valid} valid layouts, "
                        f"{fitting} fit; best {len(best)} by estimated throughput"
                        + (" under the measured routing" if loads is not None else ""), title_justify="left")
    for column in ("#", "layout", "peak GB", "step s", "tokens/s", "TFLOP/s/GPU", "MFU"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    for index, c in enumerate(best, 1):
        p = c.plan
        speed = routed_speed.get(id(c), _speed(p))
        table.add_row(str(index), _layout_text(p), f"{p.peak / GB:.1f}", f"{speed['step_time_s']:.2f}",
                      f"{speed['tokens_per_s']:,.0f}", f"{p.tflops_per_gpu * p.step_time / speed['step_time_s']:.0f}",
                      f"{speed['mfu']:.1%}")
    Console(width=200).print(table)
    if best:
        sets = " ".join(f"--set {shlex.quote(f'{k}={_yaml(v)}')}" for k, v in best[0].overrides.items())
        print(f"best as overrides: {sets}")


def _yaml(value) -> str:
    """A value as `--set` reads it (YAML; JSON is YAML)."""
    return value if isinstance(value, str) else json.dumps(value)
