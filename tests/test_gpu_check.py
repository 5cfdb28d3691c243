"""bench/gpu/check.py's CPU rehearsal: every stage of the GPU check runs here on tiny shapes, so the script
cannot fail on the H200 over a typo (issue 21). The figures are CPU figures and are only checked for shape and
for the checks each stage makes (the loss falls, resume equals the straight run, grouped_mm equals the loop)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from processes import run_bounded

REPO = Path(__file__).resolve().parents[1]
CHECK = REPO / "bench" / "gpu" / "check.py"
STAGES = ["probe", "grouped_mm", "sdpa", "tiny_run", "proxy", "fp8", "te", "hf_proxy", "resume", "compile"]


@pytest.mark.slow
def test_cpu_rehearsal_runs_every_stage(tmp_path: Path) -> None:
    done = run_bounded([sys.executable, str(CHECK), "--device", "cpu", "--in-process", "--out", str(tmp_path)],
                       timeout=400, cwd=REPO)
    report = json.loads((tmp_path / "figures.json").read_text())
    assert list(report["stages"]) == STAGES, done.stdout + done.stderr
    failed = {k: v for k, v in report["stages"].items() if v["status"] != ("skipped" if k == "te" else "ok")}
    assert not failed, json.dumps(failed, indent=1)[:4000]
    assert done.returncode == 0
    figures = {k: v["figures"] for k, v in report["stages"].items()}
    assert figures["te"]["skipped"].startswith("transformer-engine is not installed here")
    fp8 = figures["fp8"]["recipes"]
    assert {r: f["linear"]["table"] for r, f in fp8.items()} == {
        "tensorwise": "real", "rowwise": "real", "blockwise": "emulated", "mxfp8": "emulated"}  # the CPU's row
    for recipe, f in fp8.items():
        assert 1e-3 < f["linear"]["emulated"]["rel_error"] < 0.1 and f["grouped"]["table"] == "emulated", recipe
        assert f["probe_problems"] == [] and ("real" in f["linear"]) == (f["linear"]["table"] == "real")
    step = fp8["tensorwise"]["step"]
    assert step["finite"] and step["gemms"]["linear/forward/real"] > 0 and step["gemms"]["grouped/forward/emulated"] > 0
    assert figures["probe"]["missing_apis"] == []
    assert figures["grouped_mm"]["max_rel_diff"] == {"out": 0.0, "grad_x": 0.0, "grad_w": 0.0}  # fp32, CPU
    assert figures["grouped_mm"]["empty_experts"] > 0
    assert figures["sdpa"]["gqa_documents"]["kernel"] == "ScaledDotProductFlashAttentionForCpuBackward0"
    assert figures["sdpa"]["table"]["sdpa_backends"] == ["FLASH_ATTENTION", "MATH"]
    assert figures["sdpa"]["mla_padded_causal"]["kernel"] == "ScaledDotProductFlashAttentionForCpuBackward0"
    engine = figures["grouped_mm"]["engine_experts"]
    assert engine["table_choice"] == "grouped_mm"  # fp32 on the CPU
    for path in ("grouped_mm", "padded_bmm"):
        assert max(engine[f"{path}_max_rel_diff"].values()) < 1e-5, engine
    assert figures["tiny_run"]["loss_fell"] and figures["resume"]["straight"] == figures["resume"]["resumed"]
    assert figures["proxy"]["eager"]["tokens_per_s"] > 0 and figures["hf_proxy"]["tokens_per_s"] > 0
    compiled = figures["compile"]
    assert compiled["backend"] == "aot_eager" and compiled["passed"], compiled
    assert compiled["compiled"]["graphs"] > 0 and compiled["eager"]["graphs"] == 0
    assert compiled["loss_max_rel_diff"] < 1e-5 and compiled["speedup"] > 0


@pytest.mark.slow
def test_stage_runs_in_its_own_process_under_a_timeout(tmp_path: Path) -> None:
    done = run_bounded([sys.executable, str(CHECK), "--device", "cpu", "--only", "probe", "--out", str(tmp_path)],
                       timeout=200, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "figures.json").read_text())
    assert report["stages"]["probe"]["status"] == "ok" and "probe: ok" in (tmp_path / "check.log").read_text()
    bad = run_bounded([sys.executable, str(CHECK), "--only", "nope", "--out", str(tmp_path)], timeout=60,
                      cwd=REPO)
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown stage(s) nope")


def test_check_scripts_parse() -> None:
    for script in ("check.sh", "fetch_wheels.sh"):
        parsed = subprocess.run(["bash", "-n", str(REPO / "bench" / "gpu" / script)], capture_output=True, text=True)
        assert parsed.returncode == 0, (script, parsed.stderr)
