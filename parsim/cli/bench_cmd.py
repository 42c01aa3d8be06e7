"""``parsim bench``: measure collectives on this machine, like nccl-tests.

The measuring lives in :mod:`executor.collectives` (torch is imported only
there, and only when a measurement starts); this module parses, checks the
input before any process is spawned, and prints.
"""

from __future__ import annotations

import argparse
import platform
import sys

from ..errors import ParsimError
from ..results import OPERATIONS, CollectiveResult, busbw_factor, canonical_op, save_results
from ..table import render_table
from ..units import format_size, format_time, parse_size, parse_size_range
from .common import print_json

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
    sizes = [parse_size(args.size)] if args.size else parse_size_range(args.sweep or DEFAULT_SWEEP)
    if args.nproc is not None and args.nproc < 1:
        raise ParsimError(f"--nproc must be at least 1, got {args.nproc}")
    if args.timeout is not None and args.timeout <= 0:
        raise ParsimError(f"--timeout must be positive, got {args.timeout:g}")

    from executor.collectives import measure_collectives
    from executor.launch import RankFailure, in_torchrun_job, job_rank

    nproc = args.nproc if args.nproc is not None or in_torchrun_job() else DEFAULT_NPROC
    try:
        results = measure_collectives(op, sizes, nproc, args.backend, warmup=args.warmup, iters=args.iters,
                                      timeout_s=args.timeout, progress=True)
    except RankFailure as err:
        if args.verbose and err.details:
            print(err.details, file=sys.stderr)
        elif err.details:
            err.args = (f"{err} (--verbose prints the ranks' tracebacks)",)
        raise
    if job_rank() not in (None, 0):
        return 0  # in a torchrun job, rank 0 speaks for everyone
    if args.json:
        print_json([r.to_dict() for r in results])
    else:
        print(render(results))
    if args.out:
        save_results(args.out, results, meta={"command": "parsim bench", "op": op, "nranks": results[0].nranks,
                                              "backend": results[0].backend, "host": platform.node()})
        print(f"wrote {args.out}", file=sys.stderr)
    if args.plot:
        from ..plots import plot_bandwidth

        first = results[0]
        plot_bandwidth({f"measured ({first.backend})": results}, args.plot,
                       title=f"{op.replace('_', '-')} on {first.nranks} ranks ({first.backend})")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def render(results: list[CollectiveResult]) -> str:
    """An nccl-tests-like table, with the notes needed to read it right."""
    first = results[0]
    name = first.op.replace("_", "-")
    rows = [[format_size(r.size_bytes), r.size_bytes, r.extra.get("count", r.size_bytes // 4), format_time(r.time_s),
             r.algbw_Bps / 1e9, r.busbw_Bps / 1e9] for r in results]
    host = first.extra.get("host", "")
    title = f"{name} on {first.nranks} ranks, {first.backend} ({first.algorithm}), measured{' on ' + host if host else ''}"
    table = render_table(["size", "bytes", "count", "time", "algbw GB/s", "busbw GB/s"], rows, title)
    notes = [f"time: {first.extra.get('timing', 'max over ranks')}; "
             f"busbw = algbw x {busbw_factor(first.op, first.nranks):.3g}"]
    rounded = [r for r in results if r.extra.get("requested_size_bytes", r.size_bytes) != r.size_bytes]
    if rounded:
        r = rounded[0]
        notes.append(f"sizes rounded down to what can be measured: whole float32 elements, "
                     f"equal chunks per rank (e.g. {r.extra['requested_size_bytes']} B -> {r.size_bytes} B)")
    if "implementation" in first.extra:
        notes.append(first.extra["implementation"])
    if first.backend == "gloo":
        notes.append("gloo on one host: loopback TCP + memcpy + CPU reduction, not a network")
    return "\n".join([table, *notes])
