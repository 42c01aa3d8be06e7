"""``parsim compare PLAN``: a predicted step next to a measured one, phase by phase and collective by collective."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from ..calibrate.host_load import ForeignLoad
from ..errors import ParsimError
from ..hardware.cluster import Curve
from ..kineto.match import CollectiveRow, match_collectives
from ..kineto.read import measured_trace, read_profiles
from ..report.jsondoc import print_json
from ..report.step_report import PHASES, RankBreakdown, breakdown, step_time
from ..report.table import format_number, render_table
from ..report.trace import Trace
from ..sim.jitter import sampled_waits
from ..sim.step import StepPrediction, predict_step, rank_standing_for
from ..units import format_size, format_time, size_unit, time_unit
from ..workload.plan import Plan
from .common import (expert_load_text, note, note_executor_kernels, note_launch_bound, note_stages_sharing_cores,
                     progress, warn_other_machine)
from .compare_cmd import COMPARE_STEPS, host_cluster
from .plan_cmd import plan_from_args

# Measured steps whose slowest is this many times their fastest make one run's median a poor estimate.
SPREAD_NOTE = 1.25
# A host whose probes ran this many times faster or slower than at calibration may not have run the steps at that.
SPEED_NOTE = 1.25
# The wait at the step's end gets its line from a microsecond on (a pipeline's stages end apart: nothing to wait for)
WAIT_NOTE_S = 1e-6


def compare_plan_command(args: argparse.Namespace) -> int:
    args.plan = args.target
    plan = plan_from_args(args)
    cluster = host_cluster(args.cluster)
    if args.measured is not None:
        measured, source = _profiled(plan, args.measured), f"torch.profiler traces in {args.measured}"
    nproc = plan.world if args.nproc is None else args.nproc
    if args.measured is None and plan.world != nproc:
        raise ParsimError(f"plan {plan.name} needs {plan.world} ranks ({plan.degrees_text()}), not --nproc {nproc}")
    progress(f"simulating {plan.name} on {cluster.name}")
    predicted = predict_step(plan, cluster)
    if predicted.takes_turns:
        note(f"{min(plan.world, cluster.gpus_per_node)} ranks on each host's {cluster.cpu_cores} cores take turns on "
             "them, as simulated; the model shares a core's passes slice by slice where Linux runs each pass nearly "
             "whole, so by phase expect forwards and AdamW steps long and waits short, the step itself closer "
             "(docs/calibration.md, \"Ranks taking turns on a core\" and \"Weights a rank reads again from its "
             "cache\")")
        note_stages_sharing_cores("compare", plan, cluster)
    load, speed, spread, routing = None, None, None, None
    by_phase = None  # each measured rank's time by phase (None: the measured trace's one step)
    waits, stage_waits = None, None  # the wait at the step's end as medians over the steps (None: its mean)
    by_stage = None  # (stage, phase) -> the stage's measured seconds (None: the mean of its ranks' by_phase)
    if args.measured is None:
        from executor.launch import resolve_backend
        from executor.train import run_plan

        steps = COMPARE_STEPS if args.steps is None else args.steps
        probe = (cluster.speed_probe_flops is not None and not args.no_speed_probe
                 and resolve_backend(args.backend or "auto", nproc) == "gloo")
        progress(f"running {plan.name} on {nproc} ranks ({steps} measured steps"
                 f"{', the host-speed probe before and after' if probe else ''})")
        with ForeignLoad() as load:
            measured, summary = run_plan(plan, nproc, steps, backend=args.backend or "auto", probe_speed=probe,
                                         **({"timeout_s": args.timeout} if args.timeout is not None else {}))
        if summary.get("speed_probe"):
            measured_probe = summary["speed_probe"]
            speed = HostSpeed(cluster.speed_probe_flops, cluster.speed_probe_eager_s, measured_probe["matmul_flops"],
                              measured_probe["eager_s"], predicted.step_s, cluster.speed_probe_memory_Bps,
                              measured_probe.get("memory_Bps"), cluster.collective_probe_s,
                              tuple((summary.get("collective_probe_s") or {}).items()) or None,
                              matmul_elasticity=cluster.speed_probe_matmul_elasticity,
                              eager_elasticity=cluster.speed_probe_eager_elasticity,
                              memory_elasticity=cluster.speed_probe_memory_elasticity)
            cluster = cluster.at_host_speed(speed.arithmetic, speed.eager, speed.memory)
            if speed.collective:
                cluster = cluster.at_collective_probe(speed.measured_collective_s)
            predicted = predict_step(plan, cluster)
            drift = speed.drift_note()
            if drift:
                note(drift)
        backend = measured.meta.get("backend", "")
        warn_other_machine(cluster, backend)
        note_executor_kernels(plan)
        if backend == "nccl":
            note_launch_bound("compare", plan, cluster, predicted.step_s)
        if load.warning("the measured run"):
            note(load.warning("the measured run"))
        source = f"run here, median of {steps} steps"
        by_phase = [RankBreakdown(r["rank"], r["step_s"], r["seconds"],
                                  {phase: tuple(lo_hi) for phase, lo_hi in r.get("ranges", {}).items()})
                    for r in summary.get("ranks", ())]
        by_stage = {(stage["pp"], phase): seconds for stage in summary.get("stages", ())
                    for phase, seconds in stage["seconds"].items()}
        if steps > 1 and by_phase:
            waits, stage_waits = median_end_waits(plan, predicted, [r.rank for r in by_phase])
        routing = summary.get("expert_load") and _routing(plan, cluster, summary["expert_load"])
        times = summary.get("step_times_s")
        spread = (min(times), max(times)) if times else None
        if spread and spread[1] > SPREAD_NOTE * spread[0]:
            note(f"parsim compare: the {steps} measured steps spread from {format_time(spread[0])} to "
                 f"{format_time(spread[1])}: the host's speed or its transfers moved during the run "
                 "(docs/calibration.md); the median of several runs, or of more steps (--steps), is steadier")
    collectives = match_collectives(plan, predicted.trace, measured)
    rows = compare_phases(plan, predicted, by_phase or breakdown(measured), waits)
    if any(b.seconds.get("recompute") for b in predicted.ranks) and not any(r["phase"] == "recompute" for r in rows):
        note(RECOMPUTE_IN_BACKWARD)
    measured_step = step_time(measured)
    step_error = predicted.step_s / measured_step - 1 if measured_step else None
    if args.json:
        print_json("compare.plan", {
            "plan": plan.name, "cluster": cluster.name, "measured_from": source,
            "predicted_step_s": predicted.step_s, "measured_step_s": measured_step, "step_error": step_error,
            "phases": rows, "stages": stage_phases(rows, measured=by_stage, stage_waits=stage_waits),
            "collectives": [r.to_json() for r in collectives],
            "foreign_load_cores": load.cores if load else None,
            "measured_step_range_s": list(spread) if spread else None,
            "host_speed": speed.to_json(measured_step) if speed else None, "expert_load": routing})
    else:
        print(phases_table(rows, title=f"{plan.name}: predicted ({cluster.name}) vs measured ({source}), "
                                       "per rank and phase"))
        if waits is not None and predicted.end_wait_s >= WAIT_NOTE_S:
            print(end_wait_text(rows, predicted.end_wait_s))
        print()
        stages = stage_phases(rows, measured=by_stage, stage_waits=stage_waits)
        if stages:
            print(stages_table(stages, over_steps=bool(by_stage)))
            print()
        print(collectives_table(collectives) if collectives else "collectives: none in the plan, none measured")
        if speed:
            print(speed.text(measured_step))
        if routing:
            print(expert_load_text(routing))
        error = "" if step_error is None else f" ({step_error:+.1%})"
        steps_range = (f"; its steps {format_time(spread[0])} to {format_time(spread[1])}"
                       if spread and spread[1] > spread[0] else "")
        print(f"step time: predicted {format_time(predicted.step_s)}, measured {format_time(measured_step)}{error}"
              f"{steps_range}")
    if args.trace:
        from ..kineto.write import write_trace

        print(f"wrote {write_trace(args.trace, {'predicted': predicted.trace, 'measured': measured})}",
              file=sys.stderr)
    return 0


def _routing(plan: Plan, cluster, measured: dict) -> dict:
    """The measured routing beside the plan's assumed ``expert_load``, and the step predicted at the measured
    load (the busiest expert's share; every other figure the plan's): how much of the gap is routing."""
    at_measured = replace(plan, expert_load=max(1.0, measured["busiest_over_mean"]))
    return {**measured, "assumed": plan.expert_tokens_factor,
            "predicted_step_s_at_measured": predict_step(at_measured, cluster).step_s}


@dataclass(frozen=True)
class HostSpeed:
    """The host-speed probes (:mod:`executor.speed_probe`) at calibration and around the measured steps. The work
    each compute probe stands for is scaled by the probe's ratio to the power calibrate found that work following
    it (:func:`parsim.calibrate.host.fit_probe_elasticity`; 1: in step)."""

    calibrated_flops: float  # the matmul probe
    calibrated_eager_s: float  # the eager probe, per pass
    measured_flops: float
    measured_eager_s: float
    unscaled_step_s: float  # the step predicted at the calibration's speed
    calibrated_memory_Bps: float | None = None  # the memory probe (None: a file calibrated before it)
    measured_memory_Bps: float | None = None
    calibrated_collective_s: Curve | None = None  # the collective probe, seconds by KiB (None: not timed)
    measured_collective_s: Curve | None = None
    matmul_elasticity: float = 1.0
    eager_elasticity: float = 1.0
    memory_elasticity: float = 1.0

    @property
    def arithmetic_probe(self) -> float:
        """How many times as fast as at calibration the matmul probe ran."""
        return self.measured_flops / self.calibrated_flops

    @property
    def arithmetic(self) -> float:
        """How many times as fast as at calibration the host ran matmuls and a core's arithmetic."""
        return self.arithmetic_probe ** self.matmul_elasticity

    @property
    def memory_probe(self) -> float | None:
        """How many times as fast as at calibration the memory probe ran (None: not probed at both)."""
        if self.calibrated_memory_Bps and self.measured_memory_Bps:
            return self.measured_memory_Bps / self.calibrated_memory_Bps
        return None

    @property
    def memory(self) -> float | None:
        """How many times as fast as at calibration the host's memory ran (None: not probed at both)."""
        return self.memory_probe and self.memory_probe ** self.memory_elasticity

    @property
    def collective(self) -> Curve | None:
        """How many times as fast as at calibration the host ran the collective probe, by its KiB (None: not timed
        at both)."""
        if not self.calibrated_collective_s or not self.measured_collective_s:
            return None
        measured = dict(self.measured_collective_s)
        return tuple((kib, s / measured[kib]) for kib, s in self.calibrated_collective_s if kib in measured) or None

    @property
    def eager_probe(self) -> float:
        """How many times as fast as at calibration the eager probe ran."""
        return self.calibrated_eager_s / self.measured_eager_s

    @property
    def eager(self) -> float:
        """How many times as fast as at calibration the host ran its fixed cost per eager op."""
        return self.eager_probe ** self.eager_elasticity

    def unscaled_error(self, measured_step_s: float) -> float | None:
        """The error of the prediction at the calibration's speed (None without a measured step)."""
        return self.unscaled_step_s / measured_step_s - 1 if measured_step_s else None

    def drift_note(self) -> str | None:
        """A warning where the host ran over :data:`SPEED_NOTE` times faster or slower than at calibration: the
        probes sample it before and after the measured steps, and a host drifting that much may not have run
        the steps between them at that speed (docs/calibration.md, "Sets CD-CH": in CG the probes said eager ops
        x1.50 around a run whose step took 99 ms, against 60 ms predicted at their speed)."""
        factors = ([self.arithmetic_probe, self.eager_probe] + ([self.memory_probe] if self.memory_probe else [])
                   + [factor for _, factor in self.collective or ()])
        if max(max(factors), 1 / min(factors)) <= SPEED_NOTE:
            return None
        return (f"parsim compare: note: the host-speed probes ran {self._factors_text()} as fast as at calibration; "
                "the prediction follows them, but on a host drifting this much the steps between the probes may "
                "have run at another speed (compare again, or calibrate again)")

    def _factors_text(self) -> str:
        memory = f", memory x{self.memory_probe:.2f}" if self.memory_probe else ""
        collective = f", collectives {self._collective_factors()}" if self.collective else ""
        return f"matmuls x{self.arithmetic_probe:.2f}, eager ops x{self.eager_probe:.2f}{memory}{collective}"

    def _collective_factors(self) -> str:
        return " / ".join(f"x{factor:.2f}" for _, factor in self.collective)

    def _collective_text(self) -> str:
        """", collectives x0.61 / x0.45 at 256 KiB / 1 MiB (an all-reduce on 2 ranks: 400 / 820 vs 245 / 370 us)",
        or nothing where the probe was not timed at both."""
        if not self.collective:
            return ""
        sizes = [kib for kib, _ in self.collective]
        measured = dict(self.measured_collective_s)
        calibrated = dict(self.calibrated_collective_s)
        return (f", collectives {self._collective_factors()} at "
                + " / ".join(format_size(kib * 1024) for kib in sizes) + " (an all-reduce on 2 ranks: "
                + " / ".join(f"{measured[kib] * 1e6:.0f}" for kib in sizes) + " vs "
                + " / ".join(f"{calibrated[kib] * 1e6:.0f}" for kib in sizes) + " us)")

    @staticmethod
    def _followed(probe: float, elasticity: float, work: str) -> str:
        """", x1.41 to the power 0.43: as far as the eager work followed it at calibration", or nothing where the
        work follows its probe all the way."""
        if elasticity == 1.0:
            return ""
        return f", x{probe:.2f} to the power {elasticity:.2f}: as far as {work} followed it at calibration"

    def text(self, measured_step_s: float) -> str:
        unscaled = self.unscaled_error(measured_step_s)
        error = "" if unscaled is None else f" ({unscaled:+.1%})"
        if self.memory:
            memory = (f", memory x{self.memory:.2f} (probe {self.measured_memory_Bps / 1e9:.1f} vs "
                      f"{self.calibrated_memory_Bps / 1e9:.1f} GB/s"
                      f"{self._followed(self.memory_probe, self.memory_elasticity, 'AdamW')})")
        else:
            memory = ", memory as the matmuls (the cluster file has no memory probe: calibrate again for one)"
        collectives = ", and each collective takes what the collective probe took more per byte" if self.collective \
            else ""
        following = ("pipeline transfers and collectives between ranks on one core keep their fits"
                     if self.collective else
                     "collectives and transfers keep their fits" + ("" if self.calibrated_collective_s else
                                                                   ": the cluster file has no collective probe"))
        return (f"host speed around the measured steps, against calibration: matmuls x{self.arithmetic:.2f} "
                f"(probe {self.measured_flops / 1e9:.1f} vs {self.calibrated_flops / 1e9:.1f} GFLOP/s"
                f"{self._followed(self.arithmetic_probe, self.matmul_elasticity, 'matmuls')}), eager ops "
                f"x{self.eager:.2f} (probe {self.measured_eager_s * 1e6:.0f} vs {self.calibrated_eager_s * 1e6:.0f} "
                f"us per pass{self._followed(self.eager_probe, self.eager_elasticity, 'the eager work')})"
                f"{memory}{self._collective_text()}\n"
                f"  the compute figures follow them"
                f"{collectives} ({following}); at the calibration's speed the step is predicted at "
                f"{format_time(self.unscaled_step_s)}{error}")

    def to_json(self, measured_step_s: float) -> dict:
        return {"calibrated_gflops": self.calibrated_flops / 1e9, "measured_gflops": self.measured_flops / 1e9,
                "arithmetic_factor": self.arithmetic, "arithmetic_probe_factor": self.arithmetic_probe,
                "matmul_elasticity": self.matmul_elasticity, "calibrated_eager_us": self.calibrated_eager_s * 1e6,
                "measured_eager_us": self.measured_eager_s * 1e6, "eager_factor": self.eager,
                "eager_probe_factor": self.eager_probe, "eager_elasticity": self.eager_elasticity,
                "calibrated_memory_GBps": self.calibrated_memory_Bps and self.calibrated_memory_Bps / 1e9,
                "measured_memory_GBps": self.measured_memory_Bps and self.measured_memory_Bps / 1e9,
                "memory_factor": self.memory, "memory_probe_factor": self.memory_probe,
                "memory_elasticity": self.memory_elasticity,
                "calibrated_collective_us": _us_by_kib(self.calibrated_collective_s),
                "measured_collective_us": _us_by_kib(self.measured_collective_s),
                "collective_factor": dict(self.collective) if self.collective else None,
                "unscaled_predicted_step_s": self.unscaled_step_s,
                "unscaled_step_error": self.unscaled_error(measured_step_s)}


