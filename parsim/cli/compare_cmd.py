"""``parsim compare``: prediction and measurement side by side."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..calibrate.compare_collectives import compare_collectives, median_abs_error
from ..errors import ParsimError
from ..hardware.cluster import ClusterSpec, load_cluster
from ..report.jsondoc import print_json
from ..report.results import canonical_op, load_results, save_results
from ..report.table import render_table
from ..units import format_size, parse_size, parse_size_range, size_unit, time_unit
from .common import check_outputs, progress, warn_other_machine
from .plan_cmd import add_plan_args

HELP = """\
Run the executor and the simulator on the same thing and show how far apart they are.

  collectives:  parsim compare all-reduce --cluster my-host.yaml --nproc 2 --sweep 1MiB:64MiB
  a plan:       parsim compare course-pp --cluster my-host.yaml --nproc 2 --trace both.json
                parsim compare course-ddp --dp 2 --cluster my-host.yaml --nproc 2   (plan overrides)
  a profile:    parsim compare course-ddp --cluster my-host.yaml --measured profiles/

The cluster file should describe the machine that measures: write one with
`parsim calibrate` (my-host.yaml by default).

  * collectives: error = predicted / measured - 1 per size, and the median
    |error| over the sizes;
  * a plan run here: the median of its measured steps (--steps), each rank's
    phases (forward, backward, optimizer, each group's communication, idle)
    each its median over the steps beside the least and most one step spent
    on it, and, where a pipeline stage has several ranks, each phase's mean
    over them; with more ranks than cores, ranks on one core take turns as the
    kernel's scheduler runs them;
  * the host's speed: the calibration's probes (matmul, eager pass, memory, a
    collective) are timed again around the measured work, and the prediction
    follows them (--no-speed-probe: at the calibration's speed);
  * --measured reads a measurement instead of running: for a collective, a
    JSON file from `parsim bench --out` (or --save-measured); for a plan, a
    folder of torch.profiler traces of any run of it, one per rank.
Options that do not apply to the target are refused. Every rule, and how
accurate the comparison is on the hosts measured so far: docs/calibration.md
("parsim compare, in full", and "Measured accuracy").
"""


DEFAULT_SWEEP = "1MiB:64MiB"
COLLECTIVE_ONLY = ("sweep", "size", "save_measured", "plot")
# Measured steps of a plan run here, by default: a CPU rank's idle swings from step to step with which rank
# ended last, and the median of 10 steadied it (docs/calibration.md, sets BS and BT); a step more costs one
# step's time, after seconds of start-up.
COMPARE_STEPS = 10
PLAN_ONLY = ("steps", "trace", "no_speed_probe")
# Nothing to run with --measured: how to run, and (collectives) which sizes, come from the measurement.
RUN_ONLY = ("nproc", "backend", "steps", "timeout", "save_measured", "no_speed_probe", "sweep", "size")


HOST_FILE = "my-host.yaml"  # parsim calibrate's default --out


def host_cluster(name: str) -> ClusterSpec:
    """The cluster ``--cluster`` names; the default file, missing, is one line on how to write it."""
    if name == HOST_FILE and not Path(name).exists():
        raise ParsimError(f"no {HOST_FILE} here to describe this machine: write it with `parsim calibrate`, or give "
                          f"--cluster NAME|FILE")
    return load_cluster(name)


def register(subparsers) -> None:
    p = subparsers.add_parser("compare", help="predicted vs measured, side by side",
                              description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="a collective (all-reduce, ...) or a plan (name or YAML file)")
    p.add_argument("--cluster", default=HOST_FILE, metavar="NAME|FILE",
                   help=f"cluster file describing the measuring machine (default {HOST_FILE}, what parsim "
                        f"calibrate writes)")
    p.add_argument("--nproc", type=int, help="ranks to run (default 2 for collectives, the plan's world for plans)")
    p.add_argument("--sweep", help=f"collectives: sizes (default {DEFAULT_SWEEP})")
    p.add_argument("--size", help="collectives: one size instead of a sweep")
    p.add_argument("--measured", metavar="JSON|DIR",
                   help="a measurement instead of running: collectives, a `bench --out` JSON file; plans, a folder "
                        "of torch.profiler traces (one per rank)")
    p.add_argument("--save-measured", metavar="JSON", help="collectives: save what was measured")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), help="auto, gloo or nccl (default auto)")
    p.add_argument("--steps", type=int,
                   help="plans: measured steps; the median step, and each phase's median, are used "
                        f"(default {COMPARE_STEPS})")
    p.add_argument("--trace", metavar="DIR|FILE.json",
                   help="plans: predicted and measured traces, a folder of per-rank Kineto files each or one "
                        "merged .json file")
    p.add_argument("--no-speed-probe", action="store_true",
                   help="plans on a calibrated CPU host: predict at the calibration's speed (by default the "
                        "host-speed probe runs before the warm-up and after the measured steps, and the compute "
                        "figures follow it)")
    p.add_argument("--plot", metavar="PNG", help="collectives: busbw against size, both lines")
    p.add_argument("--timeout", type=float, default=None, help="seconds before a stuck run is stopped")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    add_plan_args(p, positional=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_outputs(args, files=("--save-measured",), pictures=("--plot",), traces=("--trace",))
    try:
        op = canonical_op(args.target)
    except ParsimError:
        op = None
    _refuse(args, COLLECTIVE_ONLY if op is None else PLAN_ONLY + args.plan_overrides,
            "a collective" if op is None else "a plan")
    if args.measured:
        _refuse(args, RUN_ONLY, "a run (not with --measured)")
    if op is None:
        from .compare_plan import compare_plan_command

        return compare_plan_command(args)
    return _collectives(args, op)


def _probe_us(curve) -> str:
    return " / ".join(f"{s * 1e6:.0f}" for _, s in curve)


def _probe_json(spec) -> dict | None:
    """The collective probe at calibration and around the sweep, microseconds by KiB (None: not timed)."""
    if not spec.collective_probe_now_s:
        return None
    return {"calibrated_us": {kib: s * 1e6 for kib, s in spec.collective_probe_s},
            "measured_us": {kib: s * 1e6 for kib, s in spec.collective_probe_now_s}}


def _refuse(args: argparse.Namespace, names: tuple[str, ...], target: str) -> None:
    """One line naming the options given that apply only to something else."""
    given = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n, None) is not None
             and getattr(args, n) is not False]  # 0 is given (0 == False would hide it)
    if given:
        raise ParsimError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to {target}, "
                          f"not to {args.target}")


def _collectives(args: argparse.Namespace, op: str) -> int:
    spec = host_cluster(args.cluster)
    if args.measured is not None:
        measured = [r for r in load_results(args.measured) if r.op == op]
        if not measured:
            raise ParsimError(f"{args.measured} holds no {op.replace('_', '-')} measurements")
    else:
        from executor.collectives import measure_collectives
        from executor.launch import resolve_backend
        from executor.speed_probe import measure_collective_probe, median_reading

        sizes = ([parse_size(args.size)] if args.size is not None
                 else parse_size_range(DEFAULT_SWEEP if args.sweep is None else args.sweep))
        nproc = 2 if args.nproc is None else args.nproc
        probing = spec.collective_probe_s is not None and resolve_backend(args.backend or "auto", nproc) == "gloo"
        readings = []
        if probing:  # the host's transfers have slow spells: the probe before and after the sweep
            progress("timing the collective probe")
            readings += measure_collective_probe(1)
        progress(f"measuring {op.replace('_', '-')} on {nproc} ranks")
        measured = measure_collectives(op, sizes, nproc, args.backend or "auto", timeout_s=args.timeout,
                                       progress=True)
        if probing:
            progress("timing the collective probe again")
            readings += measure_collective_probe(1)
            spec = spec.at_collective_probe(median_reading(readings))
        warn_other_machine(spec, measured[0].backend)
        if args.save_measured:
            save_results(args.save_measured, measured, {"op": op, "nproc": nproc})
    nranks = max(m.nranks for m in measured)
    nodes = spec.nodes_for(gpus=nranks) if nranks > spec.gpus_per_node else 1
    rows = compare_collectives(spec.build(nodes), measured)
    mae = median_abs_error(rows)
    if args.json:
        print_json("compare.collective", {"op": op, "cluster": spec.name, "median_abs_error": mae,
                    "collective_probe": _probe_json(spec),
                    "rows": [{"size_bytes": r.measured.size_bytes, "nranks": r.measured.nranks,
                              "measured_s": r.measured.time_s, "predicted_s": r.predicted.time_s,
                              "algorithm": r.predicted.algorithm, "error": r.error} for r in rows]})
    else:
        size, size_scale = size_unit(r.measured.size_bytes for r in rows)
        time, time_scale = time_unit([r.measured.time_s for r in rows] + [r.predicted.time_s for r in rows])
        counts = sorted({r.measured.nranks for r in rows})
        several = len(counts) > 1  # a file of several rank counts: a column for them
        table = [[*([r.measured.nranks] if several else []), r.measured.size_bytes / size_scale,
                  r.predicted.time_s / time_scale, r.measured.time_s / time_scale,
                  r.predicted.busbw_Bps / 1e9, r.measured.busbw_Bps / 1e9, f"{r.error:+.1%}"]
                 for r in rows]
        ranks = " and ".join(map(str, counts))
        print(render_table([*(["ranks"] if several else []), f"size ({size})", f"predicted ({time})",
                            f"measured ({time})", "busbw pred (GB/s)", "busbw meas (GB/s)", "error"], table,
                           title=f"{op.replace('_', '-')} on {ranks} ranks: predicted ({spec.name}, "
                                 f"{rows[0].predicted.algorithm}) vs measured ({measured[0].backend}); "
                                 "error = predicted / measured - 1"))
        print(f"median |error| {mae:.1%} over {len(rows)} "
              f"{'measurements' if several or len({r.measured.size_bytes for r in rows}) < len(rows) else 'sizes'}")
        if spec.collective_probe_now_s:
            print(f"the collective probe around the sweep took {_probe_us(spec.collective_probe_now_s)} against "
                  f"{_probe_us(spec.collective_probe_s)} us at calibration (an all-reduce on 2 ranks at "
                  f"{' / '.join(format_size(kib * 1024) for kib, _ in spec.collective_probe_s)}): each prediction "
                  "takes what it took more per byte at the size's bus bytes")
    if args.plot:
        from ..report.plots import plot_bandwidth

        plot_bandwidth({"measured": [r.measured for r in rows], "predicted": [r.predicted for r in rows]},
                       args.plot, title=f"{op.replace('_', '-')} on {nranks} ranks")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
