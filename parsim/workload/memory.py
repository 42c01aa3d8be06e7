"""What one GPU holds at its peak: weights, gradients, optimizer state, activations.

Per pipeline rank, for a plan (no simulation needed): weights and gradients
in the plan's dtype, AdamW's state, and the activations of the microbatches
the schedule keeps in flight, each holding what its stage saves for the
backward (:meth:`~parsim.workload.model.LayerCost.activation_bytes_per_token`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedules import in_flight_by_stage, peak_in_flight
from .plan import Plan

FP32 = 4


@dataclass
class Memory:
    """Peak bytes one GPU of a pipeline rank holds."""

    pp_rank: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    in_flight: int
    buffers: float = 0.0  # FSDP: unsharded weights and gradients of the layers being worked on
    # when its activations peak, the microbatches in flight on each of the rank's stages (increasing), then those
    # waiting on each for their deferred weight gradient (in_flight_by_stage)
    peak_counts: tuple[int, ...] = ()

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers

    @property
    def in_flight_at_peak(self) -> int:
        """Microbatches between their forward and backward when the activations peak."""
        return sum(self.peak_counts[:len(self.peak_counts) // 2]) if self.peak_counts else self.in_flight

    @property
    def waiting(self) -> int:
        """Microbatches waiting for their deferred weight gradient when the activations peak."""
        return sum(self.peak_counts[len(self.peak_counts) // 2:])


def weight_bytes(plan: Plan) -> tuple[int, int]:
    """Bytes per parameter of the weights a rank keeps and of AdamW's fp32 master copy of them. Mixed precision
    keeps the master beside 16-bit weights; FSDP2 (ZeRO-3 over more than one rank) keeps fp32 shards, which are
    the master weights, and gathers them in the plan's dtype (MixedPrecisionPolicy): 4 + 0 bytes, not 2 + 4."""
    d = plan.dtype_bytes
    if d >= FP32:
        return d, 0
    return (FP32, 0) if plan.shards_weights else (d, FP32)


def gradients_accumulate_whole(plan: Plan) -> bool:
    """ZeRO-2 over more than one microbatch: the gradients add up whole over the microbatches and are
    reduce-scattered after the last backward (Megatron-LM's buckets, as the executor runs them), so at their peak
    they are ZeRO-1's. (DeepSpeed's ZeRO-2 reduce-scatters after every microbatch instead: not modelled.)"""
    return plan.zero == 2 and plan.num_microbatches > 1


def largest_gathered_unit(plan: Plan, pp_rank: int) -> tuple[str, int]:
    """The FSDP unit of ``pp_rank`` (a layer, the embedding or the head) with the most parameters gathered whole
    (routed experts no other rank holds stay as they are), and that count: FSDP's buffers hold it twice."""
    whole = plan.expert_shard_size == 1
    return max(((c.name, c.params_per_rank(plan.tp, plan.ep) - c.expert_params_per_rank(plan.tp, plan.ep) * whole)
                for s in plan.stages_of(pp_rank) for c in plan.stage_costs(s)), key=lambda unit: unit[1])


