"""Causal attention across context-parallel shards: a ring of K/V exchanges (p2p) or one all-gather of K/V.

Each cp rank r holds two of the sequence's 2*cp chunks, r and 2*cp-1-r (Megatron-LM's split,
`context_parallel.py`), so every rank does the same causal work. Queries never move; keys and values do:

- `p2p` (ring): cp steps; at step t a rank attends its queries to the K/V of rank r-t while it sends the K/V it
  holds to rank r+1 and receives rank r-t-1's (isend/irecv, overlapping the block's compute). A (query chunk, key
  chunk) pair that the causal mask hides whole is skipped: of the four pairs of a step, three at t = 0 (two
  of them causal diagonals, half a block's work each) and exactly two whole blocks at every later step, so
  every rank does the same work.
  Backward runs the ring again: the K/V travel once more and their gradients travel with them, accumulated by
  each rank they pass, until one last send returns them to their owner (cp-1 K/V sends, cp gradient sends).
- `allgather`: the K/V of every rank are gathered once and each query chunk attends to the chunks up to its own
  (Megatron-Core's choice for MLA); backward gathers them again and reduce-scatters their gradients.

Partial results are merged in fp32 through their log-sum-exp, and backward recomputes the probabilities from the
saved queries, keys, values, output and log-sum-exp (flash attention's saved set, never the [s, s] scores). The
block products (models/blockwise_attention.py, which gpt-oss's attention on one rank uses too) are written in
plain torch (a [chunk, chunk] score tile at a time): torch's flash kernels do not take the per-block document
masks packed sequences need on every device. Documents: position ids restart at
each document start, so query i (global index) and key j share a document exactly when j >= i - position_i;
the mask of any block follows from the queries' global indices and positions alone, with no exchange.

gpt-oss's sliding windows and attention sinks: a layer's window (`ShardMask.window`) masks by global indices
(key j is seen by query i when i - window < j <= i), so a block whose keys all lie at or before every query's
window is skipped as the causal mask's hidden blocks are (on the ring its K/V still pass on; the all-gather path
starts each query chunk's keys at its first query's window). A head's sink is one more logit in each query's
softmax normaliser and adds no value: it joins the merged log-sum-exp once per query, after every block
(L = logaddexp(lse, sink), the output scaled by exp(lse - L)), never once per block; backward recomputes the
probabilities against that L, and the sink's gradient is -sum over queries of exp(sink - L) * rowsum(dO * out).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_train.models.blockwise_attention import block_backward, block_forward, join_sinks, merge, sinks_grad


class ShardMask:
    """What attention under CP needs to mask a block: this rank's two chunks (global chunk numbers), the chunk
    length, the local tokens' position ids [b, 2c] when documents may restart (None: plain causal), and the
    layer's sliding window (None: none; `with_window`).

    A plain class, not a dataclass: FSDP2 rebuilds dataclasses it casts into a module's inputs."""

    __slots__ = ("chunks", "chunk", "positions", "window")

    def __init__(self, *, chunks: tuple[int, int], chunk: int, positions: torch.Tensor | None,
                 window: int | None = None) -> None:
        self.chunks, self.chunk, self.positions, self.window = chunks, chunk, positions, window

    def with_window(self, window: int | None) -> ShardMask:
        """The same shards under one layer's sliding window (gpt-oss's sliding_attention layers)."""
        return self if window == self.window else ShardMask(chunks=self.chunks, chunk=self.chunk,
                                                            positions=self.positions, window=window)

    def hides(self, q_chunk: int, kv_chunk: int) -> bool:
        """Whether every (query, key) pair of two chunks is masked: the keys wholly after the queries (causal),
        or wholly at or before the first query's window (i - window < j fails for every pair)."""
        if kv_chunk > q_chunk:
            return True
        return self.window is not None and (kv_chunk + 1) * self.chunk - 1 <= q_chunk * self.chunk - self.window

    def first_key(self, q_chunk: int) -> int:
        """The first global key index any query of `q_chunk` sees (0 without a window)."""
        return 0 if self.window is None else max(0, q_chunk * self.chunk - self.window + 1)

    def indices(self, number: int, device: torch.device) -> torch.Tensor:
        """Global token indices of chunk `number`."""
        return torch.arange(number * self.chunk, (number + 1) * self.chunk, device=device)

    def local_positions(self, which: int) -> torch.Tensor | None:
        """Position ids of this rank's chunk `which` (0 or 1)."""
        if self.positions is None:
            return None
        return self.positions[..., which * self.chunk: (which + 1) * self.chunk]


