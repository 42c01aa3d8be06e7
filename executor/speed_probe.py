"""How fast this host's cores run right now: three short, fixed probes, timed the same way everywhere.

A CPU host's speed drifts: on a shared VM a core's throughput wanders by
10-30% over minutes with nothing else running inside it (other tenants), and
the cost of an eager op by up to 2x. A calibration taken minutes before a run
then describes a faster or slower machine than the one that runs it.
``parsim calibrate`` times these probes between its compute benchmarks and
writes their medians to the cluster file; ``parsim compare`` times them again
before the warm-up and after the measured steps (which run back to back, as
a training loop's do: a step right after a probe runs its first passes
cold), on the same ranks, and scales the calibrated
compute figures by the ratios:

* the **matmul probe** (FLOP/s of a thin fp32 matmul, its weight streamed in)
  stands for arithmetic: matmuls, a core's arithmetic per element;
* the **eager probe** (seconds per forward and backward of a stack of tiny
  ``nn.Linear`` layers, all fixed cost) stands for the host's cost per op and
  per optimizer tensor;
* the **memory probe** (bytes per second of foreach AdamW steps over four
  1M-element fp32 parameters, 64 MiB with their gradients and moments: twice
  the 2-core VM's L3) stands for memory-bound work: AdamW's bytes,
  elementwise work, a matmul's weight streamed in.

The memory's speed drifts apart from the arithmetic's: across loops of
``benchmarks/cpu_compare_loop.py`` the course plans' AdamW phase ran 8.1 ms in
one and 11.0-11.4 ms in the one before, with the matmul probe within 3% of
calibration in both. An add over arrays beyond the cache (STREAM's "add")
tracked that drift but overshot it: in runs where it read 1.36x and 1.58x its
calibration, course DDP's AdamW ran 1.11x and 1.23x as fast as at the add's
calibration speed (docs/calibration.md, "Memory drifts on its own"). About
half of a CPU AdamW step's time is not DRAM-bound, so the probe is an AdamW
step itself, moving as the optimizer moves.

On this project's 2-core VM, over 10 minutes of probes alternating with
steps on both cores (docs/calibration.md, "Host speed"), the host's speed
moved by 15% (matmuls) and 2x (eager ops) from minute to minute. Scaling a
calibration taken minutes earlier by the probes took the median error of a
course-MLP step from 12% to 3-4% (matmul probe) and of a small transformer's
step from 22% to 7-8.5% (eager probe; the matmul probe alone: 12-14%). Inside
``parsim compare``, where a step's own noise is as large, they gain less: a
median |step error| of 15.0% against 17.6% over 81 runs.

The probes read a host's moments more than the speed its work runs at on
some hosts: on the 2-core AMD VM (2026-11-30) the eager probe read the host
1.15-1.6x as fast as calibration around tiny PP's runs in four sets of
five while the steps ran at about the calibration's speed, and over that
VM's eleven sets the steps came out within 15% in 45 of 55 plans with the
three compute probes held at calibration speed, in 36 following them. So
calibrate pairs each reading with the work the probe stands for, timed
right after it (``compute_bench.probe_pairs``: a few matmuls, the eager
layers' passes, AdamW over memory), and fits how far each work follows its
probe (``parsim.calibrate.host.fit_probe_elasticity``); ``parsim compare``
scales each work by its probe's ratio to that power.

Only the first ``min(ranks, cores)`` ranks probe, at once, so the probes read
one core's speed with as many cores busy as the calibration had, whatever
the number of ranks sharing them.

The **collective probe** (:class:`CollectiveProbe`) times an all-reduce
between ranks 0 and 1 at 256 KiB, 1 MiB and 4 MiB, in and beyond a core's
cache. A host's transfers between processes have slow spells of their own,
seconds to tens of seconds long, that the compute probes do not see: on the
2-core VM (2026-11-30) a 1 MiB all-reduce took 430-530 us, then 800-1200 us
for 5-20 s at a time, with a 1 MiB copy inside a core unchanged (23-29 us)
and no steal time; two groups timed in turn, one on BBR and one on CUBIC,
slowed together, so it is the host, not TCP's congestion control
(docs/calibration.md, "Collectives' slow spells"). ``parsim calibrate`` times it
in each round of its collectives (and writes its all-reduce sweep's own times
at these sizes, the speed its fits describe), ``parsim compare`` beside the other probes,
and the step simulator gives each collective what the probe took more per
byte at its size (``ClusterSpec.collective_now_s``).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, NamedTuple

from parsim.lowering.lower import ADAMW_ACCESSES, FP32

from ._torch import require_distributed, require_torch
from .launch import usable_cores

SHAPE = (64, 1024, 1024)  # (m, k, n) of the matmul probe
WEIGHTS = 16  # distinct weights, 64 MiB together: beyond a core's share of a server's last-level cache
EAGER_LAYERS, EAGER_WIDTH, EAGER_ROWS = 8, 32, 16  # the eager probe: fixed cost per op, no arithmetic to speak of
# The memory probe's AdamW: course-MLP-sized parameters (1024 x 1024 weights), 64 MiB with their gradients and
# two moments, twice the 2-core VM's 32 MiB L3 (AMD EPYC): each step streams from memory, as a model's does.
ADAMW_TENSORS, ADAMW_ELEMENTS = 4, 1 << 20
ADAMW_BYTES = ADAMW_ACCESSES * FP32  # per parameter: foreach AdamW's fp32 accesses, as the model counts them
SECONDS = 0.45  # the three probes together: long enough to average over scheduler ticks, short enough between steps


# The collective probe: an all-reduce between ranks 0 and 1 (a core each) at these sizes, this many calls back to back
# after two untimed ones (their mean kept): about 25 ms in all on the 2-core VM, 60 ms in a slow spell.
COLLECTIVE_PROBE_RANKS = 2
COLLECTIVE_PROBE_KIB = (256, 1024, 4096)
COLLECTIVE_PROBE_CALLS = 9


class Speed(NamedTuple):
    """One reading of the three probes."""

    matmul_flops: float  # FLOP/s of the matmul probe
    eager_s: float  # seconds per pass of the eager probe
    memory_Bps: float  # bytes per second the memory probe's AdamW steps read and wrote


def probes_on(rank: int, world: int) -> bool:
    """Whether ``rank`` runs the probes: one rank per core, the others wait."""
    return rank < min(world, usable_cores())


class SpeedProbe:
    """``probe()``: a :class:`Speed` reading, a third of the time on each probe.

    The operands are allocated once (random values, as a model's are), so timing does not page in memory.
    """

    def __init__(self, seed: int = 0):
        torch = require_torch()
        m, k, n = SHAPE
        generator = torch.Generator().manual_seed(seed)
        self._x = torch.randn(m, k, generator=generator)
        self._weights = list(torch.randn(WEIGHTS, k, n, generator=generator).unbind(0))
        self._flops = 2 * m * k * n
        self._matmul = torch.matmul
        torch.manual_seed(seed)
        self._layers = torch.nn.Sequential(*[torch.nn.Linear(EAGER_WIDTH, EAGER_WIDTH)
                                             for _ in range(EAGER_LAYERS)])
        self._input = torch.randn(EAGER_ROWS, EAGER_WIDTH, generator=generator)
        params = [torch.nn.Parameter(torch.randn(ADAMW_ELEMENTS, generator=generator)) for _ in range(ADAMW_TENSORS)]
        for param in params:
            param.grad = torch.randn(ADAMW_ELEMENTS, generator=generator)
        self._adamw = torch.optim.AdamW(params)
        self._adamw.step()  # its moments allocated here, not in a timing

    def __call__(self, seconds: float = SECONDS) -> Speed:
        return Speed(self.matmul_flops(seconds / 3), self.eager_s(seconds / 3), self.memory_Bps(seconds / 3))

    def matmul_flops(self, seconds: float) -> float:
        self._matmul(self._x, self._weights[0])  # first-call paths out of the timing
        calls, elapsed = _repeat_for(seconds, self._over_the_weights)
        return calls * self._flops / elapsed

    def eager_s(self, seconds: float) -> float:
        self._eager_pass()
        passes, elapsed = _repeat_for(seconds, self._eager_pass)
        return elapsed / passes

    def memory_Bps(self, seconds: float) -> float:
        """Bytes per second AdamW steps move over the probe's parameters."""
        steps, elapsed = _repeat_for(seconds, self._adamw_step)
        return steps * ADAMW_BYTES * ADAMW_TENSORS * ADAMW_ELEMENTS / elapsed

    def _over_the_weights(self) -> int:
        for w in self._weights:
            self._matmul(self._x, w)
        return len(self._weights)

    def _adamw_step(self) -> int:
        self._adamw.step()
        return 1

    def _eager_pass(self) -> int:
        self._layers(self._input).sum().backward()
        self._layers.zero_grad(set_to_none=True)
        return 1


def _repeat_for(seconds: float, work: Callable[[], int]) -> tuple[int, float]:
    """Run ``work`` (it returns how many units it did) until ``seconds`` have passed: (units, seconds taken)."""
    done, start = 0, time.perf_counter()
    while True:
        done += work()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return done, elapsed


class CollectiveProbe:
    """``probe()``: seconds per all-reduce at each of :data:`COLLECTIVE_PROBE_KIB` over ``group`` (ranks 0 and 1,
    both calling it at once), the mean of :data:`COLLECTIVE_PROBE_CALLS` calls back to back after two untimed
    ones: as ``parsim calibrate``'s sweep times them (``executor.collectives``), whose all-reduce at these sizes
    the file keeps as the probe's calibrated reading. The median of 9 calls timed one by one read 8-12% under
    that sweep at 4 MiB at one speed (sets FT and FU, docs/calibration.md)."""

    def __init__(self, group: object):
        torch = require_torch()
        self._group = group
        self._buffers = [torch.ones(kib * 1024 // FP32) for kib in COLLECTIVE_PROBE_KIB]

    def __call__(self) -> tuple[float, ...]:
        dist = require_distributed()
        means = []
        for buffer in self._buffers:
            for _ in range(2):
                dist.all_reduce(buffer, group=self._group)
            start = time.perf_counter()
            for _ in range(COLLECTIVE_PROBE_CALLS):
                dist.all_reduce(buffer, group=self._group)
            means.append((time.perf_counter() - start) / COLLECTIVE_PROBE_CALLS)
        return tuple(means)


def median_reading(readings: list[tuple[float, ...]]) -> tuple[tuple[int, float], ...]:
    """The collective probe's median over ``readings`` at each size, as (KiB, seconds) points."""
    return tuple((kib, statistics.median(column)) for kib, column in zip(COLLECTIVE_PROBE_KIB, zip(*readings)))


def collective_probe_group(world: int) -> object | None:
    """The group the collective probe runs over (every rank must call this, at one point; None on one rank)."""
    if world < COLLECTIVE_PROBE_RANKS:
        return None
    from .gloo_threads import collective_group

    return collective_group(range(COLLECTIVE_PROBE_RANKS))


def measure_collective_probe(readings: int, timeout_s: float = 120.0) -> list[tuple[float, ...]]:
    """``readings`` readings of the collective probe on ranks of their own (for ``parsim calibrate``), rank 0's."""
    from .launch import launch

    return launch(_probe_rank, COLLECTIVE_PROBE_RANKS, (readings,), "gloo", timeout_s)[0]


def _probe_rank(rank: int, world: int, readings: int) -> list[tuple[float, ...]]:
    probe = CollectiveProbe(collective_probe_group(world))
    return [probe() for _ in range(readings)]
