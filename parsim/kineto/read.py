"""Read a folder of torch.profiler (Kineto) traces of any training run into parsim's trace schema.

One file per rank, as ``torch.profiler`` writes them (``on_trace_ready`` or
``export_chrome_trace`` on every rank); the rank comes from
``distributedInfo``. One step is read: of the ``ProfilerStep#N`` slices every
rank has, the one of median length (the whole file when there are none).
Times become seconds from the rank's step start.

What is recognized, from torch's own events (:mod:`.recognize` names them):

* **parsim's names** where the loop annotated them (``parsim run --profile``,
  or any loop using ``record_function`` with the names of
  :mod:`parsim.report.trace`): compute actions, pipeline transfers, the optimizer;
* **collectives** from the backend's own events: ``gloo:all_reduce`` (the
  worker thread's span of the real work) or NCCL's kernels
  (``ncclDevKernel_AllReduce_...``), with their element counts;
* **compute** otherwise, by phase: ``autograd::engine::evaluate_function``
  is the backward, ``Optimizer.step#...`` the optimizer, other top-level
  operators the forward. On GPUs a kernel takes the phase of the operator that
  launched it (``correlation``).

Collectives are named by group later, against the plan (:mod:`.match`):
the profile alone does not say which group a gloo call used.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from ..errors import ParsimError
from ..files import read_json
from ..hardware.cluster import MAX_GPUS
from ..report.trace import Event, Trace
from . import recognize


@dataclass
class RankProfile:
    path: Path
    rank: int
    world_size: int
    events: list[dict]  # complete ("X") events with a timestamp
    steps: dict[int, tuple[float, float]]  # ProfilerStep number -> (start, end) in microseconds


def read_profiles(folder: str | Path) -> list[RankProfile]:
    """Every rank's trace in ``folder`` (``*.json`` and ``*.json.gz``), one per rank, in rank order."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ParsimError(f"{folder}: not a folder of torch.profiler traces (one file per rank)")
    paths = sorted(p for p in folder.iterdir() if p.name.endswith((".json", ".json.gz")))
    if not paths:
        raise ParsimError(f"{folder}: no trace files (*.json, *.json.gz)")
    profiles: dict[int, RankProfile] = {}
    for path in paths:
        profile = _read_one(path)
        if profile.rank in profiles:
            raise ParsimError(f"{folder}: {profiles[profile.rank].path.name} and {path.name} are both rank "
                              f"{profile.rank}; keep one trace per rank in the folder")
        profiles[profile.rank] = profile
    worlds = {p.world_size for p in profiles.values()}
    if len(worlds) > 1:
        raise ParsimError(f"{folder}: the traces disagree on the world size ({sorted(worlds)})")
    return [profiles[r] for r in sorted(profiles)]


def measured_trace(profiles: list[RankProfile]) -> Trace:
    """The median common profiler step of every rank as one measured Trace (collectives not yet named)."""
    step = _median_step(profiles)
    events: list[Event] = []
    for profile in profiles:
        window = profile.steps[step] if step is not None else _extent(profile.events)
        events += recognize.rank_events(profile.events, profile.rank, window)
    meta = {"reader": "torch.profiler", "folder": str(profiles[0].path.parent),
            "profiler_step": step, "files": [p.path.name for p in profiles]}
    return Trace("measured", profiles[0].world_size, events, meta)


def _read_one(path: Path) -> RankProfile:
    data = read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ParsimError(f"{path}: not a torch.profiler trace (no traceEvents list)")
    rank, world = _rank_and_world(data.get("distributedInfo") or {}, path)
    events = [_checked(e, path) for e in data["traceEvents"] if not isinstance(e, dict) or e.get("ph") == "X"]
    steps = {}
    for e in events:
        number = recognize.profiler_step(e)
        # the host's slice: a CUDA trace also marks the step on the GPU's timeline, an instant where it ends
        if number is not None and e.get("cat") != "gpu_user_annotation":
            steps[number] = (e["ts"], e["ts"] + e["dur"])
    return RankProfile(path, rank, world, events, steps)


def _rank_and_world(info: object, path: Path) -> tuple[int, int]:
    """The rank and world size ``distributedInfo`` gives (rank 0 of 1 without it)."""
    if not isinstance(info, dict):
        raise ParsimError(f"{path}: distributedInfo is not an object")
    rank, world = info.get("rank", 0), info.get("world_size", 1)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (rank, world)) or not 0 <= rank < world <= MAX_GPUS:
        raise ParsimError(f"{path}: distributedInfo {info!r:.80} does not give a rank below its world_size")
    return rank, world


def _checked(e: object, path: Path) -> dict:
    """A complete event with a string name, a finite start and a finite duration >= 0 (0 when absent)."""
    if not isinstance(e, dict):
        raise ParsimError(f"{path}: an event is not an object ({e!r:.40})")
    ts, dur = e.get("ts"), e.get("dur", 0.0)
    numbers = all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) for t in (ts, dur))
    if not isinstance(e.get("name"), str) or not numbers or dur < 0 or not isinstance(e.get("args", {}), dict):
        raise ParsimError(f"{path}: event {e!r:.120} needs a name, a finite ts, a finite dur >= 0 and args that "
                          "are an object")
    return dict(e, ts=float(ts), dur=float(dur))


def _median_step(profiles: list[RankProfile]) -> int | None:
    """The ProfilerStep every rank has whose longest rank is the median of such steps (None: no steps)."""
    common = set.intersection(*(set(p.steps) for p in profiles))
    if not common:
        if any(p.steps for p in profiles):
            raise ParsimError("the ranks' traces share no ProfilerStep#N (profile the same steps on every rank)")
        return None
    length = {n: max(p.steps[n][1] - p.steps[n][0] for p in profiles) for n in common}
    median = statistics.median_low(sorted(length.values()))
    return min(n for n in common if length[n] == median)


def _extent(events: list[dict]) -> tuple[float, float]:
    if not events:
        return 0.0, 0.0
    return min(e["ts"] for e in events), max(e["ts"] + e["dur"] for e in events)
