"""The pipeline schedules, generated once in pure Python as per-rank action lists.

Every generator returns the order in which each rank runs its passes; the
simulator times these lists and the executor runs them, so both see the same
schedule. Orders match ``torch.distributed.pipelining`` pass for pass
(``tests/test_schedules_torch.py`` proves it), so the executor may also run
PyTorch's class of the same name:

=================  ====================================  ===================================
name               source                                torch class
=================  ====================================  ===================================
gpipe              Huang et al. 2019 (GPipe)             ScheduleGPipe
1f1b               Narayanan et al. 2021 (PipeDream-     Schedule1F1B
                   Flush); Megatron-LM's default
interleaved-1f1b   Narayanan et al. 2021 (Megatron-LM)   ScheduleInterleaved1F1B
zero-bubble        Qi et al. 2023, ZB-H1 (v = 1)          ScheduleInterleavedZeroBubble
zb-h2              Qi et al. 2023, ZB-H2                  (none; run from the action lists)
zbv                Qi et al. 2023, ZB-V (section 6)       ScheduleZBVZeroBubble
dualpipe-v         DeepSeek-AI 2024 (DualPipe), halved    ScheduleDualPipeV
=================  ====================================  ===================================
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from ..errors import ParsimError
from .core import Action, Schedule


def gpipe(pp: int, num_microbatches: int) -> Schedule:
    """GPipe (Huang et al. 2019): every rank runs all forwards, then all backwards.

    Fill, then drain: simple, but every rank keeps the activations of all
    ``m`` microbatches until its backwards start. Backwards run in microbatch
    order 0, 1, ..., as ``torch``'s ``ScheduleGPipe`` does.
    """
    m = num_microbatches
    actions = [[Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)]
               for r in range(pp)]
    return Schedule("gpipe", pp, m, 1, actions)


def one_f_one_b(pp: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021; Megatron-LM's default schedule).

    The one-forward-one-backward order comes from PipeDream (Narayanan et al.
    2019); the flush at the end of every step keeps the weights synchronous.

    Rank ``r`` runs, in three phases:

    1. warm-up: ``pp - r - 1`` forwards, enough to fill the pipe below it;
    2. steady state: one forward, one backward, until every forward ran;
    3. cool-down: the remaining backwards.

    Same bubble as GPipe, but rank ``r`` holds at most ``pp - r`` microbatches
    of activations instead of ``m``.
    """
    m = num_microbatches
    actions = []
    for rank in range(pp):
        warmup = min(pp - rank - 1, m)
        steady = m - warmup
        ops = [Action("F", rank, i) for i in range(warmup)]
        for i in range(steady):
            ops += [Action("F", rank, warmup + i), Action("B", rank, i)]
        ops += [Action("B", rank, i) for i in range(steady, m)]
        actions.append(ops)
    return Schedule("1f1b", pp, m, 1, actions)


def interleaved_1f1b(pp: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): ``v`` stages per rank.

    Rank ``r`` owns stages ``r, r + pp, r + 2pp, ...``. Microbatches go
    through a rank's stages in rounds of ``pp``: forwards of microbatches
    0..pp-1 on the first stage, then the same microbatches on the second stage,
    and so on ("depth first"); backwards walk the stages in reverse. A rank
    warms up with ``(v - 1) * pp + 2 * (pp - r - 1)`` forwards, then
    alternates one forward and one backward. Each pass is ``1/v`` as long as
    in 1F1B, so the bubble shrinks ``v``-fold, for ``v``-fold more
    point-to-point messages. Megatron-LM requires ``m % pp == 0``; PyTorch
    relaxes that to rounds of ``m // max(1, m // pp)`` microbatches (so
    ``m`` must be a multiple of the number of rounds, see :func:`round_size`),
    and so does parsim. Unlike Megatron-LM, ``m == pp`` is not special-cased
    to "all forwards first" (PyTorch does not either).
    """
    return _looped("interleaved-1f1b", pp, num_microbatches, virtual_stages, warmup_per_hop=2)


def combined_interleaved_1f1b(pp: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Interleaved 1F1B as Megatron-LM runs it with ``overlap_moe_expert_parallel_comm``: one more warm-up
    forward on every rank ("This is needed to ensure the forward and backward computations are independent in
    all 1f1b steps", ``megatron/core/pipeline_parallel/schedules.py``), then each steady forward runs together
    with the backward after it (``combined_1f1b_schedule_for_interleaved_pipelining``)."""
    return _looped("interleaved-1f1b", pp, num_microbatches, virtual_stages, warmup_per_hop=2, extra_warmup=1)


