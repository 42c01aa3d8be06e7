"""`parsim collective` and `parsim clusters` from the command line."""

from __future__ import annotations

import json
import re

import pytest

from parsim.cli.main import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_collective_prints_time_bandwidth_and_bottleneck(capsys):
    code, out, _ = run(capsys, "collective", "all-reduce", "--cluster", "dgx-h100", "--gpus", "8", "--size", "1GiB")
    assert code == 0
    for word in ("time", "algbw", "busbw", "algorithm", "bottleneck", "lower bound"):
        assert word in out


def test_explain_walks_through_the_course_formula(capsys):
    code, out, _ = run(capsys, "collective", "reduce-scatter", "--gpus", "4", "--size", "400MB", "--explain")
    assert code == 0
    assert "busbw / n" in out and "algbw = size / time" in out


@pytest.mark.parametrize("op, share", [("all-reduce", 1), ("reduce-scatter", 4)])
def test_the_course_formula_is_busbw_for_all_reduce_and_busbw_over_n_for_reduce_scatter(capsys, op, share):
    code, out, _ = run(capsys, "collective", op, "--gpus", "4", "--size", "400MB", "--json")
    busbw = json.loads(out)["results"][0]["busbw_GBps"]
    code, out, _ = run(capsys, "collective", op, "--gpus", "4", "--size", "400MB", "--explain")
    course = float(re.search(r"= ([0-9.]+) GiB/s", out).group(1)) * 2**30 / 1e9
    assert code == 0 and course == pytest.approx(busbw / share, rel=0.01)


def test_json_has_the_shared_result_schema(capsys):
    code, out, _ = run(capsys, "collective", "all-gather", "--gpus", "8", "--size", "64MiB", "--json")
    row = json.loads(out)["results"][0]
    assert code == 0 and row["source"] == "simulated" and row["nranks"] == 8
    assert row["algbw_GBps"] == pytest.approx(row["size_bytes"] / row["time_s"] / 1e9)


def test_sweep_table_and_plot(capsys, tmp_path):
    png = tmp_path / "bw.png"
    code, out, err = run(capsys, "collective", "all-reduce", "--sweep", "1KiB:1MiB:4", "--plot", str(png))
    assert code == 0 and png.stat().st_size > 0
    assert f"wrote {png}" in err  # stderr: with --json, stdout holds the JSON alone
    title, header, _, *rows = out.splitlines()
    assert header.split()[:6] == ["size", "(KiB)", "bytes", "time", "(us)", "algbw"]  # one unit per column
    assert [row.split()[:2] for row in rows] == [["1", "1024"], ["4", "4096"], ["16", "16384"], ["64", "65536"],
                                                 ["256", "262144"], ["1024", "1048576"]]


@pytest.mark.parametrize("argv, message", [
    (["collective", "all-sum"], "unknown collective"),
    (["collective", "--size", "lots"], "size 'lots'"),
    (["collective", "--cluster", "nope"], "unknown cluster"),
    (["collective", "--gpus", "12"], "whole nodes"),
    (["collective", "all-reduce", "--gpus", "6", "--algorithm", "recursive"], "power-of-two"),
    (["collective", "--sweep", "8GiB:1KiB"], "MIN <= MAX"),
    (["collective", "gather", "--gpus", "1", "--size", "1MiB"], "gather on 1 GPU moves nothing between GPUs"),
    (["collective", "all-to-all", "--gpus", "1", "--deepep", "2,8"], "all-to-all on 1 GPU moves nothing"),
    (["collective", "all-gather", "--size", "3"], "and 3 bytes do not split evenly over 8: give a multiple of 8"),
])
def test_bad_input_is_one_line_and_exit_code_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_json_with_a_plot_is_json_alone_on_stdout(capsys, tmp_path):
    code, out, err = run(capsys, "collective", "--sweep", "1MiB:4MiB", "--json", "--plot", str(tmp_path / "b.png"))
    assert code == 0 and len(json.loads(out)["results"]) == 3 and "wrote" in err


def test_a_malformed_cluster_file_names_file_and_key(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ngpus_per_node: eight\n")
    code, _, err = run(capsys, "collective", "--cluster", str(bad))
    assert code == 2 and "bad.yaml" in err and "gpus_per_node" in err

    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [x\n")
    code, _, err = run(capsys, "clusters", str(broken))
    assert code == 2 and "malformed YAML" in err


def test_clusters_lists_every_builtin(capsys):
    code, out, _ = run(capsys, "clusters")
    assert code == 0
    for name in ("dgx-a100", "dgx-h100", "dgx-h200", "dgx-b200", "gb200-nvl72"):
        assert name in out


def test_a_cluster_shows_its_kernel_rates(capsys):
    code, out, _ = run(capsys, "clusters", "dgx-a100")
    assert code == 0
    assert ("  kernels     matmuls bf16 0.869 of peak; memory-bound 0.852 of HBM; attention 0.73 forward, 0.63 "
            "backward; 108 SMs at 1,410 MHz for softmax, dropout, GeLU, norms and bias adds") in out


def test_clusters_sizes_only_a_named_cluster(capsys):
    code, _, err = run(capsys, "clusters", "--nodes", "4")
    assert code == 2 and "--nodes 4 sizes one cluster: name it" in err
    code, out, _ = run(capsys, "clusters", "dgx-h100", "--nodes", "4")
    assert code == 0 and "on 4 node(s): 32 GPUs" in out


@pytest.mark.parametrize("where, gbps", [(["--gpus", "8"], 370.8), (["--nodes", "2"], 50.0), (["--nodes", "4"], 50.0)])
def test_send_recv_runs_between_two_gpus_of_a_node_or_of_two_nodes(capsys, where, gbps):
    """A send/recv is one GPU to one other: the first two of a node (at NCCL's NVLink speed), or given nodes, the
    first GPU of each of two (a pipeline's transfer between nodes, one NIC each way): once it had refused every
    group but two GPUs of one node."""
    code, out, _ = run(capsys, "collective", "send-recv", "--cluster", "dgx-h100", *where, "--size", "1GiB", "--json")
    result = json.loads(out)["results"][0]
    assert code == 0 and result["nranks"] == 2
    assert result["busbw_GBps"] == pytest.approx(gbps, rel=0.01)
    code, out, _ = run(capsys, "collective", "send-recv", "--cluster", "dgx-h100", *where, "--size", "1GiB")
    if "--nodes" in where:
        assert "through 1 NIC (50 GB/s)" in out and "reached     100%" in out
