"""The GPU path's checks on one GPU (issue 21), in stages, each in its own process under its own timeout.

    python bench/gpu/check.py --out DIR [--device cuda|cpu] [--only STAGE,...]

After every stage DIR/figures.json is rewritten with everything measured so far (a stage that hangs or crashes
loses nothing before it) and DIR/check.log gets the stage's output. `--device cpu` is the rehearsal: the same
stages on tiny shapes, run by tests/test_gpu_check.py, so the script cannot fail on the GPU over a typo. Nothing
here states an expected GPU figure: each stage measures and writes what it saw.

Stages: probe (versions, the APIs the engine needs), grouped_mm (torch._grouped_mm forward/backward against the
per-expert loop, ragged and zero counts), sdpa (the SDPA kernel chosen for GQA, MLA and document-masked inputs,
with peak memory), fp8 (each fp8 recipe's GEMM through the kernel table's real kernel and emulated, side by
side: error against the fp64 product and time; the routed experts' grouped fp8 GEMM likewise; one qwen3-moe-tiny
training step per recipe that validate takes on this GPU), te (one such step with backend te where
transformer-engine imports; skipped with the reason elsewhere), tiny_run (`moe-train run` of qwen3-moe-tiny: the
loss falls), proxy (qwen3-30b-a3b cut to
4 layers, EP 1, one GPU, bf16: tokens/s, TFLOP/s, MFU, peak memory next to plan's estimate, eager), compile
(the proxy eager and with train.compile side by side: speed-up, first-step compile time, losses), hf_proxy
(the same config in transformers, grouped_mm experts, the same batch), resume (train.deterministic: a run
resumed from its checkpoint equals the uninterrupted run bit for bit).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Seconds per stage on the GPU (the whole script: about 6 minutes with the install); the CPU rehearsal's shapes
# are tiny and take a fraction of these.
# sdpa includes compiling FlexAttention (forward and backward) for two head layouts.
# compile: the proxy twice, inductor compiling its two block kinds' graphs (not measured on a GPU yet).
# fp8: each recipe's GEMM real and emulated, the grouped GEMM, and one training step per recipe validate takes.
# In order of what the short lease on the machine must bring back first: check.sh stops the script at 420 s and
# figures.json is written after every stage, so the longest and least certain stage (compile) runs last.
TIMEOUTS = {"probe": 15, "grouped_mm": 30, "sdpa": 60, "tiny_run": 60, "proxy": 90, "fp8": 90, "te": 30,
            "hf_proxy": 50, "resume": 50, "compile": 240}
STAGES = list(TIMEOUTS)


# ------------------------------------------------------------------------------------------------ helpers


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: str, repeats: int = 3) -> float:
    """Median seconds of fn() after one warm-up call."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _peak_bytes(fn, device: str) -> int | None:
    import torch

    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


# ------------------------------------------------------------------------------------------------- stages


