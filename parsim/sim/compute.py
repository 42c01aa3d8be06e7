"""Kernel cost model: how long one block's compute takes on one GPU (or CPU rank).

Four kinds of work, each at the rate such kernels reach on the hardware:

* **Matmuls** ``(m, n, k)`` do ``2mnk`` FLOPs and touch ``(mk + kn + mn)``
  elements; they take the longer of the two times. The FLOP rate is
  ``peak x matmul_efficiency x waves(m, n) x shape(m, n, k)``:
  ``matmul_efficiency`` is the best fraction of peak cuBLAS reaches at any
  shape (the "maximum achievable matmul FLOPS", measured per GPU);
  ``waves`` is tile and wave quantization (NVIDIA, "Matrix Multiplication
  Background User's Guide", sections 3.1-3.2): the output splits into
  128 x 128 tiles, one per SM at a time; edge tiles cost whole tiles and a
  last, partly filled wave of tiles costs a whole wave;
  ``shape`` is ``prod(d / (d + half_dim))``, a smooth penalty for thin shapes
  that ``parsim calibrate`` fits on CPUs (``half_dim`` 0 for GPUs), times
  ``k / (k + k_overhead)`` on GPUs: each output tile pays a fixed cost (its
  pipeline's fill, its epilogue) worth ``k_overhead`` elements of its
  reduction, so a GEMM with a short ``k`` runs further below the best
  shape's rate (192 on Hopper, fitted on two GPUs' sweeps of a training
  step's bf16 shapes). The cost is a time: an fp8 GEMM, whose steps along
  ``k`` run twice as fast, pays it as twice as many elements
  (:meth:`ComputeModel.matmul_rate`).
* **The attention core** (FlashAttention): its FLOPs at the fraction of peak
  the kernel reaches, forward and backward separately.
* **Memory-bound kernels** (norms, activations, residuals, softmax, the
  optimizer): bytes over the HBM bandwidth such kernels measure
  (``memory_efficiency`` of the spec sheet's figure); other FLOPs at peak.
  Some do enough arithmetic per element (a softmax's exponentials and row
  reductions, dropout's random numbers, GeLU's erf, a norm's reductions) that
  the SMs, not the memory, bound them: each takes the longer of its bytes and
  its SM cycles over ``sm_count x sm_clock`` (cycles per element measured on
  Hopper, :data:`parsim.hardware.cluster.HOPPER_SM_CYCLES`, or on the GPU at hand by
  ``parsim calibrate --ranks 1``).
* **A fixed cost per kernel**, ``kernel_overhead_s``: launch (GPU) or
  dispatch (eager CPU). It dominates small models.

The defaults (every efficiency 1, no tiles, no overhead) are the pure
roofline, an optimistic bound; built-in clusters give sourced figures and
``parsim calibrate`` measured ones.

Host costs of eager PyTorch (all 0 / None by default; ``parsim calibrate``
measures them on a CPU host, ``parsim calibrate --ranks 1`` the first two on a
GPU host):

* ``op_forward_s`` / ``op_backward_s``: the fixed cost of one op dispatched in
  a forward (Python, the dispatcher, autograd's graph recording, allocation)
  and of one op autograd runs in a backward; the lowering counts the ops of
  the eager reference implementation per block (``forward_ops``,
  ``backward_ops``, see :mod:`parsim.lowering.eager_ops`). On a CPU rank the host *is*
  the device, so these add to the block's compute. A GPU runs its stream
  while the host issues the next kernels (``host_overlaps_device``): a block
  takes the longer of the two, its kernels' time or the host's time to issue
  them. Big models' kernels outlast the host (their steps do not change);
  small models wait on the host ("launch-bound").
* ``pass_s``: (forward, backward) host time of one pass beyond its ops', once
  per schedule action (``pass_starts``, on the pass's first block). A pass's
  first layer runs colder than the identical layers after it: timed in turns
  behind 32 MiB of written memory on the 2-core AMD VM (2026-12-01), stacks
  of 1, 2, 4 and 8 eager decoder layers took a fixed 0.4-0.95 ms forward and
  0.15-0.43 ms backward beyond their per-layer time. A per-op cost fitted on
  deep stacks alone spreads that over every op, which prices a pass of one or
  two layers short.
* ``tp_call_s``: (forward, backward) host time of one tensor-parallel
  collective call (an expert all-to-all counts as one) in an eager pass
  beyond the collective itself: the wrapping
  module, its autograd function, the output buffer, the regrouping views and
  the executor's recorder. Unmeasured (None), a call costs
  :data:`parsim.lowering.eager_ops.TP_COLLECTIVE_OPS` ops. On the 2-core VM a call right
  after a layer's matmul took 100-140 us forward and 60-80 us backward, where
  three ops are 10 us.
* ``zero_grad_step_s``, ``zero_grad_tensor_s``, ``zero_grad_free_Bps``: what
  ``optimizer.zero_grad(set_to_none=True)`` costs at a step's start, per step,
  per gradient tensor and by the bytes it frees (freeing hands the pages
  back: on the 2-core VM 16 MiB of gradients took 101-112 us). The step
  simulator charges it before each rank's first action, where the trace
  shows it as idle.
* ``fsdp_unshard_s``, ``fsdp_reduce_s``, ``fsdp_optimizer_tensor_s``,
  ``fsdp_pass_s``: FSDP2's
  own host work (``fsdp_calls``, ``fsdp_passes``): its hooks unsharding and resharding a unit
  around a pass that gathers it, its post-backward beyond that (the
  reduce-scatter's copy-in and resharding), an AdamW step's extra per
  DTensor parameter, and its hooks around a unit in a forward and a backward
  that gather and reduce nothing (a pipeline stage's passes between its
  first and its last keep the weights gathered and the gradients unsynced).
  On the 2-core VM (2026-11-28) a unit of two small linears added 428-512 us
  to a forward and 601-708 us to a backward, an AdamW step 260-340 us per
  parameter (``benchmarks/cpu_fsdp_overhead.py``), and 120-197 us to a
  forward and 104-131 us to a backward that moved nothing.
* ``optimizer_tensor_s``, ``optimizer_step_s``: AdamW's fixed costs per
  parameter tensor (torch's foreach ops loop over the tensors on a CPU) and per
  step (the dozen foreach calls of torch's ``_multi_tensor_adamw``, its
  grouping and Python, whatever the tensors), on top of its bytes at the
  memory speed.
* ``matmul_stream_bw_Bps``: a CPU core does not hide streaming a matmul's
  second operand ``w[k, n]`` (a layer's weight in the forward and the
  input-gradient matmul) in from memory, nor its output ``[m, n]`` out to
  memory of its own (a step keeps its activations and gradients: a weight
  gradient's output is as large as the weight), behind its arithmetic; when
  set, a matmul costs its FLOPs at the shape's rate *plus* its ``k n``
  weight elements at this speed and its ``m n`` output elements at
  ``matmul_write_bw_Bps`` (this speed where not set), instead of the
  roofline's maximum of compute and all bytes. A core writes a new output
  sequentially faster than a thin matmul reads its weight (on the 2-core AMD
  VM 2.8x in two runs of the matmul benchmark, 1.2-1.8x in three
  calibrations; :func:`parsim.calibrate.host.fit_matmul`).
* ``matmul_cached_stream_bw_Bps`` and ``matmul_cache_hits``: that weight read
  from the rank's share of the last-level cache, and how much of it is still
  there by the bytes the rank touched since it last read it (its reuse
  distance: ``Op.weights_reuse_bytes``, which the lowering follows on a CPU
  host): GPipe's later microbatches through a stage find the weights the first
  left, a forward after AdamW finds them in memory. On the 2-core Intel VM
  (2026-12-02, two ranks, a core each) a 32 x 1024 x 1024 matmul took
  0.61-0.67 ms cycling over 4-16 MiB of weights, 0.76-0.91 over 32 MiB and
  1.12-1.14 ms over 128-256 MiB (``parsim calibrate`` measures the curve:
  ``executor.compute_bench.measure_cache_hits``).
* ``elementwise_bw_Bps``: the speed of a block's memory-bound kernels'
  bytes (products, sums, copies: ``parsim calibrate`` times a chain of them),
  apart from the plain streams of gradient accumulation and the optimizer
  (the ``stream_bytes`` part of an op's ``hbm_bytes``), which run at the
  memory's speed.
* ``core_arithmetic``: a CPU core's seconds per element of GeLU, norms and
  softmax, forward and backward, whose arithmetic outlasts their bytes
  (GeLU's erf, softmax's exp): each takes the longer of the two, as a GPU's
  kernels take the longer of their bytes and their SM cycles. Eager SiLU's
  exp is priced by its bytes alone (on the 2-core VM it took 0.7 of GeLU's
  time forward, 0.5 backward).
* ``memory_alone_bw_Bps`` / ``memory_host_bw_Bps``: a CPU host's cores share
  its memory bandwidth. One core streaming alone (an AdamW step while the
  other ranks wait) gets more than its share with every core streaming (on the
  2-core VM, 44-53 GB/s against 34-38 GB/s each). When both are set (``parsim
  calibrate`` measures them), the step simulator times each op's
  ``stream_bytes`` as a flow on the host's memory: capped at one rank's speed
  alone, the host's total shared max-min fair with the ranks streaming at that
  moment (:meth:`time` leaves them out with ``stream_apart``). Without them, a
  rank streams at ``hbm_bw_Bps``, its share when all stream at once.
* ``time_share``: a CPU host running more ranks than it has cores
  (``compute.cpu_cores`` in the cluster file) time-shares them: while every
  rank computes, each gets ``cores / ranks`` of a core, so compute and host
  costs stretch by ``ranks / cores`` (a rank waiting in gloo sleeps and frees
  its core, which this static factor does not see). The pipeline's host costs
  (a transfer's latency and rendezvous, the loop between actions) grow far
  more: a thread woken on a core where another rank computes waits for the
  scheduler. Where ``parsim calibrate`` measured them with two ranks on each
  core (``shared_cores``), :meth:`time_shared` takes those figures instead;
  so does compute, where it measured how much longer a matmul and an eager
  pass take with two ranks on their core (more than twice: each rank's slice
  starts in caches the other emptied). The step simulator uses these
  stretches as they stand only beyond ``parsim.sim.step.MAX_RANKS_IN_TURNS``
  ranks; below, it runs every rank with its core to itself
  (:meth:`with_core_each`) and lets the ranks on one core take turns
  (:mod:`parsim.sim.cores`), slowed by them only while another rank waits.
* ``action_overhead``: on CPU ranks, the training loop's own host time
  before each action of a step (a pass of one microbatch, before its receive
  and again between the receive and the pass; a gradient all-reduce the loop
  issues in turn; the optimizer step): the
  runtime's Python between one action and the next, which runs cold after
  work that streams megabytes (``parsim calibrate`` times it in a generic
  data-parallel step: 100-120 us on the 2-core AMD VM, where a loop over
  stages of small eager ops gave 46). It grows with the memory a step
  streams, which evicts the interpreter's code and data: in that step with
  layers 512, 768, 1024 and 1536 wide (4, 9, 16 and 36 MiB of gradients a
  rank) it took 22-30, 45-68, 81-89 and 87-94 us on the 2-core VM
  (2026-11-29), so ``calibrate`` times it at several sizes and a rank's is
  read off them at the gradients it holds (linear in their log, the ends'
  figures beyond them). ``p2p_issue``: the loop's time
  issuing each pipeline send (``isend``, handing it to the thread that waits
  for it), which delays the rank's next action; it too grows after passes
  that stream their weights (0.39-0.47 ms between a pipeline's generic MLP
  passes on that VM, 0.23-0.35 between small eager ops; on the 2-core VM
  107-111 us with stages of 128 and 512 KiB of weights, 212-251 us with 4.5
  MiB, a typical send's), and is read off the same way. The step simulator
  starts each action's first op ``action_overhead`` plus ``p2p_issue``
  per send issued since the last action after it could, so it shows as idle
  time, as measured. (Files calibrated before the issue was measured apart
  hold it in ``action_overhead``, spread over every action.)
* ``p2p_rendezvous``: the host time of one pipeline transfer on CPU ranks
  whose receive is posted late (gloo moves a message only once the receiver
  has asked for it, and the sender's gloo thread, woken on a core where its
  rank computes, may wait for the scheduler: on the 2-core VM most such
  receives took 0.1 ms and about one in ten 2-5 ms): the step simulator ends
  such a receive this long after it begins, a typical transfer's (the median
  over the calibration loop's, stalls left out). A receiver that waits has
  its data after the send's latency (``p2p_latency``,
  ``compute.p2p_latency_us`` in the cluster file, which the step simulator's
  sends take). Both grow with the weights the stages' passes stream, as the
  loop's own time does (on the 2-core VM, 2026-11-29: a late receive 82-90 us
  with stages of 128 and 512 KiB of weights, 108-118 us with 2 MiB, 105-292
  us with 4.5 MiB; a waiting one 89-100, 116-124 and 140-175 us), so they are
  read off the gradients the receiver holds, as ``action_overhead`` is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..errors import ParsimError
from ..hardware.cluster import HOPPER_SM_CYCLES, ClusterSpec, CoreArithmetic, Curve, SharedCoreCosts, SmCycles
from ..lowering.eager_ops import TP_COLLECTIVE_OPS

MATMUL_TILE = 128  # cuBLAS/CUTLASS's common 128 x 128 output tile per thread block (SM80/SM90)


def at_length(curve: Curve, seq: int) -> float:
    """A kernel's figure at sequence length ``seq`` from (length, figure) points: linear in log2(length)
    between them (FlashAttention's rate climbs by about the same step per doubling, a softmax's cost per
    score too), the end points' values beyond them; ``seq`` 0 (not known) takes the longest length's."""
    if seq <= 0 or seq >= curve[-1][0]:
        return curve[-1][1]
    if seq <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if seq <= x1:
            return y0 + (y1 - y0) * math.log2(seq / x0) / math.log2(x1 / x0)
    raise AssertionError("unreachable: seq is below the last point")


def at_gradients(curve: Curve, gradient_bytes: float) -> float:
    """A host cost at a rank's gradients from (KiB, figure) points, read as :func:`at_length` reads lengths."""
    return at_length(curve, math.ceil(gradient_bytes / 1024))


