"""Training metrics: metrics.jsonl (the contract), the console display and optional TensorBoard events and W&B.

metrics.jsonl is written by the one rank that holds the loss, one JSON object per line, flushed per line so a
killed run keeps everything it logged. The record's keys are built here and only here (`train_record`,
`eval_record`), so the file's schema has one definition. On a terminal the console shows a rich live progress
bar with the step, loss, tokens/s, MFU and the worst expert balance; otherwise (CI, SLURM logs) plain lines.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from moe_train.atomic import write_atomic
from moe_train.config.schema import WandbConfig
from moe_train.run_files import METRICS_FILE
from moe_train.train.wandb_log import WandbLog


def expert_balance(tokens_per_expert: torch.Tensor, dropped_fraction: float,
                   router_entropy: float | None = None) -> dict[str, Any]:
    """How unevenly one MoE layer's tokens spread over its experts: max/mean, the coefficient of variation, each
    expert's share of the assignments (`load`, for the report's heatmap) and count (`tokens`, the routing trace's
    figures) and the router's mean entropy.

    1.0 and 0.0 are perfect balance; max/mean is the slowdown of the busiest expert's rank under EP. Entropy is
    in nats, of each token's normalised scores: log(E) when a router cannot tell experts apart, 0 when certain.
    """
    load = tokens_per_expert.double()
    total = load.sum().item()
    mean = load.mean().item()
    figures: dict[str, Any] = {"load_max_over_mean": 0.0, "load_cv": 0.0, "dropped_fraction": dropped_fraction}
    if mean > 0:
        figures["load_max_over_mean"] = load.max().item() / mean
        figures["load_cv"] = load.std(unbiased=False).item() / mean
    figures["load"] = [round(v / total, 6) if total else 0.0 for v in load.tolist()]
    figures["tokens"] = [round(v) for v in load.tolist()]
    if router_entropy is not None:
        figures["router_entropy"] = router_entropy
    return figures


def train_record(
    *,
    step: int,
    loss: float,
    lm_loss: float,
    aux_loss: float,
    grad_norm: float,
    lr: float,
    tokens: int,
    tokens_per_s: float,
    tflops_per_device: float,
    mfu: float,
    memory_bytes: int,
    skipped: int,
    moe: dict[str, dict[str, float]] | None = None,
    moe_ranks: dict[str, dict] | None = None,
    mtp_loss: float | None = None,
    memory_reserved_bytes: int | None = None,
) -> dict[str, Any]:
    """One `kind: train` line. `tokens` is the cumulative count trained on; `skipped` the cumulative skips;
    `memory_reserved_bytes` (CUDA only) the allocator's peak reserved bytes of the logging interval. `moe` holds
    each MoE layer's layout-independent figures, `moe_ranks` its per-rank load under this launch's layout."""
    record: dict[str, Any] = {
        "kind": "train",
        "step": step,
        "loss": loss,
        "lm_loss": lm_loss,
        "aux_loss": aux_loss,
        "grad_norm": grad_norm,
        "lr": lr,
        "tokens": tokens,
        "tokens_per_s": tokens_per_s,
        "tflops_per_device": tflops_per_device,
        "mfu": mfu,
        "memory_bytes": memory_bytes,
        "skipped": skipped,
    }
    if memory_reserved_bytes is not None:
        record["memory_reserved_bytes"] = memory_reserved_bytes
    if mtp_loss is not None:
        record["mtp_loss"] = mtp_loss
    if moe is not None:
        record["moe"] = moe
    if moe_ranks is not None:
        record["moe_ranks"] = moe_ranks
    return record


def eval_record(*, step: int, loss: float) -> dict[str, Any]:
    """One `kind: eval` line: the language-model loss on the validation split."""
    return {"kind": "eval", "step": step, "loss": loss}


def _worst_balance(record: dict[str, Any]) -> float | None:
    layers = record.get("moe")
    return max(v["load_max_over_mean"] for v in layers.values()) if layers else None


def _summary_text(record: dict[str, Any]) -> str:
    loss = "non-finite" if record["loss"] is None else f"{record['loss']:.4f}"
    text = f"loss {loss}  lr {record['lr']:.2e}  {record['tokens_per_s']:,.0f} tok/s  MFU {record['mfu']:.1%}"
    worst = _worst_balance(record)
    if worst is not None:
        text += f"  load max/mean {worst:.2f}"
    if record["skipped"]:
        text += f"  skipped {record['skipped']}"
    return text


def _step_of(line: str) -> int | None:
    """The step of one metrics line; None for a line cut short by a killed writer."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None


def _drop_records_after(path: Path, step: int) -> None:
    """Forget what an earlier attempt logged past the step this run restarts from (atomically).

    A run killed after its last checkpoint logged steps that the resumed run trains again; keeping both would
    give two lines per step. After this, metrics.jsonl reads as one history of the run as it happened.
    """
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if (line_step := _step_of(line)) is not None and line_step <= step]
    if len(kept) != len(lines):
        write_atomic(path, "".join(kept))


class MetricsLogger:
    """Appends records to metrics.jsonl and shows them on the console (and TensorBoard when asked)."""

    def __init__(self, log_dir: Path, *, total_steps: int, start_step: int, tensorboard: bool,
                 wandb: WandbConfig | None = None, run_config: dict[str, Any] | None = None) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / METRICS_FILE
        _drop_records_after(self.path, start_step)
        self._file = self.path.open("a", encoding="utf-8")
        self._total = total_steps
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(log_dir))
        self._wandb = None if wandb is None else WandbLog(wandb, log_dir, run_config=run_config)
        self._live = None
        if sys.stdout.isatty():
            # Two lines, so a narrow terminal squeezes neither: the bar, then the latest figures.
            from rich.console import Group
            from rich.live import Live
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            from rich.text import Text

            self._progress = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(), TimeRemainingColumn())
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step)
            self._status = Text("")
            self._live = Live(Group(self._progress, self._status), refresh_per_second=4)
            self._live.start()

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def train(self, record: dict[str, Any]) -> None:
        self._write(record)
        step = record["step"]
        if self._tb is not None:
            for key in ("loss", "lm_loss", "aux_loss", "grad_norm", "lr", "tokens_per_s", "mfu"):
                if record[key] is not None:  # a skipped step's non-finite figures
                    self._tb.add_scalar(f"train/{key}", record[key], step)
            for layer, stats in (record.get("moe") or {}).items():
                for key in ("load_max_over_mean", "load_cv", "dropped_fraction", "router_entropy"):
                    if key in stats:
                        self._tb.add_scalar(f"moe/{layer}/{key}", stats[key], step)
        if self._wandb is not None:
            self._wandb.train(record)
        if self._live is not None:
            self._progress.update(self._task, completed=step)
            self._status.plain = _summary_text(record)
        else:
            print(f"step {step}/{self._total}  {_summary_text(record)}", flush=True)

    def eval(self, record: dict[str, Any]) -> None:
        self._write(record)
        if self._tb is not None:
            self._tb.add_scalar("eval/loss", record["loss"], record["step"])
        if self._wandb is not None:
            self._wandb.eval(record)
        self.message(f"eval step {record['step']}  loss {record['loss']:.4f}")

    def message(self, text: str) -> None:
        """A line for the human watching (checkpoint saved, resumed from...), above the live display."""
        if self._live is not None:
            self._live.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()
        self._file.close()
