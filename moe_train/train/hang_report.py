"""Hangs explained: where each rank waits when a collective does not return.

A hang in a distributed job shows as silence until the process group's timeout ends it, with no word of where.
This module keeps, per process, the collective each thread has entered and not yet left (its group, op, tensor
sizes and a per-group sequence number: the Nth collective this rank entered on that group), by wrapping the
Python entry points every collective goes through: `torch.distributed`'s functions (FSDP2, pipeline sends, our
own all-reduces) and the functional collectives DTensor uses. A watchdog thread checks twice a second; once no
collective has been entered or left for REPORT_AT of the process group's timeout (so before the timeout tears
the rank down) while training runs, it prints a hang report to stderr and to `{run_dir}/logs/hang-rank{R}.txt`:
the rank, its step, the last collective entered (still in it, or waiting on its result: an async collective's
`wait()`, which FSDP2 calls, is not a call this module sees), and every thread's Python stack (faulthandler, so
it works while the main thread is blocked in C++). Ranks that can still run each print one (a rank stopped by
SIGSTOP cannot); comparing their collectives (group and sequence number) shows who waits for whom, and a
mismatched collective as two ranks in different ones.

On CUDA, NCCL's flight recorder (the last collectives of every group, in C++) is switched on before the process
group is created (`flight_recorder_env`) and dumped into the run folder's logs/ on a timeout
(TORCH_NCCL_DUMP_ON_TIMEOUT) and with each hang report. On CPU (gloo) there is no flight recorder.
"""

from __future__ import annotations

import faulthandler
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

REPORT_AT = 0.75  # of the process group's timeout
POLL_S = 0.5
WRAPPED_DIST = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "broadcast",
                "reduce", "gather", "scatter", "barrier", "send", "recv", "batch_isend_irecv",
                "all_gather_object", "broadcast_object_list", "monitored_barrier", "all_reduce_coalesced",
                "all_gather_coalesced")
WRAPPED_FUNCTIONAL = ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single",
                      "broadcast", "all_reduce_coalesced", "all_gather_into_tensor_coalesced")


@dataclass(frozen=True)
class Collective:
    group: str
    op: str
    sizes: str
    sequence: int
    entered: float  # time.monotonic()

    def describe(self) -> str:
        return f"{self.op} on group {self.group} #{self.sequence} sizes {self.sizes}"


class _Log:
    """The collectives in flight, per thread, and the last one entered; safe across threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sequences: dict[str, itertools.count] = {}
        self.in_flight: dict[int, Collective] = {}
        self.last: Collective | None = None
        self.activity = time.monotonic()  # the last enter or leave, any thread

    def enter(self, group: str, op: str, sizes: str) -> Collective:
        with self.lock:
            sequence = next(self.sequences.setdefault(group, itertools.count(1)))
            entry = Collective(group, op, sizes, sequence, time.monotonic())
            self.in_flight[threading.get_ident()] = entry
            self.last = entry
            self.activity = entry.entered
            return entry

    def leave(self) -> None:
        with self.lock:
            self.in_flight.pop(threading.get_ident(), None)
            self.activity = time.monotonic()


LOG = _Log()


def group_name(group) -> str:
    """A readable name: a DeviceMesh dimension's name, a group's description (DeviceMesh names its groups
    `mesh_dp`...), `default` for the world group."""
    if group is None or group is dist.GroupMember.WORLD:
        return "default"
    if isinstance(group, tuple) and len(group) == 2:  # (DeviceMesh, dim) in functional collectives
        mesh, dim = group
        names = getattr(mesh, "mesh_dim_names", None)
        return str(names[dim] if names and isinstance(dim, int) else dim)
    if isinstance(group, str):
        return group
    names = getattr(group, "mesh_dim_names", None)  # a one-dimensional DeviceMesh
    if names:
        return "_".join(names)
    return getattr(group, "group_desc", None) or getattr(group, "group_name", None) or type(group).__name__


def _sizes(args, kwargs) -> str:
    """Shapes and dtypes of the tensors (and lists of tensors) among the arguments."""
    shown = []
    for value in [*args[:3], *kwargs.values()]:
        items = value if isinstance(value, (list, tuple)) else [value]
        shown += [f"{item.dtype}".removeprefix("torch.") + str(list(item.shape)) for item in items
                  if isinstance(item, torch.Tensor)]
    return "[" + ", ".join(shown[:4]) + (", ..." if len(shown) > 4 else "") + "]"


# Where each wrapped function takes its group when it is passed by position.
DIST_GROUP_AT = {"all_reduce": 2, "all_gather": 2, "all_gather_into_tensor": 2, "all_gather_single": 2,
                 "reduce_scatter": 3, "reduce_scatter_tensor": 3, "reduce_scatter_single": 3,
                 "all_reduce_coalesced": 2, "all_gather_coalesced": 2, "all_to_all": 2, "all_to_all_single": 4,
                 "broadcast": 2, "reduce": 3, "gather": 3, "scatter": 3, "barrier": 0, "send": 2, "recv": 2,
                 "all_gather_object": 2, "broadcast_object_list": 2, "monitored_barrier": 0}
FUNCTIONAL_GROUP_AT = {"all_reduce": 2, "all_gather_tensor": 2, "reduce_scatter_tensor": 2, "all_to_all_single": 3,
                       "broadcast": 2, "all_reduce_coalesced": 2, "all_gather_into_tensor_coalesced": 2}


def _group_argument(positions: dict[str, int], function_name: str, args, kwargs):
    if "group" in kwargs:
        return kwargs["group"]
    index = positions.get(function_name)
    return args[index] if index is not None and len(args) > index else None


def _wrap(module, name: str, functional: bool) -> None:
    real = getattr(module, name, None)
    if real is None or getattr(real, "_hang_report", False):
        return

    def call(*args, **kwargs):
        if torch.compiler.is_compiling():  # traced into a graph: no Python runs there when it executes
            return real(*args, **kwargs)
        group = _group_argument(FUNCTIONAL_GROUP_AT if functional else DIST_GROUP_AT, name, args, kwargs)
        LOG.enter(group_name(group), name, _sizes(args, kwargs))
        try:
            return real(*args, **kwargs)
        finally:
            LOG.leave()

    call._hang_report = True
    call.__wrapped__ = real
    call.__name__ = name
    call.__doc__ = real.__doc__
    setattr(module, name, call)


def install_wrappers() -> None:
    """Wrap the collectives (once per process). An async collective counts as waiting only while it is issued;
    its `wait()` is what then blocks, and the stacks show that frame. isend/irecv stay unwrapped: `P2POp` checks
    its op against those very functions (batch_isend_irecv, which runs them, is wrapped)."""
    import torch.distributed._functional_collectives as functional

    for name in WRAPPED_DIST:
        _wrap(dist, name, functional=False)
    for name in WRAPPED_FUNCTIONAL:
        _wrap(functional, name, functional=True)


def last_collective() -> str | None:
    """The last collective this process entered, described, for error lines; None before any."""
    last = LOG.last
    return None if last is None else last.describe()


def flight_recorder_env(log_dir: Path) -> dict[str, str]:
    """NCCL flight recorder settings (read when a NCCL process group is created): record the last 2000
    collectives and dump them as `{log_dir}/nccl_trace_rank_{R}` on a timeout."""
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": str(log_dir / "nccl_trace_rank_")}


def enable_flight_recorder(log_dir: Path) -> None:
    """Set flight_recorder_env's variables unless the user set them; call before the NCCL group exists."""
    log_dir.mkdir(parents=True, exist_ok=True)
    for key, value in flight_recorder_env(log_dir).items():
        os.environ.setdefault(key, value)


