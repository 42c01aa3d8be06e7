"""Read a torch.profiler Chrome trace of a real run into parsim's trace schema.

The executor wraps every action, collective, transfer and the optimizer in
``torch.profiler.record_function(name)`` with the names of the naming
contract (:mod:`parsim.trace`), so a run under ``torch.profiler`` (ours, or
any training loop that annotates the same way) carries them as
``user_annotation`` events. This reader keeps those whose names follow the
contract and derives kind, stream and phase from the name alone; other
annotations (``ProfilerStep#3``, a user's own labels) are ignored.

One difference in what the spans cover: the runner times a send from its
issue to its completion, but only the issue runs on the rank's thread, so a
profiler's send annotation covers the issue alone.

Kineto writes one file per rank; the rank comes from ``distributedInfo`` when
the run was distributed, else 0. Times become seconds from the first kept
event, or from the start of ``ProfilerStep#<step>`` when ``step`` is given
(the profiler's ``prof.step()`` marks steps so).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from parsim.cluster import MAX_GPUS
from parsim.errors import ParsimError
from parsim.files import read_json
from parsim.trace import Event, Trace

_COMPUTE = re.compile(r"^([FBIW]) stage=\d+ mb=\d+$")
_COLLECTIVE = re.compile(r"^(all_reduce|all_gather|reduce_scatter) (\w+)( \w+=\S+)*$")
_P2P = re.compile(r"^(send|recv) (act|grad) stage=\d+ mb=\d+ peer=\d+$")
_PHASE = {"F": "forward", "B": "backward", "I": "backward", "W": "weight-grad"}
_GROUP_PHASE = {"tp": "tp", "dp": "dp", "embedding": "dp"}


def classify(name: str) -> tuple[str, str, str] | None:
    """``(kind, stream, phase)`` of an event named by the contract, or None for any other name."""
    if name == "optimizer step":
        return "optimizer", "compute", "optimizer"
    match = _COMPUTE.match(name)
    if match:
        return "compute", "compute", _PHASE[match.group(1)]
    match = _COLLECTIVE.match(name)
    if match and match.group(2) in _GROUP_PHASE:
        return "collective", "comm", _GROUP_PHASE[match.group(2)]
    match = _P2P.match(name)
    if match:
        return match.group(1), "p2p", "pp"
    return None


def read_torch_profiler_trace(path: str | Path, step: int | None = None) -> Trace:
    """The contract-named ``user_annotation`` events of a ``prof.export_chrome_trace`` file as a Trace."""
    data = read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ParsimError(f"{path}: not a torch.profiler Chrome trace (no traceEvents list)")
    rank, world = _rank_and_world(data.get("distributedInfo") or {}, path)
    if not all(isinstance(e, dict) for e in data["traceEvents"]):
        raise ParsimError(f"{path}: not a torch.profiler Chrome trace (an event is not an object)")
    spans = [_checked_span(e, path) for e in data["traceEvents"]
             if e.get("ph") == "X" and e.get("cat") == "user_annotation" and "ts" in e]
    window = _step_window(spans, step, path)
    kept = []
    for e in spans:
        start, end = e["ts"], e["ts"] + e["dur"]
        kinds = classify(e["name"])
        if kinds is None or (window and not (window[0] <= start and end <= window[1])):
            continue
        kept.append((start, end, e["name"], kinds))
    if not kept:
        raise ParsimError(f"{path}: no user annotations named like parsim events (e.g. 'F stage=0 mb=0')")
    t0 = window[0] if window else min(start for start, *_ in kept)
    events = [Event(name, rank, stream, kind, (start - t0) * 1e-6, (end - start) * 1e-6, {"phase": phase})
              for start, end, name, (kind, stream, phase) in sorted(kept)]
    return Trace("measured", world, events, meta={"source_file": str(path), "reader": "torch.profiler"})


def _rank_and_world(info: object, path: str | Path) -> tuple[int, int]:
    """The rank and world size ``distributedInfo`` gives (0 of 1 without it)."""
    rank = info.get("rank", 0) if isinstance(info, dict) else None
    world = info.get("world_size", (rank if isinstance(rank, int) else 0) + 1) if isinstance(info, dict) else None
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (rank, world)) or not 0 <= rank < world <= MAX_GPUS:
        raise ParsimError(f"{path}: distributedInfo {info!r:.80} does not give a rank below its world_size")
    return rank, world


def _checked_span(e: dict, path: str | Path) -> dict:
    """A complete event with a string name, a finite start and a finite duration >= 0 (0 when absent)."""
    ts, dur = e["ts"], e.get("dur", 0.0)
    numbers = all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) for t in (ts, dur))
    if not isinstance(e.get("name"), str) or not numbers or dur < 0:
        raise ParsimError(f"{path}: event {e!r:.120} needs a name, a finite ts and a finite dur >= 0")
    return {"name": e["name"], "ts": float(ts), "dur": float(dur)}


def _step_window(spans: list[dict], step: int | None, path: str | Path) -> tuple[float, float] | None:
    if step is None:
        return None
    for e in spans:
        if e.get("name") == f"ProfilerStep#{step}":
            return e["ts"], e["ts"] + e["dur"]
    raise ParsimError(f"{path}: no ProfilerStep#{step} in the trace (call prof.step() once per step)")
