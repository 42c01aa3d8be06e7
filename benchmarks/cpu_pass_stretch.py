"""How many times as long a small model's forward and backward take with another rank computing on the same core,
against the two host-speed probes whose stretch ``parsim calibrate`` writes (``compute.shared_cores``'
``matmul_stretch`` and ``eager_stretch``) and the step simulator applies to every pass of ranks that share a core.

Like ``cpu_core_sharing.py``, it spawns one rank more than the host has cores: rank 0 and the last rank share
core 0, the others only keep the barriers. For each work (the model's forward and backward, the eager probe, the
matmul probe), round after round, rank 0 times it over a window twice: with the last rank running the same work
on its core ("together"), then with the last rank waiting in a barrier, asleep ("alone"). The stretch of a round
is the together time per call (the two ranks' mean) over the alone one; alternating the windows keeps the host's
drift out of the ratio.

On the 2-core AMD VM (2026-11-29, two runs of 6 rounds of 0.4 s windows) tiny-gpt's forward and backward (6.6
ms alone) stretched x2.14 and x2.16, the eager probe x2.08 and x2.13, the matmul probe x2.13 and x2.06: the probes
stand for the model's passes, so the calibrated stretch is not what tiny DP x PP's step misses. Timed apart within
the same steps (2026-11-29, evening), the forward stretched x2.31 and the backward x2.34: alike, though tiny DP x
PP's backward comes out 28-40% short on three of its four ranks where its forward does not.

Run:  python benchmarks/cpu_pass_stretch.py [--model tiny-gpt] [--rounds 6] [--window 0.4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

MICROBATCH = 2  # sequences per pass, as the tiny plans' microbatches
PASSES = ("forward", "backward", "forward+backward")  # the model's, each timed apart within the same steps
WORKS = (*PASSES, "eager probe", "matmul probe")


def _timers(model_name: str, seed: int) -> dict[str, Callable[[float], float]]:
    """Each work of WORKS as a timer: seconds -> seconds per call over that long, built on this rank (its own
    weights, as a plan's ranks have)."""
    from executor.speed_probe import SHAPE, SpeedProbe
    from executor.train.models import build_loss, build_pieces, make_batch, run_pieces
    from parsim.workload.model import load_model

    model = load_model(model_name)
    pieces, loss = build_pieces(model, seed=seed), build_loss(model)
    x, y = make_batch(model, MICROBATCH, seed=seed)
    probe = SpeedProbe(seed=seed)
    m, k, n = SHAPE

    def passes(part: str) -> Callable[[float], float]:
        def timed(window_s: float) -> float:
            spent, calls, start = 0.0, 0, time.perf_counter()
            while time.perf_counter() - start < window_s:
                begin = time.perf_counter()
                out = loss(run_pieces(pieces, x), y)
                middle = time.perf_counter()
                out.backward()
                end = time.perf_counter()
                spent += {"forward": middle - begin, "backward": end - middle, "forward+backward": end - begin}[part]
                calls += 1
            return spent / calls
        return timed

    return {**{part: passes(part) for part in PASSES}, "eager probe": probe.eager_s,
            "matmul probe": lambda window_s: 2 * m * k * n / probe.matmul_flops(window_s)}


def _rank(rank: int, world: int, model_name: str, rounds: int, window_s: float) -> dict | None:
    """Rank 0: work -> [(together, alone) seconds per call, each round]; the last rank, which computes beside it
    in the together windows, its own (alone: 0); the others keep the barriers and return None."""
    import torch.distributed as dist

    neighbour = world - 1
    computes = rank in (0, neighbour)
    timers = _timers(model_name, seed=rank) if computes else {}
    for timer in timers.values():  # first-call paths and allocations out of the timing
        timer(0.02)
    times: dict[str, list[tuple[float, float]]] = {work: [] for work in timers}
    for _ in range(rounds):
        for work in WORKS:
            dist.barrier()
            together = timers[work](window_s) if computes else 0.0
            dist.barrier()
            alone = timers[work](window_s) if rank == 0 else 0.0
            if computes:
                times[work].append((together, alone))
    return times if computes else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-gpt", help="a built-in model or a model YAML (default tiny-gpt)")
    parser.add_argument("--rounds", type=int, default=6, help="together/alone pairs of each work (default 6)")
    parser.add_argument("--window", type=float, default=0.4, help="seconds of each timed window (default 0.4)")
    args = parser.parse_args()
    if args.rounds < 1 or args.window <= 0:
        parser.exit(2, f"{parser.prog}: --rounds must be at least 1 and --window positive\n")

    from executor.launch import launch, usable_cores
    from parsim.errors import ParsimError
    from parsim.workload.model import load_model

    try:
        model_name = load_model(args.model).name
    except ParsimError as error:
        parser.exit(2, f"{parser.prog}: {error}\n")
    cores = usable_cores()
    if cores < 2:
        parser.exit(2, f"{parser.prog}: needs 2 cores or more (a rank on each, one more beside rank 0); "
                       f"this host gives {cores}\n")
    results = launch(_rank, cores + 1, (args.model, args.rounds, args.window), "gloo", 600.0)
    mine, beside = results[0], results[cores]
    print(f"rank 0 and rank {cores} on core 0 of {cores}: {args.rounds} rounds of {args.window:g} s windows, "
          f"together (both computing) then alone (rank {cores} asleep in a barrier)")
    print(f"{'work':<34} {'alone':>9} {'together':>9}  stretch  rounds")
    for work in WORKS:
        together = [(own[0] + other[0]) / 2 for own, other in zip(mine[work], beside[work])]
        alone = [own[1] for own in mine[work]]
        ratios = [t / a for t, a in zip(together, alone)]
        label = f"{model_name} {work}" if work in PASSES else work
        print(f"{label:<34} {statistics.median(alone) * 1e3:7.3f}ms {statistics.median(together) * 1e3:7.3f}ms  "
              f"x{statistics.median(ratios):.2f}    {min(ratios):.2f}-{max(ratios):.2f}")


if __name__ == "__main__":
    main()
