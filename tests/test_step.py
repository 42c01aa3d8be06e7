"""Step simulation: pipeline bubbles from the closed forms, overlap, memory, and the CLI."""

from __future__ import annotations

import json

import pytest
from ideal_cluster import ideal_spec

from parsim.cli.main import main
from parsim.hardware.cluster import load_cluster
from parsim.sim.step import predict_step
from parsim.workload.model import load_model
from parsim.workload.plan import Plan

# Communication made free: enormous bandwidth, no latency, so only compute and the schedule remain.
FREE_COMM = {"intra_node.bw_GBps_per_direction": 1e9, "intra_node.latency_us": 0.0,
             "scale_out.nic_bw_Gbps": 8e9, "scale_out.latency_us": 0.0, "scale_out.spine_hop_latency_us": 0.0}


def mlp_plan(**kw) -> Plan:
    model = load_model({"kind": "mlp", "name": "mlp", "num_layers": 8, "width": 512, "batch_size": 64})
    return Plan(model=model, **kw)


def durations(prediction, kind):
    return {round(e.dur_s, 15) for e in prediction.trace.events if e.name.startswith(kind + " ")}


def passes(prediction) -> tuple[float, float, float]:
    """One stage's forward and backward, and how much shorter the first stage's backward is: the MLP's
    first layer computes no gradient for its data input. Every other stage's passes are alike."""
    (t_f,) = durations(prediction, "F")
    first = durations(prediction, "B stage=0")
    (t_b,) = durations(prediction, "B") - first
    return t_f, t_b, t_b - first.pop()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16)])
def test_pipeline_step_matches_the_bubble_closed_form(schedule, p, m):
    """(m + p - 1) slots of one forward and one backward; the first stage's shorter backward shortens only its
    last one, which ends the step (the earlier ones wait for the next stage)."""
    r = predict_step(mlp_plan(pp=p, num_microbatches=m, schedule=schedule), ideal_spec(**FREE_COMM))
    t_f, t_b, shorter = passes(r)
    assert shorter > 0
    optimizer = max(e.dur_s for e in r.trace.events if e.kind == "optimizer")
    pipeline = r.step_s - optimizer
    assert pipeline == pytest.approx((m + p - 1) * (t_f + t_b) - shorter, rel=1e-6)


def test_interleaving_divides_the_bubble_by_the_virtual_stages():
    p, m, v = 4, 8, 2
    r = predict_step(mlp_plan(pp=p, num_microbatches=m, schedule="interleaved-1f1b", virtual_stages=v),
                     ideal_spec(**FREE_COMM))
    t_f, t_b, shorter = passes(r)  # one virtual stage's passes
    pipeline = r.step_s - max(e.dur_s for e in r.trace.events if e.kind == "optimizer")
    assert pipeline == pytest.approx((v * m + p - 1) * (t_f + t_b) - shorter, rel=1e-6)


def test_bucketed_overlap_hides_gradient_all_reduce_behind_backward():
    spec = ideal_spec(**{"intra_node.bw_GBps_per_direction": 5.0})
    base = dict(dp=4, grad_sync="bucketed", bucket_size=2**20)
    overlapped = predict_step(mlp_plan(overlap=True, **base), spec)
    serial = predict_step(mlp_plan(overlap=False, **base), spec)
    assert overlapped.step_s < serial.step_s
    assert overlapped.ranks[0].seconds["dp"] < serial.ranks[0].seconds["dp"]


def test_memory_of_the_course_ddp_plan():
    # 4 layers of 1024 x 1024 fp32: 4,194,304 parameters on every rank.
    plan = Plan(model=load_model("course-mlp"), dp=4, grad_sync="per_param")
    (mem,) = predict_step(plan, load_cluster("dgx-h100")).memory
    params = 4 * 1024 * 1024
    assert mem.weights == mem.gradients == params * 4
    assert mem.optimizer == params * 8  # two fp32 AdamW moments, no master copy in fp32
    # 32 rows per rank keep each layer's input and pre-gelu output: 2 x 1024 fp32 values per row per layer.
    assert mem.activations == 32 * 4 * 2 * 1024 * 4


