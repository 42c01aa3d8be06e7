"""Arguments and output helpers shared by several subcommands."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..errors import ParsimError
from ..hardware.cluster import ClusterSpec, builtin_clusters, load_cluster
from ..hardware.topology import Topology
from ..lowering.eager_ops import held_ops
from ..report.table import render_table
from ..sim.cores import core_of
from ..units import decimal_unit, format_size, format_time
from ..workload.memory import Memory
from ..workload.plan import Plan

DEFAULT_CLUSTER = "dgx-h100"
PLAN_CLUSTER_HELP = f"cluster (default: the one the plan names with cluster:, else {DEFAULT_CLUSTER})"


def plan_cluster(given: str | None, plan: Plan) -> ClusterSpec:
    """The cluster ``--cluster`` names, else the one the plan was written for (its ``cluster:``), else
    :data:`DEFAULT_CLUSTER`."""
    return load_cluster(given or plan.cluster or DEFAULT_CLUSTER)


def add_cluster_args(parser: argparse.ArgumentParser, default: str | None = DEFAULT_CLUSTER) -> None:
    names = ", ".join(sorted(builtin_clusters()))
    parser.add_argument("--cluster", default=default, metavar="NAME|FILE",
                        help=f"built-in cluster ({names}) or a cluster YAML file (default: "
                             f"{default or 'none, the plan without the links its groups cross'})")
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


def check_buffer(size: int, spec: ClusterSpec) -> None:
    """A collective's buffer must hold something and fit in one GPU's memory (every operation keeps
    at least its whole buffer on some rank: the output of all-gather, the input of reduce-scatter)."""
    if size <= 0:
        raise ParsimError(f"size {size} B: a collective moves at least one byte")
    if size > spec.gpu.hbm_capacity_bytes:
        raise ParsimError(f"size {format_size(size)} does not fit in one GPU's memory on {spec.name} "
                          f"({spec.gpu.hbm_capacity_bytes / 1e9:g} GB)")


def check_outputs(args: argparse.Namespace, files: tuple[str, ...] = (), pictures: tuple[str, ...] = (),
                  folders: tuple[str, ...] = (), traces: tuple[str, ...] = ()) -> None:
    """Refuse, before any work, output paths of ``args`` that cannot be written.

    ``files``, ``pictures``, ``folders`` and ``traces`` name flags (``"--trace"``); pictures must also
    end in a format matplotlib writes; a folder may not exist yet (it is made); a trace is a folder
    (one file per rank) or, named ``*.json``, one file. Unset flags are skipped.
    """
    for flag in files + pictures + folders + traces:
        path = getattr(args, flag.lstrip("-").replace("-", "_"))
        if path is None:
            continue
        if flag in traces and Path(path).suffix not in ("", ".json") and not Path(path).is_dir():
            raise ParsimError(f"{flag} {path}: name a .json file (one merged trace) or a folder without an "
                              f"extension (a file per rank)")
        if flag in folders or (flag in traces and not path.endswith(".json")):
            _check_folder(path, flag)
            continue
        _check_writable(path, flag)
        if flag in pictures:
            from matplotlib.backend_bases import FigureCanvasBase

            formats = FigureCanvasBase.get_supported_filetypes()
            if Path(path).suffix.lstrip(".").lower() not in formats:
                raise ParsimError(f"{flag} {path}: not a picture name (end it in .{', .'.join(sorted(formats))})")


def _check_folder(path: str, flag: str) -> None:
    """A folder that exists, or can be made under the nearest folder that does."""
    if not path.strip():
        raise ParsimError(f"{flag}: the path is empty")
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ParsimError(f"{flag} {path}: is a file (give a folder)")
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        raise ParsimError(f"{flag} {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK):
        raise ParsimError(f"{flag} {path}: {existing} is not writable")


def _check_writable(path: str, flag: str) -> None:
    target = Path(path)
    if not path.strip():
        raise ParsimError(f"{flag}: the path is empty")
    if target.is_dir():
        raise ParsimError(f"{flag} {path}: is a directory (give a file name)")
    if not target.parent.is_dir():
        raise ParsimError(f"{flag} {path}: {target.parent} is not a folder")
    if not os.access(target.parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ParsimError(f"{flag} {path}: not writable")
    if not target.exists():  # (root passes os.access anywhere: /proc says yes and then refuses the file)
        try:
            target.touch()
        except OSError as e:
            raise ParsimError(f"{flag} {path}: cannot be written ({e.strerror})") from None
        target.unlink()


def progress(message: str) -> None:
    """One progress line on stderr when it is a terminal (pipes and CI logs stay clean; stdout always)."""
    if sys.stderr.isatty():
        print(message, file=sys.stderr, flush=True)


def note(message: str) -> None:
    """A line on stderr that matters after the run too (a warning), wherever stderr goes."""
    print(message, file=sys.stderr, flush=True)


def note_unmeasured_matmuls(command: str, cluster: ClusterSpec, dtype: str) -> None:
    """Say so when the cluster file has no measured matmul rate for ``dtype`` (fp32 on a GPU, say)."""
    if cluster.lacks_matmul_rate(dtype):
        peak = cluster.gpu.peak_flops.get(dtype, 0.0) / 1e12
        note(f"parsim {command}: note: {cluster.name} gives no measured {dtype} matmul rate, so {dtype} matmuls run "
             f"at {cluster.matmul_efficiency:.0%} of the {peak:g} TFLOP/s peak: an upper bound (MFU may read above "
             f"what the GPU reaches); add compute.matmul_efficiency.{dtype} to the cluster file")


def warn_other_machine(cluster: ClusterSpec, backend: str) -> None:
    """Warn (``note``) when a comparison's cluster file and its run describe different machines: a GPU
    cluster against gloo on this machine's CPUs, or a CPU host's calibration against NCCL on GPUs."""
    if backend == "gloo" and not cluster.describes_cpu_host:
        note(f"parsim compare: warning: {cluster.name} describes GPUs, but the run measures gloo on this "
             "machine's CPUs; for a like-for-like comparison, describe this host: parsim calibrate --out my-host.yaml")
    elif backend == "nccl" and cluster.describes_cpu_host:
        note(f"parsim compare: warning: {cluster.name} describes a CPU host, but the run measures NCCL on GPUs; "
             "calibrate on this GPU host for a like-for-like comparison: parsim calibrate --out gpu-host.yaml")


# Eager PyTorch's host time per op on a GPU host, to the nearest order: 9.2 to 17 us measured per forward or
# backward op on two GPU hosts by `parsim calibrate --ranks 1` (docs/kernel-model.md). Only for note_launch_bound.
HOST_OP_S = 10e-6


def note_launch_bound(command: str, plan, cluster: ClusterSpec, step_s: float) -> None:
    """On a GPU cluster without host costs, say so when a plan's kernels are too short to hide the host: issuing
    its eager ops at about HOST_OP_S each would take longer than the step predicted, which leaves the host out."""
    if cluster.describes_cpu_host or cluster.op_forward_s or cluster.op_backward_s:
        return
    ops = sum(sum(held_ops(block.eager_ops, block.eager_ops_per_expert, plan.experts_per_rank, plan.ep > 1))
              for stage in range(plan.num_stages) for cost in plan.stage_costs(stage)
              for block in cost.blocks) * plan.num_microbatches // plan.pp
    if ops * HOST_OP_S > step_s:
        note(f"parsim {command}: note: the plan's kernels are too short to hide the host on {cluster.name}: "
             f"issuing its ~{ops:,} eager ops per step takes about {format_time(ops * HOST_OP_S)} at "
             f"{HOST_OP_S * 1e6:g} us each, against {format_time(step_s)} predicted without the host; "
             "parsim calibrate --ranks 1 on the GPU host measures it (docs/kernel-model.md)")


# What the executor's transformer runs (executor/train/models.py), as the model keys that price it: plain eager
# PyTorch layers with no biases, torch's cross-entropy, and causal attention by scaled_dot_product_attention with
# no dropout.
EXECUTOR_KERNELS = {"layer_kernels": "eager", "cross_entropy": "torch", "attention_kernel": "flash", "dropout": 0.0,
                    "linear_bias": False}


def note_executor_kernels(plan) -> None:
    """Say so when a transformer plan prices other work than the executor ran (:data:`EXECUTOR_KERNELS`): a plan's
    defaults price Megatron-LM's fused kernels, and a model may give unfused attention, dropout or linear biases,
    which the executor does not run. On any backend: a CPU's calibrated elementwise speed is per byte, and
    eager RMSNorm moves several times a fused one's bytes."""
    model = plan.model
    if getattr(model, "kind", "") != "transformer":
        return
    keys = [k for k, ran in EXECUTOR_KERNELS.items() if getattr(model, k) != ran]
    if keys:
        pairs = [f"{k}: {getattr(model, k)}" for k in keys]
        priced = " and ".join([", ".join(pairs[:-1]), pairs[-1]] if len(pairs) > 1 else pairs)
        ran = ", ".join(f"{k}: {EXECUTOR_KERNELS[k]}" for k in keys)
        note(f"parsim compare: note: {plan.name} prices {priced}, but the executor ran {ran}; to price what ran, "
             "set those in its model (docs/plans.md)")


