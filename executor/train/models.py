"""Torch modules for parsim's model descriptions, dense and seeded, cut into the simulator's pieces.

A model is a list of :class:`Piece` s named like the simulator's cost entries
(``embedding``, ``layer.0`` ... ``layer.{L-1}``, ``head``; the MLP has layers
only), so a pipeline stage takes exactly the pieces
:meth:`parsim.workload.plan.Plan.stage_costs` prices, and tensor-parallel collectives
can be named after the piece they run in. The loss is a separate module
(:func:`build_loss`) that the last stage applies.

Everything here is the plain single-process model, the reference the
distributed runs are checked against. Tensor parallelism later swaps weights
for shards and fills the ``enter`` / ``reduce`` / ``exit`` slots (identities
here) with collectives, without changing parameter names; expert parallelism
keeps a rank's slice of the routed experts and gives the MoE layers
(:mod:`executor.train.moe`, from ``dense_layers`` on) an all-to-all dispatcher.

Parameters are registered in the simulator's order within a piece (matmul
weights in cost order, then norm gains and tables) so data-parallel buckets
hold the same tensors on both sides. Each parameter carries ``full_name``
(``layer.0.attn.q.weight``), which survives sharding, to find its reference.

Weights are drawn per piece from a generator seeded by ``(seed, piece index)``:
any rank builds identical values for the pieces it holds, whatever else it
builds.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from parsim.workload.model import MLPModel, Model, TransformerModel

from .._torch import require_torch

torch = require_torch()
nn = torch.nn
F = torch.nn.functional

INIT_STD = 0.02  # GPT-2 / Megatron-LM's default for transformer weights
NORM_EPS = 1e-5
ROPE_THETA = 10000.0


class Piece(NamedTuple):
    """One cost entry's module: ``name`` as in the simulator (``layer.3``), ``module`` the torch module."""

    name: str
    module: Any  # nn.Module


# --------------------------------------------------------------------------- the course MLP
class CourseLinear(nn.Module):
    """``x @ W`` with ``W`` of shape (in, out), no bias: the lecture's layout."""

    def __init__(self, fan_in: int, fan_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(fan_in, fan_out))

    def forward(self, x):
        return x @ self.weight


class MLPLayer(nn.Module):
    """``x = gelu(x @ W)``; ``enter``, ``reduce`` (before gelu) and ``exit`` are slots for collectives."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = CourseLinear(width, width)
        self.enter, self.reduce, self.exit = nn.Identity(), nn.Identity(), nn.Identity()

    def forward(self, x):
        return self.exit(F.gelu(self.reduce(self.proj(self.enter(x)))))


class SquareMeanLoss(nn.Module):
    """The lecture's loss: ``x.square().mean()`` (no targets)."""

    def forward(self, x, targets=None):
        return x.float().square().mean()


# --------------------------------------------------------------------------- the transformer
class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + NORM_EPS).to(x.dtype) * self.weight


def _linear(fan_in: int, fan_out: int):
    return nn.Linear(fan_in, fan_out, bias=False)


