"""Ranks taking turns on a shared CPU core (parsim.sim.cores): closed forms of round-robin with a time slice."""

from __future__ import annotations

import pytest
import simpy

from parsim.sim.cores import SharedCores, eevdf_slice_s

SLICE = 1.5e-3


def _cores(ranks: int = 2) -> tuple[simpy.Environment, SharedCores, dict[str, float]]:
    env = simpy.Environment()
    return env, SharedCores(env, {rank: 0 for rank in range(ranks)}, SLICE), {}


def _job(env: simpy.Environment, cores: SharedCores, ends: dict[str, float], name: str, rank: int, work_s: float,
         at_s: float | None = 0.0, penalty: float = 1.0, then=None) -> None:
    """Submit ``work_s`` of ``rank``'s work at ``at_s`` (None: at once, as the simulator does from the end of
    the rank's last job); record when it ends under ``name``."""
    def done() -> None:
        ends[name] = env.now
        if then:
            then()

    if at_s is None:
        cores.run(rank, work_s, penalty, done)
    else:
        env.timeout(at_s).callbacks.append(lambda _e: cores.run(rank, work_s, penalty, done))


def test_a_rank_alone_on_its_core_runs_at_full_speed_whatever_its_slices():
    env, cores, ends = _cores()
    _job(env, cores, ends, "a", 0, 10e-3, penalty=1.3)
    env.run()
    assert ends["a"] == pytest.approx(10e-3)


def test_work_shorter_than_a_slice_runs_whole_while_the_other_rank_waits():
    """Both ranks ready at once, 1 ms of work each: the first runs it whole, slowed by the penalty while the
    other waits (1.2 ms), then the other runs alone."""
    env, cores, ends = _cores()
    _job(env, cores, ends, "a", 0, 1e-3, penalty=1.2)
    _job(env, cores, ends, "b", 1, 1e-3, penalty=1.2)
    env.run()
    assert ends["a"] == pytest.approx(1.2e-3)
    assert ends["b"] == pytest.approx(2.2e-3)


def test_longer_work_alternates_slice_by_slice():
    """10 ms each, 1.5 ms slices: a runs slices 1, 3, ..., its last 1 ms after six full slices of each rank."""
    env, cores, ends = _cores()
    _job(env, cores, ends, "a", 0, 10e-3)
    _job(env, cores, ends, "b", 1, 10e-3)
    env.run()
    assert ends["a"] == pytest.approx(12 * SLICE + 1e-3)
    assert ends["b"] == pytest.approx(20e-3)


def test_a_rank_that_wakes_on_a_busy_core_waits_for_the_slice_to_end():
    """a computes from 0; b's wait ends at 0.5 ms: b goes on at 1.5 ms, when a's slice is over."""
    env, cores, ends = _cores()
    _job(env, cores, ends, "a", 0, 10e-3)
    env.timeout(0.5e-3).callbacks.append(lambda _e: cores.wake(1, lambda: ends.__setitem__("b", env.now)))
    env.run()
    assert ends["b"] == pytest.approx(SLICE)


def test_a_rank_keeps_its_slice_across_work_that_follows_at_once():
    """a's first job ends at 1 ms (b waiting since 0.5 ms) and its next starts at once: a keeps the core to the
    end of its slice, 1.5 ms, b then runs its 0.2 ms, and a finishes its 2 ms after."""
    env, cores, ends = _cores()
    _job(env, cores, ends, "a1", 0, 1e-3, then=lambda: _job(env, cores, ends, "a2", 0, 2e-3, at_s=None))
    _job(env, cores, ends, "b", 1, 0.2e-3, at_s=0.5e-3)
    env.run()
    assert ends["a1"] == pytest.approx(1e-3)
    assert ends["b"] == pytest.approx(SLICE + 0.2e-3)
    assert ends["a2"] == pytest.approx(3.2e-3)


def test_a_rank_that_ran_alone_past_its_slice_is_preempted_at_once():
    """a runs alone from 0; b arrives at 4 ms, long after a's slice (to 1.5 ms) was spent: EEVDF protects only
    the slice a task was picked for, so b runs at once, and a finishes after it."""
    env, cores, ends = _cores()
    _job(env, cores, ends, "a", 0, 10e-3)
    _job(env, cores, ends, "b", 1, 0.1e-3, at_s=4e-3)
    env.run()
    assert ends["b"] == pytest.approx(4.1e-3)
    assert ends["a"] == pytest.approx(10.1e-3)


def test_work_that_follows_at_once_gets_no_new_slice():
    """a's 2 ms job ends and its 5 ms job starts at once, in no new slice: b, arriving at 3 ms, runs its 0.2 ms
    at once."""
    env, cores, ends = _cores()
    _job(env, cores, ends, "a1", 0, 2e-3, then=lambda: _job(env, cores, ends, "a2", 0, 5e-3, at_s=None))
    _job(env, cores, ends, "b", 1, 0.2e-3, at_s=3e-3)
    env.run()
    assert ends["b"] == pytest.approx(3.2e-3)
    assert ends["a2"] == pytest.approx(7.2e-3)


@pytest.mark.parametrize("cpus, slice_ms", [(1, 0.75), (2, 1.5), (4, 2.25), (6, 2.25), (8, 3.0), (96, 3.0)])
def test_the_scheduler_s_slice_grows_with_the_log_of_the_cpus_up_to_eight(cpus, slice_ms):
    assert eevdf_slice_s(cpus) == pytest.approx(slice_ms * 1e-3)
