"""Cross-field rules: everything a job would crash on because of its configuration, found before allocation.

Each rule looks at a schema-valid recipe and returns problems, each tied to the field a user should change, so
the loader can print file:line:column for it. All rules run; nothing stops at the first problem.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .data_files import DataError, read_index_header
from .fp8_auto import with_fp8_resolved
from .hardware import HardwareError, hardware_table
from .loss_chunks import recipe_loss_chunk_tokens
from .mesh_shape import (
    dispatch_node_ranks,
    ep_node_split_problem,
    expert_data_parallel_size,
    ranks_beside_dp,
    ranks_beside_edp,
    stage_ranks,
)
from .placement import PlacementError, recipe_placement
from .pp_layout import LayoutError, parse_layout
from .schema import FAMILY_FIELDS, FAMILY_ONLY_FIELDS, FP8_MODULES, MLA_FIELDS, MOE_FAMILIES, Recipe

IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
BYTE_VOCAB = 257


@dataclass(frozen=True)
class Problem:
    path: tuple[str | int, ...]
    message: str

    def __str__(self) -> str:
        return f"{'.'.join(str(part) for part in self.path)}: {self.message}"


def _p(dotted: str, message: str) -> Problem:
    return Problem(tuple(int(part) if part.isdigit() else part for part in dotted.split(".")), message)


@dataclass(frozen=True)
class Rule:
    """A cross-field rule and the recipe sections it reads. It runs only on a recipe whose sections it reads are
    complete (`REQUIRED`), so it never meets a null where the family requires a value (DeepSeek-V3's
    kv_lora_rank, a MoE family's model.moe); `files`: it looks at the filesystem (skipped by check_files=False)."""

    check: Callable[[Recipe], list[Problem]]
    reads: tuple[str, ...]
    files: bool = False


def check_recipe(recipe: Recipe, *, check_files: bool = True) -> list[Problem]:
    recipe = with_fp8_resolved(recipe)  # train.fp8.recipe auto: the rules judge what the launch target runs
    incomplete = {section: found for section, required in REQUIRED.items() if (found := required(recipe))}
    problems = [problem for found in incomplete.values() for problem in found]
    for rule in RULES:
        if (check_files or not rule.files) and not incomplete.keys() & set(rule.reads):
            problems.extend(rule.check(recipe))
    return problems


def _complete_model(r: Recipe) -> list[Problem]:
    """The fields the family requires that the schema lets be null (they mean nothing for the other families)."""
    m, out = r.model, []
    if m.family == "deepseek_v3":
        for field in MLA_FIELDS[1:]:
            if getattr(m, field) is None:
                out.append(_p(f"model.{field}", "required for family deepseek_v3 (multi-head latent attention)"))
    if m.family in MOE_FAMILIES and m.moe is None:
        out.append(_p("model.moe", f"required for family {m.family}"))
    return out


def _name(r: Recipe) -> list[Problem]:
    if not SAFE_NAME.match(r.name):
        return [_p("name", f"'{r.name}' must be letters, digits, '.', '_' or '-' (it names the run folder)")]
    return []


def _model(r: Recipe) -> list[Problem]:
    m, out = r.model, []
    set_fields = m.model_fields_set
    for field in FAMILY_ONLY_FIELDS:
        # A resolved recipe (dump_recipe) sets every field: its defaults must not count as set.
        if field in FAMILY_FIELDS[m.family] or field not in set_fields:
            continue
        if getattr(m, field) not in (None, 0, type(m).model_fields[field].default):
            families = " or ".join(family for family, fields in FAMILY_FIELDS.items() if field in fields)
            out.append(_p(f"model.{field}", f"only for family {families} (this recipe is {m.family})"))
    if "first_k_dense" in FAMILY_FIELDS[m.family] and m.first_k_dense > m.num_layers:
        out.append(_p("model.first_k_dense", f"{m.first_k_dense} exceeds num_layers {m.num_layers}"))
    if m.family == "deepseek_v3":
        if m.attention_bias:
            out.append(_p("model.attention_bias", "is for grouped-query attention; MLA (deepseek_v3) has none"))
        if m.rope.partial_rotary_factor != 1:
            out.append(_p("model.rope.partial_rotary_factor", "must be 1 for MLA (deepseek_v3): it rotates "
                          "qk_rope_head_dim"))
    if m.family != "deepseek_v3":
        if m.num_attention_heads % m.kv_heads:
            out.append(
                _p("model.num_query_groups", f"{m.kv_heads} must divide num_attention_heads {m.num_attention_heads}")
            )
        if m.head_dim is None and m.hidden_size % m.num_attention_heads:
            out.append(_p("model.head_dim", "required when hidden_size is not a multiple of num_attention_heads"))
    elif m.qk_rope_head_dim % 2:
        out.append(_p("model.qk_rope_head_dim", f"must be even for rotary embeddings, got {m.qk_rope_head_dim}"))
    if m.family == "qwen3" and m.moe is not None:
        out.append(_p("model.moe", "family qwen3 is dense; use family qwen3_moe for experts"))
    if m.family != "deepseek_v3" and m.attention_head_dim % 2:
        out.append(_p("model.head_dim", f"must be even for rotary embeddings, got {m.attention_head_dim}"))
    elif m.family != "deepseek_v3" and (m.rotary_dim % 2 or m.rotary_dim == 0):
        out.append(_p("model.rope.partial_rotary_factor", f"rotates {m.rotary_dim} of head_dim "
                      f"{m.attention_head_dim} features: must be an even number above 0"))
    if r.data.source != "mock" and r.data.tokenizer == "byte" and m.vocab_size < BYTE_VOCAB:
        out.append(_p("model.vocab_size", f"{m.vocab_size} cannot hold the byte tokenizer's {BYTE_VOCAB} ids"))
    if r.train.seq_length > m.max_position_embeddings:
        out.append(
            _p("train.seq_length", f"{r.train.seq_length} exceeds model.max_position_embeddings "
               f"{m.max_position_embeddings}")
        )
    return out


def _gpt_oss(r: Recipe) -> list[Problem]:
    """gpt-oss's own fields, and what is not built for it: packed documents on CUDA (its sinks and windows take an
    additive mask, not FlexAttention's block mask: moe_train/kernels.py). Every layout is built
    (tests/test_gpt_oss_layouts.py)."""
    m, out = r.model, []
    moe = m.moe
    if m.family != "gpt_oss":
        if moe is not None and moe.expert_biases:
            out.append(_p("model.moe.expert_biases", f"only for family gpt_oss (this recipe is {m.family})"))
        if moe is not None and moe.clamped_swiglu is not None:
            out.append(_p("model.moe.clamped_swiglu", f"only for family gpt_oss (this recipe is {m.family})"))
        if moe is not None and moe.router.learned_bias:
            out.append(_p("model.moe.router.learned_bias", f"only for family gpt_oss (this recipe is {m.family})"))
        return out
    if m.layer_types is not None and len(m.layer_types) != m.num_layers:
        out.append(_p("model.layer_types", f"has {len(m.layer_types)} entries, but num_layers is {m.num_layers}"))
    elif m.layer_types is not None and "sliding_attention" in m.layer_types and m.sliding_window is None:
        out.append(_p("model.sliding_window", "required: layer_types has sliding_attention layers"))
    if m.qk_norm:
        out.append(_p("model.qk_norm", "gpt_oss has no QK-norm"))
    if r.data.reset_at_eod and r.launch.device == "cuda":
        out.append(_p("data.reset_at_eod", "gpt_oss's sinks and sliding windows on CUDA take no FlexAttention block "
                      "mask yet (moe_train/kernels.py sinks_and_windows)"))
    return out


def _moe(r: Recipe) -> list[Problem]:
    moe, out = r.model.moe, []
    if moe is None:
        return out
    router = moe.router
    if moe.top_k > moe.num_experts:
        out.append(_p("model.moe.top_k", f"{moe.top_k} exceeds num_experts {moe.num_experts}"))
    if (router.num_groups is None) != (router.group_top_k is None):
        out.append(_p("model.moe.router.group_top_k", "set num_groups and group_top_k together, or neither"))
    elif router.num_groups is not None and router.group_top_k is not None:
        if moe.num_experts % router.num_groups:
            out.append(
                _p("model.moe.router.num_groups", f"{router.num_groups} must divide num_experts {moe.num_experts}")
            )
        if router.group_top_k > router.num_groups:
            out.append(
                _p("model.moe.router.group_top_k", f"{router.group_top_k} exceeds num_groups {router.num_groups}")
            )
        elif moe.num_experts % router.num_groups == 0:
            reachable = router.group_top_k * moe.num_experts // router.num_groups
            if moe.top_k > reachable:
                out.append(
                    _p("model.moe.top_k", f"{moe.top_k} exceeds the {reachable} experts in group_top_k groups")
                )
    if router.load_balancing == "all_layers_aux_loss" and r.parallel.pp > 1:
        out.append(_p("model.moe.router.load_balancing", "all_layers_aux_loss needs every layer's counts before any "
                      "backward, which pipeline stages (pp > 1) cannot share; use aux_loss or global_aux_loss"))
    if moe.pad_to_capacity and moe.capacity_factor is None:
        out.append(_p("model.moe.pad_to_capacity", "needs capacity_factor (dropless has no capacity)"))
    if router.logit_bias is not None and len(router.logit_bias) != moe.num_experts:
        out.append(_p("model.moe.router.logit_bias", f"{len(router.logit_bias)} values for {moe.num_experts} experts "
                      "(one per expert)"))
    return out


def _layout(r: Recipe) -> list[Problem]:
    p, m, launch, out = r.parallel, r.model, r.launch, []
    dense = ranks_beside_dp(p)
    if p.dp is None and r.world_size % dense:
        out.append(
            _p("launch.gpus_per_node", f"world size {r.world_size} (nodes {launch.nodes} x gpus_per_node "
               f"{launch.gpus_per_node}) is not divisible by pp*cp*tp = {dense}")
        )
    elif p.dp is not None and dense * p.dp != r.world_size:
        out.append(
            _p("parallel.dp", f"pp*dp*cp*tp = {dense * p.dp} but the world size is {r.world_size} (nodes "
               f"{launch.nodes} x gpus_per_node {launch.gpus_per_node})")
        )
    # The rules below hold whatever the world size; only the fold onto the dense mesh needs dp.
    dp = r.layout_dp()
    if dp is not None and dp % p.dp_replicate:
        out.append(_p("parallel.dp_replicate", f"{p.dp_replicate} must divide dp = {dp} (HSDP: dp = dp_replicate "
                      "replicas x shards)"))
    if p.gathers_per_step and p.reshard_after_forward:
        out.append(_p("parallel.param_gather", "per_step keeps a step's gathered parameters, which "
                      "reshard_after_forward true frees after every forward; set it false (or null)"))
    if m.moe is None:
        for field in ("ep", "etp"):
            if getattr(p, field) > 1:
                out.append(_p(f"parallel.{field}", "expert parallelism needs a MoE model (model.moe)"))
    else:
        if dp is not None and expert_data_parallel_size(dp, p) is None:
            out.append(
                _p("parallel.ep", f"the expert mesh must fold onto the dense one: dp*cp*tp = {stage_ranks(dp, p)} is "
                   f"not divisible by ep*etp = {ranks_beside_edp(p)}")
            )
        edp = expert_data_parallel_size(dp, p)
        if edp is not None and edp % p.dp_replicate:
            out.append(_p("parallel.dp_replicate", f"{p.dp_replicate} must divide the experts' edp = {edp} "
                          f"(dp*cp*tp / ep*etp): experts replicate over the same replicas"))
        if m.moe.num_experts % p.ep:
            out.append(_p("parallel.ep", f"{p.ep} must divide model.moe.num_experts {m.moe.num_experts}"))
        if p.etp > 1 and m.moe.dispatcher != "allgather":
            out.append(_p("parallel.etp", f"{p.etp} needs model.moe.dispatcher allgather (it gathers tokens over the "
                          "ep x etp ranks and sums the experts' partial outputs)"))
        if m.moe.ffn_hidden_size % p.etp:
            out.append(_p("parallel.etp", f"{p.etp} must divide model.moe.ffn_hidden_size {m.moe.ffn_hidden_size}"))
        if m.moe.dispatcher == "hierarchical" and edp is not None:
            out.extend(_hierarchical_nodes(r))
    if m.num_attention_heads % p.tp:
        out.append(_p("parallel.tp", f"{p.tp} must divide model.num_attention_heads {m.num_attention_heads}"))
    if m.family != "deepseek_v3" and m.kv_heads % p.tp:
        out.append(_p("parallel.tp", f"{p.tp} must divide model.num_query_groups {m.kv_heads}"))
    if m.ffn_hidden_size % p.tp:
        out.append(_p("parallel.tp", f"{p.tp} must divide model.ffn_hidden_size {m.ffn_hidden_size}"))
    if m.padded_vocab_size() % p.tp:
        out.append(_p("parallel.tp", f"{p.tp} must divide the padded vocabulary {m.padded_vocab_size()} (vocab_size "
                      f"{m.vocab_size} padded to a multiple of make_vocab_size_divisible_by)"))
    if m.moe is not None and m.moe.shared_expert_ffn_hidden_size % p.tp:
        out.append(_p("parallel.tp", f"{p.tp} must divide model.moe.shared_expert_ffn_hidden_size "
                      f"{m.moe.shared_expert_ffn_hidden_size}"))
    if m.moe is not None and p.tp > 1 and not p.sequence_parallel and r.train.seq_length % p.tp:
        out.append(_p("train.seq_length", f"{r.train.seq_length} must be divisible by tp = {p.tp}: MoE layers route "
                      "each tp rank's slice of the sequence"))
    if p.sequence_parallel and p.tp == 1:
        out.append(_p("parallel.sequence_parallel", "needs tp > 1 (it shards the tensor-parallel region)"))
    if p.sequence_parallel and r.train.seq_length % (p.tp * p.cp):
        out.append(_p("train.seq_length", f"{r.train.seq_length} must be divisible by tp*cp = {p.tp * p.cp} with "
                      "sequence parallelism"))
    if p.cp > 1:
        # Each cp rank holds 2 of 2*cp equal chunks, which a MoE layer's tp ranks split again into token slices.
        split = 2 * p.cp * (p.tp if m.moe is not None else 1)
        if r.train.seq_length % split:
            out.append(_p("train.seq_length", f"{r.train.seq_length} must be divisible by {split} (2*cp"
                          f"{'*tp' if split != 2 * p.cp else ''}) with context parallelism"))
    return out


def _hierarchical_nodes(r: Recipe) -> list[Problem]:
    """The hierarchical dispatcher splits each ep group at node boundaries (parallel/expert.py `node_split`)."""
    try:
        node_ranks = dispatch_node_ranks(r)
    except (HardwareError, KeyError):  # an unknown GPU: _launch reports it
        return []
    problem = ep_node_split_problem(world_size=r.world_size, ep=r.parallel.ep, etp=r.parallel.etp,
                                    node_ranks=node_ranks)
    return [] if problem is None else [_p("parallel.ep", f"{problem} (model.moe.dispatcher hierarchical)")]


def _pipeline(r: Recipe) -> list[Problem]:
    p, m, out = r.parallel, r.model, []
    stages = p.pp * p.vpp
    if p.vpp > 1 and p.pp == 1:
        out.append(_p("parallel.vpp", "virtual stages need pp > 1"))
    if p.pp_schedule == "interleaved_1f1b" and p.vpp == 1:
        out.append(_p("parallel.pp_schedule", "interleaved_1f1b needs vpp > 1"))
    if p.pp_schedule == "dualpipev" and (p.pp == 1 or p.vpp != 2):
        out.append(_p("parallel.pp_schedule", f"dualpipev needs pp > 1 and vpp 2 (two stages per rank in a V), got "
                      f"pp {p.pp}, vpp {p.vpp}"))
    elif p.vpp > 1 and p.pp_schedule not in ("interleaved_1f1b", "zero_bubble", "dualpipev"):
        out.append(_p("parallel.pp_schedule", f"vpp {p.vpp} needs interleaved_1f1b, zero_bubble or dualpipev"))
    if p.pp_layout is None:
        if m.num_layers % stages:
            out.append(
                _p("parallel.pp_layout", f"num_layers {m.num_layers} does not split evenly over pp*vpp = {stages} "
                   "stages; give a layout such as 'Et*3|(tt|)*29m|L'")
            )
        return out
    try:
        layout = parse_layout(p.pp_layout)
    except LayoutError as error:
        return [_p("parallel.pp_layout", str(error))]
    layers = sum(stage.layers for stage in layout)
    mtp = sum(stage.mtp for stage in layout)
    if len(layout) != stages:
        out.append(_p("parallel.pp_layout", f"has {len(layout)} stages, but pp*vpp = {stages}"))
    if layers != m.num_layers:
        out.append(_p("parallel.pp_layout", f"places {layers} decoder layers ('t'), but num_layers is {m.num_layers}"))
    if mtp != m.mtp_layers:
        out.append(_p("parallel.pp_layout", f"places {mtp} MTP modules ('m'), but mtp_layers is {m.mtp_layers}"))
    if not layout[0].embedding or sum(stage.embedding for stage in layout) != 1:
        out.append(_p("parallel.pp_layout", "the embedding 'E' must appear once, in the first stage"))
    if not layout[-1].loss or sum(stage.loss for stage in layout) != 1:
        out.append(_p("parallel.pp_layout", "the loss 'L' must appear once, in the last stage"))
    empty = [str(index) for index, stage in enumerate(layout) if not (stage.embedding or stage.layers or stage.mtp
                                                                         or stage.loss)]
    if empty:
        out.append(_p("parallel.pp_layout", f"stage(s) {', '.join(empty)} hold nothing (between two '|' there must be "
                      "E, t, m or L)"))
    if any(stage.mtp for stage in layout[:-1]):
        out.append(_p("parallel.pp_layout", "MTP modules 'm' belong to the last stage (they read its final hidden "
                      "states and share its head)"))
    return out


def _overlap(r: Recipe) -> list[Problem]:
    """parallel.ep_overlap's combinations not built (docs/parallel.md, "Overlapped micro-batches")."""
    p, out = r.parallel, []
    if p.split_wgrad:
        out.extend(_split_wgrad(r))
    if not p.ep_overlap:
        return out
    if r.model.moe is None or p.ep * p.etp == 1:
        out.append(_p("parallel.ep_overlap", "needs expert-parallel communication to hide: a MoE model with "
                      "ep or etp > 1"))
    if p.param_gather == "per_microbatch" or p.reshard_after_forward:
        out.append(_p("parallel.param_gather", "ep_overlap runs two micro-batches through a block at once, so FSDP2 "
                      "keeps its parameters gathered over the step: set param_gather per_step (or null) and "
                      "reshard_after_forward false (or null)"))
    if p.pp > 1 and p.pp_schedule != "dualpipev":
        out.append(_p("parallel.ep_overlap", f"with pipeline parallelism is built for pp_schedule dualpipev only, "
                      f"not {p.pp_schedule}: its steady state pairs a forward and a backward of two micro-batches "
                      "on a rank's two stages; 1f1b's would wait on each other across ranks"))
    return out


def _split_wgrad(r: Recipe) -> list[Problem]:
    """parallel.split_wgrad's combinations not built. With or without ep_overlap: the dispatch's backward
    collective is asynchronous in every step, so the delayed weight gradients fill it in the plain step too."""
    p, m = r.parallel, r.model
    field = "parallel.split_wgrad"
    if m.moe is None or p.ep * p.etp == 1:
        return [_p(field, "needs expert-parallel communication to hide the experts' weight gradients behind: a "
                   "MoE model with ep > 1")]
    out = []
    if p.pp > 1:
        out.append(_p(field, "with pipeline parallelism (pp > 1) is not built yet: torch's pipeline schedules "
                      "split weight gradients their own way (zero_bubble)"))
    return out


def _module_problems(field: str, modules: tuple[str, ...], m) -> list[Problem]:
    """The recompute policy's module names that this model does not have (recompute and offload share them)."""
    out = []
    for module in modules:
        if module == "mla_up_proj" and m.family != "deepseek_v3":
            out.append(_p(field, "mla_up_proj needs multi-head latent attention (deepseek_v3)"))
        if module in ("moe_act", "moe") and m.moe is None:
            out.append(_p(field, f"{module} needs a MoE model (model.moe)"))
        if module == "shared_experts" and (m.moe is None or m.moe.shared_expert_ffn_hidden_size == 0):
            out.append(_p(field, "shared_experts needs model.moe.shared_expert_ffn_hidden_size"))
        if module == "mlp" and m.moe is not None and m.first_k_dense == 0:
            out.append(_p(field, "mlp recomputes dense MLPs, and this model has none; use moe"))
    return out


def _recompute(r: Recipe) -> list[Problem]:
    rc = r.parallel.recompute
    if rc.granularity != "selective":
        return []
    return _module_problems("parallel.recompute.modules", rc.modules, r.model)


# Regions that hold others (parallel/recompute.py wraps the outer one only): the whole MoE layer its experts'
# activation and shared experts, MLA's up projections and attention its core attention.
INNER_REGIONS = {"moe": ("moe_act", "shared_experts"), "mla_up_proj": ("core_attn",)}


def _overlapping(a: str, b: str) -> bool:
    return a == b or b in INNER_REGIONS.get(a, ()) or a in INNER_REGIONS.get(b, ())


def offloadable(modules: tuple[str, ...], rc) -> tuple[str, ...]:
    """The regions of `modules` that can be offloaded beside recompute policy `rc` (parallel.recompute): none
    under full recompute, else those no recomputed region overlaps (what `plan --search` keeps of a recipe's
    offloading when it tries another policy)."""
    if rc.granularity == "full":
        return ()
    recomputed = rc.modules if rc.granularity == "selective" else ()
    return tuple(m for m in modules if not any(_overlapping(m, r) for r in recomputed))


def _offload(r: Recipe) -> list[Problem]:
    modules, rc, field = r.parallel.offload.modules, r.parallel.recompute, "parallel.offload.modules"
    if not modules:
        return []
    out = _module_problems(field, modules, r.model)
    if rc.granularity == "full":
        out.append(_p(field, "full recompute reruns every region of the stack, so none can be offloaded: set "
                      "parallel.recompute.granularity none or selective"))
    elif rc.granularity == "selective":
        for module in modules:
            for recomputed in rc.modules:
                if _overlapping(module, recomputed):
                    what = "is" if module == recomputed else "overlaps"
                    out.append(_p(field, f"{module} {what} recomputed ({recomputed} in parallel.recompute.modules): "
                                  "a region is recomputed or offloaded, not both"))
    if r.parallel.ep_overlap:
        out.append(_p(field, "with parallel.ep_overlap is not built yet (the overlapped pairs' forward and backward "
                      "threads are untested with the offload pool)"))
    return out


def _batch(r: Recipe) -> list[Problem]:
    t, p, out, dp = r.train, r.parallel, [], r.layout_dp()
    if dp is None:  # the world size does not divide (reported by _layout): no dp to check the batch against
        return out
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        out.append(
            _p("train.global_batch_size", f"{t.global_batch_size} must be divisible by micro_batch_size * dp = "
               f"{t.micro_batch_size} * {dp}")
        )
    elif p.pp > 1:
        micro_batches = t.global_batch_size // per_step
        if p.pp_schedule in ("interleaved_1f1b", "zero_bubble") and micro_batches % p.pp:
            out.append(_p("train.global_batch_size", f"{p.pp_schedule} needs the micro-batch count per step "
                          f"(global_batch_size / (micro_batch_size * dp) = {micro_batches}) to be a multiple of "
                          f"pp {p.pp}"))
        if p.pp_schedule == "dualpipev" and micro_batches < 2 * p.pp:
            out.append(_p("train.global_batch_size", f"dualpipev needs at least 2 pp = {2 * p.pp} micro-batches per "
                          f"step, got global_batch_size / (micro_batch_size * dp) = {micro_batches}"))
        if p.pp_schedule == "1f1b" and micro_batches < p.pp:
            out.append(_p("train.global_batch_size", f"1f1b needs at least pp = {p.pp} micro-batches per step to fill "
                          f"the pipeline, got global_batch_size / (micro_batch_size * dp) = {micro_batches}"))
    return out


def _train(r: Recipe) -> list[Problem]:
    t, out = r.train, []
    if t.exit_at_step is not None and t.exit_at_step > t.steps:
        out.append(_p("train.exit_at_step", f"{t.exit_at_step} is after the last step {t.steps}"))
    if t.min_lr > t.lr:
        out.append(_p("train.min_lr", f"{t.min_lr} exceeds lr {t.lr}"))
    if t.eval_interval is not None and r.data.valid_fraction == 0:
        out.append(_p("train.eval_interval", "evaluation needs held-out data: set data.valid_fraction > 0"))
    if t.optimizer == "muon" and t.muon.qk_clip is not None:
        if r.model.qk_norm and r.model.kv_lora_rank is None:
            out.append(_p("train.muon.qk_clip", "QK-norm after the projections would undo the clip: set "
                          "model.qk_norm false (or use MLA)"))
        if r.parallel.cp > 1:
            out.append(_p("train.muon.qk_clip", "the max-logit measurement sees one context shard: needs "
                          "parallel.cp 1"))
        if r.model.attention_bias:
            out.append(_p("train.muon.qk_clip", "scales the q/k weights but not their biases: not built with "
                          "model.attention_bias"))
    return out


FP8_CUDA_MULTIPLE = 16  # cuBLAS/CUTLASS fp8 GEMMs: every dimension of a weight a multiple of 16 bytes of fp8


def fp8_gemm_shapes(r: Recipe) -> dict[str, list[tuple[str, int, int]]]:
    """The weight GEMMs of each `train.fp8.modules` kind as one rank holds them: (module, out, in), its tensor-
    parallel shard (column-parallel: out / tp, row-parallel: in / tp; routed experts: ffn / etp)."""
    m, tp, etp = r.model, r.parallel.tp, r.parallel.etp
    h, heads = m.hidden_size, m.num_attention_heads
    if m.family == "deepseek_v3":
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = ([("q_a_proj", m.q_lora_rank, h), ("q_b_proj", heads * qk // tp, m.q_lora_rank)] if m.q_lora_rank
             else [("q_proj", heads * qk // tp, h)])
        attention = [*q, ("kv_a_proj_with_mqa", m.kv_lora_rank + m.qk_rope_head_dim, h),
                     ("kv_b_proj", heads * (m.qk_nope_head_dim + m.v_head_dim) // tp, m.kv_lora_rank),
                     ("o_proj", h, heads * m.v_head_dim // tp)]
    else:
        d = m.attention_head_dim
        attention = [("q_proj", heads * d // tp, h), ("k_proj", m.kv_heads * d // tp, h),
                     ("v_proj", m.kv_heads * d // tp, h), ("o_proj", h, heads * d // tp)]

    def swiglu(ffn: int, shards: int) -> list[tuple[str, int, int]]:
        return [("gate_proj", ffn // shards, h), ("up_proj", ffn // shards, h), ("down_proj", h, ffn // shards)]

    dense = m.moe is None or m.first_k_dense > 0
    shapes = {"attention": attention, "mlp": swiglu(m.ffn_hidden_size, tp) if dense else [],
              "head": [("lm_head", m.padded_vocab_size() // tp, h)], "shared_experts": [], "experts": []}
    if m.moe is not None:
        if m.moe.shared_expert_ffn_hidden_size:
            shapes["shared_experts"] = swiglu(m.moe.shared_expert_ffn_hidden_size, tp)
        shapes["experts"] = swiglu(m.moe.ffn_hidden_size, etp)
    return shapes


def _fp8(r: Recipe) -> list[Problem]:
    t, out = r.train, []
    if t.precision != "fp8":
        return out
    fp8, cuda = t.fp8, r.launch.device == "cuda"
    if fp8.fp8_all_gather and fp8.recipe != "tensorwise":
        out.append(_p("train.fp8.fp8_all_gather", f"torchao gathers fp8 weights for recipe tensorwise only, not "
                      f"{fp8.recipe}"))
    if fp8.fp8_all_gather and fp8.backend != "torchao":
        out.append(_p("train.fp8.fp8_all_gather", "only with backend torchao (FSDP2's fp8 all-gather)"))
    if fp8.backend == "te" and not cuda:
        out.append(_p("train.fp8.backend", "te (transformer-engine) runs on launch.device cuda only"))
    elif fp8.backend == "te" and importlib.util.find_spec("transformer_engine") is None:
        out.append(_p("train.fp8.backend", "te needs transformer-engine (pip install 'moe-train[te]'), which does "
                      "not import here"))
    if fp8.backend == "te" and fp8.recipe == "rowwise":
        out.append(_p("train.fp8.recipe", "transformer-engine has no rowwise recipe (te takes tensorwise, blockwise "
                      "or mxfp8)"))
    if fp8.backend == "te" and r.parallel.tp > 1 and r.parallel.sequence_parallel:
        out.append(_p("train.fp8.backend", "te with parallel.sequence_parallel: the sequence-parallel column GEMM's "
                      "hand-written backward cannot call TE's backward GEMMs"))
    if fp8.backend == "te" and "head" in fp8.modules and recipe_loss_chunk_tokens(r):
        out.append(_p("train.fp8.modules", "head with backend te and the chunked loss (train.loss_chunk_tokens): "
                      "the chunks' hand-written backward cannot call TE's backward GEMMs; set loss_chunk_tokens 0"))
    if fp8.backend == "te" and fp8.saved_inputs == "fp8":
        out.append(_p("train.fp8.saved_inputs", "applies to backend torchao; transformer-engine keeps its GEMMs' "
                      "inputs itself (leave it bf16)"))
    if not fp8.modules:
        out.append(_p("train.fp8.modules", f"empty: precision fp8 with no fp8 GEMM; name at least one of "
                      f"{', '.join(FP8_MODULES)}, or set train.precision bf16"))
    if len(set(fp8.modules)) != len(fp8.modules):
        out.append(_p("train.fp8.modules", "names a kind twice"))
    if cuda:
        for kind in dict.fromkeys(fp8.modules):
            for module, rows, cols in fp8_gemm_shapes(r)[kind]:
                if rows % FP8_CUDA_MULTIPLE or cols % FP8_CUDA_MULTIPLE:
                    out.append(_p("train.fp8.modules", f"{kind}: {module} is {rows} x {cols} on a rank, and CUDA "
                                  f"fp8 GEMMs need every dimension a multiple of {FP8_CUDA_MULTIPLE} (recipe "
                                  f"{r.name}); leave {kind} out of train.fp8.modules"))
                    break
    return out


def _launch(r: Recipe) -> list[Problem]:
    launch, out = r.launch, []
    try:
        table = hardware_table()
    except HardwareError as error:
        return [_p("launch.gpu", str(error))]
    hardware = table.get(launch.gpu)
    if hardware is None:
        out.append(_p("launch.gpu", f"unknown '{launch.gpu}'; allowed: {', '.join(table)} (or add it in a hardware "
                      "file: docs/plan.md)"))
    else:
        if launch.device == "cpu" and launch.gpu != "cpu":
            out.append(_p("launch.gpu", f"'{launch.gpu}' with launch.device cpu; use gpu: cpu or device: cuda"))
        if launch.device == "cuda" and launch.gpu == "cpu":
            out.append(_p("launch.gpu", "name the GPU for launch.device cuda (e.g. h100)"))
        if launch.device == "cuda" and launch.gpus_per_node > hardware.gpus_per_node:
            out.append(
                _p("launch.gpus_per_node", f"{launch.gpus_per_node} exceeds the {hardware.gpus_per_node} GPUs "
                   f"of a {launch.gpu} node")
            )
        if r.train.precision == "fp8" and hardware.id != "cpu" and not hardware.supports_fp8:
            out.append(_p("train.precision", f"{hardware.name} has no fp8 tensor cores"))
        elif (r.train.precision == "fp8" and r.train.fp8.recipe == "mxfp8" and launch.device == "cuda"
              and (hardware.compute_capability or 0) < 10):
            capability = hardware.compute_capability or "unknown"
            out.append(_p("train.fp8.recipe", f"mxfp8 needs compute capability 10.0 (Blackwell, sm100); "
                          f"{hardware.name} is {capability}: on it, --set train.fp8.recipe=blockwise (DeepSeek-V3's "
                          "1x128/128x128 block scales)"))
    for name in launch.env:
        if not IDENTIFIER.match(name):
            out.append(_p("launch.env", f"'{name}' is not a valid environment variable name"))
    slurm = launch.slurm
    for field in ("partition", "account", "time", "job_name", "qos", "constraint", "container_image"):
        value = getattr(slurm, field)
        if value is not None and ("\n" in value or "\r" in value):
            out.append(_p(f"launch.slurm.{field}", "must be one line (newlines would break the #SBATCH header)"))
    for index, directive in enumerate(slurm.extra_sbatch):
        if "\n" in directive or "\r" in directive:
            out.append(_p(f"launch.slurm.extra_sbatch.{index}", "must be one line"))
    return out


def _data_shape(r: Recipe) -> list[Problem]:
    d, out = r.data, []
    if d.source == "indexed" and not d.paths:
        out.append(_p("data.paths", "source indexed needs at least one .bin/.idx prefix"))
    if d.source != "indexed" and d.paths:
        out.append(_p("data.paths", f"only for source indexed (source is {d.source})"))
    if d.weights is not None:
        if len(d.weights) != len(d.paths):
            out.append(_p("data.weights", f"{len(d.weights)} weights for {len(d.paths)} paths"))
        if any(w <= 0 or not math.isfinite(w) for w in d.weights):
            out.append(_p("data.weights", "weights must be positive"))
    return out


def _data_files(r: Recipe) -> list[Problem]:
    d, out = r.data, []
    if d.tokenizer != "byte" and not Path(d.tokenizer).is_file():
        out.append(_p("data.tokenizer", f"'byte' or a tokenizer.json file; {d.tokenizer} does not exist"))
    if d.source != "indexed":
        return out
    for index, prefix in enumerate(d.paths):
        stem = prefix.removesuffix(".bin").removesuffix(".idx")
        for suffix in (".bin", ".idx"):
            if not Path(stem + suffix).is_file():
                out.append(_p(f"data.paths.{index}", f"{stem + suffix} does not exist"))
        if Path(stem + ".idx").is_file():
            try:
                header = read_index_header(stem)
            except DataError as error:
                out.append(_p(f"data.paths.{index}", str(error)))
                continue
            if header.document_count == 0:
                out.append(_p(f"data.paths.{index}", f"{stem}.idx holds 0 documents (was its input empty?); "
                              "prepare it from a non-empty input"))
    return out


def _placement_file(r: Recipe) -> list[Problem]:
    if r.model.moe is None or r.model.moe.num_experts % r.parallel.ep:
        return []  # no experts to place, or parallel.ep's own problem
    try:
        recipe_placement(r)
    except PlacementError as error:
        return [_p("model.moe.placement", str(error))]
    return []


def _checkpoint_files(r: Recipe) -> list[Problem]:
    c, out = r.checkpoint, []
    if c.resume not in ("auto", "required", "never") and not Path(c.resume).exists():
        out.append(
            _p("checkpoint.resume", f"auto, required, never or an existing checkpoint; {c.resume} does not exist")
        )
    if c.init_from is not None and not Path(c.init_from).exists():
        out.append(_p("checkpoint.init_from", f"{c.init_from} does not exist"))
    if c.init_from is not None and c.resume not in ("auto", "never"):
        out.append(_p("checkpoint.init_from", f"conflicts with resume {c.resume}: init_from starts fresh at step 0"))
    return out


def _logging(r: Recipe) -> list[Problem]:
    wandb = r.logging.wandb
    if wandb is not None and not wandb.project.strip():
        return [_p("logging.wandb.project", "empty; name the W&B project (or drop logging.wandb)")]
    return []


# Every rule, in the order its problems are listed. A section a rule reads that `REQUIRED` finds incomplete
# keeps it from running: its fields' problems are listed instead.
REQUIRED: dict[str, Callable[[Recipe], list[Problem]]] = {"model": _complete_model}
RULES: tuple[Rule, ...] = (
    Rule(_name, reads=("name",)),
    Rule(_model, reads=("model", "data", "train")),
    Rule(_moe, reads=("model", "parallel")),
    Rule(_gpt_oss, reads=("model", "data", "launch")),
    Rule(_layout, reads=("model", "parallel", "train", "launch")),
    Rule(_pipeline, reads=("model", "parallel")),
    Rule(_overlap, reads=("model", "parallel", "train")),
    Rule(_recompute, reads=("model", "parallel")),
    Rule(_offload, reads=("model", "parallel")),
    Rule(_batch, reads=("train", "parallel", "launch")),
    Rule(_train, reads=("train", "data")),
    Rule(_fp8, reads=("model", "parallel", "train", "launch")),
    Rule(_launch, reads=("launch", "train")),
    Rule(_logging, reads=("logging",)),
    Rule(_data_shape, reads=("data",)),
    Rule(_data_files, reads=("data",), files=True),
    Rule(_checkpoint_files, reads=("checkpoint",), files=True),
    Rule(_placement_file, reads=("model", "parallel"), files=True),
)
