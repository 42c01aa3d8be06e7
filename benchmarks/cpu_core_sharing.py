"""How a CPU rank's compute slows with another rank bound to its core: alone, beside a rank waiting in a
gloo receive, and beside a rank computing.

The executor binds local rank ``r`` to core ``r % cores`` (``executor/launch.py``), so a host running more
ranks than cores puts several on one core. This spawns one rank more than the host has cores: rank 0 and
the last rank share core 0. Rank 0 times blocks of matmuls (the median of ``--blocks``) three times: while
the others wait at a barrier; while the last rank waits in ``dist.recv`` for the message rank 0 sends when
it is done (a pipeline stage waiting for the stage on its own core); and while the last rank multiplies
matrices itself. The step simulator stretches every op on a host with more ranks than cores by the same
factor, as if the ranks that share a core computed all the time (``parsim.sim.compute``, ``time_share``).

On the 2-core VM (2026-11-27, two runs) a block took 17.0 / 22.2 ms alone, 16.5 / 21.8 ms beside a
receive and 44.3 / 43.4 ms beside a rank computing: a rank waiting in gloo sleeps and gives its core up.

Run:  python benchmarks/cpu_core_sharing.py [--blocks 20] [--matmuls 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

SHAPE = (256, 1024, 1024)  # (m, n, k) of each matmul: 0.5 GFLOP, milliseconds on a core


def _blocks_ms(blocks: int, matmuls: int) -> float:
    """The median milliseconds of ``blocks`` blocks of ``matmuls`` matmuls."""
    import torch

    m, n, k = SHAPE
    a, b = torch.full((m, k), 0.01), torch.full((k, n), 0.01)
    times = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(matmuls):
            a @ b
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _rank(rank: int, world: int, blocks: int, matmuls: int) -> tuple[float, float, float] | None:
    """Rank 0: its block's milliseconds (alone, beside a receive, beside compute); the others: None."""
    import torch
    import torch.distributed as dist

    from executor.compute_bench import compute_for

    neighbour = world - 1  # bound to rank 0's core
    dist.barrier()
    alone = _blocks_ms(blocks, matmuls) if rank == 0 else None
    dist.barrier()
    beside_receive = None
    if rank == 0:
        beside_receive = _blocks_ms(blocks, matmuls)
        dist.send(torch.zeros(1), neighbour)
    elif rank == neighbour:
        dist.recv(torch.zeros(1), 0)
    alone_s = torch.tensor([alone or 0.0]) / 1e3
    dist.broadcast(alone_s, 0)
    beside_compute = _blocks_ms(blocks, matmuls) if rank == 0 else None
    if rank == neighbour:  # past rank 0's blocks, shared at half speed
        compute_for(3 * blocks * float(alone_s) + 0.1, SHAPE)
    dist.barrier()
    return (alone, beside_receive, beside_compute) if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=20, help="timed blocks per condition (default 20)")
    parser.add_argument("--matmuls", type=int, default=2, help=f"matmuls of {SHAPE} per block (default 2)")
    args = parser.parse_args()
    if min(args.blocks, args.matmuls) < 1:
        parser.exit(2, f"{parser.prog}: --blocks and --matmuls must be at least 1\n")

    from executor.launch import launch, usable_cores

    cores = usable_cores()
    if cores < 2:
        parser.exit(2, f"{parser.prog}: needs 2 cores or more (a rank on each, one more beside rank 0); "
                       f"this host gives {cores}\n")
    alone, beside_receive, beside_compute = launch(_rank, cores + 1, (args.blocks, args.matmuls), "gloo", 600.0)[0]
    matmuls = f"{args.matmuls} matmul{'s' if args.matmuls > 1 else ''}"
    print(f"rank 0's block of {matmuls} {SHAPE}, median of {args.blocks}; {cores + 1} ranks on {cores} cores, "
          f"rank {cores} bound beside rank 0")
    for label, ms in (("alone", alone), (f"rank {cores} waiting in a receive", beside_receive),
                      (f"rank {cores} computing", beside_compute)):
        print(f"  {label:<34} {ms:8.2f} ms  x{ms / alone:.2f}")


if __name__ == "__main__":
    main()
