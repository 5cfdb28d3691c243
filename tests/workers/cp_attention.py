"""Worker: context-parallel attention (ring and all-gather) against full causal attention in fp64, forward and
backward, on this job's ranks as one cp group; rank 0 writes each case's largest errors. Cases with a sliding
`window` and attention `sinks` (gpt-oss) hold the reference to the same window and to a sink logit per head in
each query's softmax (transformers' eager gpt-oss attention), the sinks' gradient compared too."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.common import finish, start  # noqa: E402


def reference(q, k, v, positions, scale, window=None, sinks=None):
    """Full causal attention (within documents when `positions` restart, within the last `window` keys, with a
    sink logit per head joining the softmax and dropped after it) over the whole sequence, fp64."""
    import torch

    s = q.shape[-2]
    index = torch.arange(s)
    allowed = index[None, :] <= index[:, None]
    if window is not None:
        allowed = allowed & (index[None, :] > index[:, None] - window)
    if positions is not None:
        allowed = allowed & (index[None, None, :] >= (index - positions)[:, :, None])
        allowed = allowed[:, None]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return scores.softmax(-1) @ v
    column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat((scores, column), dim=-1).softmax(-1)[..., :-1] @ v


def main() -> None:
    spec, result_path, rank, world = start()
    import torch
    import torch.distributed as dist

    from moe_train.data import position_ids
    from moe_train.parallel.context_parallel import shard_sequence
    from moe_train.parallel.ring_attention import ShardMask, context_parallel_attention

    group = dist.group.WORLD
    results = {}
    for case in spec["cases"]:
        torch.manual_seed(7)
        b, heads, kv_heads, s, d, dv = case["b"], case["heads"], case["kv_heads"], case["s"], case["d"], case["dv"]
        q = torch.randn(b, heads, s, d, dtype=torch.float64)
        k = torch.randn(b, kv_heads, s, d, dtype=torch.float64)
        v = torch.randn(b, kv_heads, s, dv, dtype=torch.float64)
        grad = torch.randn(b, heads, s, dv, dtype=torch.float64)
        positions = None
        if case["documents"]:  # documents end at random tokens (EOD id 0)
            tokens = torch.randint(0, 5, (b, s))
            positions = position_ids(tokens, 0)
        scale = d ** -0.5
        window = case.get("window")
        sinks = torch.randn(heads, dtype=torch.float64) if case.get("sinks") else None
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        full_sinks = None if sinks is None else sinks.clone().requires_grad_()
        want = reference(*full, positions, scale, window, full_sinks)
        want.backward(grad)

        def mine(x):  # this rank's shard along the sequence (dim -2)
            return shard_sequence(x.transpose(-1, -2), cp=world, rank=rank).transpose(-1, -2)

        local = [mine(x).clone().requires_grad_() for x in (q, k, v)]
        local_sinks = None if sinks is None else sinks.clone().requires_grad_()
        mask = ShardMask(chunks=(rank, 2 * world - 1 - rank), chunk=s // (2 * world),
                         positions=None if positions is None else shard_sequence(positions, cp=world, rank=rank))
        got = context_parallel_attention(*local, mask, scale=scale, group=group, comm=case["comm"], window=window,
                                         sinks=local_sinks)
        got.backward(mine(grad))
        errors = {"out": (got - mine(want)).abs().max().item()}
        for name, x, ref in zip(("dq", "dk", "dv"), local, full, strict=True):
            errors[name] = (x.grad - mine(ref.grad)).abs().max().item()
        if sinks is not None:  # each rank's share over its queries; the shares summed are the whole gradient
            summed = local_sinks.grad.clone()
            dist.all_reduce(summed, group=group)
            errors["dsinks"] = (summed - full_sinks.grad).abs().max().item()
        gathered = [None] * world
        dist.all_gather_object(gathered, errors)
        results[case["id"]] = {key: max(e[key] for e in gathered) for key in errors}
    finish(results, result_path, rank)


if __name__ == "__main__":
    main()