def note_stages_sharing_cores(command: str, plan, cluster: ClusterSpec) -> None:
    """Say so when a pipeline hands activations between two stages that take turns on one CPU core (a rank order
    with ``pp`` innermost, on a host with fewer cores than ranks): each hand-off then passes between two processes
    on that core, which the model times poorly (docs/calibration.md, "Ranks taking turns on a core")."""
    pp = plan.pp
    hands_on = [(s, s + 1) for s in range(pp - 1)] + ([(pp - 1, 0)] if plan.virtual_stages > 1 else [])
    for ranks in plan.groups("pp"):  # each pipeline's ranks, stage by stage
        for sender, receiver in hands_on:
            core = core_of(ranks[sender], cluster.gpus_per_node, cluster.cpu_cores)
            if core == core_of(ranks[receiver], cluster.gpus_per_node, cluster.cpu_cores):
                note(f"parsim {command}: note: pipeline stages {sender} and {receiver} (ranks {ranks[sender]} and "
                     f"{ranks[receiver]}) take turns on core {core[1]}, so each activation passes between two "
                     "processes on one core, which the model times too fast (by 30-38% in this project's runs: "
                     "docs/calibration.md, \"Ranks taking turns on a core\")")
                return


class OpsProgress:
    """``simulating: 123,456 / 658,883 ops (18%)`` redrawn in place on a terminal's stderr.

    Silent when stderr is not a terminal (pipes, CI logs), so scripted output stays clean.
    Call it as ``progress(finished, total)``; :meth:`close` erases the line.
    """

    def __init__(self, label: str = "simulating", stream=None, unit: str = "ops"):
        self.label, self.stream, self.unit = label, stream or sys.stderr, unit
        self.active = self.stream.isatty()
        self.shown = False

    def __call__(self, finished: int, total: int) -> None:
        self.show(f"{self.label}: {finished:,} / {total:,} {self.unit} ({finished / max(total, 1):.0%})")

    def show(self, text: str) -> None:
        """Redraw the line as ``text`` (on a terminal only)."""
        if self.active:
            self.stream.write(f"\r\033[K{text}")
            self.stream.flush()
            self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()


