"""Worker: every expert-parallel dispatch case of tests/test_dispatch.py, on each of this job's gloo ranks.

Each case builds the tokens and routing of every rank of the expert group from one seed, so a rank can compute
the single-process reference (LocalDispatcher on the union of the group's tokens) on its own and compare its
slice: outputs, gradients of hidden states, routing weights and its local experts' weights, and the bytes the
dispatcher sent, forward and backward, as measure's CollectiveTraffic counts them, against what the routing
implies. Rank 0 writes {"checks": n, "failures": ["rank R: case: message", ...]} for all ranks.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from workers.common import finish, start  # noqa: E402

from moe_train.config.routing_shapes import expert_capacity  # noqa: E402
from moe_train.measure.traffic import CollectiveTraffic  # noqa: E402
from moe_train.models.moe.capacity import capacity_keep_mask  # noqa: E402
from moe_train.models.moe.dispatcher import LocalDispatcher, dispatcher_for  # noqa: E402
from moe_train.models.moe.router import even_counts, even_topk_indices  # noqa: E402

HIDDEN = 8


@dataclass
class Shard:
    """One group rank's inputs."""

    hidden: torch.Tensor  # [T, H]
    indices: torch.Tensor  # [T, K]
    weights: torch.Tensor  # [T, K]
    cotangent: torch.Tensor  # [T, H] gradient of the output (the loss is sum(out * cotangent))
    keep: torch.Tensor | None
    pad_to: int | None
    host_counts: list[int] | None = None  # rows per expert known on the host (forced even routing)


def distinct_topk(tokens: int, top_k: int, experts: list[int], generator: torch.Generator) -> torch.Tensor:
    """[T, K] distinct experts per token, drawn from `experts` (as a router's top-k)."""
    pool = torch.tensor(experts)
    scores = torch.rand(tokens, len(experts), generator=generator)
    return pool[scores.topk(top_k, dim=-1).indices]


def make_shards(case: str, *, size: int, num_experts: int, local: int, dtype: torch.dtype) -> list[Shard]:
    """The group's inputs for one routing case (`local` experts per rank); rank r holds 3 + 2r tokens (7 each
    when padded to capacity)."""
    generator = torch.Generator().manual_seed(0)

    def pool(rank: int) -> list[int]:
        """The experts rank's tokens may choose."""
        if case == "one_expert":
            return [num_experts - 1]
        if case == "empty_experts":  # odd experts get nothing
            return list(range(0, num_experts, 2))
        if case == "silent_ranks":
            # Rank 0 routes to its own experts only (all-to-all: sends nothing to others); nothing reaches the
            # last rank's experts (it receives nothing).
            return list(range(local)) if rank == 0 else list(range(num_experts - local))
        return list(range(num_experts))

    top_k = min(2, *(len(pool(rank)) for rank in range(size)))  # every rank routes to the same K
    shards = []
    for rank in range(size):
        tokens = 0 if case == "empty_rank" and rank == 1 else 3 + 2 * rank
        if case.endswith("_pad"):  # static splits: every rank routes as many tokens (as the engine's ranks do)
            tokens = 7
        indices = distinct_topk(tokens, top_k, pool(rank), generator)
        if case == "even":  # what `measure --fake` routes: every rank the same count, split sizes from shapes
            tokens = 5
            indices = even_topk_indices(tokens, top_k, num_experts, device=torch.device("cpu"))
        weights = torch.rand(tokens, top_k, generator=generator, dtype=torch.float64).to(dtype)
        keep, pad_to = None, None
        if case.startswith("capacity"):
            _, policy, pad = case.split("_")
            capacity = expert_capacity(num_tokens=tokens, top_k=top_k, num_experts=num_experts, capacity_factor=0.7)
            keep = capacity_keep_mask(indices, weights, num_experts=num_experts, capacity=capacity, policy=policy)
            pad_to = capacity if pad == "pad" else None
        shards.append(
            Shard(
                hidden=torch.randn(tokens, HIDDEN, generator=generator, dtype=torch.float64).to(dtype),
                indices=indices,
                weights=weights,
                cotangent=torch.randn(tokens, HIDDEN, generator=generator, dtype=torch.float64).to(dtype),
                keep=keep,
                pad_to=pad_to,
                host_counts=even_counts(tokens, top_k, num_experts) if case == "even" else None,
            )
        )
    return shards


