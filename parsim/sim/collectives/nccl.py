"""NCCL's own cost model: the channels its topology search finds and the algorithm and protocol its tuner picks.

Everything here transcribes NVIDIA/nccl v2.30.7 (commit 5067397c, 2026), file by file:

* ``src/graph/topo.h`` and ``src/graph/topo.cc``: the bandwidth NCCL assigns to
  each link of a node (``SMxx_NVLINK_BW`` per NVLink, PCIe ``lanes x GT/s / 80``,
  a NIC's ``Mb/s / 8000``);
* ``src/graph/search.cc`` (``ncclTopoCompute``, ``ncclTopoSearchTryNvls``,
  ``ncclTopoDupChannels``): how many channels the search finds and at which
  per-channel speed (``speedArrayIntra/Inter`` and their SM90/SM100 variants).
  :func:`search` is a closed-form emulation of that search for the symmetric
  nodes parsim describes (all GPUs alike, one NIC per rail): it tries the same
  speeds in the same order under the same link budgets;
* ``src/graph/connect.cc`` (``ncclTopoPostset``): channels duplicated for the
  kernels (``comm->nChannels``);
* ``src/graph/tuning.cc`` (``ncclTopoTuneModel``, ``ncclTopoGetAlgoTime``):
  per algorithm and protocol a latency (base + per-hop hardware latencies) and
  a bandwidth (channels x per-channel speed x protocol factors);
* ``src/enqueue.cc`` (``topoGetAlgoInfo``): the tuner keeps the (algorithm,
  protocol) of least ``latency + bytes / bandwidth``, then lowers the channel
  count for messages too small to fill every channel.

Latencies are microseconds and bandwidths GB/s, as in NCCL; callers convert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from ...hardware.cluster import NcclSpec

# NCCL's algorithm and protocol indices (src/include/device.h), in its order.
ALGOS = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")
PROTOS = ("LL", "LL128", "Simple")
TREE, RING, COLLNET_DIRECT, COLLNET_CHAIN, NVLS, NVLS_TREE, PAT = ALGOS
LL, LL128, SIMPLE = PROTOS

# The parsim algorithm (phase builder in algorithms.py) that moves each NCCL algorithm's bytes.
PARSIM_ALGORITHM = {RING: "ring", TREE: "tree", NVLS: "in_switch", NVLS_TREE: "nvls_tree", PAT: "pat",
                    COLLNET_DIRECT: "collnet", COLLNET_CHAIN: "collnet"}
# NCCL's collectives; everything else (all-to-all, send/recv, gather, scatter) is point-to-point in NCCL.
COLLECTIVES = ("broadcast", "reduce", "all_gather", "reduce_scatter", "all_reduce")

# -- tuning.cc: tuner constants (ncclTunerConstantsDefaults) -------------------------------------------
# baseLatencies[algo][proto], us
BASE_LAT = {TREE: (6.8, 14.0, 8.4), RING: (6.6, 14.0, 8.4), COLLNET_DIRECT: (0, 0, 0), COLLNET_CHAIN: (0, 0, 0),
            NVLS: (0, 0, 0), NVLS_TREE: (0, 0, 0), PAT: (8.0, 8.0, 8.0)}
# hwLatencies[hw][algo][proto], us per hop
HW_LAT = {
    "nvlink": {TREE: (0.6, 1.25, 4.0), RING: (0.6, 1.9, 3.4), COLLNET_DIRECT: (0, 0, 3.7),
               COLLNET_CHAIN: (0, 0, 2.8), NVLS: (0, 0, 25), NVLS_TREE: (0, 0, 25), PAT: (0, 0, 4.0)},
    "pci": {TREE: (1.0, 1.9, 4.0), RING: (1.0, 2.5, 5.7), COLLNET_DIRECT: (0, 0, 3.7), COLLNET_CHAIN: (0, 0, 2.8),
            NVLS: (0, 0, 0), NVLS_TREE: (0, 0, 0), PAT: (0, 0, 4.0)},
    "net": {TREE: (5.0, 8.5, 14), RING: (2.7, 4.0, 14.0), COLLNET_DIRECT: (0, 0, 31), COLLNET_CHAIN: (0, 0, 30),
            NVLS: (0, 0, 18), NVLS_TREE: (0, 0, 20.9), PAT: (0, 0, 14)},
}
# llMaxBws[index1][index2]: index1 the GPU generation on one node, the CPU vendor across nodes; index2 nodes 1/2/>2
LL_MAX_BW = ((39.0, 39.0, 20.4), (87.7, 22.5, 19.0), (141.0, 45.0, 35.0), (2 * 141.0, 2 * 45.0, 2 * 35.0))
# per-channel caps [compcap index][index2], GB/s
PER_CH_MAX_RING_LL128 = ((20.0, 20.0, 20.0), (20.0, 20.0, 20.0), (36.7, 36.7, 36.7), (40.0, 40.0, 40.0))
PER_CH_MAX_TREE_LL128 = ((20.0, 20.0, 20.0), (20.0, 20.0, 20.0), (36.7, 36.7, 29.0), (55.6, 31.67, 20.0))
PER_CH_MAX_TREE = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (38.7, 41.4, 36.0), (70.0, 42.8, 24.0))
PER_CH_MAX_NVLS_TREE = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (0.0, 57.7, 45.5), (0.0, 96.0, 80.0))
NVLS_EFFICIENCY = (0.0, 0.0, 0.85, 0.74)  # Volta, Ampere, Hopper, Blackwell
# treeCorrectionFactor[proto][log2(bytes / 64)]: "trees are not perfectly sticking to the model for medium sizes"
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
)
PCI_BW = 12.0  # topo.h: PCI Gen3 x16, the threshold for 256-thread Simple rings

# -- topo.h / topo.cc: link bandwidths NCCL assigns, GB/s ------------------------------------------------
NVLINK_BW = {60: 18.0, 70: 20.0, 80: 20.0, 86: 12.0, 90: 20.6, 100: 40.1}  # SMxx_NVLINK_BW, per link
# kvDictPciGen: 100 Mb/s per lane by PCIe generation; a link's bw = lanes x speed / 80
PCI_GEN_SPEED = {1: 15, 2: 30, 3: 60, 4: 120, 5: 240, 6: 480}
INTEL_P2P_OVERHEAD = 6 / 5  # topo.h: Intel CPUs turn GPU P2P traffic into 64 B TLPs

# -- search.cc: per-channel speeds the search tries, GB/s ---------------------------------------------------
SPEEDS_INTRA = {0: (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0),
                90: (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0),
                100: (90.0, 80.0, 70.0, 60.0, 50.0, 45.0, 40.0, 30.0, 24.0, 20.0, 19.0, 18.0)}
SPEEDS_INTER = {0: (48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.4, 1.2,
                    0.24, 0.12),
                90: (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4, 1.2, 0.24, 0.12),
                100: (96.0, 86.0, 80.0, 48.0, 45.1, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4,
                      1.2, 0.24, 0.12)}
MAXCHANNELS = 64  # device.h
NCCL_MAX_NVLS_ARITY = 32
NCCL_MAX_DIRECT_ARITY = 7
# device.h / comm.h: threads per channel and the bytes per thread below which enqueue.cc drops channels
MAX_THREADS = {LL: 512, LL128: 640, SIMPLE: 512}
THREAD_THRESHOLD = {LL: 8, LL128: 8, SIMPLE: 64}


def log2i(n: int) -> int:
    """NCCL's ``log2i``: floor(log2 n), -1 for 0."""
    return int(n).bit_length() - 1


