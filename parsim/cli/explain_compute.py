"""``parsim explain compute``: one layer's kernels on one GPU, each with its rate and time."""

from __future__ import annotations

import argparse
import dataclasses

from ..errors import ParsimError
from ..lowering.kernels import BlockWork, block_work
from ..lowering.lower import Lowering
from ..report.jsondoc import print_json
from ..report.table import format_number, render_table
from ..sim.compute import MATMUL_TILE, ComputeModel
from ..units import decimal_unit, format_size, format_time, time_unit
from .common import DEFAULT_CLUSTER, plan_cluster
from .plan_cmd import add_plan_args, plan_from_args

HELP = f"""\
Explain how long one layer's compute takes on one GPU, kernel by kernel.

Each matmul (m x n x k) runs at the GPU's maximum achievable matmul rate
(compute.matmul_efficiency x peak, a measured best case) times its tile fill:
the output splits into {MATMUL_TILE} x {MATMUL_TILE} tiles, one per SM at a time, so
edge tiles and a last partial wave cost whole ones; and times k / (k + k0),
each tile's fixed cost being worth k0 (compute.matmul_k_overhead) steps of its
reduction (twice as many in fp8, whose steps take half the time); or, if it
moves more bytes than it can compute in that time, at HBM speed. The attention
core runs in FlashAttention at its measured fraction of peak (or, unfused, as
batched matmuls); norms, activations, residuals and softmax are memory-bound,
at the measured fraction of HBM bandwidth, except that a softmax, dropout,
GeLU, a norm or a bias added on its own (linear_bias) takes its SM cycles where
those are longer (bound "SMs": their arithmetic, per element, over every SM at
the GPU's clock). Every rate is in the cluster
file, with its source. Where the file gives eager PyTorch's host time per op
(parsim calibrate writes it), each block also shows the host issuing its ops:
on a GPU the block takes the longer of that and its kernels, on a CPU rank the
sum.

With tensor, context or expert parallelism the layer's collectives follow,
each priced alone on the cluster's links as the simulator prices one that
nothing contends with: in line on the compute stream (all exposed), or beside
the GEMMs (context parallelism's K/V exchange; with --tp-comm-overlap the ring
exchange, pipelined and bulk methods of Transformer Engine), exposed only where
the compute beside them runs out. Each pass's time is then compute plus the
exposed collectives.

A data-parallel or FSDP collective running beside the layer (the next layer's
weights gathered, the last layer's gradients reduce-scattered) is an NCCL
kernel holding one SM per channel until it ends; --sms-held N prices the
layer on the SMs such a kernel leaves, as the simulator does while one runs:
each matmul's waves over fewer SMs, the attention core and the kernels the
SMs bound at the share of SMs left (an FSDP plan's own gather is named below
the table).

examples:
  parsim explain compute llama3-70b-1024
  parsim explain compute --model gpt3-175b --tp 8 --cluster dgx-a100 --dtype fp16
  parsim explain compute llama3-8b-fsdp8 --layer head
  parsim explain compute llama3-70b-1024 --sequence-parallel --tp-comm-overlap
  parsim explain compute llama3-8b-fsdp8 --sms-held 24
"""


