"""How a model's layers are split into pipeline stages.

Even splits are the default when the stage count divides the layers. Otherwise
(or when asked) the layers are *balanced*: contiguous runs chosen so that the
slowest stage, counting the embedding on the first stage and the LM head on
the last, is as fast as possible. That is the linear partition problem, solved
exactly by dynamic programming; among splits with the same slowest stage, the
one with the most even stage costs is kept, and among those the one with the
fewest layers early (the first stages hold the most microbatches in flight).
For Llama 3 405B on 16 stages (126 layers, a head worth about two thirds of a
layer) it gives 7 layers to the first and the last stage and 8 to the others:
Meta's split (Dubey et al. 2024, section 3.3.2). Where the first or last stage
may run only the embedding or only the head (``empty_ends``), it leaves that
stage no layer when its extra alone outweighs a stage: for DeepSeek-V3 on 32
stages, whose last stage also runs the multi-token prediction module, it gives
Megatron-LM's layout ``Et|(tt|)*30mL``, 1/2x30/0.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


def even_split(layers: int, stages: int) -> tuple[int, ...] | None:
    """``layers / stages`` per stage when that divides, else None."""
    return (layers // stages,) * stages if layers % stages == 0 else None


def balanced_split(layer_cost: float, layers: int, stages: int, first_extra: float = 0.0,
                   last_extra: float = 0.0, empty_ends: bool = False) -> tuple[int, ...]:
    """Layers per stage minimizing the slowest stage's cost, every stage holding at least one layer (with
    ``empty_ends``, every stage but the first and the last).

    Each layer costs ``layer_cost`` (all decoder layers are alike); the first
    stage also pays ``first_extra`` (embedding) and the last ``last_extra``
    (head). Costs are compared after rounding to a thousandth of a layer, so
    floating-point noise cannot break ties.
    """
    unit = layer_cost or 1.0
    return _balanced(layers, stages, round(first_extra / unit * 1000), round(last_extra / unit * 1000),
                     empty_ends and stages > 1)


@lru_cache(maxsize=256)
def _balanced(layers: int, stages: int, first: int, last: int, empty_ends: bool = False) -> tuple[int, ...]:
    # slowest[s][n], squares[s][n]: the best (slowest stage, sum of squared stage costs) for the first n
    # layers in s stages, costs in thousandths of a layer (sums stay exact in floats); choice[s][n]: the
    # layers given to stage s-1. Ties go to the largest count for the later stage, so early stages hold less.
    least = [1] * stages  # the fewest layers each stage may hold
    if empty_ends:
        least[0] = least[-1] = 0
    before = np.concatenate([[0], np.cumsum(least)])  # the fewest the first s stages hold together
    slowest = np.full((stages + 1, layers + 1), np.inf)
    squares = np.full((stages + 1, layers + 1), np.inf)
    choice = np.zeros((stages + 1, layers + 1), dtype=np.int64)
    slowest[0, 0] = squares[0, 0] = 0.0
    for s in range(1, stages + 1):
        extra = (first if s == 1 else 0) + (last if s == stages else 0)
        for n in range(before[s], layers - (before[-1] - before[s]) + 1):
            counts = np.arange(least[s - 1], n - before[s - 1] + 1)
            cost = counts * 1000.0 + extra
            worst = np.maximum(slowest[s - 1, n - counts], cost)
            sq = squares[s - 1, n - counts] + cost * cost
            best = worst == worst.min()
            best &= sq == sq[best].min()
            pick = int(np.flatnonzero(best)[-1])
            slowest[s, n], squares[s, n], choice[s, n] = worst[pick], sq[pick], counts[pick]
    split, n = [], layers
    for s in range(stages, 0, -1):
        split.append(int(choice[s, n]))
        n -= split[-1]
    return tuple(reversed(split))
