"""`moe-train experts`: expert placement from a run's measured routing. Torch-free (a login-node command)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from moe_train.plan.routing import TraceError, place, read_trace

from .common import fail

experts_app = typer.Typer(
    help="Place experts on expert-parallel ranks from a run's routing trace.", no_args_is_help=True
)


@experts_app.command("place")
def place_command(
    run_dir: Annotated[
        Path, typer.Argument(help="A run folder trained with logging.routing_trace: true.", show_default=False)
    ],
    ep: Annotated[int, typer.Option("--ep", min=1, help="Expert-parallel ranks to place the experts on.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="The placement file to write (JSON).", show_default=False)],
) -> None:
    """Pack experts onto EP ranks from the trace's tokens per expert (most loaded first onto the least loaded
    rank with room, then swaps off the most loaded rank), and print each MoE layer's max/mean rank load under
    the contiguous placement (before) and the packed one (after). Use the file as model.moe.placement.

    Examples:

        moe-train experts place runs/qwen3-moe-tiny --ep 4 -o placement.json
    """
    try:
        loads = read_trace(run_dir)
        placement, layers = place(loads, ep=ep)
    except (TraceError, ValueError) as error:
        fail([str(error)])
    out.write_text(_placement_text(placement.to_json()), encoding="utf-8")
    print(f"{loads.steps} steps of {run_dir}, {loads.num_experts} experts on ep {ep}: max/mean rank load")
    for layer in layers:
        print(f"  layer {layer.layer}: {layer.before:.3f} contiguous -> {layer.after:.3f} placed")
    worst_before = max(layer.before for layer in layers)
    worst_after = max(layer.after for layer in layers)
    print(f"  worst layer: {worst_before:.3f} -> {worst_after:.3f}; wrote {out}")


def _placement_text(data: dict) -> str:
    """The placement's JSON with one MoE layer a line (its ranks' expert lists), for a reader to scan."""
    layers = ",\n".join(f"  {json.dumps(layer)}: {json.dumps(ranks)}" for layer, ranks in data["layers"].items())
    return f'{{"num_experts": {data["num_experts"]}, "ep": {data["ep"]}, "layers": {{\n{layers}\n}}}}\n'
