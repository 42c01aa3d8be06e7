"""The fast model's batched pipeline timing equals the schedules' dependency-driven timing."""

from __future__ import annotations

import numpy as np
import pytest

from parsim.schedules import SCHEDULES, make_schedule, paired_schedule, simulate_ideal
from parsim.search.pipeline import compile_schedule, pairs_per_rank, sweep, time_schedule


def durations(tf, tb, tw) -> np.ndarray:
    """Per stage F, B, I, W: the full backward is I + W."""
    return np.stack([tf, tb, tb - tw, tw], axis=1).ravel()


def v_of(name: str) -> int:
    return 2 if name in ("interleaved-1f1b", "zbv", "dualpipe-v") else 1


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_sweep_equals_simulate_ideal_with_uneven_stages_and_transfers(name, pp):
    rng = np.random.default_rng(pp)
    v = v_of(name)
    for m in (pp, pp + 1, 2 * pp, 3 * pp + 2):
        try:
            schedule = make_schedule(name, pp, m, v)
        except Exception:
            continue
        stages = pp * v
        tf, tb = rng.uniform(1, 2, stages), rng.uniform(2, 4, stages)
        tw, comm = tb * rng.uniform(0.2, 0.5, stages), rng.uniform(0, 0.5)
        ideal = simulate_ideal(schedule, tf, tb, tw, comm)
        timing = sweep(compile_schedule(name, pp, m, v), durations(tf, tb, tw)[None], np.full((1, stages - 1), comm))
        assert timing.rank_end.max() == pytest.approx(ideal.step_time, rel=1e-12)
        ends = [max(iv.end for iv in ivs) for ivs in ideal.intervals]
        assert timing.rank_end[0] == pytest.approx(ends, rel=1e-12)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_long_schedules_are_extended_along_their_steady_state_exactly(name):
    """Realistic stages (the last one heavier: the LM head), batches of plans, m up to 96."""
    rng = np.random.default_rng(7)
    pp, v = 4, v_of(name)
    stages, batch = pp * v, 16
    tf = np.repeat(rng.uniform(0.9, 1.1, (batch, 1)), stages, axis=1)
    tf[:, -1] *= 1.2
    tb = 2 * tf
    d = np.stack([tf, tb, tb - 0.9 * tf, 0.9 * tf], axis=2).reshape(batch, -1)
    hops = np.full((batch, stages - 1), 0.02)
    extra = rng.uniform(0.0, 0.3, (batch, stages))  # the final passes slowed (the buckets' held SMs)
    for m in (40, 44, 64, 96):
        for final_extra in (None, extra):
            exact = sweep(compile_schedule(name, pp, m, v), d, hops, final_extra=final_extra)
            fast = time_schedule(name, pp, m, v, d, hops, final_extra=final_extra)
            assert fast.rank_end == pytest.approx(exact.rank_end, rel=1e-9)
            assert fast.final_start == pytest.approx(exact.final_start, rel=1e-9)


def test_a_late_rank_start_delays_the_pipeline():
    compiled = compile_schedule("1f1b", 2, 4, 1)
    d = durations(np.ones(2), 2 * np.ones(2), np.zeros(2))[None]
    base = sweep(compiled, d, np.zeros((1, 1)))
    late = sweep(compiled, d, np.zeros((1, 1)), start=np.array([[0.5, 0.0]]))
    assert late.rank_end.max() == pytest.approx(base.rank_end.max() + 0.5)


def test_a_slower_final_backward_delays_the_stages_waiting_for_its_gradients():
    """1F1B on 2 ranks: stage 1's last backward taking 0.3 longer starts stage 0's last backward 0.3 later, and
    ends the step 0.3 later; stage 1's own last backward starts when it did."""
    compiled = compile_schedule("1f1b", 2, 4, 1)
    d = durations(np.ones(2), 2 * np.ones(2), np.zeros(2))[None]
    base = sweep(compiled, d, np.zeros((1, 1)))
    slow = sweep(compiled, d, np.zeros((1, 1)), final_extra=np.array([[0.0, 0.3]]))
    assert slow.final_start[0, 1] == pytest.approx(base.final_start[0, 1], abs=1e-12)
    assert slow.final_start[0, 0] == pytest.approx(base.final_start[0, 0] + 0.3, abs=1e-12)
    assert slow.rank_end.max() == pytest.approx(base.rank_end.max() + 0.3, abs=1e-12)


@pytest.mark.parametrize("name, pp, v", [("dualpipe-v", 4, 2), ("interleaved-1f1b", 4, 2), ("1f1b", 1, 1)])
def test_paired_schedules_are_extended_and_counted_along_their_steady_state_exactly(name, pp, v):
    """``ep_comm_overlap``: each pair of a forward and a backward one pass of the sweep, its savings taken off;
    long schedules extended as unpaired ones are, and the pairs each rank runs counted the same way."""
    rng = np.random.default_rng(3)
    stages, batch = pp * v, 8
    tf = rng.uniform(0.9, 1.1, (batch, stages))
    d = np.stack([tf, 2 * tf, np.zeros_like(tf), np.zeros_like(tf)], axis=2).reshape(batch, -1)
    hops = np.full((batch, max(stages - 1, 1)), 0.05)[:, :stages - 1]
    savings = rng.uniform(0.0, 0.5, (batch, stages, stages))
    for m in (40, 64, 96):
        compiled = compile_schedule(name, pp, m, v, True)
        exact = sweep(compiled, d, hops, savings=savings)
        fast = time_schedule(name, pp, m, v, d, hops, savings=savings)
        assert fast.rank_end == pytest.approx(exact.rank_end, rel=1e-9)
        counted = np.zeros((pp, stages, stages))
        schedule = paired_schedule(name, pp, m, v)
        for r, actions in enumerate(schedule.actions):
            for i in schedule.paired[r]:
                counted[r, actions[i].stage, actions[i + 1].stage] += 1
        assert pairs_per_rank(name, pp, m, v) == pytest.approx(counted)
        assert len(compiled.var) == sum(map(len, schedule.actions)) - counted.sum()
        unpaired = sweep(compile_schedule(name, pp, m, v), d, hops)
        assert exact.rank_end.max() < unpaired.rank_end.max()  # the savings show in the step


def test_a_pairs_sends_go_out_one_after_the_other_once_both_passes_are_done():
    """DualPipe-V on 2 ranks: rank 0 pairs stage 0's forward with stage 3's backward, whose outputs both go to
    rank 1 (stages 1 and 2). The pass after such a pair waits for both transfers, the backward's first (over
    boundary 2), then the forward's (boundary 0), as the lowering sends them."""
    compiled = compile_schedule("dualpipe-v", 2, 8, 2, True)
    assert {tuple(p) for p in compiled.pairs} == {(0, 3), (3, 0), (1, 2), (2, 1)}
    both_out = compiled.num_stages * 4 + [tuple(p) for p in compiled.pairs].index((0, 3))
    pair_rows = np.flatnonzero(compiled.var == both_out)
    after = [j for j in range(len(compiled.var)) if compiled.rank[j] == 0 and compiled.waits[j, 0] in pair_rows]
    assert after and all((compiled.hop[j, 0], compiled.queued[j, 0]) == (2, 0) for j in after)
    d = np.ones((1, 16))
    hops = np.array([[0.25, 0.0, 0.5]])  # boundary 1 is inside rank 1
    timing = sweep(compiled, d, hops, every_pass=True)
    for j in after:
        pair_end = timing.starts[0, compiled.waits[j, 0]] + 2.0  # a forward and a backward of 1 s each
        assert timing.starts[0, j] >= pair_end + 0.75 - 1e-12
