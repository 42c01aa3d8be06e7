"""What one block's pass runs on a GPU: matmul shapes, attention work, memory-bound bytes.

:func:`block_work` turns a model block (:class:`~parsim.workload.model.Block`) into the
kernels one rank launches for one microbatch in one pass (``F`` forward, ``B``
full backward, ``I`` input gradient, ``W`` weight gradient). The lowering
times it with the cluster's kernel model (:mod:`parsim.sim.compute`);
``parsim explain compute`` prints it line by line.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sim.compute import SmWork
from ..workload.model import Block, flash_softmax_factor, shard
from ..workload.plan import Plan


@dataclass(frozen=True)
class BlockWork:
    """One block's kernels in one pass, for one rank and one microbatch."""

    matmuls: tuple[tuple[int, int, int], ...]  # (m, n, k)
    labels: tuple[str, ...]  # what each matmul computes, for explanations
    sources: tuple[tuple[str, str], ...]  # each matmul's (weight split, role): role "fwd", "dgrad", "wgrad" or "core"
    attention_flops: float  # the fused attention core's FLOPs as executed, forward
    attention_grad_flops: float  # and backward
    # memory-bound kernels: (name, bytes, the arithmetic that may outlast the bytes)
    elementwise_parts: tuple[tuple[str, float, tuple[SmWork, ...]], ...]
    accumulate_bytes: float  # adding weight gradients into .grad
    kernels: int
    quantize_bytes: float = 0.0  # fp8 plans: casting the GEMMs' operands (see fp8_cast_bytes)
    high_precision: bool = False  # fp8 plans: this block's matmuls stay in bf16 (FP8_EXEMPT_BLOCKS)
    accumulate_elements: float = 0.0  # of the accumulation, read or written unvectorized (Plan.accumulation)

    @property
    def elementwise_bytes(self) -> float:
        """The memory-bound kernels' reads and writes, all together."""
        return float(sum(nbytes for _, nbytes, _ in self.elementwise_parts))

    @property
    def sm_bound(self) -> tuple[tuple[float, tuple[SmWork, ...]], ...]:
        """(bytes, arithmetic) of the memory-bound kernels whose arithmetic may outlast their bytes
        (:attr:`ComputeModel.time <parsim.sim.compute.ComputeModel.time>`'s ``sm_bound``)."""
        return tuple((nbytes, works) for _, nbytes, works in self.elementwise_parts if works)


# Transformer Engine's FP8 (current scaling, TE 2.x): before a GEMM, each bf16 operand is reduced to its
# absolute maximum (read 2 bytes per element), then cast to fp8 together with its transpose, which the
# backward's GEMMs need on Hopper (read 2, write 1 + 1): 6 bytes per element of a layer's input in the
# forward and of its output gradient in the backward. Weights are cast once per step, their fp8 copies
# kept across microbatches (Megatron-LM passes is_first_microbatch), and are not counted.
FP8_CAST_BYTES = 6
# Megatron-LM's output layer is its own ColumnParallelLinear, not a Transformer Engine module: it runs
# in bf16 and casts nothing (torchtitan's float8 conversion also leaves the output layer out).
FP8_EXEMPT_BLOCKS = ("head",)


