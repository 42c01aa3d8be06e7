"""The collective benchmark and ``parsim bench``: nccl-tests semantics, the shared schema, clear errors."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from executor._torch import INSTALL_HINT
from executor.collective_buffers import forms_of
from executor.collectives import (GLOO_ALGORITHMS, IN_STEP_SIZES, BenchSpec, measure_collectives,
                                  measure_copy_bandwidth, measure_in_step, measure_reduce_bandwidth, measured_size)
from executor.launch import RankFailure
from parsim.cli.main import main
from parsim.errors import ParsimError
from parsim.report.results import OPERATIONS, CollectiveResult, busbw_factor, load_results

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")


def every_operation(rank: int, world: int) -> tuple[dict[str, list[CollectiveResult]], dict[tuple, int]]:
    """All nine operations at two sizes and in both forms in one process group (one launch keeps the test
    quick), and each form's wrong elements on this rank when the collective does nothing at all."""
    from executor.collective_buffers import forms_of, make_buffers
    from executor.collectives import bench_rank
    from executor.launch import rank_device

    results = {op: bench_rank(rank, world, BenchSpec.build(op, [1002, 8192], world, warmup=1, iters=3,
                                                           both_forms=True)) for op in OPERATIONS}
    skipped = {}
    for op in OPERATIONS:
        for form in forms_of(op):
            buffers = make_buffers(op, form, 64, rank, world, rank_device())
            buffers.run = lambda: None
            skipped[op, form] = buffers.check()
    return results, skipped


@needs_torch
@pytest.mark.multiproc
def test_every_operation_runs_on_gloo_and_fills_the_shared_schema():
    from executor.launch import launch

    per_rank, skipped = zip(*launch(every_operation, 2, backend="gloo", timeout_s=120))
    assert per_rank[0] == per_rank[1]  # every rank agrees on the same numbers
    for op, rows in per_rank[0].items():
        assert [r.size_bytes for r in rows] == [1000, 8192]  # whole float32 elements, equal chunks
        for r in rows:
            assert (r.op, r.nranks, r.source, r.backend) == (op, 2, "measured", "gloo")
            assert r.algorithm == GLOO_ALGORITHMS[op]
            assert r.time_s > 0
            assert r.algbw_Bps == pytest.approx(r.size_bytes / r.time_s)
            assert r.busbw_Bps == pytest.approx(r.algbw_Bps * busbw_factor(op, 2))
            assert r.extra["count"] == r.size_bytes // 4 and r.extra["iters"] == 3
            assert r.extra["time_s_min"] <= r.extra["time_s_mean"] <= r.extra["time_s_max"] == r.time_s
            assert CollectiveResult.from_dict(json.loads(json.dumps(r.to_dict()))) == r
            # nccl-tests' two forms, where torch.distributed has them, and every element right
            forms = [f for f in ("out_of_place", "in_place") if r.extra[f] is not None]
            assert forms == list(forms_of(op)) and r.extra["form"] == forms[0]
            assert r.extra[forms[0]]["time_s"] == r.time_s
            assert r.extra["wrong"] == 0 and all(r.extra[f]["wrong"] == 0 for f in forms)
    # a collective that did nothing is caught by the check, in every form of every operation
    assert all(skipped[0][key] + skipped[1][key] > 0 for key in skipped[0])
    assert set(skipped[0]) == {(op, f) for op in OPERATIONS for f in forms_of(op)}
    send_recv = per_rank[0]["send_recv"][0]
    assert send_recv.time_s == pytest.approx(max(send_recv.extra["per_rank_time_s"]) / 2)  # one way
    assert "all-reduce" in per_rank[0]["reduce_scatter"][0].extra["implementation"]