def stage_probe(device: str, work: Path) -> dict:
    import importlib.metadata as metadata

    import torch

    from moe_train.runtime import TESTED_TORCH, torch_problems

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    out = {"torch": torch.__version__, "tested_torch": TESTED_TORCH, "cuda": torch.version.cuda,
           "missing_apis": torch_problems(), "python": sys.version.split()[0],
           "packages": {n: version(n) for n in ("transformers", "pydantic", "pydantic-core", "typer", "triton")},
           "private_apis": {
               "torch._grouped_mm": hasattr(torch, "_grouped_mm"),
               "torch._C._clear_DTensor_sharding_propagator_cache":
                   hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache"),
               "distributed_c10d._set_pg_timeout": hasattr(torch.distributed.distributed_c10d, "_set_pg_timeout"),
           }}
    if device == "cuda":
        out["device_name"] = torch.cuda.get_device_name()
        out["capability"] = list(torch.cuda.get_device_capability())
        out["memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return out


def stage_grouped_mm(device: str, work: Path) -> dict:
    """torch._grouped_mm against one matmul per expert, forward and backward, on ragged counts with empty
    experts; the engine's GroupedExperts both ways too."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    experts, hidden, ffn = (64, 2048, 768) if device == "cuda" else (8, 64, 32)
    counts = torch.randint(0, 64 if device == "cuda" else 16, (experts,))
    counts[::5] = 0  # empty experts
    rows = int(counts.sum())
    offsets = torch.cumsum(counts, 0).to(torch.int32).to(device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=gen).to(device, dtype).requires_grad_(True)
    w = (torch.randn(experts, ffn, hidden, generator=gen) * 0.02).to(device, dtype).requires_grad_(True)

    def grouped():
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)

    def loop():
        return torch.cat([c @ we.t() for c, we in zip(torch.split(x, counts.tolist()), w.unbind(0), strict=True)])

    out = {"dtype": str(dtype), "experts": experts, "rows": rows, "empty_experts": int((counts == 0).sum())}
    if not hasattr(torch, "_grouped_mm"):
        return {**out, "grouped_mm": "absent in this torch"}
    results = {}
    for name, fn in (("grouped_mm", grouped), ("loop", loop)):
        x.grad = w.grad = None
        y = fn()
        y.float().square().sum().backward()
        results[name] = (y.detach().float(), x.grad.float(), w.grad.float())

        def step(fn=fn):
            fn().float().square().sum().backward()

        out[f"{name}_fwd_bwd_ms"] = _timed(step, device) * 1e3
    g, lp = results["grouped_mm"], results["loop"]
    scale = lp[0].abs().max().item()
    out["max_rel_diff"] = {k: (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
                           for k, a, b in zip(("out", "grad_x", "grad_w"), g, lp, strict=True)}
    out["output_scale"] = scale
    out["engine_experts"] = _engine_experts(device, dtype, counts, experts, hidden, ffn)
    return out


def _engine_experts(device: str, dtype, counts, experts: int, hidden: int, ffn: int) -> dict:
    """The engine's GroupedExperts: the kernel the table picks here (and why), and its three paths (grouped GEMM,
    the padded batched GEMM that runs below Hopper, the per-expert loop) timed forward+backward on the same rows,
    with each path's largest difference from the loop relative to the loop's largest value."""
    import torch

    from moe_train.models.moe.experts import GroupedExperts, expert_kernel

    module = GroupedExperts(num_experts=experts, hidden_size=hidden, ffn_hidden_size=ffn).to(device, dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    counts = counts.to(device)
    capacity = int(counts.max())
    x = torch.randn(int(counts.sum()), hidden, device=device, dtype=dtype, requires_grad=True)
    kernel, why = expert_kernel(dtype, x.device, hidden_size=hidden, ffn_hidden_size=ffn)
    out = {"table_choice": kernel, "why": why, "capacity": capacity}
    probs = torch.rand(x.shape[0], 1, device=device, dtype=dtype)  # the rows' routing weights
    paths = {"loop": lambda: module._loop(x, counts, probs),
             "padded_bmm": lambda: module._padded(x, counts, probs, capacity)}
    if kernel == "grouped_mm":
        paths["grouped_mm"] = lambda: module._grouped(x, counts, probs)
    results = {}
    for name, fn in paths.items():
        module.zero_grad()
        x.grad = None
        y = fn()
        y.float().square().sum().backward()
        results[name] = (y.detach().float(), x.grad.float(), module.down_proj.grad.float())

        def step(fn=fn):
            fn().float().square().sum().backward()

        out[f"{name}_fwd_bwd_ms"] = _timed(step, device) * 1e3
        out[f"{name}_peak_bytes"] = _peak_bytes(step, device)
    loop = results["loop"]
    for name, got in results.items():
        if name != "loop":
            out[f"{name}_max_rel_diff"] = {
                k: (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
                for k, a, b in zip(("out", "grad_x", "grad_down"), got, loop, strict=True)}
    return out


def stage_sdpa(device: str, work: Path) -> dict:
    """Which SDPA kernel runs (read off the backward node) under the kernel table's backend order, and the
    forward+backward peak memory, for GQA (causal), MLA's shapes (q/k 192, v 128, and v zero-padded to 192: the
    padding the cuda row leaves out) and a two-document mask (the engine's mask, and on CUDA its FlexAttention
    block mask)."""
    import torch

    from moe_train.kernels import kernels_for
    from moe_train.models.attention import attend, attention_mask

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    b, s = (1, 4096) if device == "cuda" else (1, 256)
    positions = torch.cat([torch.arange(s // 2), torch.arange(s - s // 2)]).unsqueeze(0).to(device)
    cases = {
        "gqa_causal": ((32, 128), (4, 128), (4, 128), None, {"enable_gqa": True}),
        "mla_causal": ((16, 192), (16, 192), (16, 128), None, {}),
        "mla_padded_causal": ((16, 192), (16, 192), (16, 192), None, {}),  # v zero-padded, as the CPU row does
        "gqa_documents": ((32, 128), (4, 128), (4, 128), attention_mask(positions), {"enable_gqa": True}),
        "mla_documents": ((16, 192), (16, 192), (16, 128), attention_mask(positions), {}),
    }
    row = kernels_for(device)
    out = {"dtype": str(dtype), "seq": s, "table": {"sdpa_backends": list(row.sdpa_backends),
                                                    "mla_value": row.mla_value, "documents": row.documents}}
    for name, (qs, ks, vs, mask, kwargs) in cases.items():
        def make(shape):
            return torch.randn(b, shape[0], s, shape[1], device=device, dtype=dtype, requires_grad=True)

        q, k, v = make(qs), make(ks), make(vs)
        try:
            y = attend(q, k, v, mask, **kwargs)
            node = _attention_node(y)

            def step(q=q, k=k, v=v, mask=mask, kwargs=kwargs):
                attend(q, k, v, mask, **kwargs).float().sum().backward()

            out[name] = {"kernel": node, "mask": type(mask).__name__ if mask is not None else None,
                         "fwd_bwd_ms": _timed(step, device) * 1e3, "peak_bytes": _peak_bytes(step, device)}
        except Exception as error:  # a kernel that refuses these shapes is a finding, not a crash
            out[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    return out


def _attention_node(y) -> str:
    """The fused attention kernel's backward node under y (SDPA may end in a view), or 'math' when none is."""
    seen, todo = set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        if "Attention" in name or "Flex" in name:
            return name
        todo.extend(next_node for next_node, _ in node.next_functions)
    return "math (no fused kernel: matmul + softmax)"


