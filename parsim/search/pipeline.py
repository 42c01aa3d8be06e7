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
from ..schedules import SCHEDULES, Schedule, dependencies, make_schedule, paired_schedule

KINDS = ("F", "B", "I", "W")
# Above this many microbatches a schedule is timed at two shorter lengths and extended (see the module docstring).
SWEEP_ROUNDS = 2


@dataclass(frozen=True)
class CompiledSchedule:
    """One schedule as arrays, its passes grouped in waves that can be timed together.

    Durations are indexed ``stage * 4 + kind`` (kinds F, B, I, W), then one
    column per type of pair (:attr:`pairs`). Every pass waits for up to
    ``waits.shape[1]`` others: the pass before it on its rank (or the rank's
    start), and the passes whose outputs it uses; a dependency across ranks
    adds the transfer time of the stage boundary it crosses (boundary ``b``
    between stages ``b`` and ``b + 1``). A wave holds the passes whose longest
    chain of prerequisites has the same length, so each depends only on
    earlier waves.

    A pair (``ep_comm_overlap``: a forward run together with the backward after
    it) is one pass of the table, as the lowering runs it
    (:meth:`~parsim.lowering.lower.Lowering._paired`): it waits for what either
    of its passes waits for, both its outputs leave when it ends, and the
    rank's next pass waits for those sends too.
    """

    schedule: Schedule
    rank: np.ndarray  # per pass: the rank that runs it
    var: np.ndarray  # per pass: stage * 4 + kind, or stages * 4 + its type of pair
    waits: np.ndarray  # [passes, width]: rows of the end-time table each pass waits for (padding: the zero row)
    hop: np.ndarray  # [passes, width]: the boundary each wait crosses (padding and same rank: the zero boundary)
    queued: np.ndarray  # [passes, width]: the boundary of a transfer out of a pair that went first, or the zero one
    waves: tuple[np.ndarray, ...]  # pass indices, wave by wave
    last_of_rank: np.ndarray  # per rank: its last pass
    final_grad: np.ndarray  # per stage: its last microbatch's weight-gradient pass (B, or W where split)
    counts: np.ndarray  # [pp, stages * 4]: how many passes of each (stage, kind) each rank runs
    pairs: np.ndarray  # [types of pair, 2]: the stages of each type's forward and backward
    pair_counts: np.ndarray  # [pp, types of pair]: how many pairs of each type each rank runs

    @property
    def pp(self) -> int:
        return self.schedule.pp

    @property
    def num_stages(self) -> int:
        return self.schedule.num_stages


