"""Expert placement on a built model: each MoE layer's router maps its choices to slots, and its experts' stacks
hold, row by row, the expert of each slot (`GroupedExperts.expert_ids`).

A placement is a permutation of the experts over the expert-parallel slots (config/placement.py reads the
file): slot s sits on rank s // (E / ep) as its local expert s % (E / ep). Nothing below the router changes: the
dispatchers route by slot and the grouped experts run the slots they hold, so any placement computes what the
contiguous one does, expert by expert. What is stored by global id: the router's weight and bias, the layer's
telemetry, the initial weights (each slot draws its expert by name, models/init.py) and checkpoints
(checkpoint/expert_order.py writes each slot's row at its expert's index), so a run resumes under another
placement as it does under another layout.
"""

from __future__ import annotations

from torch import nn

from moe_train.config.placement import Placement
from moe_train.models.decoder import DecoderBlock

_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def apply_placement(model: nn.Module, placement: Placement | None) -> None:
    """Give every MoE layer of `model` (a whole model or a pipeline chunk) its layer's slots; None: contiguous."""
    for module in model.modules():
        if isinstance(module, DecoderBlock) and module.is_moe:
            slots = None if placement is None else placement.slot_of_expert(module.layer_index)
            module.ffn.router.set_placement(slots)
            module.ffn.experts.expert_ids = None if slots is None else _inverse(slots)


def placed_stacks(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """{state-dict name of an expert stack: the expert each of its rows (slots) holds}, for the stacks of
    non-contiguously placed layers (names as `get_state_dict` gives them: wrappers' prefixes dropped)."""
    from moe_train.models.moe.experts import GroupedExperts

    stacks = {}
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts) and module.expert_ids is not None:
            clean = name
            for wrapper in _WRAPPERS:
                clean = clean.replace(wrapper, "")
            for param_name, _ in module.named_parameters(recurse=False):
                stacks[f"{clean}.{param_name}"] = module.expert_ids
    return stacks


def _inverse(slot_of_expert: list[int]) -> tuple[int, ...]:
    expert_of_slot = [0] * len(slot_of_expert)
    for expert, slot in enumerate(slot_of_expert):
        expert_of_slot[slot] = expert
    return tuple(expert_of_slot)