def memory_table(ranks: list[Memory], capacity: float, title: str) -> str:
    """Memory per GPU of each pipeline rank against the GPU's capacity, in GB, or in MB or kB where the largest
    rank holds less than one of the larger unit (a tiny model's would read 0.00 GB). A split schedule's
    microbatches still waiting for their weight gradient count beside those in flight (``3 + 5 W``)."""
    unit, scale = decimal_unit(max((m.total for m in ranks), default=0.0), "B")
    rows = [[f"pp {m.pp_rank}", *(f"{v / scale:.2f}" for v in (m.weights, m.gradients, m.optimizer, m.activations)),
             _microbatches_held(m), f"{m.buffers / scale:.2f}", f"{m.total / scale:.2f}",
             "ok" if m.total <= capacity else "OVER"] for m in ranks]
    table = render_table(["stage", "weights", "grads", "optimizer", "activations", "mb in flight", "fsdp buffers",
                          f"total {unit}", f"fits {capacity / 1e9:g} GB"], rows, title=f"{title} ({unit})")
    if any(m.waiting for m in ranks):
        table += ("\nmb in flight: microbatches between their forward and backward when activations peak, + W: "
                  "those whose deferred weight gradient still waits (each keeps its linears' inputs and output grads)")
    return table


def _microbatches_held(m: Memory) -> str:
    """The microbatches whose activations the column beside counts: at the peak, in flight (+ waiting for W)."""
    return f"{m.in_flight_at_peak} + {m.waiting} W" if m.waiting else str(m.in_flight_at_peak)


def expert_load_text(load: dict) -> str:
    """The measured routing (:func:`executor.train.measure.measured_expert_load`), and with ``assumed`` what the
    prediction took and what it gives at the measured load."""
    text = (f"expert load: the busiest expert got {load['busiest_over_mean']:.2f}x the mean (median over "
            f"{load['forwards']} MoE layer forwards, at most {load['most']:.2f}x)")
    if "assumed" in load:
        text += (f"; the prediction assumes {load['assumed']:g}x (--expert-load), and at the measured load "
                 f"predicts {format_time(load['predicted_step_s_at_measured'])}")
    return text
