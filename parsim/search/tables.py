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
from ..workload.memory import ADAM_STATE_BYTES
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


def layout_of(plan: Plan, placement: str) -> Layout:
    """``plan``'s stages and their placement on ranks (``"loop"`` or ``"v"``, as its schedule places them;
    the schedule itself is not built)."""
    types = {id(c.blocks): i for i, c in enumerate(entry_types(plan))}
    stages = tuple(tuple(types[id(c.blocks)] for c in plan.stage_costs(s)) for s in range(plan.num_stages))
    counts = np.zeros((len(stages), len(types)))
    for s, entries in enumerate(stages):
        np.add.at(counts[s], list(entries), 1)
    places = Schedule("placement", plan.pp, 1, plan.virtual_stages, [[] for _ in range(plan.pp)], placement)
    owner = tuple(places.stage_to_rank(s) for s in range(plan.num_stages))
    ranks = np.array([places.stages_of(p) for p in range(plan.pp)])
    distinct = tuple(dict.fromkeys(stages))
    return Layout(stages, owner, ranks, counts, distinct, np.array([distinct.index(e) for e in stages]))


@dataclass(frozen=True)
class EntryTables:
    """Per entry type: this rank's parameters, the routed experts' part, bytes saved per token for the
    backward (the input alone where recomputed), whether it is recomputed, its activations (what a
    recomputation rebuilds), and its parameter tensors (the optimizer's per-tensor costs)."""

    params: np.ndarray
    experts: np.ndarray
    saved: np.ndarray
    recomputed: np.ndarray
    activations: np.ndarray
    tensors: np.ndarray


def entry_tables(plan: Plan) -> EntryTables:
    types = entry_types(plan)
    recomputed = {c.name for s in range(plan.num_stages) for c in plan.recomputed(s)}
    flags = np.array([c.name in recomputed for c in types])
    activations = np.array([c.activation_bytes_per_token(plan.tp) for c in types], dtype=float)
    checkpoint = np.array([c.checkpoint_bytes_per_token(plan.tp) for c in types], dtype=float)
    return EntryTables(
        np.array([c.params_per_rank(plan.tp, plan.ep) for c in types], dtype=float),
        np.array([c.expert_params_per_rank(plan.tp, plan.ep) for c in types], dtype=float),
        np.where(flags, checkpoint, activations), flags, activations,
        np.array([len(param_tensors(c, plan.tp, plan.ep)) for c in types], dtype=float))


@dataclass(frozen=True)
class RankTables:
    """Per pipeline rank: parameters, routed experts' part, the largest entry and its largest without its routed
    experts (FSDP buffers), bytes per token one in-flight microbatch keeps, bytes per token a recomputation
    rebuilds, parameter tensors."""

    params: np.ndarray
    experts: np.ndarray
    largest: np.ndarray
    largest_dense: np.ndarray
    stage_saved: np.ndarray  # [pp, stages per rank]: what each of its stages saves per microbatch and token
    rebuilt: np.ndarray
    tensors: np.ndarray


def rank_tables(layout: Layout, t: EntryTables) -> RankTables:
    counts = layout.rank_counts
    present = counts > 0
    stage_saved = (layout.counts @ t.saved)[layout.rank_stages]
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
                grad_bytes: int) -> SyncArrays:
    """ZeRO stage ``k`` shards a state from stage ``k`` on: the weights (3), gradients (2), optimizer (1)."""
    master = FP32 if dtype_bytes < FP32 else 0
    states = ((3, dtype_bytes), (2, grad_bytes), (1, ADAM_STATE_BYTES + master))
    whole = sum(np.where(zero < k, b, 0.0) for k, b in states)
    sharded = sum(np.where(zero >= k, b, 0.0) for k, b in states)
    return SyncArrays(whole, sharded / shard, sharded / expert_shard, (zero == 3) & (shard > 1), expert_shard == 1)


def peak_memory(ranks: list[RankTables], which: np.ndarray, sync: SyncArrays, in_flight: np.ndarray,
                tokens: int, dtype_bytes: int, grad_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Per variant, the largest per-GPU total over the pipeline ranks, and the largest without activations
    (weights, gradients, optimizer state, FSDP buffers): ``ranks[which[i]]`` are variant ``i``'s rank
    tables (by its sequence parallelism and recomputation). ``in_flight``: [pp, moments, stages per rank],
    the microbatches in flight on each of a rank's stages at the moments its activations may peak
    (:func:`~parsim.schedules.in_flight_by_stage`, rows of zeros padding)."""
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
    return (state + activations).max(axis=1), state.max(axis=1)
