"""Checkpoint cost and preemption latency: save and load time and size for qwen3-moe-tiny and a ~100M-parameter
dense proxy at world sizes 1, 2 and 4 (FSDP2 over gloo ranks of one thread each), and the time from the
preemption notice to the end of the job.

Each (model, world size) is one torchrun job of this file's worker, after one training step (so AdamW has its
moments): `save` is `save_checkpoint` whole (DCP write, manifest, publish), `manifest` the checksums' share of it
(every rank hashes its share; timed again on the saved folder), `verify` the start-point choice with every
checksum checked, `load` `load_training_state` into the live model and optimizer. Then the job trains on; the
notice file is written as step 4 starts (the worst case: the whole step is left to run), and the parent times
notice -> the trainer's return (that step, the agreement, the save) and -> torchrun's exit (teardown too), the
latter also in step times. Configurations run in turn, `--rounds` times; medians are printed side by side with
the load average before and after.

Async vs sync (`checkpoint.async_save`): what one save costs training, in seconds of training time. Steps are
timed alone (`--cost-steps` of them; their median is the baseline), then after a synchronous save (cost = its
stall: training waits for all of it), then after a background save: cost = the stall until `save` returns
(staging to host memory) + the slowdown of the steps that overlap the write (each step's time over the
baseline, summed; on 2 cores the writer and the step compete) + any wait left when the write outlasts
2 x `--cost-steps` steps. The last column is that cost as a share of the synchronous one. Two background saves
are timed in turn in the same job, under the same load: the Checkpointer's (`async`: reused staging buffers, an
idle-class writer thread) and DCP's default `async_save` (`dcp`: a fresh copy per save, the writer at training's
priority), so the table shows what the Checkpointer's choices change.

    python bench/bench_checkpoint.py [--rounds 1] [--models moe,dense] [--worlds 1,2,4] [--cost-steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = {
    "moe": ("qwen3-moe-tiny", ["train.global_batch_size=16", "train.micro_batch_size=4", "train.seq_length=128"]),
    # ~100M parameters: 12 layers of hidden 768 (GQA 12/4 heads), FFN 2048, a 32k vocabulary (as bench_dp.py).
    "dense": ("qwen3-tiny", ["model.num_layers=12", "model.hidden_size=768", "model.num_attention_heads=12",
                             "model.num_query_groups=4", "model.head_dim=64", "model.ffn_hidden_size=2048",
                             "model.vocab_size=32000", "data.source=mock", "train.seq_length=128",
                             "train.global_batch_size=8", "train.micro_batch_size=2"]),
}
COMMON = ["train.steps=1000", "train.warmup_steps=1", "train.eval_interval=null", "checkpoint.interval=null",
          "logging.interval=1", "train.precision=fp32", "checkpoint.keep=null"]


def _timed(fn):
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    result = fn()
    dist.barrier()
    return time.perf_counter() - start, result


def _step_times(trainer, first: int, count: int, until=None) -> list[float]:
    """Seconds of each of `count` training steps from step `first` (every rank in step: barriers around each);
    with `until`, stop early once it returns True after a step."""
    times = []
    for step in range(first, first + count):
        seconds, _ = _timed(lambda step=step: trainer.train_step(step))
        times.append(seconds)
        if until is not None and until():
            break
    return times


class DcpDefaultSave:
    """The background save as DCP's `async_save` gives it, beside the Checkpointer's (side by side in one job): a
    fresh host copy of the state at every save, and DCP's writer thread at the training threads' priority; then
    the same checksums and publishing on a thread. What issue 24 first shipped."""

    def __init__(self, checkpointer, ckpt_dir: Path) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.checkpointer, self.ckpt_dir = checkpointer, ckpt_dir
        self.executor = ThreadPoolExecutor(max_workers=1)
        self.pending = None

    def save(self, trainer, step: int, model_config: dict) -> None:
        import torch.distributed.checkpoint as dcp

        from moe_train.checkpoint import collective
        from moe_train.checkpoint.layout import publish, tmp_dir
        from moe_train.checkpoint.state import Progress, training_state, write_model_config

        tmp = tmp_dir(self.ckpt_dir, step)
        write_model_config(tmp, model_config)
        state = training_state(chunks=trainer.chunks, optimizers=trainer.optimizers,
                               progress=Progress(step=step, consumed_samples=trainer.progress.consumed_samples))
        group = self.checkpointer._background_group()
        written = dcp.async_save(state, checkpoint_id=str(tmp), process_group=group)

        def finish() -> None:
            import torch.distributed as dist

            written.result()
            collective.write_manifest(tmp, group=group)
            if collective.rank() == 0:
                publish(tmp, step=step)
            dist.barrier(group=group)

        self.pending = self.executor.submit(finish)

    @property
    def in_flight(self) -> bool:
        return self.pending is not None and not self.pending.done()

    def wait(self) -> None:
        self.pending.result()


def save_costs(trainer, ckpt_dir: Path, model_config: dict, steps: int) -> dict:
    """Sync vs background save, in training seconds lost (the module docstring's definitions): the
    Checkpointer's background save (`async_*`) and DCP's default one (`dcp_*`), measured in turn in this job."""
    from moe_train.checkpoint.async_save import Checkpointer
    from moe_train.checkpoint.state import Progress

    checkpointer = Checkpointer(ckpt_dir, keep=None)
    default = DcpDefaultSave(checkpointer, ckpt_dir)

    def save(step: int, background: bool) -> None:
        checkpointer.save(chunks=trainer.chunks, optimizers=trainer.optimizers,
                          progress=Progress(step=step, consumed_samples=trainer.progress.consumed_samples),
                          model_config=model_config, background=background)

    _step_times(trainer, 2, 2)  # warm
    _timed(lambda: (save(10, True), checkpointer.wait()))  # one-off set-up: the group, the staging buffers
    _timed(lambda: (default.save(trainer, 20, model_config), default.wait()))
    cpu = time.process_time()
    baseline = statistics.median(_step_times(trainer, 4, steps))
    step_cpu_s = (time.process_time() - cpu) / steps
    cpu = time.process_time()
    sync_s, _ = _timed(lambda: save(11, False))
    record = {"baseline_step_s": baseline, "sync_cost_s": sync_s, "sync_cpu_s": time.process_time() - cpu}
    first = 4 + steps
    for name, start, writer in (("async", lambda: save(12, True), checkpointer),
                                ("dcp", lambda: default.save(trainer, 21, model_config), default)):
        cpu = time.process_time()
        stall_s, _ = _timed(start)
        overlapped = _step_times(trainer, first, 2 * steps, until=lambda writer=writer: not writer.in_flight)
        first += len(overlapped)
        left_s, _ = _timed(writer.wait)
        extra_cpu_s = time.process_time() - cpu - step_cpu_s * len(overlapped)
        slowdown_s = sum(max(0.0, t - baseline) for t in overlapped)
        record.update({f"{name}_stall_s": stall_s, f"{name}_slowdown_s": slowdown_s, f"{name}_wait_s": left_s,
                       f"{name}_overlapped_steps": len(overlapped), f"{name}_cost_s": stall_s + slowdown_s + left_s,
                       f"{name}_cpu_s": extra_cpu_s})
    checkpointer.close()
    return record


def worker(recipe_name: str, overrides: list[str], out: Path, cost_steps: int) -> None:
    """On every rank of the job: time the checkpoint steps, then train until the notice stops the run."""
    from moe_train.checkpoint.collective import agreed_start_point, write_manifest
    from moe_train.checkpoint.save import save_checkpoint
    from moe_train.checkpoint.state import Progress, load_training_state
    from moe_train.config import load_recipe
    from moe_train.run_files import PREEMPT_FILE
    from moe_train.train.loop import Trainer

    world = int(os.environ["WORLD_SIZE"])
    recipe = load_recipe(recipe_name, [*overrides, f"launch.gpus_per_node={world}"])
    trainer = Trainer(recipe)
    trainer.train_step(1)
    trainer.progress = Progress(step=1, consumed_samples=recipe.train.global_batch_size)
    ckpt_dir = Path(recipe.checkpoint_dir())
    model_config = recipe.model.model_dump(mode="json")
    def save(step: int):
        return save_checkpoint(ckpt_dir, chunks=trainer.chunks, optimizers=trainer.optimizers,
                               progress=Progress(step=step, consumed_samples=trainer.progress.consumed_samples),
                               model_config=model_config, keep=None)

    first_save_s, _ = _timed(lambda: save(1))  # includes DCP's one-off set-up in this process
    save_s, path = _timed(lambda: save(2))  # what every later save costs
    manifest_s, _ = _timed(lambda: write_manifest(path))
    verify_s, _ = _timed(lambda: agreed_start_point(ckpt_dir=ckpt_dir, resume="required", init_from=None))
    load_s, _ = _timed(lambda: load_training_state(path, chunks=trainer.chunks,
                                                             optimizers=trainer.optimizers, own=True))
    record = {"first_save_s": first_save_s, "save_s": save_s, "manifest_s": manifest_s, "verify_s": verify_s,
              "load_s": load_s, "bytes": sum(p.stat().st_size for p in path.iterdir()),
              # DTensors count their full shape
              "params": sum(p.numel() for part in trainer.chunks for p in part.parameters())}
    if cost_steps:
        record.update(save_costs(trainer, ckpt_dir, model_config, cost_steps))
        trainer.progress = Progress(step=1, consumed_samples=recipe.train.global_batch_size)
    if trainer.ctx.logs:
        notice = Path(recipe.resolved_run_dir()) / PREEMPT_FILE

        def notify(module, args) -> None:  # as step 4's first forward starts: the step has all of its work left
            if trainer.progress.step == 3 and "notice_at" not in record:
                notice.write_text("preempt bench\n")
                record["notice_at"] = time.time()

        trainer.chunks[0].register_forward_pre_hook(notify)
    trainer.train()
    if trainer.ctx.logs:
        record["stopped_at"] = time.time()  # checkpoint saved, train() returned; process teardown follows
        out.write_text(json.dumps(record))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(model: str, world: int, run_dir: Path, cost_steps: int) -> dict:
    recipe, overrides = MODELS[model]
    out = run_dir / "bench.json"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", __file__, "--worker", recipe, str(out), str(cost_steps),
            *[*overrides, *COMMON, f"run_dir={run_dir}"]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
    exited = time.time()
    record = json.loads(out.read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["tokens"] / r["step"] / r["tokens_per_s"] for r in records if r["kind"] == "train" and r["step"] > 2]
    record["notice_to_exit_s"] = exited - record["notice_at"]
    record["notice_to_stop_s"] = record["stopped_at"] - record["notice_at"]
    record["step_s"] = statistics.median(steps) if steps else float("nan")
    return record


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--models", default="moe,dense")
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--cost-steps", type=int, default=6, help="steps timed per phase of async vs sync; 0: skip")
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        recipe, out, cost_steps, *overrides = args.worker
        worker(recipe, overrides, Path(out), int(cost_steps))
        return
    worlds = [int(w) for w in args.worlds.split(",")]
    print(f"load average before: {load_average()} ({os.cpu_count()} cores)")
    with tempfile.TemporaryDirectory() as tmp:
        results: dict[tuple[str, int], list[dict]] = {}
        for round_index in range(args.rounds):
            for model in args.models.split(","):
                for world in worlds:
                    run_dir = Path(tmp) / f"{model}-{world}-{round_index}"
                    results.setdefault((model, world), []).append(run(model, world, run_dir, args.cost_steps))
    print(f"load average after:  {load_average()}")
    header = (f"{'model':<24}{'ranks':>6}{'size MB':>9}{'1st save':>9}{'save s':>8}{'manifest':>9}{'MB/s':>7}"
              f"{'verify s':>9}{'load s':>8}{'load/save':>10}{'notice->stop':>13}{'->exit s':>9}{'in steps':>9}")
    print(header)
    for (model, world), runs in results.items():
        m = {key: statistics.median(r[key] for r in runs) for key in runs[0] if not key.endswith("_at")}
        size = m["bytes"] / 1e6
        name = f"{MODELS[model][0]} ({m['params'] / 1e6:.0f}M)"
        print(f"{name:<24}{world:>6}{size:>9.1f}{m['first_save_s']:>9.2f}{m['save_s']:>8.2f}"
              f"{m['manifest_s'] / m['save_s']:>8.0%} {size / m['save_s']:>7.0f}{m['verify_s']:>9.2f}"
              f"{m['load_s']:>8.2f}{m['load_s'] / m['save_s']:>10.2f}{m['notice_to_stop_s']:>13.1f}"
              f"{m['notice_to_exit_s']:>9.1f}"
              f"{m['notice_to_exit_s'] / m['step_s']:>9.1f}")
    print("1st save: the process's first (DCP's one-off set-up); save s and everything after: a later save. "
          "manifest: the checksums' share of it; MB/s: checkpoint bytes / save time. notice->stop: the notice, "
          "written as a step starts, to train() returning with the checkpoint saved; ->exit: to torchrun's exit; "
          "in steps: ->exit in median step times.")
    if not args.cost_steps:
        return
    print(f"\n{'model':<24}{'ranks':>6}{'step s':>8}{'sync s':>8}{'save':>7}{'stall':>7}{'slowdown':>9}{'wait':>6}"
          f"{'steps':>6}{'cost s':>8}{'of sync':>8}{'sync cpu':>9}{'cpu':>6}{'of sync':>8}")
    for (model, world), runs in results.items():
        m = {key: statistics.median(r[key] for r in runs) for key in runs[0] if not key.endswith("_at")}
        name = f"{MODELS[model][0]} ({m['params'] / 1e6:.0f}M)"
        for kind in ("async", "dcp"):
            print(f"{name:<24}{world:>6}{m['baseline_step_s']:>8.2f}{m['sync_cost_s']:>8.2f}{kind:>7}"
                  f"{m[kind + '_stall_s']:>7.2f}{m[kind + '_slowdown_s']:>9.2f}{m[kind + '_wait_s']:>6.2f}"
                  f"{m[kind + '_overlapped_steps']:>6.0f}{m[kind + '_cost_s']:>8.2f}"
                  f"{m[kind + '_cost_s'] / m['sync_cost_s']:>8.0%}{m['sync_cpu_s']:>9.2f}{m[kind + '_cpu_s']:>6.2f}"
                  f"{m[kind + '_cpu_s'] / m['sync_cpu_s']:>8.0%}")
    print("step s: a step without a save (median); sync s: a synchronous save's stall; save: async is the "
          "Checkpointer's background save, dcp DCP's default async_save beside it; its cost s = stall (staging) "
          "+ slowdown of the overlapping steps (at most 2 x --cost-steps) + wait left; of sync: cost s / sync s. "
          "cpu: rank 0's CPU seconds (every thread) for the save: the synchronous save's, and the background "
          "save's over its steps less those steps' own (the CPU a save takes from training where no core is "
          "spare; under other jobs' load the one figure that does not swing).")


if __name__ == "__main__":
    main()