def _us_by_kib(curve: Curve | None) -> dict[int, float] | None:
    return {kib: s * 1e6 for kib, s in curve} if curve else None


def _profiled(plan: Plan, folder: str) -> Trace:
    """The measured step of a folder of per-rank torch.profiler traces of a run of ``plan``."""
    profiles = read_profiles(folder)
    if profiles[0].world_size != plan.world:
        raise ParsimError(f"{folder}: the traces are of {profiles[0].world_size} ranks, but plan {plan.name} "
                          f"has {plan.world} ({plan.degrees_text()})")
    return measured_trace(profiles)


def collectives_table(rows: list[CollectiveRow]) -> str:
    """Per rank and (group, operation): the plan's collectives beside the profile's (count, bytes, time),
    and how they matched."""
    def total_bytes(events: list) -> float:
        return sum(float(e.args.get("bytes") or 0) for e in events)

    def total_time(events: list) -> float:
        return sum(e.dur_s for e in events)

    sides = [(r.predicted, r.measured) for r in rows]
    size, size_scale = size_unit([total_bytes(e) for pair in sides for e in pair])
    unit, scale = time_unit([total_time(e) for pair in sides for e in pair])
    table = [[f"rank {r.rank}", r.group or "?", r.op, len(r.predicted), len(r.measured),
              total_bytes(r.predicted) / size_scale, total_bytes(r.measured) / size_scale,
              total_time(r.predicted) / scale, total_time(r.measured) / scale, r.status]
             for r in rows]
    return render_table(["rank", "group", "collective", "n pred", "n meas", f"{size} pred", f"{size} meas",
                         f"{unit} pred", f"{unit} meas", "match"], table,
                        title="collectives: the plan's beside the measured ones (count, bytes, time per step)")


