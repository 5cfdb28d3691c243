"""`plan --search`: every valid layout of a recipe for its GPU count, those that fit ranked by throughput.

Searched: tp (dividing the GPUs per node: TP stays on NVLink), cp (1, 2, 4, 8 with cp x tp within a node, so
the K/V exchange stays on NVLink too; the rules keep the sequence divisible into 2*cp chunks), pp (dividing the
GPUs, up to 16, with a generated layout string where layers do not split evenly), vpp (1, 2), ep (dividing the
experts), etp (1, and 2 where ep x etp stays within a node; Megatron-Core recommends 1), the recompute policy
(full, none, selective over the family's heavy modules, the recipe's own) and the micro-batch size (1, 2), and
the MoE token dispatcher: where the ep group spans more than one NVLink domain (the hardware table's
`nvlink_domain`) both the alltoall and the hierarchical one (which sends a token across the network once per
node, not once per expert), ranked by the plan's step time with NVLink inside a domain and the network across;
elsewhere the recipe's own (hierarchical there would add a stage to the same NVLink traffic). Each candidate
goes through the recipe rules (`check_recipe`) as `--set` overrides would, so every listed layout is one
`validate` accepts.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

from moe_train.config.hardware import Hardware
from moe_train.config.rules import check_recipe, offloadable
from moe_train.config.schema import ModelConfig, OffloadConfig, Recipe, RecomputeConfig

from .assumptions import Assumptions
from .estimate import Plan, PlanMemo, estimate, with_communication


@dataclass(frozen=True)
class Candidate:
    overrides: dict
    plan: Plan


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def generated_layout(num_layers: int, stages: int, mtp: int) -> str:
    """A Megatron layout string spreading `num_layers` over `stages` as evenly as possible: the first stage
    (which also holds the embedding) and the last (MTP and loss) take the fewer layers."""
    base, extra = divmod(num_layers, stages)
    counts = [base] * stages
    middle = list(range(1, stages - 1)) or list(range(stages))
    for i in range(extra):
        counts[middle[i % len(middle)]] += 1
    parts = []
    for i, count in enumerate(counts):
        text = ("E" if i == 0 else "") + "t" * count + ("m" * mtp + "L" if i == stages - 1 else "")
        parts.append(text)
    return "|".join(parts)


def _recompute_options(recipe: Recipe) -> list[dict]:
    """Recompute policies tried, each valid for the family by construction: full first, then none, then the
    selective ones (the recipe's own, and the family's heavy modules)."""
    m = recipe.model
    heavy = ["layernorm"]
    if m.family == "deepseek_v3":
        heavy.insert(0, "mla_up_proj")
    if m.moe is not None:
        heavy.append("moe_act")
    if m.moe is None or m.first_k_dense:
        heavy.append("mlp")
    options = [{"granularity": "full", "modules": ["core_attn"], "method": "uniform", "num_layers": 1},
               {"granularity": "none", "modules": ["core_attn"]},
               {"granularity": "selective", "modules": heavy}]
    own = recipe.parallel.recompute
    if own.granularity == "selective" and set(own.modules) != set(heavy):
        options.append({"granularity": "selective", "modules": list(own.modules)})
    return options


def dispatchers(recipe: Recipe, *, ep: int, etp: int, nvlink_domain: int) -> list[str]:
    """The MoE dispatchers tried at this ep: alltoall and hierarchical where the ep group (ep x etp consecutive
    expert ranks) spans more than one NVLink domain (the recipe's own too, when it is neither); else the
    recipe's own."""
    own = recipe.model.moe.dispatcher
    if ep * etp <= nvlink_domain:
        return [own]
    return list(dict.fromkeys([own, "alltoall", "hierarchical"]))


def layouts(recipe: Recipe, *, nvlink_domain: int | None = None) -> list[dict]:
    """Override sets (dotted path -> value) of the layouts considered, before the rules and without the
    recompute policy (`_recompute_options` adds it). `nvlink_domain`: the GPUs one NVLink domain holds (the
    hardware's), where the dispatchers are weighed (default: a node's GPUs)."""
    m, launch = recipe.model, recipe.launch
    domain = nvlink_domain or launch.gpus_per_node
    world = recipe.world_size
    tps = [t for t in _divisors(launch.gpus_per_node) if t <= 8]
    pps = [p for p in _divisors(world) if p <= 16]
    eps = _divisors(m.moe.num_experts) if m.moe else [1]
    out = []
    etps = (1, 2) if m.moe else (1,)
    cps = [c for c in (1, 2, 4, 8) if launch.gpus_per_node % c == 0]
    for tp, cp, pp, vpp, ep, etp, mbs in itertools.product(tps, cps, pps, (1, 2), eps, etps, (1, 2)):
        if vpp > 1 and pp == 1:
            continue
        if world % (tp * cp * pp) or tp * cp > launch.gpus_per_node:
            continue
        dp = world // (tp * cp * pp)
        if (dp * cp * tp) % (ep * etp) or (etp > 1 and ep * etp > launch.gpus_per_node):
            continue  # expert TP only where its group stays inside a node, as tp does
        stages = pp * vpp
        if m.num_layers < stages:
            continue
        layout = None if m.num_layers % stages == 0 else generated_layout(m.num_layers, stages, m.mtp_layers)
        base = {
            "parallel.tp": tp, "parallel.pp": pp, "parallel.vpp": vpp,
            "parallel.pp_schedule": "interleaved_1f1b" if vpp > 1 else "1f1b", "parallel.pp_layout": layout,
            "parallel.ep": ep, "parallel.etp": etp, "parallel.dp": None, "parallel.cp": cp,
            "parallel.sequence_parallel": tp > 1, "train.micro_batch_size": mbs,
            # the recipe's FSDP2 gradient cadence, which every layout runs (pipelined stages too)
            "parallel.grad_reduce": recipe.parallel.grad_reduce,
        }
        if recipe.parallel.ep_overlap:
            # the recipe's overlapped micro-batches where the engine builds them (EP communication to hide; pp 1,
            # or dualpipev's pairs: vpp 2 and 2 pp micro-batches a step: config/rules.py); FSDP2's cadence
            # follows (param_gather null: per step when overlapped)
            dualpipev = pp > 1 and vpp == 2 and recipe.train.global_batch_size // (mbs * dp) >= 2 * pp
            base["parallel.ep_overlap"] = (pp == 1 or dualpipev) and ep * etp > 1
            if pp > 1 and base["parallel.ep_overlap"]:
                base["parallel.pp_schedule"] = "dualpipev"
        if m.moe is None:
            out.append(base)
            continue
        # the recipe's delayed expert weight gradients where the engine builds them (config/rules.py)
        out += [{**base, "model.moe.dispatcher": name,
                 **({"parallel.split_wgrad": pp == 1 and ep * etp > 1}
                    if recipe.parallel.split_wgrad else {})}
                for name in dispatchers(recipe, ep=ep, etp=etp, nvlink_domain=domain)]
    return out


def _apply(recipe: Recipe, overrides: dict, models: dict[tuple, ModelConfig] | None = None) -> Recipe:
    """The recipe with the overrides (all schema-valid by construction), without a full re-validation.
    `models`: the model sections already made, by their model.moe overrides, reused (one object per dispatcher:
    plan's per-layer caches key on the model section's identity, plan/activation_memory.py)."""
    sections: dict[str, dict] = {}
    for path, value in overrides.items():
        section, key = path.rsplit(".", 1)
        sections.setdefault(section, {})[key] = value
    parallel = dict(sections["parallel"])  # every override here is a parallel.*, train.* or model.moe.* field
    parallel["recompute"] = RecomputeConfig(**parallel["recompute"])
    # the recipe's offloaded regions that the candidate's policy does not recompute
    parallel["offload"] = OffloadConfig(modules=offloadable(recipe.parallel.offload.modules, parallel["recompute"]))
    update = {"parallel": recipe.parallel.model_copy(update=parallel),
              "train": recipe.train.model_copy(update=sections["train"])}
    if "model.moe" in sections:
        key = tuple(sorted(sections["model.moe"].items()))
        model = None if models is None else models.get(key)
        if model is None:
            model = recipe.model.model_copy(update={"moe": recipe.model.moe.model_copy(update=sections["model.moe"])})
            if models is not None:
                models[key] = model
        update["model"] = model
    return recipe.model_copy(update=update)


def search(recipe: Recipe, hardware: Hardware, assumptions: Assumptions | None = None, *,
           top: int = 5, imbalance: Callable[[Recipe], float] | None = None,
           prune: bool = True, memo: bool = True) -> tuple[list[Candidate], int, int]:
    """(the best `top` fitting layouts by tokens/s, layouts valid, layouts valid and fitting). `imbalance`:
    each candidate's measured moe_imbalance (`plan --routing`: the trace's loads on its ep), in place of the
    assumption's. `prune` False plans every fitting layout and policy whole (what the pruned search is held
    to: tests/test_plan_overlap.py). `memo` False plans each layout from nothing (`PlanMemo`: the figures
    candidates share, computed once; what tests/test_plan_search.py holds equal).

    Per layout, full recompute is planned first: when even it does not fit, no policy does. Then no
    recompute: when it fits, the selective policies fit too and are slower (recompute only adds work), so they
    are counted without being planned. Each is planned first without communication (the memory is the plan's,
    the step time a lower bound); only those whose bound can still enter the best `top` are planned whole,
    the most promising first (every layout's full plan made the search of deepseek-v3 on 1,024 GPUs 14 s), by
    adding the communication to the bound's ranks (`with_communication`: their memory and FLOPs are not
    planned again), rank by rank, dropped as soon as one rank alone is slower than the best `top`. `prune`
    False plans each fitting one whole with `estimate`, from the recipe."""
    bounds: list[tuple[float, int, dict, Recipe, Assumptions | None]] = []
    valid = fits = 0
    options = _recompute_options(recipe)
    models: dict[tuple, ModelConfig] = {}
    shared = PlanMemo() if memo else None
    for base in layouts(recipe, nvlink_domain=hardware.nvlink_domain):
        first = _apply(recipe, {**base, "parallel.recompute": options[0]}, models)
        if check_recipe(first, check_files=False):
            continue
        valid += len(options)
        for index, rc in enumerate(options):
            overrides = {**base, "parallel.recompute": rc}
            candidate = first if index == 0 else _apply(recipe, overrides, models)
            planned = assumptions if imbalance is None else replace(assumptions or Assumptions(),
                                                                     moe_imbalance=imbalance(candidate))
            bound = estimate(candidate, hardware, planned, every_rank=False, comm=False, memo=shared)
            if not bound.fits:
                if index == 0 and prune:  # the leanest policy: when it does not fit, none does
                    break
                continue
            fits += 1
            bounds.append((bound.step_time, len(bounds), overrides, candidate, planned, bound))
            if rc["granularity"] == "none" and prune:
                fits += len(options) - index - 1
                break
    bounds.sort(key=lambda item: item[:2])
    best: list[Candidate] = []
    for lower, _, overrides, candidate, planned, bound in bounds:
        cutoff = best[-1].plan.step_time if prune and len(best) == top else None
        if cutoff is not None and lower >= cutoff:
            break  # this bound and every later one: slower than the best `top` already planned whole
        if not prune:
            whole = estimate(candidate, hardware, planned, every_rank=False, memo=shared)
        elif (whole := with_communication(bound, slower_than=cutoff)) is None:
            continue  # one of its ranks alone is slower than the best `top`: so is the step
        best.append(Candidate(overrides, whole))
        best.sort(key=lambda c: c.plan.step_time)
        del best[top:]
    return best, valid, fits
