"""Dependencies between passes, a deadlock check, and activation memory.

The data dependencies of a pipeline (stage ``s`` of ``S``, microbatch ``i``):

- ``F(s, i)`` needs ``F(s-1, i)`` (the activations it consumes);
- ``B(s, i)`` and ``I(s, i)`` need ``F(s, i)`` (its saved activations) and the
  input-gradient pass of ``(s+1, i)``, which is ``B`` or ``I`` (the last stage
  starts its backward from its own forward, through the loss);
- ``W(s, i)`` needs ``I(s, i)`` (the output gradient ``I`` received).

Each rank runs its list strictly in order, so a schedule deadlocks when the
heads of all unfinished lists wait on passes behind other heads.
"""

from __future__ import annotations

from collections import Counter

from ..errors import ParsimError
from .core import KINDS, Action, Schedule


class ScheduleError(ParsimError):
    """A schedule that is incomplete, misplaced, or cannot run to the end."""


def validate(schedule: Schedule) -> None:
    """Check that every pass appears exactly once, on its stage's owner, and that the schedule runs to the end.

    Per (stage, microbatch) a schedule needs one ``F`` and either one ``B``
    or one ``I`` and one ``W`` (DualPipe-V splits some backwards and not
    others). Raises :class:`ScheduleError` otherwise.
    """
    execution_order(schedule)


def execution_order(schedule: Schedule) -> list[Action]:
    """All actions in an order that respects every dependency and each rank's list order.

    Ranks take turns running the head of their list as soon as its
    dependencies are done. Raises :class:`ScheduleError` naming what each
    stuck rank waits for if no rank can make progress before all lists end.
    """
    _check_complete(schedule)
    done: set[Action] = set()
    heads = [0] * schedule.pp
    order: list[Action] = []
    total = sum(len(a) for a in schedule.actions)
    while len(order) < total:
        progressed = False
        for rank, acts in enumerate(schedule.actions):
            while heads[rank] < len(acts) and all(d in done for d in dependencies(schedule, acts[heads[rank]])):
                action = acts[heads[rank]]
                done.add(action)
                order.append(action)
                heads[rank] += 1
                progressed = True
        if not progressed:
            raise ScheduleError(_deadlock_message(schedule, heads, done))
    return order


def dependencies(schedule: Schedule, action: Action) -> list[Action]:
    """The passes ``action`` needs finished before it can start (see the module docstring)."""
    s, i = action.stage, action.microbatch
    if action.kind == "F":
        return [Action("F", s - 1, i)] if s > 0 else []
    if action.kind == "W":
        return [Action("I", s, i)]
    deps = [Action("F", s, i)]
    if s + 1 < schedule.num_stages:
        deps.append(Action(schedule.input_gradient_pass(s + 1, i), s + 1, i))
    return deps


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per rank, the most (stage, microbatch) pairs whose forward ran and whose input-gradient pass has not.

    A pair is in flight from the end of its ``F`` to the end of its ``B``, or
    of its ``I`` in split schedules: that is when the stage's saved activations
    are freed, but for what a deferred ``W`` still needs (its linears' inputs and
    output gradients, :func:`in_flight_by_stage` counts them apart). This is the
    activation memory of a rank in units of one stage's activations for one
    microbatch: 1F1B gives ``pp - r`` on rank ``r``, GPipe gives ``m``. With
    ``v`` stages per rank each unit holds ``1/v`` of the rank's layers.
    Depends only on the per-rank order, not on timing.
    """
    peaks = []
    for acts in schedule.actions:
        live = peak = 0
        for a in acts:
            if a.kind == "F":
                live += 1
                peak = max(peak, live)
            elif a.kind in ("B", "I"):
                live -= 1
        peaks.append(peak)
    return peaks


def in_flight_by_stage(schedule: Schedule) -> list[list[tuple[int, ...]]]:
    """Per rank, right after each of its forwards (the moments its activation memory may peak), the counts of
    (stage, microbatch) pairs in flight on each of its stages (as :func:`peak_in_flight` counts them), in
    increasing stage order, then of those on each stage whose input gradient ran and whose deferred weight
    gradient has not (split schedules; zeros elsewhere): ``2 x`` the rank's stages per tuple. A pair waiting on
    its ``W`` keeps the inputs of the stage's linears and their output gradients, nearly all of what its ``B``
    needed (Qi et al. 2023, table 1: ``32sbh`` of ``34sbh``), so zero-bubble's later ranks hold about as much as
    its first. Only tuples no other moment exceeds everywhere are kept: whatever each stage holds per
    microbatch, the rank's peak is ``max(sum(n * held) for counts)``, the stages weighed by what each holds."""
    out = []
    for rank, acts in enumerate(schedule.actions):
        slot = {stage: i for i, stage in enumerate(schedule.stages_of(rank))}
        n = len(slot)
        live = [0] * (2 * n)
        moments: set[tuple[int, ...]] = set()
        for a in acts:
            i = slot[a.stage]
            if a.kind == "F":
                live[i] += 1
                moments.add(tuple(live))
            elif a.kind == "B":
                live[i] -= 1
            elif a.kind == "I":
                live[i] -= 1
                live[n + i] += 1
            elif a.kind == "W":
                live[n + i] -= 1
        kept: list[tuple[int, ...]] = []
        for counts in sorted(moments, key=sum, reverse=True):  # any that exceeds it on every stage comes first
            if not any(all(x >= y for x, y in zip(k, counts)) for k in kept):
                kept.append(counts)
        out.append(sorted(kept))
    return out


def _check_complete(schedule: Schedule) -> None:
    where = f"schedule {schedule.name} (pp={schedule.pp}, m={schedule.num_microbatches})"
    if len(schedule.actions) != schedule.pp:
        raise ScheduleError(f"{where}: has {len(schedule.actions)} action lists, expected one per rank")
    counts = Counter(a for acts in schedule.actions for a in acts)
    for rank, acts in enumerate(schedule.actions):
        for a in acts:
            if a.kind not in KINDS:
                raise ScheduleError(f"{where}: rank {rank} has pass kind {a.kind!r} (expected one of {KINDS})")
            if not (0 <= a.stage < schedule.num_stages and 0 <= a.microbatch < schedule.num_microbatches):
                raise ScheduleError(f"{where}: rank {rank} runs {a.kind} stage={a.stage} mb={a.microbatch}, "
                                    f"outside {schedule.num_stages} stages x {schedule.num_microbatches} "
                                    "microbatches")
            if schedule.stage_to_rank(a.stage) != rank:
                raise ScheduleError(f"{where}: rank {rank} runs {a.kind} stage={a.stage} mb={a.microbatch}, "
                                    f"but stage {a.stage} lives on rank {schedule.stage_to_rank(a.stage)}")
    expected = 0
    for s in range(schedule.num_stages):
        for i in range(schedule.num_microbatches):
            backward = ("I", "W") if schedule.input_gradient_pass(s, i) == "I" else ("B",)
            for kind in ("F",) + backward:
                n = counts[Action(kind, s, i)]
                if n != 1:
                    raise ScheduleError(f"{where}: {kind} stage={s} mb={i} appears {n} times, expected once")
            expected += 1 + len(backward)
    if sum(counts.values()) != expected:
        extra = sorted(a for a in counts if a.kind == "B" and (a.stage, a.microbatch) in schedule.split_passes)
        what = f"e.g. B stage={extra[0].stage} mb={extra[0].microbatch}" if extra else "a W without its I"
        raise ScheduleError(f"{where}: runs a backward both whole and split ({what})")


def _deadlock_message(schedule: Schedule, heads: list[int], done: set[Action]) -> str:
    waits = []
    for rank, acts in enumerate(schedule.actions):
        if heads[rank] < len(acts):
            head = acts[heads[rank]]
            missing = [d for d in dependencies(schedule, head) if d not in done]
            need = ", ".join(f"{d.kind} stage={d.stage} mb={d.microbatch}" for d in missing)
            waits.append(f"rank {rank} at {head.kind} stage={head.stage} mb={head.microbatch} "
                         f"waits for {need}")
    return (f"schedule {schedule.name} (pp={schedule.pp}, m={schedule.num_microbatches}) deadlocks: "
            + "; ".join(waits))
