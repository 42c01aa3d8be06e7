"""Predict one training step of a plan on a cluster: lower, simulate, summarise."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from ..errors import ParsimError
from ..hardware.cluster import ClusterSpec
from ..lowering.lower import lower
from ..lowering.unfold import unfold
from ..report.step_report import RankBreakdown, breakdown, step_time
from ..report.trace import Trace
from ..workload.memory import Memory, memory
from ..workload.plan import Plan
from .compute import ComputeModel
from .jitter import end_wait_s
from .stepsim import StepSimulator

# Forward and backward passes of one layer over one microbatch that one step may hold: about four ops
# each to simulate, so this bound is some 2 million ops, a quarter of a minute (real steps: < 200,000).
MAX_LAYER_PASSES = 2**19
# Ranks that time-share a CPU host's cores take turns on them, each simulated in its own right (parsim.sim.cores)
# up to this many ranks; more share each core evenly (a stretch of every rank's work).
MAX_RANKS_IN_TURNS = 256


def rank_standing_for(plan: Plan, simulated: set[int], rank: int) -> int:
    """The simulated rank whose prediction is ``rank``'s: itself where it was simulated (every rank, where ranks
    take turns on shared cores), else the representative (the lowest simulated rank) of its pipeline rank."""
    if rank in simulated:
        return rank
    pp = plan.coords(rank).pp
    return min(r for r in simulated if plan.coords(r).pp == pp)


@dataclass
class StepPrediction:
    plan: Plan
    cluster: ClusterSpec
    trace: Trace  # representative ranks only (one per pipeline rank), or every rank where ranks take turns
    step_s: float
    ranks: list[RankBreakdown]
    memory: list[Memory]
    takes_turns: bool = False  # more ranks than the host's cores: each simulated, taking turns on its core
    # how much later the step ends, on average, for the ranks' jitter (parsim.sim.jitter): in step_s and in every
    # rank's idle, beyond the trace's last event
    end_wait_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.plan.tokens_per_step / self.step_s

    @property
    def model_flops(self) -> float:
        return float(self.plan.model.model_flops_per_token()) * self.plan.tokens_per_step

    @property
    def hardware_flops(self) -> float:
        """FLOPs the GPUs execute per step: the model's plus the forwards recomputed for the backward."""
        plan = self.plan
        recomputed = sum(c.forward_flops_per_token() for s in range(plan.num_stages) for c in plan.recomputed(s))
        return self.model_flops + float(recomputed) * plan.tokens_per_step

    @property
    def mfu(self) -> float:
        """Model FLOPs per second over the peak of every GPU in the plan."""
        return self.model_flops / self._peak_flops_per_step

    @property
    def hfu(self) -> float:
        """Hardware FLOPs (recomputation included) per second over the peak: MFU's counterpart
        (Korthikanti et al. 2022, section 6.3)."""
        return self.hardware_flops / self._peak_flops_per_step

    @property
    def _peak_flops_per_step(self) -> float:
        return self.step_s * self.plan.world * self.cluster.gpu.peak_flops[self.plan.dtype]

    @property
    def held_sms_s(self) -> dict[int, float]:
        """Per simulated rank, how much longer its compute ran on the SMs that data-parallel and FSDP collectives'
        NCCL kernels left than it would alone (:mod:`parsim.sim.held_sms`); empty where none hold any."""
        return {int(rank): seconds for rank, seconds in self.trace.meta.get("held_sms_s", {}).items()}

    @property
    def over_memory(self) -> list[Memory]:
        return [m for m in self.memory if m.total > self.cluster.gpu.hbm_capacity_bytes]


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Hold Python's cyclic garbage collector while a step is built and simulated.

    A frontier-scale step allocates millions of small objects that all live
    until the end (ops, events, callbacks); the collector would rescan them
    over and over for nothing (a third of the wall time at 650k ops). The few
    cycles made (callbacks that refer to their scheduler) are collected after.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _check_tp_overlap(plan: Plan, cluster: ClusterSpec) -> None:
    """Transformer Engine's userbuffers need each tensor-parallel group inside one node, its GPUs joined by
    NVLink (examples/pytorch/comm_gemm_overlap/README.md: "Tensor-parallel GPUs must be on a single node,
    and connected over NVLink/NVSwitch")."""
    nodes = plan.rank_grid // cluster.gpus_per_node  # [dp, pp, cp, tp]
    if (nodes != nodes[..., :1]).any():
        raise ParsimError(f"plan {plan.name}: tp_comm_overlap needs each tensor-parallel group inside one node "
                          f"(Transformer Engine's userbuffers run over NVLink), but tp {plan.tp} spans nodes of "
                          f"{cluster.gpus_per_node} GPUs of {cluster.name}")
    if not cluster.overlaps_tp_comm:
        raise ParsimError(f"plan {plan.name}: tp_comm_overlap needs the tensor-parallel GPUs joined by NVLink "
                          f"(Transformer Engine's userbuffers), but {cluster.name} joins its GPUs by PCIe")