def memory(plan: Plan) -> list[Memory]:
    """Weights, gradients, AdamW state and activations of in-flight microbatches, per pipeline rank.

    Weights are kept in the plan's dtype, gradients in its ``reduce_dtype``;
    AdamW keeps two fp32 moments, plus an fp32 master copy of the weights when
    training in 16 bits (mixed precision, Micikevicius et al. 2018). In bf16
    with fp32 gradients (the default) that is 2 + 4 + 12 = 18 bytes per
    parameter, Megatron-LM's figure (docs/user-guide/features/dist_optimizer.md:
    "bf16 param, fp32 grads"). ZeRO divides by the shard group's size ``N``:
    stage 1 the optimizer state (``6P + 12P/N``, Megatron-LM's distributed
    optimizer), stage 2 the gradients too (``2P + 16P/N``; with more than one
    microbatch they add up whole until the last backward:
    :func:`gradients_accumulate_whole`), stage 3 the weights too (``16P/N``:
    FSDP2's fp32 shards are the master weights, :func:`weight_bytes`); FSDP then holds, besides its shards, the
    unsharded weights of two layers (the one computing and the one prefetched)
    and one layer's unsharded gradients before they are reduce-scattered.
    Under a pipeline FSDP2 keeps every layer's weights gathered and its
    gradients unsharded, in the reduce dtype, until the stage's last backward
    (``torch.distributed.pipelining``; :class:`~parsim.workload.plan.Plan`):
    ``P x (weights' + gradients' bytes)`` besides the shards.

    Activations: at the schedule's peak, each (stage, microbatch) forward
    awaiting its backward holds what its stage saves per microbatch (for the
    1/cp of each sequence a context-parallel rank computes): a rank with
    several stages weighs each by its own (the one with the embedding or the
    head saves more; :func:`~parsim.schedules.in_flight_by_stage`). A layer
    whose forward is recomputed saves only its input; while its backward runs,
    one such layer's full activations exist again for one microbatch (the
    recomputation's working set).
    """
    in_flight, by_stage = peak_in_flight(plan.pipeline), in_flight_by_stage(plan.pipeline)
    tokens, d, g, n, zero = plan.tokens_per_rank, plan.dtype_bytes, plan.grad_bytes, plan.shard_size, plan.zero
    kept, master = weight_bytes(plan)
    out = []
    for p in range(plan.pp):
        params = plan.params_per_rank(p)
        per_token = [*(saved_bytes_per_token(plan, s) for s in plan.stages_of(p)),
                *(waiting_bytes_per_token(plan, s) for s in plan.stages_of(p))]
        peak = max(by_stage[p], key=lambda counts: sum(n * b for n, b in zip(counts, per_token)))
        rebuilt = max((c.activation_bytes_per_token(plan.tp) for s in plan.stages_of(p) for c in plan.recomputed(s)),
                      default=0)
        experts = plan.expert_params_per_rank(p)  # sharded over the ranks holding the same experts
        whole = plan.expert_shard_size == 1  # experts no other rank of the shard group holds: never gathered
        buffers = 0
        if plan.shards_weights and plan.pp > 1:  # every layer's weights gathered, its gradients kept whole
            buffers = (params - experts * whole) * (d + g)
        elif plan.shards_weights:
            buffers = largest_gathered_unit(plan, p)[1] * (2 * d + g)

        def held(from_stage: int) -> float:
            """Parameters' worth of a state ZeRO shards from ``from_stage`` on."""
            if zero < from_stage:
                return params
            return (params - experts) / n + experts / plan.expert_shard_size

        gradients = params if gradients_accumulate_whole(plan) else held(2)
        out.append(Memory(p, held(3) * kept, gradients * g, held(1) * (2 * plan.moment_bytes + master),
                          (sum(n * b for n, b in zip(peak, per_token)) + rebuilt) * tokens, in_flight[p], buffers,
                          peak))
    return out


def waiting_bytes_per_token(plan: Plan, stage: int) -> int:
    """What one microbatch keeps on ``stage`` per token while its deferred weight gradient waits (split
    schedules): every layer's linear inputs and their output gradients
    (:meth:`~parsim.workload.model.LayerCost.weight_grad_bytes_per_token`; a recomputed layer rebuilt them in its
    input-gradient pass)."""
    return sum(c.weight_grad_bytes_per_token(plan.tp, plan.dtype_bytes, plan.sequence_parallel)
               for c in plan.stage_costs(stage))


def saved_bytes_per_token(plan: Plan, stage: int) -> int:
    """What one microbatch leaves on ``stage`` per token until its backward: every layer's saved
    activations, or only the input of a layer that is recomputed."""
    recomputed = {c.name for c in plan.recomputed(stage)}
    return sum(c.checkpoint_bytes_per_token(plan.tp) if c.name in recomputed else c.activation_bytes_per_token(plan.tp)
               for c in plan.stage_costs(stage))
