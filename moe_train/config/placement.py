"""Expert placement files (`model.moe.placement`): which expert-parallel slot holds each expert, per MoE layer.

Torch-free: validate checks a file on the login node, `moe-train experts place` writes one, and the training
build (models/moe/placement.py) turns it into the router's table. The file is JSON:

    {"num_experts": 8, "ep": 2, "layers": {"1": [[5, 0, 3, 6], [1, 2, 4, 7]], ...}}

`layers[L][r]` lists the experts rank r of the expert-parallel group holds in MoE layer L, in local order, so
expert `layers[L][r][j]` sits in slot r * (num_experts / ep) + j. Every MoE layer is listed, each a
permutation of all experts over exactly `ep` ranks of num_experts / ep each. "contiguous" (the default) is rank
r holding experts [r E/ep, (r+1) E/ep), expert e in slot e: no table at all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CONTIGUOUS = "contiguous"


class PlacementError(ValueError):
    """A placement file that cannot be used; the message names the file."""


@dataclass(frozen=True)
class Placement:
    num_experts: int
    ep: int
    ranks: dict[int, tuple[tuple[int, ...], ...]]  # MoE layer index -> the experts of each rank, in local order

    def slot_of_expert(self, layer: int) -> list[int]:
        """[E]: the slot (rank * E/ep + local index) that holds each expert of `layer`."""
        slots = [0] * self.num_experts
        for slot, expert in enumerate(e for rank in self.ranks[layer] for e in rank):
            slots[expert] = slot
        return slots

    def to_json(self) -> dict:
        return {
            "num_experts": self.num_experts,
            "ep": self.ep,
            "layers": {str(layer): [list(rank) for rank in ranks] for layer, ranks in sorted(self.ranks.items())},
        }


def contiguous(*, num_experts: int, ep: int, layers: list[int]) -> Placement:
    """The default placement written out: rank r holds experts [r E/ep, (r+1) E/ep) in every layer."""
    local = num_experts // ep
    ranks = tuple(tuple(range(r * local, (r + 1) * local)) for r in range(ep))
    return Placement(num_experts=num_experts, ep=ep, ranks=dict.fromkeys(layers, ranks))


def read_placement(path: str | Path, *, num_experts: int, ep: int, moe_layers: list[int]) -> Placement:
    """The placement in `path`, checked against the recipe's experts, ep and MoE layers (PlacementError)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise PlacementError(f"{path}: not a readable placement file ({error})") from None
    if not isinstance(data, dict) or not isinstance(data.get("layers"), dict):
        raise PlacementError(f"{path}: a placement file is a JSON object with 'num_experts', 'ep' and 'layers'")
    if data.get("num_experts") != num_experts:
        raise PlacementError(f"{path}: placed {data.get('num_experts')} experts, the model has {num_experts}")
    if data.get("ep") != ep:
        raise PlacementError(f"{path}: placed over ep {data.get('ep')}, the recipe's parallel.ep is {ep}")
    ranks: dict[int, tuple[tuple[int, ...], ...]] = {}
    for key, value in data["layers"].items():
        if not key.isdigit() or int(key) not in moe_layers:
            raise PlacementError(f"{path}: layer {key!r} is not a MoE layer of the model ({moe_layers})")
        ranks[int(key)] = _check_layer(path, key, value, num_experts=num_experts, ep=ep)
    missing = [layer for layer in moe_layers if layer not in ranks]
    if missing:
        raise PlacementError(f"{path}: no placement for MoE layers {missing}")
    return Placement(num_experts=num_experts, ep=ep, ranks=ranks)


def _check_layer(path: Path, key: str, value, *, num_experts: int, ep: int) -> tuple[tuple[int, ...], ...]:
    local = num_experts // ep
    if (
        not isinstance(value, list)
        or len(value) != ep
        or any(not isinstance(rank, list) or len(rank) != local for rank in value)
    ):
        raise PlacementError(f"{path}: layer {key} must list {ep} ranks of {local} experts each")
    flat = [expert for rank in value for expert in rank]
    if sorted(flat) != list(range(num_experts)) or any(not isinstance(e, int) for e in flat):
        raise PlacementError(f"{path}: layer {key} is not a permutation of the experts 0..{num_experts - 1}")
    return tuple(tuple(rank) for rank in value)


def recipe_placement(recipe) -> Placement | None:
    """The recipe's placement (None: contiguous); PlacementError for a bad file."""
    m = recipe.model
    if m.moe is None or m.moe.placement == CONTIGUOUS:
        return None
    layers = [i for i in range(m.num_layers + m.mtp_layers) if m.is_moe_layer(i)]
    return read_placement(m.moe.placement, num_experts=m.moe.num_experts, ep=recipe.parallel.ep, moe_layers=layers)
