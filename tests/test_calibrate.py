"""Calibration recovers a known host from its own predictions; compare reads saved measurements."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from cpu_host import cpu_host

from parsim.calibrate.host import core_cache_bytes, fit_links, fit_matmul, fit_operation, host_cluster
from parsim.calibrate.shared_pipeline import fit_comm_stretch
from parsim.cli.common import warn_other_machine
from parsim.cli.main import main
from parsim.errors import ConfigError
from parsim.hardware.cluster import SharedCoreCosts, load_cluster, parse_cluster
from parsim.report.results import save_results
from parsim.report.step_report import PHASES
from parsim.sim.collectives import predict
from parsim.sim.collectives.algorithms import build_phases
from parsim.sim.compute import ComputeModel

GLOO = {"all_reduce": "ring", "send_recv": "direct", "all_gather": "ring", "reduce_scatter": "via_all_reduce",
        "broadcast": "recursive"}
SIZES = [2**16, 2**18, 2**20, 2**22, 2**24, 2**26]


def host(**kw):
    data = host_cluster(4, 300e-6, 2.0e9, 6e9, fabric_bw_Bps=3.0e9, algorithms=GLOO, **kw)
    return parse_cluster(data, "host.yaml")


def synthetic(spec, ops_ranks):
    topo = spec.build(1)
    return [predict(topo, op, s, np.arange(n)).result() for op, n in ops_ranks for s in SIZES]


def test_fit_recovers_latency_link_and_host_bandwidth():
    measured = synthetic(host(), [("all_reduce", 2), ("all_reduce", 4), ("send_recv", 2)])
    fit = fit_links(measured, GLOO, 6e9)
    assert fit.latency_s == pytest.approx(300e-6, rel=0.02)
    assert fit.bw_Bps == pytest.approx(2.0e9, rel=0.05)
    assert fit.fabric_bw_Bps == pytest.approx(3.0e9, rel=0.1)
    assert max(abs(f / r.time_s - 1) for r, f in fit.rows) < 0.05


def test_an_operation_with_its_own_cost_is_fitted_apart():
    slow = host(efficiency={"all_gather": 0.4}, overhead_s={"all_gather": 1e-3})
    links = fit_links(synthetic(slow, [("all_reduce", 2), ("send_recv", 2)]), GLOO, 6e9)
    fit = fit_operation(synthetic(slow, [("all_gather", 2)]), links, GLOO)
    assert fit.efficiency == pytest.approx(0.4, rel=0.05)
    assert fit.overhead_s == pytest.approx(1e-3, rel=0.05)
    assert not fit.at_link_speed and fit.cache_speedup == 1.0


def test_buffers_that_fit_a_core_s_cache_get_each_operation_s_own_speed_up():
    """A host whose all-reduces move their bytes 2.5x as fast, and all-gathers 3x, up to 1 MiB (sizes of 64 KiB
    to 1 MiB cached, 4 to 64 MiB not): the links come out as the streamed sizes' and each speed-up is recovered."""
    cached = host(efficiency={"all_gather": 0.5}, cache_bytes=2**20,
                  cache_speedup={"all_reduce": 2.5, "send_recv": 1.0, "all_gather": 3.0})
    assert cached.collective_cache_bytes == 2**20 and cached.collective_cache_speedup["all_gather"] == 3.0
    links = fit_links(synthetic(cached, [("all_reduce", 2), ("all_reduce", 4), ("send_recv", 2)]), GLOO, 6e9,
                      cache_bytes=2**20)
    assert links.latency_s == pytest.approx(300e-6, rel=0.02) and links.bw_Bps == pytest.approx(2.0e9, rel=0.05)
    for op, efficiency, speedup in (("all_reduce", 1.0, 2.5), ("all_gather", 0.5, 3.0), ("send_recv", 1.0, 1.0)):
        fit = fit_operation(synthetic(cached, [(op, 2)]), links, GLOO)
        assert fit.efficiency == pytest.approx(efficiency, rel=0.05)
        assert fit.cache_speedup == pytest.approx(speedup, rel=0.05)
        assert max(abs(f / r.time_s - 1) for r, f in fit.rows) < 0.05
    # without the split, one line cannot follow the knee
    plain = fit_links(synthetic(cached, [("all_reduce", 2), ("send_recv", 2)]), GLOO, 6e9)
    assert max(abs(f / r.time_s - 1) for r, f in plain.rows) > 0.15


def test_a_core_s_cache_is_its_l2_as_sysfs_lists_it(tmp_path):
    for index, (level, kind, size) in enumerate([("1", "Data", "32K"), ("1", "Instruction", "32K"),
                                                 ("2", "Unified", "1024K"), ("3", "Unified", "32768K")]):
        folder = tmp_path / "cpu1" / "cache" / f"index{index}"
        folder.mkdir(parents=True)
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (folder / name).write_text(value + "\n")
    assert core_cache_bytes(1, tmp_path) == 2**20
    assert core_cache_bytes(0, tmp_path) == 0  # no such CPU listed: unknown


def test_the_speed_up_applies_up_to_the_cache_s_size_only():
    """The links carry a cached all-reduce's bytes as half as many (twice as fast); one byte past the cache, all."""
    cached, plain = host(cache_bytes=2**20, cache_speedup={"all_reduce": 2.0}).build(1), host().build(1)
    for size, ratio in ((2**20, 2.0), (2**20 + 4, 1.0)):
        moved = [sum(np.sum(p.nbytes) for p in build_phases(topo, "all_reduce", "ring", np.arange(2), size))
                 for topo in (plain, cached)]
        assert moved[0] / moved[1] == pytest.approx(ratio)


@pytest.mark.parametrize("extra, message", [
    ({"collective_cache_speedup": {"all_reduce": 2.0}}, "collective_cache_speedup: has no size to apply below"),
    ({"collective_cache_KiB": 1024, "collective_cache_speedup": {"all_reduce": -1}}, "collective_cache_speedup"),
])
def test_a_bad_cache_figure_is_refused(extra, message):
    data = host_cluster(4, 300e-6, 2.0e9, 6e9, algorithms=GLOO)
    with pytest.raises(ConfigError, match=message):
        parse_cluster({**data, **extra}, "host.yaml")


def test_an_operation_whose_times_do_not_grow_keeps_link_speed_and_fits_its_fixed_cost():
    """A busy host's stalls can outweigh the bytes at every size: the fit keeps the bytes at link speed
    instead of refusing the whole calibration."""
    spec = host()
    links = fit_links(synthetic(spec, [("all_reduce", 2), ("send_recv", 2)]), GLOO, 6e9)
    flat = synthetic(spec, [("broadcast", 2)])
    for r in flat:
        r.time_s = 20e-3  # stalls as long as the largest transfer, whatever the size
    fit = fit_operation(flat, links, GLOO)
    assert fit.at_link_speed and fit.efficiency == 1.0 and fit.overhead_s > 0
    assert all(f > 0 for _, f in fit.rows)


def test_matmul_fit_recovers_peak_and_shape_efficiency():
    model = ComputeModel(peak_flops=100e9, hbm_bw_Bps=1e15, dtype_bytes=4, half_dim=32.0)
    shapes = [(32, 64, 64), (128, 128, 128), (512, 512, 512), (64, 1024, 256), (1024, 1024, 1024)]
    fit = fit_matmul([(s, model.matmul_time(*s)) for s in shapes])
    assert fit.peak_flops == pytest.approx(100e9, rel=0.05)
    assert fit.half_dim == pytest.approx(32.0, rel=0.1)


