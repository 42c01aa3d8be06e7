"""Parallelism applied to a dense model by small composable functions (torchtitan's ``apply_*`` spirit).

- :func:`apply_tensor_parallel` swaps weights for this rank's shards (sliced
  from the same seeded dense weights every rank builds) and fills the
  modules' collective slots: the lecture's all-gather style for the MLP, or
  Megatron-LM's column/row pairs with ``f`` / ``g`` (and a vocabulary-parallel
  embedding and cross-entropy for a transformer; its latent attention and
  MoE layers split as Megatron-LM splits them).
- :func:`apply_data_parallel` synchronizes gradients across replicas: the
  lecture's loop of one all-reduce per parameter after the backward, or torch
  DDP's buckets, all-reduced asynchronously as soon as their gradients are
  final when ``overlap`` is on.
- :func:`apply_expert_parallel` keeps a rank's slice of each MoE layer's
  routed experts and dispatches tokens to them by all-to-all; their
  gradients are then synchronized over the expert-data-parallel group.
- :func:`tie_embeddings` keeps a tied LM head equal to the token table.

Sharded parameters keep their ``full_name`` and gain ``shard`` =
``(dim, start, stop)``, so :func:`reference_slice` finds their part of the
dense reference.
"""

from __future__ import annotations

from typing import Any, Callable

from parsim.errors import ParsimError
from parsim.report.trace import collective_name
from parsim.workload.model import MLPModel, Model

from .._torch import require_distributed, require_torch
from .comm import (CopyToTP, EPGroup, GatherFromTP, GatherSequence, ReduceFromTP, ScatterSequence, SharedLoss, TPGroup,
                   VocabParallelCrossEntropy)
from .mixed_precision import gradient, reduced
from .models import LatentAttention, Piece, RMSNorm
from .moe import AllToAllDispatcher, ExpertTensorParallel, MoEFeedForward, RoutedExperts
from .tp_overlap import ColumnEntry, TPOverlap
from .trace_recorder import Recorder

torch = require_torch()
dist = require_distributed()
nn = torch.nn
F = torch.nn.functional


# --------------------------------------------------------------------------- shards
def shard_parameter(param, dim: int, start: int, stop: int):
    """A new parameter holding ``param[start:stop]`` along ``dim``, labelled with where it came from: its
    ``shard`` lists each ``(dim, start, stop)`` cut from the dense tensor (a routed expert's weight under
    tensor and expert parallelism is cut twice)."""
    shard = nn.Parameter(param.data.narrow(dim, start, stop - start).clone())
    shard.full_name, shard.shard = param.full_name, (*getattr(param, "shard", ()), (dim, start, stop))
    return shard


def reference_slice(param, full):
    """The part of the dense tensor ``full`` that ``param`` holds (all of it when not sharded)."""
    for dim, start, stop in getattr(param, "shard", ()):
        full = full.narrow(dim, start, stop - start)
    return full


