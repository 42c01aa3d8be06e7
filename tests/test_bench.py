"""The collective benchmark and ``parsim bench``: nccl-tests semantics, the shared schema, clear errors."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from parsim.cli.main import main
from parsim.errors import ParsimError
from parsim.results import OPERATIONS, CollectiveResult, busbw_factor, load_results

from executor._torch import INSTALL_HINT
from executor.collectives import (
    GLOO_ALGORITHMS, BenchSpec, measure_collectives, measure_copy_bandwidth, measure_reduce_bandwidth,
    measured_size,
)
from executor.launch import RankFailure

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")


def every_operation(rank: int, world: int) -> dict[str, list[CollectiveResult]]:
    """All nine operations at two sizes in one process group (one launch keeps the test quick)."""
    from executor.collectives import bench_rank

    return {op: bench_rank(rank, world, BenchSpec.build(op, [1002, 8192], world, warmup=1, iters=3))
            for op in OPERATIONS}


@needs_torch
@pytest.mark.multiproc
def test_every_operation_runs_on_gloo_and_fills_the_shared_schema():
    from executor.launch import launch

    per_rank = launch(every_operation, 2, backend="gloo", timeout_s=120)
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
    send_recv = per_rank[0]["send_recv"][0]
    assert send_recv.time_s == pytest.approx(max(send_recv.extra["per_rank_time_s"]) / 2)  # one way
    assert "all-reduce" in per_rank[0]["reduce_scatter"][0].extra["implementation"]


@needs_torch
@pytest.mark.multiproc
def test_cli_sweep_prints_a_table_progress_and_saves_results(tmp_path, capfd):
    out = tmp_path / "results.json"
    code = main(["bench", "all-reduce", "--nproc", "2", "--backend", "gloo", "--sweep", "1002:4008",
                 "--warmup", "2", "--out", str(out)])
    captured = capfd.readouterr()  # progress comes from rank 0's process, on the inherited stderr
    assert code == 0
    assert "algbw GB/s" in captured.out and "busbw GB/s" in captured.out
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
    rows = json.loads(done.stdout)  # one JSON document: only rank 0 printed
    assert [(r["op"], r["nranks"], r["size_bytes"]) for r in rows] == [("broadcast", 2, 4096)]


def fake_results(op: str = "all_gather") -> list[CollectiveResult]:
    return [CollectiveResult(op=op, nranks=2, size_bytes=size, time_s=size / 1e9, algorithm="ring",
                             source="measured", backend="gloo",
                             extra={"requested_size_bytes": size, "count": size // 4, "host": "here"})
            for size in (1 << 20, 1 << 21)]


def test_cli_json_is_the_shared_schema(monkeypatch, capsys):
    import executor.collectives

    monkeypatch.setattr(executor.collectives, "measure_collectives", lambda *a, **k: fake_results())
    assert main(["bench", "all-gather", "--sweep", "1MiB:2MiB", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [CollectiveResult.from_dict(r) for r in rows] == fake_results()
    assert rows[0]["algbw_GBps"] == pytest.approx(1.0)
    assert rows[0]["busbw_GBps"] == pytest.approx(0.5)


@pytest.mark.parametrize("argv, message", [
    (["bench", "all-shuffle"], "unknown collective 'all-shuffle'"),
    (["bench", "all-reduce", "--size", "12 parsecs"], "size '12 parsecs' is not understood"),
    (["bench", "all-reduce", "--sweep", "64MiB:1MiB"], "need 0 < MIN <= MAX"),
    (["bench", "all-gather", "--size", "4", "--nproc", "2"], "below the smallest measurable buffer"),
    (["bench", "send-recv", "--size", "4KiB", "--nproc", "1"], "send-recv needs at least 2 rank(s)"),
    (["bench", "all-reduce", "--nproc", "0"], "--nproc must be at least 1"),
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
    with pytest.raises(ParsimError, match="warm-up iterations must be at least 1"):
        BenchSpec.build("all-reduce", [4096], 2, warmup=0)
    with pytest.raises(ParsimError, match="timed iterations must be at least 1"):
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