def _allowed(q_chunk: int, keys: tuple[int, int], mask: ShardMask, q_positions: torch.Tensor | None,
             device: torch.device) -> torch.Tensor | None:
    """Boolean [b|1, 1, cq, ck] of the query chunk against the keys of global indices keys[0] .. keys[1] - 1
    (True: attend), or None when every pair is allowed (keys wholly before the queries and inside their windows,
    no documents). The bounds are host ints: nothing is read back from the device."""
    q_index = mask.indices(q_chunk, device)
    k_index = torch.arange(*keys, device=device)
    allowed = None
    if keys[1] - 1 >= q_chunk * mask.chunk:
        allowed = (k_index[None, :] <= q_index[:, None])[None, None]
    if mask.window is not None and keys[0] <= (q_chunk + 1) * mask.chunk - 1 - mask.window:
        inside = (k_index[None, :] > q_index[:, None] - mask.window)[None, None]
        allowed = inside if allowed is None else allowed & inside
    if q_positions is not None:
        starts = q_index[None, :] - q_positions  # [b, cq]: the global index where each query's document starts
        same = (k_index[None, None, :] >= starts[:, :, None])[:, None]
        allowed = same if allowed is None else allowed & same
    return allowed


# ------------------------------------------------------------------------------------------------ comm


