"""Arguments and output helpers shared by several subcommands."""

from __future__ import annotations

import argparse
import sys

from ..cluster import builtin_clusters, load_cluster
from ..memory import Memory
from ..table import render_table
from ..topology import Topology

DEFAULT_CLUSTER = "dgx-h100"


def add_cluster_args(parser: argparse.ArgumentParser, default: str | None = DEFAULT_CLUSTER) -> None:
    names = ", ".join(sorted(builtin_clusters()))
    parser.add_argument("--cluster", default=default, metavar="NAME|FILE",
                        help=f"built-in cluster ({names}) or a cluster YAML file (default: {default})")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--nodes", type=int, help="number of nodes (default: 1)")
    size.add_argument("--gpus", type=int, help="number of GPUs, in whole nodes (or fewer than one node)")


def topology_from_args(args: argparse.Namespace) -> tuple[Topology, int]:
    """The topology asked for, and how many of its GPUs take part."""
    spec = load_cluster(args.cluster)
    nodes = spec.nodes_for(args.nodes, args.gpus)
    topo = spec.build(nodes)
    gpus = args.gpus if args.gpus is not None else topo.num_gpus
    return topo, gpus


def progress(message: str) -> None:
    """One progress line on stderr, so stdout stays clean for tables and JSON."""
    print(message, file=sys.stderr, flush=True)


class OpsProgress:
    """``simulating: 123,456 / 658,883 ops (18%)`` redrawn in place on a terminal's stderr.

    Silent when stderr is not a terminal (pipes, CI logs), so scripted output stays clean.
    Call it as ``progress(finished, total)``; :meth:`close` erases the line.
    """

    def __init__(self, label: str = "simulating", stream=None):
        self.label, self.stream = label, stream or sys.stderr
        self.active = self.stream.isatty()
        self.shown = False

    def __call__(self, finished: int, total: int) -> None:
        if self.active:
            self.stream.write(f"\r{self.label}: {finished:,} / {total:,} ops ({finished / max(total, 1):.0%})")
            self.stream.flush()
            self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()


def memory_table(ranks: list[Memory], capacity: float, title: str) -> str:
    """Memory per GPU of each pipeline rank, in GB, against the GPU's capacity."""
    gb = 1e9
    rows = [[f"pp {m.pp_rank}", f"{m.weights / gb:.2f}", f"{m.gradients / gb:.2f}", f"{m.optimizer / gb:.2f}",
             f"{m.activations / gb:.2f}", m.in_flight, f"{m.buffers / gb:.2f}", f"{m.total / gb:.2f}",
             "ok" if m.total <= capacity else "OVER"] for m in ranks]
    return render_table(["stage", "weights", "grads", "optimizer", "activations", "in flight", "fsdp buffers",
                         "total GB", f"fits {capacity / gb:g} GB"], rows, title=title)
