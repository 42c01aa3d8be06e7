"""Cluster descriptions: one node's hardware plus the scale-out fabric.

A cluster file (``topologies/*.yaml``) describes a single node and the network
between nodes; the node count is chosen at run time. :func:`load_cluster`
validates the file (one :class:`~parsim.errors.ConfigError` line per problem,
naming the file, the key and the expected unit) and returns a
:class:`ClusterSpec`; :meth:`ClusterSpec.build` places it on ``nodes`` nodes and
returns a :class:`~parsim.hardware.topology.Topology`.
"""

from __future__ import annotations

import importlib.resources
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from ..errors import ConfigError, ParsimError, expected_keys
from ..files import read_yaml

FABRICS = ("nvswitch", "pcie")
DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8")
# What a figure of any hardware can be, per unit. The bounds lie far outside every real device (tests
# use 1e9 GB/s links as "free", calibration a unit host of 1 B/s), so only a NaN-like typo is refused:
# 1e-300 GB/s or 1e300 us would stall the simulation or dwarf every other figure.
PRICE_USD_PER_GPU_HOUR = (1e-6, 1e6, "US dollars per GPU-hour")
BANDWIDTH_GBPS = (1e-12, 1e12, "GB/s")  # from 1 mB/s
LINK_GBITS = (1e-11, 1e13, "Gb/s (gigabits)")
LATENCY_US = (0.0, 1e9, "microseconds")  # up to 1,000 s
PROBE_US = (1e-6, 1e9, "microseconds")  # a probe's time: more than nothing, as it divides
# A collective the collective probe finds faster than at calibration still takes at least this share of its calibrated
# time (the probe's extra per byte is read off three sizes; a large negative one is not extrapolated to nothing).
FASTEST_AFTER_PROBE = 0.25
TFLOPS = (1e-12, 1e12, "TFLOP/s, dense")  # from 1 FLOP/s
GFLOPS = (1e-9, 1e15, "GFLOP/s")  # from 1 FLOP/s
CAPACITY_GB = (1e-12, 1e12, "GB")
CLOCK_MHZ = (1.0, 1e5, "MHz")
OVERSUBSCRIPTION = (1.0, 1e6, "downlink:uplink ratio, e.g. 1.0 for non-blocking")
FRACTION = (1e-6, 1.0, "fraction")
ELASTICITY = (0.0, 1.0, "power the work follows its probe to (0: not at all, 1: in step)")
# Each compute probe's key in a cluster file's compute section (parsim.calibrate.host.COMPUTE_PROBES): its elasticity
# is speed_probe_<probe>_elasticity, given only beside it.
PROBE_KEYS = {"matmul": "speed_probe_gflops", "eager": "speed_probe_eager_us", "memory": "speed_probe_memory_GBps"}
EFFICIENCY = (1e-6, 1e6, "fraction of link speed")
SPEEDUP = (1e-3, 1e3, "times as fast")
MATRIX_DIM = (0.0, 1e9, "matrix dimension")
CACHE_SHARE = (0.0, 1.0, "share of the weight")
# GPUs in one run: beyond the largest clusters built (about 100,000 GPUs); a topology of this many
# takes seconds and 0.4 GB to build, ten times more would take minutes.
MAX_GPUS = 2**17
COUNTS = {"gpus_per_node": MAX_GPUS, "nics_per_node": 2**12, "nodes_per_leaf": MAX_GPUS}

COMPUTE_KEYS = ("matmul_efficiency", "matmul_half_dim", "matmul_k_overhead", "kernel_overhead_us", "memory_efficiency",
                "sm_cycles",
                "attention_efficiency",
                # eager-CPU host costs (parsim.sim.compute), written by `parsim calibrate`
                "op_forward_us", "op_backward_us", "optimizer_tensor_us", "optimizer_step_us", "matmul_stream_bw_GBps",
                "matmul_write_bw_GBps", "matmul_cached_stream_bw_GBps", "matmul_cache_hits",
                "p2p_rendezvous_us", "p2p_latency_us", "p2p_issue_us", "action_overhead_us",
                "elementwise_bw_GBps", "core_ns_per_element", "tp_collective_call_us",
                "zero_grad_step_us", "zero_grad_tensor_us", "zero_grad_free_GBps",
                "fsdp_unshard_us", "fsdp_reduce_us", "fsdp_optimizer_tensor_us", "fsdp_pass_us", "pass_us",
                "memory_alone_bw_GBps", "memory_host_bw_GBps", "shared_cores", "cpu_cores", "speed_probe_gflops",
                "speed_probe_eager_us", "speed_probe_memory_GBps", "speed_probe_matmul_elasticity",
                "speed_probe_eager_elasticity", "speed_probe_memory_elasticity",
                "collective_probe_us", "rank_jitter")
SHARED_CORE_KEYS = ("p2p_rendezvous_us", "p2p_latency_us", "action_overhead_us")  # SharedCoreCosts' fields, in us
# Optional (absent from files calibrated before they were measured): times in us, and speeds in GB/s.
SHARED_CORE_OPTIONAL = ("p2p_issue_us", "time_slice_us", "one_core_collective_latency_us")
SHARED_CORE_BANDWIDTHS = ("one_core_collective_GBps",)
# Optional, times: a matmul's and an eager pass's with two ranks computing on a core (absent: 2, the fair share),
# and how many times as long again both take where the ranks communicate (absent: 1).
SHARED_CORE_STRETCHES = ("matmul_stretch", "eager_stretch", "comm_stretch")
STRETCH = (1.0, 100.0, "times as long as with a core each")
JITTER = (0.0, 1.0, "fraction of a rank's time (sigma over the mean)")


@dataclass(frozen=True)
class GPUSpec:
    model: str
    peak_flops: dict[str, float]  # dtype -> FLOP/s, dense
    hbm_capacity_bytes: float
    hbm_bw_Bps: float
    sm_count: int = 0  # streaming multiprocessors (wave quantization of matmuls); 0: not a GPU / unknown
    sm_clock_Hz: float = 0.0  # the SMs' boost clock (the SM side of memory-bound kernels); 0: not known

    @property
    def sm_cycles_per_s(self) -> float:
        """SM cycles the whole GPU runs per second (0 where the SM count or the clock is not known)."""
        return self.sm_count * self.sm_clock_Hz


@dataclass(frozen=True)
class IntraNodeSpec:
    fabric: str  # "nvswitch" | "pcie"
    bw_Bps: float  # per GPU, per direction, into the fabric
    latency_s: float  # one GPU-to-GPU step through the fabric
    in_switch_reduction: bool
    # Everything crossing the fabric together (a host's memory and CPUs for a
    # PCIe root complex or loopback); None: non-blocking, never the limit.
    fabric_bw_Bps: float | None = None


@dataclass(frozen=True)
class ScaleOutSpec:
    nics_per_node: int
    nic_bw_Bps: float  # per NIC, per direction
    latency_s: float  # NIC to NIC through one leaf
    spine_hop_latency_s: float
    nodes_per_leaf: int
    oversubscription: float


@dataclass(frozen=True)
class NcclSpec:
    """What NCCL's topology detection would find on a node (the optional ``nccl:`` section).

    A cluster file with this section is timed with NCCL's own cost model
    (:mod:`parsim.sim.collectives.nccl`): protocols, channels and the tuner's choice.
    Files without it (ideal clusters, calibrated gloo hosts) keep the pure
    flow model at the links' peak bandwidth.
    """

    compute_capability: int  # e.g. 80 (A100), 90 (H100), 100 (B200)
    nvlinks_per_gpu: int = 0  # NVLink links from each GPU into the fabric (0: PCIe only)
    pcie_gen: int = 4  # PCIe generation between a GPU and its NIC (and host)
    pcie_lanes: int = 16
    cpu_vendor: str = "intel"  # intel | amd | arm: NCCL's LL bandwidth caps and network overheads differ
    collnet: bool = False  # in-network reduction (InfiniBand SHARP) that NCCL's CollNet algorithms can use


