"""A cluster placed on N nodes: links, routes, and the networkx graph.

Every GPU has one link *up* into its node's fabric (the NVSwitch planes taken
together, or the PCIe root complex) and one link *down* from it, each of the
fabric's per-direction bandwidth. GPUs reach other nodes through NICs: GPU ``g``
of a node sits next to NIC ``g * nics_per_node // gpus_per_node``, and traffic
leaves on the NIC of the destination's rail (NCCL's PXN hops over NVLink to
the GPU beside that NIC; on PCIe machines every NIC hangs off the root
complex anyway) when both ends share leaf switches. NIC ``j`` of every
node in a scalable unit plugs into the leaf switch of rail ``j`` (a
rail-optimized fat tree); leaves reach each other through an aggregated spine
whose uplink per leaf carries ``nodes_per_leaf * nic_bw / oversubscription``
(ECMP spreading flows evenly over the spine switches is assumed). A node's
fabric may also cap all the traffic through it together (``fabric_bw_GBps``:
a host's memory and CPUs when the "fabric" is loopback TCP).

Links are numbered so the simulator can keep them in numpy arrays, and routes
are computed by formula, vectorized, because 16k-GPU collectives need millions
of routes; :meth:`Topology.graph` builds the same structure as a
``networkx.DiGraph`` for inspection and for tests that check the formula
against shortest paths.
"""

from __future__ import annotations

from functools import cached_property

import networkx as nx
import numpy as np

from .cluster import ClusterSpec

SWITCH = -1  # route endpoint meaning "the fabric switch of the other endpoint's node" (in-switch reduction)
NET_SWITCH = -2  # route endpoint meaning "the leaf switch of the other endpoint's NIC" (in-network reduction)
MAX_HOPS = 9


