"""The host-speed probes: a fixed matmul's rate, an eager pass's time and AdamW's bytes per second, timed on one
rank per core, before and after the measured steps; and the collective probe, an all-reduce on ranks 0 and 1."""

from __future__ import annotations

import importlib.util
import time

import pytest

from executor.launch import HOST_CORES_ENV
from executor.speed_probe import (ADAMW_BYTES, ADAMW_ELEMENTS, ADAMW_TENSORS, COLLECTIVE_PROBE_KIB, SHAPE, WEIGHTS,
                                  SpeedProbe, probes_on)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")


def test_the_probes_report_two_rates_and_a_time_per_pass_over_at_least_their_time():
    probe = SpeedProbe()
    start = time.perf_counter()
    flops, eager_s, memory_Bps = probe(0.15)
    elapsed = time.perf_counter() - start
    m, k, n = SHAPE
    assert elapsed >= 0.15
    # At least one pass over the weights and one AdamW step, none of it before the clock started counting.
    assert WEIGHTS * 2 * m * k * n / elapsed <= flops < 1e13
    assert 0 < eager_s <= 0.05
    assert ADAMW_BYTES * ADAMW_TENSORS * ADAMW_ELEMENTS / elapsed <= memory_Bps < 1e13


def test_one_rank_per_core_probes(monkeypatch):
    monkeypatch.setenv(HOST_CORES_ENV, "2")
    assert [probes_on(rank, 4) for rank in range(4)] == [True, True, False, False]
    assert [probes_on(rank, 1) for rank in range(1)] == [True]


@pytest.mark.multiproc
def test_a_run_asked_to_probe_reports_the_host_speed_around_its_steps():
    from executor.train import run_plan
    from parsim.workload.plan import resolve_plan

    plan = resolve_plan("course-pp")
    _, probed = run_plan(plan, 2, steps=2, backend="gloo", timeout_s=120, probe_speed=True)
    _, plain = run_plan(plan, 2, steps=1, backend="gloo", timeout_s=120)
    assert 1e8 < probed["speed_probe"]["matmul_flops"] < 1e13 and 0 < probed["speed_probe"]["eager_s"] < 1
    assert 1e8 < probed["speed_probe"]["memory_Bps"] < 1e13
    # the collective probe: an all-reduce's seconds by KiB (which size takes longer is the host's to say: a
    # slow spell of its transfers can land on any one of them)
    collective = probed["collective_probe_s"]
    assert list(collective) == list(COLLECTIVE_PROBE_KIB) and all(0 < s < 1 for s in collective.values())
    assert plain["speed_probe"] is None and plain["collective_probe_s"] is None


@pytest.mark.multiproc
def test_calibrate_s_collective_probe_gives_each_reading_a_time_per_size():
    from executor.speed_probe import measure_collective_probe

    readings = measure_collective_probe(2, timeout_s=120)
    assert len(readings) == 2
    # a time per size in each reading; not which size is longer: a slow spell of the host's transfers can land
    # on any one (a CI run timed 7.05 ms at 256 KiB against 6.59 at 4 MiB)
    for reading in readings:
        assert len(reading) == len(COLLECTIVE_PROBE_KIB) and all(0 < s < 1 for s in reading)


def test_the_collective_probe_all_reduces_each_size_twice_untimed_then_its_timed_calls(monkeypatch):
    """What each reading times, whatever the host's speed: every size's buffer, two calls to warm up and then the
    timed ones, over the probe's group."""
    import torch.distributed as dist

    from executor.speed_probe import COLLECTIVE_PROBE_CALLS, CollectiveProbe

    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda buffer, group=None: calls.append((buffer.numel() * 4, group)))
    reading = CollectiveProbe("the probe's group")()
    assert calls == [(kib * 1024, "the probe's group") for kib in COLLECTIVE_PROBE_KIB
                     for _ in range(2 + COLLECTIVE_PROBE_CALLS)]
    assert len(reading) == len(COLLECTIVE_PROBE_KIB) and all(seconds >= 0 for seconds in reading)
