"""Gradient clipping by the global norm, over every way a plan splits the gradients.

``torch.nn.utils.clip_grad_norm_`` on one process: the L2 norm of all
gradients together, and every gradient scaled by ``min(1, max_norm / (norm +
1e-6))``. A rank holds only part of them, so it sums the squares of what it
holds and the ranks holding different parts add their sums, one all-reduce of
a number per parallel dimension, as Megatron-LM's ``clip_grad_norm_fp32`` (over
the model-parallel group) and torchtitan's ``clip_grad_norm_`` (over the FSDP
and tensor-parallel mesh, then the pipeline group) do:

* ``shard``: ZeRO-1/2's owned slices and FSDP's shards differ across the
  shard group (HSDP's replicas hold the same ones: no sum over them);
* ``ep``: each expert-parallel rank holds other routed experts;
* ``tp``: tensor-parallel ranks hold other slices of the split weights;
* ``pp``: pipeline ranks hold other stages.

A gradient that several ranks of one such group hold alike (a norm's gain on
every tensor-parallel rank, a dense weight on every expert-parallel rank, the
tied table's second copy on the last pipeline rank) counts ``1 / copies`` on
each, so the sums add it once. Data- and context-parallel replicas hold the
same gradients after the sync and need no sum. The executor records the local
norm as ``grad norm`` and each sum as ``all_reduce grad_norm dim=D``, as the
simulator's lowering names them; the scaling runs inside ``optimizer step``.
"""

from __future__ import annotations

from typing import Any, Callable

from parsim.plan import Plan
from parsim.trace import collective_name

from .._torch import require_distributed, require_torch
from .mixed_precision import gradient
from .trace_recorder import Recorder

torch = require_torch()
dist = require_distributed()

EPSILON = 1e-6  # torch.nn.utils.clip_grads_with_norm_: max_norm / (total_norm + 1e-6)


class GradClipper:
    """Clips this rank's gradients to a global norm of ``max_norm``.

    ``pieces()`` gives the gradient parts the rank holds, each with the share of it this rank counts
    (``1 / copies``); ``groups`` the (dimension, process group) pairs to sum the squares over, in order.
    """

    def __init__(self, max_norm: float, pieces: Callable[[], list[tuple[Any, float]]],
                 groups: list[tuple[str, Any]], recorder: Recorder, device: Any):
        self.max_norm, self.pieces, self.groups, self.recorder = max_norm, pieces, groups, recorder
        self.device = device
        self._coefficient: Any = None

    def norm(self) -> float:
        """The global gradient norm (every rank calls it together); :meth:`scale` then applies the clip."""
        with self.recorder.span("grad norm", "compute", "compute", phase="optimizer"):
            held = [(local(g), share) for g, share in self.pieces() if g is not None and g.numel() and share]
            squares = torch.zeros((), dtype=torch.float32, device=self.device)
            if held:  # one multi-tensor pass, as clip_grad_norm_'s torch._foreach_norm
                norms = torch.stack(torch._foreach_norm([g for g, _ in held], dtype=torch.float32))
                shares = torch.tensor([share for _, share in held], dtype=torch.float32, device=norms.device)
                squares += (norms.square() * shares).sum()
        for dim, group in self.groups:
            with self.recorder.span(collective_name("all_reduce", "grad_norm", dim=dim), "collective", "comm",
                                    phase="optimizer", bytes=squares.element_size()):
                dist.all_reduce(squares, group=group)
        total = squares.sqrt()
        self._coefficient = torch.clamp(self.max_norm / (total + EPSILON), max=1.0)
        return total.item()

    def scale(self) -> None:
        """Scale every gradient the rank holds by the coefficient :meth:`norm` found (one multi-tensor pass per
        dtype, as clip_grad_norm_'s torch._foreach_mul_)."""
        by_dtype: dict[Any, dict[int, Any]] = {}
        for g, _ in self.pieces():
            if g is not None and g.numel():
                g = local(g)
                by_dtype.setdefault(g.dtype, {})[id(g)] = g
        with torch.no_grad():
            for dtype, grads in by_dtype.items():
                torch._foreach_mul_(list(grads.values()), self._coefficient.to(dtype))


def local(tensor: Any) -> Any:
    """The part of ``tensor`` this rank stores: a DTensor's local shard, any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def build_clipper(plan: Plan, params: list, groups: dict[str, Any], zero: Any, tied_copy: Any, experts: set[int],
                  recorder: Recorder, device: Any) -> GradClipper:
    """The clipper of one rank: ``params`` are its parameters (ZeRO-1/2: ``zero`` owns slices of their
    gradients), ``groups`` its process groups by dimension (as ``runner._process_groups`` makes them),
    ``tied_copy`` the last pipeline rank's copy of a tied table (else None) and ``experts`` the ids of its
    routed experts' weights."""
    sharded = bool(plan.zero) and plan.shard_size > 1
    dims = [("shard", sharded), ("ep", plan.ep > 1), ("tp", plan.tp > 1), ("pp", plan.pp > 1)]
    order = [(dim, groups["dp"] if dim == "shard" and "shard" not in groups else groups[dim])
             for dim, used in dims if used]

    def share(param: Any) -> float:
        if param is tied_copy:
            return 0.0
        copies = plan.tp if plan.tp > 1 and getattr(param, "shard", None) is None else 1
        return 1.0 / (copies * (plan.ep if plan.ep > 1 and id(param) not in experts else 1))

    def pieces() -> list[tuple[Any, float]]:
        if zero is not None:
            return [(zero.owned(p), share(p)) for p in params]
        return [(gradient(p), share(p)) for p in params]

    return GradClipper(plan.grad_clip, pieces, order, recorder, device)
