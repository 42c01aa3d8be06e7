"""What FSDP2 itself costs a CPU rank: its hooks per unit and pass, and AdamW over its DTensor parameters.

The step simulator prices FSDP's gathers, reduce-scatters and the copies in and out of their buffers, not
the host work of FSDP2 around them (unsharding and resharding each unit's parameters in its pre- and
post-forward hooks, its backward hooks, the optimizer's ops dispatched through DTensor). On a GPU that
work hides behind the kernels; on a CPU host it is the step. This times one process (a one-rank gloo group,
so no collective moves bytes) on stacks of ``units`` FSDP units of two small linears each, plain and
``fully_shard``-ed, and prints the difference per unit: forward, backward, and one AdamW step
(``foreach``, torch's default) with ``zero_grad``.

On the 2-core AMD VM (2026-11-28, two runs) the extra was 428-512 us per unit in a forward, 601-708 us in
a backward and 1.05-1.37 ms per unit (four parameters) in the optimizer step, alike for 2 and 8 units:
per unit and per parameter, not per byte. ``parsim compare tiny-dp2 --grad-sync fsdp --nproc 2`` measured
77.5 ms against 25.7 ms predicted (-67%; its AdamW 11.8 ms against 2.4), where the same plan with DDP
buckets was within 15-31% per phase: `docs/calibration.md`, "FSDP on a CPU host".

Run:  python benchmarks/cpu_fsdp_overhead.py [--units 2,8] [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import time

WIDTH, ROWS, WARMUP = 64, 8, 5


def _step_ms(units: int, fsdp: bool, steps: int, mesh) -> tuple[float, float, float]:
    """Mean milliseconds of a forward, a backward and an AdamW step with zero_grad over ``steps`` steps."""
    import torch
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH))
                                  for _ in range(units)])
    if fsdp:
        for unit in model:
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(ROWS, WIDTH)
    totals = [0.0, 0.0, 0.0]
    for i in range(steps + WARMUP):
        t0 = time.perf_counter()
        loss = model(x).sum()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        t3 = time.perf_counter()
        if i >= WARMUP:
            for k, seconds in enumerate((t1 - t0, t2 - t1, t3 - t2)):
                totals[k] += seconds
    return tuple(total / steps * 1e3 for total in totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--units", default="2,8", help="FSDP units per model, comma-separated")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from executor.launch import free_port

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        print(f"{'units':>5}  {'plain fwd/bwd/adamw ms':>24}  {'fsdp2 fwd/bwd/adamw ms':>24}  "
              f"{'fsdp2 extra per unit fwd/bwd/adamw us':>38}")
        for units in (int(u) for u in args.units.split(",")):
            plain, sharded = _step_ms(units, False, args.steps, mesh), _step_ms(units, True, args.steps, mesh)
            extra = [(s - p) / units * 1e3 for p, s in zip(plain, sharded)]
            print(f"{units:>5}  {' / '.join(f'{v:.3f}' for v in plain):>24}  "
                  f"{' / '.join(f'{v:.3f}' for v in sharded):>24}  {' / '.join(f'{v:.0f}' for v in extra):>38}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
