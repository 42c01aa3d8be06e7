"""`parsim calibrate --ranks 1`: one GPU's compute figures recovered from the model's own kernel times."""

from __future__ import annotations

import pytest
from json_schema import errors

from parsim.calibrate.gpu import fit_gpu, gpu_cluster, gpu_payload
from parsim.cli.main import main
from parsim.errors import ParsimError
from parsim.files import read_yaml
from parsim.hardware.cluster import SmCycles, builtin_clusters, builtin_for_gpu, load_cluster, parse_cluster
from parsim.report.jsondoc import envelope, published_schema
from parsim.sim.compute import ComputeModel, SmWork
from parsim.workload.model import load_model

SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 8192))
LENGTHS = (1024, 4096, 16384)
HOST_US = {"forward": 9.0, "backward": 6.0, "optimizer_tensor": 2.5, "optimizer_step": 90.0}  # measured_by's host
SM_CYCLES = SmCycles(softmax=((1024, 0.25), (4096, 0.45)), dropout=0.4, gelu=(0.2, 0.15), norm=(0.3, 0.5),
                     bias_add=0.35, adamw=0.45)


def measured_by(model: ComputeModel, spec) -> list[dict]:
    """Rows as executor.gpu_bench writes them, timed by ``model`` (a GPU whose figures we know)."""
    rows = [{"kind": "matmul", "what": "mm", "measured_s": model.matmul_time(*mnk), "work": {"mnk": list(mnk)}}
            for mnk in SHAPES]
    forward, backward = model.attention_efficiency
    for seq in LENGTHS:
        flops = 1e12 * seq / 1024  # any FLOPs: the rate is what is fitted
        slower = 1 + 1024 / seq  # shorter sequences run slower, as FlashAttention's do
        rows += [{"kind": "attention", "what": "a", "measured_s": flops * slower / (forward * model.peak_flops),
                  "work": {"flops": flops, "pass": "forward", "seq": seq}},
                 {"kind": "attention", "what": "a", "measured_s": 2 * flops * slower / (backward * model.peak_flops),
                  "work": {"flops": 2 * flops, "pass": "backward", "seq": seq}}]
    rows += [{"kind": "memory", "what": "copy", "measured_s": b / model.memory_bw_Bps, "work": {"bytes": b}}
             for b in (2 << 30, 3 << 30)]
    rows += [{"kind": "host", "what": f"block, {p}", "measured_s": ops * HOST_US[p] * 1e-6,
              "work": {"pass": p, "ops": ops}} for ops in (88, 312) for p in ("forward", "backward")]
    sm = ComputeModel(peak_flops=1.0, hbm_bw_Bps=1.0, dtype_bytes=2, sm_cycles_per_s=spec.gpu.sm_cycles_per_s,
                      sm_cycles=SM_CYCLES)
    works = [SmWork("softmax", 1e9, row=row) for row, _ in SM_CYCLES.softmax]
    works += [SmWork("dropout", 5e8), SmWork("bias_add", 4e8)]
    works += [SmWork(kind, 3e8, backward) for kind in ("gelu", "norm") for backward in (False, True)]
    rows += [{"kind": "sm", "what": w.kind, "measured_s": sm.cycles(w) / spec.gpu.sm_cycles_per_s,
              "work": {"sm": w.kind, "pass": "backward" if w.backward else "forward", "elements": w.elements,
                       "bytes": 2 * w.elements, "row": w.row}} for w in works]
    params = 268e6  # a fused AdamW step: its bytes at the memory-bound rate, then its SM cycles
    rows.append({"kind": "optimizer", "what": "fused AdamW", "work": {"params": params, "bytes": 28 * params},
                 "measured_s": 28 * params / model.memory_bw_Bps + params * SM_CYCLES.adamw / spec.gpu.sm_cycles_per_s})
    return rows + [{"kind": "host", "what": "AdamW",
                    "measured_s": (HOST_US["optimizer_step"] + n * HOST_US["optimizer_tensor"]) * 1e-6,
                    "work": {"optimizer_tensors": n}} for n in (1, 64)]


