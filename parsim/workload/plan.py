"""Parallelism plans: how one training step of a model is split over GPUs.

A :class:`Plan` holds the data- (``dp``), pipeline- (``pp``) and tensor-
(``tp``) parallel degrees, the batch split, the pipeline schedule, the
precision and the styles of tensor parallelism and gradient synchronization.
Like torchtitan's ``ParallelDims`` it checks itself in one place (its
``__post_init__`` and :meth:`Plan.validate`): each violation is one
:class:`~parsim.errors.ParsimError` line naming the numbers.

Ranks form a grid with ``tp`` innermost, as in picotron
(``arange(world).view(dp, pp, tp)``): a tensor-parallel group is consecutive
ranks, inside one node whenever ``tp`` divides the GPUs per node. ``order``
names the nesting, outermost first (``"dp,pp,tp"``), so other placements can
be tried.

The batch: ``global_batch_size = dp · microbatch_size · num_microbatches``,
counted in samples (sequences for a transformer, rows for the MLP). Any two of
the three determine the third; given one of ``microbatch_size`` and
``num_microbatches`` with a known global batch, the other is derived. Given the
global batch alone, a pipeline-parallel plan runs microbatches of 1 sample
(torchtitan's ``pipeline_parallel_microbatch_size`` default) and any other plan
one microbatch. With no global batch, a missing ``microbatch_size`` is 1, and
a missing ``num_microbatches`` is 1, or on a pipeline the fewest that fill its
schedule (:meth:`Plan.least_microbatches`). The MLP's global batch is its
``batch_size``.

Plans load from YAML (:func:`load_plan`, :func:`resolve_plan`)::

    model: llama3-70b          # preset name, path to a model YAML, or an inline mapping
    parallel: {dp: 16, tp: 8, pp: 8}
    batch: {microbatch_size: 1, num_microbatches: 16}
    schedule: 1f1b
    virtual_stages: 1
    dtype: bf16
    tensor_parallel: megatron
    data_parallel: {grad_sync: bucketed, bucket_size: 25MiB, overlap: true}
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping, NamedTuple, NoReturn

import numpy as np

from ..errors import ConfigError, ParsimError
from ..files import read_yaml
from ..hardware.cluster import MAX_GPUS
from ..schedules import SCHEDULES as SCHEDULE_KINDS
from ..schedules import PAIRED_SCHEDULES, Schedule, make_schedule, paired_schedule, uneven_rounds
from .model import (DTYPE_BYTES, FP8_SAVED_BYTES, LINEAR_ALSO, LINEAR_ONLY, RECOMPUTE_MODULES, Activation,
                    ConfigReader, LayerCost, MLPModel, Model, TransformerModel, load_model)
from .stage_split import balanced_split, even_split

SCHEDULES = tuple(SCHEDULE_KINDS)
# Schedules with a steady state of one forward and one backward: with no batch given a plan fills their
# pipeline with one microbatch per rank (fewer run, sequentially).
STEADY_STATE_SCHEDULES = ("1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipe-v")
V_SCHEDULES = ("zbv", "dualpipe-v")  # two stages per rank placed in a V: rank r holds stages r and 2·pp-1-r
TP_STYLES = ("megatron", "allgather")
ROUTED_ACTIVATIONS = ("moe.dispatched", "moe.expert.")  # a MoE layer's saved rows of its routed experts
RECOMPUTE = ("none", "selective", "full")
DEFAULT_RECOMPUTE_MODULES = ("core_attn",)  # Megatron-LM's default for selective recompute
GRAD_SYNCS = ("per_param", "bucketed", "fsdp")  # fsdp: ZeRO-3 with FSDP2's per-layer units
ZERO_STAGES = (0, 1, 2, 3)
# How each microbatch's weight gradient joins the step's sum: "autograd" adds it in a pass of its own (see
# accumulation_bytes); "fused" has the weight-gradient matmul accumulate into the gradient buffer in its
# epilogue (Megatron-LM's gradient_accumulation_fusion, TE's fuse_wgrad_accumulation).
GRAD_ACCUMULATIONS = ("autograd", "fused")
# AdamW's implementation: torch's "foreach" (and for-loop) steps pass over each tensor several times; "fused"
# (torch's fused=True, Apex's and Transformer Engine's FusedAdam) updates weight and moments in one pass.
ADAMW_IMPLEMENTATIONS = ("foreach", "fused")
# The dtype AdamW keeps its two moments in: fp32, or bf16 as DeepSeek-V3 does (its report, section 3.3.3: "the BF16
# data format instead of FP32 to track the first and second moments"); Megatron-LM's --use-precision-aware-optimizer
# with --exp-avg-dtype and --exp-avg-sq-dtype bf16, which steps them in Transformer Engine's FusedAdam.
ADAM_MOMENTS = {"fp32": 4, "bf16": 2}
DEFAULT_ADAMW = "foreach"  # what the executor's torch.optim.AdamW runs by default
# The dtype data parallelism reduces gradients in (and keeps them in for the optimizer). Mixed precision
# with bf16 weights reduces in fp32 by default: Megatron-LM ("bfloat16 requires gradient accumulation and
# all-reduce to be done in fp32", megatron/training/arguments.py, unless --grad-reduce-in-bf16) and
# torchtitan's FSDP2 (mixed_precision_reduce = "float32"). fp16 training reduces in fp16 (Megatron-LM's
# --accumulate-allreduce-grads-in-fp32 is off by default), fp32 in fp32.
REDUCE_DTYPES = ("fp32", "bf16", "fp16")
DIMS = ("dp", "pp", "cp", "tp")  # expert parallelism (ep) folds into dp x cp, as Megatron-LM's
CP_STYLES = ("ring", "all_gather")
# How tokens reach their experts: Megatron-LM's all-to-all dispatcher (a copy per expert), or DeepEP's
# (a copy per node across the network, then NVLink: parsim.sim.collectives.deepep)
DISPATCHERS = ("alltoall", "deepep")
DEFAULT_ORDER = "dp,pp,cp,tp"
DEFAULT_BUCKET_SIZE = 25 * 2**20  # torch DDP's bucket_cap_mb default
# Batch figures beyond any training step: refused as typos rather than simulated for minutes.
BATCH_LIMITS = {"microbatch_size": 2**24, "num_microbatches": 2**16}


def keeps_main_grads(dtype_bytes: int, shards_weights: bool) -> bool:
    """Whether gradients add up in a buffer of their own in the reduce dtype (:func:`accumulation_bytes`) and
    AdamW steps fp32 master weights: with bf16, fp16 or fp8 weights, except under FSDP, whose FSDP2 keeps fp32
    shards and sharded gradients."""
    return dtype_bytes < DTYPE_BYTES["fp32"] and not shards_weights


def master_weights(dtype_bytes: int, grad_bytes: int, main_grads: bool) -> tuple[int, int] | None:
    """(weight bytes, gradient bytes) where AdamW steps fp32 master copies of the weights and copies them back
    (with main grads, :func:`keeps_main_grads`: Megatron-LM's mixed precision; FSDP2 keeps fp32 shards instead)."""
    return (dtype_bytes, grad_bytes) if main_grads else None


def attention_seq(model: Model, cp: int) -> int:
    """Query positions one attention kernel runs over: the whole sequence, or a context-parallel rank's
    1/cp of it (ring attention runs a kernel per K/V block; the all-gather form one over all keys, but
    still on this rank's queries). 0 without attention."""
    return model.seq_len // cp if isinstance(model, TransformerModel) else 0


def copies_embedding_table(model: Any, pp: int, schedule: str) -> bool:
    """The embedding table needed on another pipeline rank than the embedding's (every placement but a V's,
    which puts the first and last stages on rank 0): by a tied LM head, or by multi-token prediction's
    embedding of the next tokens. That rank keeps a copy of the table, whose gradient is summed with the first
    stage's after the data-parallel sync (Megatron-LM's ``_allreduce_embedding_grads``)."""
    needs_table = getattr(model, "tied_embeddings", False) or getattr(model, "mtp_layers", 0) > 0
    return needs_table and pp > 1 and schedule not in V_SCHEDULES


def rank_grid(order: str, degrees: Mapping[str, int]) -> np.ndarray:
    """Ranks indexed ``[dp, pp, cp, tp]`` for these ``degrees``: ``arange(world)`` shaped by ``order``, innermost
    last."""
    nesting = order.split(",")
    grid = np.arange(math.prod(degrees.values())).reshape([degrees[d] for d in nesting])
    return grid.transpose([nesting.index(d) for d in DIMS])


def accumulation_bytes(dtype_bytes: int, grad_bytes: int, main_grads: bool, microbatches: int) -> float:
    """Bytes per weight that adding a microbatch's weight gradient into the step's sum streams, on average
    over the step's microbatches (``grad_accumulation: autograd``).

    With ``main_grads`` (Megatron-LM's gradient buffer beside bf16/fp16 weights, which the executor keeps too)
    a hook adds every microbatch's fresh gradient into ``main_grad`` in the reduce dtype: read the gradient,
    read and write the buffer (``param.main_grad.add_(param.grad.data)``,
    ``megatron/core/distributed/distributed_data_parallel.py``). Otherwise autograd adds into ``.grad`` for
    every microbatch but the first, whose gradient becomes ``.grad``: read both, write one.
    """
    if main_grads:
        return dtype_bytes + 2 * grad_bytes
    return 3 * dtype_bytes * (microbatches - 1) / microbatches


class Accumulation(NamedTuple):
    """What adding one microbatch's weight gradients into the step's sum costs per weight: the bytes it streams
    (:func:`accumulation_bytes`) and the elements it reads or writes through torch's non-vectorized loop
    (:func:`accumulation_elements`), whose SM cycles can outlast those bytes on a GPU."""

    bytes: float
    elements: float

    def seconds(self, per_byte, per_element):
        """Its time, the longer of its bytes and its unvectorized elements, at these seconds per byte and per
        element (per weight; numbers or arrays)."""
        return np.maximum(per_byte * self.bytes, per_element * self.elements)


def accumulation_elements(dtype_bytes: int, grad_bytes: int, main_grads: bool) -> float:
    """Elements per weight, read or written, that adding a microbatch's weight gradient into ``main_grad`` runs
    through torch's non-vectorized loop: 3 (read both, write one) where ``main_grad`` is in another dtype than
    the gradient, whose add then casts on the fly (an H200 timed ``main_grad.add_(grad)`` from bf16 into fp32 at
    0.311 SM cycles an element, against the bias add's 0.366 the model prices it at:
    ``benchmarks/gpu/h200-unvectorized-ops-2026-11-30.json``); 0 where the dtypes match (vectorized)."""
    return 3.0 if main_grads and grad_bytes != dtype_bytes else 0.0


def accumulation(dtype_bytes: int, grad_bytes: int, main_grads: bool, microbatches: int) -> Accumulation:
    """A microbatch's weight gradients joining the step's sum, per weight (:class:`Accumulation`)."""
    return Accumulation(accumulation_bytes(dtype_bytes, grad_bytes, main_grads, microbatches),
                        accumulation_elements(dtype_bytes, grad_bytes, main_grads))


def default_reduce_dtype(dtype: str) -> str:
    """The gradients' dtype a plan in ``dtype`` reduces in unless it says otherwise (``REDUCE_DTYPES``)."""
    return "fp32" if dtype in ("bf16", "fp8") else dtype


class RankCoords(NamedTuple):
    """A rank's place in the grid."""

    dp: int
    pp: int
    cp: int
    tp: int


def expert_load_problem(model: TransformerModel, load: float) -> str | None:
    """What is wrong with ``load`` as a MoE model's busiest expert's tokens over the mean (None: nothing)."""
    if not load >= 1:  # NaN too
        return f"{load:g} is below 1: it is the busiest expert's tokens over the mean"
    if load > model.num_experts / model.experts_per_token:
        return (f"{load:g} is more than all tokens on one expert (num_experts / experts_per_token = "
                f"{model.num_experts / model.experts_per_token:g})")
    return None


@dataclass(frozen=True)
class Plan:
    """A validated parallelism plan for one model.

    ``microbatch_size``, ``num_microbatches`` and ``global_batch_size`` may be
    left ``None`` and are then derived (see the module docstring); after
    construction all three are whole numbers. ``tp_style`` ``None`` takes the
    model's own style ("megatron" for transformers, "allgather" for the MLP);
    ``overlap`` ``None`` means overlapped exactly when ``grad_sync`` is
    "bucketed".

    ``grad_sync`` "per_param" is the lecture's DDP: one all-reduce per parameter
    after the backward. "bucketed" is torch DDP's: gradients gathered into
    buckets of ``bucket_size`` bytes in reverse layer order, each all-reduced as
    soon as it fills, overlapping the rest of the backward when ``overlap``.

    ``zero`` shards training state over the data-parallel group (Rajbhandari et
    al. 2020): 1 the optimizer state (gradients reduce-scattered in buckets, the
    optimizer steps its shard, the weights are all-gathered after: Megatron-LM's
    distributed optimizer), 2 the gradients too, 3 the weights too, with FSDP2's
    semantics (``grad_sync: fsdp``): each layer's weights all-gathered before
    its forward and, with ``reshard_after_forward``, again before its backward,
    the next layer's gather prefetched, its gradients reduce-scattered after
    its backward. Under a pipeline, as ``torch.distributed.pipelining`` drives
    FSDP2, a backward keeps the weights gathered and the gradients unsharded
    until the stage's last one, after which every layer's gradients are
    reduce-scattered at once; ``reshard_after_forward`` defaults to false there
    (torchtitan's default policy), so a stage gathers its weights once a step.
    ``shard_group`` (HSDP) shards within groups of that many
    data-parallel ranks and all-reduces the shards across the groups; a
    mixture of experts' routed experts shard over the ranks of a group that
    hold the same experts (torchtitan's ``dp_shard_mod_ep``).
    ``overlap_param_gather`` (ZeRO-1/2) moves the weight all-gathers from after
    the optimizer step to the next step's forward, each layer's first forward
    waiting for its bucket (Megatron-LM's ``--overlap-param-gather``).
    ``reduce_dtype`` is the dtype gradients are kept and reduced in (fp32 by
    default with bf16 or fp8 weights, as Megatron-LM and torchtitan do; else the
    weights' dtype): it sets the bytes of every gradient all-reduce and
    reduce-scatter and the gradients' memory, while weight all-gathers move the
    weights' dtype. ``grad_accumulation`` "autograd" adds every microbatch's weight gradients
    but the first into ``.grad`` in a memory pass of their own; "fused" lets the
    weight-gradient matmul accumulate in place (Megatron-LM's
    ``gradient_accumulation_fusion``), which costs no pass. ``adamw`` "foreach"
    prices torch's default AdamW step (several passes per tensor), "fused" one
    pass over weight, gradient and moments (``torch.optim.AdamW(fused=True)``,
    Apex's and Transformer Engine's ``FusedAdam``); ``adam_moments`` "bf16" keeps
    its two moments in bf16 (DeepSeek-V3; Megatron-LM's precision-aware
    optimizer, on the fused step). ``grad_clip`` scales the
    gradients down so that their global L2 norm is at most that much before the
    step (``torch.nn.utils.clip_grad_norm_``, Megatron-LM's ``--clip-grad``):
    each rank takes the norm of the gradients it holds, the ranks holding
    different parts sum the squares (one all-reduce of a number per group),
    and every gradient is scaled.

    Pipeline stages: the layers split into ``pp · virtual_stages`` stages;
    stage ``s`` runs on pipeline rank ``s % pp`` (Megatron-LM's interleaved
    placement, Narayanan et al. 2021). The embedding belongs to the first stage
    and the LM head to the last. ``layers_per_stage`` gives the split
    explicitly, or ``"balanced"`` asks for the split that makes the slowest
    stage fastest (:mod:`parsim.workload.stage_split`); left ``None`` it is even when the
    stage count divides the layers and balanced otherwise.

    ``cp`` splits every sequence over context-parallel ranks (two chunks each,
    balancing the causal mask); ``context_parallel`` "ring" passes K/V around
    the cp ring overlapped with attention (Megatron-LM), "all_gather" gathers
    them first (Llama 3). Gradients are reduced over dp x cp ranks.

    ``ep`` spreads a mixture-of-experts model's routed experts over groups of
    that many data-parallel ranks (Megatron-LM folds it into dp x cp), tokens
    travelling to their experts by all-to-all; ``expert_load`` is the busiest
    expert's share of tokens over the mean (1: perfectly balanced routing),
    capped by ``capacity_factor`` when tokens beyond capacity are dropped: the
    rank holding it (its other experts taken at the mean) computes, keeps and
    moves its extra routed rows, and the others wait for it.
    ``ep_comm_overlap`` runs each pair of a forward and another microbatch's
    backward together, the all-to-alls of one beside the compute of the other:
    DualPipe-V's pairs (DeepSeek-V3 report, section 3.2.1), or Megatron-LM's
    combined 1F1B (``--overlap-moe-expert-parallel-comm``), without a pipeline or
    interleaved.
    ``dispatch_fp8`` (fp8 plans) sends the tokens to their experts, and the
    gradients to the experts' down-projections, in fp8 as DeepSeek does.
    ``dispatcher`` "alltoall" sends a copy of a token to each of its experts
    (Megatron-LM's ``alltoall`` token dispatcher); "deepep" sends it once to
    each node holding its experts and forwards it there over NVLink, as DeepEP
    does (Megatron-LM's ``flex`` dispatcher; :mod:`parsim.sim.collectives.deepep`).

    ``sequence_parallel`` (Megatron TP only) shards norms and block inputs
    along the sequence, with all-gathers and reduce-scatters in place of the
    all-reduces; ``tp_comm_overlap`` hides those behind the GEMMs they feed
    and drain, as Megatron-LM's ``--tp-comm-overlap`` does
    (:mod:`parsim.lowering.tp_overlap`). ``activation_recompute`` "full" keeps only each recomputed
    layer's input and reruns its forward before its backward (the first
    ``recompute_layers`` layers of each stage, all when unset); "selective"
    recomputes the attention core (Korthikanti et al. 2022): an unfused core
    (``attention_kernel: unfused``) then keeps no scores, softmax or dropout
    tensors and reruns its scores, softmax and dropout before its backward;
    flash attention never stores them, so there it saves and costs nothing
    (its backward already recomputes them).
    """

    model: Model
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    context_parallel: str = "ring"
    ep: int = 1
    capacity_factor: float | None = None
    expert_load: float = 1.0
    ep_comm_overlap: bool = False
    dispatch_fp8: bool = False
    dispatcher: str = "alltoall"
    microbatch_size: int | None = None
    num_microbatches: int | None = None
    global_batch_size: int | None = None
    schedule: str = "1f1b"
    virtual_stages: int | None = None  # None: the schedule's own (2 for interleaved-1f1b and the Vs, else 1)
    dtype: str = "fp32"
    tp_style: str | None = None
    grad_sync: str = "bucketed"
    bucket_size: int = DEFAULT_BUCKET_SIZE
    overlap: bool | None = None
    order: str = DEFAULT_ORDER
    layers_per_stage: tuple[int, ...] | str | None = None
    zero: int | None = None
    shard_group: int | None = None
    reshard_after_forward: bool | None = None  # None: without a pipeline only (torchtitan)
    overlap_param_gather: bool = False
    reduce_dtype: str | None = None  # None: default_reduce_dtype(dtype)
    grad_accumulation: str = "autograd"
    adamw: str = DEFAULT_ADAMW
    adam_moments: str = "fp32"
    grad_clip: float | None = None
    sequence_parallel: bool = False
    tp_comm_overlap: bool = False
    tp_async_backward: bool | None = None  # None: tensor_parallel megatron's (on since Megatron-LM's 2021-09 release)
    activation_recompute: str = "none"
    recompute_layers: int | None = None
    recompute_modules: tuple[str, ...] | None = None  # selective recompute's (None: its default, the core's)
    name: str = "plan"
    description: str = ""
    cluster: str = ""  # the cluster it was written for (a name or file): commands' default for --cluster

    def __post_init__(self) -> None:
        for key in ("dp", "tp", "pp", "cp", "ep", "virtual_stages", "bucket_size",
                    "microbatch_size", "num_microbatches", "global_batch_size", "recompute_layers", "shard_group"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                self._fail(f"{key} is {value!r}; it must be a whole number >= 1")
        if self.dp * self.tp * self.pp * self.cp > MAX_GPUS:
            self._fail(f"{self.degrees_text()} = {self.dp * self.tp * self.pp * self.cp:,} ranks, more than parsim "
                       f"simulates (at most {MAX_GPUS:,} GPUs)")
        if self.tp_style is None:
            object.__setattr__(self, "tp_style", self.model.tp_styles[0])
        if self.zero is None:
            object.__setattr__(self, "zero", 3 if self.grad_sync == "fsdp" else 0)
        if self.reduce_dtype is None:
            object.__setattr__(self, "reduce_dtype", default_reduce_dtype(self.dtype))
        if self.reshard_after_forward is None:
            object.__setattr__(self, "reshard_after_forward", self.pp == 1)
        if self.virtual_stages is None:  # as make_schedule: 2 for interleaved-1f1b (Megatron's smallest) and a V
            kind = SCHEDULE_KINDS.get(self.schedule)
            object.__setattr__(self, "virtual_stages", kind.virtual_stages[0] if kind else 1)
        object.__setattr__(self, "order", _order(self.order))
        if self.overlap is None:
            object.__setattr__(self, "overlap", self.grad_sync in ("bucketed", "fsdp"))
        if self.tp_async_backward is None:
            object.__setattr__(self, "tp_async_backward", self.tp_style == "megatron")
        self._resolve_batch()
        for key, high in BATCH_LIMITS.items():
            if getattr(self, key) > high:
                self._fail(f"{key} is {getattr(self, key):,}, beyond any training step (at most {high:,})")
        self.validate()

    def _fail(self, message: str) -> NoReturn:
        raise ParsimError(f"plan {self.name}: {message}")

    def least_microbatches(self) -> int:
        """The fewest microbatches per step that fill this plan's pipeline: 1 without a pipeline; one per
        rank for a steady-state schedule (fewer run, but one after another: torch's Schedule1F1B even
        refuses them), and one per stage for DualPipe-V, which runs no fewer."""
        kind = SCHEDULE_KINDS.get(self.schedule)
        if self.pp == 1 or kind is None:
            return 1  # an unknown schedule is refused by validate()
        return max(kind.min_microbatches(self.pp, self.virtual_stages),
                   self.pp if self.schedule in STEADY_STATE_SCHEDULES else 1)

    def _resolve_batch(self) -> None:
        mbs, nmb, gbs, dp = self.microbatch_size, self.num_microbatches, self.global_batch_size, self.dp
        if isinstance(self.model, MLPModel):
            if gbs is not None and gbs != self.model.batch_size:
                self._fail(f"global_batch_size {gbs} differs from model {self.model.name}'s batch_size "
                           f"{self.model.batch_size}")
            gbs = self.model.batch_size
        if mbs is not None and nmb is not None:
            if gbs is not None and dp * mbs * nmb != gbs:
                self._fail(f"dp {dp} x microbatch_size {mbs} x num_microbatches {nmb} = {dp * mbs * nmb}, "
                           f"not the global batch {gbs}")
        elif gbs is not None:
            if mbs is None and nmb is None and self.pp > 1:
                mbs = 1  # a pipeline needs microbatches to fill it: torchtitan's default microbatch size
            given, known = ("microbatch_size", mbs) if mbs is not None else ("num_microbatches", nmb or 1)
            if gbs % (dp * known):
                self._fail(f"the global batch {gbs} does not split evenly over dp {dp} x {given} {known}")
            other = gbs // (dp * known)
            mbs, nmb = (known, other) if given == "microbatch_size" else (other, known)
        else:
            mbs, nmb = mbs or 1, nmb or self.least_microbatches()
        object.__setattr__(self, "microbatch_size", mbs)
        object.__setattr__(self, "num_microbatches", nmb)
        object.__setattr__(self, "global_batch_size", dp * mbs * nmb)

    def _check_recompute_modules(self) -> None:
        """Selective recompute's modules: known ones, each applying to the model (as Megatron-LM checks)."""
        if self.recompute_modules is None:
            if self.activation_recompute == "selective":
                object.__setattr__(self, "recompute_modules", DEFAULT_RECOMPUTE_MODULES)
            return
        if self.activation_recompute != "selective":
            self._fail("recompute modules need activation_recompute selective (they name what it recomputes)")
        unknown = [name for name in self.recompute_modules if name not in RECOMPUTE_MODULES]
        if unknown or not self.recompute_modules:
            self._fail(f"recompute module {unknown[0] if unknown else 'list'!r} is not one of "
                       f"{', '.join(RECOMPUTE_MODULES)} (Megatron-LM's; its mlp, moe and shared_experts are not "
                       f"modelled: full recompute reruns whole layers)")
        needs = {"mla_up_proj": (getattr(self.model, "attention", "") == "mla", "latent attention (MLA)"),
                 "moe_act": (getattr(self.model, "is_moe", False), "mixture-of-experts layers")}
        for name in self.recompute_modules:
            applies, what = needs.get(name, (True, ""))
            if not applies:
                self._fail(f"recompute module {name} needs a model with {what}; {self.model.name} has none")

    def validate(self, gpus: int | None = None) -> None:
        """Check every rule; with ``gpus``, also that the plan uses exactly that many GPUs."""
        m = self.model
        if self.schedule not in SCHEDULES:
            self._fail(f"schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.dtype not in DTYPE_BYTES:
            self._fail(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        if self.tp_style not in m.tp_styles:
            known = "" if self.tp_style in TP_STYLES else f" (known styles: {', '.join(TP_STYLES)})"
            self._fail(f"tensor_parallel {self.tp_style!r} does not apply to {m.kind} model {m.name}; "
                       f"it supports {', '.join(m.tp_styles)}{known}")
        if self.activation_recompute not in RECOMPUTE:
            self._fail(f"activation_recompute {self.activation_recompute!r} is not one of {', '.join(RECOMPUTE)}")
        if self.recompute_layers is not None and self.activation_recompute != "full":
            self._fail("recompute_layers needs activation_recompute full (it counts the layers of each stage "
                       "whose forward is recomputed)")
        self._check_recompute_modules()
        if self.sequence_parallel:
            try:
                m.check_style(self.tp_style, sequence_parallel=True)
            except ParsimError as err:
                self._fail(f"sequence_parallel: {err}")
        if self.tp_comm_overlap and not (self.sequence_parallel and self.tp > 1 and self.tp_style == "megatron"
                                         and isinstance(m, TransformerModel)):
            self._fail(f"tp_comm_overlap hides a transformer's sequence-parallel all-gathers and reduce-scatters "
                       f"(Megatron-LM's --tp-comm-overlap): it needs tensor_parallel megatron with tp > 1 and "
                       f"sequence_parallel: true (this plan: {m.kind} model, tp {self.tp}, {self.tp_style}, "
                       f"sequence_parallel {str(self.sequence_parallel).lower()})")
        if self.tp_async_backward and self.tp_style != "megatron":
            self._fail(f"tp_async_backward runs a column-parallel linear's backward collectives beside its GEMMs, as "
                       f"Megatron-LM does: it needs tensor_parallel megatron (this plan: {self.tp_style})")
        if self.grad_sync not in GRAD_SYNCS:
            self._fail(f"grad_sync {self.grad_sync!r} is not one of {', '.join(GRAD_SYNCS)}")
        if self.overlap and self.grad_sync == "per_param":
            self._fail("overlap needs grad_sync bucketed (per_param all-reduces after the backward, "
                       "as in the lecture)")
        if self.reduce_dtype not in REDUCE_DTYPES:
            self._fail(f"reduce_dtype {self.reduce_dtype!r} is not one of {', '.join(REDUCE_DTYPES)}")
        if self.grad_accumulation not in GRAD_ACCUMULATIONS:
            self._fail(f"grad_accumulation {self.grad_accumulation!r} is not one of {', '.join(GRAD_ACCUMULATIONS)}")
        if self.adamw not in ADAMW_IMPLEMENTATIONS:
            self._fail(f"adamw {self.adamw!r} is not one of {', '.join(ADAMW_IMPLEMENTATIONS)}")
        if self.adam_moments not in ADAM_MOMENTS:
            self._fail(f"adam_moments {self.adam_moments!r} is not one of {', '.join(ADAM_MOMENTS)}")
        if self.adam_moments != "fp32" and self.adamw != "fused":
            self._fail(f"adam_moments {self.adam_moments} needs adamw fused: Megatron-LM's precision-aware optimizer "
                       f"steps low-precision moments in Transformer Engine's FusedAdam (add --adamw fused)")
        if self.grad_clip is not None and not (isinstance(self.grad_clip, (int, float))
                                               and not isinstance(self.grad_clip, bool)
                                               and 0 < self.grad_clip < math.inf):
            self._fail(f"grad_clip {self.grad_clip!r} is not a positive number (the largest gradient norm kept)")
        if self.zero not in ZERO_STAGES:
            self._fail(f"zero {self.zero!r} is not a ZeRO stage (0: replicated; 1: optimizer state sharded; "
                       f"2: and gradients; 3: and weights, as FSDP)")
        if self.grad_sync == "fsdp" and self.zero != 3:
            self._fail(f"grad_sync fsdp shards weights, gradients and optimizer state: it is zero 3, not {self.zero}")
        if self.zero and self.grad_sync == "per_param":
            self._fail("ZeRO shards gradients in buckets (grad_sync bucketed or fsdp), not per parameter")
        if self.overlap_param_gather and self.zero not in (1, 2):
            self._fail(f"overlap_param_gather hides ZeRO-1/2's weight all-gathers behind the next step's forward "
                       f"(Megatron-LM's --overlap-param-gather): it needs zero 1 or 2, not {self.zero}")
        if self.shard_group is not None:
            if not self.zero:
                self._fail("shard_group (HSDP) needs a ZeRO stage >= 1 to shard within the group")
            if (self.dp * self.cp) % self.shard_group:
                self._fail(f"shard_group {self.shard_group} does not divide the {self.dp * self.cp} data-parallel "
                           f"ranks (HSDP shards within groups of that size and replicates across them)")
            if self.shard_group == 1:
                self._fail("shard_group 1 shards nothing: every rank keeps the whole state (plain data "
                           "parallelism: leave out zero and shard_group)")
        if sorted(self.order.split(",")) != sorted(DIMS):
            self._fail(f"order {self.order!r} is not a nesting of dp, pp, cp and tp such as {DEFAULT_ORDER!r}")
        self._check_experts()
        if self.context_parallel not in CP_STYLES:
            self._fail(f"context_parallel {self.context_parallel!r} is not one of {', '.join(CP_STYLES)}")
        if self.context_parallel != "ring" and self.cp == 1:
            self._fail(f"context_parallel {self.context_parallel} with cp 1 splits nothing: give cp > 1 (--cp), or "
                       "leave it out")
        if self.cp > 1:
            if not isinstance(m, TransformerModel):
                self._fail(f"cp {self.cp}: context parallelism splits sequences, and {m.kind} model {m.name} has none")
            if m.seq_len % (2 * self.cp):
                self._fail(f"cp {self.cp} needs seq_len {m.seq_len} divisible by 2 x cp = {2 * self.cp} (each rank "
                           f"takes two chunks, one early and one late, to balance the causal mask)")
        if self.schedule in V_SCHEDULES and self.virtual_stages != 2:
            self._fail(f"{self.schedule} places two stages per rank in a V: virtual_stages must be 2, "
                       f"not {self.virtual_stages}")
        if self.virtual_stages > 1 and self.schedule not in ("interleaved-1f1b", *V_SCHEDULES):
            self._fail(f"virtual_stages {self.virtual_stages} needs schedule interleaved-1f1b "
                       f"(schedule {self.schedule} runs one stage per pipeline rank)")
        if self.schedule == "interleaved-1f1b" and self.virtual_stages < 2:
            self._fail("interleaved-1f1b needs virtual_stages >= 2 (with 1 it is plain 1f1b)")
        self._check_stage_split()
        if self.recompute_layers is not None and self.recompute_layers > max(self.stage_split):
            self._fail(f"recompute_layers {self.recompute_layers} is more than the {max(self.stage_split)} layers "
                       f"of the largest stage")
        for key, size in m.tp_sharded_sizes().items():
            if size % self.tp:
                self._fail(f"tp {self.tp} does not divide {key} {size} of model {m.name}")
        if isinstance(m, TransformerModel) and m.num_kv_heads % self.tp and self.tp % m.num_kv_heads:
            self._fail(f"tp {self.tp} and num_kv_heads {m.num_kv_heads} of model {m.name}: one must divide "
                       f"the other (kv heads are split across ranks, or each replicated on tp/kv ranks)")
        if self.num_microbatches < SCHEDULE_KINDS[self.schedule].min_microbatches(self.pp, self.virtual_stages):
            self._fail(f"{self.schedule} needs num_microbatches >= its {self.num_stages} stages, got "
                       f"{self.num_microbatches}")
        if self.schedule == "interleaved-1f1b" and (why := uneven_rounds(self.pp, self.num_microbatches)):
            self._fail(f"interleaved-1f1b {why}")
        if gpus is not None and gpus != self.world:
            self._fail(f"{self.degrees_text()} = {self.world} ranks, but {gpus} GPUs were given")

    def _check_experts(self) -> None:
        m = self.model
        moe = m.is_moe
        if self.dispatcher not in DISPATCHERS:
            self._fail(f"dispatcher {self.dispatcher!r} is not one of {', '.join(DISPATCHERS)}")
        if self.ep > 1 and not moe:
            self._fail(f"ep {self.ep}: expert parallelism needs a mixture-of-experts model, and {m.name} is dense")
        if not moe:
            if self.expert_load != 1 or self.capacity_factor is not None:
                self._fail(f"expert_load and capacity_factor describe expert routing; {m.name} is a dense model")
            expert_only = " and ".join(k for k, on in (("ep_comm_overlap", self.ep_comm_overlap),
                                                        ("dispatch_fp8", self.dispatch_fp8),
                                                        ("dispatcher deepep", self.dispatcher == "deepep")) if on)
            if expert_only:
                self._fail(f"{m.name} is a dense model: it has no expert all-to-alls for {expert_only}")
            return
        if self.dispatcher == "deepep" and self.ep == 1:
            self._fail("dispatcher deepep runs the expert all-to-alls, and with ep 1 there are none "
                       "(--dispatcher alltoall turns it off)")
        if self.dispatch_fp8 and self.dtype != "fp8":
            self._fail(f"dispatch_fp8 sends the tokens its fp8 GEMMs read in fp8, as DeepSeek-V3 does: it needs "
                       f"dtype fp8 (this plan: {self.dtype}; --no-dispatch-fp8 turns it off)")
        if self.ep_comm_overlap and self.ep == 1:
            self._fail("ep_comm_overlap hides the expert all-to-alls behind compute, and with ep 1 there are none")
        if self.ep_comm_overlap and not (self.schedule in PAIRED_SCHEDULES or self.pp == 1):
            self._fail(f"ep_comm_overlap pairs a forward with another microbatch's backward as DualPipe-V does "
                       f"(schedule dualpipe-v), or as Megatron-LM's combined 1F1B does, under a pipeline only "
                       f"interleaved (interleaved-1f1b, or pp 1); {self.schedule} with pp {self.pp} is not modelled "
                       f"(--no-ep-comm-overlap turns it off)")
        if self.ep_comm_overlap and self.activation_recompute == "full":
            self._fail("ep_comm_overlap with full recomputation: Megatron-LM refuses it (overlap_moe_expert_"
                       "parallel_comm needs recompute_granularity other than full); use selective recompute")
        if self.tp > 1 and not self.sequence_parallel:
            self._fail(f"tp {self.tp} with mixture-of-experts layers needs sequence_parallel: true: Megatron-LM's "
                       f"MoELayer refuses to train with tensor parallelism without it (its token dispatcher "
                       f"routes each rank's part of the sequence; add --sequence-parallel)")
        if (self.dp * self.cp) % self.ep:
            self._fail(f"ep {self.ep} must divide the {self.dp * self.cp} data-parallel ranks (dp x cp) it folds into")
        if m.num_experts % self.ep:
            self._fail(f"ep {self.ep} does not divide the {m.num_experts} experts of model {m.name}")
        if why := expert_load_problem(m, self.expert_load):
            self._fail(f"expert_load {why}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            self._fail(f"capacity_factor {self.capacity_factor:g} must be positive")
        if self.shard_group is not None and self.shard_group % self.ep:
            self._fail(f"shard_group {self.shard_group} is not a multiple of ep {self.ep}: HSDP shards experts "
                       f"within each shard group over its ranks that hold the same experts (torchtitan's "
                       f"dp_shard_mod_ep), so each shard group must hold whole expert-parallel groups")

    def _check_stage_split(self) -> None:
        layers, stages = self.model.num_layers, self.pp * self.virtual_stages
        split = self.layers_per_stage
        if stages > layers:
            self._fail(f"{stages} pipeline stages (pp {self.pp} x virtual_stages {self.virtual_stages}) "
                       f"for {layers} layers: every stage needs at least one layer")
        if split is None or split == "balanced":
            return
        if isinstance(split, str) or not all(isinstance(n, int) and not isinstance(n, bool) for n in split):
            self._fail(f"layers_per_stage is {split!r}; expected 'balanced' or a list of whole numbers")
        if len(split) != stages:
            self._fail(f"layers_per_stage lists {len(split)} stages, but pp {self.pp} x virtual_stages "
                       f"{self.virtual_stages} = {stages}")
        # A transformer's first stage may hold only the embedding and its last only the head (and any multi-token
        # prediction modules), as Megatron-LM's pipeline layouts allow ("Et|(tt|)*30mL" for DeepSeek-V3)
        ends = 0 if isinstance(self.model, TransformerModel) else 1
        if sum(split) != layers:
            self._fail(f"layers_per_stage {list(split)} adds up to {sum(split)} layers, not the model's {layers}")
        empty = [s for s, n in enumerate(split) if n < (ends if s in (0, stages - 1) else 1)]
        if empty:
            whom = "every stage but a transformer's first and last" if ends == 0 else "every stage"
            self._fail(f"layers_per_stage {list(split)} leaves stage{'s' if len(empty) > 1 else ''} "
                       f"{', '.join(map(str, empty))} without a layer: {whom} needs at least one")

    # -- sizes ----------------------------------------------------------------
    @property
    def shard_size(self) -> int:
        """Ranks that share one copy of the sharded state (ZeRO): the data-parallel group (context-
        parallel ranks included, as Megatron-LM's), or the HSDP shard group; 1 without ZeRO."""
        if not self.zero:
            return 1
        return self.shard_group or self.dp * self.cp

    @property
    def expert_shard_size(self) -> int:
        """Ranks sharing one copy of an expert's ZeRO-sharded state: the ranks of a shard group that hold
        the same experts (``shard_size / ep``; without HSDP the expert-data-parallel group, dp x cp / ep
        ranks); 1 without ZeRO."""
        return self.shard_size // self.ep if self.zero else 1

    @property
    def replicas(self) -> int:
        """HSDP's copies of each shard: ``dp x cp / shard_group`` (1 without HSDP)."""
        return self.dp * self.cp // self.shard_size if self.zero else 1

    @property
    def experts_per_rank(self) -> int:
        """Routed experts of each MoE layer one rank holds: ``num_experts / ep`` (0 for a dense model)."""
        return getattr(self.model, "num_experts", 0) // self.ep

    @property
    def expert_tokens_factor(self) -> float:
        """The busiest expert's tokens over the mean: ``expert_load``, capped by the capacity factor
        (tokens beyond an expert's capacity are dropped)."""
        if self.capacity_factor is None:
            return self.expert_load
        return min(self.expert_load, self.capacity_factor)

    @property
    def other_experts_factor(self) -> float:
        """Tokens of each other expert on the busiest expert's rank over the mean: taken as the mean's, capped by
        the capacity factor (which routing fills them is not known)."""
        return 1.0 if self.capacity_factor is None else min(1.0, self.capacity_factor)

    @property
    def rank_tokens_factor(self) -> float:
        """The routed rows the busiest expert's rank receives, keeps and sends back, over the mean rank's: its
        busiest expert at :attr:`expert_tokens_factor`, its other experts at :attr:`other_experts_factor`."""
        held = self.experts_per_rank or 1
        return (self.expert_tokens_factor + (held - 1) * self.other_experts_factor) / held

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def degrees_text(self) -> str:
        """``dp 16 x pp 8 x tp 8`` (cp only where it is used)."""
        return " x ".join(f"{d} {self.degree(d)}" for d in ("dp", "pp", "cp", "tp") if d != "cp" or self.cp > 1)

    def summary_text(self) -> str:
        """The plan as report headers name it: degrees, the schedule where there is a pipeline (a one-stage plan
        runs its microbatches in turn, under no schedule), batch, dtype and :meth:`features`: ``dp 16 x pp 8 x
        tp 8, 1f1b, 16 microbatches of 1, bf16, ZeRO-1 over 16 ranks, ...``."""
        schedule = f"{self.schedule}, " if self.pp > 1 else ""
        batches = "microbatch" if self.num_microbatches == 1 else "microbatches"
        return (f"{self.degrees_text()}, {schedule}{self.num_microbatches} {batches} of {self.microbatch_size}, "
                f"{self.dtype}" + "".join(f", {f}" for f in self.features()))

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def shards_weights(self) -> bool:
        """FSDP (ZeRO-3 over more than one rank): weights sharded, gathered per layer."""
        return self.zero == 3 and self.shard_size > 1

    @property
    def main_grads(self) -> bool:
        """:func:`keeps_main_grads`: a gradient buffer in the reduce dtype and fp32 master weights."""
        return keeps_main_grads(self.dtype_bytes, self.shards_weights)

    @property
    def scales_loss(self) -> bool:
        """fp16 training scales the loss up so small gradients survive fp16, and unscales the gradients before
        the step, skipping it when they overflowed: Megatron-LM's ``DynamicGradScaler`` under ``--fp16``,
        ``torch.amp.GradScaler`` (bf16 and fp8 plans keep bf16's range and scale nothing)."""
        return self.dtype == "fp16"

    @property
    def master_weights(self) -> tuple[int, int] | None:
        """:func:`master_weights` for this plan."""
        return master_weights(self.dtype_bytes, self.grad_bytes, self.main_grads)

    @property
    def accumulation_bytes(self) -> float:
        """Bytes per weight each microbatch streams adding its gradient into the sum, on average."""
        return accumulation_bytes(self.dtype_bytes, self.grad_bytes, self.main_grads, self.num_microbatches)

    @property
    def accumulation(self) -> Accumulation:
        """Bytes and unvectorized elements per weight each microbatch's gradient adds into the sum."""
        return accumulation(self.dtype_bytes, self.grad_bytes, self.main_grads, self.num_microbatches)

    @property
    def moment_bytes(self) -> int:
        """Bytes of each of AdamW's two moments per parameter (``adam_moments``)."""
        return ADAM_MOMENTS[self.adam_moments]

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element as data parallelism reduces and keeps it (``reduce_dtype``)."""
        return DTYPE_BYTES[self.reduce_dtype]

    @property
    def tokens_per_microbatch(self) -> int:
        """Tokens of one microbatch, every context-parallel rank's share together."""
        return self.microbatch_size * self.model.tokens_per_sample

    @property
    def tokens_per_rank(self) -> int:
        """Tokens of one microbatch that one GPU computes: its 1/cp of each sequence."""
        return self.tokens_per_microbatch // self.cp

    @property
    def attention_seq(self) -> int:
        """:func:`attention_seq` for this plan."""
        return attention_seq(self.model, self.cp)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.model.tokens_per_sample

    # -- placement ------------------------------------------------------------
    def degree(self, dim: str) -> int:
        """The size of ``"dp"``, ``"pp"``, ``"cp"`` or ``"tp"``."""
        if dim not in DIMS:
            raise ParsimError(f"unknown parallel dimension {dim!r} (expected one of {', '.join(DIMS)})")
        return getattr(self, dim)

    @cached_property
    def rank_grid(self) -> np.ndarray:
        """Ranks indexed ``[dp, pp, cp, tp]``: :func:`rank_grid` of this plan."""
        return rank_grid(self.order, {d: self.degree(d) for d in DIMS})

    def rank_of(self, dp: int = 0, pp: int = 0, tp: int = 0, cp: int = 0) -> int:
        coords = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
        for dim in DIMS:
            if not 0 <= coords[dim] < self.degree(dim):
                raise ParsimError(f"{dim} index {coords[dim]} is outside 0..{self.degree(dim) - 1}")
        return int(self.rank_grid[tuple(coords[d] for d in DIMS)])

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world:
            raise ParsimError(f"rank {rank} is outside 0..{self.world - 1}")
        return RankCoords(*(int(i[0]) for i in np.nonzero(self.rank_grid == rank)))

    def groups(self, dim: str) -> list[list[int]]:
        """Every group of ranks that differ only in ``dim``, in rank order of their first member."""
        size = self.degree(dim)
        return np.moveaxis(self.rank_grid, DIMS.index(dim), -1).reshape(-1, size).tolist()

    def group_of(self, rank: int, dim: str) -> list[int]:
        """The ``dim`` group that ``rank`` belongs to."""
        c = self.coords(rank)._asdict()
        index = [slice(None) if d == dim else c[d] for d in DIMS]
        return self.rank_grid[tuple(index)].tolist()

    # -- pipeline stages ------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @cached_property
    def stage_split(self) -> tuple[int, ...]:
        """Layers per (virtual) stage, in stage order."""
        layers, stages = self.model.num_layers, self.num_stages
        if isinstance(self.layers_per_stage, tuple):
            return self.layers_per_stage
        even = even_split(layers, stages)
        if even is not None and self.layers_per_stage != "balanced":
            return even
        embedding, costs, head = self._costs
        per_layer = costs[0].training_flops_per_token()
        last = sum(c.training_flops_per_token() for c in ([head] if head else []) + self._mtp_costs)
        return balanced_split(per_layer, layers, stages,
                              embedding.training_flops_per_token() if embedding else 0.0, last,
                              empty_ends=isinstance(self.model, TransformerModel))

    def stage_layers(self, stage: int) -> range:
        """The layer indices of (virtual) stage ``stage``: a contiguous run of :attr:`stage_split`."""
        if not 0 <= stage < self.num_stages:
            raise ParsimError(f"stage {stage} is outside 0..{self.num_stages - 1}")
        first = sum(self.stage_split[:stage])
        return range(first, first + self.stage_split[stage])

    @cached_property
    def pipeline(self) -> Schedule:
        """The schedule's per-rank action lists (built once; the lowering, memory and executor share it)."""
        if self.ep_comm_overlap:
            return paired_schedule(self.schedule, self.pp, self.num_microbatches, self.virtual_stages)
        return make_schedule(self.schedule, self.pp, self.num_microbatches, self.virtual_stages)

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank ``pp_rank`` runs: ``pp_rank``, ``pp_rank + pp``, ... (looped), or
        ``pp_rank`` and ``2·pp - 1 - pp_rank`` (V schedules), as the schedule places them."""
        if not 0 <= pp_rank < self.pp:
            raise ParsimError(f"pp index {pp_rank} is outside 0..{self.pp - 1}")
        return self.pipeline.stages_of(pp_rank)

    @cached_property
    def _costs(self) -> tuple[LayerCost | None, list[LayerCost], LayerCost | None]:
        m, d, sp = self.model, self.dtype_bytes, self.sequence_parallel
        kept: dict[int, tuple[Activation, ...]] = {}  # by the saved tuple's identity: the layers share a few
        layers = []
        for c in m.layer_costs(d, self.tp_style, sp):
            saved = kept.get(id(c.activations))
            if saved is None:
                saved = kept[id(c.activations)] = self._kept(c.activations)
            layers.append(c if saved == c.activations else dataclasses.replace(c, activations=saved))
        return (m.embedding_cost(d, self.tp_style, sp), layers,
                m.head_cost(d, self.tp_style, sp, copies_table=self.copies_embedding_table))

    @cached_property
    def _mtp_costs(self) -> list[LayerCost]:
        """The multi-token prediction modules the last stage runs after the head (none for most models)."""
        m = self.model
        if not getattr(m, "mtp_layers", 0):
            return []
        costs = m.mtp_costs(self.dtype_bytes, self.tp_style, self.sequence_parallel,
                            copies_table=self.copies_embedding_table)
        return [dataclasses.replace(c, activations=self._kept(c.activations)) for c in costs]

    def _kept(self, saved: tuple[Activation, ...]) -> tuple[Activation, ...]:
        """What a layer keeps of the tensors it saves: none that selective recompute's modules rebuild, and in an
        fp8 plan each linear's input as its fp8 copy (beside the bf16 tensor where another op keeps that too).
        The routed experts' rows scale with the busiest expert's rank's load (:attr:`rank_tokens_factor`): it
        keeps that many more, as it computes them (``parsim.lowering.kernels``)."""
        modules = self.recompute_modules or ()
        load = self.rank_tokens_factor
        kept = []
        for a in saved:
            if a.recompute in modules:
                continue
            if load != 1 and a.name.startswith(ROUTED_ACTIVATIONS):
                a = dataclasses.replace(a, width=round(a.width * load))
            if self.dtype == "fp8" and a.linear == LINEAR_ONLY:
                a = dataclasses.replace(a, element_bytes=FP8_SAVED_BYTES)
            kept.append(a)
            if self.dtype == "fp8" and a.linear == LINEAR_ALSO:
                kept.append(dataclasses.replace(a, name=f"{a.name}.fp8", element_bytes=FP8_SAVED_BYTES))
        return tuple(kept)

    def _recompute_dict(self) -> str | dict:
        """``activation_recompute`` as a plan file writes it."""
        if self.recompute_layers:
            return {"granularity": self.activation_recompute, "layers": self.recompute_layers}
        if self.recompute_modules and self.recompute_modules != DEFAULT_RECOMPUTE_MODULES:
            return {"granularity": self.activation_recompute, "modules": list(self.recompute_modules)}
        return self.activation_recompute

    @property
    def copies_embedding_table(self) -> bool:
        """:func:`copies_embedding_table` for this plan."""
        return copies_embedding_table(self.model, self.pp, self.schedule)

    def stage_costs(self, stage: int) -> list[LayerCost]:
        """What ``stage`` computes, in order: the embedding (first stage), its layers, the head and any
        multi-token prediction modules (last)."""
        embedding, layers, head = self._costs
        costs = [layers[i] for i in self.stage_layers(stage)]
        if stage == 0 and embedding is not None:
            costs.insert(0, embedding)
        if stage == self.num_stages - 1:
            costs += ([head] if head is not None else []) + self._mtp_costs
        return costs

    def recomputed(self, stage: int) -> list[LayerCost]:
        """The layers of ``stage`` whose forward is recomputed in the backward (full recomputation:
        the first ``recompute_layers`` of the stage, all when unset, as Megatron-LM's block method)."""
        if self.activation_recompute != "full":
            return []
        layers = [c for c in self.stage_costs(stage) if c.recomputable]
        return layers if self.recompute_layers is None else layers[:self.recompute_layers]

    def params_per_rank(self, pp_rank: int) -> int:
        """Parameters one GPU of pipeline rank ``pp_rank`` holds (its tensor-parallel shard, its experts)."""
        return sum(c.params_per_rank(self.tp, self.ep) for s in self.stages_of(pp_rank) for c in self.stage_costs(s))

    def expert_params_per_rank(self, pp_rank: int) -> int:
        """The routed experts' part of :meth:`params_per_rank`."""
        return sum(c.expert_params_per_rank(self.tp, self.ep) for s in self.stages_of(pp_rank)
                   for c in self.stage_costs(s))

    # -- output ---------------------------------------------------------------
    def features(self) -> list[str]:
        """What this plan does beyond plain DP x TP x PP, in words (for report headers)."""
        out = []
        if self.zero and self.shard_size > 1:
            scope = f"HSDP: shards over {self.shard_group}, replicated {self.replicas}x" \
                if self.replicas > 1 else f"over {self.shard_size} ranks"
            out.append(f"{'FSDP (ZeRO-3)' if self.zero == 3 else f'ZeRO-{self.zero}'} {scope}"
                       + (", weights gathered in the next forward" if self.overlap_param_gather else ""))
        if self.sequence_parallel and self.tp > 1:
            out.append("sequence parallel" + (", its collectives beside the GEMMs" if self.tp_comm_overlap else ""))
        if self.cp > 1:
            out.append(f"{'ring' if self.context_parallel == 'ring' else 'all-gather'} context parallel")
        if self.ep > 1:
            out.append(f"ep {self.ep}" + (f", busiest expert {self.expert_tokens_factor:g}x the mean"
                                          if self.expert_tokens_factor != 1 else "")
                       + (", all-to-alls beside the paired pass's compute" if self.ep_comm_overlap else "")
                       + (", dispatched in fp8" if self.dispatch_fp8 else "")
                       + (", by DeepEP" if self.dispatcher == "deepep" else ""))
        if self.activation_recompute != "none":
            layers = f", first {self.recompute_layers} layers per stage" if self.recompute_layers else ""
            modules = (f" ({', '.join(self.recompute_modules)})"
                       if self.recompute_modules and self.recompute_modules != DEFAULT_RECOMPUTE_MODULES else "")
            out.append(f"{self.activation_recompute} recompute{layers}{modules}")
        if self.reduce_dtype != self.dtype and self.dp * self.cp > 1:
            out.append(f"gradients reduced in {self.reduce_dtype}")
        if self.grad_accumulation == "fused":
            out.append("weight gradients accumulated by their matmuls")
        if self.adamw == "fused":
            out.append("fused AdamW" + (f", {self.adam_moments} moments" if self.adam_moments != "fp32" else ""))
        if self.grad_clip is not None:
            out.append(f"gradients clipped to norm {self.grad_clip:g}")
        if self.num_stages > 1 and len(set(self.stage_split)) > 1:
            out.append("layers per stage " + runs_text(self.stage_split))
        return out

    def to_dict(self) -> dict[str, Any]:
        """The plan as a mapping :func:`load_plan` reads back (the model inline)."""
        data_parallel: dict[str, Any] = {"grad_sync": self.grad_sync, "overlap": self.overlap, "zero": self.zero}
        if self.shard_group is not None:
            data_parallel["shard_group"] = self.shard_group
        if self.reshard_after_forward != (self.pp == 1):
            data_parallel["reshard_after_forward"] = self.reshard_after_forward
        if self.overlap_param_gather:
            data_parallel["overlap_param_gather"] = True
        if self.grad_sync == "bucketed":
            data_parallel["bucket_size"] = self.bucket_size
        if self.reduce_dtype != default_reduce_dtype(self.dtype):
            data_parallel["reduce_dtype"] = self.reduce_dtype
        data = {
            "name": self.name,
            "model": self.model.to_dict(),
            "parallel": {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep,
                         "order": self.order},
            "batch": {"microbatch_size": self.microbatch_size, "num_microbatches": self.num_microbatches,
                      "global_batch_size": self.global_batch_size},
            "schedule": self.schedule,
            "virtual_stages": self.virtual_stages,
            "dtype": self.dtype,
            "tensor_parallel": self.tp_style,
            "context_parallel": self.context_parallel,
            "sequence_parallel": self.sequence_parallel,
            "tp_comm_overlap": self.tp_comm_overlap,
            "tp_async_backward": self.tp_async_backward,
            "grad_accumulation": self.grad_accumulation,
            "adamw": self.adamw,
            "adam_moments": self.adam_moments,
            "activation_recompute": self._recompute_dict(),
            "data_parallel": data_parallel,
        }
        if isinstance(self.model, TransformerModel) and self.model.is_moe:
            data["moe"] = {"expert_load": self.expert_load, "ep_comm_overlap": self.ep_comm_overlap,
                           "dispatch_fp8": self.dispatch_fp8, "dispatcher": self.dispatcher}
            if self.capacity_factor is not None:
                data["moe"]["capacity_factor"] = self.capacity_factor
        if self.grad_clip is not None:
            data["grad_clip"] = self.grad_clip
        if self.layers_per_stage is not None:
            split = self.layers_per_stage
            data["layers_per_stage"] = split if isinstance(split, str) else list(split)
        if self.description:
            data["description"] = self.description
        if self.cluster:
            data["cluster"] = self.cluster
        return data


# --------------------------------------------------------------------------- loading
_TOP_KEYS = ("name", "description", "cluster", "model", "parallel", "batch", "schedule", "virtual_stages",
             "layers_per_stage", "dtype", "tensor_parallel", "sequence_parallel", "tp_comm_overlap",
             "tp_async_backward", "context_parallel", "activation_recompute", "data_parallel", "grad_accumulation",
             "adamw", "adam_moments", "grad_clip", "moe")
_RECOMPUTE_KEYS = ("granularity", "layers", "modules")
_PARALLEL_KEYS = ("dp", "tp", "pp", "cp", "ep", "order")
_MOE_KEYS = ("capacity_factor", "expert_load", "ep_comm_overlap", "dispatch_fp8", "dispatcher")
_BATCH_KEYS = ("microbatch_size", "num_microbatches", "global_batch_size")
_DATA_PARALLEL_KEYS = ("grad_sync", "bucket_size", "overlap", "zero", "shard_group", "reshard_after_forward",
                       "overlap_param_gather", "reduce_dtype")


def builtin_plans() -> dict[str, Path]:
    """Example plan names and their files (``parsim/presets/plans/*.yaml``)."""
    folder = importlib.resources.files("parsim").joinpath("presets", "plans")
    return {Path(p.name).stem: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".yaml")}


def resolve_plan(name_or_path: str | Path, *, gpus: int | None = None,
                 overrides: Mapping[str, Any] | None = None) -> Plan:
    """A plan from an example name (``course-ddp``) or a YAML path; see :func:`load_plan`."""
    text = str(name_or_path)
    presets = builtin_plans()
    if text in presets:
        return load_plan(presets[text], gpus=gpus, overrides=overrides)
    if Path(text).is_dir():
        raise ParsimError(f"plan {text!r} is a folder: give a plan file in it, or an example "
                          f"({', '.join(sorted(presets))})")
    if not Path(text).is_file():
        raise ParsimError(f"unknown plan {text!r}: not an example ({', '.join(sorted(presets))}) and no such file")
    return load_plan(Path(text), gpus=gpus, overrides=overrides)


def load_plan(source: str | Path | Mapping[str, Any], *, gpus: int | None = None,
              overrides: Mapping[str, Any] | None = None) -> Plan:
    """A plan from a YAML file or a mapping of the same shape.

    ``overrides`` (same shape, e.g. ``{"parallel": {"tp": 4}}``) replace the
    file's values key by key, as command-line flags do. With ``gpus`` the plan
    must use exactly that many GPUs.
    """
    if isinstance(source, Mapping):
        data, label, base_dir, name = source, "<plan>", None, str(source.get("name", "plan"))
    else:
        path = Path(source)
        if not path.is_file():
            raise ParsimError(f"no plan file {str(path)!r}")
        data, label, base_dir, name = read_yaml(path), str(path), path.parent, path.stem
    if overrides:
        if not isinstance(data, Mapping):
            raise ConfigError(label, "(file)", f"is {type(data).__name__}", "a mapping of keys")
        data, label = _merge(data, overrides), f"{label} (with command-line overrides)"
        sync, given = data.get("data_parallel"), overrides.get("data_parallel")
        if isinstance(sync, Mapping) and isinstance(given, Mapping) and "bucket_size" not in given and \
                given.get("grad_sync", "bucketed") != "bucketed":  # the file's buckets went with the sync replaced
            data["data_parallel"] = {k: v for k, v in sync.items() if k != "bucket_size"}
        if "schedule" in overrides and "virtual_stages" not in overrides:  # the file's count went with its schedule
            data.pop("virtual_stages", None)
    plan = parse_plan(data, label, base_dir, default_name=name)
    if gpus is not None:
        plan.validate(gpus)
    return plan


def parse_plan(data: object, source: str = "<plan>", base_dir: Path | None = None,
               default_name: str = "plan") -> Plan:
    """Check a plan mapping key by key and build the :class:`Plan`."""
    top = ConfigReader(data, source, _TOP_KEYS)
    if not top.has("model"):
        raise ConfigError(source, "model", "missing", "a preset name, a path to a model YAML, or a mapping")
    spec = top.data["model"]
    if not isinstance(spec, (str, Mapping)):
        raise ConfigError(source, "model", f"is {spec!r}", "a preset name, a path to a model YAML, or a mapping")
    model = load_model(spec, base_dir, source=f"{source}: model")
    parallel = top.section("parallel", _PARALLEL_KEYS)
    batch = top.section("batch", _BATCH_KEYS)
    sync = top.section("data_parallel", _DATA_PARALLEL_KEYS)
    grad_sync = sync.text("grad_sync", "bucketed")
    recompute = _recompute(top)
    moe = top.section("moe", _MOE_KEYS)
    if sync.has("bucket_size") and grad_sync != "bucketed":
        raise ConfigError(source, "data_parallel.bucket_size", f"is set with grad_sync {grad_sync}",
                          "bucket_size only with grad_sync: bucketed (fsdp syncs per layer)")
    return Plan(
        model=model,
        dp=parallel.integer("dp", 1), tp=parallel.integer("tp", 1), pp=parallel.integer("pp", 1),
        cp=parallel.integer("cp", 1), context_parallel=top.text("context_parallel", "ring"),
        ep=parallel.integer("ep", 1), capacity_factor=moe.number("capacity_factor"),
        expert_load=moe.number("expert_load", 1.0), ep_comm_overlap=moe.boolean("ep_comm_overlap", False),
        dispatch_fp8=moe.boolean("dispatch_fp8", False), dispatcher=moe.text("dispatcher", "alltoall"),
        order=parallel.text("order", DEFAULT_ORDER),
        microbatch_size=batch.integer("microbatch_size"), num_microbatches=batch.integer("num_microbatches"),
        global_batch_size=batch.integer("global_batch_size"),
        schedule=top.text("schedule", "1f1b"), virtual_stages=top.integer("virtual_stages", None),
        layers_per_stage=_stage_split(top),
        sequence_parallel=top.boolean("sequence_parallel", False),
        tp_comm_overlap=top.boolean("tp_comm_overlap", False),
        tp_async_backward=top.boolean("tp_async_backward"),
        grad_accumulation=top.text("grad_accumulation", "autograd"), adamw=top.text("adamw", DEFAULT_ADAMW),
        adam_moments=top.text("adam_moments", "fp32"),
        grad_clip=top.number("grad_clip"),
        activation_recompute=recompute[0], recompute_layers=recompute[1], recompute_modules=recompute[2],
        dtype=top.text("dtype", model.dtype), tp_style=top.text("tensor_parallel"),
        grad_sync=grad_sync, bucket_size=sync.size("bucket_size", DEFAULT_BUCKET_SIZE),
        overlap=sync.boolean("overlap"), zero=sync.integer("zero"), shard_group=sync.integer("shard_group"),
        reshard_after_forward=sync.boolean("reshard_after_forward"),
        overlap_param_gather=sync.boolean("overlap_param_gather", False),
        reduce_dtype=sync.text("reduce_dtype"),
        name=top.text("name", default_name), description=top.text("description", ""),
        cluster=top.text("cluster", ""),
    )


def _order(order: str) -> str:
    """An order of dp, pp and tp alone (written before context parallelism) gets cp just outside tp."""
    dims = order.split(",") if isinstance(order, str) else []
    if sorted(dims) == ["dp", "pp", "tp"]:
        dims.insert(dims.index("tp"), "cp")
        return ",".join(dims)
    return order


def runs_text(values: tuple[int, ...]) -> str:
    """``7/8x14/7`` for (7, 8, ..., 8, 7): repeats written once with their count."""
    parts, i = [], 0
    while i < len(values):
        j = i
        while j < len(values) and values[j] == values[i]:
            j += 1
        parts.append(f"{values[i]}x{j - i}" if j - i > 1 else str(values[i]))
        i = j
    return "/".join(parts)


def _recompute(top: ConfigReader) -> tuple[str, int | None, tuple[str, ...] | None]:
    """``activation_recompute: full``, ``{granularity: full, layers: 4}`` or
    ``{granularity: selective, modules: [layernorm, mla_up_proj, moe_act]}``."""
    value = top.data.get("activation_recompute", "none")
    if isinstance(value, str):
        return value, None, None
    section = top.section("activation_recompute", _RECOMPUTE_KEYS)
    modules = section.data.get("modules") if isinstance(section.data, Mapping) else None
    if modules is not None and (not isinstance(modules, list) or not all(isinstance(m, str) for m in modules)):
        raise ConfigError(top.source, "activation_recompute.modules", f"is {modules!r}",
                          f"a list of recompute modules ({', '.join(RECOMPUTE_MODULES)})")
    return (section.text("granularity", "full"), section.integer("layers"),
            tuple(modules) if modules is not None else None)


def _stage_split(top: ConfigReader) -> tuple[int, ...] | str | None:
    value = top.data.get("layers_per_stage")
    if value is None or value == "balanced":
        return value
    if isinstance(value, list) and all(isinstance(n, int) and not isinstance(n, bool) for n in value):
        return tuple(value)
    raise ConfigError(top.source, "layers_per_stage", f"is {value!r}",
                      "'balanced' or a list of layer counts, one per stage (e.g. [7, 8, 8, 7])")


def _merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` laid over it, nested mappings merged key by key."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged
