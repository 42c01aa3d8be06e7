"""Name one rank's torch.profiler events as parsim events: compute by phase, collectives, transfers.

Three sources, most specific first:

1. a file parsim wrote (:mod:`.write`): kernels carry ``parsim_name``, read back as they were;
2. parsim's names as ``record_function`` annotations (compute actions, transfers, the optimizer);
   where a loop has them, its other operators are left out, as the executor's own trace leaves them;
3. torch's own events: ``gloo:<op>`` spans and NCCL kernels for communication, autograd's
   ``evaluate_function`` for the backward, ``Optimizer.step#`` for the optimizer, other
   top-level operators for the forward.

Collectives come out named ``<op> ?`` with their size in ``args``; :mod:`.match` names the group.
"""

from __future__ import annotations

import bisect
import math
import re

from ..report.trace import Event

_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_COMPUTE = re.compile(r"^([FBIWR]) stage=\d+ mb=\d+$")
_P2P = re.compile(r"^(send|recv) (act|grad) stage=\d+ mb=\d+ peer=\d+$")
_COLLECTIVE_NAME = re.compile(r"^(all_reduce|all_gather|reduce_scatter|all_to_all) \w+( \w+=\S+)*$")
_NCCL_KERNEL = re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)")
_PHASE = {"F": "forward", "B": "backward", "I": "backward", "W": "weight-grad", "R": "recompute"}
_GLOO_OPS = {"all_reduce": "all_reduce", "allreduce": "all_reduce", "all_gather": "all_gather",
             "allgather": "all_gather", "reduce_scatter": "reduce_scatter", "reducescatter": "reduce_scatter",
             "all_to_all": "all_to_all", "alltoall": "all_to_all", "broadcast": "broadcast", "reduce": "reduce",
             "gather": "gather", "scatter": "scatter", "barrier": "barrier"}
_C10D_OPS = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "_allgather_base_": "all_gather",
             "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
             "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
             "reduce_scatter_tensor_coalesced_": "reduce_scatter", "alltoall_base_": "all_to_all",
             "alltoall_": "all_to_all", "broadcast_": "broadcast", "reduce_": "reduce", "gather_": "gather",
             "scatter_": "scatter", "barrier": "barrier"}
_NCCL_OPS = {"AllReduce": "all_reduce", "AllGather": "all_gather", "ReduceScatter": "reduce_scatter",
             "Broadcast": "broadcast", "Reduce": "reduce", "SendRecv": "send_recv", "AllToAll": "all_to_all"}
# Element sizes by the type names torch.profiler records ("Input type", NCCL's "dtype").
_DTYPE_BYTES = {"float": 4, "double": 8, "c10::half": 2, "half": 2, "c10::bfloat16": 2, "bfloat16": 2,
                "int": 4, "long int": 8, "long": 8, "short int": 2, "signed char": 1, "unsigned char": 1,
                "bool": 1, "c10::float8_e4m3fn": 1, "c10::float8_e5m2": 1, "float8_e4m3fn": 1}


def profiler_step(event: dict) -> int | None:
    """N of a ``ProfilerStep#N`` slice, else None."""
    match = _STEP.match(event["name"])
    return int(match.group(1)) if match else None


def rank_events(events: list[dict], rank: int, window: tuple[float, float]) -> list[Event]:
    """The events of one rank that start inside ``window`` (microseconds), as parsim events in seconds
    from the window's start."""
    t0, t1 = window
    inside = [e for e in events if t0 <= e["ts"] <= t1 and profiler_step(e) is None]
    if any("parsim_name" in (e.get("args") or {}) for e in inside):
        out = _parsim_written(inside, rank)
    elif any(e.get("cat") == "kernel" for e in inside):
        out = _gpu(inside, rank)
    else:
        out = _cpu(inside, rank, _main_thread(events, window))
    return [Event(e.name, e.rank, e.stream, e.kind, (e.start_s - t0) * 1e-6, e.dur_s * 1e-6, e.args)
            for e in sorted(out, key=lambda e: e.start_s)]


