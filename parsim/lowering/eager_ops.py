"""How many ops an eager PyTorch implementation dispatches per block: the CPU host's fixed costs.

On a CPU rank running eager PyTorch, a small model's step is mostly fixed
cost per op, not arithmetic: Python, the dispatcher, autograd recording the
graph and allocating outputs, then, in the backward, autograd's engine running
each node's ops. :class:`parsim.sim.compute.ComputeModel` charges
``op_forward_s`` per op of a forward and ``op_backward_s`` per op of a
backward (both measured by ``parsim calibrate`` on these modules' decoder layers at a
generic size, never on a plan); this module says how many ops each block dispatches.

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

* mixture-of-experts block (norm, router, top-k, softmax of the k logits,
  the (token, choice) rows sorted by expert, gathered and put back, weighted
  and summed, residual add): SwiGLU 32, 51; GeLU 31, 49; then per routed
  expert the rank holds, whether or not rows reach it (executor's loop over
  its experts): SwiGLU 5, 17; GeLU 3, 10; shared experts add SwiGLU 9, 26 or
  GeLU 6, 16; expert parallelism's dispatcher (the counts exchanged, the
  received rows regrouped by local expert and back, two all-to-alls) 26, 9.

* latent attention block (MLA: norm, queries, the latent and its norm, its
  expansion, the heads' split, decoupled RoPE on the queries' and the shared
  key's parts, concatenations, causal SDPA, head merge, output projection,
  residual add): 107, 129; queries through the bottleneck (``q_lora_rank``)
  add 11, 27.

Tensor-parallel collectives add a few ops around each (contiguous copies,
views): :data:`TP_COLLECTIVE_OPS` per collective that runs.
"""

from __future__ import annotations

ATTENTION = (42, 71)
GQA = (0, 4)
MLA = (107, 129)  # latent attention, queries projected directly
MLA_COMPRESSED_QUERIES = (11, 27)  # queries through the q_lora_rank bottleneck: a linear, a norm, a linear
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
MOE = {"swiglu": (32, 51), "gelu": (31, 49)}  # the MoE block without its experts
MOE_PER_EXPERT = {"swiglu": (5, 17), "gelu": (3, 10)}  # per routed expert held: its matmuls and activation
MOE_SHARED = {"swiglu": (9, 26), "gelu": (6, 16)}  # the shared experts' feed-forward
MOE_DISPATCH = (26, 9)  # expert parallelism's all-to-all dispatcher


def _add(*counts: tuple[int, int]) -> tuple[int, int]:
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def transformer_layer_ops(rope: bool, ffn_type: str, grouped_query: bool, latent_attention: bool = False,
                          compressed_queries: bool = False) -> tuple[tuple[int, int], tuple[int, int]]:
    """(forward, backward) ops of a decoder layer's attention block and of its dense feed-forward block."""
    if latent_attention:  # its RoPE is its own, whatever the model's position embedding
        attention = _add(MLA, MLA_COMPRESSED_QUERIES if compressed_queries else (0, 0))
    else:
        attention = _add(ATTENTION, GQA if grouped_query else (0, 0), *([ROPE, ROPE] if rope else []))
    return attention, SWIGLU if ffn_type == "swiglu" else GELU_FFN


def moe_ops(ffn_type: str, shared_experts: bool) -> tuple[tuple[int, int], tuple[int, int]]:
    """A mixture-of-experts block's (forward, backward) ops without its routed experts, and per routed expert."""
    return _add(MOE[ffn_type], MOE_SHARED[ffn_type] if shared_experts else (0, 0)), MOE_PER_EXPERT[ffn_type]


def held_ops(ops: tuple[int, int], per_expert: tuple[int, int], experts_held: int,
             expert_parallel: bool) -> tuple[int, int]:
    """A block's ops on a rank that holds ``experts_held`` of its routed experts (``per_expert`` ops each;
    (0, 0) for a block without experts), with expert parallelism's dispatcher where it is on."""
    if per_expert == (0, 0):
        return ops
    return _add(ops, (per_expert[0] * experts_held, per_expert[1] * experts_held),
                MOE_DISPATCH if expert_parallel else (0, 0))


def embedding_ops(learned_positions: bool) -> tuple[int, int]:
    return _add(EMBEDDING, LEARNED_POSITIONS) if learned_positions else EMBEDDING
