"""Where a larger message takes less time: every built-in cluster, 1, 4 and 16 nodes, five collectives.

NCCL's tuner picks an algorithm and protocol as if every channel ran, then the
kernel drops channels for a small message (enqueue.cc), so the time can dip
where a channel count or a protocol steps up (docs/nccl-accuracy.md). Prints
the steepest dips over sizes from 1 KiB to 2 GiB in steps of sqrt(2), and how
many steps are over 10% faster than the size before.

Run:  python benchmarks/collective_size_dips.py [--top 12]
"""

from __future__ import annotations

import argparse

from parsim.hardware.cluster import builtin_clusters, load_cluster
from parsim.report.table import render_table
from parsim.sim.collectives import predict

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
SHARDED = ("all_gather", "reduce_scatter", "all_to_all")  # a shard per GPU: sizes rounded to whole shards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=12, help="dips shown (default 12)")
    args = parser.parse_args()
    steps = []
    for cluster in sorted(builtin_clusters()):
        for nodes in (1, 4, 16):
            topo = load_cluster(cluster).build(nodes)
            for op in OPS:
                before = None
                for k in range(43):
                    size = int(2 ** (10 + k / 2))
                    size -= size % topo.num_gpus if op in SHARDED else 0
                    if size == 0:
                        continue
                    p = predict(topo, op, size)
                    if before is not None:
                        steps.append((p.time_s / before[1], cluster, nodes, op, before[0], before[1], size, p))
                    before = (size, p.time_s)
    steps.sort(key=lambda s: s[0])
    rows = [[cluster, nodes, op, f"{small:,}", round(t_small * 1e6, 1), f"{size:,}", round(p.time_s * 1e6, 1),
             f"{ratio - 1:+.0%}", f"{p.nccl.chosen.name} {p.nccl.channels}/{p.nccl.max_channels}" if p.nccl else "-"]
            for ratio, cluster, nodes, op, small, t_small, size, p in steps[:args.top]]
    print(render_table(["cluster", "nodes", "op", "bytes", "us", "next bytes", "us", "change", "NCCL at next"], rows))
    print(f"\n{sum(s[0] < 0.9 for s in steps):,} of {len(steps):,} steps over 10% faster than the size before")


if __name__ == "__main__":
    main()
