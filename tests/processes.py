"""Commands whose processes must all end with them: torchrun with its ranks, a CLI that starts torchrun.

torchrun starts each rank in a session of its own, so killing torchrun's process group leaves the ranks
running. On a timeout these helpers SIGKILL every process group found under the command (the command itself,
started in a new session, and each descendant's), so a hung multi-rank test never leaves orphaned ranks behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import pytest


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL the process, its descendants and all their process groups (never this test's own group)."""
    pids = [process.pid, *descendants(process.pid)]
    groups = set()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            groups.add(os.getpgid(pid))
    groups.discard(os.getpgrp())
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait()


def start(argv: list[str], **kwargs) -> subprocess.Popen:
    """Popen in a session of its own, text pipes for stdout and stderr."""
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)


def finish(process: subprocess.Popen, *, timeout: float) -> subprocess.CompletedProcess:
    """Wait for a started command; on timeout (or any interruption) kill its whole tree and fail the test."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process)
        try:
            out, err = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a survivor still holds the pipes
            pytest.fail(f"{' '.join(map(str, process.args[:6]))} ... timed out and left processes running")
        pytest.fail(f"{' '.join(map(str, process.args[:6]))} ... did not finish within {timeout} s; killed it with "
                    f"every process it started\n{err[-3000:]}")
    except BaseException:
        kill_tree(process)
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def run_bounded(argv: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(capture_output=True, text=True) whose timeout kills the whole tree, ranks included."""
    return finish(start(argv, **kwargs), timeout=timeout)
