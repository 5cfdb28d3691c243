"""Which layers `measure` keeps (torch-free: the command line checks `--layers` before importing torch)."""

from __future__ import annotations

from moe_train.config.mesh_shape import MeshShape
from moe_train.config.pp_layout import stages_of
from moe_train.config.schema import Recipe


def rank_layers(recipe: Recipe, rank: int) -> tuple[int, ...]:
    """The layers (MTP modules numbered from num_layers on) rank `rank` holds: all of them without a pipeline,
    else its stages' (its pipeline coordinate on the dense mesh, where pp is outermost)."""
    m, p = recipe.model, recipe.parallel
    if p.pp == 1:
        return tuple(range(m.num_layers + m.mtp_layers))
    pipeline_rank = MeshShape.from_recipe(recipe).dense_coords(rank)[0]
    return tuple(sorted(index for stage in stages_of(recipe) if stage.rank == pipeline_rank
                        for index in (*stage.layers, *(m.num_layers + k for k in stage.mtp))))


def layer_kinds(recipe: Recipe, rank: int) -> tuple[int, ...]:
    """One layer of each kind among the rank's, the default under --fake: its first dense and first MoE
    layer (its MTP module when it holds nothing else)."""
    cfg = recipe.model
    held = rank_layers(recipe, rank)
    decoder = [i for i in held if i < cfg.num_layers]
    dense = next((i for i in decoder if not cfg.is_moe_layer(i)), None)
    moe = next((i for i in decoder if cfg.is_moe_layer(i)), None)
    picked = tuple(i for i in (dense, moe) if i is not None)
    return picked or held[:1]


def layer_problems(recipe: Recipe, layers: tuple[int, ...], rank: int) -> list[str]:
    """Why `--layers` cannot be measured on `rank`; indices from num_layers on name the MTP modules."""
    cfg = recipe.model
    last = cfg.num_layers + cfg.mtp_layers
    if not layers:
        return ["--layers: name at least one layer"]
    bad = [i for i in layers if not 0 <= i < last]
    if bad:
        mtp = f", {cfg.num_layers}..{last - 1} the MTP modules" if cfg.mtp_layers else ""
        return [f"--layers: {bad} out of range (0..{cfg.num_layers - 1} are the decoder layers{mtp})"]
    held = rank_layers(recipe, rank)
    elsewhere = [i for i in layers if i not in held]
    if elsewhere:
        return [f"--layers: {elsewhere} are not on rank {rank}'s pipeline stage(s), which hold {list(held)}"]
    return []


def as_fake_runs(recipe: Recipe) -> Recipe:
    """The recipe as `--fake` executes it: fake tensors have CPU semantics whatever `launch.device` says, so
    the CPU's kernel-table row decides what attention saves (MLA's padded value width, the document mask). Plan
    this recipe to hold a plan to a fake measurement; plan the original for the device itself."""
    return recipe.model_copy(update={"launch": recipe.launch.model_copy(update={"device": "cpu"})})


def fake_problems(recipe: Recipe) -> list[str]:
    """What `--fake` cannot measure yet, one line each: values decide the shapes there. Forced even routing fixes
    every dispatcher's split sizes on the host (the hierarchical one's too); padded to capacity every expert
    takes exactly `capacity` rows, so dropping is measurable where the dispatcher pads without reading sizes."""
    moe = recipe.model.moe
    if moe is None or moe.capacity_factor is None:
        return []
    if not moe.pad_to_capacity:
        return ["model.moe.capacity_factor: token dropping without pad_to_capacity under --fake is not supported "
                "(how many rows each expert keeps depends on values fake tensors do not have; set "
                "model.moe.pad_to_capacity: true for static shapes)"]
    if moe.dispatcher == "allgather" and recipe.parallel.ep * recipe.parallel.etp > 1:
        return ["model.moe.pad_to_capacity: the allgather dispatcher under --fake is not supported yet (it reads "
                "the gathered sizes from the device; use the alltoall dispatcher or measure on real ranks)"]
    return []
