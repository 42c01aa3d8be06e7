"""``parsim explain memory``: what one GPU holds, line by line, and whether it fits."""

from __future__ import annotations

import argparse

from ..errors import ParsimError
from ..report.jsondoc import print_json
from ..units import decimal_unit
from ..workload.memory import (Memory, gradients_accumulate_whole, largest_gathered_unit, memory,
                               saved_bytes_per_token, waiting_bytes_per_token, weight_bytes)
from ..workload.model import LayerCost
from ..workload.plan import Plan
from .common import DEFAULT_CLUSTER, memory_table, plan_cluster
from .plan_cmd import add_plan_args, plan_from_args

HELP = """\
Explain a plan's memory per GPU step by step: the bytes per parameter of
mixed-precision AdamW (in bf16 2 + 4 + 12: fp32 gradients), what each ZeRO
stage shards, the activations each layer saves (Korthikanti et al. 2022,
with flash attention), what recomputation and sequence parallelism keep, and
how many microbatches the schedule holds in flight. Explains the pipeline rank
that needs the most (or --pp-rank), then lists every rank against the GPU's
memory.

examples:
  parsim explain memory llama3-405b-16k
  parsim explain memory llama3-70b-1024 --activation-recompute full
  parsim explain memory --model llama3-8b --dp 8 --grad-sync fsdp --dtype bf16
"""