@needs_torch
@pytest.mark.multiproc
def test_cli_sweep_prints_a_table_progress_and_saves_results(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # progress shows on a terminal only
    out = tmp_path / "results.json"
    code = main(["bench", "all-reduce", "--nproc", "2", "--backend", "gloo", "--sweep", "1002:4008",
                 "--warmup", "2", "--out", str(out)])
    captured = capfd.readouterr()  # progress comes from rank 0's process, on the inherited stderr
    assert code == 0
    header, rows = nccl_tests_table(captured.out)
    assert header[:6] == ["size", "count", "type", "redop", "root", "time"] and header.count("#wrong") == 2
    assert [row[:5] for row in rows] == [["1000", "250", "float", "sum", "-1"], ["2004", "501", "float", "sum", "-1"],
                                         ["4008", "1002", "float", "sum", "-1"]]
    assert all(row[5:9] == ["N/A"] * 4 and row[12] == "0" for row in rows)  # all_reduce: in place only
    assert "# Out of bounds values : 0 OK" in captured.out and "# Avg bus bandwidth    : " in captured.out
    assert "1002 B -> 1000 B" in captured.out
    assert "measuring all-reduce 1000 B (1/3)" in captured.err
    rows = load_results(out)
    assert [r.size_bytes for r in rows] == [1000, 2004, 4008]
    assert [r.extra["requested_size_bytes"] for r in rows] == [1002, 2004, 4008]
    assert all(r.extra["iters"] >= 5 for r in rows)  # adaptive count, never below the minimum


@needs_torch
@pytest.mark.multiproc
def test_under_torchrun_the_job_runs_once_and_rank_zero_reports():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "parsim", "bench", "broadcast", "--size", "4KiB", "--warmup", "1", "--iters", "3", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)["results"]  # one JSON document: only rank 0 printed
    assert [(r["op"], r["nranks"], r["size_bytes"]) for r in rows] == [("broadcast", 2, 4096)]


def nccl_tests_table(text: str) -> tuple[list[str], list[list[str]]]:
    """The column names and the rows of a table in nccl-tests' layout (every other line starts with #)."""
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("#") and "#wrong" in line).lstrip("#").split()
    return header, [line.split() for line in lines if line.strip() and not line.startswith("#")]


def fake_results(op: str = "all_gather", wrong: int = 0) -> list[CollectiveResult]:
    return [CollectiveResult(op=op, nranks=2, size_bytes=size, time_s=size / 1e9, algorithm="ring",
                             source="measured", backend="gloo",
                             extra={"requested_size_bytes": size, "count": size // 4, "host": "here",
                                    "form": "out_of_place", "wrong": wrong, "iters": 5,
                                    "per_rank_time_s": [size / 1e9, size / 1e9],
                                    "out_of_place": {"time_s": size / 1e9, "iters": 5, "wrong": wrong},
                                    "in_place": {"time_s": size / 2e9, "iters": 5, "wrong": 0}})
            for size in (1 << 20, 1 << 21)]


