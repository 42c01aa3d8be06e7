"""Training loops that know nothing of parsim, profiled with torch.profiler as a user would.

Spawned as ranks by :func:`executor.launch.launch`, so they live in a module of their own.
"""

from __future__ import annotations

from pathlib import Path


def course_ddp_loop(rank: int, world: int, folder: str, steps: int = 3) -> None:
    """CS336's data-parallel MLP (4 layers of 1024 x 1024, gelu, no bias; batch 128 split over the ranks;
    loss x.square().mean(); AdamW): after the backward, one all-reduce per parameter's gradient, then the
    optimizer. Every step is profiled; each rank writes its Kineto trace to ``folder``."""
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    layers = [torch.nn.Parameter(torch.randn(1024, 1024) / 32) for _ in range(4)]
    optimizer = torch.optim.AdamW(layers, lr=1e-3)
    batch = torch.randn(128, 1024).chunk(world)[rank]

    def export(prof) -> None:
        prof.export_chrome_trace(str(Path(folder) / f"trace-rank{rank}.json"))

    schedule = torch.profiler.schedule(wait=0, warmup=1, active=steps)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                                record_shapes=True, on_trace_ready=export) as prof:
        for _ in range(1 + steps):
            x = batch
            for w in layers:
                x = torch.nn.functional.gelu(x @ w)
            x.square().mean().backward()
            for w in layers:
                dist.all_reduce(w.grad)
                w.grad /= world
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
