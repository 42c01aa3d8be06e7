"""Where a CPU run's idle time goes: the host's gaps between a step's actions, and each send's issue.

Runs a plan on gloo ranks (as ``parsim run`` does) and, per rank, takes every
gap between one recorded action (a pass, a receive, a collective, the
optimizer step) and the next, by the kinds on either side; the step's idle
time (what no action covers); and, per send, the time from its issue to the
rank's next action, which is the host time the issue takes (a send runs on
beside the rank's compute, so it is not an action of its own); and, on the
host's one clock, how long the rank then waits for the last rank to end the
step (idle in ``parsim compare``'s phases too). The simulator prices the gaps
as ``compute.action_overhead_us`` before each action (and between a pass's
receive and the pass), plus ``compute.p2p_issue_us`` per send issued since the
last, which ``parsim calibrate`` measures in a generic data-parallel step and
on the executor's pipeline loop over stages that pass a small MLP.
Last, every pipeline transfer's time, split by whether the receiver waited (from
the send's issue to the receive's end: priced as ``compute.p2p_latency_us``
plus the bytes) and a receive posted after its send (the receive's own time:
``compute.p2p_rendezvous_us``). On the 2-core VM (2026-11-26): course DDP's
gap medians were 0.04-0.17 ms (0.57 ms idle per step); tiny PP's sends took a
median 0.10 and 0.13 ms to issue on its two stages, and a few took 6 ms
(gloo's stalls); its transfers took a median 83 us with the receiver waiting
(mean 157 us, one of 5.2 ms) and 74 us posted late (mean 112 us). Later
(2026-11-26, night), tiny PP's gaps were 18-27 us before a pass that follows
a receive or a pass, 168-264 us where a send was issued in between; its late
receives took a median 0.10 ms but a mean 0.42-0.55 ms (about one in ten
2.5-5.4 ms: the sender's gloo thread waiting for the core its rank computes
on).

Run:  python benchmarks/cpu_action_gaps.py tiny-pp2 --steps 20
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from plan_on_ranks import gaps_before_actions, run_from_command_line


def main() -> None:
    plan, steps, results = run_from_command_line(__doc__, "course-ddp", 20)
    print(f"{plan.name} on {plan.world} gloo ranks, {steps} steps (ms)")
    waits = _end_waits(results, steps)
    for result in results:
        gaps, idle, issue = defaultdict(list), [], []
        for events in result["steps"]:
            before_actions = gaps_before_actions(events)
            for kind, gap in before_actions:
                gaps[kind].append(gap)
            reach = max((e.end_s for e in events if e.kind != "send"), default=0.0)
            end = max(e.end_s for e in events)
            idle.append(sum(gap for _, gap in before_actions) + max(end - reach, 0.0))
            starts = [e.start_s for e in events if e.kind != "send"]
            for send in (e for e in events if e.kind == "send"):
                later = [s for s in starts if s >= send.start_s]
                if later:
                    issue.append(min(later) - send.start_s)
        wait = waits[result["rank"]]
        print(f"rank {result['rank']}: idle per step, median {1e3 * statistics.median(idle):.2f}; then waiting "
              f"for the last rank to end the step, median {1e3 * statistics.median(wait):.2f}, "
              f"p90 {1e3 * _quantile(wait, 0.9):.2f}")
        print(f"  {'gap':<32} {'count':>5} {'median':>7} {'p90':>7}")
        for name, values in gaps.items():
            print(f"  {name:<32} {len(values):>5} {1e3 * statistics.median(values):>7.3f} "
                  f"{1e3 * _quantile(values, 0.9):>7.3f}")
        if issue:
            print(f"  {'send issued -> next':<32} {len(issue):>5} {1e3 * statistics.median(issue):>7.3f} "
                  f"{1e3 * _quantile(issue, 0.9):>7.3f}  (max {1e3 * max(issue):.2f})")
    _print_transfers(results)


def _end_waits(results: list[dict], steps: int) -> dict[int, list[float]]:
    """Per rank and step, the time from its last event's end to the step's (the last rank's), on the host's
    clock: what a rank's idle holds beyond its own gaps."""
    from executor.train.measure import step_events

    waits: dict[int, list[float]] = defaultdict(list)
    for step in range(steps):
        events = step_events(results, step)
        end = max(e.end_s for e in events)
        for result in results:
            waits[result["rank"]].append(end - max(e.end_s for e in events if e.rank == result["rank"]))
    return waits


def _print_transfers(results: list[dict]) -> None:
    """Every pipeline transfer's time, its receiver waiting or its receive posted late (see the docstring)."""
    from executor.compute_bench import on_host_clock, transfer_times

    def steps(result: dict) -> list:
        return [on_host_clock(origin, [(e.name, e.kind, e.start_s, e.end_s) for e in events])
                for origin, events in zip(result["step_origins"], result["steps"])]

    late, waiting = transfer_times([(result["rank"], steps(result)) for result in results])
    for name, per_step in (("receiver waiting", waiting), ("receive posted late", late)):
        values = [t for step in per_step for t in step]
        if values:
            print(f"transfers, {name}: {len(values)}, median {1e3 * statistics.median(values):.3f}, "
                  f"p90 {1e3 * _quantile(values, 0.9):.3f}, mean {1e3 * statistics.fmean(values):.3f}, "
                  f"max {1e3 * max(values):.2f}")


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


if __name__ == "__main__":
    main()
