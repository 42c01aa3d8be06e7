"""``parsim collective``: predict a collective and explain the bandwidth math."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from ..errors import ParsimError
from ..report.jsondoc import print_json
from ..report.results import OPERATIONS, canonical_op
from ..report.table import render_table
from ..sim.collectives import ALGORITHMS, predict
from ..sim.collectives.deepep import TokenRouting
from ..sim.collectives.explain import explain
from ..units import format_size, format_time, parse_size, parse_size_range, size_unit, time_unit
from .common import OpsProgress, add_cluster_args, check_buffer, check_outputs, topology_from_args

HELP = """\
Predict the time of one collective on a simulated cluster, and say why.

Transfers travel over the cluster's links (NVLink/NVSwitch or PCIe inside a
node, NICs, leaf and spine switches between nodes) in a discrete-event,
flow-level simulation; links shared by several transfers split their bandwidth.

On clusters whose file has an nccl: section (the built-in GPU clusters) the
algorithm and protocol (LL, LL128, Simple) are the ones NCCL's tuner picks, and
the time is NCCL's own cost model (its channels, latencies and protocol
efficiencies, from NCCL's source) carried onto those links; --explain prints
NCCL's tuning table. Accuracy against published nccl-tests runs:
docs/nccl-accuracy.md.

Bandwidths follow nccl-tests: algbw = size / time; busbw = algbw x a factor
(2(n-1)/n for all-reduce, (n-1)/n for all-gather and reduce-scatter, 1 for
broadcast) that makes it comparable to a link's speed whatever the rank count.
For all-gather and reduce-scatter, --size is the total of all ranks' chunks.

examples:
  parsim collective all-reduce --cluster dgx-h100 --gpus 8 --size 1GiB --explain
  parsim collective all-reduce --cluster dgx-h100 --nodes 64 --size 1GiB
  parsim collective all-reduce --cluster dgx-a100 --gpus 8 --size 16MiB --algorithm ring --protocol Simple
  parsim collective reduce-scatter --gpus 8 --sweep 1KiB:8GiB --plot bw.png
  parsim collective all-to-all --cluster hgx-h800 --nodes 8 --size 236MiB --deepep 8,256,4 --explain

--deepep K,E[,M] times an expert all-to-all as DeepEP's kernels run it: tokens
routed to K of E experts (on at most M nodes), each crossing the network once
per node it reaches, then NVLink to its experts' GPUs; --size is the plain
all-to-all's buffer (tokens x K rows). Accuracy against DeepEP's published
bandwidths: docs/nccl-accuracy.md.
"""


DEFAULT_SIZE = "1GiB"
SHARDED = ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")  # a shard of the buffer per rank


def register(subparsers) -> None:
    ops = ", ".join(op.replace("_", "-") for op in OPERATIONS)
    p = subparsers.add_parser("collective", help="predict a collective's time and bandwidth",
                              description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("op", nargs="?", default="all-reduce", help=f"operation ({ops}); default all-reduce")
    add_cluster_args(p)
    p.add_argument("--size", help=f"message size, e.g. 4096, 512MB, 1GiB (default {DEFAULT_SIZE})")
    p.add_argument("--sweep", metavar="MIN:MAX[:FACTOR]", help="a table over sizes, e.g. 1KiB:8GiB")
    p.add_argument("--algorithm", default="auto", choices=("auto",) + ALGORITHMS,
                   help="force an algorithm (default: the fastest NCCL would pick)")
    p.add_argument("--protocol", default="auto", choices=("auto", "LL", "LL128", "Simple"),
                   help="force NCCL's protocol (clusters with an nccl: section; default: the tuner's pick)")
    p.add_argument("--deepep", metavar="K,E[,M]", type=_routing,
                   help="all-to-all: DeepEP's dispatch of tokens routed to K of E experts on at most M nodes "
                        "(DeepSeek-V3: 8,256,4)")
    p.add_argument("--explain", action="store_true", help="walk through the arithmetic step by step")
    p.add_argument("--plot", metavar="PNG", help="with --sweep: save bandwidth against size")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    op = canonical_op(args.op)
    if args.plot is not None and not args.sweep:
        raise ParsimError("--plot draws bandwidth against size: it needs --sweep")
    if args.size is not None and args.sweep is not None:
        raise ParsimError(f"--size {args.size} and --sweep {args.sweep}: give one size or a sweep of them")
    check_outputs(args, pictures=("--plot",))
    topo, gpus = topology_from_args(args)
    if gpus < 2:
        raise ParsimError(f"{op.replace('_', '-')} on 1 GPU moves nothing between GPUs: give --gpus 2 or more")
    group = _send_pair(topo) if op == "send_recv" else np.arange(gpus)
    if args.sweep is not None:
        sizes = parse_size_range(args.sweep)
        check_buffer(sizes[-1], topo.spec)
        progress, predictions = OpsProgress(f"predicting {op.replace('_', '-')}", unit="sizes"), []
        try:
            for size in sizes:
                progress(len(predictions), len(sizes))
                predictions.append(predict(topo, op, size, group, args.algorithm, protocol=args.protocol,
                                           routing=args.deepep))
        finally:
            progress.close()
        if args.json:
            print_json("collective", {"results": [p.result().to_dict() for p in predictions]})
        else:
            print(sweep_table(predictions, topo.spec.name))
        if args.plot:
            from ..report.plots import plot_bandwidth

            plot_bandwidth({"simulated": [p.result() for p in predictions]}, args.plot,
                           title=f"{op.replace('_', '-')} on {len(group)} GPUs of {topo.spec.name}")
            print(f"wrote {args.plot}", file=sys.stderr)
        return 0
    size = parse_size(DEFAULT_SIZE if args.size is None else args.size)  # --size '' is an error, not the default
    if op in SHARDED and size % gpus:
        raise ParsimError(f"--size {args.size}: {op.replace('_', '-')} splits its buffer into one shard per GPU, "
                          f"and {size:,} bytes do not split evenly over {gpus}: give a multiple of {gpus} bytes")
    check_buffer(size, topo.spec)
    prediction = predict(topo, op, size, group, args.algorithm, protocol=args.protocol, routing=args.deepep)
    if args.json:
        row = prediction.result().to_dict()
        row["phases"] = [vars(p) for p in prediction.phases]
        print_json("collective", {"results": [row]})
    elif args.explain:
        print(explain(prediction, topo))
    else:
        print(summary(prediction, topo))
    return 0


def _send_pair(topo) -> np.ndarray:
    """A send/recv's two GPUs: the first two of a node (over the fabric), or, given two nodes or more, the first
    GPU of each of the first two (over their NICs: a pipeline's transfer between nodes)."""
    return np.array([0, topo.gpus_per_node if topo.nodes > 1 else 1])


def _routing(text: str) -> TokenRouting:
    """``K,E[,M]``: top-K of E experts, on at most M nodes."""
    parts = text.split(",")
    if len(parts) not in (2, 3) or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give K,E or K,E,M (top-K of E experts on at most M nodes), "
                                         f"e.g. 8,256,4")
    k, experts, nodes = (int(p) for p in parts + ["0"] * (3 - len(parts)))
    if not 1 <= k <= experts:
        raise argparse.ArgumentTypeError(f"{text!r}: K must be from 1 to E")
    if len(parts) == 3 and nodes < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: M, the nodes a token may reach, is at least 1 (leave it out "
                                         f"for no limit)")
    return TokenRouting(k, experts, nodes)


