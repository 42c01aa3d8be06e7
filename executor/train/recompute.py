"""Full activation recomputation with ``torch.utils.checkpoint``, as Megatron-LM's "full" method runs it.

A recomputed layer keeps only its input after the forward; its backward
first runs the whole forward again, tensor-parallel collectives included,
then back-propagates. Two settings make that match the simulator's ``R``
pass op for op:

- non-reentrant checkpointing with early stop off: by default torch stops
  the re-run as soon as every tensor the backward needs exists, which would
  skip a block's final all-reduce (nothing is saved after it); Megatron-LM's
  ``CheckpointFunction`` reruns the whole layer, and so does this;
- the re-run's collectives are named ``dir=rec<i>`` (the recorder's
  :meth:`~executor.train.trace_recorder.Recorder.recomputing`), the names the
  lowering gives the ``R`` pass.
"""

from __future__ import annotations

import contextlib
from typing import Any

from .._torch import require_torch
from .models import Piece
from .trace_recorder import Recorder

torch = require_torch()
nn = torch.nn
checkpoint = torch.utils.checkpoint


class Recomputed(nn.Module):
    """``layer`` whose activations are dropped after the forward and rebuilt in the backward."""

    def __init__(self, layer: Any, recorder: Recorder):
        super().__init__()
        self.layer, self.recorder = layer, recorder

    def forward(self, x):
        with checkpoint.set_checkpoint_early_stop(False):
            return checkpoint.checkpoint(self.layer, x, use_reentrant=False, context_fn=self._contexts)

    def _contexts(self) -> tuple[Any, Any]:
        """(context of the first forward, context of the re-run)."""
        return contextlib.nullcontext(), self.recorder.recomputing()


def apply_activation_recompute(pieces: list[Piece], recomputed: set[str], recorder: Recorder) -> list[Piece]:
    """``pieces`` with those named in ``recomputed`` wrapped in :class:`Recomputed`."""
    return [Piece(p.name, Recomputed(p.module, recorder)) if p.name in recomputed else p for p in pieces]
