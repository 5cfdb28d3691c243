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
    Unsupported("parallel.tp", lambda r: r.parallel.tp > 1, "tensor parallelism (tp > 1)"),
    Unsupported("parallel.sequence_parallel", lambda r: r.parallel.sequence_parallel, "sequence parallelism"),
    Unsupported("parallel.pp", lambda r: r.parallel.pp > 1, "pipeline parallelism (pp > 1)"),
    Unsupported("parallel.cp", lambda r: r.parallel.cp > 1, "context parallelism (cp > 1)"),
    Unsupported(
        "parallel.recompute.granularity",
        lambda r: r.parallel.recompute.granularity != "none",
        "activation recomputation",
    ),
    Unsupported("train.precision", lambda r: r.train.precision == "fp8", "fp8 training"),
)


def unsupported(recipe: Recipe) -> list[str]:
    """One line per feature this recipe uses that the engine cannot train yet."""
    return [f"{row.field}: {row.what} is not supported yet" for row in NOT_SUPPORTED_YET if row.applies(recipe)]
