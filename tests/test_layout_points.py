"""Parallelism declared, not patched (parallel/layout.py): a layout changes a model module only through the
points the module declares, so `type(module)` is the model's own class under every layout.

- no file of moe_train/ swaps a class (`__class__ =`), rebinds a method (an assignment or setattr to `forward`,
  or to the name of a method of a models/ class on another object than `self`) or binds one
  (`types.MethodType`), outside the one mechanism (parallel/layout.py, models/layout_region.py);
- built as a rank of each layout builds it (torch's fake process group, as `measure --fake` does, on the meta
  device), every module of every chunk has the class the single-process model has at that name (FSDP2's
  `FSDP<class>` read as its base class), a class defined at its module's top level (no generated class); and
  the layout did act, through the points (a region's wrappers, a Linear's or CoreAttention's `parallel`, the
  chunk's `stage`).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import moe_train

PACKAGE = Path(moe_train.__file__).parent
MECHANISM = {"parallel/layout.py", "models/layout_region.py"}


def _sources() -> dict[str, ast.Module]:
    return {str(path.relative_to(PACKAGE)): ast.parse(path.read_text()) for path in PACKAGE.rglob("*.py")}


def _model_methods(trees: dict[str, ast.Module]) -> set[str]:
    """Every method name of a class in models/ (properties left out: they are read, not called)."""
    names = {"forward"}
    for path, tree in trees.items():
        if not path.startswith("models/"):
            continue
        for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
            for item in cls.body:
                decorators = {ast.unparse(d) for d in getattr(item, "decorator_list", ())}
                if isinstance(item, ast.FunctionDef) and not any("property" in d or "setter" in d for d in decorators):
                    names.add(item.name)
    return names - {"__init__"}


def _rewrites(tree: ast.Module, methods: set[str]) -> list[str]:
    """Class swaps, method rebinds and method bindings in one file, as 'line: code'."""
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AugAssign | ast.AnnAssign) else []
        for target in targets:
            if not isinstance(target, ast.Attribute):
                continue
            own = ast.unparse(target.value) in ("self", "ctx")  # an object's own attribute, in its own class
            if target.attr in ("__class__", "forward") or (target.attr in methods and not own):
                found.append(f"{node.lineno}: {ast.unparse(node)[:80]}")
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name.endswith("MethodType"):
                found.append(f"{node.lineno}: {ast.unparse(node)[:80]}")
            if name == "setattr" and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and (
                    node.args[1].value == "__class__" or node.args[1].value in methods):
                found.append(f"{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_no_class_swap_or_rebound_method_outside_the_mechanism():
    trees = _sources()
    methods = _model_methods(trees)
    assert {"forward", "up_attend", "activation", "_attach_balancing_losses"} <= methods  # the scan sees models/
    found = {path: hits for path, tree in trees.items() if path not in MECHANISM
             for hits in [_rewrites(tree, methods)] if hits}
    assert found == {}


def test_the_scan_finds_each_kind_of_rewrite():
    """The scan is not blind: each kind it forbids, written out, is found."""
    code = ("block.__class__ = Other\nblock.ffn.forward = wrapped\nattn.up_attend = checkpointed(attn.up_attend)\n"
            "setattr(m, 'forward', f)\nm.f = types.MethodType(f, m)\nm.token_group = group\n")
    hits = _rewrites(ast.parse(code), {"forward", "up_attend"})
    assert [hit.split(":")[0] for hit in hits] == ["1", "2", "3", "4", "5"]


LAYOUTS = {  # recipe, overrides: every parallel kind and every layout point
    "tp2-sp": ("deepseek-v3-tiny", ["parallel.tp=2", "parallel.sequence_parallel=true",
                                     "launch.gpus_per_node=2"]),
    "tp2-moe-slices": ("qwen3-moe-tiny", ["parallel.tp=2", "launch.gpus_per_node=2"]),
    "pp2": ("qwen3-moe-tiny", ["parallel.pp=2", "launch.gpus_per_node=2"]),
    "ep2": ("qwen3-moe-tiny", ["parallel.ep=2", "launch.gpus_per_node=2"]),
    "cp2": ("qwen3-tiny", ["parallel.cp=2", "launch.gpus_per_node=2"]),
    "selective": ("deepseek-v3-tiny", ["parallel.recompute.granularity=selective",
                                        "parallel.recompute.modules=[mla_up_proj,layernorm,mlp,moe_act,shared_experts]"]),
    "recompute-moe-compiled": ("qwen3-moe-tiny", ["parallel.recompute.granularity=selective",
                                                   "parallel.recompute.modules=[core_attn,moe]", "train.compile=true"]),
    "offload": ("deepseek-v3-tiny", ["parallel.offload.modules=[core_attn,mlp,moe]"]),
}


def _build(recipe_name: str, overrides: list[str]):
    """This rank's chunks of the recipe's model as rank 0 of its layout builds them, and the single-process
    model, on the meta device."""
    from moe_train.config import load_recipe
    from moe_train.measure.fake import fake_process_group
    from moe_train.measure.targets import as_fake_runs
    from moe_train.models import build_model
    from moe_train.parallel import parallelize
    from moe_train.parallel.bootstrap import bootstrap

    recipe = as_fake_runs(load_recipe(recipe_name, overrides))
    single = build_model(recipe.model, device="meta")
    with fake_process_group(rank=0, world_size=recipe.world_size):
        ctx = bootstrap(recipe, distinct_groups=True)
        chunks = parallelize(build_model(recipe.model, device="meta"), recipe, ctx)
    return recipe, single, chunks


def _model_class(module) -> type:
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if issubclass(cls, FSDPModule):  # FSDP2's own subclass: (FSDPModule, the model's class)
        bases = [base for base in cls.__bases__ if base is not FSDPModule]
        assert len(bases) == 1, cls.__bases__
        cls = bases[0]
    return cls


def _wrappers(chunks) -> set[str]:
    from moe_train.models.layout_region import LayoutRegion

    return {reason for chunk in chunks for module in chunk.modules() for value in vars(module).values()
            if isinstance(value, LayoutRegion) for reason in value.wrappers}


@pytest.mark.usefixtures("no_process_group")
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_module_keeps_the_models_class_under_the_layout(name):
    from moe_train.models.linear import Linear

    recipe, single, chunks = _build(*LAYOUTS[name])
    plain = {name: type(module) for name, module in single.named_modules()}
    for chunk in chunks:
        for path, module in chunk.named_modules():
            cls = _model_class(module)
            assert getattr(sys.modules[cls.__module__], cls.__qualname__, None) is cls, f"{path}: generated {cls}"
            assert cls is plain[path], f"{path}: {cls} under {name}, {plain[path]} in one process"
    wrappers = _wrappers(chunks)
    parallel_linears = [m for chunk in chunks for m in chunk.modules() if isinstance(m, Linear) and m.parallel]
    moe = recipe.model.moe
    expected = {
        "tp2-sp": lambda: ({"tensor parallel: input enters the region", "tensor parallel: joins the region"}
                           <= wrappers and bool(parallel_linears) and "tensor parallel: route a slice" not in wrappers),
        "tp2-moe-slices": lambda: "tensor parallel: route a slice" in wrappers,
        "pp2": lambda: ([chunk.stage.index for chunk in chunks] == [0]
                        and len(chunks[0].layers) < recipe.model.num_layers),
        "ep2": lambda: all(chunk.layers[str(i)].ffn.dispatcher.num_local_experts == moe.num_experts // 2
                           for chunk in chunks for i in range(recipe.model.first_k_dense, recipe.model.num_layers)),
        "cp2": lambda: all(type(chunk.layers[i].self_attn.core_attention.parallel).__name__
                           == "ContextParallelAttention" for chunk in chunks for i in chunk.layers),
        "selective": lambda: {"recompute mla_up_proj", "recompute layernorm", "recompute mlp", "recompute moe_act",
                              "recompute shared_experts"} <= wrappers,
        "recompute-moe-compiled": lambda: ({"recompute core_attn", "recompute moe", "compile: eager MoE layer"}
                                           <= wrappers),
        "offload": lambda: {"offload core_attn", "offload mlp", "offload moe", "offload layer pass"} <= wrappers,
    }
    assert expected[name](), (name, sorted(wrappers))
