"""The all-gather dispatcher: every rank sees every token of the group and computes its own experts' share.

dispatch: all-gather the hidden states, the routing (dropped slots marked) and the routing weights of the group,
then permute the slots routed to this rank's local experts with their weights (the experts apply them).
combine: scatter-add the local experts' (weighted) outputs into per-token sums over the whole group's tokens,
then reduce-scatter:
each token's owner gets the sum over all ranks, i.e. over all its experts. The traffic grows with the group
size, not with the routing, so it suits small groups and heavily skewed or dense routing (Megatron-Core's
"allgather" dispatcher).
Ranks may hold different token counts: tokens are padded to the group's largest count, padding never routed.
Token counts and the number of gathered slots routed here are host values, read back from the device unless
the caller knows every rank's routing counts on the host (`host_counts`, as the all-to-all dispatcher).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_train.models.moe.deferred_wgrad import DeferredWeightGrads
from moe_train.models.moe.dispatch_collectives import all_gather_rows, reduce_scatter_rows
from moe_train.models.moe.expert_group import ExpertShard
from moe_train.models.moe.permute import Permutation, permute, scatter_sum, slot_sum, unpermute
from moe_train.models.moe.router import count_per_expert


@dataclass
class AllGatherPlan:
    """What `combine` needs: where the local experts' rows came from, and this rank's token count."""

    permutation: Permutation  # gathered token slots [size * T_max * K] -> local experts' rows
    local_slots: torch.Tensor | None  # [n] gathered slots routed to a local expert (None without a group)
    local_rows: torch.Tensor | None  # [n] the expert row of each of those slots
    num_tokens: int  # T of this rank
    max_tokens: int  # T_max: the group's largest T (every rank's tokens are padded to it)


class AllGatherDispatcher:
    """Expert-parallel dispatch over `group` with all-gather and reduce-scatter; group None: no traffic.

    Per call, of group size G, hidden H, top-k K, the hidden dtype's itemsize b and T_max the group's largest
    token count, it sends: forward, an all-gather of T_max*H*b (this rank's hidden states) and a reduce-scatter
    of G*T_max*H*4 (the fp32 per-token sums); backward, a reduce-scatter of G*T_max*H*b (hidden gradients) and an
    all-gather of T_max*H*4; the routing: all-gathers of 16 (token count, pad_to) + T_max*K*8 (expert ids) +
    T_max*K*4 (fp32 weights), and in backward a reduce-scatter of G*T_max*K*4 (weight gradients). `measure`
    counts them (docs/measure.md).

    With expert tensor parallelism, pass the ep x etp group (etp fastest) and `expert_tp_size`: the etp ranks
    of one ep coordinate get the same rows, their experts return partial sums (row-parallel down projection),
    and the reduce-scatter adds those partials together with the other experts' outputs.
    """

    def __init__(self, *, num_experts: int, group: dist.ProcessGroup | None = None, expert_tp_size: int = 1):
        self.shard = ExpertShard.of(num_experts=num_experts, group=group, expert_tp_size=expert_tp_size)
        self.num_experts = num_experts
        self.num_local_experts = self.shard.num_local_experts
        # parallel.split_wgrad: the experts' delayed weight gradients, run by the first of the dispatch's backward
        # reduce-scatters (the hidden states' or the routing weights', whichever autograd reaches first)
        self.deferred_wgrad: DeferredWeightGrads | None = None

    def dispatch(
        self,
        hidden: torch.Tensor,
        topk_indices: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        keep: torch.Tensor | None = None,
        pad_to: int | None = None,
        host_counts: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AllGatherPlan]:
        """hidden [T, H], topk_indices [T, K] (global expert ids), topk_weights [T, K] -> (rows [N, H] sorted by
        local expert, their routing weights [N] (0 for padding), rows per local expert [E_local] int64, plan).

        keep [T, K] drops slots as decided on their source rank; pad_to (per source rank, as the all-to-all
        dispatcher) gives each local expert the sum over the group's ranks of their pad_to rows. host_counts
        [E]: the rows per expert that topk_indices makes, identical on every rank of the group (no keep, no
        pad_to), so every rank holds T tokens too.
        """
        tokens = hidden.shape[0]
        shard = self.shard
        if shard.group is None:
            rows, probs, counts, permutation = permute(
                hidden, topk_indices, topk_weights, num_experts=self.num_experts, keep=keep, pad_to=pad_to
            )
            return rows, probs, counts, AllGatherPlan(permutation, None, None, tokens, tokens)
        # Dropped slots and padding tokens are marked -1: no rank holds that expert.
        routing = topk_indices if keep is None else topk_indices.masked_fill(~keep, -1)
        gathered = self._sizes(routing, tokens, pad_to)  # gathered even when known: plan counts one shape
        if host_counts is None:  # the dispatch's one device-to-host read
            rows = gathered.tolist()
            sizes = [row[:2] for row in rows]
            max_tokens = max(count for count, _ in sizes)
            local_slots_count = sum(row[2 + shard.rank // shard.expert_tp_size] for row in rows)
        else:
            sizes = [[tokens, 0]] * shard.size
            max_tokens = tokens
            mine = host_counts[shard.first_expert: shard.first_expert + self.num_local_experts]
            local_slots_count = shard.size * sum(mine)
        routing = F.pad(routing, (0, 0, 0, max_tokens - tokens), value=-1)
        routing = all_gather_rows(routing, group=shard.group)
        hidden = F.pad(hidden, (0, 0, 0, max_tokens - tokens))
        hidden = all_gather_rows(hidden, group=shard.group, beside=self.deferred_wgrad)
        weights = F.pad(topk_weights, (0, 0, 0, max_tokens - tokens))
        weights = all_gather_rows(weights, group=shard.group, beside=self.deferred_wgrad)
        local = routing - shard.first_expert
        is_local = (local >= 0) & (local < self.num_local_experts)
        rows, probs, counts, permutation = permute(
            hidden,
            local.clamp(0, self.num_local_experts - 1),
            weights,
            num_experts=self.num_local_experts,
            keep=is_local,
            pad_to=None if pad_to is None else sum(pad for _, pad in sizes),
            kept=local_slots_count,
        )
        local_slots = torch.nonzero_static(is_local.reshape(-1), size=local_slots_count).squeeze(1)
        local_rows = permutation.slot_rows.index_select(0, local_slots)
        return rows, probs, counts, AllGatherPlan(permutation, local_slots, local_rows, tokens, max_tokens)

    def _sizes(self, routing: torch.Tensor, tokens: int, pad_to: int | None) -> torch.Tensor:
        """[group size, 2 + ep] on the device: every rank's [tokens, pad_to, its slots for each expert holder (ep
        rank)], so one read gives the padding to gather with and how many slots this rank's experts receive
        (capacities differ where token counts do)."""
        shard = self.shard
        holders = shard.size // shard.expert_tp_size
        owner = torch.where(routing >= 0, routing // self.num_local_experts, holders)
        row = routing.new_full((2 + holders,), tokens, dtype=torch.int64)
        row[1] = pad_to or 0
        row[2:] = count_per_expert(owner, holders + 1)[:holders]
        return all_gather_rows(row.unsqueeze(0), group=shard.group)

    def combine(self, expert_out: torch.Tensor, plan: AllGatherPlan) -> torch.Tensor:
        """expert_out [N, H] (rows as dispatch returned them, weighted by the experts) -> [T, H] fp32 on the
        tokens' own rank."""
        shard = self.shard
        if shard.group is None:
            return slot_sum(unpermute(expert_out, plan.permutation), plan.permutation.top_k)
        # Scatter-add only the local rows (not all G*T_max*K slots, mostly other ranks' experts) into per-token
        # sums, in fp32 at least.
        per_token = scatter_sum(
            expert_out.index_select(0, plan.local_rows),
            plan.local_slots // plan.permutation.top_k,
            shard.size * plan.max_tokens,
        )
        return reduce_scatter_rows(per_token, group=shard.group)[: plan.num_tokens]
