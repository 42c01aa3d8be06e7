"""Time a collective by running its phases on the flow-level network.

:func:`simulate_phases` is a simpy process, so the step simulator can run many
collectives at once on one :class:`~parsim.network.Network` and let them
contend; :func:`predict` runs one collective alone on an idle cluster, picks
the fastest algorithm the way NCCL's tuner would, and explains the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import simpy

from ..errors import ParsimError
from ..network import Network
from ..results import CollectiveResult
from ..topology import Topology
from .algorithms import Phase, applicable_algorithms, build_phases


@dataclass
class PhaseTiming:
    """What one phase cost, for ``--explain``."""

    label: str
    flows: int
    latency_s: float  # steps x the slowest route's latency
    transfer_s: float  # moving the bytes over shared links
    reduce_s: float  # summing received data
    bottleneck_bytes: float  # what the bottleneck link carried
    bottleneck: str  # the link that needed the most time alone
    bottleneck_bw_Bps: float

    @property
    def time_s(self) -> float:
        return self.latency_s + self.transfer_s + self.reduce_s


@dataclass
class CollectivePrediction:
    op: str
    algorithm: str
    nranks: int
    size_bytes: int
    time_s: float
    phases: list[PhaseTiming]
    lower_bound_s: float
    lower_bound_reason: str
    candidates: dict[str, float] = field(default_factory=dict)  # algorithm -> time, when chosen automatically
    cluster: str = ""

    def result(self) -> CollectiveResult:
        bottleneck = max(self.phases, key=lambda p: p.transfer_s).bottleneck if self.phases else ""
        return CollectiveResult(
            op=self.op, nranks=self.nranks, size_bytes=self.size_bytes, time_s=self.time_s,
            algorithm=self.algorithm, source="simulated", backend="simpy", cluster=self.cluster,
            extra={"lower_bound_s": self.lower_bound_s, "bottleneck": bottleneck,
                   "candidates_s": self.candidates},
        )


# What NCCL itself can run for each operation (its tuner picks among these);
# the other algorithms are available with an explicit --algorithm.
NCCL_ALGORITHMS = {
    "all_reduce": ("ring", "tree", "in_switch"),
    "all_gather": ("ring",), "reduce_scatter": ("ring",), "broadcast": ("ring",), "reduce": ("ring",),
    "gather": ("direct",), "scatter": ("direct",), "all_to_all": ("direct",), "send_recv": ("direct",),
}


def simulate_phases(env: simpy.Environment, net: Network, topo: Topology, phases: list[Phase],
                    reduce_bw_Bps: float, timings: list[PhaseTiming] | None = None):
    """simpy process: run ``phases`` one after another on ``net``; append a PhaseTiming per phase."""
    for phase in phases:
        if phase.routes is None:
            phase.routes = topo.routes(phase.src, phase.dst)
        routes = phase.routes
        latency = phase.steps * float(topo.path_latency_s(routes).max(initial=0.0)) + phase.overhead_s
        before = net.link_bytes.copy() if timings is not None else None
        if latency:
            yield env.timeout(latency)
        start = env.now
        yield net.transfer(routes, phase.nbytes)
        transfer = env.now - start
        reduce = phase.reduce_bytes / reduce_bw_Bps if phase.reduce_bytes else 0.0
        if reduce:
            yield env.timeout(reduce)
        if timings is not None:
            moved = net.link_bytes - before
            busiest = int(np.argmax(moved / net.capacity))  # ties go to the lowest index: GPU links first
            timings.append(PhaseTiming(
                phase.label, len(phase.src), latency, transfer, reduce, float(moved[busiest]),
                topo.link_name(busiest), float(net.capacity[busiest]),
            ))


def time_phases(topo: Topology, phases: list[Phase]) -> tuple[float, list[PhaseTiming]]:
    """Run ``phases`` alone on an idle network; total time and per-phase timings."""
    env = simpy.Environment()
    net = Network(env, topo.capacity_Bps)
    timings: list[PhaseTiming] = []
    env.process(simulate_phases(env, net, topo, phases, topo.spec.reduction_bw_Bps, timings))
    env.run()
    return env.now, timings


def predict(topo: Topology, op: str, size: int, group=None, algorithm: str = "auto",
            root: int = 0) -> CollectivePrediction:
    """Predict ``op`` of ``size`` bytes on ``group`` (default: every GPU) of an idle cluster.

    ``algorithm="auto"`` uses the cluster file's choice for ``op`` if it names one
    (calibrated backends), else simulates every algorithm NCCL has for ``op`` and
    keeps the fastest, as NCCL's tuner picks the fastest for the size.
    """
    group = np.arange(topo.num_gpus) if group is None else np.asarray(group, dtype=np.int64)
    if not 0 <= root < len(group):
        raise ParsimError(f"root {root} is not a rank of the {len(group)}-rank group")
    candidates: dict[str, float] = {}
    if algorithm == "auto" and op in topo.spec.algorithms:
        algorithm = topo.spec.algorithms[op]
    if algorithm == "auto":
        usable = [a for a, why in applicable_algorithms(topo, op, group).items() if not why and a in NCCL_ALGORITHMS[op]]
        if not usable:
            raise ParsimError(f"no algorithm can run {op.replace('_', '-')} on {len(group)} ranks")
        runs = {a: time_phases(topo, build_phases(topo, op, a, group, size, root)) for a in usable}
        candidates = {a: t for a, (t, _) in runs.items()}
        algorithm = min(candidates, key=candidates.get)
        time_s, timings = runs[algorithm]
    else:
        time_s, timings = time_phases(topo, build_phases(topo, op, algorithm, group, size, root))
    bound, reason = lower_bound(topo, op, size, group)
    return CollectivePrediction(op, algorithm, len(group), int(size), time_s, timings, bound, reason,
                                candidates, topo.spec.name)


def lower_bound(topo: Topology, op: str, size: float, group: np.ndarray) -> tuple[float, str]:
    """Bandwidth lower bound: bytes that must cross each level of the hierarchy over its bandwidth.

    Inside a node every rank must send (all-reduce without in-switch reduction:
    ``2(n-1)/n`` of the buffer; all-gather and reduce-scatter: ``(n-1)/n``;
    broadcast, reduce, send/recv: the whole buffer) through its fabric link; across
    nodes every node must push the node-level equivalent through all its NICs.
    Latency is ignored, so small messages sit far above the bound.
    """
    n = len(group)
    if n < 2:
        return 0.0, "one rank moves nothing"
    nodes = len(np.unique(topo.node_of(group)))
    factor = {"all_reduce": lambda k: 2 * (k - 1) / k, "all_gather": lambda k: (k - 1) / k,
              "reduce_scatter": lambda k: (k - 1) / k, "all_to_all": lambda k: (k - 1) / k,
              "gather": lambda k: (k - 1) / k, "scatter": lambda k: (k - 1) / k}.get(op, lambda k: 1.0)
    intra_bw = topo.spec.intra.bw_Bps
    bounds = [(factor(n) * size / intra_bw,
               f"each rank moves {factor(n):.3g} x the buffer through its {intra_bw / 1e9:.0f} GB/s fabric link")]
    if nodes > 1:
        nic_bw = topo.spec.scale_out.nic_bw_Bps * topo.nics_per_node
        node_bytes = factor(nodes) * size * (n / nodes if op == "all_to_all" else 1)
        bounds.append((node_bytes / nic_bw,
                       f"each node moves {node_bytes / size:.3g} x the buffer through "
                       f"{topo.nics_per_node} NICs ({nic_bw / 1e9:.0f} GB/s)"))
    return max(bounds)
