"""What a training step costs, from a trace: time by phase per rank and bubbles.

Works the same on a simulated and a measured :class:`~parsim.report.trace.Trace`, so
``parsim compare`` can put the two side by side. Per rank, the step splits into
phases that never double count:

* ``forward``, ``backward``, ``weight-grad``, ``recompute`` (a forward rerun
  for the backward): compute spans, minus the tensor-parallel collectives
  nested inside them;
* ``tp``: tensor-parallel collectives on the compute stream (they block it),
  and those overlapped with GEMMs (stream ``tp``, :mod:`parsim.lowering.tp_overlap`)
  where the compute stream waits for them;
* ``ep``: mixture-of-experts all-to-alls, dispatch and combine (they block compute);
* ``cp``: context-parallel K/V exchanges not hidden behind the attention they
  overlap (the compute stream waits for them);
* ``pp``: waiting for a pipeline receive (transfer time plus the pipeline bubble);
* ``dp``: data-parallel gradient all-reduce time *not* hidden behind the compute
  stream (compute, tensor-parallel collectives, receives);
* ``fsdp``: FSDP's weight all-gathers and gradient reduce-scatters hidden by
  neither the compute stream nor ``dp`` (on a CPU host they run in line, on
  the compute stream, and count whole);
* ``optimizer``; and ``idle``: the rest of the step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .trace import Event, Trace, by_rank_and_start, by_start

PHASES = ("forward", "backward", "weight-grad", "recompute", "tp", "ep", "cp", "pp", "dp", "fsdp", "optimizer", "idle")
BLOCKING = ("tp", "ep")  # collectives run on the compute stream, between a pass's block computes
HIDEABLE = ("cp", "tp", "ep", "dp", "fsdp")  # communication beside the compute stream, in the order it is exposed
# the streams of tensor-parallel collectives hidden behind GEMMs, and of paired passes' all-to-alls
# (ep_comm_overlap): they block nothing
SIDE_STREAMS = ("tp", "ep")


def blocks_compute(e: Event) -> bool:
    """Whether ``e`` is a collective the compute stream stops for: a tensor-parallel or expert one in line, or
    any collective on the compute stream itself (FSDP's on a CPU host, run to its end inside the hook that
    issues it: :func:`parsim.lowering.lower.lower`'s ``fsdp_in_line``, :mod:`executor.train.fsdp`)."""
    return stops_compute(e.args.get("phase"), e.stream, e.kind)


def stops_compute(phase: str | None, stream: str, kind: str) -> bool:
    """:func:`blocks_compute` of an event of this ``phase``, ``stream`` and ``kind``."""
    return (phase in BLOCKING and stream not in SIDE_STREAMS) or (stream == "compute" and kind == "collective")


def merge_spans(trace: Trace) -> Trace:
    """Join consecutive compute pieces of one action (same rank and name) into one span.

    The simulator splits a forward into blocks around tensor-parallel collectives;
    the executor times the whole action. Merged, both have one span per action
    that includes its nested collectives. Where the compute stream waited inside
    the action (for a context-parallel exchange or an overlapped tensor-parallel
    collective), the span keeps the wait as a gap (``args["gaps"]``): it counts
    towards what the stream waited for, not towards compute (:func:`busy_parts`).
    """
    spans = SpanMerger()
    for e in sorted(trace.events, key=by_rank_and_start):
        spans.add(e.name, e.rank, e.stream, e.kind, e.start_s, e.dur_s, e.args)
    return Trace(trace.source, trace.world_size, spans.events, dict(trace.meta))


class SpanMerger:
    """:func:`merge_spans` one event at a time, in order of rank and start: the simulator merges a step's ops as
    it writes its trace (a frontier step's 856,518 ops into 591,878 events), without an event for each piece."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._open: dict[int, Event] = {}  # rank -> the compute span still open
        self._busy_until: dict[int, float] = {}  # when the rank's compute stream last stopped working

    def add(self, name: str, rank: int, stream: str, kind: str, start: float, dur: float, args: dict) -> None:
        """The next event (its ``args`` are copied where an event keeps them)."""
        end = start + dur
        busy_until = self._busy_until
        if kind != "compute":
            if stops_compute(args.get("phase"), stream, kind):  # nested in the pass: does not end the span
                busy_until[rank] = max(busy_until.get(rank, 0.0), end)
            else:
                self._open.pop(rank, None)
            self.events.append(Event(name, rank, stream, kind, start, dur, args.copy()))
            return
        span = self._open.get(rank)
        if span is not None and span.name == name:
            idle = busy_until.get(rank, span.start_s + span.dur_s)
            if start > idle:
                span.args.setdefault("gaps", []).append((idle, start))
            span.dur_s = end - span.start_s
            span.args["flops"] = span.args.get("flops", 0.0) + args.get("flops", 0.0)
        else:
            span = self._open[rank] = Event(name, rank, stream, kind, start, dur, dict(args))
            self.events.append(span)
        busy_until[rank] = max(busy_until.get(rank, 0.0), end)


def busy_parts(e: Event) -> list[tuple[float, float]]:
    """The intervals of ``e`` its stream was working: all of it, less a merged span's gaps."""
    parts, start = [], e.start_s
    for gap_start, gap_end in e.args.get("gaps", ()):
        parts.append((start, gap_start))
        start = gap_end
    parts.append((start, e.end_s))
    return parts


@dataclass
class RankBreakdown:
    rank: int
    step_s: float
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    # phase -> (least, most) seconds over several measured steps (:func:`median_breakdown`; empty: one step)
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)

    def fraction(self, phase: str) -> float:
        return self.seconds.get(phase, 0.0) / self.step_s if self.step_s else 0.0


