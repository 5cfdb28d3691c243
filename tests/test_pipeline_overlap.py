"""Overlapped micro-batches with pipeline parallelism (`parallel.ep_overlap` under `parallel.pp_schedule`
dualpipev: parallel/dual_pipe.py) against the plain dualpipev step of the same layout, bit for bit, and against
the single process; the recorded order of one overlapped step on a pipeline stage; and plan's count of the pairs
against the schedule torch builds.

PP2 x EP2 on 4 gloo ranks (the experts over the two data-parallel ranks of each stage), 4 layers in 4 stages (a
V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2), 4 micro-batches a step: each rank runs 3 overlapped
pairs a step. Cases: the all-to-all, the all-gather and the hierarchical dispatcher (every rank its own
emulated node), selective recompute of the MoE layers, fp8 rowwise (against the plain step only), MTP with a
tied head (the embedding's two copies on rank 0: trained, overlapped, resumed), in one job with the recorded
order. The pairs run the plain schedule's
two sub-actions, on two stages that share no parameter, so nothing may part by a bit (tolerance 0); the plain
dualpipev step is held to the single process as every layout test is (helpers.assert_same_run).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import SHRINK_LAYOUT, assert_same_run, read_metrics
from multirank import run_ranks
from workers.record import record_run

from moe_train.plan.overlap import PairedPhases, dualpipev_order, exposed_comm, overlapped_pairs

STEPS = 2  # the gradients of step 1, the parameters after step 2 (one update), both steps' losses
EXACT = {"loss": 0.0, "rtol": 0.0, "atol": 0.0}
MODEL = ["train.micro_batch_size=1", "train.precision=fp32", "model.num_layers=4"]
DUALPIPEV = ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=dualpipev", "parallel.ep=2"]
OVERLAP = "parallel.ep_overlap=true"
# (id, model/train overrides also given to the single process)
CASES = {
    "alltoall": [],
    "allgather": ["model.moe.dispatcher=allgather"],
    "selective-recompute": ["parallel.recompute.granularity=selective", "parallel.recompute.modules=[moe]"],
    "fp8-rowwise": ["train.precision=fp8", "train.fp8.recipe=rowwise"],
    "hierarchical": [],
}
# layout overrides of a case, not given to the single process: the hierarchical dispatcher with every rank its
# own emulated node (EP2 spans 2 nodes of one rank: the network all-to-all, no NVLink fan-out)
LAYOUT_ONLY = {"hierarchical": ["model.moe.dispatcher=hierarchical", "launch.nodes=4"]}
# fp8 is held to the plain dualpipev step only: against the single process fp8 layouts differ by their own
# tolerance (test_fp8_layouts), which says nothing of the overlap
AGAINST_SINGLE = ("alltoall", "allgather", "selective-recompute", "hierarchical")


EVALUATED = "alltoall"  # its runs also evaluate after the last step (the schedule's forwards only)

# The embedding shared in the V: deepseek-v3-tiny (MTP) with its head tied to the embedding puts the embedding,
# the MTP module and the tied head on pipeline rank 0, one embedding copy in each of its two chunks; trained 3
# steps plain (against the single process), overlapped (bitwise the plain), and stopped at step 2 and resumed
# (bitwise the plain: both copies load the saved tensor)
SHARED = ("deepseek-v3-tiny", ["model.tie_embeddings=true"])
SHARED_STEPS, SHARED_STOP = 3, 2


def _spec(case_id: str, model: list[str], *, evaluate: bool = False, recipe: str = "qwen3-moe-tiny",
          steps: int = STEPS, **extra) -> dict:
    return {"id": case_id, "recipe": recipe, "steps": steps, "evaluate": evaluate,
            "overrides": [*SHRINK_LAYOUT, *MODEL, *model, *DUALPIPEV], **extra}


def _shared_cases() -> list[dict]:
    recipe, model = SHARED
    return [_spec("shared-plain", model, recipe=recipe, steps=SHARED_STEPS),
            _spec("shared-overlap", [*model, OVERLAP], recipe=recipe, steps=SHARED_STEPS),
            _spec("shared-resume", model, recipe=recipe, steps=SHARED_STEPS, stop_at=SHARED_STOP)]


def _check_shared(saved: dict[str, str], run_root: Path, tmp_path: Path) -> None:
    """The embedding's two copies on rank 0: the step equals the single process (the copies' gradients summed
    in place), the overlapped step the plain one bit for bit, and the resumed run the uninterrupted one bit for
    bit (every parameter and buffer after the last step: workers/record.py checks the two copies bit-equal on
    the rank; the losses the loss rank logged)."""
    recipe, model = SHARED
    plain, overlapped, resumed = (torch.load(saved[f"shared-{kind}"], weights_only=True)
                                  for kind in ("plain", "overlap", "resume"))
    assert_same_run(overlapped, plain, **EXACT)
    single = record_run(recipe, [*SHRINK_LAYOUT, *MODEL, *model], world=1, run_dir=tmp_path / "shared",
                        steps=SHARED_STEPS)
    assert_same_run(plain, single)
    assert resumed["started"] == SHARED_STOP
    assert resumed["state"].keys() == plain["state"].keys()
    for key, value in plain["state"].items():
        assert torch.equal(resumed["state"][key], value), key
    logged = read_metrics(run_root / "shared-resume", "train")
    assert [r["loss"] for r in logged] == plain["losses"] and all(r["mtp_loss"] > 0 for r in logged)


@pytest.mark.slow
def test_dualpipev_overlapped_pairs_equal_the_plain_step_and_the_single_process(tmp_path: Path) -> None:
    cases = []
    for name, model in CASES.items():
        evaluate = name == EVALUATED
        layout = LAYOUT_ONLY.get(name, [])
        cases += [_spec(f"{name}-plain", [*model, *layout], evaluate=evaluate),
                  _spec(f"{name}-overlap", [*model, *layout, OVERLAP], evaluate=evaluate)]
    from moe_train.config import load_recipe
    from moe_train.plan.rank_layout import PlanLayout

    hierarchical = load_recipe("qwen3-moe-tiny", [*_spec("h", LAYOUT_ONLY["hierarchical"])["overrides"],
                                                  "launch.gpus_per_node=1"], check_files=False)
    assert PlanLayout.from_recipe(hierarchical).ep_split == (2, 1)  # the EP group spans two nodes
    order = _spec("order", [OVERLAP])
    result = run_ranks("pipeline_overlap", 4, {"cases": [*cases, *_shared_cases(), order],
                                               "run_root": str(tmp_path / "pp")}, tmp_path, timeout=500)
    saved = result["saved"]
    _check_shared(saved, tmp_path / "pp", tmp_path)
    for name, model in CASES.items():
        plain = torch.load(saved[f"{name}-plain"], weights_only=True)
        overlapped = torch.load(saved[f"{name}-overlap"], weights_only=True)
        assert_same_run(overlapped, plain, **EXACT)
        if name not in AGAINST_SINGLE:
            continue
        evaluate = name == EVALUATED
        single = record_run("qwen3-moe-tiny", [*SHRINK_LAYOUT, *MODEL, *model], world=1, run_dir=tmp_path / name,
                            steps=STEPS, evaluate=evaluate)
        assert_same_run(plain, single)
        assert (overlapped["eval"] is not None) == evaluate
        if evaluate:
            assert overlapped["eval"] == plain["eval"] == pytest.approx(single["eval"], rel=1e-5)
    _check_order(result["order"])


def _check_order(order: dict) -> None:
    """Rank 0's recorded step: every overlapped pair of the built schedule ran (a pair's halves name each
    other), and inside each pair every dispatch/combine collective of one half was issued before a compute phase
    of the other and waited on after it, for as long as the other had compute left."""
    events, pairs = order["events"], order["pairs"]
    ran = {(e[2], e[3]) for e in events if e[3] is not None}
    for forward, backward in pairs["0"]:
        assert (forward, backward) in ran and (backward, forward) in ran, (forward, backward, sorted(ran))
    # the pairs the run ran on rank 0 are the plan's count (each stage's 4 micro-batches, both stages' passes)
    assert len({frozenset(pair) for pair in ran}) == overlapped_pairs(pp=2, rank=0, micro_batches=4)[0]
    checked = hidden = 0
    for index, (event, _kind, micro, partner) in enumerate(events):
        if event != "issue" or partner is None:
            continue
        waited = next(i for i in range(index + 1, len(events)) if events[i][0] == "wait" and events[i][2] == micro)
        later = [i for i in range(index + 1, len(events)) if events[i][0] == "compute" and events[i][2] == partner]
        if later and later[0] < max(i for i, e in enumerate(events) if e[2] == partner):
            checked += 1
            hidden += later[0] < waited
    # per pair at least one stage's layer of each half: a dispatch and a combine each way
    assert checked >= 2 * len(pairs["0"]), events
    assert hidden == checked, events
    # the plain passes outside the pairs (warm-up, cool-down) record no partner
    assert any(e[3] is None and e[0] == "issue" for e in events)


TWO = ["launch.gpus_per_node=4", "train.micro_batch_size=1", "model.num_layers=4"]


@pytest.mark.parametrize(("sets", "field", "refused"), [
    ([*DUALPIPEV, OVERLAP], None, None),
    (["parallel.pp=2", "parallel.ep=2", OVERLAP], "parallel.ep_overlap", "dualpipev only, not 1f1b"),
    (["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.ep=2", OVERLAP],
     "parallel.ep_overlap", "dualpipev only, not interleaved_1f1b"),
    (["parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.ep=2"], "parallel.pp_schedule",
     "dualpipev needs pp > 1 and vpp 2"),
    ([*DUALPIPEV, "train.global_batch_size=4"], "train.global_batch_size", "dualpipev needs at least 2 pp = 4"),
    ([*DUALPIPEV, OVERLAP, "parallel.split_wgrad=true"], "parallel.split_wgrad", "pipeline parallelism"),
])
def test_validate_refuses_what_dualpipev_and_its_overlap_cannot_do_by_name(sets: list[str], field: str | None,
                                                                           refused: str | None) -> None:
    """One line naming the field and the reason (exit 2 at the CLI, as every RecipeError)."""
    from moe_train.config import load_recipe
    from moe_train.config.loader import RecipeError

    overrides = [*SHRINK_LAYOUT, *TWO, *sets]
    if refused is None:
        recipe = load_recipe("qwen3-moe-tiny", overrides, check_files=False)
        assert recipe.parallel.ep_overlap and recipe.parallel.pp_schedule == "dualpipev"
        return
    with pytest.raises(RecipeError) as error:
        load_recipe("qwen3-moe-tiny", overrides, check_files=False)
    lines = [line for line in str(error.value).splitlines() if f"{field}: " in line]
    assert len(lines) == 1 and refused in lines[0], str(error.value)


@pytest.mark.parametrize("shared", [["model.tie_embeddings=true"], [], ["model.mtp_layers=0",
                                                                       "model.tie_embeddings=true"]],
                         ids=["mtp-tied", "mtp", "tied"])
def test_validate_plan_and_the_engine_agree_on_dualpipev_with_the_embedding_shared_in_the_v(shared: list[str]
                                                                                           ) -> None:
    """MTP or a tied head on the last stage, which a V puts on the first stage's rank: validate accepts it, plan
    prices it (no shared-embedding all-reduce: the rank sums its two copies in place) and the engine's gate
    passes it (config/support.py, which bootstrap applies: the slow job above trains the mtp-tied recipe)."""
    from moe_train.config import load_recipe
    from moe_train.config.hardware import HARDWARE
    from moe_train.config.support import unsupported
    from moe_train.plan.estimate import estimate, plan_json

    recipe = load_recipe(SHARED[0], [*SHRINK_LAYOUT, *TWO, *DUALPIPEV, *shared], check_files=False)
    assert recipe.model.mtp_layers > 0 or recipe.model.tie_embeddings
    assert unsupported(recipe) == []
    def summed(plan) -> list[bool]:  # per pipeline rank: does it all-reduce the embedding's gradient?
        return [any(key.startswith("embedding/") for key in rank.comm.payload) for rank in plan.ranks]

    plan = estimate(recipe, HARDWARE["h100"])
    assert plan_json(plan)["step_time_s"] > 0 and summed(plan) == [False, False]
    # the same copies on two ranks (1f1b: the last stage on rank 1) sum over the group of the two
    apart = recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update={"vpp": 1,
                                                                                      "pp_schedule": "1f1b"})})
    assert summed(estimate(apart, HARDWARE["h100"])) == [True, True]


@pytest.mark.slow
@pytest.mark.usefixtures("no_process_group")  # tests/conftest.py: --fake plays a rank of its own fake group
def test_measure_fake_of_each_dualpipev_rank_is_its_plan() -> None:
    """`measure --fake` of deepseek-v3-tiny under dualpipev (PP2 x EP2, MTP: rank 0 holds the embedding, its
    copy, the MTP module and the loss) against the plan of each pipeline rank, as every pipelined plan = measure
    case: parameters, gradients, optimizer state, FLOPs and every collective's bytes exactly (the V's tip hands
    its tensors on locally: no pp send there; the norm counts the embedding copy once); the saved bytes alive at
    the step's peak within 1% of the plan's activations, and of in_flight's micro-batches of each stage
    ([2 pp - r, r + 1]) times the stage's bytes per micro-batch measured."""
    from helpers import GPU, plan_against_measure

    from moe_train.config import load_recipe
    from moe_train.config.mesh_shape import MeshShape
    from moe_train.measure.driver import Target, measure
    from moe_train.plan.estimate import estimate, plan_json
    from moe_train.plan.rank_layout import PlanLayout, in_flight, rank_chunks

    recipe = load_recipe("deepseek-v3-tiny", [*DUALPIPEV, "model.num_layers=4", "train.seq_length=64",
                                              "train.micro_batch_size=1", "train.global_batch_size=8",
                                              "launch.gpus_per_node=4"], check_files=False)
    shape, layout, plan = MeshShape.from_recipe(recipe), PlanLayout.from_recipe(recipe), estimate(recipe, GPU)
    assert layout.micro_batches == 4
    for rank in (0, 2):  # pipeline ranks 0 and 1 (dp 0)
        stage = shape.dense_coords(rank)[0]
        report = measure(recipe, Target(fake=True, rank=rank))
        planned = plan_json(plan, pipeline_rank=stage)
        assert plan_against_measure(recipe, report, tolerance=1e-9, plan=planned) == [], rank
        peak = report["activation_bytes_peak"]
        assert peak == pytest.approx(planned["memory_bytes"]["activations"], rel=0.01), rank
        per_layer, n = report["activation_bytes_per_layer"], recipe.model.num_layers
        chunks = rank_chunks(layout, recipe.model)[stage]
        held = sum(count * sum(per_layer[str(i)] for i in [*chunk.layers, *range(n, n + chunk.mtp)])
                   for count, chunk in zip(in_flight(layout, stage), chunks, strict=True))
        assert peak == pytest.approx(held + per_layer["other"], rel=0.01), (rank, in_flight(layout, stage))


