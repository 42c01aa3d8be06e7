"""The fast tier: a plan's step time and memory in closed form over the simulator's own costs.

For one :class:`~parsim.search.space.Setting` and its variants, the fast
model charges what the step simulator charges, priced without simulating:

* **passes** — per stage and pass kind, the sum of its entries' passes
  (:mod:`parsim.search.costs`); with FSDP, each entry also waits for the
  all-gather of its weights, prefetched one entry ahead on a stream of its
  own, as the lowering orders them (under a pipeline only in each stage's
  first forward, charged before the rank's first pass), and runs on the SMs
  the gathers' and reduce-scatters' kernels beside it leave;
* **the pipeline** — the schedule timed by its dependencies
  (:mod:`parsim.search.pipeline`), a transfer between ranks costing an
  uncontended send;
* **the tail** of each pipeline rank — gradient buckets reduced on the
  communication stream as the final backward makes them (all-reduce, or
  reduce-scatter under ZeRO, plus the HSDP all-reduce across replicas),
  FSDP's per-layer reduce-scatters (under a pipeline, each stage's after its
  last backward), the sequence-parallel norm sync, the
  optimizer step, and ZeRO-1/2's weight all-gathers after it;
* **memory** — :func:`parsim.workload.memory.memory`'s account (:mod:`parsim.search.tables`).

Collectives are priced alone, as if nothing else used their links, with
one exception: under FSDP, a context-parallel exchange shares the NICs with
the weights the gather stream brings in meanwhile, and is priced beside that
gather (:meth:`FastModel.pass_table`). Other contention is left out. FSDP's passes without a pipeline run
on the SMs its gathers' and reduce-scatters' NCCL kernels leave while they run (:mod:`parsim.sim.held_sms`,
:func:`_gathered_pass`), and each stage's final backward on those its gradient buckets' kernels leave
(:meth:`FastModel._bucket_slowing`), the pipeline carrying the delay on; what the buckets still running
after that pass, and FSDP's reductions under a pipeline, hold is left out (``docs/search.md`` measures the
difference).

:meth:`FastModel.prepare` gives every variant's memory and a lower bound of
its step time (each rank's own work, its earliest start and
its tail) in a few array operations per setting; :meth:`FastModel.estimate`
times the pipelines of many plans in batches.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Hashable

import numpy as np

from ..hardware.cluster import ClusterSpec
from ..lowering.lower import (FP32, PASS_PHASE, REDUCE_CALL, UNSHARD_CALL, CommPiece, Lowering, bucket_members,
                              clip_costs, fsdp_bytes, gathered_bytes, grad_norm_dims, param_tensors, pipeline_bytes,
                              step_costs, tied_table_bytes, unscale_costs)
from ..report.step_report import PHASES
from ..schedules import SCHEDULES, in_flight_by_stage, make_schedule, paired_schedule
from ..sim.compute import ComputeModel
from ..workload.model import MLPModel
from ..workload.plan import (DTYPE_BYTES, Accumulation, Plan, accumulation, attention_seq, copies_embedding_table,
                             default_reduce_dtype, keeps_main_grads, master_weights)
from .costs import KINDS, PASS_PHASES, CommCosts, ExchangeCost, PassCosts, PassTable, no_cost
from .pipeline import PipelineTiming, pairs_per_rank, time_schedule
from .space import SearchSpace, Setting, Variant, recompute_setting
from .tables import (Layout, SyncArrays, entry_tables, entry_types, layers_to_recompute, layout_of, peak_memory,
                     rank_memory, rank_tables, recompute_steps, recomputable_types, sync_arrays)

SPLIT_SCHEDULES = ("zero-bubble", "zb-h2", "zbv")  # every backward runs as I, then W
# FSDP2's copies per pass kind (F, B, I, W), as the lowering adds them: out of the gathered buffer before a
# pass that gathers (F, B, I), into the reduce-scatter's buffer after one that finishes gradients (B, W).
GATHER_COPIES = np.array([1.0, 1.0, 1.0, 0.0])
SCATTER_COPIES = np.array([0.0, 1.0, 0.0, 1.0])
COPY_PHASES = ("forward", "backward", "backward", "weight-grad")
V_SCHEDULES = ("zbv", "dualpipe-v")
RERUN_KINDS = [KINDS.index("B"), KINDS.index("I")]  # the passes a recomputed layer's forward runs again in


@dataclass
class Prepared:
    """A setting's variants: memory, and for those that fit a lower bound of the step time."""

    setting: Setting
    variants: tuple[Variant, ...]
    memory: np.ndarray  # [variants] peak bytes per GPU
    state: np.ndarray  # [variants] the same without activations: weights, gradients, optimizer, FSDP buffers
    bound: np.ndarray  # [variants] seconds (inf where the plan does not fit)
    inputs: dict[int, "_Inputs"]  # by variant index: its pipeline's inputs (shared by variants alike)


@dataclass
class _Inputs:
    """The pipeline of one group of variants that run the same passes: per-stage pass seconds, transfers
    between ranks, when each rank can start, and (once timed) the timing."""

    key: tuple
    durations: np.ndarray  # [stages * 4]
    hops: np.ndarray  # [stages - 1]
    start: np.ndarray  # [pp]
    waits: np.ndarray  # [stages * 4]: FSDP's waits for gathers inside each pass
    lead: np.ndarray  # [stages * 4]: the part of those a rank spends before the pass's inputs matter
    slowed: np.ndarray  # [stages * 4]: FSDP: what the SMs its collectives' kernels hold add to each pass
    ends: list[list[np.ndarray]] | None = None  # FSDP: per distinct stage and kind, entry ends within the pass
    # [stages]: what the gradient buckets' kernels, holding SMs beside each stage's final backward, add to it
    final_extra: np.ndarray | None = None
    fsdp_tables: tuple[np.ndarray, np.ndarray] | None = None  # the same per (stage, kind), with the scatters
    offsets: dict[int, np.ndarray] | None = None  # per stage, when its entries' gradients are final in its last pass
    # [stages, stages] ep_comm_overlap: what a pair of a forward and a backward of these stages saves
    savings: np.ndarray | None = None
    timing: PipelineTiming | None = None


@dataclass
class Estimate:
    """The fast model's figures for one plan."""

    step_s: float
    memory_bytes: float
    phases: dict[str, float]  # the slowest pipeline rank's step, by the step report's phases
    rank: int  # that pipeline rank


