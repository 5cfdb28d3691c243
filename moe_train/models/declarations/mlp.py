"""The dense SwiGLU MLP (models/mlp.py `MLP`): gate and up column-parallel, down row-parallel."""

from __future__ import annotations

from moe_train.config.schema import ModelConfig

from .layout import ActivationLayout
from .parts import Module, RegionEntry, linear
from .saves import SWIGLU, Saved, gemm_input, kept_as_input, swiglu_items, with_scales, without

NAME = "mlp"


def swiglu(name: str, h: int, ffn: int) -> Module:
    """A SwiGLU of width `ffn` as a tensor-parallel MLP: the dense MLP's shape, the shared experts' too."""
    parts = (linear("gate_proj", ffn, h, "column", region=name, fp8=name),
             linear("up_proj", ffn, h, "column", region=name, fp8=name),
             linear("down_proj", h, ffn, "row", region=name, fp8=name))
    return Module(name, tuple(p for ps, _ in parts for p in ps), tuple(g for _, g in parts),
                  tp_entries=(RegionEntry(h, 2, name),))  # gate and up read x


def declare(cfg: ModelConfig) -> Module:
    return swiglu(NAME, cfg.hidden_size, cfg.ffn_hidden_size)


def saved(cfg: ModelConfig, lay: ActivationLayout) -> list[Saved]:
    """Its input (the norm's output: sequence-sharded and gathered again under SP) and the SwiGLU's saves on
    this rank's ffn shard."""
    a, t, fp8 = lay.act_bytes, lay.tokens, lay.kept_fp8(NAME)
    column = None if lay.gathers_shards else fp8
    return gemm_input("mlp_input", "mlp.input", lay.seq_tokens, cfg.hidden_size, a, column) + swiglu_items(
        NAME, NAME, t, cfg.ffn_hidden_size / lay.tp, a, fp8
    )


def recomputed(items: list[Saved], modules: set[str], cfg: ModelConfig, lay: ActivationLayout) -> list[Saved]:
    """`mlp` run again in backward: the MLP keeps its input only (already an item; in bf16 where its fp8 GEMMs
    kept it in fp8)."""
    if NAME not in modules:
        return items
    out = without(items, {f"{NAME}.{n}" for n in SWIGLU})
    return kept_as_input(out, "mlp_input", "mlp.input", lay.act_bytes * lay.seq_tokens * cfg.hidden_size)


def moved(region: str, cfg: ModelConfig, lay: ActivationLayout) -> set[str]:
    """Offloaded `mlp`: gate, up and silu(gate); under sequence parallelism its input too (the column-parallel
    GEMMs' shard); the down projection's input is a view (the GEMM flattens the tokens), kept. With fp8 GEMMs
    (train.fp8.modules mlp) the other way round: they keep their inputs as they came (or their fp8 copies) and
    return views of their flat outputs, so the input, silu(gate) and the down projection's input move, gate and
    up stay."""
    if region != NAME:
        return set()
    if NAME in lay.fp8_gemms:
        return with_scales({"mlp.input", "mlp.silu", "mlp.down_input"})
    return {f"{NAME}.{n}" for n in SWIGLU[:3]} | ({"mlp.input"} if lay.gathers_shards else set())
