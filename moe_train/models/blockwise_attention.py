"""Attention written out through its log-sum-exp, a block of scores at a time: what a fused (flash) kernel
keeps for backward, for the attention torch's fused kernels do not take.

Two users: context parallelism (parallel/ring_attention.py: the blocks of a ring step or of the gathered
sequence, merged through their log-sum-exp) and gpt-oss's attention sinks and sliding windows on one rank
(`sink_window_attention`, the kernel table's `sinks_and_windows`: SDPA takes the sink only as a mask column
with a gradient, which sends it to the MATH kernel, which keeps the [b, h, s, s + 1] scores and probabilities).
Each keeps q, k, v, the output (q's dtype) and the fp32 log-sum-exp for backward, never an [s, s] matrix, and
backward recomputes the probabilities from them. A head's sink is one more logit in each query's softmax
normaliser with a zero value: it joins the merged log-sum-exp once (`join_sinks`), after every block.

The block products run through `attention_product` (models/linear.py, the GEMM site) in fp32 (fp64 for fp64
inputs); grouped-query K/V heads are repeated per block, as SDPA's enable_gqa does.
"""

from __future__ import annotations

import torch

from moe_train.models.linear import attention_product as mm

NEG_INF = float("-inf")
# Elements of the score block `sink_window_attention` forms at a time (fp32: 256 MiB): the queries are taken in
# row blocks so that a long sequence never holds all [b, h, s, s] scores at once.
SCORE_BLOCK = 1 << 26


def expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """K/V heads repeated for grouped-query attention (query head i reads kv head i // group, as SDPA's
    enable_gqa does)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def fold_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of `expand_heads`: sum over each kv head's group of query heads."""
    b, heads, s, d = grad.shape
    return grad if heads == kv_heads else grad.view(b, kv_heads, heads // kv_heads, s, d).sum(2)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: q [b, h, cq, d], k [b, hk, ck, d], v [b, hk, ck, dv] -> (out [b, h, cq, dv], lse [b, h, cq]),
    both fp32 (fp64 for fp64 inputs). A query row with nothing allowed gets out 0 and lse -inf."""
    dtype = compute_dtype(q)
    k, v = expand_heads(k, q.shape[1]).to(dtype), expand_heads(v, q.shape[1]).to(dtype)
    scores = mm(q.to(dtype), k.transpose(-1, -2)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.masked_fill(lse == NEG_INF, 0.0)[..., None])
    return mm(probs, v), lse


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, scale: float,
                   lse: torch.Tensor, grad_out: torch.Tensor, delta: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block's share of the gradients given the merged lse and delta = rowsum(grad_out * out) of its query
    rows: (dq [b, h, cq, d], dk [b, hk, ck, d], dv [b, hk, ck, dv]) in the compute dtype."""
    dtype = compute_dtype(q)
    kv_heads = k.shape[1]
    qc = q.to(dtype)
    kc, vc = expand_heads(k, q.shape[1]).to(dtype), expand_heads(v, q.shape[1]).to(dtype)
    scores = mm(qc, kc.transpose(-1, -2)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, NEG_INF)
    probs = torch.exp(scores - lse[..., None])
    dv = mm(probs.transpose(-1, -2), grad_out)
    dscores = probs * (mm(grad_out, vc.transpose(-1, -2)) - delta[..., None])
    dq = mm(dscores, kc) * scale
    dk = mm(dscores.transpose(-1, -2), qc) * scale
    return dq, fold_heads(dk, kv_heads), fold_heads(dv, kv_heads)


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial softmax results of the same query rows through their log-sum-exp (fp32)."""
    if out is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)
    safe = new.masked_fill(new == NEG_INF, 0.0)
    return out * torch.exp(lse - safe)[..., None] + block_out * torch.exp(block_lse - safe)[..., None], new


def join_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged output and log-sum-exp [b, h, s] with each head's sink logit in the normaliser, once per
    query: L = logaddexp(lse, sink), out scaled by exp(lse - L) (the sink's value is zero)."""
    if sinks is None:
        return out, lse
    joined = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])
    return out * torch.exp(lse - joined)[..., None], joined