class FastModel:
    """Fast estimates for the plans of one :class:`SearchSpace` on one cluster.

    Its caches hold what a setting's stage split gives (stages, their ranks' parameters, buckets, ...) keyed by
    the setting's degrees and schedule alone: the settings whose layers are balanced over their stages
    (``Setting.balanced``) go to a second model of the same space, which shares the pricing of passes and
    collectives (:meth:`prepare`, :meth:`estimate`)."""

    def __init__(self, space: SearchSpace, cluster: ClusterSpec, capacity: float | None = None,
                 even: "FastModel | None" = None):
        """``capacity``: bytes a plan may use per GPU (default: the GPU's memory). ``even``: given (by
        :meth:`_for` alone), this is the model for the settings of balanced stages, and ``even`` the other."""
        self.space, self.cluster = space, cluster
        self.dtype_bytes = d = DTYPE_BYTES[space.dtype]
        self.grad_bytes = DTYPE_BYTES[space.reduce_dtype or default_reduce_dtype(space.dtype)]
        self.capacity = capacity or cluster.gpu.hbm_capacity_bytes
        self._plans: dict[tuple, Plan] = {}
        self._cache: dict[tuple, object] = {}
        self.balanced, self._other = even is not None, even
        if even is not None:  # the even model's pricing, shared
            self._compute_for, self.compute, self.comm, self._passes = even._compute_for, even.compute, even.comm, \
                even._passes
            return
        # The kernel model, for attention kernels over a given sequence length (0: the longest the cluster gives)
        self._compute_for = partial(ComputeModel.for_cluster, cluster, space.dtype, d,
                                    min(space.gpus, cluster.gpus_per_node))
        self.compute = self._compute_for()
        self.comm = CommCosts(cluster, space.gpus, self.compute)
        self._passes: dict[int, PassCosts] = {}  # by cp degree, which sets the attention kernels' length

    def _for(self, s: Setting) -> "FastModel":
        """The model for setting ``s``'s stage split: this one, or the other (made on first use)."""
        if s.balanced == self.balanced:
            return self
        if self._other is None:
            self._other = FastModel(self.space, self.cluster, self.capacity, even=self)
        return self._other

    def _cached(self, key: tuple, make):
        value = self._cache.get(key)
        if value is None:
            value = self._cache[key] = make()
        return value

    def _by_identity(self, key: Hashable, obj: object, make):
        """:meth:`_cached` by ``obj``'s identity (the enumeration's variant tuples, too many to hash each time),
        keeping ``obj`` alive so that no other object takes its id."""
        return self._cached((key, id(obj)), lambda: (obj, make()))[1]

    # -- plans standing in for settings --------------------------------------------------
    def plan(self, s: Setting, v: Variant, *, pp: int | None = None, dp: int | None = None,
             m: int | None = None, schedule: str | None = None, vs: int | None = None) -> Plan:
        """A plan with the setting's and variant's values, some replaced (cached)."""
        pp, dp = pp or s.pp, dp or s.dp
        m, schedule, vs = m or s.num_microbatches, schedule or s.schedule, vs or s.virtual_stages
        if schedule in V_SCHEDULES:
            vs = 2
        if s.balanced != self.balanced:
            raise ValueError("a setting's plans are made by the model for its stage split (FastModel._for)")
        key = (pp, dp, m, schedule, vs, s.tp, s.cp, s.ep, s.microbatch_size, v)
        plan = self._plans.get(key)
        if plan is None:
            model = self.space.model
            recompute, modules = recompute_setting(model, v.recompute)
            if isinstance(model, MLPModel):  # its batch is the model's: a stand-in gets one that fits it
                model = dataclasses.replace(model, batch_size=dp * s.microbatch_size * m)
            plan = self._plans[key] = Plan(
                model=model, dp=dp, tp=s.tp, pp=pp, cp=s.cp, ep=s.ep, microbatch_size=s.microbatch_size,
                num_microbatches=m, schedule=schedule, virtual_stages=vs, dtype=self.space.dtype,
                adamw=self.space.adamw, reduce_dtype=self.space.reduce_dtype, order=v.order,
                sequence_parallel=v.sequence_parallel, tp_comm_overlap=v.tp_overlap,
                activation_recompute=recompute, recompute_modules=modules, recompute_layers=v.recompute_layers,
                context_parallel=v.context_parallel, grad_sync=v.grad_sync, zero=v.zero,
                overlap_param_gather=v.param_overlap, shard_group=v.shard_group,
                bucket_size=self.space.bucket_size, dispatcher=self.space.dispatcher_for(s.ep),
                dispatch_fp8=self.space.dispatch_fp8_for(s.ep), ep_comm_overlap=v.ep_overlap,
                expert_load=self.space.expert_load,
                layers_per_stage="balanced" if self.balanced else None, name="search")
        return plan

    def layout_plan(self, s: Setting, v: Variant) -> Plan:
        """A plan with the setting's degrees, stage placement and the variant's groups and sharding, standing in
        for every microbatch split and schedule of that shape: what groups, buckets and stages need."""
        placement = s.schedule in V_SCHEDULES
        schedule = "zbv" if placement else "interleaved-1f1b" if s.virtual_stages > 1 else "1f1b"
        plain = v._replace(recompute="none", recompute_layers=None, context_parallel="ring", tp_overlap=False,
                           ep_overlap=False)
        return self.plan(s._replace(microbatch_size=1), plain, m=2 * s.pp, schedule=schedule)

    def _structure(self, s: Setting, v: Variant) -> tuple:
        """What :meth:`layout_plan` depends on: a cache key."""
        return (s.dp, s.tp, s.pp, s.cp, s.ep, s.schedule in V_SCHEDULES, s.virtual_stages, v.order,
                v.sequence_parallel, v.grad_sync, v.zero, v.shard_group)

    def _prototype(self, s: Setting, v: Variant, pp: int = 1, vs: int = 1, schedule: str | None = None) -> Plan:
        """``pp`` pipeline ranks of ``vs`` stages (one by default), a schedule that allows them (or ``schedule``),
        and two microbatches per rank: what entries and stages need, unless expert all-to-alls need the
        data-parallel ranks' real layout. Its schedule is never built."""
        plain = v._replace(grad_sync="bucketed", zero=0, shard_group=None, ep_overlap=False)
        if s.tp > 1 and getattr(self.space.model, "is_moe", False):  # MoE under tp is only sequence-parallel
            plain = plain._replace(sequence_parallel=True)
        schedule = schedule or ("interleaved-1f1b" if vs > 1 else "1f1b")
        if s.ep > 1:
            return self.plan(s, plain, m=2 * s.pp, schedule=schedule, vs=vs)
        return self.plan(s, plain, pp=pp, dp=1, m=2 * pp, schedule=schedule, vs=vs)

    def pass_table(self, s: Setting, v: Variant, beside_gathers: bool = False, held_sms: int = 0) -> PassTable:
        """Each entry type's passes; with ``beside_gathers`` (FSDP with context parallelism), each
        context-parallel exchange is priced beside the FSDP all-gather streaming next to it
        (:meth:`_exchange_beside_gathers`); with ``held_sms``, its kernels on the SMs a side stream's
        collective leaves (:meth:`_held_tables`)."""
        beside_gathers = beside_gathers and s.cp > 1 and self._gathers_every_pass(s, v)
        key = (s.tp, s.cp, s.ep, s.microbatch_size, v.sequence_parallel, v.tp_overlap, v.recompute,
               v.recompute_layers is not None, v.context_parallel,
               (s.dp, s.pp, v.order) if s.ep > 1 else None,
               (s.dp, s.pp, v.order, v.shard_group) if beside_gathers else None)
        passes = self.passes(s.cp)
        if v.recompute == "full":  # a recomputed layer's backward starts with its forward again
            def rerun() -> PassTable:
                table = self.pass_table(s, v._replace(recompute="none", recompute_layers=None), beside_gathers,
                                        held_sms)
                if v.recompute_layers is not None:  # the twins of the recomputable types (tables.twinned)
                    table = _rows(table, self._recomputable(s, v))
                return _with_recompute(table, self._entry_tables(s, v).recomputed)
            return passes.derived(key + (held_sms,), rerun)
        exchange = self._exchange_beside_gathers(s, v) if beside_gathers else None
        return passes.table(key, lambda: self._prototype(s, v), exchange, held_sms)

    def passes(self, cp: int) -> PassCosts:
        """Pass pricing for plans of context-parallel degree ``cp``: their attention kernels run over
        1/cp of the sequence (:attr:`~parsim.workload.plan.Plan.attention_seq`), at the cluster's rate for that
        length."""
        passes = self._passes.get(cp)
        if passes is None:
            compute = self._compute_for(attention_seq=attention_seq(self.space.model, cp))
            passes = self._passes[cp] = PassCosts(compute, self.comm)
        return passes

    def _exchange_beside_gathers(self, s: Setting, v: Variant) -> ExchangeCost:
        """Prices a context-parallel exchange of an entry's pass as it runs under FSDP: from the pass's start
        the next entry's weights stream in over the shard group, which holds every rank of the cp group, so
        the two share NICs and NVLink for as long as the gather lasts (``CommCosts.beside``); the exchange
        pays that contention over the part of it the gather covers."""
        lowering = Lowering(self.layout_plan(s, v))
        shard, cp = lowering.group(0, "shard")[0], lowering.group(0, "cp")[0]
        weights, gathers = self._weight_bytes(s, part="dense"), self._fsdp(s, v)[0]

        def exchange(entry: int, piece: CommPiece) -> float:
            alone = self.comm.time("collective", piece.collective, cp, piece.nbytes)
            beside = self.comm.beside(piece.collective, cp, piece.nbytes, "all_gather", shard, weights[entry])
            if beside <= alone:
                return alone
            return alone + (beside - alone) * min(1.0, gathers[entry] / beside)
        return exchange

    def layout(self, s: Setting, v: Variant | None = None) -> Layout:
        """The setting's stages and their entry types; where ``v`` recomputes only some layers of each stage, those
        as their twin types (:func:`~parsim.search.tables.twinned`: the pass tables of ``v`` have their rows)."""
        placement = "v" if s.schedule in V_SCHEDULES else "loop"
        layers = v.recompute_layers if v is not None else None
        plain = _PLAIN if layers is None else _PLAIN._replace(recompute="full", recompute_layers=layers)
        return self._cached(("layout", s.pp, s.virtual_stages, placement, layers),
                            lambda: layout_of(self._prototype(s, plain, pp=s.pp, vs=s.virtual_stages), placement))

    def _ranks(self, s: Setting, v: Variant):
        placement = "v" if s.schedule in V_SCHEDULES else "loop"
        return self._cached(("ranks", s.pp, s.virtual_stages, placement, s.tp, s.ep, v.sequence_parallel,
                             v.recompute, v.recompute_layers),
                            lambda: rank_tables(self.layout(s, v), self._entry_tables(s, v)))

    def _entry_tables(self, s: Setting, v: Variant):
        # A tied head on another pipeline rank than the embedding keeps its own copy of the table: priced
        # from a two-rank prototype, where the head has that copy. Expert parallelism keeps the setting's
        # pipeline in the prototype: placed as a V where no rank copies the table. (Recomputing some layers, the
        # tables' twins do not depend on how many.)
        copies_table = copies_embedding_table(self.space.model, s.pp, s.schedule)
        twins = v.recompute_layers is not None
        schedule = "zbv" if s.ep > 1 and s.pp > 1 and not copies_table else None
        return self._cached(("entries", s.tp, s.ep, v.sequence_parallel, v.recompute, twins, copies_table),
                            lambda: entry_tables(self._prototype(s, v._replace(recompute_layers=1) if twins else v,
                                                                 pp=2 if copies_table else 1, schedule=schedule)))

    def _recomputable(self, s: Setting, v: Variant) -> list[int]:
        """The entry types :func:`~parsim.search.tables.recomputable_types` gives (their twins' rows)."""
        return self._cached(("recomputable", s.tp, s.ep, v.sequence_parallel),
                            lambda: recomputable_types(self._prototype(s, v)))

    # -- memory and bounds ----------------------------------------------------------------
    def prepare(self, s: Setting, variants: tuple[Variant, ...]) -> Prepared:
        """Memory of every variant, and for those that fit a lower bound of the step time: each rank's
        forward chain before its first pass, its passes and its optimizer step, or the last microbatch's
        backward on the rank, that gradient's way back through the stages before it, and the first rank's passes
        after its own and optimizer step (FSDP's waits for weights and every gradient sync left out, so the bound
        never exceeds the estimate).

        Where a plan fits with every layer recomputed and not without, the variants gain the same plan
        recomputing as few layers of each stage as fit (:meth:`_fewer_recomputed`): Megatron-LM's
        ``--recompute-num-layers``, the fastest of its kind that fits. Its bound is the plan's without
        recomputation plus the forwards it reruns. (Given such variants, as a :class:`Prepared` holds them, it
        derives them again, in the same order.)"""
        if s.balanced != self.balanced:
            return self._for(s).prepare(s, variants)
        if any(v.recompute_layers is not None for v in variants):
            variants = tuple(v for v in variants if v.recompute_layers is None)
        arrays = self._variant_arrays(s, variants)
        in_flight = schedule_facts(s.schedule, s.pp, s.num_microbatches, s.virtual_stages)[0]
        tokens = s.microbatch_size * self.space.model.tokens_per_sample // s.cp
        ranks = [self._ranks(s, v) for v in arrays.activation_keys]
        rank_state, activations = rank_memory(ranks, arrays.activation_index, arrays.sync, in_flight, tokens,
                                              self.dtype_bytes, self.grad_bytes)
        memory, state = (rank_state + activations).max(axis=1), rank_state.max(axis=1)
        paired = np.array([v.ep_overlap for v in variants])
        if paired.any():  # combined 1F1B runs one forward more ahead of the backwards it pairs with
            as_paired = schedule_facts(s.schedule, s.pp, s.num_microbatches, s.virtual_stages, paired=True)[0]
            memory = np.where(paired, peak_memory(ranks, arrays.activation_index, arrays.sync, as_paired, tokens,
                                                  self.dtype_bytes, self.grad_bytes)[0], memory)
        fits = memory <= self.capacity
        fewer, fewer_memory, plain = self._fewer_recomputed(s, variants, fits, rank_state, in_flight, tokens)
        bounded = np.flatnonzero(fits)
        bound = np.full(len(variants), np.inf)
        if not len(bounded):
            return Prepared(s, variants, memory, state, bound, {})
        ranks_bound = self._rank_bounds(s, variants, arrays, np.r_[bounded, plain])
        bound[bounded] = ranks_bound[:len(bounded)].max(axis=1)
        if not fewer:
            return Prepared(s, variants, memory, state, bound, {})
        # Each the same as its twin without recomputation, but for the forwards it reruns in its backwards
        reruns: dict[tuple[int, int], np.ndarray] = {}  # by the twin's pass table and the layers rerun
        for v, j in zip(fewer, plain):
            key = (arrays.table_index[j], v.recompute_layers)
            if key not in reruns:
                reruns[key] = self._rerun(s, variants[j], v.recompute_layers)
        rerun = np.array([reruns[arrays.table_index[j], v.recompute_layers] for v, j in zip(fewer, plain)])
        return Prepared(s, variants + fewer, np.concatenate([memory, fewer_memory]),
                        np.concatenate([state, state[plain]]),
                        np.concatenate([bound, (ranks_bound[len(bounded):] + rerun).max(axis=1)]), {})

    def _rerun(self, s: Setting, v: Variant, layers: int) -> np.ndarray:
        """[pp]: what recomputing the first ``layers`` layers of each stage adds to each pipeline rank's passes
        (their forwards rerun in every backward, B or I: :func:`_with_recompute`) to those of ``v``, which
        recomputes nothing."""
        layout, table = self.layout(s), self.pass_table(s, v)
        recomputed = self._entry_tables(s, v._replace(recompute="full")).recomputed
        # [stages, most layers a stage recomputes]: each stage's recomputable entries in order, -1 past its last
        types = self._cached(("rerun types", id(layout), id(recomputed)), lambda: _padded(  # (cached: ids last)
            [[e for e in entries if recomputed[e]] for entries in layout.stage_entries]))
        forward = self._cached(("forwards", id(table)),  # (-1: nothing)
                               lambda: np.append(table.phases[:, KINDS.index("F")].sum(axis=1), 0.0))
        backwards = self._cached(("backwards", s.schedule, s.pp, s.num_microbatches, s.virtual_stages),
                                 lambda: _pass_counts(s).reshape(s.pp, -1, len(KINDS))[:, :, RERUN_KINDS].sum(axis=2))
        return backwards @ forward[types[:, :layers]].sum(axis=1)

    def _rank_bounds(self, s: Setting, variants: tuple[Variant, ...], arrays: "_VariantArrays", which: np.ndarray
                     ) -> np.ndarray:
        """[which, pp]: :meth:`prepare`'s lower bound of each pipeline rank's step, for variants ``which``."""
        layout, counts = self.layout(s), _pass_counts(s)
        # (cached: settings that differ only in schedule, pipeline shape or stage split share them)
        tables = self._cached(("bound tables", s.tp, s.cp, s.ep, s.microbatch_size, s.num_microbatches,
                               (s.pp, s.dp) if s.ep > 1 else None, id(arrays)), lambda: np.array(
            [self.pass_table(s, v).seconds(self._accumulation_of(s, v)) for v in arrays.table_keys]))
        durations = np.einsum("st,ktc->ksc", layout.counts, tables)  # [K, stages, 4]
        busy = durations.reshape(len(tables), -1) @ counts.T  # [K, pp]
        hops = np.array([self._hops(s, v, layout) for v in arrays.order_keys])  # [O, stages - 1]
        chain = np.zeros((len(tables), len(hops), durations.shape[1]))
        chain[:, :, 1:] = np.cumsum(durations[:, None, :-1, 0] + hops[None], axis=2)
        work = chain[:, :, layout.rank_stages[:, 0]] + busy[:, None, :]  # [K, O, pp]
        optimizer = np.array([self._tail_bound(s, v) for v in arrays.sync_keys])  # [Z, pp]
        table_of, order_of = arrays.table_index[which], arrays.order_index[which]
        tail = optimizer[arrays.sync_index[which]]
        total = work[table_of, order_of] + tail
        drained, trailing = _drained_stages(s.schedule, s.pp, s.num_microbatches, s.virtual_stages)
        if (drained > 0).any():
            # The last microbatch's backward on a rank ends no sooner than the rank's work less the passes it runs
            # after it; that gradient has yet to cross the stages before it, a backward and a send each; then the
            # first stage's rank runs what follows its own (zero-bubble's deferred W passes) and steps its
            # optimizer (a rank pairing passes, ep_comm_overlap, runs another schedule: left out)
            final = schedule_facts(s.schedule, s.pp, s.num_microbatches, s.virtual_stages)[2]
            back = np.where(final == KINDS.index("W"), KINDS.index("I"), KINDS.index("B"))[:-1]  # each stage's
            drain = np.zeros_like(chain)
            drain[:, :, 1:] = np.cumsum(durations[:, None, np.arange(len(back)), back] + hops[None], axis=2)
            after = durations.reshape(len(tables), -1) @ trailing.T  # [K, pp]: each rank's passes after it
            drain = drain[:, :, drained] - after[:, None, :] + after[:, None, :1]
            drained_total = (work + drain)[table_of, order_of] + tail[:, :1]
            unpaired = np.array([not variants[i].ep_overlap for i in which])
            total[unpaired] = np.maximum(total[unpaired], drained_total[unpaired])
        return total - [self.rank_pair_savings(s, variants[i]) for i in which]

    def _fewer_recomputed(self, s: Setting, variants: tuple[Variant, ...], fits: np.ndarray, state: np.ndarray,
                          in_flight: np.ndarray, tokens: int) -> tuple[tuple[Variant, ...], np.ndarray, np.ndarray]:
        """The variants that recompute every layer and fit where the same without recomputation does not, each
        as recomputing only the first layers of each stage, as few as fit
        (:func:`~parsim.search.tables.layers_to_recompute`; none where that takes all of them); their memory, and
        the index of each one's twin without recomputation. ``state``: [variants, pp] bytes of training state
        (recomputation leaves it as it is)."""
        every, plain = self._by_identity("recomputing", variants, lambda: _recomputing(variants))
        chosen: dict[tuple, tuple[int, float] | None] = {}  # by what they depend on: sp, the sharding
        out, memory, twins = [], [], []
        for i, j in zip(*(a[fits[every] & ~fits[plain]] for a in (every, plain))):
            v = variants[i]
            key = (v.sequence_parallel, v.grad_sync, v.zero, v.shard_group)
            if key not in chosen:
                chosen[key] = self._layers_to_fit(s, v, state[i], in_flight, tokens)
            if chosen[key] is not None:
                out.append(v._replace(recompute_layers=chosen[key][0]))
                memory.append(chosen[key][1])
                twins.append(j)
        return tuple(out), np.array(memory), np.array(twins, dtype=int)

    def _layers_to_fit(self, s: Setting, v: Variant, state: np.ndarray, in_flight: np.ndarray, tokens: int
                       ) -> tuple[int, float] | None:
        """:func:`~parsim.search.tables.layers_to_recompute` for ``v``'s setting and training state (``state``:
        [pp] bytes)."""
        none = v._replace(recompute="none")
        layout, plain, every = self.layout(s), self._entry_tables(s, none), self._entry_tables(s, v)
        steps = self._cached(("recompute steps", id(layout), id(plain), id(every)),  # (cached themselves: ids last)
                             lambda: recompute_steps(layout, plain, every) or False)
        if not steps:
            return None
        return layers_to_recompute(layout, steps, state, in_flight, tokens, self.capacity)

    def pair_savings(self, s: Setting, v: Variant) -> np.ndarray | None:
        """[stages, stages]: what running a forward of one stage together with a backward of another saves
        (``ep_comm_overlap``; see :func:`pair_seconds`), at the stages the schedule pairs; None for other plans."""
        if not v.ep_overlap:
            return None
        key = (s.tp, s.cp, s.ep, s.dp, s.pp, s.schedule in V_SCHEDULES, s.virtual_stages, s.microbatch_size,
               v.order, v.sequence_parallel, v.tp_overlap, v.recompute, v.context_parallel)

        def make() -> np.ndarray:
            plan, passes, layout = self.plan(s, v), self.passes(s.cp), self.layout(s)
            counts = pairs_per_rank(s.schedule, s.pp, s.num_microbatches, s.virtual_stages)
            out = np.zeros(counts.shape[1:])
            for f, b in zip(*np.nonzero(counts.sum(axis=0))):
                alone, together = self._cached(
                    ("pair",) + key + (layout.distinct_of[f], layout.distinct_of[b]),
                    lambda: pair_seconds(plan, passes, int(f), int(b), layout.stage_rank[f]))
                out[f, b] = alone - together
            return out
        return self._cached(("pairs", s.schedule, s.num_microbatches) + key, make)

    def rank_pair_savings(self, s: Setting, v: Variant) -> np.ndarray:
        """[pp]: what each pipeline rank's pairs save it (0 without ``ep_comm_overlap``)."""
        savings = self.pair_savings(s, v)
        if savings is None:
            return np.zeros(s.pp)
        return np.einsum("rfb,fb->r", pairs_per_rank(s.schedule, s.pp, s.num_microbatches, s.virtual_stages),
                         savings)

    def _variant_arrays(self, s: Setting, variants: tuple[Variant, ...]) -> "_VariantArrays":
        def make() -> _VariantArrays:
            index: dict[str, dict[tuple, Variant]] = {k: {} for k in ("activation", "table", "order", "sync")}
            positions: dict[str, list[int]] = {k: [] for k in index}
            for v in variants:
                for name, key in (("activation", (v.sequence_parallel, v.recompute)),
                                  # the expert all-to-alls' groups follow the placement order
                                  ("table", (v.sequence_parallel, v.tp_overlap, v.recompute, v.context_parallel,
                                             self._main_grads(s, v), v.order if s.ep > 1 else None)),
                                  # the pipeline's sends: by placement, sequence-parallel ones a tp-th
                                  ("order", (v.order, v.sequence_parallel)), ("sync", (v.zero, v.shard_group))):
                    keys = index[name]
                    if key not in keys:
                        keys[key] = v
                    positions[name].append(list(keys).index(key))
            return _VariantArrays(*(list(index[k].values()) for k in index),
                                  *(np.array(positions[k]) for k in index), self._sync_arrays(s, variants))
        return self._by_identity(("variants", s.dp, s.cp, s.ep, s.num_microbatches > 1), variants, make)

    def _sync_arrays(self, s: Setting, variants: tuple[Variant, ...]) -> SyncArrays:
        """How each variant's ZeRO stage shards the training state (:func:`~parsim.search.tables.sync_arrays`)."""
        zero = np.array([v.zero for v in variants])
        shard = np.array([(v.shard_group or s.dp * s.cp) if v.zero else 1 for v in variants])
        # experts shard over the ranks of a shard group holding them (Plan.expert_shard_size)
        return sync_arrays(zero, shard, np.maximum(shard // s.ep, 1), self.dtype_bytes, self.grad_bytes,
                           s.num_microbatches)

    def _tail_bound(self, s: Setting, v: Variant) -> np.ndarray:
        """Per pipeline rank, what the sharding surely adds to its passes and what surely follows its last
        one: FSDP2's copies, and its optimizer step (the gradient sync before it may hide entirely; ZeRO's
        all-gathers after it are left to the estimate)."""
        key = ("optimizer", s.pp, s.virtual_stages, s.schedule in V_SCHEDULES, s.tp, s.ep, s.dp * s.cp, v.zero,
               v.shard_group)
        optimizer = self._cached(key, lambda: np.array([self._optimizer(s, v, p) for p in range(s.pp)]))
        if not self._gathers_every_pass(s, v):
            return optimizer  # under a pipeline FSDP's copies come once a step, in the estimate
        return optimizer + self._cached(("copies", s.tp, s.ep, s.pp, s.virtual_stages, s.num_microbatches,
                                         s.schedule, self._experts_move(s, v)),
                                        lambda: _pass_counts(s) @ self._copies_per_pass(s, v))

    def _copies_per_pass(self, s: Setting, v: Variant) -> np.ndarray:
        """[stages * 4]: FSDP2's copies in one pass of each (stage, kind)."""
        return (self.layout(s).counts @ self._fsdp_copies(s, v)).ravel()

    # -- pipeline inputs ---------------------------------------------------------------------
    def _inputs_of(self, prep: Prepared, i: int) -> _Inputs:
        """Variant ``i``'s pipeline inputs, shared with the setting's variants that run the same passes."""
        key = _inputs_key(prep.variants[i])
        for x in prep.inputs.values():
            if x.key == key:
                break
        else:
            x = self._inputs(prep.setting, prep.variants[i], self.layout(prep.setting, prep.variants[i]))
        prep.inputs[i] = x
        return x

    def _inputs(self, s: Setting, v: Variant, layout: Layout) -> _Inputs:
        seconds = self.pass_table(s, v, beside_gathers=True).seconds(self._accumulation_of(s, v))  # [types, 4]
        waits = lead = slowed = np.zeros(len(layout.stage_entries) * 4)
        fsdp = self._fsdp(s, v) if self._gathers_every_pass(s, v) else None
        ends = None
        final_extra = offsets = None
        if fsdp is None:
            durations = (layout.counts @ seconds).ravel()
            final_extra, offsets = self._bucket_slowing(s, v)
        else:
            # Per distinct stage and kind: the pass after another (the gather stream still busy with that one's
            # last gathers), its part before its inputs matter (the first gathers, issued as soon as the stream
            # is free, ahead of the pass: the lead), and the rank's very first pass (nothing gathered yet); and
            # how much longer the collectives' kernels, holding SMs, made the pass after another.
            held = self._held_tables(s, v)
            shape = (len(layout.distinct), 4)
            after, ahead, first, waited = np.zeros(shape), np.zeros(shape), np.zeros(shape), np.zeros(shape)
            longer = np.zeros(shape)
            ends = []
            for d, entries in enumerate(layout.distinct):
                ends.append([])
                for k, kind in enumerate(KINDS):
                    order = list(entries if kind == "F" else entries[::-1])
                    d_ = seconds[order, k] + fsdp[2][order, k]
                    g = fsdp[0 if kind == "F" else 3][order]  # a backward's gathers share links with reductions
                    if kind == "W":  # the weight gradients need no weights
                        g = np.zeros(len(order))
                    kernels = ({m: t[order, k] + fsdp[2][order, k] for m, t in held.items()},
                               fsdp[1][order] * SCATTER_COPIES[k]) if held else None
                    timed = partial(_gathered_pass, d_, g, held=kernels)
                    waited[d, k], entry_ends = timed(min(g[-1] - d_[-2:].sum(), -d_[-1]))
                    after[d, k] = entry_ends[-1]
                    ahead[d, k] = after[d, k] - timed(-np.inf)[1][-1]
                    first[d, k] = timed(0.0)[1][-1]
                    if held:
                        longer[d, k] = after[d, k] - waited[d, k] - d_.sum()
                    ends[d].append(entry_ends)
            durations = after[layout.distinct_of].ravel()
            lead = ahead[layout.distinct_of].ravel()
            waits = waited[layout.distinct_of].ravel()
            slowed = longer[layout.distinct_of].ravel()
        hops = self._hops(s, v, layout)
        start = np.zeros(s.pp)
        if fsdp is not None:  # a rank's first forward gathers from nothing: the part beyond the usual lead
            d = layout.distinct_of[layout.rank_stages[:, 0]]
            start = np.maximum(first[d, 0] - (after[d, 0] - ahead[d, 0]) - ahead[d, 0], 0.0)
        elif self._shards_weights(s, v):  # under a pipeline each stage's first forward gathers, once a step
            start = self._first_gathers(s, v, seconds)
        elif v.param_overlap and s.dp * s.cp > 1:
            start = self._param_gather_starts(s, v, seconds, durations)
        return _Inputs(_inputs_key(v), durations, hops, start, waits, lead, slowed, ends, final_extra=final_extra,
                       offsets=offsets, savings=self.pair_savings(s, v))

    def _hops(self, s: Setting, v: Variant, layout: Layout) -> np.ndarray:
        """Per stage boundary, the send of one microbatch's activations (or their gradients) between the
        representative ranks of the two stages. (FSDP gathers nothing beside them: under a pipeline a stage
        gathers its weights once, in its first forward.)"""
        key = ("hops", s.dp, s.tp, s.pp, s.cp, s.ep, s.microbatch_size, s.schedule in V_SCHEDULES,
               s.virtual_stages, v.order, v.sequence_parallel)

        def make() -> np.ndarray:
            plan = self.layout_plan(s, v)
            nbytes = pipeline_bytes(plan) * s.microbatch_size  # the layout plan's microbatches hold one sample
            first = self._cached(("pp ranks", s.dp, s.tp, s.pp, s.cp, v.order),
                                 lambda: [plan.rank_of(pp=r) for r in range(s.pp)])
            pairs = {}  # boundaries between the same two ranks cost the same
            for a, b in zip(layout.stage_rank, layout.stage_rank[1:]):
                if (a, b) not in pairs:
                    pairs[a, b] = self.comm.time("send", "send_recv", (first[a], first[b]), nbytes)
            return np.array([pairs[a, b] for a, b in zip(layout.stage_rank, layout.stage_rank[1:])])
        return self._cached(key, make)

    def _fsdp(self, s: Setting, v: Variant) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """FSDP, per entry type: the all-gather of its weights, the reduce-scatter of its gradients (plus
        the HSDP all-reduce across replicas) over the shard group, FSDP2's copies between its flat buffers
        and the entry's tensors on the compute stream in each kind of pass (:meth:`_fsdp_copies`), and the
        all-gather in a backward pass; None without FSDP.

        In a backward, a layer's gather (for the next layer) and the reduce-scatter of the gradients just
        made run at once over the same links, as the simulation has them: the gather is priced beside the
        reduce-scatter (:meth:`CommCosts.beside`), and the reduce-scatter pays what the gather took from it
        (both share the links until the gather ends), so the links carry both for as long as they do."""
        if not self._shards_weights(s, v):
            return None
        twins = self._recomputable(s, v) if v.recompute_layers is not None else None

        def make() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
            plan = self.layout_plan(s, v)
            lowering = Lowering(plan)
            shard, eshard = lowering.group(0, "shard")[0], lowering.group(0, "eshard")[0]
            replicate = lowering.group(0, "replicate")[0]
            gathered, reduced = self._experts_move(s, v)

            def prices(group: tuple[int, ...], weights: float, grads: float) -> tuple[float, float, float]:
                """(the gather alone, beside a reduce-scatter, the reduce-scatter beside it) over ``group``."""
                alone = self.comm.time("collective", "all_gather", group, weights)
                beside = max(alone, self.comm.beside("all_gather", group, weights, "reduce_scatter", group, grads))
                return alone, beside, self.comm.time("collective", "reduce_scatter", group, grads) + beside - alone

            def across(grads: float) -> float:  # HSDP: a shard all-reduced over the replicas
                return self.comm.time("collective", "all_reduce", replicate, grads) if plan.replicas > 1 else 0.0

            gather, scatter, backward = [], [], []
            for weights, grads, expert_weights, expert_grads in zip(
                    self._weight_bytes(s, part="dense"), self._weight_bytes(s, gradients=True, part="dense"),
                    self._weight_bytes(s, part="experts", experts_move=gathered),
                    self._weight_bytes(s, gradients=True, part="experts", experts_move=reduced)):
                alone, beside, reduce = prices(shard, weights, grads)
                reduce += across(grads / plan.shard_size)
                if expert_weights:  # a layer's routed experts, after the rest, over the ranks holding them
                    more = prices(eshard, expert_weights, expert_grads)
                    alone, beside = alone + more[0], beside + more[1]
                    reduce += more[2] + across(expert_grads / plan.expert_shard_size)
                elif expert_grads:  # held whole in each shard group: only all-reduced over the others
                    reduce += self.comm.time("collective", "all_reduce", lowering.group(0, "edp")[0], expert_grads)
                gather.append(alone)
                backward.append(beside)
                scatter.append(reduce)
            arrays = np.array(gather), np.array(scatter), self._fsdp_copies(s, v), np.array(backward)
            if twins is None:
                return arrays
            return tuple(np.concatenate([a, a[twins]]) for a in arrays)  # the twins' rows (tables.twinned)
        return self._cached(("fsdp", s.dp, s.tp, s.pp, s.cp, s.ep, v.order, v.shard_group,
                             None if twins is None else v.sequence_parallel), make)

    def _held_tables(self, s: Setting, v: Variant) -> dict[int, np.ndarray]:
        """FSDP without a pipeline: each entry type's passes ([types, 4] seconds) beside the SMs its
        collectives' NCCL kernels hold (:mod:`parsim.sim.held_sms`): 1, an all-gather's; 2, a reduce-scatter's;
        3, both. Their channels are those of the largest entry's, over the shard group. Empty where no kernel
        holds any (a CPU host's gloo)."""
        def make() -> tuple[int, int]:
            shard = Lowering(self.layout_plan(s, v)).group(0, "shard")[0]
            return (self.comm.sim.kernel_sms("all_gather", shard, int(max(self._weight_bytes(s, part="dense")))),
                    self.comm.sim.kernel_sms("reduce_scatter", shard,
                                             int(max(self._weight_bytes(s, gradients=True, part="dense")))))
        gather, scatter = self._cached(("held sms", s.dp, s.tp, s.cp, s.ep, v.order, v.shard_group), make)
        if not gather and not scatter:
            return {}
        accumulation = self._accumulation_of(s, v)
        return {m: self.pass_table(s, v, beside_gathers=True, held_sms=sms).seconds(accumulation)
                for m, sms in ((1, gather), (2, scatter), (3, gather + scatter))}

    def _main_grads(self, s: Setting, v: Variant) -> bool:
        """:attr:`Plan.main_grads <parsim.workload.plan.Plan.main_grads>` of ``v``: low-precision weights, not FSDP."""
        return keeps_main_grads(self.dtype_bytes, self._shards_weights(s, v))

    def _accumulation_of(self, s: Setting, v: Variant) -> Accumulation:
        """What a microbatch's gradients cost per weight joining their sum (:class:`Accumulation`)."""
        return accumulation(self.dtype_bytes, self.grad_bytes, self._main_grads(s, v), s.num_microbatches)

    @staticmethod
    def _shards_weights(s: Setting, v: Variant) -> bool:
        return v.fsdp and (v.shard_group or s.dp * s.cp) > 1

    def _gathers_every_pass(self, s: Setting, v: Variant) -> bool:
        """FSDP without a pipeline: every pass gathers its weights and reduces its gradients. Under a pipeline
        (``Plan``: ``torch.distributed.pipelining``'s FSDP2) a stage gathers in its first forward and reduces
        after its last backward."""
        return self._shards_weights(s, v) and s.pp == 1

    def _first_gathers(self, s: Setting, v: Variant, seconds: np.ndarray) -> np.ndarray:
        """FSDP under a pipeline: per pipeline rank, what its stages' first forwards add to their passes by
        gathering their weights from nothing (each layer's all-gather, the next one prefetched, and its
        copy out of the gathered buffer), all charged before the rank's first pass."""
        gathers, _, copies, _ = self._fsdp(s, v)
        layout, f = self.layout(s), KINDS.index("F")
        start = np.zeros(s.pp)
        for p in range(s.pp):
            for stage in layout.rank_stages[p]:
                order = list(layout.stage_entries[stage])
                plain = seconds[order, f]
                start[p] += _gathered_pass(plain + copies[order, f], gathers[order], 0.0)[1][-1] - plain.sum()
        return start

    def _stage_reductions(self, s: Setting, v: Variant, p: int) -> tuple[tuple[tuple, np.ndarray, int], ...]:
        """FSDP under a pipeline: pipeline rank ``p``'s reduce-scatters (and HSDP all-reduces), every layer's
        once its stage's last backward has ended (``REDUCE_GRAD``), each after its copy into the collective's
        buffer: per stage, the end of its final backward and the seconds of each layer's reduction."""
        plan = self.layout_plan(s, v)
        lowering = Lowering(plan)
        gathered, reduced = self._experts_move(s, v)
        scatter = self.comm.pricer("collective", "reduce_scatter", lowering.group(p, "shard")[0])
        across = self.comm.pricer("collective", "all_reduce", lowering.group(p, "replicate")[0]) \
            if plan.replicas > 1 else no_cost
        if gathered:  # experts sharded over the ranks of a shard group holding them
            scatter_experts = self.comm.pricer("collective", "reduce_scatter", lowering.group(p, "eshard")[0])

            def reduce_experts(nbytes: float) -> float:
                return scatter_experts(nbytes) + across(nbytes / plan.expert_shard_size)
        else:  # held whole in each shard group: all-reduced over the others, if any
            reduce_experts = self.comm.pricer("collective", "all_reduce", lowering.group(p, "edp")[0])
        seconds = []
        for w, g, dense, experts in zip(self._weight_bytes(s, experts_move=reduced),
                                        self._weight_bytes(s, gradients=True, experts_move=reduced),
                                        self._weight_bytes(s, gradients=True, part="dense"),
                                        self._weight_bytes(s, gradients=True, part="experts", experts_move=reduced)):
            copy_in = self.compute.time((), 0.0, w + g, 1, stream_bytes=w + g, fsdp_calls=REDUCE_CALL)
            seconds.append(scatter(dense) + across(dense / plan.shard_size) + copy_in
                           + (reduce_experts(experts) if experts else 0.0))
        seconds = np.array(seconds)
        layout = self.layout(s)
        out = []
        for stage in layout.rank_stages[p][::-1]:
            entries = list(layout.stage_entries[stage])
            out.append((((int(stage), len(entries) - 1),) * len(entries), seconds[entries], 0))
        return tuple(out)

    def _experts_move(self, s: Setting, v: Variant) -> tuple[bool, bool]:
        """Whether FSDP or ZeRO gathers a rank's routed experts (sharded over the ranks of its shard group that
        hold the same experts: more than one), and whether it syncs their gradients (any other rank holds
        them), as the lowering's ``eshard`` and ``edp`` groups have it."""
        return (v.shard_group or s.dp * s.cp) // s.ep > 1, s.dp * s.cp // s.ep > 1

    def _weight_bytes(self, s: Setting, gradients: bool = False, part: str | None = None,
                      experts_move: bool = True) -> list[float]:
        """Per entry type, what FSDP gathers of one rank's weights, or with ``gradients`` reduce-scatters of its
        gradients in the reduce dtype (:func:`~parsim.lowering.lower.fsdp_bytes`): all of it, or ``part``
        "dense" (over the shard group) or "experts" (the routed experts', over the ranks holding them; none
        where no other rank holds them, or with ``experts_move`` false: :meth:`_experts_move`)."""
        moves = experts_move and s.dp * s.cp // s.ep > 1  # experts held by more than one rank

        def make() -> list[float]:
            plan = self._prototype(s, _PLAIN)
            dense = [fsdp_bytes(cost, plan, gradients, experts=False) for cost in entry_types(plan)]
            experts = [fsdp_bytes(cost, plan, gradients, experts=True) if moves else 0.0
                       for cost in entry_types(plan)]
            if part is None:
                return [d + e if e else d for d, e in zip(dense, experts)]
            return dense if part == "dense" else experts
        return self._cached(("weight bytes", s.tp, s.ep, moves, gradients, part), make)

    def _fsdp_copies(self, s: Setting, v: Variant) -> np.ndarray:
        """[entry types, 4]: FSDP2's copies on the compute stream in each kind of pass (F, B, I, W): out of the
        gathered weights' buffer (reading and writing the weights), into the reduce-scatter's (reading the
        gradients in the weights' dtype, writing the reduce dtype), as the lowering adds them."""
        gathered, reduced = self._experts_move(s, v)

        def make() -> np.ndarray:
            def copy(moved: float, calls: tuple[int, int, int]) -> float:
                return self.compute.time((), 0.0, moved, 1, stream_bytes=moved, fsdp_calls=calls)
            out_of, into = self._weight_bytes(s, experts_move=gathered), self._weight_bytes(s, experts_move=reduced)
            grads = self._weight_bytes(s, gradients=True, experts_move=reduced)
            return np.array([copy(2 * w, UNSHARD_CALL) * GATHER_COPIES + copy(i + g, REDUCE_CALL) * SCATTER_COPIES
                             for w, i, g in zip(out_of, into, grads)])
        return self._cached(("fsdp copies", s.tp, s.ep, gathered, reduced), make)

    # -- estimates ------------------------------------------------------------------------------
    def estimate(self, jobs: list[tuple[Prepared, int]]) -> list[Estimate]:
        """Estimates of variant ``i`` of each prepared setting; pipelines of one shape are timed together."""
        theirs = [job for job in jobs if job[0].setting.balanced != self.balanced]
        if theirs:  # the other stage split's jobs to its model, the answers back in order
            other = iter(self._for(theirs[0][0].setting).estimate(theirs))
            mine = iter(self.estimate([job for job in jobs if job[0].setting.balanced == self.balanced]))
            return [next(mine if prep.setting.balanced == self.balanced else other) for prep, _ in jobs]
        groups: dict[tuple, dict[int, _Inputs]] = {}
        for prep, i in jobs:
            x = self._inputs_of(prep, i)
            if x.timing is None:  # FSDP reduces every pass's gradients: it needs every pass's start
                groups.setdefault(_shape(prep.setting) + (x.ends is not None, x.savings is not None), {})[id(x)] = x
        for (name, pp, m, vs, every_pass, paired), members in groups.items():
            batch = list(members.values())
            extra = None
            if any(x.final_extra is not None for x in batch):
                nothing = np.zeros(len(batch[0].hops) + 1)  # per stage
                extra = np.array([nothing if x.final_extra is None else x.final_extra for x in batch])
            timing = time_schedule(name, pp, m, vs, np.array([x.durations for x in batch]),
                                   np.array([x.hops for x in batch]).reshape(len(batch), -1),
                                   np.array([x.start for x in batch]), every_pass, np.array([x.lead for x in batch]),
                                   extra, np.array([x.savings for x in batch]) if paired else None)
            for j, x in enumerate(batch):
                x.timing = PipelineTiming(timing.rank_end[j], timing.final_start[j],
                                          None if timing.starts is None else timing.starts[j], timing.compiled,
                                          None if timing.starts_end is None else timing.starts_end[j])
        return [self._finish(prep, i) for prep, i in jobs]

    def _finish(self, prep: Prepared, i: int) -> Estimate:
        s, v, x = prep.setting, prep.variants[i], prep.inputs[i]
        tails = self._checked(s, v, [self._rank_tail(s, v, x, p) for p in range(s.pp)])
        rank = max(range(s.pp), key=lambda p: tails[p][0])
        step, compute_end, sync_end, optimizer, gathers = tails[rank]
        counts = _pass_counts(s)[rank]
        table = self.pass_table(s, v, beside_gathers=True).phase_seconds(
            self._accumulation_of(s, v))  # [types, 4, phases]
        layout = self.layout(s, v)
        per_stage = np.einsum("st,tkp->skp", layout.counts, table).reshape(-1, len(PASS_PHASES))
        phases = dict.fromkeys(PHASES, 0.0)
        for name, seconds in zip(PASS_PHASES, counts @ per_stage):
            phases[name] += float(seconds)
        phases["fsdp"] += float(counts @ x.waits)
        if self._gathers_every_pass(s, v):  # FSDP2's copies, and the held SMs' cost, in the pass's phase
            copies = self._copies_per_pass(s, v)
            for k, name in enumerate(COPY_PHASES):
                phases[name] += float(counts[k::4] @ (copies[k::4] + x.slowed[k::4]))
        phases["fsdp" if v.fsdp else "dp"] += max(sync_end - compute_end, 0.0) + gathers
        phases["optimizer"] = optimizer
        start = float(x.start[rank])  # the first weights gathered before the rank's first pass (FSDP, ZeRO)
        phases["fsdp" if v.fsdp else "dp"] += start
        busy = float(counts @ x.durations)
        if x.final_extra is not None:  # the held SMs' cost, in the phase of each of the rank's final passes
            final = schedule_facts(s.schedule, s.pp, s.num_microbatches, s.virtual_stages)[2]
            for st in self.layout(s).rank_stages[rank]:
                phases[PASS_PHASE[KINDS[final[st]]]] += float(x.final_extra[st])
                busy += float(x.final_extra[st])
        saving = float(self.rank_pair_savings(s, v)[rank])  # the pairs' all-to-alls, hidden behind compute
        busy -= saving
        phases["ep"] -= saving
        phases["pp"] = max(compute_end - start - busy, 0.0)
        return Estimate(float(step), float(prep.memory[i]), phases, rank)

    def _rank_tail(self, s: Setting, v: Variant, x: _Inputs, p: int) -> tuple[float, float, float, float, float]:
        """Pipeline rank ``p``: (its end, its last pass's end, its gradient sync's end, optimizer seconds,
        ZeRO's all-gather seconds after the step)."""
        if x.ends is not None:  # FSDP: each entry's reduce-scatter as each backward makes its gradients
            return self._fsdp_tail(s, v, x, p)
        end = float(x.timing.rank_end[p])
        start = x.timing.final_start
        if x.offsets is None:
            x.offsets = self._final_offsets(s, v)
        ready, costs = [], []
        for marks, seconds, _ in self._bucket_plan(s, v, p):
            ready.append(np.array([start[st] + x.offsets[st][j] for st, j in marks]))
            costs.append(seconds)
        sync = end
        if ready:
            r, c = np.concatenate(ready), np.concatenate(costs)
            sync = max(end, float((r + np.cumsum(c[::-1])[::-1]).max()))
        sync += self._finalize(s, v, p)
        optimizer = self._optimizer(s, v, p)
        gathers = sum(self._zero_gathers(s, v, p))
        return sync + optimizer + gathers, end, sync, optimizer, gathers

    def _fsdp_tail(self, s: Setting, v: Variant, x: _Inputs, p: int) -> tuple[float, float, float, float, float]:
        """:meth:`_rank_tail` under FSDP: the communication stream reduce-scatters every entry's gradients after
        every backward, in the order the rank runs them. A long schedule's passes are read off a shorter one of
        the same shape: its stream ends as late as the short one's shifted by the extra rounds, or, if it
        cannot keep up, as late as its first reduction plus all of them."""
        timing = x.timing
        end = float(timing.rank_end[p])
        compiled = timing.compiled
        kind = compiled.var % 4
        mine = np.flatnonzero((compiled.rank == p) & ((kind == KINDS.index("B")) | (kind == KINDS.index("W"))))
        ends, scatters = self._fsdp_tables(s, v, x)
        which = compiled.var[mine]  # the rank's passes in the order it runs them: rows of the tables
        r = (timing.starts[mine, None] + ends[which]).ravel()
        c = scatters[which].ravel()  # padding: ready at its pass's end, costing nothing
        sync = float((r + np.cumsum(c[::-1])[::-1]).max())
        extra = s.num_microbatches - compiled.schedule.num_microbatches
        if extra:
            per_microbatch = float(c.sum()) / compiled.schedule.num_microbatches
            sync = max(sync + end - float(timing.starts_end[p]), float(r.min()) + per_microbatch * s.num_microbatches)
        sync = max(sync, end) + self._finalize(s, v, p)
        optimizer = self._optimizer(s, v, p)
        return sync + optimizer, end, sync, optimizer, 0.0

    def _fsdp_tables(self, s: Setting, v: Variant, x: _Inputs) -> tuple[np.ndarray, np.ndarray]:
        """[stages * 4, most entries]: per (stage, kind) pass, each entry's end within the pass and its
        reduce-scatter's seconds, in backward order (rows padded with the pass's end and no cost)."""
        if x.fsdp_tables is None:
            scatter = self._fsdp(s, v)[1]
            layout = self.layout(s, v)
            width = max(len(e) for e in layout.stage_entries)
            ends, costs = np.zeros((len(layout.stage_entries) * 4, width)), np.zeros((len(layout.stage_entries) * 4,
                                                                                       width))
            for stage, entries in enumerate(layout.stage_entries):
                for k in (KINDS.index("B"), KINDS.index("W")):
                    e = x.ends[layout.distinct_of[stage]][k]
                    ends[stage * 4 + k, :len(e)], ends[stage * 4 + k, len(e):] = e, e[-1]
                    costs[stage * 4 + k, :len(e)] = scatter[list(entries[::-1])]
            x.fsdp_tables = ends, costs
        return x.fsdp_tables

    def _bucket_slowing(self, s: Setting, v: Variant) -> tuple[np.ndarray | None, dict[int, np.ndarray] | None]:
        """The gradient buckets' NCCL kernels hold SMs while they run (:mod:`parsim.sim.held_sms`), beside the
        rest of the final backward that makes them: per stage, how much longer its final backward takes, and
        when each entry's gradients are final in it (:meth:`_final_offsets`, slowed). (None, None) where no
        kernel holds any. Each stage's buckets run in the communication stream's order from the pass's start,
        the stream free then; those still running after the pass slow nothing here."""
        groups = [self._bucket_plan(s, v, p) for p in range(s.pp)]
        if not any(sms for rank in groups for *_, sms in rank):
            return None, None
        table, accumulation = self.pass_table(s, v), self._accumulation_of(s, v)
        seconds, trailing = table.seconds(accumulation), table.trailing
        bits = {sms: 1 << i for i, sms in enumerate(sorted({sms for rank in groups for *_, sms in rank if sms}))}
        held = {bit: self.pass_table(s, v, held_sms=sms).seconds(accumulation) for sms, bit in bits.items()}
        final = schedule_facts(s.schedule, s.pp, s.num_microbatches, s.virtual_stages)[2]
        layout = self.layout(s, v)
        extra, offsets = np.zeros(len(layout.stage_entries)), {}
        for p, rank in enumerate(groups):
            queues: dict[int, list[tuple[int, float, int]]] = defaultdict(list)  # per stage, in the stream's order
            for marks, costs, sms in rank:
                for (stage, j), cost in zip(marks, costs):
                    queues[stage].append((j, float(cost), sms))
            for st in layout.rank_stages[p]:
                order, k, queue = list(layout.stage_entries[st][::-1]), final[st], queues[st]
                d = seconds[order, k]
                t = free = 0.0
                windows: list[tuple[float, float, int]] = []  # those not yet over at t
                ready = np.zeros(len(order))
                issued = 0
                for j, work in enumerate(d.tolist()):
                    ratios = {bit: held[bit][order[j], k] / work if work > 0 else 1.0 for bit in held}
                    t = _held_end(t, work, ratios, windows)
                    ready[j] = t - trailing[order[j], k]
                    windows = [w for w in windows if w[1] > t]
                    while issued < len(queue) and queue[issued][0] <= j:
                        _, cost, sms = queue[issued]
                        issued += 1
                        begins = max(free, ready[j])
                        free = begins + cost
                        if sms:  # (one kernel at a time: the stream runs them in turn)
                            windows.append((begins, free, bits[sms]))
                extra[st], offsets[int(st)] = t - d.sum(), ready
        return extra, offsets

    def _final_offsets(self, s: Setting, v: Variant) -> dict[int, np.ndarray]:
        """Per stage, when each entry's gradients are final (its last kernel), seconds into the stage's
        final backward (B, or W where split), entries in backward order."""
        table = self.pass_table(s, v)
        seconds = table.seconds(self._accumulation_of(s, v))
        final = schedule_facts(s.schedule, s.pp, s.num_microbatches, s.virtual_stages)[2]
        out = {}
        for st, entries in enumerate(self.layout(s, v).stage_entries):
            order, k = list(entries[::-1]), final[st]
            out[st] = np.cumsum(seconds[order, k]) - table.trailing[order, k]
        return out

    # -- the tail's pieces ---------------------------------------------------------------------
    def _bucket_sizes(self, s: Setting, v: Variant, p: int, expert: bool) -> tuple[tuple[float, tuple], ...]:
        """Pipeline rank ``p``'s gradient buckets (dense or experts'), as the lowering fills them: (bytes,
        (stage, entry position in the final backward) of the bucket's last gradient)."""
        return tuple((size, members[-1]) for size, members in self._bucket_members(s, p, expert))

    def _bucket_members(self, s: Setting, p: int, expert: bool) -> tuple[tuple[float, tuple], ...]:
        """:meth:`_bucket_sizes` with every tensor's (stage, entry position in backward order): (bytes, tags)."""
        placement = s.schedule in V_SCHEDULES
        key = ("bucket members", s.pp, s.virtual_stages, placement, s.tp, s.ep, p, expert)

        def make():
            plan = self._prototype(s, _PLAIN)
            per_type = [[n * plan.grad_bytes for n, e in param_tensors(c, plan.tp, plan.ep) if e == expert]
                        for c in entry_types(plan)]
            layout = self.layout(s)
            tensors = [(nbytes, (int(st), position)) for st in layout.rank_stages[p][::-1]
                       for position, e in enumerate(layout.stage_entries[st][::-1]) for nbytes in per_type[e]]
            return tuple((size, tuple(members)) for size, members in bucket_members(tensors, self.space.bucket_size))
        return self._cached(key, make)

    def _bucket_plan(self, s: Setting, v: Variant, p: int) -> tuple[tuple[tuple, np.ndarray, int], ...]:
        """Gradient buckets of pipeline rank ``p``, as the lowering makes them and in the order the
        communication stream runs them (dense buckets, then the experts'): per group, each bucket's (stage,
        entry position in the final backward) of its last gradient, its seconds, and the SMs the group's NCCL
        kernel holds while it runs (its largest bucket's; 0 for FSDP's reductions under a pipeline, which
        run after the stage's passes)."""
        return self._cached(("buckets", p) + self._structure(s, v), lambda: self._buckets(s, v, p))

    def _buckets(self, s: Setting, v: Variant, p: int):
        plan = self.layout_plan(s, v)
        if self._shards_weights(s, v) and s.pp > 1:
            return self._stage_reductions(s, v, p)
        if plan.dp * plan.cp == 1 or v.fsdp:
            return ()
        lowering = Lowering(plan)
        out = []
        for expert, dim in ((False, "shard"), (True, self._expert_dim(s, v))):
            if expert and plan.dp * plan.cp // plan.ep == 1:
                continue  # every expert lives on one rank only: nothing to sync
            filled = self._bucket_sizes(s, v, p, expert)
            if not filled:
                continue
            if not plan.zero or dim == "edp":
                kernel = ("all_reduce", lowering.group(p, "edp" if expert else "dp")[0])
                reduce = self.comm.pricer("collective", *kernel)
            else:
                kernel = ("reduce_scatter", lowering.group(p, dim)[0])
                scatter = self.comm.pricer("collective", *kernel)
                across = self.comm.pricer("collective", "all_reduce", lowering.group(p, "replicate")[0]) \
                    if plan.replicas > 1 else no_cost
                shards = plan.expert_shard_size if expert else plan.shard_size

                def reduce(nbytes: float) -> float:
                    return scatter(nbytes) + across(nbytes / shards)
            sizes = np.array([nbytes for nbytes, _ in filled])
            unique, index = np.unique(sizes, return_inverse=True)
            seconds = np.array([reduce(float(n)) for n in unique])[index]
            out.append((tuple(mark for _, mark in filled), seconds, self.comm.sim.kernel_sms(*kernel, int(unique[-1]))))
        return tuple(out)

    def _expert_dim(self, s: Setting, v: Variant) -> str:
        """The lowering's group for the routed experts' ZeRO buckets: ``eshard`` where their shard group shards
        them, else ``edp`` (all-reduced whole; or nothing, where no other rank holds them)."""
        return "eshard" if self._experts_move(s, v)[0] else "edp"

    def _zero_gathers(self, s: Setting, v: Variant, p: int) -> tuple[float, ...]:
        """ZeRO-1/2: each bucket's updated weights all-gathered after the optimizer step (unless the next
        step's forward overlaps them: :meth:`_param_gather_starts`)."""
        if v.zero not in (1, 2) or s.dp * s.cp == 1 or v.param_overlap:
            return ()
        return self._cached(("gathers", p) + self._structure(s, v), lambda: self._gathers(s, v, p))

    def _gathers(self, s: Setting, v: Variant, p: int) -> tuple[float, ...]:
        plan = self.layout_plan(s, v)
        lowering = Lowering(plan)
        out = []
        for expert, dim in ((False, "shard"), (True, self._expert_dim(s, v))):
            if expert and dim == "edp":
                continue  # nothing sharded: nothing to gather
            gather = self.comm.pricer("collective", "all_gather", lowering.group(p, dim)[0])
            sizes = [nbytes for nbytes, _ in self._bucket_sizes(s, v, p, expert)]
            out += [gather(gathered_bytes(plan, n)) * sizes.count(n) for n in set(sizes)]
        return tuple(out)

    def _param_gather_starts(self, s: Setting, v: Variant, seconds: np.ndarray, durations: np.ndarray
                             ) -> np.ndarray:
        """ZeRO-1/2 overlapping the weights' gather with the forward (``overlap_param_gather``): per pipeline
        rank, the earliest its first pass can start for no first forward to wait mid-pass. The buckets'
        all-gathers run back to back from the step's start in the order the lowering issues them (reverse
        bucket order), and each entry starts no earlier than the last of its buckets: a pass starting at
        ``t`` with entry ``e`` ``o_e`` into it ends as if it had started at ``max(t, max_e(G_e - o_e))``.
        A later stage's first forward (interleaved and V schedules) comes after the rank's passes ahead of
        it (``durations`` per stage and kind), which it may need to push back too."""
        key = ("param gathers", s.dp, s.tp, s.pp, s.cp, s.ep, s.virtual_stages, s.schedule in V_SCHEDULES,
               v.order, v.shard_group)

        def done() -> list[dict[tuple[int, int], float]]:
            """Per rank, when the last gather each (stage, entry position in backward order) needs ends."""
            plan = self.layout_plan(s, v)
            lowering = Lowering(plan)
            out = []
            for p in range(s.pp):
                issued = []  # (gather seconds, its tensors' tags) in issue order
                for expert, dim in ((True, self._expert_dim(s, v)), (False, "shard")):
                    if expert and dim == "edp":
                        continue  # nothing sharded: nothing to gather
                    gather = self.comm.pricer("collective", "all_gather", lowering.group(p, dim)[0])
                    issued += [(gather(gathered_bytes(plan, nbytes)), members) for nbytes, members in
                               reversed(self._bucket_members(s, p, expert))]
                ends, clock = {}, 0.0
                for cost, members in issued:
                    clock += cost
                    for member in members:
                        ends[member] = clock
                out.append(ends)
            return out
        ends = self._cached(key, done)
        layout = self.layout(s, v)
        ahead = _ahead_of_first_forwards(s.schedule, s.pp, s.num_microbatches, s.virtual_stages) @ durations
        start = np.zeros(s.pp)
        for p in range(s.pp):
            for stage in layout.rank_stages[p]:
                entries = layout.stage_entries[stage]
                forward = seconds[list(entries), KINDS.index("F")]
                offsets = np.cumsum(forward) - forward  # each entry's start within the pass
                start[p] = max(start[p], *(ends[p].get((int(stage), len(entries) - 1 - i), 0.0) - offsets[i]
                                           - ahead[p, stage] for i in range(len(entries))))
        return start

    def _finalize(self, s: Setting, v: Variant, p: int) -> float:
        """What follows the gradient sync on pipeline rank ``p``: with sequence parallelism, the norm gains' (and
        row-parallel biases') gradients all-reduced over the tp group; with a tied table split across pipeline
        ranks, its two copies' gradients summed (the lowering's ``all_reduce embedding``)."""
        norms = self._cached(("norms", p) + self._structure(s, v), lambda: self._norms(s, v, p)) if (
            v.sequence_parallel and s.tp > 1) else 0.0
        return norms + self._cached(("tied", p) + self._structure(s, v), lambda: self._tied_sum(s, v, p))

    def _tied_sum(self, s: Setting, v: Variant, p: int) -> float:
        plan = self.layout_plan(s, v)
        if not plan.copies_embedding_table or p not in (0, s.pp - 1):
            return 0.0
        return self.comm.time("collective", "all_reduce", Lowering(plan).group(p, "embedding")[0],
                              tied_table_bytes(plan))

    def _norms(self, s: Setting, v: Variant, p: int) -> float:
        plan = self.layout_plan(s, v)
        per_type = np.array([cost.sequence_shard_sums(plan.tp) for cost in entry_types(plan)], dtype=float)
        elements = self.layout(s).rank_counts[p] @ per_type
        return self.comm.time("collective", "all_reduce", Lowering(plan).group(p, "tp")[0],
                              elements * plan.grad_bytes)

    def _optimizer(self, s: Setting, v: Variant, p: int) -> float:
        """AdamW on pipeline rank ``p``'s parameters (its shard under ZeRO), after clipping's scaling of their
        gradients where the plans clip them, as the lowering charges it."""
        params, tensors = self._params_of(s, v, p)
        mixed = master_weights(self.dtype_bytes, self.grad_bytes, self._main_grads(s, v))
        clipped = self.grad_bytes if self.space.grad_clip is not None else 0
        dtensors = tensors if self._shards_weights(s, v) else 0  # FSDP2's DTensor parameters
        return self.compute.time((), fsdp_calls=(0, 0, dtensors),
                                 **step_costs(self.space.adamw, params, tensors, mixed, clipped))

    def _params_of(self, s: Setting, v: Variant, p: int) -> tuple[float, int]:
        """Pipeline rank ``p``'s parameters the optimizer steps (its shard under ZeRO) and its tensors."""
        ranks = self._ranks(s, v)
        shard = (v.shard_group or s.dp * s.cp) if v.zero else 1
        expert_shard = max(shard // s.ep, 1)  # the ranks of a shard group holding the same experts
        experts = ranks.experts[p]
        return (ranks.params[p] - experts) / shard + experts / expert_shard, int(ranks.tensors[p])

    def _checked(self, s: Setting, v: Variant, tails: list[tuple]) -> list[tuple]:
        """Each rank's tail (:meth:`_rank_tail`) with the checks between its gradient sync and its step, as
        optimizer time: fp16's unscaling and overflow check, then clipping's norm, each the rank's own pass and
        an all-reduce of a number per dimension holding other gradients. The pipeline ranks' all-reduce starts
        when the last of them is ready for it, so the others wait in it (the lowering's ``_reduced_check``)."""
        plan = self.layout_plan(s, v)
        checks = ([unscale_costs] if plan.scales_loss else []) + ([_norm_pass] if plan.grad_clip is not None else [])
        if not checks:
            return tails
        group = Lowering(plan).group
        sums = {p: [self.comm.time("collective", "all_reduce", group(p, dim)[0], FP32)
                    for dim in grad_norm_dims(plan)] for p in range(s.pp)}
        own = slice(None, -1) if s.pp > 1 else slice(None)  # the pipeline's all-reduce, the last, waits for all
        ready = [tail[2] for tail in tails]
        for costs in checks:
            ready = [r + self.compute.time((), **costs(*self._params_of(s, v, p), self.grad_bytes)) + sum(sums[p][own])
                     for p, r in enumerate(ready)]
            if s.pp > 1:
                ready = [max(ready) + max(sums[p][-1] for p in range(s.pp))] * s.pp
        return [(r + optimizer + gathers, end, sync, optimizer + r - sync, gathers)
                for r, (_, end, sync, optimizer, gathers) in zip(ready, tails)]


def _padded(rows: list[list[int]]) -> np.ndarray:
    """``rows`` as one array, each padded with -1 to the longest."""
    out = np.full((len(rows), max(map(len, rows))), -1, dtype=int)
    for k, row in enumerate(rows):
        out[k, :len(row)] = row
    return out


def _recomputing(variants: tuple[Variant, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The variants recomputing every layer, and the index of each one's twin without recomputation
    (:meth:`FastModel._fewer_recomputed`)."""
    index = {v: i for i, v in enumerate(variants)}
    pairs = [(i, index[v._replace(recompute="none")]) for i, v in enumerate(variants)
             if v.recompute == "full" and v._replace(recompute="none") in index]
    every, plain = zip(*pairs) if pairs else ((), ())
    return np.array(every, dtype=int), np.array(plain, dtype=int)


def _norm_pass(params: float, tensors: int, grad_bytes: int) -> dict[str, float]:
    """Clipping's norm pass (the first of :func:`~parsim.lowering.lower.clip_costs`; the scaling is in the step)."""
    return clip_costs(params, tensors, grad_bytes)[0]


_PLAIN = Variant("dp,pp,cp,tp", False, "none", "ring", "bucketed", 0, None)


def _inputs_key(v: Variant) -> tuple:
    """What a variant's pipeline inputs (:meth:`FastModel._inputs`) depend on."""
    return (v.order, v.sequence_parallel, v.tp_overlap, v.recompute, v.recompute_layers, v.context_parallel, v.fsdp,
            v.shard_group, v.param_overlap, v.ep_overlap)


def pair_seconds(plan: Plan, passes: PassCosts, forward_stage: int = 0, backward_stage: int = 0, rank: int = 0
                 ) -> tuple[float, float]:
    """(a forward of ``forward_stage`` and a backward of ``backward_stage``, both on pipeline rank ``rank``, in
    turn; the two run as a pair): in a pair
    (:meth:`~parsim.lowering.lower.Lowering._paired`) the compute stream takes the passes' stretches
    between expert all-to-alls in turns, the backward first, while the all-to-alls run one after another on
    a stream of their own, each pass's next stretch waiting for its last all-to-all; a stretch that starts
    beside a running all-to-all runs on the SMs its kernel leaves until it ends
    (:meth:`~parsim.sim.compute.ComputeModel.beside_collective_time`)."""
    lowering, comm, compute = Lowering(plan), passes.comm, passes.compute

    def stretches(kind: str) -> list[tuple[list, CommPiece | None]]:
        """The pass as (compute pieces, the all-to-all that ends them, or None for the last)."""
        stage = forward_stage if kind == "F" else backward_stage
        entries = plan.stage_costs(stage)
        out, pieces = [], []
        for cost in (entries if kind == "F" else entries[::-1]):
            for piece in lowering.layer_pass(rank, 0, cost, kind):
                if type(piece) is CommPiece and piece.group == "ep" and not piece.counts:
                    out.append((pieces, piece))
                    pieces = []
                else:
                    pieces.append(piece)
        return out + [(pieces, None)]

    def seconds(pieces: list, held: int = 0) -> float:
        phases, _, _, trailing = passes.time_pieces(pieces, plan.accumulation, held_sms=held)
        return float(phases.sum()) + trailing

    def a2a(piece: CommPiece) -> float:
        return comm.time("collective", piece.collective, piece.ranks, piece.nbytes, piece.routing)

    backward, forward = stretches("B"), stretches("F")
    alone = sum(seconds(p) + (a2a(c) if c else 0.0) for p, c in backward + forward)
    t = stream = 0.0  # when the compute stream and the all-to-alls' stream are free
    running: tuple[float, int] | None = None  # the last all-to-all: its end and the SMs its kernel holds
    ready = {"B": 0.0, "F": 0.0}
    left = {"B": iter(backward), "F": iter(forward)}
    turns = ["B", "F"]
    while turns:
        issued = []
        for x in turns:
            pieces, collective = next(left[x])
            start = max(t, ready[x])
            took = seconds(pieces)
            if running and running[0] > start and pieces:  # beside the all-to-all under way, on the SMs it leaves
                took = compute.beside_collective_time(took, seconds(pieces, running[1]), running[0] - start)
            t = ready[x] = start + took
            if collective is not None:
                stream = ready[x] = max(t, stream) + a2a(collective)
                running = (stream, comm.sim.kernel_sms(collective.collective, collective.ranks,
                                                       int(collective.nbytes), collective.routing))
                issued.append(x)
        turns = issued
    return alone, max(t, stream)


def _rows(table: PassTable, twins: list[int]) -> PassTable:
    """``table`` with a copy of the rows of ``twins`` after its own (:func:`~parsim.search.tables.twinned`)."""
    rows = np.r_[np.arange(len(table.phases)), twins]
    return PassTable(table.phases[rows], table.accumulate[rows], table.accumulate_sm[rows], table.trailing[rows])


def _with_recompute(table: PassTable, recomputed: np.ndarray) -> PassTable:
    """``table`` with the recomputed entries' forward rerun before their backward passes (B and I): the
    same pieces (:meth:`~parsim.lowering.lower.Lowering.layer_pass` ``R``), their compute in the recompute phase."""
    forward = table.phases[:, KINDS.index("F")].copy()
    forward[:, PASS_PHASES.index("recompute")] = forward[:, PASS_PHASES.index("forward")]
    forward[:, PASS_PHASES.index("forward")] = 0.0
    phases = table.phases.copy()
    for kind in ("B", "I"):
        phases[recomputed, KINDS.index(kind)] += forward[recomputed]
    return PassTable(phases, table.accumulate, table.accumulate_sm, table.trailing)


@dataclass(frozen=True)
class _VariantArrays:
    """A layout's variants as arrays: for each thing some variants share (activation tables, pass tables,
    pipeline sends, ZeRO sharding), one variant standing for each distinct value, and each variant's index."""

    activation_keys: list[Variant]
    table_keys: list[Variant]
    order_keys: list[Variant]
    sync_keys: list[Variant]
    activation_index: np.ndarray
    table_index: np.ndarray
    order_index: np.ndarray
    sync_index: np.ndarray
    sync: object


def _gathered_pass(seconds: np.ndarray, gathers: np.ndarray, stream: float,
                   held: tuple[dict[int, np.ndarray], np.ndarray] | None = None) -> tuple[float, np.ndarray]:
    """A pass's entries back to back, each first waiting for its FSDP all-gather, on a stream of its own
    that is free from ``stream`` (seconds from the pass's start) and issues each gather once the entry two
    back has ended (the first two at once). Returns the seconds spent waiting and each entry's end.

    With ``held`` (``slowed``, ``scatters``), the SMs the collectives' NCCL kernels hold while they run
    (:mod:`parsim.sim.held_sms`): each entry runs on the SMs left beside the next entry's all-gather (issued
    as it starts) and beside the reduce-scatters of the entries before it (``scatters``: each entry's
    seconds, 0 in a pass that reduces nothing; issued as the entry ends, one after another on a stream of
    their own that is free at the pass's start), on all of them otherwise. ``slowed[m]``: each entry's
    seconds with the kernels of ``m`` held (1: an all-gather, 2: a reduce-scatter, 3: both) all along."""
    d, g = seconds.tolist(), gathers.tolist()
    first = stream + g[0]
    if (held is None and first <= 0 and (len(g) < 2 or first + g[1] <= d[0])
            and all(gi <= di for gi, di in zip(g[2:], d[1:]))):
        return 0.0, np.cumsum(seconds)  # every gather hides behind the entry before the one it serves
    if held is not None:
        times, r = {m: t.tolist() for m, t in held[0].items()}, held[1].tolist()
    out = [0.0] * len(d)
    t = waited = scattered = 0.0
    windows: list[tuple[float, float, int]] = []  # (from, to, 1 or 2) of each kernel holding SMs
    for i, (di, gi) in enumerate(zip(d, g)):
        stream = (stream if i < 2 or stream > out[i - 2] else out[i - 2]) + gi
        if stream > t:
            waited, t = waited + stream - t, stream
        if held is None:
            t += di
            out[i] = t
            continue
        if i + 1 < len(d):  # the next entry's gather, issued once this one's ended and entry i - 1 has
            issued = stream if i + 1 < 2 or stream > out[i - 1] else out[i - 1]
            windows.append((issued, issued + g[i + 1], 1))
        windows = [w for w in windows if w[1] > t]
        t = out[i] = _held_end(t, di, {m: times[m][i] / di if di > 0 else 1.0 for m in times}, windows)
        if r[i]:
            begins = max(scattered, t)
            scattered = begins + r[i]
            windows.append((begins, scattered, 2))
    return waited, np.array(out)


def _held_end(t: float, work: float, ratios: dict[int, float], windows: list[tuple[float, float, int]]) -> float:
    """When ``work`` seconds (on every SM) begun at ``t`` end, taking ``ratios[m]`` times as long while the
    kernels ``m`` of ``windows`` (from, to, bit) hold their SMs."""
    for edge in sorted({edge for w in windows for edge in w[:2] if edge > t}) + [np.inf]:
        held = 0
        for begins, ends, bit in windows:
            if begins <= t < ends:
                held |= bit
        ratio = ratios[held] if held else 1.0
        if work * ratio <= edge - t:
            return t + work * ratio
        work, t = work - (edge - t) / ratio, edge
    return t


def _shape(s: Setting) -> tuple[str, int, int, int]:
    return (s.schedule, s.pp, s.num_microbatches, s.virtual_stages)


def schedule_facts(name: str, pp: int, m: int, v: int, paired: bool = False
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[pp, moments, 2 x stages per rank] the microbatches in flight on each of a rank's stages at the moments its
    activations may peak, then those waiting on each for a deferred weight gradient
    (:func:`~parsim.schedules.in_flight_by_stage`, rows of zeros padding); [pp, stages * 4]
    the passes of each (stage, kind) it runs; per stage, the kind of its last microbatch's weight-gradient pass
    (B or W).

    Past a few rounds of microbatches a schedule only repeats its steady state: one more forward and
    backward of every stage per microbatch, and no more in flight (GPipe aside, which holds them all);
    so a long schedule is read off one of three rounds (``tests/test_search_fast.py``). ``paired``: the
    schedule as ``ep_comm_overlap`` runs it (:func:`~parsim.schedules.paired_schedule`)."""
    short = _short_length(name, pp, m, v)
    in_flight, counts, final, _ = _short_facts(name, pp, short, v, paired)
    if m > short:
        in_flight, counts = in_flight.copy(), counts.copy()
        own = counts[:, 0::4] > 0
        counts[:, 0::4] += (m - short) * own
        for k in ((2, 3) if name in SPLIT_SCHEDULES else (1,)):
            counts[:, k::4] += (m - short) * own
        if name == "gpipe":
            in_flight[..., :v] = m
    return in_flight, counts, final


def _short_length(name: str, pp: int, m: int, v: int) -> int:
    """The microbatches of the schedule a schedule of ``m`` is read off (:func:`schedule_facts`)."""
    return min(m, 3 * pp) if SCHEDULES[name].rounds_of_pp(pp, m, v) else m


@lru_cache(maxsize=None)
def _short_facts(name: str, pp: int, m: int, v: int, paired: bool
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """:func:`schedule_facts` of a schedule of ``m`` microbatches, and :func:`_drained_stages`'."""
    schedule = paired_schedule(name, pp, m, v) if paired else make_schedule(name, pp, m, v)
    counts = np.zeros((pp, schedule.num_stages * 4))
    final = np.zeros(schedule.num_stages, dtype=int)
    for r, actions in enumerate(schedule.actions):
        for a in actions:
            counts[r, a.stage * 4 + KINDS.index(a.kind)] += 1
            if a.microbatch == m - 1 and a.kind in ("B", "W"):
                final[a.stage] = KINDS.index(a.kind)
    moments = in_flight_by_stage(schedule)
    in_flight = np.zeros((pp, max(len(m) for m in moments), 2 * v))
    for r, rows in enumerate(moments):
        in_flight[r, :len(rows)] = rows
    drained = np.zeros(pp, dtype=int)
    trailing = np.zeros((pp, schedule.num_stages * 4))
    for r, actions in enumerate(schedule.actions):
        last = max(i for i, a in enumerate(actions) if a.kind in ("B", "I") and a.microbatch == m - 1)
        drained[r] = actions[last].stage
        for a in actions[last + 1:]:
            trailing[r, a.stage * 4 + KINDS.index(a.kind)] += 1
    return in_flight, counts, final, (drained, trailing)


def _drained_stages(name: str, pp: int, m: int, v: int) -> tuple[np.ndarray, np.ndarray]:
    """[pp]: the stage of each rank's last backward (B, or I where split) of the last microbatch, whose gradient
    then crosses every stage before it, each a backward and a send, before the step ends; [pp, stages * 4]: the
    passes of each (stage, kind) the rank runs after it (none in 1F1B; zero-bubble's deferred W passes). Read
    off a short schedule, as :func:`schedule_facts` reads it: the passes after the last backward are the
    cool-down's, the same in a longer one (``tests/test_search_fast.py``)."""
    return _short_facts(name, pp, _short_length(name, pp, m, v), v, False)[3]


@lru_cache(maxsize=None)
def _ahead_of_first_forwards(name: str, pp: int, m: int, v: int) -> np.ndarray:
    """[pp, stages, stages * 4]: per rank and stage, the passes of each (stage, kind) the rank runs before
    that stage's first forward (all in the warm-up, which a schedule of three rounds already holds)."""
    schedule = make_schedule(name, pp, min(m, 3 * pp), v)
    out = np.zeros((pp, schedule.num_stages, schedule.num_stages * 4))
    for r, actions in enumerate(schedule.actions):
        seen = np.zeros(schedule.num_stages * 4)
        for a in actions:
            if a.kind == "F" and a.microbatch == 0:
                out[r, a.stage] = seen
            seen[a.stage * 4 + KINDS.index(a.kind)] += 1
    return out


@lru_cache(maxsize=None)
def _pass_counts(s: Setting) -> np.ndarray:
    return schedule_facts(s.schedule, s.pp, s.num_microbatches, s.virtual_stages)[1]
