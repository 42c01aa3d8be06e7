"""The wait for the slowest rank at a step's end (parsim.sim.jitter): closed forms, the trace's meeting points,
the prediction's step and idle, and calibrate's fit of the host's jitter."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from cpu_host import cpu_host

from parsim.calibrate.host import MEAN_ABS_DIFFERENCE, fit_rank_jitter
from parsim.cli.main import main
from parsim.hardware.cluster import parse_cluster
from parsim.report.step_report import breakdown, step_time
from parsim.report.trace import Event, Trace
from parsim.sim.jitter import end_wait_s, expected_max, sampled_waits
from parsim.sim.step import predict_step
from parsim.units import format_time
from parsim.workload.plan import resolve_plan


def test_the_expected_latest_of_normals_matches_its_closed_forms():
    one = np.array([1.0])
    # two alike: sigma / sqrt(pi); five standard normals: 1.16296 (order statistics' tables)
    assert expected_max(np.array([1.0, 1.0]), np.array([0.01, 0.01]), np.ones(2)) - 1 == pytest.approx(
        0.01 / math.sqrt(math.pi), rel=1e-6)
    assert expected_max(np.array([0.0]), one, np.array([5.0])) == pytest.approx(1.1629645, rel=1e-6)
    # a simulated rank standing for two is two draws
    assert expected_max(one, np.array([0.01]), np.array([2.0])) == pytest.approx(1 + 0.01 / math.sqrt(math.pi))
    # beside a constant: E[max(X, c)] = c + phi(c) - c (1 - Phi(c)) for X standard normal
    c = 0.5
    phi, tail = math.exp(-c * c / 2) / math.sqrt(2 * math.pi), 0.5 * math.erfc(c / math.sqrt(2))
    assert expected_max(np.array([0.0, c]), np.array([1.0, 0.0]), np.ones(2)) == pytest.approx(
        c + phi - c * tail, rel=1e-6)
    # a constant far above everything else, and no randomness at all
    assert expected_max(np.array([0.0, 10.0]), np.array([1.0, 0.0]), np.ones(2)) == pytest.approx(10.0, rel=1e-9)
    assert expected_max(np.array([3.0, 2.0]), np.zeros(2), np.ones(2)) == 3.0


def _step(ranks: dict[int, tuple[float | None, float]], represents: dict[str, int] | None = None) -> Trace:
    """Each rank: a collective ending at ``met`` (None: none), then compute up to ``end``."""
    events = []
    for rank, (met, end) in ranks.items():
        start = 0.0
        if met is not None:
            events.append(Event("all_reduce dp", rank, "comm", "collective", 0.0, met, {"phase": "dp"}))
            start = met
        events.append(Event("optimizer step", rank, "compute", "optimizer", start, end - start,
                            {"phase": "optimizer"}))
    return Trace("simulated", 4, events, {"represents": represents or {}})


def test_each_rank_s_end_varies_with_its_time_since_it_last_met_the_others():
    # both met at 50 ms and computed 12 ms more: sigma 1.2 ms each at 10%
    assert end_wait_s(_step({0: (0.050, 0.062), 1: (0.050, 0.062)}), 0.10) == pytest.approx(
        0.0012 / math.sqrt(math.pi), rel=1e-6)
    # one simulated rank standing for both: the same
    assert end_wait_s(_step({0: (0.050, 0.062)}, {"0": 2}), 0.10) == pytest.approx(0.0012 / math.sqrt(math.pi),
                                                                                  rel=1e-6)
    # a rank that never met the others varies over its whole step
    assert end_wait_s(_step({0: (None, 0.012), 1: (None, 0.012)}), 0.10) == pytest.approx(
        0.0012 / math.sqrt(math.pi), rel=1e-6)
    # a rank ending 10 sigmas early never ends last; alone, a rank's own error averages out
    assert end_wait_s(_step({0: (0.050, 0.062), 1: (0.038, 0.050)}), 0.10) == pytest.approx(0.0, abs=1e-9)
    # ranks that end as they meet, and a host without jitter
    assert end_wait_s(_step({0: (0.050, 0.050), 1: (0.050, 0.050)}), 0.10) == 0.0
    assert end_wait_s(_step({0: (0.050, 0.062), 1: (0.050, 0.062)}), 0.0) == 0.0


def test_a_jittering_host_s_step_ends_later_by_the_wait_in_every_rank_s_idle(capsys, tmp_path):
    plan = resolve_plan("course-ddp", overrides={"parallel": {"dp": 2}})
    still = parse_cluster(cpu_host(op_forward_us=7.0, op_backward_us=6.0), "host")
    jittery = parse_cluster(cpu_host(op_forward_us=7.0, op_backward_us=6.0, rank_jitter=0.08), "host")
    calm, shaky = predict_step(plan, still), predict_step(plan, jittery)
    assert calm.end_wait_s == 0.0 and calm.step_s == step_time(calm.trace)
    wait = end_wait_s(shaky.trace, 0.08)
    assert wait > 0 and shaky.end_wait_s == pytest.approx(wait)
    assert shaky.step_s == pytest.approx(step_time(shaky.trace) + wait)
    assert shaky.step_s == pytest.approx(calm.step_s + wait)  # the same trace, the same events
    for before, after in zip(calm.ranks, shaky.ranks):
        assert after.seconds["idle"] == pytest.approx(before.seconds["idle"] + wait)
        assert after.step_s == pytest.approx(shaky.step_s)
        assert sum(after.seconds.values()) == pytest.approx(after.step_s)
    assert [r.seconds for r in breakdown(shaky.trace)] == [r.seconds for r in breakdown(calm.trace)]

    host = tmp_path / "host.yaml"
    import yaml

    host.write_text(yaml.safe_dump(cpu_host(op_forward_us=7.0, op_backward_us=6.0, rank_jitter=0.08)))
    assert main(["simulate", "course-ddp", "--dp", "2", "--cluster", str(host)]) == 0
    out = capsys.readouterr().out
    # each number of the line, from the trace: the last rank's time since its last collective, sigma, the wait
    last = max(shaky.trace.events, key=lambda e: e.start_s + e.dur_s)
    met = max(e.start_s + e.dur_s for e in shaky.trace.events if e.rank == last.rank and e.kind == "collective")
    since = last.start_s + last.dur_s - met
    assert since > 0 and wait == pytest.approx(0.08 * since / math.sqrt(math.pi), rel=1e-6)  # two alike
    line = next(text for text in out.splitlines() if text.startswith("the ranks' jitter"))
    assert (f"varies by 8.0% (as calibrated) of its time since it last met the others; rank {last.rank}, the last "
            f"to end, met them {format_time(since)} before, so sigma = {format_time(0.08 * since)}. The latest of "
            f"the 2 ends that may come last is {format_time(wait)} later on average") in line
    # a pipeline's last rank ends alone, its own error averaging out: nothing worth a line
    assert main(["simulate", "tiny-pp2", "--cluster", str(host)]) == 0
    assert "the ranks' jitter" not in capsys.readouterr().out
    assert main(["simulate", "course-ddp", "--dp", "2", "--cluster", str(host), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["end_wait_s"] == pytest.approx(wait)


def test_the_drawn_steps_average_to_the_wait_and_give_its_median():
    twins = _step({0: (0.050, 0.062)}, {"0": 2})  # one simulated rank standing for both; sigma 1.2 ms
    sigma = 0.0012
    waits = sampled_waits(twins, 0.10, [0, 0])
    assert waits.shape[1] == 2
    # the mean over the steps is the wait the step is priced with, within the draws' own error
    assert waits.mean(axis=0) == pytest.approx([end_wait_s(twins, 0.10)] * 2, rel=0.05)
    # in each step one twin waits |d| (d = e_1 - e_0, sigma sqrt 2) and the other not at all: each one's median is
    # none; the mean of the two, |d| / 2, has the median 0.6745 sigma sqrt(2) / 2 (half-normal)
    assert np.median(waits, axis=0) == pytest.approx([0.0, 0.0], abs=0.02 * sigma)
    assert np.median(waits.mean(axis=1)) == pytest.approx(0.6745 * sigma * math.sqrt(2) / 2, rel=0.05)
    # one twin named, the other still ends its steps and may end them last: the same wait on average
    assert sampled_waits(twins, 0.10, [0]).mean() == pytest.approx(end_wait_s(twins, 0.10), rel=0.05)
    # a rank ending 10 sigmas early waits what the trace already holds, and nothing more
    early = sampled_waits(_step({0: (0.050, 0.062), 1: (0.038, 0.050)}), 0.10, [0, 1])
    assert np.median(early, axis=0) == pytest.approx([0.0, 0.0], abs=0.02 * sigma)
    # no jitter: nothing; the same trace: the same draws
    assert not sampled_waits(twins, 0.0, [0, 0]).any()
    assert (sampled_waits(twins, 0.10, [0, 0]) == waits).all()


def test_compare_prices_the_wait_at_the_step_s_end_as_the_median_it_is_measured_as(monkeypatch, capsys, tmp_path):
    """Measured over several steps, each rank's idle and each stage's are medians over them: compare prices the
    wait for the slowest rank as that median, not as the step's mean (which the step keeps)."""
    import yaml

    import executor.train

    host = tmp_path / "host.yaml"
    host.write_text(yaml.safe_dump(cpu_host(op_forward_us=7.0, op_backward_us=6.0, rank_jitter=0.08)))
    plan = resolve_plan("course-ddp", overrides={"parallel": {"dp": 2}})
    predicted = predict_step(plan, parse_cluster(yaml.safe_load(host.read_text()), "host"))
    wait = predicted.end_wait_s
    assert wait > 0

    def run_plan(plan, nproc, steps, **kwargs):
        rows = breakdown(predicted.trace)
        return predicted.trace, {"ranks": [{"rank": rank, "step_s": rows[0].step_s, "seconds": rows[0].seconds}
                                           for rank in range(nproc)]}

    monkeypatch.setattr(executor.train, "run_plan", run_plan)
    argv = ["compare", "course-ddp", "--dp", "2", "--nproc", "2", "--cluster", str(host), "--no-speed-probe", "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    idle = [row for row in doc["phases"] if row["phase"] == "idle"]
    trace_idle = breakdown(predicted.trace)[0].seconds["idle"]
    assert doc["predicted_step_s"] == pytest.approx(predicted.step_s)  # the step keeps the mean
    for row in idle:  # each twin: about none of it (the draws' error)
        assert abs(row["end_wait_s"]) < 0.05 * wait
        assert row["predicted_s"] == pytest.approx(trace_idle + row["end_wait_s"])
    stage = next(row for row in doc["stages"] if row["phase"] == "idle")
    # the mean of the twins' waits in a step, half the distance between their ends: its median, 0.85 of the mean
    assert stage["predicted_s"] - trace_idle == pytest.approx(0.6745 * math.sqrt(math.pi / 2) * wait, rel=0.05)
    assert main(argv[:-1]) == 0
    medians = ", ".join(f"rank {row['rank']} {format_time(max(row['end_wait_s'], 0.0))}" for row in idle)
    assert (f"idle holds the wait for the slowest rank at the step's end as its median over the steps, as measured "
            f"({medians}); the step holds its mean, {format_time(wait)} (the ranks' jitter: in each step one of "
            "two twins waits") in capsys.readouterr().out
    # one measured step is one draw: the mean is the best guess of it
    assert main([*argv, "--steps", "1"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert [row["end_wait_s"] for row in one["phases"] if row["phase"] == "idle"] == [pytest.approx(wait)] * 2


@pytest.mark.parametrize("value", [-0.1, 1.5, "much"])
def test_a_jitter_outside_a_fraction_is_refused(value):
    with pytest.raises(Exception, match="compute.rank_jitter"):
        parse_cluster(cpu_host(rank_jitter=value), "host")


def test_calibrate_fits_the_jitter_as_the_mean_difference_between_ranks_in_sigmas_over_the_median_step():
    # two rounds of two ranks: steps of 10 ms, rank 1's 1 ms apart from rank 0's but in one step, where it stalled
    rank_0 = [0.010] * 9
    rank_1 = [0.011, 0.009, 0.011, 0.009, 0.011, 0.010, 0.030, 0.009, 0.011]
    jitter = fit_rank_jitter([[rank_0, rank_1], [rank_0, rank_1]])
    # mean |difference| 27 / 9 = 3 ms (the stall counts, as it would in a step); the median step 10 ms
    assert jitter == pytest.approx(0.003 / MEAN_ABS_DIFFERENCE / 0.010)
    assert MEAN_ABS_DIFFERENCE == pytest.approx(1.1284, abs=1e-4)
    assert fit_rank_jitter([[rank_0]]) == 0.0 and fit_rank_jitter([]) == 0.0


def test_compare_says_nothing_of_a_wait_at_the_step_s_end_where_there_is_none_to_speak_of(monkeypatch, capsys,
                                                                                         tmp_path):
    """course PP's two stages end their step apart: with ranks jittering by 2% its wait for the slowest rank comes
    to a fraction of a nanosecond, and no line explains it."""
    import yaml

    import executor.train

    host = tmp_path / "host.yaml"
    host.write_text(yaml.safe_dump(cpu_host(op_forward_us=7.0, op_backward_us=6.0, rank_jitter=0.02)))
    plan = resolve_plan("course-pp")
    predicted = predict_step(plan, parse_cluster(yaml.safe_load(host.read_text()), "host"))
    assert 0 < predicted.end_wait_s < 1e-6  # a wait, but none to speak of

    def run_plan(plan, nproc, steps, **kwargs):
        rows = breakdown(predicted.trace)
        return predicted.trace, {"ranks": [{"rank": row.rank, "step_s": row.step_s, "seconds": row.seconds}
                                           for row in rows]}

    monkeypatch.setattr(executor.train, "run_plan", run_plan)
    assert main(["compare", "course-pp", "--nproc", "2", "--cluster", str(host), "--no-speed-probe"]) == 0
    assert "idle holds the wait" not in capsys.readouterr().out
