"""Activation offloading (`parallel.offload`, parallel/offload.py) against the plain step: the same losses, every
gradient of step 1 and every parameter after the last step, bit for bit (the saves come back byte for byte, and
nothing else changes), for every region name in one process; the pool really holds the saves; validate's rules.
The multi-rank layouts (PP2 1F1B and interleaved, TP2+SP, EP2, FSDP2, recompute of other regions) are in
tests/test_offload_layouts.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_helpers import assert_bad_input, run_cli
from helpers import FP32, SHRINK, SHRINK_LAYOUT, assert_same_run, sets

from moe_train.config import load_recipe

EXACT = {"loss": 0.0, "rtol": 0.0, "atol": 0.0}
# Every region name on the recipes that have it: qwen3-moe-tiny (GQA, routed experts), deepseek-v3-tiny (MLA, a
# dense first layer, shared experts, MTP's block).
REGIONS = {
    "qwen3-moe-tiny": ["core_attn", "layernorm", "moe_act", "moe", "core_attn,layernorm,moe_act"],
    "deepseek-v3-tiny": ["mla_up_proj", "core_attn", "mlp", "shared_experts", "moe"],
}


def _offloaded(modules: str) -> str:
    return f"parallel.offload.modules=[{modules}]"


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(REGIONS))
def test_every_region_offloaded_equals_the_plain_step(tmp_path: Path, recipe: str) -> None:
    from workers.record import record_run

    overrides = [*SHRINK_LAYOUT, *FP32[recipe]]
    plain = record_run(recipe, overrides, world=1, run_dir=tmp_path / "plain", steps=2)
    for modules in REGIONS[recipe]:
        run_dir = tmp_path / modules.replace(",", "+")
        got = record_run(recipe, [*overrides, _offloaded(modules)], world=1, run_dir=run_dir, steps=2)
        assert_same_run(got, plain, **EXACT)


@pytest.mark.slow
def test_fp8_kept_inputs_and_bf16_offloaded_equal_the_plain_step(tmp_path: Path) -> None:
    """FP8 GEMMs keeping their inputs in fp8 (one copy shared by the GEMMs that read it) and bf16 (FSDP2's
    per-layer casts): the pool copies what only its regions hold and leaves the rest."""
    from workers.record import record_run

    for name, extra in {
        "fp8": ["train.precision=fp8", "train.fp8.recipe=rowwise", "train.fp8.saved_inputs=fp8"],
        "bf16": ["train.precision=bf16"],
    }.items():
        overrides = [*SHRINK_LAYOUT, "train.micro_batch_size=2", *extra]
        plain = record_run("qwen3-moe-tiny", overrides, world=1, run_dir=tmp_path / f"{name}-plain", steps=2)
        got = record_run(
            "qwen3-moe-tiny",
            [*overrides, _offloaded("moe,core_attn,layernorm")],
            world=1,
            run_dir=tmp_path / f"{name}-offload",
            steps=2,
        )
        assert_same_run(got, plain, **EXACT)


def _model(modules: str):
    from moe_train.models import build_model
    from moe_train.parallel.offload import apply_offload

    recipe = load_recipe("qwen3-moe-tiny", [*SHRINK, _offloaded(modules)] if modules else SHRINK)
    model = build_model(recipe.model)
    apply_offload(model, recipe, torch.device("cpu"))
    return model


def _saved_on_device(model, ids: torch.Tensor):
    """The forward's loss and the bytes of the storages saved through the hooks around the model (parameters
    excluded), counted once each: what stays on the device."""
    from moe_train.measure.activations import is_weight

    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not is_weight(tensor):
            storages[tensor.untyped_storage()._cdata] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        terms = model(ids, labels=ids)
    return terms.lm_sum, sum(storages.values())


def test_the_pool_holds_the_offloaded_saves() -> None:
    """After the forward the pool holds exactly the bytes that no longer stay on the device; after the backward,
    nothing; and the gradients are the plain model's."""
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    plain = _model("")
    plain_loss, plain_bytes = _saved_on_device(plain, ids)
    plain_loss.backward()
    model = _model("moe_act,core_attn")
    pool = model.offload_pool
    loss, device_bytes = _saved_on_device(model, ids)
    assert pool.host_bytes > 0
    assert pool.host_bytes == sum(pool.offloaded_bytes_per_layer.values())
    assert sorted(pool.offloaded_bytes_per_layer) == [0, 1]
    assert device_bytes + pool.host_bytes == plain_bytes
    assert torch.equal(loss, plain_loss)
    loss.backward()
    del loss
    assert pool.host_bytes == 0  # every host buffer went with the saves autograd released
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_storages_held_elsewhere_stay_on_the_device() -> None:
    """A region's save that something outside the region keeps too (a tensor held by Python, a view of its
    storage, a save outside the region) is not copied: offloading it would free nothing."""
    from moe_train.parallel.offload import OffloadPool

    pool = OffloadPool(torch.device("cpu"))
    x = torch.randn(64, requires_grad=True)
    kept = torch.randn(64)  # held by this frame
    noise = torch.randn(64)

    def layer(x):
        outside = noise.clone()  # held by the saves alone: one inside the region, one outside it
        with pool.region():
            a = x.exp()  # exp saves its output: only the region holds it
            b = a * kept
            c = b * outside
        return c * outside

    out = pool.run_layer(0, layer, x)
    assert pool.host_bytes == 64 * 4  # exp's output alone: not `kept` (held here) nor `outside` (saved outside)
    out.sum().backward()
    plain = x.detach().clone().requires_grad_()
    (plain.exp() * kept * noise * noise).sum().backward()
    assert torch.equal(x.grad, plain.grad)


