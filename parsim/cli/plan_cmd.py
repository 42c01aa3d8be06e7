"""``parsim plan``: show what a parallelism plan puts where.

:func:`add_plan_args` and :func:`plan_from_args` give other subcommands the same
way to name a plan: an example name or YAML file, with flags overriding its
values (or a plan made of flags alone, from ``--model``).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ..errors import ParsimError
from ..report.jsondoc import print_json
from ..report.table import render_table
from ..units import format_size
from ..workload.model import RECOMPUTE_MODULES, builtin_models, load_model
from ..workload.plan import (ADAM_MOMENTS, ADAMW_IMPLEMENTATIONS, CP_STYLES, DIMS, DISPATCHERS, DTYPE_BYTES,
                             GRAD_ACCUMULATIONS, GRAD_SYNCS, RECOMPUTE, REDUCE_DTYPES, SCHEDULES, TP_STYLES,
                             ZERO_STAGES, Plan, builtin_plans, load_plan, resolve_plan, runs_text)
from .common import add_cluster_args, note

HELP = """\
Show a parallelism plan: the model and its size, the degrees and the batch,
which layers each pipeline stage holds, the rank grid (tp innermost, so a
tensor-parallel group is consecutive ranks) and the process groups. With
--cluster, also the slowest link each group's ring crosses.

examples:
  parsim plan list
  parsim plan show course-tp
  parsim plan show llama3-70b-1024 --cluster dgx-h100
  parsim plan show llama3-70b-1024 --tp 4 --pp 16 --gpus 1024
  parsim plan show --model llama3-8b --dp 8 --dtype bf16 --json