def _split(module, attr: str, dim: int, tp: TPGroup) -> None:
    """Keep this rank's ``1/tp`` of ``module.<attr>`` along ``dim`` (a whole number of rows or heads)."""
    param = getattr(module, attr)
    per = param.shape[dim] // tp.size
    setattr(module, attr, shard_parameter(param, dim, tp.rank * per, (tp.rank + 1) * per))


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, stop)`` of the token table; ids outside them look up zeros (summed across ranks later)."""

    def __init__(self, weight, start: int):
        super().__init__()
        self.weight, self.start = weight, start

    def forward(self, ids):
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return rows * mine.unsqueeze(-1).to(rows.dtype)


# --------------------------------------------------------------------------- tensor parallel
def apply_tensor_parallel(pieces: list[Piece], loss: Any, model: Model, style: str, tp: TPGroup,
                          sequence_parallel: bool = False, overlap: bool = False, backward: str = "autograd") -> Any:
    """Shard ``pieces`` in place for ``tp``; return the loss module the last stage must use.

    With ``sequence_parallel`` (Megatron-LM's, Korthikanti et al. 2022) the activations between blocks
    hold this rank's ``1/tp`` of the sequence: blocks enter with an all-gather and leave with a
    reduce-scatter, the embedding leaves with a reduce-scatter and the head enters with an all-gather.
    Norm gains then see only part of the sequence: they are marked ``sequence_parallel`` so their
    gradients can be summed over the group (:func:`sequence_parallel_grad_sync`). With ``overlap``
    (``tp_comm_overlap``) each block's entry and exit collectives run beside its GEMMs
    (:mod:`executor.train.tp_overlap`). ``backward`` "async" (``tp_async_backward``) or "in_line" runs the
    column-parallel linears that enter the attention, the feed-forward and the head as Megatron-LM does
    (:class:`~executor.train.tp_overlap.ColumnEntry`: under sequence parallelism their input gathered again
    in the backward), their backward's collectives beside the GEMMs or in line; "autograd" (a split
    backward's, whose input-gradient pass must not compute weight gradients) leaves them to the ``f`` / ``g``
    functions' backward, the gathered input kept.
    """
    if tp.size == 1:
        return loss
    if isinstance(model, MLPModel):
        return _mlp(pieces, loss, style, tp)
    if style != "megatron":
        raise ParsimError(f"the executor runs transformers with megatron tensor parallelism, not {style!r}")
    if model.num_kv_heads % tp.size:
        raise ParsimError(f"tp {tp.size} > num_kv_heads {model.num_kv_heads}: the executor splits key/value "
                          f"heads across ranks and does not replicate them")
    per = -(-model.vocab_size // tp.size)  # padded like Megatron-LM: the last rank may hold fewer rows
    start, stop = tp.rank * per, min(model.vocab_size, (tp.rank + 1) * per)
    if start >= stop:
        raise ParsimError(f"vocab_size {model.vocab_size} is too small to split over tp {tp.size}")
    enter, exit_ = (GatherSequence, ScatterSequence) if sequence_parallel else (CopyToTP, ReduceFromTP)
    for piece in pieces:
        m = piece.module
        if piece.name == "embedding":
            m.tokens = VocabParallelEmbedding(shard_parameter(m.tokens.weight, 0, start, stop), start)
            m.exit = exit_(tp, piece.name)
        elif piece.name == "head":
            m.out.weight = shard_parameter(m.out.weight, 0, start, stop)
            m.enter = enter(tp, piece.name)
            if backward != "autograd":
                m.overlap = ColumnEntry(tp, piece.name, sequence_parallel, backward == "async")
            loss = VocabParallelCrossEntropy(tp, start)
        else:
            if isinstance(m.attn, LatentAttention):
                _latent_attention(m.attn, piece.name, tp)
            else:
                _megatron_block(m.attn, ("q", "k", "v"), ("o",), enter(tp, piece.name), exit_(tp, piece.name), tp)
            if isinstance(m.mlp, MoEFeedForward):
                _moe_block(m.mlp, piece.name, tp)
            else:
                _feed_forward(m.mlp, enter(tp, piece.name), exit_(tp, piece.name), tp)
            # the simulator overlaps one gather and one scatter a block, and runs no MLA's or MoE's asynchronously
            for block in (m.attn, m.mlp):
                if isinstance(block, (LatentAttention, MoEFeedForward)):
                    continue
                if overlap:
                    block.overlap = TPOverlap(tp, piece.name)
                elif backward != "autograd":
                    block.overlap = ColumnEntry(tp, piece.name, sequence_parallel, backward == "async", block.exit)
        if sequence_parallel:
            for sub in m.modules():
                if isinstance(sub, RMSNorm):
                    sub.weight.sequence_parallel = True
    return loss


def _megatron_block(block, columns: tuple[str, ...], rows: tuple[str, ...], enter: Any, exit_: Any,
                    tp: TPGroup) -> None:
    """Column-parallel ``columns`` (output features split), row-parallel ``rows`` (input features split)."""
    for name in columns:
        _split(getattr(block, name), "weight", 0, tp)
    for name in rows:
        _split(getattr(block, name), "weight", 1, tp)
    block.enter, block.exit = enter, exit_


def _latent_attention(attn: LatentAttention, layer: str, tp: TPGroup) -> None:
    """Megatron-LM's ``MultiLatentAttention`` under tensor parallelism (sequence parallel; see
    ``check_plan``): the down-projections duplicated, on this rank's part of the sequence (their gradients,
    like the latent norms', summed over the group); the up-projections column-parallel by heads, each
    entered by an all-gather of its input, as is the shared RoPE key; the output row-parallel, left by a
    reduce-scatter."""
    for name in ("q_b", "kv_b") if attn.compressed_queries else ("q", "kv_b"):
        _split(getattr(attn, name), "weight", 0, tp)
    _split(attn.o, "weight", 1, tp)
    for name in ("q_a", "kv_a") if attn.compressed_queries else ("kv_a",):
        getattr(attn, name).weight.sequence_parallel = True
    attn.heads //= tp.size
    attn.gather, attn.exit = GatherSequence(tp, layer), ScatterSequence(tp, layer)


def _ffn_weights(swiglu: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A feed-forward's column-parallel weights (gate and up, or fc1) and its row-parallel one (down, or fc2)."""
    return (("gate", "up"), ("down",)) if swiglu else (("fc1",), ("fc2",))


