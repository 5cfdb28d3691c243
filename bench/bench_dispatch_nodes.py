"""All-to-all vs hierarchical dispatch on 4 gloo ranks as 2 emulated nodes x 2, side by side in one job.

Each rank routes T tokens of width H to top-K of E experts (random routing, one seed per rank), runs dispatch,
an identity expert step and combine, forward and backward, alternating the two dispatchers so drifting load
hits both alike. Printed per dispatcher: the token bytes this rank sent to the other node per step (from the
routing: the all-to-all dispatcher's rows to ranks 2-3 or 0-1, the hierarchical dispatcher's one row per other
node a token needs, each out and back, forward and backward), all bytes sent (measure's count,
measure/traffic.py: token rows, routing weights, expert ids and row counts, over every group), and the median
wall time of a step. On one machine gloo's "network" is loopback TCP, so
the time says what the extra hops cost here, not what InfiniBand would save.

Run: python bench/bench_dispatch_nodes.py [--tokens 4096] [--hidden 512] [--experts 16] [--top-k 4] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORLD, LOCAL = 4, 2


def _rank(rank: int, store: str, args: argparse.Namespace, out: dict) -> None:
    from moe_train.measure.traffic import CollectiveTraffic
    from moe_train.models.moe.dispatcher import dispatcher_for

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    local_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    node_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    generator = torch.Generator().manual_seed(rank)
    hidden = torch.randn(args.tokens, args.hidden, generator=generator)
    indices = torch.rand(args.tokens, args.experts, generator=generator).topk(args.top_k, dim=-1).indices
    weights = torch.rand(args.tokens, args.top_k, generator=generator)
    per_rank = args.experts // WORLD
    node_of = indices // per_rank // LOCAL  # [T, K]: the node of each slot's expert
    other_node = node_of != rank // LOCAL
    dispatchers = {
        "alltoall": dispatcher_for("alltoall", num_experts=args.experts, group=dist.group.WORLD),
        "hierarchical": dispatcher_for("hierarchical", num_experts=args.experts, group=local_groups[rank // LOCAL],
                                       node_group=node_groups[rank % LOCAL]),
    }
    times: dict[str, list[float]] = {name: [] for name in dispatchers}
    sent: dict[str, dict] = {}

    def step(dispatcher) -> None:
        x, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        rows, probs, counts, plan = dispatcher.dispatch(x, indices, w)
        dispatcher.combine(rows * probs.unsqueeze(-1), plan).sum().backward()

    for _ in range(args.steps):
        for name, dispatcher in dispatchers.items():
            dist.barrier()
            start = time.perf_counter()
            step(dispatcher)
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    for name, dispatcher in dispatchers.items():  # one more step each, counted (the counter's dispatch costs time)
        with CollectiveTraffic(lambda group: str(group.group_name)) as traffic:
            step(dispatcher)
        sent[name] = {"total": sum(traffic.bytes.values())}
    # across nodes, forward and backward, from the routing: for alltoall, this rank's pairs held on the other
    # node and the pairs other-node ranks route to this rank's experts; for hierarchical, one row per token and
    # other node it needs, sent and received (its node-group peer's tokens that need this node); each out and
    # back, twice
    received_pairs = received_rows = 0
    for source in range(WORLD):
        if source // LOCAL != rank // LOCAL:
            theirs = torch.Generator().manual_seed(source)
            torch.randn(args.tokens, args.hidden, generator=theirs)  # the source's draws, in order
            routed = torch.rand(args.tokens, args.experts, generator=theirs).topk(args.top_k, dim=-1).indices
            received_pairs += int((routed // per_rank == rank).sum())
            if source % LOCAL == rank % LOCAL:
                received_rows += int((routed // per_rank // LOCAL == rank // LOCAL).any(dim=1).sum())
    sent_rows = sum(int((node_of == node).any(dim=1).sum()) for node in range(WORLD // LOCAL) if node != rank // LOCAL)
    row_bytes = args.hidden * hidden.element_size()
    sent["alltoall"]["across"] = 2 * (int(other_node.sum()) + received_pairs) * row_bytes
    sent["hierarchical"]["across"] = 2 * (sent_rows + received_rows) * row_bytes
    out[rank] = {"times": {k: statistics.median(v) for k, v in times.items()}, "sent": sent}
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(str(Path(tmp) / "store"), args, out), nprocs=WORLD, join=True)
        results = dict(out)
    print(f"T {args.tokens} H {args.hidden} E {args.experts} top-{args.top_k}, fp32, 4 gloo ranks as 2 nodes x 2")
    print(f"{'rank':>4} {'dispatcher':>13} {'MB across nodes':>16} {'MB sent':>9} {'step ms':>8}")
    for rank in range(WORLD):
        for name in ("alltoall", "hierarchical"):
            figures = results[rank]["sent"][name]
            print(f"{rank:4d} {name:>13} {figures['across'] / 1e6:16.2f} {figures['total'] / 1e6:9.2f} "
                  f"{results[rank]['times'][name] * 1e3:8.1f}")
    across = {name: sum(results[r]["sent"][name]["across"] for r in range(WORLD)) for name in ("alltoall",
                                                                                              "hierarchical")}
    slow = statistics.median(results[r]["times"]["hierarchical"] / results[r]["times"]["alltoall"]
                             for r in range(WORLD))
    print(f"across nodes, all ranks: hierarchical / alltoall = {across['hierarchical'] / across['alltoall']:.3f}; "
          f"step time hierarchical / alltoall (median over ranks) = {slow:.2f}")


if __name__ == "__main__":
    main()
