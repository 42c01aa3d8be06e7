"""Kineto traces in and out: profiles of any run read back, HTA and Perfetto on the traces parsim writes."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from parsim.cli.main import main
from parsim.hardware.cluster import load_cluster
from parsim.kineto.read import measured_trace, read_profiles
from parsim.kineto.recognize import rank_events
from parsim.kineto.write import write_merged_trace, write_rank_traces
from parsim.report.step_report import comm_overlap
from parsim.sim.step import predict_step
from parsim.workload.plan import resolve_plan

try:
    import torch  # noqa: F401

    needs_torch = pytest.mark.skipif(False, reason="")
except ImportError:  # pragma: no cover
    needs_torch = pytest.mark.skip(reason="torch is not installed")


def _predicted(plan_name: str, cluster: str = "dgx-h100", **overrides):
    return predict_step(resolve_plan(plan_name, overrides=overrides or None), load_cluster(cluster))


@pytest.fixture(scope="module")
def measured_course_pp(tmp_path_factory):
    """One executor run of course-pp on 2 gloo ranks: its median step, written as per-rank Kineto files."""
    pytest.importorskip("torch")
    from executor.train import run_plan

    trace, _ = run_plan(resolve_plan("course-pp"), 2, steps=1, backend="gloo", timeout_s=120)
    folder = tmp_path_factory.mktemp("measured")
    write_rank_traces(folder, trace)
    return trace, folder


def _perfetto_drops(doc: dict) -> list[str]:
    """Slices Perfetto's JSON importer would drop: on one track, a slice that starts inside another and
    ends after it."""
    tracks = defaultdict(list)
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            tracks[e["pid"], e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    dropped = []
    for slices in tracks.values():
        open_ends: list[float] = []
        for start, end, name in sorted(slices, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= start + 1e-6:
                open_ends.pop()
            if open_ends and end > open_ends[-1] + 1e-6:
                dropped.append(name)
            open_ends.append(end)
    return dropped


def test_written_rank_traces_read_back_as_the_same_events(tmp_path):
    trace = _predicted("course-pp").trace
    write_rank_traces(tmp_path, trace)
    read = measured_trace(read_profiles(tmp_path))
    assert read.world_size == trace.world_size
    key = lambda e: (e.rank, e.name, round(e.start_s, 9))  # noqa: E731
    original, back = sorted(trace.events, key=key), sorted(read.events, key=key)
    assert [(e.rank, e.name, e.kind, e.stream) for e in back] == [(e.rank, e.name, e.kind, e.stream) for e in original]
    assert all(abs(a.start_s - b.start_s) < 1e-9 and abs(a.dur_s - b.dur_s) < 1e-9 for a, b in zip(original, back))


def test_predicted_traces_keep_every_slice_in_perfetto_and_receives_on_the_p2p_track(tmp_path):
    trace = _predicted("course-pp").trace
    assert {e.stream for e in trace.events if e.kind == "recv"} == {"p2p"}
    write_merged_trace(tmp_path / "step.json", {"predicted": trace})
    doc = json.loads((tmp_path / "step.json").read_text())
    assert _perfetto_drops(doc) == []
    flows = [e for e in doc["traceEvents"] if e["ph"] in ("s", "f")]
    assert flows and len(flows) % 2 == 0


@needs_torch
@pytest.mark.multiproc
def test_measured_async_sends_spread_over_lanes_so_perfetto_drops_nothing(measured_course_pp, tmp_path):
    trace, _ = measured_course_pp
    write_merged_trace(tmp_path / "both.json", {"measured": trace, "predicted": _predicted("course-pp").trace})
    doc = json.loads((tmp_path / "both.json").read_text())
    assert _perfetto_drops(doc) == []
    names = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    assert {"compute", "p2p"} <= names


def _hta(folder, monkeypatch):
    """HTA on a folder, keeping times to the nanosecond (by default it rounds them to whole microseconds,
    which moves µs-long simulated kernels noticeably)."""
    hta = pytest.importorskip("hta.trace_analysis")
    monkeypatch.setenv("HTA_DISABLE_NS_ROUNDING", "1")
    return hta.TraceAnalysis(trace_dir=str(folder))


@pytest.mark.parametrize("plan, overrides", [("course-pp", {}), ("tiny-tp2", {}), ("tiny-dp2", {})])
def test_hta_overlap_equals_parsims_on_predicted_traces(tmp_path, monkeypatch, plan, overrides):
    trace = _predicted(plan, **overrides).trace
    write_rank_traces(tmp_path, trace)
    analysis = _hta(tmp_path, monkeypatch)
    overlap = analysis.get_comm_comp_overlap(visualize=False)
    ours = comm_overlap(trace)
    for rank, pctg in zip(overlap["rank"], overlap["comp_comm_overlap_pctg"]):
        if ours[rank] is None:
            assert pctg != pctg  # NaN: no communication on that rank
        else:
            assert pctg == pytest.approx(100 * ours[rank], abs=0.01)
    temporal = analysis.get_temporal_breakdown(visualize=False)
    assert (temporal["kernel_time(us)"] > 0).all()
    idle, _ = analysis.get_idle_time_breakdown(visualize=False)
    assert not idle.empty


@needs_torch
@pytest.mark.multiproc
def test_hta_overlap_equals_parsims_on_measured_traces(measured_course_pp, monkeypatch):
    trace, folder = measured_course_pp
    overlap = _hta(folder, monkeypatch).get_comm_comp_overlap(visualize=False)
    ours = comm_overlap(trace)
    assert list(overlap["rank"]) == [0, 1]
    for rank, pctg in zip(overlap["rank"], overlap["comp_comm_overlap_pctg"]):
        assert pctg == pytest.approx(100 * ours[rank], abs=0.01)


@needs_torch
@pytest.mark.multiproc
def test_an_unannotated_ddp_loops_profile_is_compared_with_the_plan(tmp_path, capsys):
    from profiled_loops import course_ddp_loop

    from executor.launch import launch

    launch(course_ddp_loop, 2, (str(tmp_path), 2), backend="gloo", timeout_s=120)
    assert main(["compare", "course-ddp", "--dp", "2", "--cluster", "dgx-a100", "--measured", str(tmp_path),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["collectives"]
    assert [(r["rank"], r["group"], r["op"], r["status"]) for r in rows] == [
        (0, "dp", "all_reduce", "matched one to one"), (1, "dp", "all_reduce", "matched one to one")]
    assert all(r["measured"]["count"] == 4 and r["measured"]["bytes"] == 4 * 1024 * 1024 * 4 for r in rows)
    measured = {(r["rank"], r["phase"]): r["measured_s"] for r in out["phases"]}
    assert all(measured[rank, phase] > 0 for rank in (0, 1) for phase in ("forward", "backward", "optimizer"))
    assert out["measured_step_s"] > 0 and out["measured_from"].startswith("torch.profiler traces")

    assert main(["compare", "course-ddp", "--dp", "2", "--cluster", "dgx-a100", "--measured", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("rank    group")).split()
    assert header[:11] == ["rank", "group", "collective", "n", "pred", "n", "meas", "MiB", "pred", "MiB", "meas"]
    rows = [line.split() for line in text.splitlines() if " all_reduce " in line]
    assert [row[:9] for row in rows] == [["rank", str(r), "dp", "all_reduce", "4", "4", "16", "16", row[8]]
                                          for r, row in zip((0, 1), rows)]  # 4 x 4 MiB on both sides
    predicted_us = sum(r["predicted"]["seconds"] for r in out["collectives"] if r["rank"] == 0) * 1e6
    assert float(rows[0][8].replace(",", "")) == pytest.approx(predicted_us, abs=0.05)
    assert text.rstrip().endswith("%)") and "matched one to one" in text


def test_gpu_kernels_take_the_phase_of_the_operator_that_launched_them():
    def span(name, cat, ts, dur, tid=1, **args):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}

    events = [
        span("aten::mm", "cpu_op", 0, 10), span("cudaLaunchKernel", "cuda_runtime", 2, 1, correlation=1),
        span("autograd::engine::evaluate_function: MmBackward0", "cpu_op", 20, 10, tid=2),
        span("cudaLaunchKernel", "cuda_runtime", 22, 1, tid=2, correlation=2),
        span("Optimizer.step#AdamW.step", "user_annotation", 40, 10),
        span("cudaLaunchKernel", "cuda_runtime", 41, 1, correlation=3),
        span("sm90_xmma_gemm", "kernel", 5, 8, tid=7, stream=7, correlation=1),
        span("sm90_xmma_gemm", "kernel", 25, 8, tid=7, stream=7, correlation=2),
        span("multi_tensor_apply_kernel", "kernel", 43, 5, tid=7, stream=7, correlation=3),
        span("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "kernel", 30, 20, tid=20,
             stream=20, correlation=4, dtype="BFloat16", **{"In msg nelems": 1024, "Process Group Ranks": "[0, 1]"}),
    ]
    out = rank_events(events, 0, (0.0, 100.0))
    phases = [(e.name, e.args.get("phase")) for e in out if e.kind in ("compute", "optimizer")]
    assert phases == [("forward", "forward"), ("backward", "backward"), ("optimizer step", "optimizer")]
    (collective,) = [e for e in out if e.kind == "collective"]
    assert collective.args["op"] == "all_reduce" and collective.args["bytes"] == 2048
    assert collective.args["group_ranks"] == [0, 1] and collective.start_s == pytest.approx(30e-6)


def test_a_step_is_the_host_s_profiler_step_not_its_mark_on_the_gpu_timeline(tmp_path):
    # torch.profiler on CUDA writes each ProfilerStep#N twice: the host's slice and a gpu_user_annotation where
    # the step's kernels end (1 us on an H200's one-GPU step, 2026-11-30), which read as the step made it ~0 s
    def span(name, cat, ts, dur):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": 1, "args": {}}

    events = [span("ProfilerStep#3", "user_annotation", 0.0, 1000.0),
              span("ProfilerStep#3", "gpu_user_annotation", 990.0, 1.0),
              span("ProfilerStep#4", "user_annotation", 1000.0, 900.0)]
    (tmp_path / "rank0.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    (profile,) = read_profiles(tmp_path)
    assert profile.steps == {3: (0.0, 1000.0), 4: (1000.0, 1900.0)}


def test_an_h200_profile_of_the_one_gpu_step_reads_as_the_step_it_timed(capsys):
    """The executor's torch.profiler trace of benchmarks/gpu/one-gpu-step.yaml on an H200 (check.sh, 2026-11-30),
    kept: its median step, 174 ms on the host, splits into forward 48.4 ms, backward 97.3 and optimizer 19.7."""
    gpu = Path(__file__).parent.parent / "benchmarks" / "gpu"
    assert main(["compare", str(gpu / "one-gpu-step.yaml"), "--cluster", "dgx-h200", "--measured",
                 str(gpu / "h200-one-gpu-step-profile-2026-11-30"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["measured_step_s"] == pytest.approx(0.174, abs=0.002)
    measured = {r["phase"]: r["measured_s"] for r in out["phases"]}
    assert (measured["forward"], measured["backward"], measured["optimizer"]) == pytest.approx(
        (0.0484, 0.0973, 0.0197), abs=0.001)


@pytest.mark.parametrize("argv, message", [
    (["compare", "course-ddp", "--dp", "2", "--sweep", "1MiB:2MiB"], "--sweep applies only to a collective"),
    (["compare", "course-ddp", "--dp", "2", "--plot", "x.png"], "--plot applies only to a collective"),
    (["compare", "all-reduce", "--steps", "3"], "--steps applies only to a plan"),
    (["compare", "all-reduce", "--dp", "2"], "--dp applies only to a plan"),
    (["compare", "course-ddp", "--measured", "x", "--nproc", "4"], "--nproc applies only to a run"),
])
def test_compare_refuses_options_that_do_not_apply(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err


def test_bad_profile_folders_get_one_line(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    twins = tmp_path / "twins"
    twins.mkdir()
    for name in ("a.json", "b.json"):
        (twins / name).write_text(json.dumps({"traceEvents": [], "distributedInfo": {"rank": 0, "world_size": 2}}))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "rank0.pt.trace.json.gz").write_bytes(b"not gzip")
    cases = [(tmp_path / "nowhere", "not a folder"), (empty, "no trace files"), (twins, "are both rank 0"),
             (broken, "not a gzip file")]
    for folder, message in cases:
        assert main(["compare", "course-ddp", "--dp", "2", "--cluster", "dgx-a100", "--measured", str(folder)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and message in err


def test_each_rank_s_collectives_are_set_beside_its_own_prediction_where_every_rank_is_simulated():
    """Four ranks on a 2-core host take turns, so each is simulated and its all-reduce waits its own time: the
    collectives table sets each measured rank beside its own, not one per pipeline stage."""
    import dataclasses

    from cpu_host import cpu_host

    from parsim.hardware.cluster import parse_cluster
    from parsim.kineto.match import match_collectives
    from parsim.report.trace import Trace

    data = cpu_host(op_forward_us=7.0, op_backward_us=6.0, cpu_cores=2)
    plan = resolve_plan("tiny-pp2", overrides={"parallel": {"dp": 2}})
    predicted = predict_step(plan, parse_cluster(data, "host.yaml")).trace
    own = {r: sum(e.dur_s for e in predicted.for_rank(r) if e.kind == "collective") for r in range(4)}
    assert len(set(own.values())) > 1  # the twins wait in their all-reduce for different times
    measured = Trace("measured", 4, [dataclasses.replace(e, args=dict(e.args)) for e in predicted.events], {})
    rows = match_collectives(plan, predicted, measured)
    assert {row.rank: sum(e.dur_s for e in row.predicted) for row in rows} == own