def test_a_gpu_calibration_recovers_the_figures_its_measurements_were_made_with():
    spec = load_cluster("dgx-h100")
    gpu = ComputeModel(peak_flops=989.5e12, hbm_bw_Bps=3350e9, dtype_bytes=2, efficiency=0.7, sm_count=132,
                       memory_efficiency=0.9, attention_efficiency=(0.6, 0.45), k_overhead=spec.matmul_k_overhead)
    fit = fit_gpu(measured_by(gpu, spec), spec)
    assert fit.matmul_efficiency == pytest.approx(0.7)
    assert fit.memory_efficiency == pytest.approx(0.9)
    for seq in LENGTHS:
        assert fit.attention["forward"][seq] == pytest.approx(0.6 / (1 + 1024 / seq))
        assert fit.attention["backward"][seq] == pytest.approx(0.45 / (1 + 1024 / seq))
    assert (fit.op_forward_s, fit.op_backward_s, fit.optimizer_tensor_s, fit.optimizer_step_s) == pytest.approx(
        (9e-6, 6e-6, 2.5e-6, 90e-6))
    assert dict(fit.sm_cycles.softmax) == pytest.approx(dict(SM_CYCLES.softmax))
    assert (fit.sm_cycles.dropout, *fit.sm_cycles.gelu, *fit.sm_cycles.norm, fit.sm_cycles.bias_add,
            fit.sm_cycles.adamw) == pytest.approx((SM_CYCLES.dropout, *SM_CYCLES.gelu, *SM_CYCLES.norm,
                                                   SM_CYCLES.bias_add, SM_CYCLES.adamw))


def test_the_calibrated_file_keeps_the_base_clusters_links_and_replaces_its_compute():
    spec = load_cluster("dgx-h100")
    gpu = ComputeModel(peak_flops=989.5e12, hbm_bw_Bps=3350e9, dtype_bytes=2, efficiency=0.7, sm_count=132,
                       memory_efficiency=0.9, attention_efficiency=(0.6, 0.45), k_overhead=spec.matmul_k_overhead)
    rows = measured_by(gpu, spec)
    fit = fit_gpu(rows, spec)
    data = gpu_cluster(read_yaml(builtin_clusters()["dgx-h100"]), fit, "my-gpu", "one H100")
    mine = parse_cluster(data, "my-gpu.yaml")
    assert mine.name == "my-gpu" and mine.matmul_efficiency_for("bf16") == pytest.approx(0.7, abs=1e-4)
    assert mine.matmul_efficiency_for("fp8") == spec.matmul_efficiency_for("fp8")  # not measured: kept
    assert mine.memory_efficiency == pytest.approx(0.9, abs=1e-4)
    assert [seq for seq, _ in mine.attention_efficiency[0]] == list(LENGTHS)
    assert (mine.intra, mine.scale_out, mine.nccl, mine.gpu) == (spec.intra, spec.scale_out, spec.nccl, spec.gpu)
    assert (mine.op_forward_s, mine.op_backward_s) == pytest.approx((9e-6, 6e-6))
    assert (mine.optimizer_tensor_s, mine.optimizer_step_s) == pytest.approx((2.5e-6, 90e-6))
    assert mine.sm_cycles == SM_CYCLES  # four decimals written, these need no more
    assert not mine.describes_cpu_host  # a GPU whose host costs are known, not a CPU host
    assert ComputeModel.for_cluster(mine, "bf16", 2).host_overlaps_device
    doc = envelope("calibrate.gpu", gpu_payload("my-gpu.yaml", "NVIDIA H100 80GB HBM3", "dgx-h100", fit, rows))
    assert errors(doc, published_schema("calibrate.gpu")) == []


@pytest.mark.parametrize("device, cluster", [("NVIDIA H100 80GB HBM3", "dgx-h100"), ("NVIDIA H200", "dgx-h200"),
                                             ("NVIDIA A100-SXM4-80GB", "dgx-a100"), ("NVIDIA H800", "hgx-h800")])
def test_a_gpu_is_matched_to_the_built_in_cluster_with_it(device, cluster):
    assert builtin_for_gpu(device) == cluster


def test_a_gpu_without_a_built_in_cluster_is_refused():
    with pytest.raises(ParsimError, match="no built-in cluster has a 'Tesla T4'"):
        builtin_for_gpu("Tesla T4")