Curve = tuple[tuple[int, float], ...]  # (x, y) points, x ascending


@dataclass(frozen=True)
class SharedCoreCosts:
    """A CPU host's costs measured with two ranks on each core (``compute.shared_cores``, written by
    ``parsim calibrate``; :meth:`parsim.sim.compute.ComputeModel.time_shared`): a late receive's rendezvous, a
    transfer's latency with its receiver waiting, the loop's time before each action and a send's issue, in
    seconds; and how many times as long a matmul and an eager pass take as with a core each, both ranks
    computing (None: not measured, taken as 2, each rank's fair share). Two ranks switching on a core take
    more than twice as long, each slice starting in caches the other emptied: on a 2-core VM a small model's
    passes took 2.25-2.6x, the host-speed probes 2.0-2.2x (2026-11-27); timed in alternating windows, so that
    the host's drift cancels, tiny-gpt's passes 2.14-2.16x and the probes 2.06-2.13x (2026-11-29,
    ``benchmarks/cpu_pass_stretch.py``). Where the ranks communicate, compute takes ``comm_stretch`` times as
    long again (:mod:`parsim.calibrate.shared_pipeline`)."""

    p2p_rendezvous_s: float
    p2p_latency_s: float
    action_overhead_s: float
    p2p_issue_s: float = 0.0
    matmul_stretch: float | None = None
    eager_stretch: float | None = None
    time_slice_s: float | None = None  # how long a rank runs before the next on its core (parsim.sim.cores)
    # How many times as long again compute on a shared core takes in a run whose ranks communicate: gloo's
    # threads waking on the core, more switches (None: 1). Fitted by calibrate on a generic pipeline.
    comm_stretch: float | None = None
    # A collective among ranks that all share one core, its last rank arriving while the others sleep: this
    # latency plus its bus bytes (nccl-tests' busbw factor times the size) at this speed. Two processes on
    # one core pass the data without waking another core: a 545 KiB all-reduce took 0.70-0.74 ms there against
    # 3.9-4.1 ms with a core each on the 2-core VM (benchmarks/cpu_core_allreduce.py). None: not measured,
    # priced as between cores.
    one_core_collective_latency_s: float | None = None
    one_core_collective_bw_Bps: float | None = None

    def to_mapping(self) -> dict[str, float]:
        """The ``compute.shared_cores`` mapping: each time in microseconds, named ``..._us``, the one-core
        collectives' speed in GB/s, and the stretches measured."""
        mapping = {f"{f.name[:-2]}_us": getattr(self, f.name) * 1e6 for f in fields(self)
                   if f.name.endswith("_s") and getattr(self, f.name) is not None}
        mapping.update({key: getattr(self, f"{key[:-5]}_bw_Bps") / 1e9 for key in SHARED_CORE_BANDWIDTHS
                        if getattr(self, f"{key[:-5]}_bw_Bps") is not None})
        return {**mapping, **{key: getattr(self, key) for key in SHARED_CORE_STRETCHES
                              if getattr(self, key) is not None}}

    def one_core_collective_s(self, collective: str, nranks: int, nbytes: float) -> float | None:
        """A collective of ``nbytes`` among ``nranks`` ranks on one core (None: not measured)."""
        from ..report.results import busbw_factor  # report imports this module

        if self.one_core_collective_latency_s is None or self.one_core_collective_bw_Bps is None:
            return None
        return (self.one_core_collective_latency_s
                + busbw_factor(collective, nranks) * nbytes / self.one_core_collective_bw_Bps)


@dataclass(frozen=True)
class SmCycles:
    """SM cycles per element of the memory-bound kernels whose arithmetic, not their bytes, can bound them
    (:class:`parsim.sim.compute.SmWork`): a softmax's forward per element read or written, by row length; dropout
    per random number drawn (one per mask element); GeLU and a fused norm per element read or written,
    forward and backward; a bias added in a kernel of its own (a broadcast add, which torch does not vectorize)
    per element read or written. A softmax's backward and dropout's stream at the memory speed.

    ``adamw``: a fused AdamW step's SM cycles per parameter, *added* to its bytes' time rather than the longer
    of the two. torch's fused kernel (multi_tensor_apply: at most 320 blocks of 512 threads a launch, one
    65,536-element chunk each) does not hide its arithmetic behind its bytes: on an H200 it took 15.5 ms over
    1.92B fp32 parameters at 1,980 MHz, 9.9 ms over the same in bf16 (half the bytes) and 16.7 ms at 1,560 MHz.
    Its bytes alone or its cycles alone reproduce one of the three at most; bytes at the copy rate plus 0.39
    cycles a parameter give 15.5, 9.2 and 16.3 ms."""

    softmax: Curve
    dropout: float
    gelu: tuple[float, float]
    norm: tuple[float, float]
    bias_add: float
    adamw: float


# Measured on an H100 SXM and an H200 (132 SMs at 1,980 MHz each; the mean of the two) by
# benchmarks/gpu/score_kernels.py, kept in benchmarks/gpu/h100-score-kernels-2026-11-26.json and h200-...:
# these kernels run as long as the SMs need, however fast the memory (torch's softmax over rows of 2,048 fp16
# scores took 2.49 ms on H100 and 2.30 ms on H200 for 4.3 GB, which copies in 1.42 and 1.01 ms). The softmax
# is torch's softmax_warp_forward to 2,048 entries and cunn_SoftMaxForward beyond (Megatron-LM's fused
# scale-mask-softmax is a warp-per-row kernel of the same design); the norm is torch's LayerNorm (RMSNorm is
# priced alike). Every cluster file without figures of its own takes these; for a GPU other than Hopper that is
# an assumption (A100's SMs have half the FP32 lanes of Hopper's and as many special-function units: there the
# cost is a lower bound). `parsim calibrate --ranks 1` measures them on the GPU at hand. The bias add is from a
# later run of the same script on both GPUs (h100-score-kernels-bias-2026-11-26.json and h200-...): a bias added
# in place over 16,384 x 12,288 fp16 took 0.580 and 0.548 ms, against 0.27 and 0.19 ms for its bytes. AdamW's
# is an H200's (benchmarks/gpu/optimizer_rate.py, kept in benchmarks/gpu/h200-optimizer-rate-2026-11-30.json):
# torch's fused AdamW over fp32 parameters less its 28 bytes a parameter at the copy rate of the same run
# (4.26 TB/s), 0.383-0.400 cycles a parameter over 268M parameters in 1 to 256 tensors and 1.92B in the one-GPU
# step's 93; the median of the four.
HOPPER_SM_CYCLES = SmCycles(softmax=((512, 0.193), (1024, 0.205), (2048, 0.291), (4096, 0.407), (8192, 0.503)),
                            dropout=0.468, gelu=(0.170, 0.158), norm=(0.235, 0.356), bias_add=0.366, adamw=0.390)
SM_CYCLES = (1e-6, 1e6, "SM cycles per element")


