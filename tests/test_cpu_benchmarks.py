"""The CPU-run benchmark scripts (benchmarks/cpu_*.py): they run a plan (or AdamW steps) on gloo ranks and print
what they measured, and refuse bad input in one line before any rank starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from executor.launch import usable_cores  # noqa: E402

ROOT = Path(__file__).parents[1]


def script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ["cpu_action_gaps.py", "cpu_rank_skew.py"])
@pytest.mark.parametrize("args, expected", [(["nosuch"], "unknown plan 'nosuch'"),
                                            (["course-tp", "--tp", "3"], "tp 3 does not divide width 1024")])
def test_a_bad_plan_is_refused_in_one_line(name, args, expected):
    done = script(f"benchmarks/{name}", *args)
    assert done.returncode == 2 and expected in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert done.stderr.startswith(f"{name}: ")


def test_the_action_gaps_of_a_pipeline_run_are_printed_per_rank():
    done = script("benchmarks/cpu_action_gaps.py", "tiny-pp2", "--steps", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "tiny-pp2 on 2 gloo ranks, 2 steps (ms)"
    for rank in (0, 1):
        head = next(line for line in lines if line.startswith(f"rank {rank}: idle per step, median "))
        # then the wait for the last rank to end the step, on the host's clock: one of the two ranks ends it
        wait = head.split("then waiting for the last rank to end the step, median ")[1]
        median, p90 = (float(part) for part in wait.split(", p90 "))
        assert 0 <= median <= p90
    # on each stage, 4 passes a step follow their receive (stage 1's forwards, stage 0's backwards): 8 in 2 steps
    assert sum(line.split()[0] == "recv->compute" and line.split()[1] == "8" for line in lines) == 2
    # Each rank sends its 4 microbatches' activations or gradients per step: 8 issues over 2 steps.
    assert sum(line.strip().startswith("send issued -> next") and line.split()[4] == "8" for line in lines) == 2
    # Every transfer is timed once, its receiver waiting or its receive posted late: 8 a step.
    transfers = [line for line in lines if line.startswith("transfers, ")]
    assert sum(int(line.split(": ")[1].split(",")[0]) for line in transfers) == 16


def test_the_gap_comparison_sums_each_kind_of_gap_in_both_traces(tmp_path):
    """Each rank's gaps by kind, predicted on a cluster file and measured: tiny PP's second stage opens its
    step with a receive, and each of its 4 passes follows a receive (2 measured steps: the median one)."""
    import yaml

    sys.path.insert(0, str(ROOT / "tests"))
    from test_host_costs import HOST_KEYS, cpu_host

    cluster = tmp_path / "host.yaml"
    cluster.write_text(yaml.safe_dump(cpu_host(**HOST_KEYS)))
    done = script("benchmarks/cpu_gap_compare.py", "tiny-pp2", str(cluster), "--steps", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "tiny-pp2: gaps before actions, count x median = sum (ms)"
    second = lines[lines.index(next(line for line in lines if line.startswith("rank 1:"))) + 1:]
    rows = {line.split()[0]: line.split() for line in second}
    assert rows["start->recv"][1] == "1" and rows["start->recv"][6] == "1"  # predicted and measured, once each
    assert rows["recv->compute"][1] == "4" and rows["recv->compute"][6] == "4"


def test_the_gap_comparison_refuses_an_unknown_cluster_in_one_line():
    done = script("benchmarks/cpu_gap_compare.py", "tiny-pp2", "nosuch.yaml")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert done.stderr.startswith("cpu_gap_compare.py: ")


def test_the_memory_sharing_benchmark_prints_each_rank_alone_and_together():
    done = script("benchmarks/cpu_memory_sharing.py", "--tensors", "2", "--numel", "4096", "--steps", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("AdamW on 2 x 4,096 fp32 parameters, 2 ranks on ")
    rows = [line.split() for line in lines[2:]]
    assert [row[0] for row in rows] == ["0", "1"] and all(float(value) > 0 for row in rows for value in row[1:])


@pytest.mark.parametrize("args, expected", [(["--tensors", "0"], "must be at least 1"),
                                            (["--ranks", "4096"], "--ranks 4096: one rank per core")])
def test_the_memory_sharing_benchmark_refuses_a_bad_run_in_one_line(args, expected):
    done = script("benchmarks/cpu_memory_sharing.py", *args)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert expected in done.stderr


def test_the_cold_passes_benchmark_times_both_passes_after_every_condition():
    done = script("benchmarks/cpu_cold_passes.py", "--repeats", "1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("before the pass") and "tiny-gpt, 2 layers fwd" in lines[0]
    labels = [line[:30].strip() for line in lines[1:]]
    sleeps = [f"after sleeping {ms} ms" for ms in ("0.5", "2", "10", "30", "100", "300")]
    assert labels == ["warm (the pass just ran)", *sleeps, "after a 64 MiB write", "after AdamW on 4 x 1M params"]
    assert all(float(value) > 0 for line in lines[1:] for value in line[30:].split())


def test_the_cold_passes_benchmark_refuses_no_repeats_in_one_line():
    done = script("benchmarks/cpu_cold_passes.py", "--repeats", "0")
    assert done.returncode == 2 and done.stderr == "cpu_cold_passes.py: --repeats must be at least 1\n"


def _benchmark(name: str):
    """The script ``benchmarks/<name>.py`` as a module (the benchmarks are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import does: a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def _compare_loop():
    return _benchmark("cpu_compare_loop")


def test_the_compare_loop_takes_each_plan_s_error_against_the_median_run():
    """Three runs: the step's error is the median prediction over the median measured step; each phase's the
    same per rank, the worst named; the bounds are the issue's (15% a step, 25% a phase)."""
    def run(predicted, measured, forward, idle):
        return {"predicted_step_s": predicted, "measured_step_s": measured,
                "phases": [{"rank": 0, "pp": 0, "phase": "forward", "predicted_s": 0.010, "measured_s": forward},
                           {"rank": 0, "pp": 0, "phase": "idle", "predicted_s": 0.001, "measured_s": idle}]}

    summary = _compare_loop().summarize([run(0.040, 0.050, 0.011, 0.001), run(0.042, 0.046, 0.012, 0.002),
                                         run(0.041, 0.044, 0.020, 0.001)])
    assert summary["step_error"] == pytest.approx(0.041 / 0.046 - 1) and summary["step_within"]
    assert [row["error"] for row in summary["phases"]] == pytest.approx([0.010 / 0.012 - 1, 0.0])
    assert summary["worst_phase"]["phase"] == "forward" and summary["phases_within"]
    summary = _compare_loop().summarize([run(0.030, 0.050, 0.010, 0.004)] * 3)
    assert not summary["step_within"] and not summary["phases_within"]
    assert summary["worst_phase"] == {"rank": 0, "phase": "idle", "predicted_s": 0.001, "measured_s": 0.004,
                                      "error": pytest.approx(-0.75), "measured_range_s": None}
    assert summary["phase_misses"] == 1 and summary["phase_misses_in_range"] == 0


def test_the_compare_loop_also_holds_each_stage_s_phases_the_mean_over_its_ranks():
    """Per stage, each run's phase is the mean over the stage's ranks (a stage of one rank: that rank's), then the
    median over the runs: two twins that swap which one waits in `dp` miss per rank, not per stage."""
    def run(dp_0, dp_2):
        return {"predicted_step_s": 0.1, "measured_step_s": 0.1,
                "phases": [{"rank": 0, "pp": 0, "phase": "dp", "predicted_s": 0.005, "measured_s": dp_0},
                           {"rank": 2, "pp": 0, "phase": "dp", "predicted_s": 0.005, "measured_s": dp_2},
                           {"rank": 1, "pp": 1, "phase": "idle", "predicted_s": 0.002, "measured_s": 0.004}]}

    loop = _compare_loop()
    summary = loop.summarize([run(0.009, 0.001), run(0.0005, 0.0095), run(0.010, 0.001)])
    assert summary["phase_misses"] == 3  # rank 0's dp, rank 2's, rank 1's idle
    assert summary["stages"] == [{"pp": 0, "phase": "dp", "predicted_s": 0.005, "measured_s": pytest.approx(0.005),
                                  "error": pytest.approx(0.0)},
                                 {"pp": 1, "phase": "idle", "predicted_s": 0.002, "measured_s": 0.004,
                                  "error": pytest.approx(-0.5)}]
    assert summary["stage_misses"] == 1


def test_the_compare_loop_takes_a_stage_s_measured_phases_from_its_run_s_steps():
    """Where a run kept a stage's phases over its steps (compare's `stages`: the ranks' mean in each step, then the
    median), the loop holds the prediction against those, not against the mean of the ranks' medians."""
    def run(stage_dp):
        return {"predicted_step_s": 0.1, "measured_step_s": 0.1,
                "phases": [{"rank": 0, "pp": 0, "phase": "dp", "predicted_s": 0.005, "measured_s": 0.0001},
                           {"rank": 2, "pp": 0, "phase": "dp", "predicted_s": 0.005, "measured_s": 0.0002}],
                "stages": [{"pp": 0, "ranks": 2, "phase": "dp", "predicted_s": 0.005, "measured_s": stage_dp}]}

    summary = _compare_loop().summarize([run(0.004), run(0.005), run(0.006)])
    assert summary["phase_misses"] == 2 and summary["stage_misses"] == 0
    assert summary["stages"] == [{"pp": 0, "phase": "dp", "predicted_s": 0.005, "measured_s": 0.005, "error": 0.0}]


def test_the_compare_loop_counts_the_misses_its_steps_own_range_holds():
    """A phase outside 25% whose prediction one measured step reached (the union of the runs' ranges) is
    counted apart from one no step came near."""
    def run(idle_range, forward_range):
        return {"predicted_step_s": 0.040, "measured_step_s": 0.040,
                "phases": [{"rank": 0, "pp": 0, "phase": "idle", "predicted_s": 0.001, "measured_s": 0.002,
                            "measured_range_s": idle_range},
                           {"rank": 0, "pp": 0, "phase": "forward", "predicted_s": 0.010, "measured_s": 0.020,
                            "measured_range_s": forward_range}]}

    summary = _compare_loop().summarize([run([0.0015, 0.003], [0.018, 0.022]), run([0.0009, 0.002], [0.019, 0.03])])
    idle = next(row for row in summary["phases"] if row["phase"] == "idle")
    assert idle["measured_range_s"] == [0.0009, 0.003]
    assert summary["phase_misses"] == 2 and summary["phase_misses_in_range"] == 1


def test_the_compare_loop_refuses_no_runs_and_a_bad_cluster_in_one_line_before_any_run():
    done = script("benchmarks/cpu_compare_loop.py", "--runs", "0")
    assert done.returncode == 2 and done.stderr == "cpu_compare_loop.py: --runs must be at least 1, got 0\n"
    done = script("benchmarks/cpu_compare_loop.py", "--steps", "0")
    assert done.returncode == 2 and done.stderr == "cpu_compare_loop.py: --steps must be at least 1, got 0\n"
    done = script("benchmarks/cpu_compare_loop.py", "--hold", "eager")
    assert done.returncode == 2 and done.stderr == "cpu_compare_loop.py: --hold predicts kept runs again: it goes " \
        "with --again\n"
    for args, said in ((["--power", "eager=0.5"], "--power predicts kept runs again: it goes with --again"),
                       (["--again", "x", "--power", "collective=0.5"],
                        "--power collective=0.5: the probe is one of matmul, eager, memory"),
                       (["--again", "x", "--power", "eager=2"], "--power eager=2: the power is a number from 0 to 1"),
                       (["--again", "x", "--power", "eager=half"],
                        "--power eager=half: the power is a number from 0 to 1"),
                       (["--again", "x", "--hold", "eager", "--power", "eager=0.5"],
                        "--power eager=0.5: the eager probe is held (--hold) already")):
        done = script("benchmarks/cpu_compare_loop.py", *args)
        assert done.returncode == 2 and done.stderr == f"cpu_compare_loop.py: {said}\n"
    done = script("benchmarks/cpu_compare_loop.py", "--cluster", "nosuch.yaml")
    assert done.returncode == 2 and done.stderr.startswith("cpu_compare_loop.py: unknown cluster 'nosuch.yaml'")
    assert len(done.stderr.strip().splitlines()) == 1 and "run 1/" not in done.stderr


def test_the_compare_loop_prints_each_plan_against_the_bounds(monkeypatch, tmp_path, capsys):
    """Every compare faked: each plan's prediction, its runs' steps, the error, the worst phase, and the two
    verdicts, as printed."""
    import json

    loop = _compare_loop()

    def parsim(*args):
        assert args[args.index("--steps") + 1] == "7"
        doc = {"predicted_step_s": 0.040, "measured_step_s": 0.050 if "course-tp" in args else 0.042,
               "phases": [{"rank": 1, "pp": 0, "phase": "idle", "predicted_s": 0.001, "measured_s": 0.0011}]}
        return subprocess.CompletedProcess(args, 0, json.dumps(doc), "")

    monkeypatch.setattr(loop, "_parsim", parsim)
    monkeypatch.setattr(sys, "argv", ["cpu_compare_loop.py", "--cluster", "dgx-h100", "--runs", "2", "--steps", "7",
                                      "--out", str(tmp_path)])
    loop.main()
    rows = {line[:12].strip(): line.split() for line in capsys.readouterr().out.splitlines()[3:]}
    assert rows["course DDP"][2:] == ["40", "42.0", "42.0", "-4.8%", "yes", "r1", "idle", "-9%", "yes", "0", "(0)",
                                      "0"]
    assert rows["course TP"][2:] == ["40", "50.0", "50.0", "-20.0%", "no", "r1", "idle", "-9%", "yes", "0", "(0)",
                                     "0"]
    assert len(list(tmp_path.glob("*.json"))) == 2 * len(loop.PLANS)


def test_the_compare_loop_predicts_kept_runs_again_with_the_model_as_it_is(tmp_path, capsys, monkeypatch):
    """--again: a kept run's measured step and phases stay; its prediction is the model's now, at the host speed
    its probes measured (here the arithmetic at 1.25x the calibration's, the memory at 0.8x)."""
    import json

    from parsim.hardware.cluster import load_cluster
    from parsim.sim.step import predict_step
    from parsim.workload.plan import resolve_plan

    (tmp_path / "host.yaml").write_text((ROOT / "topologies" / "dgx-h100.yaml").read_text())
    speed = {"arithmetic_factor": 1.25, "eager_factor": 1.0, "memory_factor": 0.8}
    kept = {"predicted_step_s": 1.0, "measured_step_s": 0.004, "host_speed": speed,
            "phases": [{"rank": 1, "pp": 1, "phase": "forward", "predicted_s": 1.0, "measured_s": 0.001,
                        "measured_range_s": [0.0009, 0.0012], "error": 999.0}]}
    (tmp_path / "tiny-pp-1.json").write_text(json.dumps(kept))
    loop = _compare_loop()
    monkeypatch.setattr(sys, "argv", ["cpu_compare_loop.py", "--again", str(tmp_path), "--json"])
    loop.main()
    doc = json.loads(capsys.readouterr().out)
    assert list(doc["plans"]) == ["tiny PP"] and doc["runs"] == {"tiny PP": 1}
    cluster = load_cluster(str(tmp_path / "host.yaml")).at_host_speed(1.25, 1.0, 0.8)
    predicted = predict_step(resolve_plan("tiny-pp2"), cluster)
    plan = doc["plans"]["tiny PP"]
    assert plan["predicted_step_s"] == pytest.approx(predicted.step_s) and plan["measured_step_s"] == [0.004]
    forward = next(row for row in plan["phases"] if row["rank"] == 1 and row["phase"] == "forward")
    assert forward["predicted_s"] == pytest.approx(predicted.ranks[1].seconds["forward"])
    assert forward["measured_s"] == 0.001 and forward["measured_range_s"] == [0.0009, 0.0012]
    # --hold: as if those probes had read the calibration's speed (all of them: the calibration's prediction)
    for held, factors in ((["memory"], (1.25, 1.0, 1.0)), (["matmul", "eager"], (1.0, 1.0, 0.8)), (["all"], None)):
        monkeypatch.setattr(sys, "argv", ["cpu_compare_loop.py", "--again", str(tmp_path), "--hold", *held, "--json"])
        loop.main()
        spec = load_cluster(str(tmp_path / "host.yaml"))
        expected = predict_step(resolve_plan("tiny-pp2"), spec.at_host_speed(*factors) if factors else spec).step_s
        assert json.loads(capsys.readouterr().out)["plans"]["tiny PP"]["predicted_step_s"] == pytest.approx(expected)
    monkeypatch.setattr(sys, "argv", ["cpu_compare_loop.py", "--again", str(tmp_path), "--hold", "memory"])
    loop.main()
    assert "the memory probe held at the calibration's speed" in capsys.readouterr().out
    # --power: the probes' own ratios (a run from before the fits: its factors) to these powers
    monkeypatch.setattr(sys, "argv", ["cpu_compare_loop.py", "--again", str(tmp_path), "--hold", "eager", "--power",
                                      "matmul=0.5", "memory=0", "--json"])
    loop.main()
    expected = predict_step(resolve_plan("tiny-pp2"), spec.at_host_speed(1.25 ** 0.5, 1.0, 1.0)).step_s
    assert json.loads(capsys.readouterr().out)["plans"]["tiny PP"]["predicted_step_s"] == pytest.approx(expected)
    # a run with calibrate's fitted powers: its ratios, not its factors, are raised
    fitted = {**speed, "arithmetic_factor": 1.25 ** 0.2, "arithmetic_probe_factor": 1.25, "matmul_elasticity": 0.2}
    (tmp_path / "tiny-pp-1.json").write_text(json.dumps({**kept, "host_speed": fitted}))
    monkeypatch.setattr(sys, "argv", ["cpu_compare_loop.py", "--again", str(tmp_path), "--power", "matmul=1"])
    loop.main()
    out = capsys.readouterr().out
    assert "predicted again with this model on " in out and out.splitlines()[0].endswith(
        ", the matmul probe's ratio to the power 1.00")
    expected = predict_step(resolve_plan("tiny-pp2"), spec.at_host_speed(1.25, 1.0, 0.8)).step_s
    assert float(out.splitlines()[3].split()[2]) == pytest.approx(expected * 1e3, rel=1e-3)


def test_the_compare_loop_takes_the_model_across_several_kept_loops_stage_by_stage(tmp_path, capsys, monkeypatch):
    """--again A B: every folder predicted on its own calibration; per plan the sets whose step is within 15%,
    per stage and phase the median error over the sets and how many miss 25%."""
    import json

    measured = {"a": 0.004, "b": 1.0}  # set a's step far off the model's, set b's 1 s
    for name, step in measured.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "host.yaml").write_text((ROOT / "topologies" / "dgx-h100.yaml").read_text())
        kept = {"predicted_step_s": 1.0, "measured_step_s": step,
                "phases": [{"rank": 0, "pp": 0, "phase": "forward", "predicted_s": 1.0, "measured_s": step / 2}]}
        (folder / "tiny-pp-1.json").write_text(json.dumps(kept))
    loop = _compare_loop()
    monkeypatch.setattr(sys, "argv", ["cpu_compare_loop.py", "--again", str(tmp_path / "a"), str(tmp_path / "b"),
                                      "--json"])
    loop.main()
    doc = json.loads(capsys.readouterr().out)
    singles = [loop.summarize(loop._kept_runs(tmp_path / name)["tiny PP"]) for name in measured]
    plan = doc["plans"]["tiny PP"]
    assert plan["sets"] == 2 and plan["steps_within"] == sum(s["step_within"] for s in singles)
    assert plan["median_step_error"] == pytest.approx((singles[0]["step_error"] + singles[1]["step_error"]) / 2)
    assert plan["stage_misses"] == sum(s["stage_misses"] for s in singles)
    forward = next(row for row in doc["stages"] if row["pp"] == 0 and row["phase"] == "forward")
    errors = [next(r["error"] for r in s["stages"] if r["pp"] == 0 and r["phase"] == "forward") for s in singles]
    assert forward["sets"] == 2 and forward["median_error"] == pytest.approx(sum(errors) / 2)
    assert forward["sets_missing"] == sum(abs(e) > 0.25 for e in errors) >= 1
    monkeypatch.setattr(sys, "argv", ["cpu_compare_loop.py", "--again", str(tmp_path / "a"), str(tmp_path / "b")])
    loop.main()
    text = capsys.readouterr().out
    assert "the runs kept in 2 folders, each predicted again with this model on its own calibration" in text
    assert "sets outside 25%" in text and f"{forward['sets_missing']} of 2" in text


