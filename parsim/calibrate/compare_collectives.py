"""Prediction next to measurement for collectives, size by size."""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    """Predict every measured (op, ranks, size) on ``topo`` with the cluster's algorithm choice; on a host whose
    collective probe was timed around the measurement (``ClusterSpec.at_collective_probe``), each plus what the
    probe took more per byte at its bus bytes, at least a quarter of it (as the step simulator prices them)."""
    rows = []
    for m in measured:
        p = predict(topo, m.op, m.size_bytes, np.arange(m.nranks)).result()
        rows.append(ComparedRow(m, replace(p, time_s=topo.spec.collective_now_s(p.time_s, m.op, m.nranks,
                                                                                 m.size_bytes))))
    return rows


def median_abs_error(rows: list[ComparedRow]) -> float:
    return float(np.median([abs(r.error) for r in rows])) if rows else float("nan")
