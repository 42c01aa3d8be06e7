"""A search's results for people (tables, the winner explained) and for scripts (JSON, plan files)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from ..report.step_report import PHASES
from ..report.table import render_table
from ..units import format_size, format_time
from ..workload.plan import DEFAULT_ADAMW, DEFAULT_BUCKET_SIZE, DEFAULT_ORDER
from .search import Ranked, SearchResult
from .space import recompute_setting

GB = 1e9
TIE = 5e-4  # step times this close are the same for --explain's purpose


# --------------------------------------------------------------------------- figures
def tokens_per_step(r: Ranked) -> int:
    return r.space.global_batch * r.space.model.tokens_per_sample


def figures(result: SearchResult, r: Ranked, simulated: bool = True) -> dict[str, float | None]:
    """Step time, throughput, MFU, dollars per million tokens and days to train of one plan (its simulated
    step where it has one and ``simulated``, else its fast estimate)."""
    req = result.request
    step = r.step_s if simulated else r.estimate.step_s
    tokens = tokens_per_step(r)
    model_flops = float(req.model.model_flops_per_token()) * tokens
    peak = req.cluster.gpu.peak_flops[req.dtype]
    price = req.price
    out: dict[str, float | None] = {
        "step_s": step, "tokens_per_s": tokens / step, "mfu": model_flops / (step * r.gpus * peak),
        "memory_GB": r.memory_bytes / GB,
        "usd_per_million_tokens": None if price is None else price * r.gpus * step / 3600 / tokens * 1e6,
        "days_to_train": None, "usd_to_train": None}
    if req.train_tokens:
        out["days_to_train"] = req.train_tokens / (tokens / step) / 86400
        if price is not None:
            out["usd_to_train"] = out["usd_per_million_tokens"] * req.train_tokens / 1e6
    return out


def describe(r: Ranked) -> dict[str, str]:
    """Table cells naming a plan."""
    s, v = r.candidate
    sync = v.sync_text()
    return {"plan": r.candidate.label() + (f" ({'placed ' + v.order})" if v.order != DEFAULT_ORDER else ""),
            "schedule": r.candidate.schedule_text(), "microbatches": f"{s.num_microbatches} x {s.microbatch_size}",
            "sync": sync, "recompute": v.recompute_text(),
            "sp": ("overlap" if v.tp_overlap else "yes") if v.sequence_parallel else "no",
            "cp": v.context_parallel.replace("_", "-") if s.cp > 1 else "-"}


# --------------------------------------------------------------------------- text
def report(result: SearchResult, commands: list[str], top: int) -> str:
    req = result.request
    lines = [_header(result), ""]
    lines += _summary(result)
    lines.append("")
    if not result.ranked:
        lines.append("no plan to rank: every layout or setting was rejected, or none fits in memory (above)")
        return "\n".join(lines)
    lines.append(ranking_table(result, result.ranked[:top]))
    lines.append("")
    lines.append(front_table(result))
    lines.append("")
    lines.append("re-run a row with the event simulation:")
    lines += [f"  {k + 1:>2}: {c}" for k, c in enumerate(commands[:top])]
    if req.price is not None and req.price_per_gpu_hour is None:
        lines.append(f"cost at {req.cluster.name}'s example price, ${req.price:g} per GPU-hour "
                     f"(its cluster file; give yours with --price-per-gpu-hour)")
    return "\n".join(lines)


def _header(result: SearchResult) -> str:
    req = result.request
    r0 = req.model
    seq = getattr(r0, "seq_len", 1)
    gpus = ", ".join(f"{g:,}" for g in req.gpus)
    batch = (f"global batch {req.global_batch:,} x {seq:,} = {req.global_batch * seq:,} tokens"
             if seq > 1 else f"global batch {req.global_batch:,}")
    return (f"search: {r0.name} on {gpus} GPUs of {req.cluster.name} ({req.cluster.gpu.model}), {batch}, "
            f"{req.dtype}, gradients in {req.gradient_dtype}"
            f"{', fused AdamW' if req.adamw == 'fused' else ''}"
            f"{'' if req.grad_clip is None else f', gradients clipped to norm {req.grad_clip:g}'}"
            f"{', experts dispatched by DeepEP' if req.dispatcher == 'deepep' else ''}"
            f"{', tokens dispatched in fp8' if req.dispatch_fp8 else ''}"
            f"{'' if req.expert_load == 1 else f', busiest expert {req.expert_load:g}x the mean'}"
            f", sorted by {req.sort}")


def _count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is one: "1 layout", "2 layouts"."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _summary(result: SearchResult) -> list[str]:
    lines = []
    capacity = result.request.capacity
    for space in result.spaces:
        rej = space.rejections
        layouts = sum(rej.layouts.values())
        pipelines = sum(rej.pipelines.values())
        lines.append(f"space   {space.gpus:,} GPUs: {_count(space.plans, 'plan')} from "
                     f"{_count(rej.layouts_valid, 'layout')} "
                     f"(dp x tp x pp x cp{', ep' if result.request.model.is_moe else ''}) and "
                     f"{_count(rej.pipelines_valid, 'pipeline setting')}")
        if layouts:
            lines.append(f"        rejected {layouts:,} layouts: " + _reasons(rej.layouts))
        if pipelines:
            lines.append(f"        rejected {pipelines:,} microbatch/schedule settings: " + _reasons(rej.pipelines))
        over = sum(space.over_memory.values())
        lines.append(f"memory  {over:,} of them do not fit in {capacity / GB:g} GB per GPU"
                     + (": " + _reasons(space.over_memory) if over else "") + f"; {space.fits:,} fit")
    bound, estimate, simulate = (result.seconds[k] for k in ("bound", "estimate", "simulate"))
    fast = bound + estimate
    lines.append(f"fast    {result.plans:,} plans in {fast:.1f} s ({result.plans / fast:,.0f} plans/s): memory and a "
                 f"lower bound of the step for all, {result.estimated:,} estimated in full; the other "
                 f"{result.bounded:,} that fit cannot reach the top {result.request.keep} or the Pareto front")
    simulated = sum(1 for r in result.ranked if r.simulated is not None)
    if simulated:
        lines.append(f"sim     the best {simulated} event-simulated in {simulate:.1f} s")
    return lines


def _reasons(counts: dict[str, int]) -> str:
    return ", ".join(f"{n:,} {reason}" for reason, n in sorted(counts.items(), key=lambda x: -x[1]))


def _per_million(unit: str) -> str:
    return "$/M tok" if unit == "token" else "$/M samples"


def ranking_table(result: SearchResult, rows: list[Ranked]) -> str:
    priced = result.request.price is not None
    trains = result.request.train_tokens is not None
    unit = result.request.model.throughput_unit
    headers = ["#", "GPUs", "plan", "schedule", "m x mbs", "sync", "recompute", "sp", "cp", "step", "MFU",
               f"{unit}s/s", *([_per_million(unit)] if priced else []), *(["days"] if trains else []),
               *(["$ to train"] if trains and priced else []), "GB", "fast step", "fast vs sim", "fast #"]
    body = []
    for k, r in enumerate(rows):
        f, d = figures(result, r), describe(r)
        sim = r.simulated is not None
        body.append([k + 1, f"{r.gpus:,}", d["plan"], d["schedule"], d["microbatches"], d["sync"], d["recompute"],
                     d["sp"], d["cp"], format_time(f["step_s"]) + ("*" if sim else ""), f"{f['mfu']:.1%}",
                     f"{f['tokens_per_s']:,.0f}",
                     *([f"{f['usd_per_million_tokens']:.3f}"] if priced else []),
                     *([f"{f['days_to_train']:.1f}"] if trains else []),
                     *([f"{f['usd_to_train'] / 1e6:,.2f}M"] if trains and priced else []),
                     f"{f['memory_GB']:.1f}", format_time(r.estimate.step_s),
                     f"{r.estimate.step_s / r.simulated.step_s - 1:+.1%}" if sim else "-", r.fast_rank])
    title = ("ranked plans (* event-simulated; the other figures are the fast tier's; fast vs sim: the fast "
             "estimate's difference from the simulation)")
    return render_table(headers, body, title=title)


def front_table(result: SearchResult) -> str:
    priced = result.request.price is not None
    rows = []
    for r in result.front:
        f, d = figures(result, r, simulated=False), describe(r)
        rows.append([f"{r.gpus:,}", d["plan"], d["schedule"], d["microbatches"], d["sync"], d["recompute"], d["sp"],
                     format_time(f["step_s"]), f"{f['memory_GB']:.1f}",
                     *([f"{f['usd_per_million_tokens']:.3f}"] if priced else [])])
    headers = ["GPUs", "plan", "schedule", "m x mbs", "sync", "recompute", "sp", "fast step", "GB",
               *([_per_million(result.request.model.throughput_unit)] if priced else [])]
    what = "step time, memory and cost" if len(result.request.gpus) > 1 else "step time and memory"
    return render_table(headers, rows, title=f"Pareto front of {what} (fast tier; none is beaten on all of them, "
                                             f"up to 1.5 times the best)")


# --------------------------------------------------------------------------- explain
def explain(result: SearchResult) -> str:
    """Why the winner beats the runner-up: their simulated phases on each one's slowest pipeline rank, the
    settings that differ, and where the fast tier and the simulation disagree about the winner."""
    if len(result.ranked) < 2:
        return "explain: fewer than two plans to compare"
    a = result.ranked[0]
    # The runner-up: the next plan that is not a tie (plans the same to 0.05% run alike: cp for dp, ...).
    b = next((r for r in result.ranked[1:] if r.step_s > a.step_s * (1 + TIE)), result.ranked[1])
    ties = result.ranked.index(b) - 1
    # Both plans by one tier: the simulation's where both were simulated, else the fast tier's.
    simulated = a.simulated is not None and b.simulated is not None
    pa, pb = (_phases(a), _phases(b)) if simulated else (dict(a.estimate.phases), dict(b.estimate.phases))
    step_a, step_b = (a.step_s, b.step_s) if simulated else (a.estimate.step_s, b.estimate.step_s)
    rows = sorted(((p, pa[p], pb[p], pb[p] - pa[p]) for p in PHASES if pa[p] or pb[p]), key=lambda x: -abs(x[3]))
    tier = "event-simulated" if simulated else "fast tier"
    table = render_table(["phase", "#1", f"#{ties + 2}", "difference"],
                         [[p, format_time(x), format_time(y), _signed(d)] for p, x, y, d in rows],
                         title=f"why #1 beats #{ties + 2} ({tier}: seconds per step of each plan's slowest "
                               f"pipeline rank)")
    gap = step_b - step_a
    biggest = [f"{p} {_signed(d)}" for p, _, _, d in rows[:3] if d]
    tied = "plan #2 runs" if ties == 1 else f"plans #2 to #{ties + 1} run"
    verdict = (f"#1 is {format_time(gap)} ({gap / step_b:.1%}) faster per step" if gap >= 0 else
               f"by the fast tier #{ties + 2} is {format_time(-gap)} ({-gap / step_b:.1%}) faster per step; "
               f"#1's event simulation ranks it first")
    lines = [table, (f"{tied} within {TIE:.2%} of #1: the runner-up is #{ties + 2}\n" if ties else "")
             + verdict + (f"; the phases that differ most: {', '.join(biggest)}" if biggest else ""),
             "the plans differ in: " + (", ".join(_differences(a, b)) or "nothing but their names")]
    if a.simulated is not None:
        fast, sim = a.estimate.phases, _phases(a)
        rows = [[p, format_time(fast[p]), format_time(sim[p]), _signed(fast[p] - sim[p])] for p in PHASES
                if fast[p] or sim[p]]
        lines += ["", render_table(["phase", "fast", "simulated", "fast - simulated"], rows,
                                   title="#1 by the two tiers (where they disagree)")]
    return "\n".join(lines)


def _phases(r: Ranked) -> dict[str, float]:
    if r.simulated is None:
        return dict(r.estimate.phases)
    slowest = min(r.simulated.ranks, key=lambda b: b.seconds.get("idle", 0.0))
    return {p: slowest.seconds.get(p, 0.0) for p in PHASES}


def _signed(seconds: float) -> str:
    if abs(seconds) < 1e-7:  # rounding, not a difference
        return "0 s"
    return ("+" if seconds > 0 else "-") + format_time(abs(seconds))


def _differences(a: Ranked, b: Ranked) -> list[str]:
    out = [] if a.gpus == b.gpus else [f"GPUs {a.gpus} vs {b.gpus}"]
    for part in ("setting", "variant"):
        x, y = getattr(a.candidate, part), getattr(b.candidate, part)
        out += [f"{name} {u} vs {w}" for name, u, w in zip(x._fields, x, y) if u != w]
    return out


# --------------------------------------------------------------------------- scripts
def command(result: SearchResult, r: Ranked, plan_file: str | None) -> str:
    """A ``parsim simulate`` command that re-runs ``r``: its plan file where one was saved, else flags."""
    req = result.request
    cluster = req.cluster.source if req.cluster.source and not _builtin(req.cluster.source) else req.cluster.name
    if plan_file is not None:
        return shlex.join(["parsim", "simulate", plan_file, "--cluster", cluster])
    if not isinstance(req.model_spec, str):
        return "(a model changed on the command line: save the plan with --save-plans DIR to re-run it)"
    s, v = r.candidate
    args = ["parsim", "simulate", "--model", req.model_spec, "--dp", s.dp, "--tp", s.tp, "--pp", s.pp]
    args += ["--cp", s.cp] if s.cp > 1 else []
    args += ["--ep", s.ep] if s.ep > 1 else []
    args += ["--microbatch-size", s.microbatch_size, "--num-microbatches", s.num_microbatches]
    args += ["--schedule", s.schedule] + (["--virtual-stages", s.virtual_stages] if s.virtual_stages > 1 else [])
    args += ["--layers-per-stage", "balanced"] if s.balanced else []
    args += ["--dtype", req.dtype] + (["--adamw", req.adamw] if req.adamw != DEFAULT_ADAMW else [])
    args += ["--reduce-dtype", req.reduce_dtype] if req.reduce_dtype else []
    args += ["--grad-clip", str(req.grad_clip)] if req.grad_clip is not None else []
    args += ["--dispatcher", req.dispatcher] if s.ep > 1 and req.dispatcher != "alltoall" else []
    args += ["--dispatch-fp8"] if s.ep > 1 and req.dispatch_fp8 else []
    args += ["--expert-load", f"{req.expert_load:g}"] if req.expert_load != 1 else []
    args += ["--order", v.order] if v.order != DEFAULT_ORDER else []
    args += ["--sequence-parallel"] if v.sequence_parallel else []
    args += ["--tp-comm-overlap"] if v.tp_overlap else []
    args += ["--ep-comm-overlap"] if v.ep_overlap else []
    args += ["--overlap-param-gather"] if v.param_overlap else []
    recompute, modules = recompute_setting(req.model, v.recompute)
    args += ["--activation-recompute", recompute] if recompute != "none" else []
    args += ["--recompute-modules", ",".join(modules)] if modules else []
    args += ["--recompute-layers", v.recompute_layers] if v.recompute_layers is not None else []
    args += ["--context-parallel", v.context_parallel] if s.cp > 1 and v.context_parallel != "ring" else []
    if v.grad_sync == "fsdp":
        args += ["--grad-sync", "fsdp"]
    elif v.zero:
        args += ["--zero", v.zero]
    args += ["--shard-group", v.shard_group] if v.shard_group else []
    args += ["--bucket-size", format_size(r.space.bucket_size).replace(" ", "")] \
        if v.grad_sync == "bucketed" and r.space.bucket_size != DEFAULT_BUCKET_SIZE else []
    return shlex.join([str(a) for a in args] + ["--cluster", cluster])


def _builtin(source: str) -> bool:
    return Path(source).parent.name == "topologies" and Path(source).parent.joinpath("__init__.py").exists()


def save_plans(result: SearchResult, rows: list[Ranked], folder: str) -> list[str]:
    """Each row's plan file (``rank01.yaml``, ...) in ``folder``; the paths."""
    import yaml

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, r in enumerate(rows):
        name = f"rank{k + 1:02d}"
        path = out / f"{name}.yaml"
        f = figures(result, r)
        header = (f"# parsim search #{k + 1}: {r.candidate.label()} on {r.gpus:,} GPUs of {result.request.cluster.name}"
                  f"\n# {'simulated' if r.simulated is not None else 'fast-tier'} step {format_time(f['step_s'])}, "
                  f"MFU {f['mfu']:.1%}, {f['memory_GB']:.1f} GB per GPU\n")
        path.write_text(header + yaml.safe_dump(r.candidate.mapping(r.space, name), sort_keys=False))
        paths.append(str(path))
    return paths


