"""The GPU path's checks on one GPU (issue 21), in stages, each in its own process under its own timeout.

    python bench/gpu/check.py --out DIR [--device cuda|cpu] [--only STAGE,...] [--deadline S] [--dry-run]

After every stage DIR/figures.json is rewritten with everything measured so far (a stage that hangs or crashes
loses nothing before it) and DIR/check.log gets the stage's output. One deadline holds the whole check
(`--deadline`, 480 s, inside check.sh's outer limit): each stage runs under min(its timeout, the time left), a
stage the deadline leaves no time for is recorded "not run", and a SIGTERM (the device machine's limit) kills
the running stage's process group and still writes figures.json. `--dry-run` builds every stage's command and
validates its recipes for cuda, running nothing (tests/test_gpu_check.py), so a renamed field cannot break the
GPU run unseen. Every stage but `compile` trains with `train.compile=false`, so eager figures are eager.
`--device cpu` is the rehearsal: the same stages on tiny shapes, run by tests/test_gpu_check.py, so the script
cannot fail on the GPU over a typo. Nothing here states an expected GPU figure: each stage measures and writes
what it saw.

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
# The headline stages first (probe; the proxy step and the same step in transformers, side by side), the rest
# after, compile (the longest, its inductor build never timed on a GPU) last. They add up to less than DEADLINE.
TIMEOUTS = {"probe": 30, "proxy": 75, "hf_proxy": 45, "grouped_mm": 25, "sdpa": 45, "fp8": 70, "tiny_run": 45,
            "resume": 45, "te": 10, "compile": 80}
STAGES = list(TIMEOUTS)
DEADLINE = 480.0  # seconds for the whole check.py; check.sh's outer `timeout` is 540


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
        from moe_train.config.hardware import hardware_table

        out["device_name"] = torch.cuda.get_device_name()
        out["capability"] = list(torch.cuda.get_device_capability())
        out["memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
        out["datasheet_bf16_tflops"] = hardware_table()["h200"].bf16_flops / 1e12
    out["matmul_ceiling"] = _matmul_ceiling(device)
    return out


def _matmul_ceiling(device: str) -> dict:
    """The chip's measured dense GEMM rate (bf16 8192^3 on CUDA; fp32 256^3 on the CPU rehearsal): MFU is read
    against it as well as against the data sheet."""
    import torch

    n, dtype = (8192, torch.bfloat16) if device == "cuda" else (256, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = _timed(lambda: a @ b, device, repeats=10)
    return {"shape": [n, n, n], "dtype": str(dtype), "seconds": seconds, "tflops": 2 * n**3 / seconds / 1e12}


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
    from torch.nn.attention.flex_attention import BlockMask

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
            # compiled FlexAttention's backward node is the compiled graph's, not an attention node: named here
            node = "flex_attention (BlockMask)" if isinstance(mask, BlockMask) else _attention_node(y)

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


def _fp8_sets(device: str, work: Path, recipe: str, backend: str = "torchao") -> list[str]:
    sets = ["train.precision=fp8", f"train.fp8.recipe={recipe}", f"train.fp8.backend={backend}",
            f"launch.device={device}", f"run_dir={work / f'fp8-{backend}-{recipe}'}", "train.steps=10",
            "checkpoint.interval=null", "logging.tensorboard=false", "train.compile=false"]  # eager: no compile time
    return sets + (["launch.gpu=h200"] if device == "cuda" else [
        "model.num_layers=1", "train.seq_length=32", "train.global_batch_size=2", "train.micro_batch_size=2"])


def _fp8_step(device: str, work: Path, recipe: str, backend: str = "torchao") -> dict:
    """Three trainer steps of qwen3-moe-tiny in fp8 (the first warms up): losses, step times, GEMMs by mode."""
    from moe_train.config import RecipeError, load_recipe
    from moe_train.models.fp8.gemm import count_fp8_gemms
    from moe_train.train.loop import Trainer

    try:
        trainer = Trainer(load_recipe("qwen3-moe-tiny", _fp8_sets(device, work, recipe, backend)))
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


def _words(sets: list[str]) -> list[str]:
    return [w for s in sets for w in ("--set", s)]


def _tiny_run_sets(device: str, run_dir: Path) -> list[str]:
    """Eager (train.compile=false: compiling would take most of the stage) and, on CUDA, bf16: the grouped GEMM
    and the bf16 attention kernels are what this stage is for (fp32 runs neither)."""
    steps = 50 if device == "cuda" else 4
    sets = [f"launch.device={device}", f"train.steps={steps}", f"run_dir={run_dir}", "checkpoint.interval=null",
            "logging.interval=1", "train.compile=false"]
    if device == "cuda":
        return sets + ["launch.gpu=h200", "train.precision=bf16"]
    return sets + ["model.num_layers=1", "train.seq_length=32", "train.global_batch_size=4",
                   "train.micro_batch_size=2"]


def _tiny_run_command(device: str, run_dir: Path) -> list[str]:
    return ["run", "qwen3-moe-tiny", *_words(_tiny_run_sets(device, run_dir))]


def stage_tiny_run(device: str, work: Path) -> dict:
    """`moe-train run` of the default recipe on this device (50 steps on CUDA): the loss falls."""
    run_dir = work / "tiny"
    result = _cli(_tiny_run_command(device, run_dir), work, TIMEOUTS["tiny_run"])
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
    return load_recipe(base, [*sets, f"run_dir={work / name}", "train.steps=100", "train.compile=false", *extra])


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


def _timed_steps(trainer, device: str, *, tokens_per_step: int, graphs=None) -> dict:
    """The trainer's own steps, timed (the first warms caches and kernels, and compiles: left out of the rates).
    `graphs`: the compiled graphs made so far, counted after step 1 and after the last step (a graph made after
    step 1 is a recompilation)."""
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
        if step == 1 and graphs is not None:
            after_first = graphs()
    timed = seconds[1:]
    tokens_per_s = tokens_per_step * len(timed) / sum(timed)
    tflops = trainer.flops_per_token * tokens_per_s / 1e12
    out = {"step_seconds": seconds, "losses": losses, "tokens_per_s": tokens_per_s, "tflops_per_device": tflops,
           "mfu": tflops * 1e12 / trainer.peak}
    if graphs is not None:
        out["graphs_first_step"], out["graphs_after_first_step"] = after_first, graphs() - after_first
    if device == "cuda":
        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    return out


def _compile_extra(device: str, mode: str) -> tuple[str, ...]:
    cut = ("model.num_layers=1",) if device == "cpu" else ()
    return (f"train.compile={str(mode == 'compiled').lower()}", *cut)


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
    import gc

    import torch

    figures = {}
    for mode in ("eager", "compiled"):
        recipe = _proxy_recipe(device, work, name=f"compile-{mode}", extra=_compile_extra(device, mode))
        trainer = Trainer(recipe)
        before = counters["stats"]["unique_graphs"]

        def made(before=before) -> int:
            return counters["stats"]["unique_graphs"] - before

        figures[mode] = _timed_steps(trainer, device, tokens_per_step=recipe.train.global_batch_size
                                     * recipe.train.seq_length, graphs=made)
        figures[mode]["graphs"] = made()
        del trainer  # the eager trainer's state must not sit under the compiled one's peak
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
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
    with torch.device(device):  # built on the device: 3B parameters drawn on the host take long
        model = Qwen3MoeForCausalLM(config).float()  # fp32 master weights, as moe-train keeps them
    # fp32 AdamW moments over the fp32 weights, as the proxy's (train.adam_moment_dtype fp32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    micro = recipe.train.global_batch_size // recipe.train.micro_batch_size
    tokens = torch.randint(recipe.model.vocab_size, (recipe.train.micro_batch_size, recipe.train.seq_length),
                           device=device)

    def step():
        for _ in range(micro):
            # bf16 compute over fp32 weights, as moe-train's mixed precision; transformers shifts the labels
            # itself, so labels are the inputs (shifting them here too would predict two tokens ahead)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = _timed(step, device, repeats=3)
    tokens_per_step = recipe.train.global_batch_size * recipe.train.seq_length
    out = {"transformers": transformers.__version__, "experts_implementation": config._experts_implementation,
           "step_seconds": seconds, "tokens_per_s": tokens_per_step / seconds,
           "master_weights": "fp32", "adam_moments": "fp32",
           "compute": "bf16 autocast" if device == "cuda" else "fp32"}
    if device == "cuda":
        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    return out


def _resume_commands(device: str, work: Path) -> list[list[str]]:
    """4 steps straight; 2 steps, stopped; the 2 more the resume runs. Eager and, on CUDA, bf16 (the kernels
    train.deterministic must make repeatable)."""
    sets = [f"launch.device={device}", "train.deterministic=true", "train.steps=4", "checkpoint.interval=2",
            "train.global_batch_size=4", "train.micro_batch_size=2", "logging.interval=1", "train.compile=false"]
    sets += ["launch.gpu=h200", "model.num_layers=2", "train.seq_length=128", "train.precision=bf16"] \
        if device == "cuda" else ["model.num_layers=1", "train.seq_length=32"]
    words = _words(sets)
    return [["run", "qwen3-moe-tiny", *words, "--set", f"run_dir={work / 'straight'}"],
            ["run", "qwen3-moe-tiny", *words, "--set", f"run_dir={work / 'resumed'}", "--set", "train.exit_at_step=2"],
            ["run", "qwen3-moe-tiny", *words, "--set", f"run_dir={work / 'resumed'}"]]


def stage_resume(device: str, work: Path) -> dict:
    """train.deterministic: 4 steps straight vs 2, a checkpoint, and 2 more in a new process: equal losses."""
    out = {}
    limit = TIMEOUTS["resume"]  # each; the stage's own timeout bounds the three together
    straight, first, second = (_cli(command, work, limit) for command in _resume_commands(device, work))
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


class Stopped(Exception):
    """SIGTERM reached check.py (the device machine's limit, or check.sh's outer timeout)."""


def _on_sigterm(signum, frame) -> None:
    raise Stopped


def _stage_command(name: str, device: str, out: Path, work: Path) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--out", str(out), "--device", device, "--stage", name,
            "--work", str(work)]


def _stage_in_child(name: str, args: argparse.Namespace, work: Path, timeout: float) -> tuple[dict, str]:
    """The stage in a process session of its own, killed with everything it started when over `timeout` or when
    check.py is stopped (SIGTERM: `Stopped` goes on up once the stage's processes are gone)."""
    process = subprocess.Popen(_stage_command(name, args.device, args.out, work), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except (subprocess.TimeoutExpired, Stopped) as stop:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the stage and whatever it started (moe-train run)
        stdout, stderr = process.communicate()
        if isinstance(stop, Stopped):
            raise
        return {"status": "timeout", "timeout_s": round(timeout, 1)}, stdout + stderr
    lines = [line for line in stdout.splitlines() if line.startswith("CHECK-RESULT ")]
    if not lines:
        return {"status": "crashed", "exit_code": process.returncode, "stderr_tail": stderr[-2000:]}, stdout + stderr
    return json.loads(lines[-1][len("CHECK-RESULT "):]), stdout + stderr


def _ratios(stages: dict) -> dict:
    """moe-train's proxy step against the same step in transformers, measured side by side in this run."""
    proxy, hf = stages.get("proxy", {}), stages.get("hf_proxy", {})
    if proxy.get("status") != "ok" or hf.get("status") != "ok":
        return {}
    ours, theirs = proxy["figures"]["eager"]["tokens_per_s"], hf["figures"]["tokens_per_s"]
    return {"proxy_tokens_per_s_vs_transformers": ours / theirs}


def dry_run(device: str, out: Path) -> dict:
    """Every stage's command line, and every recipe a stage would train, loaded and validated for `device`
    (launch.device included), without running anything. validate's refusal of mxfp8 below sm100 is what the
    fp8 stage records on an H200: expected, not an error."""
    from moe_train.config import RecipeError, load_recipe

    work = Path(tempfile.gettempdir()) / "moe-train-check-dry-run"
    recipes: dict[str, list[tuple[str, list[str]]]] = {
        "tiny_run": [("qwen3-moe-tiny", _tiny_run_sets(device, work / "tiny"))],
        "resume": [(c[1], [w for w in c[2:] if w != "--set"]) for c in _resume_commands(device, work)],
        "fp8": [("qwen3-moe-tiny", _fp8_sets(device, work, recipe)) for recipe in FP8_RECIPES],
        "te": [("qwen3-moe-tiny", _fp8_sets(device, work, "tensorwise", backend="te"))],
    }
    report: dict = {"device": device, "stages": {}}
    for name in STAGES:
        entry: dict = {"command": _stage_command(name, device, out, work / name), "timeout_s": TIMEOUTS[name],
                       "recipes": []}
        if name == "tiny_run":
            entry["cli"] = _tiny_run_command(device, work / "tiny")
        if name == "resume":
            entry["cli"] = _resume_commands(device, work)
        problems = []
        try:
            if name in ("proxy", "hf_proxy", "compile"):
                extras = [_compile_extra(device, mode) for mode in ("eager", "compiled")] if name == "compile" else [()]
                for extra in extras:
                    _proxy_recipe(device, work, name, extra)
                    entry["recipes"].append({"base": "proxy", "extra": list(extra), "valid": True})
            for base, sets in recipes.get(name, []):
                try:
                    load_recipe(base, sets)
                    entry["recipes"].append({"base": base, "sets": sets, "valid": True})
                except RecipeError as error:
                    refused = str(error)
                    expected = ("train.fp8.recipe=mxfp8" in sets and "mxfp8" in refused) or \
                        ("train.fp8.backend=te" in sets and "transformer-engine" in refused)
                    entry["recipes"].append({"base": base, "sets": sets, "valid": False, "refused": refused[:500],
                                             "expected": expected})
                    if not expected:
                        problems.append(refused[:500])
        except Exception as error:  # a stage whose recipe cannot even be built: the finding
            problems.append(f"{type(error).__name__}: {error}"[:500])
        entry["problems"] = problems
        report["stages"][name] = entry
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="Folder for figures.json and check.log.")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--only", default=",".join(STAGES), help="Comma-separated stages (default: all).")
    parser.add_argument("--deadline", type=float, default=None,
                        help=f"Seconds for the whole check (default {DEADLINE:.0f} on cuda, 3x on the CPU).")
    parser.add_argument("--in-process", action="store_true",
                        help="Run the stages in this process, without their timeouts (the quick CPU rehearsal).")
    parser.add_argument("--dry-run", action="store_true",
                        help="Build every stage's command and validate its recipes for --device; run nothing.")
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
    if args.dry_run:
        report = dry_run(args.device, args.out)
        (args.out / "dry_run.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        bad = {name: entry["problems"] for name, entry in report["stages"].items() if entry["problems"]}
        for name, entry in report["stages"].items():
            verdict = "problems: " + "; ".join(entry["problems"]) if entry["problems"] else "ok"
            print(f"{name}: {len(entry['recipes'])} recipe(s) validated, {verdict}")
        return 1 if bad else 0
    figures_path, log_path = args.out / "figures.json", args.out / "check.log"
    report: dict = {"device": args.device, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "stages": {name: {"status": "not run"} for name in stages}}
    work = Path(tempfile.mkdtemp(prefix="moe-train-check-"))
    scale = 1.0 if args.device == "cuda" else 3.0  # the CPU rehearsal runs on a shared machine
    deadline = time.monotonic() + (args.deadline if args.deadline is not None else DEADLINE * scale)
    signal.signal(signal.SIGTERM, _on_sigterm)

    def write() -> None:
        report["ratios"] = _ratios(report["stages"])
        figures_path.write_text(json.dumps(report, indent=2, default=str) + "\n")

    try:
        for name in stages:
            left = deadline - time.monotonic()
            if left < 1:
                report["stages"][name] = {"status": "not run", "why": "the check's deadline passed before it"}
                continue
            start = time.monotonic()
            print(f"{name}: started", flush=True)  # a supervisor may wait for a stage to be under way
            if args.in_process:
                entry, output = _stage_entry(name, args.device, work / name), ""
            else:
                entry, output = _stage_in_child(name, args, work / name, min(TIMEOUTS[name] * scale, left))
            entry["seconds"] = round(time.monotonic() - start, 2)
            report["stages"][name] = entry
            write()
            with log_path.open("a") as log:
                log.write(f"===== {name}: {entry['status']} in {entry['seconds']} s\n{output[-20000:]}\n")
            print(f"{name}: {entry['status']} ({entry['seconds']} s)", flush=True)
    except Stopped:
        running = next(name for name, entry in report["stages"].items() if entry["status"] == "not run")
        report["stages"][running] = {"status": "killed", "why": "SIGTERM while it ran (its process group killed)"}
        print(f"{running}: killed (SIGTERM)", flush=True)
    finally:
        write()
    for name, value in report["ratios"].items():
        print(f"{name}: {value:.3f}", flush=True)
    return 0 if all(e["status"] in ("ok", "skipped") for e in report["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