def classify(name: str) -> tuple[str, str, str] | None:
    """``(kind, stream, phase)`` of an annotation named by parsim's contract, or None."""
    if name == "optimizer step":
        return "optimizer", "compute", "optimizer"
    match = _COMPUTE.match(name)
    if match:
        return "compute", "compute", _PHASE[match.group(1)]
    match = _P2P.match(name)
    if match:
        return match.group(1), "p2p", "pp"
    return None


# Events below are built in microseconds from the trace's clock; rank_events rebases them.

def _parsim_written(events: list[dict], rank: int) -> list[Event]:
    out = []
    for e in events:
        args = dict(e.get("args") or {})
        if e.get("cat") != "kernel" or "parsim_name" not in args:
            continue
        name, kind, stream = args.pop("parsim_name"), args.pop("parsim_kind", "compute"), args.pop("parsim_stream",
                                                                                                    "compute")
        for key in ("stream", "device", "correlation"):
            args.pop(key, None)
        out.append(Event(name, rank, stream, kind, e["ts"], e["dur"], args))
    return out


def _cpu(events: list[dict], rank: int, main_tid: object) -> list[Event]:
    """Eager CPU training: the main thread's top-level spans by phase, gloo's spans for communication."""
    annotated_p2p = any(_P2P.match(e["name"]) for e in events)
    annotated = any(_COMPUTE.match(e["name"]) for e in events)  # then other operators are the loop's own
    out: list[Event] = []
    span: Event | None = None
    for e in _top_level([e for e in events if e.get("tid") == main_tid]):
        name = e["name"]
        kinds = classify(name)
        if kinds and kinds[0] in ("send", "recv"):
            out.append(Event(name, rank, "p2p", kinds[0], e["ts"], e["dur"], {"phase": "pp"}))
            span = None
            continue
        if name.startswith(("c10d::", "gloo:", "nccl:", "record_param_comms")) or _COLLECTIVE_NAME.match(name):
            span = None  # communication: it ends a compute span; its time comes from gloo's own span below
            continue
        if annotated and not kinds:
            span = None
            continue
        name, phase = _compute_phase(name, kinds)
        if span is not None and span.name == name:
            span.dur_s = e["ts"] + e["dur"] - span.start_s
            continue
        span = Event(name, rank, "compute", "optimizer" if phase == "optimizer" else "compute", e["ts"], e["dur"],
                     {"phase": phase})
        out.append(span)
    for e in events:
        if e["name"] in ("gloo:send", "gloo:recv") and not annotated_p2p:
            out.append(Event(f"{e['name'][5:]} ?", rank, "p2p", e["name"][5:], e["ts"], e["dur"],
                             {"phase": "pp", "bytes": _gloo_bytes(e)}))
    return out + _gloo_collectives(events, rank)


def _gloo_collectives(events: list[dict], rank: int) -> list[Event]:
    """gloo's spans of the work (on its worker threads), each named by the ``c10d::`` call that issued it:
    gloo runs a reduce-scatter as an all-reduce of the whole buffer, and only the call says which it was."""
    spans = sorted((e for e in events if _GLOO_OPS.get(e["name"][5:]) and e["name"].startswith("gloo:")),
                   key=lambda e: e["ts"])
    calls = sorted((e for e in events if _C10D_OPS.get(e["name"][6:]) and e["name"].startswith("c10d::")),
                   key=lambda e: e["ts"])
    ops = [_C10D_OPS[c["name"][6:]] for c in calls] if len(calls) == len(spans) else \
        [_GLOO_OPS[e["name"][5:]] for e in spans]
    return [Event(f"{op} ?", rank, "comm", "collective", e["ts"], e["dur"],
                  {"op": op, "input_bytes": _gloo_bytes(e), "source": e["name"]})
            for op, e in zip(ops, spans) if op != "barrier"]


