"""fp16's dynamic loss scaling: the rule of ``torch.amp.GradScaler`` and Megatron-LM's ``DynamicGradScaler``.

fp16 keeps 5 exponent bits: gradients under 6e-8 flush to zero. The loss is
multiplied by a large scale before the backward, so the gradients come out
scaled, and divided by it again before the step. Gradients that overflowed
(infinite or NaN anywhere, on any rank) skip the step and halve the scale;
after ``growth_interval`` good steps in a row the scale doubles. Unscaling
and the check are one multi-tensor pass
(``torch._amp_foreach_non_finite_check_and_unscale_``, recorded as ``unscale
grads``); the ranks holding different gradients then take the maximum of
their flags, one all-reduce of a number per parallel dimension (``all_reduce
found_inf dim=D``, :mod:`executor.train.held_gradients`), as the simulator's
lowering names them.
"""

from __future__ import annotations

from .._torch import require_distributed, require_torch
from .held_gradients import HeldGradients

torch = require_torch()
dist = require_distributed()

INITIAL_SCALE = 2.0 ** 16  # torch.amp.GradScaler's init_scale
GROWTH_INTERVAL = 2000  # torch.amp.GradScaler's growth_interval (good steps before the scale doubles)


class DynamicLossScaler:
    """The loss scale of one rank's steps (every rank keeps the same one) and the unscaling of ``held``."""

    def __init__(self, held: HeldGradients, scale: float = INITIAL_SCALE, growth_interval: int = GROWTH_INTERVAL):
        self.held, self.scale, self.growth_interval = held, scale, growth_interval
        self._good_steps = 0

    def unscale(self) -> bool:
        """Divide every gradient the rank holds by the scale; whether all gradients, on every rank, are finite
        (every rank calls it together)."""
        found_inf = torch.zeros(1, dtype=torch.float32, device=self.held.device)
        with self.held.recorder.span("unscale grads", "compute", "compute", phase="optimizer"):
            inverse = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=self.held.device)
            for grads in self.held.tensors().values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inverse)
        self.held.all_reduce(found_inf, "found_inf", dist.ReduceOp.MAX)
        return found_inf.item() == 0

    def update(self, finite: bool) -> None:
        """The next step's scale: half after an overflow, double after ``growth_interval`` good steps."""
        if not finite:
            self.scale, self._good_steps = self.scale / 2, 0
            return
        self._good_steps += 1
        if self._good_steps == self.growth_interval:
            self.scale, self._good_steps = self.scale * 2, 0