@dataclass(frozen=True)
class SmWork:
    """The arithmetic of a memory-bound kernel that may outlast its bytes (:meth:`ComputeModel.sm_excess`):
    ``elements`` read or written by a ``kind`` kernel ("softmax", forward, over rows of ``row`` entries;
    "gelu"; "norm"; "bias_add", a bias added in its own kernel), in a forward or a ``backward``, or drawn
    ("dropout": one random number per mask element)."""

    kind: str
    elements: float
    backward: bool = False
    row: int = 0


@dataclass(frozen=True)
class ComputeModel:
    peak_flops: float  # FLOP/s for the plan's dtype
    hbm_bw_Bps: float
    dtype_bytes: int
    efficiency: float = 1.0  # matmuls' best fraction of peak
    half_dim: float = 0.0
    # a tile's fixed cost in elements of k at peak_flops' rate (matmul_rate): the cluster file's k0, a time of k0
    # steps at the bf16 rate, in steps of peak_flops' dtype (13 for fp32 on an H100: 192 x 67 / 989.5)
    k_overhead: float = 0.0
    kernel_overhead_s: float = 0.0
    matmul_peak_flops: float | None = None  # matmuls' own peak when they run in another dtype (fp8)
    # fp8 plans: the efficiency of the matmuls kept in the plan's other dtype (bf16), which run at peak_flops
    other_efficiency: float | None = None
    sm_count: int = 0  # 0: no wave quantization (CPUs)
    memory_efficiency: float = 1.0
    attention_efficiency: tuple[float, float] = (1.0, 1.0)  # forward, backward
    # Eager-CPU host costs (see the module docstring); the defaults leave every GPU prediction unchanged.
    op_forward_s: float = 0.0
    op_backward_s: float = 0.0
    tp_call_s: tuple[float, float] | None = None  # one tensor-parallel call's host time, forward and backward
    zero_grad_step_s: float = 0.0  # zero_grad(set_to_none=True) at a step's start: per step,
    zero_grad_tensor_s: float = 0.0  # per gradient tensor,
    zero_grad_free_Bps: float | None = None  # and the bytes it frees per second (None: not charged)
    fsdp_unshard_s: float = 0.0  # FSDP2's host work: a unit unsharded and resharded around a pass,
    fsdp_reduce_s: float = 0.0  # its post-backward beyond that,
    fsdp_optimizer_tensor_s: float = 0.0  # an AdamW step's extra per DTensor parameter,
    fsdp_pass_s: tuple[float, float] = (0.0, 0.0)  # and a unit's hooks in a pass that moves nothing: fwd, bwd
    pass_s: tuple[float, float] = (0.0, 0.0)  # a forward's and a backward's own host time, once per pass
    optimizer_tensor_s: float = 0.0
    optimizer_step_s: float = 0.0
    matmul_stream_bw_Bps: float | None = None
    matmul_write_bw_Bps: float | None = None  # a matmul's output streamed out (None: at matmul_stream_bw_Bps)
    matmul_cached_stream_bw_Bps: float | None = None  # its weight read from the cache
    # the share of the weight the cache holds, by the bytes touched since its last read in KiB (None: none)
    matmul_cache_hits: Curve | None = None
    # a pipeline transfer's host time, charged to a late receive (parsim.sim.stepsim), and its latency with the
    # receiver waiting (None: the links'), by the receiver's gradients in KiB
    p2p_rendezvous: Curve = ((0, 0.0),)
    p2p_latency: Curve | None = None
    shared_cores: SharedCoreCosts | None = None  # the pipeline's host costs with two ranks on each core
    # host time before each action of a step, in seconds by the rank's gradients in KiB (see the docstring)
    action_overhead: Curve = ((0, 0.0),)
    p2p_issue: Curve = ((0, 0.0),)  # host time issuing one pipeline send, before the next action (by gradients, KiB)
    elementwise_bw_Bps: float | None = None  # a block's memory-bound bytes (None: at memory_bw_Bps)
    memory_alone_bw_Bps: float | None = None  # one CPU rank streaming while the host's others wait (see above)
    memory_host_bw_Bps: float | None = None  # the CPU host's memory speed, all ranks streaming
    time_share: float = 1.0  # > 1 when a host runs more ranks than it has cores: each gets 1/time_share of one
    host_overlaps_device: bool = False  # a GPU: the host issues kernels while earlier ones run (see above)
    sm_cycles_per_s: float = 0.0  # SMs x clock: the speed of memory-bound kernels' arithmetic (0: not priced)
    sm_cycles: SmCycles = HOPPER_SM_CYCLES  # their SM cycles per element
    core_arithmetic: CoreArithmetic | None = None  # a CPU core's time per element of such kernels (None: not priced)

    @classmethod
    def for_cluster(cls, spec: ClusterSpec, dtype: str, dtype_bytes: int,
                    ranks_per_host: int | None = None, attention_seq: int = 0) -> "ComputeModel":
        """fp8 plans run matmuls at the fp8 peak and the rest (attention core) at the bf16 peak.

        ``ranks_per_host``: how many ranks of the plan share one host; beyond the host's
        ``cpu_cores`` (CPU clusters) they time-share its cores. ``attention_seq``: the query length each
        attention kernel runs over (:attr:`~parsim.workload.plan.Plan.attention_seq`), which picks the kernel's
        efficiency where the cluster file gives it by length."""
        other = "bf16" if dtype == "fp8" else dtype
        for needed in {dtype, other}:
            if needed not in spec.gpu.peak_flops:
                raise ParsimError(f"{spec.name}: the GPU has no {needed} peak in its cluster file "
                                  f"(it lists {', '.join(spec.gpu.peak_flops)})")
        peaks = spec.gpu.peak_flops
        return cls(
            peak_flops=peaks[other], hbm_bw_Bps=spec.gpu.hbm_bw_Bps, dtype_bytes=dtype_bytes,
            efficiency=spec.matmul_efficiency_for(dtype), half_dim=spec.matmul_half_dim,
            k_overhead=spec.matmul_k_overhead * peaks[other] / peaks.get("bf16", peaks[other]),
            kernel_overhead_s=spec.kernel_overhead_s, matmul_peak_flops=peaks[dtype] if dtype != other else None,
            other_efficiency=spec.matmul_efficiency_for(other) if dtype != other else None,
            sm_count=spec.gpu.sm_count, memory_efficiency=spec.memory_efficiency,
            attention_efficiency=tuple(at_length(c, attention_seq) for c in spec.attention_efficiency),
            op_forward_s=spec.op_forward_s,
            op_backward_s=spec.op_backward_s, tp_call_s=spec.tp_call_s, optimizer_tensor_s=spec.optimizer_tensor_s,
            zero_grad_step_s=spec.zero_grad_step_s, zero_grad_tensor_s=spec.zero_grad_tensor_s,
            zero_grad_free_Bps=spec.zero_grad_free_Bps, fsdp_unshard_s=spec.fsdp_unshard_s,
            fsdp_reduce_s=spec.fsdp_reduce_s, fsdp_optimizer_tensor_s=spec.fsdp_optimizer_tensor_s,
            fsdp_pass_s=spec.fsdp_pass_s, pass_s=spec.pass_s,
            optimizer_step_s=spec.optimizer_step_s,
            matmul_stream_bw_Bps=spec.matmul_stream_bw_Bps, matmul_write_bw_Bps=spec.matmul_write_bw_Bps,
            matmul_cached_stream_bw_Bps=spec.matmul_cached_stream_bw_Bps, matmul_cache_hits=spec.matmul_cache_hits,
            p2p_rendezvous=spec.p2p_rendezvous, p2p_latency=spec.p2p_latency, shared_cores=spec.shared_cores,
            action_overhead=spec.action_overhead, p2p_issue=spec.p2p_issue,
            elementwise_bw_Bps=spec.elementwise_bw_Bps, memory_alone_bw_Bps=spec.memory_alone_bw_Bps,
            memory_host_bw_Bps=spec.memory_host_bw_Bps,
            time_share=max(1.0, (ranks_per_host or 0) / spec.cpu_cores) if spec.cpu_cores else 1.0,
            host_overlaps_device=not spec.describes_cpu_host, sm_cycles_per_s=spec.gpu.sm_cycles_per_s,
            sm_cycles=spec.sm_cycles, core_arithmetic=spec.core_arithmetic if spec.describes_cpu_host else None)

    def waves(self, m: float, n: float, sms: int = 0) -> float:
        """Share of the tile work that is useful: tile quantization (edge tiles partly filled still
        cost whole tiles) times wave quantization (a last, partly filled wave costs a whole one), on
        ``sms`` of the GPU's SMs (0: all of them)."""
        if not self.sm_count:
            return 1.0
        sms = sms or self.sm_count
        tiles = -(-int(m) // MATMUL_TILE) * -(-int(n) // MATMUL_TILE)
        waves = -(-tiles // sms)
        return m * n / (waves * sms * MATMUL_TILE * MATMUL_TILE)  # useful area / area of all slots

    def matmul_rate(self, m: float, n: float, k: float, sm_reserved: int = 0, high_precision: bool = False) -> float:
        """FLOP/s of one ``(m, n, k)`` matmul; ``sm_reserved`` SMs are held by a communication kernel
        running beside it (:mod:`parsim.lowering.tp_overlap`), so it runs on the others. ``high_precision``: in an
        fp8 plan, a matmul kept in bf16 (the LM head), at the bf16 peak and efficiency.

        A tile's fixed cost is a time, ``k_overhead`` steps along ``k`` at ``peak_flops``' rate (bf16 in an fp8
        plan): at fp8's twice faster steps it is worth twice as many. On an H100 that took the fp8 GEMMs of a
        Llama 3 8B layer from a median 3.0% (max 24.6%) to 2.3% (max 12.7%) of their measured times, with
        ``k_overhead`` fitted on bf16 only (benchmarks/gpu/h100-fp8-kernels-2026-11-26.json)."""
        if high_precision and self.other_efficiency is not None:
            peak, efficiency = self.peak_flops, self.other_efficiency
        else:
            peak, efficiency = self.matmul_peak_flops or self.peak_flops, self.efficiency
        shape = 1.0
        for d in (m, n, k):
            shape *= d / (d + self.half_dim)
        shape *= k / (k + self.k_overhead * peak / self.peak_flops)
        sms = self.sms_left(sm_reserved)
        return peak * efficiency * shape * (sms / self.sm_count if self.sm_count else 1.0) * self.waves(m, n, sms)

    def sms_left(self, sm_reserved: int) -> int:
        """SMs a kernel runs on beside one holding ``sm_reserved`` (at least one; 0 where the count is unknown)."""
        return max(self.sm_count - sm_reserved, 1) if self.sm_count else 0

    @staticmethod
    def beside_collective_time(alone_s: float, reserved_s: float, collective_s: float) -> float:
        """Seconds of work that takes ``alone_s`` on every SM and ``reserved_s`` on the SMs a collective's
        kernel leaves, started with that collective, which holds its SMs for ``collective_s``: on fewer SMs
        until the collective ends, then on all. The kernel launched first takes its SMs, and the GEMM's thread
        blocks yet to run are placed on every SM once they are free (Megatron-LM issues the collective first,
        ``CUDA_DEVICE_MAX_CONNECTIONS=1``). All of it on the fewer SMs when the collective outlasts it."""
        if collective_s >= reserved_s or reserved_s <= 0:
            return reserved_s
        return collective_s + alone_s * (1.0 - collective_s / reserved_s)

    def cache_hit(self, reuse_bytes: float) -> float:
        """The share of a matmul's weight a CPU core's cache still holds, read last ``reuse_bytes`` ago
        (:attr:`matmul_cache_hits`, linear in log2 of the bytes between its points; 0 where not measured)."""
        if self.matmul_cache_hits is None or math.isinf(reuse_bytes):
            return 0.0
        return at_length(self.matmul_cache_hits, max(1, math.ceil(reuse_bytes / 1024)))

    @property
    def memory_bw_Bps(self) -> float:
        return self.hbm_bw_Bps * self.memory_efficiency

    def matmul_time(self, m: float, n: float, k: float, sm_reserved: int = 0, high_precision: bool = False,
                    reuse_bytes: float = math.inf) -> float:
        """Seconds of one ``(m, n, k)`` matmul; ``reuse_bytes``: on a CPU host, the bytes touched since its weight
        was last read (:meth:`cache_hit`)."""
        flops = 2.0 * m * n * k
        rate = self.matmul_rate(m, n, k, sm_reserved, high_precision)
        if self.matmul_stream_bw_Bps:  # eager CPU: the weight streams in and the output out, beside the arithmetic
            write_bw = self.matmul_write_bw_Bps or self.matmul_stream_bw_Bps
            hit = self.cache_hit(reuse_bytes)
            read_s = (1.0 - hit) / self.matmul_stream_bw_Bps + (hit / self.matmul_cached_stream_bw_Bps if hit else 0.0)
            return flops / rate + (k * n * read_s + m * n / write_bw) * self.dtype_bytes
        traffic = (m * k + k * n + m * n) * self.dtype_bytes
        return max(flops / rate, traffic / self.memory_bw_Bps)

    def time(self, matmuls=(), flops: float = 0.0, hbm_bytes: float = 0.0, kernels: int = 0,
             attention_flops: float = 0.0, attention_grad_flops: float = 0.0, forward_ops: int = 0,
             backward_ops: int = 0, optimizer_tensors: int = 0, stream_bytes: float = 0.0,
             sm_reserved: int = 0, high_precision: bool = False,
             sm_bound: tuple[tuple[float, tuple[SmWork, ...]], ...] = (), stream_apart: bool = False,
             optimizer_steps: int = 0, tp_calls: tuple[int, int] = (0, 0),
             fsdp_calls: tuple[int, int, int] = (0, 0, 0), fsdp_passes: tuple[int, int] = (0, 0),
             adamw_params: float = 0.0, accumulate_elements: float = 0.0,
             pass_starts: tuple[int, int] = (0, 0), weights_reuse_bytes: float = math.inf) -> float:
        """Matmuls at their shape's rate, the attention core's forward and backward FLOPs at the
        kernel's rates, other FLOPs at peak and memory-bound bytes at HBM speed, plus launches; and
        each dispatched op's, each tensor-parallel call's (``tp_calls``: forward, backward), each optimizer
        tensor's and each optimizer step's fixed host cost, and FSDP2's (``fsdp_calls``: units unsharded, units
        reduced, DTensor parameters stepped; ``fsdp_passes``: units a forward, a backward runs through moving
        nothing; ``pass_starts``: forward, backward passes this work begins, each paying ``pass_s``): added
        on an eager CPU host, the longer of host and kernels on a GPU (``host_overlaps_device``). On a CPU
        host, too, the memory-bound bytes but ``stream_bytes`` at the host's elementwise speed.
        ``sm_reserved``: SMs a communication kernel beside the work holds: the matmuls run on the rest (their
        waves, :meth:`matmul_rate`), and so do the attention core and the kernels the SMs bound, at the share
        of the SMs left (both spread their thread blocks over every free SM); ``high_precision``: the
        matmuls run in bf16 in an fp8 plan (:meth:`matmul_rate`). ``sm_bound``: (bytes, arithmetic) of
        memory-bound kernels whose arithmetic can outlast their bytes (their bytes are in ``hbm_bytes``
        too): each takes the longer of the two on a GPU whose SM clock is known (:meth:`sm_excess`).
        ``stream_apart``: on a CPU host, leave ``stream_bytes`` out; the caller times them on its shared
        memory (:attr:`shares_host_memory`). ``adamw_params``: parameters a fused AdamW kernel steps, whose SM
        cycles add to its bytes on a GPU whose SM clock is known (``sm_cycles.adamw``). ``accumulate_elements``:
        elements the gradients' accumulation (``stream_bytes``) reads or writes unvectorized; it takes the longer
        of its bytes and their cycles (:meth:`unvectorized_s`), on every SM whatever a collective holds, as the
        search's fast tier prices it. ``weights_reuse_bytes``: on a CPU host, the bytes touched since the matmuls'
        weights were last read (:meth:`matmul_time`)."""
        total = sum(self.matmul_time(*mm, sm_reserved, high_precision, weights_reuse_bytes) for mm in matmuls)
        forward, backward = self.attention_efficiency
        spread = self.sm_count / self.sms_left(sm_reserved) if self.sm_count and sm_reserved else 1.0
        total += (attention_flops / forward + attention_grad_flops / backward) / self.peak_flops * spread
        if self.elementwise_bw_Bps:
            elementwise = max(hbm_bytes - stream_bytes, 0.0)
            work = max(flops / self.peak_flops, elementwise / self.elementwise_bw_Bps)
            if not stream_apart:
                work += stream_bytes / self.memory_bw_Bps
        else:
            work = max(flops / self.peak_flops, hbm_bytes / self.memory_bw_Bps)
        host = self.host_time(forward_ops, backward_ops, optimizer_tensors, optimizer_steps, tp_calls, fsdp_calls,
                              fsdp_passes, pass_starts)
        if adamw_params and self.sm_cycles_per_s:
            work += adamw_params * self.sm_cycles.adamw / self.sm_cycles_per_s * spread
        if accumulate_elements:
            work += max(self.unvectorized_s(accumulate_elements) - stream_bytes / self.memory_bw_Bps, 0.0)
        return self.with_host(total + work + self.sm_excess(sm_bound, spread) + kernels * self.kernel_overhead_s, host)

    def unvectorized_s(self, elements: float) -> float:
        """Seconds of ``elements`` read or written through torch's non-vectorized loop, at the bias add's SM
        cycles, on a GPU whose SM clock is known (0 otherwise)."""
        return elements * self.sm_cycles.bias_add / self.sm_cycles_per_s if self.sm_cycles_per_s else 0.0

    def sm_excess(self, sm_bound: tuple[tuple[float, tuple[SmWork, ...]], ...], spread: float = 1.0) -> float:
        """How much longer than their bytes these (bytes, arithmetic) kernels run, their arithmetic being the
        slower side: over every SM on a GPU whose SM clock is known (``spread`` times as long on the SMs a
        communication kernel leaves), on the rank's core on a CPU host whose file gives its time per element
        (0 otherwise)."""
        if self.sm_cycles_per_s:
            return sum(max(sum(map(self.cycles, works)) / self.sm_cycles_per_s * spread - nbytes / self.memory_bw_Bps,
                           0.0) for nbytes, works in sm_bound)
        if self.core_arithmetic is not None and self.elementwise_bw_Bps:
            return sum(max(sum(map(self.core_seconds, works)) - nbytes / self.elementwise_bw_Bps, 0.0)
                       for nbytes, works in sm_bound)
        return 0.0

    def cycles(self, work: SmWork) -> float:
        """SM cycles of ``work`` at this GPU's cycles per element (:class:`~parsim.hardware.cluster.SmCycles`);
        a softmax's backward streams at the memory speed (none)."""
        figures = self.sm_cycles
        if work.kind == "softmax":
            per_element = 0.0 if work.backward else at_length(figures.softmax, work.row)
        elif work.kind in ("dropout", "bias_add"):
            per_element = getattr(figures, work.kind)
        else:
            per_element = getattr(figures, work.kind)[work.backward]
        return per_element * work.elements

    def core_seconds(self, work: SmWork) -> float:
        """Seconds of ``work`` on a CPU core (:class:`~parsim.hardware.cluster.CoreArithmetic`; other kinds: none beyond
        their bytes)."""
        figures = getattr(self.core_arithmetic, work.kind, None)
        return figures[work.backward] * work.elements if figures else 0.0

    def host_time(self, forward_ops: int = 0, backward_ops: int = 0, optimizer_tensors: int = 0,
                  optimizer_steps: int = 0, tp_calls: tuple[int, int] = (0, 0),
                  fsdp_calls: tuple[int, int, int] = (0, 0, 0), fsdp_passes: tuple[int, int] = (0, 0),
                  pass_starts: tuple[int, int] = (0, 0)) -> float:
        """The host's fixed costs of dispatching these eager ops, making these tensor-parallel calls (forward,
        backward), taking these AdamW steps over these tensors, FSDP2's work (units unsharded, units
        reduced, DTensor parameters stepped; units a forward, a backward runs through moving nothing), and
        beginning these forward and backward passes."""
        forward_call, backward_call = self.tp_call_s or (TP_COLLECTIVE_OPS * self.op_forward_s,
                                                         TP_COLLECTIVE_OPS * self.op_backward_s)
        return (forward_ops * self.op_forward_s + backward_ops * self.op_backward_s
                + tp_calls[0] * forward_call + tp_calls[1] * backward_call
                + optimizer_tensors * self.optimizer_tensor_s + optimizer_steps * self.optimizer_step_s
                + fsdp_calls[0] * self.fsdp_unshard_s + fsdp_calls[1] * self.fsdp_reduce_s
                + fsdp_calls[2] * self.fsdp_optimizer_tensor_s
                + fsdp_passes[0] * self.fsdp_pass_s[0] + fsdp_passes[1] * self.fsdp_pass_s[1]
                + pass_starts[0] * self.pass_s[0] + pass_starts[1] * self.pass_s[1])

    def with_host(self, device_s: float, host_s: float) -> float:
        """A block's time from its kernels' and its host's: the longer on a GPU, which runs kernels while
        the host issues the next; the sum on a CPU rank, whose host is the device, each stretched when
        ranks time-share cores (:meth:`core_stretch`)."""
        if self.host_overlaps_device:
            return max(device_s, host_s) * self.time_share
        return device_s * self.core_stretch("matmul_stretch") + host_s * self.core_stretch("eager_stretch")

    def with_core_each(self) -> "ComputeModel":
        """This model for a rank that has its core to itself (:mod:`parsim.sim.cores` times the turns)."""
        return replace(self, time_share=1.0)

    def core_stretch(self, field: str) -> float:
        """How many times as long work takes on a core this rank time-shares: ``time_share`` (each rank's fair
        share), or, where ``calibrate`` measured two ranks on each core computing at once (``shared_cores``'
        ``matmul_stretch`` for kernels, ``eager_stretch`` for the host's fixed costs), that figure, as
        :meth:`time_shared` takes it; times ``comm_stretch`` where fitted (the ranks' communication threads
        waking on the core)."""
        stretch = self.time_shared(1.0, getattr(self.shared_cores, field, None) if self.shared_cores else None)
        comm = self.shared_cores.comm_stretch if self.shared_cores else None
        return stretch * comm if comm and self.time_share > 1.0 else stretch

    @property
    def shares_host_memory(self) -> bool:
        """Whether ranks stream on a CPU host's shared memory, timed by the step simulator (see above)."""
        return bool(self.memory_alone_bw_Bps and self.memory_host_bw_Bps and self.elementwise_bw_Bps
                    and not self.host_overlaps_device)

    def time_shared(self, alone_s: float, shared_s: float | None) -> float:
        """A pipeline host cost when ranks time-share cores: ``alone_s`` with a core each; with two ranks on
        each core, ``shared_s`` where it was measured (linear between one and two ranks per core, stretched
        beyond), else ``alone_s`` stretched like compute."""
        if self.time_share <= 1.0:
            return alone_s
        if shared_s is None:
            return alone_s * self.time_share
        if self.time_share <= 2.0:
            return alone_s + (shared_s - alone_s) * (self.time_share - 1.0)
        return shared_s * self.time_share / 2.0

    def _pipeline_cost(self, alone_s: float, field: str) -> float:
        """A pipeline host cost (:meth:`time_shared`), with the ``shared_cores`` figure ``field`` if measured."""
        return self.time_shared(alone_s, getattr(self.shared_cores, field) if self.shared_cores else None)

    def rendezvous_s(self, gradient_bytes: float = 0.0) -> float:
        """Host time of one pipeline transfer received late by a rank holding ``gradient_bytes`` of gradients (0:
        not known, the most the figures give)."""
        return self._pipeline_cost(at_gradients(self.p2p_rendezvous, gradient_bytes), "p2p_rendezvous_s")

    def action_gap_s(self, gradient_bytes: float = 0.0) -> float:
        """Host time before each action of a step of a rank holding ``gradient_bytes`` of gradients (0: not
        known, the most the figures give)."""
        return self._pipeline_cost(at_gradients(self.action_overhead, gradient_bytes), "action_overhead_s")

    def zero_grad_s(self, tensors: int, nbytes: float) -> float:
        """Host time of freeing a step's gradients (``tensors`` of ``nbytes`` in all) as it starts; 0 unless
        measured (a CPU host's file)."""
        if not self.zero_grad_free_Bps:
            return 0.0
        time_s = self.zero_grad_step_s + tensors * self.zero_grad_tensor_s + nbytes / self.zero_grad_free_Bps
        return time_s * self.core_stretch("eager_stretch")

    def send_issue_s(self, gradient_bytes: float = 0.0) -> float:
        """Host time the loop spends issuing one pipeline send before the next action of a rank holding
        ``gradient_bytes`` of gradients (0: not known, the most the figures give)."""
        return self._pipeline_cost(at_gradients(self.p2p_issue, gradient_bytes), "p2p_issue_s")

    def send_latency_s(self, gradient_bytes: float = 0.0) -> float | None:
        """A pipeline transfer's latency with its receiver waiting, a rank holding ``gradient_bytes`` of gradients
        (0: not known, the most the figures give); None: the links'."""
        if self.p2p_latency is None:
            return None
        return self._pipeline_cost(at_gradients(self.p2p_latency, gradient_bytes), "p2p_latency_s")