@dataclass(frozen=True)
class CoreArithmetic:
    """Seconds per element on one CPU core, (forward, backward), of the memory-bound kernels whose arithmetic
    there outlasts their bytes at the host's elementwise speed: GeLU's erf, a norm's reductions, a softmax's
    exponentials and row sums, counted per element read or written as :class:`parsim.sim.compute.SmWork` counts
    them. ``parsim calibrate`` measures them (``compute.core_ns_per_element``); on a 2-core EPYC VM GeLU's
    backward took 4-5 times its bytes' time at the speed fitted on a mix of such kernels (2026-11-27)."""

    gelu: tuple[float, float]
    norm: tuple[float, float]
    softmax: tuple[float, float]

    def scaled(self, factor: float) -> "CoreArithmetic":
        """These figures on a core ``factor`` times as fast."""
        return CoreArithmetic(*(tuple(x / factor for x in getattr(self, kind)) for kind in CORE_ARITHMETIC_KINDS))

    def to_ns(self) -> dict[str, dict[str, float]]:
        """The ``compute.core_ns_per_element`` mapping: per kind, forward and backward in ns per element."""
        return {kind: dict(zip(("forward", "backward"), (x * 1e9 for x in getattr(self, kind))))
                for kind in CORE_ARITHMETIC_KINDS}


CORE_ARITHMETIC_KINDS = ("gelu", "norm", "softmax")
CORE_NS = (1e-6, 1e6, "ns per element")


