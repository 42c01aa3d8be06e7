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
from .mixed_precision import adamw, drop_gradient, gradient, reduced
from .parallel import BucketReducer
from .trace_recorder import Recorder

torch = require_torch()
dist = require_distributed()
F = torch.nn.functional


@dataclass
class _Shard:
    """This rank's slice ``[start, start + len(weights))`` of one padded flat bucket."""

    offsets: list[int]  # where each of the bucket's parameters starts in the flat bucket
    start: int
    weights: Any  # a leaf tensor: the owned weights, stepped by AdamW; its ``grad`` the reduced gradient


class ZeroOptimizer(BucketReducer):
    """ZeRO-``stage`` (1 or 2) over ``shard_group``: the gradient sync, the optimizer and the weight gather.

    ``replicate_group`` (HSDP) holds the ranks that own the same shards, one
    per shard group; None when the shard group is the whole data-parallel group.
    """

    def __init__(self, params: list, stage: int, shard_group: Any, replicate_group: Any, bucket_size: int,
                 overlap: bool, accumulations: int, recorder: Recorder, lr: float, reduce_dtype: Any,
                 overlap_param_gather: bool = False, fused: bool = False):
        size = dist.get_world_size(shard_group)
        self.overlap_param_gather = overlap_param_gather
        self._stale = False  # the optimizer has stepped; the parameters wait for the buckets' all-gathers
        self._gathering: dict[int, tuple[Any, Any, float]] = {}  # bucket -> (work, flat buffer, issue time)
        # The data-parallel sync's bucket bookkeeping (when a bucket is final, in which order buckets
        # launch), with a reduce-scatter where it all-reduces.
        settings = SimpleNamespace(grad_sync="bucketed", overlap=overlap, accumulations=accumulations,
                                   recorder=recorder, reduce_dtype=reduce_dtype)
        super().__init__([(p, None) for p in params], shard_group, size, size, "bucket", 0, settings, bucket_size)
        self.param_buckets = [[p for p, _ in bucket] for bucket in self.buckets]
        self.stage, self.replicate_group = stage, replicate_group
        self.replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        rank = dist.get_rank(shard_group)
        self.shards = []
        self._offset_of: dict[int, int] = {}
        with torch.no_grad():
            for bucket in self.param_buckets:
                flat = self._padded([p.reshape(-1) for p in bucket])
                per = flat.numel() // size
                offsets = [0]
                for p in bucket[:-1]:
                    offsets.append(offsets[-1] + p.numel())
                self._offset_of.update((id(p), offset) for p, offset in zip(bucket, offsets))
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
        for k, (bucket, shard) in enumerate(zip(self.param_buckets, self.shards)):
            flat = self._gather_buffer(shard)
            with self.recorder.span(collective_name("all_gather", "dp", bucket=k), "collective", "comm",
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
                self.recorder.add(collective_name("all_gather", "dp", bucket=k), "collective", "comm", start,
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
            for p, offset in zip(self.param_buckets[k], self.shards[k].offsets):
                p.copy_(flat[offset:offset + p.numel()].view_as(p))

    def owned_gradient(self, param, reference) -> tuple[Any, Any]:
        """The reduced gradient this rank owns of ``param`` (flattened, maybe empty), and that part of ``reference``."""
        lo, hi = self._owned_range(param)
        offset = self._offset_of[id(param)]
        return self.owned(param), reference.reshape(-1)[lo - offset:hi - offset]

    def owned(self, param) -> Any:
        """The reduced gradient this rank owns of ``param``: a view of its shard's (flattened, maybe empty)."""
        shard = self.shards[self._buckets_of[id(param)][0]]
        lo, hi = self._owned_range(param)
        return shard.weights.grad[lo - shard.start:hi - shard.start]

    def _owned_range(self, param) -> tuple[int, int]:
        """Where in its flat bucket the part of ``param`` this rank owns starts and stops."""
        shard, offset = self.shards[self._buckets_of[id(param)][0]], self._offset_of[id(param)]
        lo = max(offset, shard.start)
        return lo, max(lo, min(offset + param.numel(), shard.start + shard.weights.numel()))

    # -- the gradient sync (BucketReducer's bookkeeping, a reduce-scatter per bucket) ------------------
    def _padded(self, tensors: list) -> Any:
        flat = torch.cat(tensors)
        return F.pad(flat, (0, -flat.numel() % self.size))

    def _launch(self) -> None:
        k = len(self._launched)
        flat = reduced(self._padded([gradient(p).reshape(-1) for p in self.param_buckets[k]]),
                       self.sync.reduce_dtype)
        if self.stage >= 2:  # ZeRO-2: from now on only the reduced shard of these gradients exists
            for p in self.param_buckets[k]:
                drop_gradient(p)
        shard = torch.empty(flat.numel() // self.size, dtype=flat.dtype, device=flat.device)
        start = self.recorder.now()
        work = _reduce_scatter(shard, flat, op=self.average or dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._launched.append((work, shard, start))

    def _wait(self, k: int) -> None:
        work, shard, start = self._launched[k]
        work.wait()
        self.recorder.add(collective_name("reduce_scatter", "dp", bucket=k), "collective", "comm", start,
                          self.recorder.now(), phase="dp", bytes=shard.numel() * shard.element_size() * self.size)
        if self.average is None:
            shard.div_(self.size)
        if self.replicate_group is not None:
            with self.recorder.span(collective_name("all_reduce", "dp", bucket=k), "collective", "comm",
                                    phase="dp", bytes=shard.numel() * shard.element_size()):
                dist.all_reduce(shard, op=self.average or dist.ReduceOp.SUM, group=self.replicate_group)
            if self.average is None:
                shard.div_(self.replicas)
        self.shards[k].weights.grad = shard.float()