def test_the_compare_loop_refuses_a_folder_without_kept_runs_in_one_line(tmp_path):
    done = script("benchmarks/cpu_compare_loop.py", "--again", str(tmp_path))
    assert done.returncode == 2 and done.stderr.startswith("cpu_compare_loop.py: ") and done.stderr.count("\n") == 1
    (tmp_path / "host.yaml").write_text((ROOT / "topologies" / "dgx-h100.yaml").read_text())
    done = script("benchmarks/cpu_compare_loop.py", "--again", str(tmp_path))
    assert done.returncode == 2 and done.stderr == f"cpu_compare_loop.py: no runs kept in {tmp_path} (an earlier " \
        "loop's --out keeps them as PLAN-N.json)\n"
    done = script("benchmarks/cpu_compare_loop.py", "--again", str(tmp_path), "--runs", "2")
    assert done.returncode == 2
    assert done.stderr == "cpu_compare_loop.py: --again runs nothing, so --runs does not apply\n"


def test_the_compare_loop_holds_two_loops_measurements_against_each_other(tmp_path, capsys, monkeypatch):
    """--repeat: each phase's median as a share of its loop's median step, loop A's against loop B's; a loop whose
    host ran 10% slower throughout misses nothing, a phase that moved from 20% to 30% of the step misses by 50%."""
    import json

    def keep(folder, label, steps, forward, idle):
        folder.mkdir(exist_ok=True)
        for i, (step, f, d) in enumerate(zip(steps, forward, idle)):
            doc = {"predicted_step_s": 1.0, "measured_step_s": step,
                   "phases": [{"rank": 0, "pp": 0, "phase": "forward", "predicted_s": 1.0, "measured_s": f},
                              {"rank": 0, "pp": 0, "phase": "idle", "predicted_s": 1.0, "measured_s": d}]}
            (folder / f"{label}-{i + 1}.json").write_text(json.dumps(doc))

    a, b = tmp_path / "a", tmp_path / "b"
    keep(a, "tiny-pp", [0.110, 0.100, 0.130], [0.055, 0.050, 0.060], [0.022, 0.030, 0.033])
    keep(b, "tiny-pp", [0.100, 0.090, 0.095], [0.050, 0.045, 0.048], [0.020, 0.019, 0.040])
    keep(b, "course-tp", [0.1], [0.05], [0.0])  # only in B: left out
    loop = _compare_loop()
    summary = loop.repeated(loop._runs_in(a)["tiny PP"], loop._runs_in(b)["tiny PP"])
    assert summary["step_s"] == [0.110, 0.095] and summary["step_change"] == pytest.approx(0.110 / 0.095 - 1)
    forward, idle = summary["phases"]
    assert forward["error"] == pytest.approx((0.055 / 0.110) / (0.048 / 0.095) - 1)
    assert idle["share_a"] == pytest.approx(0.030 / 0.110) and idle["share_b"] == pytest.approx(0.020 / 0.095)
    assert summary["phase_misses"] == 1 and summary["worst_phase"]["phase"] == "idle"
    assert summary["stage_misses"] == 1  # a stage of one rank: as that rank
    monkeypatch.setattr(sys, "argv", ["cpu_compare_loop.py", "--repeat", str(a), str(b), "--json"])
    loop.main()
    doc = json.loads(capsys.readouterr().out)
    assert list(doc["plans"]) == ["tiny PP"] and doc["plans"]["tiny PP"]["phase_misses"] == 1