@dataclass(frozen=True)
class ClusterSpec:
    """One node's hardware and the fabric between nodes, as read from a file."""

    name: str
    description: str
    gpus_per_node: int
    gpu: GPUSpec
    intra: IntraNodeSpec
    scale_out: ScaleOutSpec
    source: str = ""
    # Per-operation algorithm override, e.g. written by `parsim calibrate` for
    # backends whose algorithm is fixed (gloo).
    algorithms: dict[str, str] = field(default_factory=dict)
    # Bytes/s at which a rank reduces (sums) a received buffer into its own;
    # None means HBM-bound: read two operands, write one.
    reduce_bw_Bps: float | None = None
    # Per operation: the fraction of link bandwidth its implementation reaches
    # (fitted by `parsim calibrate`; absent means 1).
    collective_efficiency: dict[str, float] = field(default_factory=dict)
    # Per operation: a backend's fixed cost per call, seconds (fitted by `parsim calibrate`).
    collective_overhead_s: dict[str, float] = field(default_factory=dict)
    # CPU hosts: a collective whose buffer is at most this many bytes (a core's L2) moves its bytes
    # collective_cache_speedup[op] times as fast (the copies and sums stay in the cache; fitted by `parsim calibrate`).
    collective_cache_bytes: float = 0.0
    collective_cache_speedup: dict[str, float] = field(default_factory=dict)
    # Kernel cost model (see parsim.sim.compute); the defaults are the pure roofline.
    matmul_efficiency: float = 1.0  # best fraction of peak matmuls reach, every dtype without its own figure
    matmul_efficiency_by_dtype: dict[str, float] = field(default_factory=dict)
    matmul_half_dim: float = 0.0
    matmul_k_overhead: float = 0.0  # a GEMM tile's fixed cost, in elements of k: rate x k / (k + this)
    kernel_overhead_s: float = 0.0  # fixed cost of launching one kernel / dispatching one op
    memory_efficiency: float = 1.0  # fraction of the HBM bandwidth memory-bound kernels reach
    # The attention kernel's fraction of peak, forward and backward, each as (kernel sequence length,
    # fraction) points (parsim.sim.compute.at_length); one point (0, x): x at every length
    attention_efficiency: tuple[Curve, Curve] = (((0, 1.0),), ((0, 1.0),))
    sm_cycles: SmCycles = HOPPER_SM_CYCLES  # priced where the GPU's SM clock is known (gpu.sm_clock_MHz)
    nccl: NcclSpec | None = None  # NCCL's view of the node; None: collectives use the flow model alone
    price_per_gpu_hour: float | None = None  # US dollars to rent one GPU for an hour (the search's cost figures)

    # Per operation: the extra cost of a call issued between bursts of compute, as in a training step, over
    # one in a back-to-back loop (threads asleep, tail stalls, buffers no longer in the core's cache), in
    # seconds by the call's bytes in KiB (points as parsim.sim.compute.at_length reads them); only the step
    # simulator charges it (`parsim calibrate` measures it on CPU hosts).
    collective_step_overhead_s: dict[str, Curve] = field(default_factory=dict)
    # Eager-CPU host costs (parsim.sim.compute; written by `parsim calibrate`, absent on GPU clusters).
    op_forward_s: float = 0.0  # one op dispatched in a forward
    op_backward_s: float = 0.0  # one op autograd runs in a backward
    optimizer_tensor_s: float = 0.0  # AdamW's fixed cost per parameter tensor
    optimizer_step_s: float = 0.0  # and per step, whatever its tensors (foreach AdamW's calls and Python)
    matmul_stream_bw_Bps: float | None = None  # a matmul's weight streamed in addition to its arithmetic
    matmul_write_bw_Bps: float | None = None  # and its output streamed out (None: at matmul_stream_bw_Bps)
    # and its weight read from the last-level cache, and the share of it the cache holds by the bytes the rank
    # touched since it last read it, in KiB (both None: not measured, every weight read from memory)
    matmul_cached_stream_bw_Bps: float | None = None
    matmul_cache_hits: Curve | None = None
    # A CPU rank's pipeline transfer, in seconds by the gradients its receiver holds in KiB (as action_overhead): its
    # host time, charged to a receive posted late; and its latency when the receiver waits (None: the links').
    p2p_rendezvous: Curve = ((0, 0.0),)
    p2p_latency: Curve | None = None
    # host time a CPU rank's loop spends issuing one pipeline send, before its next action, by the gradients the rank
    # holds in KiB (as action_overhead)
    p2p_issue: Curve = ((0, 0.0),)
    # host time between a training step's actions (the loop's own Python), in seconds by the gradients a rank holds,
    # in KiB (points as :func:`parsim.sim.compute.at_length` reads them; one point at 0: the same for every rank)
    action_overhead: Curve = ((0, 0.0),)
    elementwise_bw_Bps: float | None = None  # memory-bound kernels' bytes (None: at the memory speed)
    core_arithmetic: CoreArithmetic | None = None  # a CPU core's time per element of GeLU, norms, softmax
    # host time of one tensor-parallel collective call in an eager pass beyond the collective, forward and backward
    # (None: eager_ops.TP_COLLECTIVE_OPS ops' worth)
    tp_call_s: tuple[float, float] | None = None
    # zero_grad(set_to_none=True) at a step's start: per step, per gradient tensor, and the bytes it frees per
    # second (None: not charged)
    zero_grad_step_s: float = 0.0
    zero_grad_tensor_s: float = 0.0
    zero_grad_free_Bps: float | None = None
    # FSDP2's own host work on a CPU rank (0: not charged): a unit's unshard and reshard around a pass that gathers
    # it, its post-backward beyond them (the reduce-scatter's), and an AdamW step's extra per DTensor parameter
    fsdp_unshard_s: float = 0.0
    fsdp_reduce_s: float = 0.0
    fsdp_optimizer_tensor_s: float = 0.0
    # and a unit's hooks in a forward and in a backward that gather and reduce nothing (a pipeline stage's passes
    # between its first and its last), FSDP2's pre- and post-hooks around a unit kept unsharded (0: not charged)
    fsdp_pass_s: tuple[float, float] = (0.0, 0.0)
    # a forward pass's and a backward pass's own host time, once per pass beyond its ops' (the first layer of a
    # pass runs colder than those after it), seconds (0: not charged)
    pass_s: tuple[float, float] = (0.0, 0.0)
    # A CPU host's memory, shared by its ranks' streaming work (None: each rank streams at gpu.hbm_bw_Bps, its
    # share with every rank streaming): one rank's speed while the others wait, and the host's with all streaming.
    memory_alone_bw_Bps: float | None = None
    memory_host_bw_Bps: float | None = None
    shared_cores: SharedCoreCosts | None = None  # the pipeline's host costs with two ranks on each core
    cpu_cores: int | None = None  # cores a CPU host's ranks share (more ranks than this time-share them)
    # executor.speed_probe while the compute figures were measured: its matmul's FLOP/s, its eager pass's seconds
    # and its AdamW steps' bytes per second (None: not timed; files calibrated before the memory probe have the first
    # two)
    speed_probe_flops: float | None = None
    speed_probe_eager_s: float | None = None
    speed_probe_memory_Bps: float | None = None
    # How far the work each probe stands for followed it while calibrating (parsim.calibrate.host.fit_probe_elasticity):
    # at a probe reading x times as fast, that work runs x ** this as fast (1: in step, files calibrated before)
    speed_probe_matmul_elasticity: float = 1.0
    speed_probe_eager_elasticity: float = 1.0
    speed_probe_memory_elasticity: float = 1.0
    # executor.speed_probe's collective probe while the collectives were measured: an all-reduce's seconds on two
    # ranks by its KiB (None: not timed); and the same probe around a run (at_collective_probe; None: as calibrated)
    collective_probe_s: Curve | None = None
    collective_probe_now_s: Curve | None = None
    # How much the same work's time varies between ranks that start it together: sigma over the time, a CPU host's
    # as `parsim calibrate` measures it (0: not measured; a GPU's is not modelled). parsim.sim.jitter.
    rank_jitter: float = 0.0

    def at_host_speed(self, arithmetic: float, eager: float, memory: float | None = None) -> "ClusterSpec":
        """This CPU host running ``arithmetic`` times as fast as when it was calibrated in arithmetic (matmul peak,
        a core's time per element), ``memory`` times as fast in its memory (a matmul's weight streamed in and its
        output out, memory speeds, elementwise speed; None: as its arithmetic, for files calibrated before the
        memory probe), and ``eager`` times as fast in its fixed costs (per op, per tensor-parallel call, per
        kernel, per optimizer tensor, freeing gradients, between actions).
        Collectives and pipeline transfers keep their own fits: gloo's calls were not measured to follow the
        probes (executor.speed_probe)."""
        memory = arithmetic if memory is None else memory
        if min(arithmetic, eager, memory) <= 0:
            raise ParsimError(f"host speed factors must be positive, got {arithmetic}, {eager} and {memory}")
        gpu = replace(self.gpu, peak_flops={d: f * arithmetic for d, f in self.gpu.peak_flops.items()},
                      hbm_bw_Bps=self.gpu.hbm_bw_Bps * memory)
        return replace(
            self, gpu=gpu,
            matmul_stream_bw_Bps=self.matmul_stream_bw_Bps and self.matmul_stream_bw_Bps * memory,
            matmul_write_bw_Bps=self.matmul_write_bw_Bps and self.matmul_write_bw_Bps * memory,
            matmul_cached_stream_bw_Bps=self.matmul_cached_stream_bw_Bps and self.matmul_cached_stream_bw_Bps * memory,
            elementwise_bw_Bps=self.elementwise_bw_Bps and self.elementwise_bw_Bps * memory,
            core_arithmetic=self.core_arithmetic and self.core_arithmetic.scaled(arithmetic),
            memory_alone_bw_Bps=self.memory_alone_bw_Bps and self.memory_alone_bw_Bps * memory,
            memory_host_bw_Bps=self.memory_host_bw_Bps and self.memory_host_bw_Bps * memory,
            op_forward_s=self.op_forward_s / eager, op_backward_s=self.op_backward_s / eager,
            tp_call_s=self.tp_call_s and tuple(s / eager for s in self.tp_call_s),
            zero_grad_step_s=self.zero_grad_step_s / eager, zero_grad_tensor_s=self.zero_grad_tensor_s / eager,
            zero_grad_free_Bps=self.zero_grad_free_Bps and self.zero_grad_free_Bps * eager,
            fsdp_unshard_s=self.fsdp_unshard_s / eager, fsdp_reduce_s=self.fsdp_reduce_s / eager,
            fsdp_optimizer_tensor_s=self.fsdp_optimizer_tensor_s / eager,
            fsdp_pass_s=(self.fsdp_pass_s[0] / eager, self.fsdp_pass_s[1] / eager),
            pass_s=(self.pass_s[0] / eager, self.pass_s[1] / eager),
            optimizer_tensor_s=self.optimizer_tensor_s / eager, optimizer_step_s=self.optimizer_step_s / eager,
            kernel_overhead_s=self.kernel_overhead_s / eager,
            action_overhead=tuple((kib, s / eager) for kib, s in self.action_overhead),
            p2p_issue=tuple((kib, s / eager) for kib, s in self.p2p_issue),
            shared_cores=self.shared_cores and replace(
                self.shared_cores, action_overhead_s=self.shared_cores.action_overhead_s / eager,
                p2p_issue_s=self.shared_cores.p2p_issue_s / eager),
            speed_probe_flops=self.speed_probe_flops and self.speed_probe_flops * arithmetic,
            speed_probe_eager_s=self.speed_probe_eager_s and self.speed_probe_eager_s / eager,
            speed_probe_memory_Bps=self.speed_probe_memory_Bps and self.speed_probe_memory_Bps * memory)

    def at_collective_probe(self, measured: Curve) -> "ClusterSpec":
        """This host with its collective probe reading ``measured`` ((KiB, seconds) points) instead of the
        calibration's: :meth:`collective_now_s` is what that makes of a collective."""
        if not measured or min(seconds for _, seconds in measured) <= 0:
            raise ParsimError(f"the collective probe's times must be positive, got {measured}")
        return replace(self, collective_probe_now_s=tuple(measured))

    def collective_now_s(self, seconds: float, op: str, nranks: int, nbytes: float) -> float:
        """A collective ``op`` of ``nbytes`` on ``nranks`` ranks that took ``seconds`` at calibration, as the
        collective probe around a run finds it (:func:`probed_s`: plus the probe's extra time per byte at its
        bus bytes); ``seconds`` without a probe read at both. A slow spell on a host adds time per byte moved,
        not a factor on a call: between bursts of compute on the 2-core VM, all-reduces took 158, 266, 504 and
        1750 us more in a spell at 256 KiB to 4 MiB, where the probe took 150, 280, 525 and 1422 more
        (docs/calibration.md, "Collectives' slow spells")."""
        if not self.collective_probe_s or not self.collective_probe_now_s:
            return seconds
        return probed_s(seconds, op, nranks, nbytes, self.collective_probe_s, self.collective_probe_now_s)

    def _own_matmul_efficiency(self, dtype: str) -> float | None:
        """The file's figure for ``dtype``; fp16 and bf16 run at the same rate, so each stands in for the other."""
        table = self.matmul_efficiency_by_dtype
        return table.get(dtype, table.get({"fp16": "bf16", "bf16": "fp16"}.get(dtype, "")))

    def matmul_efficiency_for(self, dtype: str) -> float:
        """The dtype's own figure, else the plain ``matmul_efficiency``."""
        own = self._own_matmul_efficiency(dtype)
        return self.matmul_efficiency if own is None else own

    def lacks_matmul_rate(self, dtype: str) -> bool:
        """Whether the file measures matmul rates per dtype (the GPU clusters) but not for ``dtype``'s, which
        then runs at the plain ``matmul_efficiency`` (1 unless given): an upper bound, not a measurement."""
        return bool(self.matmul_efficiency_by_dtype) and self._own_matmul_efficiency(dtype) is None

    @property
    def describes_cpu_host(self) -> bool:
        """Whether the file describes ranks on CPU cores (``parsim calibrate`` over gloo writes their eager
        host costs), not GPUs. A GPU's file may give eager host costs too (``calibrate --ranks 1`` writes
        them), beside the GPU's ``sm_count``."""
        return self.cpu_cores is not None or (self.op_forward_s > 0 and not self.gpu.sm_count)

    @property
    def overlaps_tp_comm(self) -> bool:
        """Whether tensor-parallel collectives can run beside the GEMMs (``tp_comm_overlap``): Transformer
        Engine's userbuffers need the GPUs joined by NVLink (examples/pytorch/comm_gemm_overlap/README.md);
        a CPU host's ranks (the executor's asynchronous collectives) always can."""
        return self.intra.fabric != "pcie" or self.cpu_cores is not None

    @property
    def reduction_bw_Bps(self) -> float:
        return self.reduce_bw_Bps if self.reduce_bw_Bps else self.gpu.hbm_bw_Bps / 3

    def nodes_for(self, nodes: int | None = None, gpus: int | None = None) -> int:
        """Node count from ``--nodes`` or ``--gpus`` (whole nodes; one node by default)."""
        if nodes is not None and gpus is not None:
            raise ParsimError("give either --nodes or --gpus, not both")
        if max(gpus or 0, (nodes or 0) * self.gpus_per_node) > MAX_GPUS:
            asked = (f"--gpus {gpus:,}" if gpus is not None
                     else f"--nodes {nodes:,} ({nodes * self.gpus_per_node:,} GPUs)")
            raise ParsimError(f"{asked} is more than parsim simulates (at most {MAX_GPUS:,} GPUs)")
        if gpus is not None:
            if gpus < 1:
                raise ParsimError(f"--gpus {gpus}: need at least one GPU")
            if gpus > self.gpus_per_node and gpus % self.gpus_per_node:
                raise ParsimError(
                    f"--gpus {gpus} does not fill whole nodes of {self.gpus_per_node} GPUs on {self.name}"
                )
            return max(1, gpus // self.gpus_per_node)
        nodes = 1 if nodes is None else nodes
        if nodes < 1:
            raise ParsimError(f"--nodes {nodes}: need at least one node")
        return nodes

    def build(self, nodes: int = 1):
        """The cluster placed on ``nodes`` nodes, as a routable topology."""
        from .topology import Topology

        return Topology(self, nodes)


# What torch.cuda.get_device_name() contains, and the built-in cluster of that GPU
CLUSTER_OF_GPU = (("H200", "dgx-h200"), ("H800", "hgx-h800"), ("H100", "dgx-h100"), ("A100", "dgx-a100"),
                  ("GB200", "gb200-nvl72"), ("B200", "dgx-b200"), ("RTX 6000 Ada", "pcie-4x-rtx6000ada"))


def builtin_for_gpu(device_name: str) -> str:
    """The built-in cluster whose GPU is ``device_name`` (as CUDA names it, e.g. "NVIDIA H100 80GB HBM3")."""
    for gpu, cluster in CLUSTER_OF_GPU:
        if gpu in device_name:
            return cluster
    raise ParsimError(f"no built-in cluster has a {device_name!r}: name one with --cluster")


def builtin_clusters() -> dict[str, Path]:
    """Built-in cluster names and their files."""
    folder = importlib.resources.files("topologies")
    return {Path(p.name).stem: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".yaml")}


