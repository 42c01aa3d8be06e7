"""Two ranks all-reduce a gradient bucket, then each steps AdamW: on a core each, and bound to one core.

Tiny DP x PP on a 2-core host puts a stage's two data-parallel replicas (twins) on one core; after their
backward they all-reduce the stage's gradients and each steps AdamW. The step simulator ends a collective
for all its ranks at once, and twins on one core then take turns in the scheduler's slices
(``parsim.sim.cores``), so each AdamW comes out about twice as long as alone. This measures what the host does:
three ranks, rank 0 bound to core 0 with rank 2 and rank 1 to core 1 (``executor/launch.py`` binds rank
``r`` to core ``r % cores``); ranks 0 and 1 (a core each), then ranks 0 and 2 (one core), repeat: a barrier,
an all-reduce of ``--kib`` KiB, an AdamW step on as many fp32 parameters. Printed: how far apart the two left
the all-reduce, and each one's AdamW, the first out and the second, beside AdamW alone and beside what the
model's round robin gives two ranks that leave together.

On the 2-core VM (2026-11-28, 545 KiB, 50 rounds): on a core each the ranks left 0.03 ms apart and stepped
in 2.87 and 2.93 ms; on one core they left 3.08 ms apart, and each stepped alone (2.81 and 2.70 ms), where
the model's turns give 4.4 and 5.7 ms. With the groups' device loops batched, as the executor now runs
collectives (2026-11-30; AdamW alone 0.76 ms that day): a core each, 0.02 ms apart, 0.95 and 0.96 ms; one
core, 1.30 ms apart, 1.15 and 1.19 ms.

Run:  python benchmarks/cpu_twin_allreduce.py [--kib 545] [--rounds 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

TENSOR = 64 * 64  # fp32 parameters per tensor: a tiny-gpt stage's weights are about this size each
WARM_UP = 5  # rounds left out of the medians


def _rank(rank: int, world: int, kib: int, rounds: int) -> dict:
    """Each pairing's rounds on this rank: (all-reduce start, end, AdamW end) in seconds; AdamW alone on rank 0."""
    import torch
    import torch.distributed as dist

    from executor.gloo_threads import collective_group

    torch.manual_seed(rank)
    elements = kib * 1024 // 4
    bucket = torch.randn(elements)
    params = [torch.nn.Parameter(torch.randn(TENSOR)) for _ in range(max(1, elements // TENSOR))]
    for p in params:
        p.grad = torch.randn_like(p)
    adamw = torch.optim.AdamW(params, foreach=True)
    members = {"a core each": [0, 1], "one core": [0, 2]}
    pairs = {label: collective_group(ranks) for label, ranks in members.items()}  # as the executor's dp groups
    result: dict = {"alone_s": []}
    for _ in range(rounds):
        dist.barrier()
        if rank == 0:
            start = time.perf_counter()
            adamw.step()
            result["alone_s"].append(time.perf_counter() - start)
    for label, group in pairs.items():
        rows = result[label] = []
        for _ in range(rounds):
            dist.barrier()
            if rank in members[label]:
                start = time.perf_counter()
                dist.all_reduce(bucket, group=group)
                left = time.perf_counter()
                adamw.step()
                rows.append((start, left, time.perf_counter()))
    return result


def _model_turns(alone_s: float, cores: int) -> tuple[float, float]:
    """When two ranks on one core that leave a collective together end ``alone_s`` of work each, taking turns
    as the step simulator has them (round robin in the EEVDF base slice)."""
    import simpy

    from parsim.sim.cores import SharedCores, eevdf_slice_s

    env = simpy.Environment()
    cores_model = SharedCores(env, {0: 0, 1: 0}, eevdf_slice_s(cores))
    ends: dict[int, float] = {}
    for rank in (0, 1):
        cores_model.run(rank, alone_s, 1.0, lambda rank=rank: ends.setdefault(rank, env.now))
    env.run()
    return ends[0], ends[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--kib", type=int, default=545, help="the bucket's KiB, and AdamW's parameters (default 545)")
    parser.add_argument("--rounds", type=int, default=50, help="timed rounds per pairing (default 50)")
    args = parser.parse_args()
    if args.kib < 16 or args.rounds < 1:
        parser.exit(2, f"{parser.prog}: --kib must be at least 16 and --rounds at least 1\n")

    from executor.launch import launch, usable_cores

    cores = usable_cores()
    if cores != 2:
        parser.exit(2, f"{parser.prog}: binds ranks 0 and 2 to one core and rank 1 to another, so it needs a "
                       f"host of 2 cores; this one gives {cores}\n")
    results = launch(_rank, 3, (args.kib, args.rounds + WARM_UP), "gloo", 600.0)
    alone = statistics.median(results[0]["alone_s"][WARM_UP:])
    print(f"an all-reduce of {args.kib} KiB, then AdamW on as many fp32 parameters; medians of {args.rounds} rounds")
    print(f"  AdamW alone: {alone * 1e3:.2f} ms")
    print(f"  {'ranks':<13} {'left apart':>10} {'AdamW, first out':>17} {'AdamW, second out':>18}")
    for label, other in (("a core each", 1), ("one core", 2)):
        apart, first, second = [], [], []
        for mine, theirs in zip(results[0][label][WARM_UP:], results[other][label][WARM_UP:]):
            out_first, out_second = sorted((mine, theirs), key=lambda row: row[1])
            apart.append(out_second[1] - out_first[1])
            first.append(out_first[2] - out_first[1])
            second.append(out_second[2] - out_second[1])
        print(f"  {label:<13} {statistics.median(apart) * 1e3:8.2f} ms {statistics.median(first) * 1e3:14.2f} ms "
              f"{statistics.median(second) * 1e3:15.2f} ms")
    model = _model_turns(alone, cores)
    print(f"  {'model, 1 core':<13} {0.0:8.2f} ms {model[0] * 1e3:14.2f} ms {model[1] * 1e3:15.2f} ms"
          "  (leaving together, then taking turns)")


if __name__ == "__main__":
    main()
