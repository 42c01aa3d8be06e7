"""The CPU loop's accuracy in one command: calibrate this host, then compare each plan's prediction with runs.

`parsim calibrate` (or the cluster file given with ``--cluster``), then
``--runs`` runs of ``parsim compare`` of each plan, one after another:

* course DDP, TP and PP on 2 ranks (the course notes' plans);
* tiny-gpt's 2-stage pipeline on 2 ranks, and its data- x pipeline-parallel
  plan on 4 (two ranks on each core of a 2-core host).

For each plan: the prediction (the median of the runs', each scaled by the
host-speed probes around its steps) against the median of the runs' measured
steps, and the same per rank and phase (forward, backward, optimizer, each
group's communication, idle). It prints whether each is within the issue's
bounds: a step within 15%, every phase within 25%, and how many of the phases
outside it were predicted within the range their measured steps spanned (the
host's own noise), and how many miss per stage: each phase the mean over the
stage's ranks (``parsim compare``'s second table: measured, that mean's median
over the steps), since which of a stage's ranks runs first on a shared core,
or ends last, changes from step to step.

Each run measures 30 steps (``--steps``), not ``parsim compare``'s 10: on the
2-core VM two loops of 10 steps a run missed each other's phases 9 times per
rank (sets CN, CO), two of 30 steps 3 times (CP, CQ; docs/calibration.md).
Never run anything else on the host meanwhile: other work slows the steps and
not the calibration.

On the 2-core VM (2026-11-29) one calibration and three runs of each plan of
30 steps take about 5.5 minutes (4.5 in set DE, calibrate's generic pipeline
included; 6-10 on a 3-4x slower AMD VM, 10 measured
steps a run; 7-7.5 there since calibrate measures its collectives in three
rounds: sets BW, BX; 6.4 on the AMD VM once ranks forked from a server that
imported torch once, set HB, 2026-12-01, where its sets had taken 11-15);
`docs/calibration.md` lists the sets measured so far. ``--out DIR`` keeps
the calibration (``host.yaml``, and what calibrate printed in
``calibrate.txt``) and every run's JSON.

``--again DIR`` runs nothing: it predicts the runs an earlier loop kept in
DIR (its ``--out``) again with the model as it is now, each at the host speed
its probes measured, against what was measured then; a change to the model is
checked on the same measurements; ``--hold PROBE`` predicts them as if that
host-speed probe (``matmul``, ``eager``, ``memory``, ``collective``, or
``all``) had read the calibration's speed, and ``--power PROBE=X`` as if the
work a compute probe stands for had followed it to the power X (0 to 1; the
runs' own: calibrate's fitted one, 1 before it). Given several folders (``--again DIR
DIR ...``, each with its own calibration), it prints how the model does across
them: per plan, the sets whose step is within 15% and the misses, and per
stage and phase, the median error over the sets and how many of them miss
25%: what is systematic, not one hour's noise.

``--repeat DIR_A DIR_B`` runs nothing either: it holds two loops' measurements
against each other, as the model is held against one, to show how far the
measurement repeats itself. Each plan's median step and phases of DIR_A
against DIR_B's, each phase as a share of its own loop's median step (a host
running faster in one loop moves every phase alike, and the model is told of
that speed by the probes); a repeat of the same runs misses the bounds this
often with no model at all (``docs/calibration.md``, "How far a measurement
repeats itself").

Run:  python benchmarks/cpu_compare_loop.py [--cluster host.yaml] [--runs 3] [--steps N] [--out DIR] [--json]
      python benchmarks/cpu_compare_loop.py --again DIR [DIR ...] [--hold PROBE ...] [--power PROBE=X ...]
                                            [--json]
      python benchmarks/cpu_compare_loop.py --repeat DIR_A DIR_B [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# (label, parsim compare arguments, ranks)
PLANS = (
    ("course DDP", ["course-ddp", "--dp", "2"], 2),
    ("course TP", ["course-tp", "--tp", "2"], 2),
    ("course PP", ["course-pp"], 2),
    ("tiny PP", ["tiny-pp2"], 2),
    ("tiny DP x PP", ["tiny-pp2", "--dp", "2"], 4),
)
STEP_BOUND, PHASE_BOUND = 0.15, 0.25  # the issue's: a step within 15% of the median run, every phase within 25%
STEPS = 30  # measured steps of each run (see above)


def summarize(runs: list[dict]) -> dict:
    """One plan's runs (``parsim compare --json`` documents) against their medians: the step's error, and every
    (rank, phase)'s, with the worst. A phase outside the bound is also checked against the least and most any
    measured step of the runs spent on it: a prediction inside that range misses by less than the host's own
    step-to-step noise."""
    predicted = statistics.median(r["predicted_step_s"] for r in runs)
    measured = [r["measured_step_s"] for r in runs]
    # (rank, phase) -> each run's predicted and measured seconds and its measured steps' range (None: not kept)
    by_phase: dict[tuple[int, str], tuple[list[float], list[float], list[list[float] | None]]] = {}
    for run in runs:
        for row in run["phases"]:
            seen = by_phase.setdefault((row["rank"], row["phase"]), ([], [], []))
            seen[0].append(row["predicted_s"])
            seen[1].append(row["measured_s"])
            seen[2].append(row.get("measured_range_s"))
    phases = []
    for (rank, phase), (p, m, ranges) in sorted(by_phase.items()):
        row = {"rank": rank, "phase": phase, "predicted_s": statistics.median(p), "measured_s": statistics.median(m),
               "error": _error(statistics.median(p), statistics.median(m)), "measured_range_s": None}
        if all(ranges):
            row["measured_range_s"] = [min(lo for lo, _ in ranges), max(hi for _, hi in ranges)]
        phases.append(row)
    misses = [row for row in phases if abs(row["error"]) > PHASE_BOUND]
    worst = max(phases, key=lambda row: abs(row["error"]), default=None)
    error = _error(predicted, statistics.median(measured))
    stages = [{"pp": stage, "phase": phase, "predicted_s": p, "measured_s": m, "error": _error(p, m)}
              for (stage, phase), (p, m) in _medians(runs, _by_stage, "predicted_s", "measured_s").items()]
    return {"predicted_step_s": predicted, "measured_step_s": measured, "step_error": error,
            "step_within": abs(error) <= STEP_BOUND, "phases": phases, "worst_phase": worst,
            "phases_within": not misses, "phase_misses": len(misses),
            "phase_misses_in_range": sum(1 for row in misses if _in_range(row)),
            "stages": stages, "stage_misses": sum(1 for row in stages if abs(row["error"]) > PHASE_BOUND)}


def _by_rank(run: dict) -> dict[tuple[int, str], dict]:
    """One run's phase rows by (rank, phase)."""
    return {(row["rank"], row["phase"]): row for row in run["phases"]}


