"""Our models against transformers 5.24 (Qwen3, Qwen3-MoE, DeepSeek-V3, GLM-4.5, gpt-oss), through import_hf and
export_hf.

Each case builds a small random transformers model, saves it with save_pretrained, imports it into
build_model(model_cfg) with strict keys, and compares fp32 logits (1e-4); then exports our weights and loads
them back with AutoModelForCausalLM.from_pretrained. Weights are drawn large enough that logits are O(1), so
1e-4 is a tight test, and routing margins are checked so a near-tie cannot flip an expert on rounding.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json

import pytest
import torch
import torch.nn.functional as F
import transformers  # the test extra installs it: a missing one is an error, never a silent skip

from moe_train.checkpoint.hf import HFConversionError, config_from_hf, config_to_hf, export_hf, import_hf  # noqa: E402
from moe_train.config import load_recipe  # noqa: E402
from moe_train.config.schema import ModelConfig  # noqa: E402
from moe_train.models import build_model  # noqa: E402

TOL = 1e-4


def qwen3(**kw):
    base = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    return transformers.Qwen3Config(**{**base, **kw})


def qwen3_moe(**kw):
    base = dict(vocab_size=200, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                norm_topk_prob=True, router_aux_loss_coef=0.01, max_position_embeddings=256)
    return transformers.Qwen3MoeConfig(**{**base, **kw})


def deepseek_v3(**kw):
    base = dict(vocab_size=200, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=24,
                kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, routed_scaling_factor=2.5,
                max_position_embeddings=256)
    return transformers.DeepseekV3Config(**{**base, **kw})


def glm4_moe(**kw):
    base = dict(vocab_size=200, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                attention_bias=True, use_qk_norm=True, max_position_embeddings=256)
    return transformers.Glm4MoeConfig(**{**base, **kw})


def gpt_oss(**kw):
    base = dict(vocab_size=200, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                swiglu_limit=1.0, max_position_embeddings=256,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return transformers.GptOssConfig(**{**base, **kw})


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0}

CASES = {
    "qwen3-gqa2-untied": lambda: qwen3(),
    "qwen3-mha-tied-yarn": lambda: qwen3(num_key_value_heads=4, tie_word_embeddings=True, rope_parameters=YARN),
    "qwen3-mqa-headdim8": lambda: qwen3(num_attention_heads=8, num_key_value_heads=1, head_dim=8),
    "qwen3moe-e8k2-untied": lambda: qwen3_moe(),
    "qwen3moe-e6k3-tied-nonorm": lambda: qwen3_moe(num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
                                                   num_key_value_heads=4, tie_word_embeddings=True),
    "dsv3-groups4-yarn": lambda: deepseek_v3(rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "dsv3-qlora-null-groups1": lambda: deepseek_v3(q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=2,
                                                   first_k_dense_replace=0, v_head_dim=12),
    # GLM-4.5: q/k/v biases, QK-norm, transformers' default partial rotary (0.5 of each head), one dense layer
    "glm4moe-bias-qknorm-half-rotary": lambda: glm4_moe(),
    # GLM-4.5-Air's attention (no QK-norm), a quarter of each head rotated under YaRN, group limits, two shared
    # experts, no dense layer, tied embeddings
    "glm4moe-air-groups2-yarn-quarter": lambda: glm4_moe(
        use_qk_norm=False, n_group=2, topk_group=1, num_experts_per_tok=3, n_shared_experts=2,
        first_k_dense_replace=0, routed_scaling_factor=1.0, tie_word_embeddings=True,
        rope_parameters={**YARN, "partial_rotary_factor": 0.25}),
    # gpt-oss: sinks, q/k/v/o biases, sliding (layers 0, 2; window 8 < the 24 tokens) and full layers, biased
    # experts with a clamp that binds (limit 1 on O(1) activations), a biased softmax router over the top k
    "gptoss-sinks-window8-clamp1": lambda: gpt_oss(),
    # gpt-oss's YaRN with the unrounded ramp (truncate false), 4 of 6 experts, the published clamp
    "gptoss-yarn-untruncated-e6k4": lambda: gpt_oss(
        num_experts_per_tok=4, num_local_experts=6, swiglu_limit=7.0, sliding_window=5,
        rope_parameters={**YARN, "truncate": False, "beta_slow": 1.0, "factor": 8.0}),
    "dsv3-groups2-mscale": lambda: deepseek_v3(n_group=2, topk_group=1, num_experts_per_tok=3,
                                               routed_scaling_factor=1.0, v_head_dim=32,
                                               rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 1.0}),
}


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations: matrices N(0, 1/sqrt(fan_in)), embeddings N(0, 1), norms 1 +- 0.2, expert bias +-0.05."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn(buffer.shape, generator=generator))


def attention_of(config) -> str:
    """transformers' attention implementation: SDPA, or eager for gpt-oss (its SDPA path takes no sinks)."""
    return "eager" if config.model_type == "gpt_oss" else "sdpa"


