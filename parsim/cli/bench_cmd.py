"""``parsim bench``: measure collectives on this machine, like nccl-tests.

The measuring lives in :mod:`executor.collectives` (torch is imported only
there, and only when a measurement starts); this module parses, checks the
input before any process is spawned, and prints.
"""

from __future__ import annotations

import argparse
import platform
import sys

from ..report.jsondoc import print_json
from ..report.results import OPERATIONS, CollectiveResult, busbw_factor, canonical_op, save_results
from ..units import parse_size, parse_size_range
from .common import check_outputs

DEFAULT_SWEEP = "1MiB:64MiB"
DEFAULT_NPROC = 2

HELP = """\
Measure collectives on this machine with torch.distributed, as nccl-tests does.

--nproc ranks are spawned here (gloo on CPUs; NCCL when there is a GPU per
rank). For each size: warm-up iterations, a barrier, then timed iterations
back to back. Each rank averages its iteration time; the time reported is the
slowest rank's average (nccl-tests -a 3; its default -a 1 takes the mean over
ranks, which --json keeps as extra.time_s_mean).

  algbw = size / time       how fast the buffer moved, from the user's side
  busbw = algbw x factor    2(n-1)/n for all-reduce; (n-1)/n for all-gather,
                            reduce-scatter, gather, scatter, all-to-all; 1 for
                            broadcast, reduce, send-recv. busbw is comparable
                            to one link's bandwidth whatever the rank count.

size is the whole buffer for all-reduce, broadcast, reduce and send-recv; the
total of all ranks' chunks for all-gather, reduce-scatter, gather, scatter and
all-to-all. Sizes are rounded down to whole float32 elements (per rank, for
the chunked operations). send-recv time is one-way: half a 0->1->0 round trip.

With gloo on one machine there is no network: ranks talk over loopback TCP,
so the numbers measure CPU cores, memcpy and the kernel's TCP stack. That is
what `parsim calibrate` fits, so predictions can be checked on any laptop.

Several nodes: start one copy per GPU with torchrun; rank 0 prints and writes
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
      --rdzv-endpoint HOST:29500 --rdzv-id bench \\
      -m parsim bench all-reduce --sweep 1MiB:1GiB --out results.json

examples:
  parsim bench all-reduce --nproc 4 --sweep 1MiB:64MiB
  parsim bench all-gather --nproc 2 --size 8MiB --json
  parsim bench send-recv --sweep 1KiB:16MiB --out p2p.json --plot p2p.png
"""


def register(subparsers) -> None:
    ops = ", ".join(op.replace("_", "-") for op in OPERATIONS)
    p = subparsers.add_parser("bench", help="measure collectives on this machine (like nccl-tests)",
                              description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("op", nargs="?", default="all-reduce", help=f"operation ({ops}); default all-reduce")
    p.add_argument("--nproc", type=int, default=None,
                   help=f"ranks to spawn on this machine (default {DEFAULT_NPROC}; under torchrun: the job's size)")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                   help="auto = nccl with one GPU per rank, else gloo (default auto)")
    sizes = p.add_mutually_exclusive_group()
    sizes.add_argument("--size", help="one message size, e.g. 4096, 512MB, 8MiB")
    sizes.add_argument("--sweep", metavar="MIN:MAX[:FACTOR]",
                       help=f"sizes from MIN to MAX, doubling (default {DEFAULT_SWEEP})")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations per size (default 5)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed iterations per size (default: about 0.25 s worth, 5 to 1000)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="end the run if it takes longer (default 60 s + 15 s per size)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.add_argument("--out", metavar="FILE", help="save the results as JSON (for parsim compare)")
    p.add_argument("--plot", metavar="PNG", help="save busbw against size")
    p.add_argument("--verbose", action="store_true", help="on failure, print the ranks' tracebacks or stacks")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    op = canonical_op(args.op)
    check_outputs(args, files=("--out",), pictures=("--plot",))
    sizes = [parse_size(args.size)] if args.size is not None else \
        parse_size_range(DEFAULT_SWEEP if args.sweep is None else args.sweep)

    from executor.collectives import measure_collectives
    from executor.launch import RankFailure, in_torchrun_job, job_rank

    nproc = args.nproc if args.nproc is not None or in_torchrun_job() else DEFAULT_NPROC
    try:
        results = measure_collectives(op, sizes, nproc, args.backend, warmup=args.warmup, iters=args.iters,
                                      timeout_s=args.timeout, progress=True, both_forms=True)
    except RankFailure as err:
        if args.verbose and err.details:
            print(err.details, file=sys.stderr)
        elif err.details:
            err.args = (f"{err} (--verbose prints the ranks' tracebacks)",)
        raise
    if job_rank() not in (None, 0):
        return 0  # in a torchrun job, rank 0 speaks for everyone
    first = results[0]
    meta = {"command": "parsim bench", "op": op, "nranks": first.nranks, "backend": first.backend,
            "host": platform.node()}
    wrong = sum(r.extra.get("wrong", 0) for r in results)
    if args.json:
        print_json("bench", {"meta": meta, "results": [r.to_dict() for r in results], "wrong": wrong,
                             "avg_busbw_GBps": average_busbw(results) / 1e9})
    else:
        print(render(results, args.warmup, args.iters))
    if args.out:
        save_results(args.out, results, meta=meta)
        print(f"wrote {args.out}", file=sys.stderr)
    if args.plot:
        from ..report.plots import plot_bandwidth

        plot_bandwidth({f"measured ({first.backend})": results}, args.plot,
                       title=f"{op.replace('_', '-')} on {first.nranks} ranks ({first.backend})")
        print(f"wrote {args.plot}", file=sys.stderr)
    if wrong:
        print(f"parsim bench: {wrong:,} elements of the results were wrong (#wrong)", file=sys.stderr)
        return 1
    return 0


