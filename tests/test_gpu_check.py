"""bench/gpu/check.py's CPU rehearsal: every stage of the GPU check runs here on tiny shapes, so the script
cannot fail on the H200 over a typo (issue 21). The figures are CPU figures and are only checked for shape and
for the checks each stage makes (the loss falls, resume equals the straight run, grouped_mm equals the loop)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from processes import run_bounded

REPO = Path(__file__).resolve().parents[1]
CHECK = REPO / "bench" / "gpu" / "check.py"
STAGES = ["probe", "proxy", "hf_proxy", "grouped_mm", "sdpa", "fp8", "tiny_run", "resume", "te", "compile"]


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
    assert figures["probe"]["missing_apis"] == [] and figures["probe"]["matmul_ceiling"]["tflops"] > 0
    assert report["ratios"]["proxy_tokens_per_s_vs_transformers"] > 0
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
    assert compiled["compiled"]["graphs_first_step"] == compiled["compiled"]["graphs"]  # none after step 1
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


def _check_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stage_timeouts_fit_inside_the_deadline_and_the_deadline_inside_check_sh() -> None:
    check = _check_module()
    assert list(check.TIMEOUTS) == STAGES  # headline stages first, compile last
    assert sum(check.TIMEOUTS.values()) < check.DEADLINE
    outer = re.search(r"timeout (\d+) python3 \"\$REPO/bench/gpu/check.py\"", (CHECK.parent / "check.sh").read_text())
    assert outer and int(outer.group(1)) > check.DEADLINE


@pytest.mark.slow
def test_dry_run_builds_every_stage_and_validates_its_recipes_for_cuda(tmp_path: Path) -> None:
    """Nothing runs; every recipe a stage trains is loaded for cuda (validate's mxfp8 refusal on an H200 and te
    without transformer-engine are the stages' own findings), eager everywhere but the compile stage."""
    done = run_bounded([sys.executable, str(CHECK), "--dry-run", "--out", str(tmp_path)], timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "dry_run.json").read_text())
    assert list(report["stages"]) == STAGES and not (tmp_path / "figures.json").exists()
    recipes = {name: entry["recipes"] for name, entry in report["stages"].items()}
    assert all(recipes[name] for name in ("proxy", "hf_proxy", "fp8", "tiny_run", "resume", "te", "compile"))
    sets = [s for name in ("tiny_run", "resume", "fp8") for r in recipes[name] for s in r["sets"]]
    assert sets.count("train.compile=false") == 1 + 3 + 4
    assert [r["sets"].count("train.precision=bf16") for r in recipes["tiny_run"] + recipes["resume"]] == [1] * 4
    assert [r["extra"][0] for r in recipes["compile"]] == ["train.compile=false", "train.compile=true"]


@pytest.mark.slow
def test_the_deadline_and_sigterm_still_write_the_figures(tmp_path: Path) -> None:
    """A deadline that leaves no time records the stages after it "not run"; a SIGTERM kills the running stage
    with its process group and figures.json still says what ran, what was killed and what was not run."""
    done = run_bounded([sys.executable, str(CHECK), "--device", "cpu", "--only", "tiny_run,grouped_mm", "--deadline",
                        "2.5", "--out", str(tmp_path / "deadline")], timeout=120, cwd=REPO)
    stages = json.loads((tmp_path / "deadline" / "figures.json").read_text())["stages"]
    assert done.returncode == 1 and stages["tiny_run"]["status"] == "timeout"  # a training run takes longer
    assert stages["tiny_run"]["timeout_s"] <= 2.5
    assert stages["grouped_mm"] == {"status": "not run", "why": "the check's deadline passed before it"}
    out = tmp_path / "term"
    process = subprocess.Popen([sys.executable, str(CHECK), "--device", "cpu", "--only", "sdpa,probe", "--out",
                                str(out)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # the signal goes as sdpa starts (its child needs a second or more to import torch): a fixed 3 s sleep lost
    # the race both ways, the check still importing (before its SIGTERM handler) or sdpa already done
    guard = threading.Timer(120, process.kill)  # a check that never starts a stage ends the wait (EOF)
    guard.start()
    begun = [process.stdout.readline()]
    while begun[-1] and begun[-1].strip() != "sdpa: started":
        begun.append(process.stdout.readline())
    guard.cancel()
    assert begun[-1].strip() == "sdpa: started", begun
    process.send_signal(signal.SIGTERM)
    stdout, _ = process.communicate(timeout=60)
    stages = json.loads((out / "figures.json").read_text())["stages"]
    assert process.returncode == 1, stdout
    assert stages["sdpa"]["status"] == "killed" and stages["probe"] == {"status": "not run"}
