"""Single-rank compute microbenchmarks for `parsim calibrate`: matmul time by shape."""

from __future__ import annotations

import time
from typing import Sequence

from ._torch import require_torch

# Shapes (m, n, k) spanning thin to square, the sizes the course's MLP and the tiny transformer use,
# including weight-gradient shapes whose inner dimension is the (small) token count.
DEFAULT_SHAPES = (
    (32, 64, 64), (128, 128, 128), (32, 1024, 1024), (128, 256, 1024), (128, 1024, 256),
    (256, 512, 512), (512, 512, 512), (128, 1024, 1024), (1024, 1024, 1024), (64, 4096, 1024),
    (1024, 1024, 32), (1024, 1024, 128), (64, 64, 32), (256, 64, 64), (64, 256, 64),
)


def measure_matmuls(shapes: Sequence[tuple[int, int, int]] = DEFAULT_SHAPES, *, threads: int = 1,
                    target_time_s: float = 0.1) -> list[tuple[tuple[int, int, int], float]]:
    """Mean seconds of ``x[m, k] @ w[k, n]`` in fp32 for each shape, on ``threads`` CPU threads
    (one per rank, like the executor's ranks)."""
    torch = require_torch()
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows = []
        for m, n, k in shapes:
            x, w = torch.randn(m, k), torch.randn(k, n)
            out = torch.empty(m, n)
            torch.matmul(x, w, out=out)  # warm-up
            iters, elapsed = 1, 0.0
            while True:
                start = time.perf_counter()
                for _ in range(iters):
                    torch.matmul(x, w, out=out)
                elapsed = time.perf_counter() - start
                if elapsed >= target_time_s or iters >= 1 << 16:
                    break
                iters *= 2
            rows.append(((m, n, k), elapsed / iters))
        return rows
    finally:
        torch.set_num_threads(saved)


def measure_optimizer_bandwidth(params: int = 1 << 21, *, threads: int = 1, steps: int = 10) -> float:
    """Bytes per second a torch AdamW step moves on ``params`` fp32 parameters, one thread.

    Counts parsim's 21 element accesses per parameter (see ``parsim.lower.ADAMW_ACCESSES``),
    so the figure is the memory bandwidth that elementwise kernels reach, which is
    what the simulator's optimizer and elementwise costs divide by.
    """
    from parsim.lower import ADAMW_ACCESSES

    torch = require_torch()
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        weight = torch.nn.Parameter(torch.randn(params))
        weight.grad = torch.randn(params)
        optimizer = torch.optim.AdamW([weight], lr=1e-3, foreach=True)
        optimizer.step()  # allocates the moments
        start = time.perf_counter()
        for _ in range(steps):
            optimizer.step()
        seconds = (time.perf_counter() - start) / steps
        return params * ADAMW_ACCESSES * 4 / seconds
    finally:
        torch.set_num_threads(saved)


def measure_on_every_rank(nproc: int, timeout_s: float = 600.0) -> list[dict]:
    """Compute microbenchmarks run on ``nproc`` ranks at once, as they compute during a real run
    (sharing cores, caches and memory bandwidth); one dict per rank."""
    from .launch import launch

    return launch(_rank_compute, nproc, (), "gloo", timeout_s)


def measure_kernel_overhead(chain: int = 200, repeats: int = 20) -> float:
    """Seconds of fixed cost per op: a chain of tiny elementwise ops, forward and backward
    through autograd, divided by the ops it runs (one forward and one backward kernel each)."""
    torch = require_torch()
    x = torch.randn(16, requires_grad=True)

    def run() -> None:
        y = x
        for _ in range(chain):
            y = y * 1.0001
        y.sum().backward()

    run()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - start) / repeats / (2 * chain)


def _rank_compute(rank: int, world: int) -> dict:
    return {"matmuls": measure_matmuls(), "optimizer_Bps": measure_optimizer_bandwidth(),
            "kernel_s": measure_kernel_overhead()}
