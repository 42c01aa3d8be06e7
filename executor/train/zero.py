"""ZeRO-1/2: gradients reduce-scattered in DDP's buckets, AdamW on this rank's shard, weights all-gathered.

Megatron-LM's distributed optimizer (and DeepSpeed ZeRO stages 1 and 2,
Rajbhandari et al. 2020): the parameters are flattened, in gradient-sync
order, into the same buckets DDP all-reduces (:func:`parallel._buckets`);
each bucket is padded to a multiple of the shard group's size ``N`` and rank
``i`` of the group owns its ``i``-th ``1/N``. After the backward a bucket's
gradients are reduce-scattered (averaged) over the shard group, as soon as
the bucket is final when ``overlap`` is on; under HSDP the owned shard is then
all-reduced (averaged) across the replicas. Gradients travel in the plan's
reduce dtype. AdamW steps only the owned slices, kept in fp32 (master weights
beside bf16 or fp16 parameters; its state exists for them alone), and every
bucket's updated weights are all-gathered back into the parameters in their
own dtype. AdamW is elementwise, so this equals AdamW on the whole model.

A mixture of experts' routed experts are sharded apart (:class:`ZeroOptimizers`),
as the lowering has them: one unit per expert's slice of a weight, in buckets
of their own (``expert_bucket=k``) over the ranks of the shard group holding
the same experts, their sums divided by dp x cp (each holds every
expert-parallel rank's tokens' contributions); experts no other rank of the shard
group holds are stepped whole, after their replicas in other shard groups
(HSDP) all-reduce them in the same buckets, or, without replicas, after
their gradients are only divided.

ZeRO-1 keeps each parameter's whole local gradient (only the optimizer state
is sharded); ZeRO-2 frees it once the bucket's reduce-scatter has its copy,
keeping only the reduced shard. With ``overlap_param_gather`` (Megatron-LM's
``--overlap-param-gather``) the updated weights are not gathered after the
step: the next step opens by issuing every bucket's all-gather, last bucket
first (it holds the first layers), and each piece's forward pre-hook waits
for the buckets of its parameters before it runs. Events are the lowering's
``reduce_scatter dp bucket=k``, ``all_reduce dp bucket=k`` (HSDP) and
``all_gather dp bucket=k``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from parsim.report.trace import collective_name

from .._torch import require_distributed, require_torch
from .comm import _all_gather, _reduce_scatter
from .mixed_precision import MasterWeightsAdamW, adamw, drop_gradient, gradient, reduced
from .parallel import BucketReducer, expert_units, unit_grad
from .trace_recorder import Recorder

torch = require_torch()
dist = require_distributed()
F = torch.nn.functional


@dataclass
class _Shard:
    """This rank's slice ``[start, start + len(weights))`` of one padded flat bucket."""

    offsets: list[int]  # where each of the bucket's units starts in the flat bucket
    start: int
    weights: Any  # a leaf tensor: the owned weights, stepped by AdamW; its ``grad`` the reduced gradient


