"""Does the host-speed probe follow the speed a CPU host's steps run at, minutes later?

One process per core (bound to it), each alternating for ``--minutes``: the
two probes of ``executor.speed_probe`` (0.3 s), then a course-MLP step
(forward, backward, AdamW; median of 4) and a small transformer's step (2
``nn.TransformerEncoderLayer`` of width 64; median of 10). Afterwards, for
every pair of a 10-cycle window (the "calibration") and a 5-cycle window at
least 100 cycles later (the "run"), the error of predicting the run's step
time by the calibration's: as is, and scaled by each probe's ratio. Prints
per-minute speeds and median / 90th-percentile errors per core.

Run:  python benchmarks/host_speed_drift.py --minutes 10
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

import numpy as np


def _cycles(core: int, seconds: float) -> list[tuple[float, ...]]:
    """(t, matmul probe FLOP/s, eager probe s, MLP step s, transformer step s) per cycle, on ``core``."""
    os.sched_setaffinity(0, {core})
    import torch

    from executor.speed_probe import SpeedProbe

    torch.set_num_threads(1)
    torch.manual_seed(core)
    probe = SpeedProbe(core)
    weights = [torch.nn.Parameter(torch.randn(1024, 1024) * 0.03) for _ in range(4)]
    mlp_optimizer, x = torch.optim.AdamW(weights), torch.randn(64, 1024)
    blocks = torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
                                   for _ in range(2)])
    block_optimizer, tokens = torch.optim.AdamW(blocks.parameters()), torch.randn(4, 32, 64)

    def mlp_step() -> None:
        h = x
        for w in weights:
            h = torch.nn.functional.gelu(h @ w)
        h.square().mean().backward()
        mlp_optimizer.step()
        mlp_optimizer.zero_grad()

    def block_step() -> None:
        blocks(tokens).square().mean().backward()
        block_optimizer.step()
        block_optimizer.zero_grad()

    def median_s(fn, repeats: int) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    rows, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds:
        flops, eager_s = probe()
        rows.append((time.perf_counter() - start, flops, eager_s, median_s(mlp_step, 4), median_s(block_step, 10)))
    return rows


def _errors(rows: np.ndarray, column: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"as calibrated": [], "x matmul probe": [], "x eager probe": []}
    for i in range(0, len(rows) - 150, 5):
        cal = rows[i:i + 10].mean(axis=0)
        for j in range(i + 100, len(rows) - 5, 10):
            run = rows[j:j + 5].mean(axis=0)
            out["as calibrated"].append(cal[column] / run[column] - 1)
            out["x matmul probe"].append(cal[column] * cal[1] / run[1] / run[column] - 1)
            out["x eager probe"].append(cal[column] * run[2] / cal[2] / run[column] - 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to run (default 10)")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    with multiprocessing.get_context("spawn").Pool(len(cores)) as pool:
        per_core = pool.starmap(_cycles, [(c, args.minutes * 60) for c in cores])
    for core, rows in zip(cores, per_core):
        a = np.array(rows)
        minute = (a[:, 0] // 60).astype(int)
        print(f"core {core}: {len(a)} cycles")
        minutes = sorted(set(minute))
        print("  per minute, matmul probe GFLOP/s:", [round(float(a[minute == m, 1].mean()) / 1e9, 1) for m in minutes])
        print("  per minute, eager probe passes/s:", [round(1 / float(a[minute == m, 2].mean())) for m in minutes])
        print("  per minute, transformer step ms: ", [round(float(a[minute == m, 4].mean()) * 1e3, 2) for m in minutes])
        if len(a) < 160:
            print("  (too few cycles for the calibration/run windows: run longer)")
            continue
        for column, name in ((3, "course-MLP step"), (4, "transformer step")):
            errors = _errors(a, column)
            print(f"  {name}: " + "; ".join(f"{k} median {np.median(np.abs(v)):.1%} p90 "
                                            f"{np.percentile(np.abs(v), 90):.1%}" for k, v in errors.items()))


if __name__ == "__main__":
    main()
