"""Simulator wall time for one all-reduce against GPU count (8 to 16,384 GPUs).

Prints, per GPU count, the wall time to simulate one 1 GiB all-reduce with the
algorithm chosen automatically (which simulates every NCCL candidate) and with
the ring alone, plus the predicted time. Run:  python benchmarks/collective_scale.py
"""

from __future__ import annotations

import argparse
import time

from parsim.hardware.cluster import load_cluster
from parsim.report.table import render_table
from parsim.sim.collectives import predict
from parsim.units import format_time, parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", default="dgx-h100")
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--max-gpus", type=int, default=16384)
    args = parser.parse_args()
    spec = load_cluster(args.cluster)
    size = parse_size(args.size)
    rows = []
    gpus = spec.gpus_per_node
    while gpus <= args.max_gpus:
        topo = spec.build(gpus // spec.gpus_per_node)
        start = time.perf_counter()
        auto = predict(topo, "all_reduce", size)
        auto_wall = time.perf_counter() - start
        start = time.perf_counter()
        predict(topo, "all_reduce", size, algorithm="ring")
        ring_wall = time.perf_counter() - start
        rows.append([gpus, topo.nodes, auto.algorithm, format_time(auto.time_s),
                     f"{auto_wall:.3f}", f"{ring_wall:.3f}"])
        gpus *= 2
    print(render_table(["GPUs", "nodes", "chosen", "predicted", "wall s (auto)", "wall s (ring)"], rows,
                       title=f"all-reduce of {args.size} on {args.cluster}: simulator wall time"))


if __name__ == "__main__":
    main()