@lru_cache(maxsize=None)
def compile_schedule(name: str, pp: int, m: int, v: int, paired: bool = False) -> CompiledSchedule:
    """Rows of the end-time table: one per pass (in a dependency order), then one per rank's start, then a
    row of zeros. ``paired``: the schedule as ``ep_comm_overlap`` runs it (:func:`paired_schedule`)."""
    schedule = paired_schedule(name, pp, m, v) if paired else make_schedule(name, pp, m, v)
    actions = [a for acts in schedule.actions for a in acts]
    rank_of = [r for r, acts in enumerate(schedule.actions) for _ in acts]
    where = {a: i for i, a in enumerate(actions)}
    node_of, members = _nodes(schedule, paired)
    n, stages = len(members), schedule.num_stages
    owner = [schedule.stage_to_rank(st) for st in range(stages)]
    prereqs = []  # per node: the nodes it waits for, the rank's previous one first
    crossed = []  # per node and node it depends on: the boundary the dependency crosses, and the action it needs
    for k, group in enumerate(members):
        r = rank_of[group[0]]
        before = k - 1 if k > 0 and rank_of[members[k - 1][0]] == r else -1
        deps: dict[int, tuple[int, int]] = {}
        for i in group:
            for d in dependencies(schedule, actions[i]):
                deps.setdefault(node_of[where[d]], (min(d.stage, actions[i].stage), where[d]))
        deps.pop(k, None)
        prereqs.append([before] + list(deps))
        crossed.append(deps)
    order = _topological(prereqs)
    if len(order) != n:
        raise ParsimError(f"schedule {name} (pp={pp}, m={m}) deadlocks")
    row = [0] * n
    for j, k in enumerate(order):
        row[k] = j  # node -> its row (its place in the dependency order)
    width = max(3, max(len(p) for p in prereqs))
    zero_row, zero_hop = n + pp, stages - 1
    pair_types: dict[tuple[int, int], int] = {}
    var, rank, depth = [0] * n, [0] * n, [0] * n
    waits = [[zero_row] * width for _ in range(n)]
    hop = [[zero_hop] * width for _ in range(n)]
    queued = [[zero_hop] * width for _ in range(n)]
    for k in order:
        group, j = members[k], row[k]
        r = rank_of[group[0]]
        rank[j] = r
        if len(group) == 1:
            a = actions[group[0]]
            var[j] = a.stage * 4 + KINDS.index(a.kind)
        else:
            f, b = actions[group[0]], actions[group[1]]
            var[j] = stages * 4 + pair_types.setdefault((f.stage, b.stage), len(pair_types))
        before, *deps = prereqs[k]
        waits[j][0] = n + r if before < 0 else row[before]
        if before >= 0 and len(members[before]) == 2:  # the pair's sends, which this pass waits for
            sends = _pair_sends([actions[i] for i in members[before]], owner, r)
            hop[j][0], queued[j][0] = (sends + [zero_hop, zero_hop])[:2]
        for c, d in enumerate(deps, start=1):
            waits[j][c] = row[d]
            if rank_of[members[d][0]] != r:
                hop[j][c], producer = crossed[k][d]
                # a pair's forward's output leaves behind the backward's
                if len(members[d]) == 2 and producer == members[d][0]:
                    sends = _pair_sends([actions[i] for i in members[d]], owner, rank_of[producer])
                    queued[j][c] = sends[0] if len(sends) == 2 else zero_hop
        depth[j] = 1 + max((depth[w] for w in waits[j] if w < n), default=-1)
    var, rank, depth = np.array(var), np.array(rank), np.array(depth)
    waits, hop, queued = (np.array(x, dtype=np.int64) for x in (waits, hop, queued))
    waves = tuple(np.flatnonzero(depth == d) for d in range(depth.max() + 1))
    last = np.array([row[node_of[where[acts[-1]]]] for acts in schedule.actions])
    final = np.empty(stages, dtype=np.int64)
    counts = np.zeros((pp, stages * 4))
    for i, a in enumerate(actions):
        counts[rank_of[i], a.stage * 4 + KINDS.index(a.kind)] += 1
        if a.microbatch == m - 1 and a.kind in ("B", "W"):
            final[a.stage] = row[node_of[i]]
    pair_counts = np.zeros((pp, len(pair_types)))
    is_pair = var >= stages * 4
    np.add.at(pair_counts, (rank[is_pair], var[is_pair] - stages * 4), 1)
    pairs = np.array(list(pair_types), dtype=np.int64).reshape(-1, 2)
    return CompiledSchedule(schedule, rank, var, waits, hop, queued, waves, last, final, counts, pairs, pair_counts)


def _nodes(schedule: Schedule, paired: bool) -> tuple[list[int], list[list[int]]]:
    """The sweep's passes: per action (ranks' lists one after another) its node, and per node its actions;
    with ``paired``, a pair's forward and backward share one."""
    node_of: list[int] = []
    members: list[list[int]] = []
    offset = 0
    for r, acts in enumerate(schedule.actions):
        pairs_here = schedule.paired[r] if paired else frozenset()
        for i in range(len(acts)):
            if i - 1 in pairs_here:
                members[-1].append(offset + i)
            else:
                members.append([offset + i])
            node_of.append(len(members) - 1)
        offset += len(acts)
    return node_of, members


