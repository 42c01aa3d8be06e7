"""Fit a cluster file to measurements of the machine at hand.

Collectives: for each measured (operation, ranks, size), the simulator is run
once on a *unit* cluster (1 s per latency step, 1 byte/s links, 1 byte/s
reduction). Its phase timings are then exactly the three features of the
alpha-beta-gamma model, ``t = alpha * steps + bytes_on_busiest_link / B +
reduced_bytes / R``, so fitting ``alpha`` and ``1/B`` is a linear least-squares
problem in the simulator's own terms — whatever algorithm the backend uses.
Rows are weighted by ``1/t`` so small and large messages count alike
(relative error). The reduction speed ``R`` comes from its own microbenchmark.

Every measured operation then gets a fixed cost per call and a bandwidth
efficiency of its own (:func:`fit_operation`), as NCCL's tuner keeps a latency
and bandwidth per algorithm: backends implement some operations far less
efficiently than their links allow (gloo's all-gather, for one).

Compute (:mod:`executor.compute_bench` measures, on every rank at once):
matmul times are fitted to the shape model of :mod:`parsim.sim.compute` (peak
FLOP/s, the dimension at which efficiency halves, and the speed at which a CPU
streams cold operands in); eager blocks (the reference implementation's decoder
layers at a generic size) give the fixed cost per op of
a forward and of a backward (:func:`fit_dispatch`); AdamW steps give the costs
per step and per parameter tensor and the memory speed (:func:`fit_optimizer`); products, sums
and a rotation give the speed of memory-bound kernels' bytes (:func:`fit_elementwise`), and each of
GeLU, a norm and a softmax on its own a core's time per element of its arithmetic
(:func:`fit_core_arithmetic`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from ..errors import ParsimError
from ..hardware.cluster import (CORE_ARITHMETIC_KINDS, PROBE_KEYS, CoreArithmetic, Curve, SharedCoreCosts,
                                parse_cluster)
from ..report.results import CollectiveResult
from ..sim.collectives.algorithms import build_phases
from ..sim.collectives.simulate import time_phases
from ..sim.compute import ComputeModel
from ..units import parse_size


def host_cluster(ranks: int, latency_s: float, bw_Bps: float, reduce_bw_Bps: float, *,
                 fabric_bw_Bps: float | None = None, name: str = "my-host",
                 description: str = "", cpu: str = "CPU rank", peak_flops: float = 1e11,
                 mem_bw_Bps: float = 1e10, mem_bytes: float = 8e9, algorithms: dict | None = None,
                 efficiency: dict | None = None, overhead_s: dict | None = None,
                 cache_bytes: float = 0.0, cache_speedup: dict | None = None,
                 matmul_half_dim: float = 0.0, kernel_overhead_s: float = 0.0, op_forward_s: float = 0.0,
                 op_backward_s: float = 0.0, optimizer_tensor_s: float = 0.0, optimizer_step_s: float = 0.0,
                 matmul_stream_bw_Bps: float | None = None, matmul_write_bw_Bps: float | None = None,
                 matmul_cache: CacheFit | None = None,
                 p2p_rendezvous_s: float | Sequence[tuple[int, float]] = 0.0,
                 p2p_latency_s: float | Sequence[tuple[int, float]] | None = None,
                 action_overhead_s: float | Sequence[tuple[int, float]] = 0.0,
                 p2p_issue_s: float | Sequence[tuple[int, float]] = 0.0,
                 elementwise_bw_Bps: float | None = None,
                 memory_alone_bw_Bps: float | None = None, memory_host_bw_Bps: float | None = None,
                 shared_cores: SharedCoreCosts | None = None, step_overhead_s: dict | None = None,
                 cpu_cores: int | None = None, speed_probe: Sequence[float] | None = None,
                 elasticity: Mapping[str, float | None] | None = None,
                 collective_probe_s: Sequence[tuple[int, float]] | None = None,
                 core_arithmetic: CoreArithmetic | None = None,
                 tp_call_s: tuple[float, float] | None = None, zero_grad: OptimizerFit | None = None,
                 fsdp: FsdpHostFit | None = None, rank_jitter: float = 0.0,
                 pass_s: tuple[float, float] = (0.0, 0.0)) -> dict:
    """A cluster mapping for ``ranks`` processes on one host (loopback "fabric"); ``speed_probe`` is the
    host-speed probes' (matmul FLOP/s, seconds per eager pass, and memory bytes per second where timed) while the
    compute figures were measured, and ``elasticity`` how far the work each stands for followed it, by
    :data:`COMPUTE_PROBES` name (:func:`fit_probe_elasticity`; None: not fitted); ``collective_probe_s`` the
    collective probe's seconds by KiB while the collectives were; ``shared_cores`` the pipeline's host costs with
    two ranks on each core;
    ``tp_call_s`` a tensor-parallel collective call's host time, forward and backward; ``zero_grad`` what freeing
    the gradients costs; ``fsdp`` FSDP2's own host work; ``cache_speedup`` each operation's speed-up on buffers of
    up to ``cache_bytes`` (:func:`fit_operation`); ``matmul_cache`` a matmul's weight read from a core's cache
    (:func:`fit_cache_hits`); ``rank_jitter`` how much the same work's time varies
    between ranks (a fraction); ``pass_s`` a forward's and a backward's own host time, once per pass;
    ``action_overhead_s`` and ``p2p_issue_s`` the loop's time before each action and per send issued, and
    ``p2p_rendezvous_s`` and ``p2p_latency_s`` a pipeline transfer's host time and latency, each one figure or
    figures by the gradients a rank holds ((KiB, seconds) points)."""
    host_costs = {"op_forward_us": op_forward_s * 1e6, "op_backward_us": op_backward_s * 1e6,
                  "optimizer_tensor_us": optimizer_tensor_s * 1e6, "optimizer_step_us": optimizer_step_s * 1e6,
                  "p2p_rendezvous_us": _kib_curve_us(p2p_rendezvous_s),
                  "action_overhead_us": _kib_curve_us(action_overhead_s),
                  "p2p_issue_us": _kib_curve_us(p2p_issue_s)}
    if any(pass_s):
        host_costs["pass_us"] = {"forward": pass_s[0] * 1e6, "backward": pass_s[1] * 1e6}
    if p2p_latency_s is not None:
        host_costs["p2p_latency_us"] = _kib_curve_us(p2p_latency_s)
    if matmul_stream_bw_Bps:
        host_costs["matmul_stream_bw_GBps"] = matmul_stream_bw_Bps / 1e9
    if matmul_write_bw_Bps:
        host_costs["matmul_write_bw_GBps"] = matmul_write_bw_Bps / 1e9
    if matmul_cache:
        host_costs["matmul_cached_stream_bw_GBps"] = matmul_cache.cached_bw_Bps / 1e9
        host_costs["matmul_cache_hits"] = dict(matmul_cache.hits)
    if elementwise_bw_Bps:
        host_costs["elementwise_bw_GBps"] = elementwise_bw_Bps / 1e9
    if core_arithmetic:
        host_costs["core_ns_per_element"] = core_arithmetic.to_ns()
    if tp_call_s:
        host_costs["tp_collective_call_us"] = {"forward": tp_call_s[0] * 1e6, "backward": tp_call_s[1] * 1e6}
    if zero_grad:
        host_costs.update(zero_grad_step_us=zero_grad.step_s * 1e6, zero_grad_tensor_us=zero_grad.tensor_s * 1e6,
                          zero_grad_free_GBps=zero_grad.bw_Bps / 1e9)
    if fsdp:
        host_costs.update(fsdp_unshard_us=fsdp.unshard_s * 1e6, fsdp_reduce_us=fsdp.reduce_s * 1e6,
                          fsdp_optimizer_tensor_us=fsdp.tensor_s * 1e6)
        if fsdp.pass_s:
            host_costs["fsdp_pass_us"] = {"forward": fsdp.pass_s[0] * 1e6, "backward": fsdp.pass_s[1] * 1e6}
    if memory_alone_bw_Bps and memory_host_bw_Bps:
        host_costs["memory_alone_bw_GBps"] = memory_alone_bw_Bps / 1e9
        host_costs["memory_host_bw_GBps"] = memory_host_bw_Bps / 1e9
    if shared_cores:
        host_costs["shared_cores"] = shared_cores.to_mapping()
    if cpu_cores:
        host_costs["cpu_cores"] = int(cpu_cores)
    if rank_jitter:
        host_costs["rank_jitter"] = float(rank_jitter)
    if speed_probe:
        host_costs["speed_probe_gflops"] = speed_probe[0] / 1e9
        host_costs["speed_probe_eager_us"] = speed_probe[1] * 1e6
        if len(speed_probe) > 2:
            host_costs["speed_probe_memory_GBps"] = speed_probe[2] / 1e9
    if collective_probe_s:
        host_costs["collective_probe_us"] = _kib_curve_us(collective_probe_s)
    return {
        "name": name,
        "description": description or f"{ranks} ranks on one host, calibrated",
        "gpus_per_node": ranks,
        "gpu": {"model": cpu, "peak_tflops": {"fp32": peak_flops / 1e12},
                "hbm_capacity_GB": mem_bytes / 1e9, "hbm_bw_GBps": mem_bw_Bps / 1e9},
        "intra_node": {"fabric": "pcie", "bw_GBps_per_direction": bw_Bps / 1e9,
                       "latency_us": latency_s * 1e6, "in_switch_reduction": False,
                       **({"fabric_bw_GBps": fabric_bw_Bps / 1e9} if fabric_bw_Bps else {})},
        # One host: nothing leaves it, but the file format wants a scale-out section.
        "scale_out": {"nics_per_node": 1, "nic_bw_Gbps": 10.0, "latency_us": 50.0, "spine_hop_latency_us": 1.0,
                      "nodes_per_leaf": 32, "oversubscription": 1.0},
        "reduce_bw_GBps": reduce_bw_Bps / 1e9,
        "algorithms": dict(algorithms or {}),
        "collective_efficiency": dict(efficiency or {}),
        "collective_overhead_us": {op: t * 1e6 for op, t in (overhead_s or {}).items()},
        **({"collective_cache_KiB": cache_bytes / 1024, "collective_cache_speedup": dict(cache_speedup)}
           if cache_bytes and cache_speedup else {}),
        **({"collective_step_overhead_us": step_overhead_us(step_overhead_s)} if step_overhead_s else {}),
        "compute": {"matmul_efficiency": 1.0, "matmul_half_dim": float(matmul_half_dim),
                    "kernel_overhead_us": kernel_overhead_s * 1e6,
                    **{k: v for k, v in host_costs.items() if v},
                    # beside its probe; 0 is a fit (the work did not follow the probe), not a figure left out
                    **{f"speed_probe_{probe}_elasticity": float(power) for probe, power in (elasticity or {}).items()
                       if PROBE_KEYS[probe] in host_costs and power is not None}},
    }


def collective_features(op: str, nranks: int, size: float, algorithm: str,
                        fabric_ratio: float | None = None) -> np.ndarray:
    """(latency steps, transfer time at 1 byte/s per link, bytes reduced) of one collective.

    ``fabric_ratio`` is the host's total capacity in units of one link's (None: unlimited).
    """
    unit = parse_cluster(host_cluster(max(nranks, 1), 1.0, 1.0, 1.0, fabric_bw_Bps=fabric_ratio),
                         "<unit>").build(1)
    phases = build_phases(unit, op, algorithm, np.arange(nranks), size)
    _, timings = time_phases(unit, phases)
    return np.array([sum(t.latency_s for t in timings), sum(t.transfer_s for t in timings),
                     sum(t.reduce_s for t in timings)])


def core_cache_bytes(cpu: int | None = None, cpus: Path = Path("/sys/devices/system/cpu")) -> int:
    """The size of one core's L2 cache, read from Linux's sysfs (``cpu``: the first this process may run on); 0
    where it cannot be read. A collective's buffers up to this size stay in the core's cache (:func:`fit_links`)."""
    if cpu is None:
        try:
            cpu = min(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpu = 0
    for index in sorted((cpus / f"cpu{cpu}" / "cache").glob("index*")):
        try:
            level, kind, size = ((index / name).read_text().strip() for name in ("level", "type", "size"))
        except OSError:
            continue
        if level == "2" and kind in ("Unified", "Data"):
            return parse_size(size)  # sysfs writes "1024K"
    return 0


@dataclass
class LinkFit:
    latency_s: float
    bw_Bps: float
    fabric_bw_Bps: float | None  # the host's total, when it limits concurrent transfers
    reduce_bw_Bps: float
    rows: list[tuple[CollectiveResult, float]]  # measurement, fitted time
    cache_bytes: float = 0.0  # buffers up to this size were fitted apart (a core's cache): see fit_links


def fit_links(results: list[CollectiveResult], algorithms: dict[str, str], reduce_bw_Bps: float,
              cache_bytes: float = 0.0) -> LinkFit:
    """Fit latency per step, link bandwidth and the host's total bandwidth (reduction speed given).

    For each candidate ratio of total to per-link bandwidth (ranks on one host
    share its memory and CPUs: two transfers at once may each get half), the
    features come from the simulator and latency and ``1/B`` from weighted
    least squares; the ratio with the smallest relative error wins. A single
    transfer (send/recv) among the measurements pins ``B`` apart from the total.
    With ``cache_bytes`` (a CPU host's core cache), buffers up to that size get a
    bandwidth of their own, so that the links' is the one of buffers streamed
    from memory (:func:`fit_operation` fits each operation's speed-up in the cache).
    """
    if len(results) < 2:
        raise ParsimError("calibration needs at least two measurements")
    times = np.array([r.time_s for r in results])
    weights = 1.0 / times
    cached = np.array([r.size_bytes <= cache_bytes for r in results])
    best = None
    max_ranks = max(r.nranks for r in results)
    for ratio in [None, *np.geomspace(1.0, 2.0 * max_ranks, 24)]:
        feats = _features(results, algorithms, ratio)
        target = times - feats[:, 2] / reduce_bw_Bps  # take out the known reduction time
        columns = np.stack([feats[:, 0], *_apart(feats[:, 1], cached)], axis=1)
        coef = _nonnegative_lstsq(columns * weights[:, None], target * weights)
        if coef[1] <= 0:
            continue
        fitted = columns @ coef + feats[:, 2] / reduce_bw_Bps
        error = float(np.sum(((fitted - times) * weights) ** 2))
        if best is None or error < best[0]:
            best = (error, ratio, coef, fitted)
    if best is None:
        raise ParsimError("the measurements show no bandwidth term: use larger sizes (e.g. up to 64MiB)")
    _, ratio, (alpha, inv_bw, _), fitted = best
    bw = 1.0 / inv_bw
    return LinkFit(float(alpha), float(bw), float(ratio * bw) if ratio else None, reduce_bw_Bps,
                   list(zip(results, fitted.tolist())), float(cache_bytes))


class OperationFit(NamedTuple):
    overhead_s: float
    efficiency: float
    rows: list  # (result, fitted seconds)
    at_link_speed: bool = False  # the times did not grow with size: efficiency kept at 1
    cache_speedup: float = 1.0  # how many times as fast its bytes move in buffers that fit the links' cache_bytes


def fit_operation(results: list[CollectiveResult], links: LinkFit, algorithms: dict[str, str]) -> OperationFit:
    """One operation's own fixed cost per call and bandwidth efficiency, on top of the fitted links.

    Backends do not run every operation at link speed, nor with the same fixed
    cost (NCCL's own tuner keeps a latency and a bandwidth per algorithm and
    operation for this reason). With latency per step, links and reduction
    fixed: ``t = overhead + alpha*steps + transfer / e + reduce``, from
    weighted least squares (both terms >= 0). Where the times do not grow with
    the bytes (stalls on a busy host can outweigh them at every size), the
    bytes stay at link speed and only the fixed cost is fitted.

    On a CPU host (``links.cache_bytes``) buffers that fit a core's cache get a
    speed of their own, ``e`` times ``cache_speedup``: gloo's copies and sums
    over a buffer that stays in the cache run faster than over one streamed
    from memory, the more so the more passes the operation makes over it (on
    the 2-core VM, 2026-11-30: about 2.1-3.0x for all-reduce, all-gather and
    reduce-scatter, 1.3-1.4x for send/recv; ``docs/calibration.md``).
    """
    ratio = links.fabric_bw_Bps / links.bw_Bps if links.fabric_bw_Bps else None
    feats = _features(results, algorithms, ratio)
    times = np.array([r.time_s for r in results])
    fixed = links.latency_s * feats[:, 0] + feats[:, 2] / links.reduce_bw_Bps
    transfer = feats[:, 1] / links.bw_Bps
    cached = np.array([r.size_bytes <= links.cache_bytes for r in results])
    weights = 1.0 / times
    a = np.stack([np.ones_like(times), *_apart(transfer, cached)], axis=1)
    overhead, inverse, inverse_cached = _nonnegative_lstsq(a * weights[:, None], (times - fixed) * weights)
    at_link_speed = inverse <= 0
    if at_link_speed:
        inverse, inverse_cached = 1.0, 0.0
        overhead = max(float(np.sum(weights ** 2 * (times - fixed - transfer)) / np.sum(weights ** 2)), 0.0)
    # no cached sizes measured, or none that grew with size: the cache leaves this operation's speed as it is
    speedup = inverse / inverse_cached if inverse_cached > 0 and cached.any() else 1.0
    fitted = fixed + overhead + transfer * np.where(cached, inverse / speedup, inverse)
    return OperationFit(float(overhead), float(1.0 / inverse), list(zip(results, fitted.tolist())), at_link_speed,
                        float(speedup))


def _apart(transfer: np.ndarray, cached: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A transfer column as two: the sizes streamed from memory's, and the ones in a core's cache (``cached``)."""
    return np.where(cached, 0.0, transfer), np.where(cached, transfer, 0.0)


def _features(results: list[CollectiveResult], algorithms: dict[str, str], ratio: float | None) -> np.ndarray:
    return np.array([collective_features(r.op, r.nranks, r.size_bytes, algorithms.get(r.op, "ring"), ratio)
                     for r in results])


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: the best unconstrained fit over every subset of the
    columns whose coefficients all come out >= 0 (a handful of unknowns: exhaustive is exact and cheap)."""
    columns = a.shape[1]
    best, best_err = np.zeros(columns), float(np.sum(b ** 2))
    for mask in range(1, 1 << columns):
        kept = [j for j in range(columns) if mask >> j & 1]
        coef = np.linalg.lstsq(a[:, kept], b, rcond=None)[0]
        if (coef < 0).any():
            continue
        x = np.zeros(columns)
        x[kept] = coef
        err = float(np.sum((a @ x - b) ** 2))
        if err < best_err:
            best, best_err = x, err
    return best


def fit_one_core_collective(rows: list[list[tuple[int, float]]]) -> tuple[float, float] | None:
    """The latency and speed of an all-reduce between two ranks on one core: ``t = latency + bytes / speed``
    (both >= 0) through each size's median over the late ranks' rows ((bytes, seconds) per size,
    :func:`executor.compute_bench.measure_one_core_allreduce`). None where nothing was measured or the times
    do not grow with the size."""
    by_size: dict[int, list[float]] = {}
    for row in rows:
        for nbytes, seconds in row:
            by_size.setdefault(nbytes, []).append(seconds)
    if len(by_size) < 2:
        return None
    sizes = np.array(sorted(by_size), dtype=float)
    times = np.array([np.median(by_size[int(n)]) for n in sizes])
    latency, per_byte = _nonnegative_lstsq(np.column_stack([np.ones_like(sizes), sizes]), times)
    grows = per_byte * sizes[-1] > 0.01 * times[-1]  # the bytes' share of the largest size's time, past rounding
    return (float(latency), float(1.0 / per_byte)) if grows else None


def step_overhead_us(step_overhead_s: dict[str, Curve]) -> dict[str, float | dict[int, float]]:
    """:func:`fit_step_overhead`'s figures as the cluster file's ``collective_step_overhead_us``."""
    return {op: _kib_curve_us(curve) for op, curve in step_overhead_s.items()}


def fit_step_overhead(rounds: list[list[CollectiveResult]]) -> dict[str, Curve]:
    """Per operation and size, the extra cost of a call issued between bursts of compute (as in a training
    step) over the same call back to back: each round's call after compute less the hot calls timed right after it
    (``extra["back_to_back_s"]``, :func:`executor.collectives.measure_in_step`), the median over ``rounds``, at
    least 0, as (KiB, seconds) points by the call's bytes. The step simulator adds it to the back-to-back fit.

    By size, not one figure: back to back, a buffer that fits the core's cache stays in it and its threads awake,
    and a call after a burst of compute has neither. Against the same call timed a millisecond later, not against
    the back-to-back sweep's fit: that fit misses some sizes by 30-40%, and the calls after compute can catch a slow
    spell in every round (set QC put 2.2-4.2 ms over the fit at four sizes where 0.04-0.3 ms was usual), which adds
    its time to the hot calls too and drops out of the difference. On the 2-core AMD VM (2026-12-03, 30 rounds) the
    median of three rounds came to 25-150 us at most sizes (docs/calibration.md, "A call after compute against the
    same call hot")."""
    extra: dict[str, dict[int, list[float]]] = {}
    for results in rounds:
        for r in results:
            extra.setdefault(r.op, {}).setdefault(math.ceil(r.size_bytes / 1024), []).append(
                r.time_s - r.extra["back_to_back_s"])
    return {op: tuple((kib, max(float(np.median(values)), 0.0)) for kib, values in sorted(by_size.items()))
            for op, by_size in extra.items()}


@dataclass
class MatmulFit:
    peak_flops: float
    half_dim: float
    rows: list[tuple[tuple[int, int, int], float, float]]  # shape, measured s, fitted s
    stream_bw_Bps: float | None = None  # the weight streamed in on top of the arithmetic (None: not seen)
    # the output streamed out, where the fit tells it from the weight (None: at stream_bw_Bps)
    write_bw_Bps: float | None = None
    call_s: float = 0.0  # fixed cost per call (its dispatch: charged per op by the eager-op costs, not here)

    @property
    def median_abs_error(self) -> float:
        return float(np.median([abs(f / m - 1) for _, m, f in self.rows]))

    def model(self, dtype_bytes: int = 4) -> ComputeModel:
        """A compute model with these matmul figures (fp32 by default)."""
        return ComputeModel(self.peak_flops, 1e30, dtype_bytes, half_dim=self.half_dim,
                            matmul_stream_bw_Bps=self.stream_bw_Bps, matmul_write_bw_Bps=self.write_bw_Bps)


def fit_matmul(samples: list[tuple[tuple[int, int, int], float]], stream: bool = True, call: bool = False,
               dtype_bytes: int = 4) -> MatmulFit:
    """Fit ``t = flops / (peak * prod(d / (d + h))) + reads / stream_bw + writes / write_bw (+ call)`` to
    measured matmul times.

    A grid over ``h``; for each, ``1/peak``, the inverse speeds and the fixed cost per call by least squares
    on relative error (all >= 0). ``reads`` are the second operand's bytes, ``k n dtype_bytes``, and
    ``writes`` the output's, ``m n dtype_bytes`` (what a matmul streams in and out; see
    :mod:`parsim.sim.compute`): a core writes a new output sequentially faster than a thin matmul reads a
    weight it finds in memory (on the 2-core AMD VM a 32 x 1024 x 1024 matmul took 2.2-2.4 ms, a
    1024 x 1024 x 32 one 1.8-1.9 with the same FLOPs and bytes; fitted, 3.4 and 9.6 GB/s, then 6.3 and 18,
    in two runs of the benchmark, 1.2-1.8x apart in three calibrations), so each has its speed. Where the
    data show no cost for one of them the fit falls back to one speed for both (``write_bw_Bps`` None). With
    ``stream=False`` (or no stream term in the data) ``stream_bw_Bps`` is None: the pure shape model. With
    ``call`` a fixed cost per call is fitted too and kept apart (``call_s``): on an eager CPU host it is the
    op's dispatch, which the per-op costs charge, so the shape model describes the arithmetic alone.
    """
    if not samples:
        raise ParsimError("no matmul measurements to fit")
    shapes = np.array([s for s, _ in samples], dtype=float)
    times = np.array([t for _, t in samples])
    m, n, k = shapes.T
    reads, writes = k * n * dtype_bytes, m * n * dtype_bytes
    if stream:
        split = _fit_shape_model(shapes, times, [reads, writes], call)
        if split is not None and (split[2][1:3] > 0).all():  # coefficients: arithmetic, reads, writes[, call]
            return _matmul_fit(shapes, times, split, call, write=True)
    best = _fit_shape_model(shapes, times, [reads + writes] if stream else [], call)
    if best is None:
        raise ParsimError("the matmul measurements show no arithmetic term")
    return _matmul_fit(shapes, times, best, call, write=False)


def _fit_shape_model(shapes: np.ndarray, times: np.ndarray, streams: list[np.ndarray],
                     call: bool) -> tuple[float, float, np.ndarray, np.ndarray] | None:
    """The best (relative squared error, h, coefficients, fitted times) over the grid of ``h``: coefficients
    for the arithmetic at the shape's efficiency, each of ``streams`` (bytes) and, with ``call``, a fixed
    cost; None where no ``h`` gives the arithmetic a cost."""
    flops = 2 * shapes.prod(axis=1)
    weights = 1.0 / times
    best = None
    for h in np.concatenate([[0.0], np.geomspace(1, 4096, 200)]):
        work = flops / np.prod(shapes / (shapes + h), axis=1)
        columns = np.stack([work, *streams, *([np.ones_like(times)] if call else [])], axis=1)
        coef = _nonnegative_lstsq(columns * weights[:, None], np.ones_like(times))
        if coef[0] <= 0:
            continue
        fitted = columns @ coef
        err = float(np.mean((fitted / times - 1) ** 2))
        if best is None or err < best[0]:
            best = (err, float(h), coef, fitted)
    return best


def _matmul_fit(shapes: np.ndarray, times: np.ndarray, best: tuple[float, float, np.ndarray, np.ndarray],
                call: bool, write: bool) -> MatmulFit:
    _, h, coef, fitted = best
    streams = coef[1:-1] if call else coef[1:]
    stream_bw = float(1.0 / streams[0]) if len(streams) and streams[0] > 0 else None
    return MatmulFit(float(1.0 / coef[0]), h, [(tuple(int(d) for d in s), float(t), float(f))
                                        for s, t, f in zip(shapes, times, fitted)], stream_bw,
                     float(1.0 / streams[1]) if write else None, float(coef[-1]) if call else 0.0)


# A cache that saves less than this share of the weight's read at the nearest reuse is not followed.
CACHE_MIN_SAVING = 0.1


@dataclass(frozen=True)
class CacheFit:
    """A matmul's weight read from a CPU core's cache: its speed there, and the share of the weight the cache
    still holds by the bytes touched since its last read (KiB, share) points (the ``compute.matmul_cache_hits``
    curve)."""

    cached_bw_Bps: float
    hits: tuple[tuple[int, float], ...]


def fit_cache_hits(samples: Sequence[tuple[float, float]], stream_bw_Bps: float | None,
                   shape: tuple[int, int, int], dtype_bytes: int = 4) -> CacheFit | None:
    """The cache curve from ``samples`` of :func:`executor.compute_bench.measure_cache_hits` (bytes touched
    between two reads of a weight, seconds per call of the ``shape`` (m, n, k) matmul; several per distance, from
    every rank and round: their median). The farthest reuse reads the weight from memory (no hit), the nearest
    from the cache (all of it): the share in between is how far each time lies from the farthest toward the
    nearest. The saving at the nearest, taken off the weight's read at ``stream_bw_Bps`` (the matmul fit's), gives
    the cached read's speed. None where nothing was measured, the matmuls stream nothing, or the cache saves
    under :data:`CACHE_MIN_SAVING` of that read."""
    by_distance: dict[float, list[float]] = {}
    for distance, seconds in samples:
        by_distance.setdefault(distance, []).append(seconds)
    if len(by_distance) < 2 or not stream_bw_Bps:
        return None
    distances = sorted(by_distance)
    times = [float(np.median(by_distance[d])) for d in distances]
    near, far = times[0], times[-1]
    _, n, k = shape
    weight_read_s = k * n * dtype_bytes / stream_bw_Bps
    saving = far - near
    if saving < CACHE_MIN_SAVING * weight_read_s:
        return None
    cached_read_s = max(weight_read_s - saving, CACHE_MIN_SAVING * weight_read_s)
    hits = tuple((math.ceil(d / 1024), float(min(max((far - t) / saving, 0.0), 1.0)))
                 for d, t in zip(distances, times))
    return CacheFit(k * n * dtype_bytes / cached_read_s, hits)


def probe_shape_seconds(matmul: MatmulFit, probe_flops: float, shape: tuple[int, int, int]) -> tuple[float, float]:
    """One call of the matmul probe's ``shape`` (m, n, k): its seconds by the fitted model, and at the probe's
    median reading ``probe_flops``. The probe times that one shape beside the sweep all through a calibration, so
    the two should agree; where they do not, the fit is off at that shape. On the 2-core AMD VM the ratio ran
    0.85-1.10 over sets GA-GP (each shape's runs timed in a row), and course DDP's forward, four matmuls of the
    probe's shape, came out short as far (correlation 0.70 over the 16 sets; docs/calibration.md, "The
    forward's matmul, and the sweep in turns")."""
    m, n, k = shape
    return matmul.model().matmul_time(m, n, k), 2.0 * m * n * k / probe_flops


@dataclass
class DispatchFit:
    forward_s: float  # fixed cost of one op dispatched in a forward
    backward_s: float  # of one op autograd runs in a backward
    rows: list[dict]  # the measurements, each with its matmul time taken out ("matmul_forward_s", ...)
    elementwise_bw_Bps: float | None = None  # elementwise work, in the lowering's bytes (see fit_elementwise)
    pass_s: tuple[float, float] = (0.0, 0.0)  # a forward's and a backward's own cost, once per pass


def fit_dispatch(rows: list[dict], matmuls: ComputeModel) -> DispatchFit:
    """The fixed cost per eager op, forward and backward, and per pass, from eager blocks' times and op counts.

    Each row (see :func:`executor.compute_bench.measure_dispatch`) has its forward and backward
    seconds, the ATen ops of each, the matmuls its forward runs and its blocks (``layers``); the matmuls' time
    (from the fitted matmul model; the backward runs an input- and a weight-gradient matmul for each) is taken
    out. A pass's own cost is what a stack of one block costs beyond its share of a deep one
    (:func:`_pass_cost`); what remains, pooled over every row, is divided by the pooled op count.
    """
    if not rows:
        raise ParsimError("no dispatch measurements to fit")
    work: dict[str, list[tuple[str, int, int, float]]] = {"forward": [], "backward": []}
    kept = []
    for row in rows:
        mm = [tuple(s) for s in row["matmuls"]]
        mm_forward = sum(matmuls.matmul_time(*s) for s in mm)
        mm_backward = sum(matmuls.matmul_time(m, k, n) + matmuls.matmul_time(k, n, m) for m, n, k in mm)
        for direction, matmul_s in (("forward", mm_forward), ("backward", mm_backward)):
            work[direction].append((row["name"], row.get("layers", 0), row[f"{direction}_ops"],
                                    max(row[f"{direction}_s"] - matmul_s, 0.0)))
        kept.append({**row, "matmul_forward_s": mm_forward, "matmul_backward_s": mm_backward})
    per_op, per_pass = [], []
    for direction in ("forward", "backward"):
        pass_s = _pass_cost(work[direction])
        ops = sum(n for _, _, n, _ in work[direction])
        if ops <= 0:
            raise ParsimError("the dispatch measurements counted no ops")
        per_op.append(float(sum(max(s - pass_s, 0.0) for *_, s in work[direction]) / ops))
        per_pass.append(pass_s)
    return DispatchFit(per_op[0], per_op[1], kept, pass_s=(per_pass[0], per_pass[1]))


def _pass_cost(rows: list[tuple[str, int, int, float]]) -> float:
    """A pass's own seconds from rows of (stack, blocks, ops, seconds): for each stack timed at several depths,
    where the line through its (ops, seconds) crosses zero ops; the median over the stacks, at least 0. Only a
    stack's depths tell its pass's cost from its ops' (stacks of different blocks differ in their cost per op, so
    a line across them would not); no stack timed at two depths: 0."""
    by_stack: dict[str, dict[int, list[tuple[int, float]]]] = {}
    for name, layers, ops, seconds in rows:
        by_stack.setdefault(name, {}).setdefault(layers, []).append((ops, seconds))
    intercepts = []
    for depths in by_stack.values():
        if len(depths) < 2:
            continue
        points = np.array([np.mean(readings, axis=0) for readings in depths.values()])  # each depth's mean
        intercepts.append(np.polyfit(points[:, 0], points[:, 1], 1)[1])
    return max(float(np.median(intercepts)), 0.0) if intercepts else 0.0


# The compute probes (executor.speed_probe), each paired with the work it stands for: matmuls, eager ops' fixed
# costs, memory-bound work (executor.compute_bench.probe_pairs).
COMPUTE_PROBES = tuple(PROBE_KEYS)
# The fewest readings, and the least spread of the probe's (sd of its log), a calibration fits a work's
# elasticity on; with less, compare follows the probe all the way, as it did before the fit.
ELASTICITY_MIN_READINGS, ELASTICITY_MIN_SPREAD = 6, 0.02


def fit_probe_elasticity(pairs: Sequence[tuple[float, float]]) -> float | None:
    """How far the work a probe stands for follows that probe on this host: the slope of log(work's seconds) on
    log(probe's seconds) over a calibration's readings (``executor.compute_bench.probe_pairs``), between 0 (the
    work did not follow it) and 1 (in step); None with fewer than :data:`ELASTICITY_MIN_READINGS` or readings that
    hardly moved. ``parsim compare`` scales that work's costs by the probe's ratio to this power.

    A least-squares slope is the best linear predictor of the work from the probe: where the probe reads the
    host's moments more than its speed, the slope falls below the work's own response (regression dilution),
    and the prediction follows the probe only that far. On the 2-core AMD VM (2026-11-30) the eager probe read
    the host 1.15-1.6x as fast as calibration around tiny PP's runs in four sets of five while its steps ran at
    about the calibration's speed, and over a calibration's 28 readings the reference layers' passes followed it
    at a slope of 0.57 (docs/calibration.md, "Another host"). Over 16 points in 2.6 minutes there, both ranks
    busy, the slopes pooled over the ranks were 0.14 (matmuls on the matmul probe), 0.05 (eager) and 0.59
    (AdamW on the memory probe), the probes' readings moving 10-25% (sd of their logs)."""
    if len(pairs) < ELASTICITY_MIN_READINGS:
        return None
    probe, work = np.log(np.asarray(pairs, dtype=float)).T
    if probe.std() < ELASTICITY_MIN_SPREAD:
        return None
    slope = np.cov(probe, work, bias=True)[0, 1] / probe.var()
    return float(np.clip(slope, 0.0, 1.0))


def fit_elementwise(rows: list[dict], dispatch: DispatchFit) -> float:
    """Bytes per second of memory-bound kernels' work, the bytes counted as
    :class:`parsim.workload.model.Elementwise` counts them (every tensor each op reads and writes).

    Each row (:func:`executor.compute_bench.measure_elementwise`) gives forward and backward seconds of a
    chain of such kernels, their ops and their bytes; the ops' fixed costs (``dispatch``) are taken out, and
    the rate is the pooled bytes over the pooled rest.
    """
    nbytes = seconds = 0.0
    for row in rows:
        nbytes += row["forward_bytes"] + row["backward_bytes"]
        seconds += max(row["forward_s"] + row["backward_s"] - row["forward_ops"] * dispatch.forward_s
                       - row["backward_ops"] * dispatch.backward_s, 0.0)
    if not rows or seconds <= 0:
        raise ParsimError("the elementwise measurements show no time beyond the ops' fixed costs")
    return float(nbytes / seconds)


# Elements each kernel of parsim.workload.model.Elementwise reads or writes per element of its input, forward and
# backward (a unary kernel: read and write; its backward reads the input and the output's gradient and writes the
# input's), as SmWork counts them.
UNARY_ELEMENTS = (2, 3)


def fit_core_arithmetic(rows: list[dict], dispatch: DispatchFit) -> CoreArithmetic:
    """A core's seconds per element of GeLU, norms and softmax, forward and backward, from each kind's times
    on its own (:func:`executor.compute_bench.measure_kernel_kinds`, pooled over ranks and rounds): the ops'
    fixed costs (``dispatch``) taken out, over the elements the simulator counts (:data:`UNARY_ELEMENTS`).
    Everything of the kernel but its dispatch: the model takes the longer of this and its bytes."""
    figures = {}
    for kind in CORE_ARITHMETIC_KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            raise ParsimError(f"no measurement of {kind} kernels to fit a core's time per element")
        passes = []
        for direction, per_op, elements in (("forward", dispatch.forward_s, UNARY_ELEMENTS[0]),
                                            ("backward", dispatch.backward_s, UNARY_ELEMENTS[1])):
            seconds = sum(max(r[f"{direction}_s"] - r[f"{direction}_ops"] * per_op, 0.0) for r in mine)
            count = sum(elements * r["elements"] for r in mine)
            if seconds <= 0:
                raise ParsimError(f"the {kind} {direction} measurements show no time beyond the ops' fixed costs")
            passes.append(seconds / count)
        figures[kind] = tuple(passes)
    return CoreArithmetic(**figures)


def fit_tp_calls(rows: list[dict | None]) -> tuple[float, float] | None:
    """A tensor-parallel collective call's host time, forward and backward: the medians over ranks and rounds
    of :func:`executor.compute_bench.measure_tp_calls` (None where no rank measured it)."""
    rows = [r for r in rows if r is not None]
    if not rows:
        return None
    return float(np.median([r["forward_s"] for r in rows])), float(np.median([r["backward_s"] for r in rows]))


@dataclass
class OptimizerFit:
    """A step's fixed costs and bandwidth: AdamW's (:func:`fit_optimizer`) or zero_grad's (:func:`fit_zero_grad`)."""

    tensor_s: float  # fixed cost per parameter tensor
    step_s: float  # fixed cost per step, whatever its tensors
    bw_Bps: float  # bytes per second over parsim's ADAMW_ACCESSES fp32 accesses per parameter
    rows: list[tuple[int, int, float, float]]  # tensors, elements each, measured s, fitted s


def fit_optimizer(rows: list[tuple[int, int, float]], accesses: int, element_bytes: int = 4) -> OptimizerFit:
    """``t = step + tensors * c + params * accesses * element_bytes / bw`` by least squares on relative error
    (every term >= 0), from AdamW steps on one small tensor, many small ones and a few large ones. torch's
    foreach AdamW makes a dozen calls per step whatever its tensors, and each loops over the tensors on a
    CPU: a step over one tensor costs several tensors' worth."""
    if len(rows) < 3:
        raise ParsimError("the optimizer fit needs at least three measurements")
    tensors = np.array([r[0] for r in rows], dtype=float)
    nbytes = np.array([r[0] * r[1] for r in rows], dtype=float) * accesses * element_bytes
    times = np.array([r[2] for r in rows])
    a = np.stack([np.ones_like(tensors), tensors, nbytes], axis=1) / times[:, None]
    step_s, tensor_s, inverse_bw = _nonnegative_lstsq(a, np.ones_like(times))
    if inverse_bw <= 0:
        raise ParsimError("the optimizer measurements show no bandwidth term (use larger tensors)")
    fitted = step_s + tensors * tensor_s + nbytes * inverse_bw
    return OptimizerFit(float(tensor_s), float(step_s), float(1.0 / inverse_bw),
                        [(int(r[0]), int(r[1]), float(r[2]), float(f)) for r, f in zip(rows, fitted)])


def fit_zero_grad(rows: list[tuple[int, int, float]], element_bytes: int = 4) -> OptimizerFit:
    """``zero_grad(set_to_none=True)``'s cost from its times over (tensors, fp32 elements each): per step, per
    tensor, and the speed it frees gradients at (:func:`executor.compute_bench.measure_zero_grad`, pooled over
    ranks). The same fit as AdamW's, each element freed once: freeing hands the pages back, by the byte."""
    return fit_optimizer(rows, 1, element_bytes)


@dataclass(frozen=True)
class FsdpHostFit:
    """FSDP2's own host work on a CPU rank (:func:`fit_fsdp_host`)."""

    unshard_s: float  # a unit unsharded and resharded around a pass that gathers it
    reduce_s: float  # a unit's post-backward beyond that (the reduce-scatter's copy-in, resharding)
    tensor_s: float  # an AdamW step's extra per DTensor parameter
    # a unit's hooks in a forward and in a backward that gather and reduce nothing (a pipeline's passes
    # between a stage's first and last); None: not measured
    pass_s: tuple[float, float] | None = None


def fit_fsdp_host(rows: list[tuple]) -> FsdpHostFit | None:
    """FSDP2's host work from stacks of units timed plain and ``fully_shard``-ed
    (:func:`executor.compute_bench.measure_fsdp_host`; rows of every rank pooled): per unit, the slope of what
    FSDP2 adds between the smallest and the largest stack (the root's own costs cancel), each count's
    median over the ranks. A forward gathers and reshards each unit once; a backward (resharded after the
    forward, FSDP2's default) gathers it again and reduces its gradients, so the reduction is the backward's
    extra beyond the forward's. Rows with a fifth entry (units kept unsharded, gradients unsynced) give what
    a pass that moves nothing adds. None without two stack sizes."""
    extra: dict[int, list[tuple[float, ...]]] = {}
    for units, tensors, plain, sharded, *kept in rows:
        moving_nothing = tuple(k - p for p, k in zip(plain, kept[0])) if kept else ()
        extra.setdefault(int(units), []).append((*(s - p for p, s in zip(plain, sharded)), int(tensors),
                                                 *moving_nothing))
    if len(extra) < 2:
        return None
    low, high = min(extra), max(extra)

    def per_unit(k: int) -> float:
        return (float(np.median([r[k] for r in extra[high]])) - float(np.median([r[k] for r in extra[low]]))) / (
            high - low)

    tensors_per_unit = (extra[high][0][3] - extra[low][0][3]) / (high - low)
    forward = max(per_unit(0), 0.0)
    measured_passes = all(len(r) == 6 for n in (low, high) for r in extra[n])
    return FsdpHostFit(forward, max(per_unit(1) - forward, 0.0), max(per_unit(2), 0.0) / tensors_per_unit,
                       (max(per_unit(4), 0.0), max(per_unit(5), 0.0)) if measured_passes else None)


# The mean of |x - y| over independent x, y ~ N(0, sigma^2), in sigmas: 2 / sqrt(pi).
MEAN_ABS_DIFFERENCE = 2.0 / math.sqrt(math.pi)


def _kib_curve_us(seconds: float | Sequence[tuple[int, float]]) -> float | dict[int, float]:
    """A host cost for the cluster file, in microseconds: one figure, or figures keyed by KiB (of the gradients a
    rank holds, or of a call's bytes; a single point at 0, the same for every size, is one figure: the file's keys
    are sizes)."""
    if isinstance(seconds, (int, float)):
        return seconds * 1e6
    if len(seconds) == 1 and seconds[0][0] == 0:
        return seconds[0][1] * 1e6
    return {int(kib): s * 1e6 for kib, s in seconds}


def fit_rank_jitter(rounds: list[list[list[float]]]) -> float:
    """How much the same work's time varies between ranks that start it together, as a fraction of that time
    (``parsim.sim.jitter``): from each round's per-rank step times (:func:`executor.compute_bench.
    measure_rank_jitter`: every rank's k-th step started at once), the mean over the steps and every pair of
    ranks of ``|t_a - t_b|``, in the normal's sigmas (:data:`MEAN_ABS_DIFFERENCE`), over the median step. The
    mean, because the differences are no normal's: on the 2-core VM (2026-11-29, 100 steps of 14 ms, three
    runs) a quarter of the pairs ended within 0.1-0.3 ms and a quarter 1.7-2.6 ms or more apart, so their
    median jumped between the two (2.9%, 5.0%, 9.3%) where their mean held (6.6%, 9.5%, 10.4%); and the
    model's wait is a mean too (two ranks alike wait ``mean |t_a - t_b| / 2``). 0 without two ranks' times."""
    differences, times = [], []
    for ranks in rounds:
        for a in range(len(ranks)):
            times += ranks[a]
            for b in range(a + 1, len(ranks)):
                differences += [abs(x - y) for x, y in zip(ranks[a], ranks[b])]
    if not differences or not times:
        return 0.0
    return float(np.mean(differences)) / MEAN_ABS_DIFFERENCE / float(np.median(times))


def fit_alone_memory(rows: list[tuple[int, int, float]], fit: OptimizerFit, accesses: int,
                     element_bytes: int = 4) -> float:
    """The memory speed of one rank streaming while the host's other ranks wait: the median over ``rows``
    (tensors, elements each, seconds: each rank's AdamW step alone) of its bytes over its time less the fixed
    costs per step and per tensor (``fit``, from :func:`fit_optimizer`)."""
    fixed = [fit.step_s + tensors * fit.tensor_s for tensors, _, _ in rows]
    speeds = [tensors * numel * accesses * element_bytes / (seconds - cost)
              for (tensors, numel, seconds), cost in zip(rows, fixed) if seconds > cost]
    if not speeds:
        raise ParsimError("the optimizer steps run alone show no bandwidth term (use larger tensors)")
    return float(np.median(speeds))
