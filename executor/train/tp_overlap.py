"""Tensor-parallel collectives overlapped with the GEMMs they feed and drain (``tp_comm_overlap``), and
Megatron-LM's asynchronous column-parallel backward without it (``tp_async_backward``).

The executor's counterpart of :mod:`parsim.lowering.tp_overlap`, which models
Transformer Engine's userbuffers methods as NeMo configures them. Under
sequence parallelism a block's entry all-gathers the sequence before its
column-parallel GEMMs and its exit reduce-scatters the row-parallel GEMM's
partial output; here both move beside the GEMMs, with asynchronous
``torch.distributed`` operations (gloo or NCCL) instead of userbuffers:

* **entry, forward** (ring exchange): ``tp`` steps; at each, this rank
  multiplies the sequence chunk it holds by every column weight while the
  chunk travels one rank on around the ring.
* **exit, forward** (pipelined): the GEMM in :data:`PIPELINE_SPLITS` row
  chunks, each chunk's reduce-scatter issued as soon as it is computed; the
  first ones run beside the later GEMM chunks, the last one in line.
* **exit, backward** (ring exchange): the output gradient's chunks travel the
  ring while the input-gradient GEMM runs on each.
* **entry, backward** (bulk): the input gathered again beside the
  input-gradient GEMM (the forward keeps only this rank's part), then the
  input gradient's reduce-scatter beside the weight-gradient GEMMs.

Without ``tp_comm_overlap``, :class:`ColumnEntry` runs a block's column-parallel
GEMMs as Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``
does: under sequence parallelism the forward keeps only this rank's part of
the sequence, so the backward gathers it again (asynchronously) beside the
input-gradient GEMM; then the input gradient's reduce-scatter (an all-reduce
without sequence parallelism) runs beside the weight-gradient GEMMs. With
``tp_async_backward: false`` the same collectives run in line.

Each is recorded under the name the simulator gives the collective it
replaces (``all_gather tp layer=... dir=fwd0``); the pipelined scatter as two
events of that name, the part overlapped and the part in line, as the
lowering splits it. The results equal the plain collectives' to rounding.
"""

from __future__ import annotations

from typing import Any

from parsim.lowering.tp_overlap import PIPELINE_SPLITS

from .._torch import require_distributed, require_torch
from .comm import SEQUENCE_DIM, TOKEN_DIM, TPGroup, _all_gather, _reduce_scatter

torch = require_torch()
dist = require_distributed()


def _wait(tp: TPGroup, works: list) -> None:
    """Wait for collectives beside the compute; the time the compute stream stood still is a gap."""
    if works:
        start = tp.recorder.now()
        for work in works:
            work.wait()
        tp.recorder.waited(start, tp.recorder.now())


def _ring(tp: TPGroup, local: Any, multiply, name: str) -> tuple[Any, list]:
    """Pass ``local`` (batch, seq/tp, ...) around the ring: ``multiply(chunk)`` on every rank's chunk as it
    arrives, while the next one travels. Returns the gathered input (sequence in rank order) and each
    chunk's product, in rank order; the exchange is recorded as one event ``name``."""
    size, rank = tp.size, tp.rank
    chunks, products = [None] * size, [None] * size
    chunk, start = local.contiguous(), tp.recorder.now()
    for step in range(size):
        source = (rank - step) % size
        chunks[source] = chunk
        pending = []
        if step < size - 1:
            incoming = torch.empty_like(chunk)
            # One batch, so NCCL does not serialize the send before the receive its peer waits on.
            pending = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, chunk, group=tp.group, group_peer=(rank + 1) % size),
                dist.P2POp(dist.irecv, incoming, group=tp.group, group_peer=(rank - 1) % size)])
        products[source] = multiply(chunk)
        _wait(tp, pending)
        if step < size - 1:
            chunk = incoming
    gathered = torch.cat(chunks, SEQUENCE_DIM)
    tp.recorder.add(name, "collective", "tp", start, tp.recorder.now(), phase="tp",
                    bytes=gathered.numel() * gathered.element_size())
    return gathered, products


