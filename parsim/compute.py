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
  that ``parsim calibrate`` fits on CPUs (``half_dim`` 0 for GPUs).
* **The attention core** (FlashAttention): its FLOPs at the fraction of peak
  the kernel reaches, forward and backward separately.
* **Memory-bound kernels** (norms, activations, residuals, softmax, the
  optimizer): bytes over the HBM bandwidth such kernels measure
  (``memory_efficiency`` of the spec sheet's figure); other FLOPs at peak.
* **A fixed cost per kernel**, ``kernel_overhead_s``: launch (GPU) or
  dispatch (eager CPU). It dominates small models.

The defaults (every efficiency 1, no tiles, no overhead) are the pure
roofline, an optimistic bound; built-in clusters give sourced figures and
``parsim calibrate`` measured ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cluster import ClusterSpec
from .errors import ParsimError

MATMUL_TILE = 128  # cuBLAS/CUTLASS's common 128 x 128 output tile per thread block (SM80/SM90)


@dataclass(frozen=True)
class ComputeModel:
    peak_flops: float  # FLOP/s for the plan's dtype
    hbm_bw_Bps: float
    dtype_bytes: int
    efficiency: float = 1.0  # matmuls' best fraction of peak
    half_dim: float = 0.0
    kernel_overhead_s: float = 0.0
    matmul_peak_flops: float | None = None  # matmuls' own peak when they run in another dtype (fp8)
    sm_count: int = 0  # 0: no wave quantization (CPUs)
    memory_efficiency: float = 1.0
    attention_efficiency: tuple[float, float] = (1.0, 1.0)  # forward, backward

    @classmethod
    def for_cluster(cls, spec: ClusterSpec, dtype: str, dtype_bytes: int) -> "ComputeModel":
        """fp8 plans run matmuls at the fp8 peak and the rest (attention core) at the bf16 peak."""
        other = "bf16" if dtype == "fp8" else dtype
        for needed in {dtype, other}:
            if needed not in spec.gpu.peak_flops:
                raise ParsimError(f"{spec.name}: the GPU has no {needed} peak in its cluster file "
                                  f"(it lists {', '.join(spec.gpu.peak_flops)})")
        peaks = spec.gpu.peak_flops
        return cls(peaks[other], spec.gpu.hbm_bw_Bps, dtype_bytes, spec.matmul_efficiency_for(dtype),
                   spec.matmul_half_dim, spec.kernel_overhead_s, peaks[dtype] if dtype != other else None,
                   spec.gpu.sm_count, spec.memory_efficiency, spec.attention_efficiency)

    def waves(self, m: float, n: float) -> float:
        """Share of the tile work that is useful: tile quantization (edge tiles partly filled still
        cost whole tiles) times wave quantization (a last, partly filled wave costs a whole one)."""
        if not self.sm_count:
            return 1.0
        rows, cols = -(-int(m) // MATMUL_TILE), -(-int(n) // MATMUL_TILE)
        tiles = rows * cols
        filled = m * n / (tiles * MATMUL_TILE * MATMUL_TILE)
        return filled * tiles / (-(-tiles // self.sm_count) * self.sm_count)

    def matmul_rate(self, m: float, n: float, k: float) -> float:
        shape = 1.0
        for d in (m, n, k):
            shape *= d / (d + self.half_dim)
        return (self.matmul_peak_flops or self.peak_flops) * self.efficiency * shape * self.waves(m, n)

    @property
    def memory_bw_Bps(self) -> float:
        return self.hbm_bw_Bps * self.memory_efficiency

    def matmul_time(self, m: float, n: float, k: float) -> float:
        flops = 2.0 * m * n * k
        traffic = (m * k + k * n + m * n) * self.dtype_bytes
        return max(flops / self.matmul_rate(m, n, k), traffic / self.memory_bw_Bps)

    def time(self, matmuls=(), flops: float = 0.0, hbm_bytes: float = 0.0, kernels: int = 0,
             attention_flops: float = 0.0, attention_grad_flops: float = 0.0) -> float:
        """Matmuls at their shape's rate, the attention core's forward and backward FLOPs at the
        kernel's rates, other FLOPs at peak and memory-bound bytes at HBM speed, plus launches."""
        total = sum(self.matmul_time(*mm) for mm in matmuls)
        forward, backward = self.attention_efficiency
        total += (attention_flops / forward + attention_grad_flops / backward) / self.peak_flops
        work = max(flops / self.peak_flops, hbm_bytes / self.memory_bw_Bps)
        return total + work + kernels * self.kernel_overhead_s