def test_compare_reads_saved_measurements(tmp_path, capsys):
    spec_file = tmp_path / "host.yaml"
    import yaml

    spec_file.write_text(yaml.safe_dump(host_cluster(4, 300e-6, 2.0e9, 6e9, algorithms=GLOO)))
    measured = synthetic(host(), [("broadcast", 2)])
    for r in measured:
        r.source, r.time_s = "measured", r.time_s * 1.1  # 10% slower than the model says
    saved = tmp_path / "measured.json"
    save_results(saved, measured)
    code = main(["compare", "broadcast", "--cluster", str(spec_file), "--measured", str(saved), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and len(out["rows"]) == len(SIZES)
    assert out["median_abs_error"] == pytest.approx(1 - 1 / 1.1, rel=1e-6)


def test_compare_of_an_unknown_target_is_one_line(capsys):
    assert main(["compare", "no-such-plan-or-op", "--cluster", "dgx-h100"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_compare_of_a_file_with_several_rank_counts_shows_them(tmp_path, capsys):
    spec_file = tmp_path / "host.yaml"
    import yaml

    spec_file.write_text(yaml.safe_dump(host_cluster(4, 300e-6, 2.0e9, 6e9, algorithms=GLOO)))
    measured = synthetic(host(), [("broadcast", 2), ("broadcast", 4)])
    for r in measured:
        r.source = "measured"
    saved = tmp_path / "measured.json"
    save_results(saved, measured)
    assert main(["compare", "broadcast", "--cluster", str(spec_file), "--measured", str(saved)]) == 0
    title, header, *_ = capsys.readouterr().out.splitlines()
    assert "broadcast on 2 and 4 ranks" in title and header.split()[0] == "ranks"
    for extra in (["--nproc", "0"], ["--sweep", "1MiB:4MiB"]):  # nothing to run: refused, 0 included
        assert main(["compare", "broadcast", "--cluster", str(spec_file), "--measured", str(saved), *extra]) == 2
        assert "only to a run (not with --measured)" in capsys.readouterr().err
    simulated = tmp_path / "simulate.json"
    simulated.write_text(json.dumps({"schema": "parsim.simulate/1", "results": []}))
    assert main(["compare", "broadcast", "--cluster", str(spec_file), "--measured", str(simulated)]) == 2
    assert "a parsim.simulate/1 document; expected collective results" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["all-reduce", "tiny-pp2"])
def test_compare_without_a_host_file_says_how_to_write_one(target, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["compare", target, "--measured", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err
    assert "no my-host.yaml here to describe this machine: write it with `parsim calibrate`" in err
    assert len(err.strip().splitlines()) == 1


def test_a_comparison_of_different_machines_is_flagged(capsys):
    """A GPU cluster against gloo on this CPU host, or a CPU host's file against NCCL: a warning each; a
    calibrated host against gloo, or a GPU cluster against NCCL: nothing."""
    cpu_host = host(cpu_cores=2)
    gpu = load_cluster("dgx-h100")
    for cluster, backend in ((gpu, "gloo"), (cpu_host, "nccl"), (cpu_host, "gloo"), (gpu, "nccl")):
        warn_other_machine(cluster, backend)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert "dgx-h100 describes GPUs, but the run measures gloo" in lines[0]
    assert "describes a CPU host, but the run measures NCCL" in lines[1]


def test_a_comparison_of_a_plan_pricing_fused_kernels_says_what_the_executor_ran(capsys):
    """tiny-gpt says what the executor runs (eager layers, torch's cross-entropy); a plan pricing Megatron-LM's
    fused kernels instead is noted, on GPUs and CPUs alike (an eager RMSNorm moves several times the bytes)."""
    from parsim.cli.common import note_executor_kernels
    from parsim.workload.plan import resolve_plan

    eager = resolve_plan("tiny-dp2")
    fused = resolve_plan("tiny-dp2", overrides={"model": {**eager.model.to_dict(), "layer_kernels": "fused",
                                                          "cross_entropy": "fused"}})
    for plan in (eager, resolve_plan("course-ddp"), fused):
        note_executor_kernels(plan)
    (line,) = capsys.readouterr().err.splitlines()
    assert "tiny-dp2 prices layer_kernels: fused and cross_entropy: fused, but the executor ran layer_kernels: " \
           "eager, cross_entropy: torch" in line


def test_a_comparison_of_unfused_attention_dropout_or_biases_says_the_executor_ran_none(capsys):
    """The executor's attention is SDPA without dropout, and its linears have no biases, on every backend."""
    from parsim.cli.common import note_executor_kernels
    from parsim.workload.plan import resolve_plan

    plan = resolve_plan("tiny-dp2")
    model = {**plan.model.to_dict(), "attention_kernel": "unfused", "dropout": 0.1, "linear_bias": True,
             "layer_kernels": "fused"}  # eager layers are modelled with flash attention only
    note_executor_kernels(resolve_plan("tiny-dp2", overrides={"model": model}))
    (line,) = capsys.readouterr().err.splitlines()
    assert "prices layer_kernels: fused, attention_kernel: unfused, dropout: 0.1 and linear_bias: True, but the " \
           "executor ran layer_kernels: eager, attention_kernel: flash, dropout: 0.0, linear_bias: False" in line


def test_comparing_a_gpu_cluster_with_a_run_here_warns_once_it_has_measured(capsys):
    assert main(["compare", "all-reduce", "--cluster", "dgx-h100", "--nproc", "2", "--size", "4KiB"]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: dgx-h100 describes GPUs") == 1


@pytest.mark.parametrize("extra, probed, memory_probe", [([], True, True), ([], True, False),
                                                         (["--no-speed-probe"], False, True)])
def test_compare_scales_a_cpu_host_to_the_speed_its_probe_ran_at(extra, probed, memory_probe, monkeypatch, tmp_path,
                                                                 capsys):
    """A calibrated CPU host's compute figures follow the host-speed probes timed during the run: the
    prediction is the simulator's at that speed, and the one at the calibration's speed is kept beside it. Its
    memory follows the memory probe; in a file calibrated before that probe, the matmul probe."""
    import executor.train
    from test_json_schema import conforms
    from parsim.sim.step import predict_step
    from parsim.workload.plan import resolve_plan

    data = host_cluster(2, 300e-6, 2.0e9, 6e9, algorithms=GLOO, peak_flops=80e9, op_forward_s=10e-6,
                        cpu_cores=2, speed_probe=(60e9, 1e-3, 20e9) if memory_probe else (60e9, 1e-3))
    path = tmp_path / "host.yaml"
    path.write_text(json.dumps(data))
    spec, plan = load_cluster(str(path)), resolve_plan("course-pp")
    asked = {}

    def run_plan(plan, nproc, steps, probe_speed=False, **kwargs):  # the simulator stands in for the executor
        asked["probe_speed"] = probe_speed
        probe = {"matmul_flops": 45e9, "eager_s": 1.25e-3, "memory_Bps": 25e9}
        return predict_step(plan, spec).trace, {"speed_probe": probe} if probe_speed else {}

    monkeypatch.setattr(executor.train, "run_plan", run_plan)
    assert main(["compare", "course-pp", "--cluster", str(path), "--backend", "gloo", "--json", *extra]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert asked["probe_speed"] is probed
    unscaled = predict_step(plan, spec).step_s
    if not probed:
        assert doc["host_speed"] is None and doc["predicted_step_s"] == pytest.approx(unscaled)
        return
    assert conforms(doc) == "compare.plan"
    memory = (20.0, 25.0, 1.25) if memory_probe else (None, 25.0, None)
    scaled = predict_step(plan, spec.at_host_speed(0.75, 0.8, memory[2])).step_s
    assert doc["host_speed"] == {"calibrated_gflops": pytest.approx(60.0), "measured_gflops": pytest.approx(45.0),
                                 "arithmetic_factor": pytest.approx(0.75),
                                 "arithmetic_probe_factor": pytest.approx(0.75), "matmul_elasticity": 1.0,
                                 "calibrated_eager_us": pytest.approx(1000),
                                 "measured_eager_us": pytest.approx(1250), "eager_factor": pytest.approx(0.8),
                                 "eager_probe_factor": pytest.approx(0.8), "eager_elasticity": 1.0,
                                 "calibrated_memory_GBps": pytest.approx(memory[0]),
                                 "measured_memory_GBps": pytest.approx(memory[1]),
                                 "memory_factor": pytest.approx(memory[2]),
                                 "memory_probe_factor": pytest.approx(memory[2]), "memory_elasticity": 1.0,
                                 "calibrated_collective_us": None, "measured_collective_us": None,
                                 "collective_factor": None,
                                 "unscaled_predicted_step_s": pytest.approx(unscaled),
                                 "unscaled_step_error": pytest.approx(0.0, abs=1e-9)}
    assert doc["predicted_step_s"] == pytest.approx(scaled) and scaled > unscaled
    if memory_probe:  # the memory's own factor, not the matmul's, priced the memory-bound work
        assert scaled != pytest.approx(predict_step(plan, spec.at_host_speed(0.75, 0.8)).step_s)
    assert main(["compare", "course-pp", "--cluster", str(path), "--backend", "gloo"]) == 0
    out, err = capsys.readouterr()
    memory_text = (", memory x1.25 (probe 25.0 vs 20.0 GB/s)" if memory_probe else
                   ", memory as the matmuls (the cluster file has no memory probe: calibrate again for one)")
    assert ("host speed around the measured steps, against calibration: matmuls x0.75 (probe 45.0 vs 60.0 "
            f"GFLOP/s), eager ops x0.80 (probe 1250 vs 1000 us per pass){memory_text}\n") in out
    assert (f"the host-speed probes ran matmuls x0.75, eager ops x0.80{', memory x1.25' if memory_probe else ''} "
            "as fast as at calibration") in err


def test_compare_follows_each_probe_as_far_as_calibrate_found_its_work_following_it(monkeypatch, tmp_path, capsys):
    """A file whose matmuls, eager work and AdamW followed their probes to the powers 0.4, 0.5 and 0.6: probes
    reading 3/4, 2/3 and 5/4 of calibration's speed scale each work by its ratio to its power; the text and the
    JSON give both, the drift note the probes' own ratios."""
    import executor.train
    from test_json_schema import conforms
    from parsim.sim.step import predict_step
    from parsim.workload.plan import resolve_plan

    data = host_cluster(2, 300e-6, 2.0e9, 6e9, algorithms=GLOO, peak_flops=80e9, op_forward_s=10e-6,
                        cpu_cores=2, speed_probe=(60e9, 1e-3, 20e9),
                        elasticity={"matmul": 0.4, "eager": 0.5, "memory": 0.6})
    path = tmp_path / "host.yaml"
    path.write_text(json.dumps(data))
    spec, plan = load_cluster(str(path)), resolve_plan("tiny-pp2")
    assert (spec.speed_probe_matmul_elasticity, spec.speed_probe_eager_elasticity,
            spec.speed_probe_memory_elasticity) == (0.4, 0.5, 0.6)

    def run_plan(plan, nproc, steps, probe_speed=False, **kwargs):
        probe = {"matmul_flops": 45e9, "eager_s": 1.5e-3, "memory_Bps": 25e9}
        return predict_step(plan, spec).trace, {"speed_probe": probe}

    monkeypatch.setattr(executor.train, "run_plan", run_plan)
    assert main(["compare", "tiny-pp2", "--cluster", str(path), "--backend", "gloo", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert conforms(doc) == "compare.plan"
    speed = doc["host_speed"]
    slow = 1 / 1.5
    assert (speed["eager_factor"], speed["eager_probe_factor"], speed["eager_elasticity"]) == pytest.approx(
        (slow ** 0.5, slow, 0.5))
    assert (speed["arithmetic_factor"], speed["arithmetic_probe_factor"], speed["matmul_elasticity"]) == \
        pytest.approx((0.75 ** 0.4, 0.75, 0.4))
    assert (speed["memory_factor"], speed["memory_probe_factor"], speed["memory_elasticity"]) == pytest.approx(
        (1.25 ** 0.6, 1.25, 0.6))
    damped = predict_step(plan, spec.at_host_speed(0.75 ** 0.4, slow ** 0.5, 1.25 ** 0.6)).step_s
    assert doc["predicted_step_s"] == pytest.approx(damped)
    assert predict_step(plan, spec).step_s < damped < predict_step(plan, spec.at_host_speed(0.75, slow, 1.25)).step_s
    assert main(["compare", "tiny-pp2", "--cluster", str(path), "--backend", "gloo"]) == 0
    out, err = capsys.readouterr()
    assert ("matmuls x0.89 (probe 45.0 vs 60.0 GFLOP/s, x0.75 to the power 0.40: as far as matmuls followed it at "
            "calibration), eager ops x0.82 (probe 1500 vs 1000 us per pass, x0.67 to the power 0.50: as far as the "
            "eager work followed it at calibration), memory x1.14 (probe 25.0 vs 20.0 GB/s, x1.25 to the power "
            "0.60: as far as AdamW followed it at calibration)") in out
    assert "the host-speed probes ran matmuls x0.75, eager ops x0.67, memory x1.25 as fast as at calibration" in err


def test_compare_scales_a_cpu_host_s_collectives_to_the_speed_its_collective_probe_ran_at(monkeypatch, tmp_path,
                                                                                          capsys):
    """The collective probe around the run at half its calibration's speed at 256 KiB and 1 MiB, 0.8 of it at
    4 MiB: the collectives (course DDP's, of 4 MiB) take what the probe took more, the compute figures follow the
    other probes; the text, the JSON and the drift note say so."""
    import executor.train
    import yaml
    from test_json_schema import conforms
    from parsim.sim.step import predict_step
    from parsim.workload.plan import resolve_plan

    calibrated = ((256, 250e-6), (1024, 400e-6), (4096, 1600e-6))
    data = host_cluster(2, 300e-6, 2.0e9, 6e9, algorithms=GLOO, peak_flops=80e9, op_forward_s=10e-6,
                        cpu_cores=2, speed_probe=(60e9, 1e-3, 20e9), collective_probe_s=calibrated)
    assert data["compute"]["collective_probe_us"] == {256: 250.0, 1024: 400.0, 4096: 1600.0}
    path = tmp_path / "host.yaml"
    path.write_text(yaml.safe_dump(data))  # keyed by KiB, whole numbers: YAML keeps them
    spec, plan = load_cluster(str(path)), resolve_plan("course-ddp", overrides={"parallel": {"dp": 2}})
    assert dict(spec.collective_probe_s) == pytest.approx(dict(calibrated))

    def run_plan(plan, nproc, steps, probe_speed=False, **kwargs):
        probe = {"matmul_flops": 60e9, "eager_s": 1e-3, "memory_Bps": 20e9}
        return predict_step(plan, spec).trace, {"speed_probe": probe,
                                                "collective_probe_s": {256: 500e-6, 1024: 800e-6, 4096: 2000e-6}}

    monkeypatch.setattr(executor.train, "run_plan", run_plan)
    argv = ["compare", "course-ddp", "--dp", "2", "--nproc", "2", "--cluster", str(path), "--backend", "gloo"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert conforms(doc) == "compare.plan"
    speed = doc["host_speed"]
    assert speed["collective_factor"] == pytest.approx({"256": 0.5, "1024": 0.5, "4096": 0.8})
    assert speed["measured_collective_us"] == pytest.approx({"256": 500.0, "1024": 800.0, "4096": 2000.0})
    measured = ((256, 500e-6), (1024, 800e-6), (4096, 2000e-6))
    scaled = predict_step(plan, spec.at_host_speed(1.0, 1.0, 1.0).at_collective_probe(measured))
    assert doc["predicted_step_s"] == pytest.approx(scaled.step_s)
    assert doc["predicted_step_s"] > speed["unscaled_predicted_step_s"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert (", collectives x0.50 / x0.50 / x0.80 at 256 KiB / 1 MiB / 4 MiB (an all-reduce on 2 ranks: "
            "500 / 800 / 2000 vs 250 / 400 / 1600 us)\n  the compute figures follow them, and each collective takes "
            "what the collective probe took more per byte (pipeline transfers") in out
    assert "the host-speed probes ran matmuls x1.00, eager ops x1.00, memory x1.00, collectives x0.50 / x0.50 / " \
           "x0.80 as fast as at calibration" in err


@pytest.mark.parametrize("flops, eager_s, noted", [(54e9, 0.9e-3, False), (66e9, 1.1e-3, False),
                                                   (45e9, 1.0e-3, True), (60e9, 0.66e-3, True)])
def test_compare_notes_a_host_whose_probes_drifted_far_from_calibration(flops, eager_s, noted):
    """Probes over 1.25 times faster or slower than at calibration (60 GFLOP/s, 1 ms a pass) get a note: the
    steps between them may have run at another speed."""
    from parsim.cli.compare_plan import HostSpeed

    note = HostSpeed(60e9, 1e-3, flops, eager_s, 0.05).drift_note()
    assert (note is not None) is noted
    if noted:
        assert note.startswith(f"parsim compare: note: the host-speed probes ran matmuls x{flops / 60e9:.2f}, "
                               f"eager ops x{1e-3 / eager_s:.2f} as fast as at calibration")


def test_compare_takes_each_measured_phase_as_its_median_over_ten_steps(monkeypatch, capsys):
    """A plan run here: 10 steps by default, and each rank's phases from the run's medians over the steps (the
    summary's ``ranks``), not from the one median step whose trace comes back; beside each median, the range
    the steps spent on the phase."""
    import executor.train
    from parsim.sim.step import predict_step
    from parsim.workload.plan import resolve_plan

    trace = predict_step(resolve_plan("course-pp"), load_cluster("dgx-h100")).trace
    asked = {}

    def run_plan(plan, nproc, steps, probe_speed=False, **kwargs):
        asked["steps"] = steps
        medians = [{"rank": r, "step_s": 0.1, "seconds": {"forward": 0.004, "idle": 0.002 * (r + 1)},
                    "ranges": {"forward": [0.0035, 0.005], "idle": [0.001, 0.009]}} for r in (0, 1)]
        return trace, {"ranks": medians}

    monkeypatch.setattr(executor.train, "run_plan", run_plan)
    assert main(["compare", "course-pp", "--cluster", "dgx-h100", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["phases"]
    assert asked["steps"] == 10
    assert {(r["rank"], r["phase"]): r["measured_s"] for r in rows if r["measured_s"]} == {
        (0, "forward"): 0.004, (0, "idle"): 0.002, (1, "forward"): 0.004, (1, "idle"): 0.004}
    assert {(r["rank"], r["phase"]): r["measured_range_s"] for r in rows if r["measured_s"]} == {
        (0, "forward"): [0.0035, 0.005], (0, "idle"): [0.001, 0.009],
        (1, "forward"): [0.0035, 0.005], (1, "idle"): [0.001, 0.009]}
    assert main(["compare", "course-pp", "--cluster", "dgx-h100"]) == 0
    table = capsys.readouterr().out
    assert "steps' range (us)" in table and "3500-5000" in table and "1000-9000" in table


def test_a_gpu_cluster_runs_no_speed_probe(monkeypatch, capsys):
    import executor.train
    from parsim.sim.step import predict_step

    asked = {}

    def run_plan(plan, nproc, steps, probe_speed=False, **kwargs):
        asked["probe_speed"] = probe_speed
        return predict_step(plan, load_cluster("dgx-h100")).trace, {}

    monkeypatch.setattr(executor.train, "run_plan", run_plan)
    assert main(["compare", "course-pp", "--cluster", "dgx-h100", "--json"]) == 0
    assert asked["probe_speed"] is False and json.loads(capsys.readouterr().out)["host_speed"] is None


def test_compare_says_when_the_measured_steps_spread(monkeypatch, capsys):
    """Steps whose slowest is over 1.25x their fastest get a one-line note on stderr; the range is printed
    beside the step time and written to the JSON either way."""
    import executor.train
    from parsim.sim.step import predict_step

    spec = load_cluster("dgx-h100")
    times = {}

    def run_plan(plan, nproc, steps, **kwargs):
        return predict_step(plan, spec).trace, {"step_times_s": times["now"]}

    monkeypatch.setattr(executor.train, "run_plan", run_plan)
    for steps, noted in (([0.010, 0.011, 0.0105], False), ([0.010, 0.014, 0.011], True)):
        times["now"] = steps
        assert main(["compare", "course-pp", "--cluster", "dgx-h100"]) == 0
        out, err = capsys.readouterr()
        assert ("measured steps spread from 10 ms to 14 ms" in err) is noted
        assert f"its steps 10 ms to {max(steps) * 1e3:g} ms" in out
        assert main(["compare", "course-pp", "--cluster", "dgx-h100", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["measured_step_range_s"] == pytest.approx([0.010, max(steps)])


def test_compare_says_when_ranks_take_turns_on_the_host_s_cores(monkeypatch, capsys, tmp_path):
    """Four ranks on a 2-core host: a note says they take turns, and why twins' phases differ between runs; none
    on a GPU cluster."""
    import yaml

    import executor.train
    from parsim.sim.step import predict_step

    (tmp_path / "host.yaml").write_text(yaml.safe_dump(cpu_host(op_forward_us=7.0, op_backward_us=6.0, cpu_cores=2)))
    monkeypatch.setattr(executor.train, "run_plan",
                        lambda plan, nproc, steps, **kwargs: (predict_step(plan, spec).trace, {}))
    for spec_file, parallel, noted in ((str(tmp_path / "host.yaml"), ["--dp", "2"], True),
                                       (str(tmp_path / "host.yaml"), ["--pp", "4"], True),  # a stage a rank
                                       ("dgx-h100", ["--dp", "2"], False)):
        spec = load_cluster(spec_file)
        assert main(["compare", "tiny-pp2", *parallel, "--nproc", "4", "--cluster", spec_file,
                     "--no-speed-probe"]) == 0
        assert ("4 ranks on each host's 2 cores take turns on them" in capsys.readouterr().err) is noted


def test_simulate_notes_pipeline_stages_that_hand_activations_over_on_one_core(capsys, tmp_path):
    """Four ranks on a 2-core host: with ``pp`` innermost, a replica's two stages share a core and the note names
    them; a stage's replicas on one core (the default order), or stages 0 and 2 of four, hand nothing over there."""
    import yaml

    host = tmp_path / "host.yaml"
    host.write_text(yaml.safe_dump(cpu_host(op_forward_us=7.0, op_backward_us=6.0, cpu_cores=2)))
    for parallel, noted in ((["--dp", "2", "--order", "pp,dp,cp,tp"], "pipeline stages 0 and 1 (ranks 0 and 2) "
                                                                      "take turns on core 0"),
                            (["--dp", "2"], None), (["--pp", "4"], None)):
        assert main(["simulate", "tiny-pp2", *parallel, "--cluster", str(host), "--json"]) == 0
        err = capsys.readouterr().err
        assert (noted in err) if noted else "take turns on core" not in err


def test_compare_sets_each_stage_s_mean_beside_its_prediction(monkeypatch, capsys, tmp_path):
    """Where a stage has several measured ranks, compare also prints each phase's mean over them, and keeps it in
    its JSON: here the simulator stands in for the executor, so every stage's mean matches."""
    import yaml

    import executor.train
    from parsim.sim.step import predict_step

    (tmp_path / "host.yaml").write_text(yaml.safe_dump(cpu_host(op_forward_us=7.0, op_backward_us=6.0, cpu_cores=2)))
    spec = load_cluster(str(tmp_path / "host.yaml"))
    monkeypatch.setattr(executor.train, "run_plan",
                        lambda plan, nproc, steps, **kwargs: (predict_step(plan, spec).trace, {}))
    argv = ["compare", "tiny-pp2", "--dp", "2", "--nproc", "4", "--cluster", str(tmp_path / "host.yaml"),
            "--no-speed-probe"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "per stage, each phase the mean over its ranks" in out and "pp 1 (2 ranks)" in out
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    backward = [row for row in doc["phases"] if row["pp"] == 1 and row["phase"] == "backward"]
    stage = next(row for row in doc["stages"] if row["pp"] == 1 and row["phase"] == "backward")
    assert len(backward) == 2 and stage["ranks"] == 2 and stage["error"] == pytest.approx(0.0)
    assert stage["measured_s"] == pytest.approx(sum(row["measured_s"] for row in backward) / 2)


def test_a_stage_s_phase_is_the_mean_over_its_ranks():
    from parsim.cli.compare_plan import stage_phases

    def row(rank, pp, phase, predicted, measured):
        return {"rank": rank, "pp": pp, "phase": phase, "predicted_s": predicted, "measured_s": measured}

    rows = [row(0, 0, "dp", 0.004, 0.009), row(2, 0, "dp", 0.006, 0.001), row(2, 0, "idle", 0.002, 0.001),
            row(1, 1, "forward", 0.010, 0.008)]
    assert stage_phases(rows) == [  # stage 1 has one measured rank: left out; rank 0's idle counts 0
        {"pp": 0, "ranks": 2, "phase": "dp", "predicted_s": pytest.approx(0.005), "measured_s": pytest.approx(0.005),
         "error": pytest.approx(0.0)},
        {"pp": 0, "ranks": 2, "phase": "idle", "predicted_s": pytest.approx(0.001),
         "measured_s": pytest.approx(0.0005), "error": pytest.approx(1.0)}]
    assert [r["pp"] for r in stage_phases(rows, min_ranks=1)] == [0, 0, 1]
    # measured over several steps: the stage's figure where one is given (its mean's median over the steps)
    kept = stage_phases(rows, measured={(0, "dp"): 0.004})
    assert kept[0]["measured_s"] == 0.004 and kept[0]["error"] == pytest.approx(0.25)
    assert kept[1]["measured_s"] == pytest.approx(0.0005)


def test_compare_takes_a_stage_s_measured_phases_from_the_run_s_steps(monkeypatch, capsys, tmp_path):
    """A run's summary gives each stage's phases over its steps (the ranks' mean in each step, then the median):
    compare sets those beside the prediction rather than the mean of each rank's median."""
    import yaml

    import executor.train
    from parsim.report.step_report import breakdown
    from parsim.sim.step import predict_step

    (tmp_path / "host.yaml").write_text(yaml.safe_dump(cpu_host(op_forward_us=7.0, op_backward_us=6.0, cpu_cores=2)))
    spec = load_cluster(str(tmp_path / "host.yaml"))

    def run_plan(plan, nproc, steps, **kwargs):
        trace = predict_step(plan, spec).trace
        rows = breakdown(trace)
        stage_0 = {phase: sum(r.seconds[phase] for r in rows if r.rank in (0, 2)) / 2 for phase in PHASES}
        summary = {"ranks": [{"rank": r.rank, "step_s": r.step_s, "seconds": r.seconds} for r in rows],
                   "stages": [{"pp": 0, "seconds": {**stage_0, "dp": 2 * stage_0["dp"]}, "ranges": {}}]}
        return trace, summary

    monkeypatch.setattr(executor.train, "run_plan", run_plan)
    argv = ["compare", "tiny-pp2", "--dp", "2", "--nproc", "4", "--cluster", str(tmp_path / "host.yaml"),
            "--no-speed-probe"]
    assert main(argv) == 0
    assert "measured, that mean's median over the steps" in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    stages = {(row["pp"], row["phase"]): row for row in json.loads(capsys.readouterr().out)["stages"]}
    assert stages[0, "dp"]["error"] == pytest.approx(-0.5) and stages[0, "backward"]["error"] == pytest.approx(0.0)
    assert stages[1, "backward"]["error"] == pytest.approx(0.0)  # no figure of its own: its ranks' mean


def test_no_speed_probe_applies_only_to_a_plan_run(capsys):
    assert main(["compare", "all-reduce", "--no-speed-probe", "--measured", "x.json"]) == 2
    assert "--no-speed-probe" in capsys.readouterr().err


CORE_NS = {"gelu": (0.5, 1.2), "norm": (0.4, 0.9), "softmax": (0.3, 0.6)}  # the faked host's, ns per element


def written_cache(path) -> tuple[float, dict]:
    spec = load_cluster(str(path))
    return spec.collective_cache_bytes, spec.collective_cache_speedup


def _fake_calibration(monkeypatch, flat: tuple[str, ...] = ()) -> None:
    """Every measurement ``parsim calibrate`` takes, faked from a known host; the collectives in ``flat``
    take 20 ms at every size (a busy host's stalls)."""
    import executor.collectives
    import executor.compute_bench
    import executor.speed_probe
    from executor.compute_bench import CACHE_SHAPE
    from parsim.lowering.lower import ADAMW_ACCESSES

    truth = ComputeModel(peak_flops=70e9, hbm_bw_Bps=1e12, dtype_bytes=4, half_dim=8.0, matmul_stream_bw_Bps=15e9,
                         matmul_write_bw_Bps=45e9)
    shapes = [(32, 64, 64), (128, 128, 128), (32, 1024, 1024), (512, 512, 512), (1024, 1024, 32), (64, 4096, 1024)]
    # stacks of eight blocks and of one: 7 and 5 us an op, and 600 and 200 us a pass beyond its ops
    dispatch = [{"name": name, "layers": layers, "forward_s": 600e-6 + layers * f * 7e-6,
                 "backward_s": 200e-6 + layers * b * 5e-6, "forward_ops": layers * f, "backward_ops": layers * b,
                 "matmuls": []} for layers in (8, 1) for name, f, b in (("mlp", 11, 29), ("chain", 8, 15))]
    # each kind's arithmetic at (forward, backward) ns per element, on top of its ops' fixed costs
    kinds = [{"kind": kind, "forward_s": 2 * 7e-6 + 2 * 65536 * fwd * 1e-9, "backward_s": 5e-6 + 3 * 65536 * bwd * 1e-9,
              "forward_ops": 2, "backward_ops": 1, "elements": 65536}
             for kind, (fwd, bwd) in CORE_NS.items()]
    elementwise = {"forward_s": 7 * 7e-6 + 2e-4, "backward_s": 12 * 5e-6 + 3e-4, "forward_ops": 7,
                   "backward_ops": 12, "forward_bytes": 2 * 7 * 65536 * 4, "backward_bytes": 3 * 7 * 65536 * 4}

    def adamw(tensors, numel, bw):
        return tensors, numel, 120e-6 + tensors * 50e-6 + tensors * numel * ADAMW_ACCESSES * 4 / bw

    optimizer = {"together": [adamw(1, 256, 20e9), adamw(64, 256, 20e9), adamw(4, 1 << 20, 20e9)],
                 "alone": [adamw(2, 1 << 21, 32e9)]}
    probes = {0: [(48e9, 820e-6, 19e9), (50e9, 800e-6, 20e9)], 1: [(52e9, 780e-6, 21e9), (50e9, 800e-6, 20e9)]}

    # a thin matmul cycling over 1-64 weights: all of each weight in the cache up to 4 of them (17 MiB touched
    # between two reads), half at 8, none beyond; read from the cache at 60 GB/s (from memory: 15)
    m, n, k = CACHE_SHAPE
    call_bytes, read_s, cached_s = (m * k + k * n + m * n) * 4, k * n * 4 / 15e9, k * n * 4 / 60e9
    hits = {1: 1.0, 2: 1.0, 4: 1.0, 8: 0.5, 16: 0.0, 32: 0.0, 64: 0.0}
    cache_hits = [(count * call_bytes, truth.matmul_time(m, n, k) - hit * (read_s - cached_s))
                  for count, hit in hits.items()]

    def every_rank(nproc):
        return [{"matmuls": [(s, truth.matmul_time(*s)) for s in shapes], "cache_hits": cache_hits,
                 "dispatch": dispatch,
                 "elementwise": elementwise, "kernel_kinds": kinds, "optimizer": optimizer, "speed_probes": probes[r],
                 # the work beside each probe reading, following it to the power 0.3 (matmuls), 0.5 (eager
                 # work) and 0.7 (AdamW)
                 "probe_pairs": {probe: [(p, 0.05 * (p / 800e-6) ** power) for p in (600e-6, 700e-6, 900e-6, 1e-3)]
                                 for probe, power in (("matmul", 0.3), ("eager", 0.5), ("memory", 0.7))},
                 "tp_calls": {"forward_s": (100e-6, 140e-6)[r % 2], "backward_s": (60e-6, 80e-6)[r % 2]},
                 # zero_grad: 5 us a step, 0.5 us a tensor, freeing at 160 GB/s
                 "zero_grad": [(t, n, 5e-6 + t * 0.5e-6 + t * n * 4 / 160e9)
                               for t, n in ((1, 1024), (16, 1024), (4, 1 << 20), (16, 1 << 18))],
                 # FSDP2: 400 us a unit in a forward, 650 in a backward, 300 us a parameter (4 a unit) in AdamW;
                 # 150 and 90 us a unit in passes that move nothing
                 "fsdp": [(n, 4 * n, (1e-4 * n, 2e-4 * n, 5e-4 * n), (1e-4 * n + 4e-4 * n + 3e-4,
                                                                      2e-4 * n + 6.5e-4 * n + 5e-4,
                                                                      5e-4 * n + 1.2e-3 * n + 1e-4),
                           (1e-4 * n + 1.5e-4 * n + 2e-4, 2e-4 * n + 0.9e-4 * n + 1e-4)) for n in (2, 8)],
                 # AdamW steps started together: 10 ms on even ranks, 1 ms more or less on odd ones
                 "jitter": [0.010] * 9 if r % 2 == 0 else [0.011, 0.009] * 4 + [0.011],
                 # a generic step's at 4 and 16 MiB of gradients, which the loop's time before actions takes
                 "step_gaps": [(4 << 20, (20e-6, 40e-6)[r % 2]), (16 << 20, (110e-6, 130e-6)[r % 2])],
                 # the pipeline loop with stages of 128 KiB and 4.5 MiB: its figures at each (its gap: the latter)
                 "pipeline": [(128 << 10, {"rendezvous": 100e-6, "latency": 30e-6, "action": 20e-6, "issue": 50e-6}),
                              (4608 << 10, {"rendezvous": 300e-6, "latency": 60e-6,
                                            "action": (70e-6, 90e-6)[r % 2], "issue": 150e-6})]}
                for r in range(nproc)]

    # a core's cache of 1 MiB, in which all-reduces move their bytes twice as fast
    spec = host(cache_bytes=2**20, cache_speedup={"all_reduce": 2.0, "send_recv": 1.0})
    monkeypatch.setattr("parsim.cli.calibrate_cmd.core_cache_bytes", lambda: 2**20)
    monkeypatch.setattr(executor.compute_bench, "measure_on_every_rank", every_rank)
    monkeypatch.setattr(executor.compute_bench, "measure_on_shared_cores", lambda: [
        {"pipeline": {"rendezvous": 2.5e-3 + r * 1e-4, "latency": 200e-6, "action": 400e-6, "issue": 900e-6},
         "step_gaps": 500e-6,
         # the late rank of each pair on one core (ranks 2 and 3): 0.5 ms plus the bytes at 1.25 GB/s
         "one_core_allreduce": [(n, 0.5e-3 + n / 1.25e9) for n in (64 << 10, 1 << 20, 4 << 20)] if r >= 2 else None,
         # two ranks on each core, then one per core (ranks 0 and 1) in turn: 2.2x and 2x as long shared
         "speed_probe": (20e9, 2000e-6), "speed_probe_alone": (44e9, 1000e-6) if r < 2 else None}
        for r in range(4)])
    # the generic pipeline in three rounds: 40, 50 and 30 ms a step with a core per rank, 80, 120 and 90 ms as two
    # replicas on 2 cores (ratios 2.0, 2.4 and 3.0: their median 2.4, where the medians' ratio is 90 / 40 = 2.25)
    monkeypatch.setattr(executor.compute_bench, "measure_generic_pipeline",
                        lambda alone, shared: [(40e-3, 80e-3), (50e-3, 120e-3), (30e-3, 90e-3)])
    monkeypatch.setattr(executor.collectives, "measure_reduce_bandwidth", lambda sizes: [(s, s / 6e9) for s in sizes])

    def collectives(op, sizes, n, backend, timeout_s=None, target_time_s=None):
        results = synthetic(spec, [(op, n)])
        if op in flat:
            for r in results:
                r.time_s = 20e-3
        return results

    monkeypatch.setattr(executor.collectives, "measure_collectives", collectives)
    monkeypatch.setattr(executor.collectives, "measure_in_step", lambda ops, n: [])
    # the collective probe: 250, 400 and 1600 us at 256 KiB, 1 MiB and 4 MiB, each reading
    monkeypatch.setattr(executor.speed_probe, "measure_collective_probe",
                        lambda readings: [(250e-6, 400e-6, 1600e-6)] * readings)


def test_the_collective_probe_written_is_the_all_reduce_sweep_s_at_its_sizes(monkeypatch, tmp_path, capsys):
    """The probe is timed once a round (here one round of three in a slow spell, 2x): the file, the JSON and the
    text hold the all-reduce the fits were made of at the probe's sizes (the speed they describe); a size the
    sweep did not measure takes the probe's median over the rounds."""
    import executor.speed_probe
    from test_json_schema import conforms

    from parsim.cli.calibrate_cmd import fits_probe
    from parsim.report.results import CollectiveResult

    _fake_calibration(monkeypatch)
    rounds = iter([1.0, 2.0, 1.0])

    def probe(readings):
        slower = next(rounds)
        return [(250e-6 * slower, 400e-6 * slower, 1600e-6 * slower)] * readings

    monkeypatch.setattr(executor.speed_probe, "measure_collective_probe", probe)
    out = tmp_path / "host.yaml"
    assert main(["calibrate", "--out", str(out), "--backend", "gloo", "--ops", "all-reduce", "--json"]) == 0
    assert next(rounds, None) is None  # once a round
    doc = json.loads(capsys.readouterr().out)
    assert conforms(doc) == "calibrate"
    assert [(doc[f"speed_probe_{probe}_elasticity"], doc[f"{probe}_probe_readings"])
            for probe in ("matmul", "eager", "memory")] == [(pytest.approx(power), 16)  # 2 rounds
                                                           for power in (0.3, 0.5, 0.7)]
    swept = {r["size_bytes"] // 1024: r["measured_s"] for r in doc["rows"] if r["op"] == "all_reduce"}
    assert doc["collective_probe_us"] == pytest.approx({str(kib): swept[kib] * 1e6 for kib in (256, 1024, 4096)})
    assert dict(load_cluster(str(out)).collective_probe_s) == pytest.approx({kib: swept[kib]
                                                                             for kib in (256, 1024, 4096)})
    monkeypatch.setattr(executor.speed_probe, "measure_collective_probe",
                        lambda readings: [(250e-6, 400e-6, 1600e-6)] * readings)
    assert main(["calibrate", "--out", str(out), "--backend", "gloo", "--ops", "all-reduce"]) == 0
    assert (f"collective probe  {swept[256] * 1e6:.0f} us at 256 KiB, {swept[1024] * 1e6:.0f} at 1 MiB, "
            f"{swept[4096] * 1e6:.0f} at 4 MiB (an all-reduce on 2 ranks: the sweep's") in capsys.readouterr().out
    sweep = [CollectiveResult("all_reduce", 2, 1 << 20, 0.5e-3, "ring", "measured", "gloo"),
             CollectiveResult("all_reduce", 4, 4 << 20, 9e-3, "ring", "measured", "gloo")]  # 4 ranks: not the probe's
    assert fits_probe(sweep, ((256, 250e-6), (1024, 400e-6), (4096, 1600e-6))) == \
        ((256, 250e-6), (1024, 0.5e-3), (4096, 1600e-6))


def test_compare_of_a_collective_follows_the_collective_probe_around_its_sweep(monkeypatch, tmp_path, capsys):
    """On a calibrated CPU host the probe is timed before and after the sweep (here twice as slow as at
    calibration): a 1 MiB all-reduce's prediction takes what the probe took more at 1 MiB (its bus bytes on 2
    ranks), 400 us; the text and the JSON give both probes."""
    import executor.collectives
    import executor.speed_probe
    import yaml
    from test_json_schema import conforms

    from parsim.report.results import CollectiveResult

    data = host_cluster(2, 300e-6, 2.0e9, 6e9, algorithms=GLOO, cpu_cores=2,
                        collective_probe_s=((256, 250e-6), (1024, 400e-6), (4096, 1600e-6)))
    path = tmp_path / "host.yaml"
    path.write_text(yaml.safe_dump(data))
    spec, probed = load_cluster(str(path)), []
    monkeypatch.setattr(executor.collectives, "measure_collectives", lambda op, sizes, n, backend, **kwargs: [
        CollectiveResult(op, n, size, 2e-3, "ring", "measured", "gloo") for size in sizes])

    def probe(readings):
        probed.append(readings)
        return [(500e-6, 800e-6, 3200e-6)] * readings

    monkeypatch.setattr(executor.speed_probe, "measure_collective_probe", probe)
    argv = ["compare", "all-reduce", "--cluster", str(path), "--nproc", "2", "--size", "1MiB", "--backend", "gloo"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert conforms(doc) == "compare.collective" and probed == [1, 1]  # before and after the sweep
    assert doc["collective_probe"]["measured_us"] == pytest.approx({"256": 500.0, "1024": 800.0, "4096": 3200.0})
    alone = predict(spec.build(1), "all_reduce", 1 << 20, np.arange(2)).time_s
    assert doc["rows"][0]["predicted_s"] == pytest.approx(alone + 400e-6)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert ("the collective probe around the sweep took 500 / 800 / 3200 against 250 / 400 / 1600 us at "
            "calibration") in out
    # predicted before measured, as compare of a plan reads; busbw = 1 MiB x 2(n-1)/n / time, in GB/s
    header, _, row = out.splitlines()[1:4]
    assert header.split() == ["size", "(MiB)", "predicted", "(ms)", "measured", "(ms)", "busbw", "pred", "(GB/s)",
                              "busbw", "meas", "(GB/s)", "error"]
    predicted = alone + 400e-6
    assert row.split() == ["1", f"{predicted * 1e3:.4g}", "2", f"{2**20 / predicted / 1e9:.4g}",
                           f"{2**20 / 2e-3 / 1e9:.4g}", f"{predicted / 2e-3 - 1:+.1%}"]


def test_calls_between_bursts_of_compute_are_measured_every_round_and_the_median_round_kept(monkeypatch, tmp_path):
    """A 1 MiB all-reduce between bursts of compute, measured after each of the 3 rounds of collectives: 30 ms (a
    stall caught), then 10 and 12 ms, each against 1 ms hot. The overhead written is the 12 ms round's, as when
    every round says 12."""
    import executor.collectives
    import yaml

    from parsim.report.results import CollectiveResult

    _fake_calibration(monkeypatch)

    def overhead_us(times_s: list[float]) -> float:
        rounds = iter(times_s)

        def in_step(ops, n):
            return [CollectiveResult("all_reduce", n, 1 << 20, next(rounds), "ring", "measured", "gloo",
                                     extra={"back_to_back_s": 1e-3})]

        monkeypatch.setattr(executor.collectives, "measure_in_step", in_step)
        out = tmp_path / "host.yaml"
        assert main(["calibrate", "--out", str(out), "--backend", "gloo", "--ops", "all-reduce"]) == 0
        assert next(rounds, None) is None  # one measurement a round
        return yaml.safe_load(out.read_text())["collective_step_overhead_us"]["all_reduce"][1024]

    median = overhead_us([12e-3] * 3)
    assert median == pytest.approx(11e3) and overhead_us([30e-3, 10e-3, 12e-3]) == pytest.approx(median)


def test_calls_between_bursts_of_compute_are_written_and_printed_size_by_size(monkeypatch, tmp_path, capsys):
    """Each size measured between bursts of compute keeps its own extra cost: in the file by KiB, and on the
    operation's line, size by size."""
    import executor.collectives
    import yaml

    from parsim.report.results import CollectiveResult

    _fake_calibration(monkeypatch)
    monkeypatch.setattr(executor.collectives, "measure_in_step", lambda ops, n: [
        CollectiveResult("all_reduce", n, size, 10e-3, "ring", "measured", "gloo",
                         extra={"back_to_back_s": hot}) for size, hot in ((1 << 18, 2e-3), (1 << 20, 3e-3))])
    out = tmp_path / "host.yaml"
    assert main(["calibrate", "--out", str(out), "--backend", "gloo", "--ops", "all-reduce"]) == 0
    written = yaml.safe_load(out.read_text())["collective_step_overhead_us"]["all_reduce"]
    assert written == {256: pytest.approx(8e3), 1024: pytest.approx(7e3)}
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("all-reduce ") and "per call" in ln)
    assert f"+{written[256]:.0f} us at 256 KiB, +{written[1024]:.0f} at 1 MiB between compute" in line


def test_without_a_generic_step_the_loop_s_gap_is_the_pipeline_loop_s_with_its_largest_stages(monkeypatch, tmp_path):
    """No generic data-parallel step timed: every rank's time before an action is the pipeline loop's with its
    widest stages, the median over ranks (70 and 90 us in the faked loop)."""
    import executor.compute_bench

    _fake_calibration(monkeypatch)
    every_rank = executor.compute_bench.measure_on_every_rank
    monkeypatch.setattr(executor.compute_bench, "measure_on_every_rank",
                        lambda nproc: [{**row, "step_gaps": None} for row in every_rank(nproc)])
    out = tmp_path / "host.yaml"
    assert main(["calibrate", "--out", str(out), "--backend", "gloo", "--ops", "all-reduce"]) == 0
    assert load_cluster(str(out)).action_overhead == ((0, pytest.approx(80e-6)),)


def test_calibrate_writes_and_prints_every_host_figure_of_faked_measurements(monkeypatch, tmp_path, capsys):
    """Every measurement faked from a known host: the file, the text and the JSON carry the probes' medians
    over every rank and round (the matmul's FLOP/s, the eager pass's time), which compare scales by, the
    loop's time between actions, the pipeline transfer's costs (alone and with two ranks per core) and the
    memory speeds (every rank streaming, one alone)."""
    from test_json_schema import conforms

    _fake_calibration(monkeypatch)
    out = tmp_path / "host.yaml"
    assert main(["calibrate", "--out", str(out), "--backend", "gloo", "--ops", "all-reduce,send-recv"]) == 0
    text = capsys.readouterr().out
    assert "host speed        50.0 GFLOP/s, 800 us per eager pass, 20.0 GB/s memory" in text
    assert ("probes followed   matmul 0.30, eager 0.50, memory 0.70 (how far a few matmuls, the eager layers' "
            "passes and AdamW over memory, each timed right after a reading, followed it: log-log slopes over 16 "
            "readings; 1: in step, 0: not at all): `parsim compare` scales each work by its probe's ratio to that "
            "power") in text
    assert "of link speed, 2.00x as fast up to 1 MiB (a core's L2)" in text
    assert written_cache(out) == (2**20, pytest.approx({"all_reduce": 2.0, "send_recv": 1.0}, rel=0.02))
    assert ("between actions   30/120 us at 4/16 MiB of gradients a rank before each "
            "pass, sync call or optimizer step (a generic data-parallel step's loop; it runs colder the more memory "
            "the step streams), 50/150 us at 0.125/4.5 MiB of gradients a rank more per send issued") in text
    written = load_cluster(str(out))
    assert (written.speed_probe_flops, written.speed_probe_eager_s, written.speed_probe_memory_Bps) == \
        pytest.approx((50e9, 800e-6, 20e9))
    assert (written.speed_probe_matmul_elasticity, written.speed_probe_eager_elasticity,
            written.speed_probe_memory_elasticity) == pytest.approx((0.3, 0.5, 0.7))
    # ranks 1 ms apart in every 10 ms step: sigma 1 ms / (2 / sqrt(pi))
    assert written.rank_jitter == pytest.approx(0.001 / 1.1284 / 0.010, rel=1e-3)
    assert "rank jitter       8.9% of the same work's time" in text
    assert (written.matmul_stream_bw_Bps, written.matmul_write_bw_Bps) == pytest.approx((15e9, 45e9), rel=0.1)
    assert (f"weights stream in at {written.matmul_stream_bw_Bps / 1e9:.1f} GB/s and outputs out at "
            f"{written.matmul_write_bw_Bps / 1e9:.1f} GB/s") in text
    # the weights' cache: the saving measured at the nearest reuse, off the read at the fitted stream speed
    assert written.matmul_cached_stream_bw_Bps == pytest.approx(60e9, rel=0.15)
    call_kib = 4 * (32 * 1024 + 1024 * 1024 + 32 * 1024) / 1024
    assert written.matmul_cache_hits == tuple((round(count * call_kib), pytest.approx(hit))
                                              for count, hit in ((1, 1), (2, 1), (4, 1), (8, 0.5), (16, 0), (32, 0),
                                                                 (64, 0)))
    assert (f"matmul cache      weights read again at {written.matmul_cached_stream_bw_Bps / 1e9:.1f} GB/s from a "
            "core's cache, the share it holds by the bytes touched since: 4.25 MiB 100%, 8.5 MiB 100%, 17 MiB 100%, "
            "34 MiB 50%, 68 MiB 0%, 136 MiB 0%, 272 MiB 0%") in text
    # the fit against the matmul probe at the probe's own shape (64 x 1024 x 1024 at 50 GFLOP/s: 2.68 ms a call)
    fitted = ComputeModel.for_cluster(written, "fp32", 4, 1, 0).matmul_time(64, 1024, 1024)
    assert (f"matmul check      the fit puts the matmul probe's 64x1024x1024 at {fitted * 1e3:.2f} ms a call, the "
            f"probe read 2.68 ms (x{fitted / 2.68435456e-3:.2f}; ") in text
    # the medians over ranks at each size: a rank's gap read off them by its gradients
    assert written.action_overhead == ((4096, pytest.approx(30e-6)), (16384, pytest.approx(120e-6)))
    assert written.p2p_issue == ((128, pytest.approx(50e-6)), (4608, pytest.approx(150e-6)))
    assert written.p2p_rendezvous == ((128, pytest.approx(100e-6)), (4608, pytest.approx(300e-6)))
    assert written.p2p_latency == ((128, pytest.approx(30e-6)), (4608, pytest.approx(60e-6)))
    assert ("p2p latency       30/60 us at 0.125/4.5 MiB of gradients a rank per pipeline transfer whose receiver "
            "waits") in text
    assert ("p2p rendezvous    100/300 us at 0.125/4.5 MiB of gradients a rank per pipeline transfer received "
            "late") in text
    assert "2 ranks per core  200 us latency and 2650 us rendezvous per pipeline transfer, 500 us between actions, " \
           "900 us per send (runs with more ranks than cores); a matmul 2.20x and an eager pass 2.00x as long as " \
           "with a core each" in text
    comm = written.shared_cores.comm_stretch
    assert written.shared_cores == SharedCoreCosts(pytest.approx(2.65e-3), pytest.approx(200e-6),
                                                   pytest.approx(500e-6), pytest.approx(900e-6), pytest.approx(2.2),
                                                   pytest.approx(2.0), comm_stretch=comm,
                                                   one_core_collective_latency_s=pytest.approx(0.5e-3),
                                                   one_core_collective_bw_Bps=pytest.approx(1.25e9))
    assert "1-core collective 500 us + bus bytes at 1.25 GB/s between ranks on one core" in text
    generic = ("40.0 ms a step with a core per rank, 90.0 ms as two replicas on 2 cores (ratios 2.00-3.00 over 3 "
               "rounds, median 2.40)")
    assert f"communicating     compute on a shared core {comm:.2f}x as long again where its ranks communicate (a " \
           f"generic 2-stage pipeline: {generic}; the factor" in text
    assert f"# The generic pipeline (comm_stretch): {generic}.\n" in out.read_text()
    unstretched = replace(written, shared_cores=replace(written.shared_cores, comm_stretch=None))
    assert comm == pytest.approx(fit_comm_stretch(unstretched, 2.4), abs=2e-3)  # the rounds' median ratio
    assert "memory            20.00 GB/s per rank with every rank streaming (40.0 GB/s in all), 32.00 GB/s for a " \
           "rank alone, 120 us per AdamW step and 50 us per tensor" in text
    assert (written.optimizer_step_s, written.optimizer_tensor_s) == pytest.approx((120e-6, 50e-6))
    assert "core arithmetic   gelu 0.50 / 1.20, norm 0.40 / 0.90, softmax 0.30 / 0.60 ns per element" in text
    for kind, figures in CORE_NS.items():
        assert getattr(written.core_arithmetic, kind) == pytest.approx(tuple(x * 1e-9 for x in figures))
    assert (written.gpu.hbm_bw_Bps, written.memory_alone_bw_Bps, written.memory_host_bw_Bps) == pytest.approx(
        (20e9, 32e9, 40e9))
    assert "per-op overhead   7.0 us forward, 5.0 us backward, and 600 / 200 us per forward / backward pass (eager " \
           "decoder layers in stacks of many and of one, every rank at once" in text
    assert (written.op_forward_s, written.op_backward_s, *written.pass_s) == pytest.approx((7e-6, 5e-6, 600e-6,
                                                                                            200e-6))
    # the elementwise chain's counted bytes, 5 x 7 x 64 Ki x 4, over the 0.5 ms beyond its ops' fixed costs
    assert "elementwise       18.35 GB/s (products, sums, a rotation: bytes-bound kernels" in text
    assert "tensor-parallel   120 us forward, 70 us backward per collective call beyond the collective" in text
    assert written.tp_call_s == pytest.approx((120e-6, 70e-6))  # the medians over ranks
    assert "zero_grad         5 us per step and 0.5 us per tensor, freeing gradients at 160 GB/s" in text
    assert (written.zero_grad_step_s, written.zero_grad_tensor_s, written.zero_grad_free_Bps) == pytest.approx(
        (5e-6, 0.5e-6, 160e9))
    assert "fsdp2             400 us per unit gathered and resharded, 250 us per unit reduced, 300 us per " \
           "DTensor parameter in AdamW" in text
    assert (written.fsdp_unshard_s, written.fsdp_reduce_s, written.fsdp_optimizer_tensor_s) == pytest.approx(
        (400e-6, 250e-6, 300e-6))
    assert "150 us forward, 90 us backward per unit in a pass that gathers and reduces nothing" in text
    assert written.fsdp_pass_s == pytest.approx((150e-6, 90e-6))
    assert main(["calibrate", "--out", str(out), "--backend", "gloo", "--ops", "all-reduce,send-recv",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert conforms(doc) == "calibrate"
    assert doc["collective_cache_KiB"] == 1024
    assert doc["collective_cache_speedup"] == pytest.approx({"all_reduce": 2.0, "send_recv": 1.0}, rel=0.02)
    assert (doc["speed_probe_gflops"], doc["speed_probe_eager_us"], doc["speed_probe_memory_GBps"]) == \
        pytest.approx((50.0, 800.0, 20.0))
    assert (doc["matmul_stream_bw_GBps"], doc["matmul_write_bw_GBps"]) == pytest.approx((15.0, 45.0), rel=0.1)
    assert doc["matmul_cached_stream_bw_GBps"] == pytest.approx(60.0, rel=0.15)
    assert doc["matmul_cache_hits"]["34816"] == pytest.approx(0.5)
    assert doc["matmul_probe_shape_ms"] == {"shape": [64, 1024, 1024], "fitted": pytest.approx(fitted * 1e3),
                                            "probe": pytest.approx(2.68435456)}
    assert doc["action_overhead_us"] == pytest.approx({"4096": 30.0, "16384": 120.0})
    assert doc["p2p_issue_us"] == pytest.approx({"128": 50.0, "4608": 150.0})
    assert doc["p2p_rendezvous_us"] == pytest.approx({"128": 100.0, "4608": 300.0})
    assert doc["p2p_latency_us"] == pytest.approx({"128": 30.0, "4608": 60.0})
    assert doc["shared_cores"] == pytest.approx({"p2p_rendezvous_us": 2650.0, "p2p_latency_us": 200.0,
                                                 "action_overhead_us": 500.0, "p2p_issue_us": 900.0,
                                                 "matmul_stretch": 2.2, "eager_stretch": 2.0, "comm_stretch": comm,
                                                 "one_core_collective_latency_us": 500.0,
                                                 "one_core_collective_GBps": 1.25})
    assert doc["generic_pipeline_step_ms"] == {"core_each": pytest.approx(40.0), "two_per_core": pytest.approx(90.0),
                                               "rounds": [pytest.approx(r) for r in ([40, 80], [50, 120], [30, 90])],
                                               "ratio": pytest.approx(2.4)}
    assert (doc["memory_alone_bw_GBps"], doc["memory_host_bw_GBps"]) == pytest.approx((32.0, 40.0))
    assert (doc["optimizer_step_us"], doc["optimizer_tensor_us"]) == pytest.approx((120.0, 50.0))
    assert doc["core_ns_per_element"] == {kind: {"forward": pytest.approx(fwd), "backward": pytest.approx(bwd)}
                                          for kind, (fwd, bwd) in CORE_NS.items()}
    assert doc["tp_collective_call_us"] == pytest.approx({"forward": 120.0, "backward": 70.0})
    assert (doc["zero_grad_step_us"], doc["zero_grad_tensor_us"], doc["zero_grad_free_GBps"]) == pytest.approx(
        (5.0, 0.5, 160.0))
    assert (doc["fsdp_unshard_us"], doc["fsdp_reduce_us"], doc["fsdp_optimizer_tensor_us"]) == pytest.approx(
        (400.0, 250.0, 300.0))
    assert doc["fsdp_pass_us"] == pytest.approx({"forward": 150.0, "backward": 90.0})
    assert doc["pass_us"] == pytest.approx({"forward": 600.0, "backward": 200.0})


def test_shared_cores_stretch_against_the_compute_benchmarks_probes_without_one_per_core_probes():
    """A shared-core run without its own one-per-core probes: the stretches are against the probes the compute
    benchmarks took (here 50 GFLOP/s and 800 us a pass)."""
    from parsim.cli.calibrate_cmd import _shared_cores

    rows = [{"pipeline": {"rendezvous": 1e-3, "latency": 2e-4, "action": 1e-4, "issue": 5e-4}, "step_gaps": 2e-4,
             "speed_probe": (20e9, 2000e-6)} for _ in range(4)]
    costs = _shared_cores(rows, 50e9, 800e-6)
    assert (costs.matmul_stretch, costs.eager_stretch) == pytest.approx((2.5, 2.5))


def test_calibrate_notes_in_one_line_an_operation_whose_times_do_not_grow(monkeypatch, tmp_path, capsys):
    _fake_calibration(monkeypatch, flat=("broadcast",))
    out = tmp_path / "host.yaml"
    assert main(["calibrate", "--out", str(out), "--backend", "gloo", "--ops", "all-reduce,send-recv,broadcast"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "did not grow" in line]
    assert notes == ["broadcast: its times did not grow with size (stalls on a busy host?); its bytes are kept at "
                     "link speed and only its fixed cost is fitted"]
    assert load_cluster(str(out)).collective_efficiency["broadcast"] == 1.0


def test_calibrate_fits_each_collective_size_on_its_median_round(monkeypatch, tmp_path):
    """Every operation is measured once in each of three rounds; a round slowed by a busy minute (here the
    first, 1.6x) leaves the fit as the other two give it."""
    import executor.collectives
    from parsim.cli.calibrate_cmd import COLLECTIVE_ROUNDS

    _fake_calibration(monkeypatch)
    spec, calls = host(), []

    def collectives(op, sizes, n, backend, timeout_s=None, target_time_s=None):
        calls.append(op)
        results = synthetic(spec, [(op, n)])
        if calls.count(op) == 1:
            for r in results:
                r.time_s *= 1.6
        return results

    monkeypatch.setattr(executor.collectives, "measure_collectives", collectives)
    out = tmp_path / "host.yaml"
    assert main(["calibrate", "--out", str(out), "--backend", "gloo", "--ops", "all-reduce,send-recv"]) == 0
    assert COLLECTIVE_ROUNDS == 3 and calls == ["all_reduce", "send_recv"] * 3
    written = load_cluster(str(out))
    assert (written.intra.bw_Bps, written.intra.latency_s) == pytest.approx((spec.intra.bw_Bps, spec.intra.latency_s),
                                                                          rel=0.05)


def test_the_median_round_of_each_size_is_kept_in_the_first_round_s_order():
    from parsim.cli.calibrate_cmd import median_rounds
    from parsim.report.results import CollectiveResult

    def result(size, seconds):
        return CollectiveResult("all_reduce", 2, size, seconds, "ring", "measured", "gloo")

    rounds = [[result(1, 3.0), result(2, 9.0)], [result(1, 1.0), result(2, 5.0)], [result(1, 2.0), result(2, 7.0)]]
    assert [(r.size_bytes, r.time_s) for r in median_rounds(rounds)] == [(1, 2.0), (2, 7.0)]
    assert [r.time_s for r in median_rounds(rounds[:2])] == [1.0, 5.0]  # of two, the faster


def test_the_one_core_collective_fit_needs_times_that_grow_with_size():
    from parsim.calibrate.host import fit_one_core_collective

    rows = [[(1 << 16, 0.6e-3), (1 << 22, 3.6e-3)], [(1 << 16, 0.4e-3), (1 << 22, 3.4e-3)]]  # two late ranks
    latency, bw = fit_one_core_collective(rows)
    assert latency + (1 << 16) / bw == pytest.approx(0.5e-3) and latency + (1 << 22) / bw == pytest.approx(3.5e-3)
    assert fit_one_core_collective([[(1 << 16, 1e-3), (1 << 22, 1e-3)]]) is None  # flat: no speed to fit
    assert fit_one_core_collective([[(1 << 16, 1e-3)]]) is None and fit_one_core_collective([]) is None


def test_calibrate_says_which_probe_s_power_it_could_not_fit():
    from parsim.cli.calibrate_cmd import _elasticity_text

    text = _elasticity_text({"matmul": 0.2, "eager": None, "memory": 0.0},
                            {"matmul": [(1.0, 1.0)] * 14, "eager": [(1.0, 1.0)] * 3, "memory": [(1.0, 1.0)] * 14})
    assert text.startswith("matmul 0.20, eager all the way (too few readings or too little spread to fit), "
                           "memory 0.00 (")
    assert "log-log slopes over 3 / 14 readings" in text


def test_a_matmul_fit_off_the_probe_at_the_probe_s_own_shape_draws_a_note(monkeypatch, tmp_path, capsys):
    """The faked host's matmuls put the probe's 64 x 1024 x 1024 at 2.48 ms a call, its probe read 2.68 ms
    (50 GFLOP/s): 7.5% apart, a note once the tolerance is 5%, none at calibrate's own 10%."""
    import parsim.cli.calibrate_cmd as calibrate_cmd

    _fake_calibration(monkeypatch)
    out = tmp_path / "host.yaml"
    assert main(["calibrate", "--out", str(out), "--backend", "gloo", "--ops", "all-reduce"]) == 0
    assert "matmul fit puts" not in capsys.readouterr().err
    monkeypatch.setattr(calibrate_cmd, "PROBE_SHAPE_TOLERANCE", 0.05)
    assert main(["calibrate", "--out", str(out), "--backend", "gloo", "--ops", "all-reduce"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "matmul fit puts" in line]
    assert len(notes) == 1 and "the probe's 64x1024x1024 at 2.4" in notes[0] and "the probe read 2.68 ms" in notes[0]
    assert "priced -7% off" in notes[0] or "priced -8% off" in notes[0]


def test_a_measured_backward_holding_its_recomputation_is_set_beside_the_predicted_backward_and_recompute():
    """torch.utils.checkpoint reruns a layer's forward inside its backward, where the executor's span holds it:
    compare sets the predicted backward plus recompute beside that backward, and shows no recompute row whose
    measurement would read 0 (the backward's error had read -77% for it)."""
    from types import SimpleNamespace

    from parsim.cli.compare_plan import compare_phases
    from parsim.report.step_report import RankBreakdown
    from parsim.workload.plan import resolve_plan

    plan = resolve_plan("tiny-pp2")
    predicted = SimpleNamespace(ranks=[RankBreakdown(r, 0.03, {"forward": 0.004, "backward": 0.008,
                                                                "recompute": 0.004}) for r in (0, 1)], end_wait_s=0.0)
    measured = [RankBreakdown(r, 0.03, {"forward": 0.004, "backward": 0.012}) for r in (0, 1)]
    rows = {(row["rank"], row["phase"]): row for row in compare_phases(plan, predicted, measured)}
    assert not any(phase == "recompute" for _, phase in rows)
    backward = rows[0, "backward"]
    assert backward["predicted_s"] == pytest.approx(0.012) and backward["error"] == pytest.approx(0)
    timed = [RankBreakdown(r, 0.03, {"forward": 0.004, "backward": 0.008, "recompute": 0.004}) for r in (0, 1)]
    rows = {(row["rank"], row["phase"]): row for row in compare_phases(plan, predicted, timed)}
    assert rows[0, "recompute"]["predicted_s"] == pytest.approx(0.004) and rows[0, "backward"]["predicted_s"] == 0.008