def hf_model(case: str, seed: int = 0):
    torch.manual_seed(seed)
    config = CASES[case]()
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention_of(config))
    randomize_(model, seed)
    return model.eval()


def tokens(batch: int = 2, seq: int = 24, vocab: int = 200, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def routings(model, ids: torch.Tensor) -> dict[int, object]:
    """{layer index: Routing} of each MoE layer in a forward over ids (router outputs observed by hooks)."""
    seen, hooks = {}, []
    for block in model.modules():
        if getattr(block, "is_moe", False):
            hooks.append(block.ffn.router.register_forward_hook(
                lambda mod, args, out, index=block.layer_index: seen.__setitem__(index, out)))
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    return seen


def assert_routing_margins(model, ids: torch.Tensor, min_gap: float = 1e-4) -> None:
    """The k-th and (k+1)-th choice scores differ by more than rounding can move them, in every MoE layer."""
    cfg = model.cfg.moe
    for index, routing in routings(model, ids).items():
        if cfg.router.num_groups:
            continue  # group masking decides first; its scores are checked through the logits comparison
        choice = routing.scores.detach()
        bias = model.layers[str(index)].ffn.router.expert_bias
        if bias is not None:
            choice = choice + bias
        top = choice.topk(cfg.top_k + 1, dim=-1).values if cfg.top_k < cfg.num_experts else None
        if top is not None:
            gap = (top[:, -2] - top[:, -1]).min().item()
            assert gap > min_gap, f"layer {index}: routing near-tie (gap {gap:.2e}); pick another seed"


@pytest.mark.parametrize("case", sorted(CASES))
def test_import_export_matches_transformers(case, tmp_path):
    reference = hf_model(case)
    ids = tokens()
    with torch.no_grad():
        expected = reference(ids).logits
    reference.save_pretrained(tmp_path / "hf")

    model_cfg, state = import_hf(tmp_path / "hf")
    model = build_model(model_cfg)
    model.load_state_dict(state, strict=True)
    model.eval()
    with torch.no_grad():
        ours = model(ids)
    assert ours.shape == expected.shape
    assert (ours - expected).abs().max().item() < TOL
    if model_cfg.moe is not None:
        assert_routing_margins(model, ids)

    export_hf(model_cfg, model.state_dict(), tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export",
                                                                 attn_implementation=attention_of(reference.config))
    assert type(reloaded) is type(reference)
    with torch.no_grad():
        again = reloaded.eval()(ids).logits
    assert (again - expected).abs().max().item() < TOL


def test_import_reads_padding_tied_buffers_and_families(tmp_path):
    """What import_hf fills in: padded vocab rows, tied head, the expert bias buffer, MoE router fields."""
    reference = hf_model("dsv3-groups4-yarn")
    reference.save_pretrained(tmp_path)
    model_cfg, state = import_hf(tmp_path)
    assert model_cfg.family == "deepseek_v3" and model_cfg.mtp_layers == 0  # HF's model has no MTP weights
    assert model_cfg.first_k_dense == 1 and model_cfg.moe.router.num_groups == 4
    assert model_cfg.rope.scaling.factor == 4.0 and model_cfg.rope.scaling.mscale_all_dim == 1.0
    assert state["embed_tokens.weight"].shape == (model_cfg.padded_vocab_size(), 64)
    assert state["embed_tokens.weight"][200:].abs().sum() == 0
    bias = reference.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(state["layers.1.ffn.router.expert_bias"], bias)

    tied = hf_model("qwen3-mha-tied-yarn")
    tied.save_pretrained(tmp_path / "tied")
    tied_cfg, tied_state = import_hf(tmp_path / "tied")
    assert tied_cfg.tie_embeddings and tied_state["lm_head.weight"] is tied_state["embed_tokens.weight"]
    model = build_model(tied_cfg)
    model.load_state_dict(tied_state, strict=True)
    assert model.lm_head.weight is model.embed_tokens.weight


def test_sharded_checkpoint_and_fused_expert_keys(tmp_path):
    """A sharded save (index.json) and a file with transformers' fused expert tensors import the same."""
    reference = hf_model("qwen3moe-e8k2-untied")
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    cfg, sharded = import_hf(tmp_path / "sharded")

    from safetensors.torch import save_file

    fused = {name: t.contiguous() for name, t in reference.state_dict().items()}
    (tmp_path / "fused").mkdir()
    save_file(fused, tmp_path / "fused" / "model.safetensors")
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "sharded" / "config.json").read_text())
    cfg2, from_fused = import_hf(tmp_path / "fused")
    assert cfg2 == cfg and sorted(from_fused) == sorted(sharded)
    for name in sharded:
        assert torch.equal(from_fused[name], sharded[name]), name