def _by_stage(run: dict) -> dict[tuple[int, str], dict]:
    """One run's phases by (pipeline stage, phase), each the mean over the stage's ranks (``parsim compare``'s
    :func:`~parsim.cli.compare_plan.stage_phases`; a stage of one rank is that rank's), measured as the run's
    ``stages`` kept it (the mean in each step, its median over the steps). A stage's data- and tensor-parallel
    ranks do the same work; which of them the host runs first, or ends last, changes from step to step (two
    ranks on a core, one rank's slow spell), and the mean over them does not. A stage of several ranks is
    predicted as the run priced it (its idle's wait at the step's end a median, as measured)."""
    from parsim.cli.compare_plan import stage_phases

    rows = {(row["pp"], row["phase"]): row for row in stage_phases(run["phases"], min_ranks=1)}
    return {**rows, **{(row["pp"], row["phase"]): row for row in run.get("stages", ())}}


def _medians(runs: list[dict], rows_of: Callable[[dict], dict[tuple[int, str], dict]],
             *keys: str) -> dict[tuple[int, str], tuple[float, ...]]:
    """Per (rank or stage, phase), the median over the runs of each of ``keys`` (0 in a run without the phase)."""
    rows = [rows_of(run) for run in runs]
    phases = sorted(set().union(*rows))
    return {phase: tuple(statistics.median(r[phase][key] if phase in r else 0.0 for r in rows) for key in keys)
            for phase in phases}


