"""Check a distributed run against the same model trained in one process.

The quality bar of the executor: with the same seed, every rank's loss, the
gradients of every parameter it holds (a shard compared with its slice of the
dense gradient; under ZeRO-1/2 the reduced part the rank owns, under FSDP the
DTensor gathered over its mesh) and, optionally, the parameters after one AdamW step must
equal the single-process reference on the whole global batch, to float
tolerance. :func:`verify_rank` runs on each rank (under
:func:`executor.launch.launch`); the caller asserts on what it returns.
"""

from __future__ import annotations

from typing import Any

from parsim.workload.plan import Plan, load_plan

from .._torch import require_torch
from .context_parallel import sequence_positions
from .fsdp import dense
from .loss_scale import INITIAL_SCALE
from .mixed_precision import MasterWeightsAdamW
from .models import make_batch, reference_model, run_pieces
from .moe import set_capacity
from .parallel import reference_slice, routed_expert_parameters
from .runner import DTYPES, LEARNING_RATE, build_rank

torch = require_torch()

# AdamW's first step moves a weight by lr x g / (|g| + eps): where |g| is within a few eps of zero, a
# gradient equal to the reference's up to float rounding (checked to 1e-5 of the largest) still moves
# the weight by a different fraction of lr. Weights whose reference gradient is below this are left out of
# the comparison after the step.
STEADY_GRAD = 1e-6


def compare_with_reference(plan: Plan, rank: int, seed: int = 0, optimizer_step: bool = False) -> dict:
    """Run one step of ``plan`` on this rank and of the reference here; the largest differences.

    Errors are relative to the largest reference magnitude of the tensor
    compared, so one tolerance fits weights and gradients of any scale.
    ``loss`` is this replica's loss (last-stage ranks only, else None) and
    ``reference_loss`` the reference's on the same rows; ``events`` the names
    of the events the rank recorded, in the order they ended, and ``comm_bytes``
    the bytes of each communication event by name; ``grad_norm`` the global gradient norm the rank's
    clipping found (``reference_grad_norm`` the reference's; None without ``grad_clip``). The routed
    experts' weights (a MoE model) are also reported on their own:
    ``max_expert_grad_error`` over ``expert_params_checked`` of them.
    """
    setup = build_rank(plan, rank, seed)
    setup.recorder.start_step()
    loss = setup.step() if optimizer_step else setup.forward_backward()
    if not optimizer_step and setup.check_gradients() and setup.clipper is not None:  # step() does it all
        setup.clipper.scale()
    setup.settle()
    events = [e.name for e in setup.recorder.events]
    comm_bytes = {e.name: e.args["bytes"] for e in setup.recorder.events if e.kind != "compute" and "bytes" in e.args}

    dtype = DTYPES[plan.dtype]
    pieces, loss_fn = reference_model(plan.model, seed)

    def capped(batch_rows: int) -> None:  # the tokens each rank routes in a call drop over their own capacity
        if plan.capacity_factor is not None:
            set_capacity([p.module for p in pieces], plan.capacity_factor, drop_groups(plan, batch_rows))

    for piece in pieces:
        piece.module.to(dtype)
    inputs, targets = make_batch(plan.model, plan.global_batch_size, seed, dtype)
    coords = plan.coords(rank)
    local = plan.microbatch_size * plan.num_microbatches
    rows = slice(coords.dp * local, (coords.dp + 1) * local)
    with torch.no_grad():
        capped(local)
        local_loss = loss_fn(run_pieces(pieces, inputs[rows]), targets[rows] if targets is not None else None)
    capped(plan.global_batch_size)
    reference_loss = loss_fn(run_pieces(pieces, inputs), targets)
    reference = {p.full_name: p for piece in pieces for p in piece.module.parameters()}
    unique = list({id(p): p for p in reference.values()}.values())
    if plan.scales_loss:  # the same scale the rank's first step uses, divided out as its scaler does
        (reference_loss * INITIAL_SCALE).backward()
        for p in unique:
            p.grad /= INITIAL_SCALE
    else:
        reference_loss.backward()
    reference_norm = None
    if plan.grad_clip is not None:
        reference_norm = torch.nn.utils.clip_grad_norm_(unique, plan.grad_clip).item()
    if optimizer_step:
        adamw = (MasterWeightsAdamW(unique, LEARNING_RATE) if dtype != torch.float32
                 else torch.optim.AdamW(unique, lr=LEARNING_RATE))
        adamw.step()

    grad_error, param_error, expert_error, worst, worst_param = 0.0, 0.0, 0.0, "", ""
    params = setup.parameters()
    experts = {id(p) for p in routed_expert_parameters(list(setup.stages.values()))}
    for p in params:
        full = reference[p.full_name]
        error = _relative(*setup.gradient(p, reference_slice(p, full.grad)))
        if error > grad_error:
            grad_error, worst = error, p.full_name
        if id(p) in experts:
            expert_error = max(expert_error, error)
        grad = None if full.grad is None else reference_slice(p, full.grad)
        steady = None if grad is None else grad.abs() >= STEADY_GRAD
        error = _relative(dense(p.data), reference_slice(p, full.data), steady)
        if error > param_error:
            param_error, worst_param = error, p.full_name
    return {"rank": rank, "plan": plan.name, "loss": loss, "reference_loss": local_loss.item() if loss is not None
            else None, "max_grad_error": grad_error, "worst_grad": worst, "max_param_error": param_error,
            "worst_param": worst_param,
            "params_checked": len(params), "max_expert_grad_error": expert_error,
            "expert_params_checked": len(experts), "events": events, "comm_bytes": comm_bytes,
            "grad_norm": setup.grad_norm, "reference_grad_norm": reference_norm}