def expert_weights(num_experts: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(42)
    return torch.randn(num_experts, HIDDEN, HIDDEN, generator=generator, dtype=torch.float64).to(dtype)


def apply_experts(
    rows: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor, first: int, columns: slice = slice(None)
) -> torch.Tensor:
    """Expert first + j is the linear map rows @ weights[first + j]^T (padding rows stay zero).

    `columns` makes it a row-parallel shard (expert TP): only those input features, a partial sum of the output.
    """
    chunks = torch.split(rows, counts.tolist())
    return torch.cat([chunk[:, columns] @ weights[first + j][:, columns].T for j, chunk in enumerate(chunks)])


@dataclass
class Result:
    out: torch.Tensor
    grad_hidden: torch.Tensor
    grad_weights: torch.Tensor
    grad_experts: torch.Tensor
    forward_bytes: dict[str, int]  # "<group>/<op>" -> bytes this rank sent (measure's convention), zeros left out
    backward_bytes: dict[str, int]


def sent(traffic: CollectiveTraffic) -> dict[str, int]:
    return {key: sent for key, sent in traffic.bytes.items() if sent}


def run(dispatcher, shard: Shard, experts: torch.Tensor, first: int, columns: slice = slice(None),
        name_group: Callable[[dist.ProcessGroup], str] = lambda group: "ep") -> Result:
    hidden = shard.hidden.clone().requires_grad_()
    weights = shard.weights.clone().requires_grad_()
    experts = experts.clone().requires_grad_()
    with CollectiveTraffic(name_group) as forward:
        rows, probs, counts, plan = dispatcher.dispatch(hidden, shard.indices, weights, keep=shard.keep,
                                                        pad_to=shard.pad_to, host_counts=shard.host_counts)
        assert rows.shape[0] == int(counts.sum()), "rows and tokens_per_local_expert disagree"
        assert counts.shape == (dispatcher.num_local_experts,) and counts.dtype == torch.int64
        assert probs.shape == (rows.shape[0],), "a routing weight per row"
        # the experts apply each row's weight (a row-parallel shard's partial sum too: the weight is linear)
        out = dispatcher.combine(apply_experts(rows, counts, experts, first, columns) * probs.unsqueeze(-1), plan)
    with CollectiveTraffic(name_group) as backward:
        (out * shard.cotangent).sum().backward()
    return Result(out.detach(), hidden.grad, weights.grad, experts.grad, sent(forward), sent(backward))


def reference(shards: list[Shard], experts: torch.Tensor, num_experts: int) -> list[Result]:
    """LocalDispatcher on the union of the group's tokens (each source rank's keep-mask), split by rank."""
    union = Shard(
        hidden=torch.cat([s.hidden for s in shards]),
        indices=torch.cat([s.indices for s in shards]),
        weights=torch.cat([s.weights for s in shards]),
        cotangent=torch.cat([s.cotangent for s in shards]),
        keep=None if shards[0].keep is None else torch.cat([s.keep for s in shards]),
        pad_to=None,
    )
    whole = run(LocalDispatcher(num_experts=num_experts), union, experts, 0)
    sizes = [len(s.hidden) for s in shards]
    return [
        Result(out, grad_hidden, grad_weights, whole.grad_experts, {}, {})
        for out, grad_hidden, grad_weights in zip(
            whole.out.split(sizes), whole.grad_hidden.split(sizes), whole.grad_weights.split(sizes), strict=True
        )
    ]


def close(name: str, got: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    scale = max(expected.abs().max().item(), 1.0) if expected.numel() else 1.0
    error = (got - expected).abs().max().item() if expected.numel() else 0.0
    assert got.shape == expected.shape, f"{name}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    assert error <= tol * scale, f"{name}: differs by {error:.3e} (scale {scale:.3e})"


def rows_between(shards: list[Shard], local: int, source: int, destination: int) -> int:
    """Rows the all-to-all dispatcher sends from group rank `source` to `destination`."""
    shard = shards[source]
    if shard.pad_to is not None:
        return shard.pad_to * local
    kept = shard.indices if shard.keep is None else shard.indices[shard.keep]
    return int(((kept // local) == destination).sum())


def expected_bytes(kind: str, shards: list[Shard], me: int, local: int, etp: int, itemsize: int
                   ) -> tuple[dict[str, int], dict[str, int]]:
    """(forward, backward) bytes by "ep/<op>" that the routing implies for group rank `me`: the token rows, and beside
    them the routing (row counts, expert ids, weights and the weights' gradients)."""
    size = len(shards)
    row = HIDDEN * itemsize
    if kind == "alltoall":
        sent = sum(rows_between(shards, local, me, other) for other in range(size) if other != me)
        received = sum(rows_between(shards, local, other, me) for other in range(size) if other != me)
        # dispatch sends `sent` rows with their weights and combine returns `received`; backward the reverse
        counts = (size - 1) * local * 8
        forward = {"all_to_all": (sent + received) * row + counts + sent * itemsize}
        backward = {"all_to_all": (sent + received) * row + received * itemsize}
    else:
        max_tokens, top_k = max(len(s.hidden) for s in shards), shards[0].indices.shape[1]
        # sizes [tokens, padding, slots per expert holder] (one read per dispatch), expert ids and weights
        routing = 8 * (2 + size // etp) + max_tokens * top_k * (8 + itemsize)
        forward = {"all_gather": max_tokens * row + routing, "reduce_scatter": size * max_tokens * row}
        backward = {"all_gather": max_tokens * row,
                    "reduce_scatter": size * max_tokens * row + size * max_tokens * top_k * itemsize}
    return tuple({f"ep/{op}": n for op, n in bytes_by_op.items() if n} for bytes_by_op in (forward, backward))


def check_case(case: str, kind: str, *, group, num_experts: int, dtype: torch.dtype, etp: int = 1) -> Result:
    """etp > 1 (allgather only): consecutive group ranks hold row-parallel shards of the same experts."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    local = num_experts * etp // size
    shards = make_shards(case, size=size, num_experts=num_experts, local=local, dtype=dtype)
    if case.startswith("capacity"):
        assert any(not s.keep.all() for s in shards), "the capacity case drops nothing: a vacuous check"
    experts = expert_weights(num_experts, dtype)
    dispatcher = dispatcher_for(kind, num_experts=num_experts, group=group, expert_tp_size=etp)
    assert dispatcher.num_local_experts == local
    first = me // etp * local
    width = HIDDEN // etp
    columns = slice(me % etp * width, (me % etp + 1) * width)
    got = run(dispatcher, shards[me], experts, first, columns)
    want = reference(shards, experts, num_experts)[me]
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    close("output", got.out, want.out, tol)
    close("hidden grad", got.grad_hidden, want.grad_hidden, tol)
    close("routing weight grad", got.grad_weights, want.grad_weights, tol)
    mine = slice(first, first + dispatcher.num_local_experts)
    close("local expert grad", got.grad_experts[mine, :, columns], want.grad_experts[mine, :, columns], tol)
    forward, backward = expected_bytes(kind, shards, me, local, etp, dtype.itemsize)
    assert got.forward_bytes == forward, f"forward bytes {got.forward_bytes} != {forward}"
    assert got.backward_bytes == backward, f"backward bytes {got.backward_bytes} != {backward}"
    return got


CASES = ["random", "one_expert", "empty_experts", "silent_ranks", "empty_rank", "even"] + [
    f"capacity_{policy}_{pad}" for policy in ("probs", "position") for pad in ("pad", "nopad")
]


def run_all(rank: int, world: int) -> tuple[int, list[str]]:
    """(checks run, failures) on this rank."""
    failures: list[str] = []
    checks = 0

    def attempt(label: str, check: Callable[[], None]) -> None:
        nonlocal checks
        checks += 1
        try:
            check()
        except AssertionError as error:
            failures.append(f"rank {rank}: {label}: {error}")

    groups = {"world": dist.group.WORLD}
    if world == 4:  # strided pairs, as a folded mesh makes them: group ranks differ from global ranks
        pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        groups["pairs"] = pairs[rank % 2]
    for group_name, group in groups.items():
        size = dist.get_world_size(group)
        for num_experts in (size, 2 * size):
            for case in CASES:
                for kind in ("alltoall", "allgather"):
                    label = f"{group_name} E{num_experts} {case} {kind}"
                    attempt(label, lambda c=case, k=kind, g=group, e=num_experts: check_case(
                        c, k, group=g, num_experts=e, dtype=torch.float64))

    def fp32_agree() -> None:
        a, b = (check_case("random", kind, group=dist.group.WORLD, num_experts=2 * world, dtype=torch.float32)
                for kind in ("alltoall", "allgather"))
        for name in ("out", "grad_hidden", "grad_weights"):
            close(f"fp32 allgather vs alltoall {name}", getattr(b, name), getattr(a, name), 1e-6)

    attempt("fp32 agreement", fp32_agree)
    if world == 4:  # allgather over ep x etp = 2 x 2 (etp fastest), as docs/decisions.md asks
        for case in CASES:
            attempt(f"ep2 x etp2 E4 {case} allgather", lambda c=case: check_case(
                c, "allgather", group=dist.group.WORLD, num_experts=4, dtype=torch.float64, etp=2))
    return checks, failures


def main() -> None:
    _, result_path, rank, world = start()
    checks, failures = run_all(rank, world)
    every_rank: list = [None] * world
    dist.all_gather_object(every_rank, (checks, failures))
    finish({"checks": [c for c, _ in every_rank], "failures": [f for _, fs in every_rank for f in fs]}, result_path,
           rank)


if __name__ == "__main__":
    main()
