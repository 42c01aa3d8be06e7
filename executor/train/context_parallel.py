"""Context parallelism: the ``cp`` ranks of a group split every sequence and exchange keys and values.

Layout (Megatron-LM's load balancing of the causal mask): a sequence is cut
into ``2 * cp`` chunks and cp rank ``i`` holds chunks ``i`` and
``2 * cp - 1 - i``, so every rank gets as many early tokens (few keys to
attend) as late ones. A rank embeds, runs and scores only its tokens; token
ids, RoPE angles and learned positions follow the tokens' *global* positions
(:func:`sequence_positions`). Everything but attention is per token; attention
needs the keys and values of the whole sequence, in one of two styles:

- ``ring`` (Liu et al. 2023, Ring Attention; Megatron-LM / TransformerEngine's
  ``AttnFuncWithCPAndKVP2P``): K/V chunks travel around the cp ring, one hop
  per step by ``isend`` / ``irecv``, while the rank attends to the chunk it
  holds; partial results merge by their log-sum-exp (the online softmax). The
  backward passes K/V around again, and with them the dK/dV accumulators, so
  each ends at its owner holding every rank's contribution.
- ``all_gather`` (Llama 3, Dubey et al. 2024, section 3.3.2): all-gather K/V,
  attend the local queries to every key under the global causal mask, and
  reduce-scatter dK/dV in the backward (which gathers K/V again rather than
  keeping the whole sequence's K/V alive between the passes).

Both cores compute in fp32 from explicit scores, so the backward of every
block uses the final log-sum-exp (FlashAttention's ``dS = P * (dP - rowsum(dO * O))``).
The events are the simulator's (:meth:`parsim.lowering.lower.Lowering._with_context_exchange`):
per attention block and pass, ``all_gather cp layer=<piece> mb=<m> dir=<fwd|bwd>``,
and in the backward ``reduce_scatter cp ...``; a ring exchange is one event from
its first send to its last receive. Each carries the lowering's bytes, the K/V
of the whole sequence (the all-gather's output size), whatever the ring moves per hop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from parsim.report.trace import collective_name

from .._torch import require_distributed, require_torch
from .comm import _all_gather, _reduce_scatter
from .models import Piece
from .trace_recorder import Recorder

torch = require_torch()
dist = require_distributed()
nn = torch.nn

KV_TAG, GRAD_TAG = 1, 2  # the backward runs both rings at once between the same ranks


def sequence_positions(seq_len: int, size: int, rank: int, device: Any = None):
    """Global positions of cp rank ``rank``'s tokens: chunks ``rank`` and ``2 * size - 1 - rank`` of ``2 * size``."""
    chunk = seq_len // (2 * size)
    late = 2 * size - 1 - rank
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk, device=device),
                      torch.arange(late * chunk, (late + 1) * chunk, device=device)])


@dataclass
class CPGroup:
    """This rank's context-parallel group: ``rank`` of ``size``, its members' global ranks in cp order."""

    group: Any
    rank: int
    size: int
    members: list[int]
    style: str  # "ring" or "all_gather"
    recorder: Recorder

    @property
    def next(self) -> int:
        return self.members[(self.rank + 1) % self.size]

    @property
    def prev(self) -> int:
        return self.members[(self.rank - 1) % self.size]

    def event(self, op: str, layer: str, direction: str) -> str:
        return collective_name(op, "cp", layer=layer, mb=self.recorder.microbatch, dir=direction)


def apply_context_parallel(pieces: list[Piece], cp: CPGroup, seq_len: int) -> None:
    """Give ``pieces`` their tokens' global positions and every attention the ``cp`` core, in place."""
    positions = sequence_positions(seq_len, cp.size, cp.rank)
    for piece in pieces:
        m = piece.module
        if piece.name == "embedding":
            m.position_ids = positions
        elif piece.name.startswith("layer."):
            m.attn.position_ids = positions
            m.attn.core = ContextParallelAttention(cp, piece.name)


