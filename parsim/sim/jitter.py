"""The wait for the slowest rank at a step's end, where the same work's time varies from rank to rank.

The simulator times every rank's work exactly. On a real host the same work
takes a little more or less from rank to rank and step to step (other
processes, interrupts, two ranks' memory traffic meeting): on the 2-core VM
(2026-11-29) the AdamW steps of course DDP's two ranks, 12.3 ms at the
median, differed by 1.1 ms at the median over 30 steps, either rank the
slower about as often. Where ranks meet (a collective, a transfer) the
first to arrive waits for the last; at the step's end nothing joins them,
and the step lasts until its slowest rank is done. That wait is what this
module adds: the expected latest end over the ranks minus the simulated one.

Each rank's end is its simulated end ``T_i`` plus a normal error of sigma
``jitter x W_i``, ``W_i`` its time since it last met other ranks (the end of
its last collective or receive; else the step's start, where the loop's
barrier starts every rank at once). ``jitter`` is the host's
(``compute.rank_jitter``, which ``parsim calibrate`` measures on AdamW steps
that every rank starts at once: :func:`parsim.calibrate.host.fit_rank_jitter`).
A simulated rank stands for the replicas that run its program, each with an
error of its own. For two ranks of the same ``T`` and sigma the wait is
``sigma / sqrt(pi)``, 0.56 sigma; it grows with the ranks, as the expected
largest of n normal errors does. Every rank waits that much longer at the
step's end (its ``idle``), and the step is that much longer.

That is the wait's mean over steps. ``parsim compare`` holds each measured
rank's phases as medians over steps, where two twins' waits differ: in each
step one of them waits and the other does not, so each one's median wait is
about none, while their step ends the mean later. :func:`sampled_waits` draws
the steps, so that a rank's wait can be priced as the statistic it is held
to.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from ..report.trace import Trace

# Points of the grid the expected maximum is integrated on, and how many sigmas it spans beyond the ends.
GRID_POINTS, SIGMAS = 4001, 8.0
# Steps :func:`sampled_waits` draws (a median of them is within 2% of a sigma of the true one) and their seed:
# the same trace gives the same figures.
SAMPLED_STEPS, SAMPLE_SEED = 4001, 0
MEETS = ("collective", "recv")  # event kinds where a rank waits for others


def end_wait_s(trace: Trace, jitter: float) -> float:
    """Seconds the step's end moves out, on average, when each rank's time since it last met the others varies
    by ``jitter`` (sigma over that time): ``E[max_i (T_i + e_i)] - max_i T_i``, with ``trace.meta["represents"]``
    giving how many ranks each simulated one stands for (1 if absent)."""
    if jitter <= 0 or not trace.events:
        return 0.0
    ends = RankEnds.of(trace)
    return expected_max(ends.end, jitter * ends.since, ends.count) - float(ends.end.max())


def sampled_waits(trace: Trace, jitter: float, ranks: Sequence[int], steps: int = SAMPLED_STEPS) -> np.ndarray:
    """Each of ``ranks``' wait at the step's end beyond the trace's own, in ``steps`` drawn steps: an array of
    (steps, len(ranks)). ``ranks`` are simulated ranks, one entry per replica wanted (a simulated rank standing
    for two measured ranks is named twice, each entry a replica with an error of its own); the replicas not
    named still end their steps, and may end them last. In a step, a replica of simulated rank ``j`` ends at
    ``T_j + e`` and waits until the latest end of all; less ``max T - T_j``, which its idle in the trace
    already holds. The mean over the steps of any entry is :func:`end_wait_s`."""
    ends = RankEnds.of(trace)
    if jitter <= 0 or not trace.events:
        return np.zeros((steps, len(ranks)))
    where = {rank: i for i, rank in enumerate(ends.ranks)}
    column = np.array([where[rank] for rank in ranks], dtype=int)
    sigma = jitter * ends.since
    rng = np.random.default_rng(SAMPLE_SEED)
    own = ends.end[column] + sigma[column] * rng.standard_normal((steps, len(ranks)))
    latest = own.max(axis=1)
    unnamed = ends.count - np.bincount(column, minlength=len(ends.ranks))
    for j in np.flatnonzero((unnamed > 0) & (sigma > 0)):  # the largest of n draws: the normal's quantile of u^(1/n)
        quantile = np.vectorize(NormalDist().inv_cdf)(np.clip(rng.random(steps) ** (1.0 / unnamed[j]), 1e-12,
                                                              1 - 1e-12))
        latest = np.maximum(latest, ends.end[j] + sigma[j] * quantile)
    for j in np.flatnonzero((unnamed > 0) & (sigma == 0)):
        latest = np.maximum(latest, ends.end[j])
    return latest[:, None] - own - (ends.end.max() - ends.end[column])


@dataclass
class RankEnds:
    """Each simulated rank's end (``end``), its time since it last met the others (``since``) and how many
    ranks it stands for (``count``), in ``ranks`` order."""

    ranks: list[int]
    end: np.ndarray
    since: np.ndarray
    count: np.ndarray

    @classmethod
    def of(cls, trace: Trace) -> "RankEnds":
        ends: dict[int, float] = {}
        met: dict[int, float] = {}
        for e in trace.events:
            end = e.start_s + e.dur_s
            if end > ends.get(e.rank, 0.0):
                ends[e.rank] = end
            if e.kind in MEETS and end > met.get(e.rank, 0.0):
                met[e.rank] = end
        ranks = sorted(ends)
        represents = {int(rank): int(count) for rank, count in trace.meta.get("represents", {}).items()}
        return cls(ranks, np.array([ends[r] for r in ranks]), np.array([ends[r] - met.get(r, 0.0) for r in ranks]),
                   np.array([represents.get(r, 1) for r in ranks], dtype=float))

    def last(self, jitter: float) -> tuple[int, float, int]:
        """The simulated rank that ends last, its time since it last met the others, and how many ranks
        (replicas counted) may end last with it: those ending within ``SIGMAS`` of its sigma."""
        i = int(np.argmax(self.end))
        reach = SIGMAS * jitter * float(self.since[i])
        return self.ranks[i], float(self.since[i]), int(self.count[self.end >= self.end[i] - reach].sum())


def expected_max(mean: np.ndarray, sigma: np.ndarray, count: np.ndarray) -> float:
    """``E[max]`` over independent normals, ``count[i]`` of them of mean ``mean[i]`` and sigma ``sigma[i]`` (0: a
    constant): ``lo + integral from lo of (1 - F(t)) dt``, F the product of the normals' distribution functions,
    from ``lo``, the largest constant or ``SIGMAS`` sigmas below the largest mean (where F is 0 to float
    precision), to ``SIGMAS`` sigmas above the last mean."""
    random = sigma > 0
    if not random.any():
        return float(mean.max())
    lo = float(mean.max()) - SIGMAS * float(sigma.max())
    if not random.all():
        lo = max(lo, float(mean[~random].max()))  # the maximum is never below a constant
    hi = float((mean[random] + SIGMAS * sigma[random]).max())
    if hi <= lo:
        return lo
    t = np.linspace(lo, hi, GRID_POINTS)
    log_f = np.zeros_like(t)
    pairs, where = np.unique(np.stack([mean[random], sigma[random]], axis=1), axis=0, return_inverse=True)
    counts = np.bincount(where.ravel(), weights=count[random], minlength=len(pairs))
    for (m, s), n in zip(pairs, counts):
        cdf = 0.5 * (1.0 + _erf((t - m) / (s * math.sqrt(2.0))))
        log_f += n * np.log(np.maximum(cdf, 1e-300))
    below = 1.0 - np.exp(log_f)
    return lo + float(np.sum((below[1:] + below[:-1]) * np.diff(t)) / 2.0)


_erf = np.vectorize(math.erf, otypes=[float])
