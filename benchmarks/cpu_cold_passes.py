"""How much slower a CPU rank's pass runs right after the rank waited, or after a memory-bound phase.

Two passes, each timed warm (right after the same pass) and right after each
"before" condition: a sleep of 0.5 to 300 ms (a rank waiting on a receive, a
barrier or a bubble sleeps), a 64 MiB write (a large elementwise pass), and an
AdamW step over 4 x 1M parameters (the optimizer before the next step's
forward). The passes: tiny-gpt's two layers forward (dispatch-bound, small
ops) and one course-MLP layer's forward (a 64 x 1024 x 1024 matmul and
GeLU: arithmetic-bound). Medians of ``--repeats`` tries, one thread, one
process bound to the first core.

The simulator charges none of this: a pass costs what the calibration's
benchmarks, each run behind 32 MiB of written memory, say, whatever ran
before it. On the 2-core VM (2026-11-27, one run), tiny-gpt's two layers took
0.79 ms warm; 0.93, 1.12, 1.73, 1.91, 2.05 and 2.95 ms after sleeps of 0.5,
2, 10, 30, 100 and 300 ms; 1.22 ms after the 64 MiB write and 3.13 ms after
AdamW. The course layer: 1.57 ms warm, 1.53-2.06 ms after the sleeps, 1.67
after the write, 2.05 after AdamW (docs/calibration.md, 2026-11-27).

Run:  python benchmarks/cpu_cold_passes.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from executor.train.models import build_pieces
from parsim.workload.model import load_model

SLEEPS_MS = (0.5, 2.0, 10.0, 30.0, 100.0, 300.0)


def tiny_layers() -> Callable[[], object]:
    layers = [p.module for p in build_pieces(load_model("tiny-gpt"), 0, {"layer.0", "layer.1"})]
    x = torch.randn(2, 32, 64)

    def forward():
        h = x
        for layer in layers:
            h = layer(h)
        return h

    return forward


def course_layer() -> Callable[[], object]:
    x, w = torch.randn(64, 1024), torch.randn(1024, 1024, requires_grad=True)
    return lambda: F.gelu(x @ w)


def conditions() -> dict[str, Callable[[], object]]:
    written = torch.zeros(16 << 20)  # 64 MiB
    params = [torch.nn.Parameter(torch.randn(1 << 20)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    adamw = torch.optim.AdamW(params, lr=1e-3)
    adamw.step()  # its state, out of the timing
    rows: dict[str, Callable[[], object]] = {"warm (the pass just ran)": lambda: None}
    rows.update({f"after sleeping {ms:g} ms": (lambda s=ms / 1e3: time.sleep(s)) for ms in SLEEPS_MS})
    rows["after a 64 MiB write"] = lambda: written.add_(1.0)
    rows["after AdamW on 4 x 1M params"] = adamw.step
    return rows


def median_after(before: Callable[[], object], run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        run()  # warm
        before()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="tries per condition (default 15)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.exit(2, f"{parser.prog}: --repeats must be at least 1\n")
    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    passes = {"tiny-gpt, 2 layers fwd": tiny_layers(), "course layer fwd": course_layer()}
    for run in passes.values():
        for _ in range(20):
            run()
    print(f"{'before the pass':<30} " + " ".join(f"{name:>24}" for name in passes) + "   (ms, median)")
    for label, before in conditions().items():
        cells = [median_after(before, run, args.repeats) * 1e3 for run in passes.values()]
        print(f"{label:<30} " + " ".join(f"{c:>24.3f}" for c in cells))


if __name__ == "__main__":
    main()
