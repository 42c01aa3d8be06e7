"""How far apart a CPU run's ranks reach each collective, and what the call costs once both are there.

Runs a plan on gloo ranks (as ``parsim run`` does) and, for every collective,
transfer or receive that two or more ranks record under the same name, takes
the spread of their start times on the host's one clock (arrival skew: time the earlier ranks wait)
and the time from the last arrival to the first return (the call's own cost).
On a 2-core VM, ranks not bound to cores reached course TP's collectives
1-2 ms apart on average; bound (``executor/launch.py``), 0.2-0.5 ms.

Run:  python benchmarks/cpu_rank_skew.py course-tp --tp 2 --steps 10
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from plan_on_ranks import run_from_command_line

from executor.train.measure import step_events


def main() -> None:
    plan, steps, results = run_from_command_line(__doc__, "course-tp", 10)
    skew, cost = defaultdict(list), defaultdict(list)
    for step in range(steps):
        by_name = defaultdict(list)
        for event in step_events(results, step):
            if event.kind in ("collective", "send", "recv"):
                by_name[event.name].append(event)
        for name, events in by_name.items():
            if len(events) < 2:
                continue
            kind = name.split()[0]
            last_arrival = max(e.start_s for e in events)
            skew[kind].append(last_arrival - min(e.start_s for e in events))
            cost[kind].append(min(e.end_s for e in events) - last_arrival)
    print(f"{plan.name} on {plan.world} gloo ranks, {steps} steps (ms)")
    print(f"{'operation':<16} {'calls':>5} {'skew median':>11} {'skew mean':>9} {'cost median':>11} {'cost mean':>9}")
    for kind in skew:
        s, c = [1e3 * v for v in skew[kind]], [1e3 * v for v in cost[kind]]
        print(f"{kind:<16} {len(s):>5} {statistics.median(s):>11.2f} {statistics.fmean(s):>9.2f} "
              f"{statistics.median(c):>11.2f} {statistics.fmean(c):>9.2f}")


if __name__ == "__main__":
    main()
