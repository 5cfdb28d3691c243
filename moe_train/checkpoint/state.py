"""What a checkpoint holds and how it goes through torch.distributed.checkpoint (DCP).

A training checkpoint is one DCP state dict:
- `model.*`: the model's state dict (parameters and persistent buffers such as the MoE expert bias);
- `optim.state.*`: AdamW's per-parameter moments and step counts, keyed by parameter name
  (`get_state_dict`), so they reshard with the model. Hyperparameters (`param_groups`) are not stored: they
  come from the recipe, and the learning rate is a function of the step;
- `progress.*`: the step, consumed samples and skipped-step count as int64 tensors, and the recent losses the
  loss-spike check compares with (float64);
- `rng.rank{R}.cpu` (and `.cuda`): each rank's generator states, restored when the rank exists in the save.
Beside the tensors: `model.json` (the model section) and `manifest.json` (every file's size and SHA-256,
written last: moe_train/checkpoint/manifest.py). Parameters are DTensors with their full shapes wherever they
are sharded (TP, EP, FSDP2), so DCP reshards on load: a checkpoint saved under one layout loads under any other.
Expert stacks are kept by global expert id whatever `model.moe.placement` (expert_order.py).

Loading is not free of pickle: DCP keeps its index, `.metadata`, as a pickle (tensors are read with
`torch.load(weights_only=True)`; our state holds no pickled byte items). Checkpoints are therefore trusted input:
the manifest is checked before anything is read (by the start-point choice, before these functions run), and a
checkpoint this run did not write itself is read through trust.RestrictedReader (`own=False`).
DCP works with or without a process group; with one, every rank calls these functions together.
A model-only checkpoint (`convert from-hf`, `init_from`) is the same format with only `model.*`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from moe_train.checkpoint import collective
from moe_train.checkpoint.expert_order import ExpertOrderLoadPlanner, ExpertOrderSavePlanner
from moe_train.checkpoint.layout import MODEL_CONFIG, CheckpointError
from moe_train.checkpoint.trust import reader_for
from moe_train.models.moe.placement import placed_stacks


@dataclass(frozen=True, kw_only=True)
class Progress:
    """Where training stands: enough, with the model and optimizer, to continue bit for bit.
    `recent_losses`: the last applied steps' losses, oldest first (train/bad_steps.py's window)."""

    step: int = 0
    consumed_samples: int = 0
    skipped: int = 0
    recent_losses: tuple[float, ...] = ()


def placed_stacks_of(chunks: list[nn.Module]) -> dict[str, tuple[int, ...]]:
    """The placed expert stacks of every chunk (models/moe/placement.py), which checkpoints store by expert."""
    return {name: ids for chunk in chunks for name, ids in placed_stacks(chunk).items()}


def _dcp_save(state: dict, path: Path, stacks: dict[str, tuple[int, ...]] | None = None) -> None:
    """dcp.save, single-process when no process group exists (without DCP's warning about it); placed expert
    `stacks` are written by expert (expert_order.py)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(path), no_dist=not collective.distributed(),
                 planner=ExpertOrderSavePlanner(stacks) if stacks else None)


def _dcp_load(state: dict, path: Path, *, own: bool, stacks: dict[str, tuple[int, ...]] | None = None) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), storage_reader=reader_for(path, own=own),
                 no_dist=not collective.distributed(), planner=ExpertOrderLoadPlanner(stacks) if stacks else None)