class Topology:
    """Numbered links and vectorized routes of ``spec`` on ``nodes`` nodes."""

    def __init__(self, spec: ClusterSpec, nodes: int):
        self.spec, self.nodes = spec, nodes
        self.gpus_per_node = spec.gpus_per_node
        self.num_gpus = nodes * spec.gpus_per_node
        out = spec.scale_out
        self.nics_per_node = out.nics_per_node
        self.num_nics = nodes * out.nics_per_node
        self.num_units = -(-nodes // out.nodes_per_leaf)  # scalable units (ceil)
        self.num_leaves = self.num_units * out.nics_per_node
        # Link index blocks: gpu up | gpu down | nic up | nic down | leaf up | leaf down | node fabric
        g, k, leaves = self.num_gpus, self.num_nics, self.num_leaves
        self._gpu_up, self._gpu_down = 0, g
        self._nic_up, self._nic_down = 2 * g, 2 * g + k
        self._leaf_up, self._leaf_down = 2 * g + 2 * k, 2 * g + 2 * k + leaves
        self._fabric = 2 * g + 2 * k + 2 * leaves
        self.num_links = self._fabric + nodes
        leaf_bw = out.nodes_per_leaf * out.nic_bw_Bps / out.oversubscription
        # The fabric as a whole: non-blocking (every GPU at full speed both ways) unless the file says less.
        fabric_bw = spec.intra.fabric_bw_Bps or 2 * spec.gpus_per_node * spec.intra.bw_Bps
        self.capacity_Bps = np.concatenate([
            np.full(2 * g, spec.intra.bw_Bps), np.full(2 * k, out.nic_bw_Bps), np.full(2 * leaves, leaf_bw),
            np.full(nodes, fabric_bw),
        ])
        self.latency_s = np.concatenate([
            np.full(2 * g, spec.intra.latency_s / 2), np.full(2 * k, out.latency_s / 2),
            np.full(2 * leaves, out.spine_hop_latency_s), np.zeros(nodes),
        ])

    # -- placement ---------------------------------------------------------
    def node_of(self, gpu):
        return np.asarray(gpu) // self.gpus_per_node

    def nic_of(self, gpu):
        gpu = np.asarray(gpu)
        local = gpu % self.gpus_per_node
        return self.node_of(gpu) * self.nics_per_node + local * self.nics_per_node // self.gpus_per_node

    def unit_of(self, gpu):
        """Scalable unit (group of nodes sharing leaf switches) of each GPU."""
        return self.node_of(gpu) // self.spec.scale_out.nodes_per_leaf

    def rail_gpu(self, rail):
        """Local index of the first GPU attached to NIC ``rail`` of a node."""
        return -(-np.asarray(rail) * self.gpus_per_node // self.nics_per_node)

    def leaf_of_nic(self, nic):
        nic = np.asarray(nic)
        node, rail = nic // self.nics_per_node, nic % self.nics_per_node
        return (node // self.spec.scale_out.nodes_per_leaf) * self.nics_per_node + rail

    # -- routing -----------------------------------------------------------
    def routes(self, src, dst) -> np.ndarray:
        """Link indices from each ``src`` to each ``dst`` GPU, padded with -1 (shape flows x MAX_HOPS).

        ``SWITCH`` as an endpoint stands for the fabric of the other endpoint's node
        (data reduced or multicast inside an NVSwitch).
        """
        src, dst = np.atleast_1d(np.asarray(src, dtype=np.int64)), np.atleast_1d(np.asarray(dst, dtype=np.int64))
        src, dst = np.broadcast_arrays(src, dst)
        out = np.full((src.size, MAX_HOPS), -1, dtype=np.int64)
        to_net, from_net = dst == NET_SWITCH, src == NET_SWITCH
        out[to_net, 0] = self._nic_up + self.nic_of(src[to_net])
        out[from_net, 0] = self._nic_down + self.nic_of(dst[from_net])
        to_switch, from_switch = dst == SWITCH, src == SWITCH
        out[to_switch, 0] = self._gpu_up + src[to_switch]
        out[to_switch, 1] = self._fabric + self.node_of(src[to_switch])
        out[from_switch, 0] = self._fabric + self.node_of(dst[from_switch])
        out[from_switch, 1] = self._gpu_down + dst[from_switch]
        pair = ~(to_switch | from_switch | to_net | from_net) & (src != dst)
        s, d = src[pair], dst[pair]
        rows = np.flatnonzero(pair)
        same_node = self.node_of(s) == self.node_of(d)
        intra, inter = rows[same_node], rows[~same_node]
        out[intra, 0] = self._gpu_up + s[same_node]
        out[intra, 1] = self._fabric + self.node_of(s[same_node])
        out[intra, 2] = self._gpu_down + d[same_node]
        s, d = s[~same_node], d[~same_node]
        nic_d = self.nic_of(d)
        via_host = self.spec.intra.fabric == "pcie"  # NICs hang off the PCIe root complex
        if via_host:
            # Every NIC hangs off the root complex: use the one on the destination's rail.
            nic_s = self.node_of(s) * self.nics_per_node + nic_d % self.nics_per_node
            hops = [self._gpu_up + s, self._fabric + self.node_of(s)]
        else:
            # PXN (NCCL >= 2.12): inside one scalable unit, data first crosses NVLink to
            # the GPU beside the destination's rail so it stays under one leaf switch.
            # Between units it crosses the spine anyway and leaves from its own NIC.
            proxy = self.node_of(s) * self.gpus_per_node + self.rail_gpu(nic_d % self.nics_per_node)
            same_unit = self.unit_of(s) == self.unit_of(d)
            off_rail = self.nic_of(s) % self.nics_per_node != nic_d % self.nics_per_node
            moved = same_unit & off_rail
            proxy = np.where(moved, proxy, s)
            nic_s = self.nic_of(proxy)
            hops = [np.where(moved, self._gpu_up + s, -1), np.where(moved, self._fabric + self.node_of(s), -1),
                    np.where(moved, self._gpu_down + proxy, -1)]
        leaf_s, leaf_d = self.leaf_of_nic(nic_s), self.leaf_of_nic(nic_d)
        cross = leaf_s != leaf_d
        hops += [self._nic_up + nic_s, np.where(cross, self._leaf_up + leaf_s, -1),
                 np.where(cross, self._leaf_down + leaf_d, -1), self._nic_down + nic_d]
        if via_host:
            hops += [self._fabric + self.node_of(d), self._gpu_down + d]
        for col, hop in enumerate(hops):
            out[inter, col] = hop
        return _compact(out)

    @cached_property
    def non_spine_links(self) -> np.ndarray:
        """Mask of the links inside nodes and of the NICs (everything but leaf <-> spine)."""
        mask = np.ones(self.num_links, dtype=bool)
        mask[self._leaf_up:self._fabric] = False
        return mask

    def path_latency_s(self, routes: np.ndarray) -> np.ndarray:
        """Sum of link latencies along each route."""
        lat = np.where(routes >= 0, self.latency_s[np.maximum(routes, 0)], 0.0)
        return lat.sum(axis=1)

    def path_kind(self, a: int, b: int) -> str:
        """The slowest level a transfer between GPUs ``a`` and ``b`` crosses."""
        if a == b:
            return "self"
        if self.node_of(a) == self.node_of(b):
            return "nvlink" if self.spec.intra.fabric == "nvswitch" else "pcie"
        return "leaf" if self.leaf_of_nic(self.nic_of(a)) == self.leaf_of_nic(self.nic_of(b)) else "spine"

    # -- naming ------------------------------------------------------------
    def link_name(self, link: int) -> str:
        """Human-readable name of a link index."""
        fabric = "NVSwitch" if self.spec.intra.fabric == "nvswitch" else "PCIe root"
        medium = "NVLink" if self.spec.intra.fabric == "nvswitch" else "PCIe"
        if link < self._gpu_down:
            g = link - self._gpu_up
            return f"{medium} gpu{g} -> {fabric} (node {g // self.gpus_per_node})"
        if link < self._nic_up:
            g = link - self._gpu_down
            return f"{medium} {fabric} -> gpu{g} (node {g // self.gpus_per_node})"
        if link < self._nic_down:
            k = link - self._nic_up
            return f"NIC node{k // self.nics_per_node}/nic{k % self.nics_per_node} -> leaf"
        if link < self._leaf_up:
            k = link - self._nic_down
            return f"leaf -> NIC node{k // self.nics_per_node}/nic{k % self.nics_per_node}"
        if link < self._leaf_down:
            return f"leaf {self._leaf_label(link - self._leaf_up)} -> spine"
        if link < self._fabric:
            return f"spine -> leaf {self._leaf_label(link - self._leaf_down)}"
        return f"{fabric} of node {link - self._fabric} (all traffic through it)"

    def is_fabric_link(self, link: int) -> bool:
        """True for a node's whole-fabric capacity, which the graph keeps on the fabric vertex."""
        return link >= self._fabric

    def _leaf_label(self, leaf: int) -> str:
        return f"(unit {leaf // self.nics_per_node}, rail {leaf % self.nics_per_node})"

    # -- graph -------------------------------------------------------------
    @cached_property
    def graph(self) -> nx.DiGraph:
        """GPUs, fabric switches, NICs, leaves and the spine as a directed graph.

        Each edge carries ``link`` (the index used by :meth:`routes`), ``bw_Bps`` and
        ``latency_s``; each fabric vertex carries the ``link`` and ``bw_Bps`` of the
        node's whole-fabric capacity.
        """
        g = nx.DiGraph(name=f"{self.spec.name} x{self.nodes}")
        gpn, via_host = self.gpus_per_node, self.spec.intra.fabric == "pcie"

        def add(u, v, link):
            g.add_edge(u, v, link=link, bw_Bps=float(self.capacity_Bps[link]), latency_s=float(self.latency_s[link]))

        for node in range(self.nodes):
            g.add_node(("fabric", node), link=self._fabric + node, bw_Bps=float(self.capacity_Bps[self._fabric + node]))
        for gpu in range(self.num_gpus):
            fabric = ("fabric", gpu // gpn)
            add(("gpu", gpu), fabric, self._gpu_up + gpu)
            add(fabric, ("gpu", gpu), self._gpu_down + gpu)
        for nic in range(self.num_nics):
            node = nic // self.nics_per_node
            leaf = ("leaf", int(self.leaf_of_nic(nic)))
            add(("nic", nic), leaf, self._nic_up + nic)
            add(leaf, ("nic", nic), self._nic_down + nic)
            # GPU<->NIC attachment: through the root complex on PCIe machines,
            # through a dedicated PCIe switch (not modelled as a limit) otherwise.
            attach = ("fabric", node) if via_host else None
            for local in range(gpn):
                gpu = node * gpn + local
                if self.nic_of(gpu) == nic:
                    a = attach or ("gpu", gpu)
                    g.add_edge(a, ("nic", nic), link=-1, bw_Bps=float("inf"), latency_s=0.0)
                    g.add_edge(("nic", nic), a, link=-1, bw_Bps=float("inf"), latency_s=0.0)
        for leaf in range(self.num_leaves):
            add(("leaf", leaf), ("spine",), self._leaf_up + leaf)
            add(("spine",), ("leaf", leaf), self._leaf_down + leaf)
        return g


def _compact(routes: np.ndarray) -> np.ndarray:
    """Move the -1 padding of each row to its end (stable), trimming empty columns."""
    order = np.argsort(routes < 0, axis=1, kind="stable")
    packed = np.take_along_axis(routes, order, axis=1)
    used = (packed >= 0).any(axis=0)
    width = int(used.nonzero()[0].max()) + 1 if used.any() else 1
    return packed[:, :width]
