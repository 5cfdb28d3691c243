"""Hugging Face checkpoints to and from our DCP checkpoints (`moe-train convert`), on hf.import_hf/export_hf.

from-hf writes OUT/checkpoint/ (a model-only DCP checkpoint: fp32 weights and model.json, what
`checkpoint.init_from` loads) and OUT/recipe.yaml (the converted model section, init_from pointing at the
checkpoint, and a small train section to edit), so `moe-train run OUT/recipe.yaml` continues training the model.
to-hf reads any of our checkpoints (model-only or a training checkpoint; a checkpoints folder means its latest)
and writes config.json + model.safetensors that transformers loads.
"""

from __future__ import annotations

from pathlib import Path

from moe_train.checkpoint.hf import export_hf, import_hf
from moe_train.checkpoint.layout import MODEL_CONFIG, CheckpointError
from moe_train.checkpoint.resume import intact_checkpoint_at
from moe_train.checkpoint.state import load_model_weights, read_model_config, save_model_weights
from moe_train.config import ModelConfig, Recipe, TrainConfig, dump_recipe
from moe_train.config.schema import CheckpointConfig
from moe_train.models import build_model
from moe_train.models.init import materialize
from moe_train.run_files import RECIPE_FILE

CHECKPOINT_DIR = "checkpoint"


def from_hf(hf_dir: Path, out_dir: Path) -> tuple[Path, Path]:
    """Convert a transformers checkpoint folder; returns (the model-only checkpoint, the recipe file)."""
    model_cfg, state_dict = import_hf(hf_dir)
    # The trainer keeps fp32 master weights: store them so, whatever the file's dtype.
    state_dict = {k: v.float() if v.is_floating_point() else v for k, v in state_dict.items()}
    out_dir = out_dir.resolve()
    ckpt = out_dir / CHECKPOINT_DIR
    if ckpt.exists():
        raise CheckpointError(f"{ckpt}: already exists; choose another -o folder")
    save_model_weights(ckpt, state_dict, model_config=model_cfg.model_dump(mode="json"))
    recipe = Recipe(
        name=out_dir.name,
        model=model_cfg,
        train=TrainConfig(seq_length=min(2048, model_cfg.max_position_embeddings), global_batch_size=8, steps=100,
                          warmup_steps=10),
        checkpoint=CheckpointConfig(init_from=str(ckpt)),
    )
    header = (f"# Converted from {Path(hf_dir).resolve()} by moe-train convert from-hf. The model section and\n"
              "# checkpoint.init_from are the converted model; choose the train and data sections for your run.\n")
    recipe_path = out_dir / RECIPE_FILE
    recipe_path.write_text(header + dump_recipe(recipe), encoding="utf-8")
    return ckpt, recipe_path


def to_hf(ckpt: Path, out_dir: Path) -> Path:
    """Export the model of one of our checkpoints as a transformers folder; returns the checkpoint used.

    The checkpoint may come from any layout: DCP gathers every expert and tensor-parallel shard into the one
    full model built here. It is checked against its manifest first and read as a checkpoint from elsewhere
    (trust.RestrictedReader)."""
    ckpt = intact_checkpoint_at(ckpt, "CKPT")
    if not (ckpt / MODEL_CONFIG).is_file():
        raise CheckpointError(f"{ckpt}: has no {MODEL_CONFIG} (the model section), so its model is unknown")
    model_cfg = ModelConfig.model_validate(read_model_config(ckpt))
    model = build_model(model_cfg, device="meta")
    materialize(model, device="cpu")  # allocated, not initialised: the checkpoint fills every tensor
    load_model_weights(ckpt, model, own=False)
    export_hf(model_cfg, model.state_dict(), out_dir)
    return ckpt