class _EntryLinears(torch.autograd.Function):
    """All-gather the sequence into several column-parallel GEMMs (ring exchange); backward: the input
    gathered again beside their input gradient, which is reduce-scattered beside the weight gradients (bulk)."""

    @staticmethod
    def forward(ctx, x, tp: TPGroup, layer: str, *weights):
        ctx.tp, ctx.layer = tp, layer
        cat = torch.cat(weights, 0)
        name = tp.event_name("all_gather", layer, "fwd")
        _, products = _ring(tp, x, lambda chunk: chunk @ cat.t(), name)
        ctx.save_for_backward(x, *weights)  # this rank's part of the sequence: the backward gathers it again
        out = torch.cat(products, SEQUENCE_DIM)
        return tuple(out.split([w.shape[0] for w in weights], -1))

    @staticmethod
    def backward(ctx, *grads):
        tp = ctx.tp
        x, *weights = ctx.saved_tensors
        regather = _start_gather(tp, x, ctx.layer)  # beside the input-gradient GEMM (qkv_dgrad / fc1_dgrad)
        grad = torch.cat(grads, -1)
        grad_input = grad @ torch.cat(weights, 0)
        gathered = _finish(tp, *regather)
        reduction = _start_reduction(tp, grad_input, ctx.layer, True)
        flat_grad, flat_in = grad.flatten(0, -2), gathered.flatten(0, -2)
        weight_grads = [g.t() @ flat_in for g in flat_grad.split([w.shape[0] for w in weights], -1)]
        return (_finish(tp, *reduction), None, None, *weight_grads)


class _ExitLinear(torch.autograd.Function):
    """A row-parallel GEMM whose partial output is reduce-scattered over the sequence in pipelined chunks;
    backward: the output gradient all-gathered into the input-gradient GEMM (ring exchange)."""

    @staticmethod
    def forward(ctx, h, weight, tp: TPGroup, layer: str):
        ctx.tp, ctx.layer = tp, layer
        ctx.save_for_backward(h, weight)
        name = tp.event_name("reduce_scatter", layer, "fwd")
        # Split each rank's share of the sequence into PIPELINE_SPLITS parts; chunk j takes part j of every
        # share, so its reduce-scatter leaves this rank part j of its own share, in order.
        shares = h.unflatten(SEQUENCE_DIM, (tp.size, PIPELINE_SPLITS, -1))
        parts, works, start = [], [], tp.recorder.now()
        for j in range(PIPELINE_SPLITS):
            partial = (shares.select(SEQUENCE_DIM + 1, j) @ weight.t()).movedim(SEQUENCE_DIM, 0).contiguous()
            part = torch.empty(partial.shape[1:], dtype=partial.dtype, device=partial.device)
            if j == PIPELINE_SPLITS - 1:  # the side stream's share done, the last part in line
                _wait(tp, works)
                joined = tp.recorder.now()
                tp.recorder.add(name, "collective", "tp", start, joined, phase="tp",
                                bytes=partial.numel() * partial.element_size() * (PIPELINE_SPLITS - 1))
                _reduce_scatter(part, partial.flatten(0, 1), group=tp.group)
                tp.recorder.add(name, "collective", "compute", joined, tp.recorder.now(), phase="tp",
                                bytes=partial.numel() * partial.element_size())
            else:
                works.append(_reduce_scatter(part, partial.flatten(0, 1), group=tp.group, async_op=True))
            parts.append(part)
        return torch.stack(parts, SEQUENCE_DIM).flatten(SEQUENCE_DIM, SEQUENCE_DIM + 1)

    @staticmethod
    def backward(ctx, grad):
        tp = ctx.tp
        h, weight = ctx.saved_tensors
        name = tp.event_name("all_gather", ctx.layer, "bwd")
        gathered, products = _ring(tp, grad, lambda chunk: chunk @ weight, name)
        grad_input = torch.cat(products, SEQUENCE_DIM)
        grad_weight = gathered.flatten(0, -2).t() @ h.flatten(0, -2)
        return grad_input, grad_weight, None, None


class TPOverlap:
    """One block's entry and exit collectives, overlapped with its GEMMs (``block.overlap``)."""

    def __init__(self, tp: TPGroup, layer: str):
        self.tp, self.layer = tp, layer

    def entry(self, x, linears) -> tuple:
        """Every column-parallel linear of the block applied to the gathered sequence."""
        return _EntryLinears.apply(x, self.tp, self.layer, *(linear.weight for linear in linears))

    def exit(self, h, linear) -> Any:
        """The row-parallel linear, its output reduce-scattered over the sequence."""
        return _ExitLinear.apply(h, linear.weight, self.tp, self.layer)


