"""Time a collective by running its phases on the flow-level network.

:func:`simulate_phases` is a simpy process, so the step simulator can run many
collectives at once on one :class:`~parsim.hardware.network.Network` and let them
contend; :func:`predict` runs one collective alone on an idle cluster, picks
the fastest algorithm the way NCCL's tuner would, and explains the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import simpy

from ...errors import ParsimError
from ...hardware.network import Network
from ...hardware.topology import Topology
from ...report.results import CollectiveResult
from . import deepep
from .algorithms import Phase, applicable_algorithms, build_phases
from .deepep import TokenRouting
from .nccl import PARSIM_ALGORITHM, PROTOS, Choice, model_for, nccl_choice


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
    efficiency: float = 1.0  # payload / bytes on the links (NCCL's protocol and channel limits, or calibrated)

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
    protocol: str = ""  # NCCL's protocol (LL, LL128, Simple) where the cluster is timed with NCCL's model
    nccl: Choice | None = None  # NCCL's tuning table and channels, for --explain
    routing: TokenRouting | None = None  # an expert all-to-all DeepEP runs (algorithm "deepep")
    copies: deepep.Copies | None = None  # and the copies of a token it sends, for --explain

    def result(self) -> CollectiveResult:
        bottleneck = max(self.phases, key=lambda p: p.transfer_s).bottleneck if self.phases else ""
        extra = {"lower_bound_s": self.lower_bound_s, "bottleneck": bottleneck, "candidates_s": self.candidates}
        if self.nccl is not None:
            extra.update(protocol=self.protocol, nccl_algorithm=self.nccl.chosen.algo, channels=self.nccl.channels,
                         max_channels=self.nccl.max_channels, nccl_estimate_s=self.nccl.chosen.time_us * 1e-6,
                         pipeline_fill_s=self.nccl.fill_us * 1e-6)
        return CollectiveResult(
            op=self.op, nranks=self.nranks, size_bytes=self.size_bytes, time_s=self.time_s,
            algorithm=self.algorithm, source="simulated", backend="simpy", cluster=self.cluster, extra=extra,
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
        latency = phase_latency_s(topo, phase, phase.routes)
        before = net.link_bytes.copy() if timings is not None else None
        if latency:
            yield env.timeout(latency)
        start = env.now
        yield net.transfer(*phase.flows())
        transfer = env.now - start
        reduce = phase.reduce_bytes / reduce_bw_Bps if phase.reduce_bytes else 0.0
        if reduce:
            yield env.timeout(reduce)
        if timings is not None:
            moved = net.link_bytes - before
            busy = moved / net.capacity
            busiest = int(np.argmax(busy >= busy.max() * (1 - 1e-9)))  # ties (to rounding) go to GPU links first
            timings.append(PhaseTiming(
                phase.label, len(phase.src), latency, transfer, reduce, float(moved[busiest]),
                topo.link_name(busiest), float(net.capacity[busiest]), phase.efficiency,
            ))


def phase_latency_s(topo: Topology, phase: Phase, routes: np.ndarray) -> float:
    """A phase's latency: NCCL's share of its collective's latency where the NCCL model set one, else
    ``steps`` x the slowest route's latency; plus a calibrated backend's fixed cost."""
    if phase.latency_s is not None:
        return phase.latency_s + phase.overhead_s
    return phase.steps * float(topo.path_latency_s(routes).max(initial=0.0)) + phase.overhead_s


def time_phases(topo: Topology, phases: list[Phase]) -> tuple[float, list[PhaseTiming]]:
    """Run ``phases`` alone on an idle network; total time and per-phase timings."""
    env = simpy.Environment()
    net = Network(env, topo.capacity_Bps)
    timings: list[PhaseTiming] = []
    env.process(simulate_phases(env, net, topo, phases, topo.spec.reduction_bw_Bps, timings))
    env.run()
    return env.now, timings


def predict(topo: Topology, op: str, size: int, group=None, algorithm: str = "auto",
            root: int = 0, protocol: str = "auto", routing: TokenRouting | None = None) -> CollectivePrediction:
    """Predict ``op`` of ``size`` bytes on ``group`` (default: every GPU) of an idle cluster.

    ``routing``: an all-to-all of tokens routed to experts as DeepEP dispatches them
    (:mod:`~parsim.sim.collectives.deepep`; ``size`` is the plain all-to-all's buffer, a row per token and expert).

    ``algorithm="auto"`` uses the cluster file's choice for ``op`` if it names one
    (calibrated backends). On a cluster with an ``nccl:`` section it then takes
    the algorithm and protocol NCCL's tuner picks (least latency + bytes /
    bandwidth in NCCL's own model, :mod:`~parsim.sim.collectives.nccl`) and runs
    that on the network; elsewhere it simulates every algorithm NCCL has for
    ``op`` at the links' peak speeds and keeps the fastest.
    """
    group = np.arange(topo.num_gpus) if group is None else np.asarray(group, dtype=np.int64)
    if not 0 <= root < len(group):
        raise ParsimError(f"root {root} is not a rank of the {len(group)}-rank group")
    proto = None if protocol in (None, "auto") else protocol
    if proto is not None and proto not in PROTOS:
        raise ParsimError(f"unknown protocol {protocol!r} (expected auto or one of: {', '.join(PROTOS)})")
    if routing is not None:
        return _predict_deepep(topo, op, size, group, routing, algorithm, proto)
    candidates: dict[str, float] = {}
    if algorithm == "auto" and op in topo.spec.algorithms:
        algorithm = topo.spec.algorithms[op]
    model = model_for(topo, group)
    choice = None
    if algorithm == "auto" and model is not None and op in NCCL_TUNED:
        usable = [a for a, why in applicable_algorithms(topo, op, group).items() if not why]
        algos = tuple(a for a, name in PARSIM_ALGORITHM.items() if name in usable)
        choice = model.choose(op, int(size), algos, proto)
        if choice is None:
            raise ParsimError(f"NCCL has no {protocol} protocol for {op.replace('_', '-')} on {len(group)} ranks")
        algorithm = PARSIM_ALGORITHM[choice.chosen.algo]
        candidates = {c.name: c.time_us * 1e-6 for c in choice.candidates}
    if algorithm == "auto":
        reasons = {a: why for a, why in applicable_algorithms(topo, op, group).items() if a in NCCL_ALGORITHMS[op]}
        usable = [a for a, why in reasons.items() if not why]
        if not usable:
            why = "; ".join(dict.fromkeys(reasons.values()))
            raise ParsimError(f"no algorithm can run {op.replace('_', '-')} on {len(group)} ranks: {why}")
        runs = {a: time_phases(topo, build_phases(topo, op, a, group, size, root)) for a in usable}
        candidates = {a: t for a, (t, _) in runs.items()}
        algorithm = min(candidates, key=candidates.get)
        time_s, timings = runs[algorithm]
    else:
        if choice is None:
            choice = nccl_choice(topo, op, algorithm, group, size, proto)
            if choice is not None:
                candidates = {c.name: c.time_us * 1e-6 for c in choice.candidates}
            elif proto is not None and model is not None and op in NCCL_TUNED:
                raise ParsimError(f"NCCL cannot run {algorithm} with protocol {protocol} here")
        phases = build_phases(topo, op, algorithm, group, size, root, choice.chosen.proto if choice else None)
        time_s, timings = time_phases(topo, phases)
    bound, reason = lower_bound(topo, op, size, group)
    return CollectivePrediction(op, algorithm, len(group), int(size), time_s, timings, bound, reason,
                                candidates, topo.spec.name, choice.chosen.proto if choice else "", choice)


def _predict_deepep(topo: Topology, op: str, size: int, group: np.ndarray, routing: TokenRouting,
                    algorithm: str, protocol: str | None) -> CollectivePrediction:
    if op != "all_to_all":
        raise ParsimError(f"DeepEP dispatches tokens to their experts: an all-to-all, not {op.replace('_', '-')}")
    if algorithm != "auto" or protocol is not None:
        raise ParsimError("DeepEP runs its own kernels: no --algorithm or --protocol with it")
    time_s, timings = time_phases(topo, deepep.phases(topo, group, size, routing))
    copies = deepep.group_copies(topo, group, routing)
    bound, reason = deepep.lower_bound(topo, copies, size / routing.experts_per_token)
    return CollectivePrediction(op, "deepep", len(group), int(size), time_s, timings, bound, reason,
                                cluster=topo.spec.name, routing=routing, copies=copies)


NCCL_TUNED = ("broadcast", "reduce", "all_gather", "reduce_scatter", "all_reduce")


def choose_algorithm(topo: Topology, op: str, size: int, group) -> tuple[str, str]:
    """The (algorithm, NCCL protocol or "") :func:`predict` picks by default, without timing the pick
    where NCCL's tuner or a lone candidate decides it (the step simulator times it on its own network)."""
    group = np.asarray(group, dtype=np.int64)
    if op not in topo.spec.algorithms:
        model = model_for(topo, group)
        choice = _tuned(topo, model, op, size, group)
        if choice is not None:
            return PARSIM_ALGORITHM[choice.chosen.algo], choice.chosen.proto
        usable = [a for a, why in applicable_algorithms(topo, op, group).items() if not why]
        candidates = [a for a in usable if a in NCCL_ALGORITHMS[op]]
        if len(candidates) == 1 and (model is None or op not in NCCL_TUNED):
            return candidates[0], ""
    p = predict(topo, op, size, group)
    return p.algorithm, p.protocol


def kernel_sms(topo: Topology, op: str, size: int, group) -> int:
    """SMs the collective's kernel holds while it runs: one per channel of the pick of NCCL's tuner (each
    channel is one thread block, ``device/common.h``); 0 where NCCL does not run it (a CPU host's gloo)."""
    group = np.asarray(group, dtype=np.int64)
    choice = _tuned(topo, model_for(topo, group), op, size, group)
    return choice.channels if choice is not None else 0


def _tuned(topo: Topology, model, op: str, size: int, group: np.ndarray) -> Choice | None:
    """NCCL's tuner's pick among the algorithms this group can run, where the cluster is timed with it."""
    if model is None or op not in NCCL_TUNED:
        return None
    usable = [a for a, why in applicable_algorithms(topo, op, group).items() if not why]
    return model.choose(op, int(size), tuple(a for a, name in PARSIM_ALGORITHM.items() if name in usable), None)


def lower_bound(topo: Topology, op: str, size: float, group: np.ndarray) -> tuple[float, str]:
    """Bandwidth lower bound: bytes that must cross each level of the hierarchy over its bandwidth.

    Inside a node every rank must send (all-reduce: ``2(n-1)/n`` of the buffer, or
    the whole buffer once where the switch reduces and multicasts it; all-gather
    and reduce-scatter: ``(n-1)/n``; broadcast, reduce, send/recv: the whole
    buffer) through its fabric link; across nodes every node must push the
    node-level equivalent through the NICs of the group's GPUs. Latency is
    ignored, so small messages sit far above the bound.
    """
    n = len(group)
    if n < 2:
        return 0.0, "one rank moves nothing"
    nodes = len(np.unique(topo.node_of(group)))
    factor = {"all_reduce": lambda k: 2 * (k - 1) / k, "all_gather": lambda k: (k - 1) / k,
              "reduce_scatter": lambda k: (k - 1) / k, "all_to_all": lambda k: (k - 1) / k,
              "gather": lambda k: (k - 1) / k, "scatter": lambda k: (k - 1) / k}.get(op, lambda k: 1.0)
    intra_bw = topo.spec.intra.bw_Bps
    in_switch = op == "all_reduce" and topo.spec.intra.in_switch_reduction and n // nodes > 1
    per_rank = 1.0 if in_switch else factor(n)  # NVLS: each rank's buffer in once, the sum out once
    # gather and scatter: only the root's link carries (n-1)/n of the buffer; the others carry 1/n each
    who = {"gather": "the root receives", "scatter": "the root sends"}.get(op, "each rank moves")
    bounds = [(per_rank * size / intra_bw,
               f"{who} {per_rank:.3g} x the buffer through its {intra_bw / 1e9:.0f} GB/s fabric link"
               + (" (the switch reduces)" if in_switch else ""))]
    if nodes > 1:
        # the NICs of the group's GPUs (a pipeline's send between two GPUs has one a node)
        node = topo.node_of(group)
        nics = len(np.unique(topo.nic_of(group[node == node[0]])))
        nic_bw = topo.spec.scale_out.nic_bw_Bps * nics
        node_bytes = factor(nodes) * size * (n / nodes if op == "all_to_all" else 1)
        bounds.append((node_bytes / nic_bw,
                       f"{who.replace('the root', 'the root node').replace('each rank', 'each node')} "
                       f"{node_bytes / size:.3g} x the buffer through "
                       f"{nics} NIC{'s' if nics > 1 else ''} ({nic_bw / 1e9:.0f} GB/s)"))
    return max(bounds)
