"""Weights & Biases logging beside metrics.jsonl and TensorBoard (`logging.wandb: {project, mode}`).

metrics.jsonl stays the record of a run; W&B mirrors the same train and eval figures under the same names as
TensorBoard (`train/loss`, `moe/0/load_cv`, `eval/loss`). The W&B folder lives in the run's logging folder
(`{logging.dir}/wandb`), so an offline run (the default: clusters' compute nodes often have no network) keeps
everything with the run and `wandb sync {logging.dir}/wandb/offline-run-*` uploads it later. The W&B run id is
derived from the logging folder, so a resumed or requeued run continues the same W&B run instead of starting a
new one. wandb is imported only when asked for; it must not take over the console (console capture off) or
sample the machine (system stats off: on a busy node they cost training time).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from moe_train.config.schema import WandbConfig

TRAIN_KEYS = ("loss", "lm_loss", "aux_loss", "grad_norm", "lr", "tokens", "tokens_per_s", "mfu", "skipped")
MOE_KEYS = ("load_max_over_mean", "load_cv", "dropped_fraction", "router_entropy")


def run_id(log_dir: Path) -> str:
    """The same id for every attempt of a run: a hash of its absolute logging folder."""
    return hashlib.sha256(str(log_dir.resolve()).encode()).hexdigest()[:16]


def train_scalars(record: dict[str, Any]) -> dict[str, float]:
    """A train line's scalars as W&B keys; a skipped step's nulls are left out (W&B has no null)."""
    scalars = {f"train/{key}": record[key] for key in TRAIN_KEYS if record.get(key) is not None}
    for layer, stats in (record.get("moe") or {}).items():
        scalars.update({f"moe/{layer}/{key}": stats[key] for key in MOE_KEYS if stats.get(key) is not None})
    return scalars


class WandbLog:
    """One W&B run for the logging rank's metrics."""

    def __init__(self, config: WandbConfig, log_dir: Path, *, run_config: dict[str, Any] | None = None) -> None:
        import wandb

        log_dir.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(console="off", x_disable_stats=True, silent=True, disable_git=True,
                                  disable_code=True, disable_job_creation=True)
        self._run = wandb.init(project=config.project, mode=config.mode, dir=str(log_dir), id=run_id(log_dir),
                               name=log_dir.resolve().name, resume="allow", config=run_config, settings=settings)

    @property
    def folder(self) -> Path | None:
        """This attempt's W&B folder (offline-run-... or run-...) under {log_dir}/wandb; None when disabled."""
        directory = getattr(self._run.settings, "sync_dir", None)
        return Path(directory) if directory else None

    def train(self, record: dict[str, Any]) -> None:
        self._run.log(train_scalars(record), step=record["step"])

    def eval(self, record: dict[str, Any]) -> None:
        self._run.log({"eval/loss": record["loss"]}, step=record["step"])

    def close(self) -> None:
        self._run.finish()