def repeated(runs_a: list[dict], runs_b: list[dict]) -> dict:
    """One plan's runs in two loops against each other: the median steps, how much slower the first loop's
    was, and every (rank, phase)'s median share of its loop's median step, the first's against the second's
    (its error as the model's would be); the same per stage."""
    step_a = statistics.median(r["measured_step_s"] for r in runs_a)
    step_b = statistics.median(r["measured_step_s"] for r in runs_b)

    def shares(rows_of: Callable[[dict], dict]) -> list[tuple[tuple[int, str], float, float]]:
        a, b = _medians(runs_a, rows_of, "measured_s"), _medians(runs_b, rows_of, "measured_s")
        return [(key, a.get(key, (0.0,))[0] / step_a, b.get(key, (0.0,))[0] / step_b)
                for key in sorted(a.keys() | b.keys())]

    phases = [{"rank": rank, "phase": phase, "share_a": share_a, "share_b": share_b, "error": _error(share_a, share_b)}
              for (rank, phase), share_a, share_b in shares(_by_rank)]
    misses = [row for row in phases if abs(row["error"]) > PHASE_BOUND]
    return {"step_s": [step_a, step_b], "step_change": _error(step_a, step_b), "phases": phases,
            "worst_phase": max(phases, key=lambda row: abs(row["error"]), default=None),
            "phases_within": not misses, "phase_misses": len(misses),
            "stage_misses": sum(1 for _, share_a, share_b in shares(_by_stage)
                                if abs(_error(share_a, share_b)) > PHASE_BOUND)}


# The host-speed probes ``--again --hold`` can hold at the calibration's speed, and the factor each gives.
PROBES = {"matmul": "arithmetic_factor", "eager": "eager_factor", "memory": "memory_factor",
          "collective": "collective_factor"}
# A compute probe's own ratio in a kept run (``parsim compare --json``'s host_speed), for ``--power``: runs from
# before calibrate fitted its power keep it in the factor, the ratio itself then.
PROBE_RATIOS = {"matmul": ("arithmetic_probe_factor", "arithmetic_factor"),
                "eager": ("eager_probe_factor", "eager_factor"),
                "memory": ("memory_probe_factor", "memory_factor")}


@dataclass(frozen=True)
class SpeedOverrides:
    """How ``--again`` predicts kept runs beside the speed their probes gave: the probes ``held`` at the
    calibration's speed (of :data:`PROBES`), and compute probes followed to other ``powers`` (of
    :data:`PROBE_RATIOS`: the factor is the probe's ratio to that power, as calibrate's fitted one is)."""

    held: frozenset[str] = frozenset()
    powers: tuple[tuple[str, float], ...] = ()

    def speed(self, speed: dict) -> dict:
        """A kept run's host_speed with these overrides."""
        speed = dict(speed)
        for probe, power in self.powers:
            ratio = next((speed[key] for key in PROBE_RATIOS[probe] if speed.get(key) is not None), None)
            speed[PROBES[probe]] = None if ratio is None else ratio ** power  # memory: None follows the matmuls
        # a held compute probe: a factor of 1; a held collective probe: none (the collectives as calibrated)
        return {**speed, **{PROBES[probe]: None if probe == "collective" else 1.0 for probe in self.held}}

    def title(self) -> str:
        """How a title says what was overridden: ", the eager probe held at the calibration's speed, ..."."""
        held = sorted(self.held)
        parts = [f"the {', '.join(held)} probe{'s' if len(held) > 1 else ''} held at the calibration's speed"] \
            if held else []
        parts += [f"the {probe} probe's ratio to the power {power:.2f}" for probe, power in self.powers]
        return "".join(f", {part}" for part in parts)


