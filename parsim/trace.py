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
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import ParsimError
from .files import read_json

STREAMS = ("compute", "comm", "p2p", "gather", "cp")  # gather: FSDP's weight all-gathers; cp: K/V exchanges


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
    def from_json(cls, data: dict) -> "Trace":
        try:
            events = [Event(**e) for e in data["events"]]
            return cls(source=data["source"], world_size=int(data["world_size"]),
                       events=events, meta=data.get("meta", {}))
        except (KeyError, TypeError) as err:
            raise ParsimError(f"not a parsim trace ({err})") from None

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        return cls.from_json(read_json(path))


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