def summary(prediction, topo) -> str:
    r = prediction.result()
    name = prediction.op.replace("_", "-")
    lines = [
        f"{name} of {format_size(r.size_bytes)} on {r.nranks} GPUs of {topo.spec.name} ({topo.nodes} node(s))",
        f"  time        {format_time(r.time_s)}",
        f"  algbw       {r.algbw_Bps / 1e9:.1f} GB/s   (size / time)",
        f"  busbw       {r.busbw_Bps / 1e9:.1f} GB/s   "
        f"(algbw x {r.busbw_Bps / r.algbw_Bps:.3g}, " + (
            "as for the plain all-to-all's buffer: DeepEP sends fewer copies, so this can pass link speed)"
            if prediction.routing is not None else "comparable to link speed)"),
        f"  algorithm   {_algorithm(prediction)}" + _candidates(prediction),
        f"  bottleneck  {r.extra['bottleneck'] or '-'}",
        f"  lower bound {format_time(prediction.lower_bound_s)}: {prediction.lower_bound_reason}",
        f"  reached     {prediction.lower_bound_s / r.time_s:.0%} of the lower bound's speed (bound / time)",
        "run with --explain for the arithmetic step by step",
    ]
    return "\n".join(lines)


def _algorithm(prediction) -> str:
    """The algorithm, with NCCL's name, protocol and channels where NCCL's model timed it."""
    c = prediction.nccl
    if c is None:
        return prediction.algorithm
    return (f"{prediction.algorithm} (NCCL {c.chosen.algo}, protocol {c.chosen.proto}, "
            f"{c.channels}/{c.max_channels} channels)")


def _candidates(prediction) -> str:
    if not prediction.candidates:
        return ""
    ranked = sorted(prediction.candidates.items(), key=lambda kv: kv[1])
    others = ", ".join(f"{a} {format_time(t)}" for a, t in ranked[:4])
    more = f", +{len(ranked) - 4} more" if len(ranked) > 4 else ""
    what = "NCCL's tuning table" if prediction.nccl is not None else "fastest of"
    return f"\n              ({what}: {others}{more}; --explain lists them)"


def sweep_table(predictions, cluster: str) -> str:
    results = [p.result() for p in predictions]
    size, size_scale = size_unit(r.size_bytes for r in results)
    time, time_scale = time_unit(r.time_s for r in results)
    rows = [[r.size_bytes / size_scale, r.size_bytes, r.time_s / time_scale, round(r.algbw_Bps / 1e9, 2),
             round(r.busbw_Bps / 1e9, 2), p.algorithm, p.protocol or "-"] for p, r in zip(predictions, results)]
    first = predictions[0]
    title = f"{first.op.replace('_', '-')} on {first.nranks} GPUs of {cluster} (simulated)"
    return render_table([f"size ({size})", "bytes", f"time ({time})", "algbw GB/s", "busbw GB/s", "algorithm",
                         "protocol"], rows, title)