def step_time(trace: Trace) -> float:
    return max((e.start_s + e.dur_s for e in trace.events), default=0.0)  # Event.end_s, without its call


def breakdown(trace: Trace) -> list[RankBreakdown]:
    """Time by phase for every rank in the trace (the whole step is each rank's denominator)."""
    total = step_time(trace)
    by_rank: dict[int, list[Event]] = {}
    for e in trace.events:
        by_rank.setdefault(e.rank, []).append(e)
    rows = []
    for rank in sorted(by_rank):
        seconds = {p: 0.0 for p in PHASES}
        tp, computes = [], []
        spans: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in ("busy", *HIDEABLE)}
        busy = spans["busy"]
        for e in by_rank[rank]:  # one pass: sort each event into what it counts towards
            kind, phase = e.kind, e.args.get("phase")
            if blocks_compute(e):  # time under them is busy
                tp.append(e)
                target = busy
            elif phase in HIDEABLE:
                target = spans[phase]
            elif kind == "compute":
                target = busy
            elif kind in ("recv", "optimizer") or phase == "optimizer":  # the optimizer waits for its collectives
                seconds["pp" if kind == "recv" else "optimizer"] += e.dur_s
                target = busy
            else:
                continue
            if kind == "compute":
                computes.append(e)
                if "gaps" in e.args:
                    for start, end in busy_parts(e):
                        target[0].append(start)
                        target[1].append(end)
                    continue
            target[0].append(e.start_s)
            target[1].append(e.start_s + e.dur_s)
        tp.sort(key=by_start)
        computes.sort(key=by_start)
        for e, nested in zip(computes, _nested_time(computes, tp)):
            waited = sum(end - start for start, end in e.args.get("gaps", ()))
            seconds[e.args.get("phase", "forward")] += max(e.dur_s - nested - waited, 0.0)
        for e in tp:
            seconds[e.args["phase"]] += e.dur_s
        # Exposed time, in order: context-parallel exchanges and overlapped tensor-parallel collectives hold
        # the compute stream itself, then paired passes' all-to-alls, gradient reductions, FSDP's gathers and
        # reductions, each counting only what the ones before leave uncovered.
        covered, layers = _covered(busy), busy
        for phase in HIDEABLE:
            layers = (layers[0] + spans[phase][0], layers[1] + spans[phase][1])
            more = _covered(layers)
            seconds[phase], covered = seconds[phase] + more - covered, more
        seconds["idle"] = max(total - covered, 0.0)
        rows.append(RankBreakdown(rank, total, seconds))
    return rows


