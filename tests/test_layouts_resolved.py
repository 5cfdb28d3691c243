"""The tiny proxies under every layout the parallel tests use: what each layout resolves to (mesh sizes worked
out by hand), and where an explicit pipeline layout puts the MTP module."""

from __future__ import annotations

import pytest

from moe_train.config import RecipeError, load_recipe
from moe_train.config.pp_layout import Stage, parse_layout

# overrides -> (world, pp, vpp, dp, cp, tp, edp, ep, etp), each size worked out from the overrides by hand:
# dp = world / (pp * cp * tp); edp = dp * cp * tp / (ep * etp).
DENSE_LAYOUTS = [
    (["launch.gpus_per_node=4", "parallel.tp=4", "parallel.sequence_parallel=true"], (4, 1, 1, 1, 1, 4, 4, 1, 1)),
    (["launch.gpus_per_node=8", "parallel.pp=4", "parallel.vpp=2", "parallel.pp_schedule=interleaved_1f1b"],
     (8, 4, 2, 2, 1, 1, 2, 1, 1)),
    (["launch.gpus_per_node=8", "parallel.dp=8"], (8, 1, 1, 8, 1, 1, 8, 1, 1)),
    (["launch.gpus_per_node=4", "parallel.dp=4"], (4, 1, 1, 4, 1, 1, 4, 1, 1)),
]
MOE_LAYOUTS = [
    (["launch.gpus_per_node=8", "parallel.ep=8"], (8, 1, 1, 8, 1, 1, 1, 8, 1)),
    (["launch.gpus_per_node=8", "parallel.tp=2", "parallel.ep=4", "parallel.sequence_parallel=true"],
     (8, 1, 1, 4, 1, 2, 2, 4, 1)),
]


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny", "glm4-moe-tiny"])
def test_tiny_proxies_resolve_every_tested_layout(name: str) -> None:
    moe = load_recipe(name).model.moe is not None
    for overrides, sizes in DENSE_LAYOUTS + (MOE_LAYOUTS if moe else []):
        # At the tests' micro-batch size: qwen3-moe-tiny's own 8 (the default run's speed) divides the batch up to dp 2.
        recipe = load_recipe(name, ["train.micro_batch_size=2", *overrides])
        p, m = recipe.parallel, recipe.model
        world, pp, vpp, dp, cp, tp, edp, ep, etp = sizes
        got = (recipe.world_size, p.pp, p.vpp or 1, recipe.dp, p.cp, p.tp, recipe.edp, p.ep, p.etp)
        assert got == sizes, (overrides, got)
        # What each size needs from the model, checked here rather than trusted to validation.
        assert m.num_attention_heads % tp == 0 and m.kv_heads % tp == 0, overrides
        assert m.num_layers % (pp * vpp) == 0, overrides
        assert m.padded_vocab_size() % tp == 0, overrides
        assert recipe.train.global_batch_size % (dp * recipe.train.micro_batch_size) == 0, overrides
        if moe:
            assert m.moe.num_experts % ep == 0, overrides


def test_explicit_layout_with_mtp_puts_it_where_written() -> None:
    recipe = load_recipe("deepseek-v3-tiny", ["launch.gpus_per_node=4", "parallel.pp=4",
                                              "parallel.pp_layout=Ett|tt|tt|ttmL"])
    assert recipe.model.mtp_layers == 1 and recipe.model.num_layers == 8
    assert parse_layout(recipe.parallel.pp_layout) == [
        Stage(embedding=True, layers=2, mtp=0, loss=False),
        Stage(embedding=False, layers=2, mtp=0, loss=False),
        Stage(embedding=False, layers=2, mtp=0, loss=False),
        Stage(embedding=False, layers=2, mtp=1, loss=True),
    ]
    for layout, problem in (("Ett|tt|tt|ttL", "places 0 MTP modules ('m'), but mtp_layers is 1"),
                            ("Ettm|tt|tt|ttmL", "places 2 MTP modules ('m'), but mtp_layers is 1")):
        with pytest.raises(RecipeError, match=problem.replace("(", r"\(").replace(")", r"\)")):
            load_recipe("deepseek-v3-tiny", ["launch.gpus_per_node=4", "parallel.pp=4", f"parallel.pp_layout={layout}"])
