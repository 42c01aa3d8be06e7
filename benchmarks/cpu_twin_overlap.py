"""How much of each pass a rank runs beside the rank that shares its core, measured against the model.

With more ranks than cores, the executor binds local rank ``r`` to core ``r % cores`` (``executor/launch.py``):
tiny DP x PP on a 2-core host puts a stage's two data-parallel replicas (twins) on one core. Whether a twin's
pass runs alone or beside the other's decides how long it takes, and so every phase of the step; the phases
alone cannot tell a pass stretched by its twin from one slowed by the host. This runs the plan (``--steps``
measured steps, every step's events on the host's one clock, as ``parsim run`` times them) and, for each
pipeline stage and kind of pass (forward, backward), prints the passes' median time, the median time the
rank's thread ran in them (``time.thread_time``: the rest it waited for its core), and the share of it the
twin's compute was open too (the mean over the passes of the overlap over the pass's span), beside the same
from the step simulator's trace on ``CLUSTER`` (a calibrated host file) at the calibration's speed.

On the 2-core VM (2026-11-30, set EX's file, six runs of 30 steps; the thread's time in the last three), tiny
DP x PP's stage 0 forwards took 1.64-1.91 ms, their thread running 1.66-1.69 ms of it; its backwards 2.22-3.18
ms, running 1.98-2.04; stage 1's forwards 1.69-2.11 ms, running 1.64-1.85; its backwards 2.39-4.48 ms, running
1.85-2.01 (tiny PP, a core per rank, meanwhile: 1.55-1.93 ms a pass). The host runs a forward nearly whole
once it has begun, and a backward waits for its core, the twin's forward running meanwhile. The model:
forwards 3.20 and 3.34 ms, backwards 3.32 and 3.64, shared slice by slice.

Run:  python benchmarks/cpu_twin_overlap.py CLUSTER [--steps 30] [PLAN flags, default: tiny-pp2 --dp 2]
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

PASSES = {"F": "forward", "B": "backward"}


def _rank(rank: int, world: int, plan_data: dict, steps: int) -> dict:
    """One rank of ``parsim run`` whose spans also keep the time its thread ran in them (``args["cpu_s"]``,
    ``time.thread_time``): a pass's wall time less that is the time the rank waited for its core."""
    import time
    from contextlib import contextmanager

    from executor.train import trace_recorder
    from executor.train.runner import rank_main

    timed = trace_recorder.Recorder.span

    @contextmanager
    def span(self, name, kind, stream, **args):
        start = time.thread_time()
        with timed(self, name, kind, stream, **args):
            yield
        self.events[-1].args["cpu_s"] = time.thread_time() - start

    trace_recorder.Recorder.span = span
    return rank_main(rank, world, plan_data, steps, 2, 0)


def core_mates(world: int, gpus_per_node: int, cores: int) -> dict[int, list[int]]:
    """Each rank that shares its core (``parsim.sim.cores.core_of``, as the executor binds them), and the ranks it
    shares it with."""
    from parsim.sim.cores import core_of

    on_core: dict[tuple[int, int], list[int]] = defaultdict(list)
    for rank in range(world):
        on_core[core_of(rank, gpus_per_node, cores)].append(rank)
    return {rank: [other for other in ranks if other != rank] for ranks in on_core.values() if len(ranks) > 1
            for rank in ranks}


def pass_of(event) -> tuple[int, str] | None:
    """(stage, pass kind) of a forward or backward (a compute event named ``F stage=..`` or ``B stage=..``)."""
    kind = PASSES.get(event.name.split(" ")[0])
    if event.kind != "compute" or kind is None:
        return None
    return int(event.name.split("stage=")[1].split(" ")[0]), kind


