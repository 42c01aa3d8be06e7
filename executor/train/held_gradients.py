"""The gradients one rank holds, for checks over all of a model's gradients (clipping's norm, fp16's overflow).

A rank holds only part of the gradients: ZeRO-1/2's owned slices, FSDP's
shards, its tensor-parallel slices, its pipeline stages, its routed experts.
A check over all of them takes each rank's part and then reduces one number
per parallel dimension whose ranks hold different parts (``parsim.lowering.lower.
grad_norm_dims``, in its order): ``shard`` (ZeRO's or FSDP's shard group;
HSDP's replicas hold the same shards), ``ep``, ``tp`` and ``pp``. Data- and
context-parallel replicas hold the same gradients after the sync and take no
part. A gradient that several ranks of one such group hold alike (a norm's
gain on every tensor-parallel rank, a dense weight on every expert-parallel
rank, the tied table's second copy on the last pipeline rank) counts ``1 /
copies`` on each, so a sum adds it once (:attr:`HeldGradients.pieces`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from parsim.lowering.lower import grad_norm_dims
from parsim.report.trace import collective_name
from parsim.workload.plan import Plan

from .._torch import require_distributed, require_torch
from .mixed_precision import gradient
from .trace_recorder import Recorder

torch = require_torch()
dist = require_distributed()


@dataclass
class HeldGradients:
    """``pieces()``: each gradient part the rank holds with the share of it the rank counts; ``groups``: the
    (dimension, process group) pairs a check reduces over, in order."""

    pieces: Callable[[], list[tuple[Any, float]]]
    groups: list[tuple[str, Any]]
    recorder: Recorder
    device: Any

    def tensors(self) -> dict[Any, list]:
        """Every non-empty gradient tensor the rank stores (each once), by dtype: what a multi-tensor op takes."""
        by_dtype: dict[Any, dict[int, Any]] = {}
        for g, _ in self.pieces():
            if g is not None and g.numel():
                g = local(g)
                by_dtype.setdefault(g.dtype, {})[id(g)] = g
        return {dtype: list(grads.values()) for dtype, grads in by_dtype.items()}

    def all_reduce(self, value: Any, what: str, op: Any = None) -> None:
        """Reduce ``value`` over every group in turn, each timed as ``all_reduce WHAT dim=D`` (optimizer time)."""
        for dim, group in self.groups:
            with self.recorder.span(collective_name("all_reduce", what, dim=dim), "collective", "comm",
                                    phase="optimizer", bytes=value.numel() * value.element_size()):
                dist.all_reduce(value, op=op or dist.ReduceOp.SUM, group=group)


def held_gradients(plan: Plan, params: list, groups: dict[str, Any], zero: Any, tied_copy: Any,
                   experts: set[int], recorder: Recorder, device: Any) -> HeldGradients:
    """One rank's gradients: ``params`` are its parameters (ZeRO-1/2: ``zero`` owns slices of their gradients),
    ``groups`` its process groups by dimension (as ``runner._process_groups`` makes them), ``tied_copy`` the
    last pipeline rank's copy of a tied table (else None) and ``experts`` the ids of its routed experts'
    weights."""
    order = [(dim, groups.get(dim, groups.get("dp")) if dim == "shard" else groups[dim])
             for dim in grad_norm_dims(plan)]

    # A dense gradient on every expert-parallel rank counts 1 / ep where the ep ranks' parts are summed apart
    # (under ZeRO the shard group's sum holds them, each part once)
    ep_copies = plan.ep if "ep" in grad_norm_dims(plan) else 1

    def share(param: Any) -> float:
        if param is tied_copy:
            return 0.0
        copies = plan.tp if plan.tp > 1 and getattr(param, "shard", None) is None else 1
        return 1.0 / (copies * (1 if id(param) in experts else ep_copies))

    def pieces() -> list[tuple[Any, float]]:
        if zero is not None:
            return [(g, share(p)) for p in params for g in zero.owned_parts(p)]
        return [(gradient(p), share(p)) for p in params]

    return HeldGradients(pieces, order, recorder, device)


def local(tensor: Any) -> Any:
    """The part of ``tensor`` this rank stores: a DTensor's local shard, any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
