"""What selective recompute leaves saved: the items of plan/saved_tensors.py that go when a module runs again
in backward, and what the recomputed region keeps instead (its inputs), as each module declares it
(models/declarations: `recomputed` beside each module's saves; policies.py applies them) (no torch)."""

from __future__ import annotations

from moe_train.config.schema import ModelConfig
from moe_train.models.declarations import moe_layer, policies

from .saved_tensors import ActivationLayout, Saved


def apply_selective(items: list[Saved], modules: tuple[str, ...], cfg: ModelConfig, lay: ActivationLayout):
    """The items left when the `modules` of selective recompute run again in backward."""
    moe = any(i.region == moe_layer.REGION for i in items)
    return policies.recomputed(cfg, lay, items, set(modules), moe=moe)
