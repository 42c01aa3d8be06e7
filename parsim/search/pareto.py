"""The Pareto front: the plans no other plan beats on every objective at once."""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

import numpy as np

T = TypeVar("T")


def pareto_front(items: Sequence[T], objectives: Callable[[T], Sequence[float]]) -> list[T]:
    """The items not dominated by another (no worse on every objective, better on one; all minimized),
    sorted by their first objective. Of items with equal objectives, the first is kept."""
    if not items:
        return []
    return [items[i] for i in front_indices(np.array([objectives(x) for x in items], dtype=float))]


def front_indices(values: np.ndarray) -> list[int]:
    """Rows of ``values`` [items, objectives] on the front, in order of the first objective."""
    order = np.lexsort(values.T[::-1])  # by the first objective, then the next: no later row dominates an earlier
    kept = np.empty((0, values.shape[1]))
    out: list[int] = []
    for i in order:
        if not (kept <= values[i]).all(axis=1).any():
            kept = np.vstack([kept, values[i]])
            out.append(int(i))
    return out
