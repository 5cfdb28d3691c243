"""DCP checkpoints on disk: atomic publishing, keep-K, the resume policies, model-only loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import SHRINK_ONE_LAYER

from moe_train.checkpoint.layout import CheckpointError, is_complete, latest_checkpoint, tmp_dir
from moe_train.checkpoint.resume import start_point
from moe_train.checkpoint.save import save_checkpoint
from moe_train.checkpoint.state import (
    Progress,
    load_model_weights,
    load_training_state,
    read_model_config,
    save_model_weights,
    save_training_state,
)
from moe_train.config import load_recipe
from moe_train.models import build_model
from moe_train.train.loop import Trainer
from moe_train.train.optimizer import build_optimizer


def small_model_and_optimizer(seed: int = 0):
    recipe = load_recipe("qwen3-moe-tiny", ["model.num_layers=1"])
    model = build_model(recipe.model, seed=seed)
    optimizer = build_optimizer(model, train=recipe.train)
    tokens = torch.randint(0, 257, (2, 9), generator=torch.Generator().manual_seed(seed))
    loss = model(tokens[:, :-1]).float().logsumexp(-1).mean()  # the balancing loss rides along in backward
    loss.backward()
    optimizer.step()
    return recipe, model, optimizer


def save(ckpt_dir: Path, step: int, model, optimizer, keep: int | None = 2) -> Path:
    return save_checkpoint(ckpt_dir, chunks=[model], optimizers=[optimizer], progress=Progress(step=step),
                           model_config={"family": "qwen3_moe"}, keep=keep)


def test_training_state_round_trips_exactly(tmp_path: Path) -> None:
    recipe, model, optimizer = small_model_and_optimizer(seed=0)
    torch.manual_seed(7)
    save_training_state(tmp_path / "ck", chunks=[model], optimizers=[optimizer],
                        progress=Progress(step=5, consumed_samples=40, skipped=1))
    expected_rng = torch.get_rng_state()
    _, other, other_optimizer = small_model_and_optimizer(seed=1)
    torch.manual_seed(99)
    progress = load_training_state(tmp_path / "ck", chunks=[other], optimizers=[other_optimizer])
    assert progress == Progress(step=5, consumed_samples=40, skipped=1)
    assert torch.equal(torch.get_rng_state(), expected_rng)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    saved, loaded = optimizer.state_dict()["state"], other_optimizer.state_dict()["state"]
    assert saved.keys() == loaded.keys()
    for index in saved:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(saved[index][key], loaded[index][key]), (index, key)


def test_save_publishes_latest_and_keeps_the_newest(tmp_path: Path) -> None:
    _, model, optimizer = small_model_and_optimizer()
    for step in (1, 2, 3):
        path = save(tmp_path, step, model, optimizer, keep=2)
        assert latest_checkpoint(tmp_path) == path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-0000002", "step-0000003"]
    assert read_model_config(tmp_path / "step-0000003") == {"family": "qwen3_moe"}


@pytest.mark.parametrize("killed", ["before_rename", "during_dcp_write"])
def test_a_save_killed_midway_is_never_latest(tmp_path: Path, killed: str) -> None:
    """What a killed save leaves (a .tmp folder, complete or cut short) is never picked; the next save cleans it."""
    _, model, optimizer = small_model_and_optimizer()
    good = save(tmp_path, 1, model, optimizer)
    partial = tmp_dir(tmp_path, 2)
    save_training_state(partial, chunks=[model], optimizers=[optimizer], progress=Progress(step=2))
    if killed == "during_dcp_write":
        (partial / ".metadata").unlink()
        assert not is_complete(partial)
    assert latest_checkpoint(tmp_path) == good
    assert start_point(ckpt_dir=tmp_path, resume="auto", init_from=None).resume_from == good
    assert start_point(ckpt_dir=tmp_path, resume=str(tmp_path), init_from=None).resume_from == good
    again = save(tmp_path, 2, model, optimizer)
    assert latest_checkpoint(tmp_path) == again and not partial.exists()


def test_resume_policies(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    assert start_point(ckpt_dir=empty, resume="auto", init_from=None).resume_from is None
    assert start_point(ckpt_dir=empty, resume="never", init_from=None).resume_from is None
    with pytest.raises(CheckpointError, match=r"checkpoint.resume: required, but .*empty holds no complete"):
        start_point(ckpt_dir=empty, resume="required", init_from=None)
    with pytest.raises(CheckpointError, match="checkpoint.resume: .*nowhere is not a complete checkpoint"):
        start_point(ckpt_dir=empty, resume=str(tmp_path / "nowhere"), init_from=None)
    with pytest.raises(CheckpointError, match="checkpoint.init_from: "):
        start_point(ckpt_dir=empty, resume="auto", init_from=str(tmp_path / "nowhere"))

    _, model, optimizer = small_model_and_optimizer()
    ckpts = tmp_path / "ckpts"
    first = save(ckpts, 1, model, optimizer, keep=None)
    second = save(ckpts, 2, model, optimizer, keep=None)
    assert start_point(ckpt_dir=ckpts, resume="required", init_from=None).resume_from == second
    assert start_point(ckpt_dir=ckpts, resume=str(first), init_from=None).resume_from == first
    never = start_point(ckpt_dir=ckpts, resume="never", init_from=str(first))
    assert never.resume_from is None and never.init_from == first
    # resuming wins over init_from: a restarted fine-tune continues, it does not start over
    assert start_point(ckpt_dir=ckpts, resume="auto", init_from=str(first)).resume_from == second


def test_model_only_checkpoint_loads_strictly(tmp_path: Path) -> None:
    _, model, _ = small_model_and_optimizer(seed=0)
    save_model_weights(tmp_path / "weights", model.state_dict())
    _, fresh, _ = small_model_and_optimizer(seed=3)
    load_model_weights(tmp_path / "weights", fresh)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    dense = build_model(load_recipe("qwen3-tiny", ["model.num_layers=1"]).model)
    with pytest.raises(CheckpointError, match="does not match the model"):
        load_model_weights(tmp_path / "weights", dense)
    wider = build_model(load_recipe("qwen3-moe-tiny", ["model.num_layers=1", "model.ffn_hidden_size=512",
                                                       "model.moe.ffn_hidden_size=128"]).model)
    with pytest.raises(CheckpointError, match=r"tensors differ in shape from the model, e.g. .* \(8, 128, 128\)"):
        load_model_weights(tmp_path / "weights", wider)
    _, model, optimizer = small_model_and_optimizer(seed=3)
    with pytest.raises(CheckpointError, match="a model-only checkpoint cannot be resumed; use it as checkpoint.init"):
        load_training_state(tmp_path / "weights", chunks=[model], optimizers=[optimizer])


def test_trainer_resume_required_without_checkpoint_is_an_input_error(tmp_path: Path) -> None:
    recipe = load_recipe("qwen3-tiny", [*SHRINK_ONE_LAYER, "train.steps=2", f"run_dir={tmp_path}",
                                        "checkpoint.resume=required"])
    with pytest.raises(CheckpointError, match="required"):
        Trainer(recipe)


def test_init_from_loads_weights_with_a_fresh_optimizer_at_step_zero(tmp_path: Path) -> None:
    source = load_recipe("qwen3-tiny", [*SHRINK_ONE_LAYER, "train.steps=2", f"run_dir={tmp_path / 'a'}"])
    trained = Trainer(source)
    trained.train()
    ckpt = latest_checkpoint(tmp_path / "a" / "checkpoints")
    model_only = tmp_path / "weights"
    save_model_weights(model_only, trained.chunks[0].state_dict())
    for init_from in (ckpt, model_only):  # a full checkpoint works as init_from too
        run_dir = tmp_path / f"b-{init_from.name}"
        target = Trainer(load_recipe("qwen3-tiny", [*SHRINK_ONE_LAYER, "train.steps=2", f"run_dir={run_dir}",
                                                    f"checkpoint.init_from={init_from}"]))
        assert target.progress == Progress() and target.started_from == init_from
        assert not target.optimizers[0].state
        trained_sd, target_sd = trained.chunks[0].state_dict(), target.chunks[0].state_dict()
        for (name, a), b in zip(trained_sd.items(), target_sd.values(), strict=True):
            assert torch.equal(a, b), name
