"""Tensor-parallel collectives as autograd functions, each one timed and named.

Megatron-LM's pair (Shoeybi et al. 2019, section 3): ``f`` is the identity in
the forward and an all-reduce of the gradient in the backward (it enters a
column-parallel block, whose input gradient is a partial sum per rank); ``g``
all-reduces the partial outputs of a row-parallel block in the forward and is
the identity in the backward. The lecture's style instead all-gathers each
layer's output columns; autograd turns that gather into a reduce-scatter of
the (partial) output gradient. :class:`VocabParallelCrossEntropy` is
Megatron's loss over a vocabulary split across ranks: three small
all-reduces per token (the logit maximum, the target logit, the sum of
exponentials) and no gathered logits.

With sequence parallelism (Korthikanti et al. 2022, section 4.2.2) the
activations between blocks hold ``1/tp`` of the sequence: a block's entry
all-gathers the sequence (its backward reduce-scatters the gradient) and its
exit reduce-scatters the partial outputs (its backward all-gathers), so norms
run on sequence shards and each ``f`` / ``g`` pair moves the same bytes as
one all-reduce.

Expert parallelism's pair is Megatron-LM's all-to-all token dispatcher:
:func:`dispatch` sends each routed token row to the rank holding its expert
(the per-expert row counts are exchanged first, inside the same timed span,
so every rank knows how many rows it will receive), and :func:`combine` sends
the experts' outputs back; the backward of each is the other's all-to-all with
the split sizes swapped.

Every collective is an event ``<op> <tp|ep> layer=<piece> mb=<m> dir=<fwd|bwd><i>``
with the bytes it moved, the names the simulator gives the same collectives;
``i`` counts the collectives of the layer in that pass, whatever their group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from parsim.report.trace import collective_name

from .._torch import require_distributed, require_torch
from .trace_recorder import Recorder

torch = require_torch()
dist = require_distributed()
nn = torch.nn

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
SEQUENCE_DIM = 1  # activations are (batch, sequence, hidden)
TOKEN_DIM = -2  # the sequence there, or the rows of tokens flattened to (tokens, hidden)


@dataclass
class _LayerGroup:
    """A group whose collectives run inside a layer's pass: ``rank`` of ``size``, the process group, the recorder."""

    group: Any
    rank: int
    size: int
    recorder: Recorder
    dim: ClassVar[str]

    def event_name(self, op: str, layer: str, direction: str) -> str:
        """The next collective's name in this pass: ``<op> <dim> layer=... mb=... dir=<direction><i>``."""
        direction = self.recorder.direction(direction)
        index = self.recorder.next_index(layer, direction)
        return collective_name(op, self.dim, layer=layer, mb=self.recorder.microbatch, dir=f"{direction}{index}")

    def _span(self, op: str, layer: str, direction: str, nbytes: int):
        name = self.event_name(op, layer, direction)
        return self.recorder.span(name, "collective", "comm", phase=self.dim, bytes=nbytes)


