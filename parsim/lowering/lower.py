"""Lower a plan to per-rank programs the step simulator times.

Symmetry keeps frontier-scale plans cheap: every data-, context- and
tensor-parallel rank of a pipeline stage runs the same program, so one
*representative* rank per pipeline rank is simulated (``dp = cp = tp = 0``).
Its collectives still move the traffic of all the ranks it stands for: each
collective carries the *mirror* groups (the same op on the other replicas'
groups) as extra flows, so contention on shared NICs and switches is
simulated, not assumed.

For pipeline rank ``p`` the program is the schedule's action list for ``p``.
Each action becomes: a receive of its input (activations from the previous
stage, or gradients from the next), the per-block compute split by the
tensor-parallel collectives (and expert all-to-alls) the model places between
blocks, context-parallel K/V exchanges beside attention, FSDP's per-layer
gathers and reductions, recomputed forwards before their backward, and a send
of its output. After the last backward come the data-parallel gradient
reductions (per parameter after the backward, as in the course, or in buckets
that start as soon as their gradients are final, as DDP does; reduce-scatters
under ZeRO) and the optimizer step. A pass's pieces are built once per stage
and stamped for every microbatch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple, TypeVar

from ..report.trace import collective_name, compute_name, p2p_name
from ..schedules import Action, Schedule
from ..sim.collectives.deepep import TokenRouting
from ..sim.program import Op, Program
from ..workload.model import (COUNTS_EXCHANGE, FP8_DISPATCH_BYTES, FP8_DISPATCHED, POSITIONS, ROUTED_COLLECTIVES,
                              LayerCost, MLPModel, shard)
from ..workload.plan import Plan
from . import eager_ops, tp_overlap
from .kernels import block_work
from .pieces import CommPiece, ComputePiece, Piece

T = TypeVar("T")

FP32 = 4
# torch.optim.AdamW (foreach) passes over whole tensors: decay the weight (read+write),
# lerp the first moment (2 reads, 1 write), scale and addcmul the second (2 + 4),
# sqrt, divide and add eps into a temporary (2 + 2 + 2), addcdiv into the weight
# (3 reads, 1 write): 21 element accesses per parameter, fp32 state.
ADAMW_ACCESSES = 21
ADAMW_KERNELS = 8  # those eight passes, per parameter tensor
# A fused AdamW (torch's fused=True, Apex's and Transformer Engine's FusedAdam) reads the weight, its gradient
# and both moments and writes the weight and the moments in one pass: 7 accesses. On a GPU it launches one
# kernel per 36 tensors (multi-tensor apply over 4 tensor lists: depth_to_max_tensors in PyTorch's
# aten/src/ATen/native/cuda/MultiTensorApply.cuh); on a CPU host torch._fused_adamw_ visits the tensors one by
# one, each costing about one dispatched op (tiny-gpt's 2-rank pipeline: 0.65-0.69 ms measured against 0.26 ms
# priced as a single op for the whole call).
FUSED_ADAMW_ACCESSES = 7
FUSED_MOMENT_ACCESSES = 4  # of those, the moments' (each read and written)
FUSED_ADAMW_TENSORS_PER_KERNEL = 36

# Gradient clipping (Plan.grad_clip) as torch.nn.utils.clip_grad_norm_ runs it, and parsim's executor
# (executor/train/clip.py): torch._foreach_norm reads every gradient once, then torch._foreach_mul_ scales each
# (reads and writes it) whatever the coefficient. Megatron-LM's clip_grad_norm_fp32 runs the same two
# multi-tensor passes (multi_tensor_l2norm, then multi_tensor_scale, which it skips when nothing is clipped).
# On a GPU each pass launches one kernel per 110 tensors (depth_to_max_tensors[0], one tensor list, in
# PyTorch's aten/src/ATen/native/cuda/MultiTensorApply.cuh); the norm of the norms and the coefficient are a
# few scalar ops more. On a CPU host a foreach op visits the tensors one by one, about a sixth of a
# dispatched op each (this 2-core host: 2.2 us per tensor for _foreach_norm and 0.7 for _foreach_mul_,
# against 13 us for one dispatched op). The norm squares and sums in fp32, arithmetic a CPU core does at its
# elementwise speed rather than its streaming speed (course DDP's 16.8 MB of gradients: 2.2 ms measured,
# 1.0 ms at the calibrated streaming speed, 1.9 ms at the calibrated elementwise speed); the scaling streams.
CLIP_NORM_ACCESSES, CLIP_SCALE_ACCESSES = 1, 2
# fp16's loss scaling (Plan.scales_loss): torch._amp_foreach_non_finite_check_and_unscale_ (torch.amp.GradScaler,
# Megatron-LM's _unscale_main_grads_and_check_for_nan, and parsim's executor) multiplies every gradient by
# 1/scale and flags any that is not finite, in one multi-tensor pass: a read and a write.
UNSCALE_ACCESSES = 2
FOREACH_TENSORS_PER_KERNEL = 110
CLIP_NORM_OPS = 6  # stack the per-tensor norms, square, weigh, sum, the square root, the coefficient
FOREACH_TENSORS_PER_OP = 6

PASS_PHASE = {"F": "forward", "R": "recompute", "B": "backward", "I": "backward", "W": "weight-grad"}


def adamw_costs(implementation: str, params: float, tensors: int,
                mixed: tuple[int, int] | None = None, moment_bytes: int = FP32) -> dict[str, float]:
    """What one AdamW step (``foreach`` or ``fused``) over ``params`` parameters in ``tensors`` tensors
    costs, as keyword arguments of :meth:`ComputeModel.time <parsim.sim.compute.ComputeModel.time>` (and of
    :class:`Op`): 12 FLOPs per parameter, its fp32 passes and launches, the fused kernel's parameters (its SM
    cycles add to its bytes on a GPU: ``sm_cycles.adamw``), and on an eager CPU host its per-tensor and
    per-step costs (calibrated on the foreach step; one dispatched op's per tensor for the fused one).

    ``mixed`` (the weights' and the gradients' bytes) where AdamW steps fp32 master weights beside
    low-precision ones (:attr:`Plan.main_grads <parsim.workload.plan.Plan.main_grads>`): gradients kept narrower than
    fp32 are cast to it first, and the updated masters are copied back into the weights, a pass and an op
    per tensor each (``executor/train/mixed_precision.py``; Megatron-LM's ``Float16OptimizerWithFloat16Params``
    copies main grads in and main params out the same way).

    ``moment_bytes`` (fused only): the two moments' dtype, each read and written once (Plan.adam_moments)."""
    if implementation == "fused":
        traffic = params * (FUSED_ADAMW_ACCESSES * FP32 - FUSED_MOMENT_ACCESSES * (FP32 - moment_bytes))
        costs = {"flops": 12.0 * params, "hbm_bytes": traffic, "stream_bytes": traffic, "forward_ops": tensors,
                 "kernels": -(-tensors // FUSED_ADAMW_TENSORS_PER_KERNEL), "optimizer_tensors": 0,
                 "optimizer_steps": 0, "adamw_params": params}
    else:
        traffic = params * ADAMW_ACCESSES * FP32
        costs = {"flops": 12.0 * params, "hbm_bytes": traffic, "stream_bytes": traffic, "forward_ops": 0,
                 "kernels": tensors * ADAMW_KERNELS, "optimizer_tensors": tensors,
                 "optimizer_steps": 1}
    if mixed is not None:
        weight_bytes, grad_bytes = mixed
        copies = [(FP32, weight_bytes)] + ([(grad_bytes, FP32)] if grad_bytes < FP32 else [])
        moved = params * sum(read + write for read, write in copies)
        costs["hbm_bytes"] += moved
        costs["stream_bytes"] += moved
        costs["forward_ops"] += tensors * len(copies)
        costs["kernels"] += tensors * len(copies)
    return costs


def clip_costs(params: float, tensors: int, grad_bytes: int) -> tuple[dict[str, float], dict[str, float]]:
    """Clipping ``params`` gradients of ``grad_bytes`` each, in ``tensors`` tensors, to a global norm: (the local
    norm, the scaling), as keyword arguments of :meth:`ComputeModel.time <parsim.sim.compute.ComputeModel.time>`."""
    kernels = -(-tensors // FOREACH_TENSORS_PER_KERNEL)
    visits = tensors // FOREACH_TENSORS_PER_OP
    norm_bytes, scale_bytes = (params * grad_bytes * n for n in (CLIP_NORM_ACCESSES, CLIP_SCALE_ACCESSES))
    return ({"flops": 2.0 * params, "hbm_bytes": norm_bytes,  # squares and sums: elementwise work, not a stream
             "kernels": kernels + CLIP_NORM_OPS, "forward_ops": CLIP_NORM_OPS + visits},
            {"flops": float(params), "hbm_bytes": scale_bytes, "stream_bytes": scale_bytes, "kernels": kernels,
             "forward_ops": 1 + visits})


# Op.fsdp_calls of FSDP2's copies: out of a gather's buffer (a unit unsharded, resharded later), into a
# reduce-scatter's (a unit's post-backward)
UNSHARD_CALL, REDUCE_CALL = (1, 0, 0), (0, 1, 0)


def step_costs(implementation: str, params: float, tensors: int, mixed: tuple[int, int] | None,
               clipped_bytes: int = 0, moment_bytes: int = FP32) -> dict[str, float]:
    """The optimizer step over ``params`` parameters in ``tensors`` tensors (a rank's, or its shard): AdamW
    (:func:`adamw_costs`), after scaling the gradients of ``clipped_bytes`` each where the plan clips them
    (:func:`clip_costs`; 0: it does not)."""
    adamw = adamw_costs(implementation, params, tensors, mixed, moment_bytes)
    if not clipped_bytes:
        return adamw
    scale = clip_costs(params, tensors, clipped_bytes)[1]
    return {key: adamw.get(key, 0) + scale.get(key, 0) for key in adamw.keys() | scale.keys()}


def unscale_costs(params: float, tensors: int, grad_bytes: int) -> dict[str, float]:
    """Unscaling ``params`` gradients of ``grad_bytes`` each, in ``tensors`` tensors, and checking them for
    infinities (:data:`UNSCALE_ACCESSES`), as keyword arguments of :meth:`ComputeModel.time`."""
    moved = params * grad_bytes * UNSCALE_ACCESSES
    visits = tensors // FOREACH_TENSORS_PER_OP
    return {"flops": 2.0 * params, "hbm_bytes": moved, "stream_bytes": moved,
            "kernels": -(-tensors // FOREACH_TENSORS_PER_KERNEL) + 1, "forward_ops": 2 + visits}


def grad_norm_dims(plan: Plan) -> tuple[str, ...]:
    """The dimensions whose ranks hold different gradients, over which clipping sums the squares (and fp16's loss
    scaling looks for an overflow), in the order the executor reduces them: ZeRO's or FSDP's shards, the experts,
    tensor-parallel slices, pipeline stages.
    Data- and context-parallel replicas hold the same gradients once they are synced. A shard group holds whole
    expert-parallel groups (every rank's experts, each part once), so under ZeRO the experts take no sum apart."""
    sharded = bool(plan.zero) and plan.shard_size > 1
    used = {"shard": sharded, "ep": plan.ep > 1 and not sharded, "tp": plan.tp > 1, "pp": plan.pp > 1}
    return tuple(dim for dim, on in used.items() if on)


def data_parallel_groups(plan: Plan, p: int, dim: str) -> list[list[int]]:
    """Pipeline rank ``p``'s ``dim`` groups among its data- and context-parallel ranks, which reduce gradients
    together (Megatron-LM), one set per tensor-parallel index: ``dp`` all of them; ``shard`` ZeRO's groups of
    ``shard_size`` consecutive ones; ``replicate`` HSDP's ranks holding the same shard, one per shard group;
    ``ep`` consecutive ranks splitting the experts; ``edp`` the ranks holding the same experts, one per ep
    group; ``eshard`` those of one shard group (HSDP of experts). The executor creates the same groups."""
    groups = [plan.rank_grid[:, p, :, t].ravel().tolist() for t in range(plan.tp)]
    size, ep = plan.shard_size, plan.ep
    if dim == "shard":
        return [g[k:k + size] for g in groups for k in range(0, len(g), size)]
    if dim == "replicate":
        return [g[j::size] for g in groups for j in range(size)]
    if dim == "ep":
        return [g[k:k + ep] for g in groups for k in range(0, len(g), ep)]
    if dim == "edp":
        return [g[j::ep] for g in groups for j in range(ep)]
    if dim == "eshard":
        return [g[k:k + size][j::ep] for g in groups for k in range(0, len(g), size) for j in range(ep)]
    return groups  # dp


@dataclass
class _Pending:
    """A receive whose matching send is created later."""

    op: Op
    key: tuple


def hidden_size(plan: Plan) -> int:
    model = plan.model
    return model.width if isinstance(model, MLPModel) else model.hidden


def pipeline_bytes(plan: Plan) -> float:
    """What one pipeline rank sends the next for one microbatch (its activations, or their gradients back): a
    context-parallel rank's part of the sequence, and under sequence parallelism a tensor-parallel rank's part
    of that, the stage's output being split along the sequence (Megatron-LM: ``get_tensor_shapes`` divides the
    sequence by the tensor-parallel size, ``megatron/core/pipeline_parallel/schedules.py``; the executor sends
    its stage's output as it is)."""
    split = plan.tp if plan.sequence_parallel else 1
    return plan.tokens_per_rank * hidden_size(plan) * plan.dtype_bytes / split


def _memoized(method: Callable) -> Callable:
    """``method`` memoized per lowering, in the lowering's own ``_memo``: a cache on the class would keep every
    Lowering alive, and one on the instance around its bound method would make a cycle that only the cyclic
    garbage collector frees (a search builds thousands of lowerings)."""
    name = method.__name__

    @functools.wraps(method)
    def memoized(self, *args):
        memo = self._memo.setdefault(name, {})
        if args not in memo:
            memo[args] = method(self, *args)
        return memo[args]
    return memoized


def lower(plan: Plan, fsdp_in_line: bool = False, follow_cache: bool = False) -> Program:
    """The representative ranks' programs (one per pipeline rank); ``fsdp_in_line`` and ``follow_cache``: see
    :class:`Lowering`."""
    return Lowering(plan, fsdp_in_line, follow_cache).build()


class Lowering:
    """Builds a plan's program; its pieces (:meth:`layer_pass`, :meth:`group`) also serve the
    search's fast model (:mod:`parsim.search`), which prices the same pieces without a simulation."""

    def __init__(self, plan: Plan, fsdp_in_line: bool = False, follow_cache: bool = False):
        self.plan = plan
        # On a CPU host, how many bytes each rank touched between two reads of a block's weights: how much of them
        # its cache still holds (:meth:`_cache_reads`); a GPU's matmuls are priced from HBM.
        self.follow_cache = follow_cache
        # compute op id -> the weights its matmuls read (stage, layer, block), and whether in the layout they are
        # stored in (the read the cache speeds up: _cache_reads)
        self.weight_reads: dict[int, tuple[tuple[int, int, str], bool]] = {}
        # FSDP's collectives on streams of their own beside the compute (a GPU's NCCL streams), or ``fsdp_in_line``
        # on the compute stream, each where it is issued: on a CPU host the executor's FSDP2 comm hooks run each
        # gather and reduce-scatter to its end inside the hook that issues it (executor.train.fsdp).
        self.fsdp_streams = ("compute", "compute") if fsdp_in_line else ("gather", "comm")
        self.program = Program(plan.world)
        self.tokens = plan.tokens_per_rank  # a context-parallel rank computes 1/cp of each sequence
        self.act_bytes = pipeline_bytes(plan)
        self.sends: dict[tuple, int] = {}
        self.pending: list[_Pending] = []
        self.fsdp = plan.shards_weights  # gathered per layer
        self.stage_checks: dict[str, list[int]] = {}  # a check's all-reduce over the pipeline ranks: its ops
        model = plan.model
        self.routing = TokenRouting(model.experts_per_token, model.num_experts, model.max_routed_nodes) \
            if plan.dispatcher == "deepep" else None  # how DeepEP's all-to-alls run (parsim.sim.collectives.deepep)
        self._memo: dict[str, dict[tuple, object]] = {}  # (_memoized)

    @property
    def schedule(self) -> Schedule:
        """The plan's schedule (built on first use: pricing one pass needs none)."""
        return self.plan.pipeline

    def build(self) -> Program:
        """Lower every pipeline rank's schedule actions, gradient sync and optimizer step."""
        plan = self.plan
        last_mb = plan.num_microbatches - 1
        for p in range(plan.pp):
            rank = plan.rank_of(dp=0, pp=p, tp=0)
            self.program.replicas[rank] = tuple(plan.rank_grid[:, p].ravel().tolist())
            self.rank_ids = self.program.by_rank.setdefault(rank, [])
            self.final_grad_ops: dict[tuple[int, int], int] = {}  # (stage, layer index) -> op id
            self.fsdp_syncs: list[int] = []  # this rank's per-layer gradient reductions
            self.gathered_stages: set[int] = set()  # FSDP under a pipeline: stages whose weights stay gathered
            self.param_gathers = self._prefetch_weights(rank, p) if plan.overlap_param_gather else {}
            actions = self.schedule.actions[p]
            paired = self.schedule.paired[p] if plan.ep_comm_overlap else frozenset()
            committed: tuple[int, ...] = ()  # the last pair's sends, which the rank's next pass waits for
            for i, action in enumerate(actions):
                if i - 1 in paired:
                    continue  # lowered with the forward before it
                first = len(self.program.ops)
                if i in paired:
                    committed = self._paired(rank, p, action, actions[i + 1], last_mb, committed)
                else:
                    deque(self._passes(rank, p, action, last_mb, waits=committed), maxlen=0)
                    committed = ()
                self._opens_action(first)
            self._gradient_sync_and_step(rank, p)
            if self.follow_cache:
                self._cache_reads(self.rank_ids)
        for pending in self.pending:
            pending.op.match = self.sends[pending.key]
        self._join_checks_across_stages()
        return self.program

    def _cache_reads(self, ids: list[int]) -> None:
        """Give each compute op of one rank (``ids``, in the order it runs them) that reads its block's weights in
        the layout they are stored in the bytes the rank touched between the start of the last op that read them
        (in either layout) and its own start (every op's operands and memory-bound bytes, a transfer's or
        collective's buffer): the weights' reuse distance, by which the compute model reads how much of them
        the cache still holds. The step repeats, so a block's first read in the step counts from its last read
        in it, one step before.

        A thin matmul on a CPU core is bound by reading its weight: GPipe's second microbatch through a stage finds
        the weights the first left in the cache. A read through a transposed view (the course MLP's input
        gradients, an nn.Linear's forward) ran about as fast from memory as from the cache, so it is priced as
        calibrated; AdamW counts as touching its bytes, not as reading the weights (measured in
        docs/calibration.md, "Weights a rank reads again from its cache")."""
        ops, width = self.program.ops, self.plan.dtype_bytes
        start, touched = {}, 0.0
        for i in ids:
            op = ops[i]
            start[i] = touched
            if op.kind == "compute":  # a gradient's accumulation reads and writes the same bytes: once
                touched += (op.hbm_bytes - op.stream_bytes / 2
                            + width * sum(m * k + k * n + m * n for m, n, k in op.matmuls))
            elif op.kind == "optimizer":
                touched += op.hbm_bytes
            else:
                touched += op.nbytes
        last_read: dict[tuple[int, int, str], float] = {}
        reads = [i for i in ids if i in self.weight_reads]
        for i in reads:
            last_read[self.weight_reads[i][0]] = start[i]
        for i in reads:  # last_read holds each block's last read of the step before, then this step's
            key, stored = self.weight_reads[i]
            if stored:
                since = start[i] - last_read[key] if last_read[key] < start[i] else touched - last_read[key] + start[i]
                ops[i].weights_reuse_bytes = since
            last_read[key] = start[i]

    def _opens_action(self, first: int) -> None:
        """Mark the first compute-stream op from id ``first`` on (a pass's receive or its first block): the
        training loop's host time before the action goes there (``ComputeModel.action_gap_s``). After a
        receive, the pass's first block too: the loop's Python runs between the two (0.06-0.11 ms a receive in
        tiny PP's and course PP's steps on the 2-core AMD VM)."""
        ops = [op for op in self.program.ops[first:] if op.stream == "compute"]
        if not ops:
            return
        ops[0].opens_action = True
        if ops[0].kind == "recv":
            block = next((op for op in ops[1:] if op.kind != "recv"), None)
            if block is not None:
                block.opens_action = True

    # -- groups ---------------------------------------------------------------
    @_memoized
    def group(self, p: int, dim: str) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        """The representative's ``dim`` group at pipeline rank ``p`` and its mirror groups."""
        plan = self.plan
        grid = plan.rank_grid  # [dp, pp, cp, tp]
        if dim == "embedding":  # a tied table's two copies: the first and the last pipeline ranks' (p is either)
            groups = [[int(grid[d, 0, c, t]), int(grid[d, -1, c, t])]
                      for d in range(plan.dp) for c in range(plan.cp) for t in range(plan.tp)]
        elif dim == "tp":
            groups = grid[:, p, :, :].reshape(-1, plan.tp).tolist()
        elif dim == "cp":
            groups = grid[:, p, :, :].transpose(0, 2, 1).reshape(-1, plan.cp).tolist()
        elif dim == "pp":  # every pipeline rank (p is any of them)
            groups = grid.transpose(0, 2, 3, 1).reshape(-1, plan.pp).tolist()
        else:
            groups = data_parallel_groups(plan, p, dim)
        groups = [tuple(g) for g in groups]
        return groups[0], tuple(groups[1:])

    # -- one schedule action ------------------------------------------------------
    def _paired(self, rank: int, p: int, forward: Action, backward: Action, last_mb: int,
                waits: tuple[int, ...]) -> tuple[int, ...]:
        """A forward and another microbatch's backward run together (``ep_comm_overlap``): each pass's expert
        all-to-alls run on a stream of their own beside the compute the other pass issues next, the two passes
        taking turns at each all-to-all, the backward first. Megatron-LM's ``schedule_layer_1f1b``
        (``megatron/core/models/common/model_chunk_schedule_plan.py``) issues a layer's backward combine, the
        forward's attention, its dispatch, the backward's experts, its dispatch, the forward's experts, its
        combine, the backward's attention: the same turns. DeepSeek's DualPipe overlaps its chunks so
        (DeepSeek-V3 report, section 3.2.1 and figure 4). Both passes wait for ``waits``; returns the pair's
        sends."""
        turns = [self._passes(rank, p, backward, last_mb, paired=True, waits=waits),
                 self._passes(rank, p, forward, last_mb, paired=True, waits=waits)]
        issued: dict[Iterator, int | None] = {}  # each pass ready to send -> its last op
        while turns:
            steps = [(t, next(t, _DONE)) for t in turns]
            issued.update((t, step.last) for t, step in steps if isinstance(step, _ReadyToSend))
            turns = [t for t, step in steps if step is None]
        # Both passes' sends go out once the pair's compute is done, and the rank's next pass waits for them:
        # DualPipe posts them with the next chunk's receives and waits for all (``_commit_and_wait_comm``), so
        # they never run beside the all-to-alls, whose flows would starve them.
        ends = tuple(last for last in issued.values() if last is not None)
        first = len(self.program.ops)
        for t in issued:
            with contextlib.suppress(StopIteration):
                t.send(ends)
        return tuple(op.id for op in self.program.ops[first:] if op.kind == "send")

    def _passes(self, rank: int, p: int, action: Action, last_mb: int, paired: bool = False,
                waits: tuple[int, ...] = ()) -> Iterator[_ReadyToSend | None]:
        """Lower one action, its first op waiting for ``waits`` too. ``paired``: its expert all-to-alls run
        beside the compute stream, and it yields after issuing each (None), for the pass it is paired with to
        issue its next compute, and before its sends (:class:`_ReadyToSend`), to be sent what they wait for
        (:meth:`_paired`)."""
        plan, stage, mb, kind = self.plan, action.stage, action.microbatch, action.kind
        last_stage = plan.num_stages - 1
        act_bytes, last = self.act_bytes, None
        if kind == "F" and stage > 0:
            last = self._recv(rank, "act", stage - 1, mb, ("act", stage - 1, mb), act_bytes, waits)
            waits = ()
        if kind in ("B", "I") and stage < last_stage:
            last = self._recv(rank, "grad", stage + 1, mb, ("grad", stage + 1, mb), act_bytes, waits)
            waits = ()
        name, recompute_name = compute_name(kind, stage, mb), compute_name("R", stage, mb)
        final = kind in ("B", "W") and mb == last_mb
        gathers = self.fsdp and self._fsdp_gathers(stage, kind, final)
        # The gradients are whole after a B, or after an I's W; under a pipeline, after the stage's last one.
        scatters = self.fsdp and kind in ("B", "W") and plan.pp == 1
        # FSDP2's hooks still run around each unit of a pass that gathers and reduces nothing (a pipeline's
        # passes between a stage's first and its last): charged on the unit's first compute op.
        passes_through = self.fsdp and kind in ("F", "B", "I") and not (gathers or scatters or final)
        direction = (1, 0) if kind == "F" else (0, 1)  # a forward pass, or a backward one (B, I, W)
        begun = False  # the pass's first block pays the pass's own host time (ComputeModel.pass_s)
        hook_pending = False
        closed: list[int] = []  # per layer of this pass, the op that ended it (FSDP prefetches one layer ahead)
        layers: list[int] = []  # and its index in the stage
        beside: dict[str, list[int]] = {"cp": [], "tp": []}  # side-stream collectives the next join waits for
        gathered: tuple[int, ...] = waits  # what the pass's next compute-stream op must wait for: an FSDP
        # gather, a paired pass's all-to-all, a pair's sends
        for piece, template in zip(self._pieces(p, stage, kind), self._templates(p, stage, kind)):
            if gathers and piece.opens:
                gathered += (self._fsdp_gather(rank, p, stage, piece.layer, mb, kind, closed[-2:-1], name),)
            hook_pending |= passes_through and piece.opens
            if piece.opens and kind == "F":  # ZeRO-1/2 overlapping the weights' gather: the first forward waits
                gathered += self.param_gathers.pop((stage, piece.layer), ())
            if type(piece) is CommPiece:
                name_mb = f"{piece.name_head}{mb}{piece.name_tail}"
                if piece.beside:  # on its own stream: starts once the compute-stream op before it ends
                    deps = gathered + ((last,) if last is not None else ())
                    beside[piece.stream].append(self._stamp(rank, template, name_mb, deps))
                elif paired and piece.group == "ep" and not piece.counts:
                    deps = gathered + ((last,) if last is not None else ())
                    last = self._stamp(rank, _on_stream(template, "ep"), name_mb, deps)
                    gathered = (last,)
                    yield None
                else:
                    last, gathered = self._stamp(rank, template, name_mb, gathered), ()
            else:
                deps, gathered = gathered, ()
                if piece.joins:
                    deps, beside[piece.joins] = deps + tuple(beside[piece.joins]), []
                recompute = piece.phase == "recompute"
                beside_of = beside["tp"][-1] if piece.beside_sms is not None else -1
                last = self._stamp(rank, template, recompute_name if recompute else name, deps, beside_of,
                                   direction if hook_pending else (0, 0), (0, 0) if begun else direction)
                if self.follow_cache and piece.weights and piece.matmuls and kind != "W":  # W: reads no weight
                    stored = (kind == "F" or recompute) == plan.model.forward_reads_stored_layout
                    self.weight_reads[last] = ((stage, piece.layer, piece.weights), stored)
                hook_pending, begun = False, True
                if final and not recompute:
                    self.final_grad_ops[(stage, piece.layer)] = last
            if piece.closes:
                if scatters:
                    last = self._fsdp_reduce(rank, p, stage, piece.layer, mb, kind, last, name)
                closed.append(last)
                layers.append(piece.layer)
        sent_after = () if last is None else (last,)
        if paired:
            sent_after = yield _ReadyToSend(last)
        if kind == "F" and stage < last_stage:
            self._send(rank, "act", stage, mb, ("act", stage, mb), act_bytes, sent_after)
        if kind in ("B", "I") and stage > 0:
            self._send(rank, "grad", stage, mb, ("grad", stage, mb), act_bytes, sent_after)
        if self.fsdp and final and plan.pp > 1:  # torch.distributed.pipelining's REDUCE_GRAD action
            for layer in layers:
                last = self._fsdp_reduce(rank, p, stage, layer, mb, kind, last, name)

    @_memoized
    def _templates(self, p: int, stage: int, kind: str) -> tuple[list, ...]:
        """The op each of :meth:`_pieces` stamps, as a :func:`stamp` template (name, deps, the collective
        beside and FSDP's hooks filled in per microbatch)."""
        templates = []
        for piece in self._pieces(p, stage, kind):
            if type(piece) is CommPiece:
                op = Op("", "collective", piece.stream, collective=piece.collective, group=piece.group,
                        ranks=piece.ranks, mirrors=piece.mirrors, nbytes=piece.nbytes, phase=piece.group,
                        routing=piece.routing)
            else:
                op = Op("", "compute", "compute", matmuls=piece.matmuls, hbm_bytes=piece.hbm_bytes,
                        kernels=piece.kernels, phase=piece.phase, attention_flops=piece.attention_flops,
                        attention_grad_flops=piece.attention_grad_flops, forward_ops=piece.forward_ops,
                        backward_ops=piece.backward_ops, tp_calls=piece.tp_calls, stream_bytes=piece.stream_bytes,
                        sm_reserved=piece.sm_reserved, beside_sms=piece.beside_sms or 0,
                        high_precision=piece.high_precision, sm_bound=piece.sm_bound,
                        accumulate_elements=piece.accumulate_elements)
            templates.append([getattr(op, field) for field in OP_FIELDS])
        return tuple(templates)

    @_memoized
    def _pieces(self, p: int, stage: int, kind: str) -> tuple[Piece, ...]:
        """What one ``kind`` pass of ``stage`` runs, in order: block compute split by the
        tensor-parallel collectives between blocks. The same for every microbatch.

        With full recomputation, the backward of a recomputed layer starts by
        running its forward again (compute and collectives, named ``R``)."""
        costs = self.plan.stage_costs(stage)
        recomputed = {c.name for c in self.plan.recomputed(stage)} if kind in ("B", "I") else set()
        order = list(enumerate(costs)) if kind == "F" else list(reversed(list(enumerate(costs))))
        pieces: list[Piece] = []
        for index, cost in order:
            layer = self.layer_pass(p, index, cost, "R") if cost.name in recomputed else []
            layer = fold_joins(layer + self.layer_pass(p, index, cost, kind))
            layer[0] = dataclasses.replace(layer[0], layer=index, opens=True)
            layer[-1] = dataclasses.replace(layer[-1], layer=index, closes=True)
            pieces += layer
        return tuple(pieces)

    def layer_pass(self, p: int, index: int, cost: LayerCost, kind: str) -> list[Piece]:
        """One layer's blocks in one pass (``R``: its forward recomputed), with their TP collectives."""
        plan = self.plan
        forward = kind in ("F", "R")
        phase = PASS_PHASE[kind]
        direction = {"F": "fwd", "R": "rec"}.get(kind, "bwd")
        blocks = cost.blocks if forward else tuple(reversed(cost.blocks))
        degree = {"tp": plan.tp, "ep": plan.ep}
        pieces: list[Piece] = []
        count = 0
        for block in blocks:
            # A split backward's weight-gradient pass keeps the input its input-gradient pass gathered: no
            # gather again for the weight gradients (position "dgrad") outside a full backward.
            tp_ops = [c for c in block.collectives if c.phase == ("forward" if forward else "backward")
                      and degree[c.group] > 1 and kind != "W" and (c.position != "dgrad" or kind == "B")]
            around: dict[str, list[CommPiece]] = {position: [] for position in POSITIONS}
            for coll in tp_ops:
                head, tail = collective_name(coll.op, coll.group, layer=cost.name, mb="|",
                                             dir=f"{direction}{count}").split("|")
                count += 1
                group, mirrors = self.group(p, coll.group)
                # Expert all-to-alls carry this rank's 1/tp of the tokens (the tp ranks split the dispatch).
                nbytes = coll.bytes_per_token * self.tokens / (plan.tp if coll.group == "ep" else 1) + coll.fixed_bytes
                if coll.name.startswith(ROUTED_COLLECTIVES):
                    # The busiest expert's rank receives its extra rows in the dispatch (and sends them back in
                    # the combine), and every rank of the all-to-all waits for it: priced as if each rank moved
                    # that rank's bytes (its expert-tp group gathers and scatters them all).
                    nbytes *= plan.rank_tokens_factor
                if plan.dispatch_fp8 and coll.name in FP8_DISPATCHED:
                    nbytes *= FP8_DISPATCH_BYTES / plan.dtype_bytes
                counts = coll.name == COUNTS_EXCHANGE
                routing = self.routing if coll.group == "ep" and not counts else None
                around[coll.position].append(CommPiece(head, tail, coll.op, group, mirrors, nbytes, coll.group,
                                                       routing=routing, counts=counts))
            compute, sources = self._compute(phase, block, "F" if forward else kind, index)
            # Overlapped: a block entered by one all-gather and left by one reduce-scatter (latent attention's
            # three gathers run in line: Transformer Engine's overlap of its up-projections is not modelled)
            if (plan.tp_comm_overlap and block.name in tp_overlap.PIPELINE_SMS and len(around["before"]) == 1
                    and len(around["after"]) == 1):
                pieces += self._overlapped(p, cost, block, kind, around, compute, sources)
            elif kind == "B" and plan.tp_async_backward and tp_overlap.async_backward_applies(block.name, tp_ops):
                pieces += around["before"]
                rest, (dgrad, wgrad) = tp_overlap.split_column_grads(compute, sources)
                exchanged = self._with_context_exchange(p, cost, block, kind, rest)
                if dgrad is not None and not around["dgrad"] and exchanged == [rest]:
                    # nothing runs beside the input gradients: one op with the rest, one op fewer to simulate
                    exchanged, dgrad = [tp_overlap.then(rest, dgrad)], None
                pieces += exchanged
                pieces += tp_overlap.async_backward(around["dgrad"], around["after"][0], dgrad, wgrad)
            else:
                pieces += around["before"] + around["dgrad"]
                pieces += self._with_context_exchange(p, cost, block, kind, compute)
                pieces += around["after"]
        return pieces

    def _overlapped(self, p: int, cost: LayerCost, block, kind: str, around: dict[str, list[CommPiece]],
                    compute: ComputePiece, sources: tuple[tuple[str, str], ...]) -> list[Piece]:
        """A sequence-parallel block whose all-gather and reduce-scatter hide behind its GEMMs
        (:mod:`parsim.lowering.tp_overlap`)."""
        (gather,), (scatter,) = around["before"], around["after"]
        forward = kind in ("F", "R")
        lead, body, trail, dgrad = tp_overlap.split_partners(compute, sources, forward, backward_weights=kind == "B",
                                                             regather=bool(around["dgrad"]))
        pieces = tp_overlap.ring_exchange(gather, lead, self.plan.tp) if lead else [gather]
        pieces += self._with_context_exchange(p, cost, block, kind, body)
        if around["dgrad"]:  # the input gathered again beside the column-parallel input gradients (bulk)
            pieces += tp_overlap.bulk(around["dgrad"][0], dgrad, block.name, tp_overlap.DGRAD_BULK_SMS) if dgrad \
                else around["dgrad"]
        if trail is None:
            return pieces + [scatter]
        return pieces + (tp_overlap.pipelined if forward else tp_overlap.bulk)(scatter, trail, block.name)

    def _with_context_exchange(self, p: int, cost: LayerCost, block, kind: str,
                               compute: ComputePiece) -> list[Piece]:
        """An attention block's compute with the K/V exchange context parallelism adds around it.

        Ring attention (``context_parallel: ring``, Megatron-LM's) passes K/V
        chunks around the cp ring while each rank computes on the chunk it has:
        the exchange (an all-gather of K/V; in the backward also a
        reduce-scatter of their gradients) overlaps the attention, and the
        block ends when both have. All-gather attention (Llama 3's) gathers K/V
        before computing, and reduce-scatters their gradients after.
        """
        plan = self.plan
        if plan.cp == 1 or not block.kv_width or kind == "W":
            return [compute]
        group, mirrors = self.group(p, "cp")
        nbytes = 2 * shard(block.kv_width, plan.tp, block.kv_unit) * plan.dtype_bytes * plan.tokens_per_microbatch
        direction = {"F": "fwd", "R": "rec"}.get(kind, "bwd")

        def exchange(collective: str) -> CommPiece:
            head, tail = collective_name(collective, "cp", layer=cost.name, mb="|", dir=direction).split("|")
            return CommPiece(head, tail, collective, group, mirrors, nbytes, "cp", beside=True)

        join = compute.join("cp")
        backward = kind in ("B", "I")
        if plan.context_parallel == "ring":
            return [exchange("all_gather"), *([exchange("reduce_scatter")] if backward else []), compute, join]
        return [exchange("all_gather"), join, compute, *([exchange("reduce_scatter"), join] if backward else [])]

    def _compute(self, phase: str, block, kind: str, layer: int
                 ) -> tuple[ComputePiece, tuple[tuple[str, str], ...]]:
        """One block's compute in one pass (see :func:`~parsim.lowering.kernels.block_work`), with the ops an
        eager implementation dispatches for it (:meth:`eager_ops`), and its matmuls' sources."""
        work = block_work(self.plan, block, kind, self.tokens)
        forward_ops, backward_ops = self.eager_ops(block, kind)
        memory_bytes = work.elementwise_bytes + work.quantize_bytes + work.accumulate_bytes
        piece = ComputePiece(work.matmuls, memory_bytes, work.kernels, phase, layer,
                             attention_flops=work.attention_flops,
                             attention_grad_flops=work.attention_grad_flops, forward_ops=forward_ops,
                             backward_ops=backward_ops, tp_calls=self.tp_calls(block, kind),
                             stream_bytes=work.accumulate_bytes, accumulate_elements=work.accumulate_elements,
                             high_precision=work.high_precision, sm_bound=work.sm_bound, weights=block.name)
        return piece, work.sources

    def eager_ops(self, block, kind: str) -> tuple[int, int]:
        """(forward, backward) ops an eager implementation dispatches for ``block`` in a ``kind`` pass
        (:mod:`parsim.lowering.eager_ops`): a recomputed forward dispatches the forward's again; zero-bubble's
        weight-gradient pass runs a few per matmul and the input-gradient pass the rest. The ops around its
        tensor-parallel collectives are their calls' (:meth:`tp_calls`)."""
        forward, backward = eager_ops.held_ops(block.eager_ops, block.eager_ops_per_expert,
                                               self.plan.experts_per_rank, self.plan.ep > 1)
        if kind in ("F", "R"):
            return forward, 0
        weight_grad = eager_ops.WEIGHT_GRAD_OPS * len(block.matmuls)
        return 0, {"B": backward, "I": max(backward - weight_grad, 0), "W": weight_grad}[kind]

    def tp_calls(self, block, kind: str) -> tuple[int, int]:
        """(forward, backward) tensor-parallel and expert collective calls ``block``'s ``kind`` pass makes
        (each one's host time: :meth:`parsim.sim.compute.ComputeModel.host_time`); a weight-gradient pass makes none."""
        degree = {"tp": self.plan.tp, "ep": self.plan.ep}
        forward = kind in ("F", "R")
        calls = 0 if kind == "W" else sum(1 for c in block.collectives if degree[c.group] > 1
                                          and c.phase == ("forward" if forward else "backward"))
        return (calls, 0) if forward else (0, calls)

    # -- pipeline transfers ---------------------------------------------------------
    @_memoized
    def _stage_rank(self, stage: int) -> int:
        return self.plan.rank_of(dp=0, pp=self.schedule.stage_to_rank(stage), tp=0)

    @_memoized
    def _pairs(self, src_stage: int, dst_stage: int) -> tuple[tuple[int, int], tuple[tuple[int, int], ...]]:
        """The representative's (src, dst) ranks and its mirrors' (the other replicas' sends)."""
        plan, sched = self.plan, self.schedule
        a, b = sched.stage_to_rank(src_stage), sched.stage_to_rank(dst_stage)
        grid = plan.rank_grid  # [dp, pp, cp, tp]: the same (dp, cp, tp) position on both pipeline ranks
        pairs = list(zip(grid[:, a].ravel().tolist(), grid[:, b].ravel().tolist()))
        return pairs[0], tuple(pairs[1:])

    def _send(self, rank, what, stage, mb, key, nbytes, after: tuple[int, ...]) -> None:
        dst_stage = stage + 1 if what == "act" else stage - 1
        pair, mirrors = self._pairs(stage, dst_stage)
        peer = pair[1]
        op = Op(p2p_name("send", what, stage, mb, peer), "send", "p2p", deps=after,
                ranks=pair, mirrors=mirrors, nbytes=nbytes, peer=peer, phase="pp")
        if peer == rank:  # both stages on one rank (interleaved, V placement): nothing moves
            op.nbytes, op.ranks, op.mirrors = 0.0, (rank, rank), ()
        self.sends[key] = self._add(rank, op)

    def _recv(self, rank, what, stage, mb, key, nbytes, after: tuple[int, ...] = ()) -> int:
        peer = self._stage_rank(stage)
        op = Op(p2p_name("recv", what, stage, mb, peer), "recv", "compute", deps=after, nbytes=nbytes, peer=peer,
                phase="pp")
        self.pending.append(_Pending(op, key))
        return self._add(rank, op)

    # -- FSDP (ZeRO-3) per layer ------------------------------------------------------
    def _fsdp_gathers(self, stage: int, kind: str, final: bool) -> bool:
        """Whether a ``kind`` pass of ``stage`` all-gathers its weights first. Without a pipeline: every
        forward, and every backward with ``reshard_after_forward`` (FSDP2 reshards after each backward).
        Under a pipeline, as ``torch.distributed.pipelining`` drives FSDP2 (``backward_maybe_with_nosync``
        sets ``reshard_after_backward`` false until ``perform_reduce_grad``): a pass gathers only weights
        resharded since the stage last ran, by a forward with ``reshard_after_forward`` or by the step's
        last backward, so with torchtitan's default (no resharding after a pipeline's forward) a stage
        gathers once a step."""
        if kind == "W":
            return False  # the weight gradients need the activations, not the weights
        if self.plan.pp == 1:
            return kind == "F" or self.plan.reshard_after_forward
        sharded = stage not in self.gathered_stages
        keeps = not (self.plan.reshard_after_forward if kind == "F" else final)
        (self.gathered_stages.add if keeps else self.gathered_stages.discard)(stage)
        return sharded

    def _fsdp_gather(self, rank: int, p: int, stage: int, layer: int, mb: int, kind: str,
                     after: list[int], compute: str) -> int:
        """All-gather one layer's weight shards before its pass; ``after``: the op that must end first
        (the layer two back, so one layer is prefetched while the current one computes). Returns the
        copy-out that follows it on the compute stream (named and phased as the pass, ``compute``).
        A mixture-of-experts layer gathers its routed experts apart, over the ranks holding the same
        experts (torchtitan shards them on that mesh), after the rest over the shard group."""
        cost = self.plan.stage_costs(stage)[layer]
        gathers, moved = [], 0.0
        for experts, dim, nbytes in self._fsdp_parts(p, cost):
            group, mirrors = self.group(p, dim)
            name = collective_name("all_gather", "fsdp", layer=cost.name + (".experts" if experts else ""),
                                   stage=stage, mb=mb, dir="fwd" if kind == "F" else "bwd")
            gathers.append(self._add(rank, Op(name, "collective", self.fsdp_streams[0], deps=tuple(after),
                                              collective="all_gather", group="fsdp", ranks=group, mirrors=mirrors,
                                              nbytes=nbytes, phase="fsdp")))
            moved += 2 * nbytes
        return self._add(rank, self._fsdp_copy(compute, PASS_PHASE[kind], moved, tuple(gathers), UNSHARD_CALL))

    def _fsdp_reduce(self, rank: int, p: int, stage: int, layer: int, mb: int, kind: str, ready: int,
                     compute: str) -> int:
        """Reduce-scatter one layer's gradients once its backward made them (FSDP2 syncs every microbatch;
        under a pipeline after the stage's last backward), after copying them into the collective's input on
        the compute stream (returned);
        with HSDP, all-reduce the shard across the replicas. Routed experts' gradients go over the
        ranks holding the same experts, as their gather does."""
        plan, cost = self.plan, self.plan.stage_costs(stage)[layer]
        parts = self._fsdp_parts(p, cost, gradients=True)
        # The copy-in reads gradients in the weights' dtype and writes the reduce dtype.
        moved = sum(fsdp_bytes(cost, plan, experts=experts) + nbytes for experts, _, nbytes in parts)
        copied = self._add(rank, self._fsdp_copy(compute, PASS_PHASE[kind], moved, (ready,), REDUCE_CALL))
        for experts, dim, nbytes in parts:
            tag = cost.name + (".experts" if experts else "")
            if dim == "edp":  # experts no other rank of the shard group holds: their replicas all-reduce them
                across, deps = "edp", (copied,)
            else:
                group, mirrors = self.group(p, dim)
                op = self._add(rank, Op(collective_name("reduce_scatter", "fsdp", layer=tag, stage=stage, mb=mb),
                                        "collective", self.fsdp_streams[1], deps=(copied,),
                                        collective="reduce_scatter", group="fsdp", ranks=group, mirrors=mirrors,
                                        nbytes=nbytes, phase="fsdp"))
                across, deps = "replicate" if plan.replicas > 1 else None, ()
                nbytes /= plan.expert_shard_size if experts else plan.shard_size
            if across:
                group, mirrors = self.group(p, across)
                op = self._add(rank, Op(collective_name("all_reduce", "fsdp", layer=tag, stage=stage, mb=mb),
                                        "collective", self.fsdp_streams[1], deps=deps, collective="all_reduce",
                                        group="fsdp", ranks=group, mirrors=mirrors, nbytes=nbytes, phase="fsdp"))
            self.fsdp_syncs.append(op)
        return copied

    def _fsdp_parts(self, p: int, cost: LayerCost, gradients: bool = False) -> list[tuple[bool, str, float]]:
        """What FSDP gathers (or with ``gradients`` reduce-scatters) of one layer, group by group: (routed
        experts?, the group dim, bytes on this rank). Routed experts shard over the ranks of a shard group
        that hold the same experts ("eshard"). Experts no other rank of their shard group holds are not
        sharded: nothing of theirs is gathered, and with ``gradients`` their replicas on other shard groups
        (HSDP), if any, all-reduce them ("edp")."""
        plan = self.plan
        parts = [(False, "shard", fsdp_bytes(cost, plan, gradients, experts=False))]
        experts = fsdp_bytes(cost, plan, gradients, experts=True)
        if experts and plan.expert_shard_size > 1:
            parts.append((True, "eshard", experts))
        elif experts and gradients and plan.dp * plan.cp > plan.ep:
            parts.append((True, "edp", experts))
        return parts

    @staticmethod
    def _fsdp_copy(compute: str, phase: str, moved: float, deps: tuple[int, ...],
                   calls: tuple[int, int, int]) -> Op:
        """FSDP2's copy between its flat collective buffer and the layer's tensors, on the compute stream, with
        its hooks' host work around it (``calls``: :attr:`Op.fsdp_calls <parsim.sim.program.Op.fsdp_calls>`):
        after a gather, ``foreach_all_gather_copy_out`` (``split_with_sizes_copy``, from
        ``FSDPParamGroup.wait_for_unshard``); before a reduce-scatter, ``foreach_reduce_scatter_copy_in``
        (``chunk_cat``, in ``foreach_reduce`` before the reduce-scatter stream waits on the compute stream).
        Each reads and writes the layer's bytes once, ``moved`` in all; the copy-in casts the gradients to the
        reduce dtype (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py)."""
        return Op(compute, "compute", "compute", deps=deps, hbm_bytes=moved, kernels=1, phase=phase,
                  stream_bytes=moved, fsdp_calls=calls)

    # -- gradients and optimizer -----------------------------------------------------
    def _gradient_sync_and_step(self, rank: int, p: int) -> None:
        """Data-parallel gradient sync, then AdamW on this rank's parameters (its shard under ZeRO).

        Without ZeRO, gradients are all-reduced (per parameter, or in DDP buckets).
        ZeRO-1/2 reduce-scatter the same buckets over the shard group (HSDP: and
        all-reduce each shard across the replicas), step the optimizer on the
        shard and all-gather the updated weights. ZeRO-3 synced per layer already.
        Routed experts' gradients are synced the same way over the ranks that
        hold the same experts (the expert-data-parallel group; under HSDP,
        sharded over those of the shard group and all-reduced across), in
        buckets of their own (per parameter: numbered after the dense
        tensors), and not at all when each expert lives on one rank only.
        """
        plan = self.plan
        last_compute = self.program.by_rank[rank][-1]
        sync: list[int] = list(self.fsdp_syncs)
        gather: list[tuple[str, int, float]] = []  # ZeRO-1/2 weight all-gathers after the step: (dim, bucket, bytes)
        if plan.grad_sync == "per_param" and plan.dp * plan.cp > 1:  # dense tensors over dp, then experts over edp
            tensors = self._grad_tensors(p)
            expert_replicas = plan.dp * plan.cp // plan.ep  # ranks holding the same experts
            dims = ["dp"] * len(tensors[False]) + ["edp"] * len(tensors[True] if expert_replicas > 1 else [])
            for k, ((nbytes, _), dim) in enumerate(zip(tensors[False] + tensors[True], dims)):
                sync.append(self._dp_collective(rank, p, "all_reduce", dim, nbytes, (last_compute,), param=k))
                self.program.ops[sync[-1]].opens_action = True  # the loop issues one call after another
        elif plan.grad_sync != "per_param":
            for expert, dim, k, nbytes, members in self._sync_buckets(p):
                ready = self.final_grad_ops.get(members[-1], last_compute)
                deps = (ready if plan.overlap else last_compute,)
                tag = {"expert_bucket" if expert else "bucket": k}
                if not plan.zero or dim == "edp":  # no ZeRO, or experts their shard group does not shard
                    sync.append(self._dp_collective(rank, p, "all_reduce", "edp" if expert else "dp",
                                                    nbytes, deps, **tag))
                    self.program.ops[sync[-1]].opens_action = not plan.overlap  # else a hook issues it mid-pass
                    continue
                sync.append(self._dp_collective(rank, p, "reduce_scatter", dim, nbytes, deps, **tag))
                if plan.replicas > 1:  # HSDP: each shard all-reduced across the shard groups
                    sync.append(self._dp_collective(rank, p, "all_reduce", "replicate", nbytes / (
                        plan.expert_shard_size if expert else plan.shard_size), (), **tag))
                if not plan.overlap_param_gather:
                    gather.append((dim, tag, gathered_bytes(plan, nbytes)))
        if plan.sequence_parallel and plan.tp > 1:
            sync.append(self._sequence_parallel_norms(rank, p, tuple(sync) or (last_compute,)))
        if plan.copies_embedding_table and p in (0, plan.pp - 1):
            sync.append(self._tied_table_sum(rank, p, tuple(sync) or (last_compute,)))
        expert_params = plan.expert_params_per_rank(p)
        params = (plan.params_per_rank(p) - expert_params) / plan.shard_size + expert_params / plan.expert_shard_size
        tensors_count = sum(len(param_tensors(c, plan.tp, plan.ep)) for s in plan.stages_of(p)
                            for c in plan.stage_costs(s))
        # What zero_grad frees as the next step starts: every gradient the rank holds (FSDP: its shard).
        held = (plan.params_per_rank(p) - expert_params) / (plan.shard_size if plan.shards_weights else 1) \
            + expert_params / (plan.expert_shard_size if plan.shards_weights else 1)
        self.program.gradients[rank] = (tensors_count, held * plan.dtype_bytes)
        ready = tuple(sync) or (last_compute,)
        if plan.scales_loss:
            ready = (self._reduced_check(rank, p, "unscale grads", "found_inf",
                                         unscale_costs(params, tensors_count, plan.grad_bytes), ready),)
        if plan.grad_clip is not None:
            ready = (self._reduced_check(rank, p, "grad norm", "grad_norm",
                                         clip_costs(params, tensors_count, plan.grad_bytes)[0], ready),)
        step = self._add(rank, Op("optimizer step", "optimizer", "compute", deps=ready, phase="optimizer",
                                  opens_action=True,
                                  fsdp_calls=(0, 0, tensors_count) if plan.shards_weights else (0, 0, 0),
                                  **step_costs(plan.adamw, params, tensors_count, plan.master_weights,
                                               plan.grad_bytes if plan.grad_clip is not None else 0,
                                               plan.moment_bytes)))
        for dim, tag, nbytes in gather:  # ZeRO-1/2: every rank needs the updated weights back
            self._dp_collective(rank, p, "all_gather", dim, nbytes, (step,), **tag)

    def _reduced_check(self, rank: int, p: int, name: str, what: str, costs: dict[str, float],
                       after: tuple[int, ...]) -> int:
        """A check over all the gradients: the rank's own pass ``name`` (clipping's norm, fp16's unscaling and
        overflow check), then one all-reduce of a number (``what``) over each of :func:`grad_norm_dims`. Four
        bytes contend for nothing: the all-reduces are ``negligible``, timed alone (their mirror groups name the
        other replicas' groups, for :func:`parsim.lowering.unfold.unfold`). Returns the last op."""
        last = self._add(rank, Op(name, "compute", "compute", deps=after, phase="optimizer", **costs))
        for dim in grad_norm_dims(self.plan):
            group, mirrors = self.group(p, dim)
            last = self._add(rank, Op(collective_name("all_reduce", what, dim=dim), "collective", "comm",
                                      deps=(last,), collective="all_reduce", group=dim, ranks=group, mirrors=mirrors,
                                      nbytes=FP32, phase="optimizer", negligible=True))
            if dim == "pp":
                self.stage_checks.setdefault(what, []).append(last)
        return last

    def _join_checks_across_stages(self) -> None:
        """The pipeline ranks' all-reduce of a check (:meth:`_reduced_check`) is one collective over simulated
        ranks (:attr:`Op.joins`): it runs once every pipeline rank has reached it, so the ranks that finish their
        backward early wait in it."""
        for ops in self.stage_checks.values():
            for i in ops:
                self.program.ops[i].joins = tuple(j for j in ops if j != i)

    def _grad_tensors(self, p: int) -> dict[bool, list[tuple[float, tuple[int, int]]]]:
        """Pipeline rank ``p``'s gradient tensors in backward order, dense and routed-expert apart:
        (bytes, (stage, layer index))."""
        plan = self.plan
        tensors: dict[bool, list[tuple[float, tuple[int, int]]]] = {False: [], True: []}
        for stage in reversed(plan.stages_of(p)):
            costs = plan.stage_costs(stage)
            for index in reversed(range(len(costs))):
                for n, expert in param_tensors(costs[index], plan.tp, plan.ep):
                    tensors[expert].append((n * plan.grad_bytes, (stage, index)))
        return tensors

    @_memoized
    def _sync_buckets(self, p: int) -> tuple[tuple[bool, str, int, float, tuple[tuple[int, int], ...]], ...]:
        """Pipeline rank ``p``'s gradient buckets in backward order: (expert?, group dim, index, bytes, the
        (stage, layer) of each of its tensors). Empty when nothing syncs: one data-parallel rank, FSDP, or
        experts each living on one rank only."""
        plan = self.plan
        if plan.dp * plan.cp == 1 or self.fsdp:
            return ()
        tensors = self._grad_tensors(p)
        out = []
        experts = "eshard" if plan.expert_shard_size > 1 else "edp"  # sharded, or whole on each rank (all-reduced)
        for expert, dim in ((False, "shard"), (True, experts)):
            if expert and plan.dp * plan.cp // plan.ep == 1:
                continue  # every expert lives on one rank only: nothing to sync
            for k, (nbytes, members) in enumerate(bucket_members(tensors[expert], plan.bucket_size)):
                out.append((expert, dim, k, nbytes, tuple(members)))
        return tuple(out)

    def _prefetch_weights(self, rank: int, p: int) -> dict[tuple[int, int], tuple[int, ...]]:
        """ZeRO-1/2 with ``overlap_param_gather``: the last step's updated weights all-gathered from the start
        of this one, bucket by bucket in the order the forward needs them (Megatron-LM dispatches the
        buckets' all-gathers in reverse bucket order and waits for each in the forward pre-hook of its
        first layer: megatron/core/distributed/distributed_data_parallel.py). Returns, per (stage, layer),
        the gathers its first forward waits for."""
        waits: dict[tuple[int, int], tuple[int, ...]] = {}
        for expert, dim, k, nbytes, members in reversed(self._sync_buckets(p)):
            if dim == "edp":
                continue  # experts their shard group does not shard: nothing to gather
            tag = {"expert_bucket" if expert else "bucket": k}
            op = self._dp_collective(rank, p, "all_gather", dim, gathered_bytes(self.plan, nbytes), (), **tag)
            for member in set(members):
                waits[member] = waits.get(member, ()) + (op,)
        return waits

    def _sequence_parallel_norms(self, rank: int, p: int, after: tuple[int, ...]) -> int:
        """Sum the norm gains' (and row-parallel biases', and routers') gradients over the tp group: under
        sequence parallelism each rank saw only its part of the sequence. Megatron-LM all-reduces them after the
        data-parallel sync, in line on the compute stream (``finalize_model_grads``), where the other tp
        collectives run: no other stream shares their links, so the simulator times them all in closed form."""
        plan = self.plan
        elements = sum(cost.sequence_shard_sums(plan.tp) for s in plan.stages_of(p) for cost in plan.stage_costs(s))
        group, mirrors = self.group(p, "tp")
        return self._add(rank, Op(collective_name("all_reduce", "tp", params="norms"), "collective", "compute",
                                  deps=after, collective="all_reduce", group="tp", ranks=group, mirrors=mirrors,
                                  nbytes=elements * plan.grad_bytes, phase="tp"))

    def _tied_table_sum(self, rank: int, p: int, after: tuple[int, ...]) -> int:
        """Sum the gradients of a tied table's two copies (the embedding's on the first pipeline rank, the
        head's on the last) after the data-parallel sync, as Megatron-LM's ``finalize_model_grads`` does last.

        Each side times the sum from the moment it is ready; the first stage, which finishes its backward
        last under every schedule placing the head elsewhere, sets the step with it."""
        group, mirrors = self.group(p, "embedding")
        return self._add(rank, Op(collective_name("all_reduce", "embedding"), "collective", "comm", deps=after,
                                  collective="all_reduce", group="embedding", ranks=group, mirrors=mirrors,
                                  nbytes=tied_table_bytes(self.plan), phase="dp"))

    def _dp_collective(self, rank: int, p: int, collective: str, dim: str, nbytes: float, deps: tuple,
                       **tags) -> int:
        group, mirrors = self.group(p, dim)
        return self._add(rank, Op(collective_name(collective, "dp", **tags), "collective", "comm", deps=deps,
                                  collective=collective, group="dp", ranks=group, mirrors=mirrors, nbytes=nbytes,
                                  phase="dp"))

    def _stamp(self, rank: int, template: list, name: str, deps: tuple[int, ...], beside_of: int = -1,
               fsdp_passes: tuple[int, int] = (0, 0), pass_starts: tuple[int, int] = (0, 0)) -> int:
        """:meth:`_add` an op from ``template`` (its fields in order, :meth:`_templates`) with its own name, deps,
        the collective it runs beside, FSDP's hooks and the pass it begins: a frontier step stamps hundreds of
        thousands of ops, and positional fields build one three times as fast as keywords."""
        ops, values = self.program.ops, template.copy()
        op_id = len(ops)
        values[_NAME], values[_DEPS], values[_BESIDE_OF], values[_FSDP_PASSES] = name, deps, beside_of, fsdp_passes
        values[_PASS_STARTS] = pass_starts
        values[_ID], values[_RANK] = op_id, rank
        ops.append(Op(*values))
        self.rank_ids.append(op_id)
        return op_id

    def _add(self, rank: int, op: Op) -> int:
        """Append ``op`` to ``rank``'s program (what :meth:`Program.add` does, without its lookups:
        a frontier step adds hundreds of thousands of ops, one rank at a time)."""
        ops = self.program.ops
        op.id, op.rank = len(ops), rank
        ops.append(op)
        self.rank_ids.append(op.id)
        return op.id


OP_FIELDS = tuple(field.name for field in dataclasses.fields(Op))
_NAME, _DEPS, _BESIDE_OF, _FSDP_PASSES, _PASS_STARTS, _ID, _RANK, _STREAM = (
    OP_FIELDS.index(f) for f in ("name", "deps", "beside_of", "fsdp_passes", "pass_starts", "id", "rank", "stream"))
_DONE = object()  # what next() returns for a pass lowered to its end


class _ReadyToSend(NamedTuple):
    """What a paired pass yields before its sends: its last op (None: it issued none)."""

    last: int | None


def _on_stream(template: list, stream: str) -> list:
    """``template`` (:meth:`Lowering._templates`) run on ``stream``."""
    moved = template.copy()
    moved[_STREAM] = stream
    return moved


def fold_joins(pieces: list[Piece]) -> list[Piece]:
    """``pieces`` with each join that compute follows folded into that compute: it waits for the side stream
    itself, as it would for the join (one op fewer to simulate per overlapped collective; the compute stream's
    wait shows the same, as a gap in the pass's span: :func:`parsim.report.step_report.merge_spans`)."""
    folded: list[Piece] = []
    for piece in pieces:
        before = folded[-1] if folded else None
        if (type(piece) is ComputePiece and not piece.joins and type(before) is ComputePiece and before.joins
                and before == piece.join(before.joins)):
            folded[-1] = dataclasses.replace(piece, joins=before.joins)
        else:
            folded.append(piece)
    return folded


def tied_table_bytes(plan: Plan) -> float:
    """What summing a tied table's two copies moves per rank: the head's weight on this tensor-parallel rank (its
    FSDP shard under FSDP), in the reduce dtype."""
    shards = plan.shard_size if plan.shards_weights else 1
    return param_tensors(plan._costs[2], plan.tp)[0][0] / shards * plan.grad_bytes


def gathered_bytes(plan: Plan, bucket_bytes: float) -> float:
    """What ZeRO-1/2's all-gather of a bucket's updated weights moves: the bucket holds gradients (in the
    reduce dtype), the weights come back in their own dtype."""
    return bucket_bytes * plan.dtype_bytes / plan.grad_bytes


def fsdp_bytes(cost: LayerCost, plan: Plan, gradients: bool = False, experts: bool | None = None) -> float:
    """One layer's unsharded weights on a rank, what FSDP gathers, or with ``gradients`` its gradients in the
    reduce dtype, what it reduce-scatters (FSDP2's ``reduce_dtype``: its copy-in casts them). ``experts``:
    only the routed experts' (True; this rank's ``1/ep`` of them) or only the rest (False)."""
    elements = sum(n for n, expert in param_tensors(cost, plan.tp, plan.ep) if experts is None or expert == experts)
    return elements * (plan.grad_bytes if gradients else plan.dtype_bytes)


def param_tensors(cost: LayerCost, tp: int, ep: int = 1) -> list[tuple[int, bool]]:
    """One rank's parameter tensors of a layer (matmul weights, then others): (elements, routed expert?)."""
    sizes = []
    for mm in cost.matmuls:
        if mm.owns_weight:
            k, n = mm.shape_per_rank(tp)
            sizes += [(k * n, mm.experts > 1)] * mm.copies_per_rank(ep)
    return sizes + [(p.numel_per_rank(tp), False) for p in cost.params]


def bucket_members(tensors: list[tuple[float, T]], bucket_size: int) -> list[tuple[float, list[T]]]:
    """DDP-style buckets: gradients in backward order, filled up to ``bucket_size`` bytes; per bucket its
    bytes and its tensors' tags in order. A gradient is never split; one larger than a bucket gets a
    bucket of its own."""
    out: list[tuple[float, list[T]]] = []
    size, members = 0, []
    for nbytes, tag in tensors:
        if size and size + nbytes > bucket_size:
            out.append((size, members))
            size, members = 0, []
        size += nbytes
        members.append(tag)
    if size:
        out.append((size, members))
    return out