def overlaps(events: list, mates: dict[int, list[int]]) -> dict[tuple[int, str], list[tuple[float, float]]]:
    """Per (stage, pass kind), each pass's (seconds, share of them another rank on its core computed too, in any
    compute or optimizer event) of every rank that shares its core."""
    busy: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for event in events:
        if event.kind in ("compute", "optimizer"):
            busy[event.rank].append((event.start_s, event.start_s + event.dur_s))
    out: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for event in events:
        key = pass_of(event)
        if key is None or event.rank not in mates or event.dur_s <= 0:
            continue
        start, end = event.start_s, event.start_s + event.dur_s
        others = _merged(interval for mate in mates[event.rank] for interval in busy[mate])
        shared = sum(max(0.0, min(end, b) - max(start, a)) for a, b in others)
        out[key].append((event.dur_s, shared / event.dur_s))
    return out


def _merged(intervals) -> list[tuple[float, float]]:
    """Intervals joined where they overlap, so that time covered twice counts once."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def summary(rows: dict[tuple[int, str], list[tuple[float, float]]]) -> dict[tuple[int, str], tuple[float, float]]:
    """Per (stage, kind): the passes' median seconds and mean share overlapped."""
    return {key: (statistics.median(s for s, _ in passes), statistics.mean(f for _, f in passes))
            for key, passes in sorted(rows.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("cluster", help="a calibrated CPU host file (parsim calibrate --out)")
    parser.add_argument("--steps", type=int, default=30, help="measured steps (default 30)")
    args, plan_args = parser.parse_known_args()
    if args.steps < 1:
        parser.exit(2, f"{parser.prog}: --steps must be at least 1\n")

    from executor.launch import launch, usable_cores
    from executor.train.measure import step_events
    from parsim.cli.main import build_parser
    from parsim.cli.plan_cmd import plan_from_args
    from parsim.errors import ParsimError
    from parsim.hardware.cluster import load_cluster
    from parsim.sim.step import predict_step

    try:
        cluster = load_cluster(args.cluster)
        plan = plan_from_args(build_parser().parse_args(["simulate", *(plan_args or ["tiny-pp2", "--dp", "2"])]))
    except ParsimError as error:
        parser.exit(2, f"{parser.prog}: {error}\n")
    cores = usable_cores()
    mates = core_mates(plan.world, plan.world, cores)
    if not mates:
        parser.exit(2, f"{parser.prog}: {plan.name}'s {plan.world} ranks have a core each of this host's {cores}: "
                       "no rank shares one\n")
    results = launch(_rank, plan.world, (plan.to_dict(), args.steps), "gloo", 600.0)
    measured: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    ran: dict[tuple[int, str], list[float]] = defaultdict(list)  # each pass's time on its core
    for step in range(args.steps):
        events = step_events(results, step)
        for key, passes in overlaps(events, mates).items():
            measured[key].extend(passes)
        for event in events:
            key = pass_of(event)
            if key is not None and event.rank in mates and "cpu_s" in event.args:
                ran[key].append(event.args["cpu_s"])
    predicted = summary(overlaps(predict_step(plan, cluster).trace.events,
                                 core_mates(plan.world, cluster.gpus_per_node, cluster.cpu_cores)))
    print(f"{plan.name} on {plan.world} ranks, {cores} cores: each pass's time, its thread's time on the core, and the "
          f"share of it another rank on its core computed too, {args.steps} measured steps against the model on "
          f"{args.cluster}")
    print(f"  {'stage':>5}  {'pass':<9} {'measured':>9} {'on its core':>11} {'overlapped':>10} {'predicted':>10} "
          f"{'overlapped':>10}")
    for key, (seconds, share) in summary(measured).items():
        model_s, model_share = predicted.get(key, (float("nan"), float("nan")))
        print(f"  {key[0]:>5}  {key[1]:<9} {seconds * 1e3:6.2f} ms {statistics.median(ran[key]) * 1e3:8.2f} ms "
              f"{share:10.0%} {model_s * 1e3:7.2f} ms {model_share:10.0%}")


if __name__ == "__main__":
    main()