def test_cli_json_is_the_shared_schema(monkeypatch, capsys):
    import executor.collectives

    monkeypatch.setattr(executor.collectives, "measure_collectives", lambda *a, **k: fake_results())
    assert main(["bench", "all-gather", "--sweep", "1MiB:2MiB", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "parsim.bench/1" and doc["wrong"] == 0
    rows = doc["results"]
    assert [CollectiveResult.from_dict(r) for r in rows] == fake_results()
    assert rows[0]["algbw_GBps"] == pytest.approx(1.0)
    assert rows[0]["busbw_GBps"] == pytest.approx(0.5)
    assert doc["avg_busbw_GBps"] == pytest.approx(0.75)  # nccl-tests' mean over sizes and forms: 0.5 and 1


def test_the_table_follows_nccl_tests_and_wrong_results_fail_the_command(monkeypatch, capsys):
    import executor.collectives

    monkeypatch.setattr(executor.collectives, "measure_collectives", lambda *a, **k: fake_results(wrong=3))
    assert main(["bench", "all-gather", "--sweep", "1MiB:2MiB"]) == 1
    captured = capsys.readouterr()
    header, rows = nccl_tests_table(captured.out)
    assert header == ["size", "count", "type", "redop", "root"] + ["time", "algbw", "busbw", "#wrong"] * 2
    assert rows == [["1048576", "262144", "float", "none", "-1", "1048.6", "1.00", "0.50", "3",
                     "524.3", "2.00", "1.00", "0"],
                    ["2097152", "524288", "float", "none", "-1", "2097.2", "1.00", "0.50", "3",
                     "1048.6", "2.00", "1.00", "0"]]
    assert "# Out of bounds values : 6 FAILED" in captured.out
    assert captured.err.endswith("6 elements of the results were wrong (#wrong)\n")


@pytest.mark.parametrize("argv, message", [
    (["bench", "all-shuffle"], "unknown collective 'all-shuffle'"),
    (["bench", "all-reduce", "--size", "12 parsecs"], "size '12 parsecs' is not understood"),
    (["bench", "all-reduce", "--sweep", "64MiB:1MiB"], "need 0 < MIN <= MAX"),
    (["bench", "all-gather", "--size", "4", "--nproc", "2"], "below the smallest measurable buffer"),
    (["bench", "send-recv", "--size", "4KiB", "--nproc", "1"], "send-recv needs at least 2 rank(s)"),
    (["bench", "all-reduce", "--nproc", "0"], "--nproc 0: between 1 and 1024 ranks"),
])
def test_cli_bad_input_is_one_line_and_exit_code_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_without_torch_the_cli_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` fail
    assert main(["bench", "all-reduce", "--size", "1MiB"]) == 2
    err = capsys.readouterr().err
    assert err == f"parsim bench: error: {INSTALL_HINT}\n"


def test_verbose_prints_the_ranks_tracebacks(monkeypatch, capsys):
    import executor.collectives

    def fail(*args, **kwargs):
        raise RankFailure("rank 1 failed: ValueError: boom", [1], "--- rank 1: ValueError: boom\nTraceback ...")

    monkeypatch.setattr(executor.collectives, "measure_collectives", fail)
    assert main(["bench", "all-reduce", "--size", "1MiB"]) == 2
    assert "--verbose prints" in capsys.readouterr().err
    assert main(["bench", "all-reduce", "--size", "1MiB", "--verbose"]) == 2
    err = capsys.readouterr().err
    assert "Traceback ..." in err and err.rstrip().endswith("rank 1 failed: ValueError: boom")


def test_sizes_round_down_to_equal_float32_chunks():
    assert measured_size("all_reduce", 1002, 4) == 1000
    assert measured_size("all_gather", 1000, 4) == 992  # 250 elements -> 248, 62 per rank
    assert measured_size("send_recv", 4, 2) == 4
    with pytest.raises(ParsimError, match="smallest measurable buffer"):
        measured_size("scatter", 12, 4)


def test_a_spec_rejects_what_cannot_be_measured():
    with pytest.raises(ParsimError, match="warm-up iterations must be 1 to 100,000, got 0"):
        BenchSpec.build("all-reduce", [4096], 2, warmup=0)
    with pytest.raises(ParsimError, match="timed iterations must be 1 to 100,000, got 0"):
        BenchSpec.build("all-reduce", [4096], 2, iters=0)
    with pytest.raises(ParsimError, match="no sizes"):
        BenchSpec.build("all-reduce", [], 2)
    with pytest.raises(ParsimError, match="--nproc is missing"):
        measure_collectives("all-reduce", [4096], None)


@needs_torch
def test_local_reduce_and_copy_benchmarks_report_positive_times():
    for measure in (measure_reduce_bandwidth, measure_copy_bandwidth):
        rows = measure([4096, 1 << 16], target_time_s=0.01)
        assert [size for size, _ in rows] == [4096, 1 << 16]
        assert all(seconds > 0 for _, seconds in rows)


@needs_torch
@pytest.mark.multiproc
def test_calls_between_bursts_of_compute_are_timed_per_operation_and_size():
    """One result per (operation, size), in that order, each the slowest rank's mean over the calls after
    compute, with the hot calls timed right after them beside it; by default every doubling from 256 KiB to 4 MiB,
    the sizes calibrate reads the extra per call at."""
    rows = measure_in_step(["all_reduce", "all_gather"], 2, sizes=(1 << 16, 1 << 18), calls=3, compute_s=0.001,
                           hot_calls=2, timeout_s=120)
    assert [(r.op, r.size_bytes) for r in rows] == [("all_reduce", 1 << 16), ("all_reduce", 1 << 18),
                                                    ("all_gather", 1 << 16), ("all_gather", 1 << 18)]
    assert all(r.time_s > 0 and r.nranks == 2 and r.extra["calls"] == 3 for r in rows)
    assert all(r.extra["back_to_back_s"] > 0 and r.extra["hot_calls"] == 2 for r in rows)
    assert [s >> 10 for s in IN_STEP_SIZES] == [256, 512, 1024, 2048, 4096]