def dump_flight_recorder(path: Path) -> bool:
    """Write NCCL's flight recorder (a pickle, read with torch's `fr_trace` tool) to `path`; False without
    NCCL (CPU runs, or a torch built without it)."""
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    if dump is None or not torch.cuda.is_available():
        return False
    path.write_bytes(dump())
    return True


def last_in_flight(log: _Log) -> Collective | None:
    """The most recently entered collective that has not returned (any thread)."""
    return max(log.in_flight.values(), key=lambda c: c.entered, default=None)


class HangWatch:
    """The watchdog thread of one training process; `stop()` ends it."""

    def __init__(self, *, rank: int, timeout_s: float, step: Callable[[], int], log_dir: Path | None,
                 out=None) -> None:
        install_wrappers()
        self.rank, self.step, self.log_dir = rank, step, log_dir
        self.report_after_s = REPORT_AT * timeout_s
        self.out = out if out is not None else sys.stderr
        self.reported_at = -1.0  # the LOG.activity already reported
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(POLL_S):
            now = time.monotonic()
            with LOG.lock:
                last, activity, inside = LOG.last, LOG.activity, last_in_flight(LOG)
            if last is not None and now - activity >= self.report_after_s and activity != self.reported_at:
                self.reported_at = activity
                self.report(inside or last, now - activity, inside is not None)

    def report(self, collective: Collective, waited_s: float, inside: bool) -> None:
        where = "in" if inside else "after entering"
        header = (f"hang report: rank {self.rank}, step {self.step()}: no collective for {waited_s:.0f} s, "
                  f"{where} {collective.describe()}")
        targets = [self.out]
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            targets.append((self.log_dir / f"hang-rank{self.rank}.txt").open("a", encoding="utf-8"))
        for target in targets:
            print(header, file=target, flush=True)
            try:
                faulthandler.dump_traceback(file=target, all_threads=True)
            except (ValueError, OSError, AttributeError):  # a stream without a file descriptor (captured)
                print("(no stack: this stream has no file descriptor)", file=target, flush=True)
            target.flush()
        for target in targets[1:]:
            target.close()
        if self.log_dir is not None and dump_flight_recorder(self.log_dir / f"nccl_trace_rank_{self.rank}"):
            print(f"NCCL flight recorder: {self.log_dir / f'nccl_trace_rank_{self.rank}'}", file=self.out,
                  flush=True)