def load_cluster(name_or_path: str | Path) -> ClusterSpec:
    """A built-in cluster by name (``dgx-h100``) or a user's YAML file by path."""
    text = str(name_or_path)
    builtins = builtin_clusters()
    if text in builtins:
        path = builtins[text]
    else:
        path = Path(text)
        if not path.exists():
            raise ParsimError(
                f"unknown cluster {text!r}: not a built-in ({', '.join(sorted(builtins))}) and no such file"
            )
    return parse_cluster(read_yaml(path), str(path))


def parse_cluster(data: object, source: str = "<cluster>") -> ClusterSpec:
    """Validate a cluster mapping and convert every figure to SI units."""
    r = _Reader(data, source)
    name, description, gpus_per_node = r.text("name"), r.text("description", optional=True), r.integer("gpus_per_node")
    gpu = r.section("gpu")
    intra = r.section("intra_node")
    out = r.section("scale_out")
    peak = gpu.section("peak_tflops")
    peak_flops = {}
    for dtype in peak.keys():
        if dtype not in DTYPES:
            raise ConfigError(source, f"gpu.peak_tflops.{dtype}", "unknown dtype", f"one of {', '.join(DTYPES)}")
        peak_flops[dtype] = peak.number(dtype, TFLOPS) * 1e12
    if not peak_flops:
        raise ConfigError(source, "gpu.peak_tflops", "no dtype given", "e.g. bf16: 989.4 (TFLOP/s)")
    fabric = intra.choice("fabric", FABRICS)
    reduce_bw = r.number("reduce_bw_GBps", BANDWIDTH_GBPS, optional=True)
    algorithms = r.optional_mapping("algorithms")
    efficiency = r.optional_mapping("collective_efficiency")
    for op, value in efficiency.items():
        _figure(source, f"collective_efficiency.{op}", value, EFFICIENCY)
    cache_kib = r.number("collective_cache_KiB", (1.0, 1e9, "KiB"), optional=True)
    cache_speedup = r.optional_mapping("collective_cache_speedup")
    for op, value in cache_speedup.items():
        _figure(source, f"collective_cache_speedup.{op}", value, SPEEDUP)
    if cache_speedup and not cache_kib:
        raise ConfigError(source, "collective_cache_speedup", "has no size to apply below",
                          "collective_cache_KiB beside it (a core's cache, e.g. 2048)")
    overhead = r.optional_mapping("collective_overhead_us")
    step_overhead = r.optional_mapping("collective_step_overhead_us")
    for op, value in overhead.items():
        _figure(source, f"collective_overhead_us.{op}", value, LATENCY_US)
    compute = r.optional_mapping("compute")
    matmul_efficiency = compute.get("matmul_efficiency", 1.0)
    half_dim = compute.get("matmul_half_dim", 0.0)
    kernel_us = compute.get("kernel_overhead_us", 0.0)
    unknown = set(compute) - set(COMPUTE_KEYS)
    if unknown:
        raise ConfigError(source, f"compute.{sorted(unknown)[0]}", "unknown key", ", ".join(COMPUTE_KEYS))
    _figure(source, "compute.kernel_overhead_us", kernel_us, LATENCY_US)
    by_dtype = {}
    if isinstance(matmul_efficiency, dict):  # per dtype: {bf16: 0.80, fp8: 0.71}
        for dtype, value in matmul_efficiency.items():
            if dtype not in DTYPES:
                raise ConfigError(source, f"compute.matmul_efficiency.{dtype}", "unknown dtype", ", ".join(DTYPES))
            by_dtype[dtype] = _fraction(source, f"compute.matmul_efficiency.{dtype}", value)
        matmul_efficiency = 1.0
    matmul_efficiency = _fraction(source, "compute.matmul_efficiency", matmul_efficiency)
    memory_efficiency = _fraction(source, "compute.memory_efficiency", compute.get("memory_efficiency", 1.0))
    attention = compute.get("attention_efficiency", {})
    if not isinstance(attention, dict) or set(attention) - {"forward", "backward"}:
        raise ConfigError(source, "compute.attention_efficiency", f"is {attention!r}",
                          "a mapping with forward and backward fractions")
    attention_efficiency = tuple(_curve(source, f"compute.attention_efficiency.{p}", attention.get(p, 1.0))
                                 for p in ("forward", "backward"))
    sm_cycles = _sm_cycles(source, compute.get("sm_cycles", {}))
    host_us = {}
    for key in ("op_forward_us", "op_backward_us", "optimizer_tensor_us", "optimizer_step_us",
                "zero_grad_step_us", "zero_grad_tensor_us",
                "fsdp_unshard_us", "fsdp_reduce_us", "fsdp_optimizer_tensor_us"):
        host_us[key] = _figure(source, f"compute.{key}", compute.get(key, 0.0), LATENCY_US)
    shared = _shared_cores(source, compute["shared_cores"]) if "shared_cores" in compute else None
    host_GBps = {}
    for key in ("matmul_stream_bw_GBps", "matmul_write_bw_GBps", "matmul_cached_stream_bw_GBps", "elementwise_bw_GBps",
                "memory_alone_bw_GBps", "memory_host_bw_GBps", "zero_grad_free_GBps"):
        value = compute.get(key)
        host_GBps[key] = None if value is None else _figure(source, f"compute.{key}", value, BANDWIDTH_GBPS)
    cache_hits = compute.get("matmul_cache_hits")
    if (cache_hits is None) != (host_GBps["matmul_cached_stream_bw_GBps"] is None):
        raise ConfigError(source, "compute.matmul_cache_hits", "given without compute.matmul_cached_stream_bw_GBps, "
                          "or the other way round", "both (parsim calibrate writes them together) or neither")
    if cache_hits is not None:
        cache_hits = _curve(source, "compute.matmul_cache_hits", cache_hits, CACHE_SHARE,
                            keyed_by="the bytes touched since the weight's last read, in KiB")
    if (host_GBps["memory_alone_bw_GBps"] is None) != (host_GBps["memory_host_bw_GBps"] is None):
        raise ConfigError(source, "compute.memory_alone_bw_GBps", "given without compute.memory_host_bw_GBps, or "
                          "the other way round", "both (parsim calibrate writes them together) or neither")
    cores = compute.get("cpu_cores")
    if cores is not None:
        _whole(source, "compute.cpu_cores", cores, 1, 2**16)
    probe_gflops, probe_us = compute.get("speed_probe_gflops"), compute.get("speed_probe_eager_us")
    if (probe_gflops is None) != (probe_us is None):
        raise ConfigError(source, "compute.speed_probe_gflops", "given without compute.speed_probe_eager_us, or "
                          "the other way round", "both (parsim calibrate writes them together) or neither")
    if probe_gflops is not None:
        probe_gflops = _figure(source, "compute.speed_probe_gflops", probe_gflops, GFLOPS)
        probe_us = _figure(source, "compute.speed_probe_eager_us", probe_us, PROBE_US)
    probe_memory = compute.get("speed_probe_memory_GBps")
    if probe_memory is not None:
        if probe_gflops is None:
            raise ConfigError(source, "compute.speed_probe_memory_GBps", "given without the other probes",
                              "compute.speed_probe_gflops and speed_probe_eager_us beside it (parsim calibrate "
                              "writes them together)")
        probe_memory = _figure(source, "compute.speed_probe_memory_GBps", probe_memory, BANDWIDTH_GBPS)
    elasticity = {}
    for probe, probe_key in PROBE_KEYS.items():
        key = f"speed_probe_{probe}_elasticity"
        if key in compute and compute.get(probe_key) is None:
            raise ConfigError(source, f"compute.{key}", f"given without the {probe} probe",
                              f"compute.{probe_key} beside it (parsim calibrate writes them together)")
        elasticity[key] = _figure(source, f"compute.{key}", compute.get(key, 1.0), ELASTICITY)
    _figure(source, "compute.matmul_half_dim", half_dim, MATRIX_DIM)
    k_overhead = _figure(source, "compute.matmul_k_overhead", compute.get("matmul_k_overhead", 0.0), MATRIX_DIM)
    sm_count = gpu.data.get("sm_count", 0)
    gpu.used.add("sm_count")
    _whole(source, "gpu.sm_count", sm_count, 0, 2**16)
    nccl = _parse_nccl(r.optional_mapping("nccl"), source) if "nccl" in r.data else None
    price = r.number("price_usd_per_gpu_hour", PRICE_USD_PER_GPU_HOUR, optional=True) or None
    spec = ClusterSpec(
        name=name,
        description=description,
        gpus_per_node=gpus_per_node,
        gpu=GPUSpec(
            model=gpu.text("model"),
            peak_flops=peak_flops,
            hbm_capacity_bytes=gpu.number("hbm_capacity_GB", CAPACITY_GB) * 1e9,
            hbm_bw_Bps=gpu.number("hbm_bw_GBps", BANDWIDTH_GBPS) * 1e9,
            sm_count=sm_count,
            sm_clock_Hz=gpu.number("sm_clock_MHz", CLOCK_MHZ, optional=True) * 1e6,
        ),
        intra=IntraNodeSpec(
            fabric=fabric,
            bw_Bps=intra.number("bw_GBps_per_direction", BANDWIDTH_GBPS) * 1e9,
            latency_s=intra.number("latency_us", LATENCY_US) * 1e-6,
            in_switch_reduction=intra.boolean("in_switch_reduction", default=False),
            fabric_bw_Bps=intra.number("fabric_bw_GBps", BANDWIDTH_GBPS, optional=True) * 1e9 or None,
        ),
        scale_out=ScaleOutSpec(
            nics_per_node=out.integer("nics_per_node"),
            nic_bw_Bps=out.number("nic_bw_Gbps", LINK_GBITS) * 1e9 / 8,
            latency_s=out.number("latency_us", LATENCY_US) * 1e-6,
            spine_hop_latency_s=out.number("spine_hop_latency_us", LATENCY_US) * 1e-6,
            nodes_per_leaf=out.integer("nodes_per_leaf"),
            oversubscription=out.number("oversubscription", OVERSUBSCRIPTION),
        ),
        source=source,
        algorithms={str(k): str(v) for k, v in algorithms.items()},
        reduce_bw_Bps=reduce_bw * 1e9 if reduce_bw else None,
        collective_efficiency={str(op): float(v) for op, v in efficiency.items()},
        collective_overhead_s={str(op): float(v) * 1e-6 for op, v in overhead.items()},
        collective_cache_bytes=cache_kib * 1024,
        collective_cache_speedup={str(op): float(v) for op, v in cache_speedup.items()},
        matmul_efficiency=matmul_efficiency,
        matmul_efficiency_by_dtype=by_dtype,
        matmul_half_dim=float(half_dim),
        matmul_k_overhead=k_overhead,
        kernel_overhead_s=float(kernel_us) * 1e-6,
        memory_efficiency=memory_efficiency,
        attention_efficiency=attention_efficiency,
        sm_cycles=sm_cycles,
        nccl=nccl,
        price_per_gpu_hour=price,
        collective_step_overhead_s={str(op): _by_size(source, f"collective_step_overhead_us.{op}", v)
                                    for op, v in step_overhead.items()},
        op_forward_s=float(host_us["op_forward_us"]) * 1e-6,
        op_backward_s=float(host_us["op_backward_us"]) * 1e-6,
        optimizer_tensor_s=float(host_us["optimizer_tensor_us"]) * 1e-6,
        optimizer_step_s=float(host_us["optimizer_step_us"]) * 1e-6,
        p2p_rendezvous=_by_gradients(source, "compute.p2p_rendezvous_us", compute.get("p2p_rendezvous_us", 0.0)),
        p2p_latency=_by_gradients(source, "compute.p2p_latency_us", compute["p2p_latency_us"])
        if compute.get("p2p_latency_us") is not None else None,
        action_overhead=_by_gradients(source, "compute.action_overhead_us", compute.get("action_overhead_us", 0.0)),
        p2p_issue=_by_gradients(source, "compute.p2p_issue_us", compute.get("p2p_issue_us", 0.0)),
        zero_grad_step_s=float(host_us["zero_grad_step_us"]) * 1e-6,
        zero_grad_tensor_s=float(host_us["zero_grad_tensor_us"]) * 1e-6,
        zero_grad_free_Bps=_GBps(host_GBps["zero_grad_free_GBps"]),
        fsdp_unshard_s=float(host_us["fsdp_unshard_us"]) * 1e-6,
        fsdp_reduce_s=float(host_us["fsdp_reduce_us"]) * 1e-6,
        fsdp_optimizer_tensor_s=float(host_us["fsdp_optimizer_tensor_us"]) * 1e-6,
        fsdp_pass_s=tuple(us * 1e-6 for us in _passes(source, "compute.fsdp_pass_us", compute["fsdp_pass_us"],
                                                      LATENCY_US)) if "fsdp_pass_us" in compute else (0.0, 0.0),
        pass_s=tuple(us * 1e-6 for us in _passes(source, "compute.pass_us", compute["pass_us"], LATENCY_US))
        if "pass_us" in compute else (0.0, 0.0),
        matmul_stream_bw_Bps=_GBps(host_GBps["matmul_stream_bw_GBps"]),
        matmul_write_bw_Bps=_GBps(host_GBps["matmul_write_bw_GBps"]),
        matmul_cached_stream_bw_Bps=_GBps(host_GBps["matmul_cached_stream_bw_GBps"]),
        matmul_cache_hits=cache_hits,
        elementwise_bw_Bps=_GBps(host_GBps["elementwise_bw_GBps"]),
        core_arithmetic=_core_arithmetic(source, compute["core_ns_per_element"]) if "core_ns_per_element" in compute
        else None,
        tp_call_s=tuple(us * 1e-6 for us in _passes(source, "compute.tp_collective_call_us",
                                                    compute["tp_collective_call_us"], LATENCY_US))
        if "tp_collective_call_us" in compute else None,
        memory_alone_bw_Bps=_GBps(host_GBps["memory_alone_bw_GBps"]),
        memory_host_bw_Bps=_GBps(host_GBps["memory_host_bw_GBps"]),
        shared_cores=shared,
        cpu_cores=cores,
        speed_probe_flops=probe_gflops and probe_gflops * 1e9,
        speed_probe_eager_s=probe_us and probe_us * 1e-6,
        speed_probe_memory_Bps=_GBps(probe_memory),
        **elasticity,
        collective_probe_s=_probe_curve(source, compute["collective_probe_us"]) if "collective_probe_us" in compute
        else None,
        rank_jitter=_figure(source, "compute.rank_jitter", compute.get("rank_jitter", 0.0), JITTER),
    )
    for reader in (r, gpu, intra, out):
        reader.reject_unknown()
    if spec.intra.in_switch_reduction and spec.intra.fabric != "nvswitch":
        raise ConfigError(source, "intra_node.in_switch_reduction", "needs fabric: nvswitch")
    return spec


