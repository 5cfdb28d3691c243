"""Forward+backward time of one MoE layer as the expert count grows at fixed top-k: grouped_mm vs a loop.

Same tokens, weights and routing for every column; the columns of a row are timed interleaved (round-robin
repetitions, median) so that load from other processes hits them alike. The last column is transformers'
Qwen3MoeSparseMoeBlock with the same weights, for reference. One thread by default: on a shared machine,
several threads per process make small matmuls wait on descheduled threads and the figures turn to noise.

    PYTHONPATH=. python bench/bench_moe.py [--hidden 512 --ffn 256 --top-k 4 --tokens 2048 --dtype fp32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from moe_train.config.schema import MoEConfig
from moe_train.models.moe import MoELayer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_layer(*, experts: int, args: argparse.Namespace) -> MoELayer:
    moe = MoEConfig(num_experts=experts, top_k=args.top_k, ffn_hidden_size=args.ffn)
    layer = MoELayer(hidden_size=args.hidden, moe=moe)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return layer.to(DTYPES[args.dtype])


def hf_block(layer: MoELayer, args: argparse.Namespace) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    moe = layer.moe
    config = Qwen3MoeConfig(
        hidden_size=args.hidden,
        moe_intermediate_size=moe.ffn_hidden_size,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=True,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
    )
    block = Qwen3MoeSparseMoeBlock(config)
    block.load_state_dict(
        {
            "gate.weight": layer.router.weight,
            "experts.gate_up_proj": torch.cat((layer.experts.gate_proj, layer.experts.up_proj), dim=1),
            "experts.down_proj": layer.experts.down_proj,
        }
    )
    return block.to(DTYPES[args.dtype])


def step(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    module(x).backward(grad)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)

    print(
        f"MoE layer fwd+bwd, {args.tokens} tokens, hidden {args.hidden}, expert ffn {args.ffn}, top-{args.top_k}, "
        f"{args.dtype}, {torch.get_num_threads()} threads; median of {args.reps} (ms)"
    )
    print(f"{'experts':>8} {'grouped_mm':>11} {'loop':>9} {'loop/grouped':>13} {'transformers':>13} {'hf/grouped':>11}")
    for experts in args.experts:
        grouped = build_layer(experts=experts, args=args)
        loop = build_layer(experts=experts, args=args)
        loop.experts.use_grouped_mm = False
        hf = hf_block(grouped, args)
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(1, args.tokens, args.hidden, generator=generator).to(DTYPES[args.dtype])
        grad = torch.randn_like(x)
        modules = {"grouped": grouped, "loop": loop, "hf": hf}
        times: dict[str, list[float]] = {name: [] for name in modules}
        for rep in range(args.reps + 1):  # the first round warms up
            for name, module in modules.items():
                start = time.perf_counter()
                step(module, x, grad)
                if rep:
                    times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(
            f"{experts:>8} {ms['grouped']:>11.1f} {ms['loop']:>9.1f} {ms['loop'] / ms['grouped']:>13.2f} "
            f"{ms['hf']:>13.1f} {ms['hf'] / ms['grouped']:>11.2f}"
        )


if __name__ == "__main__":
    main()