def zero_bubble(pp: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Zero-bubble ZB-H1 (Qi et al. 2023, section 2.1; "ZB1P").

    The backward is split into ``I`` (gradient w.r.t. the input, which the
    previous stage waits for) and ``W`` (gradient w.r.t. the weights, which
    nobody waits for). Rank ``r`` runs 1F1B's warm-up (``pp - r - 1``
    forwards), then ``F, I`` pairs, but holds back its first ``r`` ``W``
    passes; from then on each ``I`` is followed by the oldest pending ``W``.
    The ``r`` deferred ``W`` s run at the very end, exactly where 1F1B's
    cool-down leaves rank ``r`` idle. In-flight activations stay those of 1F1B
    (``pp - r`` on rank ``r``) and, with ``t_F = t_I = t_W``, the bubble is a
    third of 1F1B's: ``(p - 1)(t_F + t_I - t_W)``.

    With ``virtual_stages > 1`` this is PyTorch's interleaved variant
    (``ScheduleInterleavedZeroBubble``): Megatron's interleaved order with a
    warm-up of ``(v - 1) * pp + pp - r - 1`` forwards and the same ``W``
    deferral, in PyTorch's rounds (:func:`round_size`).
    """
    return _looped("zero-bubble", pp, num_microbatches, virtual_stages, warmup_per_hop=1,
                   deferred_w=lambda rank: rank)


def zb_h2(pp: int, num_microbatches: int) -> Schedule:
    """Zero-bubble ZB-H2 (Qi et al. 2023, section 2.2; "ZB2P"): more warm-up, a parallelogram.

    Rank ``r`` warms up with ``2(pp - r) - 1`` forwards instead of 1F1B's
    ``pp - r``: exactly enough to stay busy until the first input gradient
    comes back from the last stage. It then alternates ``I`` and ``F``, and
    holds back its ``2r + 1`` most recent ``W`` passes, so the last stage
    sends its input gradients up the pipe as early as possible and the
    deferred ``W`` s fill the cool-down. With ``t_F = t_I = t_W`` and
    ``m >= 2p`` every rank then works without a gap from its first
    forward to its last ``W``: rank ``r`` is busy over ``[r t_F, r t_F +
    3 m t]``, a parallelogram. The price is memory: rank ``r`` keeps up to
    ``2(pp - r) - 1`` microbatches of activations (about twice 1F1B's).

    One step still has the parallelogram's slanted ends (the last stage
    starts ``(p - 1) t_F`` late; the first ends ``(p - 1)`` passes early):
    the paper's zero bubble needs its optimizer post-validation (section 4),
    which lets the next step's parallelogram slide into them. parsim times a
    step with the optimizer synchronized, as a training loop without
    post-validation runs it.
    """
    return _looped("zb-h2", pp, num_microbatches, 1, warmup_per_hop=2, deferred_w=lambda rank: 2 * rank + 1)


def round_size(pp: int, m: int) -> int:
    """Microbatches per round of a looped schedule: ``m // max(1, m // pp)``, PyTorch's flexible rounds.

    ``pp`` when ``m`` is a multiple of ``pp``, as Megatron-LM requires; ``m``
    itself when ``m < pp``; in between (``pp = 4, m = 10``: 2 rounds of 5)
    ``m`` must split into whole rounds, as ``ScheduleInterleaved1F1B`` checks.
    """
    return m // max(1, m // pp)


def splits_into_rounds(pp: int, m: int) -> bool:
    """True when ``m`` microbatches fill whole rounds of :func:`round_size` (always when ``pp`` divides ``m``)."""
    return m % max(1, m // pp) == 0


def uneven_rounds(pp: int, m: int) -> str:
    """Why ``m`` microbatches do not fill a looped schedule's rounds on ``pp`` ranks, or "" when they do."""
    if splits_into_rounds(pp, m):
        return ""
    below = next(k for k in range(m - 1, 0, -1) if splits_into_rounds(pp, k))
    above = next(k for k in range(m + 1, 2 * m + pp) if splits_into_rounds(pp, k))
    return (f"runs microbatches in max(1, m // pp) = {m // pp} equal rounds, as PyTorch does, and {m} "
            f"microbatches do not split into {m // pp}; {below} or {above} do")