def _probe_curve(source: str, value: object) -> Curve:
    """``compute.collective_probe_us``: microseconds keyed by KiB (the probe's sizes), as (KiB, seconds) points."""
    key = "compute.collective_probe_us"
    if not isinstance(value, dict):
        raise ConfigError(source, key, f"is {value!r}", "microseconds keyed by the all-reduce's KiB, e.g. "
                          "{256: 250, 1024: 400, 4096: 1600} (parsim calibrate writes it)")
    return tuple((kib, us * 1e-6) for kib, us in _curve(source, key, value, PROBE_US, keyed_by="KiB"))


def probed_s(seconds: float, op: str, nranks: int, nbytes: float, then: Curve, now: Curve) -> float:
    """A collective that took ``seconds`` while the collective probe read ``then``, as it takes when the probe
    reads ``now``: plus what its bus bytes (nccl-tests') take more (:func:`probe_extra_s`), at least
    :data:`FASTEST_AFTER_PROBE` of ``seconds``."""
    from ..report.results import busbw_factor  # report imports this module

    extra_s = probe_extra_s(then, now, busbw_factor(op, nranks) * nbytes)
    return max(seconds + extra_s, FASTEST_AFTER_PROBE * seconds)


def probe_extra_s(then: Curve, now: Curve, bus_bytes: float) -> float:
    """What ``bus_bytes`` per rank take more when the collective probe reads ``now`` than when it read ``then``
    ((KiB, seconds) points): the probe's extra time per byte at that size, read between its sizes linear in
    log2 of the size and the end sizes' beyond, times the bytes."""
    from ..sim.compute import at_length  # sim.compute imports this module

    later = dict(now)
    per_byte = tuple((kib, (later[kib] - s) / (kib * 1024)) for kib, s in sorted(then) if kib in later)
    return at_length(per_byte, math.ceil(bus_bytes / 1024)) * bus_bytes if per_byte and bus_bytes > 0 else 0.0