def register(topics) -> None:
    m = topics.add_parser("memory", help="a plan's memory per GPU, step by step", description=HELP,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_args(m)
    m.add_argument("--cluster", metavar="NAME|FILE",
                   help=f"cluster whose GPU memory to compare with (default: the one the plan names with cluster:, "
                        f"else {DEFAULT_CLUSTER})")
    m.add_argument("--pp-rank", type=int, help="pipeline rank to explain (default: the one needing the most)")
    m.add_argument("--json", action="store_true", help="print JSON for scripts")
    m.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plan = plan_from_args(args)
    capacity = plan_cluster(args.cluster, plan).gpu.hbm_capacity_bytes
    ranks = memory(plan)
    if args.pp_rank is not None and not 0 <= args.pp_rank < plan.pp:
        raise ParsimError(f"--pp-rank {args.pp_rank} is outside 0..{plan.pp - 1}")
    worst = ranks[args.pp_rank] if args.pp_rank is not None else max(ranks, key=lambda m: m.total)
    if args.json:
        print_json("explain.memory", {"plan": plan.name, "capacity_bytes": capacity, "explained_pp_rank": worst.pp_rank,
                    "ranks": [vars(m) | {"total": m.total, "fits": m.total <= capacity} for m in ranks]})
    else:
        print("\n".join(explain(plan, worst, ranks, capacity)))
    return 0


def explain(plan: Plan, mem: Memory, ranks: list[Memory], capacity: float) -> list[str]:
    p, d, g, n = mem.pp_rank, plan.dtype_bytes, plan.grad_bytes, plan.shard_size
    unit, scale = decimal_unit(max(m.total for m in ranks), "B")

    def size(nbytes: float) -> str:
        return f"{nbytes / scale:.2f} {unit}"

    params = plan.params_per_rank(p)
    stages = plan.stages_of(p)
    copy = " with its own copy of the embedding table" if plan.copies_embedding_table else ""
    layers = ", ".join(f"stage {s}: {len(plan.stage_layers(s))} layer{'s' * (len(plan.stage_layers(s)) != 1)}"
                       + "".join(f" + {c.name}" + (copy if c.name == "head" else "")
                                 for c in plan.stage_costs(s) if not c.name.startswith("layer"))
                       for s in stages)
    kept, master = weight_bytes(plan)
    out = [f"Memory of one GPU on pipeline rank {p} of {plan.name} ({plan.model.name}, {plan.dtype})", ""]
    out.append(f"1. Parameters it holds: {params:,} ({layers}"
               + (f"; its 1/{plan.tp} tensor-parallel share" if plan.tp > 1 else "") + ").")
    moments = 2 * plan.moment_bytes
    state = kept + g + moments + master
    grads = f"{g} of gradients" if plan.reduce_dtype == plan.dtype else f"{g} of {plan.reduce_dtype} gradients"
    adamw = "Mixed-precision AdamW" if kept != d or master else "AdamW"
    weights = (f"{kept} bytes of fp32 weights (FSDP2's shards, the master weights, gathered in {plan.dtype})"
               if kept != d else f"{d} bytes of weights")
    out.append(f"2. {adamw} keeps per parameter: {weights} + {grads} + "
               f"{moments} of {plan.adam_moments} moments" + (f" + {master} of fp32 master weights" if master else "")
               + f" = {state} bytes: {size(state * params)} unsharded.")
    if plan.zero and n > 1:
        sharded = {1: "the optimizer state", 2: "the optimizer state and the gradients",
                   3: "the optimizer state, the gradients and the weights"}[plan.zero]
        where = " of its shard group" if plan.replicas > 1 else ""
        experts = "" if not plan.expert_params_per_rank(p) else (
            f"; routed experts' over the {plan.expert_shard_size} ranks{where} holding the same experts"
            if plan.expert_shard_size > 1 else f"; routed experts' not at all: no other rank{where} holds them")
        whole = ("; the gradients add up whole over the microbatches and are reduce-scattered after the last "
                 "backward, so at their peak they are not sharded" if gradients_accumulate_whole(plan) else "")
        out.append(f"3. ZeRO-{plan.zero} shards {sharded} over {n} data-parallel ranks{experts} "
                   f"(Rajbhandari et al. 2020){whole}:")
    elif plan.zero:
        out.append(f"3. ZeRO-{plan.zero} over one data-parallel rank: nothing to shard, the rank keeps all of it:")
    else:
        out.append("3. No ZeRO: every data-parallel replica keeps all of it:")
    out.append(f"   weights {size(mem.weights)} + gradients {size(mem.gradients)} + optimizer "
               f"{size(mem.optimizer)} = {size(mem.weights + mem.gradients + mem.optimizer)}.")
    out += _activations(plan, mem, unit, scale)
    if mem.buffers and plan.pp > 1:
        out.append(f"5. FSDP buffers under a pipeline: every layer's weights stay gathered and its gradients "
                   f"unsharded, in {plan.reduce_dtype}, until the stage's last backward (torch.distributed."
                   f"pipelining): {plan.params_per_rank(p):,} parameters x ({plan.dtype_bytes} + "
                   f"{plan.grad_bytes}) bytes = {size(mem.buffers)}.")
    elif mem.buffers:
        name, largest = largest_gathered_unit(plan, p)
        out.append(f"5. FSDP buffers: two units' weights gathered (the one computing, the one prefetched) and one "
                   f"unit's unsharded gradient, at most those of its largest unit, the {name}: {largest:,} "
                   f"parameters x (2 x {d} + {g}) bytes = {size(mem.buffers)}.")
    verdict = "fits" if mem.total <= capacity else "does NOT fit"
    out += ["", f"Total {size(mem.total)} of {capacity / 1e9:g} GB: it {verdict}"
            + (f" ({(capacity - mem.total) / 1e9:.2f} GB to spare)." if mem.total <= capacity
               else f", {(mem.total - capacity) / 1e9:.2f} GB over."), ""]
    if mem.total > capacity:
        out.append(_advice(plan, mem))
        out.append("")
    out.append(memory_table(ranks, capacity, "every pipeline rank"))
    return out


def _activations(plan: Plan, mem: Memory, unit: str, scale: float) -> list[str]:
    p, tokens = mem.pp_rank, plan.tokens_per_rank
    stage = max(plan.stages_of(p), key=lambda s: saved_bytes_per_token(plan, s))
    costs = plan.stage_costs(stage)
    recomputed = {c.name for c in plan.recomputed(stage)}
    layer = next((c for c in costs if c.name.startswith("layer")), None)
    source = " (Korthikanti et al. 2022, flash attention, no dropout)" if plan.model.kind == "transformer" else ""
    out = [f"4. Activations saved for the backward, per token{source}:"]
    if layer is not None:
        terms = " + ".join(f"{a.name} {a.bytes_per_token(plan.tp)}" for a in layer.activations)
        split = " (split along the sequence too: sequence parallelism)" if plan.sequence_parallel and plan.tp > 1 \
            else " (tensor parallelism splits the per-head and feed-forward terms)" if plan.tp > 1 else ""
        out.append(f"   a layer saves {terms} = {layer.activation_bytes_per_token(plan.tp):,} bytes{split}.")
        out += _how_kept(plan, layer)
        if recomputed:
            out.append(f"   Full recomputation keeps only the input of {len(recomputed)} of the stage's layers: "
                       f"{layer.checkpoint_bytes_per_token(plan.tp):,} bytes each; their forward reruns in the "
                       f"backward.")
    others = [c for c in costs if not c.name.startswith("layer")]
    for c in others:
        out.append(f"   the {c.name} saves {c.activation_bytes_per_token(plan.tp):,} bytes.")
    share = f" (its 1/{plan.cp} of each sequence: context parallelism)" if plan.cp > 1 else ""
    stages = plan.stages_of(p)
    per_mb = {s: saved_bytes_per_token(plan, s) * tokens for s in stages}
    for s in stages:
        out.append(f"   Stage {s} in all: {per_mb[s] // tokens:,} bytes per token x {tokens:,} tokens per "
                   f"microbatch{share} = {per_mb[s] / scale:.2f} {unit} per microbatch.")
    rebuilt = ", plus one recomputed layer's full activations" if recomputed else ""
    live, waiting = mem.peak_counts[:len(stages)], mem.peak_counts[len(stages):]
    if len(stages) == 1 and not any(waiting):
        who = plan.schedule if plan.pp > 1 else "One stage, each microbatch's backward right after its forward,"
        out.append(f"   {who} keeps up to {mem.in_flight} microbatch(es) in flight on this rank "
                   f"(forwards awaiting their backward){rebuilt}: {mem.activations / scale:.2f} {unit}.")
        return out
    waits = {s: waiting_bytes_per_token(plan, s) * tokens for s in stages}
    for s, n in zip(stages, waiting):
        if n:
            out.append(f"   A microbatch whose input gradient ran keeps each linear's input and output gradient "
                       f"until its deferred weight gradient (Qi et al. 2023): stage {s} "
                       f"{waits[s] // tokens:,} bytes per token, {waits[s] / scale:.2f} {unit} per microbatch.")
    terms = [(n, per_mb[s]) for s, n in zip(stages, live) if n] + [(n, waits[s]) for s, n in zip(stages, waiting) if n]
    held = " + ".join(f"{n} x {b / scale:.2f}" for n, b in terms)
    counts = " and ".join(f"{n} of stage {s}'s" for s, n in zip(stages, live))
    waiting_text = "".join(f", {n} of stage {s}'s awaiting their weight gradient" for s, n in zip(stages, waiting) if n)
    out.append(f"   At its peak {plan.schedule} keeps {counts} microbatches in flight on this rank (forwards "
               f"awaiting their backward; {mem.in_flight} at most in all){waiting_text}{rebuilt}: {held}"
               + (f" + {(mem.activations - sum(n * b for n, b in terms)) / scale:.2f}" if recomputed else "")
               + f" = {mem.activations / scale:.2f} {unit}.")
    return out


def _how_kept(plan: Plan, layer: LayerCost) -> list[str]:
    """Why a layer's saved tensors are what they are: fp8 copies, and what selective recompute rebuilds."""
    out = []
    if plan.dtype == "fp8":
        out.append("   fp8: a linear keeps its input as the fp8 copy its GEMM read, 1 byte an element (Transformer "
                   "Engine); the attention output also in bf16, for the attention's backward (.fp8 beside it).")
    modules = plan.recompute_modules or ()
    raw = plan.model.layer_costs(plan.dtype_bytes, plan.tp_style, plan.sequence_parallel)
    whole = next((c for c in raw if c.name == layer.name), None)
    rebuilt = [a.name for a in whole.activations if a.recompute in modules] if whole is not None else []
    if rebuilt:
        out.append(f"   Selective recompute ({', '.join(modules)}) keeps none of {', '.join(rebuilt)}: it reruns "
                   f"what makes them before the backward.")
    return out


def _advice(plan: Plan, mem: Memory) -> str:
    """The largest share, and what shrinks it."""
    parts = {"activations": mem.activations, "optimizer state": mem.optimizer,
             "weights and gradients": mem.weights + mem.gradients}
    largest = max(parts, key=parts.get)
    fixes = {
        "activations": "activation recompute (--activation-recompute full), sequence parallelism "
                       "(--sequence-parallel), more tensor parallelism, or a schedule with fewer microbatches in "
                       "flight",
        "optimizer state": "ZeRO (data_parallel.zero: 1 shards it over the data-parallel group)",
        "weights and gradients": "ZeRO-2/3 or FSDP (--grad-sync fsdp), or more tensor/pipeline parallelism",
    }
    return f"The largest share is {largest} ({parts[largest] / 1e9:.2f} GB): try {fixes[largest]}."