FP8_RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8")


def _relative(out, exact) -> float:
    return ((out.double() - exact).norm() / exact.norm()).item()


def _fp8_gemm_side_by_side(device: str, recipe: str, grouped: bool) -> dict:
    """One fp8 GEMM of `recipe` real (where the kernel table chose a kernel) and emulated: the error of each
    against the fp64 product and the time of each, with bf16's time beside them."""
    import torch

    from moe_train.models.fp8.gemm import grouped_product, kernel_choice, product

    gen = torch.Generator().manual_seed(0)
    if grouped:
        experts, rows_each, k, n = (8, 512, 2048, 768) if device == "cuda" else (4, 24, 64, 32)
        rows = torch.randn(experts * rows_each, k, generator=gen).to(device, torch.bfloat16)
        weight = (torch.randn(experts, n, k, generator=gen) * 0.02).to(device, torch.bfloat16)
        offsets = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * rows_each
        exact = torch.cat([rows[e * rows_each:(e + 1) * rows_each].double() @ weight[e].double().t()
                           for e in range(experts)])  # fp64: no TF32 whatever an earlier step switched on

        def run(real: bool):
            return grouped_product(rows, weight, offsets, recipe=recipe, roles=("input", "weight"), real=real)

        def bf16():
            return torch._grouped_mm(rows, weight.transpose(-2, -1), offs=offsets)
    else:
        m, k, n = (8192, 4096, 4096) if device == "cuda" else (64, 256, 48)
        a = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
        b = torch.randn(n, k, generator=gen).to(device, torch.bfloat16)
        exact = a.double() @ b.double().t()

        def run(real: bool):
            return product(a, b, recipe=recipe, roles=("input", "weight"), real=real, out_dtype=torch.bfloat16)

        def bf16():
            return a @ b.t()
    real, why = kernel_choice(recipe, torch.device(device), grouped=grouped)
    out = {"table": "real" if real else "emulated", "why": why, "bf16_ms": _timed(bf16, device) * 1e3,
           "emulated": {"rel_error": _relative(run(False), exact), "ms": _timed(lambda: run(False), device) * 1e3}}
    if real:
        try:
            out["real"] = {"rel_error": _relative(run(True), exact), "ms": _timed(lambda: run(True), device) * 1e3}
        except Exception as error:  # a kernel that refuses is the finding
            out["real"] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    return out