def test_a_dtype_without_a_measured_matmul_rate_is_noted_once_it_has_simulated(capsys):
    """fp32 on an H100 has no measured rate in dgx-h100.yaml (only bf16 and fp8): its matmuls run at the
    plain peak, an upper bound the output must own up to; bf16 has one, and a CPU host's fit covers all."""
    assert main(["simulate", "tiny-dp2", "--cluster", "dgx-h100"]) == 0
    err = capsys.readouterr().err
    assert "note: dgx-h100 gives no measured fp32 matmul rate" in err and "compute.matmul_efficiency.fp32" in err
    assert main(["simulate", "tiny-dp2", "--cluster", "dgx-h100", "--dtype", "bf16"]) == 0
    assert "matmul rate" not in capsys.readouterr().err  # (tiny-gpt's launch-bound note stays)
    h100 = load_cluster("dgx-h100")
    assert h100.lacks_matmul_rate("fp32") and not h100.lacks_matmul_rate("fp16")


def test_a_plan_that_does_not_fit_is_flagged(capsys):
    code = main(["simulate", "llama3-70b-1024", "--pp", "4", "--dp", "32", "--zero", "0", "--json"])
    out = json.loads(capsys.readouterr().out)
    # Twice the layers per stage and 4 microbatches in flight on stage 0, optimizer state whole: far over 80 GB.
    assert code == 0 and out["fits"] is False


def test_simulate_cli_writes_chrome_trace(capsys, tmp_path):
    trace = tmp_path / "step.json"
    assert main(["simulate", "course-pp", "--cluster", "dgx-h100", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "step time" in out and "MFU" in out and "comm overlap" in out
    doc = json.loads(trace.read_text())
    assert doc["distributedInfo"]["world_size"] == 2
    names = {e["name"] for e in doc["traceEvents"] if e["ph"] == "X"}
    assert "F stage=1 mb=3" in names and "optimizer step" in names
    assert any(e["ph"] == "s" for e in doc["traceEvents"])  # send -> recv flows


def test_context_parallel_exchanges_get_their_own_named_track(capsys, tmp_path):
    trace = tmp_path / "step.json"
    assert main(["simulate", "--model", "tiny-gpt", "--cp", "2", "--cluster", "dgx-h100", "--trace", str(trace)]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    exchanges = [e for e in events if e["ph"] == "X" and e["args"].get("parsim_name", "").startswith("all_gather cp ")]
    assert exchanges and {tracks[e["pid"], e["tid"]] for e in exchanges} == {"cp"}


def test_simulate_rejects_a_bad_plan_in_one_line(capsys, tmp_path):
    bad = tmp_path / "plan.yaml"
    bad.write_text("model: course-mlp\nparallel: {dp: 3}\n")
    assert main(["simulate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1


def test_kernel_overhead_is_charged_per_launched_kernel():
    from parsim.sim.compute import ComputeModel

    model = ComputeModel(peak_flops=1e12, hbm_bw_Bps=1e12, dtype_bytes=4, kernel_overhead_s=5e-6)
    assert model.time(kernels=10) == pytest.approx(50e-6)
    slow = ideal_spec(**FREE_COMM, **{"compute": {"kernel_overhead_us": 100.0}})
    fast = predict_step(mlp_plan(pp=2, num_microbatches=4), ideal_spec(**FREE_COMM))
    slowed = predict_step(mlp_plan(pp=2, num_microbatches=4), slow)
    assert slowed.step_s > fast.step_s + 100e-6 * 8  # at least the 8 passes' matmul launches


def test_fp8_runs_matmuls_at_the_fp8_peak_and_the_rest_at_bf16():
    from parsim.sim.compute import ComputeModel

    spec = load_cluster("dgx-h100")
    fp8 = ComputeModel.for_cluster(spec, "fp8", 2)
    bf16 = ComputeModel.for_cluster(spec, "bf16", 2)
    # 1979 x 0.709 vs 989.5 x 0.803 TFLOP/s: each dtype at its own maximum achievable matmul rate, times its
    # tiles' fixed cost in k (k0 steps at the bf16 rate, twice as many at fp8's)
    k, k0 = 8192, spec.matmul_k_overhead
    assert fp8.matmul_rate(8192, 8192, k) / bf16.matmul_rate(8192, 8192, k) == pytest.approx(
        1979 * 0.709 * k / (k + 2 * k0) / (989.5 * 0.803 * k / (k + k0)))
    assert fp8.time(flops=1e12) == bf16.time(flops=1e12)  # attention core and other FLOPs stay bf16
    plan = Plan(model=load_model("llama3-8b"), dp=8, dtype="fp8")
    assert predict_step(plan, spec).step_s < predict_step(Plan(model=load_model("llama3-8b"), dp=8, dtype="bf16"),
                                                         spec).step_s


def test_fp8_on_a_gpu_without_it_is_refused(capsys):
    assert main(["simulate", "--model", "llama3-8b", "--dp", "8", "--dtype", "fp8", "--cluster", "dgx-a100"]) == 2
    assert "no fp8 peak" in capsys.readouterr().err