def replica_loss(loss: float, cp: CPGroup) -> float:
    """The replica's loss over whole sequences: the mean of the cp ranks' losses (equal token counts).

    For reporting only: the gradients already sum every rank's share through the K/V exchanges.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(cp.group) == "nccl" else "cpu"
    total = torch.tensor([loss], dtype=torch.float64, device=device)
    dist.all_reduce(total, group=cp.group)
    return total.item() / cp.size


class ContextParallelAttention(nn.Module):
    """The attention core of one layer under context parallelism: ``(q, k, v) -> out`` on local tokens."""

    def __init__(self, cp: CPGroup, layer: str):
        super().__init__()
        self.cp, self.layer = cp, layer

    def forward(self, q, k, v):
        core = _RingAttention if self.cp.style == "ring" else _AllGatherAttention
        return core.apply(q, k, v, self.cp, self.layer)


# --------------------------------------------------------------------------- attention on one K/V block
def _repeat(kv, heads: int):
    """Grouped K or V (batch, kv_heads, ...) repeated to the query heads."""
    return kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _unrepeat(grad, kv_heads: int):
    """The gradient of :func:`_repeat`: the query heads of each group summed."""
    b, heads, *rest = grad.shape
    return grad.view(b, kv_heads, heads // kv_heads, *rest).sum(2)


def _scores(q, k, mask):
    scores = (q.float() @ _repeat(k, q.shape[1]).float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def attend(q, k, v, mask=None):
    """Softmax attention of ``q`` on one block of keys: ``(out, lse)`` in fp32, ``out`` normalized within
    the block and ``lse`` its rows' log-sum-exp of scores. ``mask`` (q, k): True where a query may attend;
    every row must keep at least one key."""
    scores = _scores(q, k, mask)
    lse = scores.logsumexp(-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ _repeat(v, q.shape[1]).float(), lse


def merge(out, lse, block_out, block_lse) -> None:
    """Fold one block's ``(block_out, block_lse)`` into the running ``(out, lse)`` in place (online softmax)."""
    total = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - total).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - total).unsqueeze(-1))
    lse.copy_(total)


def attend_backward(q, k, v, dout, lse, delta, mask=None):
    """``(dq, dk, dv)`` (fp32, K/V grouped) of one block, from the *final* rows' ``lse`` and
    ``delta = rowsum(dout * out)``, as FlashAttention's backward."""
    scale = 1 / math.sqrt(q.shape[-1])
    probs = torch.exp(_scores(q, k, mask) - lse.unsqueeze(-1))
    dv = probs.transpose(-1, -2) @ dout
    dscores = probs * (dout @ _repeat(v, q.shape[1]).float().transpose(-1, -2) - delta.unsqueeze(-1))
    dq = dscores @ _repeat(k, q.shape[1]).float() * scale
    dk = dscores.transpose(-1, -2) @ q.float() * scale
    return dq, _unrepeat(dk, k.shape[1]), _unrepeat(dv, k.shape[1])


def ring_block(rank: int, source: int, length: int) -> tuple[slice, slice, bool]:
    """Which local queries attend to which keys of cp rank ``source``'s K/V, and whether causally.

    Both hold an early and a late chunk (``length`` tokens in all). The own K/V: causal (local order
    is global order). An earlier rank's: its early chunk precedes both of ours, its late chunk follows
    both. A later rank's: only our late chunk sees it, all of it. So every step past the first costs
    half a block: the load balance.
    """
    half = length // 2
    if source == rank:
        return slice(None), slice(None), True
    if source < rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


def _causal(length: int, device: Any):
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()


def _pack(k, v):
    """K and V as one tensor, side by side in the last dim (their widths may differ: latent attention's)."""
    return torch.cat([k, v], -1)


def _unpack(kv, width: int) -> tuple:
    """``(k, v)`` of a :func:`_pack`-ed tensor whose K is ``width`` wide."""
    return kv[..., :width], kv[..., width:]


def _kv_bytes(kv, size: int) -> int:
    """The simulator's size of a K/V exchange: K and V of the whole sequence (every rank's share)."""
    return size * kv.numel() * kv.element_size()


