"""Collective algorithms, each written as a short list of :class:`Phase` s.

A phase is a set of flows that run at the same time, plus how many latency
steps it costs and how many bytes a rank must reduce. Algorithms that repeat
one identical step many times (a ring's ``n-1`` steps) are written as a single
pipelined phase carrying all their bytes and ``n-1`` latency steps: that is how
NCCL streams chunks through a ring, it is exactly the alpha-beta closed form,
and it lets a 16k-GPU ring be simulated as one step instead of 32k.

Sizes follow nccl-tests (see :mod:`parsim.report.results`): ``size`` is the whole
buffer for all-reduce, broadcast, reduce and send/recv, and the total of all
ranks' chunks for all-gather, reduce-scatter, gather, scatter and all-to-all.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ...errors import ParsimError
from ...hardware.network import chain_routes
from ...hardware.topology import NET_SWITCH, SWITCH, Topology
from .nccl import nccl_choice, nvlink_p2p_efficiency

ALGORITHMS = ("ring", "tree", "recursive", "direct", "hierarchical", "in_switch", "nvls_tree", "pat", "collnet",
              "via_all_reduce")

# Which algorithms can run which operation.
SUPPORTS = {
    "ring": {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce"},
    "tree": {"all_reduce"},  # NCCL's double binary tree is an all-reduce algorithm
    "recursive": {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce"},
    "direct": {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter",
               "all_to_all", "send_recv"},
    "hierarchical": {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce"},
    "in_switch": {"all_reduce", "all_gather", "reduce_scatter"},  # NCCL's NVLS
    "nvls_tree": {"all_reduce"},  # NCCL's NVLSTree: NVLS inside nodes, trees between them
    "pat": {"all_gather", "reduce_scatter"},  # NCCL's PAT (parallel aggregated trees), one GPU per node
    "collnet": {"all_reduce"},  # NCCL's CollNet: reduction inside the InfiniBand switches (SHARP)
    # gloo runs reduce_scatter_tensor as a ring all-reduce of the whole buffer, then keeps its chunk.
    "via_all_reduce": {"reduce_scatter"},
}
MAX_DIRECT_FLOWS = 1 << 21  # n*(n-1) flows; ~1448 ranks for all-to-all


@dataclass
class Phase:
    """Flows that run together: ``src[i] -> dst[i]`` carrying ``nbytes[i]``.

    ``steps`` latency terms are paid (each the slowest route's latency), and the
    busiest rank reduces ``reduce_bytes`` (summing received data into its own).
    """

    label: str
    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    steps: int
    reduce_bytes: float = 0.0
    routes: np.ndarray | None = None  # filled in (and kept) by the first simulation of this phase
    overhead_s: float = 0.0  # a backend's fixed cost per call (calibrated), paid before the first phase
    latency_s: float | None = None  # when set (NCCL's model), replaces steps x the slowest route's latency
    efficiency: float = 1.0  # payload bytes / bytes the links carry (protocol and channel limits; see nccl.py)
    # Consecutive flows that form one pipelined chain (a ring channel, a broadcast chain): a hop forwards
    # only what it has received, so the whole chain moves at one rate (see network.chain_routes).
    chain: int = 1

    @classmethod
    def of(cls, label: str, src, dst, nbytes, steps: int, reduce_bytes: float = 0.0, chain: int = 1) -> "Phase":
        src, dst = np.asarray(src, dtype=np.int64).ravel(), np.asarray(dst, dtype=np.int64).ravel()
        sizes = np.broadcast_to(np.asarray(nbytes, dtype=float), src.shape).copy()
        return cls(label, src, dst, sizes, steps, float(reduce_bytes), chain=chain)

    def flows(self) -> tuple[np.ndarray, np.ndarray]:
        """What the network runs: the routes (filled in) and bytes of the phase's flows, each pipelined
        chain as one flow over all its hops' links."""
        return chain_routes(self.routes, self.nbytes, self.chain)


def applicable_algorithms(topo: Topology, op: str, group: np.ndarray) -> dict[str, str]:
    """Every algorithm name mapped to ``""`` if it can run ``op`` on ``group``, else the reason it cannot."""
    n = len(group)
    nodes = np.unique(topo.node_of(group))
    reasons = {}
    for name in ALGORITHMS:
        if op not in SUPPORTS[name]:
            supported = ", ".join(sorted(o.replace("_", "-") for o in SUPPORTS[name]))
            reasons[name] = f"{name} does not implement {op.replace('_', '-')} (it does: {supported})"
        elif name == "recursive" and n & (n - 1):
            reasons[name] = f"recursive halving/doubling needs a power-of-two rank count, not {n}"
        elif name == "hierarchical" and (len(nodes) < 2 or not _uniform_nodes(topo, group)):
            reasons[name] = "hierarchical needs ranks on several nodes, the same number on each"
        elif name == "in_switch" and not topo.spec.intra.in_switch_reduction:
            reasons[name] = f"{topo.spec.name} has no in-switch reduction (NVLS)"
        elif name == "in_switch" and len(nodes) > 1:
            reasons[name] = "in-switch reduction works inside one NVLink domain (node)"
        elif name == "nvls_tree" and not topo.spec.intra.in_switch_reduction:
            reasons[name] = f"{topo.spec.name} has no in-switch reduction (NVLS)"
        elif name == "nvls_tree" and (len(nodes) < 2 or not _uniform_nodes(topo, group)):
            reasons[name] = "NVLSTree needs ranks on several nodes, the same number on each"
        elif name == "pat" and len(nodes) != n:
            reasons[name] = "PAT runs with one GPU per node"
        elif name == "collnet" and not (topo.spec.nccl and topo.spec.nccl.collnet):
            reasons[name] = (f"{topo.spec.name} declares no in-network reduction (SHARP; a cluster file "
                             f"declares it with nccl: {{collnet: true}})")
        elif name == "collnet" and (len(nodes) < 2 or not _uniform_nodes(topo, group)):
            reasons[name] = "CollNet needs ranks on several nodes, the same number on each"
        elif name == "direct" and op in ("all_gather", "reduce_scatter", "all_reduce") and len(nodes) > 1:
            reasons[name] = f"direct {op.replace('_', '-')} (one-shot exchange) is an intra-node algorithm"
        elif name == "direct" and op == "all_to_all" and n * (n - 1) > MAX_DIRECT_FLOWS:
            reasons[name] = f"direct all-to-all on {n} ranks would simulate {n * (n - 1):,} flows"
        elif op == "send_recv" and n != 2:
            reasons[name] = f"send/recv runs between 2 ranks, not {n}"
        elif n < 2 and name != "direct":
            reasons[name] = "a single rank needs no algorithm"
        else:
            reasons[name] = ""
    return reasons


def build_phases(topo: Topology, op: str, algorithm: str, group: np.ndarray, size: float,
                 root: int = 0, protocol: str | None = None) -> list[Phase]:
    """Phases of ``op`` on ``group`` (GPU ids, in rank order) with ``algorithm``.

    On a cluster whose file describes NCCL (``nccl:``), an algorithm NCCL runs
    gets NCCL's latency and bandwidth for ``protocol`` (default: the protocol
    NCCL's tuner would pick for it at this size): see :func:`apply_nccl`.
    """
    reason = applicable_algorithms(topo, op, group).get(algorithm)
    if reason is None:
        raise ParsimError(f"unknown algorithm {algorithm!r} (expected one of: {', '.join(ALGORITHMS)})")
    if reason:
        raise ParsimError(reason)
    group = np.asarray(group, dtype=np.int64)
    if len(group) == 1:
        return []
    builder = {"ring": _ring, "tree": _tree, "recursive": _recursive, "direct": _direct,
               "hierarchical": _hierarchical, "in_switch": _in_switch, "nvls_tree": _nvls_tree, "pat": _pat,
               "collnet": _collnet, "via_all_reduce": _via_all_reduce}[algorithm]
    phases = builder(topo, op, group, float(size), root)
    choice = nccl_choice(topo, op, algorithm, group, size, protocol)
    if choice is not None:
        apply_nccl(topo, op, algorithm, group, phases, choice)
        return phases
    if op in NCCL_P2P_OPS:
        at_nccl_nvlink_speed(topo, phases)
    efficiency = topo.spec.collective_efficiency.get(op, 1.0)
    if size <= topo.spec.collective_cache_bytes:  # a CPU host's buffer that stays in a core's cache
        efficiency *= topo.spec.collective_cache_speedup.get(op, 1.0)
    if efficiency != 1.0:  # a calibrated backend moves this op's bytes at a speed of its own, not its links'
        for phase in phases:
            phase.nbytes = phase.nbytes / efficiency
            phase.efficiency = efficiency
    if phases:
        phases[0].overhead_s = topo.spec.collective_overhead_s.get(op, 0.0)
    return phases


# NCCL runs these as grouped sends and receives (nccl-tests' alltoall, gather, scatter, sendrecv): no tuning model
NCCL_P2P_OPS = ("all_to_all", "gather", "scatter", "send_recv")


def at_nccl_nvlink_speed(topo: Topology, phases: list[Phase]) -> None:
    """Flows that stay inside a node move at NCCL's NVLink speed, not the link's peak
    (:func:`~parsim.sim.collectives.nccl.nvlink_p2p_efficiency`); flows across nodes keep the NIC's, which is
    NCCL's own figure for it (topo.cc)."""
    efficiency = nvlink_p2p_efficiency(topo.spec)
    if efficiency == 1.0:
        return
    for phase in phases:
        inside = topo.node_of(phase.src) == topo.node_of(phase.dst)
        phase.nbytes = np.where(inside, phase.nbytes / efficiency, phase.nbytes)
        if inside.all():
            phase.efficiency = efficiency


def apply_nccl(topo: Topology, op: str, algorithm: str, group: np.ndarray, phases: list[Phase], choice) -> None:
    """Give ``phases`` NCCL's time for ``choice`` (a :class:`~parsim.sim.collectives.nccl.Choice`).

    Latency: NCCL's (base + per-hop hardware latencies) plus the kernel's
    pipeline fill and drain (``choice.fill_us``: the loops of chunks that
    cross the kernel's stages before the last one starts and after the first
    one is done, which NCCL's estimate leaves out; see
    :meth:`~parsim.sim.collectives.nccl.NcclModel.pipeline`), shared among the
    phases by their steps: the links sit idle for this collective meanwhile,
    so it is time, not bytes. Bandwidth: every phase's bytes are scaled by one
    factor so that, alone on the cluster's GPU, NVLink and NIC links, the
    phases take exactly ``bytes / NCCL's bandwidth`` (its channels x
    per-channel speed x protocol factors). The scaled bytes are what the links
    carry (LL sends 8 bytes per 4 of data, Simple loses ~20% to its protocol,
    channels cap what one collective can draw), so when collectives contend
    in the step simulator each pays NCCL's overheads on the links it shares;
    spine links and oversubscription, which NCCL's model does not know, still
    slow it down (and should NCCL's figure ever exceed the links' peak, the
    links win: bytes are never scaled down). The reduction is part of NCCL's bandwidth (the kernels sum
    as they copy), so no separate reduction time is charged.
    """
    size = float(choice.nbytes)
    per_byte = _flow_seconds_per_byte(topo, op, algorithm, group, phases, size)
    nccl_s = size / (choice.effective_bw_GBps * 1e9)
    # Never below 1: should NCCL's figure ever exceed what the links carry at their peak, the links win.
    factor = max(1.0, nccl_s / (per_byte * size)) if per_byte > 0 else 1.0
    steps = sum(p.steps for p in phases) or 1
    for phase in phases:
        phase.nbytes = phase.nbytes * factor
        phase.reduce_bytes = 0.0
        phase.latency_s = (choice.latency_us + choice.fill_us) * 1e-6 * phase.steps / steps
        phase.efficiency = 1.0 / factor
        phase.label = f"{phase.label} [NCCL {choice.chosen.name}]"


def _flow_seconds_per_byte(topo: Topology, op: str, algorithm: str, group: np.ndarray, phases: list[Phase],
                           size: float) -> float:
    """Seconds per byte of ``size`` the phases need at the links' peak, counting GPU, fabric and NIC links
    (not the spine). Every phase's busiest link bounds it; cached per group shape (as the step simulator's
    algorithm choice is), since every group of one shape loads its links alike."""
    cache = topo.__dict__.setdefault("_nccl_flow_cache", {})
    nodes, units = topo.node_of(group), topo.unit_of(group)
    key = (op, algorithm, (group % topo.gpus_per_node).tobytes(), (nodes - nodes[0]).tobytes(),
           (units - units[0]).tobytes())
    if key not in cache:
        local = topo.non_spine_links
        total = 0.0
        for phase in phases:
            if phase.routes is None:
                phase.routes = topo.routes(phase.src, phase.dst)
            valid = phase.routes >= 0
            load = np.bincount(phase.routes[valid], weights=np.repeat(phase.nbytes, valid.sum(axis=1)),
                               minlength=topo.num_links)
            with np.errstate(divide="ignore", invalid="ignore"):
                busy = np.where(local & (load > 0), load / topo.capacity_Bps, 0.0)
            total += float(busy.max(initial=0.0))
        cache[key] = total / size
    return cache[key]


# -- ring ------------------------------------------------------------------

def ring_channels(topo: Topology, group: np.ndarray) -> list[np.ndarray]:
    """Ring orders, one per channel, as NCCL builds them.

    Inside one node a single ring is enough (every GPU has the same fabric link).
    Across nodes NCCL runs one ring per NIC rail: ring ``c`` enters every node at
    the GPU on rail ``c``, so each rail carries one ring's inter-node traffic.
    """
    if len(np.unique(topo.node_of(group))) < 2 or not _uniform_nodes(topo, group):
        return [group]
    per_node = _by_node(topo, group)  # nodes x g, local order
    rails = np.unique(topo.nic_of(per_node[0]) % topo.nics_per_node)
    channels = []
    for rail in rails:
        first = int(np.argmax(topo.nic_of(per_node[0]) % topo.nics_per_node == rail))
        channels.append(np.roll(per_node, -first, axis=1).ravel())
    return channels


def _ring(topo: Topology, op: str, group: np.ndarray, size: float, root: int) -> list[Phase]:
    n = len(group)
    rings = ring_channels(topo, group)
    c = len(rings)
    src = np.concatenate(rings)
    dst = np.concatenate([np.roll(r, -1) for r in rings])
    share = (n - 1) / n * size / c  # bytes each rank passes on, per channel
    rs = Phase.of(f"reduce-scatter: ring, {n - 1} steps of {1 / n:.3g} of the buffer", src, dst, share, n - 1,
                  reduce_bytes=(n - 1) / n * size, chain=n)
    ag = Phase.of(f"all-gather: ring, {n - 1} steps of {1 / n:.3g} of the buffer", src, dst, share, n - 1, chain=n)
    if op == "all_reduce":
        return [rs, ag]
    if op == "reduce_scatter":
        return [rs]
    if op == "all_gather":
        return [ag]
    # broadcast / reduce: a pipelined chain starting (or ending) at the root.
    chains = [np.roll(r, -int(np.argmax(r == group[root]))) for r in rings]
    a = np.concatenate([ch[:-1] for ch in chains])
    b = np.concatenate([ch[1:] for ch in chains])
    if op == "broadcast":
        return [Phase.of(f"broadcast: pipelined chain through {n} ranks", a, b, size / c, n - 1, chain=n - 1)]
    return [Phase.of(f"reduce: pipelined chain through {n} ranks", b, a, size / c, n - 1, reduce_bytes=size,
                     chain=n - 1)]


# -- double binary tree ------------------------------------------------------

def binary_tree(n: int) -> np.ndarray:
    """Parent of each of ``n`` ranks in NCCL's binary tree (``-1`` for the root).

    Rank ``r``'s parent clears the lowest set bit of ``r`` and sets the next one
    (falling back when that exceeds ``n``): odd ranks are leaves, the tree is
    ``ceil(log2 n)`` deep (after NCCL ``src/graph/trees.cc``).
    """
    parent = np.full(n, -1, dtype=np.int64)
    for r in range(1, n):
        bit = r & -r
        up = (r ^ bit) | (bit << 1)
        parent[r] = up if up < n else r ^ bit
    return parent


def double_binary_tree(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Parents in NCCL's two complementary trees: the second is the first mirrored
    (even ``n``) or shifted by one (odd ``n``), so each rank is a leaf in one tree."""
    first = binary_tree(n)
    ranks = np.arange(n)
    if n % 2 == 0:
        mirrored = binary_tree(n)[n - 1 - ranks]
        second = np.where(mirrored < 0, -1, n - 1 - mirrored)
    else:
        shifted = binary_tree(n)[(ranks - 1) % n]
        second = np.where(shifted < 0, -1, (shifted + 1) % n)
    return first, second


def tree_depth(parent: np.ndarray) -> int:
    depth = np.zeros(len(parent), dtype=np.int64)
    for r in range(len(parent)):
        d, p = 0, parent[r]
        while p >= 0:
            d, p = d + 1, parent[p]
        depth[r] = d
    return int(depth.max())


@functools.cache
def _tree_shape(n: int) -> tuple[tuple[np.ndarray, np.ndarray], int]:
    """NCCL's two trees over ``n`` ranks and their depth (cached: every group of ``n`` shares them)."""
    trees = double_binary_tree(n)
    for tree in trees:
        tree.flags.writeable = False
    return trees, max(tree_depth(t) for t in trees)


def double_tree_depth(n: int) -> int:
    """Depth of NCCL's double binary tree over ``n`` ranks (or nodes): the deeper of its two trees."""
    return _tree_shape(n)[1]


def _tree(topo: Topology, op: str, group: np.ndarray, size: float, root: int) -> list[Phase]:
    """Double binary tree all-reduce: each tree reduces half the buffer up, then broadcasts it down.

    Across nodes the trees span nodes and each node chains its GPUs into the
    tree's GPU on that node, as NCCL does; like the ring, one tree pair runs per
    NIC rail (channel), each carrying its share of the buffer.
    """
    if len(np.unique(topo.node_of(group))) > 1 and _uniform_nodes(topo, group):
        channels = [ring.reshape(-1, len(group) // len(np.unique(topo.node_of(group))))
                    for ring in ring_channels(topo, group)]
    else:
        channels = [group[:, None]]  # one node: the trees span the GPUs themselves
    part = size / len(channels)
    trees, depth = _tree_shape(channels[0].shape[0])
    steps = depth + channels[0].shape[1] - 1
    src, dst, sizes = [], [], []
    loads = np.zeros(topo.num_gpus)
    for per_node in channels:
        leaders = per_node[:, 0]
        for tree in trees:
            kids = np.flatnonzero(tree >= 0)
            src.append(leaders[kids]), dst.append(leaders[tree[kids]]), sizes.append(np.full(len(kids), part / 2))
            np.add.at(loads, leaders[tree[kids]], part / 2)  # each child's half is reduced at its parent
        if per_node.shape[1] > 1:  # chain every node's GPUs into its tree GPU
            src.append(per_node[:, 1:].ravel()), dst.append(per_node[:, :-1].ravel())
            sizes.append(np.full(per_node[:, 1:].size, part))
            loads[per_node[:, :-1].ravel()] += part
    src, dst, sizes = np.concatenate(src), np.concatenate(dst), np.concatenate(sizes)
    return [
        Phase.of(f"reduce up two binary trees (half the buffer each), depth {steps}", src, dst, sizes, steps,
                 reduce_bytes=float(loads.max())),
        Phase.of(f"broadcast down the same trees, depth {steps}", dst, src, sizes, steps),
    ]


# -- recursive halving / doubling ----------------------------------------------

def _recursive(topo: Topology, op: str, group: np.ndarray, size: float, root: int) -> list[Phase]:
    n = len(group)
    idx = np.arange(n)
    rounds = n.bit_length() - 1

    def halving() -> list[Phase]:  # Rabenseifner's reduce-scatter
        phases = []
        for k in range(rounds):
            dist = n >> (k + 1)
            chunk = size / (2 ** (k + 1))
            phases.append(Phase.of(f"reduce-scatter halving {k + 1}/{rounds}: exchange {1 / 2 ** (k + 1):.3g} "
                                   f"of the buffer with the rank {dist} away", group, group[idx ^ dist], chunk, 1,
                                   reduce_bytes=chunk))
        return phases

    def doubling() -> list[Phase]:  # all-gather
        phases = []
        for k in range(rounds):
            dist = 1 << k
            chunk = size * dist / n
            phases.append(Phase.of(f"all-gather doubling {k + 1}/{rounds}: exchange {dist / n:.3g} of the buffer "
                                   f"with the rank {dist} away", group, group[idx ^ dist], chunk, 1))
        return phases

    if op == "all_reduce":
        return halving() + doubling()
    if op == "reduce_scatter":
        return halving()
    if op == "all_gather":
        return doubling()
    rel = np.roll(group, -root)  # binomial tree rooted at rel[0]
    phases = []
    for k in range(rounds):
        half = 1 << k
        a, b = rel[:half], rel[half:2 * half]
        phases.append(Phase.of(f"binomial round {k + 1}/{rounds}: {half} rank(s) send to {half} more", a, b, size, 1))
    if op == "broadcast":
        return phases
    return [Phase.of(p.label.replace("send to", "receive from"), p.dst, p.src, size, 1, reduce_bytes=size)
            for p in reversed(phases)]


# -- direct ----------------------------------------------------------------------

def _direct(topo: Topology, op: str, group: np.ndarray, size: float, root: int) -> list[Phase]:
    n = len(group)
    others = np.delete(group, root)
    if op == "send_recv":
        return [Phase.of("send: one transfer", group[:1], group[1:], size, 1)]
    if op == "broadcast":
        return [Phase.of(f"root sends the whole buffer to each of {n - 1} ranks", group[root], others, size, 1)]
    if op == "reduce":
        return [Phase.of(f"{n - 1} ranks send the whole buffer to the root", others, group[root], size, 1,
                         reduce_bytes=(n - 1) * size)]
    if op == "scatter":
        return [Phase.of(f"root sends a 1/{n} chunk to each rank", group[root], others, size / n, 1)]
    if op == "gather":
        return [Phase.of(f"each rank sends its 1/{n} chunk to the root", others, group[root], size / n, 1)]
    a, b = np.meshgrid(group, group, indexing="ij")
    off = a != b
    src, dst = a[off], b[off]  # every ordered pair of distinct ranks
    if op == "all_to_all":
        return [Phase.of(f"each rank sends a 1/{n} chunk to every other rank", src, dst, size / n, 1)]
    rs = Phase.of(f"reduce-scatter: each rank sends chunk j to rank j ({n - 1} chunks)", src, dst, size / n, 1,
                  reduce_bytes=(n - 1) * size / n)
    ag = Phase.of(f"all-gather: each rank sends its chunk to all {n - 1} others", src, dst, size / n, 1)
    return {"all_reduce": [rs, ag], "reduce_scatter": [rs], "all_gather": [ag]}[op]


# -- hierarchical ----------------------------------------------------------------

def _hierarchical(topo: Topology, op: str, group: np.ndarray, size: float, root: int) -> list[Phase]:
    """Intra-node rings, then rings across nodes between GPUs of the same local index (one per rail)."""
    per_node = _by_node(topo, group)
    nodes, g = per_node.shape

    def rings(members: np.ndarray, data: float, what: str, first: str, reduce: bool) -> Phase:
        # members: rings x ranks; every row is an independent ring, all run at once.
        k = members.shape[1]
        src, dst = members.ravel(), np.roll(members, -1, axis=1).ravel()
        share = (k - 1) / k * data
        return Phase.of(f"{first}: {members.shape[0]} rings of {k} ({what})", src, dst, share, k - 1,
                        reduce_bytes=share if reduce else 0.0, chain=k)

    if op == "all_reduce":
        return [rings(per_node, size, "inside each node", "reduce-scatter", True),
                rings(per_node.T, size / g, "across nodes, one per local GPU", "reduce-scatter", True),
                rings(per_node.T, size / g, "across nodes, one per local GPU", "all-gather", False),
                rings(per_node, size, "inside each node", "all-gather", False)]
    if op == "reduce_scatter":
        return [rings(per_node, size, "inside each node", "reduce-scatter", True),
                rings(per_node.T, size / g, "across nodes, one per local GPU", "reduce-scatter", True)]
    if op == "all_gather":
        return [rings(per_node.T, size / g, "across nodes, one per local GPU", "all-gather", False),
                rings(per_node, size, "inside each node", "all-gather", False)]
    # broadcast / reduce: a chain across nodes, then chains inside every node.
    root_node = int(np.argmax((per_node == group[root]).any(axis=1)))
    local = int(np.argmax(per_node[root_node] == group[root]))
    across = np.roll(per_node[:, local], -root_node)
    inside = np.stack([np.roll(row, -local) for row in per_node])
    inter = Phase.of(f"chain across {nodes} nodes", across[:-1], across[1:], size, nodes - 1, chain=nodes - 1)
    intra = Phase.of(f"chains inside each node ({g} GPUs)", inside[:, :-1], inside[:, 1:], size, g - 1,
                     chain=g - 1)
    if op == "broadcast":
        return [inter, intra]
    return [Phase.of(p.label, p.dst, p.src, size, p.steps, reduce_bytes=size, chain=p.chain) for p in (intra, inter)]


# -- in-switch reduction (NVLink SHARP) ---------------------------------------------

def _in_switch(topo: Topology, op: str, group: np.ndarray, size: float, root: int) -> list[Phase]:
    """NVLS all-reduce: the switch sums each 1/n chunk as GPUs read it (multimem.ld_reduce)
    and multicasts the result (multimem.st). Each GPU sends its whole buffer plus
    one reduced chunk and receives one reduced chunk plus the whole result:
    ``(n+1)/n`` of the buffer each way, against ``2(n-1)/n`` for a ring.
    All-gather is the multicast half, reduce-scatter the reducing half."""
    n = len(group)
    up, down = np.full(n, SWITCH), np.full(n, SWITCH)
    if op == "all_gather":  # each GPU writes its chunk once; the switch copies it to the others
        return [Phase.of(f"in-switch multicast: each GPU sends its 1/{n} chunk once, receives the other {n - 1}",
                         np.concatenate([group, down]), np.concatenate([up, group]),
                         np.concatenate([np.full(n, size / n), np.full(n, (n - 1) / n * size)]), 1)]
    if op == "reduce_scatter":  # the switch reads every GPU's copy of a chunk and returns the sum
        return [Phase.of(f"in-switch reduce: each GPU's buffer is read once, each receives its summed 1/{n}",
                         np.concatenate([group, down]), np.concatenate([up, group]),
                         np.concatenate([np.full(n, (n - 1) / n * size), np.full(n, size / n)]), 1)]
    per_direction = (n + 1) / n * size
    src = np.concatenate([group, down])
    dst = np.concatenate([up, group])
    return [Phase.of(f"in-switch reduce + multicast: {n + 1}/{n} of the buffer each way per GPU",
                     src, dst, per_direction, 2)]


def _nvls_tree(topo: Topology, op: str, group: np.ndarray, size: float, root: int) -> list[Phase]:
    """NCCL's NVLSTree all-reduce, one pipelined phase: inside each node the NVSwitch sums the buffer into
    one share per head GPU (the GPU beside each NIC, as NCCL's NVLS search picks heads); the heads of each
    rail run double binary trees across nodes on their share; the switch multicasts the result back."""
    per_node = _by_node(topo, group)  # nodes x g
    heads = _heads(topo, per_node)
    nodes, h = heads.shape
    share = size / h
    trees, depth = _tree_shape(nodes)
    src = [per_node.ravel(), np.full(heads.size, SWITCH)]  # every GPU into the switch, each head's sum out
    dst = [np.full(per_node.size, SWITCH), heads.ravel()]
    sizes = [np.full(per_node.size, size), np.full(heads.size, share)]
    src += [heads.ravel(), np.full(per_node.size, SWITCH)]  # each head's result multicast to every GPU
    dst += [np.full(heads.size, SWITCH), per_node.ravel()]
    sizes += [np.full(heads.size, share), np.full(per_node.size, size)]
    for column in heads.T:  # one pair of trees per head (rail), each tree carrying half of the head's share
        for tree in trees:
            kids = np.flatnonzero(tree >= 0)
            src += [column[kids], column[tree[kids]]]
            dst += [column[tree[kids]], column[kids]]
            sizes += [np.full(2 * len(kids), share / 2)]
    return [Phase.of(f"NVLS inside {nodes} nodes ({h} heads) + trees across them, depth {depth}, pipelined",
                     np.concatenate(src), np.concatenate(dst), np.concatenate(sizes), 2 + 2 * depth,
                     reduce_bytes=share)]


def _pat(topo: Topology, op: str, group: np.ndarray, size: float, root: int) -> list[Phase]:
    """NCCL's PAT (parallel aggregated trees) all-gather / reduce-scatter for one GPU per node: log2(n)
    rounds of doubling distances, moving the bandwidth-optimal (n-1)/n of the buffer (a ring where n is
    not a power of two)."""
    n = len(group)
    phases = _recursive(topo, op, group, size, root) if n & (n - 1) == 0 else _ring(topo, op, group, size, root)
    for phase in phases:
        phase.label = f"PAT: {phase.label}"
    return phases


def _collnet(topo: Topology, op: str, group: np.ndarray, size: float, root: int) -> list[Phase]:
    """NCCL's CollNet all-reduce, one pipelined phase: inside each node the GPUs reduce-scatter to the
    heads (GPUs beside a NIC) over NVLink; each head sends its share into the InfiniBand switch, which
    sums it across nodes (SHARP) and returns it; the heads all-gather inside the node. Aggregation above
    the leaf switches is not modelled."""
    per_node = _by_node(topo, group)
    heads = _heads(topo, per_node)
    nodes, h = heads.shape
    share = size / h
    src, dst = [], []
    for node in range(nodes):
        a, b = np.meshgrid(per_node[node], heads[node], indexing="ij")
        off = a != b
        src += [a[off], b[off]]  # reduce-scatter to the heads, then all-gather from them
        dst += [b[off], a[off]]
    n_intra = sum(len(x) for x in src)
    src += [heads.ravel(), np.full(heads.size, NET_SWITCH)]
    dst += [np.full(heads.size, NET_SWITCH), heads.ravel()]
    sizes = np.concatenate([np.full(n_intra, share), np.full(2 * heads.size, share)])
    return [Phase.of(f"CollNet: reduce-scatter to {h} heads per node, in-network reduction, all-gather",
                     np.concatenate(src), np.concatenate(dst), sizes, 4, reduce_bytes=(per_node.shape[1] - 1) * share)]


def _heads(topo: Topology, per_node: np.ndarray) -> np.ndarray:
    """The first GPU of the group on each NIC of each node (nodes x heads): NCCL's NVLS / CollNet heads."""
    rails = topo.nic_of(per_node[0]) % topo.nics_per_node
    _, first = np.unique(rails, return_index=True)
    return per_node[:, np.sort(first)]


def _via_all_reduce(topo: Topology, op: str, group: np.ndarray, size: float, root: int) -> list[Phase]:
    """A reduce-scatter done as a ring all-reduce of the whole buffer (gloo's way)."""
    return _ring(topo, "all_reduce", group, size, root)


# -- helpers ------------------------------------------------------------------------

def _uniform_nodes(topo: Topology, group: np.ndarray) -> bool:
    _, counts = np.unique(topo.node_of(group), return_counts=True)
    return bool((counts == counts[0]).all())


def _by_node(topo: Topology, group: np.ndarray) -> np.ndarray:
    """Group members as a nodes x per-node array (every node holding the same count)."""
    nodes = topo.node_of(group)
    order = np.argsort(nodes, kind="stable")
    return group[order].reshape(len(np.unique(nodes)), -1)
