"""Per-rank load: the rows each expert-parallel rank's experts received in a step, per MoE layer, and the
routing trace (`logging.routing_trace`) that keeps every step's tokens per expert for `experts place` and
`plan --routing`.

Under expert parallelism the most loaded rank sets the step: every rank waits for it at the combine's
all-to-all. Each rank counts what its own experts received (the dispatcher's rows per local expert, padding
included: what its GEMMs ran); the trainer sums those counts over the step's ranks by slot, so rank r's figure
is the rows its slots received over every replica of it (the edp ranks; etp ranks hold the same rows and are
counted once). Dropless, that is the experts' token counts summed by the placement.
"""

from __future__ import annotations

import json
from pathlib import Path

from moe_train.run_files import ROUTING_TRACE_FILE
from moe_train.train.metrics import _drop_records_after


def rank_figures(rows_per_slot: list[float], *, ep: int) -> dict:
    """{"rank_tokens": rows per ep rank, "rank_load_max_over_mean", "straggler_rank": the most loaded rank}."""
    local = len(rows_per_slot) // ep
    ranks = [round(sum(rows_per_slot[r * local : (r + 1) * local])) for r in range(ep)]
    mean = sum(ranks) / ep
    straggler = max(range(ep), key=lambda r: ranks[r])
    return {
        "rank_tokens": ranks,
        "rank_load_max_over_mean": ranks[straggler] / mean if mean else 0.0,
        "straggler_rank": straggler,
    }


class RoutingTrace:
    """routing.jsonl in the logging folder: one line per step,
    {"step", "ep", "experts": {layer: tokens per expert (global ids)}, "ranks": {layer: rows per ep rank}}.
    JSON lines of ints, readable without torch; a resumed run first forgets the steps it trains again."""

    def __init__(self, log_dir: Path, *, start_step: int, ep: int) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / ROUTING_TRACE_FILE
        _drop_records_after(self.path, start_step)
        self.ep = ep
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, step: int, moe: dict[str, dict], moe_ranks: dict[str, dict]) -> None:
        record = {
            "step": step,
            "ep": self.ep,
            "experts": {layer: figures["tokens"] for layer, figures in moe.items()},
            "ranks": {layer: figures["rank_tokens"] for layer, figures in moe_ranks.items()},
        }
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
