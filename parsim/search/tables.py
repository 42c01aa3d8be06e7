"""Per-entry and per-rank figures of a plan, and its memory, for many variants at once.

A plan's stages are runs of *entries* (the embedding, layers, the head) and
layers come in one or two kinds, so everything a pipeline rank holds or
computes is a count of entry types times a per-type figure. :class:`Layout`
counts the entries of each stage and rank (it depends only on the pipeline
depth, the virtual stages and their placement); :class:`EntryTables` holds
the per-type figures (parameters, bytes saved per token, parameter tensors),
which depend on the tensor- and expert-parallel degrees, sequence parallelism
and recomputation; :func:`peak_memory` combines them into
:func:`parsim.workload.memory.memory`'s account for every variant of a setting in a
few array operations (``tests/test_search_fast.py`` checks it against
:func:`~parsim.workload.memory.memory` plan by plan).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..lowering.lower import FP32, param_tensors
from ..schedules import Schedule
from ..workload.model import LayerCost
from ..workload.plan import Plan


@dataclass(frozen=True)
class Layout:
    """Which entries each stage runs and which stages each pipeline rank owns."""

    stage_entries: tuple[tuple[int, ...], ...]  # per stage: entry types in forward order
    stage_rank: tuple[int, ...]  # per stage: its pipeline rank
    rank_stages: np.ndarray  # [pp, stages per rank]: each rank's stages, increasing
    counts: np.ndarray  # [stages, types]: entries of each type per stage
    distinct: tuple[tuple[int, ...], ...]  # the different stage_entries (first, middle, last stages...)
    distinct_of: np.ndarray  # per stage: its index in ``distinct``

    @property
    def rank_counts(self) -> np.ndarray:
        """[pp, types]: entries of each type per rank."""
        return self.counts[self.rank_stages].sum(axis=1)


def entry_types(plan: Plan) -> list[LayerCost]:
    """The distinct entries of ``plan``'s stages: the embedding, the layer kinds (dense, then
    mixture-of-experts, as they first appear), the head, the multi-token prediction modules (those the model
    has; its layers of one kind, and its modules, share their blocks)."""
    embedding, layers, head = plan._costs
    out, seen = [], set()
    for cost in [embedding, *layers, head, *plan._mtp_costs]:
        if cost is not None and id(cost.blocks) not in seen:
            seen.add(id(cost.blocks))
            out.append(cost)
    return out


def recomputable_types(plan: Plan) -> list[int]:
    """The entry types whose layers full recomputation reruns (:attr:`LayerCost.recomputable`)."""
    return [t for t, c in enumerate(entry_types(plan)) if c.recomputable]


def twinned(plan: Plan) -> bool:
    """Whether ``plan`` recomputes only some layers of each stage (``recompute_layers``): its tables then hold a
    *twin* type after the others for each recomputable type (:func:`recomputable_types`, in order), standing for
    its layers that are rerun, the type itself for those that are not."""
    return plan.activation_recompute == "full" and plan.recompute_layers is not None


def layout_of(plan: Plan, placement: str) -> Layout:
    """``plan``'s stages and their placement on ranks (``"loop"`` or ``"v"``, as its schedule places them;
    the schedule itself is not built); a stage's recomputed layers as their twin types where it recomputes only
    some (:func:`twinned`)."""
    types = {id(c.blocks): i for i, c in enumerate(entry_types(plan))}
    twins = {t: len(types) + j for j, t in enumerate(recomputable_types(plan))} if twinned(plan) else {}
    stages = tuple(tuple(_twin_first(plan, s, types, twins)) for s in range(plan.num_stages))
    counts = np.zeros((len(stages), len(types) + len(twins)))
    for s, entries in enumerate(stages):
        np.add.at(counts[s], list(entries), 1)
    places = Schedule("placement", plan.pp, 1, plan.virtual_stages, [[] for _ in range(plan.pp)], placement)
    owner = tuple(places.stage_to_rank(s) for s in range(plan.num_stages))
    ranks = np.array([places.stages_of(p) for p in range(plan.pp)])
    distinct = tuple(dict.fromkeys(stages))
    return Layout(stages, owner, ranks, counts, distinct, np.array([distinct.index(e) for e in stages]))


def _twin_first(plan: Plan, stage: int, types: dict[int, int], twins: dict[int, int]) -> list[int]:
    """``stage``'s entry types in forward order, its first ``recompute_layers`` recomputable layers as their twins
    (:meth:`~parsim.workload.plan.Plan.recomputed`)."""
    out, rerun = [], plan.recompute_layers or 0
    for cost in plan.stage_costs(stage):
        t = types[id(cost.blocks)]
        if t in twins and rerun:
            t, rerun = twins[t], rerun - 1
        out.append(t)
    return out


@dataclass(frozen=True)
class EntryTables:
    """Per entry type: this rank's parameters, the routed experts' part, bytes saved per token for the
    backward (the input alone where recomputed), whether it is recomputed, its activations (what a
    recomputation rebuilds), its parameter tensors (the optimizer's per-tensor costs), and bytes per token it
    keeps while a deferred weight gradient waits (:func:`~parsim.workload.memory.waiting_bytes_per_token`)."""

    params: np.ndarray
    experts: np.ndarray
    saved: np.ndarray
    recomputed: np.ndarray
    activations: np.ndarray
    tensors: np.ndarray
    waiting: np.ndarray


def entry_tables(plan: Plan) -> EntryTables:
    """Per entry type of ``plan``, with its twins where it recomputes only some layers (:func:`twinned`)."""
    types = entry_types(plan)
    if twinned(plan):
        twins = recomputable_types(plan)
        types = types + [types[t] for t in twins]
        flags = np.arange(len(types)) >= len(types) - len(twins)
    else:
        recomputed = {c.name for s in range(plan.num_stages) for c in plan.recomputed(s)}
        flags = np.array([c.name in recomputed for c in types])
    activations = np.array([c.activation_bytes_per_token(plan.tp) for c in types], dtype=float)
    checkpoint = np.array([c.checkpoint_bytes_per_token(plan.tp) for c in types], dtype=float)
    return EntryTables(
        np.array([c.params_per_rank(plan.tp, plan.ep) for c in types], dtype=float),
        np.array([c.expert_params_per_rank(plan.tp, plan.ep) for c in types], dtype=float),
        np.where(flags, checkpoint, activations), flags, activations,
        np.array([len(param_tensors(c, plan.tp, plan.ep)) for c in types], dtype=float),
        np.array([c.weight_grad_bytes_per_token(plan.tp, plan.dtype_bytes, plan.sequence_parallel) for c in types],
                 dtype=float))


@dataclass(frozen=True)
class RankTables:
    """Per pipeline rank: parameters, routed experts' part, the largest entry and its largest without its routed
    experts (FSDP buffers), bytes per token one in-flight microbatch keeps, bytes per token a recomputation
    rebuilds, parameter tensors."""

    params: np.ndarray
    experts: np.ndarray
    largest: np.ndarray
    largest_dense: np.ndarray
    # [pp, 2 x stages per rank]: what each of its stages saves per microbatch and token, then what each keeps while
    # a microbatch's deferred weight gradient waits (the columns of schedule_facts' in-flight counts)
    stage_saved: np.ndarray
    rebuilt: np.ndarray
    tensors: np.ndarray


def rank_tables(layout: Layout, t: EntryTables) -> RankTables:
    counts = layout.rank_counts
    present = counts > 0
    stage_saved = np.concatenate([(layout.counts @ t.saved)[layout.rank_stages],
                                  (layout.counts @ t.waiting)[layout.rank_stages]], axis=1)
    rebuilt = np.where(present & t.recomputed, t.activations, 0.0).max(axis=1)
    return RankTables(counts @ t.params, counts @ t.experts, np.where(present, t.params, 0.0).max(axis=1),
                      np.where(present, t.params - t.experts, 0.0).max(axis=1), stage_saved, rebuilt,
                      counts @ t.tensors)


@dataclass(frozen=True)
class SyncArrays:
    """Per variant, how ZeRO holds training state: bytes per parameter held whole (``whole``), per
    dense parameter and per expert parameter, each sharded; whether FSDP keeps unsharded buffers, and
    whether they leave out the routed experts (no other rank of the shard group holds them)."""

    whole: np.ndarray
    dense: np.ndarray
    expert: np.ndarray
    buffers: np.ndarray
    experts_whole: np.ndarray


def sync_arrays(zero: np.ndarray, shard: np.ndarray, expert_shard: np.ndarray, dtype_bytes: int,
                grad_bytes: int, microbatches: int) -> SyncArrays:
    """ZeRO stage ``k`` shards a state from stage ``k`` on: the weights (3), gradients (2), optimizer (1), as
    :func:`~parsim.workload.memory.memory` holds them: FSDP's fp32 shards are the master weights
    (:func:`~parsim.workload.memory.weight_bytes`), ZeRO-2's gradients add up whole over several microbatches
    (:func:`~parsim.workload.memory.gradients_accumulate_whole`)."""
    fsdp = (zero == 3) & (shard > 1)
    master = np.where(fsdp, 0, FP32 if dtype_bytes < FP32 else 0)
    weights = np.where(fsdp, max(dtype_bytes, FP32), dtype_bytes)
    grads_from = np.where((zero == 2) & (microbatches > 1), 3, 2)  # the stage from which the gradients shard
    states = ((3, weights), (grads_from, grad_bytes), (1, 2 * FP32 + master))  # the search's AdamW: fp32 moments
    whole = sum(np.where(zero < k, b, 0.0) for k, b in states)
    sharded = sum(np.where(zero >= k, b, 0.0) for k, b in states)
    return SyncArrays(whole, sharded / shard, sharded / expert_shard, fsdp, expert_shard == 1)


def peak_memory(ranks: list[RankTables], which: np.ndarray, sync: SyncArrays, in_flight: np.ndarray,
                tokens: int, dtype_bytes: int, grad_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Per variant, the largest per-GPU total over the pipeline ranks, and the largest without activations
    (weights, gradients, optimizer state, FSDP buffers): ``ranks[which[i]]`` are variant ``i``'s rank
    tables (by its sequence parallelism and recomputation). ``in_flight``: [pp, moments, stages per rank],
    the microbatches in flight on each of a rank's stages at the moments its activations may peak
    (:func:`~parsim.schedules.in_flight_by_stage`, rows of zeros padding)."""
    state, activations = rank_memory(ranks, which, sync, in_flight, tokens, dtype_bytes, grad_bytes)
    return (state + activations).max(axis=1), state.max(axis=1)


def rank_memory(ranks: list[RankTables], which: np.ndarray, sync: SyncArrays, in_flight: np.ndarray,
                tokens: int, dtype_bytes: int, grad_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`peak_memory`'s two parts per variant and pipeline rank: [variants, pp] bytes of training state,
    and of activations."""
    params = np.array([r.params for r in ranks])[which]
    experts = np.array([r.experts for r in ranks])[which]
    activations = np.array([((in_flight * r.stage_saved[:, None, :]).sum(axis=2).max(axis=1) + r.rebuilt) * tokens
                            for r in ranks])[which]
    whole = sync.experts_whole[:, None]  # as parsim.workload.memory: experts never gathered hold no buffer
    if params.shape[1] > 1:  # under a pipeline, every layer gathered and its gradients kept
        buffers = (params - np.where(whole, experts, 0.0)) * (dtype_bytes + grad_bytes)
    else:
        largest = np.where(whole, np.array([r.largest_dense for r in ranks])[which],
                           np.array([r.largest for r in ranks])[which])
        buffers = largest * (2 * dtype_bytes + grad_bytes)
    state = (sync.whole[:, None] * params + sync.dense[:, None] * (params - experts) + sync.expert[:, None] * experts
             + np.where(sync.buffers[:, None], buffers, 0.0))
    return state, activations


@dataclass(frozen=True)
class RecomputeSteps:
    """A layout's stages with their first ``n`` recomputable layers recomputed, for every ``n`` from 0 to the most
    a stage has (``[n, stages]``; a shorter stage's all of them beyond its own): bytes per token one in-flight
    microbatch keeps, and the most one recomputed layer rebuilds; and per stage ([stages]) what a microbatch keeps
    while its deferred weight gradient waits, recomputed or not."""

    saved: np.ndarray
    rebuilt: np.ndarray
    waiting: np.ndarray


def recompute_steps(layout: Layout, none: EntryTables, full: EntryTables) -> RecomputeSteps | None:
    """:class:`RecomputeSteps` of ``layout`` from its tables without recomputation (``none``) and with every
    layer recomputed (``full``); None where no stage has two layers to recompute (some is then all)."""
    rerun = full.recomputed
    positions = [[t for t in entries if rerun[t]] for entries in layout.stage_entries]
    most = max(map(len, positions))
    if most < 2:
        return None
    less, rebuilt = np.zeros((most + 1, len(positions))), np.zeros((most + 1, len(positions)))
    for st, types in enumerate(positions):
        n = len(types) + 1
        less[1:n, st] = np.cumsum(none.saved[types] - full.saved[types])
        less[n:, st] = less[n - 1, st]
        rebuilt[1:n, st] = np.maximum.accumulate(none.activations[types])
        rebuilt[n:, st] = rebuilt[n - 1, st]
    return RecomputeSteps((layout.counts @ none.saved)[None, :] - less, rebuilt, layout.counts @ none.waiting)


def layers_to_recompute(layout: Layout, steps: RecomputeSteps, state: np.ndarray, in_flight: np.ndarray,
                        tokens: int, capacity: float) -> tuple[int, float] | None:
    """The fewest layers of each stage whose full recomputation (the first ones of the stage,
    :meth:`~parsim.workload.plan.Plan.recomputed`) brings every pipeline rank within ``capacity`` bytes, given its
    training state (``state``: [pp] bytes), and the peak bytes per GPU then; None where that takes all the layers
    of the longest stage, or none fits without recomputation. Each
    layer recomputed keeps its checkpoint instead of its activations, per in-flight microbatch, and the rank
    rebuilds one layer's activations at a time (:func:`rank_tables`): the same account as :func:`peak_memory`
    of a plan with ``recompute_layers``, for every count at once."""
    saved = steps.saved[:, layout.rank_stages]  # [n, pp, stages per rank]
    waiting = np.broadcast_to(steps.waiting[layout.rank_stages], saved.shape)
    held = np.einsum("pms,nps->npm", in_flight, np.concatenate([saved, waiting], axis=2)).max(axis=2)  # [n, pp]
    total = state[None, :] + (held + steps.rebuilt[:, layout.rank_stages].max(axis=2)) * tokens
    peak = total.max(axis=1)
    fitting = np.flatnonzero(peak[:-1] <= capacity)
    return (int(fitting[0]), float(peak[fitting[0]])) if len(fitting) and fitting[0] else None
