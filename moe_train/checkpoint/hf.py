"""Hugging Face checkpoints in and out: config.json + safetensors <-> (ModelConfig, our state_dict).

Our module names are transformers' without the `model.` prefix, so most keys map by prefix alone. The
differences, all handled here:
- The feed-forward slot: transformers' `mlp` (dense MLP or MoE) is our block's `ffn`. The names below are the
  files' (`mlp.`); ours are the same with `ffn.`.
- MoE: `mlp.gate.weight` is our `ffn.router.weight`, `mlp.gate.e_score_correction_bias` our
  `ffn.router.expert_bias`; files hold per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` (what
  save_pretrained writes) or transformers' fused `mlp.experts.{gate_up_proj,down_proj}` (gate rows first);
  ours are three stacks `ffn.experts.{gate,up,down}_proj` [E, ...] (see models/moe/experts.py). Export
  writes per-expert keys.
- Padded vocabulary: our embedding and head have `padded_vocab_size()` rows; files have `vocab_size`.
- GLM-4.5 has DeepSeek-V3's MoE names (gate, e_score_correction_bias, shared_experts) and MTP layout.
- MTP (DeepSeek-V3, GLM-4.5): file layer `num_layers + k` is our `mtp.{k}` (enorm, hnorm, eh_proj, shared_head.norm
  -> norm, the rest -> block); its copies of the shared embedding and head are skipped on import, not written.
- gpt-oss: experts fused and transposed, gate_up_proj [E, H, 2I] with gate and up interleaved (gate the even
  columns), gate_up_proj_bias [E, 2I] likewise, down_proj [E, I, H]; ours are the three stacks plus
  `{gate,up,down}_proj_bias`. Router (`mlp.router.weight`, `.bias`) and `self_attn.sinks` are as ours.
- Tied embeddings: files have no lm_head.weight; our state_dict has both names (one tensor).
Files are read without transformers installed; export writes each file to a temporary name, then renames.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from moe_train.atomic import atomic_path, write_atomic
from moe_train.config.schema import ClampedSwiGLU, ModelConfig, MoEConfig, RopeConfig, RouterConfig, YarnScaling
from moe_train.models import build_model

FAMILIES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
            "glm4_moe": "Glm4MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}
PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")
EXPERT_STACK = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_proj|up_proj|down_proj)$")
FFN = "ffn"  # our DecoderBlock's feed-forward slot, transformers' `mlp`
LAYER = re.compile(r"^model\.layers\.(?P<index>\d+)\.(?P<rest>.*)$")
MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
           "shared_head.norm.weight": "norm.weight"}
MTP_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


class HFConversionError(ValueError):
    """A checkpoint or config that cannot be converted; the message is one line naming the file or field."""


# ------------------------------------------------------------------------------------------------- import


def import_hf(hf_dir: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a transformers checkpoint folder into (model_cfg, state_dict) for `build_model(model_cfg)`."""
    hf_dir = Path(hf_dir)
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise HFConversionError(f"{config_path}: not found (a Hugging Face checkpoint folder has config.json)")
    try:
        hf_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise HFConversionError(f"{config_path}:{error.lineno}:{error.colno}: not valid JSON ({error.msg})") from None
    tensors = _dequantize_fp8(_read_safetensors(hf_dir), hf_config)
    try:
        num_layers = int(hf_config["num_hidden_layers"])
        mtp_layers = 0
        while f"model.layers.{num_layers + mtp_layers}.eh_proj.weight" in tensors:
            mtp_layers += 1
        model_cfg = config_from_hf(hf_config, mtp_layers=mtp_layers)
    except KeyError as missing:
        raise HFConversionError(f"{config_path}: missing field {missing.args[0]!r}") from None
    except ValidationError as error:
        problem = error.errors()[0]
        raise HFConversionError(f"{config_path}: {'.'.join(map(str, problem['loc']))}: {problem['msg']}") from None
    try:
        state = state_dict_from_hf(model_cfg, tensors)
    except KeyError as missing:
        raise HFConversionError(f"{hf_dir}: tensor {missing.args[0]!r} not found") from None
    _check_matches(hf_dir, model_cfg, state)
    return model_cfg, state