def block_work(plan: Plan, block: Block, kind: str, tokens: int) -> BlockWork:
    """The kernels of ``block`` in a ``kind`` pass over ``tokens`` tokens on one rank.

    Matmuls: a forward ``x[m, k] @ W[k, n]`` per weight; the backward's input
    gradient ``dY @ Wᵀ`` ``(m, k, n)`` and weight gradient ``Xᵀ @ dY`` ``(k, n, m)``.
    The attention core runs in FlashAttention (its FLOPs, less the tiles above
    the causal diagonal, scaled for the softmax's share at small head dims) or
    unfused (batched matmuls, :func:`unfused_attention`). The memory-bound
    kernels (:class:`~parsim.workload.model.Elementwise`) move their forward bytes in a
    forward and their backward bytes in an input-gradient pass; the
    weight-gradient pass adds its gradients into the step's sum
    (:attr:`~parsim.workload.plan.Plan.accumulation_bytes`).
    A tensor-parallel collective over the feature dimension adds a copy of its
    tensor (:class:`~parsim.workload.model.TPCollective` ``regroups``).
    Kernels launched: one per matmul and one per memory-bound kernel with bytes to move.
    """
    tp = plan.tp
    mms: list[tuple[int, int, int]] = []
    labels: list[str] = []
    sources: list[tuple[str, str]] = []

    def launch(shape: tuple[int, int, int], label: str, source: tuple[str, str] = ("none", "core")) -> None:
        mms.append(shape)
        labels.append(label)
        sources.append(source)

    backward = kind in ("B", "I")
    # Selective recompute reruns its modules' forward kernels before the backward that needs their outputs
    # (RECOMPUTE_MODULES): latent attention's up-projections, norms, activation functions, an unfused core.
    rerun = set(plan.recompute_modules or ()) if backward else set()
    for mm in block.matmuls:
        k, n = mm.shape_per_rank(tp)
        for copy in range(mm.copies_per_rank(plan.ep)):
            rows = _rows(plan, mm, tokens, busiest=copy == 0)
            split = mm.split if mm.experts == 1 else "experts"
            if kind == "F" or mm.recompute in rerun:
                launch((rows, n, k), mm.name if kind == "F" else f"{mm.name} (recomputed)", (split, "fwd"))
            if kind in ("B", "I") and not block.data_input:
                launch((rows, k, n), f"{mm.name} input grad", (split, "dgrad"))
            if kind in ("B", "W"):
                launch((k, n, rows), f"{mm.name} weight grad", (split, "wgrad"))
    core = block.core
    rerun_core = core is not None and core.kernel == "unfused" and "core_attn" in rerun
    attention_fwd = attention_bwd = 0.0
    if core is not None and core.kernel == "unfused":
        if rerun_core:
            scores, label = unfused_attention(plan, core, "F", tokens)[0]
            launch(scores, f"{label} (recomputed)")
        for shape, label in unfused_attention(plan, core, kind, tokens):
            launch(shape, label)
    elif block.attention_flops_per_token:
        attention = block.attention_flops_per_token // tp * tokens
        work = attention * core.executed_fraction() * flash_softmax_factor(core.head_dim) if core else attention
        attention_fwd = work if kind == "F" else 0.0
        attention_bwd = 2 * work if backward else 0.0
    parts: list[tuple[str, float, tuple[SmWork, ...]]] = []  # memory-bound kernels: (name, bytes, arithmetic)
    if kind != "W":
        passes = [(e, backward, e.name) for e in block.elementwise]
        passes += [(e, False, f"{e.name} (recomputed)") for e in block.elementwise if e.recompute in rerun]
        split = (plan.dtype_bytes, tp, plan.sequence_parallel)
        rows = {False: tokens, True: round(tokens * plan.rank_tokens_factor)}  # routed kernels: the busiest rank's
        parts += [(name, rows[e.routed] * e.bytes_per_token(direction, *split),
                   e.sm_work(rows[e.routed], direction, *split)) for e, direction, name in passes]
        # A tensor-parallel collective over features regroups its buffer with a copy: read and write it once.
        phase = "backward" if backward else "forward"
        regrouped = [c for c in block.collectives if c.regroups and c.group == "tp" and c.phase == phase and tp > 1]
        parts += [(f"{c.name} regrouping copy", tokens * 2 * c.bytes_per_token, ()) for c in regrouped]
        parts += _sorted_by_local_expert(plan, block, backward, tokens)
    # A lookup table's gradient is dense (torch's embedding_dense_backward, under Megatron-LM's
    # VocabParallelEmbedding too): the backward zeroes a table-sized tensor before scattering the rows in.
    tables = sum(t.numel_per_rank(tp) for t in block.tables)
    if kind in ("B", "I") and tables:
        parts += [(f"zero {t.name}'s gradient", t.numel_per_rank(tp) * plan.dtype_bytes, ()) for t in block.tables]
    parts = [part for part in parts if part[1]]  # a kernel with nothing to move does not run
    # Each weight gradient joins the step's sum in a pass over the weights (Plan.accumulation_bytes: into
    # Megatron-LM's main_grad every microbatch, or into autograd's .grad after the first). A fused
    # accumulation does it in the weight-gradient matmul's epilogue, hidden by its FLOPs (k = tokens); a
    # table's gradient has no matmul and always takes the pass. A tied head's weight is the embedding
    # table's (owns_weight False): its gradient joins the table's and is added once, with the table.
    accumulate = unvectorized = 0.0
    if kind in ("B", "W"):
        weights = tables
        if plan.grad_accumulation == "autograd":
            weights += sum(mm.shape_per_rank(tp)[0] * mm.shape_per_rank(tp)[1] * mm.copies_per_rank(plan.ep)
                           for mm in block.matmuls if mm.owns_weight)
        accumulate = weights * plan.accumulation_bytes
        unvectorized = weights * plan.accumulation.elements
    quantize, casts = fp8_cast_bytes(plan, block, kind, tokens)
    kernels = len(mms) + len(parts) + 2 * casts
    return BlockWork(tuple(mms), tuple(labels), tuple(sources), attention_fwd, attention_bwd, tuple(parts), accumulate,
                     kernels, quantize, plan.dtype == "fp8" and block.name in FP8_EXEMPT_BLOCKS, unvectorized)