def median_end_waits(plan: Plan, predicted: StepPrediction, ranks: list[int]
                     ) -> tuple[dict[int, float], dict[int, float]]:
    """The wait for the slowest rank at the step's end (:mod:`parsim.sim.jitter`) as medians over steps, the
    statistic the measured figures are: per measured rank its own, and per pipeline stage that of the mean over
    its measured ranks (:func:`stage_phases`' measured figure). The prediction's idle holds the wait's mean,
    ``predicted.end_wait_s``; of two twins, one waits in each step and the other does not, so each one's median
    wait is about none (docs/calibration.md, "The wait at the step's end, as a median")."""
    simulated = {b.rank for b in predicted.ranks}
    waits = sampled_waits(predicted.trace, predicted.cluster.rank_jitter,
                          [rank_standing_for(plan, simulated, rank) for rank in ranks])
    columns: dict[int, list[int]] = {}
    for i, rank in enumerate(ranks):
        columns.setdefault(plan.coords(rank).pp, []).append(i)
    return ({rank: float(np.median(waits[:, i])) for i, rank in enumerate(ranks)},
            {pp: float(np.median(waits[:, mine].mean(axis=1))) for pp, mine in columns.items()})


def end_wait_text(rows: list[dict], mean_s: float) -> str:
    """How the rows' idle prices the wait at the step's end: each rank's median, beside the step's mean."""
    waits = ", ".join(f"rank {row['rank']} {format_time(max(row['end_wait_s'], 0.0))}"
                      for row in rows if row["phase"] == "idle" and "end_wait_s" in row)
    return (f"idle holds the wait for the slowest rank at the step's end as its median over the steps, as measured "
            f"({waits}); the step holds its mean, {format_time(mean_s)} (the ranks' jitter: in each step one of "
            "two twins waits and the other does not)")