def compcap_index(cc: int) -> int:
    return 3 if cc >= 100 else 2 if cc >= 90 else 1 if cc >= 80 else 0


def _speeds(table: dict, cc: int) -> tuple[float, ...]:
    return table[100] if cc >= 100 else table[90] if cc >= 90 else table[0]


@dataclass(frozen=True)
class Graph:
    """One search result (``struct ncclTopoGraph``): channels and the per-channel speed inside and across nodes."""

    channels: int
    bw_intra: float
    bw_inter: float

    def describe(self) -> str:
        if self.bw_intra == self.bw_inter:
            return f"{self.channels} x {self.bw_intra:g} GB/s"
        return f"{self.channels} x {self.bw_intra:g} GB/s (inside nodes) / {self.bw_inter:g} GB/s (across)"


@dataclass(frozen=True)
class NodeView:
    """The node as NCCL's topology code sees it, for one communicator (the group's GPUs on each node)."""

    cc: int
    ppn: int  # the group's GPUs per node
    nodes: int
    nvlink_bw: float  # per GPU, all its NVLinks together; 0 on a PCIe-only node
    pci_bw: float  # GPU <-> PCIe switch / NIC
    nic_bw: float  # per NIC
    nics: int  # NICs the group's GPUs sit next to, per node
    cpu_vendor: str
    nvls: bool  # NVLink SHARP (in-switch reduction) on this fabric
    collnet: bool

    @property
    def ranks(self) -> int:
        return self.ppn * self.nodes

    @property
    def nvswitch(self) -> bool:
        return self.nvlink_bw > 0

    @property
    def p2p_overhead(self) -> float:
        """GPU-to-GPU traffic through an Intel root complex costs 6/5 of its bytes (topo.h)."""
        return INTEL_P2P_OVERHEAD if not self.nvswitch and self.cpu_vendor == "intel" else 1.0


def node_view(spec, nccl: NcclSpec, ppn: int, nodes: int, nics: int) -> NodeView:
    """NCCL's link bandwidths for ``spec`` (topo.h, topo.cc), for a group of ``ppn`` GPUs on each of ``nodes``."""
    cc = nccl.compute_capability
    sm = max((k for k in NVLINK_BW if k <= cc), default=60)
    nvlink = nccl.nvlinks_per_gpu * NVLINK_BW[sm] if spec.intra.fabric == "nvswitch" else 0.0
    pci = nccl.pcie_lanes * PCI_GEN_SPEED[nccl.pcie_gen] / 80.0
    nic = spec.scale_out.nic_bw_Bps * 8 / 1e6 / 8000.0  # Mb/s / 8000, as topo.cc converts a NIC's speed
    return NodeView(cc, ppn, nodes, nvlink, pci, nic, nics, nccl.cpu_vendor,
                    spec.intra.in_switch_reduction and cc >= 90 and spec.intra.fabric == "nvswitch",
                    nccl.collnet)


def nvlink_p2p_efficiency(spec) -> float:
    """What a point-to-point transfer inside a node reaches of the fabric link's peak on a cluster whose file
    describes NCCL: NCCL's NVLink speed per GPU (its link units, ``SMxx_NVLINK_BW`` x links, topo.h) over the
    link's peak. H100: 18 x 20.6 = 370.8 of 450 GB/s; H800: 8 x 20.6 = 164.8 of 200, where DeepEP's README
    gives "~160 GB/s" as the H800's NVLink maximum. 1 without an ``nccl:`` section or an NVSwitch."""
    nccl = spec.nccl
    if nccl is None or spec.intra.fabric != "nvswitch":
        return 1.0
    sm = max((k for k in NVLINK_BW if k <= nccl.compute_capability), default=60)
    return min(1.0, nccl.nvlinks_per_gpu * NVLINK_BW[sm] * 1e9 / spec.intra.bw_Bps)


# -- search.cc ----------------------------------------------------------------------------------------------

