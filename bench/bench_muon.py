"""AdamW against Muon on qwen3-moe-tiny: the same tokens, each optimizer at a small sweep of learning rates, the
final losses and the step-time cost of the optimizer side by side, and one PNG of the loss curves.

Every variant is a Trainer of the same recipe and seed (the same initial weights and the same batches in the
same order), differing only in `train.optimizer` and `train.lr` (min_lr a tenth of it); they are stepped
interleaved, one step of each in turn, so load from other processes hits each alike. Muon runs with
`train.muon.adjust_lr` (its default: the update scaled to AdamW's RMS), so the same learning rates are swept
for both. Reported per variant: the loss at the end (mean of the last `--tail` steps, which smooths the batch to
batch noise), the median step time and the median time of the optimizer's own step (timed by optimizer step
hooks), and for each optimizer's best learning rate the ratio Muon / AdamW of both times.

    PYTHONPATH=. python bench/bench_muon.py OUT_DIR [--steps 100] [--lr 1e-3 --lr 3e-3 ...]
        [--set k=v ...] [--threads N]

OUT_DIR receives bench_muon.png (the curves: each variant's train loss, the best learning rate of each
optimizer drawn bold) and bench_muon.json (the figures printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when torch loads OpenMP: before the import below

import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from moe_train.config import load_recipe  # noqa: E402
from moe_train.train.loop import Trainer  # noqa: E402

RECIPE = "qwen3-moe-tiny"
OPTIMIZERS = ("adamw", "muon")
WARMUP_STEPS = 2  # left out of the timings (first-touch allocation, lazily built state)
LINE_STYLES = (":", "--", "-.", "-", (0, (5, 1, 1, 1)))  # one per learning rate of the sweep


class OptimizerClock:
    """Seconds of each optimizer step of one trainer (all its chunks' optimizers), by step pre/post hooks."""

    def __init__(self, trainer: Trainer) -> None:
        self.seconds: list[float] = []
        self._started = 0.0
        for optimizer in trainer.optimizers:
            optimizer.register_step_pre_hook(self._start)
            optimizer.register_step_post_hook(self._stop)

    def _start(self, optimizer, args, kwargs) -> None:
        self._started = time.perf_counter()

    def _stop(self, optimizer, args, kwargs) -> None:
        self.seconds.append(time.perf_counter() - self._started)


def run(out_dir: Path, *, steps: int, lrs: list[float], overrides: list[str], tail: int) -> dict:
    """Train every (optimizer, lr) variant interleaved; the figures as a dict (also written as JSON)."""
    variants = [(optimizer, lr) for optimizer in OPTIMIZERS for lr in lrs]
    trainers, clocks = {}, {}
    losses: dict[tuple, list[float]] = {v: [] for v in variants}
    step_s: dict[tuple, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for index, (optimizer, lr) in enumerate(variants):
            recipe = load_recipe(RECIPE, [*overrides, f"train.steps={steps}", f"train.optimizer={optimizer}",
                                          f"train.lr={lr}", f"train.min_lr={lr / 10}", "train.eval_interval=null",
                                          "checkpoint.interval=null", f"run_dir={tmp}/{index}"])
            trainers[optimizer, lr] = Trainer(recipe)
            clocks[optimizer, lr] = OptimizerClock(trainers[optimizer, lr])
        for step in range(1, steps + 1):
            for variant, trainer in trainers.items():
                started = time.perf_counter()
                losses[variant].append(trainer.train_step(step).loss)
                step_s[variant].append(time.perf_counter() - started)
        tokens = next(iter(trainers.values())).tokens_per_step
    rows = []
    for optimizer, lr in variants:
        rows.append({"optimizer": optimizer, "lr": lr,
                     "final_loss": statistics.fmean(losses[optimizer, lr][-tail:]),
                     "step_s": statistics.median(step_s[optimizer, lr][WARMUP_STEPS:]),
                     "optimizer_s": statistics.median(clocks[optimizer, lr].seconds[WARMUP_STEPS:]),
                     "losses": losses[optimizer, lr]})
    best = {optimizer: min((r for r in rows if r["optimizer"] == optimizer), key=lambda r: r["final_loss"])
            for optimizer in OPTIMIZERS}
    figures = {"recipe": RECIPE, "overrides": overrides, "steps": steps, "tokens_per_step": tokens,
               "threads": torch.get_num_threads(), "load_average": os.getloadavg()[0], "variants": rows,
               "best_lr": {o: best[o]["lr"] for o in OPTIMIZERS},
               "muon_over_adamw": {"final_loss": best["muon"]["final_loss"] - best["adamw"]["final_loss"],
                                   "step_time": best["muon"]["step_s"] / best["adamw"]["step_s"],
                                   "optimizer_time": best["muon"]["optimizer_s"] / best["adamw"]["optimizer_s"]}}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_muon.json").write_text(json.dumps(figures, indent=1) + "\n")
    _curves(rows, best, tokens).savefig(out_dir / "bench_muon.png", dpi=110)
    return figures


def _curves(rows: list[dict], best: dict[str, dict], tokens: int) -> Figure:
    """Train loss against tokens trained on, every variant (a line style per learning rate); each optimizer's
    best learning rate bold."""
    figure = Figure(figsize=(8, 4.8), layout="constrained")
    axes = figure.add_subplot()
    styles = {lr: LINE_STYLES[index % len(LINE_STYLES)] for index, lr in enumerate(sorted({r["lr"] for r in rows}))}
    for row in rows:
        color = "C0" if row["optimizer"] == "adamw" else "C3"
        bold = row is best[row["optimizer"]]
        seen = [tokens * (step + 1) for step in range(len(row["losses"]))]
        axes.plot(seen, row["losses"], color=color, linestyle=styles[row["lr"]], linewidth=2.0 if bold else 0.9,
                  alpha=1.0 if bold else 0.6,
                  label=f"{row['optimizer']} lr {row['lr']:g}" + (" (best)" if bold else ""))
    axes.set_xlabel("tokens")
    axes.set_ylabel("train loss")
    axes.set_title(f"{RECIPE}: AdamW vs Muon, same tokens")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="Folder for bench_muon.png and bench_muon.json.")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", action="append", type=float, default=None,
                        help="A learning rate of the sweep, for both optimizers (repeatable; default 1e-3, 3e-3, "
                             "1e-2, 3e-2).")
    parser.add_argument("--set", action="append", default=[], help="Recipe override for every variant (repeatable).")
    parser.add_argument("--tail", type=int, default=10, help="Final loss: the mean over this many last steps.")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice).")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    figures = run(args.out_dir, steps=args.steps, lrs=args.lr or [1e-3, 3e-3, 1e-2, 3e-2], overrides=args.set,
                  tail=args.tail)
    print(f"{RECIPE}: {figures['steps']} steps of {figures['tokens_per_step']:,} tokens, the same for every "
          f"variant; {figures['threads']} threads, load average {figures['load_average']:.1f}")
    print(f"  {'optimizer':<9} {'lr':>8} {'final loss':>11} {'step ms':>9} {'optimizer ms':>13}")
    for row in figures["variants"]:
        mark = " best" if figures["best_lr"][row["optimizer"]] == row["lr"] else ""
        print(f"  {row['optimizer']:<9} {row['lr']:>8g} {row['final_loss']:>11.4f} {row['step_s'] * 1e3:>9.1f} "
              f"{row['optimizer_s'] * 1e3:>13.1f}{mark}")
    ratio = figures["muon_over_adamw"]
    print(f"  Muon - AdamW at each one's best lr: final loss {ratio['final_loss']:+.4f}; Muon / AdamW: step time "
          f"x{ratio['step_time']:.2f}, optimizer step x{ratio['optimizer_time']:.2f}")
    print(f"  wrote {args.out_dir / 'bench_muon.png'} and {args.out_dir / 'bench_muon.json'}")


if __name__ == "__main__":
    main()
