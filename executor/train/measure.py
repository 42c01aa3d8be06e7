"""Run a plan on torch.distributed and turn what the ranks recorded into a Trace and a summary.

:func:`run_plan` is what ``parsim run`` and ``parsim compare`` call. The
trace returned is the *median* measured step (by step time: the latest event
end over all ranks), so one slow step (a page fault, a scheduler hiccup)
does not stand for the run; the summary keeps every step's time, and each
rank's time by phase as each phase's median over the steps.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Callable

from parsim.errors import ParsimError
from parsim.report.step_report import breakdown, median_breakdown, median_step, step_time
from parsim.report.trace import Event, Trace
from parsim.workload.plan import Plan

DEFAULT_STEPS = 3
DEFAULT_WARMUP = 2  # the first steps allocate AdamW's state and grow the host heap
DEFAULT_TIMEOUT_S = 300.0
MAX_STEPS = 10_000  # measured or warm-up steps of one run: beyond any use, and hours of CPU time


def run_plan(plan: Plan, nproc: int, steps: int = DEFAULT_STEPS, backend: str = "auto",
             timeout_s: float = DEFAULT_TIMEOUT_S, warmup: int = DEFAULT_WARMUP, seed: int = 0,
             progress: Callable[[str], None] | None = None,
             profile_dir: str | None = None, probe_speed: bool = False) -> tuple[Trace | None, dict]:
    """Execute ``plan`` on ``nproc`` ranks: the measured Trace of the median step, and a summary dict.

    Spawns the ranks here, or, inside a torchrun job, runs as this process's
    rank (then only rank 0 gets the result; other ranks get ``(None, {})``).
    With ``profile_dir``, each rank also writes a torch.profiler trace of the
    measured steps there (``rank<r>.pt.trace.json``). With ``probe_speed``, the
    summary's ``speed_probe`` holds the host-speed probes' medians, keyed as
    :class:`executor.speed_probe.Speed`'s fields (timed before the warm-up and after the measured steps), and
    ``collective_probe_s`` the collective probe's, seconds by KiB (None on one rank).
    A rank that fails or hangs ends the run with a
    :class:`executor.launch.RankFailure` naming it, within ``timeout_s``.
    """
    from executor.launch import check_request, in_torchrun_job, launch, resolve_backend, run_in_job
    from executor.speed_probe import Speed, median_reading

    from .runner import check_plan, rank_main

    in_job = in_torchrun_job()
    given = int(os.environ["WORLD_SIZE"]) if in_job else nproc
    if given != plan.world:
        others = plan.world // plan.dp
        fit = f"; --dp {given // others} fits it to {given}" if given % others == 0 else ""
        raise ParsimError(f"plan {plan.name} needs {plan.degrees_text()} = {plan.world} "
                          f"ranks, but {'the torchrun job has' if in_job else '--nproc is'} {given}{fit}")
    if not 1 <= steps <= MAX_STEPS:
        raise ParsimError(f"steps must be 1 to {MAX_STEPS:,}, got {steps}")
    if not 0 <= warmup <= MAX_STEPS:
        raise ParsimError(f"warm-up steps must be 0 to {MAX_STEPS:,}, got {warmup}")
    check_request(int(os.environ.get("LOCAL_WORLD_SIZE", given)) if in_job else given, timeout_s)
    check_plan(plan)
    say = progress or (lambda message: None)
    if profile_dir is not None:
        if Path(profile_dir).exists() and not Path(profile_dir).is_dir():
            raise ParsimError(f"--profile {profile_dir}: is a file; give a folder for one trace per rank")
        Path(profile_dir).mkdir(parents=True, exist_ok=True)
    args = (plan.to_dict(), steps, warmup, seed)
    if in_job:
        say(f"running {plan.name} as one rank of a torchrun job")
        results = run_in_job(rank_main, args + (True, progress is not None, profile_dir, probe_speed), backend,
                             timeout_s)
        if results is None:
            return None, {}
        used = resolve_backend(backend, given)
    else:
        used = resolve_backend(backend, nproc)
        say(f"running {plan.name} on {nproc} ranks ({used}): {warmup} warm-up + {steps} measured steps")
        results = launch(rank_main, nproc, args + (False, progress is not None, profile_dir, probe_speed), backend,
                         timeout_s)
    traces = [Trace("measured", plan.world, step_events(results, i),
                    meta={"plan": plan.name, "backend": used, "step": i}) for i in range(steps)]
    losses = _losses(results, steps)
    probes = [p for r in results for p in r["speed_probes"]]
    summary = summarize(plan, traces, losses, used)
    summary["speed_probe"] = ({key: statistics.median(column) for key, column in zip(Speed._fields, zip(*probes))}
                              if probes else None)
    collective = [p for r in results for p in r.get("collective_probes", ())]
    summary["collective_probe_s"] = dict(median_reading(collective)) if collective else None
    summary["expert_load"] = measured_expert_load(results)
    return traces[median_step(traces)], summary


def step_events(results: list[dict], step: int) -> list[Event]:
    """Every rank's events of measured step ``step``, on one clock where the ranks share a host.

    Each rank times its events from its own exit of the barrier before the step. Ranks on one host share
    ``time.perf_counter``'s clock, so their events move to the first rank's zero: ranks that time-share a
    core leave the barrier milliseconds apart (1.5-5 ms, 4 ranks on a 2-core VM), and on their own zeros
    their passes would seem to run side by side where they took turns. Ranks on several hosts keep their
    own zeros (their clocks differ by more than the skew).
    """
    if len({r.get("host") for r in results}) > 1:
        return [e for r in results for e in r["steps"][step]]
    origins = [r["step_origins"][step] for r in results]
    first = min(origins)
    return [_shifted(e, origin - first) for r, origin in zip(results, origins) for e in r["steps"][step]]


def measured_expert_load(results: list[dict]) -> dict | None:
    """How unevenly the measured steps routed tokens: per MoE layer forward (a layer, its k-th forward on
    every rank of its pipeline stage, which run the same schedule), the busiest expert's rows over the mean
    an expert gets, the most over the ranks (each sees the experts it holds; the step waits for the
    busiest); the median and the most over the forwards (None: no MoE layer). The plan's ``expert_load``
    is the same ratio, assumed."""
    by_forward: dict[tuple[str, int], float] = {}
    for r in results:
        for layer, loads in r.get("expert_loads", {}).items():
            for k, load in enumerate(loads or ()):
                by_forward[layer, k] = max(load, by_forward.get((layer, k), 0.0))
    if not by_forward:
        return None
    return {"busiest_over_mean": statistics.median(by_forward.values()), "most": max(by_forward.values()),
            "forwards": len(by_forward)}


def _shifted(event: Event, by_s: float) -> Event:
    args = event.args
    if "gaps" in args:
        args = {**args, "gaps": [(start + by_s, end + by_s) for start, end in args["gaps"]]}
    return replace(event, start_s=event.start_s + by_s, args=args)


def _losses(results: list[dict], steps: int) -> list[float]:
    """Each step's loss over the global batch: the mean over replicas of the last stage's losses."""
    per_step = []
    for i in range(steps):
        values = [r["losses"][i] for r in results if r["losses"][i] is not None]
        per_step.append(sum(values) / len(values))
    return per_step


def summarize(plan: Plan, traces: list[Trace], losses: list[float], backend: str) -> dict:
    """Step times, throughput, losses, each rank's time by phase (each phase's median over the steps, and
    its least and most in any step), and each pipeline stage's (each phase's median over the steps of its
    ranks' mean in each step: :func:`~parsim.report.step_report.median_breakdown` by stage)."""
    times = [step_time(trace) for trace in traces]
    median = times[median_step(traces)]
    unit = f"{plan.model.throughput_unit}s"
    rows = [breakdown(trace) for trace in traces]
    stage_of = {row.rank: plan.coords(row.rank).pp for step in rows for row in step}
    return {
        "plan": plan.name, "model": plan.model.name, "world_size": plan.world, "backend": backend,
        "dp": plan.dp, "tp": plan.tp, "pp": plan.pp, "cp": plan.cp, "ep": plan.ep, "schedule": plan.schedule,
        "num_microbatches": plan.num_microbatches, "microbatch_size": plan.microbatch_size, "dtype": plan.dtype,
        "features": plan.features(), "steps": len(times),
        "step_s": median, "step_s_min": min(times), "step_s_max": max(times), "step_times_s": times,
        "throughput_unit": f"{unit}/s", "throughput": plan.tokens_per_step / median if median else 0.0,
        "tokens_per_step": plan.tokens_per_step,
        "loss": losses[-1], "losses": losses,
        "ranks": [{"rank": b.rank, "step_s": b.step_s, "seconds": b.seconds,
                   "ranges": {phase: list(lo_hi) for phase, lo_hi in b.ranges.items()}}
                  for b in median_breakdown(traces, breakdowns=rows)],
        "stages": [{"pp": b.rank, "seconds": b.seconds,
                    "ranges": {phase: list(lo_hi) for phase, lo_hi in b.ranges.items()}}
                   for b in median_breakdown(traces, stage_of, breakdowns=rows)],
    }
