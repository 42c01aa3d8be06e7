"""Tensor-parallel communication overlap: Megatron-LM's ``--tp-comm-overlap``.

With sequence parallelism every transformer block all-gathers its input
before its first GEMMs and reduce-scatters its output after its last, and the
backward mirrors both. Megatron-LM's ``--tp-comm-overlap`` has Transformer
Engine hide each of them behind the GEMM it feeds or drains ("userbuffers",
``transformer_engine/pytorch/module/base.py`` ``initialize_ub``). NeMo's
recipes name the method per GEMM (``nemo/collections/llm/recipes/
tp_overlap_configs/userbuffers.py``, ``userbuffers_bf16_h100_h8192_tp4_mbs1_
seqlen8192``, the Llama 3 70B H100 setting), and parsim models those three:

* **ring exchange** (``qkv_fprop``, ``fc1_fprop``, ``proj_dgrad``,
  ``fc2_dgrad``): the GEMM runs in ``tp`` chunks of rows. While a rank
  multiplies the chunk it holds, it passes that chunk to the next rank
  (peer-to-peer copies, no SMs taken). ``tp - 1`` chunks hide the
  all-gather; the last waits for it: ``max(G (tp-1)/tp, C) + G/tp``, ``G`` the
  GEMM's time and ``C`` the collective's.
* **pipeline** (``proj_fprop``, ``fc2_fprop``): the GEMM runs in 4 splits and
  each split's rows are reduce-scattered while the next computes, by a kernel
  holding 24 (attention) or 16 (MLP) SMs that the GEMM does without
  (``set_sm_margin``): ``G'/4 + max(3G'/4, 3C/4) + C/4``, ``G'`` the GEMM on
  the remaining SMs.
* **bulk** (``qkv_dgrad``, ``fc1_dgrad``; ``qkv_wgrad``, ``fc1_wgrad``): the
  block input gathered again (the forward keeps only this rank's part of the
  sequence) beside the input-gradient GEMM, its kernel holding 4 (attention)
  or 2 (MLP) SMs; then the input gradient's reduce-scatter beside the
  weight-gradient GEMM, holding 24 or 4. The kernel leaves its SMs when the
  collective ends (``set_sm_margin`` off), so the GEMM runs on the others
  while it runs and on all of them after:
  :meth:`~parsim.sim.compute.ComputeModel.beside_collective_time`.

The GEMMs that read one input run fused, as Transformer Engine's ``linear_qkv`` and
``linear_fc1`` do. The communication buffers are not counted in memory.
A split-backward schedule's input-gradient pass has no weight-gradient GEMM to
hide the reduce-scatter behind, so there it stays in line; its weight-gradient
pass keeps the input the input-gradient pass gathered.

Without ``--tp-comm-overlap``, :func:`async_backward` is Megatron-LM's own
asynchronous backward of the same linears, with NCCL kernels in place of
userbuffers (``tp_async_backward``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from ..sim.program import NCCL_CHANNELS
from .pieces import CommPiece, ComputePiece, Piece

PIPELINE_SPLITS = 4  # num_splits of the pipelined reduce-scatters
# SMs the communication kernel holds, by block: the attention's and the MLP's GEMMs
PIPELINE_SMS = {"attention": 24, "mlp": 16}  # proj_fprop, fc2_fprop
BULK_SMS = {"attention": 24, "mlp": 4}  # qkv_wgrad, fc1_wgrad
DGRAD_BULK_SMS = {"attention": 4, "mlp": 2}  # qkv_dgrad, fc1_dgrad: the input gathered again
ASYNC_BLOCKS = ("attention", "mlp", "head")  # blocks entered by Megatron-LM's column-parallel linears


class Partners(NamedTuple):
    """A block's compute split around its overlapped collectives: ``lead`` (the GEMMs the collective
    before the block feeds), ``body`` (the rest) and ``trail`` (the GEMMs the collective after drains)."""

    lead: ComputePiece | None
    body: ComputePiece
    trail: ComputePiece | None
    dgrad: ComputePiece | None = None  # the column-parallel input gradients, when the input is gathered again


def split_partners(compute: ComputePiece, sources: tuple[tuple[str, str], ...], forward: bool,
                   backward_weights: bool, regather: bool = False) -> Partners:
    """Split ``compute`` by its matmuls' ``(weight split, role)`` (:attr:`~parsim.lowering.kernels.BlockWork.sources`).

    Forward: the all-gathered input feeds every matmul that reads it (column and replicated weights) and
    the row-parallel matmuls' output is reduce-scattered. Backward: the all-gathered output gradient feeds
    the row-parallel input gradients; the column input gradients' sum is reduce-scattered beside the
    weight gradients of the matmuls that read the block's input (when this pass computes them), and with
    ``regather`` the input gathered again beside the column input gradients (``dgrad``)."""
    if forward:
        lead_of = {(s, "fwd") for s in ("column", "none")}
        trail_of = {("row", "fwd")}
    else:
        lead_of = {("row", "dgrad")}
        trail_of = {(s, "wgrad") for s in ("column", "none")} if backward_weights else set()
    dgrad_of = {("column", "dgrad")} if regather and not forward else set()
    (lead, trail, dgrad), rest = split_roles(compute, sources, lead_of, trail_of, dgrad_of)

    def fused(part: ComputePiece | None) -> ComputePiece | None:
        if part is None:
            return None
        shapes = _fused(list(part.matmuls))
        return dataclasses.replace(part, matmuls=shapes, kernels=len(shapes))

    return Partners(fused(lead), rest, fused(trail), fused(dgrad))


def split_roles(compute: ComputePiece, sources: tuple[tuple[str, str], ...], *roles: set[tuple[str, str]]
                ) -> tuple[list[ComputePiece | None], ComputePiece]:
    """The matmuls of ``compute`` whose ``(weight split, role)`` source is in each set of ``roles``, one piece
    per set (None: none), and the rest: every other matmul with all of the piece's memory-bound work."""
    parts: list[list[tuple[int, int, int]]] = [[] for _ in roles]
    rest = []
    for shape, source in zip(compute.matmuls, sources):
        index = next((i for i, wanted in enumerate(roles) if source in wanted), None)
        (rest if index is None else parts[index]).append(shape)
    moved = sum(len(part) for part in parts)
    pieces = [ComputePiece(tuple(part), 0.0, len(part), compute.phase, compute.layer,
                           high_precision=compute.high_precision, weights=compute.weights) if part else None
              for part in parts]
    return pieces, dataclasses.replace(compute, matmuls=tuple(rest), kernels=compute.kernels - moved)