def _torch_order(pp: int, rank: int, micro_batches: int) -> list[tuple[str, ...]]:
    """The order the engine's schedule (parallel/dual_pipe.py DualPipeVFullBackward, torch's DualPipeV order)
    gives pipeline rank `rank`, each pass named by its kind and which of the rank's two stages (0: stage
    `rank`, 1: stage 2 pp - 1 - rank), as plan/overlap.py names them. Built from torch's own order function."""
    from torch.distributed.pipelining.schedules import OVERLAP_F_B

    from moe_train.parallel.dual_pipe import DualPipeVFullBackward

    schedule = DualPipeVFullBackward.__new__(DualPipeVFullBackward)  # the order needs no stages nor group
    schedule.pp_group_size, schedule._n_microbatches = pp, micro_batches

    def name(action) -> str:
        return f"{action.computation_type.value}{0 if action.stage_index == rank else 1}"

    return [tuple(name(a) for a in action.sub_actions) if action.computation_type == OVERLAP_F_B else (name(action),)
            for action in schedule._calculate_single_rank_operations(rank) if action is not None]


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_plan_pairs_are_the_pairs_of_the_schedule_torch_builds(pp: int) -> None:
    """plan/overlap.py's dualpipev order (torch-free) is the engine schedule's, pass for pass, on every rank; so
    its count of overlapped pairs is the count of OVERLAP_F_B actions each rank runs, and behind ample compute
    plan hides exactly that share of a layer's EP communication (pairs / 2M of the rank's passes), none in the
    ramps."""
    for micro_batches in (2 * pp, 2 * pp + 1, 3 * pp, 4 * pp + 2):
        for rank in range(pp):
            built = _torch_order(pp, rank, micro_batches)
            assert dualpipev_order(pp=pp, rank=rank, micro_batches=micro_batches) == built, (pp, rank, micro_batches)
            pairs = sum(1 for passes in built if passes[0].startswith("F") and len(passes) == 2)
            assert overlapped_pairs(pp=pp, rank=rank, micro_batches=micro_batches) == (pairs, 2 * micro_batches)
            ample = PairedPhases(micro_batches=micro_batches, overlapped=True, forward_compute_s=1e3,
                                 backward_compute_s=1e3, paired_passes=(pairs, 2 * micro_batches))
            (comm,) = exposed_comm({"ep/all_to_all": 6.0}, {"ep/all_to_all": 2.0}, ample, layers=2).values()
            assert comm.hidden_s == pytest.approx(6.0 * pairs / (2 * micro_batches), rel=1e-12)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_plan_bubble_of_dualpipev_is_its_order_run_as_soon_as_each_pass_can(pp: int) -> None:
    """The order's idle time (plan/overlap.py `dualpipev_idle`, each pass run once its inputs are there), on the
    schedule torch builds (held pass for pass above): with full backwards (B = 2F, no weight pass apart) it is
    DualPipe's count (pp - 1)(F&B + B) with F&B = F + B, less the one forward torch's split of the last rank's
    first steady-state pair fills (none to fill when F = B: (pp - 1)(F&B + B) exactly). It does not grow with M,
    so plan's bubble share is that over a rank's 2M (F + B), above interleaved 1F1B's (pp - 1) / 2M at vpp 2."""
    from moe_train.plan.overlap import dualpipev_bubble, dualpipev_idle

    for micro_batches in (2 * pp, 2 * pp + 1, 3 * pp, 4 * pp + 2):
        assert dualpipev_idle(pp=pp, micro_batches=micro_batches) == (pp - 1) * (3 + 2) - 1
        assert dualpipev_idle(pp=pp, micro_batches=micro_batches, backward_ratio=1.0) == (pp - 1) * 3
        share = dualpipev_bubble(pp=pp, micro_batches=micro_batches)
        assert share == pytest.approx((5 * (pp - 1) - 1) / (6 * micro_batches), rel=1e-12)
        assert share > (pp - 1) / (2 * micro_batches)


