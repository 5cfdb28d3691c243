"""Hostile input through validate's path: every field of every built-in set in turn to a value a new user might
type (null, a wrong type, 0, -1, 10**12, a string, [], {}, 0.5, true, nan, inf), and the cases that validate
once accepted and the run then broke on. Each answer is a clean RecipeError naming a field, or a recipe that
loads, summarises and (on a GPU target) plans, in well under a second.

The walk reads each built-in once (`read_recipe`) and resolves every override against it (`resolve_recipe`,
what `load_recipe` runs after reading). Every case runs the schema, the rules and validate's summary table; the
memory check (`check_fit`, the planner's arithmetic, ~30 ms a case on a GPU target) runs for every field that
feeds the planner's arithmetic (`ARITHMETIC`) and for one field in `SAMPLE_EVERY` of the rest; the table is
rendered for that sample too (rich's cost, not ours).
"""

from __future__ import annotations

import io
import json
import time
from typing import Any, get_args

import pytest
from cli_helpers import assert_bad_input, run_cli
from pydantic import BaseModel
from rich.console import Console

from moe_train.cli.validate import summary_table
from moe_train.config import RecipeError, builtin_recipes, load_recipe
from moe_train.config.loader import read_recipe, resolve_recipe
from moe_train.config.mesh_shape import MeshShape, ep_node_split_problem, ep_split
from moe_train.config.rules import REQUIRED, RULES
from moe_train.config.schema import Recipe
from moe_train.plan.fit import check_fit
from moe_train.plan.params import _layer, count_parameters

# YAML text as --set reads it; the string is one rich would read as markup in the summary table.
HOSTILE = ("null", "[]", "{}", "0", "-1", "1000000000000", "'[/x]'", "0.5", "true", ".nan", ".inf")
# Fields whose values the planner's arithmetic walks or multiplies (and the summary counts): fit runs for all.
ARITHMETIC = (
    "model",
    "parallel",
    "train.seq_length",
    "train.micro_batch_size",
    "train.global_batch_size",
    "train.loss_chunk_tokens",
    "train.precision",
    "train.fp8",
    "launch.nodes",
    "launch.gpus_per_node",
    "launch.gpu",
    "launch.device",
    "data.reset_at_eod",
)
SAMPLE_EVERY = 7
CASE_SECONDS = 1.0  # generous: a case takes ~3 ms here (~40 ms with the planner on a GPU target)


def _key_paths(data: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, Any]]:
    """Every key of a resolved recipe, sections included (model.moe, train.fp8, ...), as (dotted path, value)."""
    out = []
    for key, value in data.items():
        path = (*prefix, str(key))
        out.append((".".join(path), value))
        if isinstance(value, dict):
            out += _key_paths(value, path)
    return out


def _problems_name_a_field(error: RecipeError, override: str) -> bool:
    """Every problem is one line `ORIGIN: dotted.field: message` (ORIGIN: a --set, or file:line:column)."""
    for line in error.problems:
        if "\n" in line:
            return False
        rest = line.removeprefix(f"--set {override}: ")
        if rest == line:  # a file position: `name (built-in):12:3: ...`
            rest = line.split(": ", 1)[-1]
        field = rest.split(": ", 1)[0]
        if not field or " " in field or not field[0].isalpha():
            return False
    return True


def _render(recipe: Recipe) -> None:
    Console(file=io.StringIO(), width=120).print(summary_table(recipe))


@pytest.mark.parametrize("name", builtin_recipes())
def test_every_field_hostile_value(name):
    source = read_recipe(name)
    fields = [(f, v) for f, v in _key_paths(load_recipe(name).model_dump(mode="json")) if f != "extends"]
    bad, slowest, cases = [], (0.0, ""), 0
    for index, (field, current) in enumerate(fields):
        sampled = index % SAMPLE_EVERY == 0
        for value in HOSTILE:
            override = f"{field}={value}"
            cases += 1
            started = time.process_time()  # this process's CPU time: the machine's load does not count
            try:
                recipe = resolve_recipe(source, [override])
                summary_table(recipe)
                if sampled or field.startswith(ARITHMETIC):
                    check_fit(recipe)
                if sampled or isinstance(current, str):  # a string may reach the table (run_dir '[/x]' once did)
                    _render(recipe)
            except RecipeError as error:
                if not _problems_name_a_field(error, override):
                    bad.append(f"{override}: unclear error {error.problems}")
            except Exception as error:  # noqa: BLE001 (the finding: anything but a RecipeError)
                bad.append(f"{override}: {type(error).__name__}: {error}")
            seconds = time.process_time() - started
            slowest = max(slowest, (seconds, override))
            if seconds > CASE_SECONDS:
                bad.append(f"{override}: {seconds:.2f} s")
    assert cases > 10 * len(HOSTILE), cases
    assert not bad, "\n".join(bad)
    print(f"{name}: {cases} cases, slowest {slowest[0] * 1000:.0f} ms ({slowest[1]})")


