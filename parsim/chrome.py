"""Chrome / Perfetto trace export, Kineto-shaped.

One process per rank (``pid``), one thread per stream (``tid``), complete
events (``"ph": "X"``) in microseconds, and flow arrows from each pipeline
send to its receive. ``distributedInfo`` carries the rank count as
torch.profiler writes it, so Perfetto and Holistic Trace Analysis open the
file. Several traces (predicted and measured) can share one file: each gets
its own block of process ids and a label.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .trace import STREAMS, Trace

PID_BLOCK = 100_000  # process ids of the n-th trace in a file start at n * PID_BLOCK
_P2P = re.compile(r"^(send|recv) (\w+) stage=(\d+) mb=(\d+) peer=(\d+)$")


def chrome_events(trace: Trace, label: str, block: int = 0) -> list[dict]:
    out: list[dict] = []
    ranks = sorted({e.rank for e in trace.events})
    for rank in ranks:
        pid = block * PID_BLOCK + rank
        out.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{label} rank {rank}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
        for tid, stream in enumerate(STREAMS):
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": stream}})
    sends: dict[tuple, dict] = {}
    for flow_id, e in enumerate(trace.events):
        pid = block * PID_BLOCK + e.rank
        tid = STREAMS.index(e.stream) if e.stream in STREAMS else len(STREAMS)
        ts = e.start_s * 1e6
        out.append({"ph": "X", "name": e.name, "cat": e.kind, "pid": pid, "tid": tid, "ts": ts,
                    "dur": e.dur_s * 1e6, "args": e.args})
        match = _P2P.match(e.name)
        if match:
            kind, what, stage, mb, _ = match.groups()
            key = (what, stage, mb)
            if kind == "send":
                sends[key] = {"ph": "s", "id": f"{block}-{flow_id}", "name": f"{what} mb={mb}", "cat": "p2p",
                              "pid": pid, "tid": tid, "ts": ts}
            elif key in sends:
                start = sends.pop(key)
                out.append(start)
                out.append({"ph": "f", "bp": "e", "id": start["id"], "name": start["name"], "cat": "p2p",
                            "pid": pid, "tid": tid, "ts": e.end_s * 1e6})
    return out


def write_chrome_trace(path: str | Path, traces: dict[str, Trace]) -> None:
    """Write one Chrome/Perfetto JSON file holding every labelled trace."""
    events: list[dict] = []
    for block, (label, trace) in enumerate(traces.items()):
        events += chrome_events(trace, label, block)
    world = max((t.world_size for t in traces.values()), default=1)
    doc = {"traceEvents": events, "displayTimeUnit": "ms",
           "distributedInfo": {"backend": "parsim", "rank": 0, "world_size": world},
           "otherData": {label: t.meta for label, t in traces.items()}}
    Path(path).write_text(json.dumps(doc))