def test_qwen3_moe_aux_loss_equals_transformers(tmp_path):
    reference = hf_model("qwen3moe-e8k2-untied")
    ids = tokens(batch=3, seq=20)
    with torch.no_grad():
        expected = reference(ids, output_router_logits=True).aux_loss
    reference.save_pretrained(tmp_path)
    model_cfg, state = import_hf(tmp_path)
    model = build_model(model_cfg)
    model.load_state_dict(state)
    assert model_cfg.moe.router.load_balancing == "all_layers_aux_loss"  # transformers' loss, under its own name
    out = model(ids, labels=ids)
    coeff = model_cfg.moe.router.aux_loss_coeff
    assert coeff == 0.01
    aux = model.aux_loss_value  # the weighted value, completed once every layer had routed
    assert abs(aux.item() / coeff - expected.item()) < 1e-5
    (out.lm_sum * 0).backward()  # its gradient reaches every layer's router through the attached scores
    assert all(b.ffn.router.weight.grad.abs().sum() > 0 for b in model.layers.values())
    assert expected.item() > 2.0  # top-2: 2 at perfect balance, so a non-trivial value was compared


@pytest.mark.parametrize("case", ["dsv3-groups4-yarn", "glm4moe-bias-qknorm-half-rotary"])
def test_mtp_round_trip_through_deepseek_files(case, tmp_path):
    """Our MTP module is written as DeepSeek's layer num_layers (GLM-4.5's files use the same layout;
    transformers loads the file and ignores it) and comes back from import_hf bit for bit, including the expert
    bias, the attention biases and every config field."""
    reference = hf_model(case)
    reference.save_pretrained(tmp_path / "hf")
    model_cfg, state = import_hf(tmp_path / "hf")
    with_mtp = model_cfg.model_copy(update={"mtp_layers": 1})
    model = build_model(with_mtp, seed=3)
    model.load_state_dict({**model.state_dict(), **state}, strict=True)
    model.mtp["0"].block.ffn.router.expert_bias.uniform_(-0.1, 0.1)
    export_hf(with_mtp, model.state_dict(), tmp_path / "export")

    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    back_cfg, back = import_hf(tmp_path / "export")
    assert back_cfg == with_mtp
    ours = model.state_dict()
    assert sorted(back) == sorted(ours)
    for name in ours:
        assert torch.equal(back[name], ours[name]), name

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="sdpa")
    ids = tokens()
    with torch.no_grad():
        assert (reloaded.eval()(ids).logits - reference(ids).logits).abs().max().item() < TOL


