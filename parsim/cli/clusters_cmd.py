"""``parsim clusters``: the built-in clusters and their key figures."""

from __future__ import annotations

import argparse
from dataclasses import asdict

from ..errors import ParsimError
from ..hardware.cluster import ClusterSpec, builtin_clusters, load_cluster
from ..report.jsondoc import print_json
from ..report.table import render_table

HELP = """\
List the built-in clusters with their key figures, or show one cluster file.

Every figure in a built-in file names its public source in a comment; a file
of your own (same keys, see docs/clusters.md) works anywhere a built-in name
does, e.g. the one `parsim calibrate` writes.

examples:
  parsim clusters
  parsim clusters dgx-h100 --nodes 4
  parsim clusters my-host.yaml --json
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("clusters", help="list built-in clusters and their key figures",
                              description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cluster", nargs="?", metavar="NAME|FILE", help="show one cluster in detail")
    p.add_argument("--nodes", type=int, help="with a cluster: place it on this many nodes (default 1)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.cluster is not None:
        spec = load_cluster(args.cluster)
        if args.json:
            print_json("clusters", {"clusters": [asdict(spec)]})
        else:
            print(describe(spec, spec.nodes_for(1 if args.nodes is None else args.nodes)))
        return 0
    if args.nodes is not None:
        raise ParsimError(f"--nodes {args.nodes} sizes one cluster: name it (parsim clusters dgx-h100 --nodes "
                          f"{args.nodes})")
    specs = [load_cluster(name) for name in sorted(builtin_clusters())]
    if args.json:
        print_json("clusters", {"clusters": [asdict(s) for s in specs]})
        return 0
    rows = [row(s) for s in specs]
    print(render_table(["name", "GPU", "GPUs/node", "bf16 TFLOP/s", "HBM GB", "HBM TB/s", "intra-node",
                        "GB/s/dir", "NICs x Gb/s", "in-switch"], rows))
    return 0


def row(s: ClusterSpec) -> list:
    return [
        s.name, s.gpu.model, s.gpus_per_node, round(s.gpu.peak_flops.get("bf16", 0) / 1e12, 1),
        round(s.gpu.hbm_capacity_bytes / 1e9), round(s.gpu.hbm_bw_Bps / 1e12, 2), s.intra.fabric,
        round(s.intra.bw_Bps / 1e9), f"{s.scale_out.nics_per_node} x {s.scale_out.nic_bw_Bps * 8 / 1e9:.0f}",
        "yes" if s.intra.in_switch_reduction else "no",
    ]


def describe(spec: ClusterSpec, nodes: int) -> str:
    topo = spec.build(nodes)
    g = topo.graph
    so = spec.scale_out
    peak = ", ".join(f"{d} {f / 1e12:g}" for d, f in spec.gpu.peak_flops.items())
    lines = [
        f"{spec.name}: {spec.description}",
        f"  file        {spec.source}",
        f"  GPU         {spec.gpu.model}: {peak} TFLOP/s (dense); HBM {spec.gpu.hbm_capacity_bytes / 1e9:g} GB "
        f"at {spec.gpu.hbm_bw_Bps / 1e9:g} GB/s",
        f"  intra-node  {spec.gpus_per_node} GPUs on {spec.intra.fabric}, {spec.intra.bw_Bps / 1e9:g} GB/s per "
        f"direction per GPU, {spec.intra.latency_s * 1e6:g} us per step"
        + (", in-switch reduction" if spec.intra.in_switch_reduction else ""),
        f"  scale-out   {so.nics_per_node} NICs x {so.nic_bw_Bps * 8 / 1e9:g} Gb/s per node, rail-optimized leaves "
        f"of {so.nodes_per_leaf} nodes, oversubscription {so.oversubscription:g}:1, "
        f"{so.latency_s * 1e6:g} us NIC to NIC (+{so.spine_hop_latency_s * 1e6:g} us per spine hop)",
        f"  kernels     {_kernel_rates(spec)}",
        f"  reduction   {spec.reduction_bw_Bps / 1e9:g} GB/s per GPU",
        f"  on {nodes} node(s): {topo.num_gpus} GPUs, graph of {g.number_of_nodes()} vertices and "
        f"{g.number_of_edges()} directed links",
    ]
    if spec.algorithms:
        lines.append("  algorithms  " + ", ".join(f"{op}: {alg}" for op, alg in spec.algorithms.items()))
    return "\n".join(lines)


def _kernel_rates(spec: ClusterSpec) -> str:
    """The kernel model's figures for this GPU (parsim.sim.compute): matmuls' best fraction of peak, memory-bound
    kernels' of HBM, attention's at its longest length, and the SMs that price arithmetic-heavy kernels."""
    matmul = ", ".join(f"{d} {spec.matmul_efficiency_for(d):.3g}" for d in spec.gpu.peak_flops
                       if d in spec.matmul_efficiency_by_dtype) or f"{spec.matmul_efficiency:.3g}"
    forward, backward = (curve[-1][1] for curve in spec.attention_efficiency)
    longest = spec.attention_efficiency[0][-1][0]
    sms = (f"; {spec.gpu.sm_count} SMs at {spec.gpu.sm_clock_Hz / 1e6:,.0f} MHz for softmax, dropout, GeLU, norms "
           "and bias adds"
           if spec.gpu.sm_cycles_per_s else "")
    return (f"matmuls {matmul} of peak; memory-bound {spec.memory_efficiency:.3g} of HBM; attention "
            f"{forward:.3g} forward, {backward:.3g} backward{f' at {longest:,} tokens' if longest else ''}{sms}")
