"""Model descriptions as data, and what each layer costs.

Two kinds of model, both frozen dataclasses loadable from YAML
(:func:`load_model`: a preset name, a path, or an inline mapping):

- :class:`MLPModel` — the CS336 lecture's toy MLP: ``num_layers`` layers of
  ``x = gelu(x @ W)`` with ``W`` of shape width x width and no bias, a global
  ``batch_size`` of rows, loss ``x.square().mean()``, trained with AdamW in fp32.
- :class:`TransformerModel` — a GPT-style dense decoder (Llama or GPT-3 shaped):
  pre-norm attention with grouped-query heads, and a SwiGLU (3 matrices) or GeLU
  (2 matrices) feed-forward block. Llama's linears have no biases; GPT-3's and
  Megatron-LM's GPT have them (``linear_bias``), priced as Megatron-LM's layers
  run them. Each norm counts one gain vector (LayerNorm's shift is left out).

Costs are described per token, so a lowering step can price any microbatch
without knowing model internals: :meth:`layer_costs`, :meth:`embedding_cost`
and :meth:`head_cost` return :class:`LayerCost` entries listing parameters,
matmul shapes, attention FLOPs, saved activations and the tensor-parallel
collectives. A "token" is one position of one sequence for a transformer and
one row of the batch for the MLP (:attr:`tokens_per_sample` converts).

FLOP conventions (Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", section 5.1):

- A matmul ``x[m, k] @ W[k, n]`` costs ``2·m·k·n`` FLOPs.
- Attention scores ``Q·Kᵀ`` and the weighted sum ``softmax·V`` cost
  ``2·seq·d_attn`` each per token per layer, ``4·seq·d_attn`` together, with
  ``d_attn = num_heads·head_dim``, counted over the full sequence: no halving
  for the causal mask (as Narayanan et al. and PaLM do).
- Element-wise work (norms, activations, softmax, residuals, the loss) and the
  embedding lookup are not counted as FLOPs; they are memory-bound kernels,
  priced by the bytes they read and write (:class:`Elementwise`).
- Backward costs twice the forward: for a matmul, the input gradient and the
  weight gradient each cost one forward; the attention core has no weights, so
  both of its backward products belong to the input gradient. The split feeds
  zero-bubble schedules (Qi et al. 2023), which run the weight-gradient half
  later. As in the 3x rule, the FLOP counts include the first layer's input
  gradient even where autograd skips it (the MLP's data input needs none);
  the kernels priced for time leave it out (``Block.data_input``).
"""

from __future__ import annotations

import importlib.resources
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping, Union

from ..errors import ConfigError, ParsimError, expected_keys
from ..files import read_yaml
from ..lowering import eager_ops
from ..sim.compute import SmWork
from ..units import parse_size

# Bytes per element of weights, gradients and activations. "fp8" is Transformer Engine's recipe (and
# DeepSeek-V3's): matmuls in fp8 at the fp8 peak, everything else kept and computed in bf16.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}
FFN_TYPES = ("swiglu", "gelu")
ATTENTIONS = ("gqa", "mla")
POSITION_EMBEDDINGS = ("rope", "learned")
# How the attention core runs: "flash" is one fused kernel (FlashAttention, Dao et al. 2022/2023) that
# never writes the scores to memory; "unfused" is Megatron-LM's pre-2022 core attention (baddbmm for
# the scores, a fused scale-mask-softmax, dropout, bmm with V), which writes and rereads them.
ATTENTION_KERNELS = ("flash", "unfused")
# How the loss runs over the vocabulary: "fused" reads the logits once and writes the fp32 softmax its
# backward rereads (Megatron-LM's --cross-entropy-loss-fusion, Liger, TE); "unfused" is Megatron-LM's
# vocab_parallel_cross_entropy on logits cast to fp32 (megatron/mpu/cross_entropy.py, the default before
# the fusion): cast, max, subtract, exp, sum, divide forward; multiply and cast back backward.
CROSS_ENTROPY_KERNELS = ("fused", "unfused", "torch")
# fp32 element accesses per vocabulary entry of the unfused loss beyond reading the logits and writing
# their gradient. Forward: the cast writes 1, max reads 1, sub_ 2, exp 2, sum 1, div_ 2 (9); backward:
# mul_ by the loss gradient 2, the cast back reads 1 (3). 38 and 14 bytes with the fp16 logits.
UNFUSED_CE_FP32_ACCESSES = (9, 3)
# "torch" is F.cross_entropy on logits cast to fp32 (HF transformers, torchtitan, parsim's executor):
# log_softmax writes 1 (its read is the logits'); the backward zero-fills the log-probabilities' gradient
# before scattering the targets' (1) and log_softmax's backward reads 2 (its write is the logits'
# gradient): (1, 3); with 16-bit logits, the cast writes 1 that log_softmax reads (2) and the cast back
# reads 1 that log_softmax's backward wrote (2).
TORCH_CE_FP32_ACCESSES = (1, 3)
TORCH_CE_CAST_ACCESSES = (2, 2)
# A vocabulary row of more fp32 than one block's default shared memory (48 KiB, sharedMemPerBlock) makes
# torch's log_softmax reread its input from memory: cunn_SoftMaxForward reads it for the max, again for the
# sum of exponentials and again to write the output (2 more reads); cunn_SoftMaxBackward reads the gradient
# for its sum and again beside the output (1 more). aten/src/ATen/native/cuda/SoftMax.cu, host_softmax.
SOFTMAX_SMEM_ELEMENTS = 48 * 1024 // 4
LOG_SOFTMAX_REREADS = (2, 1)
# How a layer's memory-bound work around the matmuls and the attention core runs: "fused" is Megatron-LM /
# Transformer Engine's kernels (one pass each for a norm, RoPE, the SwiGLU gate); "eager" is plain PyTorch
# ops, one kernel each (HF transformers' Llama, torchtitan without torch.compile, parsim's executor): RMSNorm
# in fp32 in seven kernels, RoPE by rotate-half and cat, K/V heads copied by repeat_interleave, separate
# projections whose input gradients are added. ``tests/test_eager_kernels.py`` counts the executor's bytes.
LAYER_KERNELS = ("fused", "eager")
SOFTMAX_COST = 20  # FlashAttention's softmax time per score in matmul FLOPs per head-dim unit (flash_softmax_factor)
FLASH_BLOCK = 128  # FlashAttention-2's Q/K tile (Br = Bc = 128 at head dim 128) (causal masking skips whole tiles)
INDEX_BYTES = 8  # token ids are int64
SOFTMAX_BYTES = 4  # the cross-entropy softmax over the vocabulary is kept in fp32
# Selective recompute's modules, as Megatron-LM names them (TransformerConfig.recompute_modules, Megatron Core
# 0.13): "core_attn" reruns the attention core (Korthikanti et al. 2022, the default); "layernorm" the input and
# pre-MLP norms, "mla_up_proj" latent attention's up-projections and their RoPE, "moe_act" the experts'
# activation function, each discarding its output in the forward (Megatron-LM's CheckpointWithoutOutput) and
# rebuilding it before the backward needs it. DeepSeek-V3 recomputes the same three (DeepSeek-V3 Technical
# Report, section 3.2.3). Megatron-LM's "mlp", "moe" and "shared_experts" rerun whole blocks: not modelled.
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mla_up_proj", "moe_act")
# A linear layer's saved input (Activation.linear): kept only for the linear's weight gradient, or kept by
# another op too (FlashAttention keeps its output for its backward, and the output projection its input).
LINEAR_ONLY, LINEAR_ALSO = "only", "also"
# In an fp8 plan a linear keeps its input as the fp8 copy its GEMM read, one byte an element (Transformer Engine's
# _Linear saves the quantized ``inputmat`` for the weight-gradient GEMM: transformer_engine/pytorch/module/
# linear.py); a tensor another op keeps too is then held twice, in bf16 and in fp8.
FP8_SAVED_BYTES = 1
# DeepSeek's fp8 dispatch (DeepSeek-V3 report, section 3.3.2): the tokens sent to their experts, and the gradients
# sent to the experts' down-projections, travel in fp8 with one fp32 scale per 1x128 tile; the combine and the
# dispatch's gradient stay bf16.
FP8_DISPATCHED = ("moe.dispatch", "moe.combine.grad")
FP8_DISPATCH_BYTES = 1 + 4 / 128
# A MoE layer's collectives of its routed rows: the all-to-alls to and from the experts and the expert-tp group's
# gather and scatter of the rows the experts received (the shared experts' are "moe.shared.*").
ROUTED_COLLECTIVES = ("moe.dispatch", "moe.combine", "moe.experts.")
# Before its rows, a dispatch tells each rank how many it will receive: every rank's token count per expert
# (int64), exchanged in a call of its own. Megatron-LM's MoEAlltoAllTokenDispatcher.preprocess all-gathers
# num_local_tokens_per_expert over the expert tp x ep group and copies it to the host; DeepEP's normal dispatch
# runs notify_dispatch; the executor all-to-alls the counts (executor.train.comm.EPGroup). Latency-bound in each.
COUNTS_EXCHANGE = "moe.counts"
COUNT_BYTES = 8