def _pack(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(flat: torch.Tensor, like: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset: offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


def _start_ring(flat: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, list]:
    """Send `flat` to the next cp rank and receive the previous one's into a new buffer (asynchronously)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty_like(flat)
    ops = [dist.P2POp(dist.isend, flat, dist.get_global_rank(group, (rank + 1) % size), group),
           dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - 1) % size), group)]
    return received, dist.batch_isend_irecv(ops)


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def _chunks_of(rank: int, size: int) -> tuple[int, int]:
    return rank, 2 * size - 1 - rank


# ------------------------------------------------------------------------------------------------ p2p


def _ring_blocks(mask: ShardMask, source: int, size: int) -> list[tuple[int, int]]:
    """(query half, key half) pairs of this rank's chunks against `source` rank's that the causal mask (and the
    sliding window) does not hide whole."""
    kv = _chunks_of(source, size)
    return [(qi, ki) for qi in (0, 1) for ki in (0, 1) if not mask.hides(mask.chunks[qi], kv[ki])]


def _chunk_keys(mask: ShardMask, number: int) -> tuple[int, int]:
    """The global key indices of chunk `number`, as `_allowed`'s bounds."""
    return number * mask.chunk, (number + 1) * mask.chunk


def _halves(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    return x[..., :chunk, :], x[..., chunk:, :]


def _save(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
          outs: list[torch.Tensor], lses: list[torch.Tensor], mask: ShardMask, scale: float,
          group: dist.ProcessGroup) -> torch.Tensor:
    """Both exchanges' forward end: the halves' outputs joined (with the sinks), and what backward recomputes the
    blocks from (q, k, v, the output and its fp32 log-sum-exp, the sinks, the document positions when there are
    documents)."""
    out, lse = join_sinks(torch.cat(outs, dim=-2), torch.cat(lses, dim=-1), sinks)
    out = out.to(q.dtype)
    optional = [t for t in (sinks, mask.positions) if t is not None]
    ctx.save_for_backward(q, k, v, out, lse, *optional)
    ctx.has_sinks = sinks is not None
    ctx.mask, ctx.scale, ctx.group = mask, scale, group
    return out


def _saved(ctx) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                         ShardMask]:
    """`_save`'s tensors back (the sinks None without them), the mask rebuilt around the saved positions."""
    q, k, v, out, lse, *optional = ctx.saved_tensors
    sinks = optional.pop(0) if ctx.has_sinks else None
    mask = ShardMask(chunks=ctx.mask.chunks, chunk=ctx.mask.chunk, positions=optional[0] if optional else None,
                     window=ctx.mask.window)
    return q, k, v, out, lse, sinks, mask


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, mask: ShardMask, scale: float, group: dist.ProcessGroup):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        c = mask.chunk
        q_halves = _halves(q, c)
        outs, lses = [None, None], [None, None]
        flat = _pack(k, v)
        for step in range(size):
            source = (rank - step) % size
            pending = _start_ring(flat, group) if step < size - 1 else None
            k_t, v_t = _unpack(flat, (k, v))
            kv_chunks = _chunks_of(source, size)
            for qi, ki in _ring_blocks(mask, source, size):
                allowed = _allowed(mask.chunks[qi], _chunk_keys(mask, kv_chunks[ki]), mask, mask.local_positions(qi),
                                   q.device)
                o, lse = block_forward(q_halves[qi], _halves(k_t, c)[ki], _halves(v_t, c)[ki], allowed, scale)
                outs[qi], lses[qi] = merge(outs[qi], lses[qi], o, lse)
            if pending is not None:
                flat, requests = pending
                _wait(requests)
        return _save(ctx, q, k, v, sinks, outs, lses, mask, scale, group)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks, mask = _saved(ctx)
        group, scale, c = ctx.group, ctx.scale, mask.chunk
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        dtype = lse.dtype  # the blocks' compute dtype (fp32; fp64 for fp64 inputs)
        grad_out = grad_out.to(dtype)
        delta = (grad_out * out.to(dtype)).sum(-1)
        q_halves, g_halves = _halves(q, c), _halves(grad_out, c)
        lse_halves, delta_halves = (lse[..., :c], lse[..., c:]), (delta[..., :c], delta[..., c:])
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        dq_halves = _halves(dq, c)
        flat = _pack(k, v)
        dkv = torch.zeros(flat.numel(), dtype=dtype, device=q.device)  # travels with the K/V it belongs to
        for step in range(size):
            source = (rank - step) % size
            pending = _start_ring(flat, group) if step < size - 1 else None
            k_t, v_t = _unpack(flat, (k, v))
            dk_t, dv_t = _unpack(dkv, (k, v))
            kv_chunks = _chunks_of(source, size)
            for qi, ki in _ring_blocks(mask, source, size):
                allowed = _allowed(mask.chunks[qi], _chunk_keys(mask, kv_chunks[ki]), mask, mask.local_positions(qi),
                                   q.device)
                dq_b, dk_b, dv_b = block_backward(q_halves[qi], _halves(k_t, c)[ki], _halves(v_t, c)[ki], allowed,
                                                  scale, lse_halves[qi], g_halves[qi], delta_halves[qi])
                dq_halves[qi].add_(dq_b)
                _halves(dk_t, c)[ki].add_(dk_b)
                _halves(dv_t, c)[ki].add_(dv_b)
            dkv, dkv_requests = _start_ring(dkv, group)  # on to the next rank; the last send returns it home
            if pending is not None:
                flat, requests = pending
                _wait(requests)
            _wait(dkv_requests)
        dk, dv = _unpack(dkv, (k, v))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), sinks_grad(sinks, lse, delta), None, None, None


# ------------------------------------------------------------------------------------------- allgather