def test_export_refuses_what_transformers_cannot_express(tmp_path):
    cfg = ModelConfig(family="qwen3", num_layers=1, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
                      vocab_size=50, qk_norm=False)
    model = build_model(cfg)
    with pytest.raises(HFConversionError, match="qk_norm"):
        export_hf(cfg, model.state_dict(), tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_import_names_missing_files(tmp_path):
    with pytest.raises(HFConversionError, match="config.json"):
        import_hf(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "qwen3",}')
    with pytest.raises(HFConversionError, match="config.json:1:.*not valid JSON"):
        import_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(HFConversionError, match="model.safetensors"):
        import_hf(tmp_path)
    hf_model("qwen3-gqa2-untied").save_pretrained(tmp_path)
    for field, value in [("model_type", "llama"), ("use_sliding_window", True), ("hidden_act", "gelu"),
                         ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})]:
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(HFConversionError, match="config.json"):
            import_hf(tmp_path)
        (tmp_path / "config.json").write_text(json.dumps(config))
    config = json.loads((tmp_path / "config.json").read_text())
    for changes, message in [({"num_hidden_layers": 3}, "missing: layers.2"), ({"head_dim": 8}, "wrong shape"),
                             ({"num_hidden_layers": 1}, "unexpected: layers.1"),
                             ({"num_attention_heads": 0}, "num_attention_heads"), ({"vocab_size": None}, "vocab")]:
        (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
        with pytest.raises(HFConversionError, match=message):
            import_hf(tmp_path)
    del config["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFConversionError, match="missing field 'hidden_size'"):
        import_hf(tmp_path)


def test_sharded_export_loads_and_replaces_an_earlier_export(tmp_path):
    reference = hf_model("qwen3moe-e8k2-untied")
    reference.save_pretrained(tmp_path / "hf")
    model_cfg, state = import_hf(tmp_path / "hf")
    out = tmp_path / "export"
    export_hf(model_cfg, state, out)  # one file first
    export_hf(model_cfg, state, out, max_shard_bytes=200_000)
    shards = sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == shards
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa")
    ids = tokens()
    with torch.no_grad():
        assert (reloaded.eval()(ids).logits - reference(ids).logits).abs().max().item() < TOL
    _, back = import_hf(out)
    assert all(torch.equal(back[name], state[name]) for name in state)

    export_hf(model_cfg, state, out)  # back to one file: the shards and index go
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]


def test_fp8_block_scaled_weights_are_dequantized(tmp_path):
    """DeepSeek-V3's release format: float8_e4m3fn weights with one fp32 `weight_scale_inv` per block."""
    from safetensors.torch import load_file, save_file

    reference = hf_model("dsv3-groups4-yarn")
    reference.save_pretrained(tmp_path)
    block = 16
    tensors = load_file(tmp_path / "model.safetensors")
    quantized = {}
    for name, weight in tensors.items():
        if name.endswith("proj.weight") and weight.dim() == 2:
            rows, cols = weight.shape
            padded = F.pad(weight, (0, -cols % block, 0, -rows % block))
            blocks = padded.unflatten(0, (-1, block)).unflatten(2, (-1, block))
            scale = blocks.abs().amax(dim=(1, 3)) / 448.0
            expanded = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
            quantized[name] = (weight / expanded).to(torch.float8_e4m3fn)
            quantized[name + "_scale_inv"] = scale
        else:
            quantized[name] = weight
    save_file(quantized, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [block, block]}
    (tmp_path / "config.json").write_text(json.dumps(config))

    model_cfg, state = import_hf(tmp_path)
    original = tensors["model.layers.0.self_attn.q_b_proj.weight"]
    restored = state["layers.0.self_attn.q_b_proj.weight"]
    assert restored.dtype == torch.bfloat16
    error = (restored.float() - original).abs().max().item()
    assert 0 < error < 0.07 * original.abs().max().item()  # e4m3 keeps 3 mantissa bits per block scale
    model = build_model(model_cfg)
    model.load_state_dict(state, strict=True)


@pytest.mark.parametrize("case", ["qwen3-gqa2-untied", "qwen3moe-e8k2-untied", "dsv3-groups4-yarn",
                                  "glm4moe-bias-qknorm-half-rotary", "glm4moe-air-groups2-yarn-quarter",
                                  "gptoss-sinks-window8-clamp1", "gptoss-yarn-untruncated-e6k4"])
def test_gradients_match_transformers(case, tmp_path):
    """Same loss, same weights: every parameter's gradient equals transformers' (in-memory fused names)."""
    reference = hf_model(case).train()
    reference.save_pretrained(tmp_path)
    model_cfg, state = import_hf(tmp_path)
    model = build_model(model_cfg)
    model.load_state_dict(state, strict=True)
    ids, labels = tokens(seed=2), tokens(seed=3)
    # Qwen3-MoE: transformers' loss with its all-layers balancing loss, ours attached to the layers. DeepSeek-V3
    # and GLM-4.5 have no balancing loss in transformers: ours (seq_aux_loss) is scaled to 0 for the comparison.
    with_aux = model_cfg.moe is not None and model_cfg.moe.router.load_balancing == "all_layers_aux_loss"
    out = reference(ids, output_router_logits=with_aux)
    loss = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())
    if with_aux:
        loss = loss + reference.config.router_aux_loss_coef * out.aux_loss
    loss.backward()
    model.balancing.start_step(scale=1.0 if with_aux else 0.0)
    F.cross_entropy(model(ids).flatten(0, 1), labels.flatten()).backward()
    theirs = {name: param.grad for name, param in reference.named_parameters()}
    gpt_oss = model_cfg.family == "gpt_oss"
    for name in [name for name in theirs if name.endswith(".mlp.experts.gate_up_proj")]:  # ours: gate_proj, up_proj
        prefix = name.removesuffix("gate_up_proj")
        fused = theirs.pop(name)
        if gpt_oss:  # [E, H, 2I], gate and up interleaved; down [E, I, H]; the biases interleaved too
            theirs[prefix + "gate_proj"], theirs[prefix + "up_proj"] = (fused[..., j::2].mT for j in (0, 1))
            bias = theirs.pop(prefix + "gate_up_proj_bias")
            theirs[prefix + "gate_proj_bias"], theirs[prefix + "up_proj_bias"] = bias[:, 0::2], bias[:, 1::2]
            theirs[prefix + "down_proj"] = theirs[prefix + "down_proj"].mT
        else:
            theirs[prefix + "gate_proj"], theirs[prefix + "up_proj"] = fused.chunk(2, dim=1)
    compared = 0
    for name, param in model.named_parameters():
        if name.startswith("mtp."):
            continue
        ours_as_hf = name.replace(".ffn.", ".mlp.")  # our feed-forward slot is transformers' `mlp`
        ours_as_hf = ours_as_hf if gpt_oss else ours_as_hf.replace("mlp.router.", "mlp.gate.")  # gpt-oss: ours
        hf_name = name if name == "lm_head.weight" else "model." + ours_as_hf
        expected = theirs.pop(hf_name)
        if name in ("embed_tokens.weight", "lm_head.weight"):
            assert param.grad[model_cfg.vocab_size :].abs().sum() == 0
            grad = param.grad[: model_cfg.vocab_size]
        else:
            grad = param.grad
        scale = expected.abs().max().item()
        assert scale > 0, name
        assert (grad - expected).abs().max().item() <= 1e-4 * max(scale, 1.0), name
        compared += 1
    assert compared > 0 and not theirs, sorted(theirs)  # every transformers gradient was compared


