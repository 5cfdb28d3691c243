"""`moe-train data prepare`: tokenize .jsonl/.txt files into a Megatron-format indexed dataset (.bin + .idx)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from .common import fail

data_app = typer.Typer(help="Prepare training data (Megatron-format indexed datasets).", no_args_is_help=True)


@data_app.command("prepare")
def prepare(
    inputs: Annotated[
        list[str],
        typer.Argument(
            help="Inputs: .jsonl (one JSON document per line), .txt (one document per file), .parquet (one per "
            "row) or a folder written by datasets' save_to_disk (one per row).",
            metavar="INPUT",
            show_default=False,
        ),
    ],
    output: Annotated[
        str, typer.Option("--output", "-o", help="Output prefix: writes PREFIX.bin and PREFIX.idx.", show_default=False)
    ],
    tokenizer: Annotated[str, typer.Option(help="'byte' or the path of a tokenizer.json.")] = "byte",
    text_field: Annotated[str, typer.Option(
        "--text-field", "--text-column", help="The JSON field (.jsonl) or column (parquet, datasets) holding the text.")
    ] = "text",
    append_eod: Annotated[bool, typer.Option(help="End every document with the tokenizer's EOD token.")] = True,
) -> None:
    """Tokenize INPUT files into PREFIX.bin/.idx, readable by moe-train and Megatron-LM alike.

    Examples:

        moe-train data prepare corpus.jsonl -o data/corpus

        moe-train data prepare shard-*.jsonl -o data/web --tokenizer tokenizer.json --text-field content

        moe-train data prepare train-*.parquet hf-saved/train -o data/mix --text-column body

    Then in a recipe: data: {source: indexed, paths: \\[data/corpus], tokenizer: tokenizer.json}.
    """
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from moe_train.data import DataError
    from moe_train.data.prepare import check_inputs
    from moe_train.data.prepare import prepare as run_prepare

    try:
        total = check_inputs(inputs)
        columns = (TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
        console = Console(stderr=True)
        with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
            task = progress.add_task("prepare", total=total)
            summary = run_prepare(
                inputs,
                output,
                tokenizer=tokenizer,
                text_field=text_field,
                append_eod=append_eod,
                on_progress=lambda done: progress.update(task, completed=done),
            )
    except DataError as error:
        fail([str(error)])
    except OSError as error:  # e.g. an output folder that cannot be written
        fail([f"{error.filename or output}: {error.strerror or error}"])
    skipped = f", {summary.empty_documents} empty skipped" if summary.empty_documents else ""
    print(
        f"{output}.bin/.idx: {summary.documents} documents{skipped}, {summary.tokens} tokens "
        f"in {summary.seconds:.2f} s ({summary.tokens_per_s / 1e6:.2f}M tokens/s)",
        file=sys.stdout,
    )