def _gather_kv(k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[cp, n]: every rank's packed K/V, in rank order."""
    flat = _pack(k, v)
    size = dist.get_world_size(group)
    gathered = flat.new_empty(size * flat.numel())  # gloo takes the flat output only
    dist.all_gather_single(gathered, flat, group=group)
    return gathered.view(size, -1)


def _in_sequence_order(gathered: torch.Tensor, like: tuple[torch.Tensor, torch.Tensor], chunk: int
                       ) -> list[torch.Tensor]:
    """K and V of the whole sequence [b, hk, s, d] from the gathered shards (rank r holds chunks r, 2cp-1-r)."""
    size = gathered.shape[0]
    per_rank = [_unpack(gathered[r], like) for r in range(size)]
    out = []
    for i in range(len(like)):
        pieces = [None] * (2 * size)
        for r, tensors in enumerate(per_rank):
            first, second = _chunks_of(r, size)
            pieces[first], pieces[second] = _halves(tensors[i], chunk)
        out.append(torch.cat(pieces, dim=-2))
    return out


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, mask: ShardMask, scale: float, group: dist.ProcessGroup):
        c = mask.chunk
        k_all, v_all = _in_sequence_order(_gather_kv(k, v, group), (k, v), c)
        outs, lses = [], []
        for qi, q_half in enumerate(_halves(q, c)):
            number = mask.chunks[qi]
            start, end = mask.first_key(number), (number + 1) * c
            allowed = _allowed(number, (start, end), mask, mask.local_positions(qi), q.device)
            o, lse = block_forward(q_half, k_all[..., start:end, :], v_all[..., start:end, :], allowed, scale)
            outs.append(o)
            lses.append(lse)
        return _save(ctx, q, k, v, sinks, outs, lses, mask, scale, group)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks, mask = _saved(ctx)
        group, scale, c = ctx.group, ctx.scale, mask.chunk
        size = dist.get_world_size(group)
        k_all, v_all = _in_sequence_order(_gather_kv(k, v, group), (k, v), c)
        dtype = lse.dtype  # the blocks' compute dtype (fp32; fp64 for fp64 inputs)
        grad_out = grad_out.to(dtype)
        delta = (grad_out * out.to(dtype)).sum(-1)
        dk_all = torch.zeros(k_all.shape, dtype=dtype, device=q.device)
        dv_all = torch.zeros(v_all.shape, dtype=dtype, device=q.device)
        dqs = []
        for qi, (q_half, g_half) in enumerate(zip(_halves(q, c), _halves(grad_out, c), strict=True)):
            number = mask.chunks[qi]
            start, end = mask.first_key(number), (number + 1) * c
            rows = slice(qi * c, (qi + 1) * c)
            allowed = _allowed(number, (start, end), mask, mask.local_positions(qi), q.device)
            dq, dk, dv = block_backward(q_half, k_all[..., start:end, :], v_all[..., start:end, :], allowed, scale,
                                        lse[..., rows], g_half, delta[..., rows])
            dqs.append(dq)
            dk_all[..., start:end, :] += dk
            dv_all[..., start:end, :] += dv
        # Back to the owners: rank r's shard is its chunks r and 2cp-1-r; summed over the ranks that read them.
        shards = []
        for r in range(size):
            first, second = _chunks_of(r, size)
            pick = [slice(first * c, (first + 1) * c), slice(second * c, (second + 1) * c)]
            shards.append(_pack(*(torch.cat([g[..., p, :] for p in pick], dim=-2) for g in (dk_all, dv_all))))
        mine = shards[0].new_empty(shards[0].numel())
        dist.reduce_scatter_single(mine, torch.cat(shards), group=group)
        dk, dv = _unpack(mine, (k, v))
        return (torch.cat(dqs, dim=-2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), sinks_grad(sinks, lse, delta),
                None, None, None)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: ShardMask, *,
                               scale: float, group: dist.ProcessGroup, comm: str, window: int | None = None,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries [b, h, 2c, d] over the whole sequence's keys and values, of which
    this rank holds [b, hk, 2c, d] / [b, hk, 2c, dv] (its chunks of `mask`): [b, h, 2c, dv] in q's dtype.
    `window`: the layer's sliding window (keys i - window < j <= i); `sinks` [h]: each head's sink logit."""
    function = _RingAttention if comm == "p2p" else _AllGatherAttention
    return function.apply(q.contiguous(), k.contiguous(), v.contiguous(), sinks, mask.with_window(window), scale,
                          group)