# ------------------------------------------------------------------------------ rules meet nulls


def _nullable_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted paths of every schema field that admits null, nested sections included."""
    out = []
    for name, info in model.model_fields.items():
        args = get_args(info.annotation)
        if type(None) in args:
            out.append(prefix + name)
        for kind in (info.annotation, *args):
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                out += _nullable_fields(kind, f"{prefix}{name}.")
    return out


def _with_null(data: dict, dotted: str) -> dict | None:
    """A copy of `data` with the field null, or None where its section is absent (moe of a dense model)."""
    data = json.loads(json.dumps(data))
    node: Any = data
    *parents, last = dotted.split(".")
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict):
        return None
    node[last] = None
    return data


def test_every_rule_meets_each_nullable_field_null():
    """Each rule runs on a recipe with one nullable field null wherever the sections it declares it reads are
    complete (REQUIRED), and never raises: a rule reading a section it does not declare, or a completeness check
    that misses a field, fails here (DeepSeek-V3's kv_lora_rank null once crashed fp8_gemm_shapes)."""
    nullable = _nullable_fields(Recipe)
    assert {"model.kv_lora_rank", "model.moe", "model.moe.capacity_factor", "parallel.dp"} <= set(nullable)
    runs = 0
    for name in builtin_recipes():
        base = load_recipe(name).model_dump(mode="json")
        # every rule: the fp8 shapes (cuda), and data checks (indexed) need these settings to be reached at all
        base["train"]["precision"] = "fp8"
        for dotted in nullable:
            data = _with_null(base, dotted)
            if data is None:
                continue
            try:
                recipe = Recipe.model_validate(data)
            except ValueError:
                continue  # the schema refuses this null itself
            incomplete = {section for section, required in REQUIRED.items() if required(recipe)}
            for rule in RULES:
                if not incomplete & set(rule.reads):
                    rule.check(recipe)
                    runs += 1
    assert runs > 1000, runs


@pytest.mark.parametrize("field", ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"])
def test_mla_field_null_is_required_not_a_crash(field):
    with pytest.raises(RecipeError) as caught:
        load_recipe("deepseek-v3", [f"model.{field}=null"])
    assert caught.value.problems == [
        f"--set model.{field}=null: model.{field}: required for family deepseek_v3 (multi-head latent attention)"
    ]


# --------------------------------------------------------------------------- accepted, then broken


def _refused(name: str, overrides: list[str], field: str, fragment: str = "") -> list[str]:
    started = time.perf_counter()
    with pytest.raises(RecipeError) as caught:
        load_recipe(name, overrides)
    assert time.perf_counter() - started < CASE_SECONDS
    lines = [line for line in caught.value.problems if f": {field}: " in line and fragment in line]
    assert lines, caught.value.problems
    return caught.value.problems


HIERARCHICAL = [
    "model.moe.dispatcher=hierarchical",
    "launch.nodes=2",
    "launch.gpus_per_node=3",
    "parallel.ep=2",
    "train.global_batch_size=48",
]

REFUSED = [
    # hangs: sizes no hardware holds
    *[(name, ["model.num_layers=1000000000000"], "model.num_layers", "10000") for name in builtin_recipes()],
    ("deepseek-v3", ["model.moe.num_experts=1000000000000"], "model.moe.num_experts", "65536"),
    ("deepseek-v3-tiny", ["model.mtp_layers=1000000000000"], "model.mtp_layers", "10000"),
    ("qwen3-moe-tiny", ["launch.nodes=1000000000000"], "launch.nodes", "100000"),
    ("qwen3-moe-tiny", ["launch.nodes=100001"], "launch.nodes", "100000"),
    ("qwen3-moe-tiny", ["launch.gpus_per_node=1000000000000"], "launch.gpus_per_node", "1024"),
    ("qwen3-moe-tiny", ["launch.gpus_per_node=1025"], "launch.gpus_per_node", "1024"),
    # timedelta overflows at bootstrap
    ("qwen3-tiny", ["launch.startup_timeout_minutes=.inf"], "launch.startup_timeout_minutes", "finite"),
    ("qwen3-tiny", ["launch.timeout_minutes=.inf"], "launch.timeout_minutes", "finite"),
    ("qwen3-tiny", ["launch.startup_timeout_minutes=1e300"], "launch.startup_timeout_minutes", "10080"),
    ("qwen3-tiny", ["launch.timeout_minutes=1e300"], "launch.timeout_minutes", "10080"),
    # booleans as counts
    ("qwen3-tiny", ["train.loss_chunk_tokens=true"], "train.loss_chunk_tokens", "valid integer"),
    ("qwen3-moe-tiny", ["parallel.cp=true"], "parallel.cp", "valid integer"),
    ("qwen3-moe-tiny", ["parallel.dp_replicate=true"], "parallel.dp_replicate", "valid integer"),
    ("qwen3-moe-tiny", ["parallel.ep=true"], "parallel.ep", "valid integer"),
    ("qwen3-tiny", ["train.steps=2.0"], "train.steps", "valid integer"),
    ("qwen3-tiny", ["train.lr=true"], "train.lr", "valid number"),
    # the hierarchical dispatcher's ep group across a node boundary (set-up failed in parallel/expert.py)
    ("qwen3-moe-tiny", HIERARCHICAL, "parallel.ep", "straddle node boundaries"),
    # a run called fp8 with no fp8 GEMM; a W&B run with no project
    ("qwen3-moe-tiny", ["train.precision=fp8", "train.fp8.modules=[]"], "train.fp8.modules", "empty"),
    ("qwen3-tiny", ["logging.wandb={project: ''}"], "logging.wandb.project", "empty"),
    ("qwen3-tiny", ["logging.wandb={project: '  '}"], "logging.wandb.project", "empty"),
    # mxfp8 on sm90: the error says how to plan it there
    (
        "deepseek-v3",
        ["launch.gpu=h100", "launch.gpus_per_node=8", "train.fp8.recipe=mxfp8"],
        "train.fp8.recipe",
        "--set train.fp8.recipe=blockwise",
    ),
]


@pytest.mark.parametrize(("name", "overrides", "field", "fragment"), REFUSED, ids=[f"{c[0]}:{c[2]}" for c in REFUSED])
def test_refused_with_the_field_named(name, overrides, field, fragment):
    _refused(name, overrides, field, fragment)


def test_the_largest_cluster_the_schema_admits_loads():
    """The bounds refuse only what no hardware holds: 100,000 nodes of 1,024 ranks still validate, fast."""
    started = time.perf_counter()
    recipe = load_recipe(
        "qwen3-moe-tiny",
        ["launch.nodes=100000", "launch.gpus_per_node=1024", f"train.global_batch_size={8 * 100_000 * 1024 * 2}"],
    )
    assert time.perf_counter() - started < CASE_SECONDS
    assert recipe.world_size == 100_000 * 1024


def test_hierarchical_nodes_that_hold_whole_ep_groups_load():
    recipe = load_recipe(
        "qwen3-moe-tiny",
        [
            "model.moe.dispatcher=hierarchical",
            "launch.nodes=2",
            "launch.gpus_per_node=4",
            "parallel.ep=8",
            "train.global_batch_size=64",
        ],
    )
    assert ep_split(MeshShape.from_recipe(recipe), 4) == (2, 4)


def _brute_force_split_problem(world_size: int, ep: int, etp: int, node_ranks: int) -> bool:
    """Whether some ep group's eplocal block holds ranks of two nodes, rank by rank on the expert mesh
    (pp 1, edp, ep, etp), as parallel/expert.py's node_split once checked it on the host."""
    shape = MeshShape(pp=1, dp=world_size, cp=1, tp=1, edp=world_size // (ep * etp), ep=ep, etp=etp)
    local = ep_split(shape, node_ranks)[1]
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(world_size):
        pp, edp, _, etp_index = shape.expert_coords(rank)
        groups.setdefault((pp, edp, etp_index), []).append(rank)
    for ranks in groups.values():
        nodes = [rank // node_ranks for rank in ranks]
        if len(ranks) % local or any(nodes[i] != nodes[i - i % local] for i in range(len(nodes))):
            return True
    return False


def test_ep_node_split_problem_matches_the_rank_by_rank_check():
    checked = 0
    for ep in range(1, 9):
        for etp in range(1, 5):
            for node_ranks in range(1, 13):
                for groups in (1, 2, 3):
                    world = ep * etp * groups
                    found = ep_node_split_problem(world_size=world, ep=ep, etp=etp, node_ranks=node_ranks)
                    assert (found is not None) == _brute_force_split_problem(world, ep, etp, node_ranks), (
                        ep,
                        etp,
                        node_ranks,
                        world,
                        found,
                    )
                    checked += found is not None
    assert checked > 50, checked  # the walk meets both answers


def test_prepare_refuses_an_empty_parquet_and_validate_a_0_document_dataset(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    empty = tmp_path / "empty.parquet"
    pq.write_table(pyarrow.table({"text": pyarrow.array([], pyarrow.string())}), empty)
    prefix = tmp_path / "data" / "empty"
    result = run_cli("data", "prepare", str(empty), "-o", str(prefix))
    assert_bad_input(result, f"{empty}: no documents")
    assert len(result.stderr.strip().splitlines()) == 1
    assert not prefix.parent.exists() or not list(prefix.parent.iterdir())  # nothing written, no temporary file

    # a 0-document dataset written some other way (an older moe-train) is refused where validate reads files
    from moe_train.data.indexed import IndexedDatasetWriter, dtype_for_vocab

    with IndexedDatasetWriter(str(prefix), dtype_for_vocab(257)):
        pass
    result = run_cli("validate", "qwen3-tiny", "--set", "data.source=indexed", "--set", f"data.paths=[{prefix}]")
    assert_bad_input(result, "data.paths.0: ", "holds 0 documents")


# ----------------------------------------------------------------------------------- CLI level


@pytest.mark.parametrize(
    "args",
    [
        ("validate", "deepseek-v3", "--set", "model.kv_lora_rank=null"),
        ("validate", "qwen3-8b", "--set", "model.num_layers=1000000000000"),
        ("validate", "deepseek-v3", "--set", "model.moe.num_experts=1000000000000"),
        ("validate", "qwen3-moe-tiny", "--set", "launch.nodes=1000000000000"),
        ("validate", "qwen3-tiny", "--set", "launch.startup_timeout_minutes=.inf"),
        ("validate", "qwen3-moe-tiny", "--set", "parallel.cp=true"),
        ("plan", "deepseek-v3", "--gpu", "h100", "--set", "train.fp8.recipe=mxfp8"),
    ],
    ids=lambda args: " ".join(args[1:]),
)
def test_cli_one_line_exit_2(args):
    started = time.perf_counter()
    result = run_cli(*args)
    assert time.perf_counter() - started < 10
    assert_bad_input(result)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    if args[0] == "plan":
        assert "--set train.fp8.recipe=blockwise" in result.stderr


# ----------------------------------------------------------------- arithmetic without walking the count


@pytest.mark.parametrize("name", builtin_recipes())
def test_count_parameters_counts_layers_without_walking_them(name):
    m = load_recipe(name).model
    embedding = m.vocab_size * m.hidden_size * (1 if m.tie_embeddings else 2) + m.hidden_size
    walked = [
        tuple(_layer(m, moe_layer=m.is_moe_layer(i), active=active) for active in (False, True))
        for i in range(m.num_layers)
    ]
    count = count_parameters(m)
    assert (count.total, count.active) == (embedding + sum(t for t, _ in walked), embedding + sum(a for _, a in walked))
    started = time.perf_counter()  # the layers past the recipe's are like its last
    deeper = count_parameters(m.model_copy(update={"num_layers": 10**12}))
    assert deeper.total - count.total == (10**12 - m.num_layers) * walked[-1][0]
    assert time.perf_counter() - started < CASE_SECONDS
