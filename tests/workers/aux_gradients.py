"""Worker: one training step of each case with the language-model (and MTP) loss multiplied by zero, so the
step's gradients are those of the balancing losses alone (aux_loss, seq_aux_loss, global_aux_loss, z-loss), after
every reduction the layout makes (FSDP2 over dp and edp, tp's replicated-gradient sums); rank 0 saves each
case's record (tests/test_aux_loss_gradients.py compares them with the single process)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.common import finish, start  # noqa: E402


class ZeroedLanguageModelLoss:
    """The model's language-model loss times 0: the forward and its collectives run as in training and backward
    sends exact zeros from the head, so only the gradients the MoE layers attach reach the parameters."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def head_sum(self, head, hidden, targets):
        return self.inner.head_sum(head, hidden, targets) * 0

    def head_mean(self, head, hidden, targets):
        return self.inner.head_mean(head, hidden, targets) * 0

    def full_logits(self, logits):
        return self.inner.full_logits(logits)


def zero_language_model_loss(trainer) -> None:
    """A `prepare` for record_run: the trainer's model then optimises its balancing losses only."""
    for part in trainer.chunks:
        part.lm_loss = ZeroedLanguageModelLoss(part.lm_loss)


def main() -> None:
    spec, result_path, rank, world = start()
    from workers.record import keep_record, record_run

    saved = {}
    Path(spec["run_root"]).mkdir(parents=True, exist_ok=True)
    for case in spec["cases"]:
        record = record_run(case["recipe"], case["overrides"], world=world, run_dir=Path(spec["run_root"]) / case["id"],
                            steps=1, prepare=zero_language_model_loss)
        keep_record(record, run_root=Path(spec["run_root"]), case_id=case["id"], rank=rank, saved=saved)
    finish(saved, result_path, rank)


if __name__ == "__main__":
    main()
