"""An expert all-to-all as DeepEP's normal kernels run it: once per node over the network, then NVLink.

Megatron-LM's all-to-all dispatcher sends one copy of a token per chosen
expert: ``top-k`` rows, each to its expert's GPU, across InfiniBand whenever
that GPU is on another node (the plain all-to-all, ``algorithms._direct``).
DeepEP (deepseek-ai/DeepEP, the dispatcher DeepSeek-V3 was trained with,
report section 3.2.2) sends a token once to each node holding one of its
experts, to the GPU with the sender's own local index there, which forwards
it over NVLink to each GPU of that node holding one of its experts; a GPU gets
each token once however many of its experts it feeds. The combine runs the
same paths back, each forwarding GPU summing its node's rows before the one
transfer across the network. Both legs stream at once (the forwarding starts
on the first chunks received), so one phase carries them together.

Per token, with ``k`` experts chosen out of ``E`` on ``n`` GPUs in ``N`` nodes
of ``g`` (``r = E / n`` experts per GPU, ``e = E / N`` per node), over the
``m`` nodes a token may use (DeepSeek-V3's node-limited routing, ``M = 4``,
section 2.1.2; every node without a limit) and the ``k`` experts spread evenly
over those ``m x e`` candidates:

* GPUs reached: ``R = m g (1 - C(m e - r, k) / C(m e, k))``, each GPU's chance
  that none of its ``r`` experts is among the ``k`` (hypergeometric);
* nodes reached: ``D = m`` under a limit (the router picks a token's nodes by
  its best experts' scores there, so each picked node gets one of them), else
  ``D = N (1 - C(E - e, k) / C(E, k))``;
* across the network: ``D (N - 1) / N`` copies (the sender's node is as likely
  as any to be reached), ``D / N`` to each other node's GPU of the sender's index;
* over NVLink: ``R (g - 1) / g`` copies (all but those for the receiving GPU
  itself), ``R / g`` to each other GPU of the node.

DeepEP's kernels reach ~160 GB/s of an H800's 200 GB/s per direction of NVLink
and the InfiniBand NIC's ~50 GB/s (DeepEP README, "Performance": "H800 (~160
GB/s NVLink maximum bandwidth), with each connected to a CX7 InfiniBand 400
Gb/s RDMA network card (~50 GB/s maximum bandwidth)"): NVLink flows carry
``1 / NVLINK_FRACTION`` of their bytes. Each call holds ``DEEPEP_SMS`` SMs
(``Buffer.num_sms = 20``, ``deep_ep/buffers/legacy.py`` in DeepEP today; the report: "only 20 SMs
are sufficient to fully utilize the bandwidths of IB and NVLink").
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

import numpy as np

from ...errors import ParsimError
from ...hardware.topology import Topology
from .algorithms import Phase, _by_node, _uniform_nodes

NVLINK_FRACTION = 160 / 200  # DeepEP README: ~160 GB/s of H800 NVLink's 200 GB/s per direction
DEEPEP_SMS = 20  # DeepEP's Buffer.num_sms (deep_ep/buffers/legacy.py)


@dataclass(frozen=True)
class TokenRouting:
    """How an MoE layer routes a token: ``experts_per_token`` of ``num_experts``, on at most
    ``max_nodes`` nodes (0: no limit)."""

    experts_per_token: int
    num_experts: int
    max_nodes: int = 0


@dataclass(frozen=True)
class Copies:
    """Copies of one token a dispatch sends (a combine receives), on average over tokens."""

    gpus: float  # R: GPUs reached, the sender's own included
    nodes: float  # D: nodes reached, the sender's own included
    network: float  # copies crossing the network: D (N - 1) / N
    nvlink: float  # copies over NVLink: R (g - 1) / g
    node_limit: int  # m: the nodes a token may use
    group_nodes: int  # N: the nodes the group spans
    per_node: int  # g: the group's GPUs on each


def _none_chosen(candidates: int, held: int, k: int) -> float:
    """Chance that none of ``held`` of ``candidates`` experts is among ``k`` picked evenly: C(c - h, k) / C(c, k)."""
    return comb(candidates - held, k) / comb(candidates, k)


def copies(routing: TokenRouting, nodes: int, gpus_per_node: int) -> Copies:
    """Copies of one token for a dispatch over ``nodes`` x ``gpus_per_node`` GPUs (see the module docstring)."""
    k, experts, n = routing.experts_per_token, routing.num_experts, nodes * gpus_per_node
    if experts % n:
        raise ParsimError(f"DeepEP dispatch: {experts} experts do not split evenly over {n} GPUs")
    limited = 0 < routing.max_nodes < nodes
    m = routing.max_nodes if limited else nodes
    per_gpu, per_node = experts // n, experts // nodes
    if m * per_node < k:
        raise ParsimError(f"DeepEP dispatch: {k} experts per token cannot fit on {m} nodes of {per_node} experts")
    gpus = m * gpus_per_node * (1 - _none_chosen(m * per_node, per_gpu, k))
    reached = float(m) if limited else nodes * (1 - _none_chosen(experts, per_node, k))
    return Copies(gpus, reached, reached * (nodes - 1) / nodes, gpus * (gpus_per_node - 1) / gpus_per_node, m,
                  nodes, gpus_per_node)


def group_copies(topo: Topology, group: np.ndarray, routing: TokenRouting) -> Copies:
    """:func:`copies` for a dispatch over ``group`` of ``topo``."""
    return copies(routing, *_per_node(topo, group).shape)


def _per_node(topo: Topology, group: np.ndarray) -> np.ndarray:
    """``group`` as nodes x GPUs; DeepEP's kernels pair each GPU with the GPU of its index on every other node, so
    each node must hold as many of the group as the others."""
    if not _uniform_nodes(topo, group):
        counts = np.unique(topo.node_of(group), return_counts=True)[1]
        raise ParsimError(f"DeepEP's dispatch needs as many of the {len(group)} expert-parallel ranks on each node, "
                          f"not {' + '.join(map(str, counts))}: give ep a multiple of the node's "
                          f"{topo.gpus_per_node} GPUs, or a divisor of it")
    return _by_node(topo, group)


def phases(topo: Topology, group: np.ndarray, size: float, routing: TokenRouting) -> list[Phase]:
    """One phase of DeepEP's dispatch (or combine) over ``group``, whose ranks each send a ``size``-byte
    buffer of ``top-k`` rows per token (the plain all-to-all's): network and NVLink flows together."""
    per_node = _per_node(topo, group)
    nodes, g = per_node.shape
    c = copies(routing, nodes, g)
    row = size / routing.experts_per_token  # one copy of every token of the sender
    src, dst, nbytes = [], [], []
    if nodes > 1:  # to the GPU of the sender's local index on every other node
        a, b = np.meshgrid(np.arange(nodes), np.arange(nodes), indexing="ij")
        off = a != b
        src.append(per_node[a[off]].ravel())
        dst.append(per_node[b[off]].ravel())
        nbytes.append(np.full(src[-1].size, row * c.nodes / nodes))
    if g > 1:  # to every other GPU of the node, the forwarded tokens with the sender's own
        a, b = np.meshgrid(np.arange(g), np.arange(g), indexing="ij")
        off = a != b
        src.append(per_node[:, a[off]].ravel())
        dst.append(per_node[:, b[off]].ravel())
        nbytes.append(np.full(src[-1].size, row * c.gpus / g / NVLINK_FRACTION))
    label = (f"DeepEP: each token to {c.nodes:.2f} nodes, {c.network:.2f} copies across the network, then "
             f"{c.nvlink:.2f} over NVLink to its experts' GPUs ({c.gpus:.2f} reached)")
    return [Phase.of(label, np.concatenate(src), np.concatenate(dst), np.concatenate(nbytes), 1)]


def lower_bound(topo: Topology, c: Copies, row: float) -> tuple[float, str]:
    """The copies ``c`` of a ``row``-byte token over the links at their peak: each GPU's NVLink copies through its
    fabric link, each GPU's copies across the network through its NIC (one per GPU on the clusters DeepEP runs
    on)."""
    nvlink_bw = topo.spec.intra.bw_Bps
    bounds = [(row * c.nvlink / nvlink_bw, f"each GPU forwards {c.nvlink:.3g} rows per token over its "
                                           f"{nvlink_bw / 1e9:.0f} GB/s fabric link")]
    if c.group_nodes > 1:
        nic_bw = topo.spec.scale_out.nic_bw_Bps * topo.nics_per_node / topo.gpus_per_node
        bounds.append((row * c.network / nic_bw, f"each GPU sends {c.network:.3g} rows per token across the "
                                                 f"network at {nic_bw / 1e9:.0f} GB/s"))
    return max(bounds)