def rotary(x, positions=None, theta: float = ROPE_THETA):
    """RoPE (Su et al. 2021), rotate-half form, on ``x`` of shape (batch, heads, seq, head_dim).

    ``positions`` are the tokens' places in the whole sequence (``arange(seq)`` when None; a
    context-parallel rank holds two separate chunks of it).
    """
    seq, dim = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    positions = torch.arange(seq, device=x.device) if positions is None else positions
    angles = torch.outer(positions.to(torch.float32), inv_freq).repeat(1, 2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def causal_sdpa(q, k, v):
    """Causal SDPA, keys and values per query head (their widths may differ: latent attention's)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def causal_attention(q, k, v):
    """Causal SDPA of ``q`` (batch, heads, seq, head_dim) on grouped ``k`` / ``v`` (batch, kv_heads, seq, head_dim)."""
    group = q.shape[1] // k.shape[1]  # query heads per key/value head
    return causal_sdpa(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))


class Attention(nn.Module):
    """Causal grouped-query attention; the number of heads follows the (possibly sharded) weights.

    ``core(q, k, v)`` is the attention proper (:func:`causal_attention`, or context parallelism's
    exchange of K/V across ranks); ``position_ids`` the tokens' global positions for RoPE (None: 0..seq-1).
    """

    def __init__(self, m: TransformerModel):
        super().__init__()
        self.head_dim, self.rope = m.head_dim, m.position_embedding == "rope"
        self.q = _linear(m.hidden, m.num_heads * m.head_dim)
        self.k = _linear(m.hidden, m.num_kv_heads * m.head_dim)
        self.v = _linear(m.hidden, m.num_kv_heads * m.head_dim)
        self.o = _linear(m.num_heads * m.head_dim, m.hidden)
        self.enter, self.exit = nn.Identity(), nn.Identity()
        self.overlap = None  # tensor-parallel collectives beside the GEMMs (executor.train.tp_overlap)
        self.core = causal_attention
        self.register_buffer("position_ids", None, persistent=False)

    def forward(self, x):
        projections = (self.q, self.k, self.v)
        if self.overlap is not None:
            q, k, v = self.overlap.entry(x, projections)
        else:
            x = self.enter(x)  # under sequence parallelism this gathers the whole sequence
            q, k, v = (proj(x) for proj in projections)
        b, s, _ = q.shape
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if self.rope:
            q, k = rotary(q, self.position_ids), rotary(k, self.position_ids)
        out = self.core(q, k, v).transpose(1, 2).reshape(b, s, -1)
        return self.overlap.exit(out, self.o) if self.overlap is not None else self.exit(self.o(out))


class LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention (DeepSeek-AI 2024, DeepSeek-V2 section 2.1), causal.

    Queries come from ``q`` (or through the ``q_lora_rank`` bottleneck ``q_a``, normed, then ``q_b``); keys
    and values from one latent: ``kv_a`` makes ``kv_lora_rank`` compressed features (normed, then ``kv_b``
    expands them per head into a ``qk_nope`` key part and a ``v_head_dim`` value) and one ``qk_rope`` key
    part every head shares. Queries' and keys' ``qk_rope`` parts carry RoPE (decoupled), so a head scores
    over ``qk_nope + qk_rope`` widths and returns ``v_head_dim``. The two latent norms are the layer's
    (``norms``: registered after its other norms, the simulator's order), not this module's. As in
    :class:`Attention`, ``core(q, k, v)`` is the attention proper and ``position_ids`` the tokens' global
    positions for RoPE (context parallelism sets both); tensor parallelism fills ``gather`` and ``exit``.
    """

    def __init__(self, m: TransformerModel):
        super().__init__()
        self.heads, self.nope, self.rope_dim, self.v_dim = (m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim,
                                                             m.v_head_dim)
        qk = self.nope + self.rope_dim
        self.compressed_queries = bool(m.q_lora_rank)
        if self.compressed_queries:
            self.q_a, self.q_b = _linear(m.hidden, m.q_lora_rank), _linear(m.q_lora_rank, m.num_heads * qk)
        else:
            self.q = _linear(m.hidden, m.num_heads * qk)
        self.kv_a = _linear(m.hidden, m.kv_lora_rank + self.rope_dim)
        self.kv_b = _linear(m.kv_lora_rank, m.num_heads * (self.nope + self.v_dim))
        self.o = _linear(m.num_heads * self.v_dim, m.hidden)
        self.norms: tuple = ()  # (q_a's norm or None, kv_a's norm): the layer sets them
        # tensor parallelism's slots: the sequence gathered before each up-projection, the output scattered
        self.gather, self.exit = nn.Identity(), nn.Identity()
        self.core = causal_sdpa  # context parallelism's exchange of K/V replaces it (as Attention's)
        self.register_buffer("position_ids", None, persistent=False)

    def forward(self, x):
        q_norm, kv_norm = self.norms
        # Megatron-LM's order: both down-projections, the shared RoPE key's gather, then the up-projections
        latent, k_rope = self.kv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rope = self.gather(k_rope)
        q = self.q_b(self.gather(q_norm(self.q_a(x)))) if self.compressed_queries else self.q(self.gather(x))
        b, s, _ = q.shape
        q = q.view(b, s, self.heads, -1).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        kv = self.kv_b(self.gather(kv_norm(latent))).view(b, s, self.heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = rotary(k_rope.unsqueeze(1), self.position_ids).expand(-1, self.heads, -1, -1)
        q = torch.cat([q_nope, rotary(q_rope, self.position_ids)], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        out = self.core(q, k, v)
        return self.exit(self.o(out.transpose(1, 2).reshape(b, s, -1)))

    @property
    def kv_lora_rank(self) -> int:
        return self.kv_b.in_features


class FeedForward(nn.Module):
    """SwiGLU ``down(silu(gate x) * up x)`` or GeLU ``fc2(gelu(fc1 x))``, of ``ffn_hidden`` (the model's by default)."""

    def __init__(self, m: TransformerModel, ffn_hidden: int | None = None):
        super().__init__()
        self.swiglu = m.ffn_type == "swiglu"
        f = ffn_hidden or m.ffn_hidden
        if self.swiglu:
            self.gate, self.up, self.down = _linear(m.hidden, f), _linear(m.hidden, f), _linear(f, m.hidden)
        else:
            self.fc1, self.fc2 = _linear(m.hidden, f), _linear(f, m.hidden)
        self.enter, self.exit = nn.Identity(), nn.Identity()
        self.overlap = None  # tensor-parallel collectives beside the GEMMs (executor.train.tp_overlap)

    def forward(self, x):
        columns = (self.gate, self.up) if self.swiglu else (self.fc1,)
        if self.overlap is not None:
            hidden = self.overlap.entry(x, columns)
        else:
            x = self.enter(x)
            hidden = tuple(proj(x) for proj in columns)
        h = F.silu(hidden[0]) * hidden[1] if self.swiglu else F.gelu(hidden[0])
        out = self.down if self.swiglu else self.fc2
        return self.overlap.exit(h, out) if self.overlap is not None else self.exit(out(h))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    ``mlp`` is a dense :class:`FeedForward`, or with ``moe`` a
    :class:`executor.train.moe.MoEFeedForward`. Submodules are registered
    matmuls first, norms last: the simulator's order.
    """

    def __init__(self, m: TransformerModel, moe: bool = False):
        super().__init__()
        latent = m.attention == "mla"
        self.attn = LatentAttention(m) if latent else Attention(m)
        self.mlp = _moe_feed_forward(m) if moe else FeedForward(m)
        self.norm_attn, self.norm_mlp = RMSNorm(m.hidden), RMSNorm(m.hidden)
        if latent:  # the latent norms after the layer's own, as the simulator lists them
            self.norm_q_a = RMSNorm(m.q_lora_rank) if m.q_lora_rank else None
            self.norm_kv_a = RMSNorm(m.kv_lora_rank)
            self.attn.norms = (self.norm_q_a, self.norm_kv_a)

    def forward(self, x):
        x = x + self.attn(self.norm_attn(x))
        return x + self.mlp(self.norm_mlp(x))


class Embedding(nn.Module):
    """Token table (plus learned positions); ``exit`` is the slot for the vocabulary-parallel all-reduce.

    ``position_ids``: the tokens' global positions (None: 0..seq-1).
    """

    def __init__(self, m: TransformerModel):
        super().__init__()
        self.tokens = nn.Embedding(m.vocab_size, m.hidden)
        self.positions = nn.Embedding(m.seq_len, m.hidden) if m.position_embedding == "learned" else None
        self.exit = nn.Identity()
        self.register_buffer("position_ids", None, persistent=False)

    def forward(self, ids):
        x = self.exit(self.tokens(ids))
        if self.positions is not None:  # a module call, so the split backward sees its output
            where = torch.arange(ids.shape[1], device=ids.device) if self.position_ids is None else self.position_ids
            x = x + self.positions(where)
        return x


class Head(nn.Module):
    """Final norm and LM head to logits; registered head matmul first, then the norm (the simulator's order)."""

    def __init__(self, m: TransformerModel):
        super().__init__()
        self.out = _linear(m.hidden, m.vocab_size)
        self.norm = RMSNorm(m.hidden)
        self.enter = nn.Identity()
        self.overlap = None  # tensor-parallel collectives beside the GEMMs (executor.train.tp_overlap)

    def forward(self, x):
        if self.overlap is not None:
            (logits,) = self.overlap.entry(self.norm(x), (self.out,))
            return logits
        return self.out(self.enter(self.norm(x)))


class CrossEntropyLoss(nn.Module):
    """Mean next-token cross-entropy over every position, in fp32."""

    def forward(self, logits, targets):
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


# --------------------------------------------------------------------------- building
def piece_names(model: Model) -> list[str]:
    """Names of the pieces in execution order, as the simulator names its cost entries."""
    layers = [f"layer.{i}" for i in range(model.num_layers)]
    return layers if isinstance(model, MLPModel) else ["embedding", *layers, "head"]


def build_pieces(model: Model, seed: int, only: set[str] | None = None, dtype: Any = None) -> list[Piece]:
    """The model's pieces (those named in ``only``, or all), seeded per piece, labelled with ``full_name``.

    With tied embeddings the head's weight starts as a copy of the token
    table; :func:`tie_embeddings` shares or synchronizes the two.
    """
    names = piece_names(model)
    pieces = []
    for index, name in enumerate(names):
        if only is not None and name not in only:
            continue
        module = _make(model, name)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
        _initialize(module, model, generator)
        for param_name, param in module.named_parameters():
            param.full_name = f"{name}.{param_name}"
        if name == "head" and model.tied_embeddings:
            table = build_pieces(model, seed, {"embedding"})[0].module.tokens.weight
            module.out.weight.data.copy_(table.data)
            module.out.weight.full_name = table.full_name
        pieces.append(Piece(name, module.to(dtype) if dtype is not None else module))
    return pieces


def build_loss(model: Model):
    """The module the last stage applies: ``loss(output, targets)``."""
    return SquareMeanLoss() if isinstance(model, MLPModel) else CrossEntropyLoss()


def make_batch(model: Model, global_batch: int, seed: int, dtype: Any = None) -> tuple[Any, Any]:
    """The step's global batch ``(inputs, targets)``, the same on every rank for a seed.

    MLP: ``randn(batch, width)``, no targets. Transformer: random token ids;
    the targets are the inputs shifted by one position.
    """
    generator = torch.Generator().manual_seed(seed)
    if isinstance(model, MLPModel):
        x = torch.randn(global_batch, model.width, generator=generator)
        return (x.to(dtype) if dtype is not None else x), None
    tokens = torch.randint(0, model.vocab_size, (global_batch, model.seq_len + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def reference_model(model: Model, seed: int):
    """The whole model in one process: ``(pieces, loss)``, with a tied head sharing the token table."""
    pieces = build_pieces(model, seed)
    if isinstance(model, TransformerModel) and model.tied_embeddings:
        pieces[-1].module.out.weight = pieces[0].module.tokens.weight
    return pieces, build_loss(model)


def run_pieces(pieces: list[Piece], x: Any) -> Any:
    for piece in pieces:
        x = piece.module(x)
    return x


def _make(model: Model, name: str):
    if isinstance(model, MLPModel):
        return MLPLayer(model.width)
    if name == "embedding":
        return Embedding(model)
    if name == "head":
        return Head(model)
    return DecoderLayer(model, moe=model.is_moe and int(name.split(".")[1]) >= model.dense_layers)


def _moe_feed_forward(m: TransformerModel):
    from .moe import MoEFeedForward  # moe builds on this module's FeedForward

    return MoEFeedForward(m, FeedForward(m, m.shared_experts * m.expert_ffn_hidden) if m.shared_experts else None)


def _initialize(module, model: Model, generator) -> None:
    """Course MLP: ``randn / sqrt(width)`` (the lecture); transformer: N(0, 0.02) weights, unit norm gains."""
    scale = 1 / math.sqrt(model.width) if isinstance(model, MLPModel) else INIT_STD
    for sub in module.modules():
        if isinstance(sub, RMSNorm):
            continue  # gains start at one
        for param in sub.parameters(recurse=False):
            param.data = torch.randn(param.shape, generator=generator) * scale
