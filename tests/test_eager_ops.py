"""parsim's eager-op counts per block agree with what the executor's modules really dispatch."""

from __future__ import annotations

import importlib.util

import pytest

from parsim.lowering.eager_ops import (MLP_FIRST_LAYER, MLP_LAYER, MOE_DISPATCH, embedding_ops, held_ops,
                                      transformer_layer_ops)
from parsim.workload.model import load_model

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
pytestmark = needs_torch

TINY = {"name": "t", "kind": "transformer", "num_layers": 2, "hidden": 64, "num_heads": 4, "num_kv_heads": 2,
        "ffn_hidden": 256, "ffn_type": "swiglu", "seq_len": 16, "vocab_size": 128, "position_embedding": "rope"}


def counted(fn, x, grad=None) -> tuple[int, int]:
    """(forward, backward) ATen ops of ``fn(x)``; ``x`` is a leaf whose own gradient accumulation is not counted."""
    import torch

    from executor.compute_bench import count_ops

    y, forward = count_ops(lambda: fn(x))
    grad = torch.ones_like(y) if grad is None else grad
    _, backward = count_ops(lambda: torch.autograd.backward(y, grad))
    return forward, backward - (1 if x.requires_grad else 0)


def block_counts(spec: dict) -> dict[str, tuple[int, int]]:
    import torch

    from executor.train.models import build_loss, build_pieces

    model = load_model(spec)
    embedding, layer, head = (build_pieces(model, 0, {n})[0].module for n in ("embedding", "layer.0", "head"))
    x = torch.randn(2, model.seq_len, model.hidden, requires_grad=True)
    ids = torch.randint(0, model.vocab_size, (2, model.seq_len))
    targets = torch.randint(0, model.vocab_size, (2, model.seq_len))
    loss = build_loss(model)
    return {
        "attention": counted(lambda v: v + layer.attn(layer.norm_attn(v)), x),
        "mlp": counted(lambda v: v + layer.mlp(layer.norm_mlp(v)), x),
        "embedding": counted(embedding, ids),
        "head": counted(lambda v: loss(head(v), targets), x),
    }


@pytest.mark.parametrize("variant", [
    {},  # tiny-gpt's shape: RoPE, grouped-query attention, SwiGLU
    {"position_embedding": "learned", "ffn_type": "gelu", "num_kv_heads": 4},  # GPT-2's shape
    {"num_kv_heads": 4}, {"position_embedding": "learned"},
])
def test_transformer_block_counts_match_the_executor(variant):
    spec = {**TINY, **variant}
    model = load_model(spec)
    attention, ffn = transformer_layer_ops(model.position_embedding == "rope", model.ffn_type,
                                           model.num_kv_heads != model.num_heads)
    costs = {b.name: b.eager_ops for c in model.costs(4) for b in c.blocks}
    measured = block_counts(spec)
    expected = {"attention": attention, "mlp": ffn, "embedding": embedding_ops(model.position_embedding == "learned")}
    for name, ops in expected.items():
        assert measured[name] == ops, name
        assert costs[name] == ops, name  # and the model's blocks carry them
    assert costs["head"] == measured["head"]


@pytest.mark.parametrize("variant", [{}, {"q_lora_rank": 0}, {"position_embedding": "learned"}])
def test_latent_attention_counts_match_the_executor(variant):
    spec = {**TINY, "attention": "mla", "num_kv_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 8,
            "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6, **variant}
    model = load_model(spec)
    attention, _ = transformer_layer_ops(model.position_embedding == "rope", model.ffn_type, False, True,
                                         model.q_lora_rank > 0)
    assert block_counts(spec)["attention"] == attention
    assert {b.name: b.eager_ops for c in model.costs(4) for b in c.blocks}["attention"] == attention


def test_course_layer_counts_match_the_executor():
    import torch

    from executor.train.models import build_pieces

    model = load_model("course-mlp")
    layer = build_pieces(model, 0, {"layer.0"})[0].module
    assert counted(layer, torch.randn(4, model.width, requires_grad=True)) == MLP_LAYER
    assert model.costs(4)[1].blocks[0].eager_ops == MLP_LAYER
    # The first layer's input is the data: autograd computes no gradient for it.
    assert counted(layer, torch.randn(4, model.width)) == MLP_FIRST_LAYER
    assert model.costs(4)[0].blocks[0].eager_ops == MLP_FIRST_LAYER


MOE = {**TINY, "num_kv_heads": 4, "num_experts": 4, "experts_per_token": 2, "expert_ffn_hidden": 32}


@pytest.fixture
def one_rank_group():
    """A gloo group of this process alone, for the expert-parallel dispatcher's collectives."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def moe_block_counts(spec: dict, group=None) -> tuple[int, int]:
    """The executor's MoE feed-forward block (layer 1), with its all-to-all dispatcher over ``group`` if given."""
    import torch

    from executor.train.comm import EPGroup
    from executor.train.models import build_pieces
    from executor.train.moe import AllToAllDispatcher
    from executor.train.trace_recorder import Recorder

    model = load_model(spec)
    layer = build_pieces(model, 0, {"layer.1"})[0].module
    if group is not None:
        layer.mlp.dispatcher = AllToAllDispatcher(EPGroup(group, 0, 1, Recorder(0)), "layer.1")
    x = torch.randn(2, model.seq_len, model.hidden, requires_grad=True)
    return counted(lambda v: v + layer.mlp(layer.norm_mlp(v)), x)


@pytest.mark.parametrize("variant", [
    {}, {"num_experts": 8}, {"ffn_type": "gelu"}, {"ffn_type": "gelu", "num_experts": 8}, {"shared_experts": 1},
    {"ffn_type": "gelu", "shared_experts": 2},
])
def test_moe_block_counts_match_the_executor_per_expert_held(variant, one_rank_group):
    """Every routed expert a rank holds runs its own ops (the executor loops over them, rows or none); expert
    parallelism's dispatcher adds its own. One rank holding all experts stands for ep ranks holding E / ep."""
    spec = {**MOE, **variant}
    block = next(b for c in load_model(spec).costs(4) for b in c.blocks if b.name == "moe")
    experts = spec["num_experts"]
    ops = held_ops(block.eager_ops, block.eager_ops_per_expert, experts, False)
    assert moe_block_counts(spec) == ops
    dispatched = held_ops(block.eager_ops, block.eager_ops_per_expert, experts, True)
    assert moe_block_counts(spec, one_rank_group) == dispatched == (ops[0] + MOE_DISPATCH[0], ops[1] + MOE_DISPATCH[1])


def test_an_expert_parallel_rank_dispatches_the_ops_of_its_own_experts():
    """4 experts: ep 2 holds 2 and dispatches, ep 4 holds 1 (before, every rank counted all 4)."""
    from parsim.lowering.lower import Lowering
    from parsim.workload.plan import Plan

    model = load_model(MOE)
    block = next(b for c in model.costs(4) for b in c.blocks if b.name == "moe")
    ops = {ep: Lowering(Plan(model, dp=ep, ep=ep, microbatch_size=1)).eager_ops(block, "F")[0] for ep in (1, 2, 4)}
    per = block.eager_ops_per_expert[0]
    assert ops[1] - ops[2] == 2 * per - MOE_DISPATCH[0] and ops[2] - ops[4] == per
