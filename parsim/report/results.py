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

from ..errors import ParsimError
from ..files import read_json
from ..hardware.cluster import MAX_GPUS
from ..units import MAX_SIZE
from .jsondoc import envelope, schema_id

# Canonical operation names (the torch.distributed spelling, with dashes on the CLI).
OPERATIONS = (
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce",
    "gather", "scatter", "all_to_all", "send_recv",
)


MAX_TIME_S = 1e6  # one collective measured for longer than 11 days is not a measurement


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
    def from_dict(cls, row: object, where: str = "result") -> "CollectiveResult":
        """A result from its :meth:`to_dict` form, every field checked (``where`` names it in errors)."""
        if not isinstance(row, dict):
            raise ParsimError(f"{where} is {row!r:.80} (expected a mapping of op, nranks, size_bytes, time_s)")
        missing = {"op", "nranks", "size_bytes", "time_s"} - set(row)
        if missing:
            raise ParsimError(f"{where} lacks {', '.join(sorted(missing))}")

        def bad(key: str, expected: str) -> ParsimError:
            return ParsimError(f"{where}.{key} is {row[key]!r:.80} (expected {expected})")

        if not isinstance(row["op"], str):
            raise bad("op", "an operation name")
        for key, high in (("nranks", MAX_GPUS), ("size_bytes", MAX_SIZE)):
            value = row[key]
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise bad(key, f"a whole number from 1 to {high:,}")
        time_s = row["time_s"]
        if isinstance(time_s, bool) or not isinstance(time_s, (int, float)) or not 0 < time_s <= MAX_TIME_S:
            raise bad("time_s", f"seconds, above 0 and at most {MAX_TIME_S:g}")
        for key in ("algorithm", "source", "backend", "cluster"):
            if not isinstance(row.get(key, ""), str):
                raise bad(key, "a string")
        if not isinstance(row.get("extra", {}), dict):
            raise bad("extra", "a mapping")
        return cls(op=canonical_op(row["op"]), nranks=row["nranks"], size_bytes=row["size_bytes"],
                   time_s=float(time_s), algorithm=row.get("algorithm", ""), source=row.get("source", ""),
                   backend=row.get("backend", ""), cluster=row.get("cluster", ""), extra=row.get("extra", {}))


def save_results(path: str | Path, rows: list[CollectiveResult], meta: dict | None = None) -> None:
    """Write results as the ``parsim bench --json`` document (``parsim.bench/1``), with ``meta``."""
    doc = envelope("bench", {"meta": meta or {}, "results": [r.to_dict() for r in rows]})
    Path(path).write_text(json.dumps(doc, indent=2, allow_nan=False))


def load_results(path: str | Path) -> list[CollectiveResult]:
    """Read a file written by :func:`save_results`, or the ``--json`` output of bench or collective."""
    data = read_json(path)
    schema = data.get("schema") if isinstance(data, dict) else None
    if schema is not None and schema not in (schema_id("bench"), schema_id("collective")):
        raise ParsimError(f"{path}: a {schema} document; expected collective results (parsim bench --json or "
                          f"--save-measured, or parsim collective --json)")
    rows = data.get("results") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise ParsimError(f"{path}: expected a JSON object with a 'results' list")
    return [CollectiveResult.from_dict(r, f"{path}: results[{i}]") for i, r in enumerate(rows)]