# transformers 5.24's configuration defaults against the recipes of the models they describe: every field the
# import reads is the recipe's but these (the published configs differ from the defaults there).
DEFAULTS_DIFFER = {
    "gpt-oss-120b": (transformers.GptOssConfig, {"moe.router.aux_loss_coeff": (0.001, 0.9)}),
    "glm4.5-air": (transformers.Glm4MoeConfig, {"head_dim": (None, 128), "attention_bias": (False, True),
                                                "rope.theta": (1e4, 1e6)}),
}


def _flat(fields: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in fields.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


@pytest.mark.parametrize("recipe", sorted(DEFAULTS_DIFFER))
def test_transformers_defaults_are_the_recipes_but_the_published_differences(recipe):
    """Glm4MoeConfig() is GLM-4.5-Air and GptOssConfig() gpt-oss-120b, as import_hf reads them, in every field
    but the ones the published config.json sets otherwise (DEFAULTS_DIFFER): the recipes' hyperparameters
    checked against transformers' own."""
    config_class, differ = DEFAULTS_DIFFER[recipe]
    defaults = _flat(config_from_hf(config_class().to_dict(), mtp_layers=1 if "glm" in recipe else 0).model_dump())
    ours = _flat(load_recipe(recipe).model.model_dump())
    found = {key: (defaults[key], ours[key]) for key in ours if defaults[key] != ours[key]}
    assert found == differ


# zai-org/GLM-4.5-Air's config.json as published (transformers 4.54's format: rope_theta and
# partial_rotary_factor at the top level), and GLM-4.5's fields where they differ.
GLM45_AIR_CONFIG = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 10944,
    "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1408,
    "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 128,
    "n_shared_experts": 1, "routed_scaling_factor": 1.0, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
    "num_hidden_layers": 46, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_qk_norm": False, "vocab_size": 151552,
}
GLM45_CONFIG = {**GLM45_AIR_CONFIG, "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                "n_routed_experts": 160, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
                "num_hidden_layers": 92, "use_qk_norm": True}


