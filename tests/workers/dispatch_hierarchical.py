"""Worker: the hierarchical dispatcher on 4 gloo ranks as 2 emulated nodes x 2 (node = rank // 2), against the
single-process reference and the all-to-all dispatcher over the same 4 ranks: every routing case of
tests/workers/dispatch.py in fp64 (1e-12) and one in fp32 (1e-6), outputs, gradients of the hidden states, the
routing weights and the local experts (the capacity cases padded to capacity too, against the all-to-all
dispatcher padded; the even case with its splits computed on the host from forced even routing's counts); and
the bytes crossing nodes, counted by measure's CollectiveTraffic on the node group, equal to what the routing
(padded: the capacity) implies, with the all-to-all dispatcher's rows (pairs to ranks on the other node) beside
them.
Rank 0 writes {"checks": [n per rank], "failures": [...], "network": {case: [[hierarchical, alltoall] per rank]}}.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from workers.common import finish, start  # noqa: E402
from workers.dispatch import CASES, HIDDEN, close, expert_weights, make_shards, reference, run  # noqa: E402

from moe_train.models.moe.dispatcher import dispatcher_for  # noqa: E402
from moe_train.models.moe.router import even_topk_indices  # noqa: E402

LOCAL = 2  # ranks per emulated node


def network_rows(shards, me: int, num_experts: int, kind: str) -> tuple[int, int]:
    """(rows sent, rows returned): what rank `me` sends to the other node per forward, as the routing implies:
    hierarchical, each token once per other node it needs, and the partial sums it returns to the ranks of its
    local index there; alltoall, each (token, expert) pair held on the other node, and the outputs of pairs it
    returns there."""
    size = len(shards)
    per_rank = num_experts // size
    node_of_rank = [rank // LOCAL for rank in range(size)]

    def kept(rank):
        shard = shards[rank]
        return shard.indices if shard.keep is None else shard.indices.masked_fill(~shard.keep, -1)

    def to_nodes(rank, node):  # tokens of `rank` needing `node`, or pairs of `rank` held on `node`
        pad_to = shards[rank].pad_to
        if pad_to is not None:  # static: the most tokens that can need a node, or every expert's pad_to rows
            experts = num_experts // (size // LOCAL)
            return min(len(shards[rank].hidden), experts * pad_to) if kind == "hierarchical" else experts * pad_to
        ids = kept(rank)
        on = (ids >= 0) & (ids // per_rank // LOCAL == node)
        return int(on.any(dim=1).sum()) if kind == "hierarchical" else int(on.sum())

    mine = node_of_rank[me]
    others = [node for node in set(node_of_rank) if node != mine]
    sent = sum(to_nodes(me, node) for node in others)
    if kind == "hierarchical":  # partials go back to the same-local-index rank of each other node
        peers = [rank for rank in range(size) if rank % LOCAL == me % LOCAL and node_of_rank[rank] != mine]
        returned = sum(to_nodes(peer, mine) for peer in peers)
    else:  # outputs of the pairs other-node ranks sent to my experts
        returned = sum(per_rank * shards[rank].pad_to if shards[rank].pad_to is not None
                       else int(((kept(rank) >= 0) & (kept(rank) // per_rank == me)).sum())
                       for rank in range(size) if node_of_rank[rank] != mine)
    return sent, returned


def node_bytes(shards, me: int, num_experts: int, itemsize: int) -> int:
    """Bytes the hierarchical dispatcher sends over the network, forward and backward: each token row out and
    its partial sum back, both ways (2 x rows); with each sent row its K expert ids (int64) and weights, the
    weights' gradients coming back; and, unpadded, the row counts exchanged with the other node."""
    sent, returned = network_rows(shards, me, num_experts, "hierarchical")
    top_k = shards[me].indices.shape[1]
    counts = 8 * (len(shards) // LOCAL - 1) if shards[me].pad_to is None else 0
    return 2 * (sent + returned) * HIDDEN * itemsize + sent * top_k * 8 + (sent + returned) * top_k * itemsize + counts


def main() -> None:
    spec, result_path, rank, world = start()
    assert world == 4
    torch.set_num_threads(1)
    local_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    node_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    local_group, node_group = local_groups[rank // LOCAL], node_groups[rank % LOCAL]
    failures, checks, network = [], 0, {}

    def check(case: str, num_experts: int, dtype: torch.dtype, tol: float, *, shards=None) -> None:
        nonlocal checks
        checks += 1
        label = f"E{num_experts} {case} {dtype}"
        try:
            shards = shards or make_shards(case, size=world, num_experts=num_experts, local=num_experts // world,
                                           dtype=dtype)
            experts = expert_weights(num_experts, dtype)
            first = rank * num_experts // world
            hier = dispatcher_for("hierarchical", num_experts=num_experts, group=local_group, node_group=node_group)
            # host counts are the forced routing's alone now (its spread over the nodes, set by measure); that path
            # is held by test_hierarchical_plan's real 4-rank measure: here the even pattern exchanges its counts
            shards = [replace(shard, host_counts=None) for shard in shards]
            flat = dispatcher_for("alltoall", num_experts=num_experts, group=dist.group.WORLD)
            got = run(hier, shards[rank], experts, first,
                      name_group=lambda group: "node" if group.group_name == node_group.group_name else "local")
            a2a = run(flat, shards[rank], experts, first)
            want = reference(shards, experts, num_experts)[rank]
            mine = slice(first, first + hier.num_local_experts)
            for name, value, expected in (("output", got.out, want.out),
                                          ("hidden grad", got.grad_hidden, want.grad_hidden),
                                          ("routing weight grad", got.grad_weights, want.grad_weights),
                                          ("expert grad", got.grad_experts[mine], want.grad_experts[mine])):
                close(name, value, expected, tol)
            for name in ("out", "grad_hidden", "grad_weights"):
                close(f"vs alltoall {name}", getattr(got, name), getattr(a2a, name), tol)
            crossed = got.forward_bytes.get("node/all_to_all", 0) + got.backward_bytes.get("node/all_to_all", 0)
            expected = node_bytes(shards, rank, num_experts, dtype.itemsize)
            assert crossed == expected, f"network bytes {crossed} != {expected} (the routing's)"
            # per rank either may send more (a rank forwards its node's share); the test compares the totals
            network[label] = [sum(network_rows(shards, rank, num_experts, "hierarchical")),
                              sum(network_rows(shards, rank, num_experts, "alltoall"))]
        except AssertionError as error:
            failures.append(f"rank {rank}: {label}: {error}")

    for num_experts in (4, 8):
        for case in CASES:
            check(case, num_experts, torch.float64, 1e-12)
    check("random", 8, torch.float32, 1e-6)
    # top-4 of 8 experts over 64 tokens: most tokens need both nodes' experts several times over
    generator = torch.Generator().manual_seed(7)
    wide = make_shards("random", size=world, num_experts=8, local=2, dtype=torch.float64)
    for shard in wide:
        tokens = 64
        shard.indices = torch.rand(tokens, 8, generator=generator).topk(4, dim=-1).indices
        shard.hidden = torch.randn(tokens, HIDDEN, generator=generator, dtype=torch.float64)
        shard.weights = torch.rand(tokens, 4, generator=generator, dtype=torch.float64)
        shard.cotangent = torch.randn(tokens, HIDDEN, generator=generator, dtype=torch.float64)
    check("top4", 8, torch.float64, 1e-12, shards=wide)
    even = make_shards("random", size=world, num_experts=8, local=2, dtype=torch.float64)
    for shard in even:
        shard.indices = even_topk_indices(len(shard.hidden), 2, 8, device=torch.device("cpu"))
    check("even", 8, torch.float64, 1e-12, shards=even)

    gathered = [None] * world
    dist.all_gather_object(gathered, {"checks": checks, "failures": failures, "network": network})
    result = {"checks": [g["checks"] for g in gathered], "failures": [f for g in gathered for f in g["failures"]],
              "network": {k: [g["network"].get(k, [0, 0]) for g in gathered] for k in gathered[0]["network"]}}
    finish(result, result_path, rank)


if __name__ == "__main__":
    main()