def _by_gradients(source: str, key: str, value: object) -> Curve:
    """A host cost in microseconds, one figure or figures keyed by the gradients a rank holds in KiB, as seconds."""
    return _us_by_kib(source, key, value, "the gradients a rank holds, in KiB")


def _by_size(source: str, key: str, value: object) -> Curve:
    """A collective's cost in microseconds, one figure or figures keyed by the call's bytes in KiB, as seconds."""
    return _us_by_kib(source, key, value, "the call's bytes, in KiB")


def _us_by_kib(source: str, key: str, value: object, keyed_by: str) -> Curve:
    return tuple((kib, us * 1e-6) for kib, us in _curve(source, key, value, LATENCY_US, keyed_by=keyed_by))


def _GBps(value: float | None) -> float | None:
    return float(value) * 1e9 if value is not None else None


def _fraction(source: str, key: str, value: object) -> float:
    return _figure(source, key, value, FRACTION)


def _curve(source: str, key: str, value: object, limits: tuple[float, float, str] = FRACTION,
           keyed_by: str = "sequence lengths (whole numbers of tokens)") -> Curve:
    """A figure, or figures by sequence length (``{2048: 0.53, 8192: 0.61}``; or by what ``keyed_by`` says), as
    sorted points."""
    if not isinstance(value, dict):
        return ((0, _figure(source, key, value, limits)),)
    if not value or not all(isinstance(k, int) and not isinstance(k, bool) and k > 0 for k in value):
        raise ConfigError(source, key, f"is {value!r}", f"{limits[2]}: one figure, or figures keyed by {keyed_by}")
    return tuple((k, _figure(source, f"{key}.{k}", value[k], limits)) for k in sorted(value))


def _shared_cores(source: str, value: object) -> SharedCoreCosts:
    """``compute.shared_cores``: every one of SHARED_CORE_KEYS, and any of SHARED_CORE_OPTIONAL, in microseconds,
    any of SHARED_CORE_STRETCHES, and any of SHARED_CORE_BANDWIDTHS, in GB/s."""
    optional = set(SHARED_CORE_OPTIONAL) | set(SHARED_CORE_STRETCHES) | set(SHARED_CORE_BANDWIDTHS)
    if (not isinstance(value, dict) or not set(SHARED_CORE_KEYS) <= set(value)
            or set(value) - set(SHARED_CORE_KEYS) - optional):
        raise ConfigError(source, "compute.shared_cores", f"is {value!r}",
                          f"a mapping of {', '.join(SHARED_CORE_KEYS)} (and optionally "
                          f"{', '.join(SHARED_CORE_OPTIONAL + SHARED_CORE_STRETCHES + SHARED_CORE_BANDWIDTHS)})")
    times = {f"{key[:-3]}_s": _figure(source, f"compute.shared_cores.{key}", figure, LATENCY_US) * 1e-6
             for key, figure in value.items() if key.endswith("_us")}
    stretches = {key: _figure(source, f"compute.shared_cores.{key}", value[key], STRETCH)
                 for key in SHARED_CORE_STRETCHES if key in value}
    speeds = {f"{key[:-5]}_bw_Bps": _figure(source, f"compute.shared_cores.{key}", value[key], BANDWIDTH_GBPS) * 1e9
              for key in SHARED_CORE_BANDWIDTHS if key in value}
    return SharedCoreCosts(**times, **stretches, **speeds)