@pytest.mark.parametrize(("recipe", "published"), [("glm4.5-air", GLM45_AIR_CONFIG), ("glm4.5", GLM45_CONFIG)])
def test_glm_recipes_are_the_published_configs(recipe, published):
    """The built-in GLM recipes' model sections are what import_hf reads from the published config.json (with
    its MTP layer), field for field; and transformers builds the same shapes from our export of it."""
    ours = load_recipe(recipe).model
    assert config_from_hf(published, mtp_layers=published["num_nextn_predict_layers"]) == ours
    exported = transformers.Glm4MoeConfig(**config_to_hf(ours))
    for field in ("attention_bias", "use_qk_norm", "n_routed_experts", "first_k_dense_replace", "head_dim",
                  "routed_scaling_factor", "num_nextn_predict_layers"):
        assert getattr(exported, field) == published[field], field
    assert exported.rope_parameters["partial_rotary_factor"] == 0.5
    assert exported.rope_parameters["rope_theta"] == 1e6


# openai/gpt-oss-20b's config.json as published (transformers 4.55's format: rope_scaling and rope_theta at the
# top level), and gpt-oss-120b's fields where they differ; the 120b's is transformers 5.24's GptOssConfig defaults
# but for router_aux_loss_coef (0.001 there: test_transformers_defaults_are_the_recipes_but_the_published_differences).
GPT_OSS_20B_CONFIG = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}
GPT_OSS_120B_CONFIG = {**GPT_OSS_20B_CONFIG, "num_hidden_layers": 36, "num_local_experts": 128,
                       "layer_types": ["sliding_attention", "full_attention"] * 18}


@pytest.mark.parametrize(("recipe", "published"), [("gpt-oss-20b", GPT_OSS_20B_CONFIG),
                                                   ("gpt-oss-120b", GPT_OSS_120B_CONFIG)])
def test_gpt_oss_recipes_are_the_published_configs(recipe, published):
    """The built-in gpt-oss recipes' model sections are what import_hf reads from the published config.json,
    field for field; and transformers reads our export of it as the same architecture."""
    ours = load_recipe(recipe).model
    assert config_from_hf(published) == ours
    exported = transformers.GptOssConfig(**config_to_hf(ours))
    for field in ("attention_bias", "num_local_experts", "num_experts_per_tok", "head_dim", "sliding_window",
                  "layer_types", "swiglu_limit", "router_aux_loss_coef", "intermediate_size"):
        assert getattr(exported, field) == published[field], field
    assert exported.rope_parameters["truncate"] is False and exported.rope_parameters["factor"] == 32.0