FORMS = ("out_of_place", "in_place")
REDOPS = {"all_reduce": "sum", "reduce_scatter": "sum", "reduce": "sum"}
ROOTED = ("broadcast", "reduce", "gather", "scatter")


def form_busbw(r: CollectiveResult, form: str) -> float | None:
    """Bus bandwidth of one form of a result in bytes/s; None where it was not measured."""
    timing = r.extra.get(form)
    if not timing or not timing["time_s"] > 0:
        return None
    return r.size_bytes / timing["time_s"] * busbw_factor(r.op, r.nranks)


def average_busbw(results: list[CollectiveResult]) -> float:
    """nccl-tests' "Avg bus bandwidth": the mean over every size and form measured."""
    values = [bw for r in results for f in FORMS if (bw := form_busbw(r, f)) is not None]
    return sum(values) / len(values) if values else 0.0


def render(results: list[CollectiveResult], warmup: int, iters: int | None) -> str:
    """nccl-tests' table: size, count, type, redop, root, then time (us), algbw, busbw (GB/s) and #wrong
    out-of-place and in-place; every other line starts with ``#``."""
    first = results[0]
    name = first.op.replace("_", "-")
    host = first.extra.get("host", "")
    lines = [
        f"# parsim bench {name}: nranks {first.nranks} backend {first.backend} ({first.algorithm}) "
        f"minBytes {results[0].size_bytes} maxBytes {results[-1].size_bytes}",
        f"# warmup iters: {warmup} iters: {iters if iters else 'adaptive'} validation: 1"
        + (f" host: {host}" if host else "") + f" device: {first.extra.get('device', '?')}",
        "#",
        "#" + " " * 61 + "out-of-place" + " " * 22 + "in-place",
        "#       size         count      type   redop    root     time   algbw   busbw #wrong"
        "     time   algbw   busbw #wrong",
        "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)       "
        "     (us)  (GB/s)  (GB/s)",
    ]
    for r in results:
        root = r.extra.get("root", 0) if r.op in ROOTED else -1
        row = (f"{r.size_bytes:12d}  {r.extra.get('count', r.size_bytes // 4):12d}  "
               f"{'float':>8}  {REDOPS.get(r.op, 'none'):>6}  {root:6d}")
        for form in FORMS:
            row += _form_cells(r, form)
        lines.append(row)
    wrong = sum(r.extra.get("wrong", 0) for r in results)
    lines += [f"# Out of bounds values : {wrong} {'FAILED' if wrong else 'OK'}",
              f"# Avg bus bandwidth    : {average_busbw(results) / 1e9:g}", "#"]
    lines += [f"# {note}" for note in notes(results)]
    return "\n".join(lines)


def _form_cells(r: CollectiveResult, form: str) -> str:
    timing = r.extra.get(form)
    if not timing:
        return f"  {'N/A':>7}  {'N/A':>6}  {'N/A':>6}  {'N/A':>5}"
    us = timing["time_s"] * 1e6
    time_text = f"{us:7.0f}" if us >= 10000 else f"{us:7.1f}" if us >= 100 else f"{us:7.2f}"
    algbw = r.size_bytes / timing["time_s"] / 1e9
    return f"  {time_text}  {algbw:6.2f}  {algbw * busbw_factor(r.op, r.nranks):6.2f}  {timing['wrong']:5d}"


def notes(results: list[CollectiveResult]) -> list[str]:
    """What a reader needs to read the table right."""
    first = results[0]
    out = [f"time: {first.extra.get('timing', 'max over ranks')}; busbw = algbw x "
           f"{busbw_factor(first.op, first.nranks):.3g}; compare and --out use the "
           f"{first.extra.get('form', 'out_of_place').replace('_', '-')} time"]
    missing = [f.replace("_", "-") for f in FORMS if not first.extra.get(f)]
    if missing:
        out.append(f"N/A: torch.distributed runs {first.op.replace('_', '-')} {FORM_NOTES[missing[0]]}")
    rounded = [r for r in results if r.extra.get("requested_size_bytes", r.size_bytes) != r.size_bytes]
    if rounded:
        r = rounded[0]
        out.append(f"sizes rounded down to what can be measured: whole float32 elements, "
                   f"equal chunks per rank (e.g. {r.extra['requested_size_bytes']} B -> {r.size_bytes} B)")
    if "implementation" in first.extra:
        out.append(first.extra["implementation"])
    if first.backend == "gloo":
        out.append("gloo on one host: loopback TCP + memcpy + CPU reduction, not a network")
    return out


FORM_NOTES = {
    "out-of-place": "on one buffer only (no out-of-place form in its API)",
    "in-place": "out of place only (gloo corrupts an all-to-all whose input is its output)",
}
