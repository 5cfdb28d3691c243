"""`moe-train convert from-hf | to-hf`: Hugging Face checkpoints to our DCP checkpoints and back."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import fail

convert_app = typer.Typer(help="Convert checkpoints between Hugging Face (transformers) and moe-train (DCP).",
                          no_args_is_help=True)


@convert_app.command("from-hf")
def from_hf(
    hf_dir: Annotated[Path, typer.Argument(help="A transformers checkpoint folder: config.json + *.safetensors.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder: gets checkpoint/ and recipe.yaml.")],
) -> None:
    """Write a model-only DCP checkpoint (for checkpoint.init_from) and a recipe with the converted model.

    Example:

        moe-train convert from-hf ~/hf/Qwen3-0.6B -o runs/qwen3-0.6b && moe-train run runs/qwen3-0.6b/recipe.yaml
    """
    from moe_train.checkpoint.convert import from_hf as convert
    from moe_train.checkpoint.hf import HFConversionError
    from moe_train.checkpoint.layout import CheckpointError

    try:
        ckpt, recipe = convert(hf_dir, out)
    except (HFConversionError, CheckpointError) as error:
        fail([str(error)])
    print(f"checkpoint {ckpt}\nrecipe {recipe}")


@convert_app.command("to-hf")
def to_hf(
    ckpt: Annotated[
        Path, typer.Argument(help="A checkpoint folder (step-NNNNNNN, or from-hf's checkpoint/) or a checkpoints "
                                  "folder, meaning its latest.")
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder for config.json + model.safetensors.")],
) -> None:
    """Export the model of a moe-train checkpoint as a folder transformers.AutoModelForCausalLM loads.

    Example:

        moe-train convert to-hf runs/qwen3-moe-tiny/checkpoints -o hf/qwen3-moe-tiny
    """
    from moe_train.checkpoint.convert import to_hf as convert
    from moe_train.checkpoint.hf import HFConversionError
    from moe_train.checkpoint.layout import CheckpointError

    try:
        used = convert(ckpt, out)
    except (HFConversionError, CheckpointError) as error:
        fail([str(error)])
    print(f"exported {used} to {out}")
