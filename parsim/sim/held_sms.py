"""SMs that the NCCL kernels of data-parallel and FSDP collectives hold while compute runs beside them.

A GPU runs an NCCL collective as one kernel of one thread block per channel
(``src/device/common.h``: ``ncclKernelMain`` runs ``channelId = blockIdx.x``),
launched on a stream of its own; each block stays resident on its SM until the
collective ends. A kernel launched beside it gets the SMs that are left, so a
data-parallel reduce-scatter or an FSDP all-gather running under a backward
slows that backward's GEMMs, attention and SM-bound kernels for as long as it
runs (:meth:`ComputeModel.time <parsim.sim.compute.ComputeModel.time>`'s
``sm_reserved``). This is the cost the
tensor-parallel overlap already pays (:meth:`ComputeModel.beside_collective_time
<parsim.sim.compute.ComputeModel.beside_collective_time>`); :class:`HeldSMs`
charges it to whatever compute runs while the side streams' collectives do.
"""

from __future__ import annotations

from typing import Callable

# The side streams whose collectives are NCCL kernels beside the compute (parsim.lowering.lower): data-parallel
# gradient buckets and ZeRO's weight gathers ("comm"), FSDP's all-gathers ("gather"), the expert all-to-alls of a
# pass paired with another (``ep_comm_overlap``: "ep"; DeepEP's kernels hold 20 SMs of 132,
# parsim.sim.collectives.deepep). Tensor-parallel collectives
# beside compute are costed with their partner op (Op.beside_sms); a pipeline's sends and context parallelism's
# ring (Transformer Engine passes K/V with point-to-point sends, not a collective kernel) are left out.
HOLDING_STREAMS = ("comm", "gather", "ep")


class HeldSMs:
    """Per rank, the collectives under way whose kernels hold SMs (op id -> SMs), and what compute takes
    beside them. The SMs are held until the collective ends, which the network alone knows (it may contend):
    the engine times compute as if they were held for good, and again whenever a collective starts or ends,
    so between two such moments every op's speed is one and its progress is a straight line."""

    def __init__(self, slowdown: Callable[[int, int], float]):
        """``slowdown(op, sms)``: how many times as long compute op ``op`` takes with ``sms`` SMs held."""
        self.slowdown = slowdown
        self.held: dict[int, dict[int, int]] = {}

    def hold(self, rank: int, op: int, sms: int) -> None:
        self.held.setdefault(rank, {})[op] = sms

    def release(self, rank: int, op: int) -> None:
        del self.held[rank][op]

    def holding(self, rank: int) -> bool:
        """Whether any of the rank's collectives holds SMs now."""
        return bool(self.held.get(rank))

    def seconds(self, rank: int, op: int, work_s: float) -> float:
        """Seconds compute op ``op`` takes for ``work_s`` of its work on every SM, beside the rank's collectives
        under way."""
        sms = sum(self.held.get(rank, {}).values())
        return work_s * self.slowdown(op, sms) if sms and work_s > 0 else work_s
