"""The step simulator's algorithm choice is predict()'s, without timing what it discards."""

from __future__ import annotations

import numpy as np
import pytest

from parsim.hardware.cluster import load_cluster
from parsim.sim.collectives.simulate import choose_algorithm, predict


@pytest.mark.parametrize("cluster", ["dgx-h100", "dgx-a100", "pcie-4x-rtx6000ada"])
def test_choose_algorithm_picks_what_predict_picks(cluster):
    spec = load_cluster(cluster)
    gpn = spec.gpus_per_node
    topo = spec.build(4)
    groups = [np.arange(gpn), np.arange(0, 4 * gpn, gpn), np.arange(4 * gpn), np.arange(0, 4 * gpn, 2)]
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"):
        for group in groups:
            group = group[:2] if op == "send_recv" else group
            for size in (4096, 1 << 20, 1 << 28):
                p = predict(topo, op, size, group)
                assert choose_algorithm(topo, op, size, group) == (p.algorithm, p.protocol)