def _rows(plan: Plan, mm, tokens: int, busiest: bool) -> int:
    """Rows of ``mm``'s input on this rank: every token, its part of the sequence for a weight applied there
    (``on_sequence_shard``), or for a routed expert its share of the ep group's routed tokens, on the rank of
    the busiest expert (``busiest``: that expert; else another it holds)."""
    if mm.on_sequence_shard and plan.sequence_parallel:
        return tokens // plan.tp
    if mm.experts == 1:
        return tokens
    load = plan.expert_tokens_factor if busiest else plan.other_experts_factor
    return round(tokens * mm.active * plan.ep / mm.experts * load)


def _sorted_by_local_expert(plan: Plan, block: Block, backward: bool, tokens: int) -> list[tuple[str, float, tuple]]:
    """The rows an all-to-all dispatch brought, grouped by source rank, copied into groups by local expert for
    the experts and back into source order for the combine: Megatron-LM's ``sort_chunks_by_idxs`` in the
    alltoall dispatcher's post- and pre-processing, where a rank holds more than one expert (read and write
    each row twice; so its backward), and the executor's ``by_expert`` always (eager ``index_select``; its
    backward scatters into zeros: write, read and write). DeepEP's dispatch writes them grouped already."""
    if not any(mm.experts > 1 for mm in block.matmuls) or plan.ep == 1 or plan.dispatcher != "alltoall":
        return []
    eager = plan.model.layer_kernels == "eager"
    if plan.experts_per_rank == 1 and not eager:
        return []
    rows = tokens * plan.model.experts_per_token * plan.rank_tokens_factor  # after the tp group's gather
    accesses = 2 * (3 if backward and eager else 2)  # two copies
    return [("moe rows sorted by local expert and back", rows * plan.model.hidden * accesses * plan.dtype_bytes, ())]


def _held_rows(plan: Plan, mm, tokens: int) -> int:
    """Rows of ``mm``'s input over every copy this rank holds (an expert each: the busiest and the others)."""
    copies = mm.copies_per_rank(plan.ep)
    return _rows(plan, mm, tokens, busiest=True) + (copies - 1) * _rows(plan, mm, tokens, busiest=False)


def fp8_cast_bytes(plan: Plan, block: Block, kind: str, tokens: int) -> tuple[float, int]:
    """Bytes an fp8 plan's casts move in ``block``'s ``kind`` pass, and how many tensors they cast (each
    an amax kernel and a cast-transpose kernel): FP8_CAST_BYTES per element of every GEMM input in the
    forward and of every GEMM's output gradient in the input-gradient pass. Unsplit and column-split GEMMs
    of one block reading an input of the same width read the same tensor and share its cast (a fused QKV
    or gate-and-up GEMM; MLA's two down-projections of the block input)."""
    if plan.dtype != "fp8" or block.name in FP8_EXEMPT_BLOCKS or kind == "W":
        return 0.0, 0
    elements, casts, cast_inputs = 0.0, 0, set()
    for mm in block.matmuls:
        k, n = mm.shape_per_rank(plan.tp)
        copies = mm.copies_per_rank(plan.ep)
        if kind == "F":
            if mm.split != "row" and mm.experts == 1:
                if k in cast_inputs:
                    continue
                cast_inputs.add(k)
            elements += _held_rows(plan, mm, tokens) * k
        else:
            elements += _held_rows(plan, mm, tokens) * n
        casts += copies
    return elements * FP8_CAST_BYTES, casts


def unfused_attention(plan: Plan, core, kind: str, tokens: int) -> list[tuple[tuple[int, int, int], str]]:
    """The unfused core's batched matmuls, the batch (this rank's heads) folded into the rows: scores
    ``Q Kᵀ`` ``(s, s, d)`` and ``P V`` ``(s, d, s)`` per head forward; the backward computes
    ``dP = dO Vᵀ``, ``dV = Pᵀ dO``, ``dQ = dS K`` and ``dK = dSᵀ Q``."""
    if kind == "W":
        return []
    rows = tokens * shard(core.heads, plan.tp)  # every local query position of every head
    d, s = core.head_dim, core.seq
    if kind == "F":
        return [((rows, s, d), "scores Q Kᵀ"), ((rows, d, s), "softmax(scores) V")]
    return [((rows, s, d), "dP = dO Vᵀ"), ((rows, d, s), "dV = Pᵀ dO"), ((rows, d, s), "dQ = dS K"),
            ((rows, d, s), "dK = dSᵀ Q")]