def predict_step(plan: Plan, cluster: ClusterSpec,
                 progress: Callable[[int, int], None] | None = None) -> StepPrediction:
    """Simulate one step of ``plan`` on ``cluster`` (nodes enough for the plan's world size).

    ``progress(ops finished, ops in all)`` is called now and then while a long step simulates.
    """
    passes = plan.num_microbatches * plan.model.num_layers * (3 if plan.pipeline.split_backward else 2)
    if passes > MAX_LAYER_PASSES:
        raise ParsimError(f"plan {plan.name}: {plan.num_microbatches:,} microbatches x {plan.model.num_layers:,} "
                          f"layers is {passes:,} layer passes per step, more than parsim simulates "
                          f"({MAX_LAYER_PASSES:,}); fewer microbatches take the same time each")
    gpn = cluster.gpus_per_node
    if plan.world > gpn and plan.world % gpn:
        raise ParsimError(f"the plan needs {plan.world} GPUs, which is not a whole number of "
                          f"{gpn}-GPU nodes of {cluster.name}")
    if plan.tp_comm_overlap:
        _check_tp_overlap(plan, cluster)
    topo = cluster.build(max(1, plan.world // gpn))
    compute = ComputeModel.for_cluster(cluster, plan.dtype, plan.dtype_bytes, min(plan.world, gpn), plan.attention_seq)
    turns = compute.time_share > 1 and plan.world <= MAX_RANKS_IN_TURNS
    with _gc_paused():
        trace = _simulate(plan, cluster, StepSimulator(topo, compute, take_turns=turns), progress)
        wait = end_wait_s(trace, cluster.rank_jitter)
        return StepPrediction(plan, cluster, trace, step_time(trace) + wait, _waiting(breakdown(trace), wait),
                              memory(plan), turns, wait)


def _waiting(ranks: list[RankBreakdown], wait_s: float) -> list[RankBreakdown]:
    """Every rank's time by phase with ``wait_s`` more idle at the step's end (:mod:`parsim.sim.jitter`)."""
    for row in ranks:
        row.step_s += wait_s
        row.seconds["idle"] += wait_s
    return ranks


def _simulate(plan: Plan, cluster: ClusterSpec, sim: StepSimulator,
              progress: Callable[[int, int], None] | None) -> Trace:
    """The trace of ``plan``'s program on ``sim``, each action's compute in one span. The program is freed on
    return, before the garbage collector resumes and would look over its ops (856,518 for the 1T plan)."""
    program = lower(plan, fsdp_in_line=cluster.describes_cpu_host, follow_cache=cluster.matmul_cache_hits is not None)
    program = unfold(program) if sim.turns else program
    meta = {"plan": plan.name, "cluster": cluster.name, "world_size": plan.world,
            "represents": {str(k): v for k, v in program.represents.items()}}
    return sim.run(program, meta, progress, merged=True)
