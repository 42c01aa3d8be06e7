"""Routes computed by formula are real paths in the networkx graph, and as short as its shortest paths."""

from __future__ import annotations

import itertools

import networkx as nx
import numpy as np
import pytest
from ideal_cluster import ideal_spec

from parsim.hardware.topology import SWITCH


def _edges_by_link(graph):
    return {d["link"]: (u, v) for u, v, d in graph.edges(data=True) if d["link"] >= 0}


@pytest.mark.parametrize("fabric", ["nvswitch", "pcie"])
def test_every_route_is_a_path_of_the_graph(fabric):
    spec = ideal_spec(**{"intra_node.fabric": fabric, "intra_node.in_switch_reduction": False,
                         "scale_out.nics_per_node": 2})
    topo = spec.build(6)  # two scalable units of 4 nodes
    graph = topo.graph
    links = _edges_by_link(graph)
    pairs = np.array(list(itertools.permutations(range(topo.num_gpus), 2)))
    routes = topo.routes(pairs[:, 0], pairs[:, 1])
    for (src, dst), route in zip(pairs, routes):
        here, free = ("gpu", src), 0
        for link in route[route >= 0]:
            if topo.is_fabric_link(link):  # a capacity of the fabric vertex, not an edge
                fabric = next(n for n, d in graph.nodes(data=True) if d.get("link") == link)
                if here != fabric:
                    assert graph[here][fabric]["link"] == -1
                    free += 1
                here = fabric
                continue
            u, v = links[link]
            if here != u:  # joined by a zero-cost GPU/host-to-NIC attachment
                assert graph[here][u]["link"] == -1
                free += 1
            here = v
        if here != ("gpu", dst):
            assert graph[here][("gpu", dst)]["link"] == -1
            free += 1
        hops = sum(1 for link in route[route >= 0] if not topo.is_fabric_link(link)) + free
        assert hops == nx.shortest_path_length(graph, ("gpu", src), ("gpu", dst))


def test_switch_endpoint_routes_end_in_the_fabric():
    topo = ideal_spec().build(1)
    routes = topo.routes([3, SWITCH], [SWITCH, 5])
    names = [[topo.link_name(int(link)) for link in r if link >= 0] for r in routes]
    fabric = "NVSwitch of node 0 (all traffic through it)"
    assert names == [["NVLink gpu3 -> NVSwitch (node 0)", fabric], [fabric, "NVLink NVSwitch -> gpu5 (node 0)"]]


def test_path_kinds():
    topo = ideal_spec().build(8)
    assert topo.path_kind(0, 1) == "nvlink"
    assert topo.path_kind(0, 8) == "leaf"  # same rail, same scalable unit
    assert topo.path_kind(0, 40) == "spine"  # node 5 is in the second scalable unit