def to_json(result: SearchResult, rows: list[Ranked], commands: list[str]) -> dict[str, Any]:
    req = result.request

    def plan(r: Ranked, k: int | None) -> dict[str, Any]:
        out = {"gpus": r.gpus, "plan": r.candidate.mapping(r.space, f"rank{k + 1}" if k is not None else "plan"),
               "fast": {"step_s": r.estimate.step_s, "memory_bytes": r.estimate.memory_bytes,
                        "phases_s": r.estimate.phases, "rank": r.fast_rank},
               "simulated": None if r.simulated is None else {
                   "step_s": r.simulated.step_s, "mfu": r.simulated.mfu,
                   "phases_s": _phases(r)},
               "figures": figures(result, r)}
        if k is not None:
            out["rank"], out["command"] = k + 1, commands[k]
        return out

    return {
        "model": req.model.name, "cluster": req.cluster.name, "gpus": list(req.gpus),
        "global_batch": req.global_batch, "dtype": req.dtype, "adamw": req.adamw,
        "reduce_dtype": req.gradient_dtype, "grad_clip": req.grad_clip, "dispatcher": req.dispatcher,
        "dispatch_fp8": req.dispatch_fp8, "expert_load": req.expert_load,
        "sort": req.sort,
        "price_usd_per_gpu_hour": req.price, "train_tokens": req.train_tokens,
        "memory_capacity_bytes": req.capacity, "degrees": {dim: list(values) for dim, values in req.degrees},
        "spaces": [{"gpus": s.gpus, "plans": s.plans, "fit": s.fits, "over_memory": s.over_memory,
                    "layouts": s.rejections.layouts_valid, "layouts_rejected": dict(s.rejections.layouts),
                    "pipelines": s.rejections.pipelines_valid, "pipelines_rejected": dict(s.rejections.pipelines)}
                   for s in result.spaces],
        "estimated": result.estimated, "bounded": result.bounded,  # wall times left out: same input, same JSON
        "ranked": [plan(r, k) for k, r in enumerate(rows)],
        "pareto_front": [plan(r, None) for r in result.front],
    }