# --------------------------------------------------------------------------- ring
class _RingPass:
    """One logical collective carried out as hops around the cp ring (send to the next rank, receive
    from the previous), recorded as one event from its first send to its last receive."""

    def __init__(self, cp: CPGroup, op: str, layer: str, direction: str, nbytes: int, tag: int):
        self.cp, self.tag, self.nbytes = cp, tag, nbytes
        self.name = cp.event(op, layer, direction)
        self.start: float | None = None
        self.end = 0.0
        self._pending: tuple[list, Any] | None = None

    def send(self, tensor) -> None:
        """Start passing ``tensor`` on, and receiving the previous rank's in its place."""
        if self.start is None:
            self.start = self.cp.recorder.now()
        buffer = torch.empty_like(tensor)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, self.cp.next, tag=self.tag),
                                        dist.P2POp(dist.irecv, buffer, self.cp.prev, tag=self.tag)])
        self._pending = (works, buffer)

    def receive(self):
        """Wait for the hop under way; the tensor that arrived."""
        works, buffer = self._pending
        for work in works:
            work.wait()
        self._pending, self.end = None, self.cp.recorder.now()
        return buffer

    def record(self) -> None:
        """The event, once the last hop has arrived (work after it is not the exchange's)."""
        self.cp.recorder.add(self.name, "collective", "cp", self.start, self.end, phase="cp", bytes=self.nbytes)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp: CPGroup, layer: str):
        kv = _pack(k, v)  # one message per hop
        ring = _RingPass(cp, "all_gather", layer, "fwd", _kv_bytes(kv, cp.size), KV_TAG)
        length, width = q.shape[2], k.shape[-1]
        out = lse = None
        for step in range(cp.size):
            if step < cp.size - 1:
                ring.send(kv)  # overlaps the attention on the chunk at hand
            rows, cols, causal = ring_block(cp.rank, (cp.rank - step) % cp.size, length)
            block_k, block_v = _unpack(kv[:, :, cols], width)
            block = attend(q[:, :, rows], block_k, block_v, _causal(length, q.device) if causal else None)
            if out is None:  # step 0 is the own, causal block: it covers every row
                out, lse = block
            else:
                merge(out[:, :, rows], lse[:, :, rows], *block)
            if step < cp.size - 1:
                kv = ring.receive()
        ring.record()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.layer = cp, layer
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        cp, length, width = ctx.cp, q.shape[2], k.shape[-1]
        dout = grad.float()
        delta = (dout * out).sum(-1)
        kv = _pack(k, v)
        nbytes = _kv_bytes(kv, cp.size)
        kv_ring = _RingPass(cp, "all_gather", ctx.layer, "bwd", nbytes, KV_TAG)
        grad_ring = _RingPass(cp, "reduce_scatter", ctx.layer, "bwd", nbytes, GRAD_TAG)
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkv = torch.zeros_like(kv)  # the accumulator of the K/V at hand; it travels with them, one hop behind
        for step in range(cp.size):
            if step < cp.size - 1:
                kv_ring.send(kv)
            if step > 0:
                dkv = grad_ring.receive()
            rows, cols, causal = ring_block(cp.rank, (cp.rank - step) % cp.size, length)
            block_k, block_v = _unpack(kv[:, :, cols], width)
            block_dq, dk, dv = attend_backward(q[:, :, rows], block_k, block_v, dout[:, :, rows],
                                               lse[:, :, rows], delta[:, :, rows],
                                               _causal(length, q.device) if causal else None)
            dq[:, :, rows] += block_dq
            dkv[:, :, cols] += _pack(dk, dv).to(dkv.dtype)
            grad_ring.send(dkv)  # the last hop brings each accumulator home to its owner
            if step < cp.size - 1:
                kv = kv_ring.receive()
        kv_ring.record()
        dkv = grad_ring.receive()
        grad_ring.record()
        return (dq.to(q.dtype), *_unpack(dkv, width), None, None)


# --------------------------------------------------------------------------- all-gather
def _gather_kv(kv, cp: CPGroup, direction: str, layer: str):
    """Every rank's packed K/V (:func:`_pack`), as (batch, kv_heads, seq, widths) in the order of the ranks."""
    out = torch.empty((cp.size * kv.shape[0], *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
    with cp.recorder.span(cp.event("all_gather", layer, direction), "collective", "cp", phase="cp",
                          bytes=out.numel() * out.element_size()):
        _all_gather(out, kv.contiguous(), group=cp.group)
    return out.unflatten(0, (cp.size, -1)).movedim(0, 2).flatten(2, 3)


def _global_mask(cp: CPGroup, length: int, device: Any):
    """(local queries, gathered keys): True where the key's global position is not after the query's."""
    seq_len = length * cp.size
    keys = torch.cat([sequence_positions(seq_len, cp.size, r, device) for r in range(cp.size)])
    return sequence_positions(seq_len, cp.size, cp.rank, device).unsqueeze(1) >= keys.unsqueeze(0)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp: CPGroup, layer: str):
        kv = _gather_kv(_pack(k, v), cp, "fwd", layer)
        out, lse = attend(q, *_unpack(kv, k.shape[-1]), _global_mask(cp, q.shape[2], q.device))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.layer = cp, layer
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        cp, length, width = ctx.cp, q.shape[2], k.shape[-1]
        kv = _gather_kv(_pack(k, v), cp, "bwd", ctx.layer)
        dout = grad.float()
        dq, dk, dv = attend_backward(q, *_unpack(kv, width), dout, lse, (dout * out).sum(-1),
                                     _global_mask(cp, length, q.device))
        # back to one block per rank, (cp, batch, kv_heads, seq/cp, widths), summed onto its owner
        blocks = _pack(dk, dv).to(k.dtype).unflatten(2, (cp.size, length)).movedim(2, 0).contiguous()
        mine = torch.empty(blocks.shape[1:], dtype=blocks.dtype, device=blocks.device)
        with cp.recorder.span(cp.event("reduce_scatter", ctx.layer, "bwd"), "collective", "cp", phase="cp",
                              bytes=blocks.numel() * blocks.element_size()):
            _reduce_scatter(mine, blocks.flatten(0, 1), group=cp.group)
        return (dq.to(q.dtype), *_unpack(mine, width), None, None)