"""

GRID_LIMIT = 64  # print the whole rank grid up to this many ranks
GROUPS_SHOWN = 3
# Path kinds from fastest to slowest; kinds a cluster names otherwise sort after these.
LINK_ORDER = ("self", "nvlink", "pcie", "leaf", "spine")


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="show a parallelism plan: stages, rank grid, groups",
                              description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    show = actions.add_parser("show", help="summarise a plan", description=HELP,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_args(show)
    add_cluster_args(show, default=None)
    show.add_argument("--json", action="store_true", help="print JSON for scripts")
    show.set_defaults(func=run_show)
    listing = actions.add_parser("list", help="list the model presets and example plans")
    listing.add_argument("--json", action="store_true", help="print JSON for scripts")
    listing.set_defaults(func=run_list)
    p.set_defaults(func=lambda args: p.print_help() or 0)


def add_plan_args(parser: argparse.ArgumentParser, positional: bool = True) -> None:
    """A PLAN argument (unless the command names its own) and flags that override its values."""
    if positional:
        parser.add_argument("plan", nargs="?", metavar="PLAN",
                            help=f"example plan ({', '.join(sorted(builtin_plans()))}) or a plan YAML file")
    g = parser.add_argument_group("plan overrides")
    g.add_argument("--model", help=f"model preset ({', '.join(sorted(builtin_models()))}) or a model YAML file")
    for dim in DIMS:
        g.add_argument(f"--{dim}", type=int, help=f"{dim} degree")
    g.add_argument("--ep", type=int, help="expert-parallel degree (MoE models; folds into dp x cp)")
    g.add_argument("--order", metavar="DIMS", help="rank placement, outermost first (default dp,pp,cp,tp)")
    g.add_argument("--microbatch-size", type=int, help="samples per microbatch")
    g.add_argument("--num-microbatches", type=int, help="microbatches per step per data-parallel replica")
    g.add_argument("--global-batch-size", type=int, help="samples per step, all replicas together")
    g.add_argument("--schedule", choices=SCHEDULES, help="pipeline schedule")
    g.add_argument("--virtual-stages", type=int,
                   help="stages per pipeline rank (default: the schedule's own, 2 for interleaved-1f1b and the Vs)")
    g.add_argument("--layers-per-stage", type=_stage_split, metavar="N,N,...|balanced",
                   help="layers of each pipeline stage, e.g. 7,8,8,7; 'balanced' evens out stage time "
                        "(default: even when the stages divide the layers, else balanced)")
    g.add_argument("--dtype", choices=tuple(DTYPE_BYTES), help="compute and activation precision")
    g.add_argument("--tensor-parallel", choices=TP_STYLES, help="tensor-parallel style")
    g.add_argument("--context-parallel", choices=CP_STYLES, help="how cp ranks exchange K/V (default ring)")
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction,
                   help="Megatron sequence parallelism: norms and block inputs split along the sequence")
    g.add_argument("--tp-comm-overlap", action=argparse.BooleanOptionalAction,
                   help="hide the sequence-parallel all-gathers and reduce-scatters behind the GEMMs they feed "
                        "and drain (Megatron-LM's --tp-comm-overlap; needs --sequence-parallel)")
    g.add_argument("--tp-async-backward", action=argparse.BooleanOptionalAction,
                   help="run a column-parallel linear's backward collectives beside its GEMMs, as Megatron-LM "
                        "has since 2021-09 (default on for megatron tensor parallelism; --no-tp-async-backward: "
                        "in line, as in the SC21 runs)")
    g.add_argument("--activation-recompute", choices=RECOMPUTE,
                   help="rerun forwards in the backward to save activations (full: all but each layer's input)")
    g.add_argument("--recompute-layers", type=int, metavar="N",
                   help="with full recompute: only the first N layers of each stage")
    g.add_argument("--recompute-modules", metavar="LIST",
                   help="with selective recompute: what it reruns, Megatron-LM's names, comma-separated "
                        f"({', '.join(RECOMPUTE_MODULES)}; default core_attn), e.g. layernorm,mla_up_proj,moe_act "
                        "as DeepSeek-V3")
    g.add_argument("--grad-sync", choices=GRAD_SYNCS, help="data-parallel gradient synchronization")
    g.add_argument("--bucket-size", help="DDP bucket size, e.g. 25MiB")
    g.add_argument("--overlap", action=argparse.BooleanOptionalAction,
                   help="overlap bucketed gradient all-reduces with the backward")
    g.add_argument("--overlap-param-gather", action=argparse.BooleanOptionalAction,
                   help="ZeRO-1/2: all-gather the updated weights during the next step's forward, each layer "
                        "waiting for its bucket (Megatron-LM's --overlap-param-gather), not after the optimizer")
    g.add_argument("--reduce-dtype", choices=REDUCE_DTYPES,
                   help="the dtype data parallelism reduces gradients in (default fp32 with bf16 or fp8 weights, as "
                        "Megatron-LM and torchtitan do; else the weights' dtype)")
    g.add_argument("--grad-accumulation", choices=GRAD_ACCUMULATIONS,
                   help="how microbatches' weight gradients are summed: autograd adds each into .grad in a pass of "
                        "its own; fused has the weight-gradient matmul accumulate (Megatron-LM's "
                        "gradient_accumulation_fusion)")
    g.add_argument("--adamw", choices=ADAMW_IMPLEMENTATIONS,
                   help="AdamW's implementation: foreach (torch's default, several passes per tensor) or fused "
                        "(one pass: torch's fused=True, Apex's and Transformer Engine's FusedAdam)")
    g.add_argument("--adam-moments", choices=tuple(ADAM_MOMENTS),
                   help="the dtype of AdamW's two moments: fp32 (default) or bf16 as DeepSeek-V3 keeps them "
                        "(Megatron-LM's precision-aware optimizer; needs --adamw fused)")
    g.add_argument("--grad-clip", type=float, metavar="NORM",
                   help="scale the gradients down to this global L2 norm before the optimizer step "
                        "(torch's clip_grad_norm_, Megatron-LM's --clip-grad; default: no clipping)")
    g.add_argument("--zero", type=int, choices=ZERO_STAGES,
                   help="ZeRO stage: 1 shards optimizer state, 2 and gradients, 3 and weights (as --grad-sync fsdp)")
    g.add_argument("--shard-group", type=int, metavar="N", help="HSDP: shard within groups of N data-parallel ranks")
    g.add_argument("--expert-load", type=float, metavar="X",
                   help="MoE: the busiest expert's tokens over the mean (default 1: balanced); its rank's other "
                        "experts are taken at the mean")
    g.add_argument("--capacity-factor", type=float, metavar="X",
                   help="MoE: tokens beyond X times an expert's mean load are dropped")
    g.add_argument("--ep-comm-overlap", action=argparse.BooleanOptionalAction,
                   help="MoE: run a forward and another microbatch's backward together, the all-to-alls of one "
                        "beside the compute of the other (DualPipe-V's pairs; with pp 1 or interleaved-1f1b "
                        "Megatron-LM's --overlap-moe-expert-parallel-comm)")
    g.add_argument("--dispatch-fp8", action=argparse.BooleanOptionalAction,
                   help="MoE, dtype fp8: send tokens to their experts (and gradients to the experts' "
                        "down-projections) in fp8, as DeepSeek-V3 does")
    g.add_argument("--dispatcher", choices=DISPATCHERS,
                   help="MoE: how tokens reach their experts: alltoall sends a copy to each expert (Megatron-LM's "
                        "default); deepep sends one per node across the network and forwards it over NVLink "
                        "(DeepEP, as DeepSeek-V3 trained)")
    parser.set_defaults(plan_overrides=tuple(action.dest for action in g._group_actions))


def plan_from_args(args: argparse.Namespace, gpus: int | None = None) -> Plan:
    """The plan named by ``args.plan`` (or ``--model`` alone), flags overriding its values."""
    flags = {
        "model": args.model,
        "parallel": {d: getattr(args, d) for d in (*DIMS, "ep", "order")},
        "batch": {k: getattr(args, k) for k in ("microbatch_size", "num_microbatches", "global_batch_size")},
        "schedule": args.schedule, "virtual_stages": args.virtual_stages,
        "layers_per_stage": args.layers_per_stage, "dtype": args.dtype,
        "tensor_parallel": args.tensor_parallel, "sequence_parallel": args.sequence_parallel,
        "tp_comm_overlap": args.tp_comm_overlap, "tp_async_backward": args.tp_async_backward,
        "context_parallel": args.context_parallel,
        "activation_recompute": _recompute_flags(args), "grad_accumulation": args.grad_accumulation,
        "adamw": args.adamw, "adam_moments": args.adam_moments, "grad_clip": args.grad_clip,
        "data_parallel": {"grad_sync": args.grad_sync, "bucket_size": args.bucket_size, "overlap": args.overlap,
                          "zero": args.zero, "shard_group": args.shard_group,
                          "overlap_param_gather": args.overlap_param_gather, "reduce_dtype": args.reduce_dtype},
        "moe": {"expert_load": args.expert_load, "capacity_factor": args.capacity_factor,
                "ep_comm_overlap": args.ep_comm_overlap, "dispatch_fp8": args.dispatch_fp8,
                "dispatcher": args.dispatcher},
    }
    overrides = _drop_unset(flags)
    if args.plan:
        plan = resolve_plan(args.plan, gpus=gpus, overrides=overrides)
        if "dp" in overrides.get("parallel", {}) and "batch" not in overrides:
            written = resolve_plan(args.plan).global_batch_size
            if plan.global_batch_size != written:
                per_replica, left = divmod(written, plan.dp * plan.microbatch_size)
                keep = f"; --num-microbatches {per_replica} keeps it" if per_replica and not left else ""
                note(f"parsim: dp {plan.dp} runs {plan.num_microbatches} microbatch(es) of {plan.microbatch_size} "
                     f"a replica, as written: the global batch is now {plan.global_batch_size:,} samples (written: "
                     f"{written:,}){keep}")
        if overrides and plan.description:  # it describes the plan as written, no longer this one
            plan = dataclasses.replace(plan, description=f"changed on the command line (as written: "
                                                         f"{plan.description})")
        return plan
    if args.model is None:
        raise ParsimError("give a plan (an example name or a YAML file) or --model to build one from flags")
    plan = load_plan({"name": "command-line"}, gpus=gpus, overrides=overrides)
    if plan.pp > 1 and "batch" not in overrides:
        note(f"parsim: no batch given: {plan.num_microbatches} microbatches of {plan.microbatch_size} sample(s) a "
             f"step, the fewest that fill {plan.schedule}'s pipeline on pp {plan.pp}; more shrink the bubble "
             f"(--num-microbatches, --global-batch-size)")
    return plan


def _recompute_flags(args: argparse.Namespace) -> str | dict | None:
    if args.recompute_modules is not None:
        return {"granularity": args.activation_recompute or "selective",
                "modules": [m.strip() for m in args.recompute_modules.split(",")]}
    if args.recompute_layers is None:
        return args.activation_recompute
    return {"granularity": args.activation_recompute or "full", "layers": args.recompute_layers}


def _stage_split(text: str) -> str | list[int]:
    if text == "balanced":
        return text
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not 'balanced' or layer counts such as 7,8,8,7") from None


def _drop_unset(flags: dict[str, Any]) -> dict[str, Any]:
    kept = {}
    for key, value in flags.items():
        if isinstance(value, dict):
            value = _drop_unset(value)
        if value is not None and value != {}:
            kept[key] = value
    return kept


def run_list(args: argparse.Namespace) -> int:
    models = [load_model(path) for _, path in sorted(builtin_models().items())]
    plans = [resolve_plan(name) for name in sorted(builtin_plans())]
    if args.json:
        print_json("plan.list", {
            "models": [{"name": m.name, "kind": m.kind, "params": m.num_params, "description": m.description}
                       for m in models],
            "plans": [{"name": p.name, "model": p.model.name, "gpus": p.world, "description": p.description}
                      for p in plans]})
        return 0
    rows = [[m.name, m.kind, f"{m.num_params:,}", m.description] for m in models]
    print(render_table(["model", "kind", "params", "description"], rows, title="Model presets"))
    print()
    rows = [[p.name, p.model.name, p.world, p.description] for p in plans]
    print(render_table(["plan", "model", "GPUs", "description"], rows, title="Example plans"))
    return 0


def run_show(args: argparse.Namespace) -> int:
    if args.nodes is not None and args.cluster is None:
        raise ParsimError("--nodes needs --cluster (to know the GPUs per node); or give --gpus")
    spec = topology = None
    gpus = args.gpus
    if args.cluster is not None:
        from ..hardware.cluster import load_cluster

        spec = load_cluster(args.cluster)
        if args.nodes is not None:
            gpus = spec.nodes_for(nodes=args.nodes) * spec.gpus_per_node
    plan = plan_from_args(args, gpus)
    if spec is not None:
        topology = spec.build(spec.nodes_for(gpus=plan.world))
    links = {dim: group_links(plan, dim, topology.path_kind) for dim in DIMS} if topology else None
    if args.json:
        print_json("plan.show", plan_json(plan, links))
    else:
        print(plan_text(plan, links, topology))
    return 0


# --------------------------------------------------------------------------- links
def group_links(plan: Plan, dim: str, path_kind) -> dict[str, int]:
    """How many ``dim`` groups have each kind of link as their slowest hop.

    The hops are those of a ring over the group in rank order (tensor and data
    parallel collectives), or of the chain of stages (pipeline sends).
    """
    counts: dict[str, int] = {}
    for group in plan.groups(dim):
        pairs = list(zip(group, group[1:]))
        if dim != "pp" and len(group) > 2:
            pairs.append((group[-1], group[0]))
        kinds = [path_kind(a, b) for a, b in pairs] or ["self"]
        slowest = max(kinds, key=_link_rank)
        counts[slowest] = counts.get(slowest, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: _link_rank(item[0])))


def _link_rank(kind: str) -> tuple[int, str]:
    return (LINK_ORDER.index(kind) if kind in LINK_ORDER else len(LINK_ORDER), kind)


# --------------------------------------------------------------------------- text
def plan_text(plan: Plan, links: dict[str, dict[str, int]] | None = None, topology=None) -> str:
    m = plan.model
    out = [f"plan {plan.name}" + (f": {plan.description}" if plan.description else ""), ""]
    sync = _sync_text(plan)
    split = plan.stage_split
    stages = (f"{plan.num_stages} stages of {split[0]} layers" if len(set(split)) == 1 else
              f"{plan.num_stages} stages of {min(split)}-{max(split)} layers ({runs_text(split)})")
    if plan.virtual_stages > 1:
        stages += f", {plan.virtual_stages} per pipeline rank"
    microbatches = f"{plan.num_microbatches} microbatch" + ("es" if plan.num_microbatches > 1 else "")
    batch = (f"{plan.global_batch_size} rows per step" if m.kind == "mlp"
             else f"{plan.global_batch_size} sequences per step ({plan.tokens_per_step:,} tokens)")
    summary = [
        ("model", m.describe()),
        ("parameters", f"{m.num_params:,} ({_count(m.num_params)})"),
        ("parallel", f"{plan.degrees_text()} = {plan.world} ranks, "
                     f"order {plan.order} ({plan.order.split(',')[-1]} innermost)"),
        ("batch", f"{batch} = dp {plan.dp} x microbatch size {plan.microbatch_size} x {microbatches}"),
        ("pipeline", f"{plan.schedule}, {stages}" if plan.pp > 1 else "none (one stage)"),
        ("precision", f"{plan.dtype} ({plan.dtype_bytes} bytes)"
                      + (", matmuls in fp8" if plan.dtype == "fp8" else "")),
        *([("kernels", f"attention {m.attention_kernel}, layers {m.layer_kernels}, loss {m.cross_entropy}")]
          if m.kind == "transformer" else []),
        ("tensor parallel", (plan.tp_style + (" with sequence parallelism" if plan.sequence_parallel else "")
                             + (", communication overlapped with GEMMs" if plan.tp_comm_overlap else
                                ", backward collectives beside the GEMMs" if plan.tp_async_backward else ""))
                            if plan.tp > 1 else "none"),
        ("context parallel", (f"{plan.cp} ranks per sequence, " + (
            "K/V passed around a ring, overlapped with attention" if plan.context_parallel == "ring"
            else "K/V all-gathered before attention")) if plan.cp > 1 else "none"),
        ("experts", _experts_text(plan)),
        ("gradient sync", sync if plan.dp > 1 else "none (one replica)"),
        ("recompute", {"none": "none", "selective": f"selective ({', '.join(plan.recompute_modules or ())})",
                       "full": "full" + (f", first {plan.recompute_layers} layers of each stage"
                                         if plan.recompute_layers else ", every layer")}[plan.activation_recompute]),
        ("optimizer", _optimizer_text(plan)),
        ("model FLOPs/step", f"{m.model_flops_per_token() * plan.tokens_per_step:.4g}"),
    ]
    width = max(len(k) for k, _ in summary)
    out += [f"{k.ljust(width)}  {v}" for k, v in summary]
    out += ["", stage_table(plan), "", grid_text(plan, topology), "", groups_text(plan, links)]
    return "\n".join(out)


def _optimizer_text(plan: Plan) -> str:
    """AdamW's implementation and what runs before it: fp16's loss scaling, the clip."""
    out = [f"AdamW {plan.adamw}" + (" on fp32 master weights" if plan.master_weights else "")
           + (f", {plan.adam_moments} moments" if plan.adam_moments != "fp32" else "")]
    if plan.scales_loss:
        out.append("fp16 loss scaling (gradients unscaled and checked for overflow)")
    if plan.grad_clip is not None:
        out.append(f"gradients clipped to global norm {plan.grad_clip:g}")
    return ", ".join(out)


def _experts_text(plan: Plan) -> str:
    m = plan.model
    if not m.is_moe:
        return "none (dense)"
    load = "balanced routing" if plan.expert_tokens_factor == 1 else \
        f"busiest expert {plan.expert_tokens_factor:g}x the mean load"
    all_to_alls = ((", tokens and their gradients into the experts in fp8" if plan.dispatch_fp8 else "")
                   + (", each beside the compute of the pass paired with its own (ep_comm_overlap)"
                      if plan.ep_comm_overlap else ""))
    routed = f" on at most {m.max_routed_nodes} nodes" if m.max_routed_nodes else ""
    dispatch = ("DeepEP (a copy per node across the network, then NVLink to the experts' GPUs)"
                if plan.dispatcher == "deepep" else "all-to-all")
    return (f"{m.num_experts} per MoE layer over ep {plan.ep} ranks ({m.num_experts // plan.ep} per GPU), "
            f"top-{m.experts_per_token}{routed}, {dispatch} dispatch and combine{all_to_alls}; {load}")


def _sync_text(plan: Plan) -> str:
    if plan.grad_sync == "per_param":
        return "one all-reduce per parameter after the backward"
    if plan.zero == 3:
        shards = f"shards over {plan.shard_size} ranks" + (
            f", replicated {plan.replicas}x (HSDP)" if plan.replicas > 1 else "")
        if plan.pp > 1:
            again = ", again after each forward that resharded them" if plan.reshard_after_forward else ""
            return (f"FSDP (ZeRO-3), {shards}: each layer's weights all-gathered in its stage's first forward"
                    f"{again}, its gradients reduce-scattered after the stage's last backward")
        again = "again before its backward, " if plan.reshard_after_forward else ""
        return (f"FSDP (ZeRO-3), {shards}: each layer's weights all-gathered before its forward, {again}"
                f"its gradients reduce-scattered after")
    when = "overlapped with" if plan.overlap else "after"
    if plan.zero:
        shards = f"{plan.shard_size} ranks" + (f" (HSDP, replicated {plan.replicas}x)" if plan.replicas > 1 else "")
        sharded = "optimizer state" if plan.zero == 1 else "optimizer state and gradients"
        gathered = ("during the next step's forward, each layer waiting for its bucket"
                    if plan.overlap_param_gather else "after the optimizer")
        return (f"ZeRO-{plan.zero}: {sharded} sharded over {shards}; {format_size(plan.bucket_size)} buckets "
                f"reduce-scattered {when} the backward, weights all-gathered {gathered}")
    return f"bucketed all-reduce, {format_size(plan.bucket_size)} buckets, {when} the backward"


def stage_table(plan: Plan) -> str:
    rows = []
    for r in range(plan.pp):
        stages = plan.stages_of(r)
        layers = ", ".join(span for s in stages if (span := _span(plan.stage_layers(s)))) or "no layers"
        extra = [c.name for s in stages for c in plan.stage_costs(s) if not c.name.startswith("layer.")]
        if extra:
            layers += " + " + " + ".join(extra)
        params = plan.params_per_rank(r)
        rows.append([r, ", ".join(map(str, stages)), layers, f"{params:,} ({_count(params)})"])
    return render_table(["pp rank", "stages", "layers", "params per GPU"], rows,
                        title=f"Pipeline stages (each GPU holds 1/{plan.tp} of its stages' tensor-parallel weights)"
                        if plan.tp > 1 else "Pipeline stages")


def grid_text(plan: Plan, topology=None) -> str:
    strides = {d: int(s) // plan.rank_grid.itemsize for d, s in zip(DIMS, plan.rank_grid.strides)}
    formula = " + ".join(f"{strides[d]}*{d}" if strides[d] != 1 else d
                         for d in plan.order.split(",") if plan.degree(d) > 1) or "0"
    title = f"Rank grid: {plan.degrees_text()}, rank = {formula}"
    if plan.world > GRID_LIMIT:
        return f"{title} ({plan.world} ranks; the grid is printed up to {GRID_LIMIT})"
    rows = []
    for d in range(plan.dp):
        for p in range(plan.pp):
            for c in range(plan.cp):
                ranks = plan.rank_grid[d, p, c].tolist()
                if topology is not None:
                    ranks = [f"{r} (node {int(topology.node_of(r))})" for r in ranks]
                rows.append([d, p, *([c] if plan.cp > 1 else []), *ranks])
    headers = ["dp", "pp", *(["cp"] if plan.cp > 1 else []), *(f"tp {t}" for t in range(plan.tp))]
    return render_table(headers, rows, title=title)


def groups_text(plan: Plan, links: dict[str, dict[str, int]] | None) -> str:
    rows = []
    for dim in reversed(DIMS):  # innermost first
        if dim == "cp" and plan.cp == 1:
            continue
        groups = plan.groups(dim)
        shown = ", ".join(_format_group(g) for g in groups[:GROUPS_SHOWN])
        if len(groups) > GROUPS_SHOWN:
            shown += f", ... {_format_group(groups[-1])}"
        row = [dim, plan.degree(dim), len(groups), shown]
        if links is not None:
            row.insert(3, ", ".join(f"{kind} ({n})" if len(links[dim]) > 1 else kind
                                    for kind, n in links[dim].items()))
        rows.append(row)
    headers = ["group", "size", "count", "ranks"]
    if links is not None:
        headers.insert(3, "slowest link")
    return render_table(headers, rows, title="Process groups")


def _format_group(group: list[int]) -> str:
    """``[0..7]``, ``[0..56 step 8]``, or the members when few or irregular."""
    if len(group) <= 4:
        return "[" + " ".join(map(str, group)) + "]"
    step = group[1] - group[0]
    if all(b - a == step for a, b in zip(group, group[1:])):
        return f"[{group[0]}..{group[-1]}" + (f" step {step}]" if step != 1 else "]")
    return "[" + " ".join(map(str, group[:3])) + f" ... {group[-1]}]"


def _span(layers: range) -> str:
    """Layers ``a-b``, one layer ``a``, or nothing (a stage of only the embedding, or only the head)."""
    if len(layers) > 1:
        return f"{layers.start}-{layers.stop - 1}"
    return str(layers.start) if layers else ""


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return str(int(n))


# --------------------------------------------------------------------------- json
def plan_json(plan: Plan, links: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
    """The plan (loadable by ``load_plan``) and what follows from it."""
    m = plan.model
    data: dict[str, Any] = {
        "plan": plan.to_dict(),
        "world": plan.world,
        "num_params": m.num_params,
        "tokens_per_step": plan.tokens_per_step,
        "model_flops_per_step": m.model_flops_per_token() * plan.tokens_per_step,
        "stages": [{"pp_rank": r, "stages": plan.stages_of(r),
                    "layers": [list(plan.stage_layers(s)) for s in plan.stages_of(r)],
                    "params_per_gpu": plan.params_per_rank(r)} for r in range(plan.pp)],
        "groups": {dim: plan.groups(dim) for dim in DIMS},
    }
    if links is not None:
        data["slowest_link"] = links
    return data
