"""How a CPU host's cores share its memory: AdamW steps on one rank alone, on every rank at once, and on one
rank while the others run matmuls.

Each rank is a process bound to its own core, one thread, and times
``torch.optim.AdamW`` steps (torch's defaults, as the executor builds them)
behind dirty caches, first alone, then with every rank stepping at the same
moment, then alone again while the other ranks multiply matrices (as a
pipeline's other stage runs its backward). The speed counts parsim's 21 fp32 accesses per parameter
(``parsim.lowering.lower.ADAMW_ACCESSES``). ``parsim calibrate`` writes the same two
figures (``compute.memory_alone_bw_GBps``, ``compute.memory_host_bw_GBps``)
and the step simulator shares the host's memory among the ranks that stream
at once; it does not slow a stream beside another rank's matmuls. On the
2-core VM (2026-11-26): 2 x 2M parameters took 6.7-7.2 ms alone (53-49
GB/s) and 10.2-11.4 ms on both cores at once (34-31 GB/s each).

Run:  python benchmarks/cpu_memory_sharing.py [--ranks 2] [--tensors 2] [--numel 2097152]
"""

from __future__ import annotations

import argparse

BACKWARD_MATMUL = (256, 1024, 1024)  # (m, n, k) the other ranks multiply, as a pipeline stage's backward does


def _rank(rank: int, world: int, tensors: int, numel: int, steps: int) -> tuple[float, float, float]:
    """(alone, all at once, beside the others' matmuls): each rank alone in turn (the others wait at a
    barrier), then all at once, then each in turn while the others multiply for longer than its steps take."""
    from executor.compute_bench import adamw, after_dirty_caches, compute_for, in_turn

    def steps_s(together: bool = False) -> float:
        return after_dirty_caches(adamw(tensors, numel).step, repeats=steps, together=together)

    alone = in_turn(steps_s)
    together = steps_s(together=True)
    beside = in_turn(steps_s, lambda: compute_for(3 * (steps + 1) * alone + 0.1, BACKWARD_MATMUL))
    return alone, together, beside


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="processes, one per core (default 2)")
    parser.add_argument("--tensors", type=int, default=2, help="parameter tensors (default 2)")
    parser.add_argument("--numel", type=int, default=1 << 21, help="elements per tensor (default 2097152)")
    parser.add_argument("--steps", type=int, default=25, help="timed steps per run (default 25)")
    args = parser.parse_args()
    if min(args.ranks, args.tensors, args.numel, args.steps) < 1:
        parser.exit(2, f"{parser.prog}: --ranks, --tensors, --numel and --steps must be at least 1\n")

    from executor.launch import launch, usable_cores
    from parsim.lowering.lower import ADAMW_ACCESSES

    if args.ranks > usable_cores():
        parser.exit(2, f"{parser.prog}: --ranks {args.ranks}: one rank per core, and this host gives "
                       f"{usable_cores()} cores\n")

    results = launch(_rank, args.ranks, (args.tensors, args.numel, args.steps), "gloo", 600.0)
    nbytes = args.tensors * args.numel * ADAMW_ACCESSES * 4
    print(f"AdamW on {args.tensors} x {args.numel:,} fp32 parameters, {args.ranks} ranks on "
          f"{usable_cores()} cores, median of {args.steps} steps")
    print(f"{'rank':>4}  {'alone (ms)':>10} {'GB/s':>6}  {'all at once (ms)':>16} {'GB/s':>6}  "
          f"{'beside matmuls (ms)':>19} {'GB/s':>6}")
    for rank, times in enumerate(results):
        print(f"{rank:>4}  " + "  ".join(f"{t * 1e3:>{width}.2f} {nbytes / t / 1e9:>6.1f}"
                                         for t, width in zip(times, (10, 16, 19))))


if __name__ == "__main__":
    main()
