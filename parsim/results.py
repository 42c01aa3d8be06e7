"""The record both the collective simulator and the executor benchmark write.

One schema for prediction and measurement is what lets ``parsim compare``
line them up. Bandwidths follow nccl-tests (``doc/PERFORMANCE.md``):

* ``algbw = size / time``, where ``size`` is the buffer nccl-tests reports:
  the whole buffer for all-reduce, broadcast and reduce; the *total* (all
  ranks' chunks together) for all-gather, reduce-scatter, gather, scatter and
  all-to-all.
* ``busbw = algbw * factor``, the factor making busbw comparable to a link's
  bandwidth whatever the rank count.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import ParsimError
from .files import read_json
from .jsondoc import envelope

# Canonical operation names (the torch.distributed spelling, with dashes on the CLI).
OPERATIONS = (
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce",
    "gather", "scatter", "all_to_all", "send_recv",
)


def canonical_op(name: str) -> str:
    """``"all-reduce"``/``"allreduce"``/``"all_reduce"`` -> ``"all_reduce"``."""
    key = name.strip().lower().replace("-", "_")
    aliases = {op.replace("_", ""): op for op in OPERATIONS}
    aliases.update({"sendrecv": "send_recv", "p2p": "send_recv", "alltoall": "all_to_all"})
    op = key if key in OPERATIONS else aliases.get(key.replace("_", ""))
    if op is None:
        raise ParsimError(
            f"unknown collective {name!r} (expected one of: {', '.join(o.replace('_', '-') for o in OPERATIONS)})"
        )
    return op


def busbw_factor(op: str, nranks: int) -> float:
    """nccl-tests' bus-bandwidth factor for ``op`` on ``nranks`` ranks."""
    n = nranks
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    return 1.0  # broadcast, reduce, send_recv


@dataclass
class CollectiveResult:
    """One collective at one size, predicted or measured."""

    op: str
    nranks: int
    size_bytes: int
    time_s: float
    algorithm: str
    source: str  # "simulated" | "measured"
    backend: str = ""  # "simpy" for predictions, "gloo"/"nccl" for measurements
    cluster: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def algbw_Bps(self) -> float:
        return self.size_bytes / self.time_s if self.time_s > 0 else float("inf")

    @property
    def busbw_Bps(self) -> float:
        return self.algbw_Bps * busbw_factor(self.op, self.nranks)

    def to_dict(self) -> dict:
        row = asdict(self)
        row["algbw_GBps"] = self.algbw_Bps / 1e9
        row["busbw_GBps"] = self.busbw_Bps / 1e9
        return row

    @classmethod
    def from_dict(cls, row: dict) -> "CollectiveResult":
        known = {k: row[k] for k in ("op", "nranks", "size_bytes", "time_s", "algorithm", "source") if k in row}
        missing = {"op", "nranks", "size_bytes", "time_s"} - set(known)
        if missing:
            raise ParsimError(f"result row lacks {', '.join(sorted(missing))}: {row}")
        return cls(
            algorithm=row.get("algorithm", ""), source=row.get("source", ""),
            backend=row.get("backend", ""), cluster=row.get("cluster", ""),
            extra=row.get("extra", {}), **{k: v for k, v in known.items() if k not in ("algorithm", "source")},
        )


def save_results(path: str | Path, rows: list[CollectiveResult], meta: dict | None = None) -> None:
    """Write results as the ``parsim bench --json`` document (``parsim.bench/1``), with ``meta``."""
    doc = envelope("bench", {"meta": meta or {}, "results": [r.to_dict() for r in rows]})
    Path(path).write_text(json.dumps(doc, indent=2, allow_nan=False))


def load_results(path: str | Path) -> list[CollectiveResult]:
    """Read a file written by :func:`save_results`, or the ``--json`` output of bench or collective."""
    data = read_json(path)
    rows = data.get("results") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise ParsimError(f"{path}: expected a JSON object with a 'results' list")
    return [CollectiveResult.from_dict(r) for r in rows]
