"""Checkpoint integrity: the manifest written with every checkpoint, damage found before anything is loaded, the
fallback to the newest intact checkpoint, and checkpoints from elsewhere read through the restricted unpickler."""

from __future__ import annotations

import hashlib
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_bad_input, run_cli
from helpers import SHRINK_ONE_LAYER, train_losses

from moe_train.checkpoint import manifest
from moe_train.checkpoint.layout import LATEST, CheckpointError
from moe_train.checkpoint.resume import candidates, start_point
from moe_train.checkpoint.save import save_checkpoint
from moe_train.checkpoint.state import Progress, load_model_weights
from moe_train.config import load_recipe
from moe_train.train.loop import Trainer


def small() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def saved(ckpt_dir: Path, *steps: int) -> list[Path]:
    model, optimizer = small()
    return [save_checkpoint(ckpt_dir, chunks=[model], optimizers=[optimizer], progress=Progress(step=s),
                            model_config={"step": s}, keep=None) for s in steps]





def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_manifest_lists_every_file_with_its_size_and_checksum(tmp_path: Path) -> None:
    (ckpt,) = saved(tmp_path, 1)
    listed = {e.name: e for e in manifest.read_manifest(ckpt)}
    on_disk = {p.name for p in ckpt.iterdir()} - {manifest.MANIFEST}
    assert set(listed) == on_disk and {".metadata", "model.json"} <= on_disk and any(
        name.endswith(".distcp") for name in on_disk)
    for name, entry in listed.items():
        data = (ckpt / name).read_bytes()
        assert entry.bytes == len(data) and entry.sha256 == hashlib.sha256(data).hexdigest(), name
    assert manifest.verify(ckpt) == []


def test_a_flipped_byte_is_reported_and_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path: Path) -> None:
    first, second = saved(tmp_path, 1, 2)
    shard = next(second.glob("*.distcp"))
    flip_byte(shard)
    assert manifest.verify(second) == [f"{shard}: SHA-256 differs from manifest.json (corrupted)"]
    assert manifest.sizes_only(second) == []  # same size: only the checksum tells
    for policy in ("auto", "required"):
        start = start_point(ckpt_dir=tmp_path, resume=policy, init_from=None)
        assert start.resume_from == first and start.own
        assert start.notes[0].startswith(f"checkpoint {second} is not intact, not resumed from: {shard}: SHA-256")
        assert start.notes[1] == "resuming from step-0000001, the newest intact checkpoint"
    with pytest.raises(CheckpointError, match=rf"checkpoint.resume: {second} is not intact: {shard}: SHA-256"):
        start_point(ckpt_dir=tmp_path, resume=str(second), init_from=None)
    with pytest.raises(CheckpointError, match="checkpoint.init_from: .* is not intact"):
        start_point(ckpt_dir=tmp_path / "none", resume="auto", init_from=str(second))