def _pair_sends(pair: list, owner: list[int], rank: int) -> list[int]:
    """The boundaries a pair's sends to other ranks cross, in the order the lowering sends them: its
    backward's, then its forward's."""
    forward, backward = pair
    sends = []
    if backward.stage > 0 and owner[backward.stage - 1] != rank:
        sends.append(backward.stage - 1)
    if forward.stage + 1 < len(owner) and owner[forward.stage + 1] != rank:
        sends.append(forward.stage)
    return sends


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
          final_extra: np.ndarray | None = None, savings: np.ndarray | None = None) -> PipelineTiming:
    """Time ``compiled`` for a batch: ``durations`` [batch, stages * 4], ``hops`` [batch, stages - 1],
    ``start`` [batch, pp] the time each rank can begin (default 0); ``every_pass`` keeps every pass's start.

    ``lead`` [batch, stages * 4] is the part of a pass that needs only its rank, not its inputs (FSDP's
    prefetched weights): it runs while the rank waits for them, so a pass ends at
    ``max(rank free + lead, inputs ready) + duration - lead``. ``final_extra`` [batch, stages]: what each
    stage's final weight-gradient pass takes beyond its kind's duration (the gradient buckets' kernels
    beside it holding SMs). A pair takes its forward's and backward's durations less ``savings`` [batch,
    stages, stages] at (the forward's stage, the backward's): what running them together saves."""
    if len(compiled.pairs):
        forward, backward = compiled.pairs[:, 0], compiled.pairs[:, 1]
        together = durations[:, forward * 4] + durations[:, backward * 4 + 1]
        if savings is not None:
            together = together - savings[:, forward, backward]
        durations = np.concatenate([durations, together], axis=1)
        if lead is not None:
            lead = np.concatenate([lead, np.zeros_like(together)], axis=1)
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
        ready = end[compiled.waits[wave]] + hop[compiled.hop[wave]] + hop[compiled.queued[wave]]  # 0: rank's previous
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
                  lead: np.ndarray | None = None, final_extra: np.ndarray | None = None,
                  savings: np.ndarray | None = None) -> PipelineTiming:
    """:func:`sweep` of the schedule, extended along its steady state when ``m`` is long; with ``savings``,
    the schedule as ``ep_comm_overlap`` runs it, its pairs saving that much (:func:`compile_schedule`).

    The schedule is timed at three shorter lengths a round apart; where the
    two increments agree (the steady state is reached) the line through them is
    extended to ``m``, and the plans of the batch where they do not are swept in
    full. With ``every_pass``, every pass's start of the shortest is kept.
    """
    step = max(2, round_length(name, pp, v))
    short = SWEEP_ROUNDS * pp * v + (m % step)
    paired = savings is not None
    if m <= short + 3 * step or not SCHEDULES[name].rounds_of_pp(pp, m, v):
        return sweep(compile_schedule(name, pp, m, v, paired), durations, hops, start, every_pass, lead, final_extra,
                     savings)
    a, b, c = (sweep(compile_schedule(name, pp, short + k * step, v, paired), durations, hops, start,
                     every_pass and k == 0, lead, final_extra, savings) for k in range(3))
    rounds = (m - short) / step
    out = PipelineTiming(a.rank_end + rounds * (b.rank_end - a.rank_end),
                         a.final_start + rounds * (b.final_start - a.final_start), a.starts, a.compiled, a.starts_end)
    tolerance = 1e-9 * np.abs(c.rank_end).max(axis=1)
    steady = ((np.abs((c.rank_end - b.rank_end) - (b.rank_end - a.rank_end)).max(axis=1) <= tolerance)
              & (np.abs((c.final_start - b.final_start) - (b.final_start - a.final_start)).max(axis=1) <= tolerance))
    if not steady.all():
        rest = ~steady
        full = sweep(compile_schedule(name, pp, m, v, paired), durations[rest], hops[rest],
                     None if start is None else start[rest], lead=None if lead is None else lead[rest],
                     final_extra=None if final_extra is None else final_extra[rest],
                     savings=None if savings is None else savings[rest])
        out.rank_end[rest], out.final_start[rest] = full.rank_end, full.final_start
    return out


@lru_cache(maxsize=None)
def pairs_per_rank(name: str, pp: int, m: int, v: int) -> np.ndarray:
    """[pp, stages, stages]: how many pairs of a forward of one stage and a backward of another each rank
    runs under ``ep_comm_overlap``; a long schedule's counted at two shorter lengths and extended along its
    steady state, as :func:`time_schedule` does."""
    def dense(compiled: CompiledSchedule) -> np.ndarray:
        out = np.zeros((pp, compiled.num_stages, compiled.num_stages))
        out[:, compiled.pairs[:, 0], compiled.pairs[:, 1]] = compiled.pair_counts
        return out
    step = max(2, round_length(name, pp, v))
    short = SWEEP_ROUNDS * pp * v + (m % step)
    if m <= short + 3 * step or not SCHEDULES[name].rounds_of_pp(pp, m, v):
        return dense(compile_schedule(name, pp, m, v, True))
    a, b = (dense(compile_schedule(name, pp, short + k * step, v, True)) for k in range(2))
    return a + (m - short) / step * (b - a)
