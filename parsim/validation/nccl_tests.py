"""Published nccl-tests results (``nccl_tests.yaml``) next to parsim's predictions of the same runs."""

from __future__ import annotations

import importlib.resources
import statistics
from dataclasses import dataclass

from ..files import read_yaml
from ..hardware.cluster import load_cluster
from ..sim.collectives import predict
from ..units import format_size


@dataclass(frozen=True)
class Row:
    source: str
    url: str
    hardware: str
    nccl_version: str
    cluster: str
    nodes: int
    op: str
    size: int
    published_GBps: float
    predicted_GBps: float
    algorithm: str  # NCCL algorithm/protocol parsim predicts NCCL picks
    approximate: bool

    @property
    def gpus(self) -> int:
        return self.nodes * load_cluster(self.cluster).gpus_per_node

    @property
    def error(self) -> float:
        """predicted / published - 1 (positive: parsim predicts a faster collective)."""
        return self.predicted_GBps / self.published_GBps - 1


def sources() -> list[dict]:
    path = importlib.resources.files("parsim.validation") / "nccl_tests.yaml"
    return read_yaml(path)["sources"]


def compare() -> list[Row]:
    """Every published row with parsim's busbw for the same collective, size and cluster."""
    rows = []
    for src in sources():
        topo = load_cluster(src["cluster"]).build(src["nodes"])
        for r in src["rows"]:
            p = predict(topo, src["op"], r["size"])
            name = f"{p.nccl.chosen.algo}/{p.protocol}" if p.nccl else p.algorithm
            rows.append(Row(src["id"], src["url"], src["hardware"], str(src["nccl_version"]), src["cluster"],
                            src["nodes"], src["op"], int(r["size"]), float(r["busbw_GBps"]),
                            p.result().busbw_Bps / 1e9, name, bool(src.get("approximate", False))))
    return rows


def median_abs_error(rows: list[Row]) -> float:
    return statistics.median(abs(r.error) for r in rows)


def markdown(rows: list[Row]) -> str:
    """The accuracy table of docs/nccl-accuracy.md."""
    lines = ["| op | GPUs (nodes) | cluster file | size | published busbw | predicted busbw | error "
             "| NCCL algo/proto (predicted) | source |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = " (approx.)" if r.approximate else ""
        lines.append(f"| {r.op.replace('_', '-')} | {r.gpus} ({r.nodes}) | {r.cluster} | {format_size(r.size)} "
                     f"| {r.published_GBps:.1f} GB/s{mark} | {r.predicted_GBps:.1f} GB/s | {r.error:+.1%} "
                     f"| {r.algorithm} | [{r.source}]({r.url}) |")
    lines.append("")
    lines.append(f"Median |error| over {len(rows)} rows: {median_abs_error(rows):.1%}")
    return "\n".join(lines)
