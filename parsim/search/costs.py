"""What the fast model charges: the simulator's own pieces, priced once per shape.

:class:`CommCosts` times a collective or a send the way the step simulator
times one that nothing else contends with: its algorithm's phases (NCCL's
choice and protocol on clusters that describe NCCL), latency plus the flows'
uncontended transfer plus any reduction. Groups of the same shape (the same
local GPUs, node and scalable-unit offsets) cost the same, so each shape and
size is priced once.

:class:`PassCosts` times one pass (forward, backward, input- or
weight-gradient) of one entry (the embedding, a layer, the LM head) from the
pieces the lowering builds (:meth:`~parsim.lowering.lower.Lowering.layer_pass`): each
block's kernels at the compute model's rates, tensor-parallel collectives and
expert all-to-alls blocking the compute stream, context-parallel exchanges
overlapping the attention they serve, recomputed forwards before their
backward. Gradient accumulation is linear in the bytes per weight it streams
(:func:`~parsim.workload.plan.accumulation_bytes`: the dtypes, the microbatch count,
FSDP or not) and in the elements it reads or writes unvectorized, whose SM cycles
can outlast those bytes on a GPU (:func:`~parsim.workload.plan.accumulation_elements`);
it is priced once per byte and per element, and scaled.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Callable

import numpy as np
import simpy

from ..hardware.cluster import ClusterSpec
from ..hardware.network import Network, max_min_rates, stack_routes
from ..lowering.lower import CommPiece, Lowering
from ..sim.collectives.deepep import TokenRouting
from ..sim.compute import ComputeModel
from ..sim.stepsim import StepSimulator, uncontended_s
from ..workload.plan import Accumulation, Plan
from .tables import entry_types

# Where a pass's time on the compute stream goes (the step report's phases that compute-stream work fills).
PASS_PHASES = ("forward", "backward", "weight-grad", "recompute", "tp", "ep", "cp")
KINDS = ("F", "B", "I", "W")
ExchangeCost = Callable[[int, CommPiece], float]  # (entry type, a context-parallel exchange) -> seconds


class CommCosts:
    """Uncontended collective and send times on ``gpus`` GPUs of ``cluster`` (see the module docstring)."""

    def __init__(self, cluster: ClusterSpec, gpus: int, compute: ComputeModel):
        self.topo = cluster.build(max(1, gpus // cluster.gpus_per_node))
        self.sim = StepSimulator(self.topo, compute)
        self.net = Network(simpy.Environment(), self.topo.capacity_Bps, track_bytes=False)
        self._by_shape: dict[tuple, dict[float, float]] = {}
        self._shapes: dict[tuple[int, ...], tuple] = {}
        self._beside: dict[tuple, float] = {}

    def time(self, kind: str, collective: str, ranks: tuple[int, ...], nbytes: float,
             routing: TokenRouting | None = None) -> float:
        """Seconds for ``collective`` over ``ranks`` (``kind`` "send": ``ranks[0]`` sends to ``ranks[1]``;
        ``routing``: an expert all-to-all DeepEP runs)."""
        return self.pricer(kind, collective, ranks, routing)(nbytes)

    def pricer(self, kind: str, collective: str, ranks: tuple[int, ...],
               routing: TokenRouting | None = None) -> Callable[[float], float]:
        """:meth:`time` of one group for any size (the group's shape looked up once)."""
        if len(ranks) < 2 or (kind == "send" and ranks[0] == ranks[1]):
            return no_cost
        shape = self._shapes.get(ranks)
        if shape is None:
            group = np.asarray(ranks)
            nodes, units = self.topo.node_of(group), self.topo.unit_of(group)
            shape = self._shapes[ranks] = ((group % self.topo.gpus_per_node).tobytes(),
                                           (nodes - nodes[0]).tobytes(), (units - units[0]).tobytes())
        memo = self._by_shape.setdefault((kind, collective, shape, routing), {})

        def price(nbytes: float) -> float:
            seconds = memo.get(nbytes)
            if seconds is None:
                if not nbytes:
                    return 0.0
                phases = self.sim.comm_phases(kind, collective, ranks, (), nbytes, routing=routing)
                seconds = memo[nbytes] = uncontended_s(phases, self.net)
            return seconds
        return price

    def beside(self, collective: str, ranks: tuple[int, ...], nbytes: float, other: str,
               other_ranks: tuple[int, ...], other_bytes: float, kind: str = "collective") -> float:
        """Seconds for ``collective`` over ``ranks`` (``kind`` "send": a send from ``ranks[0]`` to
        ``ranks[1]``) while ``other`` (over ``other_ranks``) streams through the whole of it: each phase's
        uncontended time stretched by how much slower its slowest flow gets at the max-min rates it has
        beside the other's busiest phase (1 where they share no link)."""
        key = ("beside", kind, collective, ranks, nbytes, other, other_ranks, other_bytes)
        found = self._beside.get(key)
        if found is None:
            theirs = self.sim.comm_phases("collective", other, other_ranks, (), other_bytes)
            busy = max(theirs, key=lambda p: float(np.sum(p.nbytes))) if theirs else None
            found = 0.0
            for p in self.sim.comm_phases(kind, collective, ranks, (), nbytes):
                alone = self.net.solo_time(p.routes, p.nbytes, p.key)
                if busy is not None and alone > 0 and np.intersect1d(p.links, busy.links).size:
                    flows = len(p.routes)
                    both = max_min_rates(stack_routes([p.routes, busy.routes]), self.net.capacity)[:flows]
                    own = max_min_rates(p.routes, self.net.capacity)
                    with np.errstate(divide="ignore"):
                        alone *= float(np.max(p.nbytes / both) / np.max(p.nbytes / own))
                found += p.latency_s + alone + p.reduce_s
            self._beside[key] = found
        return found


def no_cost(nbytes: float) -> float:
    return 0.0


@dataclass(frozen=True)
class PassTable:
    """Per entry type (:func:`~parsim.search.tables.entry_types`) and pass kind (F, B, I, W), one
    microbatch's seconds on the compute stream.

    ``phases`` splits them by :data:`PASS_PHASES`, without gradient accumulation;
    ``accumulate`` is the accumulation's time per byte per weight and ``accumulate_sm`` its SM time per
    unvectorized element per weight: it takes the longer of the two, times a plan's
    :class:`~parsim.workload.plan.Accumulation`, in the pass's compute phase. ``trailing`` is
    the blocking communication after an entry's last kernel (its gradients are
    final before it).
    """

    phases: np.ndarray  # [types, 4, phases]
    accumulate: np.ndarray  # [types, 4]
    accumulate_sm: np.ndarray  # [types, 4]
    trailing: np.ndarray  # [types, 4]

    def accumulation_s(self, accumulation: Accumulation) -> np.ndarray:
        """[types, 4]: each entry's accumulation in a pass, per microbatch."""
        return accumulation.seconds(self.accumulate, self.accumulate_sm)

    def seconds(self, accumulation: Accumulation) -> np.ndarray:
        """[types, 4]: each entry's pass when its gradients join their sum as ``accumulation`` says."""
        return self.phases.sum(axis=2) + self.accumulation_s(accumulation)

    def phase_seconds(self, accumulation: Accumulation) -> np.ndarray:
        """[types, 4, phases]."""
        out = self.phases.copy()
        compute = out[..., :4].argmax(axis=2)  # the pass's own compute phase takes the accumulation
        np.put_along_axis(out, compute[..., None], np.take_along_axis(out, compute[..., None], axis=2)
                          + self.accumulation_s(accumulation)[..., None], axis=2)
        return out


class PassCosts:
    """Entry pass times for one search's plans, cached by what they depend on."""

    def __init__(self, compute: ComputeModel, comm: CommCosts):
        self.compute, self.comm = compute, comm
        self.compute_time = lru_cache(maxsize=None)(compute.time)
        self._tables: dict[tuple, PassTable] = {}

    def table(self, key: tuple, prototype: Callable[[], Plan], exchange: ExchangeCost | None = None,
              held_sms: int = 0) -> PassTable:
        """The passes of ``prototype()``'s entries, cached under ``key`` (what they depend on); the
        prototype is any plan with those settings whose accumulation streams bytes (its scale).
        ``exchange(entry, piece)`` prices context-parallel exchanges instead of :class:`CommCosts` alone;
        ``held_sms``: SMs a collective's kernel beside the whole pass holds (:mod:`parsim.sim.held_sms`)."""
        key += (held_sms,)
        cached = self._tables.get(key)
        if cached is None:
            cached = self._tables[key] = self._price(prototype(), exchange, held_sms)
        return cached

    def derived(self, key: tuple, make: Callable[[], PassTable]) -> PassTable:
        """A table made from others (``make``), cached under ``key``."""
        cached = self._tables.get(key)
        if cached is None:
            cached = self._tables[key] = make()
        return cached

    def _price(self, plan: Plan, exchange: ExchangeCost | None = None, held_sms: int = 0) -> PassTable:
        lowering = Lowering(plan)
        recomputed = {c.name for s in range(plan.num_stages) for c in plan.recomputed(s)}
        types = entry_types(plan)
        phases = np.zeros((len(types), len(KINDS), len(PASS_PHASES)))
        accumulate, accumulate_sm = np.zeros((len(types), len(KINDS))), np.zeros((len(types), len(KINDS)))
        trailing = np.zeros((len(types), len(KINDS)))
        for e, cost in enumerate(types):
            for k, kind in enumerate(KINDS):
                pieces = lowering.layer_pass(0, 0, cost, "R") if cost.name in recomputed and kind in "BI" else []
                phases[e, k], accumulate[e, k], accumulate_sm[e, k], trailing[e, k] = self.time_pieces(
                    pieces + lowering.layer_pass(0, 0, cost, kind), plan.accumulation,
                    None if exchange is None else partial(exchange, e), held_sms=held_sms)
        return PassTable(phases, accumulate, accumulate_sm, trailing)

    def time_pieces(self, pieces, accumulation: Accumulation, exchange: Callable[[CommPiece], float] | None = None,
                    exposure: list[dict] | None = None,
                    held_sms: int = 0) -> tuple[np.ndarray, float, float, float]:
        """Seconds of ``pieces`` on the compute stream by phase, the accumulation's per byte per weight and per
        unvectorized element per weight (the pieces accumulate as ``accumulation`` says), and the blocking
        communication after the last kernel: collectives in line, or on their side stream (context-parallel
        exchanges, overlapped tensor-parallel collectives) from the op before them until their stream's
        next join, whose wait counts in that group's phase. ``exposure``, if given, receives one row per
        collective: the piece, its seconds alone and the seconds it holds the compute stream up. ``held_sms``:
        SMs a side stream's collective holds all along, which the pieces' kernels do without (``sm_reserved``)."""
        phases = np.zeros(len(PASS_PHASES))
        t = last_kernel = accumulate = accumulate_sm = 0.0
        free = {"cp": 0.0, "tp": 0.0}  # when each side stream finishes what it was given
        pending: dict[str, list[float]] = {"cp": [], "tp": []}
        waiting: dict[str, list[dict]] = {"cp": [], "tp": []}  # exposure rows of each side stream before its join
        rows = exposure if exposure is not None else []
        last_beside: tuple[CommPiece, float] | None = None  # the last collective beside, and its seconds
        for piece in pieces:
            if type(piece) is CommPiece:
                if piece.group == "cp" and exchange is not None:
                    cost = exchange(piece)
                else:
                    cost = self.comm.time("collective", piece.collective, piece.ranks, piece.nbytes, piece.routing)
                rows.append({"piece": piece, "alone_s": cost, "exposed_s": 0.0 if piece.beside else cost})
                if piece.beside:
                    free[piece.stream] = max(t, free[piece.stream]) + cost
                    pending[piece.stream].append(free[piece.stream])
                    waiting[piece.stream].append(rows[-1])
                    last_beside = (piece, cost)
                else:
                    t += cost
                    phases[PASS_PHASES.index(piece.group)] += cost
                continue
            if piece.joins:
                wait = max(max(pending[piece.joins], default=t) - t, 0.0)
                t += wait
                phases[PASS_PHASES.index(piece.joins)] += wait
                if wait and waiting[piece.joins]:  # the stream's last collective is the one still running
                    waiting[piece.joins][-1]["exposed_s"] += wait
                pending[piece.joins], waiting[piece.joins] = [], []
                continue
            acc = piece.stream_bytes

            def seconds_on(sm_reserved: int) -> float:
                return self.compute_time(piece.matmuls, 0.0, piece.hbm_bytes - acc, piece.kernels,
                                         piece.attention_flops, piece.attention_grad_flops, piece.forward_ops,
                                         piece.backward_ops, 0, 0.0, sm_reserved + held_sms, piece.high_precision,
                                         piece.sm_bound, tp_calls=piece.tp_calls)
            seconds = seconds_on(piece.sm_reserved)
            if piece.beside_sms is not None:  # beside the last collective, whose kernel holds SMs while it runs
                other, other_s = last_beside
                sms = self.comm.sim.held_sms(piece.beside_sms, other.collective, other.ranks, other.nbytes,
                                             other.routing)
                if sms > 0:
                    seconds = self.compute.beside_collective_time(seconds, seconds_on(sms), other_s)
            if acc:  # adding the gradients into their sum takes the longer of its bytes and its SM cycles
                extra = self.compute_time((), 0.0, acc, 0, 0.0, 0.0, 0, 0, 0, acc)
                cycles = self.compute.unvectorized_s(piece.accumulate_elements)
                accumulate += extra / accumulation.bytes
                if cycles:
                    accumulate_sm += cycles / accumulation.elements
                t += max(extra, cycles)
            t += seconds
            phases[PASS_PHASES.index(piece.phase)] += seconds
            last_kernel = t
        return phases, accumulate, accumulate_sm, t - last_kernel
