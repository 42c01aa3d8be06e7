"""``parsim run``: refuses what cannot run in one line, reports a measured step, writes traces, never hangs.

Also :mod:`parsim.kineto.read`: a real torch.profiler run of one training
step, annotated by the runner, reads back as the events the runner recorded
itself.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter

import pytest
from test_json_schema import conforms

from parsim.cli.main import main
from parsim.report.step_report import PHASES, step_time
from parsim.report.trace import Event, Trace
from parsim.workload.plan import resolve_plan

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")


def test_nproc_must_equal_the_plan_world_size(capsys):
    assert main(["run", "course-ddp", "--nproc", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "dp 4 x pp 1 x tp 1 = 4 ranks, but --nproc is 2; --dp 2 fits it to 2" in err


@needs_torch
def test_a_plan_the_executor_cannot_shard_is_refused_before_any_rank_starts(capsys):
    assert main(["run", "tiny-tp2", "--tp", "4", "--nproc", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "num_kv_heads 2" in err


@pytest.mark.parametrize("flags, feature", [
    (["tiny-pp2", "--dtype", "fp8"], "fp8 compute"),
    (["tiny-pp2", "--grad-accumulation", "fused"], "weight-gradient matmuls that accumulate in place"),
    (["tiny-pp2", "--recompute-modules", "core_attn,layernorm"], "selective recompute of norms"),
    (["tiny-pp2", "--adamw", "fused", "--adam-moments", "bf16"], "AdamW moments in bf16"),
    (["--model", "tiny-gpt", "--dp", "2", "--grad-sync", "fsdp", "--schedule", "zero-bubble"],
     "FSDP with a split-backward (zero-bubble) schedule"),
])
def test_features_the_executor_does_not_run_yet_are_refused_not_ignored(flags, feature, capsys):
    assert main(["run", *flags, "--nproc", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"does not execute {feature}" in err


@pytest.mark.parametrize("flags, message", [
    (["tiny-pp2", "--activation-recompute", "full", "--schedule", "zero-bubble"],
     "full activation recomputation with the split backward of zero-bubble"),
    (["--model", "gpt3-175b", "--tp", "2", "--sequence-parallel"], "sequence parallelism with learned positions"),
])
def test_combinations_the_executor_cannot_run_are_refused_in_one_line(flags, message, capsys):
    assert main(["run", *flags, "--nproc", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err


@needs_torch
@pytest.mark.multiproc
def test_run_reports_the_median_step_and_writes_traces(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # progress shows on a terminal only
    trace_path, chrome_path = tmp_path / "measured.json", tmp_path / "chrome.json"
    assert main(["run", "tiny-pp2", "--nproc", "2", "--steps", "2", "--json",
                 "--trace", str(trace_path), "--chrome", str(chrome_path)]) == 0
    out = capsys.readouterr()
    summary = json.loads(out.out)
    assert conforms(summary) == "run"
    assert "2 warm-up + 2 measured steps" in out.err  # progress goes to stderr
    assert summary["world_size"] == 2 and summary["steps"] == 2 and len(summary["step_times_s"]) == 2
    assert (summary["pp"], summary["cp"], summary["dtype"], summary["features"]) == (2, 1, "fp32", [])
    assert summary["step_s_min"] <= summary["step_s"] <= summary["step_s_max"]
    assert summary["throughput_unit"] == "tokens/s" and summary["throughput"] > 0
    assert len(summary["losses"]) == 2 and all(loss > 0 for loss in summary["losses"])
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert set(summary["ranks"][0]["seconds"]) == set(PHASES)
    # two stages of one rank each: each stage's figures are its rank's over the steps
    assert [s["pp"] for s in summary["stages"]] == [0, 1]
    assert summary["stages"][1]["seconds"] == pytest.approx(summary["ranks"][1]["seconds"])

    trace = Trace.load(trace_path)
    assert trace.source == "measured" and trace.world_size == 2
    names = Counter(e.name for e in trace.for_rank(0))
    assert names["F stage=0 mb=3"] == 1 and names["send act stage=0 mb=3 peer=1"] == 1
    assert names["recv grad stage=1 mb=0 peer=1"] == 1 and names["optimizer step"] == 1
    assert all(e.start_s >= 0 and e.dur_s >= 0 for e in trace.events)
    assert summary["step_s"] == pytest.approx(step_time(trace))  # the trace kept is the median step
    assert {e["name"] for e in json.loads(chrome_path.read_text())["traceEvents"]} >= {"B stage=1 mb=2"}

    from parsim.cli.run_cmd import report

    text = report(resolve_plan("tiny-pp2"), summary)
    assert "step time" in text and "tokens/s" in text and "idle" in text
    assert "time by phase per rank, ms (each phase's median over 2 steps; the median step " in text


def _rank_result(rank: int, host: str, origin_s: float) -> dict:
    pass_ = Event("F stage=0 mb=0", rank, "compute", "compute", 0.001, 0.002, {"gaps": [(0.0015, 0.002)]})
    return {"rank": rank, "host": host, "steps": [[pass_]], "step_origins": [origin_s]}


def test_ranks_on_one_host_share_its_clock_and_others_keep_their_own():
    from executor.train.measure import step_events

    # Rank 1 left the barrier 4 ms after rank 0: on one host, its pass began 4 ms later, its wait with it.
    late = step_events([_rank_result(0, "a", 10.0), _rank_result(1, "a", 10.004)], 0)
    assert late[0].start_s == pytest.approx(0.001) and late[1].start_s == pytest.approx(0.005)
    assert late[1].args["gaps"] == [pytest.approx((0.0055, 0.006))] and late[1].dur_s == pytest.approx(0.002)
    # On two hosts the clocks are unrelated: each rank stays on its own zero.
    apart = step_events([_rank_result(0, "a", 10.0), _rank_result(1, "b", 99.0)], 0)
    assert [e.start_s for e in apart] == [0.001, 0.001] and apart[1].args["gaps"] == [(0.0015, 0.002)]


def test_each_phase_is_its_median_over_the_steps_and_the_step_the_median_step():
    from parsim.report.step_report import median_breakdown, median_step

    def step(forward_ms: tuple[float, float]) -> Trace:  # each rank's forward from 0; the step ends with the later
        return Trace("measured", 2, [Event("F stage=0 mb=0", r, "compute", "compute", 0.0, ms * 1e-3)
                                     for r, ms in enumerate(forward_ms)])

    # Rank 1 ends first in every step, by 1, 9 and 2 ms; one slow step of rank 0 does not stand for the run.
    rows = median_breakdown([step((10, 9)), step((18, 9)), step((11, 9))])
    assert [r.step_s for r in rows] == [pytest.approx(0.011)] * 2
    assert rows[0].seconds["forward"] == pytest.approx(0.011) and rows[0].seconds["idle"] == pytest.approx(0.0)
    assert rows[1].seconds["forward"] == pytest.approx(0.009) and rows[1].seconds["idle"] == pytest.approx(0.002)
    # Beside each median, the least and most one step spent on the phase.
    assert rows[0].ranges["forward"] == pytest.approx((0.010, 0.018))
    assert rows[1].ranges["idle"] == pytest.approx((0.001, 0.009))
    # Of an even count, the lower middle step: the one run_plan returns and whose time the rows give.
    assert median_step([step((18, 9)), step((10, 9)), step((12, 9)), step((11, 9))]) == 3


def test_a_stage_s_phase_is_its_ranks_mean_in_each_step_then_the_median_over_the_steps():
    from parsim.report.step_report import median_breakdown

    def step(waits_ms: tuple[float, float]) -> Trace:  # twins 0 and 2 compute 10 ms, then wait in their all-reduce
        return Trace("measured", 4, [event for r, wait in zip((0, 2), waits_ms) for event in (
            Event("F stage=0 mb=0", r, "compute", "compute", 0.0, 0.010, {"phase": "forward"}),
            Event("all_reduce dp", r, "comm", "collective", 0.010, wait * 1e-3, {"phase": "dp"}))])

    # Which twin waits swaps from step to step: each one's median lands on either side of the split.
    traces = [step((0.1, 11.0)), step((9.0, 0.2)), step((0.1, 12.0)), step((10.0, 0.1)), step((11.0, 0.1))]
    per_rank = {row.rank: row.seconds["dp"] for row in median_breakdown(traces)}
    assert per_rank == {0: pytest.approx(0.009), 2: pytest.approx(0.0002)}
    stages = median_breakdown(traces, {0: 0, 2: 0})
    assert [row.rank for row in stages] == [0]
    # the step means: 5.55, 4.6, 6.05, 5.05, 5.55 ms
    assert stages[0].seconds["dp"] == pytest.approx(0.00555)
    assert stages[0].ranges["dp"] == pytest.approx((0.0046, 0.00605))
    assert stages[0].seconds["forward"] == pytest.approx(0.010) and stages[0].step_s == pytest.approx(0.021)


@needs_torch
@pytest.mark.multiproc
def test_a_run_that_overruns_its_timeout_names_the_ranks_and_ends(capsys):
    # 500 steps of about 20 ms: well past the timeout (the default 2 + 3, with ranks forked from a server that
    # imported torch once, could end within it)
    assert main(["run", "tiny-pp2", "--nproc", "2", "--timeout", "1", "--steps", "500"]) == 2
    err = capsys.readouterr().err
    assert "did not finish within 1 s" in err and "rank" in err


@needs_torch
def test_a_torch_profiler_trace_of_a_step_reads_back_as_the_recorded_events(tmp_path):
    import torch
    import torch.distributed as dist

    from executor.train.runner import build_rank
    from parsim.kineto.read import measured_trace, read_profiles

    plan = resolve_plan("tiny-pp2", overrides={
        "parallel": {"pp": 1}, "schedule": "interleaved-1f1b", "virtual_stages": 2,
        "batch": {"microbatch_size": 1, "num_microbatches": 2}})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        setup = build_rank(plan, 0)
        setup.step()  # warm-up
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            setup.recorder.start_step()
            setup.step()
        prof.export_chrome_trace(str(tmp_path / "profile.json"))
    finally:
        dist.destroy_process_group()
    recorded = [e for e in setup.recorder.events if e.kind != "collective"]
    read = measured_trace(read_profiles(tmp_path))
    assert read.world_size == 1 and {e.rank for e in read.events} == {0}
    assert Counter(e.name for e in read.events if e.kind != "collective") == Counter(e.name for e in recorded)
    kinds = {e.name: (e.kind, e.stream, e.args["phase"]) for e in recorded}
    assert all(kinds[e.name] == (e.kind, e.stream, e.args["phase"]) for e in read.events if e.kind != "collective")
    assert "send act stage=0 mb=1 peer=0" in kinds  # two stages on one rank still hand over, as simulated
    assert min(e.start_s for e in read.events) >= 0.0


@needs_torch
def test_spans_are_annotated_for_a_profiler_only(monkeypatch):
    """Without a profiler a span enters no record_function: it costs 25-50 us between large kernels, which the
    measured step would show as idle time no training loop spends."""
    import torch

    from executor.train.trace_recorder import Recorder

    entered = []
    real = torch.profiler.record_function

    class Counting(real):
        def __enter__(self):
            entered.append(self.name)
            return super().__enter__()

    monkeypatch.setattr(torch.profiler, "record_function", Counting)
    recorder = Recorder(0)
    with recorder.span("F stage=0 mb=0", "compute", "compute", phase="forward"):
        pass
    assert entered == [] and [e.name for e in recorder.events] == ["F stage=0 mb=0"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with recorder.span("B stage=0 mb=0", "compute", "compute", phase="backward"):
            pass
    assert entered == ["B stage=0 mb=0"]


def test_only_names_of_the_contract_are_read_from_a_profile():
    from parsim.kineto.recognize import classify

    assert classify("W stage=3 mb=7") == ("compute", "compute", "weight-grad")
    assert classify("I stage=0 mb=0") == ("compute", "compute", "backward")
    assert classify("all_reduce dp bucket=2") is None  # collectives are read from gloo's or NCCL's own events
    assert classify("recv grad stage=2 mb=0 peer=1") == ("recv", "p2p", "pp")
    assert classify("optimizer step") == ("optimizer", "compute", "optimizer")
    assert classify("ProfilerStep#2") is None and classify("aten::mm") is None


@pytest.mark.parametrize("argv", [["run", "tiny-pp2", "--nproc", "2", "--trace", "/proc/parsim-trace.json"],
                                  ["bench", "all-reduce", "--nproc", "2", "--size", "1MiB",
                                   "--out", "/proc/parsim-bench.json"]])
def test_an_output_that_cannot_be_created_is_refused_before_any_rank_starts(argv, capsys):
    """/proc passes ``os.access`` for root and refuses the file: the path is tried before the run, not after it
    (when a run's table was lost with the error)."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and ("cannot be written" in err or "not writable" in err)
