"""The dense SwiGLU MLP (models/mlp.py `MLP`): gate and up column-parallel, down row-parallel."""

from __future__ import annotations

from moe_train.config.schema import ModelConfig

from .layout import ActivationLayout
from .parts import Module, linear
from .saves import Saved, gemm_input, swiglu_items

NAME = "mlp"


def swiglu(name: str, h: int, ffn: int) -> Module:
    """A SwiGLU of width `ffn` as a tensor-parallel MLP: the dense MLP's shape, the shared experts' too."""
    parts = (linear("gate_proj", ffn, h, "column", region=name, fp8=name),
             linear("up_proj", ffn, h, "column", region=name, fp8=name),
             linear("down_proj", h, ffn, "row", region=name, fp8=name))
    return Module(name, tuple(p for ps, _ in parts for p in ps), tuple(g for _, g in parts))


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