def verify_rank(rank: int, world: int, plans: list[dict], seed: int = 0, optimizer_step: bool = False) -> list[dict]:
    """:func:`compare_with_reference` for each plan (given as ``Plan.to_dict()``) in turn, on one rank."""
    return [compare_with_reference(load_plan(data), rank, seed, optimizer_step) for data in plans]


def steps_rank(rank: int, world: int, plans: list[dict], steps: int, seed: int = 0) -> list[dict]:
    """Each plan (``Plan.to_dict()``) trained ``steps`` steps from the same seed on this rank: its loss per
    step (last-stage ranks; else None) and its dense parameters at the end, by full name. Two plans that
    must train alike (an overlap on or off) compare step for step, whatever runs across the step boundary."""
    out = []
    for data in plans:
        setup = build_rank(load_plan(data), rank, seed)
        losses = [setup.step() for _ in range(steps)]
        setup.settle()
        # numpy, not tensors: a tensor crosses to the parent as a shared-memory handle the exiting rank frees
        out.append({"losses": losses,
                    "params": {p.full_name: dense(p.data).detach().cpu().numpy() for p in setup.parameters()}})
    return out


def drop_groups(plan: Plan, batch_rows: int) -> Any:
    """Each token of ``batch_rows`` rows (whole microbatches; flattened batch-major), the group a rank's
    router scores it with: its microbatch's (``microbatch_size`` consecutive rows), its context-parallel
    rank's chunks of the sequence (``sequence_positions``) and, under sequence parallelism, its
    tensor-parallel rank's part of those. Ids count from 0, every group of the same size."""
    seq, cp = plan.model.seq_len, plan.cp
    tp = plan.tp if plan.sequence_parallel else 1
    owner = torch.empty(seq, dtype=torch.long)  # position -> its (cp rank, tp rank) part, numbered
    for c in range(cp):
        positions = sequence_positions(seq, cp, c)
        owner[positions] = c * tp + torch.arange(len(positions)) // (len(positions) // tp)
    microbatch = torch.arange(batch_rows) // plan.microbatch_size
    return (microbatch.unsqueeze(1) * (cp * tp) + owner).flatten()


def _relative(value, reference, only=None) -> float:
    """The largest difference over the largest reference element, over the elements ``only`` marks (all)."""
    if not reference.numel():  # a parameter of which this rank owns no gradient (ZeRO-1/2)
        return 0.0
    scale = reference.abs().max().item() or 1.0
    difference = (value.float() - reference.float()).abs()
    if only is not None:
        difference = difference[only]
    return (difference.max().item() if difference.numel() else 0.0) / scale