def test_plan_of_a_dualpipev_recipe_prices_the_pairs_of_each_rank() -> None:
    """`plan` of deepseek-v3's own pipeline (pp 8, vpp 2) under dualpipev: without ep_overlap nothing hides; with
    it every pipeline rank hides EP communication, at most its schedule's pairs / 2M, and the time rank's
    `ep_comm_hidden` is its dispatcher collectives' hidden seconds."""
    from moe_train.config import load_recipe
    from moe_train.config.hardware import hardware_table
    from moe_train.plan.estimate import estimate, plan_json

    sets = ["parallel.pp_schedule=dualpipev", "model.moe.dispatcher=hierarchical"]
    plain = load_recipe("deepseek-v3", sets, check_files=False)
    overlapped = load_recipe("deepseek-v3", [*sets, OVERLAP], check_files=False)
    hardware = hardware_table()[plain.launch.gpu]
    plain_json = plan_json(estimate(plain, hardware))
    assert plain_json["time_s"]["ep_comm_hidden"] == 0.0
    assert all(c["exposed_fraction"] == 1.0 for c in plain_json["exposed_comm"].values())
    plan = estimate(overlapped, hardware)
    data, m = plan_json(plan), plan.layout.micro_batches
    pairs, passes = overlapped_pairs(pp=8, rank=data["time_rank"]["pp"], micro_batches=m)
    assert 0 < pairs < passes
    for comm in data["exposed_comm"].values():
        assert 1 - pairs / passes - 1e-12 <= comm["exposed_fraction"] < 1.0
    assert data["time_s"]["ep_comm_hidden"] == pytest.approx(sum(c["hidden_s"] for c in data["exposed_comm"].values()))
    assert data["step_time_s"] < plain_json["step_time_s"]
