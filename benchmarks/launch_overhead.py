"""What starting ranks costs before they run: the fork server against a fresh interpreter per rank.

``executor.launch.launch`` forks its ranks from a server that imported torch once
(``executor.launch.rank_context``). This times launches of ranks that only join
the process group and leave it, in turns: one launch from the server, then one
with every rank a fresh ``spawn`` interpreter that imports torch itself, round
after round, for each rank count. The first launch from the server also starts
the server; it is printed apart and left out of the medians.

On the 2-core VM (2026-12-01, three rounds): the first launch 4.04 s, the
server's start included; then 2 and 4 ranks 0.06 and 0.11 s from the server,
2.98 and 5.62 s spawned. The test suite went from 902 s to 681 s.

Run:  python benchmarks/launch_overhead.py [--ranks 2,4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time


def _nothing(rank: int, world: int) -> int:
    return rank


def _timed_launch(nproc: int) -> float:
    from executor.launch import launch

    start = time.perf_counter()
    launch(_nothing, nproc, backend="gloo", timeout_s=300.0)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2,4", help="rank counts to launch, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="launches of each kind per rank count")
    args = parser.parse_args()
    try:
        counts = [int(n) for n in args.ranks.split(",")]
    except ValueError:
        parser.error(f"--ranks {args.ranks!r}: whole numbers, comma-separated")
    if min(counts) < 1 or args.rounds < 1:
        parser.error("--ranks and --rounds must be at least 1")

    import executor.launch as launcher

    server = launcher.rank_context
    first = _timed_launch(counts[0])
    print(f"first launch from the fork server ({counts[0]} ranks), its start included: {first:.2f} s")
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for nproc in counts:
            for kind, context in (("fork server", server), ("spawn", lambda: multiprocessing.get_context("spawn"))):
                launcher.rank_context = context
                times.setdefault((kind, nproc), []).append(_timed_launch(nproc))
    launcher.rank_context = server
    print(f"{'ranks':>5}  {'fork server (s)':>15}  {'spawn (s)':>9}   median of {args.rounds}, in turns")
    for nproc in counts:
        print(f"{nproc:>5}  {statistics.median(times['fork server', nproc]):>15.2f}  "
              f"{statistics.median(times['spawn', nproc]):>9.2f}")


if __name__ == "__main__":
    main()