RECOMPUTE_IN_BACKWARD = ("parsim compare: the run's backward holds its recomputation (torch.utils.checkpoint reruns "
                         "each layer's forward inside the backward), so the predicted recompute is counted in "
                         "backward here")


def compare_phases(plan, predicted, measured: list[RankBreakdown],
                   waits: Mapping[int, float] | None = None) -> list[dict]:
    """Per measured rank and phase: predicted seconds (of the rank, or where it was not simulated in its own right,
    of its representative), measured seconds, and the least and most one measured step spent on the phase (None:
    one step measured). ``waits``: each rank's wait at the step's end to price in its idle in place of the
    prediction's mean (:func:`median_end_waits`); each idle row keeps the wait it holds (``end_wait_s``)."""
    by_rank = {b.rank: b for b in predicted.ranks}
    rows = []
    for m in measured:
        pp = plan.coords(m.rank).pp
        p = by_rank[rank_standing_for(plan, set(by_rank), m.rank)]
        predicted_s = dict(p.seconds)
        if not m.seconds.get("recompute") and predicted_s.get("recompute"):
            # torch.utils.checkpoint reruns a layer's forward inside its backward, where the executor's span
            # holds it: the predicted rerun is set beside the measured backward (RECOMPUTE_IN_BACKWARD)
            predicted_s["backward"] = predicted_s.get("backward", 0.0) + predicted_s.pop("recompute")
        for phase in PHASES:
            pred, meas = predicted_s.get(phase, 0.0), m.seconds.get(phase, 0.0)
            wait = None
            if phase == "idle" and predicted.end_wait_s:
                wait = predicted.end_wait_s if waits is None else waits[m.rank]
                pred += wait - predicted.end_wait_s
            if pred or meas:
                lo_hi = m.ranges.get(phase)
                rows.append({"rank": m.rank, "pp": pp, "phase": phase, "predicted_s": pred, "measured_s": meas,
                             "measured_range_s": list(lo_hi) if lo_hi else None,
                             "error": pred / meas - 1 if meas else None,
                             **({"end_wait_s": wait} if wait is not None else {})})
    return rows


