"""What the engine cannot train yet: one table, shrunk by each engine issue.

`validate`, `render` and `plan` accept every schema field; `run`, `submit` and the entry refuse a recipe that
uses a feature listed here, with exit code 2, rather than accepting and silently ignoring it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .schema import Recipe


@dataclass(frozen=True)
class Unsupported:
    field: str
    applies: Callable[[Recipe], bool]
    what: str


NOT_SUPPORTED_YET: tuple[Unsupported, ...] = (
    Unsupported(
        "model.moe.router.load_balancing",
        lambda r: r.parallel.tp > 1 and r.model.moe is not None
        and r.model.moe.router.load_balancing == "all_layers_aux_loss",
        "all_layers_aux_loss with tensor parallelism (tp > 1)",
    ),
    # Its loss is over every layer's rows of the micro-batch, of which a cp rank holds only its shards.
    Unsupported(
        "model.moe.router.load_balancing",
        lambda r: r.parallel.cp > 1 and r.model.moe is not None
        and r.model.moe.router.load_balancing == "all_layers_aux_loss",
        "all_layers_aux_loss with context parallelism (cp > 1)",
    ),
    # torch's zero-bubble weight pass differentiates the parameters a stage holds, which under FSDP2 (used at
    # every world size) are the sharded ones, not the gathered ones its forward used: their gradients stay empty.
    Unsupported("parallel.pp_schedule", lambda r: r.parallel.pp > 1 and r.parallel.pp_schedule == "zero_bubble",
                "the zero_bubble schedule with FSDP2 (use 1f1b, interleaved_1f1b or gpipe)"),
    Unsupported("parallel.cp", lambda r: r.parallel.cp > 1 and r.parallel.dp_replicate > 1,
                "context parallelism with HSDP (cp > 1 and dp_replicate > 1)"),
)


def unsupported(recipe: Recipe) -> list[str]:
    """One line per feature this recipe uses that the engine cannot train yet."""
    return [f"{row.field}: {row.what} is not supported yet" for row in NOT_SUPPORTED_YET if row.applies(recipe)]
