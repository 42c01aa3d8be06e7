"""CPU cores shared by more ranks than they can run at once, as the kernel's scheduler shares them.

A rank waiting in gloo sleeps and frees its core (``benchmarks/cpu_core_sharing.py``);
ranks ready to compute on one core take turns, each running for the scheduler's
slice (Linux EEVDF's base slice: 1.5 ms on 2 CPUs), or until it blocks, before
the next in line. A rank that wakes waits for the running one's slice to end,
as EEVDF's run-to-parity protects the slice a task was picked for; but a rank
that has kept the core past that slice (running alone, or job after job) is no
longer protected, and the waking rank, placed with the earlier deadline,
preempts it at once (``check_preempt_wakeup_fair`` -> ``pick_eevdf`` in
``kernel/sched/fair.c``). So work shorter than a slice runs whole while its
twin waits, and the twin's wait shows where it waits (a receive, a
collective), not in its own pass, as it does in the measured traces
(``docs/calibration.md``, "Ranks taking turns on a core", with the other
slices and scheduler rules tried against them, and "A rank that wakes on a
core whose slice is spent").

:class:`SharedCores` keeps one round-robin queue per core. A job is a rank's
work in seconds *alone* on the core; while other ranks wait for the core it
runs ``penalty`` times as slowly (each slice starts in caches the others
emptied: the stretch ``calibrate`` measured with two ranks computing on each
core, less the factor two of sharing itself). A rank whose receive,
collective or send ended goes on only once it has the core again
(:meth:`SharedCores.wake`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import simpy

# Work left below this many seconds is done (float rounding of rate x time).
DONE_S = 1e-12
# Linux's EEVDF scheduler (kernel 6.6 on) gives each task a base slice of 0.75 ms scaled by 1 + log2 of the
# CPUs, at most 8 counted (sysctl_sched_base_slice and get_update_sysctl_factor in kernel/sched/fair.c).
BASE_SLICE_S = 0.75e-3
SLICE_SCALED_CPUS = 8


def core_of(rank: int, gpus_per_node: int, cores: int) -> tuple[int, int]:
    """The (host, core) the executor binds ``rank`` to: its host's local rank ``r`` on core ``r % cores``
    (``executor/launch.py``)."""
    return rank // gpus_per_node, rank % gpus_per_node % cores


def eevdf_slice_s(cpus: int) -> float:
    """The scheduler's slice on a host of ``cpus`` CPUs: 1.5 ms on 2, 3 ms on 8 or more."""
    return BASE_SLICE_S * (1 + math.floor(math.log2(max(1, min(cpus, SLICE_SCALED_CPUS)))))


@dataclass(slots=True)
class _Job:
    rank: int
    left_s: float  # work left, in seconds alone on the core
    penalty: float  # how many times as slowly it runs while others wait for the core
    then: Callable[[], None]


@dataclass
class _Core:
    queue: deque[_Job] = field(default_factory=deque)  # ready, waiting for the core, in turn order
    running: _Job | None = None
    holder: int = -1  # the rank whose slice runs (it keeps the core between two of its jobs)
    slice_end: float = 0.0
    since: float = 0.0  # when the running job's progress was last counted
    version: int = 0  # wake-ups planned before the last change are stale


class SharedCores:
    """Round-robin cores for ranks that share them (``core_of``: rank -> core id; ranks not in it have a core
    each and never come here). ``slice_s``: how long a rank runs while others wait for its core."""

    def __init__(self, env: simpy.Environment, core_of: dict[int, int], slice_s: float):
        self.env, self.slice_s = env, slice_s
        self.core_of = core_of
        self.cores = {core: _Core() for core in set(core_of.values())}

    def shares(self, rank: int) -> bool:
        return rank in self.core_of

    def run(self, rank: int, work_s: float, penalty: float, then: Callable[[], None]) -> None:
        """Run ``work_s`` seconds (alone) of ``rank``'s work on its core; ``then()`` when it is done."""
        core = self.cores[self.core_of[rank]]
        job = _Job(rank, work_s, penalty, then)
        if core.running is not None:
            self._count(core)
            if not core.queue:  # past the slice it was picked for, the running rank is preempted at once
                core.slice_end = max(core.slice_end, self.env.now)
            core.queue.append(job)
            self._plan(core)
        elif core.holder == rank:  # it never gave the core up: still in (or past) the slice it was picked for
            self._begin(core, job, keep_slice=True)
        elif core.holder == -1 and not core.queue:
            self._begin(core, job)
        else:  # another rank's job just ended and it may run more at once: in line after it
            core.queue.append(job)

    def wake(self, rank: int, then: Callable[[], None]) -> None:
        """``rank``'s wait has ended: ``then()`` once it has its core (at once if it holds it, or it is free)."""
        core = self.cores[self.core_of[rank]]
        if core.holder == rank or any(job.rank == rank for job in core.queue):
            then()
        else:
            self.run(rank, 0.0, 1.0, then)

    # -- the queue ------------------------------------------------------------------
    def _begin(self, core: _Core, job: _Job, keep_slice: bool = False) -> None:
        now = self.env.now
        core.running, core.holder, core.since = job, job.rank, now
        if not keep_slice:
            core.slice_end = now + self.slice_s
        if job.left_s <= DONE_S:
            self._done(core)
        else:
            self._plan(core)

    def _rate(self, core: _Core) -> float:
        return 1.0 if not core.queue else 1.0 / core.running.penalty

    def _count(self, core: _Core) -> None:
        """Charge the running job with the work done since it was last counted."""
        now = self.env.now
        core.running.left_s -= (now - core.since) * self._rate(core)
        core.since = now

    def _plan(self, core: _Core) -> None:
        """Wake up when the running job ends or, with others waiting, when its slice does."""
        core.version += 1
        version = core.version
        delay = max(core.running.left_s, 0.0) / self._rate(core)
        if core.queue:
            delay = min(delay, max(core.slice_end - self.env.now, 0.0))
        self.env.timeout(delay).callbacks.append(lambda _event: self._check(core, version))

    def _check(self, core: _Core, version: int) -> None:
        if version != core.version:
            return
        self._count(core)
        if core.running.left_s <= DONE_S:
            self._done(core)
        elif core.queue and self.env.now >= core.slice_end - DONE_S:
            core.queue.append(core.running)  # its slice is over and others wait: to the back of the line
            self._begin(core, core.queue.popleft())
        else:
            self._plan(core)

    def _done(self, core: _Core) -> None:
        """The running job's work is done: its rank goes on (and keeps its slice if it runs more at once);
        else the next in line gets the core."""
        job, core.running = core.running, None
        core.version += 1
        job.then()
        if core.running is None:
            core.holder = -1
            if core.queue:
                self._begin(core, core.queue.popleft())
