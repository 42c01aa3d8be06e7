"""What a pipeline schedule is: per-rank ordered lists of compute actions.

A pipeline splits the model into ``pp * v`` consecutive *stages* (``v``
virtual stages per rank) and the batch into ``m`` microbatches. A schedule
says, for every rank, in which order it runs the passes of the stages it owns:

- ``F``: forward of one stage for one microbatch;
- ``B``: full backward (gradients w.r.t. inputs and weights together);
- ``I``: backward w.r.t. the stage's *input* only (what the previous stage waits for);
- ``W``: backward w.r.t. the stage's *weights* only (nobody waits for it).

Splitting ``B`` into ``I`` + ``W`` is the idea of zero-bubble pipelines
(Qi et al. 2023): only ``I`` is on the critical path between stages, so ``W``
can be moved to fill idle time. The letters are those of
``torch.distributed.pipelining`` (``_ComputationType``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

KINDS = ("F", "B", "I", "W")
KIND_NAMES = {"F": "forward", "B": "full backward", "I": "input-gradient backward",
              "W": "weight-gradient backward"}
PLACEMENTS = ("loop", "v")


@dataclass(frozen=True, order=True)
class Action:
    """One compute pass: ``kind`` (F, B, I or W) of global stage ``stage`` on ``microbatch``."""

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"

    def torch_str(self) -> str:
        """PyTorch's notation: stage, kind, microbatch (``4F3``)."""
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass
class Schedule:
    """Per-rank action lists of one pipeline schedule.

    ``actions[r]`` is what rank ``r`` runs, in order. Stages are global
    (``0 .. pp * virtual_stages - 1``); ``placement`` says which rank owns
    which stage: ``"loop"`` puts stage ``s`` on rank ``s % pp`` (Megatron
    interleaving), ``"v"`` runs stages down the ranks and back up again
    (``0 1 2 3 | 3 2 1 0``), as ZB-V and DualPipe-V do.
    """

    name: str
    pp: int
    num_microbatches: int
    virtual_stages: int
    actions: list[list[Action]]
    placement: str = "loop"
    # per rank, the index of each forward that runs together with the backward right after it (DualPipe's
    # overlapped chunks, Megatron-LM's combined 1F1B): what ``ep_comm_overlap`` overlaps
    paired: tuple[frozenset[int], ...] = ()
    _owner: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, not {self.placement!r}")
        self._owner = [self._place(s) for s in range(self.num_stages)]

    @property
    def num_stages(self) -> int:
        """Number of (virtual) stages in the whole pipeline."""
        return self.pp * self.virtual_stages

    @cached_property
    def split_backward(self) -> bool:
        """True when the backward runs as separate I and W passes (actions are not to be edited after creation)."""
        return any(a.kind in ("I", "W") for rank in self.actions for a in rank)

    @cached_property
    def split_passes(self) -> frozenset[tuple[int, int]]:
        """The (stage, microbatch) pairs whose backward runs as I and W (DualPipe-V splits only some)."""
        return frozenset((a.stage, a.microbatch) for rank in self.actions for a in rank if a.kind == "I")

    def input_gradient_pass(self, stage: int, microbatch: int) -> str:
        """``I`` when that backward is split, else ``B``: the pass that sends the gradient upstream."""
        return "I" if (stage, microbatch) in self.split_passes else "B"

    def stage_to_rank(self, stage: int) -> int:
        """The rank that owns (runs every pass of) ``stage``."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} out of range 0..{self.num_stages - 1}")
        return self._owner[stage]

    def stages_of(self, rank: int) -> list[int]:
        """The stages rank ``rank`` owns, in increasing order."""
        return [s for s, r in enumerate(self._owner) if r == rank]

    def format(self, torch_notation: bool | None = None) -> str:
        """One line per rank listing its actions; stage numbers are shown when a rank owns several."""
        if torch_notation is None:
            torch_notation = self.virtual_stages > 1
        lines = []
        for rank, acts in enumerate(self.actions):
            body = " ".join(a.torch_str() if torch_notation else str(a) for a in acts)
            lines.append(f"rank {rank}: {body}")
        return "\n".join(lines)

    def _place(self, stage: int) -> int:
        if self.placement == "loop":
            return stage % self.pp
        chunk, offset = divmod(stage, self.pp)
        return offset if chunk % 2 == 0 else self.pp - 1 - offset
