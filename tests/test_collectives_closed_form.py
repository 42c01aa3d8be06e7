"""On an ideal uniform cluster every algorithm reproduces its alpha-beta closed form."""

from __future__ import annotations

import math

import numpy as np
import pytest
from ideal_cluster import ideal_spec

from parsim.sim.collectives import build_phases, predict
from parsim.sim.collectives.algorithms import binary_tree, double_binary_tree

S = 64 * 2**20  # bytes
ALPHA = 2e-6  # one GPU-to-GPU step inside a node (two 1 us link halves)
B = 100e9  # bytes/s per direction per GPU
R = 500e9  # reduction speed, bytes/s


def sim(op, algorithm, n=8, nodes=1, size=S, spec=None):
    topo = (spec or ideal_spec()).build(nodes)
    return predict(topo, op, size, np.arange(n), algorithm).time_s


def close(a, b):
    assert a == pytest.approx(b, rel=1e-3)


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_ring_all_reduce(n):
    close(sim("all_reduce", "ring", n), 2 * (n - 1) * ALPHA + 2 * (n - 1) / n * S / B + (n - 1) / n * S / R)


@pytest.mark.parametrize("n", [2, 4, 7, 8])
def test_ring_all_gather_and_reduce_scatter(n):
    close(sim("all_gather", "ring", n), (n - 1) * ALPHA + (n - 1) / n * S / B)
    close(sim("reduce_scatter", "ring", n), (n - 1) * ALPHA + (n - 1) / n * S / B + (n - 1) / n * S / R)


@pytest.mark.parametrize("n", [2, 6, 8])
def test_ring_broadcast_and_reduce_are_pipelined_chains(n):
    close(sim("broadcast", "ring", n), (n - 1) * ALPHA + S / B)
    close(sim("reduce", "ring", n), (n - 1) * ALPHA + S / B + S / R)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_recursive_halving_doubling(n):
    k = math.log2(n)
    close(sim("all_reduce", "recursive", n), 2 * k * ALPHA + 2 * (n - 1) / n * S / B + (n - 1) / n * S / R)
    close(sim("all_gather", "recursive", n), k * ALPHA + (n - 1) / n * S / B)
    close(sim("broadcast", "recursive", n), k * (ALPHA + S / B))


@pytest.mark.parametrize("n", [2, 5, 8])
def test_direct_operations(n):
    close(sim("all_to_all", "direct", n), ALPHA + (n - 1) / n * S / B)
    close(sim("scatter", "direct", n), ALPHA + (n - 1) / n * S / B)
    close(sim("gather", "direct", n), ALPHA + (n - 1) / n * S / B)
    close(sim("broadcast", "direct", n), ALPHA + (n - 1) * S / B)
    close(sim("send_recv", "direct", 2), ALPHA + S / B)


def test_in_switch_all_reduce_moves_n_plus_one_over_n_each_way():
    n = 8
    # Two steps of one GPU<->switch hop each (half a GPU-to-GPU step).
    close(sim("all_reduce", "in_switch", n), 2 * (ALPHA / 2) + (n + 1) / n * S / B)


def test_double_binary_tree_on_one_node():
    # Each rank is interior in one tree (2 children x half the buffer in) and a leaf in the other.
    n = 8
    depth = 3
    close(sim("all_reduce", "tree", n), 2 * depth * ALPHA + 2 * S / B + S / R)


def test_hierarchical_all_reduce_on_two_nodes():
    g, nodes = 8, 2
    nic_bw, alpha_net = 200e9 / 8, 5e-6
    intra = 2 * ((g - 1) * ALPHA + (g - 1) / g * S / B) + (g - 1) / g * S / R
    inter = 2 * ((nodes - 1) * alpha_net + (nodes - 1) / nodes * (S / g) / nic_bw) + (nodes - 1) / nodes * S / g / R
    close(sim("all_reduce", "hierarchical", g * nodes, nodes), intra + inter)


def test_binary_tree_matches_nccl_shape():
    # Rank 0 is the root; odd ranks are leaves; parent clears the lowest set bit (see trees.cc).
    assert binary_tree(8).tolist() == [-1, 2, 4, 2, 0, 6, 4, 6]
    first, second = double_binary_tree(8)
    # Every rank is interior in at most one of the two trees.
    interior = [set(first[first >= 0].tolist()), set(second[second >= 0].tolist())]
    assert not (interior[0] & interior[1])


def test_phases_carry_the_bytes_of_the_closed_form():
    topo = ideal_spec().build(1)
    phases = build_phases(topo, "all_reduce", "ring", np.arange(4), S)
    assert [p.steps for p in phases] == [3, 3]
    assert all(np.allclose(p.nbytes, 3 / 4 * S) for p in phases)


def test_a_ring_without_latency_or_reduction_cost_reaches_the_lower_bound():
    spec = ideal_spec(**{"intra_node.latency_us": 0.0, "reduce_bw_GBps": 1e12, "intra_node.in_switch_reduction": False})
    p = predict(spec.build(1), "all_reduce", S, np.arange(8), "ring")
    assert p.lower_bound_s == pytest.approx(2 * 7 / 8 * S / B)
    assert p.time_s == pytest.approx(p.lower_bound_s, rel=1e-3)


def test_a_gathers_bound_is_the_roots_link_carrying_all_but_its_own_share():
    """Gather and scatter load one link, the root's: (n-1)/n of the buffer in (or out); the text says so."""
    topo = ideal_spec().build(1)
    for op, verb in (("gather", "receives"), ("scatter", "sends")):
        p = predict(topo, op, S, np.arange(8))
        assert p.lower_bound_s == pytest.approx(7 / 8 * S / B)
        assert p.lower_bound_reason.startswith(f"the root {verb} 0.875 x the buffer")


def test_where_the_switch_reduces_an_all_reduce_is_bound_by_one_buffer_each_way():
    """NVLS: each rank sends its buffer into the switch once and receives the sum once, so the bound is S / B,
    not 2(n-1)/n S / B, and a ring stays above it."""
    topo = ideal_spec(**{"intra_node.latency_us": 0.0, "reduce_bw_GBps": 1e12}).build(1)
    p = predict(topo, "all_reduce", S, np.arange(8), "in_switch")
    assert p.lower_bound_s == pytest.approx(S / B)
    assert p.time_s >= p.lower_bound_s * (1 - 1e-9)
    assert predict(topo, "all_reduce", S, np.arange(8), "ring").time_s > 1.7 * p.lower_bound_s