def test_the_compare_loop_refuses_a_repeat_of_nothing_in_one_line(tmp_path):
    done = script("benchmarks/cpu_compare_loop.py", "--repeat", str(tmp_path), str(tmp_path), "--runs", "2")
    assert done.returncode == 2
    assert done.stderr == "cpu_compare_loop.py: --repeat runs nothing, so --runs does not apply\n"
    done = script("benchmarks/cpu_compare_loop.py", "--repeat", str(tmp_path), str(tmp_path))
    assert done.returncode == 2 and done.stderr == f"cpu_compare_loop.py: no runs kept in {tmp_path} (an earlier " \
        "loop's --out keeps them as PLAN-N.json)\n"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "tiny-pp-1.json").write_text('{"measured_step_s": 0.1, "phases": []}')
    (tmp_path / "b" / "course-tp-1.json").write_text('{"measured_step_s": 0.1, "phases": []}')
    done = script("benchmarks/cpu_compare_loop.py", "--repeat", str(tmp_path / "a"), str(tmp_path / "b"))
    assert done.returncode == 2 and done.stderr == f"cpu_compare_loop.py: {tmp_path / 'a'} and {tmp_path / 'b'} " \
        "keep no plan's runs in common\n"


@pytest.mark.skipif(usable_cores() < 2, reason="binds a rank beside rank 0 on a host of 2 cores or more")
def test_the_core_sharing_benchmark_times_rank_0_beside_its_core_s_other_rank():
    done = script("benchmarks/cpu_core_sharing.py", "--blocks", "2", "--matmuls", "1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("rank 0's block of 1 matmul (256, 1024, 1024), median of 2;")
    assert [line.split()[0] for line in lines[1:]] == ["alone", "rank", "rank"]
    assert lines[1].endswith("x1.00") and all(float(line.split()[-3]) > 0 for line in lines[1:])


def test_the_core_sharing_benchmark_refuses_no_blocks_in_one_line():
    done = script("benchmarks/cpu_core_sharing.py", "--blocks", "0")
    assert done.returncode == 2 and done.stderr.strip().endswith("--blocks and --matmuls must be at least 1")


@pytest.mark.skipif(usable_cores() < 2, reason="binds a rank beside rank 0 on a host of 2 cores or more")
def test_the_pass_stretch_benchmark_sets_a_model_s_passes_beside_both_probes():
    done = script("benchmarks/cpu_pass_stretch.py", "--rounds", "1", "--window", "0.02")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("rank 0 and rank ") and "1 rounds of 0.02 s windows" in lines[0]
    rows = {" ".join(line.split()[:-4]): line.split()[-4:] for line in lines[2:]}
    assert list(rows) == ["tiny-gpt forward", "tiny-gpt backward", "tiny-gpt forward+backward", "eager probe",
                          "matmul probe"]
    for alone, together, stretch, _ in rows.values():  # the stretch: the together time over the alone one
        alone_ms, together_ms = float(alone.removesuffix("ms")), float(together.removesuffix("ms"))
        assert alone_ms > 0 and float(stretch[1:]) == pytest.approx(together_ms / alone_ms, abs=0.02)


@pytest.mark.parametrize("args, expected", [(["--rounds", "0"], "--rounds must be at least 1 and --window positive"),
                                            (["--model", "nosuch"], "nosuch")])
def test_the_pass_stretch_benchmark_refuses_a_bad_run_in_one_line(args, expected):
    done = script("benchmarks/cpu_pass_stretch.py", *args)
    assert done.returncode == 2 and expected in done.stderr and len(done.stderr.strip().splitlines()) == 1


def _twin_allreduce():
    return _benchmark("cpu_twin_allreduce")


def test_the_twin_allreduce_benchmark_sets_the_model_s_turns_beside_what_it_measured():
    """The model's figure is its round robin's closed form: 2.31 ms each in 1.5 ms slices ends the first at
    1.5 + 2.31 ms (its second turn after the other's first) and the second at twice 2.31 ms."""
    first, second = _twin_allreduce()._model_turns(2.31e-3, cores=2)
    assert first == pytest.approx(1.5e-3 + 2.31e-3) and second == pytest.approx(2 * 2.31e-3)
    assert _twin_allreduce()._model_turns(1e-3, cores=2) == pytest.approx((1e-3, 2e-3))  # within a slice: whole


@pytest.mark.skipif(usable_cores() != 2, reason="binds ranks 0 and 2 to one core of a 2-core host")
def test_the_twin_allreduce_benchmark_prints_both_pairings_and_the_model():
    done = script("benchmarks/cpu_twin_allreduce.py", "--rounds", "2", "--kib", "64")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "an all-reduce of 64 KiB, then AdamW on as many fp32 parameters; medians of 2 rounds"
    assert [line.split()[0] for line in lines[3:]] == ["a", "one", "model,"] and lines[1].startswith("  AdamW alone: ")


def test_the_twin_allreduce_benchmark_refuses_no_rounds_in_one_line():
    done = script("benchmarks/cpu_twin_allreduce.py", "--rounds", "0")
    assert done.returncode == 2
    assert done.stderr == "cpu_twin_allreduce.py: --kib must be at least 16 and --rounds at least 1\n"


@pytest.mark.skipif(usable_cores() != 2, reason="binds ranks 0 and 2 to one core of a 2-core host")
def test_the_core_allreduce_benchmark_prints_each_size_on_a_core_each_and_on_one():
    done = script("benchmarks/cpu_core_allreduce.py", "--rounds", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "a gloo all-reduce whose second rank calls it 3 ms after the first; medians of 2 rounds"
    rows = [line.split() for line in lines[2:]]
    assert [(row[0], row[1]) for row in rows] == [(kib, pair) for kib in ("4", "64", "545", "4096")
                                                  for pair in ("a", "one")]
    assert all(float(row[-4]) > 0 and row[-3] == "ms" and row[-1] == "ms" for row in rows)


def test_the_core_allreduce_benchmark_refuses_no_rounds_in_one_line():
    done = script("benchmarks/cpu_core_allreduce.py", "--rounds", "0")
    assert done.returncode == 2 and done.stderr == "cpu_core_allreduce.py: --rounds must be at least 1\n"


def test_the_twin_overlap_benchmark_measures_each_pass_s_share_beside_its_twin():
    """Rank 0's forward (0-2 ms) beside its twin's backward (1-4 ms): half of it overlapped; the twin's backward,
    a third; ranks 0 and 2 share core 0 of 2, ranks 1 and 3 core 1. On a core of three ranks, time two others
    computed counts once."""
    from parsim.report.trace import Event

    bench = _benchmark("cpu_twin_overlap")
    assert bench.core_mates(4, 4, 2) == {0: [2], 2: [0], 1: [3], 3: [1]} and bench.core_mates(2, 2, 2) == {}
    events = [Event("F stage=0 mb=0", 0, "compute", "compute", 0.0, 2e-3),
              Event("B stage=0 mb=1", 2, "compute", "compute", 1e-3, 3e-3),
              Event("send act stage=0 mb=0 peer=1", 0, "p2p", "send", 2e-3, 1e-3)]
    rows = bench.overlaps(events, {0: [2], 2: [0]})
    assert rows[0, "forward"] == [(2e-3, pytest.approx(0.5))] and rows[0, "backward"] == [(3e-3, pytest.approx(1 / 3))]
    assert bench.summary(rows)[0, "forward"] == (2e-3, pytest.approx(0.5))
    three = events + [Event("optimizer step", 4, "compute", "optimizer", 0.5e-3, 1e-3)]
    assert bench.overlaps(three, {0: [2, 4]})[0, "forward"] == [(2e-3, pytest.approx(0.75))]


def test_the_twin_overlap_benchmark_refuses_a_plan_whose_ranks_have_a_core_each_in_one_line():
    done = script("benchmarks/cpu_twin_overlap.py", "dgx-h100", "course-ddp", "--dp", "1")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    done = script("benchmarks/cpu_twin_overlap.py", "nosuch.yaml")
    assert done.returncode == 2 and "unknown cluster 'nosuch.yaml'" in done.stderr


@pytest.mark.parametrize("args, expected", [(["--ranks", "0"], "--ranks 0: between 1 and"),
                                            (["--linears", "0"], "--linears 0: between 1 and 64")])
def test_the_fsdp_overhead_benchmark_refuses_bad_input_in_one_line(args, expected):
    done = script("benchmarks/cpu_fsdp_overhead.py", *args)
    assert done.returncode == 2 and expected in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_the_fsdp_overhead_benchmark_prints_what_fsdp2_adds_per_unit():
    done = script("benchmarks/cpu_fsdp_overhead.py", "--steps", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "units of 2 x 64-wide linears, 1 rank(s): what FSDP2 adds per unit, ms"
    row = lines[2].split()  # rank, mesh, then forward, backward, AdamW, and the kept forward and backward in ms
    assert row[:3] == ["0", "own", "group"] and len(row) == 8 and all(float(v) == float(v) for v in row[3:])


def test_the_collective_skew_benchmark_prints_a_row_per_skew():
    done = script("benchmarks/cpu_collective_skew.py", "--ops", "all_reduce,all_to_all", "--calls", "1", "--kib", "16")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "2 gloo ranks, 16 KiB, 1 calls per skew, after 2 ms of compute (ms)"
    rows = [line.split() for line in lines[2:]]
    skews = ["0.0", "0.1", "0.2", "0.4", "0.8", "1.6", "3.2"]
    assert [(r[0], r[1]) for r in rows] == [(op, s) for op in ("all_reduce", "all_to_all") for s in skews]
    # a call lasts no less than nothing: the early rank's call minus the skew is at least minus the skew (how much
    # more it waits is the host's scheduling, which a loaded CI machine moves by milliseconds)
    assert all(float(v) >= -float(r[1]) - 0.01 for r in rows for v in r[2:4])
    assert all(float(v) >= 0 for r in rows for v in r[4:])


@pytest.mark.parametrize("args, expected", [
    (["--ops", "broadcast"], "cpu_collective_skew.py: unknown op 'broadcast' (expected all_reduce, all_to_all, "
                             "all_gather)\n"),
    (["--calls", "0"], "cpu_collective_skew.py: --kib must be 1 to 65536 and --calls 1 to 10000\n")])
def test_the_collective_skew_benchmark_refuses_bad_input_in_one_line(args, expected):
    done = script("benchmarks/cpu_collective_skew.py", *args)
    assert done.returncode == 2 and done.stderr == expected


def test_the_gloo_loops_benchmark_prints_each_plan_under_each_policy():
    done = script("benchmarks/cpu_gloo_loops.py", "--plans", "course DDP", "--policies", "split", "preempt",
                  "--steps", "1")
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    assert header.split() == ["plan", "policy", "step", "ms", "forward", "backward", "tp", "pp", "dp", "optimizer",
                              "idle"]
    assert [row.split()[:3] for row in rows] == [["course", "DDP", "split"], ["course", "DDP", "preempt"]]
    for row in rows:
        step, *phases = (float(x) for x in row.split()[3:])
        assert step > 0 and phases[2] == phases[3] == 0.0 and phases[4] > 0  # no tp, no pp; a dp all-reduce


def test_the_gloo_loops_benchmark_refuses_bad_input_in_one_line():
    done = script("benchmarks/cpu_gloo_loops.py", "--steps", "0")
    assert done.returncode == 2 and done.stderr == "cpu_gloo_loops.py: --steps must be at least 1\n"


def test_the_spells_benchmark_prints_the_probe_and_calls_between_compute_by_size():
    done = script("benchmarks/cpu_collective_spells.py", "--seconds", "1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[1:4] == ["rounds", "in", "1"] and "in slow spells" in lines[0]
    table = lines[lines.index("medians in us, out of / in the spells (what a spell added)") + 1:]
    assert table[0].split()[:3] == ["size", "probe", "(all-reduce,"]
    assert [row.split()[:2] for row in table[1:]] == [["256", "KiB"], ["1024", "KiB"], ["4096", "KiB"]]


def test_the_spells_benchmark_splits_its_rounds_at_the_slow_ones():
    bench = _benchmark("cpu_collective_spells")

    def round_(at_s: float, us: float) -> dict:
        return {"at_s": at_s, **{kind: {kib: us * 1e-6 for kib in (256, 1024, 4096)}
                                 for kind in ("probe", "all_reduce", "all_gather")}}

    rounds = [round_(0.0, 400), round_(0.5, 900), round_(1.0, 1000), round_(1.5, 400), round_(2.0, 900)]
    slow = [False, True, True, False, True]
    assert bench.spells(rounds, slow) == [(0.5, 1.0), (2.0, 2.0)]
    # medians out of (400, 400) and in the spells (900, 1000, 900): 400 / 900, for the probe and both operations
    assert bench.table(rounds, slow)[2].split() == ["1024", "KiB", *["400", "/", "900", "(+500)"] * 3]


def test_the_spells_benchmark_refuses_bad_input_in_one_line():
    done = script("benchmarks/cpu_collective_spells.py", "--seconds", "0")
    assert done.returncode == 2 and done.stderr == \
        "cpu_collective_spells.py: --seconds must be more than 0 and at most 3600\n"


def test_the_launch_benchmark_times_the_fork_server_against_spawned_ranks():
    done = script("benchmarks/launch_overhead.py", "--ranks", "2", "--rounds", "1")
    assert done.returncode == 0, done.stderr
    first, header, row = done.stdout.splitlines()
    assert first.startswith("first launch from the fork server (2 ranks), its start included: ")
    assert header.split()[:4] == ["ranks", "fork", "server", "(s)"]
    ranks, server_s, spawn_s = row.split()
    assert ranks == "2" and float(server_s) > 0 and float(spawn_s) > 0


@pytest.mark.parametrize("args, expected", [(["--ranks", "0"], "--ranks and --rounds must be at least 1"),
                                            (["--rounds", "0"], "--ranks and --rounds must be at least 1"),
                                            (["--ranks", "two"], "--ranks 'two': whole numbers, comma-separated")])
def test_the_launch_benchmark_refuses_bad_input_in_one_line(args, expected):
    done = script("benchmarks/launch_overhead.py", *args)
    assert done.returncode == 2 and done.stderr.strip().endswith(expected)
