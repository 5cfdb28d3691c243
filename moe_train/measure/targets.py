"""Which layers `measure` keeps (torch-free: the command line checks `--layers` before importing torch)."""

from __future__ import annotations

from moe_train.config.schema import ModelConfig


def layer_kinds(cfg: ModelConfig) -> tuple[int, ...]:
    """One layer of each kind, the default under --fake: the first dense layer and the first MoE layer."""
    dense = next((i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)), None)
    moe = next((i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)), None)
    return tuple(i for i in (dense, moe) if i is not None)


def layer_problems(cfg: ModelConfig, layers: tuple[int, ...]) -> list[str]:
    """Why `--layers` cannot be measured; indices from num_layers on name the MTP modules."""
    last = cfg.num_layers + cfg.mtp_layers
    if not layers:
        return ["--layers: name at least one layer"]
    bad = [i for i in layers if not 0 <= i < last]
    if bad:
        mtp = f", {cfg.num_layers}..{last - 1} the MTP modules" if cfg.mtp_layers else ""
        return [f"--layers: {bad} out of range (0..{cfg.num_layers - 1} are the decoder layers{mtp})"]
    return []
