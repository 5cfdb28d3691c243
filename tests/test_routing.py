"""Real routing (docs/interfaces.md, "Real routing"): per-rank load, the routing trace, expert placement and
`experts place`, on a router skewed by `model.moe.router.logit_bias` (real routing, biased logits).

The multi-rank cases run one worker job per world size (tests/workers/train_layouts.py): under EP2 and EP4,
with the alltoall, allgather and hierarchical dispatchers, a placement packed by `experts place` trains what the
contiguous one does (fp32, every loss within 1e-6, every parameter by global expert id), the per-rank loads
equal the expert counts summed by the placement, the placement lowers the measured max/mean rank load, and a
run resumed under a changed placement equals the straight one (its optimizer state read back by expert).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_bad_input, run_cli
from multirank import run_ranks

from moe_train.config.placement import Placement, PlacementError, contiguous, read_placement
from moe_train.plan.routing import max_over_mean, pack, rank_loads, read_trace
from moe_train.train.rank_load import rank_figures

# Two MoE layers of 8 experts, fp32, one micro-batch of 1 sequence per step and rank (dp 4 needs 2 per rank).
TINY = [
    "model.num_layers=2",
    "train.seq_length=32",
    "train.global_batch_size=8",
    "train.warmup_steps=1",
    "train.lr=1e-3",
    "train.min_lr=1e-4",
    "train.adam_eps=1e-6",
    "train.eval_interval=null",
    "checkpoint.interval=null",
    "logging.interval=1",
    "train.micro_batch_size=1",
    "train.precision=fp32",
]
# Favours experts 0-3, which the contiguous placement puts on one rank of EP2 (and two of EP4).
SKEW = "model.moe.router.logit_bias=[1.2,1.0,0.8,0.6,0,0,0,0]"
EXPERTS = 8
STEPS = 2


def write_trace(run_dir: Path, steps: list[dict[str, list[int]]], *, ep: int = 1) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": i + 1, "ep": ep, "experts": experts, "ranks": {}}) for i, experts in enumerate(steps)]
    (run_dir / "routing.jsonl").write_text("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------------- unit tests


def test_pack_is_a_permutation_and_optimal_on_small_cases() -> None:
    """Against every placement of 8 experts on 2 or 4 ranks (brute force): the greedy pack plus swaps finds the
    optimal max rank load on these loads, and always places each expert exactly once, E/ep per rank."""
    cases = [
        [40, 30, 20, 10, 5, 5, 1, 1],
        [9, 9, 9, 9, 1, 1, 1, 1],
        [100, 1, 1, 1, 1, 1, 1, 1],
        [13, 11, 7, 7, 6, 5, 3, 2],
    ]
    for loads, ep in itertools.product(cases, (2, 4)):
        ranks = pack(loads, ep=ep)
        assert sorted(e for r in ranks for e in r) == list(range(EXPERTS)) and {len(r) for r in ranks} == {8 // ep}
        best = min(max(rank_loads(loads, split)) for split in _all_splits(list(range(EXPERTS)), ep))
        assert max(rank_loads(loads, ranks)) == best, (loads, ep, ranks)


def _all_splits(experts: list[int], ep: int):
    if ep == 1:
        yield (tuple(experts),)
        return
    first, rest = experts[0], experts[1:]
    for others in itertools.combinations(rest, len(experts) // ep - 1):
        remaining = [e for e in rest if e not in others]
        for tail in _all_splits(remaining, ep - 1):
            yield ((first, *others), *tail)


def test_rank_figures_sum_slots_by_rank() -> None:
    figures = rank_figures([5, 1, 0, 2, 3, 3, 0, 0], ep=4)
    assert figures == {"rank_tokens": [6, 2, 6, 0], "rank_load_max_over_mean": 6 / 3.5, "straggler_rank": 0}


def test_experts_place_writes_a_valid_placement_and_prints_the_objective(tmp_path: Path) -> None:
    skewed = {"1": [50, 40, 30, 20, 1, 1, 1, 1], "2": [1, 1, 1, 1, 1, 1, 1, 100]}
    write_trace(tmp_path / "run", [skewed, skewed])
    out = tmp_path / "placement.json"
    result = run_cli("experts", "place", str(tmp_path / "run"), "--ep", "2", "-o", str(out))
    assert result.code == 0, result.stderr
    placement = read_placement(out, num_experts=EXPERTS, ep=2, moe_layers=[1, 2])
    loads = read_trace(tmp_path / "run")
    # Layer 1: 140 of 144 tokens on rank 0, packed to 72 + 72. Layer 2: one expert outweighs the rest, so
    # nothing beats its rank's 103 of 107.
    for layer, before, after in (("1", 140 / 72, 1.0), ("2", 103 / 53.5, 103 / 53.5)):
        tokens = loads.per_step(int(layer))
        assert max_over_mean(rank_loads(tokens, placement.ranks[int(layer)])) == pytest.approx(after)
        assert f"layer {layer}: {before:.3f} contiguous -> {after:.3f} placed" in result.stdout
    assert "wrote" in result.stdout

    assert_bad_input(
        run_cli("experts", "place", str(tmp_path / "none"), "--ep", "2", "-o", str(out)),
        "routing.jsonl: no routing trace",
    )
    assert_bad_input(
        run_cli("experts", "place", str(tmp_path / "run"), "--ep", "3", "-o", str(out)),
        "--ep 3 must divide the 8 experts",
    )


def test_validate_refuses_a_bad_placement_file_naming_it(tmp_path: Path) -> None:
    good = contiguous(num_experts=EXPERTS, ep=2, layers=[0, 1]).to_json()
    cases = {
        "duplicate.json": {**good, "layers": {"0": [[0, 0, 1, 2], [3, 4, 5, 6]], "1": good["layers"]["1"]}},
        "uneven.json": {**good, "layers": {"0": [[0, 1, 2], [3, 4, 5, 6, 7]], "1": good["layers"]["1"]}},
        "missing.json": {**good, "layers": {"0": good["layers"]["0"]}},
        "ep4.json": {**good, "ep": 4},
    }
    messages = {
        "duplicate.json": "layer 0 is not a permutation of the experts 0..7",
        "uneven.json": "layer 0 must list 2 ranks of 4 experts each",
        "missing.json": "no placement for MoE layers [1]",
        "ep4.json": "placed over ep 4, the recipe's parallel.ep is 2",
    }
    ep2 = ["--set", "launch.gpus_per_node=2", "--set", "parallel.ep=2", "--set", "model.num_layers=2"]
    for name, data in cases.items():
        path = tmp_path / name
        path.write_text(json.dumps(data))
        result = run_cli("validate", "qwen3-moe-tiny", *ep2, "--set", f"model.moe.placement={path}")
        assert_bad_input(result, "model.moe.placement", str(path), messages[name])
    good_path = tmp_path / "good.json"
    good_path.write_text(json.dumps(good))
    assert run_cli("validate", "qwen3-moe-tiny", *ep2, "--set", f"model.moe.placement={good_path}").code == 0
    with pytest.raises(PlacementError, match="not a readable placement file"):
        read_placement(tmp_path / "absent.json", num_experts=EXPERTS, ep=2, moe_layers=[0, 1])


# ---------------------------------------------------------------------------------------------- multi-rank


@pytest.fixture(scope="module")
def skewed_trace(tmp_path_factory) -> Path:
    """Two steps of the skewed tiny model on one process, with the routing trace on."""
    from moe_train.config import load_recipe
    from moe_train.train.loop import Trainer

    run_dir = tmp_path_factory.mktemp("trace") / "run"
    Trainer(
        load_recipe(
            "qwen3-moe-tiny",
            [
                *TINY,
                SKEW,
                "logging.routing_trace=true",
                "train.steps=2",
                "launch.gpus_per_node=1",
                f"run_dir={run_dir}",
            ],
        )
    ).train()
    # The trace holds every step's tokens per expert, as metrics.jsonl logged them, and the one rank's load.
    trace = [json.loads(line) for line in (run_dir / "routing.jsonl").open()]
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [t["step"] for t in trace] == [1, 2]
    for t, record in zip(trace, logged, strict=True):
        assert t["experts"] == {layer: figures["tokens"] for layer, figures in record["moe"].items()}
        assert t["ranks"] == {layer: [sum(figures["tokens"])] for layer, figures in record["moe"].items()}
        assert sum(t["experts"]["0"]) == 8 * 32 * 2  # every routed slot: global batch x sequence x top_k
    return run_dir


def _case(case_id: str, overrides: list[str], **extra) -> dict:
    return {"id": case_id, "recipe": "qwen3-moe-tiny", "overrides": [*TINY, SKEW, *overrides], "steps": STEPS, **extra}


def _by_expert(state: dict[str, torch.Tensor], slot_of: dict[int, list[int]]) -> dict[str, torch.Tensor]:
    """A record's state with each placed expert stack's rows in global expert order."""
    out = dict(state)
    for layer, slots in slot_of.items():
        for name in ("gate_proj", "up_proj", "down_proj"):
            key = f"layers.{layer}.ffn.experts.{name}"
            out[key] = state[key][torch.tensor(slots)]
    return out


def _check_world(tmp_path: Path, skewed_trace: Path, ep: int) -> None:
    placement_file = tmp_path / f"placement-ep{ep}.json"
    result = run_cli("experts", "place", str(skewed_trace), "--ep", str(ep), "-o", str(placement_file))
    assert result.code == 0, result.stderr
    placement = read_placement(placement_file, num_experts=EXPERTS, ep=ep, moe_layers=[0, 1])
    base = contiguous(num_experts=EXPERTS, ep=ep, layers=[0, 1])
    placed = f"model.moe.placement={placement_file}"
    hierarchical = ["launch.nodes=2", "model.moe.dispatcher=hierarchical"]
    common = [f"parallel.ep={ep}"]
    cases = [
        _case("alltoall", common),
        _case("alltoall-placed", [*common, placed]),
        _case("allgather", [*common, "model.moe.dispatcher=allgather"]),
        _case("allgather-placed", [*common, "model.moe.dispatcher=allgather", placed]),
        _case("hierarchical", [*common, *hierarchical]),
        _case("hierarchical-placed", [*common, *hierarchical, placed]),
        _case("resume-placed", common, stop_at=1, resume_overrides=[placed]),
    ]
    saved = run_ranks("train_layouts", ep, {"cases": cases, "run_root": str(tmp_path / "runs")}, tmp_path, timeout=600)
    records = {key: torch.load(path, weights_only=True) for key, path in saved.items()}
    slot_of = {layer: placement.slot_of_expert(layer) for layer in (0, 1)}
    for dispatcher in ("alltoall", "allgather", "hierarchical"):
        plain, moved = records[dispatcher], records[f"{dispatcher}-placed"]
        assert moved["losses"] == pytest.approx(plain["losses"], rel=1e-6), dispatcher
        want, got = plain["state"], _by_expert(moved["state"], slot_of)
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
        assert moved["moe"] == plain["moe"]  # the same routing: the same tokens per expert
        for record, ranks in ((plain, base.ranks), (moved, placement.ranks)):
            for moe, moe_ranks in zip(record["moe"], record["moe_ranks"], strict=True):
                for layer in ("0", "1"):
                    tokens = moe[layer]["tokens"]
                    assert moe_ranks[layer]["rank_tokens"] == rank_loads(tokens, ranks[int(layer)]), (dispatcher, layer)
        # The skew lands on the contiguous placement's first ranks; the packed placement spreads it.
        for layer in ("0", "1"):
            before = plain["moe_ranks"][0][layer]["rank_load_max_over_mean"]
            after = moved["moe_ranks"][0][layer]["rank_load_max_over_mean"]
            assert after < before and before > 1.2, (dispatcher, layer, before, after)
    # plan --routing from the contiguous run's expert counts (its trace, as the trainer would write it: the
    # harness steps trainers without their loop), on the placed layout: the slowest rank's expert rows of each
    # layer are what the placed run measured (its rank loads summed over the steps, the same routing).
    write_trace(
        tmp_path / "runs" / "alltoall",
        [{layer: figures["tokens"] for layer, figures in step.items()} for step in records["alltoall"]["moe"]],
        ep=ep,
    )
    sets = [
        f"--set={o}"
        for o in [
            *TINY,
            SKEW,
            *common,
            placed,
            "launch.device=cuda",
            "launch.gpu=h100",
            f"launch.gpus_per_node={ep}",
            f"train.steps={STEPS}",
        ]
    ]
    result = run_cli("plan", "qwen3-moe-tiny", *sets, "--json", "--routing", str(tmp_path / "runs" / "alltoall"))
    assert result.code == 0, result.stderr
    routing = json.loads(result.stdout)["routing"]
    measured_rows = {
        layer: [
            sum(step[layer]["rank_tokens"][r] for step in records["alltoall-placed"]["moe_ranks"]) / STEPS
            for r in range(ep)
        ]
        for layer in ("0", "1")
    }
    for layer, rows in measured_rows.items():
        assert routing["layers"][layer]["rows_max"] == pytest.approx(max(rows), rel=1e-9), layer
        assert routing["layers"][layer]["straggler_rank"] == rows.index(max(rows)), layer
    assert routing["moe_imbalance"] == pytest.approx(
        sum(max(rows) / (sum(rows) / ep) for rows in measured_rows.values()) / 2, rel=1e-9
    )
    # One step contiguous, the second under the placement (its checkpoint read back by expert, optimizer state
    # included): the straight contiguous run's second step.
    resumed = records["resume-placed"]
    assert resumed["started"] == 1
    got = _by_expert(resumed["state"], slot_of)
    for key, value in records["alltoall"]["state"].items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
    logged = [json.loads(line) for line in (tmp_path / "runs" / "resume-placed" / "metrics.jsonl").open()]
    assert [r["loss"] for r in logged if r["kind"] == "train"] == pytest.approx(records["alltoall"]["losses"], rel=1e-6)


@pytest.mark.slow
def test_placement_on_ep2_trains_the_contiguous_run_and_balances_ranks(tmp_path: Path, skewed_trace: Path) -> None:
    _check_world(tmp_path, skewed_trace, 2)


@pytest.mark.slow
def test_placement_on_ep4_trains_the_contiguous_run_and_balances_ranks(tmp_path: Path, skewed_trace: Path) -> None:
    _check_world(tmp_path, skewed_trace, 4)


# Every token's top 2 are experts 0 and 1 whatever its hidden state (the tiny router's own logits are far under
# 10), so every rank routes as the whole batch does: the case where the trace's loads fix each rank's traffic.
FIXED = "model.moe.router.logit_bias=[30,20,0,0,0,0,0,0]"


@pytest.mark.slow
def test_plan_routing_prices_the_all_to_all_bytes_measure_counts_on_ep4(tmp_path: Path) -> None:
    """One EP4 step per placement under measure's collective counter (CollectiveTraffic), its routing trace
    written by the engine's writer; plan --routing on that trace and layout predicts every rank's ep all-to-all
    bytes (the counts exchange, the rows and their fp32 weights, forward and backward) and expert rows exactly,
    prices the slowest rank's step above the balanced one, and the placement that splits experts 0 and 1 lowers
    the slowest rank's bytes."""
    placement_file = tmp_path / "split.json"
    split = ((0, 2), (1, 3), (4, 5), (6, 7))
    placement_file.write_text(json.dumps(Placement(num_experts=EXPERTS, ep=4, ranks={0: split, 1: split}).to_json()))
    layouts = {"contiguous": [], "split": [f"model.moe.placement={placement_file}"]}
    cases = [
        {"id": name, "recipe": "qwen3-moe-tiny", "overrides": [*TINY, FIXED, "parallel.ep=4", *extra]}
        for name, extra in layouts.items()
    ]
    measured = run_ranks(
        "routing_traffic", 4, {"cases": cases, "run_root": str(tmp_path / "runs")}, tmp_path, timeout=600
    )
    slowest = {}
    for name, extra in layouts.items():
        sets = [
            f"--set={o}"
            for o in [
                *TINY,
                FIXED,
                "parallel.ep=4",
                *extra,
                "launch.device=cuda",
                "launch.gpu=h100",
                "launch.gpus_per_node=4",
                "train.steps=1",
            ]
        ]
        result = run_cli("plan", "qwen3-moe-tiny", *sets, "--json", "--routing", str(tmp_path / "runs" / name))
        assert result.code == 0, result.stderr
        routing = json.loads(result.stdout)["routing"]
        layers = routing["layers"]
        for rank, counted in enumerate(measured[name]["comm_bytes"]):
            predicted = sum(layer["rank_all_to_all_bytes"][rank] for layer in layers.values())
            assert counted["ep/all_to_all"] == pytest.approx(predicted, rel=1e-12), (name, rank)
        for layer, figures in measured[name]["moe_ranks"].items():
            assert layers[layer]["rank_rows"] == pytest.approx(figures["rank_tokens"], rel=1e-12), (name, layer)
        # the skew costs the slowest rank all-to-all bytes over the balanced routing, and time over the balanced plan
        assert all(layer["all_to_all_bytes_max"] > layer["all_to_all_bytes_balanced"] for layer in layers.values())
        assert (
            routing["all_to_all_extra_s"] > 0
            and routing["routed_step_time_s"] > json.loads(result.stdout)["step_time_s"]
        )
        slowest[name] = max(layer["all_to_all_bytes_max"] for layer in layers.values())
    assert slowest["split"] < slowest["contiguous"]


