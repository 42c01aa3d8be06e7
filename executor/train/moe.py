"""The mixture-of-experts feed-forward of parsim's ``TransformerModel`` (``num_experts`` > 1), and its
expert-parallel token dispatch.

Routing follows Mixtral (Jiang et al. 2024, "Mixtral of Experts", section
2.1): a bias-free router ``hidden x num_experts`` scores every expert, each
token keeps its ``experts_per_token`` highest logits, and its gate weights are
the softmax over those k logits only, ``G(x) = Softmax(TopK(x W_g))`` (the same
as renormalizing the full softmax's top k, as Hugging Face's Mixtral does).
The output is ``sum_i G_i(x) E_i(x)`` over the chosen experts, each expert a
feed-forward of the model's ``ffn_type`` and ``expert_ffn_hidden``. Routing is
dropless (as MegaBlocks and Megatron-LM's dropless mode) unless the plan gives
a ``capacity_factor``: then, as Megatron-LM's ``topk_softmax_with_capacity``
with its default ``probs`` drop policy, each expert takes at most
``ceil(tokens x k / experts x capacity_factor)`` of the (token, choice) rows
of a rank's microbatch (its part of the sequence under tensor or context
parallelism: the tokens its router scores), those with the highest gates,
before any dispatch; a dropped choice adds nothing to its token's output (the
residual carries it).
There is no auxiliary load-balancing loss.
Shared experts are DeepSeekMoE's (Dai et al. 2024): one dense feed-forward of
``shared_experts x expert_ffn_hidden`` that every token goes through, added
to the routed output.

The routed experts' weights are 3-D parameters ``[num_experts, in, out]``
(:class:`RoutedExperts`), so expert parallelism keeps a rank's experts by
slicing dim 0. Parameters register in the simulator's matmul order: the
router, the routed experts (gate, up, down or fc1, fc2), the shared experts.

Token flow: each (token, choice) row is sorted by expert, the experts run on
their contiguous rows, and the rows are put back and weighted. With
:class:`AllToAllDispatcher` (expert parallelism) the sorted rows travel to
their experts' ranks and back between those steps, as Megatron-LM's
all-to-all token dispatcher does; with :class:`ExpertTensorParallel` the tp
group all-gathers the rows its experts received, each rank runs its slice
of every expert on them, and the partial outputs are reduce-scattered back.
The shared experts run first, as Megatron-LM's ``MoELayer`` runs them.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from parsim.workload.model import TransformerModel

from .._torch import require_torch
from .comm import EPGroup, TPGroup, combine, dispatch, gather_rows, scatter_rows

torch = require_torch()
nn = torch.nn
F = torch.nn.functional


class RoutedExperts(nn.Module):
    """Feed-forward experts stored as ``[experts, in, out]`` weights: SwiGLU ``gate``, ``up``, ``down``
    (``down(silu(x gate) * x up)``) or GeLU ``fc1``, ``fc2``.

    ``forward(x, counts)`` runs expert ``j`` (of the experts held here) on the
    next ``counts[j]`` rows of ``x``.
    """

    def __init__(self, num_experts: int, hidden: int, ffn_hidden: int, ffn_type: str):
        super().__init__()
        self.swiglu = ffn_type == "swiglu"
        inner = ("gate", "up") if self.swiglu else ("fc1",)
        for name in inner:
            setattr(self, name, nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden)))
        setattr(self, "down" if self.swiglu else "fc2", nn.Parameter(torch.empty(num_experts, ffn_hidden, hidden)))

    def forward(self, x, counts: list[int]):
        if self.swiglu:
            weights = zip(self.gate.unbind(0), self.up.unbind(0), self.down.unbind(0))
            outs = [(F.silu(rows @ gate) * (rows @ up)) @ down
                    for rows, (gate, up, down) in zip(x.split(counts), weights)]
        else:
            outs = [F.gelu(rows @ fc1) @ fc2 for rows, (fc1, fc2) in
                    zip(x.split(counts), zip(self.fc1.unbind(0), self.fc2.unbind(0)))]
        return torch.cat(outs)


def set_capacity(modules: list, capacity_factor: float | None, drop_groups: Any = None) -> None:
    """Cap every MoE layer under ``modules`` at ``capacity_factor``: over all the tokens of each call (a
    rank's microbatch, or its part of the sequence under tensor or context parallelism), or, given
    ``drop_groups`` (each token's group, for the single-process reference), over each group."""
    for root in modules:
        for module in root.modules():
            if isinstance(module, MoEFeedForward):
                module.capacity_factor, module.drop_groups = capacity_factor, drop_groups


class AllToAllDispatcher:
    """Expert parallelism: runs the sorted rows on the experts of their ranks of ``ep`` (Megatron-LM's
    all-to-all token dispatcher).

    The dispatch all-to-all (after exchanging the per-expert counts) gives this
    rank the rows for its experts, grouped by source rank; they are regrouped
    by local expert, run, put back in source order and returned by the
    combine all-to-all, in the order they were sent.
    """

    def __init__(self, ep: EPGroup, layer: str):
        self.ep, self.layer = ep, layer
        self.received = None  # the last dispatch's rows per local expert, from every rank of the group

    def __call__(self, rows, counts, experts: Callable[[Any, Any], Any]):
        """``experts(rows, counts)`` runs rows sorted by local expert (``counts`` each, a tensor)."""
        received, received_counts = dispatch(rows, counts, self.ep, self.layer)  # [source rank, local expert]
        out, self.received = by_expert(received, received_counts, experts)
        return combine(out, self.ep, self.layer, received_counts.sum(1).tolist(),
                       counts.view(received_counts.shape[0], -1).sum(1).tolist())


def by_expert(rows, counts, experts: Callable[[Any, Any], Any]) -> tuple[Any, Any]:
    """Run ``rows``, in blocks by source rank and within each by expert (``counts[source, expert]``), through
    ``experts`` sorted by expert: their outputs in the order of ``rows``, and the rows per expert."""
    sources, local = counts.shape
    expert_of_row = torch.arange(local, device=rows.device).repeat(sources).repeat_interleave(counts.flatten())
    order = expert_of_row.argsort(stable=True)  # by expert, then source
    per_expert = counts.sum(0)
    out = experts(rows.index_select(0, order), per_expert)
    return out.index_select(0, order.argsort()), per_expert


class ExpertTensorParallel:
    """Tensor parallelism of the routed experts over ``tp`` (Megatron-LM's expert tensor parallelism, its
    group the tp group by default): each rank holds a column slice of every expert's gate/up (fc1) and the
    matching row slice of its down (fc2). The rows this rank's experts received are all-gathered from the
    group (with their counts), every rank runs its slices on all of them, and the partial outputs are
    reduce-scattered back to the rank that received each row (``MoEAlltoAllTokenDispatcher``'s
    ``dispatch_postprocess`` and ``combine_preprocess``)."""

    def __init__(self, tp: TPGroup, layer: str):
        self.tp, self.layer = tp, layer
        self.held = None  # the last forward's rows per expert here, from every rank of the group

    def __call__(self, rows, counts, experts: RoutedExperts, nbytes: int):
        """``nbytes``: what both events record, the simulator's: the rows every rank of the group routed."""
        gathered, every = gather_rows(rows, counts, self.tp, self.layer, nbytes)  # [tp rank, expert]
        out, self.held = by_expert(gathered, every, lambda sorted_rows, held: experts(sorted_rows, held.tolist()))
        return scatter_rows(out, every.sum(1).tolist(), self.tp, self.layer, nbytes)


class MoEFeedForward(nn.Module):
    """Router, routed experts and shared experts of one MoE layer (see the module docstring)."""

    def __init__(self, m: TransformerModel, shared: Any = None):
        super().__init__()
        self.num_experts, self.top_k = m.num_experts, m.experts_per_token
        self.router = nn.Linear(m.hidden, m.num_experts, bias=False)
        self.experts = RoutedExperts(m.num_experts, m.hidden, m.expert_ffn_hidden, m.ffn_type)
        self.shared = shared  # a dense FeedForward of shared_experts x expert_ffn_hidden, or None
        self.dispatcher: AllToAllDispatcher | None = None  # expert parallelism sets it
        self.tensor_parallel: ExpertTensorParallel | None = None  # tensor parallelism sets it
        self.capacity_factor: float | None = None  # the plan's: each expert's rows capped (None: dropless)
        self.drop_groups = None  # each token's capacity group, ids from 0, all of a size (None: one group)
        # a list: each forward's busiest expert here over the mean an expert gets (parsim run; tensors, so a GPU
        # need not wait for them)
        self.loads: list[Any] | None = None

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        shared = None if self.shared is None else self.shared(tokens)  # Megatron-LM runs them first
        top, chosen = self.router(tokens).topk(self.top_k, dim=-1)
        gates = F.softmax(top.float(), dim=-1).to(tokens.dtype)  # [tokens, k]
        if self.capacity_factor is not None:
            y = self._with_capacity(tokens, chosen, gates)
        else:
            order = chosen.flatten().argsort(stable=True)  # (token, choice) rows sorted by expert
            counts = torch.bincount(chosen.flatten(), minlength=self.num_experts)
            rows = tokens.index_select(0, order // self.top_k)
            out = self._run_experts(rows, counts, chosen.numel())
            out = out.index_select(0, order.argsort()).view(len(tokens), self.top_k, -1)  # back per token
            y = (out * gates.unsqueeze(-1)).sum(1)
        return (y if shared is None else y + shared).view_as(x)

    def _run_experts(self, rows, counts, routed: int):
        """``rows`` (sorted by expert, ``counts`` each) through their experts, here or on their ranks; with
        ``loads``, note the busiest expert here over the mean of the ``routed`` (token, choice) rows every
        rank of the ep (and tp) group routes (as many as this one)."""
        experts, held, ranks = self._local_experts(routed * rows.shape[-1] * rows.element_size()), counts, 1
        if self.dispatcher is None:
            out = experts(rows, counts)
        else:
            out = self.dispatcher(rows, counts, experts)
            held, ranks = self.dispatcher.received, self.dispatcher.ep.size
        if self.tensor_parallel is not None:
            held, ranks = self.tensor_parallel.held, ranks * self.tensor_parallel.tp.size
        if self.loads is not None:
            self.loads.append(held.max() / (routed * ranks / self.num_experts))
        return out

    def _local_experts(self, routed_bytes: int) -> Callable[[Any, Any], Any]:
        """What runs rows sorted by this rank's experts (a tensor of counts each): the experts, or their
        tensor-parallel slices with the tp group's rows (events of the tp group's ``routed_bytes``)."""
        if self.tensor_parallel is None:
            return lambda rows, counts: self.experts(rows, counts.tolist())
        nbytes = routed_bytes * self.tensor_parallel.tp.size
        return lambda rows, counts: self.tensor_parallel(rows, counts, self.experts, nbytes)

    def _with_capacity(self, tokens, chosen, gates):
        """The forward with each expert capped at its capacity per drop group: the kept (token, choice) rows
        only are sorted, sent and run; a dropped choice's output is zero."""
        kept = self.kept_choices(chosen.flatten(), gates.flatten().detach())
        order = kept[chosen.flatten()[kept].argsort(stable=True)]  # the kept rows, sorted by expert
        counts = torch.bincount(chosen.flatten()[kept], minlength=self.num_experts)
        rows = tokens.index_select(0, order // self.top_k)
        out = self._run_experts(rows, counts, chosen.numel())
        every = out.new_zeros(chosen.numel(), out.shape[-1]).index_copy(0, order, out)
        return (every.view(len(tokens), self.top_k, -1) * gates.unsqueeze(-1)).sum(1)

    def kept_choices(self, choice, gate):
        """Indices of the (token, choice) rows within their expert's capacity: per drop group of tokens and
        expert, the ``ceil(rows / experts x capacity_factor)`` with the highest gates (ties: the earlier)."""
        per_token, groups = self.top_k, self.drop_groups
        tokens = len(choice) // per_token
        group = tokens if groups is None else tokens // (int(groups.max()) + 1)
        capacity = math.ceil(group * per_token / self.num_experts * self.capacity_factor)
        bucket = choice if groups is None else groups.repeat_interleave(per_token) * self.num_experts + choice
        by_gate = (-gate).argsort(stable=True)
        ranked = by_gate[bucket[by_gate].argsort(stable=True)]  # by bucket, each by gate, highest first
        sorted_bucket = bucket[ranked]
        place = torch.arange(len(choice), device=choice.device) - torch.searchsorted(sorted_bucket, sorted_bucket)
        return ranked[place < capacity].sort().values
