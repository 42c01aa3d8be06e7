"""A schedule's timing for many plans at once: the fast model's pipeline.

The step simulator runs each rank's action list in order, every pass waiting
for its rank and for the passes it depends on, plus the point-to-point
transfer where those ran on another rank. That is
:func:`~parsim.schedules.simulate_ideal`'s dependency-driven timing, with a
time per (stage, pass kind) and a transfer time per stage boundary.
:class:`CompiledSchedule` turns one schedule into flat arrays once and times
it for a whole batch of plans in one sweep, each step a few numpy operations
over the batch.

Long schedules are not swept to the end: once the pipeline is full, every
schedule here repeats itself, so each finishing time grows by the same amount
per round of microbatches (``pp`` microbatches for looped and V schedules,
one otherwise). :func:`time_schedule` times two shorter schedules of the same
shape and extends the line; ``tests/test_search_pipeline.py`` checks the
extension against full sweeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..schedules import SCHEDULES, Schedule, dependencies, execution_order, make_schedule

KINDS = ("F", "B", "I", "W")
# Above this many microbatches a schedule is timed at two shorter lengths and extended (see the module docstring).
SWEEP_ROUNDS = 4


@dataclass(frozen=True)
class CompiledSchedule:
    """One schedule as arrays, its passes grouped in waves that can be timed together.

    Durations are indexed ``stage * 4 + kind`` (kinds F, B, I, W). Every pass
    waits for up to three others: the pass before it on its rank (or the
    rank's start), and the passes whose outputs it uses; a dependency across
    ranks adds the transfer time of the stage boundary it crosses (boundary
    ``b`` between stages ``b`` and ``b + 1``). A wave holds the passes whose
    longest chain of prerequisites has the same length, so each depends only
    on earlier waves.
    """

    schedule: Schedule
    rank: np.ndarray  # per pass: the rank that runs it
    var: np.ndarray  # per pass: stage * 4 + kind
    waits: np.ndarray  # [passes, 3]: rows of the end-time table each pass waits for (padding: the zero row)
    hop: np.ndarray  # [passes, 3]: the boundary each wait crosses (padding and same rank: the zero boundary)
    waves: tuple[np.ndarray, ...]  # pass indices, wave by wave
    last_of_rank: np.ndarray  # per rank: its last pass
    final_grad: np.ndarray  # per stage: its last microbatch's weight-gradient pass (B, or W where split)
    counts: np.ndarray  # [pp, stages * 4]: how many passes of each (stage, kind) each rank runs

    @property
    def pp(self) -> int:
        return self.schedule.pp

    @property
    def num_stages(self) -> int:
        return self.schedule.num_stages


@lru_cache(maxsize=None)
def compile_schedule(name: str, pp: int, m: int, v: int) -> CompiledSchedule:
    """Rows of the end-time table: one per pass, then one per rank's start, then a row of zeros."""
    schedule = make_schedule(name, pp, m, v)
    order = execution_order(schedule)
    n, stages = len(order), schedule.num_stages
    index = {a: i for i, a in enumerate(order)}
    zero_row, zero_hop = n + pp, stages - 1
    var = np.empty(n, dtype=np.int64)
    waits = np.full((n, 3), zero_row, dtype=np.int64)
    hop = np.full((n, 3), zero_hop, dtype=np.int64)
    depth = np.zeros(n, dtype=np.int64)
    previous = [n + r for r in range(pp)]  # each rank's first pass waits for the rank's start
    for a in order:
        i, r = index[a], schedule.stage_to_rank(a.stage)
        var[i] = a.stage * 4 + KINDS.index(a.kind)
        waits[i, 0], previous[r] = previous[r], i
        for k, d in enumerate(dependencies(schedule, a), start=1):
            waits[i, k] = index[d]
            if schedule.stage_to_rank(d.stage) != r:
                hop[i, k] = min(d.stage, a.stage)
        depth[i] = 1 + max((depth[w] for w in waits[i] if w < n), default=-1)
    waves = tuple(np.flatnonzero(depth == k) for k in range(depth.max() + 1))
    last = np.array([index[acts[-1]] for acts in schedule.actions])
    final = np.empty(stages, dtype=np.int64)
    for a, i in index.items():
        if a.microbatch == m - 1 and a.kind in ("B", "W"):
            final[a.stage] = i
    rank = np.array([schedule.stage_to_rank(a.stage) for a in order])
    counts = np.zeros((pp, stages * 4))
    np.add.at(counts, (rank, var), 1)
    return CompiledSchedule(schedule, rank, var, waits, hop, waves, last, final, counts)


@dataclass
class PipelineTiming:
    """Per plan of a batch: when each rank's last pass ends and when each stage's final
    weight-gradient pass starts (its gradients are final as it runs), in seconds from the step's start."""

    rank_end: np.ndarray  # [batch, pp]
    final_start: np.ndarray  # [batch, stages]
    starts: np.ndarray | None = None  # [batch, passes] every pass's start (``sweep(..., every_pass=True)``)
    compiled: CompiledSchedule | None = None  # whose passes ``starts`` are


def sweep(compiled: CompiledSchedule, durations: np.ndarray, hops: np.ndarray, start: np.ndarray | None = None,
          every_pass: bool = False, lead: np.ndarray | None = None) -> PipelineTiming:
    """Time ``compiled`` for a batch: ``durations`` [batch, stages * 4], ``hops`` [batch, stages - 1],
    ``start`` [batch, pp] the time each rank can begin (default 0); ``every_pass`` keeps every pass's start.

    ``lead`` [batch, stages * 4] is the part of a pass that needs only its rank, not its inputs (FSDP's
    prefetched weights): it runs while the rank waits for them, so a pass ends at
    ``max(rank free + lead, inputs ready) + duration - lead``."""
    batch, n, pp = durations.shape[0], len(compiled.var), compiled.pp
    dur = durations.T[compiled.var]  # [passes, batch]
    ahead = np.zeros_like(dur) if lead is None else lead.T[compiled.var]
    hop = np.vstack([hops.T, np.zeros((1, batch))])
    end = np.zeros((n + pp + 1, batch))
    if start is not None:
        end[n:n + pp] = start.T
    for wave in compiled.waves:
        ready = end[compiled.waits[wave]] + hop[compiled.hop[wave]]  # [passes, 3, batch]; 0: the rank's previous
        ready[:, 0] += ahead[wave]
        end[wave] = ready.max(axis=1) + dur[wave] - ahead[wave]
    final = end[compiled.final_grad] - dur[compiled.final_grad]
    starts = (end[:n] - dur).T.copy() if every_pass else None
    return PipelineTiming(end[compiled.last_of_rank].T.copy(), final.T.copy(), starts, compiled if every_pass else None)


def round_length(name: str, pp: int, v: int) -> int:
    """Microbatches per repeat of the steady state: a round of ``pp`` for looped and V schedules."""
    kind = SCHEDULES[name]
    return pp if kind.needs_whole_rounds(v) or v > 1 or kind.microbatch_per_stage else 1


def time_schedule(name: str, pp: int, m: int, v: int, durations: np.ndarray, hops: np.ndarray,
                  start: np.ndarray | None = None, every_pass: bool = False,
                  lead: np.ndarray | None = None) -> PipelineTiming:
    """:func:`sweep` of the schedule, extended along its steady state when ``m`` is long (unless
    ``every_pass`` asks for every pass's start).

    The schedule is timed at three shorter lengths a round apart; where the
    two increments agree (the steady state is reached) the line through them is
    extended to ``m``, and the plans of the batch where they do not are swept in full.
    """
    step = 2 * round_length(name, pp, v)
    short = SWEEP_ROUNDS * pp * v + (m % step)
    if m <= short + 3 * step or every_pass:
        return sweep(compile_schedule(name, pp, m, v), durations, hops, start, every_pass, lead)
    a, b, c = (sweep(compile_schedule(name, pp, short + k * step, v), durations, hops, start, lead=lead)
               for k in range(3))
    rounds = (m - short) / step
    out = PipelineTiming(a.rank_end + rounds * (b.rank_end - a.rank_end),
                         a.final_start + rounds * (b.final_start - a.final_start))
    tolerance = 1e-9 * np.abs(c.rank_end).max(axis=1)
    steady = ((np.abs((c.rank_end - b.rank_end) - (b.rank_end - a.rank_end)).max(axis=1) <= tolerance)
              & (np.abs((c.final_start - b.final_start) - (b.final_start - a.final_start)).max(axis=1) <= tolerance))
    if not steady.all():
        rest = ~steady
        full = sweep(compile_schedule(name, pp, m, v), durations[rest], hops[rest],
                     None if start is None else start[rest], lead=None if lead is None else lead[rest])
        out.rank_end[rest], out.final_start[rest] = full.rank_end, full.final_start
    return out
