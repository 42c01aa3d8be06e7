"""The fast model's batched pipeline timing equals the schedules' dependency-driven timing."""

from __future__ import annotations

import numpy as np
import pytest

from parsim.schedules import SCHEDULES, make_schedule, simulate_ideal
from parsim.search.pipeline import compile_schedule, sweep, time_schedule


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
