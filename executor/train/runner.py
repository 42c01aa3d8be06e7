"""Build one rank of a plan (groups, model shards, pipeline, gradient sync, AdamW) and time its steps.

Every rank builds the same seeded dense weights for the pieces it holds and
keeps its shards, so a distributed run starts exactly where the single-process
reference does. The rank grid and groups are the plan's own
(:meth:`parsim.workload.plan.Plan.groups`), so ranks sit where the simulator put them.

A step is the schedule's actions (without pipelining: stage 0 alone, the
local batch as ``num_microbatches`` rounds of gradient accumulation), then
the data-parallel gradient sync, then the optimizer. Each measured step
starts right after a barrier; its events are seconds from there.
"""

from __future__ import annotations

import platform
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from parsim.errors import ParsimError
from parsim.lowering.lower import data_parallel_groups
from parsim.lowering.tp_overlap import PIPELINE_SPLITS
from parsim.schedules import Schedule
from parsim.workload.model import MLPModel
from parsim.workload.plan import Plan, load_plan

from .._torch import require_distributed, require_torch
from ..gloo_threads import collective_group
from ..speed_probe import COLLECTIVE_PROBE_RANKS, CollectiveProbe, SpeedProbe, collective_probe_group, probes_on
from .clip import GradClipper
from .comm import EPGroup, TPGroup
from .context_parallel import CPGroup, apply_context_parallel, replica_loss, sequence_positions
from .fsdp import apply_fsdp, data_parallel_mesh, dense
from .held_gradients import held_gradients
from .loss_scale import DynamicLossScaler
from .mixed_precision import MasterWeightsAdamW, adamw, attach_main_grads, gradient
from .models import build_loss, build_pieces, make_batch
from .moe import MoEFeedForward, set_capacity
from .parallel import (apply_data_parallel, apply_expert_parallel, apply_tensor_parallel, routed_expert_parameters,
                       sequence_parallel_grad_sync, tie_embeddings)
from .pipeline import PipelineRuntime, Stage
from .recompute import apply_activation_recompute
from .trace_recorder import Recorder
from .zero import ZeroOptimizer, ZeroOptimizers, whole_experts

torch = require_torch()
dist = require_distributed()

