"""Recipes that are valid: loading, extends, overrides, the resolved YAML, built-ins and the commands."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import yaml
from cli_helpers import run_cli
from pydantic import ValidationError

from moe_train.config import builtin_recipes, dump_recipe, load_recipe
from moe_train.config.pp_layout import parse_layout
from moe_train.plan.params import count_parameters

TINY = ["qwen3-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny", "glm4-moe-tiny", "gpt-oss-tiny"]
FULL = ["deepseek-v3", "qwen3-235b-a22b", "qwen3-30b-a3b", "qwen3-8b", "glm4.5", "glm4.5-air", "gpt-oss-20b",
        "gpt-oss-120b"]


def test_builtins_are_listed_and_load():
    assert set(TINY + FULL) <= set(builtin_recipes())
    for name in builtin_recipes():
        assert load_recipe(name).name == name


def test_extends_deep_merges_and_overrides_apply_last(tmp_path):
    child = tmp_path / "mine.yaml"
    child.write_text(
        textwrap.dedent(
            """\
            extends: qwen3-moe-tiny
            name: mine
            model:
              moe: {top_k: 4}
            parallel:
              recompute: {granularity: selective, modules: [moe_act]}
            """
        )
    )
    recipe = load_recipe(child, ["train.lr=1e-3", "model.moe.capacity_factor=null", "parallel.recompute.modules=[moe]"])
    assert recipe.name == "mine"
    assert recipe.model.moe.top_k == 4
    assert recipe.model.moe.num_experts == 8  # kept from the parent
    assert recipe.train.lr == 1e-3
    assert recipe.model.moe.capacity_factor is None
    assert recipe.parallel.recompute.modules == ("moe",)  # lists replace, never append
    assert recipe.extends is None  # the resolved recipe stands alone


def test_relative_extends_chain(tmp_path):
    (tmp_path / "base.yaml").write_text("extends: qwen3-tiny\ntrain: {steps: 50}\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "leaf.yaml").write_text("extends: ../base.yaml\nname: leaf\n")
    recipe = load_recipe(tmp_path / "sub" / "leaf.yaml")
    assert (recipe.name, recipe.train.steps, recipe.model.family) == ("leaf", 50, "qwen3")


def test_slurm_times_stay_strings(tmp_path):
    path = tmp_path / "timed.yaml"
    path.write_text("extends: qwen3-tiny\nlaunch:\n  slurm: {time: 4:00:00}\ntrain: {lr: 1e-3}\n")
    recipe = load_recipe(path)
    assert (recipe.launch.slurm.time, recipe.train.lr) == ("4:00:00", 1e-3)
    assert load_recipe("qwen3-tiny", ["launch.slurm.time=48:00:00"]).launch.slurm.time == "48:00:00"
    assert load_recipe("qwen3-tiny", ["launch.slurm.time=60"]).launch.slurm.time == "60"
    (tmp_path / "again.yaml").write_text(dump_recipe(recipe))
    assert load_recipe(tmp_path / "again.yaml") == recipe


def test_resolved_recipe_is_frozen_and_round_trips(tmp_path):
    recipe = load_recipe("deepseek-v3", ["parallel.ep=16"])
    with pytest.raises(ValidationError):
        recipe.train.lr = 1.0
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_recipe(recipe))
    assert load_recipe(path) == recipe
    assert yaml.safe_load(path.read_text())["model"]["moe"]["router"]["num_groups"] == 8


# Published counts (model cards on huggingface.co): deepseek-ai/DeepSeek-V3 "671B total parameters with 37B
# activated" (the 14B MTP module not included); Qwen/Qwen3-235B-A22B "235B in total and 22B activated";
# Qwen/Qwen3-30B-A3B "30.5B in total and 3.3B activated"; Qwen/Qwen3-8B "8.2B"; Qwen/Qwen3-0.6B "0.6B". The cards
# round to the figures in quotes (DeepSeek's "37B" is 37.5B counted exactly); the finer figures below pin the
# exact counts of the published configs to 0.2%, and agree with the cards to their rounding. zai-org/GLM-4.5
# "355 billion total parameters and 32 billion active", GLM-4.5-Air "106 billion total ... 12 billion active": the
# cards' active figures leave out the embedding and head (32.08B and 12.18B here), their totals sit between the
# counts without and with the MTP module (352.8B / 356.8B; 106.9B / 109.2B). openai/gpt-oss-20b "21B parameters
# with 3.6B active", gpt-oss-120b "117B ... 5.1B active": the cards' active figures leave out the input embedding
# (3.61B and 5.13B here, 0.58B less than ours with both).
@pytest.mark.parametrize(
    ("name", "total", "active"),
    [
        ("deepseek-v3", 671.0e9, 37.5e9),
        ("qwen3-235b-a22b", 235.09e9, 22.19e9),
        ("qwen3-30b-a3b", 30.53e9, 3.35e9),
        ("qwen3-8b", 8.19e9, 8.19e9),
        ("glm4.5", 352.80e9, 33.63e9),
        ("glm4.5-air", 106.85e9, 13.42e9),
        ("gpt-oss-20b", 20.91e9, 4.19e9),
        ("gpt-oss-120b", 116.83e9, 5.71e9),
    ],
)
def test_full_size_recipes_are_the_published_architectures(name, total, active):
    params = count_parameters(load_recipe(name).model)
    assert params.total == pytest.approx(total, rel=2e-3)
    assert params.active == pytest.approx(active, rel=2e-3)


@pytest.mark.parametrize(("name", "card_total", "card_active"), [("gpt-oss-20b", 21e9, 3.6e9),
                                                                ("gpt-oss-120b", 117e9, 5.1e9)])
def test_gpt_oss_counts_round_to_the_cards(name, card_total, card_active):
    """The cards' figures to their rounding (0.5B, 0.05B), active without the input embedding."""
    m = load_recipe(name).model
    params = count_parameters(m)
    assert abs(params.total - card_total) < 0.5e9
    assert abs(params.active - m.vocab_size * m.hidden_size - card_active) < 0.05e9


