"""Every GEMM of the model runs through one site, models/linear.py (`linear`, `grouped_mm` and the two
gradient products), so a precision or kernel choice (FP8, a chunked loss over the head) is made in one place.

Two checks: a source rule (no other module of models/ or parallel/ calls a matrix product or builds a plain
nn.Linear), and a run: every matrix product a forward dispatches comes from the site (SDPA's score products
excepted: they have no weight), and their number is the model's GEMM count written out from its config. The
same run check holds per rank under tensor parallelism (tests/test_tensor_parallel.py's two-rank job).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from helpers import block_gemms, gemm_origins

import moe_train
from moe_train.config import load_recipe
from moe_train.models import build_model
from moe_train.models.moe.experts import GroupedExperts, grouped_mm_supported

PACKAGE = Path(moe_train.__file__).parent
SITE = PACKAGE / "models" / "linear.py"
FP8_PRODUCTS = PACKAGE / "models" / "fp8" / "gemm.py"  # the site's fp8 half: only linear.py's functions call it
PRODUCTS = {"matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "einsum", "_grouped_mm", "tensordot"}


def _bypasses(path: Path) -> list[str]:
    """`file:line what` for every matrix product or plain nn.Linear in the source of `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        what = None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
            what = "@"
        elif isinstance(node, ast.Attribute) and node.attr in PRODUCTS:
            what = node.attr
        elif isinstance(node, ast.Attribute) and node.attr == "linear" and (
            isinstance(node.value, ast.Name) and node.value.id == "F" or
            isinstance(node.value, ast.Attribute) and node.value.attr == "functional"
        ):
            what = "F.linear"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "Linear" and (
            isinstance(node.func.value, ast.Name) and node.func.value.id == "nn"
        ):
            what = "nn.Linear"
        if what is not None:
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {what}")
    return found


def test_no_module_of_models_or_parallel_multiplies_matrices_outside_the_site():
    offenders = [hit for folder in ("models", "parallel") for path in sorted((PACKAGE / folder).rglob("*.py"))
                 if path not in (SITE, FP8_PRODUCTS) for hit in _bypasses(path)]
    assert offenders == []
    # The rule sees what it must: the site itself is full of products.
    assert {hit.split()[-1] for hit in _bypasses(SITE)} >= {"F.linear", "matmul", "_grouped_mm"}
    assert {hit.split()[-1] for hit in _bypasses(FP8_PRODUCTS)} >= {"mm", "_grouped_mm"}


def test_only_the_site_calls_the_fp8_products():
    """models/fp8/gemm.py's GEMMs are reached through linear.py's functions (which take the module's `fp8`), so
    the site stays one: no other module of models/ or parallel/ names Fp8Gemm's product methods."""
    methods = {"grouped_mm", "input_grad", "weight_grad", "linear"}
    callers = []
    for folder in ("models", "parallel"):
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            if path in (SITE, FP8_PRODUCTS):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in methods
                        and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "fp8"):
                    callers.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert callers == []


def expected_gemms(cfg) -> int:
    """The model forward's weight GEMMs: every block, the head, and per MTP depth its projection, block and the
    head again; and gpt-oss's sink and window attention, written out, its two score products a layer (QK^T and
    PV through the site's `attention_product`, one block of query rows at these sizes)."""
    written_out = 2 if cfg.attention_sinks or cfg.sliding_window is not None else 0
    layers = sum(block_gemms(cfg, i) + written_out for i in range(cfg.num_layers))
    mtp = sum(1 + block_gemms(cfg, cfg.num_layers + k) + 1 for k in range(cfg.mtp_layers))
    return layers + 1 + mtp


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny", "glm4-moe-tiny",
                                  "gpt-oss-tiny"])
def test_every_forward_gemm_runs_through_the_site(name: str):
    torch.set_num_threads(1)
    cfg = load_recipe(name).model.model_copy(update={"num_layers": 2})
    if cfg.family == "deepseek_v3":
        cfg = cfg.model_copy(update={"mtp_layers": 1})
    model = build_model(cfg, seed=0)
    for module in model.modules():
        if isinstance(module, GroupedExperts):  # one grouped GEMM per projection, not one per expert
            assert grouped_mm_supported(torch.float32, torch.device("cpu"), hidden_size=module.hidden_size,
                                        ffn_hidden_size=module.ffn_hidden_size)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with gemm_origins() as gemms:
        terms = model(tokens, labels=tokens)
    assert "elsewhere" not in gemms.origins
    assert gemms.origins.count("site") == expected_gemms(cfg)
    (terms.lm_sum + terms.mtp).backward()  # the site's products are differentiable as before
    assert model.lm_head.weight.grad is not None


@pytest.mark.parametrize(("name", "recipe"), [("qwen3-moe-tiny", "tensorwise"), ("deepseek-v3-tiny", "blockwise")])
def test_fp8_gemms_run_through_the_site(name: str, recipe: str):
    """With every kind marked for fp8 (the head too), each forward GEMM is still one product from the site: one
    torch._scaled_mm (real) or one bf16 mm (emulated) per linear, one grouped GEMM per expert projection; only
    the router (fp32) and MTP's eh_proj stay out of fp8."""
    from moe_train.config.schema import Fp8Config
    from moe_train.models.fp8.gemm import count_fp8_gemms
    from moe_train.models.fp8.select import apply_fp8

    torch.set_num_threads(1)
    cfg = load_recipe(name).model.model_copy(update={"num_layers": 2})
    model = build_model(cfg, seed=0).bfloat16()
    marked = apply_fp8(model, Fp8Config(recipe=recipe, modules=("attention", "mlp", "shared_experts", "experts",
                                                                "head")))
    assert marked["head"] == 1 and marked["experts"] == sum(
        cfg.is_moe_layer(i) for i in range(cfg.num_layers + cfg.mtp_layers))
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with gemm_origins() as gemms, count_fp8_gemms() as tally:
        model(tokens, labels=tokens)
    assert "elsewhere" not in gemms.origins
    assert gemms.origins.count("site") == expected_gemms(cfg)
    routers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers + cfg.mtp_layers))
    forward = sum(n for (kind, product, _), n in tally.items() if product == "forward")
    assert forward == expected_gemms(cfg) - routers - cfg.mtp_layers  # eh_proj: one per MTP depth