def _feed_forward(ffn, enter: Any, exit_: Any, tp: TPGroup) -> None:
    """A dense feed-forward: gate and up (fc1) column-parallel, down (fc2) row-parallel."""
    _megatron_block(ffn, *_ffn_weights(ffn.swiglu), enter, exit_, tp)


def _moe_block(moe: MoEFeedForward, layer: str, tp: TPGroup) -> None:
    """A MoE layer under Megatron-LM's tensor parallelism (sequence parallel, which Megatron requires): the
    router replicated, scoring this rank's part of the sequence (its gradient summed over the group like a
    norm's), each routed expert split like a dense feed-forward (:class:`~executor.train.moe.ExpertTensorParallel`
    moves the rows), the shared experts a tensor-parallel feed-forward of their own."""
    moe.router.weight.sequence_parallel = True
    experts = moe.experts
    columns, rows = _ffn_weights(experts.swiglu)
    for name in columns:  # [experts, hidden, ffn]: split the ffn outputs
        _split(experts, name, 2, tp)
    for name in rows:  # [experts, ffn, hidden]: split the ffn inputs
        _split(experts, name, 1, tp)
    moe.tensor_parallel = ExpertTensorParallel(tp, layer)
    if moe.shared is not None:  # on the rows of this rank's tokens, gathered and scattered like the sequence
        _feed_forward(moe.shared, GatherSequence(tp, layer), ScatterSequence(tp, layer), tp)


def _mlp(pieces: list[Piece], loss: Any, style: str, tp: TPGroup) -> Any:
    """The course MLP, ``W`` stored (in, out).

    allgather (the lecture): every layer keeps columns of ``W`` and gathers
    its output. megatron: even layers are column-parallel (``f``, gelu on the
    shard), odd layers row-parallel (partial sums, ``g``, then gelu), so a
    layer pair needs one all-reduce each way.
    """
    if style == "allgather":
        for piece in pieces:
            _split(piece.module.proj, "weight", 1, tp)
            piece.module.exit = GatherFromTP(tp, piece.name)
        return SharedLoss(loss, tp.size)
    indices = [int(p.name.split(".")[1]) for p in pieces]
    if len(pieces) % 2 or indices[0] % 2:
        raise ParsimError("megatron tensor parallelism pairs MLP layers (column, row): each stage needs an "
                          "even number of layers starting at an even layer")
    for piece, index in zip(pieces, indices):
        layer = piece.module
        if index % 2 == 0:
            _split(layer.proj, "weight", 1, tp)
            layer.enter = CopyToTP(tp, piece.name)
        else:
            _split(layer.proj, "weight", 0, tp)
            layer.reduce = ReduceFromTP(tp, piece.name)
    return loss