def _fp8_step(device: str, work: Path, recipe: str, backend: str = "torchao") -> dict:
    """Three trainer steps of qwen3-moe-tiny in fp8 (the first warms up): losses, step times, GEMMs by mode."""
    from moe_train.config import RecipeError, load_recipe
    from moe_train.models.fp8.gemm import count_fp8_gemms
    from moe_train.train.loop import Trainer

    sets = ["train.precision=fp8", f"train.fp8.recipe={recipe}", f"train.fp8.backend={backend}",
            f"launch.device={device}", f"run_dir={work / f'fp8-{backend}-{recipe}'}", "train.steps=10",
            "checkpoint.interval=null", "logging.tensorboard=false", "train.compile=false"]  # eager: no compile time
    sets += ["launch.gpu=h200"] if device == "cuda" else ["model.num_layers=1", "train.seq_length=32",
                                                          "train.global_batch_size=2", "train.micro_batch_size=2"]
    try:
        trainer = Trainer(load_recipe("qwen3-moe-tiny", sets))
    except RecipeError as error:  # validate refuses the recipe on this GPU: the finding
        return {"refused": str(error)[:1000]}
    seconds, losses = [], []
    with count_fp8_gemms() as tally:
        for step in range(1, 4 if device == "cuda" else 2):
            start = time.perf_counter()
            losses.append(trainer.train_step(step).loss)
            _sync(device)
            seconds.append(time.perf_counter() - start)
    return {"losses": losses, "step_seconds": seconds, "finite": all(math.isfinite(x) for x in losses),
            "gemms": {"/".join(key): count for key, count in sorted(tally.items())}}


def stage_fp8(device: str, work: Path) -> dict:
    """Each fp8 recipe's GEMM real and emulated side by side, the grouped GEMM likewise, the start-up probe's
    verdict, and one training step per recipe (the CPU rehearsal: tensorwise only)."""
    import torch

    from moe_train.models.fp8.gemm import capability
    from moe_train.models.fp8.runtime import fp8_problems, fp8_stack

    out: dict = {"capability": capability(torch.device(device)), "recipes": {}}
    for recipe in FP8_RECIPES:
        figures = {"linear": _fp8_gemm_side_by_side(device, recipe, grouped=False),
                   "grouped": _fp8_gemm_side_by_side(device, recipe, grouped=True),
                   "probe_problems": fp8_problems(recipe, torch.device(device)),
                   "stack": fp8_stack(recipe, torch.device(device))}
        if device == "cuda" or recipe == "tensorwise":
            figures["step"] = _fp8_step(device, work, recipe)
        out["recipes"][recipe] = figures
    steps = [f["step"] for f in out["recipes"].values() if "step" in f and "refused" not in f["step"]]
    out["passed"] = bool(steps) and all(step["finite"] for step in steps) and not any(
        f["probe_problems"] for f in out["recipes"].values())
    return out


