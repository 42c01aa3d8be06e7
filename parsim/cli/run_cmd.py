"""``parsim run``: execute a plan with torch.distributed and measure it in the simulator's trace schema."""

from __future__ import annotations

import argparse
import sys

from ..report.jsondoc import print_json
from ..report.step_report import PHASES
from ..report.table import render_table
from ..units import format_time
from ..workload.plan import Plan
from .common import check_outputs, expert_load_text, progress
from .plan_cmd import add_plan_args, plan_from_args

HELP = """\
Run a parallelism plan for real: --nproc ranks on this machine (gloo on CPUs,
NCCL when there is a GPU per rank), the same rank grid, pipeline schedule,
tensor-parallel collectives and gradient sync the simulator prices, on the
plan's model with seeded weights and a seeded random batch. After --warmup
steps, --steps steps are timed; the trace of the median step is kept, and
each rank's time by phase is each phase's median over the steps.

Every event has the simulator's name (F stage=1 mb=3, all_reduce tp
layer=layer.0 mb=0 dir=fwd0, all_reduce dp bucket=2, send act stage=0 mb=1
peer=1, optimizer step), so `parsim compare` can set the two side by side.

phases per rank: forward / backward / weight-grad = compute spans less the
tensor-parallel collectives inside them; tp = those collectives; pp = waiting
on pipeline receives (transfer + bubble); dp = gradient all-reduce time not
hidden behind compute; idle = the step less everything the rank did.

examples:
  parsim run course-ddp --nproc 4
  parsim run course-tp --nproc 4 --steps 5
  parsim run course-pp --nproc 2 --trace measured.json --chrome measured-chrome.json
  parsim run tiny-pp2 --nproc 2 --schedule zero-bubble --json
  parsim run course-tp --tp 2 --nproc 2 --profile profiles/
    (then: parsim compare course-tp --tp 2 --cluster my-host.yaml --measured profiles/)
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("run", help="execute a plan with torch.distributed and measure it",
                              description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_args(p)
    p.add_argument("--nproc", type=int, help="ranks to spawn; must equal the plan's dp x tp x pp x cp (default: that)")
    p.add_argument("--steps", type=int, default=3, help="measured steps (default 3)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps first (default 2: the first steps allocate AdamW's state and grow the heap)")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                   help="auto = nccl with one GPU per rank, else gloo (default auto)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="end the run if it takes longer, naming the ranks that hang (default 300)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch (default 0)")
    p.add_argument("--trace", metavar="JSON", help="save the median step's measured trace (parsim trace schema)")
    p.add_argument("--chrome", metavar="DIR|FILE.json",
                   help="write it as Kineto traces too: a folder gets one file per rank (Perfetto, Holistic Trace "
                        "Analysis), a .json name one merged file")
    p.add_argument("--profile", metavar="DIR",
                   help="also profile the measured steps with torch.profiler: one Kineto trace per rank in DIR "
                        "(TensorBoard, Perfetto, HTA; `parsim compare PLAN --measured DIR` reads them back)")
    p.add_argument("--json", action="store_true", help="print a JSON summary for scripts")
    p.add_argument("--verbose", action="store_true", help="on failure, print the ranks' tracebacks or stacks")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_outputs(args, files=("--trace",), folders=("--profile",), traces=("--chrome",))
    plan = plan_from_args(args)
    nproc = plan.world if args.nproc is None else args.nproc

    from executor.launch import RankFailure
    from executor.train import run_plan

    try:
        trace, summary = run_plan(plan, nproc, steps=args.steps, backend=args.backend, timeout_s=args.timeout,
                                  warmup=args.warmup, seed=args.seed, progress=progress,
                                  profile_dir=args.profile)
    except RankFailure as err:
        if args.verbose and err.details:
            print(err.details, file=sys.stderr)
        elif err.details:
            err.args = (f"{err} (--verbose prints the ranks' tracebacks)",)
        raise
    if trace is None:
        return 0  # a non-zero rank of a torchrun job: rank 0 reports
    if args.trace:
        trace.save(args.trace)
        print(f"wrote {args.trace}", file=sys.stderr)
    if args.profile:
        print(f"wrote {args.profile}/rank*.pt.trace.json (torch.profiler, one per rank)", file=sys.stderr)
    if args.chrome:
        from ..kineto.write import write_trace

        print(f"wrote {write_trace(args.chrome, {'measured': trace})}", file=sys.stderr)
    if args.json:
        print_json("run", summary)
    else:
        print(report(plan, summary))
    return 0


def report(plan: Plan, s: dict) -> str:
    """Step time, throughput, loss and each rank's time by phase, for people."""
    unit = s["throughput_unit"].split("/")[0]
    lines = [  # the plan as parsim simulate names it: degrees, schedule, batch, dtype, sync, SP, recompute...
        f"{plan.name}: {plan.model.name} on {s['world_size']} ranks, {s['backend']} ({plan.summary_text()})",
        f"  step time   {format_time(s['step_s'])}  (median of {s['steps']}; min {format_time(s['step_s_min'])}, "
        f"max {format_time(s['step_s_max'])})",
        f"  throughput  {s['throughput']:,.0f} {s['throughput_unit']} ({s['tokens_per_step']:,} {unit} per step)",
        "  loss        " + " -> ".join(f"{x:.5g}" for x in s["losses"]) + f"  (steps 1..{s['steps']})",
        *([f"  {expert_load_text(s['expert_load'])}"] if s.get("expert_load") else []),
        "",
    ]
    rows = []
    dims = ("dp", "pp", "cp", "tp") if plan.cp > 1 else ("dp", "pp", "tp")
    for r in s["ranks"]:
        coords = plan.coords(r["rank"])
        rows.append([r["rank"], "/".join(str(getattr(coords, d)) for d in dims)]
                    + [round(r["seconds"][p] * 1e3, 2) for p in PHASES])
    lines.append(render_table(["rank", "/".join(dims)] + list(PHASES), rows,
                              title=f"time by phase per rank, ms (each phase's median over {s['steps']} steps; the "
                                    f"median step {format_time(s['step_s'])})"))
    return "\n".join(lines)
