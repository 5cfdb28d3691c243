"""Hangs explained (issue 24): a mismatched collective on real gloo ranks. Each rank's hang watch prints, before
the timeout, the collective it waits in (group, op, sizes, sequence number), its step and its Python stack.
The stuck-rank case (SIGSTOP through `moe-train run`) is tests/test_stop_one_rank.py's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from multirank import run_ranks

from moe_train.train import hang_report


@pytest.mark.slow
def test_mismatched_collectives_are_each_reported_with_their_stack(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    # The report comes at 0.75 x the timeout (6 s of 8), checked every 0.5 s: the 2 s left before the timeout
    # ends the wait hold on a loaded machine, where 4 s (3 s to the report) once lost the race.
    result = run_ranks("hang", 2, {"timeout_s": 8, "log_dir": str(logs)}, tmp_path, timeout=120)
    assert result["error"] is not None  # the wait ended by the timeout, after the report
    reports = {rank: (logs / f"hang-rank{rank}.txt").read_text() for rank in (0, 1)}
    # Rank 0 waits in its second collective on `a`, rank 1 in its first on `b`: the mismatch, named.
    for rank, group in ((0, "a #2"), (1, "b #1")):
        header = reports[rank].splitlines()[0]
        match = re.fullmatch(rf"hang report: rank {rank}, step 7: no collective for (\d+) s, in all_reduce on group "
                             rf"{group} sizes \[float32\[3, 5\]\]", header)
        assert match and 6 <= int(match.group(1)) <= 8, header  # at 0.75 x the timeout, before it ends the wait
    for report in reports.values():
        assert "Current thread" in report or "Thread 0x" in report  # faulthandler's stacks, every thread
        assert 'workers/hang.py", line' in report and "in main" in report
        assert "in call" in report  # the wrapped collective's frame, where the main thread waits
        assert "hang-watch" not in report.split("\n")[0]


def test_flight_recorder_settings_name_the_run_folder(tmp_path: Path) -> None:
    env = hang_report.flight_recorder_env(tmp_path / "logs")
    assert env == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "logs" / "nccl_trace_rank_")}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL's flight recorder needs CUDA")
def test_nccl_flight_recorder_dump_lands_in_the_run_folder(tmp_path: Path) -> None:
    """One NCCL rank: the recorder switched on before the group exists records an all-reduce, and the dump a
    hang report makes is written into logs/."""
    import pickle

    import torch.distributed as dist

    hang_report.enable_flight_recorder(tmp_path / "logs")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        tensor = torch.ones(8, device="cuda")
        dist.all_reduce(tensor)
        torch.cuda.synchronize()
        path = tmp_path / "logs" / "nccl_trace_rank_0"
        assert hang_report.dump_flight_recorder(path)
        trace = pickle.loads(path.read_bytes())
        assert any("all_reduce" in str(entry.get("profiling_name", "")) for entry in trace["entries"]), trace
    finally:
        dist.destroy_process_group()
