"""Independent step simulations on every core this process may use: each simulation is serial Python, so a
search's best plans or a validation table's rows run side by side, one process per core."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

if TYPE_CHECKING:  # (types only: the executor's launcher imports this module for usable_cores, and stays light)
    from ..hardware.cluster import ClusterSpec
    from ..workload.plan import Plan

T = TypeVar("T")


def usable_cores() -> int:
    """The cores this process may run on (a container's or a ``taskset``'s share, not the whole machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def simulate_each(simulate: Callable[[Plan, ClusterSpec], T], plans: Sequence[Plan], cluster: ClusterSpec,
                  done: Callable[[int, int], None] | None = None) -> list[T]:
    """``simulate(plan, cluster)`` for every plan, in the plans' order; ``done(finished, total)`` after each.

    ``simulate`` must be a module-level function (it is sent to the worker processes) and should return no more
    than its caller needs: a 1T plan's trace alone holds 591,878 events to send back."""
    workers = min(usable_cores(), len(plans))
    if workers < 2:
        results = []
        for plan in plans:
            results.append(simulate(plan, cluster))
            if done:
                done(len(results), len(plans))
        return results
    results: list = [None] * len(plans)
    # fork: the workers start at once with everything imported (spawn would import parsim again in each)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        futures = {pool.submit(simulate, plan, cluster): k for k, plan in enumerate(plans)}
        for finished, future in enumerate(as_completed(futures), 1):
            results[futures[future]] = future.result()
            if done:
                done(finished, len(plans))
    return results
