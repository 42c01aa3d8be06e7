"""An ideal cluster whose collectives have closed forms (imported by tests as ``ideal_cluster``)."""

from __future__ import annotations

import copy

from parsim.hardware.cluster import parse_cluster

IDEAL = {
    "name": "ideal",
    "gpus_per_node": 8,
    "gpu": {"model": "ideal", "peak_tflops": {"bf16": 1000.0, "fp32": 500.0},
            "hbm_capacity_GB": 80, "hbm_bw_GBps": 3000},
    "intra_node": {"fabric": "nvswitch", "bw_GBps_per_direction": 100, "latency_us": 2.0,
                   "in_switch_reduction": True},
    "scale_out": {"nics_per_node": 8, "nic_bw_Gbps": 200, "latency_us": 5.0, "spine_hop_latency_us": 1.0,
                  "nodes_per_leaf": 4, "oversubscription": 1.0},
    "reduce_bw_GBps": 500,
}


def ideal_spec(**changes):
    """The ideal cluster with dotted-key overrides, e.g. ``{"intra_node.bw_GBps_per_direction": 50}``."""
    data = copy.deepcopy(IDEAL)
    for dotted, value in changes.items():
        *path, key = dotted.split(".")
        target = data
        for part in path:
            target = target[part]
        target[key] = value
    return parse_cluster(data, "ideal.yaml")