@dataclass
class TPGroup(_LayerGroup):
    """This rank's tensor-parallel group."""

    dim: ClassVar[str] = "tp"

    def all_reduce(self, x, layer: str, direction: str, op: Any = None) -> Any:
        """All-reduce ``x`` in place (SUM unless ``op``) and return it."""
        with self._span("all_reduce", layer, direction, x.numel() * x.element_size()):
            dist.all_reduce(x, op=op or dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather(self, x, dim: int, layer: str, direction: str) -> Any:
        """Concatenate every rank's ``x`` along ``dim``, in rank order."""
        dim %= x.dim()
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        with self._span("all_gather", layer, direction, out.numel() * out.element_size()):
            _all_gather(out, x.contiguous(), group=self.group)
        return out.unflatten(0, (self.size, -1)).movedim(0, dim).flatten(dim, dim + 1)

    def reduce_scatter(self, x, dim: int, layer: str, direction: str) -> Any:
        """Sum ``x`` over ranks and keep this rank's slice of ``dim``."""
        dim %= x.dim()
        chunks = x.unflatten(dim, (self.size, -1)).movedim(dim, 0).contiguous()
        out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
        with self._span("reduce_scatter", layer, direction, chunks.numel() * chunks.element_size()):
            _reduce_scatter(out, chunks.flatten(0, 1), group=self.group)
        return out

    def gather_rows(self, x, sizes: list[int], layer: str, direction: str, nbytes: int) -> Any:
        """Every rank's rows of ``x`` (``sizes[r]`` from rank ``r``), concatenated in rank order; ``nbytes``
        is what the event records."""
        with self._span("all_gather", layer, direction, nbytes):
            return self._gather_rows(x, sizes)

    def gather_rows_counted(self, x, counts, layer: str, nbytes: int) -> tuple[Any, Any]:
        """The forward's gather of the rows this rank's experts received (``counts[j]`` for its expert ``j``):
        the counts are exchanged first, inside the same span (Megatron-LM's dispatcher gathers them over
        the expert tensor-parallel group beforehand). Returns the rows and the counts, ``[size, experts]``."""
        with self._span("all_gather", layer, "fwd", nbytes):
            every = counts.new_empty(self.size * counts.numel())
            _all_gather(every, counts.contiguous(), group=self.group)
            every = every.view(self.size, -1)
            return self._gather_rows(x, every.sum(1).tolist()), every

    def _gather_rows(self, x, sizes: list[int]) -> Any:
        most = max(sizes)  # uneven parts travel padded to the largest
        padded = x.new_empty((self.size * most, *x.shape[1:]))
        _all_gather(padded, torch.cat([x, x.new_zeros((most - x.shape[0], *x.shape[1:]))]), group=self.group)
        return torch.cat([part[:n] for part, n in zip(padded.split(most), sizes)])

    def scatter_rows(self, x, sizes: list[int], layer: str, direction: str, nbytes: int) -> Any:
        """Sum ``x`` (every rank's rows, ``sizes[r]`` of rank ``r``'s in rank order) over ranks and keep this
        rank's rows; ``nbytes`` is what the event records."""
        most = max(sizes)
        padded = torch.cat([torch.cat([part, part.new_zeros((most - n, *x.shape[1:]))])
                            for part, n in zip(x.split(sizes), sizes)])
        out = x.new_empty((most, *x.shape[1:]))
        with self._span("reduce_scatter", layer, direction, nbytes):
            _reduce_scatter(out, padded, group=self.group)
        return out[:sizes[self.rank]]


class _GatherRows(torch.autograd.Function):
    """The expert tensor-parallel all-gather of the rows each rank's experts received; its backward sums the
    partial input gradients and returns each rank its rows' (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, counts, tp: TPGroup, layer: str, nbytes: int):
        out, every = tp.gather_rows_counted(x, counts, layer, nbytes)
        ctx.sizes, ctx.tp, ctx.layer, ctx.nbytes = every.sum(1).tolist(), tp, layer, nbytes
        ctx.mark_non_differentiable(every)
        return out, every

    @staticmethod
    def backward(ctx, grad, _):
        return ctx.tp.scatter_rows(grad.contiguous(), ctx.sizes, ctx.layer, "bwd", ctx.nbytes), None, None, None, None


class _ScatterRows(torch.autograd.Function):
    """Sums the experts' partial outputs of every rank's rows and returns each rank its own (a
    reduce-scatter); the backward all-gathers their gradients."""

    @staticmethod
    def forward(ctx, x, sizes: list[int], tp: TPGroup, layer: str, nbytes: int):
        ctx.sizes, ctx.tp, ctx.layer, ctx.nbytes = sizes, tp, layer, nbytes
        return tp.scatter_rows(x, sizes, layer, "fwd", nbytes)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.gather_rows(grad.contiguous(), ctx.sizes, ctx.layer, "bwd", ctx.nbytes), None, None, None, None


def gather_rows(x, counts, tp: TPGroup, layer: str, nbytes: int) -> tuple[Any, Any]:
    """All-gather over ``tp`` the rows this rank's experts received (``counts`` per expert): every rank's, in
    rank order, and their counts ``[tp.size, experts]``. The backward reduce-scatters the gradients."""
    return _GatherRows.apply(x, counts, tp, layer, nbytes)


def scatter_rows(x, sizes: list[int], tp: TPGroup, layer: str, nbytes: int) -> Any:
    """Reduce-scatter uneven row blocks over ``tp`` (rank ``r`` keeps ``sizes[r]``); backward: all-gather."""
    return _ScatterRows.apply(x, sizes, tp, layer, nbytes)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp: TPGroup, layer: str):
        ctx.tp, ctx.layer = tp, layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_reduce(grad.contiguous().clone(), ctx.layer, "bwd"), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp: TPGroup, layer: str):
        return tp.all_reduce(x.contiguous().clone(), layer, "fwd")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp: TPGroup, layer: str):
        ctx.tp, ctx.layer = tp, layer
        return tp.all_gather(x, -1, layer, "fwd")

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.reduce_scatter(grad, -1, ctx.layer, "bwd"), None, None


class _GatherSequence(torch.autograd.Function):
    """Megatron-LM's ``gather_from_sequence_parallel_region``: all-gather the sequence, reduce-scatter back.
    Along the second-to-last dim: the sequence of ``(batch, sequence, hidden)``, or the rows of tokens
    flattened ``(tokens, hidden)``, which a per-token block (MoE's shared experts) gathers as well."""

    @staticmethod
    def forward(ctx, x, tp: TPGroup, layer: str):
        ctx.tp, ctx.layer = tp, layer
        return tp.all_gather(x, TOKEN_DIM, layer, "fwd")

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.reduce_scatter(grad, TOKEN_DIM, ctx.layer, "bwd"), None, None


class _ScatterSequence(torch.autograd.Function):
    """Megatron-LM's ``reduce_scatter_to_sequence_parallel_region``: sum partial outputs, keep this rank's
    part of the sequence; the backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, tp: TPGroup, layer: str):
        ctx.tp, ctx.layer = tp, layer
        return tp.reduce_scatter(x, TOKEN_DIM, layer, "fwd")

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_gather(grad, TOKEN_DIM, ctx.layer, "bwd"), None, None


class _ShareLoss(torch.autograd.Function):
    """Identity forward; the backward gives each of the ``size`` ranks 1/size of the gradient."""

    @staticmethod
    def forward(ctx, loss, size: int):
        ctx.size = size
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.size, None


class CopyToTP(nn.Module):
    """Megatron's ``f``: enters a column-parallel block."""

    def __init__(self, tp: TPGroup, layer: str):
        super().__init__()
        self.tp, self.layer = tp, layer

    def forward(self, x):
        return _CopyToTP.apply(x, self.tp, self.layer)


class ReduceFromTP(CopyToTP):
    """Megatron's ``g``: leaves a row-parallel block."""

    def forward(self, x):
        return _ReduceFromTP.apply(x, self.tp, self.layer)


class GatherFromTP(CopyToTP):
    """The lecture's all-gather of a column-parallel layer's output."""

    def forward(self, x):
        return _GatherFromTP.apply(x, self.tp, self.layer)


class GatherSequence(CopyToTP):
    """Sequence parallelism's entry to a column-parallel block: the whole sequence from every rank's part."""

    def forward(self, x):
        return _GatherSequence.apply(x, self.tp, self.layer)


class ScatterSequence(CopyToTP):
    """Sequence parallelism's exit from a row-parallel block: partial sums in, this rank's sequence part out."""

    def forward(self, x):
        return _ScatterSequence.apply(x, self.tp, self.layer)


class SharedLoss(nn.Module):
    """A loss computed identically on every rank of a group whose gathers sum gradients (the lecture's TP).

    Each gather's backward is a reduce-scatter: it sums the ranks'
    gradients. A loss replicated on every rank would therefore count ``size``
    times; each rank back-propagates its share instead. The value is unchanged.
    """

    def __init__(self, loss, size: int):
        super().__init__()
        self.loss, self.size = loss, size

    def forward(self, x, targets=None):
        return _ShareLoss.apply(self.loss(x, targets), self.size)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, start: int, tp: TPGroup):
        logits = logits.float()
        top = tp.all_reduce(logits.max(-1).values, "head", "fwd", dist.ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)
        local = targets - start
        mine = (local >= 0) & (local < logits.shape[-1])
        index = local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
        target = tp.all_reduce(shifted.gather(-1, index).squeeze(-1) * mine, "head", "fwd")
        exp = shifted.exp()
        total = tp.all_reduce(exp.sum(-1), "head", "fwd")
        ctx.save_for_backward(exp / total.unsqueeze(-1), index, mine)
        return (total.log() - target).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, index, mine = ctx.saved_tensors
        grad_logits = softmax.scatter_add(-1, index, -mine.unsqueeze(-1).to(softmax.dtype))
        return grad_logits * (grad / index.numel()), None, None, None


class VocabParallelCrossEntropy(nn.Module):
    """Cross-entropy over logits split by vocabulary rows ``[start, start + local)`` across the group."""

    def __init__(self, tp: TPGroup, start: int):
        super().__init__()
        self.tp, self.start = tp, start

    def forward(self, logits, targets):
        flat = logits.flatten(0, -2)
        return _VocabParallelCE.apply(flat, targets.flatten(), self.start, self.tp)


# --------------------------------------------------------------------------- expert parallelism
@dataclass
class EPGroup(_LayerGroup):
    """This rank's expert-parallel group: rank ``rank`` holds experts ``[rank*E/size, (rank+1)*E/size)``."""

    dim: ClassVar[str] = "ep"

    def all_to_all(self, x, send: list[int], receive: list[int], layer: str, direction: str, nbytes: int):
        """Send ``send[r]`` rows of ``x`` (in rank order) to rank ``r``; receive ``receive[r]`` rows from each.

        ``nbytes`` is what the event records: the simulator's bytes, this
        rank's own routed rows (what it dispatches, or gets back).
        """
        with self._span("all_to_all", layer, direction, nbytes):
            return self._exchange(x, send, receive)

    def all_to_all_counted(self, x, counts, layer: str, nbytes: int) -> tuple[Any, Any]:
        """The forward dispatch: ``counts[e]`` rows of ``x`` go to expert ``e``'s rank.

        The counts are exchanged first, in a call of their own (Megatron-LM's
        dispatcher gathers them before its token all-to-all too; the
        simulator's ``moe.counts``), so each rank knows what it receives.
        Returns the rows and the counts received, ``[size, experts per rank]``.
        """
        with self._span("all_to_all", layer, "fwd", counts.numel() * counts.element_size()):
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts, group=self.group)
            received = received.view(self.size, -1)
        with self._span("all_to_all", layer, "fwd", nbytes):
            out = self._exchange(x, counts.view(self.size, -1).sum(1).tolist(), received.sum(1).tolist())
        return out, received

    def _exchange(self, x, send: list[int], receive: list[int]):
        out = x.new_empty((sum(receive), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), receive, send, group=self.group)
        return out