def test_qwen3_0_6b_count_with_tied_embeddings():
    overrides = [
        "model.hidden_size=1024", "model.num_layers=28", "model.num_attention_heads=16", "model.num_query_groups=8",
        "model.ffn_hidden_size=3072", "model.tie_embeddings=true",
    ]
    params = count_parameters(load_recipe("qwen3-8b", overrides).model)
    assert params.total == pytest.approx(0.596e9, rel=2e-3)


@pytest.mark.parametrize("name", TINY)
def test_tiny_proxies_are_small_byte_level_cpu_recipes(name):
    """Small enough for a CPU, divisible by every tested layout's sizes (test_layouts_resolved.py resolves each
    layout and checks its mesh, and the MTP placement of an explicit pipeline layout)."""
    recipe = load_recipe(name)
    m = recipe.model
    assert m.hidden_size <= 256 and m.num_layers >= 8
    assert m.num_attention_heads % 4 == 0 and m.kv_heads % 4 == 0 and m.padded_vocab_size() % 4 == 0
    assert m.vocab_size >= 257 and recipe.train.seq_length % 8 == 0
    assert (recipe.data.source, recipe.data.tokenizer) == ("builtin", "byte")
    if m.moe is not None:
        assert m.moe.num_experts >= 8


def test_deepseek_layout_strings():
    stages = parse_layout("Et*3|(tt|)*29m|L")
    assert len(stages) == 32 and sum(s.layers for s in stages) == 61
    assert stages[0].embedding and stages[-1].loss and stages[-2].mtp == 1


def test_validate_prints_a_summary():
    result = run_cli("validate", "qwen3-30b-a3b", "--set", "parallel.ep=16", "--set", "launch.nodes=8")
    assert result.code == 0, result.stderr
    for fragment in ("30.53B total", "3.35B active", "ep 16", "world size", "64", "1,048,576 tokens per step"):
        assert fragment in result.stdout, fragment


def test_recipes_list_and_show():
    listed = run_cli("recipes", "list")
    assert listed.code == 0 and all(name[:12] in listed.stdout for name in TINY + FULL)
    shown = run_cli("recipes", "show", "qwen3-tiny", "--set", "train.steps=7")
    assert shown.code == 0
    assert yaml.safe_load(shown.stdout)["train"]["steps"] == 7


def test_schema_is_json_schema_of_the_recipe(tmp_path):
    result = run_cli("schema")
    schema = json.loads(result.stdout)
    assert {"model", "parallel", "train", "data", "launch"} <= set(schema["properties"])
    assert schema["$defs"]["ModelConfig"]["additionalProperties"] is False
    run_cli("schema", "-o", str(tmp_path / "s.json"))
    assert json.loads((tmp_path / "s.json").read_text()) == schema


def test_login_node_commands_do_not_import_torch():
    code = textwrap.dedent(
        """
        import sys
        from typer.testing import CliRunner
        from moe_train.cli.main import app
        for args in (["validate", "deepseek-v3"], ["schema"], ["recipes", "list"], ["recipes", "show", "qwen3-8b"]):
            result = CliRunner().invoke(app, args)
            assert result.exit_code == 0, (args, result.output)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy"))
        print(loaded)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_help_on_every_command():
    for args in (["--help"], ["validate", "--help"], ["recipes", "show", "--help"], ["schema", "--help"]):
        result = run_cli(*args)
        assert result.code == 0 and "Usage" in result.stdout
    assert "Example" in run_cli("validate", "--help").stdout