def test_one_rank_without_a_gpu_is_refused_in_one_line(tmp_path, capsys):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    assert main(["calibrate", "--ranks", "1", "--out", str(tmp_path / "gpu.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no CUDA GPU" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "gpu.yaml").exists()


def test_one_rank_on_a_gpu_prints_each_figure_beside_the_base_clusters_and_writes_a_loadable_file(
        tmp_path, capsys, monkeypatch):
    """The command's own path, the GPU's timings standing in (the kernel model of a known GPU)."""
    torch = pytest.importorskip("torch")
    import executor.gpu_bench as gpu_bench

    spec = load_cluster("dgx-h100")
    gpu = ComputeModel(peak_flops=989.5e12, hbm_bw_Bps=3350e9, dtype_bytes=2, efficiency=0.7, sm_count=132,
                       memory_efficiency=0.9, attention_efficiency=(0.6, 0.45), k_overhead=spec.matmul_k_overhead)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(gpu_bench, "calibration_rows", lambda device, dtype: measured_by(gpu, spec))
    out = tmp_path / "my-gpu.yaml"
    assert main(["calibrate", "--ranks", "1", "--name", "my-gpu", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for line in ("matmul_efficiency.bf16                   0.803     0.700",
                 "memory_efficiency                        0.852     0.900",
                 "attention_efficiency.forward at 4,096    0.603     0.480",  # 0.6 / (1 + 1024/4096)
                 "attention_efficiency.backward at 16,384  0.543     0.424",  # 0.45 / (1 + 1024/16384)
                 "sm_cycles.softmax at 4,096               0.407     0.450",
                 "sm_cycles.norm backward                  0.356     0.500",
                 "sm_cycles.bias_add                       0.366     0.350",
                 "sm_cycles.adamw                          0.390     0.450",
                 "op_forward_us (host, µs)                 0.0       9.0",
                 "optimizer_tensor_us (host, µs)           0.0       2.5",
                 "optimizer_step_us (host, µs)             0.0       90.0"):
        assert line in printed
    mine = load_cluster(str(out))
    assert mine.name == "my-gpu" and mine.memory_efficiency == pytest.approx(0.9, abs=1e-4)


def test_the_benchmarks_attention_flops_are_the_kernel_models():
    """executor.gpu_bench counts causal attention's FLOPs as parsim.lowering.kernels.block_work does."""
    pytest.importorskip("torch")
    from executor.gpu_bench import attention_flops
    from parsim.lowering.kernels import block_work
    from parsim.workload.plan import Plan

    plan = Plan(model=load_model("llama3-8b"), dp=8, dtype="bf16")
    layer = next(c for c in plan.stage_costs(0) if c.name == "layer.0")
    block = next(b for b in layer.blocks if b.attention_flops_per_token)
    m = plan.model
    forward = attention_flops(plan.microbatch_size, m.seq_len, m.num_heads, m.head_dim)
    assert block_work(plan, block, "F", plan.tokens_per_rank).attention_flops == pytest.approx(forward)
    assert block_work(plan, block, "B", plan.tokens_per_rank).attention_grad_flops == pytest.approx(2 * forward)


def test_the_sm_kernels_calibrate_times_run_and_are_fitted_here():
    """executor.gpu_bench.sm_rows on this host's CPU (tiny sizes): every kind the model prices, each with the
    elements it counts, and a figure fitted for each."""
    torch = pytest.importorskip("torch")
    from executor.gpu_bench import SM_ROW_LENGTHS, sm_rows
    from parsim.calibrate.gpu import fit_sm_cycles
    from parsim.hardware.cluster import HOPPER_SM_CYCLES

    rows = sm_rows(torch.device("cpu"), torch.float32, elements=4 * max(SM_ROW_LENGTHS), tokens=64)
    kinds = {(r["work"]["sm"], r["work"]["pass"], r["work"]["row"]) for r in rows}
    assert kinds == {("softmax", "forward", n) for n in SM_ROW_LENGTHS} | {("dropout", "forward", 0)} | {
        (k, p, 0) for k in ("gelu", "norm") for p in ("forward", "backward")} | {("bias_add", "forward", 0)}
    dropout = next(r for r in rows if r["work"]["sm"] == "dropout")["work"]
    assert dropout["bytes"] == 9 * dropout["elements"]  # fp32 read and written, a one-byte mask
    fit = fit_sm_cycles(rows, 1e9, HOPPER_SM_CYCLES)
    assert [n for n, _ in fit.softmax] == list(SM_ROW_LENGTHS) and fit.dropout > 0 and min(fit.gelu + fit.norm) > 0
    assert fit.bias_add > 0
    assert fit_sm_cycles(rows, 0.0, HOPPER_SM_CYCLES) is None  # no SM clock: nothing to fit against