def sequence_parallel_grad_sync(params: list, tp: TPGroup, reduce_dtype: Any,
                                zero: Any = None) -> Callable[[], None] | None:
    """Sum the gradients of ``params`` marked ``sequence_parallel`` over ``tp``, in one flat all-reduce in
    ``reduce_dtype``.

    Each rank's norm gains saw only its part of the sequence, so their
    gradients are partial sums; Megatron-LM all-reduces them over the
    tensor-parallel group after the data-parallel sync (``finalize_model_grads``).
    What a rank holds of them by then is summed: the slices ZeRO-1/2 (``zero``) reduced to it, FSDP's shard,
    or the whole gradient. Its tensor-parallel peers hold the same slices (their buckets and shards are laid
    out alike), and a sum over tp of each slice is that slice of the sum.
    """
    from torch.distributed.tensor import DTensor

    marked = [p for p in params if getattr(p, "sequence_parallel", False)]
    if not marked:
        return None

    def held(p) -> list:
        if zero is not None:
            return zero.owned_parts(p)
        grad = gradient(p)
        return [grad.to_local() if isinstance(grad, DTensor) else grad]

    def sync() -> None:
        parts = [part for p in marked for part in held(p)]
        flat = reduced(torch.cat([part.reshape(-1) for part in parts]), reduce_dtype)
        with tp.recorder.span(collective_name("all_reduce", "tp", params="norms"), "collective", "comm",
                              phase="tp", bytes=flat.numel() * flat.element_size()):
            dist.all_reduce(flat, group=tp.group)
        offset = 0
        for part in parts:
            part.copy_(flat[offset:offset + part.numel()].view_as(part))
            offset += part.numel()

    return sync


# --------------------------------------------------------------------------- expert parallel
def apply_expert_parallel(pieces: list[Piece], ep: EPGroup) -> None:
    """Keep this rank's ``1/ep`` of every MoE layer's routed experts and dispatch their tokens by all-to-all.

    Rank ``e`` of the group holds experts ``[e*E/ep, (e+1)*E/ep)``: dim 0 of
    each routed expert weight, sliced from the dense weights every rank built.
    """
    if ep.size == 1:
        return
    for piece in pieces:
        for module in piece.module.modules():
            if isinstance(module, MoEFeedForward):
                experts = module.experts
                per = module.num_experts // ep.size
                for name, param in list(experts.named_parameters(recurse=False)):
                    setattr(experts, name, shard_parameter(param, 0, ep.rank * per, (ep.rank + 1) * per))
                module.dispatcher = AllToAllDispatcher(ep, piece.name)


def routed_expert_parameters(modules: list) -> list:
    """The routed experts' weights among ``modules`` (synchronized over the expert-data-parallel group)."""
    return [p for m in modules for sub in m.modules() if isinstance(sub, RoutedExperts) for p in sub.parameters()]


# --------------------------------------------------------------------------- data parallel
class GradSync:
    """Averages gradients over a data-parallel group, per parameter or in DDP buckets.

    ``params`` come in the order gradients are synchronized: the reverse of
    the forward (last layer first), as the simulator orders them. A gradient
    is final after ``accumulations`` backward passes (one per microbatch);
    with ``overlap`` a post-accumulate hook counts them, and a bucket's
    all-reduce starts, asynchronously, once all its gradients are final and
    every earlier bucket has started (all ranks must issue collectives in the
    same order).

    Routed experts' weights (``experts``, in the same order) are synchronized
    over ``expert_group`` of ``expert_size`` ranks, the ranks holding the same
    experts, in buckets of their own (``expert_bucket=k``; per parameter they
    are numbered after the dense ones), one expert's slice of a weight at a
    time as the simulator counts them. Their gradients are sums of the
    contributions of every rank of the expert-parallel group (the all-to-all
    brought its tokens), so the sum over the expert-data-parallel group is the
    sum over all ``expert_divisor`` (= dp) replicas' losses: it is divided by
    ``expert_divisor``, not by the group's size (Megatron-LM's expert gradient
    scaling). With ``expert_size`` 1 nothing is sent and the gradients are
    only divided.
    """

    def __init__(self, params: list, group: Any, size: int, grad_sync: str, bucket_size: int, overlap: bool,
                 accumulations: int, recorder: Recorder, reduce_dtype: Any, experts: list = (),
                 expert_group: Any = None, expert_size: int = 1, expert_divisor: int = 1):
        self.grad_sync, self.overlap, self.accumulations = grad_sync, overlap, accumulations
        self.reduce_dtype = reduce_dtype
        self.recorder = recorder
        self.reducers = [BucketReducer([(p, None) for p in params], group, size, size, "bucket", 0, self, bucket_size)]
        if experts:
            units = expert_units(experts)
            self.reducers.append(BucketReducer(units, expert_group, expert_size, expert_divisor, "expert_bucket",
                                          len(params), self, bucket_size))
        self.start_step()

    def start_step(self) -> None:
        for reducer in self.reducers:
            reducer.start_step()

    def finish(self) -> None:
        """After the last backward: synchronize whatever has not been, and wait for everything."""
        for reducer in self.reducers:
            reducer.finish()


