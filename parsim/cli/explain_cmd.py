"""``parsim explain``: the arithmetic behind a number, step by step, for a student.

Topics are sub-subcommands (``parsim explain bubble``), so more can join.
"""

from __future__ import annotations

import argparse
import math
import sys

from ..errors import ParsimError
from ..report.jsondoc import print_json
from ..report.table import render_table
from ..schedules import (KIND_NAMES, SCHEDULES, IdealTiming, Schedule, closed_form, in_flight_by_stage, make_schedule,
                         peak_in_flight, simulate_ideal)
from . import explain_compute, explain_memory
from .common import check_outputs

HELP = """\
Explain a number parsim prints, step by step.

topics:
  bubble   the pipeline bubble of a schedule: closed form, simulation, memory, picture
  memory   a plan's memory per GPU: bytes per parameter, ZeRO, activations, in-flight microbatches
  compute  one layer's kernels on one GPU: matmul shapes and rates, attention, memory-bound work
"""

BUBBLE_HELP = f"""\
Explain the pipeline bubble: the time ranks sit idle while a pipeline fills
and drains.

Passes take --tf (forward) and --tb (full backward) time units per microbatch
for one rank's share of the model; with v stages per rank each stage takes
1/v of that. Zero-bubble schedules split the backward into I (input
gradient) and W (weight gradient, --tw of --tb; default half). Communication
is free unless --tcomm is given.

schedules: {", ".join(SCHEDULES)}

examples:
  parsim explain bubble --pp 4 --microbatches 8 --schedule 1f1b
  parsim explain bubble --pp 4 --microbatches 8 --schedule interleaved-1f1b --virtual-stages 2
  parsim explain bubble --pp 4 --microbatches 8 --schedule zero-bubble --gantt zb.png
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("explain", help="explain a number step by step (bubble, memory, compute)",
                              description=HELP,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    topics = p.add_subparsers(dest="topic", metavar="TOPIC")
    p.set_defaults(func=_missing_topic)

    b = topics.add_parser("bubble", help="the pipeline bubble of a schedule", description=BUBBLE_HELP,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--pp", type=int, default=4, help="pipeline ranks p (default 4)")
    b.add_argument("--microbatches", "-m", type=int, default=8, help="microbatches m per step (default 8)")
    b.add_argument("--schedule", default="1f1b", help="pipeline schedule (default 1f1b)")
    b.add_argument("--virtual-stages", "-v", type=int, help="stages per rank v (default: the schedule's own)")
    b.add_argument("--tf", type=float, default=1.0, help="forward time per microbatch per rank (default 1)")
    b.add_argument("--tb", type=float, default=2.0, help="full backward time per microbatch per rank (default 2)")
    b.add_argument("--tw", type=float, help="weight-gradient part of --tb, for zero-bubble schedules "
                                            "(default --tb / 2)")
    b.add_argument("--tcomm", type=float, default=0.0, help="time of one pipeline transfer (default 0)")
    b.add_argument("--gantt", metavar="PNG", help="save a Gantt chart of the simulated step")
    b.add_argument("--json", action="store_true", help="print JSON for scripts")
    b.set_defaults(func=run_bubble)
    explain_memory.register(topics)
    explain_compute.register(topics)


def _missing_topic(args: argparse.Namespace) -> int:
    raise ParsimError("which topic? bubble, memory or compute (see 'parsim explain --help')")


def run_bubble(args: argparse.Namespace) -> int:
    check_outputs(args, pictures=("--gantt",))
    schedule = make_schedule(args.schedule, args.pp, args.microbatches, args.virtual_stages)
    for flag in ("tf", "tb", "tcomm") + (("tw",) if args.tw is not None else ()):
        if not 0 <= getattr(args, flag) < math.inf:
            raise ParsimError(f"--{flag} must be a finite time >= 0, got {getattr(args, flag):g}")
    if args.tf + args.tb <= 0:
        raise ParsimError("--tf and --tb are both 0: there is nothing to time")
    if args.tw is not None and not schedule.split_backward:
        raise ParsimError(f"--tw {args.tw:g}: {args.schedule} runs each backward whole; zero-bubble, zb-h2, zbv and "
                          f"dualpipe-v split it into I and W")
    v = schedule.virtual_stages
    t_w = (args.tb / 2 if args.tw is None else args.tw) if schedule.split_backward else 0.0
    if t_w > args.tb:
        raise ParsimError(f"--tw ({t_w:g}) is part of the backward and cannot exceed --tb ({args.tb:g})")
    t_f, t_b, t_w = args.tf / v, args.tb / v, t_w / v  # one (virtual) stage's share
    timing = simulate_ideal(schedule, t_f, t_b, t_w, args.tcomm, time_unit="units")
    peaks = peak_in_flight(schedule)
    if args.json:
        print_json("explain.bubble", _as_json(schedule, timing, peaks, t_f, t_b, t_w))
    else:
        print(explain_bubble(schedule, timing, peaks, t_f, t_b, t_w, picture=not args.gantt))
    if args.gantt:
        from ..report.gantt import draw_gantt

        draw_gantt(timing.to_trace(), args.gantt, _title(schedule, timing))
        if not args.json:
            print(f"wrote {args.gantt}", file=sys.stderr)
    return 0


def explain_bubble(schedule: Schedule, timing: IdealTiming, peaks: list[int], t_f: float, t_b: float, t_w: float,
                   picture: bool = True) -> str:
    """The bubble of ``schedule`` walked through: order, closed form, simulation, memory, picture."""
    kind = SCHEDULES[schedule.name]
    p, m, v = schedule.pp, schedule.num_microbatches, schedule.virtual_stages
    torch_class = kind.torch_class or "no class; parsim runs its action lists"
    out = [f"Pipeline bubble of {kind.name}: p = {p} ranks, m = {m} microbatches, "
           f"v = {v} stage{'s' if v > 1 else ''} per rank", f"({kind.source}; PyTorch: {torch_class})", ""]

    out.append(f"1. The schedule: {kind.summary}")
    kinds = sorted({a.kind for acts in schedule.actions for a in acts}, key="FBIW".index)
    legend = ", ".join(f"{k} = {KIND_NAMES[k]}" for k in kinds)
    if v > 1:
        out.append(f"   Each rank's passes in order; 4F3 = stage 4, forward, microbatch 3 ({legend}).")
        where = ("stage s lives on rank s mod p" if schedule.placement == "loop"
                 else "stages run down the ranks and back up, a V")
        out.append(f"   Rank 0 runs stages {' and '.join(map(str, schedule.stages_of(0)))}: {where}.")
    else:
        out.append(f"   Each rank's passes in order; F3 = forward of microbatch 3 ({legend}).")
    out += ["   " + line for line in schedule.format().splitlines()]
    back = "I" if schedule.split_backward else "B"
    out.append(f"   A pass waits for its rank and its inputs: F on stage s needs F on stage s-1; {back} on "
               f"stage s needs {back} on stage s+1" + ("; W needs the I before it." if back == "I" else "."))
    out.append("")

    out.append("2. The closed form (equal stages, free communication)")
    out.append(_times_line(schedule, t_f, t_b, t_w))
    form = closed_form(schedule, t_f, t_b, t_w)
    busy = v * m * (t_f + t_b)
    if form is None:
        out.append(_no_closed_form(schedule, t_f, t_b, t_w))
    else:
        out.append(f"   bubble per rank = {form.bubble_formula} = {form.bubble_substituted}")
        out.append(f"   busy per rank   = {'v*' if v > 1 else ''}m(t_f + t_b) = "
                   f"{f'{v}*' if v > 1 else ''}{m}({t_f:g} + {t_b:g}) = {busy:g}")
        out.append(f"   step time       = busy + bubble = {busy:g} + {form.bubble_time:g} = {form.step_time:g}")
        out.append(f"   bubble fraction = {form.fraction_formula} = {form.fraction_substituted}")
        out.append(f"   Why: {form.note}.")
    out.append("")

    out.append(f"3. Simulated pass by pass (each pass starts when its rank is free and its inputs have "
               f"arrived; t_comm = {timing.t_comm:g})")
    rows = [[r, " ".join(map(str, schedule.stages_of(r))), round(timing.busy[r], 6), round(timing.idle[r], 6),
             f"{timing.bubble_fractions[r]:.1%}", peaks[r]] for r in range(p)]
    out += ["   " + line for line in render_table(
        ["rank", "stages", "busy", "idle", "bubble", "peak in flight"], rows).splitlines()]
    out.append(f"   step time {timing.step_time:g} units; bubble {timing.bubble_fraction:.1%} of all rank-time"
               + _agreement(form, timing))
    out.append("")

    out.append("4. Activation memory: microbatches in flight")
    out.append(f"   A microbatch is in flight on a stage from its F until its {back} ends: its activations "
               "stay in memory that long.")
    out.append(f"   Peak per rank: {peaks}" + _memory_comparison(schedule, peaks))
    if schedule.split_backward:
        waiting = [max(sum(m[len(m) // 2:]) for m in moments) for moments in in_flight_by_stage(schedule)]
        out.append("   A microbatch whose W is deferred still keeps its linears' inputs and output gradients, nearly")
        out.append(f"   all of what its B needed (Qi et al. 2023, table 1): at most {waiting} such per rank, not")
        out.append("   counted above (parsim explain memory weighs both).")
    if picture:
        from ..report.gantt import ascii_gantt

        chart = ascii_gantt(timing.to_trace())
        out.append("")
        if chart is None:
            out.append("5. The picture: too many time slots for a terminal; use --gantt out.png")
        else:
            out.append("5. The picture (one column per time slot; '.' idle, '-' the pass goes on)")
            out += ["   " + line for line in chart.splitlines()]
    return "\n".join(out)


def _times_line(schedule: Schedule, t_f: float, t_b: float, t_w: float) -> str:
    v = schedule.virtual_stages
    per = f"each of the v = {v} stages per rank holds 1/{v} of its layers: " if v > 1 else ""
    split = f" = t_i + t_w = {t_b - t_w:g} + {t_w:g}" if schedule.split_backward else ""
    return f"   {per}t_f = {t_f:g}, t_b = {t_b:g}{split} time units per microbatch and stage"


def _no_closed_form(schedule: Schedule, t_f: float, t_b: float, t_w: float) -> str:
    if schedule.name == "zero-bubble" and schedule.virtual_stages == 1:
        t_i = t_b - t_w
        return (f"   ZB-H1's bubble (p-1)(t_f + t_i - t_w) (Qi et al. 2023) holds when m >= p and "
                f"t_w <= min(t_f, t_i); here m = {schedule.num_microbatches}, p = {schedule.pp}, "
                f"t_w = {t_w:g}, min(t_f, t_i) = {min(t_f, t_i):g}, so the simulation below is the answer.")
    return f"   {schedule.name} has no simple closed form here; the simulation below is the answer."


def _agreement(form, timing: IdealTiming) -> str:
    if form is None:
        return "."
    if abs(form.step_time - timing.step_time) <= 1e-9 * timing.step_time:
        return ", as the closed form says."
    return (f"; the closed form says {form.bubble_fraction:.1%}: transfers on the critical path add "
            f"{timing.step_time - form.step_time:g} to the step.")


def _memory_comparison(schedule: Schedule, peaks: list[int]) -> str:
    m, v, p = schedule.num_microbatches, schedule.virtual_stages, schedule.pp
    one_f_one_b = min(p, m)
    if v == 1:
        return (f" (1F1B: pp - r = {[min(p - r, m) for r in range(p)]}; GPipe: m = {m} on every rank)."
                if schedule.name != "gpipe" else f" (1F1B would need at most {one_f_one_b}).")
    return (f" stage-microbatches, each 1/{v} of a rank's layers: the busiest rank holds "
            f"{max(peaks) / v:g} full-rank microbatches (1F1B: {one_f_one_b}).")


def _title(schedule: Schedule, timing: IdealTiming) -> str:
    v = f", v={schedule.virtual_stages}" if schedule.virtual_stages > 1 else ""
    return (f"{schedule.name}: p={schedule.pp}, m={schedule.num_microbatches}{v} - "
            f"bubble {timing.bubble_fraction:.1%}, step {timing.step_time:g} units")


def _as_json(schedule: Schedule, timing: IdealTiming, peaks: list[int], t_f: float, t_b: float, t_w: float) -> dict:
    form = closed_form(schedule, t_f, t_b, t_w)
    return {
        "schedule": schedule.name, "pp": schedule.pp, "microbatches": schedule.num_microbatches,
        "virtual_stages": schedule.virtual_stages,
        "stage_times": {"t_f": t_f, "t_b": t_b, "t_w": t_w, "t_comm": timing.t_comm},
        "closed_form": None if form is None else {
            "bubble_formula": form.bubble_formula, "bubble_time": form.bubble_time,
            "fraction_formula": form.fraction_formula, "bubble_fraction": form.bubble_fraction,
            "step_time": form.step_time},
        "simulated": {"step_time": timing.step_time, "bubble_fraction": timing.bubble_fraction},
        "ranks": [{"rank": r, "stages": schedule.stages_of(r), "busy": timing.busy[r], "idle": timing.idle[r],
                   "bubble_fraction": timing.bubble_fractions[r], "peak_in_flight": peaks[r],
                   "actions": [a.torch_str() for a in schedule.actions[r]]} for r in range(schedule.pp)],
    }
