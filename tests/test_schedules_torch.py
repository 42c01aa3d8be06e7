"""parsim's schedules run the same passes in the same order as torch.distributed.pipelining's.

No process group is needed:

- single-stage schedules (``ScheduleGPipe``, ``Schedule1F1B``) are driven
  through their real runtime loop, ``_step_microbatches``, with a stand-in
  stage that records each ``forward_one_chunk`` / ``backward_one_chunk`` call
  and has no peers to talk to. (Their ``pipeline_order`` IR is not used: in
  torch 2.13 ``Schedule1F1B._get_pipeline_order`` numbers the last rank's
  forwards 1..m instead of 0..m-1, while the runtime runs 0..m-1.)
- multi-stage schedules are built with stand-in stage objects; their
  ``pipeline_order_with_comms`` is the exact list the runtime executes, and we
  keep its compute actions.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from parsim.errors import ParsimError
from parsim.schedules import Action, make_schedule

S = pytest.importorskip("torch.distributed.pipelining.schedules")

COMPUTE = {"F", "B", "I", "W"}


class RecordingStage:
    """Just enough of ``_PipelineStageBase`` for a single-stage schedule's runtime loop, with no peers."""

    def __init__(self, stage_index: int, num_stages: int):
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.calls: list[Action] = []
        self.output_chunks: list = []

    def forward_one_chunk(self, mb, *args, **kwargs):
        self.calls.append(Action("F", self.stage_index, mb))

    def backward_one_chunk(self, mb, **kwargs):
        self.calls.append(Action("B", self.stage_index, mb))

    def get_fwd_recv_ops(self, mb):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def clear_runtime_states(self):
        pass

    def perform_reduce_grad(self, scale):
        pass


def torch_single_stage_order(cls, pp: int, m: int) -> list[list[Action]]:
    order = []
    for rank in range(pp):
        stage = RecordingStage(rank, pp)
        schedule = cls(stage, m)
        schedule._initialize_stage = lambda *args, **kwargs: None  # no tensors to shape-check
        schedule._step_microbatches()
        order.append(stage.calls)
    return order


def torch_multi_stage_order(cls, pp: int, m: int, stages_per_rank: list[list[int]]) -> list[list[Action]]:
    num_stages = sum(len(s) for s in stages_per_rank)
    stages = [SimpleNamespace(num_stages=num_stages, group_size=pp, group_rank=0, stage_index=i, submod=None)
              for i in stages_per_rank[0]]
    schedule = cls(stages, m)
    return [[Action(a.computation_type.value, a.stage_index, a.microbatch_index)
             for a in _expand(schedule.pipeline_order_with_comms[rank]) if a.computation_type.value in COMPUTE]
            for rank in range(pp)]


def _expand(actions):
    """DualPipeV's overlapped forward+backward actions, as the two passes they hold (forward first)."""
    for a in actions:
        yield from (a.sub_actions or ()) if getattr(a, "sub_actions", None) else (a,)


SIZES = [(p, m) for p in (1, 2, 3, 4, 5, 8) for m in (1, 2, 3, 4, 6, 8, 12, 16)]


@pytest.mark.parametrize("pp,m", SIZES)
def test_gpipe_matches_torch(pp, m):
    assert make_schedule("gpipe", pp, m).actions == torch_single_stage_order(S.ScheduleGPipe, pp, m)


@pytest.mark.parametrize("pp,m", [(p, m) for p, m in SIZES if m >= p])  # torch needs m >= pp
def test_1f1b_matches_torch(pp, m):
    assert make_schedule("1f1b", pp, m).actions == torch_single_stage_order(S.Schedule1F1B, pp, m)


def torch_accepts_rounds(pp: int, m: int) -> bool:
    """torch's looped schedules want m to be a multiple of their rounds, max(1, m // pp)."""
    return m % max(1, m // pp) == 0


# Sizes where m is not a multiple of pp but fills torch's rounds: 3 on 4 (one round of 3), 10 on 4 (two of
# 5), 9 on 4 (two rounds would be 4.5: refused), 14 on 4 (three of 4.67: refused), 6 on 5, 7 on 3.
ROUND_SIZES = SIZES + [(4, 5), (4, 9), (4, 10), (4, 14), (5, 6), (3, 7), (8, 10), (8, 18)]
LOOPED_SIZES = [(p, m) for p, m in ROUND_SIZES if torch_accepts_rounds(p, m)]


@pytest.mark.parametrize("pp,m,v", [(p, m, v) for p, m in LOOPED_SIZES for v in (2, 3, 4)])
def test_interleaved_1f1b_matches_torch(pp, m, v):
    ours = make_schedule("interleaved-1f1b", pp, m, v)
    theirs = torch_multi_stage_order(S.ScheduleInterleaved1F1B, pp, m, [ours.stages_of(r) for r in range(pp)])
    assert ours.actions == theirs


@pytest.mark.parametrize("pp,m", [(p, m) for p, m in ROUND_SIZES if not torch_accepts_rounds(p, m)])
def test_looped_schedules_refuse_what_torch_refuses(pp, m):
    for name, cls in (("interleaved-1f1b", S.ScheduleInterleaved1F1B),
                      ("zero-bubble", S.ScheduleInterleavedZeroBubble)):
        with pytest.raises(ParsimError, match="rounds"):
            make_schedule(name, pp, m, 2)
        with pytest.raises(ValueError, match="multiple of the number of rounds"):
            torch_multi_stage_order(cls, pp, m, [[r, r + pp] for r in range(pp)])


@pytest.mark.parametrize("pp,m,v", [(p, m, 1) for p, m in LOOPED_SIZES]
                         + [(p, m, v) for p, m in LOOPED_SIZES for v in (2, 3)])
def test_zero_bubble_matches_torch_interleaved_zero_bubble(pp, m, v):
    """With one stage per rank, torch's ScheduleInterleavedZeroBubble is ZB-H1 ("ZB1P").

    torch refuses some sizes ZB-H1 handles (pp=3, m=16: 16 is not a multiple
    of its 5 rounds, a constraint that only matters with several stages per
    rank); parsim builds those too and compares where torch builds.
    """
    ours = make_schedule("zero-bubble", pp, m, v)
    theirs = torch_multi_stage_order(S.ScheduleInterleavedZeroBubble, pp, m, [ours.stages_of(r) for r in range(pp)])
    assert ours.actions == theirs


@pytest.mark.parametrize("pp,m", SIZES)
def test_zbv_matches_torch(pp, m):
    ours = make_schedule("zbv", pp, m)
    theirs = torch_multi_stage_order(S.ScheduleZBVZeroBubble, pp, m, [ours.stages_of(r) for r in range(pp)])
    assert ours.actions == theirs


@pytest.mark.parametrize("pp,m", [(p, m) for p, m in SIZES if m >= 2 * p])  # DualPipeV needs m >= 2 pp
def test_dualpipe_v_matches_torch(pp, m):
    ours = make_schedule("dualpipe-v", pp, m)
    theirs = torch_multi_stage_order(S.ScheduleDualPipeV, pp, m, [ours.stages_of(r) for r in range(pp)])
    assert ours.actions == theirs


def test_stage_placement_matches_torch():
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for pp in (1, 2, 4, 8):
        for name, v, style in (("interleaved-1f1b", 3, "loop"), ("zbv", 2, "v")):
            schedule = make_schedule(name, pp, pp * 2, v)
            mapping = generate_stage_to_rank_mapping(pp, pp * v, style=style)
            assert [schedule.stage_to_rank(s) for s in range(pp * v)] == [mapping[s] for s in range(pp * v)]
