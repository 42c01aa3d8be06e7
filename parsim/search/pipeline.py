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

from ..errors import ParsimError
from ..schedules import SCHEDULES, Schedule, dependencies, make_schedule

KINDS = ("F", "B", "I", "W")
# Above this many microbatches a schedule is timed at two shorter lengths and extended (see the module docstring).
SWEEP_ROUNDS = 2


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
    """Rows of the end-time table: one per pass (in a dependency order), then one per rank's start, then a
    row of zeros."""
    schedule = make_schedule(name, pp, m, v)
    actions = [a for acts in schedule.actions for a in acts]
    rank_of = [r for r, acts in enumerate(schedule.actions) for _ in acts]
    where = {a: i for i, a in enumerate(actions)}
    prereqs = []  # per action (in rank order): the actions it waits for, the rank's previous one first
    for i, a in enumerate(actions):
        before = [i - 1] if i > 0 and rank_of[i - 1] == rank_of[i] else [-1]
        prereqs.append(before + [where[d] for d in dependencies(schedule, a)])
    order = _topological(prereqs)
    if len(order) != len(actions):
        raise ParsimError(f"schedule {name} (pp={pp}, m={m}) deadlocks")
    n, stages = len(actions), schedule.num_stages
    row = [0] * n
    for j, i in enumerate(order):
        row[i] = j  # action -> its row (its place in the dependency order)
    zero_row, zero_hop = n + pp, stages - 1
    var, rank, depth = [0] * n, [0] * n, [0] * n
    waits = [[zero_row] * 3 for _ in range(n)]
    hop = [[zero_hop] * 3 for _ in range(n)]
    for i in order:
        a, r, j = actions[i], rank_of[i], row[i]
        var[j], rank[j] = a.stage * 4 + KINDS.index(a.kind), r
        first, *deps = prereqs[i]
        waits[j][0] = n + r if first < 0 else row[first]
        for k, d in enumerate(deps, start=1):
            waits[j][k] = row[d]
            if rank_of[d] != r:
                hop[j][k] = min(actions[d].stage, a.stage)
        depth[j] = 1 + max((depth[w] for w in waits[j] if w < n), default=-1)
    var, rank, depth = np.array(var), np.array(rank), np.array(depth)
    waits, hop = np.array(waits, dtype=np.int64), np.array(hop, dtype=np.int64)
    waves = tuple(np.flatnonzero(depth == k) for k in range(depth.max() + 1))
    last = np.array([row[where[acts[-1]]] for acts in schedule.actions])
    final = np.empty(stages, dtype=np.int64)
    for i, a in enumerate(actions):
        if a.microbatch == m - 1 and a.kind in ("B", "W"):
            final[a.stage] = row[i]
    counts = np.zeros((pp, stages * 4))
    np.add.at(counts, (rank, var), 1)
    return CompiledSchedule(schedule, rank, var, waits, hop, waves, last, final, counts)


def _topological(prereqs: list[list[int]]) -> list[int]:
    """Kahn's order of the actions (-1 in ``prereqs`` stands for none)."""
    waiting = [sum(1 for p in ps if p >= 0) for ps in prereqs]
    followers: list[list[int]] = [[] for _ in prereqs]
    for i, ps in enumerate(prereqs):
        for p in ps:
            if p >= 0:
                followers[p].append(i)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    order = []
    while ready:
        i = ready.pop()
        order.append(i)
        for f in followers[i]:
            waiting[f] -= 1
            if waiting[f] == 0:
                ready.append(f)
    return order


@dataclass
class PipelineTiming:
    """Per plan of a batch: when each rank's last pass ends and when each stage's final
    weight-gradient pass starts (its gradients are final as it runs), in seconds from the step's start."""

    rank_end: np.ndarray  # [batch, pp]
    final_start: np.ndarray  # [batch, stages]
    starts: np.ndarray | None = None  # [batch, passes] every pass's start (``every_pass``)
    compiled: CompiledSchedule | None = None  # whose passes ``starts`` are: the schedule timed, or a shorter
    # one of the same shape that a long schedule extends (its last passes are the long one's, shifted)
    starts_end: np.ndarray | None = None  # [batch, pp] rank ends of that schedule


