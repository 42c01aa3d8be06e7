"""Time a :class:`~parsim.program.Program` on the simulated cluster (simpy).

Every (rank, stream) pair is a simpy process that runs its ops in order; an op
starts when its stream is free and its ``deps`` have finished. Compute ops take
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
                yield env.timeout(self.compute.time(op.matmuls, op.flops, op.hbm_bytes))
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
        """The group's phases with its mirror groups' flows added (cached: ops repeat every microbatch)."""
        algorithm = self._choose(collective, ranks, int(nbytes))
        per_group = [build_phases(self.topo, collective, algorithm, np.asarray(g), nbytes) for g in (ranks, *mirrors)]
        return [Phase(first.label, np.concatenate([p[i].src for p in per_group]),
                      np.concatenate([p[i].dst for p in per_group]),
                      np.concatenate([p[i].nbytes for p in per_group]), first.steps, first.reduce_bytes)
                for i, first in enumerate(per_group[0])]

    def _send(self, env, net, op: Op):
        pairs = np.array([op.ranks, *op.mirrors])
        routes = self.topo.routes(pairs[:, 0], pairs[:, 1])
        latency = float(self.topo.path_latency_s(routes).max(initial=0.0))
        if latency:
            yield env.timeout(latency)
        yield net.transfer(routes, op.nbytes)

    def _choose_algorithm(self, collective: str, ranks: tuple[int, ...], nbytes: int) -> str:
        """The algorithm NCCL would pick for this collective alone (cached per group and size)."""
        return predict(self.topo, collective, nbytes, np.asarray(ranks)).algorithm


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
