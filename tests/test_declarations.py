"""The module declarations (models/declarations): they describe the modules as built, and the planner files
that read them no longer restate a module's parameters, GEMMs or saved tensors of their own.

The saved tensors and FLOPs the declarations give are held to autograd's saves and measure's counter elsewhere
(tests/test_plan.py, tests/test_plan_measure.py); here: every parameter a built model holds is declared with its
shape, and the converted plan files (CONVERTED) contain no module-specific name or module-shape field."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path
from typing import get_args

import pytest

import moe_train
from moe_train.config import load_recipe
from moe_train.config.loader import builtin_recipes
from moe_train.config.rules import INNER_REGIONS
from moe_train.config.schema import RecomputeModule
from moe_train.models import build_model
from moe_train.models.declarations import embedding as ends
from moe_train.models.declarations import mla, moe_layer, mtp, policies
from moe_train.models.declarations.layer import attention_module, decoder_layer, layer_saved
from moe_train.models.declarations.layout import ActivationLayout

TINY = [name for name in builtin_recipes() if name.endswith("-tiny")]  # every family has one
ROOT = Path(moe_train.__file__).parent.parent
# The plan files that compute from the declarations instead of restating the modules.
CONVERTED = tuple(f"moe_train/plan/{name}.py" for name in (
    "saved_tensors", "flop_count", "params", "selective_recompute", "offloaded_saves", "muon_cost",
    "activation_memory", "comm_bytes"))
# The model section's fields that shape one module: read by its declaration, not by the planner.
MODULE_FIELDS = frozenset({
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank", "kv_lora_rank", "attention_head_dim",
    "kv_heads", "num_attention_heads", "ffn_hidden_size", "shared_expert_ffn_hidden_size", "attention_bias",
    "attention_output_bias", "attention_sinks", "qk_norm", "expert_biases", "learned_bias", "rotary_dim",
    "padded_vocab_size", "vocab_size",
})
# Names that are the planner's own as well as a module's: FSDP2 units (parallel/data_parallel.py) and gradient-norm
# meshes (train/grad_norm.py), which params.Tensor names: the routed experts' and the MTP module's own parts'; a
# pipeline chunk's ends (rank_layout.Chunk), whose collectives comm_bytes.py names "embedding" and "head".
PLAN_VOCABULARY = frozenset({"experts", "mtp", "embedding", "head"})
LAYOUTS = [ActivationLayout(micro_batch=2, seq_length=64, tp=tp, sequence_parallel=sp, ep=ep, etp=etp, device=device,
                            fp8_kept=fp8, fp8_modules=("attention", "mlp", "experts", "shared_experts") if fp8 else ())
           for tp, sp, ep, etp, device, fp8 in [(1, False, 1, 1, "cpu", None), (2, True, 2, 2, "cuda", "rowwise")]]


def _match(real: list[tuple[str, tuple[int, ...]]], declared: list[tuple[str, tuple[int, ...]]]) -> list[str]:
    """The real parameters no declared one accounts for: a declared (name, shape) matches a real parameter of the
    same shape whose name is that name under the module's path (longest declared names matched first)."""
    left = Counter(declared)
    missing = []
    for name, shape in real:
        hit = max((d for d in left if left[d] and d[1] == shape and (name == d[0] or name.endswith("." + d[0]))),
                  key=lambda d: len(d[0]), default=None)
        if hit is None:
            missing.append(name)
        else:
            left[hit] -= 1
    return missing + [f"declared, not built: {d[0]}" for d, n in left.items() for _ in range(n)]


@pytest.mark.parametrize("name", TINY)
def test_every_parameter_of_a_built_model_is_declared_with_its_shape(name: str) -> None:
    """Decoder blocks of each kind, the ends and the MTP module's own parts: the meta-built model's parameters
    are the declarations', name under the module's path and shape, one to one."""
    cfg = load_recipe(name).model
    model = build_model(cfg, device="meta")
    for index in sorted({0, cfg.num_layers - 1}):
        real = [(n, tuple(p.shape)) for n, p in model.layers[str(index)].named_parameters()]
        declared = [(p.name, p.shape) for m in decoder_layer(cfg, moe_layer=cfg.is_moe_layer(index)) for p in m.params]
        assert _match(real, declared) == [], (name, index)
    real = [(n, tuple(p.shape)) for n, p in model.named_parameters()
            if not n.startswith("layers.") and ".block." not in n]
    ends_and_mtp = [ends.embedding(cfg), ends.final_norm(cfg), ends.head(cfg, tied=cfg.tie_embeddings)]
    ends_and_mtp += [mtp.declare(cfg)] * cfg.mtp_layers
    assert _match(real, [(p.name, p.shape) for m in ends_and_mtp for p in m.params]) == [], name


def _declared_names() -> set[str]:
    """Every name a declaration gives (parameters, GEMMs, saved storages, regions) and its first part, over every
    built-in recipe's layer kinds and a plain and a sharded fp8 layout."""
    names: set[str] = set()
    for recipe in builtin_recipes():
        cfg = load_recipe(recipe, check_files=False).model
        modules = [ends.embedding(cfg), ends.final_norm(cfg), ends.head(cfg), mtp.declare(cfg)]
        for moe in {False, cfg.moe is not None}:
            modules += decoder_layer(cfg, moe_layer=moe)
            for lay in LAYOUTS:
                names |= {n for item in layer_saved(cfg, lay, moe_layer=moe) for n in (item.name, item.region)}
        names |= {n for m in modules for n in (m.name, *(p.name for p in m.params), *(g.name for g in m.gemms),
                                               *(g.region for g in m.gemms))}
    return (names | {n.split(".")[0] for n in names}) - PLAN_VOCABULARY


def _restatements(path: Path, declared: set[str]) -> list[str]:
    """What `path` names of the modules itself: string constants (docstrings aside; f-strings' literal parts
    included) that are declared names, reads of module-shape fields, and the MLA family branch."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if node.value in declared or node.value.strip(".") in declared or node.value == "deepseek_v3":
                found.append(f"{path.name}:{node.lineno} {node.value!r}")
        elif isinstance(node, ast.Attribute) and node.attr in MODULE_FIELDS:
            found.append(f"{path.name}:{node.lineno} .{node.attr}")
    return found


def test_converted_plan_files_name_no_module_part_of_their_own() -> None:
    """plan/saved_tensors.py, flop_count.py, params.py, selective_recompute.py, offloaded_saves.py, muon_cost.py,
    activation_memory.py and comm_bytes.py compute from the declarations: none names a module's
    parameters, GEMMs, saved tensors or regions, reads a module-shape field of the model section, or branches on
    the MLA family (before the declarations, each did all of these)."""
    declared = _declared_names()
    assert {"q_proj", "gate_proj", "sdpa.q", "shared_experts", "router.scores", "core_attn"} <= declared
    assert [hit for rel in CONVERTED for hit in _restatements(ROOT / rel, declared)] == []


def test_the_policies_region_names_are_the_declared_ones() -> None:
    """The recipe's recompute and offload module names (config/schema.py `RecomputeModule`; config imports nothing
    of models/, so the list is written there) are the regions the declarations own, and config/rules.py's nesting
    of regions is the declarations': the MoE layer holds its activation and shared experts, MLA's up projections
    hold core attention."""
    assert set(get_args(RecomputeModule)) == policies.REGIONS
    assert set(INNER_REGIONS[moe_layer.REGION]) == set(moe_layer.INNER)
    mla_core = attention_module(load_recipe("deepseek-v3-tiny").model).core
    assert set(INNER_REGIONS[mla.UP]) == set(mla_core.rerun_by) - {mla.UP}
