"""Per-rank programs: the ordered operations a plan lowers to.

A :class:`Program` holds, for every simulated rank, a list of :class:`Op` s in
issue order. Each op runs on one stream of its rank (``compute``, ``comm`` for
collectives, ``p2p`` for pipeline sends); ops on one stream run one after
another, ops on different streams overlap, and ``deps`` name ops (on any rank)
that must finish first. A receive finishes when its matching send has
arrived. The simulator times a program; the executor's measured trace uses the
same op names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .collectives.deepep import TokenRouting


NCCL_CHANNELS = -1  # Op.beside_sms: the collective beside it is NCCL's kernel, holding one SM per channel


@dataclass(slots=True)
class Op:
    """One operation of one rank. Ids are assigned by :meth:`Program.add`."""

    name: str
    kind: str  # "compute" | "collective" | "send" | "recv" | "optimizer"
    stream: str  # "compute" | "comm" | "p2p"
    deps: tuple[int, ...] = ()
    # compute: matmuls as (m, n, k), plus other FLOPs and HBM bytes (elementwise work, optimizer)
    matmuls: tuple[tuple[int, int, int], ...] = ()
    flops: float = 0.0
    hbm_bytes: float = 0.0
    kernels: int = 0  # kernels launched (each pays the compute model's fixed overhead)
    attention_flops: float = 0.0  # the fused attention core's FLOPs as executed: forward
    attention_grad_flops: float = 0.0  # and backward
    # eager CPU host costs (parsim.sim.compute): ops dispatched in a forward / run by autograd in a backward,
    # and parameter tensors an optimizer step updates, in how many foreach AdamW steps
    forward_ops: int = 0
    backward_ops: int = 0
    tp_calls: tuple[int, int] = (0, 0)  # tensor-parallel collective calls the pass wraps: forward, backward
    optimizer_tensors: int = 0
    optimizer_steps: int = 0
    fsdp_calls: tuple[int, int, int] = (0, 0, 0)  # FSDP2's host work: units unsharded, reduced, DTensors stepped
    fsdp_passes: tuple[int, int] = (0, 0)  # and units a forward, a backward passes through, moving nothing
    pass_starts: tuple[int, int] = (0, 0)  # forward, backward passes of a schedule's action this op begins
    stream_bytes: float = 0.0  # the part of hbm_bytes that only streams memory (gradient accumulation, AdamW)
    sm_reserved: int = 0  # SMs a communication kernel beside these matmuls holds (parsim.lowering.tp_overlap)
    # compute beside collective ``beside_of`` (an op id), whose kernel holds ``beside_sms`` SMs while it runs
    # (NCCL_CHANNELS: its NCCL channels): ComputeModel.beside_collective_time
    beside_of: int = -1
    beside_sms: int = 0
    high_precision: bool = False  # fp8 plans: these matmuls run in bf16 (the LM head)
    sm_bound: tuple = ()  # (bytes, SmWork...) of kernels the SMs may bound (their bytes in hbm_bytes too)
    adamw_params: float = 0.0  # parameters a fused AdamW kernel steps: SM cycles beside its bytes (sm_cycles.adamw)
    # elements the weight gradients' accumulation (stream_bytes) reads or writes unvectorized (Plan.accumulation)
    accumulate_elements: float = 0.0
    # a CPU host: the bytes the rank touched since it last read these matmuls' weights (their share still in its
    # cache: ComputeModel.cache_hit; parsim.lowering.lower.Lowering._cache_reads); inf: not followed
    weights_reuse_bytes: float = math.inf
    # communication
    collective: str = ""  # all_reduce, all_gather, reduce_scatter, ...
    group: str = ""  # "tp" | "dp" | "pp"
    ranks: tuple[int, ...] = ()  # GPUs of the group (collective) or (src, dst) GPUs (send)
    mirrors: tuple[tuple[int, ...], ...] = ()  # symmetric copies run at the same time by unsimulated ranks
    nbytes: float = 0.0
    routing: TokenRouting | None = None  # an expert all-to-all DeepEP runs (parsim.sim.collectives.deepep)
    peer: int = -1  # send: destination rank; recv: source rank
    match: int = -1  # recv: id of the matching send
    # a collective whose group spans simulated ranks: the same collective's ops on the others. Each starts when
    # its rank is ready for it; the collective runs once all have, and ends for all of them together.
    joins: tuple[int, ...] = ()
    negligible: bool = False  # so few bytes that it takes no link's bandwidth from others: timed alone
    phase: str = ""  # report category: forward, backward, weight-grad, optimizer, tp, dp, pp
    opens_action: bool = False  # the first op of one of the training loop's actions (a pass, a sync call, ...)
    id: int = -1
    rank: int = -1


@dataclass
class Program:
    """Ops of every simulated rank; ``replicas[r]``: the real ranks rank ``r`` stands for (itself included),
    which run its program at the same time."""

    world_size: int
    ops: list[Op] = field(default_factory=list)
    by_rank: dict[int, list[int]] = field(default_factory=dict)
    replicas: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # rank -> (gradient tensors, their bytes) its step frees as it starts (zero_grad)
    gradients: dict[int, tuple[int, float]] = field(default_factory=dict)

    @property
    def represents(self) -> dict[int, int]:
        """How many real ranks each simulated rank stands for."""
        return {rank: len(ranks) for rank, ranks in self.replicas.items()}

    def add(self, rank: int, op: Op) -> int:
        op.id, op.rank = len(self.ops), rank
        self.ops.append(op)
        self.by_rank.setdefault(rank, []).append(op.id)
        return op.id

    def rank_ops(self, rank: int) -> list[Op]:
        return [self.ops[i] for i in self.by_rank.get(rank, [])]

    @property
    def ranks(self) -> list[int]:
        return sorted(self.by_rank)
