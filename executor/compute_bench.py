"""Single-rank compute microbenchmarks for `parsim calibrate`: matmul time by shape."""

from __future__ import annotations

import time
from typing import Sequence

from ._torch import require_torch

# Shapes (m, n, k) spanning thin to square, the sizes the course's MLP and the tiny transformer use.
DEFAULT_SHAPES = (
    (32, 64, 64), (128, 128, 128), (32, 1024, 1024), (128, 256, 1024), (128, 1024, 256),
    (256, 512, 512), (512, 512, 512), (128, 1024, 1024), (1024, 1024, 1024), (64, 4096, 1024),
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
