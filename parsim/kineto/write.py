"""Write parsim traces as Kineto (torch.profiler) files that Perfetto and Holistic Trace Analysis read.

Each rank becomes what a GPU run's profile looks like:

* a GPU process (``pid`` = the rank's device) whose threads are CUDA-like
  streams: compute on stream 7 (PyTorch's default stream), communication,
  pipeline transfers, FSDP gathers and K/V exchanges on streams of their own.
  Every event is a ``kernel`` with ``stream``, ``device`` and ``correlation``
  args, launched by a ``cudaLaunchKernel`` runtime event on a CPU thread, and
  a ``ProfilerStep#0`` annotation spans the step, as HTA requires;
* communication kernels are named as NCCL's are (``ncclDevKernel_AllReduce``,
  then parsim's event name in brackets), which is how HTA tells communication
  from computation; ``args.parsim_name`` keeps the name parsim joins on;
* compute spans are cut around the tensor-parallel (and expert) collectives
  nested in them: those block the compute stream, so no compute runs under
  them, and HTA's overlap then agrees with :func:`parsim.report.step_report.comm_overlap`;
* a stream whose events overlap (asynchronous sends in flight together) is
  spread over extra lanes, ``p2p`` then ``p2p #2``: a CUDA stream runs one
  kernel at a time, HTA's idle time assumes so, and Perfetto drops a slice
  that partly overlaps another on its track.

:func:`write_rank_traces` writes one file per rank (what HTA's
``TraceAnalysis(trace_dir=...)`` opens); :func:`write_merged_trace` writes
several labelled traces (predicted and measured) into one file to open side
by side in Perfetto.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

from ..errors import ParsimError
from ..report.step_report import blocks_compute
from ..report.trace import STREAMS, Event, Trace

# CUDA-like stream ids per parsim stream: 7 is PyTorch's default stream in Kineto traces.
STREAM_IDS = {"compute": 7, "comm": 21, "p2p": 22, "gather": 23, "cp": 24, "ep": 25}
LANE_STRIDE = 100  # the n-th extra lane of a stream is stream id + n * LANE_STRIDE
CPU_TID = 1  # the thread that launches the kernels
PID_BLOCK = 100_000  # in a merged file, the n-th trace's processes start at n * PID_BLOCK
_NCCL_OPS = {"all_reduce": "AllReduce", "all_gather": "AllGather", "reduce_scatter": "ReduceScatter",
             "all_to_all": "SendRecv", "broadcast": "Broadcast", "send": "SendRecv", "recv": "SendRecv"}
_P2P = re.compile(r"^(send|recv) (\w+) stage=(\d+) mb=(\d+) peer=(\d+)$")


def kernel_name(event: Event) -> str:
    """What an NCCL-aware tool sees: ``ncclDevKernel_AllReduce (all_reduce dp bucket=2)`` for communication,
    parsim's own name for computation."""
    if event.kind in ("compute", "optimizer"):
        return event.name
    op = _NCCL_OPS.get(event.kind if event.kind in ("send", "recv") else event.name.split(" ", 1)[0], "SendRecv")
    return f"ncclDevKernel_{op} ({event.name})"


def rank_events(trace: Trace, rank: int, pid_base: int = 0, label: str = "") -> list[dict]:
    """The Kineto events of one rank: metadata, the step annotation, kernels on lanes, their launches."""
    events = _cut_blocked_compute(trace.for_rank(rank))
    gpu_pid, cpu_pid = pid_base + rank, pid_base + PID_BLOCK // 2 + rank
    prefix = f"{label} " if label else ""
    out = [_meta("process_name", gpu_pid, name=f"{prefix}rank {rank} GPU"),
           _meta("process_labels", gpu_pid, labels=f"GPU {rank}"),
           _meta("process_sort_index", gpu_pid, sort_index=gpu_pid),
           _meta("process_name", cpu_pid, name=f"{prefix}rank {rank} host"),
           _meta("process_sort_index", cpu_pid, sort_index=cpu_pid),
           _meta("thread_name", cpu_pid, CPU_TID, name="launches")]
    end = max((e.end_s for e in events), default=0.0)
    out.append({"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#0", "pid": cpu_pid, "tid": CPU_TID,
                "ts": 0.0, "dur": end * 1e6, "args": {}})
    named: set[int] = set()
    correlation = itertools.count(1)
    for stream, lanes in _lanes(events).items():
        for lane, lane_events in enumerate(lanes):
            sid = STREAM_IDS.get(stream, max(STREAM_IDS.values()) + 1) + lane * LANE_STRIDE
            if sid not in named:
                named.add(sid)
                out.append(_meta("thread_name", gpu_pid, sid, name=stream + (f" #{lane + 1}" if lane else "")))
                out.append(_meta("thread_sort_index", gpu_pid, sid, sort_index=sid))
            for e in lane_events:
                corr = next(correlation)
                ts = e.start_s * 1e6
                out.append({"ph": "X", "cat": "kernel", "name": kernel_name(e), "pid": gpu_pid, "tid": sid,
                            "ts": ts, "dur": e.dur_s * 1e6,
                            "args": {**e.args, "parsim_name": e.name, "parsim_kind": e.kind, "parsim_stream": e.stream,
                                     "stream": sid, "device": rank, "correlation": corr}})
                out.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": cpu_pid,
                            "tid": CPU_TID, "ts": ts, "dur": 0.0, "args": {"correlation": corr}})
    return out