def _rng_state() -> dict[str, torch.Tensor]:
    prefix = f"rank{collective.rank()}"
    state = {f"{prefix}.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[f"{prefix}.cuda"] = torch.cuda.get_rng_state()
    return state


def _progress_tensors(progress: Progress) -> dict[str, torch.Tensor]:
    return {
        "step": torch.tensor(progress.step, dtype=torch.int64),
        "consumed_samples": torch.tensor(progress.consumed_samples, dtype=torch.int64),
        "skipped": torch.tensor(progress.skipped, dtype=torch.int64),
        "recent_losses": torch.tensor(progress.recent_losses, dtype=torch.float64),
    }


def write_model_config(path: Path, model_config: dict | None) -> None:
    """Rank 0 creates `path` and writes model.json there; every rank returns once it exists."""
    if collective.rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        if model_config is not None:
            (path / MODEL_CONFIG).write_text(json.dumps(model_config, indent=1) + "\n", encoding="utf-8")
    collective.barrier()


def _write_files(path: Path, state: dict, model_config: dict | None,
                 stacks: dict[str, tuple[int, ...]] | None = None) -> None:
    """model.json (rank 0), the DCP state, then the manifest of them all; every rank calls this together."""
    write_model_config(path, model_config)
    _dcp_save(state, path, stacks)
    collective.barrier()
    collective.write_manifest(path)


def read_model_config(path: Path) -> dict:
    return json.loads((path / MODEL_CONFIG).read_text(encoding="utf-8"))


def _chunk_states(
    chunks: list[nn.Module], optimizers: list[torch.optim.Optimizer], *, with_optim: bool
) -> list[tuple[dict[str, torch.Tensor], dict | None]]:
    """Each chunk's (model state dict, optimizer state dict, or None without optimizer state). With it,
    `get_state_dict` creates an optimizer's state when it has none, for a load to fill."""
    return [get_state_dict(chunk, optimizer) if with_optim else (get_model_state_dict(chunk), None)
            for chunk, optimizer in zip(chunks, optimizers, strict=True)]


def _merged(states: list[tuple[dict[str, torch.Tensor], dict | None]]) -> tuple[dict[str, torch.Tensor], dict]:
    """The chunks' model and optimizer state merged (the same tensors): keys are the whole model's names, so a
    checkpoint holds the same keys whatever the pipeline split (each stage writes its own). A key two chunks hold
    (a V's embedding and its copy, bit-equal) keeps one of the two tensors: `_fill_copies` after a load."""
    model_sd = {k: v for chunk_sd, _ in states for k, v in chunk_sd.items()}
    optim_state = {k: v for _, chunk_optim in states if chunk_optim is not None
                   for k, v in chunk_optim["state"].items()}
    return model_sd, optim_state


def _fill_copies(states: list[tuple[dict[str, torch.Tensor], dict | None]], model_sd: dict[str, torch.Tensor],
                 optim_state: dict) -> None:
    """After a load into the merged state: a key two chunks of this rank hold (the embedding and the last stage's
    copy, both on pipeline rank 0 in a V) was filled in one chunk's tensor only (the merged one); the other
    chunk's tensor takes the same values, so both copies resume bit-equal."""
    def fill(copy: object, loaded: object) -> None:
        if isinstance(copy, torch.Tensor) and copy is not loaded:
            local = copy.to_local() if hasattr(copy, "to_local") else copy  # both sharded alike (same shape, mesh)
            local.copy_(loaded.to_local() if hasattr(loaded, "to_local") else loaded)

    for chunk_sd, chunk_optim in states:
        for key, value in chunk_sd.items():
            fill(value, model_sd[key])
        for key, entries in (chunk_optim or {"state": {}})["state"].items():
            for name, value in entries.items():
                fill(value, optim_state[key][name])


def save_training_state(
    path: Path, *, chunks: list[nn.Module], optimizers: list[torch.optim.Optimizer], progress: Progress,
    model_config: dict | None = None,
) -> None:
    """Write model, optimizer, progress and RNG states of this rank's model chunks (each with its optimizer)
    into `path` (a fresh folder), with `model_config` as model.json when given, and the manifest.

    Optimizers that have never stepped (a stop before the first applied step; the chunks' optimizers step
    together) have no state, and none is written: `get_state_dict` would create it by taking a step of lr 0,
    whose step count changes the next real update's bias correction (the resumed run would differ from the
    uninterrupted one)."""
    _write_files(path, training_state(chunks=chunks, optimizers=optimizers, progress=progress),
                 model_config, placed_stacks_of(chunks))


def training_state(
    *, chunks: list[nn.Module], optimizers: list[torch.optim.Optimizer], progress: Progress
) -> dict:
    """The DCP state dict of a training checkpoint (the module docstring's keys); see save_training_state."""
    stepped = any(optimizer.state for optimizer in optimizers)
    model_sd, optim_state = _merged(_chunk_states(chunks, optimizers, with_optim=stepped))
    state = {"progress": _progress_tensors(progress), "rng": _rng_state(), "model": model_sd}
    if stepped:
        state["optim"] = {"state": optim_state}
    return state


def load_training_state(
    path: Path,
    *,
    chunks: list[nn.Module],
    optimizers: list[torch.optim.Optimizer],
    model_keys: Collection[str] | None = None,
    own: bool = False,
) -> Progress:
    """Restore what `save_training_state` wrote (under any layout) into freshly built model chunks and their
    optimizers. `model_keys`: the whole model's state-dict keys when the chunks are pipeline stages (checked
    against the checkpoint's), None when they hold the whole model. `own`: the checkpoint is one this run wrote
    (read with DCP's own reader; see trust.py)."""
    saved = _saved_tensors(path, own=own)
    stepped = any(key.startswith("optim.state.") for key in saved)  # see save_training_state
    states = _chunk_states(chunks, optimizers, with_optim=stepped)
    model_sd, optim_state = _merged(states)
    _check_model_matches(path, saved, model_sd, model_keys)
    if "progress.step" not in saved:
        raise CheckpointError(f"{path}: a model-only checkpoint cannot be resumed; use it as checkpoint.init_from")
    rng = {k: v for k, v in _rng_state().items() if f"rng.{k}" in saved}
    progress = _progress_tensors(Progress())
    recent = saved.get("progress.recent_losses")
    if recent is None:  # a checkpoint written before the loss-spike check existed
        del progress["recent_losses"]
    else:
        progress["recent_losses"] = torch.empty(tuple(recent.size), dtype=torch.float64)
    state = {"model": model_sd, "progress": progress, "rng": rng}
    if stepped:
        state["optim"] = {"state": optim_state}
    # fills the chunks' state dicts in place (merged above: the same tensors)
    _dcp_load(state, path, own=own, stacks=placed_stacks_of(chunks))
    _fill_copies(states, model_sd, optim_state)
    for chunk, optimizer, (chunk_sd, chunk_optim) in zip(chunks, optimizers, states, strict=True):
        if chunk_optim is None:
            set_model_state_dict(chunk, chunk_sd)
        else:
            set_state_dict(chunk, optimizer, model_state_dict=chunk_sd, optim_state_dict=chunk_optim)
    prefix = f"rank{collective.rank()}"
    if f"{prefix}.cpu" in rng:
        torch.set_rng_state(rng[f"{prefix}.cpu"])
    if f"{prefix}.cuda" in rng:
        torch.cuda.set_rng_state(rng[f"{prefix}.cuda"])
    p = state["progress"]
    return Progress(step=int(p["step"]), consumed_samples=int(p["consumed_samples"]), skipped=int(p["skipped"]),
                    recent_losses=tuple(p["recent_losses"].tolist()) if "recent_losses" in p else ())


def save_model_weights(path: Path, state_dict: dict[str, torch.Tensor], *, model_config: dict | None = None) -> None:
    """A model-only checkpoint (no optimizer, no progress): what `init_from` loads; with model.json and manifest."""
    _write_files(path, {"model": state_dict}, model_config)


def _saved_tensors(path: Path, *, own: bool) -> dict:
    """The checkpoint's DCP metadata: flattened key -> tensor metadata (size, dtype), without reading tensors."""
    return reader_for(path, own=own).read_metadata().state_dict_metadata


def _check_model_matches(path: Path, saved: dict, model_sd: dict[str, torch.Tensor],
                         model_keys: Collection[str] | None) -> None:
    """Names and shapes of the checkpoint's `model.*` against the model: a CheckpointError before any read.
    `model_sd` holds this rank's tensors (every one must be in the checkpoint, in its shape); `model_keys` names
    the whole model's (a pipeline stage holds some), None when `model_sd` is the whole model."""
    prefix = "model."
    whole = set(model_sd if model_keys is None else model_keys)
    missing = sorted(k for k in model_sd if prefix + k not in saved)
    unexpected = sorted(k[len(prefix) :] for k in saved if k.startswith(prefix) and k[len(prefix) :] not in whole)
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: does not match the model: {len(missing)} tensors missing {missing[:3]}, "
            f"{len(unexpected)} unexpected {unexpected[:3]}"
        )
    reshaped = [
        f"{k} {tuple(saved[prefix + k].size)} vs {tuple(v.shape)}"
        for k, v in model_sd.items()
        if tuple(saved[prefix + k].size) != tuple(v.shape)
    ]
    if reshaped:
        raise CheckpointError(f"{path}: {len(reshaped)} tensors differ in shape from the model, e.g. {reshaped[0]}")


def load_model_weights(path: Path, model: nn.Module, model_keys: Collection[str] | None = None, *,
                       own: bool = False) -> None:
    """Load the `model.*` part of any checkpoint (model-only or full) into `model` (the whole model, or a
    pipeline stage of the model whose keys are `model_keys`), strictly by name. `own`: see load_training_state."""
    model_sd = model.state_dict()
    _check_model_matches(path, _saved_tensors(path, own=own), model_sd, model_keys)
    _dcp_load({"model": model_sd}, path, own=own, stacks=placed_stacks_of([model]))
    model.load_state_dict(model_sd, strict=True)