def _row_bytes(x) -> int:
    return math.prod(x.shape[1:]) * x.element_size()


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, ep: EPGroup, layer: str):
        ctx.own_bytes = x.shape[0] * _row_bytes(x)  # this rank's routed rows: what the rows' four spans record
        out, received = ep.all_to_all_counted(x, counts, layer, ctx.own_bytes)
        ctx.ep, ctx.layer = ep, layer
        ctx.send, ctx.receive = counts.view(ep.size, -1).sum(1).tolist(), received.sum(1).tolist()
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _):
        return ctx.ep.all_to_all(grad, ctx.receive, ctx.send, ctx.layer, "bwd", ctx.own_bytes), None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, ep: EPGroup, layer: str, send: list[int], receive: list[int]):
        ctx.ep, ctx.layer, ctx.send, ctx.receive = ep, layer, send, receive
        ctx.own_bytes = sum(receive) * _row_bytes(y)
        return ep.all_to_all(y, send, receive, layer, "fwd", ctx.own_bytes)

    @staticmethod
    def backward(ctx, grad):
        out = ctx.ep.all_to_all(grad, ctx.receive, ctx.send, ctx.layer, "bwd", ctx.own_bytes)
        return out, None, None, None, None


def dispatch(x, counts, ep: EPGroup, layer: str) -> tuple[Any, Any]:
    """Send each row of ``x`` (sorted by expert; ``counts[e]`` rows for expert ``e``) to its expert's rank.

    Returns the rows received, ordered by source rank and within a source
    by local expert, and the counts received, ``[ep.size, local experts]``.
    The backward sends the rows' gradients back.
    """
    return _Dispatch.apply(x, counts, ep, layer)


def combine(y, ep: EPGroup, layer: str, send: list[int], receive: list[int]):
    """Send the experts' outputs back: ``send[r]`` rows of ``y`` to rank ``r`` (the rows :func:`dispatch`
    received from it), ``receive[r]`` rows from each (what this rank dispatched to it)."""
    return _Combine.apply(y, ep, layer, send, receive)
