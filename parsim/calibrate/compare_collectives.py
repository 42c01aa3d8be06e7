"""Prediction next to measurement for collectives, size by size."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..hardware.topology import Topology
from ..report.results import CollectiveResult
from ..sim.collectives import predict


@dataclass
class ComparedRow:
    measured: CollectiveResult
    predicted: CollectiveResult

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return self.predicted.time_s / self.measured.time_s - 1


def compare_collectives(topo: Topology, measured: list[CollectiveResult]) -> list[ComparedRow]:
    """Predict every measured (op, ranks, size) on ``topo`` with the cluster's algorithm choice."""
    rows = []
    for m in measured:
        p = predict(topo, m.op, m.size_bytes, np.arange(m.nranks))
        rows.append(ComparedRow(m, p.result()))
    return rows


def median_abs_error(rows: list[ComparedRow]) -> float:
    return float(np.median([abs(r.error) for r in rows])) if rows else float("nan")