def stage_te(device: str, work: Path) -> dict:
    """One qwen3-moe-tiny fp8 step with backend te (tensorwise) where transformer-engine imports and CUDA runs;
    otherwise skipped, with the reason."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        return {"skipped": "transformer-engine is not installed here (its CUDA wheels exceed what this check "
                           "carries)"}
    if device != "cuda":
        return {"skipped": "backend te runs on CUDA only"}
    from moe_train.models.fp8.te import te_version

    step = _fp8_step(device, work, "tensorwise", backend="te")
    return {"transformer_engine": te_version(), "step": step, "passed": step.get("finite", False)}


def _cli(args: list[str], work: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "moe_train.cli.main", *args], cwd=work, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _train_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def stage_tiny_run(device: str, work: Path) -> dict:
    """`moe-train run` of the default recipe on this device (50 steps on CUDA): the loss falls."""
    run_dir = work / "tiny"
    steps = 50 if device == "cuda" else 4
    sets = [f"launch.device={device}", f"train.steps={steps}", f"run_dir={run_dir}", "checkpoint.interval=null",
            "logging.interval=1"]
    if device == "cuda":
        sets += ["launch.gpu=h200"]
    else:
        sets += ["model.num_layers=1", "train.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=2"]
    result = _cli(["run", "qwen3-moe-tiny", *[w for s in sets for w in ("--set", s)]], work, TIMEOUTS["tiny_run"])
    out = {"exit_code": result.returncode, "stderr_tail": result.stderr[-2000:]}
    if (run_dir / "metrics.jsonl").exists():
        records = _train_records(run_dir)
        out.update(steps=len(records), first_loss=records[0]["loss"], last_loss=records[-1]["loss"],
                   loss_fell=records[-1]["loss"] < records[0]["loss"],
                   tokens_per_s=records[-1]["tokens_per_s"], mfu=records[-1]["mfu"],
                   memory_bytes=records[-1]["memory_bytes"],
                   memory_reserved_bytes=records[-1].get("memory_reserved_bytes"))
    out["passed"] = result.returncode == 0 and bool(out.get("loss_fell"))
    return out


def _proxy_recipe(device: str, work: Path, name: str = "proxy", extra: tuple[str, ...] = ()):
    from moe_train.config import load_recipe

    if device == "cuda":
        sets = ["model.num_layers=4", "parallel.ep=1", "launch.nodes=1", "launch.gpus_per_node=1",
                "launch.gpu=h200", "train.global_batch_size=4", "train.micro_batch_size=1", "train.seq_length=4096",
                "parallel.recompute.granularity=none", "logging.tensorboard=false"]
        base = "qwen3-30b-a3b"
    else:
        sets = ["model.num_layers=2", "train.seq_length=64", "train.global_batch_size=4", "train.micro_batch_size=2",
                "launch.device=cpu"]
        base = "qwen3-moe-tiny"
    return load_recipe(base, [*sets, f"run_dir={work / name}", "train.steps=100", *extra])


def stage_proxy(device: str, work: Path) -> dict:
    """A Qwen3-MoE proxy that fills the GPU, eager: timed steps with the trainer's own step."""
    from moe_train.config.hardware import hardware_table
    from moe_train.plan.estimate import estimate
    from moe_train.train.loop import Trainer

    recipe = _proxy_recipe(device, work)
    out: dict = {"recipe": "qwen3-30b-a3b, 4 layers, EP 1, 1 GPU" if device == "cuda" else "qwen3-moe-tiny cut",
                 "tokens_per_step": recipe.train.global_batch_size * recipe.train.seq_length}
    plan = estimate(recipe, hardware_table()[recipe.launch.gpu if device == "cuda" else "h200"])
    out["plan"] = {"peak_memory_bytes": plan.peak, "tokens_per_s": plan.tokens_per_s, "mfu": plan.mfu}
    out["eager"] = _timed_steps(Trainer(recipe), device, tokens_per_step=out["tokens_per_step"])
    out["compile"] = "the compile stage: eager and train.compile side by side"
    return out


def _timed_steps(trainer, device: str, *, tokens_per_step: int) -> dict:
    """The trainer's own steps, timed (the first warms caches and kernels, and compiles: left out of the rates)."""
    import torch

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds, losses = [], []
    for step in range(1, 6 if device == "cuda" else 3):
        start = time.perf_counter()
        result = trainer.train_step(step)
        _sync(device)
        seconds.append(time.perf_counter() - start)
        losses.append(result.loss)
    timed = seconds[1:]
    tokens_per_s = tokens_per_step * len(timed) / sum(timed)
    tflops = trainer.flops_per_token * tokens_per_s / 1e12
    out = {"step_seconds": seconds, "losses": losses, "tokens_per_s": tokens_per_s, "tflops_per_device": tflops,
           "mfu": tflops * 1e12 / trainer.peak}
    if device == "cuda":
        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    return out