def predicted_again(run: dict, plan_args: list[str], cluster, overrides: SpeedOverrides = SpeedOverrides()) -> dict:
    """A kept run (``parsim compare --json``) with the step and phases predicted by the model as it is now, on
    ``cluster`` at the host speed the run's probes measured, but for the ``overrides``; what was measured
    stays."""
    from parsim.cli.compare_plan import compare_phases, median_end_waits, stage_phases
    from parsim.cli.main import build_parser
    from parsim.cli.plan_cmd import plan_from_args
    from parsim.report.step_report import RankBreakdown
    from parsim.sim.step import predict_step

    plan = plan_from_args(build_parser().parse_args(["simulate", *plan_args]))
    speed = run.get("host_speed")
    if speed:
        speed = overrides.speed(speed)
        cluster = cluster.at_host_speed(speed["arithmetic_factor"], speed["eager_factor"], speed.get("memory_factor"))
        if speed.get("collective_factor"):  # JSON's keys are strings: the KiB
            cluster = cluster.at_collective_probe(tuple(sorted((int(kib), us * 1e-6)
                                                               for kib, us in speed["measured_collective_us"].items())))
    predicted = predict_step(plan, cluster)
    kept: dict[int, tuple[dict, dict]] = {}  # rank -> (phase -> seconds, phase -> the steps' range)
    for row in run["phases"]:
        seconds, ranges = kept.setdefault(row["rank"], ({}, {}))
        seconds[row["phase"]] = row["measured_s"]
        if row.get("measured_range_s"):
            ranges[row["phase"]] = tuple(row["measured_range_s"])
    measured = [RankBreakdown(rank, run["measured_step_s"], seconds, ranges)
                for rank, (seconds, ranges) in sorted(kept.items())]
    waits, stage_waits = median_end_waits(plan, predicted, [m.rank for m in measured])
    phases = compare_phases(plan, predicted, measured, waits)
    kept_stages = {(row["pp"], row["phase"]): row["measured_s"] for row in run.get("stages", ())}
    stages = stage_phases(phases, measured=kept_stages, stage_waits=stage_waits)
    return {**run, "predicted_step_s": predicted.step_s, "step_error": _error(predicted.step_s, run["measured_step_s"]),
            "phases": phases, "stages": stages}


def _in_range(row: dict) -> bool:
    """Whether a phase's prediction lies within the least and most one measured step spent on it."""
    lo_hi = row["measured_range_s"]
    return lo_hi is not None and lo_hi[0] <= row["predicted_s"] <= lo_hi[1]


def _error(predicted: float, measured: float) -> float:
    """Relative error of ``predicted``; a phase measured at 0 counts as exact when predicted 0 too."""
    if measured > 0:
        return predicted / measured - 1.0
    return 0.0 if predicted == 0 else float("inf")