def register(topics) -> None:
    c = topics.add_parser("compute", help="one layer's kernels on one GPU, step by step", description=HELP,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_args(c)
    c.add_argument("--cluster", metavar="NAME|FILE", help=f"cluster whose GPU runs it (default: the one the plan "
                                                          f"names with cluster:, else {DEFAULT_CLUSTER})")
    c.add_argument("--layer", default="layer.0", help="entry to explain: layer.N, embedding or head (default layer.0)")
    c.add_argument("--sms-held", type=int, default=0, metavar="N",
                   help="SMs a collective's kernel beside the layer holds: the layer runs on the rest (default 0)")
    c.add_argument("--json", action="store_true", help="print JSON for scripts")
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plan = plan_from_args(args)
    spec = plan_cluster(args.cluster, plan)
    model = ComputeModel.for_cluster(spec, plan.dtype, plan.dtype_bytes, attention_seq=plan.attention_seq)
    costs = {c.name: c for s in range(plan.num_stages) for c in plan.stage_costs(s)}
    if args.layer not in costs:
        names = [n for n in costs if not n.startswith("layer.")] + [f"layer.0 to layer.{plan.model.num_layers - 1}"]
        raise ParsimError(f"--layer {args.layer!r}: the model has {', '.join(names)}")
    cost = costs[args.layer]
    held = args.sms_held
    if held and not 0 < held < model.sm_count:
        raise ParsimError(f"--sms-held {held}: give 0 to {model.sm_count - 1}, the {spec.gpu.model} has "
                          f"{model.sm_count} SMs" if model.sm_count else
                          f"--sms-held {held}: the {spec.gpu.model} has no SMs (the cluster file gives no "
                          f"gpu.sm_count)")
    passes = ("F", "I", "W") if plan.pipeline.split_backward else ("F", "B")
    lowering = Lowering(plan)
    rows, totals = [], {}
    for kind in passes:
        totals[kind] = 0.0
        for block in cost.blocks:
            work = block_work(plan, block, kind, plan.tokens_per_rank)
            kernels = [{"pass": kind, **row}
                       for row in _rows(model, block.name, work, "main_grad" if plan.main_grads else ".grad", held)]
            host = _host_row(model, block.name, *lowering.eager_ops(block, kind), lowering.tp_calls(block, kind))
            rows += kernels + ([{"pass": kind, **host}] if host else [])
            totals[kind] += model.with_host(sum(r["time_s"] for r in kernels), host["time_s"] if host else 0.0)
    collectives, passes = _collectives(plan, spec, model, args.layer, held)
    gather = _fsdp_gather(plan, spec, model, cost)
    if args.json:
        print_json("explain.compute", {"plan": plan.name, "cluster": spec.name, "layer": cost.name,
                                       "tokens": plan.tokens_per_rank, "sms_held": held, "kernels": rows,
                                       "pass_s": totals, "collectives": collectives, "passes": passes,
                                       "fsdp_gather": gather})
        return 0
    print(_report(plan, spec, model, cost.name, rows, totals, held))
    if gather:
        print(f"  FSDP gathers the next layer's weights ({format_size(gather['bytes'])}) beside this one: its NCCL "
              f"kernel holds {gather['sms']} SMs while it runs" + ("" if held else
                                                                 f" (--sms-held {gather['sms']} prices the layer so)"))
    if collectives:
        print()
        print(_collectives_report(plan, cost.name, collectives, passes))
    return 0


def _fsdp_gather(plan, spec, model: ComputeModel, cost) -> dict | None:
    """FSDP: the all-gather of ``cost``'s weights over the shard group, its bytes and the SMs its NCCL kernel
    holds (:func:`~parsim.sim.collectives.simulate.kernel_sms`); None without FSDP or where none are held."""
    if plan.zero != 3 or plan.shard_size == 1 or not model.sm_count:
        return None
    from ..lowering.lower import fsdp_bytes
    from ..sim.stepsim import StepSimulator

    nbytes = fsdp_bytes(cost, plan, experts=False)
    shard = Lowering(plan).group(0, "shard")[0]
    sms = StepSimulator(spec.build(max(1, plan.world // spec.gpus_per_node)), model).kernel_sms(
        "all_gather", shard, int(nbytes))
    return {"bytes": nbytes, "sms": sms} if sms and nbytes else None


def _collectives(plan, spec, model: ComputeModel, layer: str, held: int = 0) -> tuple[list[dict], list[dict]]:
    """The layer's collectives in each pass, priced alone, and how much of each the pass exposes; and per
    pass its compute, exposed collectives and total, beside the same with the collectives in line. The
    passes are timed as the search's fast tier times them (:meth:`PassCosts.time_pieces`): one rank alone,
    a side-stream collective running from the op before it to its stream's next join."""
    if plan.tp * plan.cp * plan.ep == 1:
        return [], []
    from ..search.costs import PASS_PHASES, CommCosts, PassCosts  # the simulator's uncontended pricing

    costs = PassCosts(model, CommCosts(spec, plan.world, model))
    stage, index = next((s, i) for s in range(plan.num_stages) for i, c in enumerate(plan.stage_costs(s))
                        if c.name == layer)
    p, cost = plan.pipeline.stage_to_rank(stage), plan.stage_costs(stage)[index]

    def timed(of_plan, kind: str, exposure: list | None = None) -> tuple[float, float]:
        """(pass seconds, of which collectives hold the compute stream up)."""
        phases, accumulate, accumulate_sm, _ = costs.time_pieces(Lowering(of_plan).layer_pass(p, index, cost, kind),
                                                                 of_plan.accumulation, exposure=exposure,
                                                                 held_sms=held)
        exposed = sum(phases[PASS_PHASES.index(g)] for g in ("tp", "ep", "cp"))
        return float(phases.sum() + of_plan.accumulation.seconds(accumulate, accumulate_sm)), float(exposed)

    in_line = (dataclasses.replace(plan, tp_comm_overlap=False, tp_async_backward=False)
               if plan.tp_comm_overlap or plan.tp_async_backward else None)
    rows, passes = [], []
    for kind in ("F", "I", "W") if plan.pipeline.split_backward else ("F", "B"):
        exposure: list[dict] = []
        pass_s, exposed_s = timed(plan, kind, exposure)
        for row in exposure:
            piece = row["piece"]
            rows.append({"pass": kind, "collective": f"{piece.name_head}{piece.name_tail}".replace(" mb=", ""),
                         "group": piece.group, "method": piece.method or ("beside" if piece.beside else "in line"),
                         "bytes": piece.nbytes, "alone_s": row["alone_s"], "exposed_s": row["exposed_s"]})
        summary = {"pass": kind, "compute_s": pass_s - exposed_s, "exposed_s": exposed_s, "time_s": pass_s}
        if in_line is not None:
            summary["in_line_s"] = timed(in_line, kind)[0]
        passes.append(summary)
    return rows, passes


def _collectives_report(plan, layer: str, rows: list[dict], passes: list[dict]) -> str:
    unit, scale = time_unit(r["alone_s"] for r in rows)
    table = [[PASS_NAMES[r["pass"]], r["collective"], r["method"], format_size(r["bytes"]),
              r["alone_s"] / scale, r["exposed_s"] / scale] for r in rows]
    lines = [f"{layer}'s collectives, each priced alone on the cluster's links (the simulator's uncontended "
             f"time; contention in a step adds to it)",
             render_table(["pass", "collective", "how", "size", f"alone ({unit})", f"exposed ({unit})"], table), ""]
    for s in passes:
        line = (f"  {PASS_NAMES[s['pass']]:<16} {format_time(s['time_s'])} = compute {format_time(s['compute_s'])}"
                f" + exposed collectives {format_time(s['exposed_s'])}")
        if "in_line_s" in s:
            line += f" (collectives in line: {format_time(s['in_line_s'])})"
        lines.append(line)
    if plan.tp_comm_overlap:
        lines.append("  With the overlap the GEMMs run in chunks, some on the SMs a communication kernel leaves, so "
                     "their compute is longer than the kernels above.")
    elif any(r["method"] == "async" for r in rows):
        lines.append("  Beside an asynchronous collective a GEMM runs on the SMs its NCCL kernel leaves (one per "
                     "channel) until the collective ends, so the backward's compute is longer than the kernels above.")
    return "\n".join(lines)


def _rows(model: ComputeModel, block: str, work: BlockWork, gradient_sum: str, held: int = 0) -> list[dict]:
    """The block's kernels, its matmuls on the SMs ``held`` leaves."""
    rows = []
    for (m, n, k), label in zip(work.matmuls, work.labels):
        rate, flops = model.matmul_rate(m, n, k, held, work.high_precision), 2.0 * m * n * k
        time = model.matmul_time(m, n, k, held, work.high_precision)
        bound = "compute" if time == flops / rate else "memory"
        rows.append({"block": block, "kernel": label, "shape": f"{m:,} x {n:,} x {k:,}", "flops": flops,
                     "fill": model.waves(m, n, model.sms_left(held)), "bound": bound,
                     "time_s": time})
    if work.attention_flops or work.attention_grad_flops:
        backward = bool(work.attention_grad_flops)
        flops = work.attention_grad_flops or work.attention_flops
        time = model.time(attention_flops=0 if backward else flops, attention_grad_flops=flops if backward else 0,
                          sm_reserved=held)
        rows.append({"block": block, "kernel": "attention core (flash" + (", backward)" if backward else ")"),
                     "shape": "", "flops": flops, "fill": None, "bound": "compute", "time_s": time})
    for what, nbytes, works in (*work.elementwise_parts,
                                ("fp8 casts (amax, cast and transpose)", work.quantize_bytes, ())):
        if nbytes:
            kernel = ((nbytes, works),)
            rows.append({"block": block, "kernel": what, "shape": _bytes_text(nbytes), "flops": 0.0,
                         "fill": None, "bound": _arithmetic_bound(model) if model.sm_excess(kernel) else "memory",
                         "time_s": model.time(hbm_bytes=nbytes, sm_bound=kernel, sm_reserved=held)})
    if work.accumulate_bytes:  # the longer of its bytes and, where dtypes differ, its unvectorized cycles
        nbytes, elements = work.accumulate_bytes, work.accumulate_elements
        rows.append({"block": block, "kernel": f"add weight gradients into {gradient_sum}",
                     "shape": _bytes_text(nbytes), "flops": 0.0, "fill": None,
                     "bound": _arithmetic_bound(model) if model.unvectorized_s(elements) > nbytes / model.memory_bw_Bps
                     else "memory",
                     "time_s": model.time(hbm_bytes=nbytes, stream_bytes=nbytes, accumulate_elements=elements)})
    if work.kernels and model.kernel_overhead_s:
        rows.append({"block": block, "kernel": f"{work.kernels} launches", "shape": "", "flops": 0.0, "fill": None,
                     "bound": "launch", "time_s": work.kernels * model.kernel_overhead_s})
    return rows


def _arithmetic_bound(model: ComputeModel) -> str:
    """What bounds a memory-bound kernel whose arithmetic outlasts its bytes: a GPU's SMs or a CPU rank's core."""
    return "SMs" if model.sm_cycles_per_s else "core"


def _host_row(model: ComputeModel, block: str, forward_ops: int, backward_ops: int,
              tp_calls: tuple[int, int]) -> dict | None:
    """The host issuing the block's eager ops and wrapping its tensor-parallel calls, where the cluster file
    gives its time per op."""
    seconds = model.host_time(forward_ops, backward_ops, tp_calls=tp_calls)
    if not seconds:
        return None
    how = "races the kernels" if model.host_overlaps_device else "adds to the kernels"
    calls = sum(tp_calls)
    what = f"{forward_ops + backward_ops} eager ops" + (f", {calls} tensor-parallel call{'s' * (calls > 1)}"
                                                         if calls else "")
    return {"block": block, "kernel": f"host: {what} ({how})", "shape": "",
            "flops": 0.0, "fill": None, "bound": "host", "time_s": seconds}


PASS_NAMES = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}


def _bytes_text(nbytes: float) -> str:
    """A kernel's bytes in MB, or in kB below one (a tiny model's would read 0.0 MB)."""
    return f"{nbytes / 1e6:,.1f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:.3g} kB"


def _percent(share: float) -> str:
    """A share as a whole percent, or to two significant digits below 1% (a tiny GEMM's tile fill)."""
    return f"{share:.0%}" if share >= 0.01 else f"{share * 100:.2g}%"


def _report(plan, spec, model: ComputeModel, layer: str, rows: list[dict], totals: dict, held: int = 0) -> str:
    peak = (model.matmul_peak_flops or model.peak_flops) / 1e12
    fwd, bwd = model.attention_efficiency
    lines = [
        f"{plan.name}: {layer} on one GPU of {spec.name} (tp {plan.tp}), {plan.tokens_per_rank:,} "
        f"{'tokens' if plan.model.kind == 'transformer' else 'samples'} per microbatch, {plan.dtype}",
        f"  matmuls     {model.efficiency:g} x {peak:g} TFLOP/s = {model.efficiency * peak:.1f} TFLOP/s at best, "
        f"x tile fill ({model.sm_count or 'no'} SMs"
        + (f", {held} of them held by a collective's kernel beside: {model.sm_count - held})" if held else ")")
        + (f" x k / (k + {model.k_overhead * peak * 1e12 / model.peak_flops:.3g})" if model.k_overhead else ""),
        *([f"  attention   forward {fwd:.3g}, backward {bwd:.3g} of {model.peak_flops / 1e12:g} TFLOP/s"
           f"{f' (kernels over {plan.attention_seq:,} tokens)' if plan.attention_seq else ''}"]
          if plan.model.kind == "transformer" else []),
        f"  memory      {model.memory_efficiency:g} x {model.hbm_bw_Bps / 1e9:g} GB/s = "
        f"{model.memory_bw_Bps / 1e9:.0f} GB/s",
    ]
    if model.sm_cycles_per_s:
        lines.append(f"  SMs         {model.sm_count} x {model.sm_cycles_per_s / model.sm_count / 1e6:,.0f} MHz: "
                     "softmax, dropout, GeLU, norms, bias adds, unvectorized eager ops: the longer of bytes and "
                     "SM cycles")
    if model.core_arithmetic is not None and model.elementwise_bw_Bps:
        figures = ", ".join(f"{kind} {ns['forward']:.2f} / {ns['backward']:.2f}"
                            for kind, ns in model.core_arithmetic.to_ns().items())
        lines.append(f"  core        {figures} ns per element forward / backward: these kernels take the longer of "
                     f"that and their bytes at {model.elementwise_bw_Bps / 1e9:.3g} GB/s")
    if model.op_forward_s or model.op_backward_s:
        how = ("a block takes the longer of its kernels and its host" if model.host_overlaps_device
               else "added to each block's kernels")
        lines.append(f"  host        {model.op_forward_s * 1e6:.1f} us per forward op, "
                     f"{model.op_backward_s * 1e6:.1f} us per backward op: {how}")
    if model.matmul_cache_hits is not None:
        held = ", ".join(f"{format_size(kib * 1024)} {hit:.0%}" for kib, hit in model.matmul_cache_hits)
        lines.append(f"  cache       a weight read again in the layout it is stored in comes from the core's cache at "
                     f"{model.matmul_cached_stream_bw_Bps / 1e9:.3g} GB/s, the share held by the bytes touched since "
                     f"its last read: {held} (a stage's later microbatches): this table reads every weight from "
                     "memory")
    if any(model.pass_s):
        lines.append(f"  per pass    {model.pass_s[0] * 1e6:.0f} us a forward, {model.pass_s[1] * 1e6:.0f} us a "
                     "backward, once on a pass's first layer (it runs colder than the layers after it): not in "
                     "this layer's times")
    lines.append("")
    unit, scale = time_unit(r["time_s"] for r in rows)
    flop_unit, flop_scale = decimal_unit(max(r["flops"] for r in rows), "FLOP")
    table = [[PASS_NAMES[r["pass"]], r["block"], r["kernel"], r["shape"],
              format_number(r["flops"] / flop_scale) if r["flops"] else "",
              _percent(r["fill"]) if r["fill"] is not None else "",
              format_number(r["flops"] / r["time_s"] / 1e12) if r["flops"] else "", r["bound"], r["time_s"] / scale]
             for r in rows]
    lines.append(render_table(["pass", "block", "kernel", "m x n x k", flop_unit, "fill", "TFLOP/s", "bound",
                               f"time ({unit})"], table))
    lines.append("")
    lines += [f"  {PASS_NAMES[k]:<16} {format_time(t)}" for k, t in totals.items()]
    flops = sum(r["flops"] for r in rows)
    total = sum(totals.values())
    peak = model.matmul_peak_flops or model.peak_flops  # an fp8 plan's matmuls run at the fp8 peak
    lines.append(f"  {'all passes':<16} {format_time(total)}: {flops / total / 1e12:.0f} TFLOP/s, "
                 f"{flops / total / peak:.0%} of the {peak / 1e12:g} TFLOP/s {plan.dtype} peak (FLOPs as executed)")
    return "\n".join(lines)