def stage_compile(device: str, work: Path) -> dict:
    """The proxy eager and with train.compile (each decoder block compiled, inductor), side by side in one
    process: step times, tokens/s, MFU and peak memory of each, the compiled first step (which compiles), the
    speed-up, the losses' largest relative difference and the graphs made after the first step (none
    expected). The CPU rehearsal cuts the proxy to one layer and compiles with aot_eager (inductor's C++ build
    takes minutes on two cores; the GPU runs inductor)."""
    from torch._dynamo.utils import counters

    from moe_train.parallel.compile import BACKEND_ENV
    from moe_train.train.loop import Trainer

    if device == "cpu":
        os.environ.setdefault(BACKEND_ENV, "aot_eager")
    figures = {}
    for mode in ("eager", "compiled"):
        cut = ("model.num_layers=1",) if device == "cpu" else ()
        extra = (f"train.compile={str(mode == 'compiled').lower()}", *cut)
        recipe = _proxy_recipe(device, work, name=f"compile-{mode}", extra=extra)
        trainer = Trainer(recipe)
        graphs = counters["stats"]["unique_graphs"]
        figures[mode] = _timed_steps(trainer, device, tokens_per_step=recipe.train.global_batch_size
                                     * recipe.train.seq_length)
        figures[mode]["graphs"] = counters["stats"]["unique_graphs"] - graphs
    eager, compiled = figures["eager"], figures["compiled"]
    out = {"backend": os.environ.get(BACKEND_ENV, "inductor"), **figures,
           "first_step_seconds": compiled["step_seconds"][0],
           "speedup": compiled["tokens_per_s"] / eager["tokens_per_s"],
           "loss_max_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(compiled["losses"], eager["losses"],
                                                                         strict=True))}
    out["passed"] = compiled["graphs"] > 0 and out["loss_max_rel_diff"] < (2e-2 if device == "cuda" else 1e-5)
    return out


def stage_hf_proxy(device: str, work: Path) -> dict:
    """The same config in transformers (Qwen3MoeForCausalLM, bf16, grouped_mm experts), the same batch shape:
    forward, backward and an AdamW step, timed as the proxy's steps are."""
    import torch
    import transformers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from moe_train.checkpoint.hf import config_to_hf

    recipe = _proxy_recipe(device, work, "hf")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = Qwen3MoeConfig.from_dict(config_to_hf(recipe.model, dtype=dtype))
    config._attn_implementation = "sdpa"
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built on the device in its dtype: 3B parameters drawn on the host take long
    try:
        with torch.device(device):
            model = Qwen3MoeForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    micro = recipe.train.global_batch_size // recipe.train.micro_batch_size
    tokens = torch.randint(recipe.model.vocab_size, (recipe.train.micro_batch_size, recipe.train.seq_length + 1),
                           device=device)

    def step():
        for _ in range(micro):
            model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = _timed(step, device, repeats=3)
    tokens_per_step = recipe.train.global_batch_size * recipe.train.seq_length
    out = {"transformers": transformers.__version__, "experts_implementation": config._experts_implementation,
           "step_seconds": seconds, "tokens_per_s": tokens_per_step / seconds,
           "note": "fp32 master weights are not kept here: the model itself is bf16 (transformers' usual run)"}
    if device == "cuda":
        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    return out


def stage_resume(device: str, work: Path) -> dict:
    """train.deterministic: 4 steps straight vs 2, a checkpoint, and 2 more in a new process: equal losses."""
    sets = [f"launch.device={device}", "train.deterministic=true", "train.steps=4", "checkpoint.interval=2",
            "train.global_batch_size=4", "train.micro_batch_size=2", "logging.interval=1"]
    sets += ["launch.gpu=h200", "model.num_layers=2", "train.seq_length=128"] if device == "cuda" else \
        ["model.num_layers=1", "train.seq_length=32"]
    out = {}
    words = [w for s in sets for w in ("--set", s)]
    limit = TIMEOUTS["resume"]  # each; the stage's own timeout bounds the three together
    straight = _cli(["run", "qwen3-moe-tiny", *words, "--set", f"run_dir={work / 'straight'}"], work, limit)
    first = _cli(["run", "qwen3-moe-tiny", *words, "--set", f"run_dir={work / 'resumed'}",
                  "--set", "train.exit_at_step=2"], work, limit)
    second = _cli(["run", "qwen3-moe-tiny", *words, "--set", f"run_dir={work / 'resumed'}"], work, limit)
    out["exit_codes"] = [straight.returncode, first.returncode, second.returncode]
    if out["exit_codes"] != [0, 0, 0]:
        out["stderr_tail"] = (straight.stderr + first.stderr + second.stderr)[-2000:]
        return {**out, "passed": False}
    a = [r["loss"] for r in _train_records(work / "straight")]
    b = [r["loss"] for r in _train_records(work / "resumed")]
    out.update(straight=a, resumed=b, passed=a == b)
    return out


