"""Gradient clipping by the global norm, over every way a plan splits the gradients.

``torch.nn.utils.clip_grad_norm_`` on one process: the L2 norm of all
gradients together, and every gradient scaled by ``min(1, max_norm / (norm +
1e-6))``. A rank holds only part of them (:mod:`executor.train.held_gradients`),
so it sums the squares of what it holds and the ranks holding different parts
add their sums, one all-reduce of a number per parallel dimension, as
Megatron-LM's ``clip_grad_norm_fp32`` (over the model-parallel group) and
torchtitan's ``clip_grad_norm_`` (over the FSDP and tensor-parallel mesh, then
the pipeline group) do. The executor records the local norm as ``grad norm``
and each sum as ``all_reduce grad_norm dim=D``, as the simulator's lowering
names them; the scaling runs inside ``optimizer step``.
"""

from __future__ import annotations

from typing import Any

from .._torch import require_torch
from .held_gradients import HeldGradients, local

torch = require_torch()

EPSILON = 1e-6  # torch.nn.utils.clip_grads_with_norm_: max_norm / (total_norm + 1e-6)


class GradClipper:
    """Clips the gradients a rank holds (``held``) to a global norm of ``max_norm``."""

    def __init__(self, max_norm: float, held: HeldGradients):
        self.max_norm, self.held = max_norm, held
        self._coefficient: Any = None

    def norm(self) -> float:
        """The global gradient norm (every rank calls it together); :meth:`scale` then applies the clip."""
        with self.held.recorder.span("grad norm", "compute", "compute", phase="optimizer"):
            parts = [(local(g), share) for g, share in self.held.pieces() if g is not None and g.numel() and share]
            squares = torch.zeros((), dtype=torch.float32, device=self.held.device)
            if parts:  # one multi-tensor pass, as clip_grad_norm_'s torch._foreach_norm
                norms = torch.stack(torch._foreach_norm([g for g, _ in parts], dtype=torch.float32))
                shares = torch.tensor([share for _, share in parts], dtype=torch.float32, device=norms.device)
                squares += (norms.square() * shares).sum()
        self.held.all_reduce(squares, "grad_norm")
        total = squares.sqrt()
        self._coefficient = torch.clamp(self.max_norm / (total + EPSILON), max=1.0)
        return total.item()

    def scale(self) -> None:
        """Scale every gradient the rank holds by the coefficient :meth:`norm` found (one multi-tensor pass per
        dtype, as clip_grad_norm_'s torch._foreach_mul_)."""
        with torch.no_grad():
            for dtype, grads in self.held.tensors().items():
                torch._foreach_mul_(grads, self._coefficient.to(dtype))
