"""Runs `layout.publish` (or `prune`, or a whole `save_checkpoint`) for tests/test_checkpoint_kill.py, pausing
after every filesystem step.

After each `os.replace` and `shutil.rmtree` the real call has completed; the driver prints one line naming it
(`replace SRC DST` or `rmtree PATH`, base names) and waits for a line on stdin before going on. `save` also
pauses once the DCP files are written, before the manifest is (`manifest FOLDER`). The test reads these lines
and SIGKILLs this process at the point it wants, so what is left on disk is what a real kill leaves. The
production code has no hook for this: the driver wraps the calls in its own process.

`async_save` is a background save (checkpoint/async_save.py) of STEP: it pauses once the state is staged and
the write has started (`staged`), while training would go on, then at the background thread's steps (the
manifest, the renames). One lock orders the pauses of both threads, so the test sees one event at a time.

usage: python publish_driver.py publish CKPT_DIR STEP | prune CKPT_DIR KEEP | save CKPT_DIR STEP |
       async_save CKPT_DIR STEP
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import threading
from pathlib import Path

from moe_train.checkpoint import collective, layout


def shown(path) -> str:
    """A base name, with the atomic writer's random temporary name `.NAME.XXXX.tmp` shown as `tmp:NAME`."""
    name = Path(path).name
    match = re.fullmatch(r"\.(.+)\.[^.]+\.tmp", name)
    return f"tmp:{match.group(1)}" if match else name


PAUSE = threading.Lock()


def pause(*words: str) -> None:
    with PAUSE:
        print(*words, flush=True)
        sys.stdin.readline()


def paused(name, real):
    def call(*args, **kwargs):
        result = real(*args, **kwargs)
        pause(name, *(shown(a) for a in args[:2]))
        return result

    return call


def paused_before(name, real):
    def call(folder, *args, **kwargs):
        pause(name, shown(folder))
        return real(folder, *args, **kwargs)

    return call


def trained():
    """A small model and its optimizer after one step."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def save(ckpt_dir: Path, step: int) -> None:
    """A real checkpoint of a small model and its optimizer after one step, with progress `step`."""
    from moe_train.checkpoint.save import save_checkpoint
    from moe_train.checkpoint.state import Progress

    model, optimizer = trained()
    save_checkpoint(ckpt_dir, chunks=[model], optimizers=[optimizer],
                    progress=Progress(step=step, consumed_samples=step), model_config={}, keep=None)


def async_save(ckpt_dir: Path, step: int) -> None:
    """The same checkpoint written in the background, the model changed meanwhile (the next step's update)."""
    import torch

    from moe_train.checkpoint.async_save import Checkpointer
    from moe_train.checkpoint.state import Progress

    model, optimizer = trained()
    checkpointer = Checkpointer(ckpt_dir, keep=None)
    checkpointer.save(chunks=[model], optimizers=[optimizer], progress=Progress(step=step, consumed_samples=step),
                      model_config={}, background=True)
    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on: the checkpoint must hold the staged values
    pause("staged")
    checkpointer.close()


def main() -> None:
    action, ckpt_dir, number = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    collective.write_manifest = paused_before("manifest", collective.write_manifest)
    os.replace = paused("replace", os.replace)
    shutil.rmtree = paused("rmtree", shutil.rmtree)
    if action == "publish":
        layout.publish(layout.tmp_dir(ckpt_dir, number), step=number)
    elif action == "save":
        save(ckpt_dir, number)
    elif action == "async_save":
        async_save(ckpt_dir, number)
    else:
        layout.prune(ckpt_dir, keep=number)
    print("done", flush=True)


if __name__ == "__main__":
    main()