def median_step(traces: list[Trace]) -> int:
    """Which of several measured steps is the median one by step time (the lower middle one for an even count)."""
    times = [step_time(trace) for trace in traces]
    return sorted(range(len(traces)), key=times.__getitem__)[(len(traces) - 1) // 2]


def median_breakdown(traces: list[Trace], group_of: Mapping[int, int] | None = None,
                     breakdowns: list[list[RankBreakdown]] | None = None) -> list[RankBreakdown]:
    """Each rank's time by phase over several measured steps: per phase, its median over the steps (the whole
    step: the :func:`median_step`'s time), and the least and most any step spent on it. One step's idle swings
    with which rank happened to end last (on the 2-core VM a rank waited for the other 0.04 ms at the median
    step and 6.9 ms at the 90th percentile); the median over the steps is what a typical step spends on each,
    the range how far one step may stray from it. ``breakdowns``: each trace's :func:`breakdown`, where already
    computed.

    With ``group_of`` (rank -> group of ranks that do the same work, e.g. a pipeline stage's data-, tensor- and
    context-parallel ranks), one row per group instead (its ``rank`` the group): each phase's median over the
    steps of the group's mean in that step. Twins that share a core, or meet in a collective, swap from step to
    step which of them waits: one step's `dp` may be 0.1 ms on one and 11 ms on the other, the next the other
    way round. Each twin's median then lands on either side of that split at random, while their mean in each
    step does not: it is what the group spends on the phase, whichever of them spends it."""
    per_step: dict[int, dict[str, list[float]]] = {}  # group -> phase -> its mean in each step
    for rows in breakdowns if breakdowns is not None else map(breakdown, traces):
        sums: dict[int, list] = {}  # group -> [ranks, phase -> seconds]
        for row in rows:
            group = row.rank if group_of is None else group_of[row.rank]
            ranks_and_totals = sums.setdefault(group, [0, dict.fromkeys(PHASES, 0.0)])
            ranks_and_totals[0] += 1
            for phase in PHASES:
                ranks_and_totals[1][phase] += row.seconds[phase]
        for group, (ranks, totals) in sums.items():
            seen = per_step.setdefault(group, {phase: [] for phase in PHASES})
            for phase in PHASES:
                seen[phase].append(totals[phase] / ranks)
    step_s = step_time(traces[median_step(traces)])
    return [RankBreakdown(group, step_s, {phase: float(np.median(v)) for phase, v in means.items()},
                          {phase: (min(v), max(v)) for phase, v in means.items()})
            for group, means in sorted(per_step.items())]


def comm_overlap(trace: Trace) -> dict[int, float | None]:
    """Per rank, the share of communication time during which the rank also computes (None: no communication).

    Holistic Trace Analysis's *comm/comp overlap*: the union of communication spans (collectives, sends,
    receives) against the union of compute spans, where compute excludes the tensor-parallel and expert
    collectives that block it. One sweep over every span's start and end.
    """
    out: dict[int, float | None] = {}
    for rank in sorted({e.rank for e in trace.events}):
        kinds: dict[str, list[tuple[float, float]]] = {"comm": [], "compute": [], "blocked": []}
        for e in trace.for_rank(rank):
            if e.kind in ("collective", "send", "recv"):
                kinds["comm"].append((e.start_s, e.end_s))
                if blocks_compute(e):
                    kinds["blocked"].append((e.start_s, e.end_s))
            elif e.kind in ("compute", "optimizer"):
                kinds["compute"] += busy_parts(e)
        times, depth = _sweep(kinds)
        seconds = np.diff(times)
        comm, computing = depth["comm"][:-1] > 0, (depth["compute"][:-1] > 0) & (depth["blocked"][:-1] == 0)
        comm_s = float(seconds[comm].sum())
        out[rank] = float(seconds[comm & computing].sum()) / comm_s if comm_s else None
    return out


def _sweep(kinds: dict[str, list[tuple[float, float]]]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Every span boundary in time order, and per kind how many of its spans are open from each boundary on."""
    times = np.array([t for spans in kinds.values() for span in spans for t in span])
    order = np.argsort(times, kind="stable")
    depth, offset = {}, 0
    for kind, spans in kinds.items():
        step = np.zeros(len(times))
        step[offset:offset + 2 * len(spans)] = np.tile([1.0, -1.0], len(spans))
        depth[kind] = np.cumsum(step[order])
        offset += 2 * len(spans)
    return times[order], depth


def _nested_time(spans: list[Event], inner: list[Event]) -> list[float]:
    """For each span (sorted by start), the time of the ``inner`` events (sorted) overlapping it.

    One sweep: inner events that end before a span starts can overlap no later span.
    """
    inner_starts = [e.start_s for e in inner]
    inner_ends = [e.start_s + e.dur_s for e in inner]
    out, first, count = [], 0, len(inner)
    for span in spans:
        start, end = span.start_s, span.start_s + span.dur_s
        while first < count and inner_ends[first] <= start:
            first += 1
        nested, j = 0.0, first
        while j < count and inner_starts[j] < end:
            nested += max(0.0, min(end, inner_ends[j]) - max(start, inner_starts[j]))
            j += 1
        out.append(nested)
    return out


def _covered(spans: tuple[list[float], list[float]]) -> float:
    """Seconds covered by the union of intervals given as (starts, ends)."""
    if not spans[0]:
        return 0.0
    starts, ends = np.array(spans[0]), np.array(spans[1])
    order = np.argsort(starts, kind="stable")
    starts, reach = starts[order], np.maximum.accumulate(ends[order])
    # A new stretch begins where an interval starts after everything before it has ended.
    first = np.flatnonzero(np.concatenate([[True], starts[1:] > reach[:-1]]))
    last = np.concatenate([first[1:] - 1, [len(starts) - 1]])
    return float((reach[last] - starts[first]).sum())