def stage_phases(rows: list[dict], min_ranks: int = 2,
                 measured: Mapping[tuple[int, str], float] | None = None,
                 stage_waits: Mapping[int, float] | None = None) -> list[dict]:
    """:func:`compare_phases`' rows per pipeline stage of at least ``min_ranks`` measured ranks: each phase's
    predicted and measured seconds, the mean over the stage's ranks (a phase a rank lacks counts 0 there). Where
    ``measured`` has a (stage, phase), that is the measured figure: the median over several steps of the
    stage's mean in each step (``run_plan``'s ``stages``), where the mean of the ranks' medians would take each
    rank's median on whichever side of a twin's wait it happened to fall
    (:func:`~parsim.report.step_report.median_breakdown` by stage). ``stage_waits``: the wait at the step's end
    each stage's idle holds in place of its ranks' (:func:`median_end_waits`), as that median is measured.

    A stage's data-, tensor- and context-parallel ranks do the same work; which of them a shared core runs
    first, or which ends its step last, changes from step to step, so one rank's phase can miss where the
    stage's mean does not (docs/calibration.md, "How far a measurement repeats itself")."""
    ranks: dict[int, set[int]] = {}
    sums: dict[tuple[int, str], list[float]] = {}
    for r in rows:
        ranks.setdefault(r["pp"], set()).add(r["rank"])
        total = sums.setdefault((r["pp"], r["phase"]), [0.0, 0.0])
        own_wait = r.get("end_wait_s", 0.0) if stage_waits is not None else 0.0  # the stage's takes its place
        total[0] += r["predicted_s"] - own_wait
        total[1] += r["measured_s"]
    stages = []
    for pp, phase in sorted(sums, key=lambda key: (key[0], PHASES.index(key[1]))):
        (predicted_sum, measured_sum), n = sums[pp, phase], len(ranks[pp])
        if n < min_ranks:
            continue
        predicted_s = predicted_sum / n
        if stage_waits is not None and phase == "idle":
            predicted_s += stage_waits.get(pp, 0.0)
        measured_s = (measured or {}).get((pp, phase), measured_sum / n)
        stages.append({"pp": pp, "ranks": n, "phase": phase, "predicted_s": predicted_s, "measured_s": measured_s,
                       "error": predicted_s / measured_s - 1 if measured_s else None})
    return stages