def search(view: NodeView) -> dict[str, Graph]:
    """The graphs ``ncclTopoCompute`` finds for ring, tree and NVLS (and CollNet), emulated in closed form.

    The search tries speeds from the fastest the paths allow downwards; a
    channel costs its speed on every link it crosses, so the channel count at
    a speed is the tightest link budget divided by the speed. It keeps the most
    total bandwidth (channels x speed), stops once that reaches the GPU's total
    or the next speed is under 0.49 of the best, then (pass 2) raises the
    ring's speed while the same channel count still fits, and finally
    duplicates channels at half speed (``ncclTopoDupChannels``).
    """
    inter = view.nodes > 1
    speeds = _speeds(SPEEDS_INTER if inter else SPEEDS_INTRA, view.cc)
    total_bw = max(view.nvlink_bw, view.pci_bw)
    if inter:
        max_bw = min(view.pci_bw, view.nic_bw)  # GPU -> PCIe switch -> NIC
    elif view.nvswitch:
        max_bw = view.nvlink_bw
    else:
        max_bw = view.pci_bw / view.p2p_overhead

    def ring_channels(bw: float) -> int:
        limits = [MAXCHANNELS // 2]
        if view.ppn > 1:  # every GPU forwards each channel to the next (through NVLink, or the host's PCIe)
            link = view.nvlink_bw if view.nvswitch else view.pci_bw
            limits.append(int(link / (bw * view.p2p_overhead) + 1e-9))
        if inter:  # each channel enters and leaves a node through one NIC (same rail, NCCL_CROSS_NIC=0 first)
            limits.append(view.nics * int(min(view.nic_bw, view.pci_bw) / bw + 1e-9))
        return min(limits)

    ring = _search_speeds(speeds, max_bw, total_bw, 1, MAXCHANNELS // 2, ring_channels)
    ring = _dup_channels(ring, view.cc, MAXCHANNELS // 2)
    graphs = {RING: ring}

    if inter and view.ppn > 1:
        # Trees use the ring's channel count; across nodes a channel is a chain through the node's GPUs
        # (ppn - 1 NVLink hops) between one NIC and itself. Pass 2 then raises the speed inside the node
        # while it stays under twice the speed across (search.cc, "increase bwIntra for trees").
        def tree_channels(bw_inter: float, bw_intra: float) -> int:
            link = view.nvlink_bw if view.nvswitch else view.pci_bw / view.p2p_overhead
            nvl = int(link / (bw_intra * (view.ppn - 1) / view.ppn) + 1e-9)
            return min(nvl, view.nics * int(min(view.nic_bw, view.pci_bw) / bw_inter + 1e-9))

        want = ring.channels  # treeGraph min = max = the ring's channels (init.cc)
        base = next((s for s in speeds if s <= max_bw and tree_channels(s, s) >= want), speeds[-1])
        intra = base
        for s in reversed(speeds):
            if base < s < 2 * base and tree_channels(base, s) >= want:
                intra = max(intra, s)
        graphs[TREE] = _dup_channels(Graph(want, intra, base), view.cc, want)
    else:
        graphs[TREE] = ring

    if view.nvls and view.ppn > 1:
        graphs[NVLS] = _nvls_graph(view, speeds, max_bw)
    if view.collnet and inter:
        heads = min(view.ppn, view.nics)
        graphs[COLLNET_DIRECT] = Graph(heads, graphs[TREE].bw_intra, graphs[TREE].bw_inter)
        graphs[COLLNET_CHAIN] = graphs[TREE]
    return graphs


def _search_speeds(speeds, max_bw: float, total_bw: float, min_channels: int, max_channels: int,
                   channels_at) -> Graph:
    """Pass 1 and pass 2 of ``ncclTopoCompute`` for a ring, as described in :func:`search`."""
    start = 0
    while start < len(speeds) - 1 and (speeds[start] > max_bw or speeds[start] * min_channels > total_bw):
        start += 1
    best: Graph | None = None
    i = start
    while True:
        s = speeds[i]
        ch = min(max_channels, channels_at(s))
        if ch >= min_channels and (best is None or ch * s > best.channels * best.bw_intra):
            best = Graph(ch, s, s)
        if best is not None and (best.channels >= max_channels or best.channels * best.bw_intra >= total_bw):
            break
        if i + 1 < len(speeds) and (best is None or speeds[i + 1] / best.bw_intra > 0.49):
            i += 1
            continue
        break
    if best is None:  # "Could not find a path": NCCL falls back to one slow channel
        return Graph(1, speeds[-1], speeds[-1])
    k = speeds.index(best.bw_intra)
    while k > 0 and channels_at(speeds[k - 1]) >= best.channels:  # pass 2: faster with as many channels
        k -= 1
        best = Graph(best.channels, speeds[k], speeds[k])
    return best


def _dup_channels(graph: Graph, cc: int, max_channels: int) -> Graph:
    """``ncclTopoDupChannels``: fast channels are split in two of half the speed."""
    if graph.bw_intra < 25.0 or (cc > 80 and graph.bw_intra < 50.0 and graph.channels > 4):
        return graph
    dup = min(graph.channels * 2, max_channels)
    div = -(-dup // graph.channels)
    return Graph(dup, graph.bw_intra / div, graph.bw_inter / div)


def _nvls_graph(view: NodeView, speeds, max_bw: float) -> Graph:
    """``ncclTopoSearchTryNvls``: one channel per head GPU; each channel costs every GPU's NVLink its speed
    both ways, twice for its head, so n channels at speed s need ``s (n + 1)`` per GPU. More channels win;
    then pass 2 raises the speed across nodes while it is under twice the speed inside."""
    heads = min(view.ppn, view.nics) if view.nodes > 1 else view.ppn
    heads = min(heads, NCCL_MAX_NVLS_ARITY)
    intra_speeds = [s for s in speeds if view.nodes == 1 or s <= max_bw]
    for ch in range(heads, 0, -1):
        fit = [s for s in intra_speeds if s * (ch + 1) <= view.nvlink_bw + 1e-9]
        if fit:
            bw_intra = fit[0]
            break
    else:
        return Graph(0, 0.0, 0.0)
    if view.nodes > 1:
        cap = min(view.pci_bw, view.nic_bw)
        bw_inter = bw_intra
        for s in reversed(speeds):
            if bw_inter < s <= cap and bw_inter < 2 * bw_intra:
                bw_inter = s
    else:
        bw_inter = bw_intra
        for s in reversed(speeds):  # nothing crosses a NIC on one node: the search raises it to the top
            if s > bw_inter and bw_inter < 2 * bw_intra:
                bw_inter = s
    return Graph(ch, bw_intra, bw_inter)


# -- enqueue.cc and the device kernels: chunks, loops and the pipeline ----------------------------------------
NCCL_STEPS = 8  # device.h: slots in every connection's FIFO
# init.cc DEFAULT_LL_BUFFSIZE (NCCL_LL_LINES_PER_THREAD 8 x NCCL_LL_MAX_NTHREADS 512 x NCCL_STEPS x 16-byte lines),
# DEFAULT_LL128_BUFFSIZE (NCCL_LL128_ELEMS_PER_THREAD 120 x NCCL_LL128_MAX_NTHREADS 640 x NCCL_STEPS x 8 bytes),
# DEFAULT_BUFFSIZE (4 MiB): each connection's buffer per protocol, cut into NCCL_STEPS steps
BUFFSIZE = {LL: 8 * 512 * NCCL_STEPS * 16, LL128: 120 * 640 * NCCL_STEPS * 8, SIMPLE: 1 << 22}
LL128_DATA_PER_LINE = (15, 16)  # device.h: NCCL_LL128_DATAELEMS / NCCL_LL128_LINEELEMS (8-byte words per 128 B line)
GRAIN = {LL: 16, LL128: 32 * 8 // 16 * 15 * 8, SIMPLE: 512}  # device.h ncclProtoGrainSize: chunks align to these
# collectives.h: steps per chunk and per slice of a Simple ring (ALLREDUCE_CHUNKSTEPS = NCCL_STEPS / 2, ...)
CHUNK_STEPS = {"all_reduce": NCCL_STEPS // 2, "all_gather": NCCL_STEPS // 2, "reduce_scatter": NCCL_STEPS // 2,
               "broadcast": 1, "reduce": 1}
SLICE_STEPS = {"all_reduce": NCCL_STEPS // 4, "all_gather": NCCL_STEPS // 4, "reduce_scatter": NCCL_STEPS // 4,
               "broadcast": 1, "reduce": 1}
NVLS_CHUNKSIZE = 128 * 1024  # transport/nvls.cc NCCL_NVLS_CHUNKSIZE default
# transport/nvls.cc: NVLS kernels' channels (CTAs): NVLS_NCHANNELS_SM90, _SM100 (across nodes), _SM100_NVL (one node)
NVLS_NCHANNELS_SM90, NVLS_NCHANNELS_SM100, NVLS_NCHANNELS_SM100_NVL = 16, 32, 24


def nvls_tuning(view: NodeView) -> tuple[int, int, int]:
    """``ncclNvlsTuning`` (transport/nvls.cc): the NVLS kernels' channels (CTAs), chunk size and NVLSTree's chunk
    cap. Blackwell across nodes follows ``ncclNvlsTreeSm100Tuning``, which needs the GPU-to-NIC path: taken as
    through a PCIe switch (``PATH_PXB``) where every GPU has its own NIC, as on DGX/HGX nodes."""
    channels, chunk, tree_max = NVLS_NCHANNELS_SM90, NVLS_CHUNKSIZE, 0
    if view.cc >= 100:
        channels = NVLS_NCHANNELS_SM100 if view.nodes > 1 else NVLS_NCHANNELS_SM100_NVL
        if view.nodes > 1:
            nic, ppn, pxb = view.nic_bw, view.ppn, view.nics >= view.ppn
            if view.nodes == 2 and nic >= 48.0:
                channels, tree_max = 32, 128 * 1024
                if ppn <= 4:
                    chunk = tree_max = 256 * 1024
                elif ppn >= 16 or (ppn <= 8 and pxb and nic < 96.0):
                    tree_max = 64 * 1024
            elif nic >= 96.0:
                if ppn <= 8:
                    channels, chunk, tree_max = 24, 256 * 1024, 256 * 1024
                else:
                    channels, tree_max = 32, (128 if ppn < 32 else 64) * 1024
            elif nic >= 48.0:
                channels, tree_max = 24, (64 if pxb else 128) * 1024
    if tree_max == 0:
        tree_max = 65536 if view.nodes >= 4 else chunk
    return channels, chunk, tree_max


@dataclass(frozen=True)
class Pipeline:
    """How NCCL's kernel moves one collective: the message split over channels, each channel's share cut into
    chunks (``calcCollChunking``, enqueue.cc), chunks grouped into loops, and the loops streamed through the
    kernel's stages (device/all_reduce.h ...).

    NCCL's tuning model charges ``latency + bytes / bandwidth``: every stage busy from the first byte to the
    last. But a stage hands a chunk on only once it holds all of it (Simple protocol: a FIFO step is posted
    when the whole chunk is written), so the first loop must cross every hand-off before the last stage
    starts, and the last loop must still cross them after the first stage is done. That costs
    ``handoffs x loop_us / flows``: see :meth:`NcclModel.pipeline`.
    """

    channels: int  # kernel channels (CTAs) the message is split over
    channel_bytes: float  # each channel's share
    chunk: int  # bytes per chunk
    chunks_per_loop: int  # chunks a channel moves per loop (ring: one per rank; NVLS: one per head)
    loops: int  # loops per channel (the last one rebalanced by the kernel, not padded)
    first_loop_bytes: float  # the largest loop's bytes per channel
    loop_us: float  # that loop at NCCL's bandwidth per channel
    handoffs: int  # store-and-forward hand-offs a chunk crosses after its first stage
    flows: int  # 2 where a reduce half and a broadcast half share every resource; 1 otherwise
    path: str  # the stages a chunk goes through
    why: str  # where handoffs is 0: why the kernel has no fill to pay
    chunk_steps: list[str] = field(default_factory=list)  # how calcCollChunking arrived at the chunk

    @property
    def loop_bytes(self) -> int:
        return self.chunks_per_loop * self.chunk

    @property
    def fill_us(self) -> float:
        return self.handoffs * self.loop_us / self.flows


# -- tuning.cc ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Candidate:
    """One cell of NCCL's tuning table for a collective: ``time = latency + bytes / bandwidth``."""

    algo: str
    proto: str
    latency_us: float
    bw_GBps: float  # the tuner's bandwidth: bytes / this = the transfer time
    time_us: float = 0.0  # for a given size, with the tree correction and ring plateau applied
    latency_text: str = field(default="", compare=False)  # how the latency adds up, in NCCL's constants
    bw_text: str = field(default="", compare=False)  # how the bandwidth arises from the search's channels

    @property
    def name(self) -> str:
        return f"{self.algo}/{self.proto}"


@dataclass
class Choice:
    """What NCCL's tuner does for one collective and size: every candidate, the pick, the channels it runs on."""

    op: str
    nbytes: int
    candidates: list[Candidate]  # sorted by the tuner's time
    chosen: Candidate
    latency_us: float  # the chosen candidate's latency (with the ring plateau factor)
    bw_GBps: float  # its bandwidth with every channel (with the tree correction factor)
    channels: int  # channels the kernel runs on (enqueue.cc drops channels for small messages)
    max_channels: int  # channels the communicator has for this algorithm
    effective_bw_GBps: float  # the bandwidth on the channels the kernel really runs on (NcclModel._bus)
    graph: Graph
    disabled: dict[str, str] = field(default_factory=dict)  # algorithm -> why NCCL cannot use it here
    graphs: dict[str, Graph] = field(default_factory=dict)  # every search result of the communicator
    pipeline: Pipeline | None = None  # how the kernel streams the message (chunks, loops, fill)

    @property
    def time_us(self) -> float:
        """NCCL's own estimate: latency + bytes / bandwidth (on the channels the kernel runs on)."""
        return self.latency_us + self.nbytes / (1000.0 * self.effective_bw_GBps)

    @property
    def fill_us(self) -> float:
        """The kernel's pipeline fill and drain, which NCCL's estimate leaves out."""
        return self.pipeline.fill_us if self.pipeline is not None else 0.0

    @property
    def predicted_us(self) -> float:
        """parsim's time alone on the cluster: NCCL's estimate + the pipeline fill and drain."""
        return self.time_us + self.fill_us


class NcclModel:
    """NCCL's tuner for one communicator shape (``ppn`` GPUs on each of ``nodes`` nodes)."""

    def __init__(self, view: NodeView):
        self.view = view
        self.graphs = search(view)

    @cached_property
    def comm_channels(self) -> int:
        """``comm->nChannels`` (connect.cc): the ring's channels doubled, doubled again on Hopper and newer
        across nodes when the ring's channels are fast and few."""
        ring = self.graphs[RING]
        nc = min(MAXCHANNELS, ring.channels * 2)
        if self.view.cc >= 90 and self.view.nodes > 1 and ring.bw_intra > 45.0 and nc < 16:
            nc *= 2
        return nc

    @cached_property
    def nvls_tuning(self) -> tuple[int, int, int]:
        """NVLS channels, chunk size and NVLSTree chunk cap (:func:`nvls_tuning`)."""
        return nvls_tuning(self.view)

    def max_threads(self, algo: str, proto: str) -> int:
        if proto == SIMPLE and algo == RING:
            ring = self.graphs[RING]
            return 256 if ring.bw_intra * ring.channels <= PCI_BW else MAX_THREADS[SIMPLE]
        if algo in (NVLS, NVLS_TREE, COLLNET_DIRECT, COLLNET_CHAIN):
            return 640  # NCCL_MAX_NTHREADS
        return MAX_THREADS[proto]

    def _graph(self, algo: str) -> Graph | None:
        if algo == PAT:
            return self.graphs[RING]
        if algo == NVLS_TREE:
            return self.graphs.get(NVLS)
        return self.graphs.get(algo)

    @cached_property
    def _tables(self) -> dict[str, tuple[dict[tuple[str, str], Candidate], dict[str, str]]]:
        return {op: self._tune(op) for op in COLLECTIVES}

    def table(self, op: str) -> tuple[dict[tuple[str, str], Candidate], dict[str, str]]:
        """Latency and bandwidth of every usable (algorithm, protocol) for ``op``; and why the others are not."""
        return self._tables[op]

    def _tune(self, op: str):
        """``ncclTopoTuneModel`` for one collective."""
        v = self.view
        n, nodes, ppn = v.ranks, v.nodes, v.ppn
        nsteps = 2 * (n - 1) if op == "all_reduce" else n - 1 if op in ("all_gather", "reduce_scatter") else n
        intra_hw = "nvlink" if v.nvswitch else "pci"
        table: dict[tuple[str, str], Candidate] = {}
        disabled: dict[str, str] = {}
        for a in ALGOS:
            why = self._unavailable(op, a)
            if why:
                disabled[a] = why
                continue
            g = self._graph(a)
            for pi, p in enumerate(PROTOS):
                if a in (NVLS, NVLS_TREE, PAT, COLLNET_DIRECT, COLLNET_CHAIN) and p != SIMPLE:
                    continue
                if p == LL128 and not v.nvswitch:
                    continue  # LL128 only over NVLink paths (typeIntra <= PATH_NVB)
                bw_steps: list[str] = []
                bus = self._bus(op, a, p, g.channels, bw_steps)
                if bus <= 0:
                    continue
                lat = BASE_LAT[a][pi]
                intra_lat = HW_LAT[intra_hw][a][pi]
                inter_lat = HW_LAT["net"][TREE][pi] if ppn == 1 else HW_LAT["net"][a][pi]  # + latencyInter (IB: 0)
                hops = f"{intra_hw} hop {intra_lat:g}"
                net = f"network hop {inter_lat:g}"
                lat_text = f"base {lat:g}"
                if a == RING:
                    hw = "net" if nodes > 1 else intra_hw
                    if op in ("broadcast", "reduce"):
                        lat += HW_LAT[hw][RING][pi]  # the search keeps the same channels: one hop of latency
                        lat_text += f" + one {hw} hop {HW_LAT[hw][RING][pi]:g}"
                    else:
                        overhead = 0.0
                        if nodes > 1:
                            overhead = 2.0 if v.cpu_vendor == "amd" else 1.0
                            if p == SIMPLE:
                                overhead *= 3
                        if overhead > intra_lat:
                            hops = f"{intra_hw} hop raised to the {v.cpu_vendor} CPU's {overhead:g}"
                        intra_lat = max(intra_lat, overhead)
                        inter_steps = 0 if nodes == 1 else 2 * (nodes - 1) if op == "all_reduce" else nodes - 1
                        lat += (nsteps - inter_steps) * intra_lat + inter_steps * inter_lat
                        lat_text += f" + {nsteps - inter_steps} steps x {hops}" + (
                            f" + {inter_steps} steps x {net}" if inter_steps else "")
                elif a == TREE:
                    lat += 2 * ((ppn - 1) * intra_lat + log2i(nodes) * inter_lat)
                    lat_text += f" + 2 x ({ppn - 1} x {hops} + log2({nodes}) = {log2i(nodes)} x {net})"
                elif a == COLLNET_DIRECT:
                    lat += 2 * (min(1, ppn - 1) * intra_lat + (ppn - 1) * 0.4) + inter_lat
                    lat_text += f" + 2 x ({min(1, ppn - 1)} x {hops} + {ppn - 1} x 0.4) + {net}"
                elif a == COLLNET_CHAIN:
                    lat += 2 * (ppn - 1) * intra_lat + inter_lat
                    lat_text += f" + 2 x {ppn - 1} x {hops} + {net}"
                elif a == NVLS:
                    lat = intra_lat + (inter_lat if nodes > 1 else 0.0)
                    lat_text = f"{hops}" + (f" + {net}" if nodes > 1 else "")
                elif a == NVLS_TREE:
                    lat += intra_lat + 2 * log2i(nodes) * inter_lat
                    lat_text += f" + {hops} + 2 x log2({nodes}) = {2 * log2i(nodes)} x {net}"
                elif a == PAT:
                    lat += log2i(nodes) * (inter_lat / 3.5) + n * 2.8
                    lat_text += f" + log2({nodes}) x {net} / 3.5 + {n} ranks x 2.8"
                table[(a, p)] = Candidate(a, p, lat, bus, latency_text=f"{lat_text} us",
                                          bw_text=" ".join(bw_steps))
        return table, disabled

    def _bus(self, op: str, a: str, p: str, channels: float, why: list[str] | None = None) -> float:
        """The tuner's bandwidth of algorithm ``a`` with protocol ``p`` for ``op`` (``ncclTopoTuneModel``), in the
        message's own GB/s, on ``channels`` of the search's channels: all of them for the tuning table, their
        share of the communicator's where the kernel runs on fewer (:meth:`_channels`). Caps on the whole (LL's
        ``llMaxBw``) stay; caps per channel scale with them. ``why`` gets each factor, in words."""
        v = self.view
        n, nodes, ppn = v.ranks, v.nodes, v.ppn
        cci = compcap_index(v.cc)
        index2 = min(nodes, 3) - 1
        index1 = cci if nodes == 1 else (1 if v.cpu_vendor == "amd" else 0)
        ll_max_bw = LL_MAX_BW[index1][index2]
        nsteps = 2 * (n - 1) if op == "all_reduce" else n - 1 if op in ("all_gather", "reduce_scatter") else n
        g = self._graph(a)
        collnet = a in (COLLNET_DIRECT, COLLNET_CHAIN)
        bw = g.bw_intra if nodes <= 2 or collnet else g.bw_inter
        explain = why is not None
        if explain:
            why.append(f"{channels:g} ch x {bw:g} GB/s")
        if a in (NVLS, NVLS_TREE):
            intra = g.bw_intra * NVLS_EFFICIENCY[cci] * (g.channels - 1) / g.channels  # its heads
            intra *= 2.0 if op == "all_reduce" else (ppn - 1) / ppn
            across = g.bw_inter * (2 if nodes <= 2 and a == NVLS_TREE else 1)
            bw = min(intra, across, PER_CH_MAX_NVLS_TREE[cci][index2] if a == NVLS_TREE else math.inf)
            if explain:
                why[-1] = (f"{channels:g} ch x min({g.bw_intra:g} GB/s x NVLS efficiency {NVLS_EFFICIENCY[cci]:g}"
                           f" x {g.channels - 1}/{g.channels} heads x "
                           + ("2 (in and out)" if op == "all_reduce" else f"{ppn - 1}/{ppn}")
                           + f", across {across:g}) = {channels:g} x {bw:.4g} GB/s")
        bus = channels * bw
        if a == RING and p == LL:
            bus = min(ll_max_bw, bus * .5)
            if explain:
                why.append(f"x 0.5 (LL's flags), at most llMaxBw {ll_max_bw:g}")
        if a == RING and p == LL128:
            bus = min(bus * 0.92, channels * PER_CH_MAX_RING_LL128[cci][index2])
            if explain:
                why.append(f"x 0.92 (LL128), at most {PER_CH_MAX_RING_LL128[cci][index2]:g} a channel")
        if a == TREE and op == "all_reduce":
            bus = min(bus * .92, channels * PER_CH_MAX_TREE[cci][index2])
            if explain:
                why.append(f"x 0.92 (tree), at most {PER_CH_MAX_TREE[cci][index2]:g} a channel")
        if a == TREE and p == LL:
            bus = min(bus / 3.8, ll_max_bw)
            if explain:
                why.append(f"/ 3.8 (tree LL), at most llMaxBw {ll_max_bw:g}")
        if a == TREE and p == LL128:
            factor = 7.0 / 9.0 if nodes == 1 else 120.0 / 128.0
            bus = min(bus * factor, channels * PER_CH_MAX_TREE_LL128[cci][index2])
            if explain:
                why.append(f"x {'7/9' if nodes == 1 else '120/128'} (tree LL128), at most "
                           f"{PER_CH_MAX_TREE_LL128[cci][index2]:g} a channel")
        if a == PAT:
            bus *= .75
            if explain:
                why.append("x 0.75 (PAT)")
        if a == COLLNET_DIRECT:
            if op in ("all_gather", "reduce_scatter"):
                bus = ppn * min(g.bw_intra, g.bw_inter * 0.9)
                if explain:
                    why[:] = [f"{ppn} GPUs x min({g.bw_intra:g}, {g.bw_inter:g} x 0.9) GB/s"]
            else:
                factor = ppn / g.channels
                factor -= (factor - 1) / 2
                bus /= factor
                if explain:
                    why.append(f"/ {factor:.3g} (CollNet's GPUs per channel)")
                if v.cc >= 90:
                    bus *= .85
                    if explain:
                        why.append("x 0.85 (Hopper and later)")
        if not (a != RING and op in ("all_gather", "reduce_scatter")):
            rate = n / nsteps if a in (RING, NVLS, NVLS_TREE) else .5
            bus *= rate
            if explain:
                why.append(f"x {n}/{nsteps} steps (the message's own rate)" if a in (RING, NVLS, NVLS_TREE)
                           else "x 0.5 (the message's own rate)")
        if explain:
            why.append(f"= {bus:.4g} GB/s")
        return bus

    def _unavailable(self, op: str, a: str) -> str:
        """Why NCCL would not run algorithm ``a`` for ``op`` on this communicator ("" if it would)."""
        v = self.view
        if op in ("broadcast", "reduce") and a != RING:
            return "broadcast and reduce run on rings only"
        if op in ("all_gather", "reduce_scatter") and a not in (PAT, RING, NVLS, COLLNET_DIRECT):
            return f"{op.replace('_', '-')} has no {a} implementation"
        if op == "all_reduce" and a == PAT:
            return "PAT implements all-gather and reduce-scatter only"
        if a == TREE and v.ranks < 2:
            return "needs two ranks"
        if a == PAT and (v.ppn != 1 or v.cc < 60):
            return "PAT runs with one GPU per node only"
        if a in (NVLS, NVLS_TREE):
            if not v.nvls:
                return "no NVLink SHARP on this fabric (needs an NVSwitch with in-switch reduction, SM90+)"
            g = self.graphs.get(NVLS)
            if g is None or g.channels < 2:
                return "NVLS needs at least 2 channels (2 GPUs on the node)"
            if a == NVLS_TREE and v.nodes == 1:
                return "NVLSTree is disabled on a single node"
            if a == NVLS and v.nodes > 1 and not v.collnet:
                return "NVLS across nodes needs CollNet (SHARP); NVLSTree runs instead"
            if op in ("all_gather", "reduce_scatter") and v.nodes > 1:
                return "NVLS all-gather/reduce-scatter across nodes needs CollNet all-gather support"
        if a in (COLLNET_DIRECT, COLLNET_CHAIN):
            if not v.collnet:
                return "the cluster file declares no CollNet/SHARP network (nccl.collnet)"
            if v.nodes < 2:
                return "CollNet reduces across nodes"
            if v.ppn > NCCL_MAX_DIRECT_ARITY + 1:
                return f"CollNet supports up to {NCCL_MAX_DIRECT_ARITY + 1} GPUs per node"
            if a == COLLNET_DIRECT and not v.nvswitch:
                return "CollNetDirect needs an NVSwitch"
            if op in ("all_gather", "reduce_scatter"):
                return "CollNet all-gather/reduce-scatter need one NIC per GPU and plugin support (not modelled)"
        return ""

    def time_us(self, op: str, c: Candidate, nbytes: int) -> float:
        """``ncclTopoGetAlgoTime``: latency + bytes / bandwidth, with NCCL's corrections."""
        bw, lat = c.bw_GBps, c.latency_us
        log_size = log2i(nbytes >> 6)
        if c.algo == TREE and op == "all_reduce" and 0 <= log_size < 23:
            bw *= TREE_CORRECTION[PROTOS.index(c.proto)][log_size]
        if (c.algo == NVLS_TREE and op == "all_reduce" and 0 <= log_size < 24 and self.view.cc >= 100
                and self.view.cpu_vendor != "arm"):
            bw *= TREE_CORRECTION[PROTOS.index(c.proto)][log_size]
        lat *= self._plateau(op, c, nbytes)
        return lat + nbytes / (1000.0 * bw)

    def _plateau(self, op: str, c: Candidate, nbytes: int) -> float:
        """"Plateau effect of ring": multi-node Simple ring all-reduce latency x1.4 (x1.9 before SM80)."""
        if (c.algo == RING and c.proto == SIMPLE and self.view.nodes > 1 and op == "all_reduce"
                and nbytes / (self.comm_channels * self.view.ranks) >= 64):
            return 1.9 if self.view.cc < 80 else 1.4
        return 1.0

    def choose(self, op: str, nbytes: int, algos: tuple[str, ...] | None = None,
               proto: str | None = None) -> Choice | None:
        """The candidate of least time (``topoGetAlgoInfo``), optionally restricted like NCCL_ALGO/NCCL_PROTO."""
        table, disabled = self.table(op)
        cands = sorted((Candidate(c.algo, c.proto, c.latency_us, c.bw_GBps, self.time_us(op, c, nbytes),
                                  c.latency_text, c.bw_text) for c in table.values()), key=lambda c: c.time_us)
        pool = [c for c in cands if (algos is None or c.algo in algos) and (proto is None or c.proto == proto)]
        if not pool:
            return None
        chosen = pool[0]
        latency = chosen.latency_us * self._plateau(op, chosen, nbytes)
        transfer = chosen.time_us - latency
        bw = nbytes / (1000.0 * transfer) if transfer > 0 else chosen.bw_GBps  # the tree correction folded in
        nc, max_nc = self._channels(chosen, nbytes)
        run_bw = bw  # what the kernel's channels reach: per-channel speeds scale with them, a cap on the whole stays
        if nc < max_nc:  # (the tuner counts the search's channels, which the communicator's split: the same share)
            searched = self._graph(chosen.algo).channels
            run_bw *= (self._bus(op, chosen.algo, chosen.proto, searched * nc / max_nc)
                       / self._bus(op, chosen.algo, chosen.proto, searched))
        pipe = self.pipeline(op, chosen, int(nbytes), nc, run_bw)
        return Choice(op, int(nbytes), cands, chosen, latency, bw, nc, max_nc, run_bw, self._graph(chosen.algo),
                      disabled, self.graphs, pipe)

    # -- enqueue.cc calcCollChunking and the kernels' loops ----------------------------------------------------

    def chunk_size(self, op: str, c: Candidate, channel_bytes: float) -> tuple[int, list[str]]:
        """``calcCollChunking`` (enqueue.cc) for one channel's share: the chunk, and how it was arrived at."""
        algo, proto = c.algo, c.proto
        step = BUFFSIZE[proto] // NCCL_STEPS
        steps = CHUNK_STEPS[op] if algo == RING and proto == SIMPLE else 1
        chunk = step * steps
        name = op.replace("_", "").upper()
        notes = [f"{proto} buffer {BUFFSIZE[proto]:,} B / NCCL_STEPS {NCCL_STEPS} = {step:,} B per step"
                 + (f", {steps} steps per chunk ({name}_CHUNKSTEPS): {chunk:,} B" if steps > 1 else
                    ", one step per chunk")]
        if proto == LL:
            chunk //= 2
            notes.append(f"LL lines carry 8 data bytes in 16: {chunk:,} B of data")
        elif proto == LL128:
            chunk = chunk // LL128_DATA_PER_LINE[1] * LL128_DATA_PER_LINE[0]
            notes.append(f"LL128 lines carry 120 data bytes in 128: {chunk:,} B of data")
        nb = int(channel_bytes)
        heads = self.graphs[NVLS].channels if NVLS in self.graphs else 1

        def shrink(rules, why):
            nonlocal chunk
            for mult, floor in rules:
                if nb < mult * heads * chunk and chunk > floor:
                    notes.append(f"{nb:,} B < {mult} x {heads} heads x {chunk:,} B: chunk {floor:,} B ({why})")
                    chunk = floor

        if algo == NVLS:
            cap = self.nvls_tuning[1]
            nvls = self.table("all_reduce")[0].get((NVLS, SIMPLE))
            if self.view.nodes > 1 and nvls is not None and nvls.bw_GBps < 150:
                cap = 32768
            chunk = min(chunk, cap)
            notes.append(f"NVLS chunks are at most {cap:,} B (NCCL_NVLS_CHUNKSIZE): {chunk:,} B")
            shrink(((64, 65536), (8, 32768), (2, 16384)), "smaller chunks for a smaller share")
        elif algo == NVLS_TREE:
            _, nvls_chunk, tree_max = self.nvls_tuning
            chunk = min(nvls_chunk, tree_max)
            notes.append(f"NVLSTree chunks are at most min(NCCL_NVLS_CHUNKSIZE {nvls_chunk:,}, "
                         f"tree cap {tree_max:,}) = {chunk:,} B (nvls.cc: 64 KiB from 4 nodes on)")
            shrink(((32, 262144), (16, 131072), (4, 65536), (1, 32768)), "smaller chunks for a smaller share")
        elif algo == TREE and proto == LL128:
            ppn = self.view.ranks / self.view.nodes
            nsteps = 1 + log2i(self.view.nodes) + 0.1 * ppn
            while nb // chunk < nsteps * 64 / ppn and chunk > 131072:
                chunk //= 2
            while nb // chunk < nsteps * 16 / ppn and chunk > 32768:
                chunk //= 2
            notes.append(f"Tree/LL128 halves it while a channel's share holds fewer than {nsteps:.3g} x 64/ppn chunks "
                         f"(while above 128 KiB), then {nsteps:.3g} x 16/ppn (while above 32 KiB): {chunk:,} B")
        elif algo == PAT:
            k = 32 if op == "all_gather" else 16
            while chunk * k > nb and chunk > 65536:
                chunk //= 2
            notes.append(f"PAT halves it while {k} chunks exceed a channel's share (while above 64 KiB): {chunk:,} B")
        aligned = chunk // GRAIN[proto] * GRAIN[proto]
        if aligned != chunk:
            notes.append(f"aligned to {GRAIN[proto]} B: {aligned:,} B")
        return aligned, notes

    def pipeline(self, op: str, c: Candidate, nbytes: int, channels: int, bw_GBps: float) -> Pipeline:
        """How the kernel streams ``nbytes`` of ``op`` with candidate ``c`` over ``channels`` channels at
        ``bw_GBps`` in all, and the fill and drain that NCCL's estimate leaves out.

        Each channel moves its share in loops of ``chunks_per_loop`` chunks. At NCCL's bandwidth a loop takes
        ``loop_us``; the tuner's ``bytes / bandwidth`` is every loop back to back. A chunk is handed from stage
        to stage (rank to rank, warp group to warp group, over NVLink or a NIC) through FIFOs of NCCL_STEPS
        slots, and a stage passes a chunk on only once it holds all of it, so the first loop crosses
        ``handoffs`` hand-offs before the last stage starts, and the last loop crosses them again after the
        first stage is done. Where the reducing half of an all-reduce and its broadcasting half share every
        resource (scatter and gather the SMs and memory, switch reduction and multicast the NVLinks, the up and
        down tree the NICs: NCCL alternates two trees over the channels), the steady loop time is both halves'
        work and a half running alone during fill or drain goes twice as fast: ``flows`` = 2. Fill and drain
        cost ``handoffs x loop_us / flows``.

        Rings (all-reduce, all-gather, reduce-scatter) pay none: every rank starts by sending its own chunk,
        and the chunk it forwards next has arrived while it sent the previous one.
        """
        v, algo, proto = self.view, c.algo, c.proto
        channel_bytes = nbytes / channels
        chunk, notes = self.chunk_size(op, c, channel_bytes)
        heads = self.graphs[NVLS].channels if NVLS in self.graphs else 1
        ring_like = op in ("all_reduce", "all_gather", "reduce_scatter")
        per_loop = {RING: v.ranks if ring_like else 1, NVLS: heads, NVLS_TREE: heads,
                    COLLNET_DIRECT: heads}.get(algo, 1)
        loop = per_loop * chunk
        loops = max(1, math.ceil(channel_bytes / loop)) if loop > 0 else 1
        first = min(loop, channel_bytes)
        loop_us = first / (1000.0 * bw_GBps / channels) if bw_GBps > 0 else 0.0
        handoffs, flows, why = 0, 1, ""
        n = v.ranks
        if algo == RING and ring_like:
            steps = {"all_reduce": 2 * (n - 1)}.get(op, n - 1)
            path = f"a ring: {steps} steps per loop, each passing one chunk to the next rank"
            slices = f" in {CHUNK_STEPS[op] // SLICE_STEPS[op]} slices" if proto == SIMPLE else " line by line"
            why = ("every rank sends its own chunk at the first step, and the chunk it forwards next arrives"
                   f"{slices} while it sends the previous one: no rank waits for the pipe to fill (the last"
                   " loop is rebalanced, not padded)")
        elif algo == RING:
            path = f"a chain through {n} ranks: each chunk crosses {n - 1} links"
            if proto == SIMPLE:
                handoffs = n - 2
            else:
                why = f"{proto} flags every line, so a rank forwards data as it arrives: nothing is stored whole"
        elif algo == NVLS and v.nodes == 1:
            if op == "all_reduce":
                path = "scatter into the NVLS buffer -> switch reduction + multicast (head GPU) -> gather"
                handoffs, flows = 2, 2
            elif op == "all_gather":
                path, handoffs = "multicast into the NVLS buffer -> gather", 1
            else:
                path, handoffs = "scatter into the NVLS buffer -> switch reduction", 1
        elif algo == NVLS_TREE:
            from .algorithms import double_tree_depth
            d = double_tree_depth(v.nodes)
            path = (f"scatter -> switch reduction (head GPU) -> {d} network hop(s) up the tree to the root -> "
                    f"{d} down -> multicast -> gather")
            handoffs, flows = 2 + 2 * d, 2
        else:
            path = {TREE: "a double binary tree, reduced up and broadcast down in chunks",
                    PAT: "PAT's aggregated trees", NVLS: "NVLS with in-network (SHARP) reduction across nodes"
                    }.get(algo, "CollNet (SHARP)")
            why = ("NCCL's treeCorrectionFactor (tuning.cc) already slows trees at medium sizes" if algo == TREE
                   else "not modelled")
        return Pipeline(channels, channel_bytes, chunk, per_loop, loops, first, loop_us, handoffs, flows, path,
                        why, notes)

    def _channels(self, c: Candidate, nbytes: int) -> tuple[int, int]:
        """Channels the kernel runs on (enqueue.cc ``topoGetAlgoInfo``): ring and tree drop channels while
        ``bytes < channels x threads x threshold``; NVLS keeps its own; the model's bandwidth assumed all."""
        if c.algo in (NVLS, NVLS_TREE):  # NCCL_NVLS_NCHANNELS CTAs; NVLS across nodes at most comm->nChannels
            nc = self.nvls_tuning[0]
            if c.algo == NVLS and self.view.nodes > 1:
                nc = min(nc, self.comm_channels)
            return nc, nc
        if c.algo in (COLLNET_DIRECT, COLLNET_CHAIN):
            g = self._graph(c.algo)
            return g.channels, g.channels
        total = self.comm_channels
        nt = self.max_threads(c.algo, c.proto)
        threshold = THREAD_THRESHOLD[c.proto] * (self.view.ranks if c.algo == RING and c.proto == LL else 1)
        nc = total
        while nbytes < nc * nt * threshold and nc >= 2:
            nc -= 1
        return nc, total


# -- parsim glue ---------------------------------------------------------------------------------------------

NCCL_ALGOS_OF = {"ring": (RING,), "tree": (TREE,), "in_switch": (NVLS,), "nvls_tree": (NVLS_TREE,), "pat": (PAT,),
                 "collnet": (COLLNET_DIRECT, COLLNET_CHAIN)}


def model_for(topo, group) -> NcclModel | None:
    """NCCL's tuner for ``group`` on ``topo`` (cached per shape), or None where the cluster file has no
    ``nccl:`` section."""
    nccl = topo.spec.nccl
    if nccl is None or len(group) < 2:
        return None
    group = np.asarray(group)
    nodes = topo.node_of(group)
    uniq, counts = np.unique(nodes, return_counts=True)
    first = group[nodes == uniq[0]]
    nics = len(np.unique(topo.nic_of(first)))
    key = (len(uniq), int(counts.max()), nics)
    cache = topo.__dict__.setdefault("_nccl_models", {})
    if key not in cache:
        cache[key] = NcclModel(node_view(topo.spec, nccl, int(counts.max()), len(uniq), nics))
    return cache[key]


def nccl_choice(topo, op: str, algorithm: str, group, size: float, protocol: str | None = None) -> Choice | None:
    """NCCL's latency and bandwidth for parsim's ``algorithm`` (and ``protocol``, default the best for it),
    or None where NCCL's model does not apply (no ``nccl:`` section, not an NCCL collective or algorithm,
    or one NCCL would not run here: the flow model then times it alone)."""
    if op not in COLLECTIVES or algorithm not in NCCL_ALGOS_OF:
        return None
    model = model_for(topo, group)
    if model is None:
        return None
    return model.choose(op, int(size), NCCL_ALGOS_OF[algorithm], protocol)
