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
Meta's split (Dubey et al. 2024, section 3.3.2).
"""

from __future__ import annotations

from functools import lru_cache


def even_split(layers: int, stages: int) -> tuple[int, ...] | None:
    """``layers / stages`` per stage when that divides, else None."""
    return (layers // stages,) * stages if layers % stages == 0 else None


def balanced_split(layer_cost: float, layers: int, stages: int, first_extra: float = 0.0,
                   last_extra: float = 0.0) -> tuple[int, ...]:
    """Layers per stage minimizing the slowest stage's cost, every stage holding at least one layer.

    Each layer costs ``layer_cost`` (all decoder layers are alike); the first
    stage also pays ``first_extra`` (embedding) and the last ``last_extra``
    (head). Costs are compared after rounding to a millionth of a layer, so
    floating-point noise cannot break ties.
    """
    unit = layer_cost or 1.0
    return _balanced(layers, stages, round(first_extra / unit * 1e6), round(last_extra / unit * 1e6))


@lru_cache(maxsize=256)
def _balanced(layers: int, stages: int, first: int, last: int) -> tuple[int, ...]:
    # best[s][n]: (slowest stage, sum of squared stage costs) for the first n layers in s stages,
    # costs in millionths of a layer; choice[s][n]: layers given to stage s-1.
    def cost(stage: int, count: int) -> int:
        return count * 1_000_000 + (first if stage == 0 else 0) + (last if stage == stages - 1 else 0)

    inf = (float("inf"), float("inf"))
    best = [[inf] * (layers + 1) for _ in range(stages + 1)]
    choice = [[0] * (layers + 1) for _ in range(stages + 1)]
    best[0][0] = (0, 0)
    for s in range(1, stages + 1):
        for n in range(s, layers - (stages - s) + 1):
            for count in range(1, n - (s - 1) + 1):
                before = best[s - 1][n - count]
                if before[0] == float("inf"):
                    continue
                c = cost(s - 1, count)
                candidate = (max(before[0], c), before[1] + c * c)
                if candidate <= best[s][n]:  # ties: the later stage takes more, so early stages hold less
                    best[s][n], choice[s][n] = candidate, count
    split, n = [], layers
    for s in range(stages, 0, -1):
        split.append(choice[s][n])
        n -= choice[s][n]
    return tuple(reversed(split))
