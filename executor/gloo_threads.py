"""Which of gloo's threads may take a CPU rank's core the moment they wake.

A gloo process group runs a device loop (thread ``gloo_tcp_loop``, in ``epoll_wait``) beside the
workers that run its operations (``pt_gloo_runloop``), and the launcher binds all of a rank's
threads to the rank's core (:func:`executor.launch._pin_to_core`). The kernel lets a thread that
wakes preempt the one running on its core (``check_preempt_wakeup_fair``, ``kernel/sched/fair.c``).
In a collective that goes wrong: a worker wakes the loop from inside the pair's lock (as
``Pair::sendAsyncMode`` does, in ``gloo/transport/tcp/pair.cc``, when a chunk does not fit the
socket at once: it registers the socket for ``EPOLLOUT``), and the loop preempts the worker still
holding the lock; its handler only try-locks the pair (``Pair::handleEvents``: "skip handling
the events until the next tick if the lock cannot be acquired") and epoll reports the socket again
at once, so the loop spins on the core until the scheduler takes it back at a tick. Traced on the
2-core VM (2026-11-30, ``perf record -e sched:*`` over ``parsim run course-tp --tp 2``, 30 steps):
114 runs of a loop of 0.3-5.4 ms, 109 of them inside a tensor-parallel call, 102 woken by a worker
they then preempted; the calls bimodal (all-gathers a median 0.98 ms, a mean 2.17, a tenth over 5.4).

A ``SCHED_BATCH`` thread never preempts on waking ("Batch and idle tasks do not preempt non-idle
tasks", the same function): a collective's loop so set runs once the worker blocks. Pipeline
transfers need the loop to preempt: it writes a send's data when the receiver asks for it
(``Pair::handleRemotePendingRecv``), while the sender's main thread computes its next pass. So
transfers that run beside compute (the pipeline's sends, context parallelism's ring, the
tensor-parallel ring beside GEMMs) keep groups whose loops preempt, and every other group's loop is
batched. ``python benchmarks/cpu_gloo_loops.py`` (2026-11-30), this against loops left as gloo
starts them: course TP's step 29.7 ms against 39.6 (its ``tp`` phase 3.3 against 14.3), course DDP's
41.2 against 49.5 (``dp`` 8.2 against 16.3), course PP and tiny PP unchanged; with every loop
batched, tiny PP's step took 32.6 ms against 22.4, its receives waiting for the sender's next pass.

The pipeline's group is made with the job, its loop batched until a pipeline first sends through it:
a loop wakes every 10 ms with nothing to do (``epoll_wait(..., 10)`` in ``Loop::run``,
``gloo/transport/tcp/loop.cc``), and an idle loop that preempts lands inside other groups'
collectives, taking the core from a worker that holds a pair's lock. Course TP, alternating runs in
a slow hour of 2026-11-30: its ``tp`` phase a median 4.4 ms (4.2-5.8, six runs) with that loop
batched, 5.2 ms (4.0-7.0, six) with it preempting; then this change against the one before, five
runs each: 4.0 ms against 4.8.

``PARSIM_GLOO_LOOPS`` picks another policy, for comparing them: ``preempt`` leaves every loop as gloo
starts it, ``batch`` batches the transfers' too.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Sequence, TypeVar

from parsim.errors import ParsimError

from ._torch import require_distributed

LOOP_THREAD = "gloo_tcp_loop"  # the name gloo's device loop gives its thread
POLICY_ENV = "PARSIM_GLOO_LOOPS"
POLICIES = ("split", "preempt", "batch")  # the first is the default

T = TypeVar("T")

_transfer_group: Any = None  # the gloo job's group for transfers beside compute (prepare_groups)
_transfer_loops: set[int] = set()  # its device loops, batched until a transfer first uses the group


def loop_threads() -> set[int]:
    """The thread ids of this process's gloo device loops (empty where ``/proc`` is not Linux's)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return set()
    found = set()
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                if comm.read().startswith(LOOP_THREAD):
                    found.add(int(tid))
        except OSError:  # the thread ended meanwhile
            continue
    return found


def policy() -> str:
    """The loops' policy this job runs under (:data:`POLICY_ENV`)."""
    chosen = os.environ.get(POLICY_ENV, POLICIES[0])
    if chosen not in POLICIES:
        raise ParsimError(f"{POLICY_ENV}={chosen!r}: expected one of {', '.join(POLICIES)}")
    return chosen


def _set_policy(tids: Iterable[int], batch: bool) -> None:
    """Batched: threads ``tids`` run only when their core is free or at a tick; else they may preempt on waking
    (unprivileged either way; a no-op where unsupported)."""
    for tid in tids:
        try:
            os.sched_setscheduler(tid, os.SCHED_BATCH if batch else os.SCHED_OTHER, os.sched_param(0))
        except (AttributeError, OSError):  # not Linux, or the thread ended meanwhile
            pass


def _new_loops(create: Callable[[], T]) -> tuple[T, set[int]]:
    """Run ``create`` (which makes process groups): what it made, and the device loops it started."""
    before = loop_threads()
    made = create()
    return made, loop_threads() - before


def prepare_groups() -> None:
    """In a gloo rank that has just joined the job: batch the default group's loops (its collectives, barriers
    and benchmarks) and make the group that carries transfers beside compute, its loop batched too until
    :func:`transfer_group` first hands it out. Every rank must call it at the same point (it creates a group)."""
    global _transfer_group, _transfer_loops
    dist = require_distributed()
    batch = policy() != "preempt"
    _set_policy(loop_threads(), batch)
    _transfer_group, _transfer_loops = _new_loops(lambda: dist.new_group(list(range(dist.get_world_size()))))
    _set_policy(_transfer_loops, batch)


def transfer_group() -> Any:
    """The group for point-to-point transfers that run beside compute (its loop now free to preempt, unless
    ``PARSIM_GLOO_LOOPS=batch``); None (the default group) outside a gloo rank that called
    :func:`prepare_groups`."""
    if _transfer_loops:
        _set_policy(_transfer_loops, batch=policy() == "batch")
        _transfer_loops.clear()
    return _transfer_group


def collective_group(members: Sequence[int]) -> Any:
    """A new process group over ``members`` (every rank must call it, in one order) for collectives: its
    device loop batched."""
    dist = require_distributed()
    group, loops = _new_loops(lambda: dist.new_group(list(members)))
    _set_policy(loops, batch=policy() != "preempt")
    return group
