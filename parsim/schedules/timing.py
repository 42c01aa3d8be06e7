"""Ideal timing of a schedule: when each pass runs if only dependencies and order hold it back.

Every rank runs its list in order; a pass starts when its rank is free and
every pass it depends on has finished, plus ``t_comm`` when that pass ran on
another rank (a point-to-point transfer; same-rank hand-offs are free). No
contention, no launch overheads: this is the schedule's own cost, the number
the closed forms describe (bubble ``(p-1)/(m+p-1)`` for GPipe and 1F1B).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple, Sequence

from ..errors import ParsimError
from ..report.trace import Event, Trace, compute_name, p2p_name
from .checks import dependencies, execution_order
from .core import Action, Schedule

Times = float | Sequence[float]


class Interval(NamedTuple):
    """One pass on one rank, busy from ``start`` to ``end``."""

    start: float
    end: float
    action: Action


@dataclass(frozen=True)
class IdealTiming:
    """Result of :func:`simulate_ideal`.

    ``intervals[r]`` are rank ``r``'s busy intervals in execution order.
    ``step_time`` is the makespan: from 0 to the end of the last pass on any
    rank (every rank waits for the slowest before the optimizer step). A
    rank's idle time is ``step_time`` minus its busy time; its bubble fraction
    is idle / ``step_time``.
    """

    schedule: Schedule
    intervals: list[list[Interval]]
    step_time: float
    t_comm: float
    time_unit: str = "s"

    @cached_property  # callers index it rank by rank: once per timing, not once per rank
    def busy(self) -> list[float]:
        """Per rank, the total time spent in passes."""
        return [sum(iv.end - iv.start for iv in ivs) for ivs in self.intervals]

    @property
    def idle(self) -> list[float]:
        """Per rank, the bubble time: ``step_time`` minus busy time."""
        return [self.step_time - b for b in self.busy]

    @property
    def bubble_fractions(self) -> list[float]:
        """Per rank, idle / step time."""
        return [i / self.step_time for i in self.idle]

    @property
    def bubble_fraction(self) -> float:
        """Overall: all ranks' idle time / (ranks x step time)."""
        return sum(self.idle) / (self.schedule.pp * self.step_time)

    def to_trace(self) -> Trace:
        """The timing as a :class:`~parsim.report.trace.Trace` (``source="simulated"``).

        Each pass is an event on stream ``compute`` named like the executor
        names it (``F stage=1 mb=3``). With ``t_comm > 0``, every transfer to
        another rank is a ``send`` event on stream ``p2p`` (``send act`` for
        activations, ``send grad`` for input gradients).
        """
        s = self.schedule
        events = []
        for rank, ivs in enumerate(self.intervals):
            for iv in ivs:
                a = iv.action
                events.append(Event(compute_name(a.kind, a.stage, a.microbatch), rank, "compute", "compute",
                                    iv.start, iv.end - iv.start,
                                    {"phase": a.kind, "stage": a.stage, "mb": a.microbatch}))
        if self.t_comm > 0:
            end = {iv.action: iv.end for ivs in self.intervals for iv in ivs}
            for rank, ivs in enumerate(self.intervals):
                for iv in ivs:
                    for dep in dependencies(s, iv.action):
                        src = s.stage_to_rank(dep.stage)
                        if src != rank:
                            what = "act" if dep.kind == "F" else "grad"
                            events.append(Event(p2p_name("send", what, dep.stage, dep.microbatch, rank), src,
                                                "p2p", "send", end[dep], self.t_comm,
                                                {"peer": rank, "stage": dep.stage, "mb": dep.microbatch}))
        events.sort(key=lambda e: (e.rank, e.start_s, e.stream))
        meta = {"schedule": s.name, "pp": s.pp, "microbatches": s.num_microbatches,
                "virtual_stages": s.virtual_stages, "step_time": self.step_time,
                "bubble_fraction": self.bubble_fraction, "time_unit": self.time_unit}
        return Trace(source="simulated", world_size=s.pp, events=events, meta=meta)


def simulate_ideal(schedule: Schedule, t_f: Times, t_b: Times, t_w: Times = 0.0, t_comm: float = 0.0,
                   time_unit: str = "s") -> IdealTiming:
    """Time ``schedule`` by dependency-driven execution.

    ``t_f`` and ``t_b`` are the forward and *full* backward times of one
    microbatch on one (virtual) stage: a number, or one per stage. ``t_w``
    is the part of ``t_b`` that computes weight gradients: schedules that
    split the backward run ``I`` for ``t_b - t_w`` and ``W`` for ``t_w``, so
    every schedule does the same work ``m (t_f + t_b)`` per stage. ``t_comm``
    is added to every dependency between different ranks. ``time_unit`` only
    labels the result (seconds by default; "units" for textbook examples).
    Raises :class:`ParsimError` for negative times or ``t_w > t_b``, and
    :class:`~parsim.schedules.checks.ScheduleError` if the schedule deadlocks.
    """
    n = schedule.num_stages
    tf, tb, tw = (_per_stage(t, n, label) for t, label in ((t_f, "t_f"), (t_b, "t_b"), (t_w, "t_w")))
    for s in range(n):
        if tw[s] > tb[s]:
            raise ParsimError(f"t_w ({tw[s]:g}) is part of the backward and cannot exceed t_b ({tb[s]:g})"
                              + (f" on stage {s}" if n > 1 else ""))
    if t_comm < 0:
        raise ParsimError(f"t_comm must be >= 0, got {t_comm:g}")
    duration = {"F": tf, "B": tb, "I": [b - w for b, w in zip(tb, tw)], "W": tw}

    end: dict[Action, float] = {}
    free = [0.0] * schedule.pp
    intervals: list[list[Interval]] = [[] for _ in range(schedule.pp)]
    for action in execution_order(schedule):
        rank = schedule.stage_to_rank(action.stage)
        start = free[rank]
        for dep in dependencies(schedule, action):
            hop = t_comm if schedule.stage_to_rank(dep.stage) != rank else 0.0
            start = max(start, end[dep] + hop)
        end[action] = free[rank] = start + duration[action.kind][action.stage]
        intervals[rank].append(Interval(start, end[action], action))
    step_time = max(free)
    if step_time <= 0:
        raise ParsimError("all pass times are zero: nothing to time")
    return IdealTiming(schedule, intervals, step_time, t_comm, time_unit)


def _per_stage(value: Times, n: int, label: str) -> list[float]:
    values = [float(value)] * n if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != n:
        raise ParsimError(f"{label} needs one time per stage: {n} values, got {len(values)}")
    if any(v < 0 for v in values):
        raise ParsimError(f"{label} must be >= 0, got {min(values):g}")
    return values
