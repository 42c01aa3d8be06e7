"""The host's gaps between a step's actions, predicted against measured, by the kinds on either side.

Runs a plan on gloo ranks (as ``parsim compare`` does: the median of the
measured steps, every rank on the host's one clock) and simulates it on a
calibrated cluster file; then, per rank, sums each kind of gap in both traces:
from the step's start or an action's end (a pass, a receive, a collective, the
optimizer step) to the next action, keyed by the kinds on either side and the
sends issued in between. Where ``parsim compare`` says a rank's idle time is
off, this says which gaps make the difference. On the 2-core AMD VM
(2026-11-27, set BI's file, before a pass after its receive opened an action
of its own): tiny PP's measured gaps from a receive to its pass were 0.099 /
0.094 ms (stage 0 / 1; four a step each), none predicted; from the step's
start to the first action 0.45 / 0.57 ms against 0.20.

Run:  python benchmarks/cpu_gap_compare.py tiny-pp2 my-host.yaml
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from plan_on_ranks import gaps_before_actions


def gaps_by_kind(events: list) -> dict[int, dict[str, list[float]]]:
    """Per rank, every gap before an action (:func:`plan_on_ranks.gaps_before_actions`), by its kind."""
    out: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for rank in sorted({e.rank for e in events}):
        for kind, gap in gaps_before_actions([e for e in events if e.rank == rank]):
            out[rank][kind].append(gap)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plan", help="a plan name or YAML file (tiny-pp2, course-pp, ...)")
    parser.add_argument("cluster", help="a calibrated cluster file (parsim calibrate --out FILE)")
    parser.add_argument("--dp", type=int, help="data-parallel degree override")
    parser.add_argument("--steps", type=int, default=5, help="measured steps; the median one is compared")
    args = parser.parse_args()

    from executor.train import run_plan
    from parsim.errors import ParsimError
    from parsim.hardware.cluster import load_cluster
    from parsim.sim.step import predict_step
    from parsim.workload.plan import resolve_plan

    try:
        plan = resolve_plan(args.plan, overrides={"parallel": {"dp": args.dp}} if args.dp else None)
        predicted = predict_step(plan, load_cluster(args.cluster)).trace
        measured, _ = run_plan(plan, plan.world, args.steps)
    except ParsimError as error:
        parser.exit(2, f"{parser.prog}: {error}\n")
    ours, theirs = gaps_by_kind(predicted.events), gaps_by_kind(measured.events)
    print(f"{plan.name}: gaps before actions, count x median = sum (ms)")
    for rank in sorted(theirs):
        print(f"rank {rank}: {'gap':<34} {'predicted':>22}   {'measured':>22}")
        for key in sorted(set(ours[rank]) | set(theirs[rank])):
            print(f"  {key:<40} {_summary(ours[rank].get(key, []))}   {_summary(theirs[rank].get(key, []))}")


def _summary(gaps: list[float]) -> str:
    if not gaps:
        return " " * 22
    return f"{len(gaps):2d} x {1e3 * statistics.median(gaps):6.3f} = {1e3 * sum(gaps):6.2f}"


if __name__ == "__main__":
    main()
