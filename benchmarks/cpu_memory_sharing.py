"""How a CPU host's cores share its memory: AdamW steps on one rank alone and on every rank at once.

Each rank is a process bound to its own core, one thread, and times
``torch.optim.AdamW`` steps (torch's defaults, as the executor builds them)
behind dirty caches, first alone, then with every rank stepping at the same
moment. The speed counts parsim's 21 fp32 accesses per parameter
(``parsim.lower.ADAMW_ACCESSES``). ``parsim calibrate`` writes the same two
figures (``compute.memory_alone_bw_GBps``, ``compute.memory_host_bw_GBps``)
and the step simulator shares the host's memory among the ranks that stream
at once. On the 2-core VM (2026-11-26): 2 x 2M parameters took 6.7 ms alone
(53 GB/s) and 10.2 ms on both cores at once (34 GB/s each).

Run:  python benchmarks/cpu_memory_sharing.py [--ranks 2] [--tensors 2] [--numel 2097152]
"""

from __future__ import annotations

import argparse
import statistics
import time


def _step_times(tensors: int, numel: int, steps: int) -> float:
    import torch

    params = [torch.nn.Parameter(torch.full((numel,), 0.01)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.full((numel,), 1e-3)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    dirty = torch.zeros(8 << 20)
    times = []
    for _ in range(steps + 3):
        dirty.add_(1.0)
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:])


def _rank(rank: int, world: int, tensors: int, numel: int, steps: int) -> tuple[list[float], float]:
    """Each rank alone in turn (the others wait at a barrier), then all at once."""
    import torch

    torch.set_num_threads(1)
    dist = torch.distributed
    alone = []
    for turn in range(world):
        dist.barrier()
        if turn == rank:
            alone.append(_step_times(tensors, numel, steps))
    dist.barrier()
    return alone, _step_times(tensors, numel, steps)


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
    from parsim.lower import ADAMW_ACCESSES

    results = launch(_rank, args.ranks, (args.tensors, args.numel, args.steps), "gloo", 600.0)
    nbytes = args.tensors * args.numel * ADAMW_ACCESSES * 4
    print(f"AdamW on {args.tensors} x {args.numel:,} fp32 parameters, {args.ranks} ranks on "
          f"{usable_cores()} cores, median of {args.steps} steps")
    print(f"{'rank':>4}  {'alone (ms)':>10} {'GB/s':>6}  {'all at once (ms)':>16} {'GB/s':>6}")
    for rank, (alone, together) in enumerate(results):
        print(f"{rank:>4}  {alone[0] * 1e3:>10.2f} {nbytes / alone[0] / 1e9:>6.1f}  {together * 1e3:>16.2f} "
              f"{nbytes / together / 1e9:>6.1f}")


if __name__ == "__main__":
    main()