ALL_ON_TWO = {"0": [256, 256, 0, 0, 0, 0, 0, 0], "1": [256, 256, 0, 0, 0, 0, 0, 0]}
EP2_H100 = [*TINY, "parallel.ep=2", "launch.device=cuda", "launch.gpu=h100", "launch.gpus_per_node=2"]


def test_plan_routing_times_the_slowest_ranks_exchanges(tmp_path: Path) -> None:
    """At ep 2 a rank sends as many bytes whatever the routing (its tokens out, the other's rows back), but with
    every token on rank 0's experts each exchange moves all of them one way: twice the balanced exchange, which
    the routed step pays; an even trace adds nothing."""
    from moe_train.config import load_recipe
    from moe_train.config.hardware import hardware_table
    from moe_train.plan.assumptions import Assumptions
    from moe_train.plan.routing import all_to_all_seconds, routing_plan

    recipe = load_recipe("qwen3-moe-tiny", EP2_H100)
    hardware = hardware_table()["h100"]
    write_trace(tmp_path / "skewed", [ALL_ON_TWO])
    write_trace(tmp_path / "even", [{"0": [64] * 8, "1": [64] * 8}])
    skewed = routing_plan(recipe, read_trace(tmp_path / "skewed"))
    even = routing_plan(recipe, read_trace(tmp_path / "even"))
    for layer in skewed.layers:
        assert layer.rank_all_to_all_bytes == pytest.approx([layer.all_to_all_bytes_balanced] * 2)
        assert max(layer.rank_exchange_bytes) > 1.9 * layer.exchange_bytes_balanced
    assert all_to_all_seconds(skewed, recipe, hardware, Assumptions()) > 0
    assert all_to_all_seconds(even, recipe, hardware, Assumptions()) == pytest.approx(0, abs=1e-15)


def test_plan_search_routing_ranks_layouts_by_the_routed_step(tmp_path: Path) -> None:
    write_trace(tmp_path / "skewed", [ALL_ON_TWO])
    sets = [f"--set={o}" for o in EP2_H100]
    # the links slowed to a thousandth, so that the routed all-to-alls reorder the layouts
    slow = ["--assume", "nvlink_efficiency=0.001", "--top", "20"]
    result = run_cli(
        "plan", "qwen3-moe-tiny", *sets, *slow, "--search", "--json", "--routing", str(tmp_path / "skewed")
    )
    assert result.code == 0, result.stderr
    best = json.loads(result.stdout)["best"]
    routed, plain = [b["routed"]["tokens_per_s"] for b in best], [b["tokens_per_s"] for b in best]
    assert routed == sorted(routed, reverse=True) and plain != sorted(plain, reverse=True)
    assert all(r <= p * (1 + 1e-12) for r, p in zip(routed, plain, strict=True))
    assert any(r < p for r, p in zip(routed, plain, strict=True))