class _ColumnLinears(torch.autograd.Function):
    """Column-parallel GEMMs with Megatron-LM's backward (the module docstring): under sequence parallelism
    the input gathered again, then the input gradient reduced; beside the GEMMs, or in line when not
    ``overlap`` (``tp_async_backward: false``)."""

    @staticmethod
    def forward(ctx, x, tp: TPGroup, layer: str, sequence_parallel: bool, overlap: bool, *weights):
        ctx.tp, ctx.layer, ctx.sequence_parallel, ctx.overlap = tp, layer, sequence_parallel, overlap
        ctx.save_for_backward(x, *weights)  # this rank's part of the sequence only
        full = tp.all_gather(x, TOKEN_DIM, layer, "fwd") if sequence_parallel else x
        return tuple(full @ w.t() for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        tp, layer, sp = ctx.tp, ctx.layer, ctx.sequence_parallel
        x, *weights = ctx.saved_tensors  # an unused output's gradient comes as zeros (materialize_grads)
        if not ctx.overlap:
            full = tp.all_gather(x, TOKEN_DIM, layer, "bwd") if sp else x
            grad_input = sum(g @ w for g, w in zip(grads, weights))
            out = tp.reduce_scatter(grad_input, TOKEN_DIM, layer, "bwd") if sp else \
                tp.all_reduce(grad_input.contiguous(), layer, "bwd")
            return (out, None, None, None, None, *_weight_grads(grads, full))
        regather = _start_gather(tp, x, layer) if sp else None
        grad_input = sum(g @ w for g, w in zip(grads, weights))
        full = _finish(tp, *regather) if regather else x
        reduction = _start_reduction(tp, grad_input, layer, sp)
        weight_grads = _weight_grads(grads, full)
        return (_finish(tp, *reduction), None, None, None, None, *weight_grads)


def _weight_grads(grads, full) -> list:
    """Each column-parallel weight's gradient: its output gradient against the (gathered) input."""
    flat_in = full.flatten(0, -2)
    return [g.flatten(0, -2).t() @ flat_in for g in grads]


def _start_gather(tp: TPGroup, x, layer: str) -> tuple:
    """Issue the backward's all-gather of ``x`` along the tokens; :func:`_finish` waits for it and returns the
    tokens in rank order."""
    out = torch.empty((tp.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    name, start = tp.event_name("all_gather", layer, "bwd"), tp.recorder.now()
    dim = TOKEN_DIM % x.dim()

    def result():
        return out.unflatten(0, (tp.size, -1)).movedim(0, dim).flatten(dim, dim + 1)

    return _all_gather(out, x.contiguous(), group=tp.group, async_op=True), name, start, out.numel(), result


def _start_reduction(tp: TPGroup, grad_input, layer: str, sequence_parallel: bool) -> tuple:
    """Issue the input gradient's sum over the group: a reduce-scatter over the tokens (sequence parallel) or
    an all-reduce; :func:`_finish` waits for it and returns this rank's part."""
    start = tp.recorder.now()
    if not sequence_parallel:
        out = grad_input.contiguous()
        name = tp.event_name("all_reduce", layer, "bwd")
        return dist.all_reduce(out, group=tp.group, async_op=True), name, start, out.numel(), lambda: out
    dim = TOKEN_DIM % grad_input.dim()
    chunks = grad_input.unflatten(dim, (tp.size, -1)).movedim(dim, 0).contiguous()
    out = torch.empty(chunks.shape[1:], dtype=grad_input.dtype, device=grad_input.device)
    name = tp.event_name("reduce_scatter", layer, "bwd")
    work = _reduce_scatter(out, chunks.flatten(0, 1), group=tp.group, async_op=True)
    return work, name, start, chunks.numel(), lambda: out


def _finish(tp: TPGroup, work, name: str, start: float, numel: int, result):
    """Wait for a collective beside the GEMMs, record it (its whole tensor's bytes), and return its result."""
    _wait(tp, [work])
    out = result()
    tp.recorder.add(name, "collective", "tp", start, tp.recorder.now(), phase="tp",
                    bytes=numel * out.element_size())
    return out


class ColumnEntry:
    """One block's column-parallel entry as Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``
    runs it (``block.overlap``): under sequence parallelism the forward keeps only this rank's part of the
    input; the backward's collectives run beside the GEMMs (``asynchronous``) or in line. Its exit is the plain
    row-parallel collective ``exit_``."""

    def __init__(self, tp: TPGroup, layer: str, sequence_parallel: bool, asynchronous: bool, exit_: Any = None):
        self.tp, self.layer, self.sequence_parallel, self.exit_ = tp, layer, sequence_parallel, exit_
        self.asynchronous = asynchronous

    def entry(self, x, linears) -> tuple:
        """Every column-parallel linear of the block applied to its (gathered) input."""
        return _ColumnLinears.apply(x, self.tp, self.layer, self.sequence_parallel, self.asynchronous,
                                    *(linear.weight for linear in linears))

    def exit(self, h, linear) -> Any:
        """The row-parallel linear and its collective, as without the overlap."""
        return self.exit_(linear(h))