def _check_matches(hf_dir: Path, model_cfg: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    """The strict-load guarantee, checked here so that a mismatch is one line naming the folder."""
    expected = build_model(model_cfg, device="meta").state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [name for name in expected if name in state and state[name].shape != expected[name].shape]
    for what, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
        if names:
            shown = ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
            raise HFConversionError(f"{hf_dir}: weights do not match config.json: {what}: {shown}")


def _read_safetensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (hf_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise HFConversionError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(hf_dir / name))
    return tensors


def _dequantize_fp8(tensors: dict[str, torch.Tensor], hf_config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's released weights are FP8 with one scale per 128x128 block (`<name>_scale_inv`, to multiply
    by): return them as bf16, so the model starts from the released values."""
    scales = [name for name in tensors if name.endswith(".weight_scale_inv")]
    if not scales:
        return tensors
    block = (hf_config.get("quantization_config") or {}).get("weight_block_size", [128, 128])
    out = {name: tensor for name, tensor in tensors.items() if not name.endswith(".weight_scale_inv")}
    for scale_name in scales:
        name = scale_name.removesuffix("_scale_inv")
        weight, scale = out[name], tensors[scale_name].float()
        rows, cols = weight.shape
        scale = scale.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
        out[name] = (weight.float() * scale).to(torch.bfloat16)
    return out


def config_from_hf(hf: dict[str, Any], *, mtp_layers: int = 0) -> ModelConfig:
    """Our model section for a transformers config.json dict (qwen3, qwen3_moe, deepseek_v3, glm4_moe)."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise HFConversionError(f"config.json: model_type {family!r} is not one of {', '.join(FAMILIES)}")
    if hf.get("attention_bias") and family == "deepseek_v3":
        raise HFConversionError("config.json: attention_bias true is not supported for MLA (deepseek_v3)")
    if hf.get("use_sliding_window"):
        raise HFConversionError("config.json: use_sliding_window true is not supported (full causal attention)")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFConversionError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported (silu)")
    fields: dict[str, Any] = dict(
        family=family,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        init_std=hf.get("initializer_range", 0.02),
        rope=_rope_from_hf(hf, partial_default=0.5 if family == "glm4_moe" else 1.0),
    )
    if family == "deepseek_v3":
        if hf.get("rope_interleave", True) is False:
            raise HFConversionError("config.json: rope_interleave false is not supported (DeepSeek-V3 interleaves)")
        fields.update(
            qk_norm=False,
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            first_k_dense=hf.get("first_k_dense_replace", 0),
            mtp_layers=mtp_layers,
            moe=_sigmoid_moe(hf, shared_experts=0),
        )
    elif family == "glm4_moe":
        fields.update(
            head_dim=hf.get("head_dim"),
            qk_norm=bool(hf.get("use_qk_norm", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            first_k_dense=hf.get("first_k_dense_replace", 1),
            mtp_layers=mtp_layers,
            moe=_sigmoid_moe(hf, shared_experts=1),
        )
    elif family == "gpt_oss":
        fields.update(_gpt_oss_fields(hf))
    else:
        fields.update(head_dim=hf.get("head_dim"), qk_norm=True, attention_bias=bool(hf.get("attention_bias", False)))
    if family == "qwen3_moe":
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            raise HFConversionError("config.json: decoder_sparse_step/mlp_only_layers (dense layers) not supported")
        fields["moe"] = MoEConfig(
            num_experts=hf.get("num_experts") or hf["num_local_experts"],
            top_k=hf["num_experts_per_tok"],
            ffn_hidden_size=hf["moe_intermediate_size"],
            router=RouterConfig(
                score_function="softmax",
                normalize_topk=bool(hf.get("norm_topk_prob", False)),
                load_balancing="all_layers_aux_loss",
                aux_loss_coeff=hf.get("router_aux_loss_coef", 1e-3),
            ),
        )
    return ModelConfig(**fields)


def _gpt_oss_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's model fields (transformers' GptOssConfig defaults where the file omits one): q/k/v/o biases,
    sinks, the layer types (default: sliding on even layers), biased clamped-SwiGLU experts (their width is
    intermediate_size) and a softmax router with a bias over the top-k logits (our softmax renormalised over
    the top k), trained with transformers' all-layers balancing loss (router_aux_loss_coef)."""
    bias = bool(hf.get("attention_bias", True))
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return dict(
        head_dim=hf.get("head_dim", 64),
        qk_norm=False,
        attention_bias=bias,
        attention_output_bias=bias,
        attention_sinks=True,
        sliding_window=hf.get("sliding_window", 128),
        layer_types=tuple(types),
        moe=MoEConfig(
            num_experts=hf.get("num_local_experts", 128),
            top_k=hf.get("num_experts_per_tok", 4),
            ffn_hidden_size=hf["intermediate_size"],
            expert_biases=True,
            clamped_swiglu=ClampedSwiGLU(limit=hf.get("swiglu_limit", 7.0), alpha=hf.get("swiglu_alpha", 1.702)),
            router=RouterConfig(
                score_function="softmax", normalize_topk=True, learned_bias=True,
                load_balancing="all_layers_aux_loss", aux_loss_coeff=hf.get("router_aux_loss_coef", 1e-3),
            ),
        ),
    )


def _sigmoid_moe(hf: dict[str, Any], *, shared_experts: int) -> MoEConfig:
    """DeepSeek-V3's and GLM-4.5's MoE section: sigmoid routing with the aux-loss-free expert bias, optional
    group limits, shared experts (`shared_experts`: the family's default count); their checkpoints carry no
    training loss, so ours is DeepSeek-V3's sequence-level one (1e-4)."""
    groups = hf.get("n_group") or 1
    return MoEConfig(
        num_experts=hf["n_routed_experts"],
        top_k=hf["num_experts_per_tok"],
        ffn_hidden_size=hf["moe_intermediate_size"],
        shared_expert_ffn_hidden_size=hf["moe_intermediate_size"] * hf.get("n_shared_experts", shared_experts),
        router=RouterConfig(
            score_function="sigmoid",
            normalize_topk=bool(hf.get("norm_topk_prob", True)),
            num_groups=groups if groups > 1 else None,
            group_top_k=hf.get("topk_group") if groups > 1 else None,
            topk_scaling_factor=hf.get("routed_scaling_factor", 1.0),
            expert_bias=True,
            load_balancing="seq_aux_loss",
            aux_loss_coeff=1e-4,
        ),
    )


def _rope_from_hf(hf: dict[str, Any], *, partial_default: float = 1.0) -> RopeConfig:
    """`partial_default`: the family's partial_rotary_factor where the file has none (transformers' GLM-4.5
    config sets 0.5); it sits in rope_parameters (transformers 5) or at the top level (the released files)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", partial_default))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return RopeConfig(theta=theta, partial_rotary_factor=partial)
    if kind != "yarn":
        raise HFConversionError(f"config.json: rope type {kind!r} is not supported (default or yarn)")
    yarn = YarnScaling(
        factor=params["factor"],
        original_max_position_embeddings=params.get("original_max_position_embeddings")
        or hf["max_position_embeddings"],
        beta_fast=params.get("beta_fast") or 32.0,
        beta_slow=params.get("beta_slow") or 1.0,
        mscale=params.get("mscale") or 0.0,
        mscale_all_dim=params.get("mscale_all_dim") or 0.0,
        truncate=params.get("truncate", True),
    )
    if params.get("attention_factor") is not None:
        raise HFConversionError("config.json: yarn attention_factor overrides are not supported")
    return RopeConfig(theta=theta, scaling=yarn, partial_rotary_factor=partial)


def state_dict_from_hf(model_cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename, stack experts and pad the vocabulary: HF tensors -> a strict state_dict of build_model(model_cfg)."""
    tensors = _unfuse_gpt_oss_experts(tensors) if model_cfg.family == "gpt_oss" else _stack_experts(tensors)
    state: dict[str, torch.Tensor] = {}
    for hf_name, tensor in tensors.items():
        name = _our_name(hf_name, model_cfg.num_layers, model_cfg.mtp_layers)
        if name is not None:
            state[name] = tensor
    padded = model_cfg.padded_vocab_size()
    state["embed_tokens.weight"] = _pad_rows(state["embed_tokens.weight"], padded)
    if model_cfg.tie_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    else:
        state["lm_head.weight"] = _pad_rows(state["lm_head.weight"], padded)
    return state


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down weights, or a fused gate_up_proj [E, 2I, H] -> our stacks gate_proj [E, I, H],
    up_proj [E, I, H], down_proj [E, H, I]."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        match = PER_EXPERT.match(name)
        if match is not None:
            experts.setdefault(match["prefix"], {}).setdefault(match["proj"], {})[int(match["expert"])] = tensor
        elif name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            if tensor.shape[1] % 2:
                raise HFConversionError(f"{name}: fused gate_up_proj has an odd row count {tensor.shape[1]}")
            gate, up = tensor.chunk(2, dim=1)
            out[f"{prefix}.gate_proj"], out[f"{prefix}.up_proj"] = gate.contiguous(), up.contiguous()
        else:
            out[name] = tensor
    for prefix, projs in experts.items():
        count = len(projs.get("down", ()))
        if any(sorted(projs.get(p, ())) != list(range(count)) for p in ("gate", "up", "down")):
            raise HFConversionError(f"{prefix}: per-expert gate/up/down weights are incomplete")
        for proj in ("gate", "up", "down"):
            out[f"{prefix}.{proj}_proj"] = torch.stack([projs[proj][e] for e in range(count)])
    return out


def _unfuse_gpt_oss_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss's interleaved, transposed expert tensors -> our stacks and their biases (module docstring)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            out[prefix + "gate_proj"] = tensor[..., 0::2].transpose(1, 2).contiguous()
            out[prefix + "up_proj"] = tensor[..., 1::2].transpose(1, 2).contiguous()
        elif name.endswith(".mlp.experts.gate_up_proj_bias"):
            prefix = name.removesuffix("gate_up_proj_bias")
            out[prefix + "gate_proj_bias"] = tensor[:, 0::2].contiguous()
            out[prefix + "up_proj_bias"] = tensor[:, 1::2].contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            out[name] = tensor.transpose(1, 2).contiguous()
        else:
            out[name] = tensor
    return out


def _fuse_gpt_oss_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `_unfuse_gpt_oss_experts` (HF names already applied)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(".mlp.experts.gate_proj"):
            prefix = name.removesuffix("gate_proj")
            up = tensors[prefix + "up_proj"]
            out[prefix + "gate_up_proj"] = torch.stack((tensor, up), dim=2).flatten(1, 2).transpose(1, 2)
        elif name.endswith(".mlp.experts.gate_proj_bias"):
            prefix = name.removesuffix("gate_proj_bias")
            up = tensors[prefix + "up_proj_bias"]
            out[prefix + "gate_up_proj_bias"] = torch.stack((tensor, up), dim=2).flatten(1)
        elif name.endswith((".mlp.experts.up_proj", ".mlp.experts.up_proj_bias")):
            continue
        elif name.endswith(".mlp.experts.down_proj"):
            out[name] = tensor.transpose(1, 2)
        else:
            out[name] = tensor
    return out


def _our_name(hf_name: str, num_layers: int, mtp_layers: int) -> str | None:
    """Our key for an HF key (experts already stacked); None for MTP copies of the shared embedding and head."""
    if not hf_name.startswith("model.layers."):
        return hf_name.removeprefix("model.")
    match = LAYER.match(hf_name)
    index, rest = int(match["index"]), _moe_to_ours(match["rest"])
    if not num_layers <= index < num_layers + mtp_layers:
        return f"layers.{index}.{rest}"
    if rest in MTP_SHARED_COPIES:
        return None
    depth = index - num_layers
    return f"mtp.{depth}.{MTP_OWN[rest]}" if rest in MTP_OWN else f"mtp.{depth}.block.{rest}"


def _moe_to_ours(rest: str) -> str:
    """A layer's key below `model.layers.{i}.` -> ours: `mlp.` is our `ffn.`, the router `gate` our `router`."""
    rest = rest.replace("mlp.gate.e_score_correction_bias", "mlp.router.expert_bias").replace(
        "mlp.gate.weight", "mlp.router.weight"
    )
    return f"{FFN}.{rest.removeprefix('mlp.')}" if rest.startswith("mlp.") else rest


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero rows appended up to the padded vocabulary (never read: logits stop at vocab_size)."""
    return torch.cat((tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])))


# ------------------------------------------------------------------------------------------------- export


def export_hf(
    model_cfg: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    out_dir: str | os.PathLike,
    *,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write config.json + safetensors that transformers.AutoModelForCausalLM.from_pretrained loads.

    One `model.safetensors` when everything fits in max_shard_bytes, else `model-0000i-of-0000n.safetensors`
    shards and `model.safetensors.index.json`, as save_pretrained names them. Tensors are copied one shard at a
    time (peak memory: one shard), each file goes to a temporary name and is renamed; weight files of an earlier
    export that this one does not write are removed, so the folder never mixes two exports' files.
    """
    out_dir = Path(out_dir)
    hf_config = config_to_hf(model_cfg, dtype=state_dict["embed_tokens.weight"].dtype)
    tensors = state_dict_to_hf(model_cfg, state_dict)
    shards = _plan_shards(tensors, max_shard_bytes)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    for file_name, shard in zip(names, shards, strict=True):
        # Own copies: safetensors refuses tensors that share storage (the experts of one stacked weight).
        data = {name: tensors[name].detach().to("cpu", copy=True).contiguous() for name in shard}
        with atomic_path(out_dir / file_name) as tmp:
            save_file(data, tmp, metadata={"format": "pt"})
    index_path = out_dir / "model.safetensors.index.json"
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
            "weight_map": {name: file_name for file_name, shard in zip(names, shards, strict=True) for name in shard},
        }
        write_atomic(index_path, json.dumps(index, indent=2))
    written = set(names) | ({index_path.name} if len(shards) > 1 else set())
    for stale in [*out_dir.glob("model-*-of-*.safetensors"), out_dir / "model.safetensors", index_path]:
        if stale.exists() and stale.name not in written:
            stale.unlink()
    write_atomic(out_dir / "config.json", json.dumps(hf_config, indent=2))


def _plan_shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Consecutive groups of names, each under max_shard_bytes (a larger tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += tensor.nbytes
    return shards


def config_to_hf(cfg: ModelConfig, *, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A transformers config.json dict for our model section; raises HFConversionError where HF cannot express it."""
    hf: dict[str, Any] = {
        "architectures": [FAMILIES[cfg.family]],
        "model_type": cfg.family,
        "num_hidden_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.kv_heads,
        "intermediate_size": cfg.ffn_hidden_size,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rms_norm_eps": cfg.norm_eps,
        "initializer_range": cfg.init_std,
        "hidden_act": "silu",
        "attention_bias": cfg.attention_bias,
        "rope_parameters": _rope_to_hf(cfg.rope, partial=cfg.family == "glm4_moe"),
        "dtype": str(dtype).removeprefix("torch."),
    }
    moe = cfg.moe
    if cfg.family in ("qwen3", "qwen3_moe"):
        if not cfg.qk_norm:
            raise HFConversionError("model.qk_norm: Qwen3 always normalises q and k; export needs qk_norm true")
        hf["head_dim"] = cfg.attention_head_dim
    if cfg.family == "qwen3_moe":
        router = moe.router
        if (
            router.score_function != "softmax" or router.num_groups not in (None, 1) or router.expert_bias
            or router.topk_scaling_factor != 1.0 or moe.shared_expert_ffn_hidden_size or cfg.first_k_dense
        ):
            raise HFConversionError(
                "model.moe: Qwen3-MoE has softmax routing without groups, bias, scaling, shared or dense-first layers"
            )
        hf.update(
            num_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
            moe_intermediate_size=moe.ffn_hidden_size,
            norm_topk_prob=router.normalize_topk,
            router_aux_loss_coef=router.aux_loss_coeff,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if cfg.family in ("deepseek_v3", "glm4_moe"):
        hf.update(_sigmoid_moe_to_hf(cfg))
    if cfg.family == "deepseek_v3":
        hf.update(
            q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            rope_interleave=True,
        )
    if cfg.family == "glm4_moe":
        hf.update(head_dim=cfg.attention_head_dim, use_qk_norm=cfg.qk_norm)
    if cfg.family == "gpt_oss":
        hf.update(_gpt_oss_to_hf(cfg))
    return hf


def _gpt_oss_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """GptOssConfig's fields; refused where it cannot express ours (one attention_bias for q/k/v and o)."""
    moe = cfg.moe
    if cfg.attention_bias != cfg.attention_output_bias or not cfg.attention_sinks or cfg.qk_norm:
        raise HFConversionError("model: GptOssForCausalLM has one attention_bias for q/k/v and o_proj, sinks and no "
                                "QK-norm")
    router = moe.router
    if (not moe.expert_biases or moe.clamped_swiglu is None or not router.learned_bias
            or moe.shared_expert_ffn_hidden_size or router.score_function != "softmax" or not router.normalize_topk
            or router.expert_bias or router.num_groups not in (None, 1)
            or router.topk_scaling_factor != 1.0):
        raise HFConversionError("model.moe: GptOssForCausalLM needs expert_biases, clamped_swiglu, a softmax router "
                                "with learned_bias renormalised over the top k, no groups, scaling or shared experts")
    return dict(
        head_dim=cfg.attention_head_dim,
        sliding_window=cfg.sliding_window,
        layer_types=list(cfg.layer_types or ["full_attention"] * cfg.num_layers),
        intermediate_size=moe.ffn_hidden_size,
        num_local_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        swiglu_limit=moe.clamped_swiglu.limit,
        swiglu_alpha=moe.clamped_swiglu.alpha,
        router_aux_loss_coef=moe.router.aux_loss_coeff,
        output_router_logits=False,
    )


def _sigmoid_moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The MoE, dense-first and MTP fields DeepSeek-V3 and GLM-4.5 share."""
    moe = cfg.moe
    router, shared, ffn = moe.router, moe.shared_expert_ffn_hidden_size, moe.ffn_hidden_size
    if router.score_function != "sigmoid" or shared % ffn:
        raise HFConversionError(
            f"model.moe: {FAMILIES[cfg.family]} needs sigmoid routing and a shared expert FFN that is a multiple of "
            "the expert FFN"
        )
    return dict(
        first_k_dense_replace=cfg.first_k_dense,
        num_nextn_predict_layers=cfg.mtp_layers,
        n_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        moe_intermediate_size=ffn,
        n_shared_experts=shared // ffn,
        n_group=router.num_groups or 1,
        topk_group=router.group_top_k or router.num_groups or 1,
        routed_scaling_factor=router.topk_scaling_factor,
        norm_topk_prob=router.normalize_topk,
    )


def _rope_to_hf(rope: RopeConfig, *, partial: bool = False) -> dict[str, Any]:
    """`partial`: write partial_rotary_factor even at 1 (GLM-4.5's config reads a missing one as 0.5)."""
    shared: dict[str, Any] = {"rope_theta": rope.theta}
    if partial or rope.partial_rotary_factor != 1:
        shared["partial_rotary_factor"] = rope.partial_rotary_factor
    if rope.scaling is None:
        return {"rope_type": "default", **shared}
    yarn = rope.scaling
    return {
        "rope_type": "yarn",
        **shared,
        "factor": yarn.factor,
        "original_max_position_embeddings": yarn.original_max_position_embeddings,
        "beta_fast": yarn.beta_fast,
        "beta_slow": yarn.beta_slow,
        "mscale": yarn.mscale,
        "mscale_all_dim": yarn.mscale_all_dim,
        "truncate": yarn.truncate,
    }


def state_dict_to_hf(cfg: ModelConfig, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state_dict -> HF tensors (views of ours): renamed, experts split per expert, padding stripped."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue
        if name in ("embed_tokens.weight", "lm_head.weight"):
            tensor = tensor[: cfg.vocab_size]
        hf_name = _hf_name(name, cfg.num_layers, router_named_gate=cfg.family != "gpt_oss")
        expert_stack = EXPERT_STACK.match(hf_name)
        if expert_stack is not None and cfg.family != "gpt_oss":
            for e, weight in enumerate(tensor):
                out[f"{expert_stack['prefix']}.{e}.{expert_stack['proj']}.weight"] = weight
        else:
            out[hf_name] = tensor
    return _fuse_gpt_oss_experts(out) if cfg.family == "gpt_oss" else out


def _hf_name(name: str, num_layers: int, *, router_named_gate: bool = True) -> str:
    """`router_named_gate`: the file calls the router `mlp.gate` (every family but gpt-oss: `mlp.router`)."""
    if name == "lm_head.weight":
        return name
    name = name.replace(f".{FFN}.", ".mlp.")
    if router_named_gate:
        name = name.replace("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias").replace(
            "mlp.router.weight", "mlp.gate.weight"
        )
    if name.startswith("mtp."):
        _, depth, rest = name.split(".", 2)
        layer = f"model.layers.{num_layers + int(depth)}"
        if rest.startswith("block."):
            return f"{layer}.{rest.removeprefix('block.')}"
        return f"{layer}.{'shared_head.norm.weight' if rest == 'norm.weight' else rest}"
    return f"model.{name}"
