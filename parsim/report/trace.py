"""The one trace schema shared by the simulator and the executor.

A :class:`Trace` is a list of :class:`Event` s, one per operation a rank ran:
a compute kernel, a collective, a send or a receive. Event names are the join
key between prediction and measurement (``F stage=1 mb=3``,
``all_reduce dp bucket=2``), so both sides must build them with the helpers
here. Traces save as JSON and export as Chrome/Perfetto traces (Kineto-shaped:
one process per rank, one thread per stream, ``distributedInfo`` metadata).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from operator import attrgetter
from pathlib import Path

from ..errors import ParsimError
from ..files import read_json
from ..hardware.cluster import MAX_GPUS

# gather: FSDP's weight all-gathers; cp: K/V exchanges; ep: the all-to-alls of paired passes (ep_comm_overlap)
STREAMS = ("compute", "comm", "p2p", "gather", "cp", "ep")
KINDS = ("compute", "collective", "send", "recv", "optimizer")


@dataclass(slots=True)
class Event:
    """One operation on one rank. Times are seconds from the start of the step."""

    name: str
    rank: int
    stream: str  # one of STREAMS
    kind: str  # "compute" | "collective" | "send" | "recv" | "optimizer"
    start_s: float
    dur_s: float
    args: dict = field(default_factory=dict)  # bytes, flops, group, peer, algorithm, ...

    @property
    def end_s(self) -> float:
        return self.start_s + self.dur_s


# Sort keys: an event's start, and its rank then its start (the order a simulated trace keeps its events in)
by_start, by_rank_and_start = attrgetter("start_s"), attrgetter("rank", "start_s")


@dataclass
class Trace:
    """Events of one run (``source`` is ``"simulated"`` or ``"measured"``)."""

    source: str
    world_size: int
    events: list[Event] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def for_rank(self, rank: int) -> list[Event]:
        return [e for e in self.events if e.rank == rank]

    def to_json(self) -> dict:
        return {"source": self.source, "world_size": self.world_size, "meta": self.meta,
                "events": [asdict(e) for e in self.events]}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def from_json(cls, data: object) -> "Trace":
        """A trace from its :meth:`to_json` form, every event checked (one line naming what is wrong)."""
        if not isinstance(data, dict) or not isinstance(data.get("events"), list):
            raise ParsimError("not a parsim trace (expected an object with an events list)")
        world = data.get("world_size")
        if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= MAX_GPUS:
            raise ParsimError(f"not a parsim trace: world_size is {world!r:.40} (expected 1 to {MAX_GPUS:,})")
        if not isinstance(data.get("source"), str) or not isinstance(data.get("meta", {}), dict):
            raise ParsimError("not a parsim trace: source must be a string and meta a mapping")
        return cls(source=data["source"], world_size=world, events=[_event(e, i, world)
                                                                     for i, e in enumerate(data["events"])],
                   meta=data.get("meta", {}))

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        return cls.from_json(read_json(path))


def _event(e: object, i: int, world: int) -> Event:
    """Event ``i`` of a saved trace, checked: names and streams are strings, times finite, ranks in the world."""
    fields = ("name", "rank", "stream", "kind", "start_s", "dur_s")
    if not isinstance(e, dict) or not set(fields) <= set(e) or set(e) - {*fields, "args"}:
        raise ParsimError(f"not a parsim trace: events[{i}] is {e!r:.80} (expected {', '.join(fields)}, args)")
    rank, start, dur = e["rank"], e["start_s"], e["dur_s"]
    problems = [
        not isinstance(e["name"], str) or e["stream"] not in STREAMS or e["kind"] not in KINDS,
        isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world,
        not all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) for t in (start, dur)),
        not isinstance(e.get("args", {}), dict),
    ]
    if any(problems) or start < 0 or dur < 0:
        raise ParsimError(f"not a parsim trace: events[{i}] is {e!r:.120} (expected a name, a stream of "
                          f"{', '.join(STREAMS)}, a kind of {', '.join(KINDS)}, a rank below {world}, times >= 0)")
    return Event(e["name"], rank, e["stream"], e["kind"], float(start), float(dur), e.get("args", {}))


def compute_name(phase: str, stage: int, microbatch: int) -> str:
    """``F stage=1 mb=3``: a compute action: F forward, B full backward, I input-grad, W weight-grad,
    R a forward recomputed for the backward."""
    return f"{phase} stage={stage} mb={microbatch}"


def collective_name(op: str, group: str, **tags: object) -> str:
    """``all_reduce dp bucket=2``: a collective on a named group with identifying tags."""
    suffix = "".join(f" {k}={v}" for k, v in tags.items())
    return f"{op} {group}{suffix}"


def p2p_name(kind: str, what: str, stage: int, microbatch: int, peer: int) -> str:
    """``send act stage=0 mb=3 peer=1``: one side of a pipeline transfer."""
    return f"{kind} {what} stage={stage} mb={microbatch} peer={peer}"
