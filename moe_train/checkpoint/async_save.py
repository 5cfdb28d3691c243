"""Checkpoints that do not stop training (`checkpoint.async_save: true`).

A save has two parts. Staging copies this rank's state (model, optimizer, progress, RNG) into host memory;
training must wait for it, since the next step changes the tensors. Writing the copy to disk, hashing it into the
manifest and publishing it (rename, `latest`, keep-K) does not need the live tensors, so it runs on a background
thread while training goes on: the thread runs DCP's save of the staged copy, then does what
`save.save_checkpoint` does after it (the manifest, layout.publish, layout.prune).

What the background write costs training is the CPU it takes from it (bench/bench_checkpoint.py measures it,
beside DCP's default `async_save`). The staging buffers are allocated once and reused by every later save (DCP's
DefaultStager caches a host copy per source storage; pinned memory on a GPU node, for fast device-to-host
copies): a fresh copy per save spent most of the stall zeroing new pages (~2 s of CPU for the 125M proxy's
1.5 GB), where a copy into warm buffers is a memcpy, and the writer no longer pays those page faults either.
The writer keeps the training threads' scheduling class: in the idle class (SCHED_IDLE, tried) it held the GIL
while other processes had the cores, and the training thread waited for it (on this shared machine the write
then spanned three steps instead of one, and cost more).

The background thread's collectives (DCP's plan and metadata exchange, the manifest's shared hashing, the final
barrier) run on a dedicated gloo group: the staged tensors live on the host, and the training group's
collectives (NCCL on GPUs, or gloo on CPU) must never interleave with a thread's. Every rank runs the same
sequence on that group, in the same order, so the ranks need not agree on when their threads run.

What stays as with a synchronous save: `latest` moves only after the manifest is on disk (a SIGKILL at any point
leaves `latest` naming a complete checkpoint; the unpublished `.tmp-` folder is removed by the next save), a
second save first waits for the first, and the Trainer's last save and a preemption's are synchronous (they
must be on disk before the job ends), waiting for a background one first.
"""

from __future__ import annotations

import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from moe_train.checkpoint import collective
from moe_train.checkpoint.expert_order import ExpertOrderSavePlanner
from moe_train.checkpoint.layout import prune, publish, step_dir_name, tmp_dir
from moe_train.checkpoint.save import save_checkpoint
from moe_train.checkpoint.state import Progress, placed_stacks_of, training_state, write_model_config


class Checkpointer:
    """A run's checkpoint writer: `save(..., background=True)` returns once the state is staged; anything else
    is save_checkpoint, after the background save in flight (if any) is published. Every rank calls each method
    together."""

    def __init__(self, ckpt_dir: Path, *, keep: int | None) -> None:
        self.ckpt_dir = ckpt_dir
        self.keep = keep
        self._group = None
        self._stager: DefaultStager | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def save(self, *, chunks: list[nn.Module], optimizers: list[torch.optim.Optimizer], progress: Progress,
             model_config: dict, background: bool = False) -> Path:
        """Save `progress.step`; returns the checkpoint's final path (with background=True it is published
        later: `wait()` returns once it is)."""
        self.wait()  # also: the staging buffers are free again (the write in flight reads them)
        if not background:
            return save_checkpoint(self.ckpt_dir, chunks=chunks, optimizers=optimizers, progress=progress,
                                   model_config=model_config, keep=self.keep)
        tmp = tmp_dir(self.ckpt_dir, progress.step)
        if collective.rank() == 0:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left by a save that was killed midway
                shutil.rmtree(tmp)
        write_model_config(tmp, model_config)
        if self._stager is None:
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(),
                                                        use_shared_memory=False, use_async_staging=False,
                                                        use_non_blocking_copy=False))
        staged = self._stager.stage(training_state(chunks=chunks, optimizers=optimizers, progress=progress))
        group = self._background_group()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._pending = self._executor.submit(self._write, staged, tmp, progress.step, group,
                                              placed_stacks_of(chunks))
        return self.ckpt_dir / step_dir_name(progress.step)

    def wait(self) -> None:
        """Block until the background save in flight (if any) is published; raises what it raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    @property
    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _background_group(self):
        """The dedicated gloo group (created once, by every rank together); None without a process group."""
        if self._group is None and collective.distributed():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _write(self, staged: dict, tmp: Path, step: int, group, stacks: dict[str, tuple[int, ...]]) -> None:
        """On the background thread: DCP's write of the staged copy, the checksums, then publish like a
        synchronous save."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(staged, checkpoint_id=str(tmp), process_group=group, no_dist=not collective.distributed(),
                     planner=ExpertOrderSavePlanner(stacks) if stacks else None)
        collective.write_manifest(tmp, group=group)
        if collective.rank() == 0:
            publish(tmp, step=step)
            prune(self.ckpt_dir, keep=self.keep)
        if group is not None:
            dist.barrier(group=group)
