"""What FSDP2 itself costs a CPU rank: its hooks per unit and pass, and AdamW over its DTensor parameters.

The step simulator prices FSDP's gathers, reduce-scatters and the copies in and out of their buffers, and
(from ``parsim calibrate``'s ``compute.fsdp_*`` figures) FSDP2's host work per unit and per parameter, which
on a GPU hides behind the kernels and on a CPU host is the step. This times ``--ranks`` processes, one core
each, on stacks of 2 and 8 FSDP units of ``--linears`` linear layers, plain and ``fully_shard``-ed (the
calibration's own measurement, ``executor.compute_bench.measure_fsdp_host``), and prints what FSDP2 adds
per unit (the slope between the two stacks: the root's own costs cancel) to a
forward, a backward and an AdamW step (``foreach``, torch's default) with ``zero_grad``, and ("kept") to a
forward and a backward that gather and reduce nothing (units kept gathered, gradients unsynced, as a
pipeline's passes between a stage's first and last):

* over a group of each rank's own: no collective moves bytes;
* with more than one rank, over all of them too (as ``parsim calibrate`` measures it): the all-gathers and
  reduce-scatters run for real, and the seconds inside them are left out.

On the 2-core AMD VM (2026-11-28, two runs each), units of two 64-wide linears on one rank: 0.32-0.37 ms per
unit in a forward, 0.47-0.56 ms in a backward, 0.75-0.94 ms per unit (four parameters) in AdamW. With
``--ranks 2 --linears 4 --width 256`` (1 MiB of weights a unit): 0.09-0.46 / 0.43-1.33 / 0.96-2.16 ms per unit
over each rank's own group, and 3.65-5.54 / 6.84-8.58 / 2.3-3.5 ms over both ranks, where set CI's file prices
a unit's all-gather at 1.79 ms and its reduce-scatter at 3.63. (The script's first version, its own loop with
a barrier before every step, gave 428-512 us / 601-708 us / 1.05-1.37 ms and 0.54-0.75 / 1.17-1.40 /
2.8-3.5 and 3.79-4.07 / 7.05-7.48 / 1.6-3.1 ms.) `docs/calibration.md`, "FSDP on a CPU host".

Run:  python benchmarks/cpu_fsdp_overhead.py [--ranks 1] [--linears 2] [--width 64] [--steps 15]
"""

from __future__ import annotations

import argparse
import sys

ROWS = 8  # each unit's input rows: host work, not arithmetic, sets its time


def _extra_ms(rows: list) -> list[float]:
    """Milliseconds FSDP2 adds per unit to a forward, a backward and an AdamW step, and to a forward and a
    backward that gather and reduce nothing: from the rows of :func:`executor.compute_bench.measure_fsdp_host`,
    fully_shard-ed less plain, the slope between its stacks (the root's own costs cancel)."""
    (low, _, plain_low, sharded_low, kept_low), (high, _, plain_high, sharded_high, kept_high) = rows[0], rows[-1]

    def slope(fsdp_high, fsdp_low, k):
        return ((fsdp_high[k] - plain_high[k]) - (fsdp_low[k] - plain_low[k])) / (high - low) * 1e3
    return [slope(sharded_high, sharded_low, k) for k in range(3)] + [slope(kept_high, kept_low, k) for k in range(2)]


def _rank(rank: int, world: int, linears: int, width: int, steps: int) -> dict[str, list[float]]:
    from torch.distributed.device_mesh import DeviceMesh

    from executor.compute_bench import measure_fsdp_host
    from executor.gloo_threads import collective_group

    unit = (linears, width, ROWS)
    own = DeviceMesh.from_group([collective_group([r]) for r in range(world)][rank], "cpu")
    out = {"own group": _extra_ms(measure_fsdp_host(steps=steps, unit=unit, mesh=own))}
    if world > 1:
        out["all ranks"] = _extra_ms(measure_fsdp_host(steps=steps, unit=unit))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1, help="processes, one core each")
    parser.add_argument("--linears", type=int, default=2, help="linear layers per FSDP unit")
    parser.add_argument("--width", type=int, default=64, help="each linear's width")
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()

    from executor.launch import launch, usable_cores

    cores = usable_cores()
    for name, value, high in (("--ranks", args.ranks, cores), ("--linears", args.linears, 64),
                              ("--width", args.width, 8192), ("--steps", args.steps, 10_000)):
        if not 1 <= value <= high:
            print(f"cpu_fsdp_overhead.py: {name} {value}: between 1 and {high}"
                  + (f" (one core each: this host has {cores})" if name == "--ranks" else ""), file=sys.stderr)
            sys.exit(2)
    per_rank = launch(_rank, args.ranks, (args.linears, args.width, args.steps), "gloo", 600)
    print(f"units of {args.linears} x {args.width}-wide linears, {args.ranks} rank(s): what FSDP2 adds per unit, ms")
    print(f"{'rank':>4}  {'mesh':<10}  {'forward':>8}  {'backward':>8}  {'adamw':>8}  {'fwd kept':>8}  "
          f"{'bwd kept':>8}")
    for rank, result in enumerate(per_rank):
        for mesh, extra in result.items():
            print(f"{rank:>4}  {mesh:<10}  " + "  ".join(f"{v:>8.3f}" for v in extra))


if __name__ == "__main__":
    main()