def _fused(shapes: list[tuple[int, int, int]]) -> tuple[tuple[int, int, int], ...]:
    """Matmuls of one input fused into one GEMM, as Transformer Engine runs them (``linear_qkv``,
    ``linear_fc1``'s gate and up): shapes ``(a, b, c)`` with the same ``a`` and ``c`` add their ``b``
    (forward ``(rows, n, k)``; weight gradient ``(k, n, rows)``)."""
    widths: dict[tuple[int, int], int] = {}
    for a, b, c in shapes:
        widths[a, c] = widths.get((a, c), 0) + b
    return tuple((a, b, c) for (a, c), b in widths.items())


def chunks(piece: ComputePiece, count: int, of: int, sm_reserved: int = 0) -> ComputePiece:
    """``count`` of ``of`` row chunks of every matmul of ``piece`` (Transformer Engine splits the
    GEMM along its token rows), on the SMs a communication kernel leaves."""
    shapes = tuple((-(-m // of), n, k) for m, n, k in piece.matmuls for _ in range(count))
    return dataclasses.replace(piece, matmuls=shapes, kernels=len(shapes), sm_reserved=sm_reserved)


def ring_exchange(gather: CommPiece, lead: ComputePiece, tp: int) -> list[Piece]:
    """An all-gather hidden behind the GEMMs it feeds, ``tp`` chunks, the last after the gather."""
    return [dataclasses.replace(gather, beside=True, method="ring exchange"), chunks(lead, tp - 1, tp),
            lead.join("tp"), chunks(lead, 1, tp)]


def pipelined(scatter: CommPiece, trail: ComputePiece, block: str) -> list[Piece]:
    """A reduce-scatter of the GEMMs' output, split by split as the next split computes."""
    n, sms = PIPELINE_SPLITS, PIPELINE_SMS[block]
    hidden = dataclasses.replace(scatter, nbytes=scatter.nbytes * (n - 1) / n, beside=True, method="pipelined")
    last = dataclasses.replace(scatter, nbytes=scatter.nbytes / n, method="pipelined")
    return [chunks(trail, 1, n, sms), hidden, chunks(trail, n - 1, n, sms), trail.join("tp"), last]


def bulk(collective: CommPiece, partner: ComputePiece, block: str, sms: dict[str, int] = BULK_SMS) -> list[Piece]:
    """A collective beside GEMMs on the SMs its kernel leaves: the input gradient's reduce-scatter beside the
    weight gradients (``sms`` BULK_SMS), or the input's all-gather beside the input gradients (DGRAD_BULK_SMS)."""
    return [dataclasses.replace(collective, beside=True, method="bulk"),
            dataclasses.replace(partner, beside_sms=sms[block]), partner.join("tp")]


def async_backward_applies(block: str, collectives: list) -> bool:
    """Whether a block's backward collectives are those of the column-parallel linears that read its input
    (Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``): its input gradient's all-reduce or
    reduce-scatter after the block, maybe its input gathered again, maybe the output gradient gathered
    before. Latent attention's several up-projections run in line, as do MoE layers, whose token
    dispatcher gathers and scatters the rows itself."""
    positions = [c.position for c in collectives]
    return (block in ASYNC_BLOCKS and positions.count("after") == 1 and positions.count("before") <= 1
            and positions.count("dgrad") <= 1)


def split_column_grads(compute: ComputePiece, sources: tuple[tuple[str, str], ...]
                       ) -> tuple[ComputePiece, tuple[ComputePiece | None, ComputePiece | None]]:
    """``compute`` (a backward) without the input and weight gradients of the matmuls that read the block's
    input, and those two parts: the column-parallel input gradients, and the weight gradients."""
    (dgrad, wgrad), rest = split_roles(compute, sources, {("column", "dgrad")},
                                       {(s, "wgrad") for s in ("column", "none")})
    return rest, (dgrad, wgrad)


def then(first: ComputePiece, second: ComputePiece) -> ComputePiece:
    """``first`` with ``second``'s matmuls after its own, as one piece (``second``: a split part's matmuls)."""
    return dataclasses.replace(first, matmuls=first.matmuls + second.matmuls, kernels=first.kernels + second.kernels)


def async_backward(regather: list[CommPiece], reduce: CommPiece, dgrad: ComputePiece | None,
                   wgrad: ComputePiece | None) -> list[Piece]:
    """A column-parallel linear's backward as Megatron-LM runs it without ``--tp-comm-overlap``
    (``LinearWithGradAccumulationAndAsyncCommunication.backward``): the input gathered again (sequence
    parallelism) by an asynchronous NCCL call beside the input-gradient GEMM, then the input gradient's
    all-reduce or reduce-scatter beside the weight-gradient GEMM, each NCCL kernel holding one SM per
    channel while it runs (as the data-parallel and FSDP collectives' kernels do beside whatever compute
    runs: :mod:`parsim.sim.held_sms`)."""
    pieces: list[Piece] = []
    for collective, partner in ((regather[0] if regather else None, dgrad), (reduce, wgrad)):
        if partner is None:
            pieces += [collective] if collective else []
        elif collective is None:
            pieces.append(partner)
        else:
            pieces += [dataclasses.replace(collective, beside=True, method="async"),
                       dataclasses.replace(partner, beside_sms=NCCL_CHANNELS), partner.join("tp")]
    return pieces
