"""Fit one GPU's kernel figures (:mod:`parsim.sim.compute`) to measurements of it.

``parsim calibrate --ranks 1`` times kernels on the GPU at hand
(:mod:`executor.gpu_bench`) and rewrites the ``compute:`` figures of the
built-in cluster with that GPU; everything else (peaks, links, NCCL) stays the
spec sheet's, since one GPU measures no collective. Each figure follows the
rule its built-in value was sourced by:

* ``matmul_efficiency``: the best rate over the matmuls timed, divided by the
  peak, the shape's tile and wave fill and its tile cost in k
  (``k / (k + matmul_k_overhead)``, the base file's), as the maximum achievable
  matmul FLOPS (MAMF) takes the best shape of a sweep;
* ``memory_efficiency``: the median rate of plain memory-bound kernels (copy,
  add, multiply, SiLU) over the spec sheet's HBM bandwidth, as a STREAM figure;
* ``attention_efficiency``: causal attention's rate by sequence length, forward
  and backward, over the FLOPs the model counts, as FlashAttention-3's figures;
* ``sm_cycles``: the SM cycles per element of the memory-bound kernels whose
  arithmetic may outlast their bytes (softmax by row length, dropout, GeLU, a
  norm): seconds x SMs x clock over the elements the model counts, as the
  built-in figures were measured (:data:`parsim.hardware.cluster.HOPPER_SM_CYCLES`); a fused AdamW step's
  (``adamw``) per parameter from its time less its bytes' at the memory-bound rate measured beside it, since
  its cycles add to its bytes;
* ``op_forward_us``, ``op_backward_us``: the host's time per eager op, forward
  and backward, pooled over eager blocks too small to keep the GPU busy (as
  ``parsim calibrate`` fits a CPU host's); ``optimizer_tensor_us`` and
  ``optimizer_step_us``: torch's default AdamW step on one and on many small
  tensors, the line through the two. A GPU runs its kernels while
  the host issues the next, so these bind only small models
  (:class:`parsim.sim.compute.ComputeModel`, ``host_overlaps_device``).
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass
from typing import Any

from ..errors import ParsimError
from ..hardware.cluster import ClusterSpec, SmCycles
from ..sim.compute import ComputeModel
from ..workload.plan import DTYPE_BYTES

# The host's figures: ``{name}_us`` in a cluster file, ``{name}_s`` on a GpuFit and a ClusterSpec.
HOST_FIGURES = ("op_forward", "op_backward", "optimizer_tensor", "optimizer_step")


def host_us(figures: Any) -> dict[str, float]:
    """A GpuFit's or a ClusterSpec's host figures in microseconds, by name (HOST_FIGURES)."""
    return {name: getattr(figures, f"{name}_s") * 1e6 for name in HOST_FIGURES}


@dataclass(frozen=True)
class GpuFit:
    """One GPU's fitted compute figures, as the cluster file's ``compute:`` keys take them."""

    matmul_efficiency: float
    memory_efficiency: float
    attention: dict[str, dict[int, float]]  # "forward" / "backward" -> {sequence length: fraction of peak}
    op_forward_s: float = 0.0  # host time per eager op (0: not measured)
    op_backward_s: float = 0.0
    optimizer_tensor_s: float = 0.0
    optimizer_step_s: float = 0.0
    sm_cycles: SmCycles | None = None  # None: not measured (no such rows, or the GPU's SM clock is not known)


def fit_sm_cycles(rows: list[dict], sm_cycles_per_s: float, base: SmCycles,
                  memory_Bps: float | None = None) -> SmCycles | None:
    """SM cycles per element of the ``sm`` rows (:func:`executor.gpu_bench.sm_rows`): seconds x SMs x clock
    over the elements the model counts, the median where a kernel was timed more than once; and per parameter
    of the ``optimizer`` rows (:func:`executor.gpu_bench.adamw_row`), their seconds beyond their bytes at
    ``memory_Bps`` (None: not fitted); ``base``'s figures for kinds not timed."""
    timed = [r for r in rows if r["kind"] == "sm"]
    if not timed or not sm_cycles_per_s:
        return None
    steps = [r for r in rows if r["kind"] == "optimizer"] if memory_Bps else []
    adamw = statistics.median(max(r["measured_s"] - r["work"]["bytes"] / memory_Bps, 0.0) * sm_cycles_per_s
                              / r["work"]["params"] for r in steps) if steps else base.adamw
    per_element: dict[tuple[str, str, int], list[float]] = {}
    for r in timed:
        work = r["work"]
        key = (work["sm"], work["pass"], work.get("row", 0))
        per_element.setdefault(key, []).append(r["measured_s"] * sm_cycles_per_s / work["elements"])
    figure = {key: statistics.median(values) for key, values in per_element.items()}

    def passes(kind: str, fallback: tuple[float, float]) -> tuple[float, float]:
        return tuple(figure.get((kind, p, 0), old) for p, old in zip(("forward", "backward"), fallback))

    softmax = tuple(sorted((row, f) for (kind, _, row), f in figure.items() if kind == "softmax"))
    return SmCycles(softmax=softmax or base.softmax, dropout=figure.get(("dropout", "forward", 0), base.dropout),
                    gelu=passes("gelu", base.gelu), norm=passes("norm", base.norm),
                    bias_add=figure.get(("bias_add", "forward", 0), base.bias_add), adamw=adamw)


