"""Time a :class:`~parsim.sim.program.Program` on the simulated cluster (simpy).

The engine is a dependency-driven list scheduler on a simpy clock. Every op
waits for its prerequisites: the op before it on its (rank, stream), and its
``deps``. When the last one finishes it starts at that instant; a receive
lasts until its matching send has arrived. Compute ops take their modelled
time (identical compute is costed once). Collectives run their algorithm's
phases and sends their single transfer as flows on one shared
:class:`~parsim.hardware.network.Network`, so data-parallel all-reduces,
tensor-parallel all-reduces and pipeline sends that overlap in time contend
for the same links. Mirror flows (replicas the representative stands for) are
kept only where they share links with it, directly or through each other.

Nothing here polls. Runs of ops that follow each other at once are timed with
one timeout; a collective whose links no other stream ever uses takes its
uncontended time in closed form; a transfer alone on its links costs one
wake-up. So a step with hundreds of thousands of ops runs in seconds (see
``docs/engine.md``). The result is a :class:`~parsim.report.trace.Trace` in the
schema the executor writes.
"""

from __future__ import annotations

import inspect
import math
import time
from collections import Counter, deque
from dataclasses import dataclass
from functools import lru_cache
from operator import attrgetter
from typing import Callable

import numpy as np
import simpy

from ..errors import ParsimError
from ..hardware.network import Network, chain_routes, stack_routes, unique_links
from ..hardware.topology import Topology
from ..report.step_report import SpanMerger
from ..report.trace import Event, Trace
from .collectives import deepep
from .collectives.algorithms import Phase, at_nccl_nvlink_speed, build_phases
from .collectives.simulate import choose_algorithm, kernel_sms, time_phases
from .compute import ComputeModel, at_length
from .cores import SharedCores, core_of, eevdf_slice_s
from .held_sms import HOLDING_STREAMS, HeldSMs
from .program import NCCL_CHANNELS, Op, Program

# progress(ops finished, ops in all) is called at most this often (seconds of wall time)
PROGRESS_EVERY_S = 0.5


@dataclass(frozen=True)
class CommPhase:
    """One phase of a collective (or a whole send) ready to run: the flows of the
    representative and of the mirror groups that contend with it."""

    routes: np.ndarray
    nbytes: np.ndarray | float
    latency_s: float  # steps x the slowest route's latency, plus a backend's fixed cost
    reduce_s: float  # summing received data after the transfer
    key: int  # names this transfer (routes and sizes) for the network's memo
    links: np.ndarray  # the links ``routes`` use