def shard(size: int, tp: int, unit: int = 1) -> int:
    """One rank's share of ``size`` split ``tp`` ways.

    Rounded up, so a vocabulary that ``tp`` does not divide is padded (as
    Megatron-LM pads it); never below ``unit``, so when there are fewer
    key/value heads than ranks each rank keeps one whole head (replicated)
    instead of a fraction of one.
    """
    return min(size, max(-(-size // tp), unit))


# --------------------------------------------------------------------------- costs
@dataclass(frozen=True)
class Matmul:
    """``y[m, n] = x[m, k] @ W[k, n]`` for ``m`` tokens; ``W`` is the weight.

    ``split`` is how tensor parallelism shards ``W``: ``"column"`` splits ``n``
    (each rank computes some output features), ``"row"`` splits ``k`` (each rank
    computes a partial sum over some input features), ``"none"`` replicates it.
    ``owns_weight`` is false for a matmul that reuses another entry's parameters
    (an LM head tied to the embedding table). A routed expert's matmul has
    ``experts`` copies of its weight, of which each token uses ``active``
    (top-k); expert parallelism spreads the copies over ranks.
    ``on_sequence_shard``: a replicated weight applied to the rank's own part of
    the sequence under sequence parallelism (a MoE router, latent attention's
    down-projections: Megatron-LM runs them on each rank's tokens), so its
    gradient is summed over the tp group.
    """

    name: str
    k: int
    n: int
    split: str = "none"
    unit: int = 1
    owns_weight: bool = True
    experts: int = 1
    active: int = 1
    on_sequence_shard: bool = False
    recompute: str = ""  # the selective recompute module (RECOMPUTE_MODULES) that reruns its forward

    @property
    def params(self) -> int:
        return self.experts * self.k * self.n

    @property
    def active_params(self) -> int:
        """Weights one token is multiplied by (its top-k experts' for a routed matmul)."""
        return self.active * self.k * self.n

    def shape_per_rank(self, tp: int = 1) -> tuple[int, int]:
        """``(k, n)`` of one rank's weight shard."""
        if self.split == "column":
            return self.k, shard(self.n, tp, self.unit)
        if self.split == "row":
            return shard(self.k, tp, self.unit), self.n
        return self.k, self.n

    def flops_per_token(self, tp: int = 1) -> int:
        """Forward FLOPs per token on one of ``tp`` ranks: ``2·k·n`` of its shard, per active expert."""
        k, n = self.shape_per_rank(tp)
        return 2 * k * n * self.active

    def copies_per_rank(self, ep: int = 1) -> int:
        """Copies of the weight one rank holds: its ``1/ep`` of the experts (one for a dense matmul)."""
        return self.experts // ep if self.experts > 1 else 1


@dataclass(frozen=True)
class Param:
    """A parameter tensor that is not a matmul weight: a norm gain, a linear's bias or an embedding table.

    ``split="rows"`` shards its rows under tensor parallelism (a vocabulary-
    parallel embedding, a column-parallel linear's bias); ``"none"`` replicates
    it on every rank.
    """

    name: str
    rows: int
    cols: int
    split: str = "none"

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    def numel_per_rank(self, tp: int = 1) -> int:
        rows = shard(self.rows, tp) if self.split == "rows" else self.rows
        return rows * self.cols

    @property
    def sums_over_sequence_shards(self) -> bool:
        """A replicated parameter applied to the activations sequence parallelism splits (a norm's gain, a
        row-parallel linear's bias): each tensor-parallel rank's gradient covers its part of the sequence,
        and Megatron-LM all-reduces them over the group (``finalize_model_grads``)."""
        return self.split == "none" and self.name.startswith(("norm.", "bias."))


@dataclass(frozen=True)
class Activation:
    """A tensor saved in the forward pass for the backward: ``width`` elements per token.

    ``sharded`` tensors are split across tensor-parallel ranks (never below
    ``unit`` elements, one head); the others are replicated on every rank.
    """

    name: str
    width: int
    element_bytes: int
    sharded: bool
    unit: int = 1
    # the selective recompute module (RECOMPUTE_MODULES) that discards this tensor and rebuilds it for the backward
    recompute: str = ""
    # a linear layer's input: LINEAR_ONLY, kept for its weight gradient alone, or LINEAR_ALSO, which another op
    # keeps too (FlashAttention its output); in an fp8 plan the linear keeps its own fp8 copy (FP8_SAVED_BYTES)
    linear: str = ""

    def bytes_per_token(self, tp: int = 1) -> int:
        width = shard(self.width, tp, self.unit) if self.sharded else self.width
        return width * self.element_bytes


POSITIONS = ("before", "dgrad", "after")  # where a block's collectives run in its pass (TPCollective.position)


@dataclass(frozen=True)
class TPCollective:
    """A tensor-parallel collective inside a block; runs only when ``tp > 1``.

    ``op`` is ``"all_reduce"``, ``"all_gather"`` or ``"reduce_scatter"`` (the
    names of :mod:`parsim.report.results`' operations) over the tensor-parallel group.
    ``phase`` is ``"forward"`` or ``"backward"``; ``position`` is ``"before"``
    or ``"after"`` the block's compute in that phase's execution order, or
    ``"dgrad"``: in the backward, before the input-gradient matmuls of the
    block's column-parallel weights (Megatron-LM gathers their input again
    there, beside those matmuls; :class:`parsim.lowering.lower.Lowering`).
    ``bytes_per_token`` is the whole (unsharded) tensor's size per token, the
    nccl-tests convention: for an all-gather, all ranks' chunks together.
    ``fixed_bytes``: bytes every call carries beside those by token (an expert
    dispatch's per-expert token counts). ``regroups``: the tensor is split
    along its last (feature) dimension, so the rank-major collective buffer is
    regrouped by a copy of the whole tensor
    (after an all-gather, ``torch.cat(dim=-1)`` as the lecture and Megatron-LM's
    ``_gather_along_last_dim`` do; before a reduce-scatter, the chunks made
    contiguous).
    """

    name: str
    op: str
    phase: str
    position: str
    bytes_per_token: int
    group: str = "tp"  # "ep": an all-to-all over the expert-parallel group, run only when ep > 1
    regroups: bool = False
    fixed_bytes: int = 0


@dataclass(frozen=True)
class Elementwise:
    """A memory-bound kernel of a block (norm, activation, residual add, softmax, dropout, ...).

    ``forward`` and ``backward`` count the elements it reads plus writes per
    token in each pass (a LayerNorm reads ``h`` and writes ``h``: 2h forward;
    its backward reads the input and the output gradient and writes the input
    gradient: 3h). ``element_bytes`` 0 means the plan's dtype. ``sharded``
    kernels split over tensor-parallel ranks (by whole ``unit`` s); the others
    run replicated on every rank, unless sequence parallelism splits them.
    """

    name: str
    forward: int
    backward: int
    sharded: bool = True
    unit: int = 1
    element_bytes: int = 0
    recompute: str = ""  # the selective recompute module (RECOMPUTE_MODULES) that reruns its forward
    cast: bool = False  # one side of a cast to or from fp32, which an fp32 plan does not run
    # a kernel whose arithmetic the SMs may take longer over than its bytes (parsim.sim.compute.SmWork): "softmax"
    # (forward, over rows of ``row`` entries), "gelu", "norm" or "bias_add" (forward)
    sm_kind: str = ""
    row: int = 0
    # elements per token of a one-byte dropout mask the kernel draws (Philox random numbers) and writes in the
    # forward and reads in the backward
    mask: int = 0
    # elements per token (forward, backward), read or written, of this kernel's eager ops that torch runs through
    # its non-vectorized elementwise loop (an operand broadcast or strided, a cast from bf16 to fp32), priced at
    # the bias add's SM cycles per element (sm_cycles.bias_add: a broadcast add, timed alone); the kernel takes the
    # longer of its bytes and its cycles, and on Hopper these ops' cycles are the longer
    unvectorized: tuple[int, int] = (0, 0)
    # over the rows a rank's routed experts received: the busiest expert's rank runs its share of them
    # (Plan.rank_tokens_factor; parsim.lowering.kernels), as its expert GEMMs do
    routed: bool = False

    def _per_rank(self, elements: int, tp: int, sequence_parallel: bool) -> int:
        split = tp if (self.sharded or sequence_parallel) else 1
        return shard(elements, split, self.unit) if split > 1 else elements

    def bytes_per_token(self, backward: bool, dtype_bytes: int, tp: int = 1, sequence_parallel: bool = False) -> int:
        if self.cast and dtype_bytes == 4:
            return 0
        elements = self._per_rank(self.backward if backward else self.forward, tp, sequence_parallel)
        return elements * (self.element_bytes or dtype_bytes) + self._per_rank(self.mask, tp, sequence_parallel)

    def sm_work(self, tokens: int, backward: bool, dtype_bytes: int, tp: int = 1,
                sequence_parallel: bool = False) -> tuple[SmWork, ...]:
        """The arithmetic of this kernel over ``tokens`` tokens on one rank that may outlast its bytes: none for
        a kernel only its bytes bound, nor for a bias add's backward (a read of the gradient: it streams). A
        softmax's backward streams on a GPU (:meth:`~parsim.sim.compute.ComputeModel.cycles`), not on a CPU core."""
        if self.cast and dtype_bytes == 4:
            return ()
        works = []
        if self.sm_kind and not (backward and self.sm_kind == "bias_add"):
            elements = self._per_rank(self.backward if backward else self.forward, tp, sequence_parallel)
            works.append(SmWork(self.sm_kind, float(tokens * elements), backward, self.row))
        if self.unvectorized[backward]:
            elements = self._per_rank(self.unvectorized[backward], tp, sequence_parallel)
            works.append(SmWork("bias_add", float(tokens * elements)))
        if self.mask and not backward:
            works.append(SmWork("dropout", float(tokens * self._per_rank(self.mask, tp, sequence_parallel))))
        return tuple(works)


@dataclass(frozen=True)
class AttentionCore:
    """The attention core's shape, for the kernels that run it: ``heads`` query heads of
    ``head_dim`` attending over ``seq`` positions with a causal mask, run by ``kernel``
    (one of :data:`ATTENTION_KERNELS`)."""

    heads: int
    head_dim: int
    seq: int
    kernel: str = "flash"

    def executed_fraction(self) -> float:
        """Share of the full ``seq x seq`` score matrix the kernel computes: FlashAttention skips the
        tiles above the causal diagonal, ``(n+1)/2n`` of ``n x n`` tiles; the unfused path computes
        every score and masks after."""
        if self.kernel != "flash":
            return 1.0
        n = -(-self.seq // FLASH_BLOCK)
        return (n + 1) / (2 * n)


def flash_softmax_factor(head_dim: int) -> float:
    """FlashAttention's time per matmul FLOP at ``head_dim`` relative to head dim 128, where its
    efficiency is measured. Per score the kernel does ``4·d`` matmul FLOPs on tensor cores and about
    5 softmax FLOPs (scale, max, subtract, exp, sum) on the FP32 units, 16x slower (Dao 2023,
    FlashAttention-2, section 3.1: A100 312 vs 19.5 TFLOP/s): ``5·16 / 4d = 20/d`` of extra time."""
    return (1 + SOFTMAX_COST / head_dim) / (1 + SOFTMAX_COST / 128)


@dataclass(frozen=True)
class Block:
    """A run of compute between tensor-parallel collectives: attention, MLP, linear, ...

    ``attention_flops_per_token`` is the weightless attention core (scores and
    values); tensor parallelism splits it by heads.
    """

    name: str
    matmuls: tuple[Matmul, ...] = ()
    attention_flops_per_token: int = 0
    collectives: tuple[TPCollective, ...] = ()
    kv_width: int = 0  # K and V elements per token each (attention): what context parallelism exchanges
    kv_unit: int = 1  # tensor parallelism splits K/V by whole heads of this width
    elementwise: tuple[Elementwise, ...] = ()  # its memory-bound kernels
    core: AttentionCore | None = None  # the attention core's shape (attention blocks)
    # Lookup tables (the embedding's) whose backward writes a dense gradient: zeroed, rows scattered into it,
    # then added into the step's sum like a matmul weight's (parsim.lowering.kernels.block_work)
    tables: tuple[Param, ...] = ()
    # (forward, backward) ops an eager PyTorch implementation dispatches for the block, per microbatch
    # (parsim.lowering.eager_ops; the CPU host's fixed costs). (0, 0): not counted. A mixture of experts'
    # block counts its routed experts apart, per expert a rank holds (eager_ops.held_ops).
    eager_ops: tuple[int, int] = (0, 0)
    eager_ops_per_expert: tuple[int, int] = (0, 0)
    # Its input is the model's data (the MLP's first layer): nothing needs that input's gradient, so autograd
    # runs no input-gradient matmul for it (parsim.lowering.kernels.block_work); FLOP counts keep the 3x rule.
    data_input: bool = False

    def forward_flops_per_token(self, tp: int = 1) -> int:
        return sum(m.flops_per_token(tp) for m in self.matmuls) + self.attention_flops_per_token // tp

    def backward_input_flops_per_token(self, tp: int = 1) -> int:
        """Gradients with respect to inputs: one forward per matmul, two per attention core."""
        return sum(m.flops_per_token(tp) for m in self.matmuls) + 2 * self.attention_flops_per_token // tp

    def backward_weight_flops_per_token(self, tp: int = 1) -> int:
        """Gradients with respect to weights: one forward per matmul."""
        return sum(m.flops_per_token(tp) for m in self.matmuls)


@dataclass(frozen=True)
class LayerCost:
    """What one layer (or the embedding, or the LM head) costs, per token.

    ``params`` lists the non-matmul parameters; matmul weights live in the
    blocks. Every ``*_per_token`` method takes the tensor-parallel degree and
    answers for one rank (``tp=1``: the whole layer).
    """

    name: str
    blocks: tuple[Block, ...]
    params: tuple[Param, ...] = ()
    activations: tuple[Activation, ...] = ()
    checkpoint: tuple[Activation, ...] = ()  # what full recomputation keeps: the layer's input (empty: never)

    @property
    def matmuls(self) -> tuple[Matmul, ...]:
        return tuple(m for b in self.blocks for m in b.matmuls)

    @property
    def num_params(self) -> int:
        return sum(m.params for m in self.matmuls if m.owns_weight) + sum(p.numel for p in self.params)

    def sequence_shard_sums(self, tp: int) -> int:
        """Elements of this layer's replicated weights whose gradients sequence parallelism leaves partial on
        each tp rank (norm gains, row-parallel biases, ``on_sequence_shard`` matmuls): Megatron-LM sums them
        over the group (``finalize_model_grads``)."""
        return (sum(p.numel_per_rank(tp) for p in self.params if p.sums_over_sequence_shards)
                + sum(m.k * m.n for m in self.matmuls if m.on_sequence_shard))

    def params_per_rank(self, tp: int = 1, ep: int = 1) -> int:
        owned = 0
        for m in self.matmuls:
            if m.owns_weight:
                k, n = m.shape_per_rank(tp)
                owned += k * n * m.copies_per_rank(ep)
        return owned + sum(p.numel_per_rank(tp) for p in self.params)

    def expert_params_per_rank(self, tp: int = 1, ep: int = 1) -> int:
        """The part of :meth:`params_per_rank` in routed experts (synced over the expert-data-parallel group)."""
        return sum(m.shape_per_rank(tp)[0] * m.shape_per_rank(tp)[1] * m.copies_per_rank(ep)
                   for m in self.matmuls if m.experts > 1)

    def forward_flops_per_token(self, tp: int = 1) -> int:
        return sum(b.forward_flops_per_token(tp) for b in self.blocks)

    def backward_input_flops_per_token(self, tp: int = 1) -> int:
        return sum(b.backward_input_flops_per_token(tp) for b in self.blocks)

    def backward_weight_flops_per_token(self, tp: int = 1) -> int:
        return sum(b.backward_weight_flops_per_token(tp) for b in self.blocks)

    def training_flops_per_token(self, tp: int = 1) -> int:
        """Forward plus both backward halves: three forwards."""
        return (self.forward_flops_per_token(tp) + self.backward_input_flops_per_token(tp)
                + self.backward_weight_flops_per_token(tp))

    def activation_bytes_per_token(self, tp: int = 1) -> int:
        return sum(a.bytes_per_token(tp) for a in self.activations)

    def weight_grad_bytes_per_token(self, tp: int = 1, dtype_bytes: int = 2, sequence_parallel: bool = False) -> int:
        """What a deferred weight-gradient pass (``W``, zero-bubble schedules) keeps per token once the input
        gradients ran: each linear's input (the saved activations a linear reads) and its output's gradient,
        ``dW = x^T dy`` (Qi et al. 2023, table 1: 32sbh of the layer's 34sbh). Under sequence parallelism a
        row-parallel linear's output gradient is kept as the rank's part of the sequence, as its inputs are."""
        inputs = sum(a.bytes_per_token(tp) for a in self.activations if a.linear)
        outputs = 0
        for m in self.matmuls:
            width = m.shape_per_rank(tp)[1]
            if m.split == "row" and sequence_parallel:
                width = shard(width, tp)
            outputs += width * m.active
        return inputs + outputs * dtype_bytes

    def checkpoint_bytes_per_token(self, tp: int = 1) -> int:
        """What the layer keeps per token when its forward is recomputed in the backward."""
        return sum(a.bytes_per_token(tp) for a in self.checkpoint)

    @property
    def recomputable(self) -> bool:
        return bool(self.checkpoint)

    def collectives(self, phase: str) -> list[TPCollective]:
        """The tensor-parallel collectives of ``phase``, in execution order."""
        blocks = self.blocks if phase == "forward" else tuple(reversed(self.blocks))
        ordered = []
        for block in blocks:
            mine = [c for c in block.collectives if c.phase == phase]
            ordered += sorted(mine, key=lambda c: POSITIONS.index(c.position))
        return ordered


# --------------------------------------------------------------------------- models
def _model_flops_per_token(costs: list[LayerCost]) -> int:
    """``6·N_matmul + 12·L·seq·d_attn`` over ``costs`` (:meth:`TransformerModel.model_flops_per_token`)."""
    matmul_params = sum(m.active_params for c in costs for m in c.matmuls)
    attention = sum(b.attention_flops_per_token for c in costs for b in c.blocks)  # 4·seq·d_attn per layer
    return 6 * matmul_params + 3 * attention


class _CostTotals:
    """Whole-model parameters and FLOPs, summed over :meth:`costs`."""

    def costs(self, dtype_bytes: int, tp_style: str | None = None,
              sequence_parallel: bool = False) -> list[LayerCost]:
        """Every cost entry in execution order: embedding, layers, head (where the model has them)."""
        entries = [self.embedding_cost(dtype_bytes, tp_style, sequence_parallel),
                   *self.layer_costs(dtype_bytes, tp_style, sequence_parallel),
                   self.head_cost(dtype_bytes, tp_style, sequence_parallel)]
        return [e for e in entries if e is not None]

    def check_style(self, tp_style: str | None, sequence_parallel: bool = False) -> None:
        """Refuse a tensor-parallel style this model's costs do not describe (None: its own)."""
        if tp_style is not None and tp_style not in self.tp_styles:
            raise ParsimError(f"model {self.name} ({self.kind}) supports tensor_parallel "
                              f"{' or '.join(self.tp_styles)}, not {tp_style!r}")
        if sequence_parallel and not self.sequence_parallel:
            raise ParsimError(f"model {self.name} ({self.kind}) has no sequence-parallel form "
                              f"(it is Megatron's, for transformers)")

    @property
    def throughput_unit(self) -> str:
        """What the model's throughput counts: ``"token"``, or ``"sample"`` for the MLP (its rows)."""
        return "token" if self.tokens_per_sample > 1 else "sample"

    @property
    def num_params(self) -> int:
        """Total parameters (FLOPs and parameter counts do not depend on the dtype)."""
        return sum(c.num_params for c in self.costs(1))

    def computed(self) -> list:
        """Every cost entry a training step computes: :meth:`costs`, and whatever trains beside the model its
        parameter count describes (a transformer's multi-token prediction modules)."""
        return self.costs(1)

    def forward_flops_per_token(self) -> int:
        return sum(c.forward_flops_per_token() for c in self.computed())

    def backward_flops_per_token(self) -> tuple[int, int]:
        """``(input-gradient, weight-gradient)`` FLOPs per token; together twice the forward."""
        costs = self.computed()
        return (sum(c.backward_input_flops_per_token() for c in costs),
                sum(c.backward_weight_flops_per_token() for c in costs))

    def training_flops_per_token(self) -> int:
        """Forward + backward: 3x the forward FLOPs (no activation recomputation)."""
        return self.forward_flops_per_token() + sum(self.backward_flops_per_token())


@dataclass(frozen=True)
class MLPModel(_CostTotals):
    """The CS336 lecture's MLP: ``num_layers`` x ``x = gelu(x @ W)``, W width x width, no bias.

    ``batch_size`` is the global batch in rows; the loss is ``x.square().mean()``
    and the optimizer AdamW, in fp32 as in the lecture. Tensor parallelism
    follows the lecture ("allgather"): each rank holds a column shard
    ``W[:, r·width/tp : (r+1)·width/tp]``, computes its slice of the output,
    and all-gathers the slices after every layer; autograd turns that all-gather
    into a reduce-scatter of the gradient in the backward.
    """

    name: str
    num_layers: int
    width: int
    batch_size: int
    description: str = ""
    dtype: str = "fp32"  # the precision a plan trains it in unless it says (Hugging Face config.json's torch_dtype)
    source: str = field(default="", compare=False)  # the file it came from, for messages

    kind = "mlp"
    # How the executor stores a weight (executor/train/models.py): CourseLinear's W[in, out], read as is by the
    # forward's x @ W, through a transposed view by the input gradient's dY @ W.T (Lowering._cache_reads).
    forward_reads_stored_layout = True
    tp_styles = ("allgather",)
    sequence_parallel = False
    is_moe = False
    attention = "none"  # the lecture's layers have no attention
    tokens_per_sample = 1

    def __post_init__(self) -> None:
        for key in ("num_layers", "width", "batch_size"):
            _check_positive(self, key)

    @property
    def params_per_layer(self) -> int:
        return self.width * self.width

    def tp_sharded_sizes(self) -> dict[str, int]:
        """Sizes tensor parallelism must divide."""
        return {"width": self.width}

    def layer_costs(self, dtype_bytes: int, tp_style: str | None = None,
                    sequence_parallel: bool = False) -> list[LayerCost]:
        """One entry per layer.

        Saved for backward per row: the layer's input (for the weight gradient,
        replicated under TP since every rank holds the gathered input) and the
        pre-activation (for gelu's backward, sharded). Recomputation keeps the input.
        """
        self.check_style(tp_style, sequence_parallel)
        w, d = self.width, dtype_bytes
        gelu = Elementwise("gelu", 2 * w, 3 * w, sm_kind="gelu")
        block = Block("linear", (Matmul("w", w, w, "column"),), elementwise=(gelu,), collectives=(
            TPCollective("out", "all_gather", "forward", "after", w * d, regroups=True),
            TPCollective("out.grad", "reduce_scatter", "backward", "before", w * d, regroups=True),
        ), eager_ops=eager_ops.MLP_LAYER)
        first = replace(block, data_input=True, eager_ops=eager_ops.MLP_FIRST_LAYER)
        saved = (Activation("in", w, d, sharded=False), Activation("pre_gelu", w, d, sharded=True))
        return [LayerCost(f"layer.{i}", (first if i == 0 else block,), activations=saved, checkpoint=saved[:1])
                for i in range(self.num_layers)]

    def embedding_cost(self, dtype_bytes: int, tp_style: str | None = None, sequence_parallel: bool = False) -> None:
        """The MLP reads its input directly: no embedding."""
        return None

    def head_cost(self, dtype_bytes: int, tp_style: str | None = None, sequence_parallel: bool = False,
                  copies_table: bool = False) -> None:
        """The MLP's loss works on the last layer's output: no head."""
        return None

    def model_flops_per_token(self) -> int:
        """FLOPs per row for MFU: ``6·N`` (forward 2·N, backward 4·N), N = num_layers·width²."""
        return 6 * self.num_params

    def describe(self) -> str:
        return (f"{self.name} (mlp): {self.num_layers} layers of width {self.width}, "
                f"batch {self.batch_size}")

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)


@dataclass(frozen=True)
class TransformerModel(_CostTotals):
    """A GPT-style dense decoder: embedding, ``num_layers`` pre-norm blocks, final norm, LM head.

    ``head_dim = hidden / num_heads``; queries have ``num_heads`` heads, keys
    and values ``num_kv_heads`` (grouped-query attention; equal for multi-head).
    ``ffn_type`` "swiglu" has gate, up and down matrices, "gelu" two. Learned
    position embeddings (GPT-3) add ``seq_len x hidden`` parameters; RoPE none.
    Tensor parallelism is Megatron-LM's (Shoeybi et al. 2019): column-parallel
    Q/K/V and gate/up, row-parallel output and down projections, so each block
    ends in an all-reduce of the activations in the forward and starts with one
    of their gradient in the backward.
    """

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    ffn_hidden: int
    seq_len: int
    vocab_size: int
    num_kv_heads: int | None = None  # None: as many as num_heads (multi-head attention)
    ffn_type: str = "swiglu"
    tied_embeddings: bool = False
    position_embedding: str = "rope"
    attention: str = "gqa"  # "gqa" (multi-/grouped-query) or "mla" (DeepSeek's multi-head latent attention)
    q_lora_rank: int = 0  # MLA: the queries' compressed width (0: queries are not compressed)
    kv_lora_rank: int = 512  # MLA: the keys' and values' shared compressed width
    qk_nope_head_dim: int = 128  # MLA: per-head query/key width without position encoding
    qk_rope_head_dim: int = 64  # MLA: per-head query/key width carrying RoPE (the key part shared by all heads)
    v_head_dim: int = 128  # MLA: per-head value width
    num_experts: int = 0  # routed experts per MoE layer (0: a dense model)
    experts_per_token: int = 2  # top-k
    expert_ffn_hidden: int | None = None  # each expert's feed-forward size (None: ffn_hidden)
    shared_experts: int = 0  # experts every token also goes through (DeepSeek's)
    dense_layers: int = 0  # the first layers keep a dense feed-forward of ffn_hidden (DeepSeek-V3: 3)
    # a token's experts lie on at most this many of the expert-parallel nodes (0: any): DeepSeek-V3's
    # node-limited routing (M = 4), which DeepEP's dispatch turns into fewer bytes across the network
    max_routed_nodes: int = 0
    # multi-token prediction modules after the last layer, each predicting one token further (DeepSeek-V3: 1;
    # Hugging Face num_nextn_predict_layers, Megatron-LM --mtp-num-layers): mtp_costs
    mtp_layers: int = 0
    attention_kernel: str = "flash"  # how the attention core runs (see ATTENTION_KERNELS)
    dropout: float = 0.0  # dropout probability (GPT-3 and Megatron-LM's GPT: 0.1; Llama: none)
    cross_entropy: str = "fused"  # how the loss runs (see CROSS_ENTROPY_KERNELS)
    layer_kernels: str = "fused"  # how norms, RoPE and activations run (see LAYER_KERNELS)
    linear_bias: bool = False  # the layers' linears add biases (GPT-3, Megatron-LM's GPT; Llama: none)
    description: str = ""
    dtype: str = "fp32"  # the precision a plan trains it in unless it says (Hugging Face config.json's torch_dtype)
    source: str = field(default="", compare=False)  # the file it came from, for messages

    kind = "transformer"
    # nn.Linear's W[out, in]: the forward reads it transposed (x @ W.T), the input gradient as stored (dY @ W)
    forward_reads_stored_layout = False
    tp_styles = ("megatron",)
    sequence_parallel = True

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        for key in ("num_layers", "hidden", "num_heads", "num_kv_heads", "ffn_hidden", "seq_len", "vocab_size",
                    "experts_per_token", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _check_positive(self, key)
        for key in ("num_experts", "shared_experts", "dense_layers", "q_lora_rank", "max_routed_nodes",
                    "mtp_layers"):  # 0: not used
            _check_positive(self, key, low=0)
        if self.ffn_type not in FFN_TYPES:
            _fail(self, "ffn_type", f"is {self.ffn_type!r}", " or ".join(FFN_TYPES))
        if self.position_embedding not in POSITION_EMBEDDINGS:
            _fail(self, "position_embedding", f"is {self.position_embedding!r}", " or ".join(POSITION_EMBEDDINGS))
        if self.hidden % self.num_heads:
            _fail(self, "num_heads", f"{self.num_heads} does not divide hidden {self.hidden}",
                  "a divisor of hidden, giving head_dim = hidden / num_heads")
        if self.num_heads % self.num_kv_heads:
            _fail(self, "num_kv_heads", f"{self.num_kv_heads} does not divide num_heads {self.num_heads}",
                  "a divisor of num_heads (grouped-query attention)")
        if self.attention not in ATTENTIONS:
            _fail(self, "attention", f"is {self.attention!r}", " or ".join(ATTENTIONS))
        if self.attention_kernel not in ATTENTION_KERNELS:
            _fail(self, "attention_kernel", f"is {self.attention_kernel!r}", " or ".join(ATTENTION_KERNELS))
        if self.attention_kernel == "unfused" and self.attention == "mla":
            _fail(self, "attention_kernel", "unfused is not modelled for latent attention (mla)", "flash")
        if self.cross_entropy not in CROSS_ENTROPY_KERNELS:
            _fail(self, "cross_entropy", f"is {self.cross_entropy!r}", " or ".join(CROSS_ENTROPY_KERNELS))
        if self.layer_kernels not in LAYER_KERNELS:
            _fail(self, "layer_kernels", f"is {self.layer_kernels!r}", " or ".join(LAYER_KERNELS))
        if self.layer_kernels == "eager" and (self.attention == "mla" or self.attention_kernel == "unfused"):
            _fail(self, "layer_kernels", "eager is modelled for grouped-query flash attention only", "fused")
        if self.linear_bias and (self.attention == "mla" or self.num_experts):
            _fail(self, "linear_bias", "is modelled for dense layers of grouped-query attention",
                  "false with attention mla or num_experts")
        if not 0 <= self.dropout < 1:
            _fail(self, "dropout", f"is {self.dropout!r}", "a probability in [0, 1)")
        if self.expert_ffn_hidden is None:
            object.__setattr__(self, "expert_ffn_hidden", self.ffn_hidden)
        _check_positive(self, "expert_ffn_hidden")
        if self.num_experts:
            if self.num_experts < 2:
                _fail(self, "num_experts", f"is {self.num_experts}", "0 (dense) or at least 2 routed experts")
            if not 1 <= self.experts_per_token <= self.num_experts:
                _fail(self, "experts_per_token", f"is {self.experts_per_token}",
                      f"between 1 and num_experts {self.num_experts}")
            if not 0 <= self.dense_layers < self.num_layers:
                _fail(self, "dense_layers", f"is {self.dense_layers}", f"0 to {self.num_layers - 1}")

    @property
    def tokens_per_sample(self) -> int:
        return self.seq_len

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def params_per_layer(self) -> int:
        """Q, K, V, O, the feed-forward matrices, two norm gains and any biases."""
        return self._layer(1).num_params

    @property
    def embedding_params(self) -> int:
        return self.embedding_cost(1).num_params

    @property
    def head_params(self) -> int:
        """The final norm plus the LM head (zero extra when tied to the embedding)."""
        return self.head_cost(1).num_params

    def tp_sharded_sizes(self) -> dict[str, int]:
        """Sizes tensor parallelism must divide (key/value heads have their own rule)."""
        sizes = {"num_heads": self.num_heads, "hidden": self.hidden, "ffn_hidden": self.ffn_hidden}
        if self.num_experts:
            sizes["expert_ffn_hidden"] = self.expert_ffn_hidden
        return sizes

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    def layer_costs(self, dtype_bytes: int, tp_style: str | None = None,
                    sequence_parallel: bool = False) -> list[LayerCost]:
        """One entry per decoder layer (all alike).

        Saved activations per token (bytes = width x ``dtype_bytes``): the two
        norm inputs, the attention input, Q, K, V, the output projection's
        input, the MLP input, and the feed-forward intermediates (SwiGLU: gate
        output, up output, down input; GeLU: fc1 output, fc2 input). This is
        Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
        Transformer Models", section 4.1) with flash attention (no ``5·a·s``
        score and softmax terms) and no dropout: for GPT-3's shapes at 2 bytes
        it is ``32·h`` per token, their ``34·h`` less the two dropout masks.
        Flash attention's per-head softmax statistics (fp32) are left out.
        Under TP without sequence parallelism the norm inputs and block inputs
        are replicated and the rest is split, as in their ``10 + 24/t`` count;
        with it (section 4.2.2) every term is split: ``32·h/t``. Full
        recomputation keeps only the layer's input (``2·h``, split under SP).

        Sequence parallelism replaces each block's all-reduce by an all-gather
        of its input and a reduce-scatter of its output (the same bytes on the
        wire), in the forward and, mirrored, in the backward. Megatron-LM also
        all-gathers a block's input again for the weight gradients (the
        forward keeps only its part of the sequence), beside the input-gradient
        matmuls.
        """
        self.check_style(tp_style, sequence_parallel)
        # Cached on the instance (a search builds thousands of plans of one model), as cached_property does
        cache = self.__dict__.setdefault("_layer_costs", {})
        key = (dtype_bytes, sequence_parallel)
        if key not in cache:
            dense = self._layer(dtype_bytes, sequence_parallel)
            moe = self._layer(dtype_bytes, sequence_parallel, moe=True) if self.is_moe else dense
            cache[key] = tuple(LayerCost(f"layer.{i}", layer.blocks, layer.params, layer.activations, layer.checkpoint)
                               for i, layer in ((i, dense if i < self.dense_layers else moe)
                                                for i in range(self.num_layers)))
        return list(cache[key])

    def _layer(self, d: int, sequence_parallel: bool = False, moe: bool = False) -> LayerCost:
        h, f, hd = self.hidden, self.ffn_hidden, self.head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        sp = sequence_parallel
        attention_ops, ffn_ops = eager_ops.transformer_layer_ops(
            self.position_embedding == "rope", self.ffn_type, self.num_kv_heads != self.num_heads,
            self.attention == "mla", self.q_lora_rank > 0)
        if self.attention == "mla":
            attention, attention_saved, attention_params = self._mla_block(d, sp, attention_ops)
        else:
            core = AttentionCore(self.num_heads, hd, self.seq_len, self.attention_kernel)
            attention = Block(
                "attention",
                (Matmul("attn.q", h, q, "column", hd), Matmul("attn.k", h, kv, "column", hd),
                 Matmul("attn.v", h, kv, "column", hd), Matmul("attn.o", q, h, "row", hd)),
                attention_flops_per_token=4 * self.seq_len * q,
                collectives=_block_collectives("attn", h * d, sequence_parallel),
                kv_width=kv, kv_unit=hd, elementwise=self._attention_kernels(q, kv, hd), core=core,
                eager_ops=attention_ops,
            )
            attention_saved = (
                Activation("attn.q", q, d, sharded=True, unit=hd), Activation("attn.k", kv, d, sharded=True, unit=hd),
                Activation("attn.v", kv, d, sharded=True, unit=hd),
                Activation("attn.o.in", q, d, sharded=True, unit=hd, linear=self._core_output_kept),
                *self._score_activations(d))
            attention_params = ()
        if moe:
            mlp, ffn_saved = self._moe_block(d)
        else:
            ffn, intermediates = _ffn("mlp", h, f, self.ffn_type)
            mlp = Block("mlp", ffn, collectives=_block_collectives("mlp", h * d, sequence_parallel),
                        elementwise=self._mlp_kernels(f), eager_ops=ffn_ops)
            ffn_saved = _ffn_saved(intermediates, f, d)
        # The norms' outputs are the next linears' inputs; selective recompute of "layernorm" reruns the norms
        saved = (
            Activation("norm.attn.in", h, d, sharded=sp),
            Activation("attn.in", h, d, sharded=sp, recompute="layernorm", linear=LINEAR_ONLY),
            *attention_saved,
            Activation("norm.mlp.in", h, d, sharded=sp),
            Activation("mlp.in", h, d, sharded=sp, recompute="layernorm", linear=LINEAR_ONLY),
            *ffn_saved,
        )
        params = (Param("norm.attn", 1, h), Param("norm.mlp", 1, h), *attention_params, *self._biases(q, kv, f))
        return LayerCost("layer", (attention, mlp), params, saved, checkpoint=saved[:1])

    def _biases(self, q: int, kv: int, f: int) -> tuple[Param, ...]:
        """The linears' biases: a column-parallel linear's splits with its outputs; a row-parallel linear's is
        whole on every tensor-parallel rank, added after the partial outputs are summed (Megatron-LM's
        ``RowParallelLinear``)."""
        if not self.linear_bias:
            return ()
        h = self.hidden
        return (Param("bias.attn.qkv", q + 2 * kv, 1, "rows"), Param("bias.attn.o", h, 1),
                Param("bias.mlp.in", self._ffn_in(f), 1, "rows"), Param("bias.mlp.out", h, 1))

    def _ffn_in(self, f: int) -> int:
        """The column-parallel feed-forward matmuls' outputs per token: SwiGLU's gate and up, or fc1."""
        return 2 * f if self.ffn_type == "swiglu" else f

    def _mla_block(self, d: int, sp: bool, eager_ops: tuple[int, int]) -> tuple[Block, tuple[Activation, ...],
                                                                             tuple[Param, ...]]:
        """DeepSeek's multi-head latent attention (DeepSeek-AI 2024, DeepSeek-V2 section 2.1), by its
        matmuls and FLOPs: queries (optionally through a ``q_lora_rank`` bottleneck), keys and values
        from one ``kv_lora_rank`` latent plus a shared RoPE key, per-head widths ``qk_nope + qk_rope``
        for queries and keys and ``v_head_dim`` for values.

        Tensor parallelism splits the per-head up-projections and the output by heads, as Megatron-LM's
        ``MultiLatentAttention`` does; the down-projections are duplicated on every rank (``TELinear``
        ``parallel_mode="duplicated"``). With sequence parallelism they run on the rank's part of the
        sequence (their gradients summed over tp like the norms'), and the tp group all-gathers the shared
        RoPE key, the normed query latent (or, uncompressed, the block input) and the normed key/value
        latent before the up-projections; the output is reduce-scattered. Without it each up-projection's
        input gradient is all-reduced (Megatron-LM's column-parallel ``f``), and the output all-reduced.
        """
        h, nh = self.hidden, self.num_heads
        qk, v = self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
        latent = self.kv_lora_rank + self.qk_rope_head_dim
        up = "mla_up_proj"  # the up-projections, rerun under that selective recompute module
        if self.q_lora_rank:
            queries = (Matmul("attn.q_a", h, self.q_lora_rank, on_sequence_shard=True),
                       Matmul("attn.q_b", self.q_lora_rank, nh * qk, "column", qk, recompute=up))
        else:
            queries = (Matmul("attn.q", h, nh * qk, "column", qk, recompute=up),)
        matmuls = (*queries, Matmul("attn.kv_a", h, latent, on_sequence_shard=True),
                   Matmul("attn.kv_b", self.kv_lora_rank, nh * (self.qk_nope_head_dim + v), "column",
                          self.qk_nope_head_dim + v, recompute=up),
                   Matmul("attn.o", nh * v, h, "row", v))
        block = Block("attention", matmuls, attention_flops_per_token=2 * self.seq_len * nh * (qk + v),
                      collectives=self._mla_collectives(d, sp), kv_width=nh * (qk + v) // 2,
                      kv_unit=(qk + v) // 2, elementwise=self._attention_kernels(nh * qk, nh * (qk + v) // 2, qk),
                      core=AttentionCore(nh, (qk + v) // 2, self.seq_len, self.attention_kernel),
                      eager_ops=eager_ops)
        saved = (*((Activation("attn.q_a.out", self.q_lora_rank, d, sharded=sp),) if self.q_lora_rank else ()),
                 Activation("attn.kv_a.out", latent, d, sharded=sp),
                 Activation("attn.q", nh * qk, d, sharded=True, unit=qk, recompute=up),
                 Activation("attn.k", nh * qk, d, sharded=True, unit=qk, recompute=up),
                 Activation("attn.v", nh * v, d, sharded=True, unit=v, recompute=up),
                 Activation("attn.o.in", nh * v, d, sharded=True, unit=v, linear=self._core_output_kept))
        norms = ((Param("norm.q_a", 1, self.q_lora_rank),) if self.q_lora_rank else ()) + \
            (Param("norm.kv_a", 1, self.kv_lora_rank),)
        return block, saved, norms

    def _mla_collectives(self, d: int, sp: bool) -> tuple[TPCollective, ...]:
        """Latent attention's tensor-parallel collectives (see :meth:`_mla_block`), in Megatron-LM's order:
        forward, the RoPE key's gather (right after the down-projections), the queries' and the latent's (in
        their up-projections); backward, autograd's reverse."""
        rope, queries, latent, out = (w * d for w in (self.qk_rope_head_dim, self.q_lora_rank or self.hidden,
                                                       self.kv_lora_rank, self.hidden))
        if not sp:
            return (TPCollective("attn.out", "all_reduce", "forward", "after", out),
                    TPCollective("attn.kv_b.in.grad", "all_reduce", "backward", "after", latent),
                    TPCollective("attn.q.in.grad", "all_reduce", "backward", "after", queries))
        return (TPCollective("attn.k_rope", "all_gather", "forward", "before", rope),
                TPCollective("attn.q.in", "all_gather", "forward", "before", queries),
                TPCollective("attn.kv_b.in", "all_gather", "forward", "before", latent),
                TPCollective("attn.out", "reduce_scatter", "forward", "after", out),
                TPCollective("attn.out.grad", "all_gather", "backward", "before", out),
                TPCollective("attn.kv_b.in.grad", "reduce_scatter", "backward", "after", latent),
                TPCollective("attn.q.in.grad", "reduce_scatter", "backward", "after", queries),
                TPCollective("attn.k_rope.grad", "reduce_scatter", "backward", "after", rope))

    def _moe_block(self, d: int) -> tuple[Block, tuple[Activation, ...]]:
        """A mixture-of-experts feed-forward: a router picks ``experts_per_token`` of ``num_experts``
        experts per token (plus the shared experts every token uses).

        Under expert parallelism each token's hidden state goes to the ranks of
        its experts and back: an all-to-all (dispatch) before the experts and
        one (combine) after, in the forward and mirrored in the backward; each
        moves ``top-k x hidden`` elements per token. Saved: the dispatched
        tokens and each routed and shared expert's intermediates.

        With tensor parallelism (and the sequence parallelism Megatron-LM then
        requires) each rank routes and dispatches its own part of the sequence;
        the tp group all-gathers the rows its experts received, runs its slice
        of every expert (gate/up split by columns, down by rows) on all of them,
        and reduce-scatters the partial outputs back to the rows each rank
        received before the combine (Megatron-LM's ``MoEAlltoAllTokenDispatcher``:
        ``dispatch_postprocess`` and ``combine_preprocess`` over the expert
        tensor-parallel group, which is the tp group by default). Shared experts
        are a tensor-parallel feed-forward with an all-gather of the block's
        input and a reduce-scatter of their output (``SharedExpertMLP``).
        """
        h, fe, k, e = self.hidden, self.expert_ffn_hidden, self.experts_per_token, self.num_experts
        routed, intermediates = _ffn("moe.expert", h, fe, self.ffn_type, experts=e, active=k)
        matmuls = (Matmul("moe.router", h, e, on_sequence_shard=True), *routed)
        saved = [Activation("moe.dispatched", k * h, d, sharded=False, linear=LINEAR_ONLY),
                 *_ffn_saved(intermediates, k * fe, d, "moe_act")]
        if self.shared_experts:
            shared, names = _ffn("moe.shared", h, self.shared_experts * fe, self.ffn_type)
            matmuls += shared
            saved += _ffn_saved(names, self.shared_experts * fe, d, "moe_act")
        routed_rows, block_input = k * h * d, h * d  # bytes per token: its k routed rows; its hidden state

        def shared_collective(name: str, op: str, phase: str, position: str) -> tuple[TPCollective, ...]:
            return (TPCollective(name, op, phase, position, block_input),) if self.shared_experts else ()

        collectives = (  # in Megatron-LM's order: the shared experts first, then route, dispatch, run, combine
            *shared_collective("moe.shared.in", "all_gather", "forward", "before"),
            *shared_collective("moe.shared.out", "reduce_scatter", "forward", "before"),
            TPCollective(COUNTS_EXCHANGE, "all_to_all", "forward", "before", 0, group="ep",
                         fixed_bytes=e * COUNT_BYTES),
            TPCollective("moe.dispatch", "all_to_all", "forward", "before", routed_rows, group="ep"),
            TPCollective("moe.experts.in", "all_gather", "forward", "before", routed_rows),
            TPCollective("moe.experts.out", "reduce_scatter", "forward", "after", routed_rows),
            TPCollective("moe.combine", "all_to_all", "forward", "after", routed_rows, group="ep"),
            TPCollective("moe.combine.grad", "all_to_all", "backward", "before", routed_rows, group="ep"),
            TPCollective("moe.experts.out.grad", "all_gather", "backward", "before", routed_rows),
            TPCollective("moe.experts.in.grad", "reduce_scatter", "backward", "after", routed_rows),
            TPCollective("moe.dispatch.grad", "all_to_all", "backward", "after", routed_rows, group="ep"),
            *shared_collective("moe.shared.out.grad", "all_gather", "backward", "after"),
            *shared_collective("moe.shared.in.grad", "reduce_scatter", "backward", "after"),
        )
        shared_act = (replace(self._activation("moe.shared.act", self.shared_experts * fe), recompute="moe_act"),) \
            if self.shared_experts else ()
        kernels = (*self._norm("moe.norm", h),
                   Elementwise("moe.permute", 2 * k * h, 2 * k * h, sharded=False),  # each token's k rows by expert
                   replace(self._activation("moe.act", k * fe), recompute="moe_act", routed=True), *shared_act,
                   self._unpermute(k, h), *self._residual("moe", h))
        ops, per_expert = eager_ops.moe_ops(self.ffn_type, self.shared_experts > 0)
        return Block("moe", matmuls, collectives=collectives, elementwise=kernels, eager_ops=ops,
                     eager_ops_per_expert=per_expert), tuple(saved)

    # -- memory-bound kernels, per token (elements read + written; see Elementwise) ------------------
    def _attention_kernels(self, q: int, kv: int, unit: int) -> tuple[Elementwise, ...]:
        """The attention block's memory-bound kernels: its norm, RoPE on queries and keys, the core's
        own traffic, and the residual add (with a dropout mask if the model has dropout).

        FlashAttention reads Q, K, V and writes O (and its backward reads Q, K, V, O, dO and writes
        dQ, dK, dV); the unfused core's batched matmuls write and read the scores (priced as matmul
        traffic) and its softmax, and dropout, touch every score: ``heads x seq`` per token."""
        h = self.hidden
        if self.layer_kernels == "eager":
            return (*self._norm("attn.norm", h), *self._attention_biases(q, kv, unit),
                    *self._eager_attention(q, kv, unit), *self._residual("attn", h))
        kernels = [*self._norm("attn.norm", h), *self._attention_biases(q, kv, unit)]
        if self.position_embedding == "rope":  # latent attention's is part of its up-projections ("mla_up_proj")
            kernels.append(Elementwise("attn.rope", 2 * (q + kv), 2 * (q + kv), unit=unit,
                                       recompute="mla_up_proj" if self.attention == "mla" else ""))
        if self.attention_kernel == "flash":
            kernels.append(Elementwise("attn.core", 2 * q + 2 * kv, 4 * q + 4 * kv, unit=unit))
        else:
            scores = self.num_heads * self.seq_len
            kernels.append(Elementwise("attn.softmax", 2 * scores, 3 * scores, unit=self.seq_len,
                                       recompute="core_attn", sm_kind="softmax", row=self.seq_len))
            # Megatron-LM's core copies the context from [b, np, s, d] back to [s, b, np·d] (read and
            # write q), and the backward of splitting the fused QKV output writes the three gradients
            # into one tensor (read and write q + 2kv): megatron/model/transformer.py, ParallelAttention.
            kernels.append(Elementwise("attn.core.copies", 2 * q, 2 * (q + 2 * kv), unit=unit))
            if self.dropout:
                kernels.append(Elementwise("attn.dropout", 2 * scores, 2 * scores, unit=self.seq_len,
                                           recompute="core_attn", mask=scores))
        return tuple(kernels + self._residual("attn", h))

    def _attention_biases(self, q: int, kv: int, unit: int) -> tuple[Elementwise, ...]:
        """The attention block's bias kernels (``linear_bias``). Megatron-LM adds the QKV bias in a kernel of
        its own after the matmul (torch 1.8's ``F.linear`` on 3-D input, ``output += bias``; from 2022 its
        ``LinearWithGradAccumulationAndAsyncCommunication``, ``output + bias``): it reads and writes q + 2kv,
        a broadcast add the SMs bound (``sm_cycles.bias_add``). The output projection's bias goes into the
        fused bias-dropout-add, which reads it at no cost. Backward, each bias's gradient is its output's
        gradient summed over the tokens, a reduction reading q + 2kv and h (``grad_output.sum(dim=0)``,
        ``megatron/mpu/layers.py``; autograd's sum to the bias's shape). Eager torch adds biases in the
        matmul's epilogue (cuBLASLt) and sums their gradients alike."""
        if not self.linear_bias:
            return ()
        qkv = q + 2 * kv
        forward = (Elementwise("attn.qkv.bias", 2 * qkv, qkv, unit=unit, sm_kind="bias_add")
                   if self.layer_kernels == "fused" else Elementwise("attn.qkv.bias.grad", 0, qkv, unit=unit))
        return forward, Elementwise("attn.o.bias.grad", 0, self.hidden, sharded=False)

    def _eager_attention(self, q: int, kv: int, unit: int) -> list[Elementwise]:
        """The attention block's memory-bound kernels between its norm and its residual as eager PyTorch runs
        them (``executor/train/models.py``: ``rotary``, ``causal_attention``, ``Attention.forward``), per token.

        RoPE per rotated tensor of width ``w`` (queries, then keys): the angles rebuilt in fp32 for the
        ``head_dim`` ``d`` (outer product, repeat, cos, sin: 6d fp32 elements) and cast (2d read, 2d
        written); then ``-x[..., d/2:]`` (1w), ``cat`` (2w), ``x * cos`` and ``rotated * sin`` (2w each, plus
        the d-wide tables) and their sum (3w): 10w + 2d. Backward: two products by the tables (4w + 2d),
        two slice backwards writing zero-padded halves (3w), two sums (6w) and the negation (1w): 14w + 2d.
        K/V heads are copied to every query head (``repeat_interleave``: read kv, write q, twice) and, when
        grouped, their gradients summed back (read q, write kv, twice). The attention kernel then reads the
        expanded K and V (4q; backward 5q read, 3q written); its output, laid out token-major, needs no
        copy to merge the heads. Backward, the K and V gradients are copied from the heads' layout back
        into the projections' (2kv each), and the three projections' input gradients are added (two sums
        of 3h); with as many K/V heads as query heads, the gradients need neither sum nor copy.

        Unvectorized (torch's non-vectorized loop: strided head views, broadcast tables; an H200's profile of
        the one-GPU step, 2026-11-30): all of RoPE's forward (10w); backward, the products, the slices' copies
        (2w), the negation and, where the gradient arrives in the attention kernel's strided layout, the sums
        (6w): 13w for the queries, and for the keys unless grouped heads' gradients were summed back into a
        contiguous tensor first (7w); the K/V heads' copies (two reads through the expanded view and two
        writes of q) and their gradients' copies back (4kv)."""
        d = self.head_dim
        grouped = kv < q  # repeat_interleave by 1 still copies, but its backward passes the gradient as it is
        kernels = []
        if self.position_embedding == "rope":
            for w, name in ((q, "q"), (kv, "k")):
                strided = name == "q" or not grouped
                kernels += [Elementwise(f"attn.rope.{name}", 10 * w + 2 * d, 14 * w + 2 * d, unit=unit,
                                        unvectorized=(10 * w, (13 if strided else 7) * w)),
                            Elementwise(f"attn.rope.{name}.angles", 6 * d, 0, sharded=False, element_bytes=4),
                            Elementwise(f"attn.rope.{name}.angles.cast", 2 * d, 0, sharded=False, element_bytes=4,
                                        cast=True),
                            Elementwise(f"attn.rope.{name}.angles.cast.out", 2 * d, 0, sharded=False, cast=True)]
        kernels.append(Elementwise("attn.kv.repeat", 2 * (q + kv), 2 * (q + kv) if grouped else 0, unit=unit,
                                   unvectorized=(4 * q, 0)))
        return kernels + [Elementwise("attn.core", 4 * q, 8 * q, unit=unit),
                          Elementwise("attn.kv.grad.copy", 0, 4 * kv if grouped else 0, unit=unit,
                                      unvectorized=(0, 4 * kv if grouped else 0)),
                          Elementwise("attn.in.grad.sum", 0, 6 * self.hidden, sharded=False)]

    def _norm(self, name: str, h: int) -> tuple[Elementwise, ...]:
        """An RMSNorm or LayerNorm over ``h``: one fused kernel reads h and writes h (backward: reads 2h,
        writes h). Eager (the executor's ``RMSNorm``: ``x * rsqrt(x.float().pow(2).mean(-1) + eps).to(x.dtype)
        * weight``): the cast to fp32 (read h, write h fp32) and, backward, back (read h fp32, write h);
        ``pow`` and ``mean`` in fp32 (3h fp32); two products in the dtype (4h). Backward: the weight's
        gradient (a product, 3h, and a sum over tokens, h), the input's through both products (2h, 3h, 2h)
        and the row sum (h), ``mean``'s and ``pow``'s backward in fp32 (8h fp32), and the two paths added
        (3h): 15h and 8h fp32. Unvectorized (an H200's profile of the one-GPU step, 2026-11-30): the two
        products, each by a broadcast operand (the weight, the per-row scale), forward and backward (4h
        each); the cast to fp32 (2h; torch's bf16-to-fp32 copy kernel is its unrolled one, the cast back
        vectorized); ``mean``'s backward, the gradient over h broadcast (2h)."""
        if self.layer_kernels != "eager":
            return (Elementwise(name, 2 * h, 3 * h, sharded=False, sm_kind="norm", recompute="layernorm"),)
        return (Elementwise(name, 4 * h, 15 * h, sharded=False, unvectorized=(4 * h, 4 * h), recompute="layernorm"),
                Elementwise(f"{name}.fp32", 3 * h, 8 * h, sharded=False, element_bytes=4, unvectorized=(0, 2 * h),
                            recompute="layernorm"),
                Elementwise(f"{name}.cast", h, h, sharded=False, cast=True, recompute="layernorm"),
                Elementwise(f"{name}.cast.fp32", h, h, sharded=False, element_bytes=4, cast=True,
                            unvectorized=(2 * h, 0), recompute="layernorm"))

    def _mlp_kernels(self, f: int) -> tuple[Elementwise, ...]:
        """The norm, the activation and the residual; eager SwiGLU's gate and up projections also add their
        input gradients (3h), where Megatron-LM runs them as one matmul. With ``linear_bias`` the biases go
        into the activation's kernel (Megatron-LM's bias-GeLU) and the bias-dropout-add; their gradients are
        sums over the tokens of the column-parallel outputs' gradients and of the block output's."""
        h = self.hidden
        summed = (Elementwise("mlp.in.grad.sum", 0, 3 * h, sharded=False),) \
            if self.layer_kernels == "eager" and self.ffn_type == "swiglu" else ()
        biases = (Elementwise("mlp.in.bias.grad", 0, self._ffn_in(f)),
                  Elementwise("mlp.out.bias.grad", 0, h, sharded=False)) if self.linear_bias else ()
        return (*self._norm("mlp.norm", h), self._activation("mlp.act", f), *summed, *biases,
                *self._residual("mlp", h))

    def _activation(self, name: str, f: int) -> Elementwise:
        """GeLU reads f and writes f (backward: reads input and gradient, writes one); SwiGLU reads
        gate and up (2f) and writes f (backward: reads 3f, writes 2f). Eager SwiGLU is ``silu(gate) * up``:
        SiLU (2f) and the product (3f); backward, the two products' gradients (3f each) and SiLU's (3f)."""
        if self.ffn_type == "swiglu":
            return Elementwise(name, 5 * f, 9 * f) if self.layer_kernels == "eager" else Elementwise(name, 3 * f, 5 * f)
        return Elementwise(name, 2 * f, 3 * f, sm_kind="gelu")

    def _unpermute(self, k: int, h: int) -> Elementwise:
        """The combined rows back to their tokens, each weighted by its gate and summed: a fused kernel reads the
        k rows and writes one (Megatron-LM's ``moe_unpermute``; its backward reads one and writes k). Eager, as
        the executor runs it: the rows back in token order (read kh, write kh), times the gates (read kh, write
        kh), summed over k (read kh, write h); backward, the sum's gradient broadcast (read h, write kh), the
        product's (read kh twice, write kh), the reorder's scatter into zeros (write kh, read kh, write kh)."""
        if self.layer_kernels == "eager":
            return Elementwise("moe.unpermute", (5 * k + 1) * h, (7 * k + 1) * h, sharded=False)
        return Elementwise("moe.unpermute", (k + 1) * h, (k + 1) * h, sharded=False)

    def _residual(self, block: str, h: int) -> list[Elementwise]:
        """The residual add (two reads, one write; its backward sums the two gradients), with dropout
        drawing its one-byte mask in the same kernel (Megatron-LM's fused bias-dropout-add)."""
        return [Elementwise(f"{block}.residual", 3 * h, 3 * h, sharded=False, mask=h if self.dropout else 0)]

    @property
    def _core_output_kept(self) -> str:
        """How the attention output, the output projection's input, is kept: FlashAttention's backward reads its
        output too (LINEAR_ALSO); the unfused core's backward does not (LINEAR_ONLY)."""
        return LINEAR_ALSO if self.attention_kernel == "flash" else LINEAR_ONLY

    def _score_activations(self, d: int) -> tuple[Activation, ...]:
        """The unfused core keeps its softmax output for the backward and, with dropout, the mask and
        the dropped-out scores: ``2·a·s`` or ``5·a·s`` bytes per token at 2 bytes (Korthikanti et al.
        2022, section 4.1); FlashAttention keeps none (it recomputes them)."""
        if self.attention_kernel == "flash":
            return ()
        scores = self.num_heads * self.seq_len
        saved = [Activation("attn.softmax.out", scores, d, sharded=True, unit=self.seq_len, recompute="core_attn")]
        if self.dropout:
            saved += [Activation("attn.dropout.mask", scores, 1, sharded=True, unit=self.seq_len,
                                 recompute="core_attn"),
                      Activation("attn.dropout.out", scores, d, sharded=True, unit=self.seq_len,
                                 recompute="core_attn")]
        return tuple(saved)

    def embedding_cost(self, dtype_bytes: int, tp_style: str | None = None,
                       sequence_parallel: bool = False) -> LayerCost:
        """The token table (vocabulary-parallel under TP) and learned positions if any.

        A lookup costs no FLOPs. Under TP each rank looks up the ids in its
        slice of the vocabulary and an all-reduce assembles the embeddings
        (Megatron-LM's VocabParallelEmbedding); with sequence parallelism a
        reduce-scatter leaves each rank its part of the sequence, and its
        backward all-gathers the gradient (the all-reduce's backward is the
        identity). Saved: the token ids.
        """
        self.check_style(tp_style, sequence_parallel)
        h = self.hidden
        params = [Param("embed.tokens", self.vocab_size, h, "rows")]
        if self.position_embedding == "learned":
            params.append(Param("embed.positions", self.seq_len, h))
        if sequence_parallel:
            collectives = (TPCollective("embed.out", "reduce_scatter", "forward", "after", h * dtype_bytes),
                           TPCollective("embed.out.grad", "all_gather", "backward", "before", h * dtype_bytes))
        else:
            collectives = (TPCollective("embed.out", "all_reduce", "forward", "after", h * dtype_bytes),)
        lookup = Elementwise("embed.lookup", h, 2 * h, sharded=False)  # write the rows; backward: scatter-add
        block = Block("embedding", collectives=collectives, elementwise=(lookup,), tables=tuple(params),
                      eager_ops=eager_ops.embedding_ops(self.position_embedding == "learned"))
        return LayerCost("embedding", (block,), tuple(params),
                         (Activation("embed.ids", 1, INDEX_BYTES, sharded=False),))

    def head_cost(self, dtype_bytes: int, tp_style: str | None = None,
                  sequence_parallel: bool = False, copies_table: bool = False) -> LayerCost:
        """The final norm, the LM head matmul ``hidden x vocab`` and the cross-entropy.

        The head is column-parallel over the vocabulary (padded to a multiple of
        ``tp``), so its input gradient is all-reduced in the backward (with
        sequence parallelism: its input is all-gathered in the forward, again in
        the backward for the weight gradient, and its gradient reduce-scattered:
        Megatron-LM's output layer is a ``ColumnParallelLinear``, which keeps
        only this rank's part of the sequence), and the vocabulary-parallel cross-entropy
        all-reduces three fp32 numbers per token (the logit maximum, the target
        logit, the sum of exponentials). With tied embeddings the head reuses
        the embedding table and owns no parameters, unless it runs on another
        pipeline rank than the embedding (``copies_table``): that rank keeps a
        copy of the table, with its gradient and optimizer state, and its
        gradient is summed with the first stage's (Megatron-LM); so does an untied model's last rank for
        its multi-token prediction modules' lookups (``mtp.embed.copy``). Saved: the norm and head inputs, and the
        softmax over the vocabulary in fp32, which dominates for large
        vocabularies.
        """
        self.check_style(tp_style, sequence_parallel)
        h, d, v = self.hidden, dtype_bytes, self.vocab_size
        if sequence_parallel:
            entry = (TPCollective("head.in", "all_gather", "forward", "before", h * d),
                     TPCollective("head.in", "all_gather", "backward", "dgrad", h * d),
                     TPCollective("head.in.grad", "reduce_scatter", "backward", "after", h * d))
        else:
            entry = (TPCollective("head.in.grad", "all_reduce", "backward", "after", h * d),)
        collectives = (*entry, *(TPCollective(f"ce.{n}", "all_reduce", "forward", "after", SOFTMAX_BYTES)
                                 for n in ("max", "target", "sumexp")))
        loss = (*self._norm("head.norm", h),
                Elementwise("ce.logits", v, v),  # the loss reads the logits; its backward writes their gradient
                *self._loss_kernels(v))
        owns_weight = not self.tied_embeddings or copies_table
        block = Block("head", (Matmul("head", h, v, "column", owns_weight=owns_weight),),
                      collectives=collectives, elementwise=loss, eager_ops=eager_ops.HEAD)
        saved = (Activation("norm.final.in", h, d, sharded=sequence_parallel),
                 Activation("head.in", h, d, sharded=sequence_parallel),
                 Activation("ce.softmax", v, SOFTMAX_BYTES, sharded=True))
        params = (Param("norm.final", 1, h),)
        if copies_table and not self.tied_embeddings and self.mtp_layers:  # multi-token prediction's lookups
            params += (Param("mtp.embed.copy", self.vocab_size, h, "rows"),)
        return LayerCost("head", (block,), params, saved)

    def computed(self) -> list[LayerCost]:
        return self.costs(1) + self.mtp_costs(1)

    def mtp_costs(self, dtype_bytes: int, tp_style: str | None = None, sequence_parallel: bool = False,
                  copies_table: bool = False) -> list[LayerCost]:
        """The multi-token prediction modules (DeepSeek-V3 report, section 2.2), as Megatron-LM's
        ``MultiTokenPredictionLayer`` runs them on the last pipeline stage after the LM head.

        Each normalizes the hidden state before it (the last layer's, or the previous module's) and the
        embedding of the token one further ahead (``hnorm``, ``enorm``), projects the two side by side back
        to ``hidden`` (``eh_proj``, 2h x h, column-parallel: its output all-gathered, then split along the
        sequence again under sequence parallelism), runs one more layer of the model's last kind (a MoE layer
        for DeepSeek-V3) and predicts through a final norm and the main model's LM head, whose weight it
        shares, with a loss of its own over the vocabulary. Its matmuls count as model FLOPs, as Megatron-LM
        counts the projection and the extra logits. The embedding of the next tokens reads the embedding table,
        which the last stage keeps a copy of where it sits on another pipeline rank than the embedding
        (:meth:`head_cost`).
        """
        if not self.mtp_layers:
            return []
        self.check_style(tp_style, sequence_parallel)
        h, d = self.hidden, dtype_bytes
        layer = self._layer(d, sequence_parallel, moe=self.is_moe)
        head = self.head_cost(d, tp_style, sequence_parallel)
        shared_head = replace(head.blocks[0], matmuls=tuple(replace(m, owns_weight=False)
                                                            for m in head.blocks[0].matmuls))
        if sequence_parallel:  # the input gathered along the sequence, the output along the hidden dimension
            collectives = (TPCollective("mtp.in", "all_gather", "forward", "before", 2 * h * d),
                           TPCollective("mtp.out", "all_gather", "forward", "after", h * d),
                           TPCollective("mtp.out.grad", "all_gather", "backward", "before", h * d),
                           TPCollective("mtp.in.grad", "reduce_scatter", "backward", "after", 2 * h * d))
        else:
            collectives = (TPCollective("mtp.out", "all_gather", "forward", "after", h * d),
                           TPCollective("mtp.in.grad", "all_reduce", "backward", "after", 2 * h * d))
        entry = Block("mtp.in", (Matmul("mtp.eh_proj", 2 * h, h, "column"),), collectives=collectives,
                      elementwise=(Elementwise("mtp.embed.lookup", h, 2 * h, sharded=False),
                                   *self._norm("mtp.hnorm", h), *self._norm("mtp.enorm", h)))
        params = (Param("mtp.hnorm", 1, h), Param("mtp.enorm", 1, h), *layer.params, Param("mtp.norm.final", 1, h))
        blocks = (entry, *layer.blocks, shared_head)
        saved = (Activation("mtp.norms.in", 2 * h, d, sharded=sequence_parallel),
                 Activation("mtp.eh_proj.in", 2 * h, d, sharded=sequence_parallel),
                 *layer.activations, *head.activations)
        return [LayerCost(f"mtp.{i}", blocks, params, saved, layer.checkpoint) for i in range(self.mtp_layers)]

    def _loss_kernels(self, v: int) -> tuple[Elementwise, ...]:
        """The loss's fp32 traffic per token over ``v`` vocabulary entries: the fused kernel writes the
        softmax and its backward rereads it; the unfused one runs UNFUSED_CE_FP32_ACCESSES passes, torch's
        TORCH_CE_FP32_ACCESSES, on 16-bit logits TORCH_CE_CAST_ACCESSES, and over a vocabulary too wide for
        shared memory LOG_SOFTMAX_REREADS."""
        if self.cross_entropy == "unfused":
            forward, backward = UNFUSED_CE_FP32_ACCESSES
            return (Elementwise("ce.fp32", forward * v, backward * v, element_bytes=SOFTMAX_BYTES),)
        if self.cross_entropy == "torch":
            (forward, backward), (cast_forward, cast_backward) = TORCH_CE_FP32_ACCESSES, TORCH_CE_CAST_ACCESSES
            kernels = (Elementwise("ce.fp32", forward * v, backward * v, element_bytes=SOFTMAX_BYTES),
                       Elementwise("ce.fp32.cast", cast_forward * v, cast_backward * v, element_bytes=SOFTMAX_BYTES,
                                   cast=True))
            # rereads inside the kernels, which a count of ops does not see (torch's loss runs on whole rows)
            if v > SOFTMAX_SMEM_ELEMENTS:
                kernels += (Elementwise("ce.log_softmax.rereads", LOG_SOFTMAX_REREADS[0] * v,
                                        LOG_SOFTMAX_REREADS[1] * v, element_bytes=SOFTMAX_BYTES),)
            return kernels
        return (Elementwise("ce.softmax", v, v, element_bytes=SOFTMAX_BYTES),)

    def model_flops_per_token(self) -> int:
        """FLOPs per token for MFU: ``6·N_matmul + 12·L·seq·d_attn``.

        ``N_matmul`` counts the weights used in matmuls (every layer's and the
        LM head's, tied or not; not the embedding lookup or norms), and the
        second term is the attention core; this is PaLM's ``6N + 12·L·H·Q·T``
        (Chowdhery et al. 2022, appendix B) and, for GPT shapes, Narayanan et
        al.'s ``72·l·h²·(1 + s/6h + V/12lh)`` per token without recomputation.
        It equals :meth:`training_flops_per_token`; recomputed work is never
        model FLOPs.
        """
        return _model_flops_per_token(self.computed())

    def mtp_flops_per_token(self) -> int:
        """Of :meth:`model_flops_per_token`, the multi-token prediction modules' (0 without them)."""
        return _model_flops_per_token(self.mtp_costs(1))

    def describe(self) -> str:
        kv = f" ({self.num_kv_heads} kv)" if self.num_kv_heads != self.num_heads else ""
        heads = f"{self.num_heads} heads{kv}"
        ffn = f"ffn {self.ffn_hidden} {self.ffn_type}"
        if self.is_moe:
            shared = f" + {self.shared_experts} shared" if self.shared_experts else ""
            dense = f", first {self.dense_layers} layers dense" if self.dense_layers else ""
            nodes = f" on at most {self.max_routed_nodes} nodes" if self.max_routed_nodes else ""
            ffn = (f"{self.num_experts} experts{shared} of ffn {self.expert_ffn_hidden} {self.ffn_type}, "
                   f"top-{self.experts_per_token}{nodes}{dense}")
        if self.mtp_layers:
            ffn += f", {self.mtp_layers} multi-token prediction layer{'s' if self.mtp_layers > 1 else ''}"
        if self.attention == "mla":
            heads += " of latent attention (MLA)"
        return (f"{self.name} (transformer): {self.num_layers} layers, hidden {self.hidden}, {heads}, "
                f"{ffn}, seq {self.seq_len}, vocab {self.vocab_size}"
                + (", tied embeddings" if self.tied_embeddings else "")
                + (", linear biases" if self.linear_bias else ""))

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)


def _ffn_saved(names: tuple[str, ...], width: int, d: int, recompute: str = "") -> list[Activation]:
    """A feed-forward's saved intermediates (:func:`_ffn`'s names, ``width`` elements each per token): the
    activation function's inputs, and its output, the last matmul's input, which ``recompute`` (the selective
    recompute module rerunning the activation function) discards."""
    *inputs, output = names
    return [*(Activation(name, width, d, sharded=True) for name in inputs),
            Activation(output, width, d, sharded=True, recompute=recompute, linear=LINEAR_ONLY)]


def _ffn(prefix: str, h: int, f: int, ffn_type: str, experts: int = 1,
         active: int = 1) -> tuple[tuple[Matmul, ...], tuple[str, ...]]:
    """A feed-forward's matmuls (SwiGLU: gate, up, down; GeLU: fc1, fc2) and the intermediates it saves."""
    if ffn_type == "swiglu":
        return ((Matmul(f"{prefix}.gate", h, f, "column", experts=experts, active=active),
                 Matmul(f"{prefix}.up", h, f, "column", experts=experts, active=active),
                 Matmul(f"{prefix}.down", f, h, "row", experts=experts, active=active)),
                (f"{prefix}.gate.out", f"{prefix}.up.out", f"{prefix}.down.in"))
    return ((Matmul(f"{prefix}.fc1", h, f, "column", experts=experts, active=active),
             Matmul(f"{prefix}.fc2", f, h, "row", experts=experts, active=active)),
            (f"{prefix}.fc1.out", f"{prefix}.fc2.in"))


def _block_collectives(block: str, nbytes_per_token: int, sequence_parallel: bool) -> tuple[TPCollective, ...]:
    """A Megatron block's tensor-parallel collectives: an all-reduce after it in the forward and of
    its input gradient in the backward, or, with sequence parallelism, an all-gather of its input and
    a reduce-scatter of its output (mirrored in the backward), and the input gathered again in the
    backward for the weight gradients: the forward keeps only this rank's part of the sequence
    (``LinearWithGradAccumulationAndAsyncCommunication.backward``, Megatron-LM since its sequence
    parallelism, 2022; Transformer Engine's ``LayerNormLinear`` likewise)."""
    if not sequence_parallel:
        return (TPCollective(f"{block}.out", "all_reduce", "forward", "after", nbytes_per_token),
                TPCollective(f"{block}.in.grad", "all_reduce", "backward", "after", nbytes_per_token))
    return (TPCollective(f"{block}.in", "all_gather", "forward", "before", nbytes_per_token),
            TPCollective(f"{block}.out", "reduce_scatter", "forward", "after", nbytes_per_token),
            TPCollective(f"{block}.out.grad", "all_gather", "backward", "before", nbytes_per_token),
            TPCollective(f"{block}.in", "all_gather", "backward", "dgrad", nbytes_per_token),
            TPCollective(f"{block}.in.grad", "reduce_scatter", "backward", "after", nbytes_per_token))


Model = Union[MLPModel, TransformerModel]
MODEL_KINDS: dict[str, type] = {"mlp": MLPModel, "transformer": TransformerModel}


# The largest each shape can be: far beyond every published model (the deepest have about 130 layers,
# the widest hidden sizes 25,600), so a typo is refused instead of a step too large to simulate.
SHAPE_LIMITS = {"num_layers": 2**14, "width": 2**20, "hidden": 2**20, "ffn_hidden": 2**22, "expert_ffn_hidden": 2**22,
                "num_heads": 2**14, "num_kv_heads": 2**14, "seq_len": 2**27, "vocab_size": 2**24,
                "batch_size": 2**31, "num_experts": 2**16, "experts_per_token": 2**16, "shared_experts": 2**10,
                "dense_layers": 2**14, "max_routed_nodes": 2**14, "mtp_layers": 2**6, "q_lora_rank": 2**20,
                "kv_lora_rank": 2**20, "qk_nope_head_dim": 2**16, "qk_rope_head_dim": 2**16, "v_head_dim": 2**16}


def _check_positive(model: Model, key: str, low: int = 1) -> None:
    value, high = getattr(model, key), SHAPE_LIMITS[key]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        _fail(model, key, f"is {value!r}", f"a whole number from {low} to {high:,}")


def _fail(model: Model, key: str, problem: str, expected: str) -> None:
    raise ConfigError(model.source or f"model {model.name}", key, problem, expected)


def _to_dict(model: Model) -> dict[str, Any]:
    """The model as a mapping :func:`load_model` reads back (``source`` left out)."""
    data: dict[str, Any] = {"kind": model.kind}
    data.update({f.name: getattr(model, f.name) for f in fields(model) if f.name != "source"})
    if not data["description"]:
        del data["description"]
    return data


# --------------------------------------------------------------------------- loading
class ConfigReader:
    """Typed access to one mapping of a model or plan file.

    Unknown keys are rejected up front, listing the allowed ones; each typed
    getter raises a :class:`ConfigError` naming the file, the key, what was
    found and what is expected. Values are checked for type only; ranges and
    cross-field rules belong to the dataclass the values build.
    """

    def __init__(self, data: object, source: str, allowed: tuple[str, ...], prefix: str = ""):
        self.source, self.prefix = source, prefix
        if not isinstance(data, Mapping):
            raise ConfigError(source, prefix.rstrip(".") or "(file)", f"is {type(data).__name__} {data!r}",
                              "a mapping of keys")
        for key in data:
            if key not in allowed:
                raise ConfigError(source, f"{prefix}{key}", "unknown key", expected_keys(str(key), allowed))
        self.data = data

    def has(self, key: str) -> bool:
        return key in self.data

    def _bad(self, key: str, expected: str) -> ConfigError:
        return ConfigError(self.source, self.prefix + key, f"is {self.data[key]!r}", expected)

    def integer(self, key: str, default: int | None = None) -> int | None:
        value = self.data.get(key, default)
        if key in self.data and (isinstance(value, bool) or not isinstance(value, int)):
            raise self._bad(key, "a whole number")
        return value

    def text(self, key: str, default: str | None = None) -> str | None:
        value = self.data.get(key, default)
        if key in self.data and not isinstance(value, str):
            raise self._bad(key, "a string")
        return value

    def number(self, key: str, default: float | None = None) -> float | None:
        value = self.data.get(key, default)
        if key in self.data and (isinstance(value, bool) or not isinstance(value, (int, float))
                                 or not math.isfinite(value)):
            raise self._bad(key, "a finite number")
        return None if value is None else float(value)

    def boolean(self, key: str, default: bool | None = None) -> bool | None:
        value = self.data.get(key, default)
        if key in self.data and not isinstance(value, bool):
            raise self._bad(key, "true or false")
        return value

    def size(self, key: str, default: int | None = None) -> int | None:
        if key not in self.data:
            return default
        try:
            return parse_size(self.data[key])
        except ParsimError:
            raise self._bad(key, "a size in bytes such as 25MiB or 4096") from None

    def section(self, key: str, allowed: tuple[str, ...]) -> "ConfigReader":
        """A nested mapping (empty when the key is absent)."""
        return ConfigReader(self.data.get(key, {}), self.source, allowed, f"{self.prefix}{key}.")


def builtin_models() -> dict[str, Path]:
    """Preset model names and their files (``parsim/presets/*.yaml``)."""
    folder = importlib.resources.files("parsim").joinpath("presets")
    return {Path(p.name).stem: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".yaml")}


def load_model(spec: str | Path | Mapping[str, Any], base_dir: Path | None = None, source: str = "") -> Model:
    """A model from a preset name (``llama3-8b``), a YAML path, or an inline mapping.

    Relative paths are tried against ``base_dir`` (the referring plan's folder)
    first, then the working directory. ``source`` names an inline mapping in
    error messages.
    """
    if isinstance(spec, Mapping):
        return parse_model(spec, source or "<model>", default_name=f"custom-{spec.get('kind', 'model')}")
    text = str(spec)
    presets = builtin_models()
    if text in presets:
        path = presets[text]
    else:
        candidates = [base_dir / text] if base_dir is not None else []
        path = next((p for p in candidates + [Path(text)] if p.is_file()), None)
        if path is None:
            raise ParsimError(f"unknown model {text!r}: not a preset ({', '.join(sorted(presets))}) "
                              f"and no such file")
    return parse_model(read_yaml(path), str(path), default_name=path.stem)


_COMMON_KEYS = ("name", "kind", "description", "dtype")
_KIND_KEYS = {
    "mlp": ("num_layers", "width", "batch_size"),
    "transformer": ("num_layers", "hidden", "num_heads", "num_kv_heads", "ffn_hidden", "ffn_type", "seq_len",
                    "vocab_size", "tied_embeddings", "position_embedding", "num_experts", "experts_per_token",
                    "expert_ffn_hidden", "shared_experts", "dense_layers", "max_routed_nodes", "mtp_layers",
                    "attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "attention_kernel", "dropout", "cross_entropy", "layer_kernels", "linear_bias"),
}
_REQUIRED = {
    "mlp": ("num_layers", "width", "batch_size"),
    "transformer": ("num_layers", "hidden", "num_heads", "ffn_hidden", "seq_len", "vocab_size"),
}


TEXT_DEFAULTS = {"ffn_type": "swiglu", "position_embedding": "rope", "attention": "gqa", "attention_kernel": "flash",
                 "cross_entropy": "fused", "layer_kernels": "fused"}


def parse_model(data: object, source: str = "<model>", default_name: str = "model") -> Model:
    """Check a model mapping key by key and build the model."""
    if not isinstance(data, Mapping):
        raise ConfigError(source, "(file)", f"is {type(data).__name__} {data!r}", "a mapping of keys")
    kind = data.get("kind")
    if not isinstance(kind, str) or kind not in MODEL_KINDS:
        found = "missing" if kind is None else f"is {kind!r}"
        raise ConfigError(source, "kind", found, " or ".join(MODEL_KINDS))
    reader = ConfigReader(data, source, _COMMON_KEYS + _KIND_KEYS[kind])
    for key in _REQUIRED[kind]:
        if not reader.has(key):
            raise ConfigError(source, key, "missing",
                              f"a whole number; a {kind} model needs {', '.join(_REQUIRED[kind])}")
    values: dict[str, Any] = {
        "name": reader.text("name", default_name), "description": reader.text("description", ""), "source": source,
        "dtype": reader.text("dtype", "fp32"),
    }
    if values["dtype"] not in DTYPE_BYTES:
        raise ConfigError(source, "dtype", f"is {values['dtype']!r}", " or ".join(DTYPE_BYTES))
    for key in _KIND_KEYS[kind]:
        if key in TEXT_DEFAULTS:
            values[key] = reader.text(key, TEXT_DEFAULTS[key])
        elif key == "dropout":
            values[key] = reader.number(key, 0.0)
        elif key in ("tied_embeddings", "linear_bias"):
            values[key] = reader.boolean(key, False)
        elif reader.has(key):
            values[key] = reader.integer(key)
    return MODEL_KINDS[kind](**values)
