"""parsim's eager-op counts per block agree with what the executor's modules really dispatch."""

from __future__ import annotations

import importlib.util

import pytest

from parsim.lowering.eager_ops import MLP_FIRST_LAYER, MLP_LAYER, embedding_ops, transformer_layer_ops
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
