"""QK-clip (train/qk_clip.py): the heads over the threshold are scaled so that their largest logit on the step's
batch comes back at the threshold; every other head, the shared rope key and the values are bit for bit the
run without the clip. Grouped-query attention (qwen3-tiny without QK-norm) and MLA (deepseek-v3-tiny, MTP's
attention included), one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import trainer

from moe_train.config import load_recipe
from moe_train.config.loader import RecipeError
from moe_train.models.attention import Attention, head_max_logits
from moe_train.models.mla import MLA
from moe_train.train.batch import rank_batch

# lr tiny: the step's update barely moves the weights, so the clip's effect on the logits is what is measured
BASE = ["train.optimizer=muon", "train.lr=1e-9", "train.min_lr=0", "train.steps=1"]
RECIPES = {"qwen3-tiny": ["model.qk_norm=false"], "deepseek-v3-tiny": []}


def _attention(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Attention | MLA)}


def _step_one(name: str, run_dir: Path, threshold: float) -> tuple:
    """Train step 1 with QK-clip at `threshold`: (trainer, each attention module's maxima measured in that step)."""
    run = trainer(name, run_dir, *BASE, *RECIPES[name], f"train.muon.qk_clip={threshold}")
    measured = {}

    def snapshot(optimizer, args, kwargs) -> None:
        measured.update({n: m.max_logits.clone() for n, m in _attention(run.chunks[0]).items()})

    run.optimizers[0].register_step_pre_hook(snapshot)
    run.train_step(1)
    return run, measured


def _maxima_on_step_one_batch(run) -> dict[str, torch.Tensor]:
    model = run.chunks[0]
    batch = rank_batch(run.datasets.train, 0, recipe=run.recipe, ctx=run.ctx, eod=run.datasets.eod)
    with torch.no_grad():
        for micro in batch.micro_batches(run.recipe.train.micro_batch_size):
            model(micro.inputs, micro.positions, labels=micro.labels, **micro.mtp_kwargs)
    return {n: m.max_logits for n, m in _attention(model).items()}


def _rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    return weight.detach().view(heads, -1, weight.shape[-1])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RECIPES))
def test_qk_clip_caps_the_heads_over_the_threshold_and_leaves_the_rest(tmp_path: Path, name: str) -> None:
    free, free_max = _step_one(name, tmp_path / "free", 1e9)  # measures, never clips
    threshold = float(torch.cat(list(free_max.values())).median())
    clipped, clipped_max = _step_one(name, tmp_path / "clip", threshold)
    for key in free_max:
        torch.testing.assert_close(clipped_max[key], free_max[key], rtol=0, atol=0)  # the same forward
    over = {key: value > threshold for key, value in free_max.items()}
    assert 0 < sum(int(v.sum()) for v in over.values()) < sum(v.numel() for v in over.values())

    free_modules, clipped_modules = _attention(free.chunks[0]), _attention(clipped.chunks[0])
    for key, module in clipped_modules.items():
        before, heads = free_modules[key], over[key].numel()
        keep = ~over[key]
        if isinstance(module, MLA):
            q = "q_proj" if module.q_lora_rank is None else "q_b_proj"
            pairs = [(getattr(module, q), getattr(before, q)), (module.kv_b_proj, before.kv_b_proj)]
            for after, was in pairs:
                assert torch.equal(_rows(after.weight, heads)[keep], _rows(was.weight, heads)[keep]), key
            # values (kv_b_proj's v rows) and the shared rope key untouched, clipped heads or not
            v_rows = _rows(module.kv_b_proj.weight, heads)[:, module.nope_dim :]
            assert torch.equal(v_rows, _rows(before.kv_b_proj.weight, heads)[:, module.nope_dim :]), key
            assert torch.equal(module.kv_a_proj_with_mqa.weight, before.kv_a_proj_with_mqa.weight), key
        else:  # GQA: a group is untouched when none of its query heads is over
            groups = module.k_proj.weight.shape[0] // module.head_dim
            keep = ~over[key].view(groups, -1).any(dim=1)
            assert torch.equal(_rows(module.k_proj.weight, groups)[keep], _rows(before.k_proj.weight, groups)[keep])
            q_keep = keep.repeat_interleave(heads // groups)
            assert torch.equal(_rows(module.q_proj.weight, heads)[q_keep], _rows(before.q_proj.weight, heads)[q_keep])
    # On the batch that measured them, the first layer's clipped heads' largest logit is now the threshold and
    # none is above it (MLA: exactly, each head alone; GQA: a group's heads share the smallest factor). Later layers
    # see inputs the earlier clips changed: within 1% of the cap.
    after = _maxima_on_step_one_batch(clipped)
    for key, value in after.items():
        first = key == "layers.0.self_attn"
        if first and isinstance(clipped_modules[key], MLA):
            torch.testing.assert_close(
                value[over[key]], torch.full_like(value[over[key]], threshold), rtol=1e-4, atol=0
            )
        assert (value <= threshold * (1 + (1e-4 if first else 1e-2))).all(), (key, value, threshold)


def test_head_max_logits_is_the_largest_allowed_score() -> None:
    """Against the scores written out: causal by default, and the additive document mask where given."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(2, dim=1)) * 0.3
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    want = scores.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(head_max_logits(q, k, None, 0.3), want)
    docs = torch.ones(6, 6, dtype=torch.bool).tril()
    docs[3:, :3] = False  # a second document from position 3
    additive = torch.zeros(2, 1, 6, 6).masked_fill(~docs, float("-inf"))
    want = scores.masked_fill(~docs, float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(head_max_logits(q, k, additive, 0.3), want)


def test_qk_clip_needs_attention_without_qk_norm() -> None:
    with pytest.raises(RecipeError, match="train.muon.qk_clip"):
        load_recipe("qwen3-tiny", ["train.optimizer=muon", "train.muon.qk_clip=50"])
