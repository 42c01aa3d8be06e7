"""What a gloo collective costs when one rank reaches it late, on this host's cores.

Two ranks (bound to cores as ``parsim run`` binds them) compute for 2 ms after a
barrier; rank 1 computes ``skew`` ms longer, then both call the collective. For
each skew the table gives the early rank's call minus the skew (what the call
costs it beyond waiting) and the late rank's call, median and mean over the
calls. ``parsim calibrate`` times collectives between bursts of compute with the
ranks together (skew 0); ranks of a real step arrive apart
(``benchmarks/cpu_rank_skew.py``).

On this 2-core VM (2026-11-28) a 256 KiB all-reduce took 0.5 ms (median) with the
ranks together and 4-5 ms for both ranks once one came 0.1-1.6 ms late; an
all-to-all of the same size took 0.3 ms at every skew.

Run:  python benchmarks/cpu_collective_skew.py --ops all_reduce,all_to_all --kib 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from executor.launch import launch

SKEWS_MS = (0.0, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2)
COMPUTE_S = 0.002
WARMUP = 3
OPS = ("all_reduce", "all_to_all", "all_gather")


def _spin(seconds: float, a, b) -> None:
    """Small matmuls until ``seconds`` have passed (fine-grained: the skew stays what was asked)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ b


def _rank(rank: int, world: int, op: str, kib: int, calls: int) -> dict[float, list[float]]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    x = torch.randn(kib * 256)
    out = torch.empty_like(x)
    a, b = torch.randn(16, 64), torch.randn(64, 64)
    call = {"all_reduce": lambda: dist.all_reduce(x), "all_to_all": lambda: dist.all_to_all_single(out, x),
            "all_gather": lambda: dist.all_gather_into_tensor(out, x[: x.numel() // world])}[op]
    times: dict[float, list[float]] = {}
    for skew_ms in SKEWS_MS:
        times[skew_ms] = []
        for i in range(calls + WARMUP):
            dist.barrier()
            _spin(COMPUTE_S + (skew_ms / 1e3 if rank == 1 else 0.0), a, b)
            start = time.perf_counter()
            call()
            if i >= WARMUP:
                times[skew_ms].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default="all_reduce,all_to_all", help=f"comma-separated: {', '.join(OPS)}")
    parser.add_argument("--kib", type=int, default=256, help="each rank's buffer in KiB (1 to 65536)")
    parser.add_argument("--calls", type=int, default=40, help="calls per skew (1 to 10000)")
    args = parser.parse_args()
    unknown = [op for op in args.ops.split(",") if op not in OPS]
    problem = (f"unknown op {unknown[0]!r} (expected {', '.join(OPS)})" if unknown else
               "--kib must be 1 to 65536 and --calls 1 to 10000"
               if not (1 <= args.kib <= 65536 and 1 <= args.calls <= 10_000) else None)
    if problem:
        print(f"cpu_collective_skew.py: {problem}", file=sys.stderr)
        sys.exit(2)
    print(f"2 gloo ranks, {args.kib} KiB, {args.calls} calls per skew, after {COMPUTE_S * 1e3:g} ms of compute (ms)")
    print(f"{'operation':<11} {'skew':>5}  {'early - skew: median':>20} {'mean':>6}  {'late: median':>12} {'mean':>6}")
    for op in args.ops.split(","):
        early, late = launch(_rank, 2, args=(op, args.kib, args.calls), backend="gloo", timeout_s=600)
        for skew_ms in SKEWS_MS:
            waited = [t * 1e3 - skew_ms for t in early[skew_ms]]
            own = [t * 1e3 for t in late[skew_ms]]
            print(f"{op:<11} {skew_ms:5.1f}  {statistics.median(waited):20.2f} {statistics.mean(waited):6.2f}  "
                  f"{statistics.median(own):12.2f} {statistics.mean(own):6.2f}")


if __name__ == "__main__":
    main()
