"""The multi-rank tests' timeout: a command that starts children in sessions of their own (as torchrun starts
its ranks) is killed with all of them."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from processes import run_bounded

# A stand-in for torchrun: two "ranks" in new sessions, their pids in a file, then the launcher waits forever.
LAUNCHER = """
import pathlib, subprocess, sys, time
ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
         for _ in range(2)]
pathlib.Path(sys.argv[1]).write_text(" ".join(str(r.pid) for r in ranks))
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_a_timed_out_launcher_is_killed_with_its_ranks(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    with pytest.raises(pytest.fail.Exception, match="did not finish within 3 s"):
        run_bounded([sys.executable, "-c", LAUNCHER, str(pids)], timeout=3)
    ranks = [int(pid) for pid in pids.read_text().split()]
    assert len(ranks) == 2
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in ranks)
