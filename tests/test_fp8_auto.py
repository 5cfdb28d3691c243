"""`train.fp8.recipe: auto` (config/fp8_auto.py): blockwise on sm90, mxfp8 on sm100 and later, tensorwise on the
CPU, resolved from the hardware table on the login node (validate, plan, measure) as the ranks resolve it from
the device's capability; the built-in deepseek-v3 takes it, so it plans on H100s (blockwise) and on its own
B200s (mxfp8, as before)."""

from __future__ import annotations

import json

import pytest
from cli_helpers import run_cli

from moe_train.config import load_recipe
from moe_train.config.fp8_auto import resolve_fp8_recipe, with_fp8_resolved
from moe_train.config.hardware import HARDWARE


@pytest.mark.parametrize(("device", "capability", "expected"), [
    ("cuda", 9.0, "blockwise"), ("cuda", 10.0, "mxfp8"), ("cuda", 10.3, "mxfp8"), ("cuda", 8.0, "tensorwise"),
    ("cuda", None, "tensorwise"), ("cpu", None, "tensorwise"), ("cpu", 10.0, "tensorwise")])
def test_auto_resolves_by_device_and_capability(device, capability, expected):
    assert resolve_fp8_recipe("auto", device=device, capability=capability) == expected
    assert resolve_fp8_recipe("rowwise", device=device, capability=capability) == "rowwise"


def test_the_table_and_the_device_resolve_alike():
    """Every GPU of the table: the login node's resolution (launch.gpu's table entry) is the ranks' (the same
    function of the device's capability, moe_train/entry.py)."""
    for gpu, hardware in HARDWARE.items():
        if gpu == "cpu" or not hardware.supports_fp8:
            continue
        recipe = load_recipe("deepseek-v3", [f"launch.gpu={gpu}", f"launch.gpus_per_node={hardware.gpus_per_node}",
                                             "parallel.ep=8", "parallel.pp=1", "parallel.vpp=1",
                                             "parallel.pp_schedule=1f1b", "parallel.pp_layout=null"],
                             check_files=False)
        assert recipe.train.fp8.recipe == "auto"
        device_side = resolve_fp8_recipe("auto", device="cuda", capability=hardware.compute_capability)
        assert with_fp8_resolved(recipe).train.fp8.recipe == device_side, gpu
    cpu = load_recipe("qwen3-moe-tiny", ["train.precision=fp8", "train.fp8.recipe=auto"])
    assert with_fp8_resolved(cpu).train.fp8.recipe == "tensorwise"


def test_deepseek_v3_plans_on_h100_with_blockwise_and_on_b200_with_mxfp8():
    h100 = run_cli("plan", "deepseek-v3", "--gpu", "h100", "--json")
    assert h100.code == 0, h100.stderr
    assert json.loads(h100.stdout)["fp8_recipe"] == "blockwise"
    own = json.loads(run_cli("plan", "deepseek-v3", "--json").stdout)
    assert own["fp8_recipe"] == "mxfp8" and own["gpu"] == "b200"
    shown = run_cli("validate", "deepseek-v3")
    assert shown.code == 0 and "fp8 mxfp8 (auto on b200)" in " ".join(shown.stdout.split())
