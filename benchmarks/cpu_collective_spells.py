"""A host's slow spells for collectives: the collective probe and calls between compute, in turn, over time.

Two ranks, a core each, repeat for ``--seconds``: the collective probe
(``executor.speed_probe.CollectiveProbe``: an all-reduce back to back at 256
KiB, 1 MiB and 4 MiB, the mean of 9 calls), then an all-reduce and an
all-gather at each of those sizes between bursts of compute (2 ms of
matmuls and a barrier before each call, as calibrate's in-step loop; the
mean of 6 calls). A round whose probe took over 1.5 times its fastest
quarter's at 1 MiB is in a slow spell. Printed: when the spells were, and per
size the medians in and out of them, and what a spell added.

On the 2-core VM (2026-11-30, 11:06, 90 s: 594 rounds, 112 in 13 spells)
the probe took 230 / 385 us at 256 KiB, 366 / 890 at 1 MiB and 1817 / 3074 at
4 MiB out of and in a spell, the all-reduce between compute 344 / 486, 543 /
965 and 1965 / 3044: about what the probe took more (+143, +421, +1080
against +154, +524, +1257 us), not as many times as long; the all-gather
less (+84, +163, +99) (docs/calibration.md, "Collectives' slow spells, and a
probe for them"). The step simulator adds the probe's extra per byte at a
collective's bus bytes (``ClusterSpec.collective_now_s``).

Run:  python benchmarks/cpu_collective_spells.py [--seconds 90]
"""

from __future__ import annotations

import argparse
import statistics
import time

CALLS = 6  # calls between compute per operation and size each round (their mean)
COMPUTE_S = 2e-3  # matmuls before each of them, as calibrate's in-step loop (executor.collectives.IN_STEP_COMPUTE_S)
SLOW = 1.5  # a round is in a slow spell past this many times the fastest quarter's probe at 1 MiB
OPS = ("all_reduce", "all_gather")


def _rank(rank: int, world: int, seconds: float) -> list[dict]:
    """This rank's rounds: each its start (s since the first), and seconds per probe size and per call kind."""
    import torch
    import torch.distributed as dist

    from executor.collective_buffers import forms_of, make_buffers
    from executor.collectives import DTYPE_BYTES, measured_size
    from executor.launch import rank_device
    from executor.speed_probe import COLLECTIVE_PROBE_KIB, CollectiveProbe, collective_probe_group

    group = collective_probe_group(world)
    probe = CollectiveProbe(group)
    rows, weights = torch.full((64, 256), 0.01), torch.full((256, 256), 0.01)
    calls = {(op, kib): make_buffers(op, forms_of(op)[0], measured_size(op, kib * 1024, world) // DTYPE_BYTES, rank,
                                     world, rank_device()).run
             for op in OPS for kib in COLLECTIVE_PROBE_KIB}
    rounds, start = [], time.perf_counter()
    while True:
        going = torch.tensor([float(time.perf_counter() - start < seconds)])
        dist.all_reduce(going, op=dist.ReduceOp.MIN, group=group)  # both ranks stop after the same round
        if not going.item():
            return rounds
        row = {"at_s": time.perf_counter() - start, "probe": dict(zip(COLLECTIVE_PROBE_KIB, probe()))}
        for (op, kib), call in calls.items():
            times = []
            for _ in range(CALLS):
                dist.barrier(group=group)
                stop = time.perf_counter() + COMPUTE_S
                while time.perf_counter() < stop:
                    rows @ weights
                begun = time.perf_counter()
                call()
                times.append(time.perf_counter() - begun)
            row.setdefault(op, {})[kib] = statistics.mean(times)
        rounds.append(row)


def spells(rounds: list[dict], slow: list[bool]) -> list[tuple[float, float]]:
    """The (first, last) round start of each run of slow rounds."""
    found: list[tuple[float, float]] = []
    for row, is_slow, was_slow in zip(rounds, slow, [False, *slow]):
        if is_slow and was_slow:
            found[-1] = (found[-1][0], row["at_s"])
        elif is_slow:
            found.append((row["at_s"], row["at_s"]))
    return found


def table(rounds: list[dict], slow: list[bool]) -> list[str]:
    """Per size: the probe's and each operation's median out of / in the spells (us), and the difference."""
    from executor.speed_probe import COLLECTIVE_PROBE_KIB

    def cell(kind: str, kib: int) -> str:
        fast = [r[kind][kib] for r, s in zip(rounds, slow) if not s]
        spell = [r[kind][kib] for r, s in zip(rounds, slow) if s]
        if not fast or not spell:
            return f"{statistics.median(fast or spell) * 1e6:.0f}"
        a, b = statistics.median(fast) * 1e6, statistics.median(spell) * 1e6
        return f"{a:.0f} / {b:.0f} ({b - a:+.0f})"

    head = ["size", "probe (all-reduce, back to back)", *(f"{op.replace('_', '-')} between compute" for op in OPS)]
    body = [[f"{kib} KiB", *(cell(kind, kib) for kind in ("probe", *OPS))] for kib in COLLECTIVE_PROBE_KIB]
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    return ["  ".join(text.ljust(width) for text, width in zip(line, widths)).rstrip() for line in [head, *body]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--seconds", type=float, default=90.0, help="how long to repeat the rounds (default 90)")
    args = parser.parse_args()
    if not 0 < args.seconds <= 3600:
        parser.exit(2, f"{parser.prog}: --seconds must be more than 0 and at most 3600\n")

    from executor.launch import launch

    rounds = launch(_rank, 2, (args.seconds,), "gloo", args.seconds + 300.0)[0]
    at_1mib = sorted(r["probe"][1024] for r in rounds)
    threshold = SLOW * at_1mib[len(at_1mib) // 4]
    slow = [r["probe"][1024] > threshold for r in rounds]
    print(f"{len(rounds)} rounds in {args.seconds:g} s, {sum(slow)} in slow spells (the probe at 1 MiB over "
          f"{threshold * 1e6:.0f} us, {SLOW:g}x its fastest quarter's)")
    found = spells(rounds, slow)
    if found:
        print("spells: " + ", ".join(f"{a:.1f}-{b:.1f} s" for a, b in found))
    print("medians in us, out of / in the spells (what a spell added)")
    for line in table(rounds, slow):
        print("  " + line)


if __name__ == "__main__":
    main()