class BucketReducer:
    """One group's share of :class:`GradSync`: gradient units ``(param, None)`` (the whole gradient) or
    ``(param, i)`` (its slice ``i`` along dim 0), summed over ``group`` and divided by ``divisor``."""

    def __init__(self, units: list, group: Any, size: int, divisor: int, tag: str, first_param: int,
                 sync: GradSync, bucket_size: int):
        self.units, self.group, self.size, self.divisor, self.tag = units, group, size, divisor, tag
        self.first_param, self.sync, self.recorder = first_param, sync, sync.recorder
        self.params = list({id(p): p for p, _ in units}.values())
        # ReduceOp.AVG divides by the group's size; another divisor needs SUM, then a division.
        self.average = _average_op(group) if size > 1 and divisor == size else None
        if size == 1:
            self.buckets: list[list] = []
        elif sync.grad_sync == "bucketed":  # sized in the reduce dtype, as the simulator sizes them
            self.buckets = _buckets(units, bucket_size, lambda u: _grad_numel(u) * sync.reduce_dtype.itemsize)
        else:
            self.buckets = [[u] for u in units]
        self._buckets_of: dict[int, list[int]] = {}
        for k, bucket in enumerate(self.buckets):
            for p, _ in bucket:
                self._buckets_of.setdefault(id(p), []).append(k)
        if self.buckets and sync.grad_sync == "bucketed" and sync.overlap:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def start_step(self) -> None:
        self._counts = {id(p): 0 for p in self.params}
        self._final = [0] * len(self.buckets)
        self._launched: list[tuple[Any, Any, float]] = []  # (work, flat buffer, issue time) per started bucket

    def finish(self) -> None:
        if not self.buckets:  # nothing to send: every replica's share is already here
            if self.divisor != 1:
                for p in self.params:
                    gradient(p).div_(self.divisor)
            return
        if self.sync.grad_sync == "per_param":
            for k, (unit,) in enumerate(self.buckets):
                grad = unit_grad(unit)
                buffer = reduced(grad, self.sync.reduce_dtype)
                with self.recorder.span(collective_name("all_reduce", "dp", param=self.first_param + k),
                                        "collective", "comm", phase="dp",
                                        bytes=buffer.numel() * buffer.element_size()):
                    dist.all_reduce(buffer, op=self.average or dist.ReduceOp.SUM, group=self.group)
                    if self.average is None:
                        buffer.div_(self.divisor)
                if buffer is not grad:
                    grad.copy_(buffer)
            return
        while len(self._launched) < len(self.buckets):
            self._launch()
            if not self.sync.overlap:
                self._wait(len(self._launched) - 1)
        if self.sync.overlap:
            for k in range(len(self.buckets)):
                self._wait(k)

    def _on_grad(self, param) -> None:
        self._counts[id(param)] += 1
        if self._counts[id(param)] == self.sync.accumulations:
            for k in self._buckets_of[id(param)]:
                self._final[k] += 1
            while (len(self._launched) < len(self.buckets)
                   and self._final[len(self._launched)] == len(self.buckets[len(self._launched)])):
                self._launch()

    def _launch(self) -> None:
        bucket = self.buckets[len(self._launched)]
        flat = reduced(torch.cat([unit_grad(u).reshape(-1) for u in bucket]), self.sync.reduce_dtype)
        start = self.recorder.now()
        work = dist.all_reduce(flat, op=self.average or dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._launched.append((work, flat, start))

    def _wait(self, k: int) -> None:
        work, flat, start = self._launched[k]
        work.wait()
        self.recorder.add(collective_name("all_reduce", "dp", **{self.tag: k}), "collective", "comm", start,
                          self.recorder.now(), phase="dp", bytes=flat.numel() * flat.element_size())
        if self.average is None:
            flat.div_(self.divisor)
        offset = 0
        for unit in self.buckets[k]:
            grad = unit_grad(unit)
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def expert_units(params: list) -> list[tuple]:
    """Routed experts' gradient units, as the simulator counts them: each expert's slice (dim 0) of each weight."""
    return [(p, i) for p in params for i in range(p.shape[0])]


def unit_grad(unit: tuple) -> Any:
    """A unit's gradient: the parameter's, or its slice ``i`` along dim 0 (a view)."""
    param, index = unit
    return gradient(param) if index is None else gradient(param)[index]


def _grad_numel(unit: tuple) -> int:
    param, index = unit
    return param.numel() if index is None else param[index].numel()


def apply_data_parallel(params: list, group: Any, size: int, grad_sync: str, bucket_size: int, overlap: bool,
                        accumulations: int, recorder: Recorder, reduce_dtype: Any, experts: list = (),
                        expert_group: Any = None, expert_size: int = 1,
                        expert_divisor: int = 1) -> GradSync | None:
    """A :class:`GradSync` for ``params`` over ``group`` (None when there is one replica), and for the routed
    ``experts`` over ``expert_group``."""
    if size == 1:
        return None
    return GradSync(params, group, size, grad_sync, bucket_size, overlap, accumulations, recorder, reduce_dtype,
                    experts, expert_group, expert_size, expert_divisor)


def _average_op(group: Any) -> Any:
    """``ReduceOp.AVG`` where the backend has it (NCCL; gloo in recent torch), else None: SUM, then divide."""
    try:
        dist.all_reduce(torch.zeros(1, device=_device(group)), op=dist.ReduceOp.AVG, group=group)
        return dist.ReduceOp.AVG
    except (RuntimeError, ValueError):
        return None


def _device(group: Any) -> Any:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"


def _buckets(items: list, bucket_size: int, nbytes: Callable[[Any], int] | None = None) -> list[list]:
    """DDP's buckets: parameters (or gradient units, sized by ``nbytes``) in sync order, up to ``bucket_size``
    bytes each, one never split."""
    nbytes = nbytes or (lambda p: p.numel() * p.element_size())
    buckets: list[list] = [[]]
    size = 0
    for item in items:
        n = nbytes(item)
        if buckets[-1] and size + n > bucket_size:
            buckets.append([])
            size = 0
        buckets[-1].append(item)
        size += n
    return buckets


# --------------------------------------------------------------------------- tied embeddings
def tie_embeddings(pieces: list[Piece], group: Any, recorder: Recorder,
                   reduce_dtype: Any) -> Callable[[], None] | None:
    """Keep a tied head equal to the token table; returns the gradient sync to run after the backward, if any.

    On one rank the head simply uses the table's parameter. Across pipeline
    ranks (the table on the first stage, the head on the last) each keeps a
    copy and their gradients are summed over ``group``, as Megatron-LM does.
    """
    by_name = {p.name: p.module for p in pieces}
    if "embedding" in by_name and "head" in by_name:
        by_name["head"].out.weight = by_name["embedding"].tokens.weight
        return None
    param = by_name["embedding"].tokens.weight if "embedding" in by_name else by_name["head"].out.weight

    def sync() -> None:
        grad = gradient(param)
        buffer = reduced(grad, reduce_dtype)
        with recorder.span(collective_name("all_reduce", "embedding"), "collective", "comm", phase="dp",
                           bytes=buffer.numel() * buffer.element_size()):
            dist.all_reduce(buffer, group=group)
        if buffer is not grad:
            grad.copy_(buffer)

    return sync