def _parsim(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parsim", *args], capture_output=True, text=True)


def _last_line(done: subprocess.CompletedProcess) -> str:
    """What a failed parsim command said last (its one-line refusal), or its exit code."""
    return (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]


def _fail(message: str) -> None:
    print(f"cpu_compare_loop.py: {message}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--cluster", help="a calibrated cluster file (default: calibrate this host first)")
    parser.add_argument("--runs", type=int, help="runs of each plan (default 3)")
    parser.add_argument("--steps", type=int, help=f"measured steps of each run (default {STEPS})")
    parser.add_argument("--out", help="keep the calibration and every run's JSON in this folder")
    parser.add_argument("--again", metavar="DIR", nargs="+",
                        help="run nothing: predict the runs kept in DIR (an earlier --out) again with this model; "
                             "several DIRs: the model across them, stage by stage")
    parser.add_argument("--hold", nargs="+", choices=[*PROBES, "all"], default=[],
                        help="with --again: predict as if these host-speed probes had read the calibration's speed")
    parser.add_argument("--power", nargs="+", metavar="PROBE=X", default=[],
                        help="with --again: follow these compute probes (matmul, eager, memory) to the power X, "
                             "0 to 1, instead of the run's (calibrate's fit, or 1 before it)")
    parser.add_argument("--repeat", nargs=2, metavar=("DIR_A", "DIR_B"),
                        help="run nothing: hold the measurements kept in DIR_A against DIR_B's")
    parser.add_argument("--json", action="store_true", help="print a JSON summary for scripts")
    args = parser.parse_args()
    for flag, value in (("--again", args.again), ("--repeat", args.repeat)):
        if value is None:
            continue
        given = [other for other, value in (("--cluster", args.cluster), ("--runs", args.runs), ("--steps", args.steps),
                                            ("--out", args.out), ("--again", args.again), ("--repeat", args.repeat))
                 if value is not None and other != flag]
        if given:
            _fail(f"{flag} runs nothing, so {', '.join(given)} do{'es' if len(given) == 1 else ''} not apply")
    for flag, value in (("--hold", args.hold), ("--power", args.power)):
        if value and args.again is None:
            _fail(f"{flag} predicts kept runs again: it goes with --again")
    held = frozenset(PROBES if "all" in args.hold else args.hold)
    overrides = SpeedOverrides(held, _powers(args.power, held))
    if args.repeat is not None:
        _print_repeat(*args.repeat, as_json=args.json)
        return
    args.runs = 3 if args.runs is None else args.runs
    if args.runs < 1:
        _fail(f"--runs must be at least 1, got {args.runs}")
    if args.steps is not None and args.steps < 1:
        _fail(f"--steps must be at least 1, got {args.steps}")
    if args.again is not None and len(args.again) > 1:
        _print_across([Path(folder) for folder in args.again], args.json, overrides)
        return
    if args.again is not None:
        out = Path(args.again[0])
        cluster, runs = str(out / "host.yaml"), _kept_runs(out, overrides)
        title = f"the runs kept in {out}, predicted again with this model on {cluster}{overrides.title()}"
    else:
        cluster, out, runs = _measure(args)
        title = f"{args.runs} runs of each plan on {cluster} (every run's JSON in {out})"
    summary = {label: summarize(plan_runs) for label, plan_runs in runs.items()}
    if args.json:
        print(json.dumps({"cluster": cluster, "runs": {label: len(r) for label, r in runs.items()}, "out": str(out),
                          "plans": summary}, indent=1))
        return
    from parsim.report.table import render_table

    rows = []
    for label, row in summary.items():
        worst = row["worst_phase"]
        rows.append([label, row["predicted_step_s"] * 1e3, " ".join(f"{m * 1e3:.1f}" for m in row["measured_step_s"]),
                     f"{row['step_error']:+.1%}", "yes" if row["step_within"] else "no",
                     f"r{worst['rank']} {worst['phase']} {worst['error']:+.0%}" if worst else "-",
                     "yes" if row["phases_within"] else "no",
                     f"{row['phase_misses']} ({row['phase_misses_in_range']})", row["stage_misses"]])
    print(render_table(["plan", "predicted (ms)", "measured (ms)", "error", "within 15%", "worst phase",
                        "phases within 25%", "misses (inside steps' range)", "misses per stage"], rows, title=title))


def across_sets(summaries: list[dict[str, dict]]) -> dict:
    """Several loops' :func:`summarize` results (one dict of plans each) taken together: per plan, the sets whose
    step is within the bound, the median step error and the misses summed; per (plan, stage, phase), the median
    error over the sets and how many of them miss the phase bound."""
    plans: dict[str, dict] = {}
    stages: dict[tuple[str, int, str], list[dict]] = {}
    for summary in summaries:
        for label, plan in summary.items():
            row = plans.setdefault(label, {"sets": 0, "steps_within": 0, "step_errors": [], "phase_misses": 0,
                                           "stage_misses": 0})
            row["sets"] += 1
            row["steps_within"] += plan["step_within"]
            row["step_errors"].append(plan["step_error"])
            row["phase_misses"] += plan["phase_misses"]
            row["stage_misses"] += plan["stage_misses"]
            for stage in plan["stages"]:
                stages.setdefault((label, stage["pp"], stage["phase"]), []).append(stage)
    for row in plans.values():
        row["median_step_error"] = statistics.median(row.pop("step_errors"))
    return {"plans": plans, "stages": [
        {"plan": label, "pp": pp, "phase": phase, "sets": len(rows),
         "median_error": statistics.median(r["error"] for r in rows),
         "sets_missing": sum(abs(r["error"]) > PHASE_BOUND for r in rows),
         "median_predicted_s": statistics.median(r["predicted_s"] for r in rows),
         "median_measured_s": statistics.median(r["measured_s"] for r in rows)}
        for (label, pp, phase), rows in stages.items()]}


def _powers(given: list[str], held: frozenset[str]) -> tuple[tuple[str, float], ...]:
    """``--power``'s PROBE=X arguments, checked: a compute probe, not also held, and a power from 0 to 1."""
    powers = []
    for item in given:
        probe, _, value = item.partition("=")
        if probe not in PROBE_RATIOS:
            _fail(f"--power {item}: the probe is one of {', '.join(PROBE_RATIOS)}")
        if probe in held:
            _fail(f"--power {item}: the {probe} probe is held (--hold) already")
        try:
            power = float(value)
        except ValueError:
            power = -1.0
        if not 0.0 <= power <= 1.0:
            _fail(f"--power {item}: the power is a number from 0 to 1")
        powers.append((probe, power))
    return tuple(powers)


def _print_across(folders: list[Path], as_json: bool, overrides: SpeedOverrides = SpeedOverrides()) -> None:
    summaries = [{label: summarize(runs) for label, runs in _kept_runs(folder, overrides).items()}
                 for folder in folders]
    across = across_sets(summaries)
    if as_json:
        print(json.dumps({"sets": [str(f) for f in folders], **across}, indent=1))
        return
    from parsim.report.table import render_table

    print(render_table(["plan", "sets", "steps within 15%", "median step error", "misses per rank", "per stage"],
                       [[label, row["sets"], row["steps_within"], f"{row['median_step_error']:+.1%}",
                         row["phase_misses"], row["stage_misses"]] for label, row in across["plans"].items()],
                       title=f"the runs kept in {len(folders)} folders, each predicted again with this model on its "
                             f"own calibration{overrides.title()}"))
    print()
    print(render_table(["plan", "stage", "phase", "median error", "sets outside 25%", "predicted (ms)",
                        "measured (ms)"],
                       [[row["plan"], row["pp"], row["phase"], f"{row['median_error']:+.0%}",
                         f"{row['sets_missing']} of {row['sets']}", row["median_predicted_s"] * 1e3,
                         row["median_measured_s"] * 1e3] for row in across["stages"]],
                       title="each stage's phases across the sets (medians over the sets)"))


def _print_repeat(folder_a: str, folder_b: str, as_json: bool) -> None:
    runs_a, runs_b = _runs_in(Path(folder_a)), _runs_in(Path(folder_b))
    summary = {label: repeated(runs_a[label], runs_b[label]) for label in runs_a if label in runs_b}
    if not summary:
        _fail(f"{folder_a} and {folder_b} keep no plan's runs in common")
    if as_json:
        print(json.dumps({"a": folder_a, "b": folder_b, "plans": summary}, indent=1))
        return
    from parsim.report.table import render_table

    rows = []
    for label, row in summary.items():
        worst = row["worst_phase"]
        rows.append([label, row["step_s"][0] * 1e3, row["step_s"][1] * 1e3, f"{row['step_change']:+.1%}",
                     f"r{worst['rank']} {worst['phase']} {worst['error']:+.0%}" if worst else "-",
                     "yes" if row["phases_within"] else "no", row["phase_misses"], row["stage_misses"]])
    print(render_table(["plan", "A median step (ms)", "B median step (ms)", "A against B", "worst phase (share)",
                        "phases within 25%", "misses", "misses per stage"], rows,
                       title=f"the measurements kept in {folder_a} (A) against {folder_b} (B), each phase as a share "
                             "of its loop's median step"))


def _measure(args: argparse.Namespace) -> tuple[str, Path, dict[str, list[dict]]]:
    """Calibrate (unless ``--cluster``), then run every plan ``--runs`` times: (the cluster file, the folder
    keeping the runs, each plan's runs)."""
    steps = ("--steps", str(STEPS if args.steps is None else args.steps))
    cluster = args.cluster
    if cluster is not None:
        _load_cluster(cluster)  # before any run: one line, as the CLI says it
    out = Path(args.out or tempfile.mkdtemp(prefix="parsim-loop-"))
    out.mkdir(parents=True, exist_ok=True)
    if cluster is None:
        cluster = str(out / "host.yaml")
        print(f"calibrating this host into {cluster} ...", file=sys.stderr, flush=True)
        done = _parsim("calibrate", "--out", cluster)
        if done.returncode:
            _fail(f"parsim calibrate failed: {_last_line(done)}")
        (out / "calibrate.txt").write_text(done.stdout)  # the fit as calibrate printed it, kept with the runs
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in PLANS}
    for i in range(args.runs):
        for label, plan, ranks in PLANS:
            print(f"run {i + 1}/{args.runs}: {label}", file=sys.stderr, flush=True)
            done = _parsim("compare", *plan, "--cluster", cluster, "--nproc", str(ranks), *steps, "--json")
            if done.returncode:
                _fail(f"parsim compare {' '.join(plan)} failed: {_last_line(done)}")
            (out / f"{_slug(label)}-{i + 1}.json").write_text(done.stdout)
            runs[label].append(json.loads(done.stdout))
    return cluster, out, runs


