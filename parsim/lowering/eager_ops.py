"""How many ops an eager PyTorch implementation dispatches per block: the CPU host's fixed costs.

On a CPU rank running eager PyTorch, a small model's step is mostly fixed
cost per op, not arithmetic: Python, the dispatcher, autograd recording the
graph and allocating outputs, then, in the backward, autograd's engine running
each node's ops. :class:`parsim.sim.compute.ComputeModel` charges
``op_forward_s`` per op of a forward and ``op_backward_s`` per op of a
backward (both measured by ``parsim calibrate`` on generic blocks, never on a
plan); this module says how many ops each block dispatches.

The counts are those of parsim's reference implementation (the executor's
modules in ``executor/train/models.py``), counted with a
``TorchDispatchMode`` on torch 2.13: every ATen op the dispatcher sees,
views included (a view costs its dispatch like any op). The backward counts
are the ops autograd runs for the block, including the accumulation of each
parameter's gradient; ``tests/test_eager_ops.py`` recounts the executor's
modules and checks these tables, so they cannot drift apart unnoticed.

Counts per block and microbatch, independent of the number of tokens (the
forward, then the backward):

* attention block (norm, q/k/v projections, head split, causal SDPA, head
  merge, output projection, residual add): 42, 71; grouped-query attention's
  repeated K/V add 0, 4 (their gradients summed back); RoPE adds 19, 9 per
  rotated tensor (queries and keys: the angles are rebuilt on every call);
* feed-forward block (norm, projections, activation, residual add): SwiGLU
  22, 50; GeLU 17, 38;
* embedding: 1, 2 (learned positions add 3, 4); LM head with its final norm
  and the cross-entropy: 16, 31;
* the lecture's MLP layer (``gelu(x @ W)``): 2, 6; its first layer 2, 4
  (its input is the data, whose gradient autograd does not compute).

Tensor-parallel collectives add a few ops around each (contiguous copies,
views): :data:`TP_COLLECTIVE_OPS` per collective that runs. Mixture-of-experts
blocks are an estimate (routing, a loop over the experts), not pinned by a
test; latent attention (MLA) is not run by the executor and counts 0.
"""

from __future__ import annotations

ATTENTION = (42, 71)
GQA = (0, 4)
ROPE = (19, 9)  # per rotated tensor (queries, keys)
SWIGLU = (22, 50)
GELU_FFN = (17, 38)
EMBEDDING = (1, 2)
LEARNED_POSITIONS = (3, 4)
HEAD = (16, 31)
MLP_LAYER = (2, 6)
MLP_FIRST_LAYER = (2, 4)  # its input is data: no input gradient (its transpose and matmul)
WEIGHT_GRAD_OPS = 3  # per matmul in a split backward's weight-gradient pass: transpose, mm, accumulate
TP_COLLECTIVE_OPS = 3  # contiguous copies, views and the output buffer around each tensor-parallel collective
NORM_AND_RESIDUAL = (8, 18)  # a feed-forward block's RMSNorm and residual add (MoE estimate below)
MOE_ROUTER = (12, 16)  # router matmul, softmax, top-k, sort and index bookkeeping (estimate)
MOE_PER_EXPERT = (20, 44)  # gather the expert's rows, its SwiGLU, scale and index-add back (estimate)


def _add(*counts: tuple[int, int]) -> tuple[int, int]:
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def transformer_layer_ops(rope: bool, ffn_type: str, grouped_query: bool, experts: int = 0,
                          latent_attention: bool = False) -> tuple[tuple[int, int], tuple[int, int]]:
    """(forward, backward) ops of a decoder layer's attention block and of its feed-forward block
    (``experts``: a mixture-of-experts layer with that many experts)."""
    attention = (0, 0) if latent_attention else _add(ATTENTION, GQA if grouped_query else (0, 0),
                                                     *([ROPE, ROPE] if rope else []))
    if experts:
        ffn = _add(NORM_AND_RESIDUAL, MOE_ROUTER, *([MOE_PER_EXPERT] * experts))
    else:
        ffn = SWIGLU if ffn_type == "swiglu" else GELU_FFN
    return attention, ffn


def embedding_ops(learned_positions: bool) -> tuple[int, int]:
    return _add(EMBEDDING, LEARNED_POSITIONS) if learned_positions else EMBEDDING
