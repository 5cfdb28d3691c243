"""Whole-model training steps, moe-train against transformers, side by side in one run.

1. The issue's Qwen3-MoE (hidden 512, 4 layers, 16 experts top-4, expert FFN 256, seq 512, batch 4) in fp32
   and bf16: moe-train vs Qwen3MoeForCausalLM with the same weights (exported by export_hf). transformers 5.24
   runs experts through torch._grouped_mm by default, as we do; its per-expert loop (experts_implementation=
   "eager", the implementation of earlier releases) is timed too, for reference.
2. deepseek-v3-tiny (the built-in recipe, its seq_length and micro_batch_size) vs DeepseekV3ForCausalLM.
3. Step time as the experts grow 8 -> 64 at top-4 (the Qwen3-MoE shape, fp32).

A step is forward + cross-entropy (+ the MoE aux loss both sides compute) + backward. The two models of a row
are timed interleaved (round-robin repetitions, median), so load from other processes hits them alike.
FLOPs per step come from FlopCounterMode, with formulas registered for the ops it does not know on CPU (the
fused CPU attention kernel and torch._grouped_mm); MFU is against the best square-matmul rate measured in this
run, in the step's dtype (moe_train.train.peak).

    PYTHONPATH=. python bench/bench_models.py [--repeats 5] [--threads 1] [--skip-sweep]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

from moe_train.checkpoint.hf import export_hf
from moe_train.config import load_recipe
from moe_train.config.schema import ModelConfig, MoEConfig, RouterConfig
from moe_train.models import build_model
from moe_train.train.peak import measured_matmul_flops

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
aten = torch.ops.aten


# ------------------------------------------------------------------------------------ FLOP formulas for CPU ops


def _heads_like_query(query_shape, other_shape):
    """GQA passes fewer key/value heads; the attention FLOPs are those of every query head."""
    return (*other_shape[:-3], query_shape[-3], *other_shape[-2:])


@register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu)
def _sdpa_cpu_flops(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    return sdpa_flop_count(query_shape, _heads_like_query(query_shape, key_shape),
                           _heads_like_query(query_shape, value_shape))


@register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward)
def _sdpa_cpu_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, _heads_like_query(query_shape, key_shape),
                                    _heads_like_query(query_shape, value_shape))


@register_flop_formula(aten._grouped_mm)
def _grouped_mm_flops(a_shape, b_shape, *args, **kwargs) -> int:
    """Grouped GEMM: every group multiplies its slice; the slices add up to one product of the full shapes."""
    if len(a_shape) == 2 and len(b_shape) == 3:  # [M, K] x [E, K, N], rows grouped
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:  # [M, K] x [K, N], K grouped (weight gradients)
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    if len(a_shape) == 3 and len(b_shape) == 2:  # [E, M, K] x [K, N], columns grouped
        return 2 * a_shape[1] * a_shape[2] * b_shape[1]
    return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]  # batched


# -------------------------------------------------------------------------------------------------- models


def qwen3_moe_config(num_experts: int = 16) -> ModelConfig:
    return ModelConfig(
        family="qwen3_moe", num_layers=4, hidden_size=512, num_attention_heads=8, num_query_groups=4, head_dim=64,
        ffn_hidden_size=1024, vocab_size=8192, max_position_embeddings=1024, init_std=0.02,
        moe=MoEConfig(num_experts=num_experts, top_k=4, ffn_hidden_size=256,
                      router=RouterConfig(load_balancing="aux_loss", aux_loss_coeff=1e-3)),
    )


def model_pair(cfg: ModelConfig, dtype: torch.dtype, *, hf_eager: bool = False) -> dict[str, torch.nn.Module]:
    """Ours and transformers' (default experts: grouped_mm; with hf_eager also its per-expert loop) with the
    same weights, in train mode, in `dtype`."""
    from transformers import AutoModelForCausalLM

    ours = build_model(cfg, seed=0)
    models = {"moe-train": ours}
    with tempfile.TemporaryDirectory() as folder:
        export_hf(cfg, ours.state_dict(), folder)
        models["transformers"] = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
        if hf_eager:
            models["hf-eager-experts"] = AutoModelForCausalLM.from_pretrained(
                folder, attn_implementation="sdpa", experts_implementation="eager"
            )
    return {name: model.to(dtype).train() for name, model in models.items()}


def ours_step(model, ids, labels):
    logits = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())  # + the attached balancing losses
    loss.backward()


def hf_step(model, ids, labels, *, router_logits: bool):
    out = model(ids, output_router_logits=True) if router_logits else model(ids)
    loss = F.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten())
    if router_logits:
        loss = loss + model.config.router_aux_loss_coef * out.aux_loss
    loss.backward()


def count_flops(step) -> int:
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def time_interleaved(steps: dict, repeats: int) -> dict[str, float]:
    """Median seconds per call of each step, run round-robin after one warm-up call each."""
    for step in steps.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def compare(title: str, cfg: ModelConfig, *, batch: int, seq: int, dtype_name: str, repeats: int,
            router_logits: bool, hf_eager: bool = False) -> dict:
    dtype = DTYPES[dtype_name]
    models = model_pair(cfg, dtype, hf_eager=hf_eager)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=generator)
    labels = torch.randint(0, cfg.vocab_size, (batch, seq), generator=generator)
    steps = {
        name: (lambda m=model: ours_step(m, ids, labels)) if name == "moe-train"
        else (lambda m=model: hf_step(m, ids, labels, router_logits=router_logits))
        for name, model in models.items()
    }
    flops = {name: count_flops(step) for name, step in steps.items()}
    seconds = time_interleaved(steps, repeats)
    peak = measured_matmul_flops(dtype)
    tokens = batch * seq
    row = {"title": title, "dtype": dtype_name, "peak_tflops": peak / 1e12, "models": list(steps)}
    for name in steps:
        row[name] = {"step_s": seconds[name], "tokens_per_s": tokens / seconds[name], "gflop": flops[name] / 1e9,
                     "mfu": flops[name] / seconds[name] / peak,
                     "speedup": seconds[name] / seconds["moe-train"]}
    return row


def print_row(row: dict) -> None:
    print(f"\n{row['title']} [{row['dtype']}]  matmul peak {row['peak_tflops'] * 1e3:.1f} GFLOP/s")
    print(f"  {'':<17} {'step s':>8} {'tokens/s':>10} {'GFLOP/step':>11} {'MFU':>7} {'moe-train speedup':>18}")
    for name in row["models"]:
        r = row[name]
        print(f"  {name:<17} {r['step_s']:8.3f} {r['tokens_per_s']:10.0f} {r['gflop']:11.1f} {r['mfu']:7.1%} "
              f"{r['speedup']:17.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (default 1: on shared cores, one busy core stalls a 2-thread team)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    for dtype_name in ("fp32", "bf16"):
        print_row(compare("Qwen3-MoE h512 L4 E16 top-4 ffn256, seq 512 x batch 4", qwen3_moe_config(),
                          batch=4, seq=512, dtype_name=dtype_name, repeats=args.repeats, router_logits=True,
                          hf_eager=True))

    recipe = load_recipe("deepseek-v3-tiny", check_files=False)
    ds_cfg = recipe.model.model_copy(update={"mtp_layers": 0})
    train = recipe.train
    print_row(compare(f"deepseek-v3-tiny (no MTP: transformers has none), seq {train.seq_length} x batch "
                      f"{train.micro_batch_size}", ds_cfg, batch=train.micro_batch_size,
                      seq=train.seq_length, dtype_name="fp32", repeats=args.repeats, router_logits=False))

    if args.skip_sweep:
        return
    print("\nExperts 8 -> 64 at top-4 (Qwen3-MoE shape, fp32, seq 512 x batch 4): seconds per step")
    print(f"  {'experts':>7} {'moe-train':>10} {'transformers':>13} {'hf-eager-experts':>17} {'speedup':>8}")
    for experts in (8, 16, 32, 64):
        row = compare("", qwen3_moe_config(experts), batch=4, seq=512, dtype_name="fp32",
                      repeats=max(2, args.repeats // 2), router_logits=True, hf_eager=True)
        print(f"  {experts:>7} {row['moe-train']['step_s']:10.3f} {row['transformers']['step_s']:13.3f} "
              f"{row['hf-eager-experts']['step_s']:17.3f} {row['transformers']['speedup']:7.2f}x")


if __name__ == "__main__":
    main()