def sm_cycles_mapping(figures: SmCycles) -> dict[str, Any]:
    """``figures`` as a cluster file's ``compute.sm_cycles`` takes them."""
    def both(pair: tuple[float, float]) -> dict[str, float]:
        return {"forward": round(pair[0], 4), "backward": round(pair[1], 4)}

    return {"softmax": {row: round(f, 4) for row, f in figures.softmax}, "dropout": round(figures.dropout, 4),
            "gelu": both(figures.gelu), "norm": both(figures.norm), "bias_add": round(figures.bias_add, 4),
            "adamw": round(figures.adamw, 4)}


def fit_gpu(rows: list[dict], spec: ClusterSpec, dtype: str = "bf16") -> GpuFit:
    """The compute figures of ``spec``'s GPU that reproduce ``rows`` (:mod:`executor.gpu_bench`'s)."""
    model = ComputeModel.for_cluster(spec, dtype, DTYPE_BYTES[dtype])
    peak = model.matmul_peak_flops or model.peak_flops
    matmuls = [r for r in rows if r["kind"] == "matmul"]
    memory = [r for r in rows if r["kind"] == "memory"]
    if not matmuls or not memory:
        raise ParsimError("a GPU calibration needs matmul and memory-bound measurements")
    # over the rate at efficiency 1: the peak, the tile fill and the tile's fixed cost in k (matmul_k_overhead)
    best = max(2 * m * n * k / r["measured_s"] / (model.matmul_rate(m, n, k) / model.efficiency)
               for r in matmuls for m, n, k in [r["work"]["mnk"]])
    streamed = statistics.median(r["work"]["bytes"] / r["measured_s"] for r in memory)
    attention: dict[str, dict[int, list[float]]] = {"forward": {}, "backward": {}}
    for r in rows:
        if r["kind"] == "attention":
            work = r["work"]
            attention[work["pass"]].setdefault(work["seq"], []).append(work["flops"] / r["measured_s"] / peak)
    return GpuFit(_fraction(best), _fraction(streamed / spec.gpu.hbm_bw_Bps),
                  {p: {seq: _fraction(statistics.median(v)) for seq, v in sorted(by_seq.items())}
                   for p, by_seq in attention.items()},
                  *(_per_op([r for r in rows if r["kind"] == "host" and r["work"].get("pass") == p])
                    for p in ("forward", "backward")),
                  *_optimizer_line([r for r in rows if r["kind"] == "host" and r["work"].get("optimizer_tensors")]),
                  fit_sm_cycles(rows, spec.gpu.sm_cycles_per_s, spec.sm_cycles, streamed))


def _per_op(rows: list[dict]) -> float:
    """Pooled seconds over the pooled ops of the rows that count them; 0 without any."""
    counted = [r for r in rows if r["work"].get("ops")]
    return sum(r["measured_s"] for r in counted) / sum(r["work"]["ops"] for r in counted) if counted else 0.0


def _optimizer_line(rows: list[dict]) -> tuple[float, float]:
    """(seconds per tensor, seconds per step) of AdamW steps over different numbers of tensors: the line through
    the fewest's and the most's (a single count: all of it per tensor; none: 0, 0)."""
    if not rows:
        return 0.0, 0.0
    few, many = (min(rows, key=lambda r: r["work"]["optimizer_tensors"]),
                 max(rows, key=lambda r: r["work"]["optimizer_tensors"]))
    n_few, n_many = few["work"]["optimizer_tensors"], many["work"]["optimizer_tensors"]
    if n_few == n_many:
        return many["measured_s"] / n_many, 0.0
    per_tensor = max((many["measured_s"] - few["measured_s"]) / (n_many - n_few), 0.0)
    return per_tensor, max(few["measured_s"] - n_few * per_tensor, 0.0)


def gpu_cluster(base: dict[str, Any], fit: GpuFit, name: str, description: str, dtype: str = "bf16") -> dict:
    """``base`` (a cluster file's mapping) with its GPU's compute figures replaced by ``fit``'s."""
    data = copy.deepcopy(base)
    data["name"], data["description"] = name, description
    compute = data.setdefault("compute", {})
    matmul = compute.get("matmul_efficiency", 1.0)
    others = matmul if isinstance(matmul, dict) else {d: matmul for d in data["gpu"]["peak_tflops"]}
    compute["matmul_efficiency"] = {**others, dtype: round(fit.matmul_efficiency, 4)}
    compute["memory_efficiency"] = round(fit.memory_efficiency, 4)
    measured = {p: {seq: round(f, 4) for seq, f in by_seq.items()} for p, by_seq in fit.attention.items() if by_seq}
    if measured:
        compute["attention_efficiency"] = {**compute.get("attention_efficiency", {}), **measured}
    compute.update({f"{name}_us": round(us, 3) for name, us in host_us(fit).items() if us})
    if fit.sm_cycles is not None:
        compute["sm_cycles"] = sm_cycles_mapping(fit.sm_cycles)
    return data


def gpu_payload(out: str, device: str, base_cluster: str, fit: GpuFit, rows: list[dict]) -> dict:
    """What ``parsim calibrate --ranks 1 --json`` prints (``parsim.calibrate.gpu/1``)."""
    return {"out": out, "device": device, "base_cluster": base_cluster,
            "matmul_efficiency": fit.matmul_efficiency, "memory_efficiency": fit.memory_efficiency,
            "attention_efficiency": {p: {str(seq): f for seq, f in by_seq.items()}
                                     for p, by_seq in fit.attention.items()},
            "host_us": host_us(fit),
            "sm_cycles": None if fit.sm_cycles is None else sm_cycles_mapping(fit.sm_cycles),
            "rows": [{k: r[k] for k in ("kind", "what", "measured_s", "work")} for r in rows]}


def _fraction(value: float) -> float:
    """A measured fraction of a spec-sheet figure, at most the figure itself (as cluster files require)."""
    return min(float(value), 1.0)