def _gpu(events: list[dict], rank: int) -> list[Event]:
    """GPU training: kernels, each with the phase of the operator that launched it."""
    phase_of = _launch_phases(events)
    out = []
    for e in events:
        if e.get("cat") != "kernel":
            continue
        args = e.get("args") or {}
        match = _NCCL_KERNEL.match(e["name"])
        if match:
            op = _NCCL_OPS.get(match.group(1), match.group(1).lower())
            if op == "send_recv":
                out.append(Event("send_recv ?", rank, "p2p", "recv", e["ts"], e["dur"], {"phase": "pp"}))
            else:
                out.append(Event(f"{op} ?", rank, "comm", "collective", e["ts"], e["dur"], _nccl_args(op, args,
                                                                                                      e["name"])))
            continue
        name, phase = phase_of.get(args.get("correlation"), ("forward", "forward"))
        out.append(Event(name, rank, "compute", "optimizer" if phase == "optimizer" else "compute", e["ts"],
                         e["dur"], {"phase": phase}))
    return out


def _compute_phase(name: str, kinds: tuple[str, str, str] | None) -> tuple[str, str]:
    """(event name, phase) of a top-level compute span."""
    if kinds:
        return name, kinds[2]
    if name.startswith("Optimizer.zero_grad"):
        return "optimizer zero_grad", "optimizer"
    if name.startswith("Optimizer."):
        return "optimizer step", "optimizer"
    if name.startswith("autograd::engine::evaluate_function"):
        return "backward", "backward"
    return "forward", "forward"


def _launch_phases(events: list[dict]) -> dict[object, tuple[str, str]]:
    """correlation id -> (name, phase) of the top-level operator around the kernel's launch."""
    by_tid: dict[object, list[dict]] = {}
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation"):
            by_tid.setdefault(e.get("tid"), []).append(e)
    tops = {tid: _top_level(spans) for tid, spans in by_tid.items()}
    starts = {tid: [s["ts"] for s in spans] for tid, spans in tops.items()}
    out = {}
    for e in events:
        corr = (e.get("args") or {}).get("correlation")
        if e.get("cat") not in ("cuda_runtime", "cuda_driver") or corr is None or e.get("tid") not in tops:
            continue
        spans = tops[e["tid"]]
        i = bisect.bisect_right(starts[e["tid"]], e["ts"]) - 1
        if i >= 0 and e["ts"] <= spans[i]["ts"] + spans[i]["dur"]:
            out[corr] = _compute_phase(spans[i]["name"], classify(spans[i]["name"]))
    return out


def _top_level(events: list[dict]) -> list[dict]:
    """The events not inside another one of the list (same thread), in time order."""
    out: list[dict] = []
    end = float("-inf")
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def _main_thread(events: list[dict], window: tuple[float, float]) -> object:
    """The thread that ran the step: the one holding the ProfilerStep slice, else the busiest."""
    for e in events:
        if profiler_step(e) is not None and e["ts"] == window[0]:
            return e.get("tid")
    counts: dict[object, int] = {}
    for e in events:
        counts[e.get("tid")] = counts.get(e.get("tid"), 0) + 1
    return max(counts, key=counts.get) if counts else None


def _gloo_bytes(event: dict) -> int | None:
    """Bytes of a gloo call's input, from the shapes torch.profiler records (``record_shapes=True``)."""
    args = event.get("args") or {}
    dims, types = args.get("Input Dims"), args.get("Input type")
    if not dims or not types or not isinstance(dims[0], list):
        return None
    size = _DTYPE_BYTES.get(str(types[0]).lower())
    if size is None:
        return None
    try:
        return math.prod(int(d) for d in dims[0]) * size
    except (TypeError, ValueError):  # shapes recorded in a form this reader does not know: size unknown
        return None


def _nccl_args(op: str, args: dict, name: str) -> dict:
    """Size and group of an NCCL kernel, from the collective metadata Kineto attaches to it."""
    size = _DTYPE_BYTES.get(str(args.get("dtype", "")).lower())
    nelems = args.get("Out msg nelems" if op == "all_gather" else "In msg nelems")
    out: dict = {"op": op, "source": name}
    if size and isinstance(nelems, (int, float)):
        out["bytes"] = int(nelems) * size
    ranks = args.get("Process Group Ranks")
    if isinstance(ranks, str):
        try:
            out["group_ranks"] = [int(r) for r in ranks.strip("[]").split(",") if r.strip()]
        except ValueError:
            pass
    return out
