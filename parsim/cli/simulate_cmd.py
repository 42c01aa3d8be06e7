"""``parsim simulate``: predict one training step of a plan."""

from __future__ import annotations

import argparse
import sys

from ..report.jsondoc import print_json
from ..report.step_report import PHASES, comm_overlap
from ..report.table import render_table
from ..sim.collectives.deepep import DEEPEP_SMS
from ..sim.jitter import RankEnds
from ..sim.step import StepPrediction, predict_step
from ..units import format_time
from .common import (PLAN_CLUSTER_HELP, OpsProgress, check_outputs, memory_table, note_launch_bound,
                     note_stages_sharing_cores, note_unmeasured_matmuls, plan_cluster)
from .plan_cmd import add_plan_args, plan_from_args

DEFAULT_PLAN = "llama3-70b-1024"

HELP = """\
Predict one training step of a parallelism plan on a simulated cluster.

The plan is lowered to per-rank programs (forward/backward compute per block,
tensor-parallel collectives, pipeline sends, data-parallel gradient
all-reduces, optimizer); compute is timed by a roofline (FLOPs vs peak, bytes
vs HBM bandwidth) and communication on the same flow-level network as
`parsim collective`, on separate streams, so overlap and contention are
simulated. One representative rank per pipeline stage is simulated; its
collectives carry the traffic of every replica it stands for. On a CPU host
running more ranks than it has cores, every rank is simulated, the ranks on
one core taking turns as the kernel's scheduler runs them.

phases per rank: forward / backward / weight-grad = compute; recompute =
forwards rerun for the backward; tp = tensor-parallel collectives; ep = expert
all-to-alls; cp = context-parallel K/V exchanges not hidden behind attention;
pp = waiting on pipeline receives (bubble + transfer); dp = gradient
reductions not hidden behind compute; fsdp = FSDP gathers and reductions not
hidden; idle = the rest. Memory per GPU is explained by `parsim explain memory`;
every plan key and its cost: docs/plans.md.

examples:
  parsim simulate llama3-70b-1024 --cluster dgx-h100        (the default plan)
  parsim simulate llama3-70b-1024 --schedule interleaved-1f1b --virtual-stages 2 --activation-recompute full
  parsim simulate llama3-405b-16k --activation-recompute full --zero 3
  parsim simulate mixtral-8x22b --expert-load 1.5
  parsim simulate my-plan.yaml --cluster dgx-b200 --trace step.json --gantt step.png
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("simulate", help="predict a training step: time, bubbles, MFU, memory",
                              description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_args(p)
    p.add_argument("--cluster", metavar="NAME|FILE", help=PLAN_CLUSTER_HELP)
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.add_argument("--trace", metavar="DIR|FILE.json",
                   help="write the step's trace: a folder gets one Kineto file per rank (Perfetto, Holistic Trace "
                        "Analysis), a .json name one merged file (ui.perfetto.dev)")
    p.add_argument("--gantt", metavar="PNG", help="draw the pipeline schedule with its bubbles")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_outputs(args, pictures=("--gantt",), traces=("--trace",))
    if args.plan is None and args.model is None:
        args.plan = DEFAULT_PLAN
    plan = plan_from_args(args)
    cluster = plan_cluster(args.cluster, plan)
    progress = OpsProgress(f"simulating {plan.name}")
    try:
        prediction = predict_step(plan, cluster, progress)
    finally:
        progress.close()
    note_unmeasured_matmuls("simulate", cluster, plan.dtype)
    note_launch_bound("simulate", plan, cluster, prediction.step_s)
    if prediction.takes_turns:
        note_stages_sharing_cores("simulate", plan, cluster)
    if args.json:
        print_json("simulate", to_json(prediction))
    else:
        print(report(prediction))
    if args.trace:
        from ..kineto.write import write_trace

        print(f"wrote {write_trace(args.trace, {'predicted': prediction.trace})}", file=sys.stderr)
    if args.gantt:
        from ..report.gantt import draw_gantt

        draw_gantt(prediction.trace, args.gantt, title=f"{plan.name} on {prediction.cluster.name} (simulated)")
        print(f"wrote {args.gantt}", file=sys.stderr)
    return 0


def report(r: StepPrediction) -> str:
    plan, gb = r.plan, 1e9
    capacity = r.cluster.gpu.hbm_capacity_bytes
    unit = plan.model.throughput_unit
    lines = [
        f"{plan.name}: {plan.model.name} on {plan.world:,} GPU{'' if plan.world == 1 else 's'} of {r.cluster.name} "
        f"({plan.summary_text()})",
        f"  step time   {format_time(r.step_s)}",
        f"  throughput  {r.tokens_per_s:,.0f} {unit}s/s ({plan.tokens_per_step:,} {unit}s per step)",
        f"  MFU         {r.mfu:.1%}  (model FLOPs {r.model_flops:.3g} per step / (step x {plan.world} GPUs x "
        f"{r.cluster.gpu.peak_flops[plan.dtype] / 1e12:g} TFLOP/s))",
    ]
    if r.hardware_flops != r.model_flops:
        lines.append(f"  HFU         {r.hfu:.1%}  (with the recomputed forwards: {r.hardware_flops:.3g} FLOPs "
                     f"per step)")
    if getattr(plan.model, "mtp_layers", 0):
        mtp = plan.model.mtp_flops_per_token()
        lines.append(f"              (model FLOPs include the multi-token prediction module's, {mtp / 1e9:.2f} of "
                     f"{plan.model.model_flops_per_token() / 1e9:.2f} GFLOP a token: the step computes them)")
    if plan.capacity_factor is not None and plan.capacity_factor < 1:
        lines.append(f"              (model FLOPs count every routed token, as Megatron-LM's formula does; at "
                     f"capacity_factor {plan.capacity_factor:g} the experts drop at least "
                     f"{1 - plan.capacity_factor:.0%} of the routed rows, which no GPU computes)")
    lines.append("")
    rows = []
    overlap = comm_overlap(r.trace)
    for b in r.ranks:
        hidden = overlap.get(b.rank)
        rows.append([f"pp {plan.coords(b.rank).pp} (rank {b.rank})"] + [f"{b.fraction(p):.1%}" for p in PHASES]
                    + ["-" if hidden is None else f"{hidden:.0%}"])
    whose = ("per rank (more ranks than the host's cores: each simulated in its own right, taking turns on its "
             "core)" if r.takes_turns else "per pipeline stage (each stands for its dp x tp replicas)")
    lines.append(render_table(["stage"] + list(PHASES) + ["comm overlap"], rows,
                              title=f"time by phase, {whose}; "
                                    "comm overlap: communication time with compute running beside it (as HTA)"))
    if plan.pp > 1:
        bubble = sum(b.fraction("pp") + b.fraction("idle") for b in r.ranks) / len(r.ranks)
        v = f" --virtual-stages {plan.virtual_stages}" if plan.virtual_stages > 1 else ""
        lines.append(f"pipeline bubble: {bubble:.1%} of the step on the average stage (its pp wait and idle); "
                     f"with equal stages and free transfers: parsim explain bubble --pp {plan.pp} --microbatches "
                     f"{plan.num_microbatches} --schedule {plan.schedule}{v}")
    held = r.held_sms_s
    if held and max(held.values()) >= 1e-3 * r.step_s:  # (a share of the step the table's rounding would hide)
        rank = max(held, key=held.get)
        lines.append(f"SMs held by communication kernels (data-parallel, FSDP and paired expert all-to-alls: NCCL's "
                     f"one per channel, DeepEP's {DEEPEP_SMS}) slowed the compute beside them by "
                     f"{format_time(held[rank])} on rank {rank} ({held[rank] / r.step_s:.1%} of the step; "
                     f"docs/engine.md)")
    if r.end_wait_s >= 1e-3 * r.step_s:  # (less is below the table's rounding, or the integral's own error)
        jitter = r.cluster.rank_jitter
        rank, since, together = RankEnds.of(r.trace).last(jitter)
        lines.append(f"the ranks' jitter: each rank's end varies by {jitter:.1%} (as calibrated) of its time since "
                     f"it last met the others; rank {rank}, the last to end, met them {format_time(since)} before, "
                     f"so sigma = {format_time(jitter * since)}. The latest of the {together} ends that may come "
                     f"last is {format_time(r.end_wait_s)} later on average (two alike: sigma / sqrt(pi)), counted "
                     f"in the step and in every rank's idle (parsim/sim/jitter.py)")
    lines.append("")
    lines.append(memory_table(r.memory, capacity, "peak memory per GPU"))
    if r.over_memory:
        worst = max(r.over_memory, key=lambda m: m.total)
        lines.append(f"does not fit: pipeline stage {worst.pp_rank} needs {worst.total / gb:.1f} GB of "
                     f"{capacity / gb:g} GB (try ZeRO, activation recompute, more tensor/pipeline parallelism "
                     f"or fewer microbatches in flight)")
    return "\n".join(lines)


def to_json(r: StepPrediction) -> dict:
    overlap, held = comm_overlap(r.trace), r.held_sms_s
    return {
        "plan": r.plan.name, "cluster": r.cluster.name, "world_size": r.plan.world,
        "step_s": r.step_s, "end_wait_s": r.end_wait_s, "tokens_per_s": r.tokens_per_s, "mfu": r.mfu, "hfu": r.hfu,
        "ranks": [{"rank": b.rank, "seconds": b.seconds, "comm_overlap": overlap.get(b.rank),
                   "held_sms_s": held.get(b.rank, 0.0)} for b in r.ranks],
        "memory": [vars(m) | {"total": m.total} for m in r.memory],
        "fits": not r.over_memory,
    }