def sweep(compiled: CompiledSchedule, durations: np.ndarray, hops: np.ndarray, start: np.ndarray | None = None,
          every_pass: bool = False, lead: np.ndarray | None = None,
          final_extra: np.ndarray | None = None) -> PipelineTiming:
    """Time ``compiled`` for a batch: ``durations`` [batch, stages * 4], ``hops`` [batch, stages - 1],
    ``start`` [batch, pp] the time each rank can begin (default 0); ``every_pass`` keeps every pass's start.

    ``lead`` [batch, stages * 4] is the part of a pass that needs only its rank, not its inputs (FSDP's
    prefetched weights): it runs while the rank waits for them, so a pass ends at
    ``max(rank free + lead, inputs ready) + duration - lead``. ``final_extra`` [batch, stages]: what each
    stage's final weight-gradient pass takes beyond its kind's duration (the gradient buckets' kernels
    beside it holding SMs)."""
    batch, n, pp = durations.shape[0], len(compiled.var), compiled.pp
    dur = durations.T[compiled.var]  # [passes, batch]
    if final_extra is not None:
        dur[compiled.final_grad] += final_extra.T
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
    rank_end = end[compiled.last_of_rank].T.copy()
    return PipelineTiming(rank_end, final.T.copy(), starts, compiled if every_pass else None,
                          rank_end if every_pass else None)


def round_length(name: str, pp: int, v: int) -> int:
    """Microbatches per repeat of the steady state: a round of ``pp`` for looped and V schedules."""
    kind = SCHEDULES[name]
    return pp if kind.needs_whole_rounds(v) or v > 1 or kind.microbatch_per_stage else 1


def time_schedule(name: str, pp: int, m: int, v: int, durations: np.ndarray, hops: np.ndarray,
                  start: np.ndarray | None = None, every_pass: bool = False,
                  lead: np.ndarray | None = None, final_extra: np.ndarray | None = None) -> PipelineTiming:
    """:func:`sweep` of the schedule, extended along its steady state when ``m`` is long.

    The schedule is timed at three shorter lengths a round apart; where the
    two increments agree (the steady state is reached) the line through them is
    extended to ``m``, and the plans of the batch where they do not are swept in
    full. With ``every_pass``, every pass's start of the shortest is kept.
    """
    step = max(2, round_length(name, pp, v))
    short = SWEEP_ROUNDS * pp * v + (m % step)
    if m <= short + 3 * step or not SCHEDULES[name].rounds_of_pp(pp, m, v):
        return sweep(compile_schedule(name, pp, m, v), durations, hops, start, every_pass, lead, final_extra)
    a, b, c = (sweep(compile_schedule(name, pp, short + k * step, v), durations, hops, start, every_pass and k == 0,
                     lead, final_extra) for k in range(3))
    rounds = (m - short) / step
    out = PipelineTiming(a.rank_end + rounds * (b.rank_end - a.rank_end),
                         a.final_start + rounds * (b.final_start - a.final_start), a.starts, a.compiled, a.starts_end)
    tolerance = 1e-9 * np.abs(c.rank_end).max(axis=1)
    steady = ((np.abs((c.rank_end - b.rank_end) - (b.rank_end - a.rank_end)).max(axis=1) <= tolerance)
              & (np.abs((c.final_start - b.final_start) - (b.final_start - a.final_start)).max(axis=1) <= tolerance))
    if not steady.all():
        rest = ~steady
        full = sweep(compile_schedule(name, pp, m, v), durations[rest], hops[rest],
                     None if start is None else start[rest], lead=None if lead is None else lead[rest],
                     final_extra=None if final_extra is None else final_extra[rest])
        out.rank_end[rest], out.final_start[rest] = full.rank_end, full.final_start
    return out