class ZeroOptimizer(BucketReducer):
    """ZeRO-``stage`` (1 or 2) over ``shard_group``: the gradient sync, the optimizer and the weight gather.

    ``replicate_group`` (HSDP) holds the ranks that own the same shards, one
    per shard group; None when the shard group is the whole data-parallel group.
    With ``experts`` the units are each expert's slice (dim 0) of ``params``,
    the buckets ``expert_bucket=k`` and the sums divided by ``divisor``.
    """

    def __init__(self, params: list, stage: int, shard_group: Any, replicate_group: Any, bucket_size: int,
                 overlap: bool, accumulations: int, recorder: Recorder, lr: float, reduce_dtype: Any,
                 overlap_param_gather: bool = False, fused: bool = False, experts: bool = False,
                 divisor: int | None = None):
        size = dist.get_world_size(shard_group)
        self.overlap_param_gather = overlap_param_gather
        self._stale = False  # the optimizer has stepped; the parameters wait for the buckets' all-gathers
        self._gathering: dict[int, tuple[Any, Any, float]] = {}  # bucket -> (work, flat buffer, issue time)
        # The data-parallel sync's bucket bookkeeping (when a bucket is final, in which order buckets
        # launch), with a reduce-scatter where it all-reduces.
        units = expert_units(params) if experts else [(p, None) for p in params]
        super().__init__(units, shard_group, size, divisor or size, "expert_bucket" if experts else "bucket", 0,
                         _bucketed(overlap, accumulations, recorder, reduce_dtype), bucket_size)
        self.stage, self.replicate_group = stage, replicate_group
        self.replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        rank = dist.get_rank(shard_group)
        self.shards = []
        self._units_of: dict[int, list[tuple]] = {}
        for p, i in units:
            self._units_of.setdefault(id(p), []).append((p, i))
        self._place: dict[tuple[int, int | None], tuple[int, int]] = {}  # unit -> (its bucket, where it starts)
        with torch.no_grad():
            for k, bucket in enumerate(self.buckets):
                flat = self._padded([_weights(u).reshape(-1) for u in bucket])
                per = flat.numel() // size
                offsets = [0]
                for u in bucket[:-1]:
                    offsets.append(offsets[-1] + _weights(u).numel())
                self._place.update(((id(p), i), (k, offset)) for (p, i), offset in zip(bucket, offsets))
                # fp32 master weights beside low-precision parameters (Megatron-LM's distributed optimizer)
                weights = flat[rank * per:(rank + 1) * per].to(torch.float32, copy=True).requires_grad_(True)
                self.shards.append(_Shard(offsets, rank * per, weights))
        self.adamw = adamw([s.weights for s in self.shards], lr, fused)

    # -- the optimizer's face ----------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            drop_gradient(p)
        self.adamw.zero_grad(set_to_none)

    def step(self) -> None:
        """AdamW on the owned slices (the weights reach the parameters in :meth:`gather_weights`)."""
        self.adamw.step()

    def gather_weights(self) -> None:
        """All-gather every bucket's updated slices into the parameters (with ``overlap_param_gather``: at
        the next step's start, see :meth:`start_step`)."""
        if self.overlap_param_gather:
            self._stale = True
            return
        for k, shard in enumerate(self.shards):
            flat = self._gather_buffer(shard)
            with self.recorder.span(collective_name("all_gather", "dp", **{self.tag: k}), "collective", "comm",
                                    phase="dp", bytes=flat.numel() * flat.element_size()):
                _all_gather(flat, self._gathered_shard(shard), group=self.group)
            self._copy_in(k, flat)

    def start_step(self) -> None:
        super().start_step()
        self._issue_gathers()

    def _issue_gathers(self) -> None:
        """After a step: every bucket's all-gather, in the order the forward needs them."""
        if not self._stale:
            return
        for k in reversed(range(len(self.shards))):
            flat = self._gather_buffer(self.shards[k])
            start = self.recorder.now()
            work = _all_gather(flat, self._gathered_shard(self.shards[k]), group=self.group, async_op=True)
            self._gathering[k] = (work, flat, start)
        self._stale = False

    def await_weights(self, params) -> None:
        """Before a piece's forward: wait for the all-gathers of its parameters' buckets, copy them in."""
        for k in sorted({k for p in params for k in self._buckets_of.get(id(p), ())}, reverse=True):
            if k in self._gathering:
                work, flat, start = self._gathering.pop(k)
                work.wait()
                self.recorder.add(collective_name("all_gather", "dp", **{self.tag: k}), "collective", "comm", start,
                                  self.recorder.now(), phase="dp", bytes=flat.numel() * flat.element_size())
                self._copy_in(k, flat)

    def settle(self) -> None:
        """Gather whatever updated weights are still pending (a run's end, a check of the weights)."""
        self._issue_gathers()
        self.await_weights(self.params)

    def _gather_buffer(self, shard: _Shard) -> Any:
        return torch.empty(shard.weights.numel() * self.size, dtype=self.params[0].dtype, device=shard.weights.device)

    def _gathered_shard(self, shard: _Shard) -> Any:
        """The updated weights a rank sends: its master slice in the parameters' own dtype."""
        return shard.weights.detach().to(self.params[0].dtype)

    def _copy_in(self, k: int, flat: Any) -> None:
        with torch.no_grad():
            for unit, offset in zip(self.buckets[k], self.shards[k].offsets):
                weights = _weights(unit)
                weights.copy_(flat[offset:offset + weights.numel()].view_as(weights))

    def owned_gradient(self, param, reference) -> tuple[Any, Any]:
        """The reduced gradient this rank owns of ``param`` (flattened, maybe empty), and that part of ``reference``."""
        mine, theirs = self.owned_parts(param), []
        for p, i in self._units_of[id(param)]:
            _, offset = self._place[(id(p), i)]
            lo, hi = self._owned_range((p, i))
            theirs.append((reference if i is None else reference[i]).reshape(-1)[lo - offset:hi - offset])
        return (mine[0], theirs[0]) if len(mine) == 1 else (torch.cat(mine), torch.cat(theirs))

    def owned_parts(self, param) -> list:
        """The reduced gradient this rank owns of each of ``param``'s units: views of its shards' (flattened,
        maybe empty)."""
        parts = []
        for p, i in self._units_of[id(param)]:
            shard = self.shards[self._place[(id(p), i)][0]]
            lo, hi = self._owned_range((p, i))
            parts.append(shard.weights.grad[lo - shard.start:hi - shard.start])
        return parts

    def _owned_range(self, unit: tuple) -> tuple[int, int]:
        """Where in its flat bucket the part of ``unit`` this rank owns starts and stops."""
        k, offset = self._place[(id(unit[0]), unit[1])]
        shard = self.shards[k]
        lo = max(offset, shard.start)
        return lo, max(lo, min(offset + _weights(unit).numel(), shard.start + shard.weights.numel()))

    # -- the gradient sync (BucketReducer's bookkeeping, a reduce-scatter per bucket) ------------------
    def _padded(self, tensors: list) -> Any:
        flat = torch.cat(tensors)
        return F.pad(flat, (0, -flat.numel() % self.size))

    def _launch(self) -> None:
        k = len(self._launched)
        flat = reduced(self._padded([unit_grad(u).reshape(-1) for u in self.buckets[k]]), self.sync.reduce_dtype)
        if self.stage >= 2:  # ZeRO-2: from now on only the reduced shard of these gradients exists
            for p in {id(p): p for p, _ in self.buckets[k]}.values():
                if max(self._buckets_of[id(p)]) == k:  # its last unit's bucket
                    drop_gradient(p)
        shard = torch.empty(flat.numel() // self.size, dtype=flat.dtype, device=flat.device)
        start = self.recorder.now()
        work = _reduce_scatter(shard, flat, op=self.average or dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._launched.append((work, shard, start))

    def _wait(self, k: int) -> None:
        work, shard, start = self._launched[k]
        work.wait()
        self.recorder.add(collective_name("reduce_scatter", "dp", **{self.tag: k}), "collective", "comm", start,
                          self.recorder.now(), phase="dp", bytes=shard.numel() * shard.element_size() * self.size)
        averaged = self.divisor == self.size  # else the experts' sum over every replica's loss, divided once
        if self.average is None and averaged:
            shard.div_(self.size)
        if self.replicate_group is not None:
            with self.recorder.span(collective_name("all_reduce", "dp", **{self.tag: k}), "collective", "comm",
                                    phase="dp", bytes=shard.numel() * shard.element_size()):
                dist.all_reduce(shard, op=self.average or dist.ReduceOp.SUM, group=self.replicate_group)
            if self.average is None and averaged:
                shard.div_(self.replicas)
        if not averaged:
            shard.div_(self.divisor)
        self.shards[k].weights.grad = shard.float()


def _bucketed(overlap: bool, accumulations: int, recorder: Recorder, reduce_dtype: Any) -> SimpleNamespace:
    """The data-parallel sync's settings a :class:`BucketReducer` reads (DDP's buckets, when final, in order)."""
    return SimpleNamespace(grad_sync="bucketed", overlap=overlap, accumulations=accumulations, recorder=recorder,
                           reduce_dtype=reduce_dtype)


def _weights(unit: tuple) -> Any:
    """A unit's weights: the parameter, or its slice ``i`` along dim 0 (a view)."""
    param, index = unit
    return param if index is None else param[index]


class ZeroOptimizers:
    """ZeRO-1/2's :class:`ZeroOptimizer` s under one face (the gradient sync's, the optimizer's and the weight
    gather's): the dense weights', and a mixture of experts' routed experts' (over the ranks of the shard group
    holding them), or its routed experts no other rank of the shard group holds, whose gradients are only
    all-reduced across shard groups, or divided (``local``: that :class:`BucketReducer` and the AdamW stepping
    them whole: :func:`whole_experts`)."""

    def __init__(self, parts: list[ZeroOptimizer], local: tuple[BucketReducer, Any] | None = None):
        self.parts, self.local = parts, local
        self._part_of = {id(p): part for part in parts for p in part.params}

    def _all(self) -> list:
        return self.parts + ([self.local[0]] if self.local else [])

    def start_step(self) -> None:
        for part in self._all():
            part.start_step()

    def finish(self) -> None:
        for part in self._all():
            part.finish()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none)
        if self.local:
            self.local[1].zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for part in self.parts:
            part.step()
        if self.local:
            self.local[1].step()

    def gather_weights(self) -> None:
        for part in self.parts:
            part.gather_weights()

    def await_weights(self, params) -> None:
        params = list(params)
        for part in self.parts:
            part.await_weights(params)

    def settle(self) -> None:
        for part in self.parts:
            part.settle()

    def owned_gradient(self, param, reference) -> tuple[Any, Any]:
        part = self._part_of.get(id(param))
        return part.owned_gradient(param, reference) if part else (gradient(param), reference)

    def owned_parts(self, param) -> list:
        part = self._part_of.get(id(param))
        return part.owned_parts(param) if part else [gradient(param)]


def whole_experts(params: list, group: Any, size: int, divisor: int, settings: dict,
                  main_grads: bool) -> tuple[BucketReducer, Any]:
    """Routed experts no other rank of their shard group holds: not sharded, their gradients all-reduced over
    ``group`` (HSDP's ``size`` replicas holding the same experts; ``size`` 1: nothing sent) in buckets of one
    unit per expert's slice, as the lowering has them (``expert_bucket=k``), divided by ``divisor``, and
    AdamW on them whole. ``settings`` are :class:`ZeroOptimizer`'s."""
    sync = _bucketed(settings["overlap"], settings["accumulations"], settings["recorder"], settings["reduce_dtype"])
    reducer = BucketReducer(expert_units(params), group, size, divisor, "expert_bucket", 0, sync,
                            settings["bucket_size"])
    lr, fused = settings["lr"], settings["fused"]
    return reducer, (MasterWeightsAdamW(params, lr, fused) if main_grads else adamw(params, lr, fused))