def _looped(name: str, pp: int, m: int, v: int, *, warmup_per_hop: int,
            deferred_w: Callable[[int], int] | None = None, extra_warmup: int = 0) -> Schedule:
    """Warm-up / steady / cool-down over ``v`` looped stages per rank (PyTorch's ``_get_1f1b_rank_ops``).

    Microbatches go through a rank's stages in rounds of ``n =``
    :func:`round_size` (``pp`` when ``m`` is a multiple of it). Pass ``k`` of
    a rank (counted separately for forwards and backwards) handles microbatch
    ``(k // (n v)) n + k % n`` on the rank's local stage ``(k // n) % v``
    (forward) or ``v - 1 - (k // n) % v`` (backward). ``deferred_w`` splits
    backwards into ``I`` and ``W`` and says how many ``W`` passes rank ``r``
    holds back (run after its last ``I``). ``extra_warmup``: more warm-up forwards, and each steady forward
    paired with the backward after it (:attr:`Schedule.paired`, :func:`combined_interleaved_1f1b`).
    """
    total = v * m
    n = round_size(pp, m)  # (with one stage per rank any round size gives the same order)

    def microbatch(k: int) -> int:
        return (k // (n * v)) * n + k % n

    actions, pairs = [], []
    for rank in range(pp):
        def forward(k: int) -> Action:
            return Action("F", ((k // n) % v) * pp + rank, microbatch(k))

        def backward(k: int, kind: str) -> Action:
            return Action(kind, (v - 1 - (k // n) % v) * pp + rank, microbatch(k))

        warmup = min((v - 1) * n + warmup_per_hop * (pp - 1 - rank) + extra_warmup, total)
        ops = [forward(k) for k in range(warmup)]
        pending_w: deque[Action] = deque()
        paired: set[int] = set()

        def run_backward(k: int) -> None:
            if deferred_w is None:
                ops.append(backward(k, "B"))
                return
            ops.append(backward(k, "I"))
            pending_w.append(backward(k, "W"))
            if len(pending_w) > deferred_w(rank):  # keep that many weight-gradient passes for the tail
                ops.append(pending_w.popleft())

        for k in range(total - warmup):  # steady state: one forward, one backward
            if extra_warmup:
                paired.add(len(ops))
            ops.append(forward(warmup + k))
            run_backward(k)
        for k in range(total - warmup, total):  # cool-down: the remaining backwards
            run_backward(k)
        ops.extend(pending_w)  # deferred W passes fill the tail bubble
        actions.append(ops)
        pairs.append(frozenset(paired))
    return Schedule(name, pp, m, v, actions, paired=tuple(pairs) if extra_warmup else ())


def zbv(pp: int, num_microbatches: int) -> Schedule:
    """ZB-V (Qi et al. 2023, section 6): two stages per rank in a V, W passes fill the gaps.

    Rank ``r`` owns stage ``r`` (chunk 0, on the way down) and stage
    ``2pp - 1 - r`` (chunk 1, on the way up), so the last rank runs the middle
    two stages back to back and the first rank computes both the first and the
    last stage. Phases, as in PyTorch's ``ScheduleZBVZeroBubble``:

    1. ``2(pp - r) - 1`` chunk-0 forwards;
    2. ``r`` pairs (chunk-1 forward, chunk-0 forward);
    3. ``pp - r`` triples (chunk-1 F, I, W);
    4. steady: (chunk-0 F, I, W), (chunk-1 F, I, W) until every forward ran;
    5. cool-down: ``r`` pairs of I (chunk 0, chunk 1), then ``pp - r`` pairs
       (chunk-0 I, W), then every W still pending.

    The phases are laid out for ``max(m, 2pp - 1)`` microbatches and passes of
    the microbatches beyond ``m`` are dropped. With equal F, I and W times per
    chunk the steady state has no bubble, and activations stay those of 1F1B.
    """
    m = num_microbatches
    n = max(2 * pp - 1, m)
    last = 2 * pp - 1
    actions = []
    for rank in range(pp):
        down, up = rank, last - rank
        count = {(k, s): 0 for k in "FIW" for s in (down, up)}
        ops: list[Action] = []

        def run(kind: str, stage: int) -> None:
            mb = count[kind, stage]
            count[kind, stage] += 1
            ops.append(Action(kind, stage, mb))

        for _ in range(2 * (pp - rank) - 1):
            run("F", down)
        for _ in range(rank):
            run("F", up)
            run("F", down)
        for _ in range(pp - rank):
            for kind in "FIW":
                run(kind, up)
        while count["F", up] < count["F", down] or count["F", down] < n:
            if count["F", down] < n:
                run("F", down)
            run("I", down)
            run("W", down)
            for kind in "FIW":
                run(kind, up)
        for _ in range(rank):
            run("I", down)
            run("I", up)
        for _ in range(pp - rank):
            run("I", down)
            run("W", down)
        for stage in (up, down):
            while count["W", stage] < count["I", stage]:
                run("W", stage)
        actions.append([a for a in ops if a.microbatch < m])
    return Schedule("zbv", pp, m, 2, actions, placement="v")


def dualpipe_v(pp: int, num_microbatches: int) -> Schedule:
    """DualPipe-V: DeepSeek's DualPipe (DeepSeek-AI 2024, DeepSeek-V3 report section 3.2.1) cut in half.

    Two stages per rank in a V, as ZB-V. Its point is the steady state: every
    step pairs the forward of one microbatch with the full backward of another
    on the other chunk, so that the communication of one (expert all-to-alls,
    pipeline transfers) hides behind the computation of the other. Phases for
    rank ``r``, as in PyTorch's ``ScheduleDualPipeV`` (from deepseek-ai/DualPipe):

    1. ``2(pp - r - 1)`` chunk-0 forwards;
    2. ``r + 1`` pairs of forwards (chunk 0, chunk 1);
    3. ``pp - r - 1`` triples: chunk-1 input-gradient, a pending W, chunk-1 forward;
    4. steady: ``m - 2pp + r + 1`` rounds of (chunk-0 F with chunk-1 B) and
       (chunk-1 F with chunk-0 B), each pair run forward first;
    5. ``pp - r - 1`` rounds of a chunk-1 B, then (chunk-1 F with chunk-0 B);
    6. ``r + 1`` pairs of backwards (chunk 1, chunk 0), split into I with a
       W deferred from the middle of the pairs on;
    7. ``pp - r - 1`` rounds of a pending W, then a chunk-0 backward;
    8. the remaining W passes.

    The pairs are marked (:attr:`Schedule.paired`); with ``ep_comm_overlap``
    each pass's expert all-to-alls run beside the other's compute
    (:meth:`~parsim.lowering.lower.Lowering.build`), otherwise one pass
    runs after the other.
    """
    m = num_microbatches
    last = 2 * pp - 1
    actions, pairs = [], []
    for rank in range(pp):
        down, up = rank, last - rank
        forwards = {down: 0, up: 0}
        backwards = {down: 0, up: 0}  # I and full B share one count: a B is that microbatch's I and W at once
        deferred: deque[Action] = deque()  # W passes owed by earlier I passes, oldest first
        ops: list[Action] = []
        paired: set[int] = set()

        def forward(stage: int) -> None:
            ops.append(Action("F", stage, forwards[stage]))
            forwards[stage] += 1

        def backward(stage: int, split: bool = False) -> None:
            ops.append(Action("I" if split else "B", stage, backwards[stage]))
            if split:
                deferred.append(Action("W", stage, backwards[stage]))
            backwards[stage] += 1

        def weight() -> None:
            if deferred:
                ops.append(deferred.popleft())

        for _ in range(2 * (pp - rank - 1)):
            forward(down)
        for _ in range(rank + 1):
            forward(down)
            forward(up)
        for _ in range(pp - rank - 1):
            backward(up, split=True)
            weight()
            forward(up)
        for i in range(m - 2 * pp + rank + 1):
            if i or rank < pp - 1:  # DualPipeV.step: the last rank runs its first two alone, for a smaller bubble
                paired.add(len(ops))
            forward(down)
            backward(up)
            paired.add(len(ops))
            forward(up)
            backward(down)
        for _ in range(pp - rank - 1):
            backward(up)
            paired.add(len(ops))
            forward(up)
            backward(down)
        split = False
        for i in range(rank + 1):
            split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
            backward(up, split)
            split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
            backward(down, split)
        for _ in range(pp - rank - 1):
            weight()
            backward(down, split)
        while deferred:
            weight()
        actions.append(ops)
        pairs.append(frozenset(paired))
    return Schedule("dualpipe-v", pp, m, 2, actions, placement="v", paired=tuple(pairs))


def combined_1f1b(schedule: Schedule) -> Schedule:
    """1F1B without a pipeline as Megatron-LM runs it with ``overlap_moe_expert_parallel_comm``
    (``combined_1f1b_schedule_for_no_pipelining``, ``megatron/core/pipeline_parallel/combined_1f1b.py``): the
    first forward alone, then each next forward together with the backward of the microbatch before it, then
    the last backward. Two microbatches' activations are held at once."""
    if schedule.pp != 1 or schedule.virtual_stages != 1:
        raise ValueError("combined 1F1B reorders a schedule without a pipeline (pp 1, one stage)")
    m = schedule.num_microbatches
    actions = [Action("F", 0, 0)]
    for mb in range(1, m):
        actions += [Action("F", 0, mb), Action("B", 0, mb - 1)]
    actions.append(Action("B", 0, m - 1))
    return Schedule(schedule.name, 1, m, 1, [actions], paired=(frozenset(range(1, 2 * m - 1, 2)),))


# Under a pipeline, the schedules that pair a forward with another microbatch's backward (ep_comm_overlap)
PAIRED_SCHEDULES = ("dualpipe-v", "interleaved-1f1b")


def paired_schedule(name: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The schedule as it runs with each forward paired with the backward after it (``ep_comm_overlap``):
    Megatron-LM's combined 1F1B without a pipeline (:func:`combined_1f1b`) or interleaved
    (:func:`combined_interleaved_1f1b`); DualPipe-V pairs its chunks in its own order."""
    if pp == 1:
        return combined_1f1b(make_schedule(name, pp, num_microbatches, virtual_stages))
    if name == "interleaved-1f1b":
        return combined_interleaved_1f1b(pp, num_microbatches, virtual_stages)
    if name == "dualpipe-v":
        return make_schedule(name, pp, num_microbatches, virtual_stages)
    raise ValueError(f"{name} pairs no passes: ep_comm_overlap runs under dualpipe-v, interleaved-1f1b or pp 1")


@dataclass(frozen=True)
class ScheduleKind:
    """A schedule generator with what people need to know to choose it.

    ``virtual_stages`` is the allowed range of stages per rank (``None``: no
    upper bound); its lower end is the default. Schedules that loop ``v > 1``
    stages over the ranks run microbatches in whole rounds (:func:`splits_into_rounds`).
    """

    name: str
    summary: str
    source: str
    torch_class: str
    build: Callable[[int, int, int], Schedule]
    virtual_stages: tuple[int, int | None] = (1, 1)
    looped: bool = False  # v > 1 stages per rank loop over the ranks in rounds of pp microbatches
    microbatch_per_stage: bool = False  # needs at least as many microbatches as stages (pp x v)

    def min_microbatches(self, pp: int, v: int) -> int:
        return pp * v if self.microbatch_per_stage else 1

    def check_virtual_stages(self, v: int) -> None:
        low, high = self.virtual_stages
        if v < low or (high is not None and v > high):
            allowed = f"{low}" if low == high else f">= {low}" if high is None else f"{low}..{high}"
            raise ParsimError(f"schedule {self.name} needs virtual stages per rank {allowed}, got {v}")

    def needs_whole_rounds(self, v: int) -> bool:
        """True when microbatches must fill whole rounds (looped stages; see :func:`round_size`)."""
        return v > 1 and self.looped

    def rounds_of_pp(self, pp: int, m: int, v: int) -> bool:
        """True unless looped stages run ``m`` in rounds of another size than ``pp`` (:func:`round_size`): then
        a schedule a few rounds shorter is not this one's steady state, and shortcuts that time one must not
        stand in for it."""
        return not (self.needs_whole_rounds(v) and m % pp)


SCHEDULES: dict[str, ScheduleKind] = {
    k.name: k for k in (
        ScheduleKind("gpipe", "all forwards, then all backwards", "Huang et al. 2019, GPipe", "ScheduleGPipe",
                     lambda p, m, v: gpipe(p, m)),
        ScheduleKind("1f1b", "warm-up forwards, then one forward / one backward, then cool-down",
                     "Narayanan et al. 2021, PipeDream-Flush; Megatron-LM", "Schedule1F1B",
                     lambda p, m, v: one_f_one_b(p, m)),
        ScheduleKind("interleaved-1f1b", "1F1B over v looped stages per rank",
                     "Narayanan et al. 2021, Megatron-LM interleaved schedule", "ScheduleInterleaved1F1B",
                     interleaved_1f1b, (2, None), looped=True),
        ScheduleKind("zero-bubble", "backward split into I and W; W deferred to fill the bubble",
                     "Qi et al. 2023, Zero Bubble Pipeline Parallelism (ZB-H1)", "ScheduleInterleavedZeroBubble",
                     zero_bubble, (1, None), looped=True),
        ScheduleKind("zb-h2", "ZB-H1 with twice the warm-up forwards: no gaps, about twice 1F1B's activations",
                     "Qi et al. 2023, Zero Bubble Pipeline Parallelism (ZB-H2)", "",
                     lambda p, m, v: zb_h2(p, m)),
        ScheduleKind("zbv", "two stages per rank in a V; I and W split to fill the bubble",
                     "Qi et al. 2023, Zero Bubble Pipeline Parallelism (ZB-V)", "ScheduleZBVZeroBubble",
                     lambda p, m, v: zbv(p, m), (2, 2)),
        ScheduleKind("dualpipe-v", "two stages per rank in a V; forward and backward of two microbatches paired",
                     "DeepSeek-AI 2024, DualPipe (DeepSeek-V3), cut in half", "ScheduleDualPipeV",
                     lambda p, m, v: dualpipe_v(p, m), (2, 2), microbatch_per_stage=True),
    )
}


# Stage-microbatch pairs of one schedule: generating and timing them is linear in this (up to about
# 10 s at this bound, zbv being the slowest), and no real step comes near it.
MAX_STAGE_MICROBATCHES = 2**17


def make_schedule(name: str, pp: int, num_microbatches: int, virtual_stages: int | None = None) -> Schedule:
    """Build the schedule called ``name`` for ``pp`` ranks and ``num_microbatches`` microbatches.

    ``virtual_stages`` (stages per rank) defaults to the schedule's own: 1,
    or 2 for ``interleaved-1f1b`` and ``zbv``. Unknown names and impossible
    sizes raise :class:`ParsimError` with one line saying what is expected.
    """
    kind = SCHEDULES.get(name.lower())
    if kind is None:
        raise ParsimError(f"unknown pipeline schedule {name!r} (expected one of {', '.join(SCHEDULES)})")
    v = kind.virtual_stages[0] if virtual_stages is None else virtual_stages
    if pp < 1:
        raise ParsimError(f"pipeline size must be at least 1, got {pp}")
    if num_microbatches < 1:
        raise ParsimError(f"number of microbatches must be at least 1, got {num_microbatches}")
    kind.check_virtual_stages(v)
    if pp * v * num_microbatches > MAX_STAGE_MICROBATCHES:
        raise ParsimError(f"pp {pp:,} x {v} virtual stages x {num_microbatches:,} microbatches is more than parsim "
                          f"schedules ({MAX_STAGE_MICROBATCHES:,} stage-microbatches; each stage's time per "
                          f"microbatch does not depend on their number)")
    if num_microbatches < kind.min_microbatches(pp, v):
        raise ParsimError(f"schedule {kind.name} needs at least as many microbatches as stages "
                          f"({pp} x {v} = {pp * v}), got {num_microbatches}")
    if kind.needs_whole_rounds(v) and (why := uneven_rounds(pp, num_microbatches)):
        raise ParsimError(f"schedule {kind.name} with {v} virtual stages {why}")
    return kind.build(pp, num_microbatches, v)
