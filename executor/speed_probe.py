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
* the **memory probe** (bytes per second of ``torch.add`` over arrays three
  times the last-level cache, STREAM's "add") stands for memory: AdamW's
  bytes, elementwise work, a matmul's weight streamed in.

The memory's speed drifts apart from the arithmetic's. Over 90 s of the three
probes alternating with foreach AdamW steps (4.2M parameters) on both cores
of the 2-core VM (2026-11-29), the AdamW step's rate followed the memory
probe with a correlation of 0.63 and 0.70 (one rank per core), and the matmul
probe with 0.39 and 0.40; across loops of ``benchmarks/cpu_compare_loop.py``
the course plans' AdamW phase had run 8.1 ms in one and 11.0-11.4 ms in the
one before, with the matmul probe within 3% of calibration in both.

On this project's 2-core VM, over 10 minutes of probes alternating with
steps on both cores (docs/calibration.md, "Host speed"), the host's speed
moved by 15% (matmuls) and 2x (eager ops) from minute to minute. Scaling a
calibration taken minutes earlier by the probes took the median error of a
course-MLP step from 12% to 3-4% (matmul probe) and of a small transformer's
step from 22% to 7-8.5% (eager probe; the matmul probe alone: 12-14%). Inside
``parsim compare``, where a step's own noise is as large, they gain less: a
median |step error| of 15.0% against 17.6% over 81 runs.

Only the first ``min(ranks, cores)`` ranks probe, at once, so the probes read
one core's speed with as many cores busy as the calibration had, whatever
the number of ranks sharing them.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

from ._torch import require_torch
from .launch import usable_cores

SHAPE = (64, 1024, 1024)  # (m, k, n) of the matmul probe
WEIGHTS = 16  # distinct weights, 64 MiB together: beyond a core's share of a server's last-level cache
EAGER_LAYERS, EAGER_WIDTH, EAGER_ROWS = 8, 32, 16  # the eager probe: fixed cost per op, no arithmetic to speak of
# The memory probe's three arrays, 32 MiB each: together three times the 2-core VM's 32 MiB L3 (AMD EPYC), so
# that every add streams from memory as AdamW's and an elementwise kernel's bytes do.
STREAM_ELEMENTS = 8 * 1024 * 1024
SECONDS = 0.45  # the three probes together: long enough to average over scheduler ticks, short enough between steps


class Speed(NamedTuple):
    """One reading of the three probes."""

    matmul_flops: float  # FLOP/s of the matmul probe
    eager_s: float  # seconds per pass of the eager probe
    memory_Bps: float  # bytes per second the memory probe read and wrote


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
        self._addends = [torch.randn(STREAM_ELEMENTS, generator=generator) for _ in range(2)]
        self._sum = torch.empty(STREAM_ELEMENTS)
        self._add = torch.add

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
        """Bytes per second an add moves: two arrays read, one written (as STREAM counts them)."""
        self._stream_add()
        adds, elapsed = _repeat_for(seconds, self._stream_add)
        return adds * 3 * self._sum.numel() * self._sum.element_size() / elapsed

    def _over_the_weights(self) -> int:
        for w in self._weights:
            self._matmul(self._x, w)
        return len(self._weights)

    def _stream_add(self) -> int:
        self._add(*self._addends, out=self._sum)
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