# ------------------------------------------------------------------------------------------------- driver


def run_stage(name: str, device: str, work: Path) -> dict:
    """One stage in this process (the child's side): its figures, or the error."""
    import torch

    torch.manual_seed(0)
    if device == "cpu":
        torch.set_num_threads(1)
    work.mkdir(parents=True, exist_ok=True)
    return globals()[f"stage_{name}"](device, work)


def _stage_entry(name: str, device: str, work: Path) -> dict:
    try:
        measured = run_stage(name, device, work)
        status = "skipped" if "skipped" in measured else "failed" if measured.get("passed") is False else "ok"
        return {"status": status, "figures": measured}
    except Exception as error:
        return {"status": "failed", "error": f"{type(error).__name__}: {error}"[:2000],
                "traceback": traceback.format_exc()[-4000:]}


def _stage_in_child(name: str, args: argparse.Namespace, work: Path, timeout: float) -> tuple[dict, str]:
    """The stage in a process session of its own, killed with everything it started when over `timeout`."""
    command = [sys.executable, str(Path(__file__).resolve()), "--out", str(args.out), "--device", args.device,
               "--stage", name, "--work", str(work)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the stage and whatever it started (moe-train run)
        stdout, stderr = process.communicate()
        return {"status": "timeout", "timeout_s": timeout}, stdout + stderr
    lines = [line for line in stdout.splitlines() if line.startswith("CHECK-RESULT ")]
    if not lines:
        return {"status": "crashed", "exit_code": process.returncode, "stderr_tail": stderr[-2000:]}, stdout + stderr
    return json.loads(lines[-1][len("CHECK-RESULT "):]), stdout + stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="Folder for figures.json and check.log.")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--only", default=",".join(STAGES), help="Comma-separated stages (default: all).")
    parser.add_argument("--in-process", action="store_true",
                        help="Run the stages in this process, without their timeouts (the quick CPU rehearsal).")
    parser.add_argument("--stage", help=argparse.SUPPRESS)  # the child: run one stage, print its JSON
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stage:
        print("CHECK-RESULT " + json.dumps(_stage_entry(args.stage, args.device, args.work), default=str), flush=True)
        return 0
    stages = [s for s in args.only.split(",") if s]
    unknown = [s for s in stages if s not in TIMEOUTS]
    if unknown:
        print(f"error: unknown stage(s) {', '.join(unknown)}; known: {', '.join(STAGES)}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    figures_path, log_path = args.out / "figures.json", args.out / "check.log"
    report: dict = {"device": args.device, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "stages": {}}
    work = Path(tempfile.mkdtemp(prefix="moe-train-check-"))
    scale = 1.0 if args.device == "cuda" else 3.0  # the CPU rehearsal runs on a shared machine
    for name in stages:
        start = time.monotonic()
        if args.in_process:
            entry, output = _stage_entry(name, args.device, work / name), ""
        else:
            entry, output = _stage_in_child(name, args, work / name, TIMEOUTS[name] * scale)
        entry["seconds"] = round(time.monotonic() - start, 2)
        report["stages"][name] = entry
        figures_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        with log_path.open("a") as log:
            log.write(f"===== {name}: {entry['status']} in {entry['seconds']} s\n{output[-20000:]}\n")
        print(f"{name}: {entry['status']} ({entry['seconds']} s)", flush=True)
    return 0 if all(e["status"] in ("ok", "skipped") for e in report["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