def _kept_runs(folder: Path, overrides: SpeedOverrides = SpeedOverrides()) -> dict[str, list[dict]]:
    """Each plan's runs kept in ``folder`` (``--out``), predicted again (:func:`predicted_again`, with the
    ``overrides``) on the cluster file kept beside them."""
    cluster = _load_cluster(str(folder / "host.yaml"))
    arguments = {label: plan for label, plan, _ in PLANS}
    return {label: [predicted_again(run, arguments[label], cluster, overrides) for run in runs]
            for label, runs in _runs_in(folder).items()}


def _runs_in(folder: Path) -> dict[str, list[dict]]:
    """Each plan's runs (``parsim compare --json`` documents) kept in ``folder`` (``--out``), as they were."""
    runs: dict[str, list[dict]] = {}
    for label, _, _ in PLANS:
        for path in sorted(folder.glob(f"{_slug(label)}-*.json")):
            try:
                runs.setdefault(label, []).append(json.loads(path.read_text()))
            except (OSError, ValueError) as error:
                _fail(f"{path}: not a compare run's JSON ({error})")
    if not runs:
        _fail(f"no runs kept in {folder} (an earlier loop's --out keeps them as PLAN-N.json)")
    return runs


def _load_cluster(path: str):
    from parsim.errors import ParsimError
    from parsim.hardware.cluster import load_cluster

    try:
        return load_cluster(path)
    except ParsimError as error:
        _fail(str(error))


def _slug(label: str) -> str:
    """A plan's label as the file names of its runs have it: ``tiny DP x PP`` -> ``tiny-dp-x-pp``."""
    return label.lower().replace(" ", "-")


if __name__ == "__main__":
    main()
