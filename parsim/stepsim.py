"""Time a :class:`~parsim.program.Program` on the simulated cluster (simpy).

Every (rank, stream) pair is a simpy process that runs its ops in order; an op
starts when its stream is free and its ``deps`` have finished. Mirror flows
(replicas the representative stands for) are simulated only where they share
links with it, directly or through each other. Compute ops take
their roofline time; collectives and sends become flows on one shared
:class:`~parsim.network.Network`, so data-parallel all-reduces, tensor-parallel
all-reduces and pipeline sends that overlap in time contend for the same
links. The result is a :class:`~parsim.trace.Trace` in the schema the executor
writes.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import simpy

from .collectives.algorithms import Phase, build_phases
from .collectives.simulate import predict, simulate_phases
from .compute import ComputeModel
from .network import Network
from .program import Op, Program
from .topology import Topology
from .trace import Event, Trace


class StepSimulator:
    """Runs one program on one topology with one compute model."""

    def __init__(self, topo: Topology, compute: ComputeModel):
        self.topo, self.compute = topo, compute
        self._choose = lru_cache(maxsize=None)(self._choose_algorithm)
        self._phases = lru_cache(maxsize=None)(self._merged_phases)
        self._send_routes = lru_cache(maxsize=None)(self._pair_routes)

    def run(self, program: Program, meta: dict | None = None) -> Trace:
        env = simpy.Environment()
        net = Network(env, self.topo.capacity_Bps)
        done = [env.event() for _ in program.ops]
        events: list[Event] = []
        for rank in program.ranks:
            streams: dict[str, list[Op]] = {}
            for op in program.rank_ops(rank):
                streams.setdefault(op.stream, []).append(op)
            for ops in streams.values():
                env.process(self._stream(env, net, ops, done, events))
        env.run()
        unfinished = [op.name for op, ev in zip(program.ops, done) if not ev.triggered]
        if unfinished:
            raise RuntimeError(f"program deadlocked: {len(unfinished)} ops never ran, e.g. {unfinished[:3]}")
        events.sort(key=lambda e: (e.rank, e.start_s))
        return Trace("simulated", program.world_size, events, dict(meta or {}))

    def _stream(self, env, net, ops: list[Op], done: list[simpy.Event], events: list[Event]):
        for op in ops:
            if op.deps:
                yield simpy.AllOf(env, [done[d] for d in op.deps])
            start = env.now
            if op.kind == "recv":  # the receive lasts until its send has arrived
                yield done[op.match]
            if op.kind in ("compute", "optimizer"):
                yield env.timeout(self.compute.time(op.matmuls, op.flops, op.hbm_bytes, op.kernels))
            elif op.kind == "collective":
                yield env.process(self._collective(env, net, op))
            elif op.kind == "send":
                yield env.process(self._send(env, net, op))
            events.append(Event(op.name, op.rank, op.stream, op.kind, start, env.now - start, _args(op)))
            done[op.id].succeed()

    def _collective(self, env, net, op: Op):
        phases = self._phases(op.collective, op.ranks, op.mirrors, op.nbytes)
        yield env.process(simulate_phases(env, net, self.topo, phases, self.topo.spec.reduction_bw_Bps))

    def _merged_phases(self, collective: str, ranks: tuple[int, ...], mirrors: tuple[tuple[int, ...], ...],
                       nbytes: float) -> list[Phase]:
        """The group's phases plus the flows of the mirror groups that contend with it (cached:
        ops repeat every microbatch)."""
        algorithm = self._choose(collective, ranks, int(nbytes))
        per_group = [build_phases(self.topo, collective, algorithm, np.asarray(g), nbytes) for g in (ranks, *mirrors)]
        for phases in per_group:
            for phase in phases:
                phase.routes = self.topo.routes(phase.src, phase.dst)
        kept = [per_group[i] for i in _contending([_links(p) for p in per_group])]
        return [Phase(first.label, np.concatenate([p[i].src for p in kept]), np.concatenate([p[i].dst for p in kept]),
                      np.concatenate([p[i].nbytes for p in kept]), first.steps, first.reduce_bytes,
                      _stack([p[i].routes for p in kept]), first.overhead_s)
                for i, first in enumerate(kept[0])]

    def _send(self, env, net, op: Op):
        routes = self._send_routes(op.ranks, op.mirrors)
        latency = float(self.topo.path_latency_s(routes).max(initial=0.0))
        if latency:
            yield env.timeout(latency)
        yield net.transfer(routes, op.nbytes)

    def _pair_routes(self, ranks: tuple[int, ...], mirrors: tuple[tuple[int, ...], ...]) -> np.ndarray:
        """Routes of a send and of the mirrored sends that share links with it."""
        pairs = np.array([ranks, *mirrors])
        routes = self.topo.routes(pairs[:, 0], pairs[:, 1])
        return routes[_contending([set(r[r >= 0].tolist()) for r in routes])]

    def _choose_algorithm(self, collective: str, ranks: tuple[int, ...], nbytes: int) -> str:
        """The algorithm NCCL would pick for this collective alone (cached per group and size)."""
        return predict(self.topo, collective, nbytes, np.asarray(ranks)).algorithm


def _links(phases: list[Phase]) -> set[int]:
    return {int(link) for phase in phases for link in phase.routes.ravel() if link >= 0}


def _contending(link_sets: list[set[int]]) -> list[int]:
    """Indices of the sets connected to the first through shared links (itself included).

    Mirror groups on links nobody else uses cannot change the representative's
    timing under max-min sharing, so only this connected part is simulated.
    """
    kept, reached = [0], set(link_sets[0])
    rest = list(range(1, len(link_sets)))
    grew = True
    while grew:
        grew = False
        for i in list(rest):
            if link_sets[i] & reached:
                kept.append(i)
                reached |= link_sets[i]
                rest.remove(i)
                grew = True
    return sorted(kept)


def _stack(routes: list[np.ndarray]) -> np.ndarray:
    width = max(r.shape[1] for r in routes)
    return np.vstack([np.pad(r, ((0, 0), (0, width - r.shape[1])), constant_values=-1) for r in routes])


def _args(op: Op) -> dict:
    args = {"phase": op.phase}
    if op.kind in ("compute", "optimizer"):
        args["flops"] = op.flops + sum(2.0 * m * n * k for m, n, k in op.matmuls)
    if op.nbytes:
        args["bytes"] = op.nbytes
    if op.group:
        args["group"] = op.group
    if op.peer >= 0:
        args["peer"] = op.peer
    return args
