"""`moe-train report`: plots and summary from a real training run's metrics.jsonl and from hand-written ones (a run
still writing its last line, a sweep folder, a dense run), torch-free, and bad input as one line with exit 2."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
from matplotlib.collections import QuadMesh
from matplotlib.image import imread

from moe_train.report.curves import loss_figure, save, throughput_figure
from moe_train.report.expert_load import bin_columns, expert_load_figure
from moe_train.report.history import load_histories, read_history
from moe_train.report.summary import describe, summarize
from tests.cli_helpers import assert_bad_input, run_cli

REPO = Path(__file__).resolve().parents[1]
EXPERTS = 8


class TrainedRun(NamedTuple):
    run_dir: Path
    summary: Any  # moe_train.train.loop.Summary: the trainer's own end-of-run figures


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> TrainedRun:
    """A real qwen3-moe-tiny run of 4 steps with eval every 2: the metrics.jsonl the trainer writes. One thread:
    on this shared machine two contend with other processes and take three times as long."""
    import torch

    from moe_train.config import load_recipe
    from moe_train.train.loop import Trainer

    run_dir = tmp_path_factory.mktemp("run") / "tiny"
    overrides = ["model.num_layers=2", "train.seq_length=32", "train.global_batch_size=4",
                 "train.micro_batch_size=2", "train.warmup_steps=1", "train.precision=fp32", "logging.interval=1",
                 "checkpoint.interval=null", "train.steps=4", "train.eval_interval=2", "train.eval_steps=1",
                 f"run_dir={run_dir}"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = Trainer(load_recipe("qwen3-moe-tiny", overrides)).train()
    finally:
        torch.set_num_threads(threads)
    return TrainedRun(run_dir, summary)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_line(step: int, loss: float | None, *, loads: dict[str, list[float]] | None = None,
               dropped: float = 0.0) -> dict:
    """A train record as docs/interfaces.md defines it; `loads` (layer -> shares) makes it an MoE run."""
    line = {"kind": "train", "step": step, "loss": loss, "lm_loss": None if loss is None else loss - 0.01,
            "aux_loss": 0.01, "grad_norm": 1.0, "lr": 1e-3, "tokens": 1024 * step,
            "tokens_per_s": 900.0 + 13 * step, "tflops_per_device": 1.0, "mfu": 0.2 + 0.01 * step,
            "memory_bytes": 1, "skipped": 0}
    if loads is not None:
        line["moe"] = {
            layer: {"load_max_over_mean": max(shares) * len(shares), "load_cv": 0.0,
                    "dropped_fraction": dropped, "load": shares, "router_entropy": 1.0}
            for layer, shares in loads.items()}
    return line


def skewed(step: int) -> dict[str, list[float]]:
    """Layer 0 sends half its assignments to expert (step % 8), layer 1 is spread evenly."""
    hot = [0.5 if e == step % EXPERTS else 0.5 / (EXPERTS - 1) for e in range(EXPERTS)]
    return {"0": hot, "1": [1 / EXPERTS] * EXPERTS}


def write_metrics(folder: Path, lines: list[dict | str], *, complete: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines)
    (folder / "metrics.jsonl").write_text(text)
    if complete:
        (folder / "COMPLETE").write_text("")
    return folder


def read_png(path: Path) -> np.ndarray:
    """The image as rows x columns x RGB(A) floats; a plausible plot size, not a sliver or a poster."""
    assert path.is_file(), path
    image = imread(path)
    height, width = image.shape[:2]
    assert 300 <= height <= 6000 and 400 <= width <= 6000, (path, image.shape)
    assert image[..., :3].std() > 0.05, f"{path} is blank"
    return image


def colored_pixels(image: np.ndarray) -> int:
    """Pixels neither white, grey nor black: the heatmap's over- and under-loaded experts (and the colour bar,
    the lines)."""
    rgb = image[..., :3]
    return int((rgb.max(axis=-1) - rgb.min(axis=-1) > 0.15).sum())


def test_real_run_plots_and_summary_equal_the_file(trained: TrainedRun) -> None:
    run_dir = trained.run_dir
    result = run_cli("report", str(run_dir))
    assert result.code == 0, result.stderr
    out = run_dir / "report"  # the default output folder
    assert sorted(p.name for p in out.iterdir()) == ["expert_load.png", "loss.png", "throughput.png"]
    for name in ("loss.png", "throughput.png"):
        read_png(out / name)
    assert colored_pixels(read_png(out / "expert_load.png")) > 5000

    # Every figure recomputed from the file here, independently of the report's code.
    lines = records(run_dir)
    train = [r for r in lines if r["kind"] == "train"]
    evals = [r for r in lines if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and [r["step"] for r in evals] == [2, 4]
    best = min(train, key=lambda r: r["loss"])
    best_eval = min(evals, key=lambda r: r["loss"])
    tokens_per_s = 3 / sum(1 / r["tokens_per_s"] for r in train[1:])  # tokens over seconds of steps 2-4
    mfu = 3 / sum(1 / r["mfu"] for r in train[1:])
    worst = [max(((s["load_max_over_mean"], layer) for layer, s in r["moe"].items())) for r in (train[0], train[-1])]
    dropped = [s["dropped_fraction"] for r in train for s in r["moe"].values()]

    s = summarize(read_history(run_dir, "tiny"))
    assert (s.complete, s.last_step, s.logged_steps, s.skipped, s.tokens) == (True, 4, 4, 0, 4 * 4 * 32)
    assert (s.first_loss.value, s.final_loss.value) == (train[0]["loss"], train[-1]["loss"])
    assert (s.best_loss.step, s.best_loss.value) == (best["step"], best["loss"])
    assert (s.final_eval.step, s.final_eval.value) == (4, evals[-1]["loss"])
    assert (s.best_eval.step, s.best_eval.value) == (best_eval["step"], best_eval["loss"])
    assert s.tokens_per_s == pytest.approx(tokens_per_s, rel=1e-12) and s.mfu == pytest.approx(mfu, rel=1e-12)
    # The trainer timed the same steps (all logged): its end-of-run figures are the report's.
    assert s.tokens_per_s == pytest.approx(trained.summary.tokens_per_s, rel=1e-9)
    assert s.mfu == pytest.approx(trained.summary.mfu, rel=1e-9)
    assert (s.balance_start.load_max_over_mean, s.balance_start.layer) == worst[0]
    assert (s.balance_end.load_max_over_mean, s.balance_end.layer) == worst[1]
    assert s.dropped_mean == pytest.approx(sum(dropped) / len(dropped))

    text = result.stdout
    assert "run tiny: complete" in text and "steps: 4 (4 logged, 0 skipped), 512 tokens" in text
    assert f"loss: {train[0]['loss']:.4f} -> {train[-1]['loss']:.4f} (best {best['loss']:.4f} at step " \
           f"{best['step']})" in text
    assert f"eval loss: {evals[-1]['loss']:.4f} at step 4" in text
    assert f"speed: {tokens_per_s:,.0f} tokens/s, MFU {mfu:.2%}" in text
    assert f"{worst[0][0]:.2f} (layer {worst[0][1]}) at step 1 -> {worst[1][0]:.2f} (layer {worst[1][1]}) at step 4" \
        in text
    assert f"dropped: {sum(dropped) / len(dropped):.2%}" in text


def test_heatmap_draws_each_experts_load_relative_to_the_mean(trained: TrainedRun) -> None:
    history = read_history(trained.run_dir, "tiny")
    figure = expert_load_figure(history)
    meshes = {axes.get_title(): c for axes in figure.axes for c in axes.collections
              if isinstance(c, QuadMesh) and axes.get_title()}  # the colour bar's mesh has no title
    assert set(meshes) == {"layer 0", "layer 1"}
    train = [r for r in records(trained.run_dir) if r["kind"] == "train"]
    for layer in ("0", "1"):
        expected = np.array([[r["moe"][layer]["load"][e] * EXPERTS for r in train] for e in range(EXPERTS)])
        drawn = np.asarray(meshes[f"layer {layer}"].get_array()).reshape(EXPERTS, len(train))
        np.testing.assert_allclose(drawn, expected, rtol=1e-12)
        assert np.abs(expected - 1).max() > 0.2  # routing at init is uneven: there is something to see


def test_balanced_heatmap_is_white_and_skewed_one_is_not(tmp_path: Path) -> None:
    even = {"0": [1 / EXPERTS] * EXPERTS, "1": [1 / EXPERTS] * EXPERTS}
    images = {}
    for name, loads in (("even", lambda step: even), ("skew", skewed)):
        folder = write_metrics(tmp_path / name, [train_line(step, 3.0, loads=loads(step)) for step in range(1, 21)])
        images[name] = read_png(save(expert_load_figure(read_history(folder, name)), tmp_path / f"{name}.png"))
    even_image, skew_image = images["even"], images["skew"]
    assert even_image.shape == skew_image.shape
    # The colour bar is in both; only the skewed run's layer-0 panel adds red and blue cells.
    extra = colored_pixels(skew_image) - colored_pixels(even_image)
    assert extra > 0.02 * even_image.shape[0] * even_image.shape[1], extra


def test_running_run_skips_a_half_written_last_line(tmp_path: Path) -> None:
    lines = [train_line(step, 4.0 - 0.25 * step, loads=skewed(step), dropped=0.01 * step) for step in range(1, 6)]
    lines.insert(3, {"kind": "eval", "step": 3, "loss": 3.5})
    cut = json.dumps(train_line(6, 2.0, loads=skewed(6)))[:90]
    run_dir = write_metrics(tmp_path / "live", [*lines, cut])
    result = run_cli("report", str(run_dir), "-o", str(tmp_path / "out"))
    assert result.code == 0, result.stderr
    assert "run live: not complete" in result.stdout
    assert "steps: 5 (5 logged, 0 skipped)" in result.stdout
    assert "loss: 3.7500 -> 2.7500 (best 2.7500 at step 5)" in result.stdout
    assert "eval loss: 3.5000 at step 3" in result.stdout
    assert "tokens/s" in result.stdout and "unreadable" not in result.stdout
    mean_speed = 4 / sum(1 / (900.0 + 13 * step) for step in range(2, 6))
    assert f"speed: {mean_speed:,.0f} tokens/s" in result.stdout
    # Layer 0 holds half of the assignments on one of 8 experts at every step: max/mean 4; layer 1 is even.
    assert "4.00 (layer 0) at step 1 -> 4.00 (layer 0) at step 5" in result.stdout
    assert f"dropped: {sum(0.01 * s for s in range(1, 6)) / 5:.2%} of expert assignments on average, 5.00% at " \
           "step 5" in result.stdout
    for name in ("loss.png", "throughput.png", "expert_load.png"):
        read_png(tmp_path / "out" / name)

    # A broken line in the middle is not a write in progress: skipped, but said.
    write_metrics(run_dir, [lines[0], "{not json\n", *lines[1:], cut])
    text = describe(summarize(read_history(run_dir, "live")))
    assert text[1].startswith("steps: 5 (5 logged") and text[-1] == \
        "warning: 1 unreadable line(s) in metrics.jsonl skipped"


def test_sweep_folder_one_curve_per_point(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    final = {"lr-1e-3": 3.1, "lr-3e-3": 2.6}
    for name, last in final.items():
        steps = [train_line(step, last + 0.1 * (4 - step), loads=skewed(step)) for step in range(1, 5)]
        write_metrics(sweep / name, [*steps, {"kind": "eval", "step": 4, "loss": last + 0.05}], complete=True)
    write_metrics(sweep / "lr-1e-2", [])  # queued, not started: left out with a note
    (sweep / "logs").mkdir()
    result = run_cli("report", str(sweep), "-o", str(tmp_path / "out"))
    assert result.code == 0, result.stderr
    assert "lr-1e-2" in result.stderr and "no training step logged yet" in result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line.startswith("lr-")}
    assert set(rows) == set(final)
    for name, last in final.items():
        assert rows[name][1:5] == ["4", f"{last:.4f}", f"{last:.4f}", f"{last + 0.05:.4f}"]
    names = ["loss.png", "throughput.png", "expert_load-lr-1e-3.png", "expert_load-lr-3e-3.png"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(names)
    for name in names:
        read_png(tmp_path / "out" / name)

    histories, _ = load_histories(sweep)
    labels = loss_figure(histories).axes[0].get_legend_handles_labels()[1]
    assert {"lr-1e-3", "lr-3e-3"} <= set(labels)
    lines = [line for line in throughput_figure(histories).axes[0].get_lines() if line.get_label() in final]
    assert {line.get_label(): list(line.get_ydata()) for line in lines} == {
        name: [900.0 + 13 * step for step in range(1, 5)] for name in final}


def test_dense_run_has_curves_and_no_heatmap(tmp_path: Path) -> None:
    run_dir = write_metrics(tmp_path / "dense", [train_line(1, 5.0), train_line(2, None), train_line(3, 4.0)])
    result = run_cli("report", str(run_dir), "-o", str(tmp_path / "out"))
    assert result.code == 0, result.stderr
    assert "expert balance: no MoE layers logged" in result.stdout
    assert "loss: 5.0000 -> 4.0000 (best 4.0000 at step 3)" in result.stdout  # the skipped step's null left out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["loss.png", "throughput.png"]


def test_binning_averages_consecutive_steps_and_tiles_the_step_axis() -> None:
    steps = np.array([*range(10, 1000, 10), 995, *range(1000, 2001, 10)])  # an extra line at step 995
    matrix = np.random.default_rng(0).random((3, len(steps)))
    edges, binned = bin_columns(steps, matrix, max_columns=50)
    size = math.ceil(len(steps) / 50)
    assert binned.shape == (3, math.ceil(len(steps) / size)) and len(edges) == binned.shape[1] + 1
    np.testing.assert_allclose(binned[:, 0], matrix[:, :size].mean(axis=1))
    np.testing.assert_allclose(binned[:, -1], matrix[:, (binned.shape[1] - 1) * size:].mean(axis=1))
    assert np.all(np.diff(edges) > 0) and edges[0] < steps[0] and edges[-1] > steps[-1]
    assert edges[1] == (steps[size - 1] + steps[size]) / 2
    same_edges, same = bin_columns(steps, matrix, max_columns=len(steps))
    np.testing.assert_array_equal(same, matrix)
    assert len(same_edges) == len(steps) + 1


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    assert_bad_input(run_cli("report", str(tmp_path / "nope")), "nope: no such folder")
    (tmp_path / "empty").mkdir()
    assert_bad_input(run_cli("report", str(tmp_path / "empty")), "empty: no metrics.jsonl")
    write_metrics(tmp_path / "started", [])
    assert_bad_input(run_cli("report", str(tmp_path / "started")), "metrics.jsonl: no training step logged yet")
    write_metrics(tmp_path / "garbage", ["{\"kind\": \"train\", \"st"])
    assert_bad_input(run_cli("report", str(tmp_path / "garbage")), "no training step logged yet")
    run_dir = write_metrics(tmp_path / "ok", [train_line(1, 3.0)])
    (tmp_path / "file").write_text("")
    assert_bad_input(run_cli("report", str(run_dir), "-o", str(tmp_path / "file")), "is not a folder")
    assert_bad_input(run_cli("report", str(tmp_path / "file")), "not a folder")
    for args in (["nope"], ["empty"], ["started"]):
        assert len(run_cli("report", str(tmp_path / args[0])).stderr.strip().splitlines()) == 1


def test_report_imports_matplotlib_and_never_torch(tmp_path: Path) -> None:
    run_dir = write_metrics(tmp_path / "run", [train_line(step, 3.0, loads=skewed(step)) for step in (1, 2)])
    code = textwrap.dedent(f"""
        import sys
        from moe_train.cli.main import app
        assert "matplotlib" not in sys.modules  # the CLI loads it only when a report is drawn
        try:
            app(["report", {str(run_dir)!r}])
        except SystemExit as exit:
            assert exit.code in (0, None), exit.code
        import matplotlib
        print(sorted(m for m in sys.modules if m.split(".")[0] == "torch"), matplotlib.get_backend())
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1].lower() == "[] agg"
    assert (run_dir / "report" / "expert_load.png").is_file()


def test_a_skipped_steps_nulls_are_gaps_not_errors(tmp_path: Path) -> None:
    nulls = train_line(2, None, loads=skewed(2))
    nulls["skipped"] = 1
    for stats in nulls["moe"].values():
        stats.update(load_max_over_mean=None, load_cv=None, dropped_fraction=None)
    third = train_line(3, 2.5, loads=skewed(3), dropped=0.02)
    third["skipped"] = 1
    run_dir = write_metrics(tmp_path / "run", [train_line(1, 3.0, loads=skewed(1)), nulls, third])
    summary = summarize(read_history(run_dir, "run"))
    assert (summary.skipped, summary.final_loss.value, summary.best_loss.step) == (1, 2.5, 3)
    assert (summary.balance_start.step, summary.balance_end.step) == (1, 3)
    assert (summary.dropped_mean, summary.dropped_end) == (pytest.approx(0.01), 0.02)
    balance = expert_load_figure(read_history(run_dir, "run")).axes[-1]
    layer0 = next(line for line in balance.get_lines() if line.get_label() == "layer 0")
    assert list(layer0.get_xdata()) == [1, 2, 3] and math.isnan(layer0.get_ydata()[1])