def _sm_cycles(source: str, value: object) -> SmCycles:
    """``compute.sm_cycles``: any of softmax (by row length), dropout, gelu and norm ({forward, backward}),
    bias_add and adamw; the others are Hopper's (HOPPER_SM_CYCLES)."""
    key, default = "compute.sm_cycles", HOPPER_SM_CYCLES
    if not isinstance(value, dict) or set(value) - {"softmax", "dropout", "gelu", "norm", "bias_add", "adamw"}:
        raise ConfigError(source, key, f"is {value!r}",
                          "a mapping of softmax, dropout, gelu, norm, bias_add and adamw")

    def passes(kind: str, fallback: tuple[float, float]) -> tuple[float, float]:
        given = value.get(kind)
        return fallback if given is None else _passes(source, f"{key}.{kind}", given, SM_CYCLES)

    softmax = _curve(source, f"{key}.softmax", value["softmax"], SM_CYCLES) if "softmax" in value else default.softmax
    dropout, bias_add, adamw = (_figure(source, f"{key}.{kind}", value[kind], SM_CYCLES) if kind in value
                                else getattr(default, kind) for kind in ("dropout", "bias_add", "adamw"))
    return SmCycles(softmax, dropout, gelu=passes("gelu", default.gelu), norm=passes("norm", default.norm),
                    bias_add=bias_add, adamw=adamw)


def _core_arithmetic(source: str, value: object) -> CoreArithmetic:
    """``compute.core_ns_per_element``: gelu, norm and softmax, each {forward, backward} in ns per element."""
    key = "compute.core_ns_per_element"
    if not isinstance(value, dict) or set(value) != set(CORE_ARITHMETIC_KINDS):
        raise ConfigError(source, key, f"is {value!r}", f"a mapping of {', '.join(CORE_ARITHMETIC_KINDS)}")
    return CoreArithmetic(**{kind: tuple(ns * 1e-9 for ns in _passes(source, f"{key}.{kind}", given, CORE_NS))
                             for kind, given in value.items()})


def _passes(source: str, key: str, given: object, limits: tuple[float, float, str]) -> tuple[float, float]:
    """A ``{forward, backward}`` mapping of figures within ``limits``, as (forward, backward)."""
    if not isinstance(given, dict) or set(given) != {"forward", "backward"}:
        raise ConfigError(source, key, f"is {given!r}", "a mapping of forward and backward")
    return _figure(source, f"{key}.forward", given["forward"], limits), \
        _figure(source, f"{key}.backward", given["backward"], limits)


def _figure(source: str, key: str, value: object, limits: tuple[float, float, str]) -> float:
    """``value`` as a float when it is a finite number within ``limits`` (low, high, unit)."""
    low, high, unit = limits
    if not _is_number(value):
        raise ConfigError(source, key, f"is {value!r}", f"a finite number in {unit}")
    if not low <= value <= high:
        raise ConfigError(source, key, f"is {value!r}", f"{low:g} to {high:g} {unit}")
    return float(value)


def _whole(source: str, key: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(source, key, f"is {value!r}", f"a whole number from {low} to {high:,}")
    return value


CPU_VENDORS = ("intel", "amd", "arm")
NCCL_KEYS = ("compute_capability", "nvlinks_per_gpu", "pcie_gen", "pcie_lanes", "cpu_vendor", "collnet")


def _parse_nccl(data: dict, source: str) -> NcclSpec:
    """The optional ``nccl:`` section (see :class:`NcclSpec`)."""
    unknown = sorted(set(data) - set(NCCL_KEYS))
    if unknown:
        raise ConfigError(source, f"nccl.{unknown[0]}", "unknown key", ", ".join(NCCL_KEYS))
    cc = data.get("compute_capability")
    if isinstance(cc, bool) or not isinstance(cc, int) or not 60 <= cc < 200:
        raise ConfigError(source, "nccl.compute_capability", f"is {cc!r}", "an SM number such as 80, 90 or 100")
    for key, low, high in (("nvlinks_per_gpu", 0, 64), ("pcie_gen", 1, 6), ("pcie_lanes", 1, 32)):
        value = data.get(key, getattr(NcclSpec, key))
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ConfigError(source, f"nccl.{key}", f"is {value!r}", f"a whole number from {low} to {high}")
    vendor = data.get("cpu_vendor", NcclSpec.cpu_vendor)
    if vendor not in CPU_VENDORS:
        raise ConfigError(source, "nccl.cpu_vendor", f"is {vendor!r}", f"one of {', '.join(CPU_VENDORS)}")
    collnet = data.get("collnet", False)
    if not isinstance(collnet, bool):
        raise ConfigError(source, "nccl.collnet", f"is {collnet!r}", "true or false")
    return NcclSpec(compute_capability=cc, nvlinks_per_gpu=data.get("nvlinks_per_gpu", 0),
                    pcie_gen=data.get("pcie_gen", NcclSpec.pcie_gen), pcie_lanes=data.get("pcie_lanes", 16),
                    cpu_vendor=vendor, collnet=collnet)


def _is_number(value: object) -> bool:
    """A real, finite number (YAML's .nan and .inf are not figures of any hardware)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


class _Reader:
    """Typed access to one mapping of a config file, remembering which keys were read."""

    def __init__(self, data: object, source: str, prefix: str = ""):
        self.source, self.prefix = source, prefix
        if not isinstance(data, dict):
            raise ConfigError(source, prefix.rstrip(".") or "(file)", f"is {type(data).__name__}", "a mapping of keys")
        self.data, self.used = data, set()

    def keys(self) -> list[str]:
        self.used.update(self.data)
        return list(self.data)

    def _get(self, key: str, optional: bool = False):
        self.used.add(key)
        if key not in self.data:
            if optional:
                return None
            raise ConfigError(self.source, self.prefix + key, "missing")
        return self.data[key]

    def section(self, key: str) -> "_Reader":
        return _Reader(self._get(key), self.source, f"{self.prefix}{key}.")

    def optional_mapping(self, key: str) -> dict:
        value = self._get(key, optional=True)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(self.source, self.prefix + key, f"is {value!r}", "a mapping")
        return value

    def text(self, key: str, optional: bool = False) -> str:
        value = self._get(key, optional)
        if value is None:
            return ""
        if not isinstance(value, str):
            raise ConfigError(self.source, self.prefix + key, f"is {value!r}", "a string")
        return value

    def number(self, key: str, limits: tuple[float, float, str], optional: bool = False) -> float:
        value = self._get(key, optional)
        if value is None:
            return 0.0
        return _figure(self.source, self.prefix + key, value, limits)

    def integer(self, key: str) -> int:
        return _whole(self.source, self.prefix + key, self._get(key), 1, COUNTS[key])

    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key, optional=True)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ConfigError(self.source, self.prefix + key, f"is {value!r}", "true or false")
        return value

    def choice(self, key: str, options: tuple[str, ...]) -> str:
        value = self._get(key)
        if value not in options:
            raise ConfigError(self.source, self.prefix + key, f"is {value!r}", f"one of {', '.join(options)}")
        return value

    def reject_unknown(self) -> None:
        unknown = sorted(set(self.data) - self.used)
        if unknown:
            raise ConfigError(self.source, self.prefix + unknown[0], "unknown key",
                              expected_keys(str(unknown[0]), sorted(self.used)))
