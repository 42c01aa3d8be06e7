"""How long a gloo all-reduce takes its last rank to arrive: the two ranks on one core, and on a core each.

Tiny DP x PP on a 2-core host puts a stage's two data-parallel replicas (twins) on one core
(``executor/launch.py`` binds rank ``r`` to core ``r % cores``), and their gradient all-reduce runs between
two processes on that core. The step simulator prices every gloo collective by the links ``parsim calibrate``
fitted between ranks with a core each. This measures both: three ranks, rank 0 bound to core 0 with rank 2
and rank 1 to core 1; for each size, ranks 0 and 1 (a core each), then ranks 0 and 2 (one core), each round
a barrier, then rank 0 calls the all-reduce at once and its partner after 3 ms of matmuls (rank 0 waits,
asleep, as a twin that ended its backward first does). Printed: the late rank's all-reduce, from its call
to its return, and how long after that call rank 0 returned; medians over the rounds.

On the 2-core VM (2026-11-30, two runs of 40 rounds, gloo's device loops as gloo starts them), the late
rank's all-reduce took, a core each / one core: 4 KiB 0.45 and 3.27 / 0.49 and 0.46 ms, 64 KiB 3.05 and
3.97 / 0.48 and 0.52 ms, 545 KiB (a tiny-gpt stage's gradients) 3.94 and 4.09 / 0.70 and 0.74 ms, 4 MiB
4.56 and 4.21 / 3.78 and 3.59 ms: between cores the groups' device loops spun on their cores
(``executor/gloo_threads.py``). With the loops batched, as the executor now runs collectives (the same
day): 4 KiB 0.24 / 0.49 ms, 64 KiB 0.25 / 0.48, 545 KiB 0.41 / 0.67, 4 MiB 2.56 / 3.71.

Run:  python benchmarks/cpu_core_allreduce.py [--rounds 40]
"""

from __future__ import annotations

import argparse
import statistics

SIZES_KIB = (4, 64, 545, 4096)
PAIRS = {"a core each": (0, 1), "one core": (0, 2)}
LATE_BY_S = 3e-3  # the partner's compute before its call
WARM_UP = 5  # rounds left out of the medians


def _rank(rank: int, world: int, rounds: int) -> dict:
    """Per (pairing, KiB): this rank's (call, return) times, one per round, if it is in the pair."""
    import torch
    import torch.distributed as dist

    from executor.compute_bench import late_call
    from executor.gloo_threads import collective_group

    groups = {label: collective_group(ranks) for label, ranks in PAIRS.items()}  # as calibrate's
    out: dict = {}
    for kib in SIZES_KIB:
        bucket = torch.randn(kib * 256)
        for label, group in groups.items():
            times = out[label, kib] = []
            for _ in range(rounds):
                dist.barrier()
                if rank in PAIRS[label]:
                    times.append(late_call(lambda: dist.all_reduce(bucket, group=group), LATE_BY_S if rank else 0.0))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--rounds", type=int, default=40, help="timed rounds per size and pairing (default 40)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.exit(2, f"{parser.prog}: --rounds must be at least 1\n")

    from executor.launch import launch, usable_cores

    cores = usable_cores()
    if cores != 2:
        parser.exit(2, f"{parser.prog}: binds ranks 0 and 2 to one core and rank 1 to another, so it needs a "
                       f"host of 2 cores; this one gives {cores}\n")
    results = launch(_rank, 3, (args.rounds + WARM_UP,), "gloo", 600.0)
    print(f"a gloo all-reduce whose second rank calls it {LATE_BY_S * 1e3:.0f} ms after the first; medians of "
          f"{args.rounds} rounds")
    print(f"  {'KiB':>5}  {'ranks':<12} {'the late rank':>14} {'the early rank, after that call':>32}")
    for kib in SIZES_KIB:
        for label, (_, partner) in PAIRS.items():
            early, late = results[0][label, kib][WARM_UP:], results[partner][label, kib][WARM_UP:]
            late_s = statistics.median(back - call for call, back in late)
            early_s = statistics.median(back - late_call for (_, back), (late_call, _) in zip(early, late))
            print(f"  {kib:>5}  {label:<12} {late_s * 1e3:11.2f} ms {early_s * 1e3:29.2f} ms")


if __name__ == "__main__":
    main()