def _validate(tmp_path: Path, *overrides: str):
    return run_cli("validate", "qwen3-moe-tiny", *sets(*overrides))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["parallel.recompute.granularity=selective", "parallel.recompute.modules=[moe_act]", _offloaded("moe_act")],
            "moe_act is recomputed",
        ),
        (
            ["parallel.recompute.granularity=selective", "parallel.recompute.modules=[moe]", _offloaded("moe_act")],
            "moe_act overlaps recomputed (moe in",
        ),
        (["parallel.recompute.granularity=full", _offloaded("core_attn")], "full recompute"),
        ([_offloaded("mla_up_proj")], "mla_up_proj needs multi-head latent attention"),
        ([_offloaded("attention")], "attention"),
    ],
)
def test_validate_refuses_offloading_a_recomputed_or_unknown_region(tmp_path: Path, overrides, message) -> None:
    assert_bad_input(_validate(tmp_path, *overrides), "parallel.offload.modules", message)


def test_validate_accepts_offloading_beside_recomputing_other_regions(tmp_path: Path) -> None:
    result = _validate(
        tmp_path,
        "parallel.recompute.granularity=selective",
        "parallel.recompute.modules=[core_attn,layernorm]",
        _offloaded("moe_act"),
    )
    assert result.code == 0, (result.stdout, result.stderr)


@pytest.mark.slow
@pytest.mark.usefixtures("no_process_group")  # tests/conftest.py: an earlier in-process run may hold one
def test_measure_peak_counts_the_device_alone() -> None:
    """measure's peak on a CPU leaves the pool's host copies out, fake tensors or real: with every layer's moved
    saves off the device but the two back in backward (the layer running, the one prefetched), the peak falls by
    at least the moved bytes less two layers' worth, and the fake step's peak is the real one's."""
    from moe_train.measure.driver import Target, measure

    shape = ["model.num_layers=4", "train.seq_length=512", "train.micro_batch_size=2", "train.global_batch_size=2",
             "train.precision=fp32"]
    plain = measure(load_recipe("qwen3-moe-tiny", shape), Target(fake=True))
    recipe = load_recipe("qwen3-moe-tiny", [*shape, _offloaded("moe_act,core_attn,layernorm")])
    fake, real = measure(recipe, Target(fake=True)), measure(recipe, Target())
    moved = fake["offloaded_bytes_per_layer"]
    assert len(moved) == 4 and min(moved.values()) > 0
    assert fake["peak_memory_bytes"] <= plain["peak_memory_bytes"] - sum(moved.values()) + 2 * max(moved.values())
    assert fake["peak_memory_bytes"] == pytest.approx(real["peak_memory_bytes"], rel=1e-3)