def stages_table(stages: list[dict], over_steps: bool = False) -> str:
    """The rows of :func:`stage_phases` for people (``over_steps``: measured over several steps)."""
    unit, scale = time_unit([r["predicted_s"] for r in stages] + [r["measured_s"] for r in stages])
    return render_table(["stage", "phase", f"predicted ({unit})", f"measured ({unit})", "error"],
                        [[f"pp {r['pp']} ({r['ranks']} ranks)", r["phase"], r["predicted_s"] / scale,
                          r["measured_s"] / scale, _error_text(r)] for r in stages],
                        title="per stage, each phase the mean over its ranks (they do the same work; which of "
                              "them runs first, or ends last, changes from step to step)"
                              + ("; measured, that mean's median over the steps" if over_steps else ""))


def phases_table(rows: list[dict], title: str) -> str:
    """The rows of :func:`compare_phases` for people; with several measured steps, the range a phase took over
    them beside its median, so a miss can be told from the run's own noise."""
    unit, scale = time_unit([r["predicted_s"] for r in rows] + [r["measured_s"] for r in rows])
    ranges = any(r["measured_range_s"] for r in rows)
    table = []
    for r in rows:
        row = [f"rank {r['rank']} (pp {r['pp']})", r["phase"], r["predicted_s"] / scale, r["measured_s"] / scale]
        if ranges:
            lo_hi = r["measured_range_s"]
            row.append(f"{format_number(lo_hi[0] / scale)}-{format_number(lo_hi[1] / scale)}" if lo_hi else "")
        table.append([*row, _error_text(r)])
    headers = ["rank", "phase", f"predicted ({unit})", f"measured ({unit})"]
    return render_table([*headers, *([f"steps' range ({unit})"] if ranges else []), "error"], table, title=title)


def _error_text(row: dict) -> str:
    return "-" if row["error"] is None else f"{row['error']:+.0%}"
