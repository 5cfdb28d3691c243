"""`plan` against `measure`: the figures both report for one rank, side by side (torch-free).

docs/decisions.md holds the planner to the measurement under forced even routing, for the same rank: parameter
bytes exactly; activation bytes per layer, FLOPs per step (forward, backward, recompute, total; the optimizer's
apart) and bytes per `<group>/<op>` within a tolerance. `against(plan, report)` lists every figure with both
values, so a test or a bench can print the table and name the figure that disagrees (tests/test_plan_measure.py
holds each figure to its tolerance); a key only one side has is a row with 0 on the other, never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Figure:
    """One figure: what it is (`flops/recompute`, `comm/tp/all_gather`, `activations/3`), planned, measured."""

    name: str
    planned: float
    measured: float

    @property
    def relative_error(self) -> float:
        """|planned - measured| / measured (0 when both are 0, infinite when only the plan has it)."""
        if self.measured == 0:
            return 0.0 if self.planned == 0 else float("inf")
        return abs(self.planned - self.measured) / abs(self.measured)


def against(plan: dict, report: dict) -> list[Figure]:
    """Figures of `moe-train plan --json` and `moe-train measure --json` for the same recipe and rank.

    Activation bytes per decoder layer (`other` aside: the plan counts the head and loss per stage, not as one
    figure); the parameter bytes of this rank (fp32 master weights, FSDP2 shards); FLOPs by phase (the
    optimizer's Newton-Schulz products under Muon among them) and those of the fp8 GEMMs; payload bytes per
    `<group>/<op>` over the union of both sides' keys."""
    figures = [Figure(name="param_bytes", planned=plan["memory_bytes"]["weights"], measured=report["param_bytes"])]
    planned_layers, measured_layers = plan["activation_bytes_per_layer"], report["activation_bytes_per_layer"]
    for layer in sorted((set(planned_layers) | set(measured_layers)) - {"other"}, key=int):
        figures.append(Figure(name=f"activations/{layer}", planned=planned_layers.get(layer, 0),
                              measured=measured_layers.get(layer, 0)))
    planned_off, measured_off = plan.get("offloaded_bytes_per_layer", {}), report.get("offloaded_bytes_per_layer", {})
    for layer in sorted(set(planned_off) | set(measured_off), key=int):
        figures.append(Figure(name=f"offloaded/{layer}", planned=planned_off.get(layer, 0),
                              measured=measured_off.get(layer, 0)))
    for phase in ("forward", "backward", "recompute", "total", "optimizer"):
        figures.append(Figure(name=f"flops/{phase}", planned=plan["flops"][phase], measured=report["flops"][phase]))
    figures.append(Figure(name="flops/fp8", planned=plan["fp8_gemm_flops"], measured=report["fp8_gemm_flops"]))
    planned_comm, measured_comm = plan["comm_bytes"], report["comm_bytes"]
    for key in sorted(set(planned_comm) | set(measured_comm)):
        figures.append(Figure(name=f"comm/{key}", planned=planned_comm.get(key, 0),
                              measured=measured_comm.get(key, 0)))
    return figures