def test_truncated_missing_and_unlisted_damage(tmp_path: Path) -> None:
    first, second, third = saved(tmp_path, 1, 2, 3)
    shard = next(third.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # a copy that stopped midway
    size = next(e.bytes for e in manifest.read_manifest(third) if e.name == shard.name)
    assert manifest.sizes_only(third) == [f"{shard}: 100 bytes, manifest.json says {size} (truncated or partly copied)"]
    (second / manifest.MANIFEST).unlink()
    assert manifest.verify(second)[0].startswith(f"{second / manifest.MANIFEST}: missing")
    (first / ".metadata").unlink()  # not even complete: not a candidate at all
    assert candidates(tmp_path) == [third, second]
    with pytest.raises(CheckpointError, match=r"checkpoint.resume: auto, but no checkpoint in .* is intact .*"
                                              r"set checkpoint.resume: never to start over"):
        start_point(ckpt_dir=tmp_path, resume="auto", init_from=None)  # never a silent fresh start over history
    assert start_point(ckpt_dir=tmp_path, resume="never", init_from=None).resume_from is None


def test_latest_missing_or_naming_a_lost_folder_falls_back_to_older_complete_checkpoints(tmp_path: Path) -> None:
    first, second, third = saved(tmp_path, 1, 2, 3)
    (tmp_path / LATEST).write_text("step-0000002\n")  # a step 3 saved but never named latest is not trusted
    assert candidates(tmp_path) == [second, first]
    shutil.rmtree(second)
    assert candidates(tmp_path) == [first]
    (tmp_path / LATEST).unlink()
    assert candidates(tmp_path) == [third, first]
    assert start_point(ckpt_dir=tmp_path, resume="auto", init_from=None).resume_from == third


def test_the_trainer_resumes_from_the_newest_intact_checkpoint_and_says_so(tmp_path: Path, capsys) -> None:
    recipe = load_recipe("qwen3-tiny", [*SHRINK_ONE_LAYER, "train.steps=3", "checkpoint.interval=1",
                                        "checkpoint.keep=null", f"run_dir={tmp_path}"])
    Trainer(recipe).train()
    ckpts = tmp_path / "checkpoints"
    history = train_losses(tmp_path)
    flip_byte(ckpts / "step-0000003" / ".metadata", offset=40)  # the pickle: never unpickled once damaged
    capsys.readouterr()
    trainer = Trainer(recipe)
    assert trainer.progress.step == 2 and trainer.started_from == ckpts / "step-0000002"
    summary = trainer.train()
    out = capsys.readouterr().out
    assert f"checkpoint {ckpts / 'step-0000003'} is not intact, not resumed from: " in out
    assert "resuming from step-0000002, the newest intact checkpoint" in out
    # Step 3 trained again from step 2 is the same step 3 (fp32, bit for bit), and its new save is intact.
    assert summary.step == 3 and train_losses(tmp_path) == history
    assert manifest.verify(ckpts / "step-0000003") == []


def test_convert_refuses_a_damaged_checkpoint(tmp_path: Path) -> None:
    recipe = load_recipe("qwen3-tiny", [*SHRINK_ONE_LAYER, "train.steps=1", f"run_dir={tmp_path}"])
    Trainer(recipe).train()
    ckpt = tmp_path / "checkpoints" / "step-0000001"
    shard = next(ckpt.glob("*.distcp"))
    flip_byte(shard)
    assert_bad_input(run_cli("convert", "to-hf", str(ckpt), "-o", str(tmp_path / "hf")), f"{shard}: SHA-256 differs")
    assert not (tmp_path / "hf").exists()


class _Payload:
    """Unpickling this runs `touch MARKER`: what a crafted .metadata could do through a full unpickler."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_from_elsewhere_cannot_run_code_through_its_metadata(tmp_path: Path) -> None:
    """A crafted .metadata with a valid manifest (a manifest proves integrity, not origin) given as init_from or
    to convert: refused naming the global, and nothing ran. An honest foreign checkpoint loads the same way."""
    recipe = load_recipe("qwen3-tiny", [*SHRINK_ONE_LAYER, "train.steps=1", f"run_dir={tmp_path / 'a'}"])
    trainer = Trainer(recipe)
    trainer.train()
    honest = tmp_path / "a" / "checkpoints" / "step-0000001"
    model = Trainer(load_recipe("qwen3-tiny", [*SHRINK_ONE_LAYER, "train.steps=1", f"run_dir={tmp_path / 'b'}",
                                              f"checkpoint.init_from={honest}"])).chunks[0]
    for (name, a), b in zip(trainer.chunks[0].state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    crafted = tmp_path / "crafted"
    shutil.copytree(honest, crafted)
    marker = tmp_path / "PWNED"
    (crafted / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    manifest.write_manifest(crafted, manifest.entries_for(crafted, [n for n, _ in manifest.listing(crafted)]))
    assert manifest.verify(crafted) == []
    with pytest.raises(CheckpointError, match=r"refers to posix.system, which a DCP checkpoint's metadata never holds"):
        load_model_weights(crafted, model)
    assert_bad_input(run_cli("convert", "to-hf", str(crafted), "-o", str(tmp_path / "hf")), "posix.system")
    with pytest.raises(CheckpointError, match="posix.system"):
        Trainer(load_recipe("qwen3-tiny", [*SHRINK_ONE_LAYER, "train.steps=1", f"run_dir={tmp_path / 'c'}",
                                           f"checkpoint.init_from={crafted}"]))
    assert not marker.exists()