def write_rank_traces(folder: str | Path, trace: Trace) -> list[Path]:
    """One Kineto file per rank of ``trace`` in ``folder`` (``rank0.pt.trace.json``, ...); the paths written."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ParsimError(f"{folder} is a file; give a folder for one trace file per rank")
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for rank in sorted({e.rank for e in trace.events}):
        doc = _document(rank_events(trace, rank), rank, trace.world_size, {"source": trace.source, **trace.meta})
        path = folder / f"rank{rank}.pt.trace.json"
        path.write_text(json.dumps(doc))
        paths.append(path)
    return paths


def write_merged_trace(path: str | Path, traces: dict[str, Trace]) -> None:
    """One Chrome/Perfetto file holding every labelled trace, each rank's tracks under its label, with
    arrows from each pipeline send to its receive."""
    events: list[dict] = []
    for block, (label, trace) in enumerate(traces.items()):
        for rank in sorted({e.rank for e in trace.events}):
            events += rank_events(trace, rank, block * PID_BLOCK, label)
        events += _flows(events, block)
    world = max((t.world_size for t in traces.values()), default=1)
    doc = _document(events, 0, world, {label: t.meta for label, t in traces.items()})
    Path(path).write_text(json.dumps(doc))


def write_trace(path: str | Path, traces: dict[str, Trace]) -> str:
    """``path`` ending in ``.json``: one merged file; otherwise a folder of per-rank files (a subfolder per
    label when there are several). Returns what was written, for the user."""
    path = Path(path)
    if path.suffix == ".json":
        if path.is_dir():
            raise ParsimError(f"{path} is a folder; a merged trace needs a file name")
        write_merged_trace(path, traces)
        return f"{path} (open in ui.perfetto.dev)"
    for label, trace in traces.items():
        write_rank_traces(path / label if len(traces) > 1 else path, trace)
    labels = ", ".join(f"{label}/" for label in traces) if len(traces) > 1 else ""
    return f"{path}/ {labels}(one Kineto file per rank: Perfetto, HTA's TraceAnalysis(trace_dir=...))"


def _document(events: list[dict], rank: int, world: int, meta: dict) -> dict:
    return {"schemaVersion": 1, "deviceProperties": [], "displayTimeUnit": "ms", "traceName": "parsim",
            "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world},
            "traceEvents": events, "otherData": meta}


def _meta(kind: str, pid: int, tid: int | None = None, **args: object) -> dict:
    event = {"ph": "M", "name": kind, "pid": pid, "args": args}
    if tid is not None:
        event["tid"] = tid
    return event


def _cut_blocked_compute(events: list[Event]) -> list[Event]:
    """Compute spans less the blocking collectives nested in them: a forward that ran a tensor-parallel
    all-reduce becomes the pieces before, between and after."""
    blocking = sorted((e for e in events if blocks_compute(e)), key=lambda e: e.start_s)
    if not blocking:
        return events
    out = []
    for e in events:
        if e.kind != "compute":
            out.append(e)
            continue
        start = e.start_s
        for b in blocking:
            if b.end_s <= start or b.start_s >= e.end_s:
                continue
            if b.start_s > start:
                out.append(Event(e.name, e.rank, e.stream, e.kind, start, b.start_s - start, e.args))
            start = max(start, b.end_s)
        if e.end_s > start:
            out.append(Event(e.name, e.rank, e.stream, e.kind, start, e.end_s - start, e.args))
    return out


def _lanes(events: list[Event]) -> dict[str, list[list[Event]]]:
    """Per stream, events spread over as few lanes as keep each lane sequential, as a CUDA stream is."""
    lanes: dict[str, list[list[Event]]] = {}
    for e in sorted(events, key=lambda e: (e.start_s, e.end_s)):
        stream = lanes.setdefault(e.stream if e.stream in STREAMS else "other", [])
        free = next((lane for lane in stream if lane[-1].end_s <= e.start_s), None)
        if free is None:
            stream.append([e])
        else:
            free.append(e)
    return lanes


def _flows(events: list[dict], block: int) -> list[dict]:
    """Arrows from each pipeline send to its receive (matched by what, stage, microbatch and the two ranks)."""
    sends: dict[tuple, dict] = {}
    out = []
    for i, e in enumerate(events):
        match = _P2P.match(e.get("args", {}).get("parsim_name", "")) if e.get("cat") == "kernel" else None
        if not match:
            continue
        kind, what, stage, mb, peer = match.groups()
        rank = e["args"]["device"]
        key = (what, stage, mb) + ((rank, int(peer)) if kind == "send" else (int(peer), rank))  # (from, to)
        if kind == "send":
            sends[key] = {"ph": "s", "id": f"{block}-{i}", "name": f"{what} mb={mb}", "cat": "p2p",
                          "pid": e["pid"], "tid": e["tid"], "ts": e["ts"]}
        elif key in sends:
            start = sends.pop(key)
            out += [start, {"ph": "f", "bp": "e", "id": start["id"], "name": start["name"], "cat": "p2p",
                            "pid": e["pid"], "tid": e["tid"], "ts": e["ts"] + e["dur"]}]
    return out