LEARNING_RATE = 1e-3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class RankSetup:
    """Everything one rank needs to run steps of its share of the plan."""

    plan: Plan
    rank: int
    stages: dict[int, Stage]
    runtime: PipelineRuntime
    grad_sync: Any  # GradSync | None
    finalize: list[Callable[[], None]]  # gradient fix-ups after the data-parallel sync, in order
    optimizer: Any
    recorder: Recorder
    microbatches: tuple[list, list]  # (inputs, targets) per microbatch
    after_step: Callable[[], None] | None = None  # ZeRO-1/2: all-gather the updated weights
    cp: CPGroup | None = None
    clipper: GradClipper | None = None  # the plan's grad_clip
    scaler: DynamicLossScaler | None = None  # fp16's loss scaling
    grad_norm: float | None = None  # the global gradient norm the last clip found

    def parameters(self) -> list:
        seen: dict[int, Any] = {}
        for stage in self.stages.values():
            for p in stage.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def gradient(self, param, reference) -> tuple[Any, Any]:
        """This rank's gradient of ``param`` (the reduced part ZeRO-1/2 owns; FSDP's gathered) and the same
        part of ``reference``, the dense gradient of what ``param`` holds."""
        if isinstance(self.grad_sync, ZeroOptimizers):
            return self.grad_sync.owned_gradient(param, reference)
        return dense(gradient(param)), reference

    def forward_backward(self) -> float | None:
        """Run the schedule and synchronize gradients; the mean loss on last-stage ranks, else None."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.grad_sync is not None:
            self.grad_sync.start_step()
        loss = self.runtime.run(*self.microbatches)
        if self.grad_sync is not None:
            self.grad_sync.finish()
        for fix_up in self.finalize:
            fix_up()
        if self.cp is not None and loss is not None:
            loss = replica_loss(loss, self.cp)
        return loss

    def settle(self) -> None:
        """Bring every parameter up to date (ZeRO-1/2 overlapping the weights' gather leaves it to the next
        forward)."""
        if isinstance(self.grad_sync, ZeroOptimizers):
            self.grad_sync.settle()

    def check_gradients(self) -> bool:
        """After the sync, every rank together: unscale fp16's gradients, then take clipping's global norm
        (kept as ``grad_norm``); False when the gradients overflowed, and the step is to be skipped."""
        finite = self.scaler.unscale() if self.scaler is not None else True
        if finite and self.clipper is not None:
            self.grad_norm = self.clipper.norm()
        return finite

    def step(self) -> float | None:
        loss = self.forward_backward()
        finite = self.check_gradients()
        with self.recorder.span("optimizer step", "optimizer", "compute", phase="optimizer"):
            if finite:
                if self.clipper is not None:
                    self.clipper.scale()
                self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update(finite)
            self.runtime.loss_scale = self.scaler.scale
        if self.after_step is not None:
            self.after_step()
        return loss


def stage_piece_names(plan: Plan, stage: int) -> list[str]:
    """The pieces of ``stage``: the embedding (first stage), its layers, the head (last), as the simulator prices."""
    names = [f"layer.{i}" for i in plan.stage_layers(stage)]
    if isinstance(plan.model, MLPModel):
        return names
    return (["embedding"] if stage == 0 else []) + names + (["head"] if stage == plan.num_stages - 1 else [])


def check_plan(plan: Plan) -> None:
    """Refuse, in one line and before any rank starts, a plan the executor's modules cannot run."""
    m, schedule = plan.model, plan.pipeline
    sharded = plan.zero and plan.shard_size > 1
    tied = getattr(m, "tied_embeddings", False)
    tie_across = tied and schedule.stage_to_rank(0) != schedule.stage_to_rank(plan.num_stages - 1)
    missing = [what for what, used in (
        ("FSDP with a split-backward (zero-bubble) schedule", sharded and plan.zero == 3 and schedule.split_backward),
        ("tied embeddings under FSDP, or across pipeline ranks under ZeRO",
         sharded and tied and (plan.zero == 3 or tie_across)),
        ("tensor-parallel communication overlapped with GEMMs (tp_comm_overlap) with a split backward "
         "(its weight gradients are computed with the input gradient)",
         plan.tp_comm_overlap and schedule.split_backward),
        (f"tensor-parallel communication overlapped with GEMMs (tp_comm_overlap) unless each rank's share of "
         f"the sequence splits into {PIPELINE_SPLITS} equal parts",
         plan.tp_comm_overlap and (m.seq_len // (plan.cp * plan.tp)) % PIPELINE_SPLITS != 0),
        ("latent attention (MLA) with tensor parallelism but no sequence parallelism",
         m.attention == "mla" and plan.tp > 1 and not plan.sequence_parallel),
        ("weight-gradient matmuls that accumulate in place (grad_accumulation: fused)",
         plan.grad_accumulation == "fused"),
        ("selective recompute of norms, up-projections or activation functions (recompute modules beyond "
         "core_attn)", bool(set(plan.recompute_modules or ()) - {"core_attn"})),
        ("expert all-to-alls beside the compute of a paired pass (ep_comm_overlap)", plan.ep_comm_overlap),
        ("DeepEP's expert dispatch (dispatcher: deepep; the executor's all-to-all sends a copy per expert)",
         plan.dispatcher == "deepep"),
        ("multi-token prediction (the model's mtp_layers)", getattr(m, "mtp_layers", 0) > 0),
        (f"AdamW moments in {plan.adam_moments} (adam_moments; torch's AdamW keeps them in the weights' dtype)",
         plan.adam_moments != "fp32"),
        (f"{plan.dtype} compute", plan.dtype not in DTYPES)) if used]
    if missing:
        raise ParsimError(f"parsim run does not execute {', '.join(missing)} yet; `parsim simulate` predicts it "
                          f"(the executor runs DDP, ZeRO-1/2, FSDP and HSDP, tensor, pipeline, context and "
                          f"expert parallelism with uneven stages)")
    if isinstance(m, MLPModel):
        return  # the lecture's layers run under every plan parsim accepts
    if plan.activation_recompute == "full" and schedule.split_backward:
        raise ParsimError(f"full activation recomputation with the split backward of {schedule.name}: torch's "
                          f"checkpoint would re-run each layer's forward for every weight-gradient pass")
    if plan.sequence_parallel and plan.tp > 1 and m.position_embedding == "learned":
        raise ParsimError("sequence parallelism with learned positions: Megatron-LM all-reduces and then splits "
                          "those embeddings, which the executor does not do; use rope")
    if m.position_embedding == "rope" and m.head_dim % 2:
        raise ParsimError(f"model {m.name}: RoPE needs an even head_dim, got {m.head_dim}")
    if m.num_kv_heads % plan.tp:
        raise ParsimError(f"tp {plan.tp} > num_kv_heads {m.num_kv_heads} of model {m.name}: the executor splits "
                          f"key/value heads across ranks and does not replicate them")
    if (plan.tp - 1) * -(-m.vocab_size // plan.tp) >= m.vocab_size:
        raise ParsimError(f"vocab_size {m.vocab_size} is too small to split over tp {plan.tp}")
    last = plan.num_stages - 1
    if m.tied_embeddings and schedule.split_backward and schedule.stage_to_rank(0) == schedule.stage_to_rank(last):
        raise ParsimError("tied embeddings with a split backward (zero-bubble) need the embedding and the head "
                          "on different pipeline ranks")


def build_rank(plan: Plan, rank: int, seed: int = 0) -> RankSetup:
    """Set up ``rank`` of ``plan`` inside an initialized process group of ``plan.world`` ranks.

    Every rank must call this together: it creates the process groups.
    """
    check_plan(plan)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    recorder = Recorder(rank, torch.cuda.synchronize if device.type == "cuda" else None)
    schedule = plan.pipeline
    groups = _process_groups(plan, rank, schedule)
    coords = plan.coords(rank)
    dtype, reduce_dtype = DTYPES[plan.dtype], DTYPES[plan.reduce_dtype]
    sharded = plan.zero and plan.shard_size > 1
    fsdp = plan.shards_weights
    model = plan.model

    tp = TPGroup(groups.get("tp"), coords.tp, plan.tp, recorder)
    cp = CPGroup(groups["cp"], coords.cp, plan.cp, plan.group_of(rank, "cp"), plan.context_parallel,
                 recorder) if plan.cp > 1 else None
    ep = EPGroup(groups.get("ep"), _data_parallel_groups(plan, "ep", rank).index(rank), plan.ep, recorder)
    stage_ids = schedule.stages_of(coords.pp)
    names = {s: stage_piece_names(plan, s) for s in stage_ids}
    built = {p.name: p for p in build_pieces(model, seed, {n for ns in names.values() for n in ns})}
    stages = {}
    sequence_parallel = plan.sequence_parallel and plan.tp > 1
    # Megatron-LM's column-parallel backward (executor.train.tp_overlap.ColumnEntry), as the lowering models it:
    # a split backward's passes keep the gathered input, and its input-gradient pass computes no weight gradient
    column_backward = "autograd" if schedule.split_backward else \
        "async" if plan.tp_async_backward else "in_line" if sequence_parallel else "autograd"
    for s in stage_ids:
        pieces = [built[n] for n in names[s]]
        loss = apply_tensor_parallel(pieces, build_loss(model), model, plan.tp_style, tp, sequence_parallel,
                                     plan.tp_comm_overlap, column_backward)
        if cp is not None:
            apply_context_parallel(pieces, cp, model.seq_len)
        apply_expert_parallel(pieces, ep)
        if plan.capacity_factor is not None:  # a MoE transformer's: the tokens each call routes share one capacity
            set_capacity([p.module for p in pieces], plan.capacity_factor)
        pieces = apply_activation_recompute(pieces, {c.name for c in plan.recomputed(s)}, recorder)
        # FSDP2 keeps fp32 parameters and computes in the plan's dtype (its MixedPrecisionPolicy)
        stages[s] = Stage(pieces, loss if s == plan.num_stages - 1 else None).to(
            device=device, dtype=torch.float32 if fsdp else dtype)
    shard_group = groups.get("shard", groups.get("dp"))
    if fsdp:
        dp_ranks = _data_parallel_groups(plan, "dp", rank)  # dp x cp: gradients average over both
        rows = [dp_ranks[k:k + plan.shard_size] for k in range(0, len(dp_ranks), plan.shard_size)]
        mesh = data_parallel_mesh(rows, shard_group, groups.get("replicate"), device.type)
        experts_mesh = None
        if model.is_moe:  # torchtitan's: the ranks holding the same experts, HSDP's 2-D within shard groups
            holding, n = _data_parallel_groups(plan, "edp", rank), plan.expert_shard_size
            experts_mesh = data_parallel_mesh([holding[k:k + n] for k in range(0, len(holding), n)],
                                              groups["eshard"], groups.get("replicate"), device.type)
        apply_fsdp(stages, names, mesh, plan.reshard_after_forward, recorder, dtype, reduce_dtype,
                   experts_mesh, plan.dp * plan.cp)
    tie_sync = None
    if getattr(model, "tied_embeddings", False):
        tie_sync = tie_embeddings(list(built.values()), groups.get("tie"), recorder, reduce_dtype)

    sync_order = _unique_last([p for s in reversed(stage_ids) for piece in reversed(stages[s].pieces)
                               for p in piece.parameters()])
    after_step = None
    if plan.main_grads:  # bf16/fp16 weights outside FSDP; before the gradient sync's hooks, which see the sums
        attach_main_grads(sync_order, reduce_dtype)
    replicas = plan.dp * plan.cp  # gradients are averaged over dp x cp
    fused = plan.adamw == "fused"
    if sharded and plan.zero < 3:
        optimizer = grad_sync = _zero_optimizer(plan, stages, sync_order, groups, recorder, reduce_dtype)
        after_step = grad_sync.gather_weights
        if plan.overlap_param_gather:  # each piece's forward waits for its parameters' buckets
            for stage in stages.values():
                for piece in stage.pieces:
                    piece.register_forward_pre_hook(lambda module, args: grad_sync.await_weights(module.parameters()))
    else:  # FSDP syncs its own gradients, per unit
        routed = {id(p) for p in routed_expert_parameters(list(stages.values()))}
        grad_sync = None if sharded else apply_data_parallel(
            [p for p in sync_order if id(p) not in routed], groups.get("dp"), replicas, plan.grad_sync,
            plan.bucket_size, plan.overlap, plan.num_microbatches, recorder, reduce_dtype,
            [p for p in sync_order if id(p) in routed], groups.get("edp"), replicas // plan.ep, replicas)
        optimizer = (MasterWeightsAdamW(sync_order, LEARNING_RATE, fused) if plan.main_grads
                     else adamw(sync_order, LEARNING_RATE, fused))
    owners = {s: plan.rank_of(dp=coords.dp, pp=schedule.stage_to_rank(s), cp=coords.cp, tp=coords.tp)
              for s in range(plan.num_stages)}
    runtime = PipelineRuntime(schedule, coords.pp, stages, owners, rank, recorder, _activation_shape(plan),
                              dtype, device)
    # Megatron-LM's finalize_model_grads order: data-parallel sync, then sequence-parallel norms, then embeddings.
    zero = grad_sync if isinstance(grad_sync, ZeroOptimizers) else None
    finalize = [f for f in (sequence_parallel_grad_sync(sync_order, tp, reduce_dtype, zero), tie_sync)
                if f is not None]
    clipper = scaler = None
    if plan.grad_clip is not None or plan.scales_loss:  # checks over every rank's gradients before the step
        tied_copy = built["head"].module.out.weight if tie_sync is not None and "embedding" not in built else None
        held = held_gradients(plan, sync_order, groups, zero,
                              tied_copy, {id(p) for p in routed_expert_parameters(list(stages.values()))}, recorder,
                              device)
        clipper = GradClipper(plan.grad_clip, held) if plan.grad_clip is not None else None
        scaler = DynamicLossScaler(held) if plan.scales_loss else None
        if scaler is not None:
            runtime.loss_scale = scaler.scale
    return RankSetup(plan, rank, stages, runtime, grad_sync, finalize, optimizer, recorder,
                     _local_microbatches(plan, coords.dp, coords.cp, seed, dtype, device), after_step, cp, clipper,
                     scaler)


def _zero_optimizer(plan: Plan, stages: dict, params: list, groups: dict[str, Any], recorder: Recorder,
                    reduce_dtype: Any) -> ZeroOptimizers:
    """ZeRO-1/2 over the shard group; a mixture of experts' routed experts apart, sharded over the ranks of the
    shard group holding them, or, where no other rank of the shard group holds them, whole and all-reduced
    across the shard groups (HSDP), if any."""
    settings = dict(bucket_size=plan.bucket_size, overlap=plan.overlap, accumulations=plan.num_microbatches,
                    recorder=recorder, lr=LEARNING_RATE, reduce_dtype=reduce_dtype,
                    overlap_param_gather=plan.overlap_param_gather, fused=plan.adamw == "fused")
    shard_group, replicate = groups.get("shard", groups.get("dp")), groups.get("replicate")
    routed = {id(p) for p in routed_expert_parameters(list(stages.values()))}
    dense = ZeroOptimizer([p for p in params if id(p) not in routed], plan.zero, shard_group, replicate, **settings)
    experts = [p for p in params if id(p) in routed]
    if not experts:
        return ZeroOptimizers([dense])
    if plan.expert_shard_size > 1:
        return ZeroOptimizers([dense, ZeroOptimizer(experts, plan.zero, groups["eshard"], replicate, experts=True,
                                                    divisor=plan.dp * plan.cp, **settings)])
    replicas = plan.dp * plan.cp // plan.ep  # the ranks holding the same experts, one per shard group
    return ZeroOptimizers([dense], whole_experts(experts, groups.get("edp"), replicas, plan.dp * plan.cp, settings,
                                                 plan.main_grads))


def rank_main(rank: int, world: int, plan_data: dict, steps: int, warmup: int, seed: int,
              gather: bool = False, verbose: bool = False, profile_dir: str | None = None,
              probe_speed: bool = False) -> dict | list | None:
    """One rank of ``parsim run``: warm-up, then measured steps; its events and losses.

    With ``gather`` (a torchrun job, where no parent collects return values)
    rank 0 returns every rank's result and the others None. With
    ``profile_dir``, every step runs under ``torch.profiler`` (one
    ``ProfilerStep#N`` each) and the rank writes its Kineto trace of the
    measured steps there. With ``probe_speed``, the host-speed probe
    (:mod:`executor.speed_probe`) runs before the warm-up and after the
    measured steps, every probing rank at once (``speed_probes``), and the
    collective probe on ranks 0 and 1 (``collective_probes``): the steps
    themselves run back to back, as a training loop's do. Probed right before
    it, a step is not the loop's: on a 2-core VM the first pass after the probe
    took 1.1 ms longer than the passes after it (tiny-gpt's two layers,
    forward and backward, 1.8-1.9 ms warm), and tiny PP's measured steps
    14.8-19.6 ms against 12.5-12.8 ms without it (2026-11-27).
    """
    plan = load_plan(plan_data)
    setup = build_rank(plan, rank, seed)
    recorder = setup.recorder
    probe = SpeedProbe(seed) if probe_speed and probes_on(rank, world) else None
    probe_group = collective_probe_group(world) if probe_speed else None  # every rank makes the group
    collective_probe = CollectiveProbe(probe_group) if probe_group is not None and rank < COLLECTIVE_PROBE_RANKS \
        else None
    result: dict = {"rank": rank, "host": platform.node(), "steps": [], "step_origins": [], "losses": [],
                    "speed_probes": [], "collective_probes": []}
    moe_layers = {f"stage {s}: {path}": module for s, stage in setup.stages.items()
                  for path, module in stage.named_modules() if isinstance(module, MoEFeedForward)}

    def probe_now() -> None:  # every rank waits out the probes: none computes or exits beside them
        dist.barrier()
        if probe is not None:
            result["speed_probes"].append(probe())
        if collective_probe is not None:  # ranks 0 and 1, after the compute probes: each on a core of its own
            result["collective_probes"].append(collective_probe())
        dist.barrier()

    if probe_speed:
        probe_now()
    with _profiler(profile_dir, rank, warmup, steps) as profiler:
        for i in range(warmup + steps):
            dist.barrier()
            if profiler is not None:
                profiler.step()  # ProfilerStep#N starts here, as the recorded step does
            recorder.start_step()
            if i == warmup:  # the measured steps' routing: each MoE layer's busiest expert here, per forward
                for module in moe_layers.values():
                    module.loads = []
            loss = setup.step()
            recorder.sync()
            if i >= warmup:
                result["steps"].append(list(recorder.events))
                result["step_origins"].append(recorder.origin_s)
                result["losses"].append(loss)
            if verbose and rank == 0:
                kind = "warm-up step" if i < warmup else f"step {i - warmup + 1}/{steps}"
                end = max((e.end_s for e in recorder.events), default=0.0)
                print(f"parsim run: {kind} took {end * 1e3:.1f} ms on rank 0", file=sys.stderr, flush=True)
    if probe_speed:
        probe_now()
    result["expert_loads"] = {name: [float(load) for load in module.loads or ()] for name, module in moe_layers.items()}
    if not gather:
        return result
    everyone = [None] * world if rank == 0 else None
    dist.gather_object(result, everyone, dst=0)
    return everyone


def _profiler(folder: str | None, rank: int, warmup: int, steps: int) -> Any:
    """``torch.profiler`` over the measured steps (warm-up steps are its warm-up), exporting
    ``<folder>/rank<r>.pt.trace.json``; a context doing nothing without a folder.

    Each step is marked right after its barrier, so the profiler's first "step" is the first barrier
    (skipped: ``wait=1``) and the last one closes when the profiler does.
    """
    if folder is None:
        return nullcontext()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    path = Path(folder) / f"rank{rank}.pt.trace.json"
    return torch.profiler.profile(
        activities=activities, record_shapes=True,
        schedule=torch.profiler.schedule(wait=1, warmup=warmup, active=steps),
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(path)))


def _process_groups(plan: Plan, rank: int, schedule: Schedule) -> dict[str, Any]:
    """This rank's dp, cp and tp groups, HSDP's shard and replicate groups, the tied-embedding pair, and a MoE
    model's expert-parallel (ep) and expert-data-parallel (edp) groups, and under ZeRO its experts' shard
    group (eshard); every rank creates every group, in one order.

    Gradients are averaged over the data- and context-parallel ranks together (Megatron-LM), so "dp"
    is the dp x cp ranks of each (pipeline, tensor) coordinate, as the simulator's lowering groups them.
    """
    memberships = {"dp": _data_parallel_groups(plan, "dp"), "cp": plan.groups("cp"), "tp": plan.groups("tp")}
    if 1 < plan.shard_size < plan.dp * plan.cp:  # HSDP: shards within consecutive data-parallel ranks
        memberships.update({dim: _data_parallel_groups(plan, dim) for dim in ("shard", "replicate")})
    if plan.model.is_moe:
        memberships.update({dim: _data_parallel_groups(plan, dim) for dim in ("ep", "edp")})
        if plan.zero:  # ZeRO's expert shards (FSDP's mesh: one rank where its shard group holds its experts once)
            memberships["eshard"] = _data_parallel_groups(plan, "eshard")
    if plan.grad_clip is not None or plan.scales_loss:  # checks over every pipeline rank's gradients
        memberships["pp"] = plan.groups("pp")
    if getattr(plan.model, "tied_embeddings", False):
        first, last = schedule.stage_to_rank(0), schedule.stage_to_rank(plan.num_stages - 1)
        memberships["tie"] = [[plan.rank_of(dp=d, pp=first, cp=c, tp=t), plan.rank_of(dp=d, pp=last, cp=c, tp=t)]
                              for d in range(plan.dp) for c in range(plan.cp) for t in range(plan.tp)
                              ] if first != last else []
    # Rings beside compute keep device loops that preempt (executor.gloo_threads); collectives' are batched.
    beside_compute = {"cp"} | ({"tp"} if plan.tp_comm_overlap else set())
    mine = {}
    for key, groups in memberships.items():
        for members in groups:
            if len(members) > 1 or key == "eshard":
                group = dist.new_group(members) if key in beside_compute else collective_group(members)
                if rank in members:
                    mine[key] = group
    return mine


def _data_parallel_groups(plan: Plan, dim: str, rank: int | None = None) -> list:
    """Every data-parallel ``dim`` group of every pipeline rank (:func:`parsim.lowering.lower.data_parallel_groups`:
    dp, shard, replicate, ep, edp or eshard), as the lowering simulates them; with ``rank``, only the one holding
    it."""
    groups = [g for p in range(plan.pp) for g in data_parallel_groups(plan, p, dim)]
    return groups if rank is None else next(g for g in groups if rank in g)


def _unique_last(params: list) -> list:
    """``params`` without repeats, each kept at its last place (a shared table is final last)."""
    seen: set[int] = set()
    kept = []
    for p in reversed(params):
        if id(p) not in seen:
            seen.add(id(p))
            kept.append(p)
    return kept[::-1]


def _activation_shape(plan: Plan) -> tuple[int, ...]:
    m = plan.model
    if isinstance(m, MLPModel):
        return (plan.microbatch_size, m.width)
    # Context parallelism keeps 1/cp of the sequence on each rank; sequence parallelism sends 1/tp of that.
    sequence_shards = plan.cp * (plan.tp if plan.sequence_parallel else 1)
    return (plan.microbatch_size, m.seq_len // sequence_shards, m.hidden)


def _local_microbatches(plan: Plan, dp_rank: int, cp_rank: int, seed: int, dtype: Any,
                        device: Any) -> tuple[list, list]:
    """This replica's rows of the seeded global batch (this cp rank's tokens of them), cut into microbatches."""
    inputs, targets = make_batch(plan.model, plan.global_batch_size, seed, dtype)
    local = plan.microbatch_size * plan.num_microbatches
    rows = slice(dp_rank * local, (dp_rank + 1) * local)
    inputs, targets = inputs[rows], targets[rows] if targets is not None else None
    if plan.cp > 1:
        tokens = sequence_positions(plan.model.seq_len, plan.cp, cp_rank)
        inputs, targets = inputs[:, tokens], targets[:, tokens]
    xs = list(inputs.to(device).split(plan.microbatch_size))
    ys = list(targets.to(device).split(plan.microbatch_size)) if targets is not None else [None] * len(xs)
    return xs, ys
