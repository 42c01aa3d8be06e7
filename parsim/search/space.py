"""The plans a search considers: every distinct plan the simulator accepts for a model, a GPU count and a batch.

A :class:`SearchSpace` names the fixed part (model, GPUs, global batch,
dtype); :func:`enumerate_space` walks the free part level by level, outermost
first, and counts what each level rejects and why:

1. **layouts** — ``dp x tp x pp x cp = GPUs`` (and ``ep`` for mixtures of
   experts): tensor parallelism must divide the heads, hidden and feed-forward
   sizes, context parallelism the sequence into ``2 cp`` chunks, the stages
   must not outnumber the layers, and ``dp`` must divide the global batch;
   ``degrees`` may restrict any of them to some values (``--tp 8 --pp 2,4``);
2. **pipelines** — microbatch size (every divisor of the replica's batch, the
   count following), schedule and virtual stages, under each schedule's rules
   (looped ones equal rounds of ``m // max(1, m // pp)`` microbatches, as
   torch runs them; DualPipe-V ``m >= 2 pp``); interleaved stages only where
   they split the layers evenly (Megatron-LM's rule), and zero-bubble with one
   stage per rank (as plans take it); where the stages split the layers evenly,
   also the split that balances them, the embedding's and the head's work
   counted (``layers_per_stage: balanced``, Megatron-LM's
   ``--account-for-embedding-in-pipeline-split`` and
   ``--account-for-loss-in-pipeline-split``), if it makes the slowest stage faster;
3. **variants** — placement (``dp,pp,cp,tp`` or ``pp,dp,cp,tp``), sequence
   parallelism (its collectives in line or overlapped with GEMMs), activation
   recomputation (none, of the cheap modules where the model has experts or
   latent attention, whole layers), the context-parallel exchange, gradient
   sync (DDP buckets, ZeRO-1/2, FSDP, and HSDP inside a node), and, for a
   mixture of experts on a schedule that pairs passes (:func:`pairs_passes`),
   its all-to-alls beside a paired pass's compute (Megatron-LM's combined
   1F1B, DualPipe-V's overlap; for more than one microbatch).

Variants that are the same plan under another name are generated once: with
one pipeline rank every schedule is 1F1B (GPipe only holds more activations),
sequence parallelism needs ``tp > 1``, the two placements coincide when
``dp`` or ``pp`` is 1, ZeRO needs more than one data-parallel rank, and
selective recomputation of a flash-attention core saves and costs nothing
(:class:`~parsim.workload.plan.Plan`). ``tests/test_search_space.py`` checks on small
spaces that every enumerated plan is one :func:`~parsim.workload.plan.parse_plan`
accepts and that the rejected ones are exactly those it refuses.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Iterator, NamedTuple

import numpy as np

from ..schedules import SCHEDULES as SCHEDULE_KINDS
from ..schedules import PAIRED_SCHEDULES, uneven_rounds
from ..workload.model import Model, TransformerModel
from ..workload.plan import DEFAULT_ADAMW, DEFAULT_BUCKET_SIZE, DEFAULT_ORDER, Plan, parse_plan, rank_grid

ORDERS = (DEFAULT_ORDER, "pp,dp,cp,tp")  # parsim's default, and Megatron-LM's (pp outermost, dp inside it)


class Setting(NamedTuple):
    """The degrees, batch split and schedule of a plan: what its pipeline timing depends on."""

    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    microbatch_size: int
    num_microbatches: int
    schedule: str
    virtual_stages: int
    balanced: bool = False  # the layers split to balance the stages' work, where the default splits them evenly

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


class Variant(NamedTuple):
    """The rest of a plan: placement, sequence parallelism, recomputation, K/V exchange, gradient sync,
    whether the sequence-parallel collectives hide behind GEMMs (``tp_comm_overlap``), and whether a
    mixture of experts' all-to-alls run beside the compute of a paired pass (``ep_comm_overlap``).
    ``recompute_layers``: with ``recompute`` "full", how many layers of each stage it reruns (the first ones,
    Megatron-LM's ``--recompute-method block``); None: all of them. The fast tier sets it where a plan fits
    only with some of its layers recomputed (:meth:`~parsim.search.fast.FastModel.prepare`)."""

    order: str
    sequence_parallel: bool
    recompute: str
    context_parallel: str
    grad_sync: str  # "bucketed" or "fsdp"
    zero: int
    shard_group: int | None
    tp_overlap: bool = False
    ep_overlap: bool = False
    recompute_layers: int | None = None

    @property
    def fsdp(self) -> bool:
        return self.grad_sync == "fsdp"

    @property
    def param_overlap(self) -> bool:
        """ZeRO-1/2 run as Megatron-LM's distributed optimizer in NVIDIA's recipes: the weights' all-gathers
        overlapped with the next step's forward (``overlap_param_gather``)."""
        return self.zero in (1, 2)

    def recompute_text(self) -> str:
        """``none``, ``full``, ``3 layers`` (the first three of each stage), ...: what the plan recomputes."""
        if self.recompute_layers is None:
            return self.recompute
        return f"{self.recompute_layers} layer{'s' if self.recompute_layers > 1 else ''}"

    def sync_text(self) -> str:
        """``ddp``, ``zero-1``, ``fsdp``, ``hsdp 8``: how gradients and training state are synced and sharded."""
        if self.fsdp:
            return f"hsdp {self.shard_group}" if self.shard_group else "fsdp"
        return f"zero-{self.zero}" if self.zero else "ddp"


class Candidate(NamedTuple):
    """One plan of the space (:meth:`plan` builds the real one)."""

    setting: Setting
    variant: Variant

    def label(self) -> str:
        """``dp 16 x pp 8 x tp 8`` (cp and ep only where used)."""
        s = self.setting
        parts = [f"dp {s.dp}", f"pp {s.pp}", *([f"cp {s.cp}"] if s.cp > 1 else []), f"tp {s.tp}"]
        return " x ".join(parts) + (f", ep {s.ep}" if s.ep > 1 else "") + (", stages balanced" if s.balanced else "")

    def schedule_text(self) -> str:
        s = self.setting
        text = f"{s.schedule} v{s.virtual_stages}" if s.schedule == "interleaved-1f1b" else s.schedule
        if not self.variant.ep_overlap:
            return text
        # Megatron-LM's name for (interleaved) 1F1B with the all-to-alls beside the paired pass
        return f"{text} + ep overlap" if s.schedule == "dualpipe-v" else f"combined {text}"

    def mapping(self, space: "SearchSpace", name: str = "plan") -> dict[str, Any]:
        """The plan as a plan file's mapping (what ``parsim simulate FILE`` reads)."""
        s, v = self
        data: dict[str, Any] = {
            "name": name,
            "model": space.model_spec,
            "parallel": {"dp": s.dp, "tp": s.tp, "pp": s.pp, "cp": s.cp, "ep": s.ep, "order": v.order},
            "batch": {"microbatch_size": s.microbatch_size, "num_microbatches": s.num_microbatches},
            "schedule": s.schedule,
            "virtual_stages": s.virtual_stages,
            **({"layers_per_stage": "balanced"} if s.balanced else {}),
            "dtype": space.dtype,
            "adamw": space.adamw,
            "sequence_parallel": v.sequence_parallel,
            "tp_comm_overlap": v.tp_overlap,
            "activation_recompute": plan_recompute(space.model, v.recompute, v.recompute_layers),
            "data_parallel": {"grad_sync": v.grad_sync, "zero": v.zero, "overlap_param_gather": v.param_overlap},
        }
        if space.reduce_dtype:
            data["data_parallel"]["reduce_dtype"] = space.reduce_dtype
        if space.grad_clip is not None:
            data["grad_clip"] = space.grad_clip
        moe: dict[str, Any] = {}
        if space.dispatcher_for(s.ep) != "alltoall":
            moe["dispatcher"] = space.dispatcher_for(s.ep)
        if space.dispatch_fp8_for(s.ep):
            moe["dispatch_fp8"] = True
        if v.ep_overlap:
            moe["ep_comm_overlap"] = True
        if space.expert_load != 1:
            moe["expert_load"] = space.expert_load
        if moe:
            data["moe"] = moe
        if s.cp > 1:
            data["context_parallel"] = v.context_parallel
        if v.grad_sync == "bucketed":
            data["data_parallel"]["bucket_size"] = space.bucket_size
        if v.shard_group:
            data["data_parallel"]["shard_group"] = v.shard_group
        return data

    def plan(self, space: "SearchSpace", name: str = "plan") -> Plan:
        """The :class:`~parsim.workload.plan.Plan` itself, through the same parser plan files go through."""
        return parse_plan(self.mapping(space, name), f"search plan {name}")


@dataclass(frozen=True)
class SearchSpace:
    """What is fixed: the model, the GPUs, the global batch (in samples) and the dtype."""

    model: Model
    gpus: int
    global_batch: int
    dtype: str = "bf16"
    gpus_per_node: int = 8
    bucket_size: int = DEFAULT_BUCKET_SIZE
    model_spec: Any = None  # how a plan file names the model (a preset name); None: the model inline
    degrees: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (dim, allowed values): only those (``--tp 8``)
    tp_overlap: bool = True  # whether the cluster can overlap TP collectives with GEMMs (ClusterSpec.overlaps_tp_comm)
    adamw: str = DEFAULT_ADAMW  # AdamW's implementation, the same for every plan
    reduce_dtype: str | None = None  # the gradients' dtype in every plan (None: the dtype's default)
    grad_clip: float | None = None  # every plan clips its gradients to this global norm (None: no clipping)
    dispatcher: str = "alltoall"  # how every plan with expert parallelism sends tokens to their experts
    dispatch_fp8: bool = False  # every plan with expert parallelism sends tokens to their experts in fp8
    expert_load: float = 1.0  # MoE: the busiest expert's tokens over the mean, in every plan

    def dispatcher_for(self, ep: int) -> str:
        """The dispatcher of a plan with expert parallelism ``ep`` (without it there is nothing to dispatch)."""
        return self.dispatcher if ep > 1 else "alltoall"

    def dispatch_fp8_for(self, ep: int) -> bool:
        """Whether a plan with expert parallelism ``ep`` dispatches in fp8 (without it there is nothing to send)."""
        return self.dispatch_fp8 and ep > 1

    def allows(self, dim: str, value: int) -> bool:
        """Whether ``dim`` (dp, tp, pp, cp or ep) may take ``value`` (``degrees`` restricts some)."""
        return all(value in values for name, values in self.degrees if name == dim)

    def __post_init__(self) -> None:
        if self.model_spec is None:
            object.__setattr__(self, "model_spec", self.model.to_dict())


@dataclass
class Rejections:
    """What each level of the space rejected, by reason (counts in that level's units)."""

    layouts: Counter = field(default_factory=Counter)
    pipelines: Counter = field(default_factory=Counter)
    layouts_valid: int = 0
    pipelines_valid: int = 0


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_reason(space: SearchSpace, dp: int, tp: int, pp: int, cp: int) -> str:
    """Why ``dp x tp x pp x cp`` cannot run this model and batch, or "" when it can."""
    m = space.model
    for key, size in m.tp_sharded_sizes().items():
        if size % tp:
            return f"tp does not divide {key}"
    if isinstance(m, TransformerModel) and m.num_kv_heads % tp and tp % m.num_kv_heads:
        return "tp and the kv heads do not divide one another"
    if cp > 1 and not isinstance(m, TransformerModel):
        return "cp splits a sequence, and an MLP has none"
    if cp > 1 and m.seq_len % (2 * cp):
        return "cp does not split the sequence into 2 cp chunks"
    if pp > m.num_layers:
        return "more pipeline stages than layers"
    if space.global_batch % dp:
        return "dp does not divide the global batch"
    return ""


def schedule_reason(schedule: str, pp: int, m: int, v: int, layers: int) -> str:
    """Why ``schedule`` with ``v`` stages per rank cannot run ``m`` microbatches on ``pp`` ranks, or ""."""
    kind = SCHEDULE_KINDS[schedule]
    if pp * v > layers:
        return "more stages than layers"
    if m < kind.min_microbatches(pp, v):
        return "fewer microbatches than stages (dualpipe-v)"
    if kind.needs_whole_rounds(v) and uneven_rounds(pp, m):
        return "looped stages need equal rounds of microbatches (max(1, m // pp) of them, as torch runs them)"
    return ""


def schedule_options(pp: int, layers: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs worth trying on ``pp`` ranks (see the module docstring)."""
    if pp == 1:
        return [("1f1b", 1)]
    options = [("gpipe", 1), ("1f1b", 1), ("zero-bubble", 1), ("zb-h2", 1), ("zbv", 2), ("dualpipe-v", 2)]
    for v in range(2, layers // pp + 1):
        if layers % (pp * v) == 0:
            options.append(("interleaved-1f1b", v))
    return options


def sync_options(space: SearchSpace, dp: int, tp: int, cp: int, ep: int = 1) -> list[tuple[str, int, int | None]]:
    """(grad_sync, zero, shard_group) choices for ``dp x cp`` data-parallel ranks, ``ep`` of them splitting the
    experts (HSDP's shard group must hold whole expert-parallel groups, as torchtitan's dp_shard does)."""
    ranks = dp * cp
    if ranks == 1:
        return [("bucketed", 0, None)]
    options: list[tuple[str, int, int | None]] = [("bucketed", z, None) for z in (0, 1, 2)]
    options.append(("fsdp", 3, None))
    local = max(1, space.gpus_per_node // (tp * cp)) if tp * cp <= space.gpus_per_node else 1
    if 1 < local < ranks and ranks % local == 0 and local % ep == 0:
        options.append(("fsdp", 3, local))  # HSDP: shard inside a node, replicate across nodes
    return options


def recompute_options(model: Model) -> tuple[str, ...]:
    """``none``, ``selective`` (the attention core, where it is not FlashAttention, which recomputes it anyway),
    ``modules`` (:func:`cheap_modules`, for a mixture of experts or latent attention) and ``full``."""
    core = getattr(model, "attention_kernel", "flash")
    options = ("none", "full") if core == "flash" else ("none", "selective", "full")
    return options[:-1] + ("modules",) + options[-1:] if cheap_modules(model) else options


def cheap_modules(model: Model) -> tuple[str, ...] | None:
    """What the ``modules`` option recomputes: those of Megatron-LM's ``--recompute-modules`` that are cheap to
    rerun and hold much memory, as DeepSeek-V3 recomputes them (report, section 3.2.3): the norms, latent
    attention's up-projections and the experts' activation; None where the model has neither of the last two
    (with the norms alone, little to save)."""
    moe, mla = getattr(model, "is_moe", False), getattr(model, "attention", "") == "mla"
    cheap = ("mla_up_proj",) * mla + ("moe_act",) * moe
    return ("layernorm",) + cheap if cheap else None


def recompute_setting(model: Model, recompute: str) -> tuple[str, tuple[str, ...] | None]:
    """A search's recompute option as a plan's ``activation_recompute`` and ``recompute_modules``."""
    return ("selective", cheap_modules(model)) if recompute == "modules" else (recompute, None)


def plan_recompute(model: Model, recompute: str, layers: int | None = None) -> str | dict[str, Any]:
    """A search's recompute option (and how many layers of each stage it reruns) as a plan file writes it."""
    granularity, modules = recompute_setting(model, recompute)
    if layers is not None:
        return {"granularity": granularity, "layers": layers}
    return {"granularity": granularity, "modules": list(modules)} if modules else granularity


def enumerate_space(space: SearchSpace, rejections: Rejections | None = None) -> Iterator[Candidate]:
    """Every distinct plan of ``space`` (see :func:`enumerate_settings`)."""
    for setting, variants in enumerate_settings(space, rejections):
        for variant in variants:
            yield Candidate(setting, variant)


def enumerate_settings(space: SearchSpace, rejections: Rejections | None = None
                       ) -> Iterator[tuple[Setting, tuple[Variant, ...]]]:
    """Every valid setting of ``space`` with the variants that go with it, outermost level first;
    rejected combinations are counted in ``rejections``."""
    rej = rejections if rejections is not None else Rejections()
    m = space.model
    for tp in divisors(space.gpus):
        for cp in divisors(space.gpus // tp):
            for pp in divisors(space.gpus // (tp * cp)):
                dp = space.gpus // (tp * cp * pp)
                reason = _outside(space, dp=dp, tp=tp, pp=pp, cp=cp) or layout_reason(space, dp, tp, pp, cp)
                if reason:
                    rej.layouts[reason] += 1
                    continue
                for ep in _expert_options(m, dp * cp):
                    if not space.allows("ep", ep):
                        rej.layouts[_outside(space, ep=ep)] += 1
                        continue
                    variants = _variants(space, dp, tp, pp, cp, ep)
                    if not variants:  # DeepEP's dispatch over expert-parallel groups split unevenly across nodes
                        rej.layouts["ep group spread unevenly over nodes (DeepEP)"] += 1
                        continue
                    rej.layouts_valid += 1
                    unpaired = tuple(v for v in variants if not v.ep_overlap)
                    for setting in _settings(space, rej, dp, tp, pp, cp, ep):
                        yield setting, variants if pairs_passes(setting) else unpaired


def pairs_passes(s: Setting) -> bool:
    """Whether ``s``'s schedule can run a forward together with another microbatch's backward
    (``ep_comm_overlap``): Megatron-LM's combined 1F1B without a pipeline or interleaved, and DualPipe-V;
    one microbatch has nothing to pair."""
    return s.num_microbatches > 1 and (s.pp == 1 or s.schedule in PAIRED_SCHEDULES)


def _expert_group(dp: int, tp: int, pp: int, cp: int, ep: int, order: str) -> np.ndarray:
    """The first expert-parallel group's ranks under placement ``order`` (``ep`` consecutive data-parallel
    ranks, as :func:`parsim.lowering.lower.data_parallel_groups` takes them)."""
    return rank_grid(order, {"dp": dp, "pp": pp, "cp": cp, "tp": tp})[:, 0, :, 0].ravel()[:ep]


def _even_on_nodes(ranks: np.ndarray, gpus_per_node: int) -> bool:
    """Whether every node ``ranks`` touch holds as many of them."""
    counts = np.unique(ranks // gpus_per_node, return_counts=True)[1]
    return bool((counts == counts[0]).all())


def _outside(space: SearchSpace, **degrees: int) -> str:
    """Which restricted degree (``--tp 8``) a layout is outside of, or ""."""
    for dim, value in degrees.items():
        if not space.allows(dim, value):
            allowed = ",".join(map(str, dict(space.degrees)[dim]))
            return f"{dim} outside --{dim} {allowed}"
    return ""


def _expert_options(model: Model, data_ranks: int) -> list[int]:
    if not model.is_moe:
        return [1]
    return [e for e in divisors(data_ranks) if model.num_experts % e == 0]


def _settings(space: SearchSpace, rej: Rejections, dp: int, tp: int, pp: int, cp: int, ep: int
              ) -> Iterator[Setting]:
    layers = space.model.num_layers
    per_replica = space.global_batch // dp
    for mbs in divisors(per_replica):
        nmb = per_replica // mbs
        for schedule, v in schedule_options(pp, layers):
            reason = schedule_reason(schedule, pp, nmb, v, layers)
            if reason:
                rej.pipelines[reason] += 1
                continue
            rej.pipelines_valid += 1
            yield Setting(dp, tp, pp, cp, ep, mbs, nmb, schedule, v)
            if pp > 1 and balancing_helps(space.model, pp * v):
                yield Setting(dp, tp, pp, cp, ep, mbs, nmb, schedule, v, balanced=True)


@lru_cache(maxsize=None)
def balancing_helps(model: Model, stages: int) -> bool:
    """Whether ``stages`` stages split ``model``'s layers evenly, and a split balancing their work (the embedding's
    on the first, the head's on the last: :func:`~parsim.workload.stage_split.balanced_split`) makes the slowest
    stage's training work smaller."""
    if not isinstance(model, TransformerModel) or model.num_layers % stages:
        return False
    even, balanced = (Plan(model=model, pp=stages, microbatch_size=1, num_microbatches=stages, layers_per_stage=split)
                      for split in (None, "balanced"))
    return _slowest_stage(balanced) < _slowest_stage(even) * (1 - 1e-9)


def _slowest_stage(plan: Plan) -> float:
    """The training FLOPs per token of ``plan``'s busiest stage."""
    return max(sum(c.training_flops_per_token() for c in plan.stage_costs(s)) for s in range(plan.num_stages))


def _variants(space: SearchSpace, dp: int, tp: int, pp: int, cp: int, ep: int) -> tuple[Variant, ...]:
    transformer = isinstance(space.model, TransformerModel)
    orders = ORDERS if dp > 1 and pp > 1 else ORDERS[:1]
    if space.dispatcher_for(ep) == "deepep":  # its kernels pair each GPU with the GPU of its index on other nodes
        orders = tuple(o for o in orders if _even_on_nodes(_expert_group(dp, tp, pp, cp, ep, o), space.gpus_per_node))
    # (sequence parallel, tp_comm_overlap): the overlap hides the sequence-parallel collectives, over NVLink
    # inside a node (tp is the innermost dimension of every order searched)
    can_overlap = space.tp_overlap and space.gpus_per_node % tp == 0
    sps = ((False, False), (True, False)) + (((True, True),) if can_overlap else ()) if tp > 1 and transformer \
        else ((False, False),)
    if tp > 1 and transformer and space.model.is_moe:  # Megatron-LM trains MoE under tp only sequence-parallel
        sps = sps[1:]
    cp_styles = ("ring", "all_gather") if cp > 1 else ("ring",)
    variants = tuple(Variant(order, sp, recompute, cp_style, grad_sync, zero, shard, overlap)
                     for order in orders for sp, overlap in sps for recompute in recompute_options(space.model)
                     for cp_style in cp_styles for grad_sync, zero, shard in sync_options(space, dp, tp, cp, ep))
    # The expert all-to-alls beside a paired pass's compute (Megatron-LM's combined 1F1B, DualPipe-V), on the
    # schedules that pair passes (pairs_passes): the fast tier times those pairs (FastModel.pair_savings); not
    # with full recomputation (Megatron-LM refuses it) nor FSDP, whose gathers the pairs' timing leaves out
    if ep > 1:
        variants += tuple(v._replace(ep_overlap=True) for v in variants if v.recompute != "full" and not v.fsdp)
    return variants
