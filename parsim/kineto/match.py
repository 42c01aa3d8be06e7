"""Put a profiled run's collectives onto the plan's: which group each one used, and which lowered op it is.

A gloo profile names the operation and its size, not the group, so a
measured collective takes the plan group that runs the same operation on the
same number of bytes (or the only group running that operation). Where a
group's measured sizes, in order, are the plan's, each measured collective
takes the name of its lowered op (``all_reduce dp bucket=2``) and ``compare``
joins them one to one; otherwise they are numbered (``all_reduce dp #0``)
and compared as a group: count, bytes and time. DDP's own buckets (25 MiB by
default) rarely cut a model where the plan's do; the bytes still add up.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..report.trace import Event, Trace
from ..sim.step import rank_standing_for
from ..workload.plan import Plan

SAME_BYTES = 0.01  # sizes within 1% are the same buffer


@dataclass
class CollectiveRow:
    """One (group, operation) of one rank: what the plan predicts and what the profile holds."""

    rank: int
    group: str  # "" when the plan has no such collective
    op: str
    predicted: list[Event]
    measured: list[Event]

    @property
    def status(self) -> str:
        if not self.group:
            return "not in the plan"
        if not self.measured:
            return "not measured"
        if not self.predicted:
            return "not predicted"
        sizes = [_bytes(e) for e in self.predicted], [_bytes(e) for e in self.measured]
        if len(sizes[0]) == len(sizes[1]) and all(_same(a, b) for a, b in zip(*sizes)):
            return "matched one to one"
        if _same(sum(sizes[0]), sum(sizes[1])):
            return "same bytes, cut differently"
        return "bytes differ"

    def to_json(self) -> dict:
        return {"rank": self.rank, "group": self.group or None, "op": self.op, "status": self.status,
                "predicted": {"count": len(self.predicted), "bytes": sum(_bytes(e) for e in self.predicted),
                              "seconds": sum(e.dur_s for e in self.predicted)},
                "measured": {"count": len(self.measured), "bytes": sum(_bytes(e) for e in self.measured),
                             "seconds": sum(e.dur_s for e in self.measured)}}


def match_collectives(plan: Plan, predicted: Trace, measured: Trace) -> list[CollectiveRow]:
    """Name every measured collective after the plan's (in place) and list each rank's groups side by side.

    ``predicted`` holds one representative rank per pipeline rank (as :func:`parsim.sim.step.predict_step`
    returns it), or every rank where ranks take turns on shared cores; each measured rank is set beside its
    own prediction, else the representative of its pipeline rank.
    """
    simulated = {e.rank for e in predicted.events}
    rows = []
    for rank in sorted({e.rank for e in measured.events}):
        planned = [e for e in predicted.for_rank(rank_standing_for(plan, simulated, rank)) if e.kind == "collective"]
        seen = sorted((e for e in measured.for_rank(rank) if e.kind == "collective"), key=lambda e: e.start_s)
        by_key: dict[tuple[str, str], tuple[list[Event], list[Event]]] = {}
        for e in planned:
            by_key.setdefault((e.args.get("group", ""), e.name.split(" ", 1)[0]), ([], []))[0].append(e)
        for e in seen:
            group = _group(plan, rank, e, planned)
            e.args["group"] = group
            if group:
                e.args["phase"] = next(p.args.get("phase") for p in planned if p.args.get("group") == group)
            by_key.setdefault((group, _op(e)), ([], []))[1].append(e)
        for (group, op), (plan_events, measured_events) in sorted(by_key.items()):
            row = CollectiveRow(rank, group, op, plan_events, measured_events)
            _name(row)
            rows.append(row)
    return rows


def _group(plan: Plan, rank: int, event: Event, planned: list[Event]) -> str:
    """The plan group a measured collective ran on, or "" when none fits."""
    op = _op(event)
    groups = sorted({e.args.get("group", "") for e in planned if e.name.startswith(op + " ")})
    ranks = event.args.get("group_ranks")
    if ranks is not None:  # NCCL says which ranks: find the plan dimension with exactly those
        for group in groups:
            if group in ("dp", "tp", "cp") and sorted(_members(plan, rank, group)) == sorted(ranks):
                return _sized(plan, event, group)
    exact = [g for g in groups if any(_same(_bytes_in(plan, event, g), _bytes(e)) for e in planned
                                      if e.args.get("group") == g and e.name.startswith(op + " "))]
    if len(exact) == 1 or (not exact and len(groups) == 1):
        return _sized(plan, event, (exact or groups)[0])
    return ""


def _sized(plan: Plan, event: Event, group: str) -> str:
    """Record the measured collective's size in the plan's convention for ``group``; return the group."""
    event.args["bytes"] = _bytes_in(plan, event, group)
    return group


def _bytes_in(plan: Plan, event: Event, group: str) -> int:
    """Bytes as parsim counts them (the whole buffer: an all-gather's output), from what the profile recorded
    (gloo records an all-gather's input, one rank's share)."""
    if "bytes" in event.args and "input_bytes" not in event.args:
        return event.args["bytes"]
    size = event.args.get("input_bytes") or 0
    return size * _group_size(plan, group) if _op(event) == "all_gather" else size


def _group_size(plan: Plan, group: str) -> int:
    return {"tp": plan.tp, "cp": plan.cp, "dp": plan.dp * plan.cp, "ep": plan.ep, "embedding": 2}.get(group, 1)


def _members(plan: Plan, rank: int, group: str) -> list[int]:
    if group == "dp":  # gradients reduce over dp x cp together (see the lowering)
        return [r for r in range(plan.world)
                if (plan.coords(r).pp, plan.coords(r).tp) == (plan.coords(rank).pp, plan.coords(rank).tp)]
    return plan.group_of(rank, group)


def _name(row: CollectiveRow) -> None:
    """The plan's op names where the sizes match one to one, else ``<op> <group> #i``."""
    one_to_one = row.status == "matched one to one"
    for i, e in enumerate(row.measured):
        if one_to_one:
            e.name = row.predicted[i].name
        else:
            e.name = f"{row.op} {row.group or '(not in the plan)'} #{i}"


def _op(event: Event) -> str:
    """The collective a measured event ran: recognized in a profile, or the first word of the executor's
    name for it (the lowering's, e.g. ``all_reduce tp layer=...``)."""
    return event.args.get("op") or event.name.split(" ", 1)[0]


def _bytes(event: Event) -> int:
    return int(event.args.get("bytes") or 0)


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= SAME_BYTES * max(abs(a), abs(b))
