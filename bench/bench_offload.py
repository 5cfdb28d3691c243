"""Activation offloading (`parallel.offload.modules`) against the plain step on this machine: the peak of live
device bytes and the forward + backward time of a 4-layer proxy, with and without offloading, side by side in one
run, printed as ratios to the plain step.

The proxy is qwen3-moe-tiny cut to 4 layers at 512-token sequences, 2 a micro-batch, fp32, in this process with
one thread. The peak is measure's own count of live tensor storages over one forward + backward (measure/memory.py
`LiveBytes`, the parameters included, the pool's host copies left out as host memory is on CUDA); the time is the
median of `--steps` timed forward + backward passes after one untimed, the variants taken in turn each round so
that the machine's load falls on all of them alike. On a CPU the "host" copies are synchronous clones, so the time
ratio is what the bookkeeping and the copies cost with nothing to hide them behind: an upper bound of what a GPU's
side-stream copies add (plan prices those on the host link, docs/plan.md).

    python bench/bench_offload.py [--steps 5] [--seq 512]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch

from moe_train.config import load_recipe
from moe_train.measure.memory import LiveBytes
from moe_train.models import build_model
from moe_train.parallel.offload import apply_offload

RECIPE = "qwen3-moe-tiny"
VARIANTS = {  # label: regions offloaded
    "plain": "",
    "moe_act + core_attn + layernorm": "moe_act,core_attn,layernorm",
    "moe + core_attn + layernorm": "moe,core_attn,layernorm",
}


def _model(regions: str, seq: int):
    recipe = load_recipe(RECIPE, ["model.num_layers=4", f"train.seq_length={seq}", "train.precision=fp32",
                                  f"parallel.offload.modules=[{regions}]"])
    model = build_model(recipe.model, seed=1234)
    apply_offload(model, recipe, torch.device("cpu"))
    return model


def _pass(model, ids: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids).lm_sum.backward()


def _peak(model, ids: torch.Tensor) -> tuple[int, int]:
    """(peak live bytes over one forward + backward, bytes the host pool held after the forward)."""
    gc.collect()
    live = LiveBytes([*model.parameters(), *model.buffers()])
    pool = getattr(model, "offload_pool", None)
    with live:
        terms = model(ids, labels=ids)
        host = pool.host_bytes if pool else 0
        terms.lm_sum.backward()
    model.zero_grad(set_to_none=True)
    return live.peak, host


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load average {os.getloadavg()[0]:.1f} at the start; {RECIPE}, 4 layers, 2 x {args.seq} tokens, fp32")
    ids = torch.randint(0, 256, (2, args.seq), generator=torch.Generator().manual_seed(0))
    models = {label: _model(regions, args.seq) for label, regions in VARIANTS.items()}
    peaks = {label: _peak(model, ids) for label, model in models.items()}
    times: dict[str, list[float]] = {label: [] for label in models}
    for model in models.values():
        _pass(model, ids)  # untimed: first-call allocations
    for _ in range(args.steps):
        for label, model in models.items():
            start = time.perf_counter()
            _pass(model, ids)
            times[label].append(time.perf_counter() - start)
    base_peak, base_time = peaks["plain"][0], statistics.median(times["plain"])
    print(f"{'offloaded regions':34s} {'peak MB':>8s} {'x plain':>8s} {'host MB':>8s} {'step ms':>8s} {'x plain':>8s}")
    for label in models:
        peak, host = peaks[label]
        step = statistics.median(times[label])
        print(f"{label:34s} {peak / 1e6:8.1f} {peak / base_peak:8.2f} {host / 1e6:8.1f} {step * 1e3:8.0f} "
              f"{step / base_time:8.2f}")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