class StepSimulator:
    """Runs programs on one topology with one compute model; costs are cached across runs."""

    def __init__(self, topo: Topology, compute: ComputeModel, take_turns: bool = False):
        """``take_turns``: where ranks time-share a CPU host's cores (``compute.time_share`` > 1), run them in
        turns on each core (:mod:`parsim.sim.cores`; the program must simulate every rank,
        :func:`parsim.lowering.unfold.unfold`) rather than stretch every rank's work by the share."""
        self.topo, self.compute = topo, compute
        self.turns = take_turns and compute.time_share > 1
        if self.turns:  # each rank's work alone on its core; the stretched model gives the penalty of turns
            self.shared, self.compute = compute, compute.with_core_each()
        self._algorithms: dict[tuple, tuple[str, str | None]] = {}
        self._sms: dict[tuple, int] = {}
        self.comm_phases = lru_cache(maxsize=None)(self._comm_phases)
        self.compute_time = lru_cache(maxsize=None)(self.compute.time)
        self.shared_time = lru_cache(maxsize=None)(self.shared.time) if self.turns else None
        self._keys = 0

    def run(self, program: Program, meta: dict | None = None,
            progress: Callable[[int, int], None] | None = None, merged: bool = False) -> Trace:
        """Simulate ``program``; ``progress(finished, total)`` is called now and then on long runs. ``merged``:
        each action's compute pieces in one span (:func:`~parsim.report.step_report.merge_spans`)."""
        run = _Run(self, program, progress)
        try:
            return run.trace(meta, merged)
        finally:
            run.release()

    # -- cached costs -------------------------------------------------------------
    def _comm_phases(self, kind: str, collective: str, ranks: tuple[int, ...],
                     mirrors: tuple[tuple[int, ...], ...], nbytes: float,
                     receiver_gradients: float = 0.0,
                     routing: deepep.TokenRouting | None = None) -> tuple[CommPhase, ...]:
        """A send's or a collective's phases, with the flows of the mirror groups that contend
        with the representative's (cached: ops repeat every microbatch); a send's latency on a CPU host is read
        off the gradients its receiver holds, ``receiver_gradients`` bytes. ``routing``: an expert all-to-all
        DeepEP runs (:mod:`parsim.sim.collectives.deepep`)."""
        groups = [ranks, *mirrors]
        if kind == "send":
            pairs = np.array(groups)
            routes = self.topo.routes(pairs[:, 0], pairs[:, 1])
            kept = _contending([r[r >= 0] for r in routes], self.topo.num_links)
            transfer = Phase.of("send", pairs[kept, 0], pairs[kept, 1], float(nbytes), 1)
            at_nccl_nvlink_speed(self.topo, [transfer])  # inside a node at NCCL's NVLink speed
            # CPU hosts: a pipeline transfer's own measured latency (compute.p2p_latency_us), not the links'
            latency_s = self.compute.send_latency_s(receiver_gradients)
            return (self._ready_phase(routes[kept], transfer.nbytes, 1, 0.0, 0.0, latency_s),)
        groups = self._may_contend(groups)
        if routing is not None:
            per_group = [deepep.phases(self.topo, np.asarray(g), nbytes, routing) for g in groups]
        else:
            algorithm, protocol = self._algorithm(collective, ranks, int(nbytes))
            per_group = [build_phases(self.topo, collective, algorithm, np.asarray(g), nbytes, protocol=protocol)
                         for g in groups]
        for i in range(len(per_group[0])):  # every group's routes of phase i at once
            phases = [p[i] for p in per_group]
            routes = self.topo.routes(np.concatenate([p.src for p in phases]),
                                      np.concatenate([p.dst for p in phases]))
            for phase, part in zip(phases, np.split(routes, np.cumsum([len(p.src) for p in phases])[:-1])):
                phase.routes = part
        hops = [np.concatenate([p.routes.ravel() for p in phases]) for phases in per_group]
        kept = [per_group[i] for i in _contending([h[h >= 0] for h in hops], self.topo.num_links)]
        spec = self.topo.spec
        # A call between bursts of compute pays the backend's in-step extra (calibrated on CPU hosts) up front.
        extra = spec.collective_step_overhead_s.get(collective)
        in_step = at_length(extra, math.ceil(nbytes / 1024)) if extra else 0.0
        slower = self._probe_slowdown(collective, len(ranks), nbytes, per_group[0], in_step)
        return tuple(self._ready_phase(stack_routes([p[i].routes for p in kept]),
                                       np.concatenate([p[i].nbytes for p in kept]),
                                       first.steps, first.overhead_s + (in_step if i == 0 else 0.0),
                                       first.reduce_bytes / spec.reduction_bw_Bps, first.latency_s, first.chain,
                                       slower)
                     for i, first in enumerate(kept[0]))

    def _probe_slowdown(self, collective: str, nranks: int, nbytes: float, phases: list, in_step_s: float) -> float:
        """How many times as long as calibrated a CPU host's collective takes now, by the collective probe
        (:meth:`~parsim.hardware.cluster.ClusterSpec.collective_now_s` of its calibrated time alone); 1 without
        a probe read around a run."""
        spec = self.topo.spec
        if not spec.collective_probe_now_s:
            return 1.0
        alone_s = time_phases(self.topo, phases)[0] + in_step_s
        return spec.collective_now_s(alone_s, collective, nranks, nbytes) / alone_s if alone_s > 0 else 1.0

    def _may_contend(self, groups: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """The representative group (first) and the mirror groups that could share a link with it.

        A group inside one node moves data over that node's links only, so two
        such groups on different nodes never meet: those mirrors are dropped
        before their phases are built (tensor-parallel groups at 16k GPUs).
        """
        nodes = [set(np.unique(self.topo.node_of(np.asarray(g))).tolist()) for g in groups]
        if len(nodes[0]) > 1:
            return groups
        return [g for g, n in zip(groups, nodes) if len(n) > 1 or n == nodes[0]]

    def _ready_phase(self, routes: np.ndarray, nbytes, steps: int, overhead_s: float, reduce_s: float,
                     latency_s: float | None, chain: int = 1, slower: float = 1.0) -> CommPhase:
        """``routes`` per hop; the network gets each pipelined ``chain`` of hops as one flow. ``slower``: every
        part of it takes that many times as long (its bytes count that many times on the links)."""
        self._keys += 1
        if latency_s is not None:  # NCCL's latency (nccl.py), not the routes'
            latency = latency_s + overhead_s
        else:
            latency = steps * float(self.topo.path_latency_s(routes).max(initial=0.0)) + overhead_s
        routes, nbytes = chain_routes(routes, np.broadcast_to(np.asarray(nbytes, dtype=float) * slower,
                                                              routes.shape[:1]), chain)
        return CommPhase(routes, nbytes, latency * slower, reduce_s * slower, self._keys,
                         unique_links(routes[routes >= 0], self.topo.num_links))

    def held_sms(self, beside_sms: int, collective: str, ranks: tuple[int, ...], nbytes: float,
                 routing: deepep.TokenRouting | None = None) -> int:
        """SMs a collective beside compute holds while it runs: ``beside_sms``, or, for NCCL_CHANNELS, its
        kernel's (:meth:`kernel_sms`)."""
        return beside_sms if beside_sms != NCCL_CHANNELS else self.kernel_sms(collective, ranks, int(nbytes), routing)

    def kernel_sms(self, collective: str, ranks: tuple[int, ...], nbytes: int,
                   routing: deepep.TokenRouting | None = None) -> int:
        """SMs the collective's kernel holds while it runs: NCCL's
        (:func:`~parsim.sim.collectives.simulate.kernel_sms`, cached per group shape and size as
        :meth:`_algorithm`), or on a GPU DeepEP's (``routing``)."""
        if routing is not None:
            return deepep.DEEPEP_SMS if self.topo.spec.gpu.sm_count else 0
        key = (collective, self._group_shape(ranks), nbytes)
        if key not in self._sms:
            self._sms[key] = kernel_sms(self.topo, collective, nbytes, np.asarray(ranks))
        return self._sms[key]

    def _group_shape(self, ranks: tuple[int, ...]) -> tuple:
        """Where a group's GPUs sit: their local indices, node offsets and unit offsets. Nodes are wired alike
        and scalable units alike, so groups of one shape choose alike wherever they sit."""
        group = np.asarray(ranks)
        nodes, units = self.topo.node_of(group), self.topo.unit_of(group)
        return (tuple((group % self.topo.gpus_per_node).tolist()), tuple((nodes - nodes[0]).tolist()),
                tuple((units - units[0]).tolist()))

    def _algorithm(self, collective: str, ranks: tuple[int, ...], nbytes: int) -> tuple[str, str | None]:
        """The algorithm (and, on clusters timed with NCCL's model, protocol) NCCL would pick for this
        collective alone.

        Cached per group shape and size (:meth:`_group_shape`).
        """
        key = (collective, self._group_shape(ranks), nbytes)
        if key not in self._algorithms:
            algorithm, protocol = choose_algorithm(self.topo, collective, nbytes, np.asarray(ranks))
            self._algorithms[key] = (algorithm, protocol or None)
        return self._algorithms[key]


@dataclass(frozen=True)
class _Comm:
    """How one communication op runs: phase by phase on the network, or, when no op of another
    stream ever touches its links, in the closed form of its uncontended phases."""

    phases: tuple[CommPhase, ...]
    closed_form_s: float | None


class _Run:
    """One simulation of one program: the scheduler state and its callbacks."""

    def __init__(self, sim: StepSimulator, program: Program, progress: Callable[[int, int], None] | None):
        self.sim, self.program, self.ops = sim, program, program.ops
        self.env = simpy.Environment()
        self.net = Network(self.env, sim.topo.capacity_Bps, track_bytes=False)
        n = len(self.ops)
        self.start = [0.0] * n
        self.end = [-1.0] * n  # -1: not finished
        self.waiting = [0] * n  # prerequisites not yet finished
        self.dependents: list[list[int]] = [[] for _ in range(n)]
        self.recv_of: dict[int, int] = {}  # send id -> the receive waiting for it
        self.joined: dict[int, list[int]] = {}  # a collective over simulated ranks: its lowest op id -> ops arrived
        self.finished = 0
        self._due: deque[int] = deque()  # ops ending now, not yet processed
        self._draining = False
        self.progress = progress
        self._next_report = time.monotonic() + PROGRESS_EVERY_S
        self.comm: list[_Comm | None] = [None] * n
        self._plan_comms()
        # a CPU host's late receive costs its rendezvous, read off the gradients the receiver holds (see _received)
        self._rendezvous_s = {rank: sim.compute.rendezvous_s(nbytes) for rank, (_, nbytes) in program.gradients.items()}
        self._default_rendezvous_s = sim.compute.rendezvous_s()
        self.fixed: list[float | None] = [None] * n  # duration, where known before the op starts
        self.through = [False] * n  # ends by starting its stream successor at once (see _start)
        # collectives taken out of the schedule (see _absorb_beside): id -> (partner compute op, seconds); and the
        # joins after them: id -> the same, the join starting no sooner than the collective would have ended
        self.absorbed: dict[int, tuple[int, float]] = {}
        self.partners: list[int] = []  # compute ops beside a collective (Op.beside_of)
        self.holds: dict[int, tuple[int, float]] = {}
        # A CPU host's loop runs before each op that opens one of its actions (see _leads): a fixed op's duration
        # includes it, any other op begins that much later; the trace shows it as idle.
        self.lead, self.sent_after = self._leads(sim.compute)
        # Ranks taking turns on shared cores (StepSimulator's take_turns): their ops' work alone on the core, and
        # how many times as slowly it runs while another rank waits for the core (parsim.sim.cores); the same for the
        # loop's time before an op, from the host's costs measured with two ranks on each core.
        self.cores = self._shared_cores() if sim.turns else None
        self.work: dict[int, tuple[float, float]] = {}
        if self.cores is not None:
            self._price_one_core_collectives()
            self.lead_penalty = {i: self._penalty(alone, shared)
                                 for i, (alone, shared) in enumerate(zip(self.lead, self._leads(sim.shared)[0]))
                                 if alone}
        # On a CPU host whose ranks share the memory bandwidth, an op's streamed bytes are a flow on it (HostMemory),
        # after the rest of its work, which takes ``beside[i]``.
        shares_memory = sim.compute.shares_host_memory and self.cores is None
        self.memory = HostMemory(self.env, sim.topo, sim.compute, program) if shares_memory else None
        self.beside: dict[int, float] = {}
        # A GPU's data-parallel and FSDP collectives hold SMs while they run (parsim.sim.held_sms): the compute
        # beside them runs on the rest. Each compute-stream chain of a rank that has such collectives is kept
        # (head op, and its last op, planned end and version) so that it can be timed again when one starts.
        self.sms_of = self._holding_sms()
        self.held = HeldSMs(self._slowdown) if self.sms_of else None
        self.held_ranks = {self.ops[i].rank for i in self.sms_of}
        self.chain_head: dict[int, int] = {}
        self.chain_end: dict[int, tuple[int, float, int]] = {}
        self.anchor: dict[int, tuple[int, float, float]] = {}  # rank -> (op under way, time it was timed, work left)
        self._slowdowns: dict[tuple, float] = {}
        ready = self._link_prerequisites()
        self.env.timeout(0).callbacks.append(lambda _event: self._begin(ready))
        self.env.run()
        if progress is not None:
            progress(self.finished, n)

    def _shared_cores(self) -> SharedCores:
        """The cores ranks share and take turns on (:func:`~parsim.sim.cores.core_of`)."""
        program, topo = self.program, self.sim.topo
        if len(program.ranks) < program.world_size or any(len(r) > 1 for r in program.replicas.values()):
            raise ParsimError("ranks take turns on their cores only in a program that simulates every rank "
                              "(parsim.lowering.unfold)")
        cores = topo.spec.cpu_cores
        on_core = {r: core_of(r, topo.gpus_per_node, cores) for r in program.ranks}
        ranks_on = Counter(on_core.values())
        shared = self.sim.shared.shared_cores
        slice_s = (shared.time_slice_s if shared else None) or eevdf_slice_s(cores)
        return SharedCores(self.env, {r: c for r, c in on_core.items() if ranks_on[c] > 1}, slice_s)

    def _price_one_core_collectives(self) -> None:
        """A collective whose ranks all take turns on one core runs between processes on that core, at the
        figures calibrate measured there (``SharedCoreCosts.one_core_collective_s``), not over the links fitted
        between ranks with a core each."""
        shared, core_of = self.sim.shared.shared_cores, self.cores.core_of
        if shared is None or shared.one_core_collective_s("all_reduce", 2, 0.0) is None:  # not measured
            return
        for op in self.ops:
            if op.kind == "collective" and op.ranks[0] in core_of and all(
                    core_of.get(r) == core_of[op.ranks[0]] for r in op.ranks):
                seconds = shared.one_core_collective_s(op.collective, len(op.ranks), op.nbytes)
                self.comm[op.id] = _Comm(self.comm[op.id].phases, seconds)

    def _penalty(self, alone_s: float, shared_s: float) -> float:
        """How many times as slowly work runs while another rank waits for its core: its time with two ranks on
        each core all along (``shared_s``, the stretched model's) over the share of it that is its own."""
        return max(shared_s / (self.sim.shared.time_share * alone_s), 1.0) if alone_s > 0 else 1.0

    def _turn_work(self, op: Op) -> tuple[float, float]:
        """Op ``op``'s work alone on its core, and its :meth:`_penalty`. On a host whose memory speed was measured
        (``shares_host_memory``), its streamed bytes at a core's speed alone, at most the host's shared by all
        its cores: which cores stream at each moment is not followed here."""
        sim = self.sim
        compute = sim.compute
        stream_bw = (min(compute.memory_alone_bw_Bps, compute.memory_host_bw_Bps / sim.topo.spec.cpu_cores)
                     if compute.shares_host_memory else None)
        streams = op.stream_bytes / stream_bw if stream_bw else 0.0
        args = _time_args(op, stream_apart=bool(stream_bw))
        alone = sim.compute_time(*args) + streams
        shared = sim.shared_time(*args) + streams * sim.shared.time_share
        return alone, self._penalty(alone, shared)

    def _link_prerequisites(self) -> list[int]:
        """Count each op's prerequisites (stream predecessor and deps) and find the chains.

        Returns the ops with no prerequisites. An op whose only dependent is
        its stream successor, and whose successor waits for nothing else and
        has a known duration, is ``through``: when it ends, the successor
        starts at that instant, so :meth:`_start` times the whole chain with
        one timeout (the block computes and uncontended tensor-parallel
        collectives of a pass run back to back).
        """
        ops, fixed, waiting, dependents = self.ops, self.fixed, self.waiting, self.dependents
        compute_time, costs = self.sim.compute_time, {}
        last: dict[tuple[int, str], int] = {}
        successor = [-1] * len(ops)
        prereqs_of: list[tuple[int, ...]] = []
        cores = self.cores
        for op in ops:
            i = op.id
            if cores is not None and cores.shares(op.rank):
                if op.kind == "compute" or op.kind == "optimizer":
                    self.work[i] = self._turn_work(op)
            elif op.kind == "compute" or op.kind == "optimizer":
                apart = self.memory is not None and op.stream_bytes > 0
                key = (*_work_key(op), apart)
                if op.beside_of >= 0:  # and the collective beside it (its comm is shared by ops of one shape)
                    key += (op.beside_sms, id(self.comm[op.beside_of]))
                    self.partners.append(i)
                time_s = costs.get(key)
                if time_s is None:
                    args = _time_args(op, apart)
                    time_s = costs[key] = compute_time(*args)
                    if op.beside_of >= 0:
                        time_s = costs[key] = self._beside_collective(op, args, time_s)
                if apart:
                    self.beside[i] = time_s
                else:
                    fixed[i] = time_s
            elif self.comm[i] is not None and not op.joins:
                fixed[i] = self.comm[i].closed_form_s
            if op.opens_action and fixed[i] is not None:
                fixed[i] += self.lead[i]
            stream = (op.rank, op.stream)
            before = last.get(stream)
            last[stream] = i
            deps = op.deps
            if before is None:
                prereqs = tuple(dict.fromkeys(deps)) if len(deps) > 1 else deps
            else:
                successor[before] = i
                if not deps:
                    prereqs = (before,)
                elif len(deps) == 1 and deps[0] != before:  # (most ops: nothing to drop)
                    prereqs = (before, deps[0])
                else:
                    prereqs = tuple(dict.fromkeys((before, *deps)))
            waiting[i] = len(prereqs)
            prereqs_of.append(prereqs)
            for p in prereqs:
                dependents[p].append(i)
        self._absorb_beside(prereqs_of, successor)
        # a send's end starts its receive; a collective holding SMs starts and ends on its own (see _hold)
        holding = self.sms_of
        barred = {op.match for op in ops if op.kind == "recv"} | holding.keys()
        through = self.through
        for i, k in enumerate(successor):
            if (k >= 0 and waiting[k] == 1 and fixed[k] is not None and len(dependents[i]) == 1 and i not in barred
                    and k not in holding):
                through[i] = True  # its one dependent is then k (k waits for one op: its predecessor, i)
        return [i for i, count in enumerate(waiting) if count == 0]

    def _absorb_beside(self, prereqs: list[tuple[int, ...]], successor: list[int]) -> None:
        """Take out of the schedule each uncontended collective beside a compute op ``k`` and joined right after
        it (:func:`parsim.lowering.tp_overlap.async_backward`, ``bulk``): the collective ``j`` and ``k`` both
        start when the compute-stream op before ``k`` ends (the collective before ``j`` on its stream was joined
        before that op), and ``j``'s closed form is known, so the join ``m`` waits for ``k`` alone and starts
        once ``j`` would have ended (:attr:`holds`); ``j``'s times are filled in at the end. The compute stream's
        ops then run as one chain (``through``) rather than as events."""
        ops, fixed, waiting, dependents, comm = self.ops, self.fixed, self.waiting, self.dependents, self.comm
        for k in self.partners:
            j, m = ops[k].beside_of, successor[k]
            if m < 0 or fixed[k] is None or fixed[m] is None or self.lead[k] or len(prereqs[k]) != 1:
                continue
            stream, closed = ops[j].stream, comm[j].closed_form_s if comm[j] is not None else None
            before = prereqs[k][0]
            if (closed is None or ops[j].joins or before not in prereqs[j] or set(prereqs[m]) != {k, j}
                    or not _on_stream(ops, prereqs[j], stream, before)
                    or not _on_stream(ops, dependents[j], stream, m)):
                continue
            for q in prereqs[j]:
                if q not in self.absorbed:  # (an absorbed one let go of its dependents)
                    dependents[q].remove(j)
            for d in dependents[j]:
                waiting[d] -= 1
            dependents[j] = []
            self.holds[m] = (k, closed)
            self.absorbed[j] = (k, closed)
            self.finished += 1

    def _beside_collective(self, op: Op, args: tuple, alone_s: float) -> float:
        """Compute op ``op``'s seconds beside the collective whose kernel holds some of the SMs while it runs
        (:meth:`ComputeModel.beside_collective_time`, the collective at its uncontended time)."""
        other, comm = self.ops[op.beside_of], self.comm[op.beside_of]
        sms = self.sim.held_sms(op.beside_sms, other.collective, other.ranks, other.nbytes, other.routing)
        if sms <= 0 or comm is None:
            return alone_s
        collective_s = comm.closed_form_s if comm.closed_form_s is not None else uncontended_s(comm.phases, self.net)
        reserved_s = self.sim.compute_time(*args[:SM_RESERVED], sms, *args[SM_RESERVED + 1:])
        return self.sim.compute.beside_collective_time(alone_s, reserved_s, collective_s)

    def _leads(self, compute: ComputeModel) -> tuple[list[float], dict[int, tuple[int, float]]]:
        """Each op's host time before it: for the first op of an action, the loop's own time
        (``ComputeModel.action_gap_s`` at the gradients the rank holds) plus the issue of each send the rank made
        since its last action (``send_issue_s``, likewise: the loop issues them before it moves on), and before a rank's
        first action the freeing of its last step's gradients (``zero_grad_s``); 0 for every other op. A program
        lists each rank's ops in the order its loop runs them. And, for each op whose lead holds sends' issues,
        the compute op after which the loop issued them and their seconds (see :meth:`_cover_issues`)."""
        lead = [0.0] * len(self.ops)
        sent_after: dict[int, tuple[int, float]] = {}
        held = self.program.gradients
        gaps = {rank: compute.action_gap_s(nbytes) for rank, (_, nbytes) in held.items()}
        issues = {rank: compute.send_issue_s(nbytes) for rank, (_, nbytes) in held.items()}
        default_gap, default_issue = compute.action_gap_s(), compute.send_issue_s()
        starts = {rank: compute.zero_grad_s(*grads) for rank, grads in held.items()}
        if not any((default_gap, default_issue, *gaps.values(), *issues.values(), *starts.values())):
            return lead, sent_after
        issued: dict[int, int] = {}  # rank -> sends since its last action
        last_compute: dict[int, int] = {}  # rank -> its latest op on the compute stream, which ends an action
        for op in self.ops:
            if op.kind == "send" and op.nbytes:
                issued[op.rank] = issued.get(op.rank, 0) + 1
            elif op.opens_action:
                issue_s = issues.get(op.rank, default_issue) * issued.pop(op.rank, 0)
                lead[op.id] = gaps.get(op.rank, default_gap) + issue_s + starts.pop(op.rank, 0.0)
                if issue_s and op.rank in last_compute:
                    sent_after[op.id] = (last_compute[op.rank], issue_s)
            if op.stream == "compute":
                last_compute[op.rank] = op.id
        return lead, sent_after

    def _cover_issues(self, i: int) -> None:
        """Op ``i``, whose lead holds sends' issues, is ready now. The loop issues a pass's sends as the pass ends,
        and only then waits for what its next action needs (a gradient all-reduce that a backward hook launched,
        which it waits for before the optimizer step): the time since that pass's end covers the issues, and only
        the rest of them delays the action."""
        after, issue_s = self.sent_after[i]
        if self.end[after] < 0:  # (not over: the op runs beside it, on another stream)
            return
        covered = min(issue_s, self.env.now - self.end[after])
        self.lead[i] -= covered
        if self.fixed[i] is not None:
            self.fixed[i] -= covered

    def _gradient_bytes(self, rank: int) -> float:
        """The bytes of gradients ``rank`` holds (0: not known)."""
        return self.program.gradients.get(rank, (0, 0.0))[1]

    def _plan_comms(self) -> None:
        """Give every send and collective its phases, and a closed form where it cannot contend.

        Ops on one (rank, stream) run one after another, so they never share a
        link at the same time; so do a rank's tensor-parallel collectives beside
        the compute and in line (:data:`ONE_STREAM`). A link that only one stream's ops ever use is
        therefore never contended, and an op whose links are all such links
        takes exactly its uncontended time: no need to simulate its flows. A
        ``negligible`` op (a few bytes: the checks before the optimizer step)
        takes its uncontended time, its latency, and leaves every link to the
        others.
        """
        sim = self.sim
        phases_of: dict[tuple, tuple[CommPhase, ...]] = {}  # by the identity of the op's group tuples
        uses: dict[tuple, int] = {}  # (rank, stream, op's comm key) -> index of that use
        use_of: list[tuple[int, int]] = []  # (op id, use index)
        for op in self.ops:
            kind = op.kind
            if kind != "collective" and kind != "send":
                continue
            receiver = self._gradient_bytes(op.ranks[1]) if kind == "send" else 0.0
            if op.negligible:
                phases = sim.comm_phases(kind, op.collective, op.ranks, (), op.nbytes, receiver,
                                         op.routing)  # no mirror flows
                self.comm[op.id] = _Comm(phases, uncontended_s(phases, self.net))
                continue
            use_key = (op.rank, ONE_STREAM.get(op.stream, op.stream), kind, op.collective, id(op.ranks),
                       id(op.mirrors), op.nbytes, op.routing)
            use = uses.get(use_key)
            if use is None:
                use = uses[use_key] = len(uses)
                key = use_key[2:]
                if key not in phases_of:
                    phases_of[key] = sim.comm_phases(kind, op.collective, op.ranks, op.mirrors, op.nbytes, receiver,
                                                     op.routing)
            use_of.append((op.id, use))
        if not uses:
            return
        streams: dict[tuple[int, str], int] = {}
        use_phases, use_stream = [], []
        for rank, stream, *key in uses:
            use_phases.append(phases_of[tuple(key)])
            use_stream.append(streams.setdefault((rank, stream), len(streams)))
        nstreams = len(streams)
        links = [unique_links(np.concatenate([p.links for p in phases]), sim.topo.num_links) for phases in use_phases]
        pairs = np.unique(np.concatenate([lk * nstreams + s for lk, s in zip(links, use_stream)]))
        contended = np.bincount(pairs // nstreams, minlength=sim.topo.num_links) > 1
        comms = []
        for lk, phases in zip(links, use_phases):
            closed = None
            if not contended[lk].any():
                closed = uncontended_s(phases, self.net)
            comms.append(_Comm(phases, closed))
        for i, use in use_of:
            self.comm[i] = comms[use]

    # -- scheduling ----------------------------------------------------------------
    def _begin(self, ready: list[int]) -> None:
        for i in ready:
            self._start(i)

    def _start(self, i: int) -> None:
        now = self.env.now
        hold = self.holds.pop(i, None)
        if hold is not None and self.start[hold[0]] + hold[1] > now:  # a join waiting for an absorbed collective
            self._after(self.start[hold[0]] + hold[1] - now, lambda: self._start(i))
            return
        self.start[i] = now
        if i in self.sent_after:
            self._cover_issues(i)
        if self.cores is not None and self.cores.shares(self.ops[i].rank):
            self._take_turn(i)
            return
        duration = self.fixed[i]
        if self.held is not None and self.ops[i].rank in self.held_ranks:
            if i in self.sms_of:
                if not self.ops[i].joins:  # (a joined collective holds its SMs once it runs: _join)
                    self._hold(i)
            elif duration is not None and self.ops[i].stream == "compute":
                self._start_chain(i, now)
                return
        if duration is not None:  # with the chain of ops that follow at once (see _link_prerequisites)
            last, end = self._chain_from(i, now + duration, count=True)
            self._after(end - now, lambda: self._finish(last))
        elif self.lead[i]:
            self._after(self.lead[i], lambda: self._proceed(i))
        else:
            self._proceed(i)

    # -- SMs held by side-stream collectives (parsim.sim.held_sms) ---------------------------
    def _holding_sms(self) -> dict[int, int]:
        """Op id -> SMs its NCCL kernel holds, for each data-parallel or FSDP collective on a side stream."""
        sms_of: dict[int, int] = {}
        known: dict[tuple, int] = {}  # by the identity of the op's group tuple
        for op in self.ops:
            if op.kind == "collective" and op.stream in HOLDING_STREAMS and not op.negligible:
                key = (op.collective, id(op.ranks), op.nbytes, op.routing)
                if key not in known:
                    known[key] = self.sim.kernel_sms(op.collective, op.ranks, int(op.nbytes), op.routing)
                if known[key]:
                    sms_of[op.id] = known[key]
        return sms_of

    def _slowdown(self, i: int, sms: int) -> float:
        """How many times as long compute op ``i`` takes with ``sms`` more SMs held (it runs on the rest)."""
        op = self.ops[i]
        key = (*_work_key(op), sms)
        ratio = self._slowdowns.get(key)
        if ratio is None:
            args = _time_args(op, False)
            alone = self.sim.compute_time(*args)
            held = self.sim.compute_time(*args[:SM_RESERVED], args[SM_RESERVED] + sms, *args[SM_RESERVED + 1:])
            ratio = self._slowdowns[key] = held / alone if alone > 0 else 1.0
        return ratio

    def _hold(self, i: int) -> None:
        """Collective ``i``'s kernel takes its SMs now: time its rank's compute again."""
        rank = self.ops[i].rank
        self.held.hold(rank, i, self.sms_of[i])
        self._retime(rank)

    def _timed(self, k: int) -> float:
        """Op ``k``'s seconds, a compute op's beside the SMs its rank's collectives hold now."""
        kind = self.ops[k].kind
        if kind != "compute" and kind != "optimizer":
            return self.fixed[k]
        return self.held.seconds(self.ops[k].rank, k, self.fixed[k])

    def _start_chain(self, i: int, now: float) -> None:
        """:meth:`_start` of a compute-stream op ``i`` of known duration, on a rank whose collectives hold SMs."""
        rank = self.ops[i].rank
        self.chain_head[rank] = i
        self.anchor[rank] = (i, now, self.fixed[i])
        last, end = self._chain_from(i, now + self._timed(i), count=True)
        self._chain_ends(rank, last, end)

    def _chain_from(self, last: int, end: float, count: bool) -> tuple[int, float]:
        """The ops chained after ``last`` (see _link_prerequisites), which ends at ``end``: each starts as the one
        before it ends (a join no sooner than its absorbed collective). Returns the chain's last op and its end;
        with ``count``, the others are counted finished (they end by the chain's timing alone)."""
        through, ends, starts, dependents, holds = self.through, self.end, self.start, self.dependents, self.holds
        # nothing held on the rank now: every op takes its fixed time (what _timed returns then), without the calls
        holding = self.held is not None and self.held.holding(self.ops[last].rank)
        timed = self._timed if holding else self.fixed.__getitem__
        chained = 0
        while through[last]:
            ends[last] = end
            chained += 1
            last = dependents[last][0]
            hold = holds.get(last)
            if hold is not None:
                end = max(end, starts[hold[0]] + hold[1])
            starts[last] = end
            end += timed(last)
        if count:
            self.finished += chained
        return last, end

    def _chain_ends(self, rank: int, last: int, end: float) -> None:
        """The rank's compute chain ends with op ``last`` at ``end``, unless it is timed again before that."""
        version = self.chain_end[rank][2] + 1 if rank in self.chain_end else 0
        self.chain_end[rank] = (last, end, version)
        self._after(end - self.env.now, lambda: self.chain_end[rank][2] == version and self._finish(last))

    def _retime(self, rank: int) -> None:
        """The SMs the rank's collectives hold changed: time the rest of its compute chain again from now. The op
        under way ran at one speed since it began or was last timed (``anchor``: op, time, work left then), so
        the share of that work still to do is the share of that stretch still ahead."""
        head = self.chain_head.get(rank)
        if head is None:
            return
        last, planned, _ = self.chain_end[rank]
        now = self.env.now
        if planned <= now:
            return
        timed, timed_at, work = self.anchor[rank]
        k = timed
        while k != last and self.end[k] <= now:
            k = self.dependents[k][0]
        ends, begun = planned if k == last else self.end[k], self.start[k]
        if k != timed:
            timed_at, work = begun, self.fixed[k]
        if begun >= now:  # not begun yet (a join waiting for its absorbed collective)
            end = begun + self._timed(k)
        elif self.ops[k].kind in ("compute", "optimizer"):
            work *= (ends - now) / (ends - timed_at)
            end, timed_at = now + self.held.seconds(rank, k, work), now
        else:
            end = ends
        self.anchor[rank] = (k, timed_at, work)
        self._chain_ends(rank, *self._chain_from(k, end, count=False))

    def _take_turn(self, i: int) -> None:
        """Op ``i`` of a rank that takes turns on its core: the loop's time before it (``lead``) and its compute
        run on the core (:class:`~parsim.sim.cores.SharedCores`); the op begins once the loop's time is done."""
        op = self.ops[i]

        def begin() -> None:
            self.start[i], self.lead[i] = self.env.now, 0.0
            if i in self.work:
                work, penalty = self.work[i]
                self.cores.run(op.rank, work, penalty, lambda: self._finish(i))
            else:
                self._proceed(i)

        if self.lead[i]:
            self.cores.run(op.rank, self.lead[i], self.lead_penalty[i], begin)
        else:
            begin()

    def _end(self, i: int) -> None:
        """Op ``i``, a receive, a collective or a send, is over; on a rank taking turns on its core it ends once
        the rank has the core again (gloo's side of each runs in the rank's process: leaving the sends out moved
        tiny DP x PP's phase misses over sets BT-CA from 57 to 59)."""
        rank = self.ops[i].rank
        if self.cores is not None and self.cores.shares(rank):
            self.cores.wake(rank, lambda: self._finish(i))
        else:
            self._finish(i)

    def _proceed(self, i: int) -> None:
        """Op ``i``, whose duration depends on others (a receive, a collective that may contend, compute that
        streams on a host's shared memory), begins now."""
        op = self.ops[i]
        if op.joins:
            self._join(i, op)
        elif op.kind == "recv":
            if self.end[op.match] >= 0:
                self._received(i, late=True)
            else:
                self.recv_of[op.match] = i
        elif op.kind == "collective" or op.kind == "send":
            self._phase(i, self.comm[i].phases, 0)
        elif i in self.beside:
            self._after(self.beside[i], lambda: self.memory.stream(op.rank, op.stream_bytes, lambda: self._finish(i)))
        else:
            raise ParsimError(f"op {op.name!r} on rank {op.rank} has unknown kind {op.kind!r}")

    def _join(self, i: int, op: Op) -> None:
        """Op ``i`` reached a collective it shares with other simulated ranks: the last to arrive runs it, and
        it ends for every one of them at once."""
        arrived = self.joined.setdefault(min(i, *op.joins), [])
        arrived.append(i)
        if len(arrived) <= len(op.joins):
            return
        comm = self.comm[i]
        if self.held is not None and i in self.sms_of:
            for j in arrived:
                self._hold(j)

        def end_all() -> None:
            for j in arrived:
                self._end(j)

        if comm.closed_form_s is not None:
            self._after(comm.closed_form_s, end_all)
        else:
            self._phase(i, comm.phases, 0, done=end_all)

    def _received(self, i: int, late: bool = False) -> None:
        """Receive ``i``'s data has arrived: it ends now, or, posted ``late`` (after the data could have
        arrived), after the host's rendezvous (``ComputeModel.rendezvous_s`` at the gradients the receiver holds:
        gloo moves a CPU rank's message only once its receiver asks; a receiver that waits has it after the send's
        latency)."""
        rendezvous = self._rendezvous_s.get(self.ops[i].rank, self._default_rendezvous_s)
        if late and rendezvous and self.ops[i].nbytes:
            self._after(rendezvous, lambda: self._end(i))
        elif self.cores is not None and self.cores.shares(self.ops[i].rank):
            self._end(i)
        elif self._draining:
            self._due.append(i)
        else:
            self._finish(i)

    def _phase(self, i: int, phases: tuple[CommPhase, ...], k: int, done: Callable[[], None] | None = None) -> None:
        """Run phase ``k`` of a collective (a send is one phase): latency, transfer, reduction; then ``done``
        (by default, op ``i`` ends)."""
        if k == len(phases):
            (done or (lambda: self._end(i)))()
            return
        phase = phases[k]
        next_phase = lambda: self._phase(i, phases, k + 1, done)  # noqa: E731
        then = (lambda: self._after(phase.reduce_s, next_phase)) if phase.reduce_s else next_phase
        self._after(phase.latency_s, lambda: self.net.start(phase.routes, phase.nbytes, then, phase.key))

    def _after(self, seconds: float, then: Callable[[], None]) -> None:
        if not seconds < math.inf:
            return  # never (a link without bandwidth): the op stays unfinished and the run reports it
        if seconds > 0:
            self.env.timeout(seconds).callbacks.append(lambda _event: then())
        else:
            then()

    def _finish(self, i: int) -> None:
        """End op ``i`` now and start whatever it was the last prerequisite of.

        Ops that end the instant they start (a receive whose send has arrived)
        are queued rather than finished recursively, so long chains of them
        cannot overflow the stack.
        """
        self._due.append(i)
        if self._draining:
            return
        self._draining = True
        now = self.env.now
        while self._due:
            j = self._due.popleft()
            self.end[j] = now
            self.finished += 1
            if self.held is not None and j in self.sms_of:
                self.held.release(self.ops[j].rank, j)
                self._retime(self.ops[j].rank)
            for d in self.dependents[j]:
                self.waiting[d] -= 1
                if self.waiting[d] == 0:
                    self._start(d)
            recv = self.recv_of.pop(j, None)
            if recv is not None:
                self._received(recv)
        self._draining = False
        if self.progress is not None and time.monotonic() > self._next_report:
            self._next_report = time.monotonic() + PROGRESS_EVERY_S
            self.progress(self.finished, len(self.ops))

    # -- result ----------------------------------------------------------------------
    def release(self) -> None:
        """Drop the run's state. Its network, cores and held SMs keep callbacks that refer back to it, so
        otherwise only the cyclic garbage collector would free its objects (1.4 million for the 1T plan: a
        second's collection)."""
        self.__dict__.clear()

    def trace(self, meta: dict | None, merged: bool = False) -> Trace:
        """The run's events in order of rank and start; ``merged``: each action's compute pieces joined into one
        span as they are written (:class:`~parsim.report.step_report.SpanMerger`)."""
        if self.finished < len(self.ops):
            raise ParsimError(_stall_message(self.program, self.end))
        ops, start, end = self.ops, self.start, self.end
        for j, (k, seconds) in self.absorbed.items():
            start[j], end[j] = start[k], start[k] + seconds
        # An op that opens an action starts after the host's time before it, which the trace leaves idle. No op
        # begins after it ends: a chained op's start is a sum of durations, its end the clock's time then, and the
        # two can differ in the last bit. Left so, an instant op would sort after the op that follows it on its
        # stream and seem to overlap it.
        ends = np.array(end)
        begins = np.minimum(np.array(start) + np.array(self.lead), ends)
        order = np.lexsort((begins, np.fromiter((op.rank for op in ops), dtype=np.int64, count=len(ops))))
        begins, durations = begins.tolist(), (ends - begins).tolist()
        # A receive holds the compute stream (what runs next needs its data), but it is a transfer: it is drawn
        # on the p2p track, where the executor records it too. Event args are built once per op shape (the
        # lowering's templates share their matmuls), copied per event.
        spans = SpanMerger() if merged else None
        events, args_of = [], {}
        for i in order.tolist():
            op = ops[i]
            key = (id(op.matmuls), _event_shape(op))
            args = args_of.get(key)
            if args is None:
                args = args_of[key] = _args(op)
            kind = op.kind
            stream = "p2p" if kind == "recv" else op.stream
            if spans is not None:
                spans.add(op.name, op.rank, stream, kind, begins[i], durations[i], args)
            else:
                events.append(Event(op.name, op.rank, stream, kind, begins[i], durations[i], args.copy()))
        meta = dict(meta or {})
        if self.held is not None:
            meta["held_sms_s"] = self._held_seconds()
        return Trace("simulated", self.program.world_size, spans.events if merged else events, meta)

    def _held_seconds(self) -> dict[str, float]:
        """Per rank whose collectives hold SMs, how much longer its compute ran beside them than alone (an op
        lengthened by less than a picosecond was only rounded)."""
        ops, start, end, fixed = self.ops, self.start, self.end, self.fixed
        out = {}
        for rank in sorted(self.held_ranks):
            longer = (end[i] - start[i] - fixed[i] for i in self.program.by_rank[rank]
                      if fixed[i] is not None and ops[i].stream == "compute"
                      and ops[i].kind in ("compute", "optimizer"))
            out[str(rank)] = sum(extra for extra in longer if extra > 1e-12)
        return out


class HostMemory:
    """The memory bandwidth of CPU hosts, shared by their ranks' streaming work
    (:attr:`ComputeModel.shares_host_memory <parsim.sim.compute.ComputeModel.shares_host_memory>`).

    Each rank's stream is a flow over two links: its own, at the speed one
    core reaches alone (shared when ranks time-share cores), and its host's,
    at the host's total with every core streaming. Max-min sharing on
    :class:`~parsim.hardware.network.Network` then gives a rank streaming alone its
    core's speed, and ranks streaming at once an equal share of the host's. A
    simulated rank's replicas on the same host (the data-, context- and
    tensor-parallel ranks that run its program at the same moment) stream
    beside it as flows of their own.
    """

    def __init__(self, env: simpy.Environment, topo: Topology, compute: ComputeModel, program: Program):
        self.world = program.world_size
        self.host_of = topo.node_of(np.arange(self.world))
        capacity = np.concatenate([np.full(self.world, compute.memory_alone_bw_Bps / compute.time_share),
                                   np.full(int(self.host_of.max()) + 1, compute.memory_host_bw_Bps)])
        self.net = Network(env, capacity, track_bytes=False)
        self.routes = {rank: self._routes(rank, replicas) for rank, replicas in program.replicas.items()}
        self._keys: dict[tuple[int, float], int] = {}

    def _routes(self, rank: int, replicas: tuple[int, ...]) -> np.ndarray:
        """(rank's link, host's link) of ``rank`` and of each of its ``replicas`` on its host."""
        together = np.asarray(replicas)
        together = together[self.host_of[together] == self.host_of[rank]]
        return np.stack([together, self.world + self.host_of[together]], axis=1)

    def stream(self, rank: int, nbytes: float, then: Callable[[], None]) -> None:
        """Stream ``nbytes`` on ``rank`` (and on each of its replicas on its host); ``then()`` when done."""
        routes = self.routes.get(rank)
        if routes is None:  # a program built without replicas: the rank alone
            routes = self.routes[rank] = self._routes(rank, (rank,))
        key = self._keys.setdefault((rank, nbytes), len(self._keys))
        self.net.start(routes, np.full(len(routes), nbytes), then, key)


def uncontended_s(phases: tuple[CommPhase, ...], net: Network) -> float:
    """Seconds of a send's or a collective's phases with no other transfer on their links: each phase's
    latency, its flows' solo trajectory (memoized by ``net``) and its reduction."""
    return sum(p.latency_s + net.solo_time(p.routes, p.nbytes, p.key) + p.reduce_s for p in phases)


# Streams whose collectives never overlap in time: a block joins its tensor-parallel collectives beside the
# compute before the compute stream issues its next one (parsim.lowering.tp_overlap), so for contention a
# rank's "tp" stream is its compute stream.
ONE_STREAM = {"tp": "compute"}


# ComputeModel.time's arguments in order: each an Op field of that name, but stream_apart (the caller's).
TIME_ARGS = tuple(inspect.signature(ComputeModel.time).parameters)[1:]
SM_RESERVED, _APART = TIME_ARGS.index("sm_reserved"), TIME_ARGS.index("stream_apart")
_op_work = attrgetter(*(name for name in TIME_ARGS if name != "stream_apart"))
# What the time reads of an op besides its matmuls and sm_bound, which ops of one shape share (the lowering's
# templates): with their identities, a key to the time of every op of that shape.
SCALAR_WORK = tuple(name for name in TIME_ARGS if name not in ("matmuls", "sm_bound", "stream_apart"))
_scalar_work = attrgetter(*SCALAR_WORK)


def _work_key(op: Op) -> tuple:
    """A key to compute op ``op``'s work: the identities of the tuples ops of one shape share, and the rest."""
    return id(op.matmuls), id(op.sm_bound), _scalar_work(op)


def _time_args(op: Op, stream_apart: bool) -> tuple:
    """Compute op ``op``'s arguments of :meth:`ComputeModel.time <parsim.sim.compute.ComputeModel.time>`, in order."""
    work = _op_work(op)
    return (*work[:_APART], stream_apart, *work[_APART:])


def _on_stream(ops: list[Op], ids, stream: str, but: int) -> bool:
    """Whether every op of ``ids`` other than ``but`` runs on ``stream``."""
    for q in ids:
        if q != but and ops[q].stream != stream:
            return False
    return True


def _stall_message(program: Program, end: list[float]) -> str:
    """Why a simulation stopped short: how many ops never ran, the first of them, and what it waits on."""
    stuck = [op for op in program.ops if end[op.id] < 0]
    first = stuck[0]
    waits = [program.ops[d].name for d in first.deps if end[d] < 0]
    if first.kind == "recv" and end[first.match] < 0:
        waits.append(program.ops[first.match].name)
    reason = f", waiting for {', '.join(repr(w) for w in waits[:3])}" if waits else \
        " (a transfer that never completes: a link with no bandwidth?)"
    return (f"simulation stalled: {len(stuck)} of {len(program.ops)} ops never finished; the first is "
            f"{first.name!r} on rank {first.rank}{reason}")


def _contending(links: list[np.ndarray], num_links: int) -> list[int]:
    """Indices of the link sets connected to the first through shared links (itself included).

    Mirror groups on links nobody else uses cannot change the representative's
    timing under max-min sharing, so only this connected part is simulated.
    A breadth-first search over sets and links, one array pass per step.
    """
    owner = np.repeat(np.arange(len(links)), [len(lk) for lk in links])  # the set of each entry of ``flat``
    flat = np.concatenate(links)
    reached = np.zeros(num_links, dtype=bool)
    reached[links[0]] = True
    kept = np.zeros(len(links), dtype=bool)
    kept[0] = True
    while True:
        touching = np.zeros(len(links), dtype=bool)
        touching[owner[reached[flat]]] = True
        new = touching & ~kept
        if not new.any():
            return np.flatnonzero(kept).tolist()
        kept |= new
        reached[flat[new[owner]]] = True


# What an op's event args read, besides its matmuls
_event_shape = attrgetter("kind", "phase", "flops", "attention_flops", "attention_grad_flops", "nbytes", "group",
                          "peer")


def _args(op: Op) -> dict:
    args = {"phase": op.phase}
    if op.kind in ("compute", "optimizer"):
        args["flops"] = (op.flops + op.attention_flops + op.attention_grad_flops
                         + sum(2.0 * m * n * k for m, n, k in op.matmuls))
    if op.nbytes:
        args["bytes"] = op.nbytes
    if op.group:
        args["group"] = op.group
    if op.peer >= 0:
        args["peer"] = op.peer
    return args
