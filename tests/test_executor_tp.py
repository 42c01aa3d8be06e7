"""Tensor parallelism on 2 gloo ranks computes exactly what the dense model computes.

Layer level: the course MLP sharded in the lecture's all-gather style and in
Megatron's column/row style gives the dense output on every rank, and each
rank's weight gradient is its slice of the dense gradient. Plan level: a
whole training step (the MLP all-gather style; the tiny transformer with
Megatron attention, SwiGLU or GeLU, vocabulary-parallel embedding and
cross-entropy) equals the single-process step, with the tensor-parallel
collectives the simulator predicts, by name and count.
"""

from __future__ import annotations

import importlib.util
from collections import Counter

import pytest

from parsim.lowering.lower import lower
from parsim.workload.model import MLPModel
from parsim.workload.plan import load_plan

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
pytestmark = needs_torch

WORLD = 2
MLP = {"kind": "mlp", "name": "mlp", "num_layers": 4, "width": 64, "batch_size": 16}
GPT = {"kind": "transformer", "name": "gpt", "num_layers": 2, "hidden": 32, "num_heads": 4, "num_kv_heads": 2,
       "ffn_hidden": 64, "seq_len": 16, "vocab_size": 64}

PLANS = {
    "course mlp, all-gather": load_plan({"model": MLP, "parallel": {"tp": WORLD}, "tensor_parallel": "allgather"}),
    "transformer, megatron": load_plan({"model": GPT, "parallel": {"tp": WORLD}, "batch": {"microbatch_size": 4}}),
    "transformer, gelu and learned positions, 2 microbatches": load_plan({
        "model": dict(GPT, ffn_type="gelu", position_embedding="learned", vocab_size=63),
        "parallel": {"tp": WORLD}, "batch": {"microbatch_size": 2, "num_microbatches": 2}}),
}


def layer_checks(rank: int, world: int) -> dict[str, tuple[float, float]]:
    """Both styles on the MLP's four layers: (output error, gradient error) relative to the dense model."""
    import torch

    from executor.train.comm import TPGroup
    from executor.train.models import build_loss, build_pieces, make_batch, run_pieces
    from executor.train.parallel import apply_tensor_parallel, reference_slice
    from executor.train.trace_recorder import Recorder

    model = MLPModel("mlp", num_layers=4, width=64, batch_size=16)
    x, _ = make_batch(model, 16, seed=1)
    dense = build_pieces(model, seed=1)
    dense_out = run_pieces(dense, x)
    build_loss(model)(dense_out).backward()
    errors = {}
    for style in ("allgather", "megatron"):
        pieces = build_pieces(model, seed=1)
        tp = TPGroup(torch.distributed.group.WORLD, rank, world, Recorder(rank))
        loss = apply_tensor_parallel(pieces, build_loss(model), model, style, tp)
        out = run_pieces(pieces, x)
        loss(out).backward()
        grad_error = max((p.grad - reference_slice(p, ref.grad)).abs().max().item() / ref.grad.abs().max().item()
                         for piece, ref_piece in zip(pieces, dense)
                         for p, ref in zip(piece.module.parameters(), ref_piece.module.parameters()))
        errors[style] = ((out - dense_out).abs().max().item() / dense_out.abs().max().item(), grad_error)
    return errors


def all_checks(rank: int, world: int, plans: list[dict]) -> tuple[dict, list[dict]]:
    from executor.train.verify import verify_rank

    return layer_checks(rank, world), verify_rank(rank, world, plans, 0, True)


@pytest.fixture(scope="module")
def results() -> list[tuple[dict, list[dict]]]:
    from executor.launch import launch

    return launch(all_checks, WORLD, ([p.to_dict() for p in PLANS.values()],), backend="gloo", timeout_s=120)


@pytest.mark.multiproc
@pytest.mark.parametrize("style", ["allgather", "megatron"])
def test_sharded_layers_give_the_dense_output_and_gradients(results, style):
    for rank, (layers, _) in enumerate(results):
        output_error, grad_error = layers[style]
        assert output_error < 1e-6, f"rank {rank}"
        assert grad_error < 1e-5, f"rank {rank}"


@pytest.mark.multiproc
@pytest.mark.parametrize("name", PLANS)
def test_tensor_parallel_step_equals_single_process(results, name):
    index = list(PLANS).index(name)
    for rank, (_, plans) in enumerate(results):
        r = plans[index]
        assert r["loss"] == pytest.approx(r["reference_loss"], rel=1e-5), f"rank {rank}"
        assert r["max_grad_error"] < 1e-5, f"rank {rank}: {r['worst_grad']}"
        assert r["max_param_error"] < 1e-4, f"rank {rank}"


@pytest.mark.multiproc
@pytest.mark.parametrize("name", PLANS)
def test_collectives_are_the_ones_the_simulator_predicts(results, name):
    plan = PLANS[name]
    predicted = Counter(op.name for op in lower(plan).rank_ops(0) if op.kind == "collective")
    for rank, (_, plans) in enumerate(results):
        measured = Counter(n for n in plans[list(PLANS).index(name)]["events"] if " tp " in n)
        assert measured == predicted, f"rank {rank}"
