"""The report's text: each run's figures computed once (`RunSummary`), then printed as lines or a sweep table.

Speed is time-weighted, as in the trainer's own end-of-run summary: the logged steps' tokens over their seconds
(the harmonic mean of their tokens/s, every step training the same number of tokens), with the first step left
out when there are more (it pays for warm-up and allocation); a plain mean of rates would overweight fast steps.
MFU is proportional to tokens/s, so it is averaged the same way. Balance is the worst MoE layer's
max/mean load: the busiest expert's rank sets the pace under expert parallelism, so the worst layer is what a
reader needs to know at the start and at the end, to see whether balancing brought it down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .history import RunHistory


@dataclass(frozen=True)
class StepValue:
    step: int
    value: float


@dataclass(frozen=True)
class LayerBalance:
    step: int
    layer: str
    load_max_over_mean: float


@dataclass(frozen=True)
class RunSummary:
    name: str
    complete: bool
    last_step: int
    logged_steps: int
    skipped: int
    tokens: int
    first_loss: StepValue | None
    final_loss: StepValue | None
    best_loss: StepValue | None
    final_eval: StepValue | None
    best_eval: StepValue | None
    tokens_per_s: float | None
    mfu: float | None
    balance_start: LayerBalance | None
    balance_end: LayerBalance | None
    dropped_mean: float | None
    dropped_end: float | None
    unreadable: int


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _losses(records: list[dict]) -> list[StepValue]:
    return [StepValue(r["step"], r["loss"]) for r in records if _finite(r.get("loss"))]


def _best(values: list[StepValue]) -> StepValue | None:
    return min(values, key=lambda v: v.value) if values else None


def _time_weighted(records: list[dict], key: str) -> float | None:
    """The harmonic mean of a rate over the logged steps after the first (all of them when there is one)."""
    kept = records[1:] if len(records) > 1 else records
    values = [r[key] for r in kept if _finite(r.get(key)) and r[key] > 0]
    return len(values) / sum(1 / v for v in values) if values else None


def _balances(record: dict) -> dict[str, float]:
    """Each MoE layer's finite max/mean load in one record (a skipped step may log nulls)."""
    return {layer: stats["load_max_over_mean"] for layer, stats in (record.get("moe") or {}).items()
            if _finite(stats.get("load_max_over_mean"))}


def _dropped(record: dict) -> list[float]:
    """Each MoE layer's finite dropped share in one record."""
    return [s["dropped_fraction"] for s in (record.get("moe") or {}).values() if _finite(s.get("dropped_fraction"))]


def _worst_layer(record: dict) -> LayerBalance:
    layer, value = max(_balances(record).items(), key=lambda item: item[1])
    return LayerBalance(record["step"], layer, value)


def summarize(history: RunHistory) -> RunSummary:
    """Every figure the text shows, from the records alone."""
    train, last = history.train, history.train[-1]
    losses, evals = _losses(train), _losses(history.evals)
    moe = [r for r in train if _balances(r)]
    dropped = [share for r in moe for share in _dropped(r)]
    dropped_end = _dropped(moe[-1]) if moe else []
    return RunSummary(
        name=history.name,
        complete=history.complete,
        last_step=last["step"],
        logged_steps=len(train),
        skipped=last.get("skipped") or 0,
        tokens=last.get("tokens") or 0,
        first_loss=losses[0] if losses else None,
        final_loss=losses[-1] if losses else None,
        best_loss=_best(losses),
        final_eval=evals[-1] if evals else None,
        best_eval=_best(evals),
        tokens_per_s=_time_weighted(train, "tokens_per_s"),
        mfu=_time_weighted(train, "mfu"),
        balance_start=_worst_layer(moe[0]) if moe else None,
        balance_end=_worst_layer(moe[-1]) if moe else None,
        dropped_mean=sum(dropped) / len(dropped) if dropped else None,
        dropped_end=max(dropped_end) if dropped_end else None,
        unreadable=history.unreadable,
    )


def _loss(value: StepValue | None) -> str:
    return "-" if value is None else f"{value.value:.4f}"


def _at(value: StepValue | None) -> str:
    return "-" if value is None else f"{value.value:.4f} at step {value.step}"


def _balance(value: LayerBalance | None) -> str:
    return f"{value.load_max_over_mean:.2f} (layer {value.layer}) at step {value.step}"


def _speed(summary: RunSummary) -> str:
    tokens = "-" if summary.tokens_per_s is None else f"{summary.tokens_per_s:,.0f}"
    mfu = "-" if summary.mfu is None else f"{summary.mfu:.2%}"
    return f"{tokens} tokens/s, MFU {mfu}"


def describe(summary: RunSummary) -> list[str]:
    """A single run's summary, one figure per line."""
    state = "complete" if summary.complete else "not complete (still running, or stopped)"
    lines = [
        f"run {summary.name}: {state}",
        f"steps: {summary.last_step} ({summary.logged_steps} logged, {summary.skipped} skipped), "
        f"{summary.tokens:,} tokens",
        f"loss: {_loss(summary.first_loss)} -> {_loss(summary.final_loss)} (best {_at(summary.best_loss)})",
    ]
    if summary.final_eval is not None:
        lines.append(f"eval loss: {_at(summary.final_eval)} (best {_at(summary.best_eval)})")
    lines.append(f"speed: {_speed(summary)} (time-weighted over logged steps, the first left out)")
    if summary.balance_start is None:
        lines.append("expert balance: no MoE layers logged")
    else:
        lines.append(f"expert balance (worst layer's max/mean load): {_balance(summary.balance_start)} -> "
                     f"{_balance(summary.balance_end)}")
        if summary.dropped_mean is not None and summary.dropped_end is not None:
            lines.append(f"dropped: {summary.dropped_mean:.2%} of expert assignments on average, "
                         f"{summary.dropped_end:.2%} at step {summary.balance_end.step} (worst layer)")
    if summary.unreadable:
        lines.append(f"warning: {summary.unreadable} unreadable line(s) in metrics.jsonl skipped")
    return lines


def sweep_table(summaries: list[RunSummary]) -> list[str]:
    """One aligned row per sweep point, so points compare at a glance."""
    rows = [("point", "step", "loss", "best", "eval", "tokens/s", "MFU", "max/mean start->end", "dropped")]
    for s in summaries:
        balance = "-" if s.balance_start is None else \
            f"{s.balance_start.load_max_over_mean:.2f} -> {s.balance_end.load_max_over_mean:.2f}"
        rows.append((
            s.name + ("" if s.complete else " *"),
            str(s.last_step),
            _loss(s.final_loss),
            _loss(s.best_loss),
            _loss(s.final_eval),
            "-" if s.tokens_per_s is None else f"{s.tokens_per_s:,.0f}",
            "-" if s.mfu is None else f"{s.mfu:.2%}",
            balance,
            "-" if s.dropped_mean is None else f"{s.dropped_mean:.2%}",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    if any(not s.complete for s in summaries):
        lines.append("* not complete (still running, or stopped)")
    lines += [f"warning: {s.name}: {s.unreadable} unreadable line(s) in metrics.jsonl skipped"
              for s in summaries if s.unreadable]
    return lines
