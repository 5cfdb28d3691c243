"""What selective recompute leaves saved: the items of plan/saved_tensors.py that go when a module runs again
in backward, and what the recomputed region keeps instead (its inputs), module by module (no torch)."""

from __future__ import annotations

from moe_train.config.schema import ModelConfig

from .saved_tensors import ActivationLayout, Saved

# Recomputed regions (parallel/recompute.py) keep their inputs; what their outputs' consumers save stays too.
SWIGLU = ("gate", "up", "silu", "down_input")


def _without(items: list[Saved], names: set[str]) -> list[Saved]:
    """`items` but `names` (and their fp8 scales)."""
    names = names | {f"{n}.scale" for n in names}
    return [i for i in items if i.name not in names]


def _kept_as_input(items: list[Saved], region: str, name: str, bytes_: float) -> list[Saved]:
    """A recomputed region's input that one of its own fp8 GEMMs kept in fp8 (`name`, with `name.scale`): the
    region keeps the input as it came instead (checkpoint saves a region's inputs; what its GEMMs saved goes)."""
    if not any(i.name == f"{name}.scale" for i in items):
        return items
    return [*_without(items, {name}), Saved(region, name, bytes_)]


def _layernorm_recomputed(items: list[Saved], lay: ActivationLayout, h: int) -> list[Saved]:
    """Both pre-norms run again in backward: each keeps its input (the residual stream, a x Ts x h), which the
    norm keeps anyway, and drops its rstd. Their outputs stay where a consumer saved them (the next GEMM's
    input, the router's): our checkpoint keeps a region's output like any tensor (Megatron-Core's
    checkpoint-without-output discards those too)."""
    kept = [i for i in items if i.region not in ("input_layernorm", "post_attention_layernorm")]
    residual = lay.act_bytes * lay.seq_tokens * h
    return [Saved("layernorm", "input_layernorm.input", residual), Saved("layernorm", "post_norm.input", residual),
            *kept]


def _mla_up_recomputed(items: list[Saved], cfg: ModelConfig, lay: ActivationLayout) -> list[Saved]:
    """MLA's up projections, rotary embeddings and attention run again: SDPA's q, k, v, output and logsumexp
    go; the region keeps its inputs: the latents (already kept by the up projections), the rotary tables (in
    bf16 the layer's casts, already an item) and the shared rope key: under SP the gathered key (a x T x r, a
    storage of its own), without SP a view of kv_a_proj's output, whose whole storage the kv norm keeps already."""
    a, r = lay.act_bytes, cfg.qk_rope_head_dim
    dropped = {"sdpa.q", "sdpa.k", "sdpa.v", "sdpa.out", "sdpa.logsumexp"}  # the rotary casts are its inputs
    out = _without(items, dropped)
    if cfg.q_lora_rank:  # the latents: inputs of its up projections, which kept them in fp8 otherwise
        out = _kept_as_input(out, "mla_latent", "q_b_proj.input", a * lay.seq_tokens * cfg.q_lora_rank)
    out = _kept_as_input(out, "mla_latent", "kv_b_proj.input", a * lay.seq_tokens * cfg.kv_lora_rank)
    if lay.sequence_parallel and lay.tp > 1:
        out.append(Saved("mla_up_proj", "mla_up_proj.rope_key", a * lay.tokens * r))
    return out


def apply_selective(items: list[Saved], modules: tuple[str, ...], cfg: ModelConfig, lay: ActivationLayout):
    """The items left when the `modules` of selective recompute run again in backward.

    core_attn: SDPA keeps its inputs only (its output and logsumexp go). mla_up_proj: see `_mla_up_recomputed`.
    mlp / shared_experts: the MLP keeps its input only (already an item; in bf16 where its fp8 GEMMs kept it in
    fp8; the shared experts' is the router's). moe: the whole layer keeps its input,
    the post-attention norm's output (a x Ts x h). moe_act: nothing goes: the weighted SwiGLU keeps only its
    inputs (gate, up, the rows' routing weights; models/moe/weighted_swiglu.py), which the checkpoint keeps as
    well, and its output is the down projection's input.
    layernorm: see `_layernorm_recomputed`.
    """
    names = set(modules)
    out = list(items)
    if cfg.family == "deepseek_v3" and "mla_up_proj" in names:
        out = _mla_up_recomputed(out, cfg, lay)
    elif "core_attn" in names:
        out = _without(out, {"sdpa.out", "sdpa.logsumexp"})
    moe_layer = any(i.region == "moe" for i in items)
    if moe_layer and "moe" in names:
        out = [i for i in out if i.region not in ("moe", "moe_act", "shared_experts", "shared_experts_input")]
        out.append(Saved("moe", "moe.input", lay.act_bytes * lay.seq_tokens * cfg.hidden_size))
    elif moe_layer:
        if "shared_experts" in names:
            out = _without(out, {f"shared_experts.{n}" for n in SWIGLU})
    elif "mlp" in names:
        out = _without(out, {f"mlp.{n}" for n in SWIGLU})
        out = _kept_as_input(out, "mlp_input", "mlp.input", lay.act_bytes * lay.seq_tokens * cfg.hidden_size)
    if "layernorm" in names:
        out = _layernorm_recomputed(out, lay, cfg.hidden_size)
    return out