def sinks_grad(sinks: torch.Tensor | None, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor | None:
    """d sink_h = -sum over the queries of P(sink) * delta, P(sink) = exp(sink - L): the sink's score gradient
    with a zero value row (under CP each rank's share, summed with the other replicated gradients)."""
    if sinks is None:
        return None
    share = torch.exp(sinks.to(lse.dtype)[None, :, None] - lse)
    return -(share * delta).sum(dim=(0, 2)).to(sinks.dtype)


def _sink_window_allowed(rows: slice, keys: int, mask: torch.Tensor | None, window: int | None,
                         device: torch.device) -> torch.Tensor:
    """Boolean [b|1, 1, len(rows), keys] (True: attend) of the query rows `rows`: causal, within the last
    `window` keys of each query (itself included: transformers' kv > q - window) and, given the document mask
    [b, 1, s, s] (additive, 0 or -inf: models/attention.py `attention_mask`; or boolean), within its
    document."""
    q_index = torch.arange(rows.start, rows.stop, device=device)
    k_index = torch.arange(keys, device=device)
    allowed = k_index[None, :] <= q_index[:, None]
    if window is not None:
        allowed = allowed & (k_index[None, :] > q_index[:, None] - window)
    allowed = allowed[None, None]
    if mask is not None:
        rows_mask = mask[..., rows, :]
        allowed = allowed & (rows_mask if rows_mask.dtype == torch.bool else rows_mask == 0)
    return allowed


def _row_blocks(q: torch.Tensor, keys: int) -> list[slice]:
    """The query row blocks of `sink_window_attention`: at most SCORE_BLOCK scores each."""
    b, heads, seq = q.shape[0], q.shape[1], q.shape[-2]
    rows = max(1, SCORE_BLOCK // (b * heads * keys))
    return [slice(start, min(start + rows, seq)) for start in range(0, seq, rows)]


class _SinkWindowAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, mask, window: int | None, scale: float):
        outs, lses = [], []
        for rows in _row_blocks(q, k.shape[-2]):
            allowed = _sink_window_allowed(rows, k.shape[-2], mask, window, q.device)
            out, lse = block_forward(q[..., rows, :], k, v, allowed, scale)
            outs.append(out)
            lses.append(lse)
        out, lse = join_sinks(torch.cat(outs, dim=-2), torch.cat(lses, dim=-1), sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *(t for t in (sinks, mask) if t is not None))
        ctx.has_sinks, ctx.has_mask, ctx.window, ctx.scale = sinks is not None, mask is not None, window, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, *optional = ctx.saved_tensors
        sinks = optional.pop(0) if ctx.has_sinks else None
        mask = optional[0] if ctx.has_mask else None
        dtype = lse.dtype
        grad_out = grad_out.to(dtype)
        delta = (grad_out * out.to(dtype)).sum(-1)
        dq = torch.empty(q.shape, dtype=dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=dtype, device=q.device)
        dv = torch.zeros(v.shape, dtype=dtype, device=q.device)
        for rows in _row_blocks(q, k.shape[-2]):
            allowed = _sink_window_allowed(rows, k.shape[-2], mask, ctx.window, q.device)
            dq_b, dk_b, dv_b = block_backward(q[..., rows, :], k, v, allowed, ctx.scale, lse[..., rows],
                                              grad_out[..., rows, :], delta[..., rows])
            dq[..., rows, :] = dq_b
            dk += dk_b
            dv += dv_b
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), sinks_grad(sinks, lse, delta), None, None,
                None)


def sink_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
                          window: int | None, sinks: torch.Tensor | None, scale: float | None = None
                          ) -> torch.Tensor:
    """Causal attention over [b, heads, s, d] (k, v: [b, kv_heads, s, d]) with gpt-oss's sliding `window` and
    per-head `sinks` [heads], within the documents of the additive `mask` [b, 1, s, s] when given: [b, heads,
    s, d] in q's dtype. Saves q, k, v, the output and the fp32 log-sum-exp (and the shared mask), as a fused
    kernel would."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _SinkWindowAttention.apply(q, k, v, sinks, mask, window, scale)
