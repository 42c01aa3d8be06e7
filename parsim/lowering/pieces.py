"""The pieces one pass of a layer lowers to, in order: block compute and the collectives between blocks.

:meth:`parsim.lowering.lower.Lowering.layer_pass` builds them once per stage; the lowering
stamps them into ops for every microbatch, and the search's fast tier
(:mod:`parsim.search.costs`) prices the same pieces without a simulation.
Collectives run in line on the compute stream, or beside it on a side stream
("cp": context parallelism's K/V exchange, "tp": an overlapped tensor-parallel
collective, :mod:`parsim.lowering.tp_overlap`) until a join piece waits for them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sim.collectives.deepep import TokenRouting


@dataclass(frozen=True)
class ComputePiece:
    """One block's compute in one pass (see :meth:`Lowering._compute`), or part of it; ``layer`` indexes the
    stage's costs. A join piece (``joins`` names a side stream) has no work: it waits for that stream's
    collectives started since the last join."""

    matmuls: tuple[tuple[int, int, int], ...]
    hbm_bytes: float
    kernels: int
    phase: str
    layer: int
    attention_flops: float = 0.0  # the FlashAttention core's, forward
    attention_grad_flops: float = 0.0  # and backward
    forward_ops: int = 0  # eager ops dispatched (parsim.lowering.eager_ops; the CPU host's fixed costs)
    backward_ops: int = 0
    tp_calls: tuple[int, int] = (0, 0)  # tensor-parallel collective calls the block's pass wraps: forward, backward
    stream_bytes: float = 0.0  # the part of hbm_bytes that only streams memory (gradient accumulation)
    accumulate_elements: float = 0.0  # of that accumulation, read or written unvectorized (Plan.accumulation)
    opens: bool = False  # the first piece of its layer in this pass (FSDP gathers the layer before it)
    closes: bool = False  # the last (FSDP reduce-scatters the layer's gradients after a backward's)
    joins: str = ""  # "cp" or "tp": a join of that side stream
    sm_reserved: int = 0  # SMs a communication kernel beside these matmuls holds (parsim.lowering.tp_overlap)
    # SMs the collective just before it on the tp stream holds while that collective runs (parsim.sim.program's
    # NCCL_CHANNELS: its NCCL kernel's channels); None: beside no such collective (beside_collective_time)
    beside_sms: int | None = None
    high_precision: bool = False  # fp8 plans: these matmuls run in bf16 (the LM head)
    sm_bound: tuple = ()  # (bytes, SmWork...) of kernels the SMs may bound (parsim.sim.compute.ComputeModel.time)
    weights: str = ""  # the block whose weights its matmuls read (a CPU host's cache: Lowering._cache_reads)

    def join(self, stream: str) -> "ComputePiece":
        """A join of ``stream`` in this piece's phase and layer."""
        return ComputePiece((), 0.0, 0, self.phase, self.layer, joins=stream)


@dataclass(frozen=True)
class CommPiece:
    """A collective inside a pass; its name is ``name_head + mb + name_tail``.

    ``group`` "tp" (tensor-parallel) and "ep" (an expert all-to-all) run on the
    compute stream between blocks unless ``beside``; "cp" (context parallelism's
    K/V exchange) always runs beside. A collective beside the compute runs on its
    group's stream from the moment the op before it ends, and the next join of
    that stream waits for it.
    """

    name_head: str
    name_tail: str
    collective: str
    ranks: tuple[int, ...]
    mirrors: tuple[tuple[int, ...], ...]
    nbytes: float
    group: str = "tp"
    layer: int = -1
    opens: bool = False
    closes: bool = False
    beside: bool = False
    method: str = ""  # how it overlaps the GEMMs (parsim.lowering.tp_overlap: "ring exchange", "pipelined", "bulk")
    routing: TokenRouting | None = None  # an expert all-to-all DeepEP runs (parsim.sim.collectives.deepep)
    # a dispatch's exchange of token counts: on the compute stream, where the pass waits for its answer, even in
    # a pair whose all-to-alls run beside the compute (Lowering._paired)
    counts: bool = False

    @property
    def stream(self) -> str:
        """The stream it runs on: "compute", or its group's side stream."""
        return self.group if self.beside else "compute"


Piece = ComputePiece | CommPiece
