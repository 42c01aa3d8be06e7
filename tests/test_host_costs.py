"""The CPU host's costs: fits recover known figures from synthetic data, the cluster file reads and
checks the new keys, and the step simulator charges them (without changing GPU predictions)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import yaml
from cpu_host import cpu_host
from ideal_cluster import IDEAL, ideal_spec

from parsim.calibrate.host import (DispatchFit, OptimizerFit, fit_alone_memory, fit_cache_hits, fit_core_arithmetic,
                                   fit_dispatch, fit_elementwise, fit_matmul, fit_optimizer, fit_probe_elasticity,
                                   fit_step_overhead, host_cluster, step_overhead_us)
from parsim.cli.main import main
from parsim.errors import ConfigError, ParsimError
from parsim.files import read_yaml
from parsim.hardware.cluster import builtin_clusters, load_cluster, parse_cluster
from parsim.lowering.lower import ADAMW_ACCESSES, lower
from parsim.report.step_report import breakdown, merge_spans
from parsim.report.trace import Event, Trace
from parsim.sim.compute import ComputeModel, SmWork
from parsim.sim.program import Op, Program
from parsim.sim.step import predict_step
from parsim.sim.stepsim import StepSimulator
from parsim.workload.model import load_model
from parsim.workload.plan import Plan, resolve_plan

SHAPES = [(32, 64, 64), (128, 128, 128), (32, 1024, 1024), (128, 256, 1024), (512, 512, 512),
          (128, 1024, 1024), (1024, 1024, 32), (64, 4096, 1024), (256, 64, 64)]
HOST_KEYS = {"op_forward_us": 7.0, "op_backward_us": 6.0, "optimizer_tensor_us": 50.0, "optimizer_step_us": 130.0,
             "matmul_stream_bw_GBps": 15.0, "p2p_rendezvous_us": 150.0, "elementwise_bw_GBps": 6.0,
             "action_overhead_us": 40.0}
CORE_NS = {"gelu": {"forward": 0.5, "backward": 1.2}, "norm": {"forward": 0.4, "backward": 0.9},
           "softmax": {"forward": 0.3, "backward": 0.6}}  # a core's ns per element read or written
SHARED = {"p2p_rendezvous_us": 2500.0, "p2p_latency_us": 300.0, "action_overhead_us": 400.0}  # two ranks per core


# ----------------------------------------------------------------------------- fits on synthetic data
def test_matmul_fit_recovers_the_streamed_operand_and_keeps_the_call_cost_apart():
    truth = ComputeModel(peak_flops=70e9, hbm_bw_Bps=1e12, dtype_bytes=4, half_dim=8.0, matmul_stream_bw_Bps=15e9)
    samples = [(s, truth.matmul_time(*s) + 4e-6) for s in SHAPES]  # each call also pays 4 us of dispatch
    fit = fit_matmul(samples, call=True)
    assert fit.peak_flops == pytest.approx(70e9, rel=0.05)
    assert fit.stream_bw_Bps == pytest.approx(15e9, rel=0.1)
    assert fit.call_s == pytest.approx(4e-6, rel=0.2)
    assert fit.median_abs_error < 0.02
    model = fit.model()  # the arithmetic alone: the dispatch is charged per op elsewhere
    assert model.matmul_time(64, 1024, 1024) == pytest.approx(truth.matmul_time(64, 1024, 1024), rel=0.05)


def test_matmul_fit_tells_the_weight_read_from_the_output_write():
    truth = ComputeModel(peak_flops=70e9, hbm_bw_Bps=1e12, dtype_bytes=4, half_dim=8.0, matmul_stream_bw_Bps=4e9,
                         matmul_write_bw_Bps=12e9)
    # A thin matmul reading a 4 MiB weight takes longer than one writing a 4 MiB output, at the same FLOPs.
    assert truth.matmul_time(32, 1024, 1024) - truth.matmul_time(1024, 1024, 32) == pytest.approx(
        1024 * 1024 * 4 * (1 / 4e9 - 1 / 12e9) - 32 * 1024 * 4 * (1 / 4e9 - 1 / 12e9))
    fit = fit_matmul([(s, truth.matmul_time(*s) + 4e-6) for s in SHAPES], call=True)
    assert (fit.stream_bw_Bps, fit.write_bw_Bps) == pytest.approx((4e9, 12e9), rel=0.1)
    assert fit.model().matmul_time(64, 1024, 1024) == pytest.approx(truth.matmul_time(64, 1024, 1024), rel=0.05)
    assert host_cluster(2, 1e-4, 1e9, 1e9, matmul_stream_bw_Bps=4e9, matmul_write_bw_Bps=12e9)["compute"][
        "matmul_write_bw_GBps"] == pytest.approx(12.0)


CACHE_KEYS = {"matmul_cached_stream_bw_GBps": 60.0, "matmul_cache_hits": {4096: 1.0, 32768: 0.5, 131072: 0.0}}


def test_a_matmul_reads_the_share_of_its_weight_the_cache_holds_at_the_cache_s_speed():
    """The share held is read off the curve at the bytes touched since the weight's last read (linear in log2
    between its points, its ends beyond them); the rest streams from memory. Nothing followed: from memory."""
    model = ComputeModel.for_cluster(parse_cluster(cpu_host(**HOST_KEYS, **CACHE_KEYS), "host.yaml"), "fp32", 4)
    weight = 1024 * 1024 * 4
    cold = model.matmul_time(32, 1024, 1024)
    for reuse_MiB, hit in ((1, 1.0), (4, 1.0), (16, 1 - 0.5 * 2 / 3), (32, 0.5), (128, 0.0), (1024, 0.0)):
        assert model.cache_hit(reuse_MiB * 2**20) == pytest.approx(hit)
        saved = hit * weight * (1 / 15e9 - 1 / 60e9)
        assert model.matmul_time(32, 1024, 1024, reuse_bytes=reuse_MiB * 2**20) == pytest.approx(cold - saved)
    assert model.cache_hit(float("inf")) == 0.0
    plain = ComputeModel.for_cluster(parse_cluster(cpu_host(**HOST_KEYS), "host.yaml"), "fp32", 4)
    assert plain.matmul_time(32, 1024, 1024, reuse_bytes=1.0) == pytest.approx(cold)


def test_the_cache_fit_reads_the_saving_at_the_nearest_reuse_and_the_share_held_in_between():
    truth = ComputeModel(peak_flops=70e9, hbm_bw_Bps=1e12, dtype_bytes=4, half_dim=8.0, matmul_stream_bw_Bps=15e9)
    weight, call = 1024 * 1024 * 4, (32 * 1024 + 1024 * 1024 + 32 * 1024) * 4
    saving = weight * (1 / 15e9 - 1 / 60e9)
    samples = [(count * call, truth.matmul_time(32, 1024, 1024) - hit * saving + jitter)
               for count, hit in ((1, 1.0), (4, 1.0), (8, 0.25), (32, 0.0)) for jitter in (-1e-6, 0.0, 1e-6)]
    fit = fit_cache_hits(samples, 15e9, (32, 1024, 1024))
    assert fit.cached_bw_Bps == pytest.approx(60e9, rel=1e-3)
    assert fit.hits == ((4352, 1.0), (17408, 1.0), (34816, pytest.approx(0.25)), (139264, 0.0))
    # no saving worth following, nothing streamed, or one distance: no curve
    flat = [(d, truth.matmul_time(32, 1024, 1024)) for d, _ in samples]
    assert fit_cache_hits(flat, 15e9, (32, 1024, 1024)) is None
    assert fit_cache_hits(samples, None, (32, 1024, 1024)) is None
    assert fit_cache_hits(samples[:3], 15e9, (32, 1024, 1024)) is None


def test_the_lowering_follows_the_bytes_a_rank_touches_between_two_reads_of_a_block_s_weights():
    """Course PP's stage 0 (GPipe, 4 microbatches of 32 rows, two 1024 x 1024 layers): a layer's second
    microbatch reads its weight after its first microbatch's two matmuls (input, weight, output, the GeLU's bytes)
    and the send of their activations; the first microbatch after the last read of the step before (its last
    backward), the rest of the step between (AdamW's bytes with it). Only reads in the layout a weight is stored
    in are followed: the course MLP's forwards (x @ W), a transformer's backwards (nn.Linear's dY @ W); nothing
    on a GPU."""
    plan = resolve_plan("course-pp")
    ops = lower(plan, fsdp_in_line=True, follow_cache=True).rank_ops(0)
    forwards = [op for op in ops if op.name.startswith("F ")]
    matmul = 4 * (32 * 1024 + 1024 * 1024 + 32 * 1024) + 32 * 1024 * 4 * 2
    assert [op.weights_reuse_bytes for op in forwards[2:]] == [2 * matmul + 32 * 1024 * 4] * 6
    optimizer = next(op for op in ops if op.kind == "optimizer")
    assert all(op.weights_reuse_bytes > optimizer.hbm_bytes for op in forwards[:2])
    assert all(op.weights_reuse_bytes == float("inf") for op in ops if op.name.startswith("B "))
    assert all(op.weights_reuse_bytes == float("inf") for op in lower(plan, fsdp_in_line=True).rank_ops(0))
    tiny = lower(resolve_plan("tiny-pp2"), fsdp_in_line=True, follow_cache=True).rank_ops(1)
    assert all(op.weights_reuse_bytes == float("inf") for op in tiny if op.name.startswith("F "))
    assert all(op.weights_reuse_bytes < float("inf") for op in tiny if op.name.startswith("B ") and op.matmuls)


def test_a_pipeline_s_later_microbatches_find_the_stage_s_weights_in_the_cache():
    """With every reuse within the curve's first point, course PP's forwards after each stage's first
    microbatch read their weights at the cache's speed: each stage's forward phase is shorter by exactly
    three microbatches' two weight reads' saving, its backward as long."""
    plan = resolve_plan("course-pp")
    cached = predict_step(plan, parse_cluster(cpu_host(**HOST_KEYS, matmul_cached_stream_bw_GBps=60.0,
                                                       matmul_cache_hits={32768: 1.0, 65536: 0.0}), "host.yaml"))
    plain = predict_step(plan, parse_cluster(cpu_host(**HOST_KEYS), "host.yaml"))
    saved = 3 * 2 * 1024 * 1024 * 4 * (1 / 15e9 - 1 / 60e9)
    for with_cache, without in zip(cached.ranks, plain.ranks):
        assert without.seconds["forward"] - with_cache.seconds["forward"] == pytest.approx(saved)
        assert with_cache.seconds["backward"] == pytest.approx(without.seconds["backward"])


def test_explain_compute_names_the_cache_apart_from_the_table_it_prices_from_memory(tmp_path, capsys):
    host = tmp_path / "host.yaml"
    host.write_text(yaml.safe_dump(cpu_host(**HOST_KEYS, **CACHE_KEYS)))
    assert main(["explain", "compute", "course-pp", "--cluster", str(host)]) == 0
    assert ("cache       a weight read again in the layout it is stored in comes from the core's cache at 60 GB/s, "
            "the share held by the bytes touched since its last read: 4 MiB 100%, 32 MiB 50%, 128 MiB 0% (a stage's "
            "later microbatches): this table reads every weight from memory") in capsys.readouterr().out


def test_matmul_fit_with_free_writes_keeps_one_speed_for_both():
    """A file without the write speed streams the output at the weight's: a fit whose writes cost nothing
    would be read that way, so it keeps one speed."""
    truth = ComputeModel(peak_flops=70e9, hbm_bw_Bps=1e12, dtype_bytes=4, half_dim=8.0, matmul_stream_bw_Bps=4e9,
                         matmul_write_bw_Bps=1e30)
    fit = fit_matmul([(s, truth.matmul_time(*s)) for s in SHAPES])
    assert fit.stream_bw_Bps is not None and fit.write_bw_Bps is None


def test_matmul_fit_without_a_stream_term_in_the_data_keeps_the_roofline():
    truth = ComputeModel(peak_flops=100e9, hbm_bw_Bps=1e15, dtype_bytes=4, half_dim=32.0)
    fit = fit_matmul([(s, truth.matmul_time(*s)) for s in SHAPES])
    assert fit.stream_bw_Bps is None and fit.write_bw_Bps is None and fit.half_dim == pytest.approx(32.0, rel=0.1)


def test_dispatch_fit_takes_the_matmuls_out_and_divides_by_the_ops():
    matmuls = ComputeModel(peak_flops=50e9, hbm_bw_Bps=1e12, dtype_bytes=4)
    rows = []
    for mm, forward_ops, backward_ops in (([(32, 128, 32), (32, 32, 128)], 88, 232), ([], 64, 88)):
        mm_forward = sum(matmuls.matmul_time(*s) for s in mm)
        mm_backward = sum(matmuls.matmul_time(m, k, n) + matmuls.matmul_time(k, n, m) for m, n, k in mm)
        rows.append({"name": "x", "forward_s": forward_ops * 7e-6 + mm_forward,
                     "backward_s": backward_ops * 5e-6 + mm_backward, "forward_ops": forward_ops,
                     "backward_ops": backward_ops, "matmuls": mm})
    fit = fit_dispatch(rows, matmuls)
    assert fit.forward_s == pytest.approx(7e-6) and fit.backward_s == pytest.approx(5e-6)


def test_dispatch_fit_separates_a_pass_s_own_cost_from_the_cost_per_op():
    """Stacks of one block and of eight (executor.compute_bench.measure_dispatch): the line through their times in
    the op count has the cost per op as its slope and the pass's own cost as its intercept. A per-op cost pooled
    over the deep stacks alone (the fit before) would spread the pass over their ops and price a one-block pass
    short."""
    matmuls = ComputeModel(peak_flops=50e9, hbm_bw_Bps=1e12, dtype_bytes=4)
    rows = []
    for layers in (8, 1):
        for mm, forward_ops, backward_ops in (([(32, 128, 32)], 102, 143), ([], 8, 11)):
            mm = mm * layers
            mm_forward = sum(matmuls.matmul_time(*s) for s in mm)
            mm_backward = sum(matmuls.matmul_time(m, k, n) + matmuls.matmul_time(k, n, m) for m, n, k in mm)
            rows.append({"name": "x", "layers": layers, "matmuls": mm,
                         "forward_s": 600e-6 + layers * forward_ops * 7e-6 + mm_forward,
                         "backward_s": 200e-6 + layers * backward_ops * 5e-6 + mm_backward,
                         "forward_ops": layers * forward_ops, "backward_ops": layers * backward_ops})
    fit = fit_dispatch(rows, matmuls)
    assert (fit.forward_s, fit.backward_s) == (pytest.approx(7e-6), pytest.approx(5e-6))
    assert fit.pass_s == pytest.approx((600e-6, 200e-6))
    pooled = fit_dispatch([r for r in rows if r["layers"] == 8], matmuls)  # one depth: no pass cost told apart
    assert pooled.pass_s == (0.0, 0.0) and pooled.forward_s > 7.5e-6
    two_ranks = fit_dispatch(rows + rows, matmuls)  # every rank's rows alike: the same fit
    assert two_ranks.pass_s == pytest.approx(fit.pass_s) and two_ranks.forward_s == pytest.approx(fit.forward_s)


def test_each_pass_of_a_schedule_pays_its_own_cost_once_on_its_first_block():
    """compute.pass_us: every forward and backward action of a rank's schedule begins one pass, charged on its
    first compute op (after its receive), inside the pass: the forward and backward phases grow by exactly the
    passes times the cost, and the cost follows the eager probe."""
    plan = resolve_plan("tiny-pp2")
    m = plan.num_microbatches
    for p in range(plan.pp):
        ops = lower(plan).rank_ops(p)
        starts = [op for op in ops if op.pass_starts != (0, 0)]
        assert all(op.kind == "compute" for op in starts)
        assert [op.pass_starts for op in starts].count((1, 0)) == m
        assert [op.pass_starts for op in starts].count((0, 1)) == m
        assert all(op.name.startswith(("F ", "B ")) and op.name.split()[0] == ("F" if op.pass_starts[0] else "B")
                   for op in starts)
    keys = {"pass_us": {"forward": 500.0, "backward": 200.0}}
    spec = parse_cluster(cpu_host(**HOST_KEYS, **keys), "host.yaml")
    plain = parse_cluster(cpu_host(**HOST_KEYS), "host.yaml")
    assert spec.pass_s == pytest.approx((500e-6, 200e-6))
    for with_passes, without in zip(predict_step(plan, spec).ranks, predict_step(plan, plain).ranks):
        assert with_passes.seconds["forward"] - without.seconds["forward"] == pytest.approx(m * 500e-6)
        assert with_passes.seconds["backward"] - without.seconds["backward"] == pytest.approx(m * 200e-6)
    assert spec.at_host_speed(1.0, 2.0).pass_s == pytest.approx((250e-6, 100e-6))  # follows the eager probe
    assert predict_step(plan, ideal_spec()).step_s == predict_step(resolve_plan("tiny-pp2"), ideal_spec()).step_s


def test_explain_compute_names_the_cost_per_pass_apart_from_the_layers(tmp_path, capsys):
    host = tmp_path / "host.yaml"
    host.write_text(yaml.safe_dump(cpu_host(**HOST_KEYS, pass_us={"forward": 500.0, "backward": 200.0})))
    assert main(["explain", "compute", "tiny-pp2", "--cluster", str(host)]) == 0
    assert "per pass    500 us a forward, 200 us a backward, once on a pass's first layer" in capsys.readouterr().out


def test_elementwise_fit_divides_the_counted_bytes_by_the_time_beyond_the_ops_fixed_costs():
    dispatch = DispatchFit(7e-6, 5e-6, [])
    forward_ops, backward_ops, forward_bytes, backward_bytes = 8, 13, 3.4e6, 5.5e6
    row = {"forward_s": forward_bytes / 30e9 + forward_ops * 7e-6, "backward_s": backward_bytes / 30e9
           + backward_ops * 5e-6, "forward_ops": forward_ops, "backward_ops": backward_ops,
           "forward_bytes": forward_bytes, "backward_bytes": backward_bytes}
    assert fit_elementwise([row], dispatch) == pytest.approx(30e9)
    assert fit_elementwise([row, {**row, "forward_s": row["forward_s"] + 8.9e6 / 30e9}], dispatch) == \
        pytest.approx(20e9)  # pooled: twice the bytes in three times the time


def test_core_arithmetic_fit_takes_the_ops_out_and_counts_elements_as_the_model_does():
    dispatch = DispatchFit(7e-6, 5e-6, [])
    elements = 65536
    rows = [{"kind": kind, "forward_s": 2 * 7e-6 + 2 * elements * ns["forward"] * 1e-9,
             "backward_s": 3 * 5e-6 + 3 * elements * ns["backward"] * 1e-9, "forward_ops": 2, "backward_ops": 3,
             "elements": elements} for kind, ns in CORE_NS.items()]
    fitted = fit_core_arithmetic(rows + rows, dispatch)  # two ranks alike
    assert fitted.to_ns() == {kind: pytest.approx(ns) for kind, ns in CORE_NS.items()}
    with pytest.raises(ParsimError, match="no measurement of norm"):
        fit_core_arithmetic([r for r in rows if r["kind"] != "norm"], dispatch)
    with pytest.raises(ParsimError, match="gelu forward measurements show no time beyond"):
        fit_core_arithmetic([{**rows[0], "forward_s": 1e-6}, *rows[1:]], dispatch)


def test_a_cpu_core_prices_gelu_norms_and_softmax_by_the_longer_of_their_bytes_and_arithmetic():
    """On a CPU host each kind takes the longer of its bytes at the elementwise speed (6 GB/s here) and its
    arithmetic: GeLU's forward over 1M elements has 0.5 ms of arithmetic under 0.67 ms of bytes, its
    backward over 1.5M elements 1.8 ms over 1 ms. Kinds without figures (dropout) take their bytes."""
    spec = parse_cluster(cpu_host(**HOST_KEYS, core_ns_per_element=CORE_NS), "host.yaml")
    model = ComputeModel.for_cluster(spec, "fp32", 4)
    forward = ((4e6, (SmWork("gelu", 1e6),)),)  # 1M elements of 4 bytes: 0.67 ms of bytes, 0.5 ms of arithmetic
    assert model.time(hbm_bytes=4e6, sm_bound=forward) == pytest.approx(4e6 / 6e9)
    backward = ((6e6, (SmWork("gelu", 1.5e6, backward=True),)),)  # 1 ms of bytes, 1.8 ms of arithmetic
    assert model.time(hbm_bytes=6e6, sm_bound=backward) == pytest.approx(1.5e6 * 1.2e-9)
    softmax = ((6e6, (SmWork("softmax", 1.5e6, backward=True, row=64),)),)  # a CPU's softmax backward computes
    assert model.time(hbm_bytes=6e6, sm_bound=softmax) == pytest.approx(max(6e6 / 6e9, 1.5e6 * 0.6e-9))
    assert model.time(hbm_bytes=4e6, sm_bound=((4e6, (SmWork("dropout", 1e6),)),)) == pytest.approx(4e6 / 6e9)
    faster = ComputeModel.for_cluster(spec.at_host_speed(2.0, 1.0), "fp32", 4)  # follows the matmul probe
    assert faster.time(hbm_bytes=6e6, sm_bound=backward) == pytest.approx(1.5e6 * 1.2e-9 / 2)
    assert ComputeModel.for_cluster(parse_cluster(cpu_host(**HOST_KEYS), "host.yaml"), "fp32", 4).time(
        hbm_bytes=6e6, sm_bound=backward) == pytest.approx(6e6 / 6e9)  # a file without the figures: bytes alone


def test_explain_compute_shows_the_core_s_figures_and_the_kernels_they_bound(tmp_path, capsys):
    path = tmp_path / "host.yaml"
    path.write_text(yaml.safe_dump(cpu_host(**HOST_KEYS, core_ns_per_element=CORE_NS)))
    assert main(["explain", "compute", "course-ddp", "--cluster", str(path)]) == 0
    out = capsys.readouterr().out
    assert "core        gelu 0.50 / 1.20, norm 0.40 / 0.90, softmax 0.30 / 0.60 ns per element" in out
    gelu = [line.split() for line in out.splitlines() if line.split()[2:3] == ["gelu"]]
    # at 6 GB/s the forward's bytes outlast its arithmetic; the backward's arithmetic (1.2 ns) outlasts its bytes
    assert [(row[0], row[-2]) for row in gelu] == [("forward", "memory"), ("backward", "core")]


def test_the_course_mlp_s_gelu_carries_its_arithmetic_into_the_step():
    plan = Plan(model=load_model("course-mlp"), dp=1)
    plain = parse_cluster(cpu_host(**HOST_KEYS), "host.yaml")
    timed = parse_cluster(cpu_host(**HOST_KEYS, core_ns_per_element={**CORE_NS, "gelu": {"forward": 9.0,
                                                                                          "backward": 9.0}}), "h.yaml")
    assert predict_step(plan, timed).step_s > predict_step(plan, plain).step_s


def test_optimizer_fit_separates_the_costs_per_step_and_per_tensor_from_the_bytes():
    def step(tensors, numel):
        return 130e-6 + tensors * 50e-6 + tensors * numel * ADAMW_ACCESSES * 4 / 20e9

    runs = ((1, 256), (64, 256), (8, 1 << 19), (4, 1 << 20))
    fit = fit_optimizer([(t, n, step(t, n)) for t, n in runs], ADAMW_ACCESSES)
    assert fit.step_s == pytest.approx(130e-6, rel=1e-6) and fit.tensor_s == pytest.approx(50e-6, rel=1e-6)
    assert fit.bw_Bps == pytest.approx(20e9, rel=1e-6)
    assert [row[3] for row in fit.rows] == pytest.approx([step(t, n) for t, n in runs])
    with pytest.raises(ParsimError, match="at least three"):
        fit_optimizer([(t, n, step(t, n)) for t, n in runs[:2]], ADAMW_ACCESSES)


def test_the_memory_speed_alone_takes_out_the_costs_per_step_and_per_tensor():
    fit = OptimizerFit(tensor_s=50e-6, step_s=130e-6, bw_Bps=20e9, rows=[])
    rows = [(2, 1 << 21, 130e-6 + 2 * 50e-6 + 2 * (1 << 21) * ADAMW_ACCESSES * 4 / s) for s in (40e9, 44e9, 60e9)]
    assert fit_alone_memory(rows, fit, ADAMW_ACCESSES) == pytest.approx(44e9)
    with pytest.raises(ParsimError, match="no bandwidth term"):
        fit_alone_memory([(64, 256, 1e-3)], fit, ADAMW_ACCESSES)


def _in_step(op: str, size: int, after_compute_s: float, back_to_back_s: float):
    from parsim.report.results import CollectiveResult

    return CollectiveResult(op, 2, size, after_compute_s, "ring", "measured", "gloo",
                            extra={"back_to_back_s": back_to_back_s})


def test_step_overhead_is_what_a_call_after_compute_takes_over_the_same_call_hot_size_by_size():
    """Each size's call after compute less the hot calls timed right after it, the median over the rounds, none
    below 0 (a call after compute that beats the hot ones costs nothing extra)."""
    rounds = [[_in_step("all_reduce", 1 << 18, 600e-6, 300e-6), _in_step("all_reduce", 1 << 20, 1.5e-3, 0.8e-3),
               _in_step("all_reduce", 1 << 22, 2.0e-3, 2.4e-3)],
              [_in_step("all_reduce", 1 << 18, 500e-6, 300e-6), _in_step("all_reduce", 1 << 20, 1.4e-3, 0.8e-3),
               _in_step("all_reduce", 1 << 22, 2.0e-3, 2.5e-3)],
              [_in_step("all_reduce", 1 << 18, 550e-6, 300e-6), _in_step("all_reduce", 1 << 20, 1.6e-3, 0.8e-3),
               _in_step("all_reduce", 1 << 22, 2.0e-3, 2.1e-3)]]
    fitted = fit_step_overhead(rounds)
    assert fitted == {"all_reduce": ((256, pytest.approx(250e-6)), (1024, pytest.approx(700e-6)), (4096, 0.0))}
    assert step_overhead_us(fitted) == {"all_reduce": {256: pytest.approx(250.0), 1024: pytest.approx(700.0),
                                                       4096: 0.0}}


def test_a_slow_spell_through_every_round_leaves_the_step_overhead_as_it_was():
    """A spell adds time per byte to a call after compute and to the hot calls right after it alike
    (docs/calibration.md, "Collectives' slow spells"): three rounds in one, 2 ms more on both, fit as three
    rounds without it."""
    calm = [[_in_step("all_gather", 1 << 20, 700e-6, 500e-6)] for _ in range(3)]
    spell = [[_in_step("all_gather", 1 << 20, 2.7e-3, 2.5e-3)] for _ in range(3)]
    for rounds in (calm, spell):
        assert fit_step_overhead(rounds) == {"all_gather": ((1024, pytest.approx(200e-6)),)}


# ----------------------------------------------------------------------------- the cluster file
def test_host_keys_are_read_in_si_units():
    spec = parse_cluster(cpu_host(**HOST_KEYS), "host.yaml")
    assert spec.op_forward_s == pytest.approx(7e-6) and spec.op_backward_s == pytest.approx(6e-6)
    assert spec.optimizer_tensor_s == pytest.approx(50e-6) and spec.p2p_rendezvous == ((0, pytest.approx(150e-6)),)
    assert spec.matmul_stream_bw_Bps == pytest.approx(15e9) and spec.elementwise_bw_Bps == pytest.approx(6e9)
    assert spec.action_overhead == ((0, pytest.approx(40e-6)),) and spec.matmul_write_bw_Bps is None
    model = ComputeModel.for_cluster(spec, "fp32", 4)
    assert spec.optimizer_step_s == pytest.approx(130e-6)
    assert model.time(forward_ops=10, backward_ops=20, optimizer_tensors=2, optimizer_steps=1) == pytest.approx(
        10 * 7e-6 + 20 * 6e-6 + 2 * 50e-6 + 130e-6)


@pytest.mark.parametrize("key, value, expected", [
    ("op_forward_us", -1.0, "0 to 1e[+]09 microseconds"), ("op_backward_us", "fast", "a finite number in micro"),
    ("optimizer_tensor_us", float("nan"), "a finite number"), ("p2p_rendezvous_us", True, "a finite number"),
    ("action_overhead_us", -5.0, "0 to 1e[+]09 microseconds"), ("p2p_latency_us", "slow", "a finite number in micro"),
    ("action_overhead_us", {"4 MiB": 30.0}, "figures keyed by the gradients a rank holds, in KiB"),
    ("action_overhead_us", {4096: -1.0}, "action_overhead_us.4096: is -1"),
    ("p2p_issue_us", -1.0, "0 to 1e[+]09 microseconds"),
    ("p2p_rendezvous_us", {0: 100.0}, "p2p_rendezvous_us: is .*figures keyed by the gradients a rank holds"),
    ("p2p_latency_us", {512: -1.0}, "p2p_latency_us.512: is -1"),
    ("matmul_stream_bw_GBps", 0, "1e-12 to 1e[+]12 GB/s"), ("elementwise_bw_GBps", -3, "1e-12 to 1e[+]12 GB/s"),
    ("matmul_write_bw_GBps", "fast", "a finite number in GB/s"),
    ("op_overhead_us", 1.0, "unknown key"), ("cpu_cores", 0, "a whole number from 1 to 65,536"),
    ("cpu_cores", 2.5, "a whole number from 1 to 65,536"),
    ("speed_probe_eager_us", 1.0, "given without compute.speed_probe_eager_us, or the other way round"),
    ("speed_probe_memory_GBps", 20.0, "speed_probe_memory_GBps: given without the other probes"),
    ("memory_alone_bw_GBps", 40.0, "given without compute.memory_host_bw_GBps, or the other way round"),
    ("memory_host_bw_GBps", -1.0, "1e-12 to 1e[+]12 GB/s"),
    ("core_ns_per_element", {"gelu": {"forward": 1.0, "backward": 1.0}}, "a mapping of gelu, norm, softmax"),
    ("core_ns_per_element", {**CORE_NS, "norm": {"forward": 1.0}}, "norm: is .* a mapping of forward and backward"),
    ("core_ns_per_element", {**CORE_NS, "gelu": {"forward": -1.0, "backward": 1.0}}, "gelu.forward: is -1"),
    ("shared_cores", {"p2p_latency_us": 1.0}, "a mapping of p2p_rendezvous_us, p2p_latency_us, action_overhead_us "
     "[(]and optionally p2p_issue_us, time_slice_us, one_core_collective_latency_us, matmul_stretch, eager_stretch, "
     "comm_stretch, one_core_collective_GBps[)]"),
    ("shared_cores", {**SHARED, "p2p_issue_us": 1.0, "p2p_lag_us": 1.0}, "a mapping of"),
    ("shared_cores", {"p2p_rendezvous_us": 1.0, "p2p_latency_us": -1.0, "action_overhead_us": 1.0},
     "shared_cores.p2p_latency_us: is -1"),
    ("shared_cores", {**SHARED, "eager_stretch": 0.5}, "shared_cores.eager_stretch: is 0.5 .*1 to 100 times"),
    ("shared_cores", {**SHARED, "one_core_collective_GBps": 0}, "shared_cores.one_core_collective_GBps: is 0"),
    ("tp_collective_call_us", 120.0, "tp_collective_call_us: is 120.0 .*a mapping of forward and backward"),
    ("tp_collective_call_us", {"forward": 120.0, "backward": -1.0}, "tp_collective_call_us.backward: is -1"),
    ("pass_us", {"forward": "fast"}, "pass_us: is .*a mapping of forward and backward"),
    ("pass_us", {"forward": -3.0, "backward": 1.0}, "pass_us.forward: is -3.0 .*0 to 1e[+]09 microseconds"),
    ("zero_grad_free_GBps", 0, "1e-12 to 1e[+]12 GB/s"), ("zero_grad_tensor_us", "slow", "a finite number"),
    ("collective_probe_us", {1024: 0.0}, "collective_probe_us.1024: is 0"),
    ("collective_probe_us", {"1 MiB": 400.0}, "collective_probe_us: is .*figures keyed by KiB"),
    ("collective_probe_us", 400.0, "collective_probe_us: is 400.0 .*microseconds keyed by the all-reduce's KiB"),
    ("matmul_cache_hits", {4096: 1.0}, "matmul_cache_hits: given without compute.matmul_cached_stream_bw_GBps"),
    ("matmul_cached_stream_bw_GBps", 60.0, "matmul_cache_hits: given without"),
])
def test_bad_host_keys_are_refused_in_one_line(key, value, expected, tmp_path, capsys):
    with pytest.raises(ConfigError, match=expected):
        parse_cluster(cpu_host(**{key: value}), "host.yaml")
    path = tmp_path / "host.yaml"
    path.write_text(yaml.safe_dump(cpu_host(**{key: value})))
    assert main(["simulate", "course-pp", "--cluster", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "compute." in err


def test_the_host_speed_scales_the_compute_figures_by_their_probe_and_no_collective():
    data = cpu_host(**HOST_KEYS, speed_probe_gflops=50.0, speed_probe_eager_us=800.0, memory_alone_bw_GBps=30.0,
                    memory_host_bw_GBps=45.0, shared_cores=SHARED, matmul_write_bw_GBps=40.0)
    data["collective_step_overhead_us"] = {"all_reduce": 300.0}
    spec = parse_cluster(data, "host.yaml")
    assert (spec.speed_probe_flops, spec.speed_probe_eager_s) == pytest.approx((50e9, 800e-6))
    assert host_cluster(2, 1e-4, 1e9, 1e9, speed_probe=(50e9, 800e-6))["compute"] == {
        **host_cluster(2, 1e-4, 1e9, 1e9)["compute"], "speed_probe_gflops": 50.0, "speed_probe_eager_us": 800.0}
    moved = spec.at_host_speed(1.25, 0.5)
    # Arithmetic and memory follow the matmul probe ...
    assert moved.gpu.peak_flops["fp32"] == pytest.approx(1.25 * 70e9)
    assert moved.gpu.hbm_bw_Bps == pytest.approx(1.25 * 20e9)
    assert (moved.matmul_stream_bw_Bps, moved.matmul_write_bw_Bps) == pytest.approx((1.25 * 15e9, 1.25 * 40e9))
    assert moved.elementwise_bw_Bps == pytest.approx(1.25 * 6e9)
    assert (moved.memory_alone_bw_Bps, moved.memory_host_bw_Bps) == pytest.approx((1.25 * 30e9, 1.25 * 45e9))
    # ... fixed costs the eager probe.
    assert (moved.op_forward_s, moved.op_backward_s, moved.optimizer_tensor_s, moved.optimizer_step_s,
            moved.action_overhead[0][1]) == pytest.approx(
        (7e-6 / 0.5, 6e-6 / 0.5, 50e-6 / 0.5, 130e-6 / 0.5, 40e-6 / 0.5))
    assert (moved.speed_probe_flops, moved.speed_probe_eager_s) == pytest.approx((62.5e9, 1600e-6))
    assert moved.shared_cores.action_overhead_s == pytest.approx(400e-6 / 0.5)
    # Collectives and pipeline transfers keep their fits.
    assert moved.p2p_rendezvous == spec.p2p_rendezvous and moved.intra == spec.intra
    assert (moved.shared_cores.p2p_rendezvous_s, moved.shared_cores.p2p_latency_s) == pytest.approx((2.5e-3, 300e-6))
    assert moved.reduce_bw_Bps == spec.reduce_bw_Bps
    assert moved.collective_step_overhead_s == spec.collective_step_overhead_s
    with pytest.raises(ParsimError, match="positive"):
        spec.at_host_speed(0.0, 1.0)
    with pytest.raises(ParsimError, match="positive"):
        spec.at_host_speed(1.0, 1.0, -1.0)
    with pytest.raises(ConfigError, match="compute.speed_probe_gflops: is 0 .*1e-09 to 1e[+]15 GFLOP/s"):
        parse_cluster(cpu_host(speed_probe_gflops=0, speed_probe_eager_us=800.0), "host.yaml")
    with pytest.raises(ConfigError, match="compute.speed_probe_memory_GBps: is 0 .*1e-12 to 1e[+]12 GB/s"):
        parse_cluster(cpu_host(speed_probe_gflops=50.0, speed_probe_eager_us=800.0, speed_probe_memory_GBps=0),
                      "host.yaml")


def test_with_a_memory_probe_the_memory_figures_follow_it_and_the_arithmetic_the_matmul_probe():
    data = cpu_host(**HOST_KEYS, speed_probe_gflops=50.0, speed_probe_eager_us=800.0, speed_probe_memory_GBps=20.0,
                    memory_alone_bw_GBps=30.0, memory_host_bw_GBps=45.0, matmul_write_bw_GBps=40.0,
                    core_ns_per_element=CORE_NS)
    spec = parse_cluster(data, "host.yaml")
    assert spec.speed_probe_memory_Bps == pytest.approx(20e9)
    assert host_cluster(2, 1e-4, 1e9, 1e9, speed_probe=(50e9, 800e-6, 20e9))["compute"] == {
        **host_cluster(2, 1e-4, 1e9, 1e9)["compute"], "speed_probe_gflops": 50.0, "speed_probe_eager_us": 800.0,
        "speed_probe_memory_GBps": 20.0}
    moved = spec.at_host_speed(1.25, 0.5, 0.8)
    assert moved.gpu.peak_flops["fp32"] == pytest.approx(1.25 * 70e9)
    assert moved.core_arithmetic == spec.core_arithmetic.scaled(1.25)
    assert moved.gpu.hbm_bw_Bps == pytest.approx(0.8 * 20e9)
    assert (moved.matmul_stream_bw_Bps, moved.matmul_write_bw_Bps) == pytest.approx((0.8 * 15e9, 0.8 * 40e9))
    assert moved.elementwise_bw_Bps == pytest.approx(0.8 * 6e9)
    assert (moved.memory_alone_bw_Bps, moved.memory_host_bw_Bps) == pytest.approx((0.8 * 30e9, 0.8 * 45e9))
    assert (moved.speed_probe_flops, moved.speed_probe_eager_s, moved.speed_probe_memory_Bps) == pytest.approx(
        (62.5e9, 1600e-6, 16e9))
    # Without a memory factor (a file calibrated before the memory probe) memory follows the arithmetic.
    assert spec.at_host_speed(1.25, 0.5).elementwise_bw_Bps == pytest.approx(1.25 * 6e9)


def test_the_eager_work_s_elasticity_is_its_log_log_slope_on_the_probe_between_none_and_all():
    """Work following the probe to the power 0.4, exactly: 0.4; steeper than the probe, 1; against it, 0; too few
    readings, or a probe that hardly moved, leave it unfitted (compare then follows the probe all the way)."""
    probe = [500e-6, 600e-6, 700e-6, 800e-6, 900e-6, 1000e-6]
    assert fit_probe_elasticity([(p, 0.02 * (p / 800e-6) ** 0.4) for p in probe]) == pytest.approx(0.4)
    assert fit_probe_elasticity([(p, 0.02 * (p / 800e-6) ** 1.5) for p in probe]) == 1.0
    assert fit_probe_elasticity([(p, 0.02 * (800e-6 / p)) for p in probe]) == 0.0
    assert fit_probe_elasticity([(p, 0.02) for p in probe[:5]]) is None
    assert fit_probe_elasticity([(800e-6 * (1 + 0.001 * i), 0.02 * (1 + i)) for i in range(8)]) is None
    # noise on the probe that the work does not share dilutes the slope: half its variance, half the slope
    noisy = [(p * k, 0.02 * p / 800e-6) for p in probe for k in (0.9, 1 / 0.9)]
    spread, noise = np.log(probe).var(), np.log(0.9) ** 2
    assert fit_probe_elasticity(noisy) == pytest.approx(spread / (spread + noise))


def test_a_file_s_probe_elasticities_are_kept_and_refused_out_of_range_or_without_their_probe():
    probes = {"speed_probe_gflops": 50.0, "speed_probe_eager_us": 800.0, "speed_probe_memory_GBps": 20.0}
    powers = {"speed_probe_matmul_elasticity": 0.2, "speed_probe_eager_elasticity": 0.4,
              "speed_probe_memory_elasticity": 0.6}
    spec = parse_cluster(cpu_host(**HOST_KEYS, **probes, **powers), "host.yaml")
    assert {key: getattr(spec, key) for key in powers} == powers
    before = parse_cluster(cpu_host(**HOST_KEYS, **probes), "host.yaml")  # a file calibrated before the fits
    assert [getattr(before, key) for key in powers] == [1.0, 1.0, 1.0]
    with pytest.raises(ConfigError, match="compute.speed_probe_eager_elasticity: is 1.5 .*0 to 1 power"):
        parse_cluster(cpu_host(**HOST_KEYS, **probes, speed_probe_eager_elasticity=1.5), "host.yaml")
    with pytest.raises(ConfigError, match="compute.speed_probe_eager_elasticity: given without the eager probe"):
        parse_cluster(cpu_host(**HOST_KEYS, speed_probe_eager_elasticity=0.5), "host.yaml")
    with pytest.raises(ConfigError, match="compute.speed_probe_memory_elasticity: given without the memory probe"):
        parse_cluster(cpu_host(**HOST_KEYS, speed_probe_gflops=50.0, speed_probe_eager_us=800.0,
                               speed_probe_memory_elasticity=0.5), "host.yaml")
    written = host_cluster(2, 1e-4, 1e9, 1e9, speed_probe=(50e9, 800e-6, 20e9),
                           elasticity={"matmul": 0.2, "eager": 0.0, "memory": None})["compute"]
    # 0 written (work that did not follow its probe at all), None not (compare follows the probe all the way)
    assert (written["speed_probe_matmul_elasticity"], written["speed_probe_eager_elasticity"]) == (0.2, 0.0)
    assert "speed_probe_memory_elasticity" not in written
    # a power is written only beside its probe, so the file loads
    two_probes = host_cluster(2, 1e-4, 1e9, 1e9, speed_probe=(50e9, 800e-6), elasticity={"memory": 0.5})
    assert "speed_probe_memory_elasticity" not in two_probes["compute"]
    assert parse_cluster(two_probes, "host.yaml").speed_probe_memory_elasticity == 1.0
    assert parse_cluster(cpu_host(**HOST_KEYS, **probes, speed_probe_eager_elasticity=0.0),
                         "host.yaml").speed_probe_eager_elasticity == 0.0


def test_a_step_without_communication_runs_in_proportion_to_the_host_speed():
    spec = parse_cluster(cpu_host(**HOST_KEYS, cpu_cores=2), "host.yaml")
    plan = Plan(model=load_model("course-mlp"), dp=1)
    base = predict_step(plan, spec)
    halved = predict_step(plan, spec.at_host_speed(2.0, 2.0))
    assert halved.step_s == pytest.approx(base.step_s / 2, rel=1e-9)
    assert halved.ranks[0].seconds["forward"] == pytest.approx(base.ranks[0].seconds["forward"] / 2, rel=1e-9)
    # A faster host in one respect alone lands in between.
    assert base.step_s / 2 < predict_step(plan, spec.at_host_speed(2.0, 1.0)).step_s < base.step_s


@pytest.mark.parametrize("value, expected", [
    (-5, "collective_step_overhead_us.all_reduce: is -5"),
    ({"1 MiB": 30.0}, "figures keyed by the call's bytes, in KiB"),
    ({1024: -1.0}, "collective_step_overhead_us.all_reduce.1024: is -1"),
])
def test_bad_step_overhead_is_refused(value, expected, capsys, tmp_path):
    data = cpu_host()
    data["collective_step_overhead_us"] = {"all_reduce": value}
    path = tmp_path / "host.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["simulate", "course-ddp", "--dp", "2", "--cluster", str(path)]) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- the model charges them
def test_gpu_clusters_have_no_host_costs():
    for name in ("dgx-h100", "dgx-a100", "pcie-4x-rtx6000ada"):
        spec = load_cluster(name)
        model = ComputeModel.for_cluster(spec, "bf16", 2)
        assert model.time(forward_ops=100, backward_ops=100, optimizer_tensors=10) == 0.0
        assert spec.p2p_rendezvous == ((0, 0.0),) and spec.p2p_latency is None
        assert spec.collective_step_overhead_s == {}
        assert spec.action_overhead == ((0, 0.0),)


def test_a_gpu_runs_its_kernels_while_the_host_issues_the_next():
    """On a GPU a block takes the longer of its kernels and the host's time to issue them; on a CPU rank,
    where the host is the device, the sum."""
    gpu = ComputeModel(peak_flops=989e12, hbm_bw_Bps=3.35e12, dtype_bytes=2, sm_count=132, op_forward_s=7e-6,
                       op_backward_s=5e-6, host_overlaps_device=True)
    big = gpu.matmul_time(8192, 8192, 8192)
    assert gpu.time(matmuls=[(8192, 8192, 8192)], forward_ops=40) == pytest.approx(big)  # the kernels bind
    assert gpu.time(matmuls=[(64, 64, 64)], forward_ops=40, backward_ops=10) == pytest.approx(40 * 7e-6 + 10 * 5e-6)
    cpu = ComputeModel(peak_flops=70e9, hbm_bw_Bps=20e9, dtype_bytes=4, op_forward_s=7e-6)
    assert cpu.time(matmuls=[(64, 64, 64)], forward_ops=40) == pytest.approx(cpu.matmul_time(64, 64, 64) + 40 * 7e-6)


def test_host_costs_on_a_gpu_bind_a_small_model_and_leave_a_big_one():
    with_host = read_yaml(builtin_clusters()["dgx-h100"])
    with_host["compute"].update(op_forward_us=7.0, op_backward_us=5.0, optimizer_tensor_us=2.0)
    spec, bare = parse_cluster(with_host, "h100-host.yaml"), load_cluster("dgx-h100")
    tiny = resolve_plan("tiny-dp2", overrides={"parallel": {"dp": 1}})
    ops = lower(tiny).ops
    host_s = sum(op.forward_ops * 7e-6 + op.backward_ops * 5e-6 + op.optimizer_tensors * 2e-6 for op in ops)
    assert predict_step(tiny, spec).step_s >= host_s > 3 * predict_step(tiny, bare).step_s
    big = Plan(model=load_model("llama3-8b"), dp=8, dtype="bf16")
    assert predict_step(big, spec).step_s == pytest.approx(predict_step(big, bare).step_s, rel=1e-9)


def test_blocks_carry_eager_op_counts_into_the_program():
    plan = resolve_plan("tiny-pp2")
    ops = lower(plan).ops
    forward = [op for op in ops if op.name == "F stage=0 mb=0"]
    backward = [op for op in ops if op.name == "B stage=0 mb=0"]
    assert sum(op.forward_ops for op in forward) == 1 + 2 * (80 + 22)  # embedding + 2 layers (tests/test_eager_ops)
    assert sum(op.backward_ops for op in backward) == 2 + 2 * (93 + 50)
    assert all(op.backward_ops == 0 for op in forward) and all(op.forward_ops == 0 for op in backward)
    step = next(op for op in ops if op.kind == "optimizer")
    assert step.optimizer_tensors > 0 and step.optimizer_steps == 1 and step.stream_bytes == step.hbm_bytes


def test_a_tensor_parallel_pass_counts_its_collective_calls_apart_from_its_ops():
    plan = resolve_plan("course-tp", overrides={"parallel": {"tp": 2}})
    layers = [op for op in lower(plan).ops if op.kind == "compute" and op.rank == 0]
    forward = [op for op in layers if op.phase == "forward"]
    backward = [op for op in layers if op.phase == "backward"]
    assert forward and all(op.tp_calls == (1, 0) for op in forward)  # each layer's all-gather of its output
    assert backward and all(op.tp_calls == (0, 1) for op in backward)  # and its reduce-scatter
    alone = resolve_plan("course-ddp", overrides={"parallel": {"dp": 2}})
    assert all(op.tp_calls == (0, 0) for op in lower(alone).ops)


def test_a_tensor_parallel_call_costs_what_was_measured_or_three_ops():
    spec = parse_cluster(cpu_host(**HOST_KEYS), "host.yaml")
    model = ComputeModel.for_cluster(spec, "fp32", 4)
    assert model.host_time(forward_ops=2, tp_calls=(1, 0)) == pytest.approx((2 + 3) * 7e-6)
    assert model.host_time(backward_ops=4, tp_calls=(0, 1)) == pytest.approx((4 + 3) * 6e-6)
    measured = parse_cluster(cpu_host(**HOST_KEYS, tp_collective_call_us={"forward": 120.0, "backward": 70.0}),
                             "host.yaml")
    assert measured.tp_call_s == pytest.approx((120e-6, 70e-6))
    model = ComputeModel.for_cluster(measured, "fp32", 4)
    assert model.host_time(forward_ops=2, tp_calls=(1, 0)) == pytest.approx(2 * 7e-6 + 120e-6)
    assert model.time(backward_ops=4, tp_calls=(0, 2)) == pytest.approx(4 * 6e-6 + 2 * 70e-6)
    assert measured.at_host_speed(1.0, 2.0).tp_call_s == pytest.approx((60e-6, 35e-6))  # follows the eager probe
    plan = resolve_plan("course-tp", overrides={"parallel": {"tp": 2}})
    slower = predict_step(plan, measured).step_s - predict_step(plan, spec).step_s
    # 4 layers: an all-gather each forward and a reduce-scatter each backward, charged beyond three ops each
    assert slower == pytest.approx(4 * ((120e-6 - 3 * 7e-6) + (70e-6 - 3 * 6e-6)), rel=0.02)


def test_fsdp2_s_host_work_is_charged_on_its_copies_and_its_optimizer_step():
    """Each gather's copy-out pays a unit's unshard, each reduce-scatter's copy-in a unit's reduction, and the
    optimizer step each DTensor parameter's extra; a file without the figures charges none of it."""
    plan = resolve_plan("tiny-dp2", overrides={"data_parallel": {"grad_sync": "fsdp"}})
    ops = lower(plan).rank_ops(0)
    gathers = sum(op.fsdp_calls[0] for op in ops)
    reduces = sum(op.fsdp_calls[1] for op in ops)
    step = next(op for op in ops if op.kind == "optimizer")
    units = len(plan.stage_costs(0))
    assert (gathers, reduces) == (2 * units, units)  # a gather before the forward and the backward; one reduction
    assert step.fsdp_calls == (0, 0, step.optimizer_tensors)
    keys = {"fsdp_unshard_us": 400.0, "fsdp_reduce_us": 250.0, "fsdp_optimizer_tensor_us": 300.0}
    spec = parse_cluster(cpu_host(**HOST_KEYS, **keys), "host.yaml")
    plain = parse_cluster(cpu_host(**HOST_KEYS), "host.yaml")
    with_host, without = predict_step(plan, spec).ranks[0].seconds, predict_step(plan, plain).ranks[0].seconds
    extra, charged = sum(with_host.values()) - sum(without.values()), (
        gathers * 400e-6 + reduces * 250e-6 + step.optimizer_tensors * 300e-6)
    assert 0.95 * charged < extra <= charged  # longer compute hides a little more of the gathers beside it
    assert with_host["optimizer"] - without["optimizer"] == pytest.approx(step.optimizer_tensors * 300e-6)
    assert spec.at_host_speed(1.0, 2.0).fsdp_unshard_s == pytest.approx(200e-6)  # follows the eager probe
    dense = resolve_plan("tiny-dp2")
    assert predict_step(dense, spec).step_s == predict_step(dense, plain).step_s  # DDP: FSDP2 runs nothing


def test_fsdp2_s_hooks_are_charged_on_a_pipelines_passes_that_move_nothing():
    """Under a pipeline a stage gathers once a step and reduces after its last backward; its other passes still
    run FSDP2's hooks around each unit: charged once per unit and pass on its first compute op."""
    plan = resolve_plan("tiny-pp2", overrides={"parallel": {"dp": 2, "pp": 2}, "data_parallel": {"grad_sync": "fsdp"}})
    m = plan.num_microbatches
    for p in range(plan.pp):
        ops = lower(plan).rank_ops(p)
        units = len(plan.stage_costs(p))
        forward, backward = (sum(op.fsdp_passes[k] for op in ops) for k in (0, 1))
        # one forward gathers (the weights stay gathered) and the last backward reduces: the rest pass through
        assert (forward, backward) == ((m - 1) * units, (m - 1) * units)
        assert sum(op.fsdp_calls[0] for op in ops) == units
        assert all(op.kind == "compute" for op in ops if op.fsdp_passes != (0, 0))
    keys = {"fsdp_pass_us": {"forward": 150.0, "backward": 90.0}}
    spec = parse_cluster(cpu_host(**HOST_KEYS, **keys), "host.yaml")
    plain = parse_cluster(cpu_host(**HOST_KEYS), "host.yaml")
    ranks = predict_step(plan, spec).ranks, predict_step(plan, plain).ranks
    units = len(plan.stage_costs(0))
    with_hooks, without = ranks[0][0].seconds, ranks[1][0].seconds
    assert with_hooks["forward"] - without["forward"] == pytest.approx((m - 1) * units * 150e-6)
    assert with_hooks["backward"] - without["backward"] == pytest.approx((m - 1) * units * 90e-6)
    assert spec.at_host_speed(1.0, 2.0).fsdp_pass_s == pytest.approx((75e-6, 45e-6))  # follows the eager probe
    no_pipeline = resolve_plan("tiny-dp2", overrides={"data_parallel": {"grad_sync": "fsdp"}})
    assert not any(op.fsdp_passes != (0, 0) for op in lower(no_pipeline).ops)  # every pass gathers there


def test_on_a_cpu_host_fsdp_s_collectives_run_in_line_with_the_compute():
    """The executor's FSDP2 comm hooks run each gather and reduce-scatter to its end where FSDP2 issues it, so
    on a CPU host the simulator puts them on the compute stream: every second of them is exposed. On a GPU
    they run on streams of their own, partly hidden behind the compute."""
    plan = resolve_plan("tiny-dp2", overrides={"data_parallel": {"grad_sync": "fsdp"}})
    assert {op.stream for op in lower(plan).ops if op.group == "fsdp"} == {"gather", "comm"}
    assert {op.stream for op in lower(plan, fsdp_in_line=True).ops if op.group == "fsdp"} == {"compute"}
    for spec, exposed in ((parse_cluster(cpu_host(**HOST_KEYS), "host.yaml"), True), (ideal_spec(), False)):
        step = predict_step(plan, spec)
        collectives = sum(e.dur_s for e in step.trace.events if e.rank == 0 and e.args.get("group") == "fsdp")
        assert (step.ranks[0].seconds["fsdp"] == pytest.approx(collectives)) is exposed


def test_a_collective_on_the_compute_stream_counts_whole_inside_the_pass_it_holds():
    """A measured CPU step records FSDP's gathers on the compute stream inside the forward's span (the executor's
    hooks run them to their end there), the simulated one between the pass's pieces: both count them as ``fsdp``
    and the pass less them, and the simulated pass stays one span. On a GPU's own stream the gather is hidden."""
    forward = {"phase": "forward", "flops": 1.0}

    def gather(stream: str) -> Event:
        return Event("all_gather fsdp layer=layer.0 stage=0 mb=0 dir=fwd", 0, stream, "collective", 2e-3, 3e-3,
                     {"phase": "fsdp", "group": "fsdp"})

    measured = Trace("measured", 1, [Event("F stage=0 mb=0", 0, "compute", "compute", 0.0, 10e-3, dict(forward)),
                                     gather("compute")])
    simulated = merge_spans(Trace("simulated", 1, [
        Event("F stage=0 mb=0", 0, "compute", "compute", 0.0, 2e-3, dict(forward)), gather("compute"),
        Event("F stage=0 mb=0", 0, "compute", "compute", 5e-3, 5e-3, dict(forward))]))
    assert [(e.name, e.dur_s, e.args.get("flops")) for e in simulated.events if e.kind == "compute"] == [
        ("F stage=0 mb=0", pytest.approx(10e-3), 2.0)]
    for trace in (measured, simulated):
        seconds = breakdown(trace)[0].seconds
        assert seconds["fsdp"] == pytest.approx(3e-3) and seconds["forward"] == pytest.approx(7e-3)
    hidden = Trace("measured", 1, [measured.events[0], gather("gather")])
    assert breakdown(hidden)[0].seconds["fsdp"] == 0.0 and breakdown(hidden)[0].seconds["forward"] == 10e-3


def test_freeing_a_step_s_gradients_shows_as_idle_before_each_rank_s_first_action():
    plan = resolve_plan("course-pp")
    program = lower(plan)
    tensors, nbytes = program.gradients[0]
    assert tensors == 2 and nbytes == pytest.approx(plan.params_per_rank(0) * 4)  # its two layers' weights, fp32
    keys = {"zero_grad_step_us": 5.0, "zero_grad_tensor_us": 0.5, "zero_grad_free_GBps": 160.0}
    spec = parse_cluster(cpu_host(**HOST_KEYS, **keys), "host.yaml")
    model = ComputeModel.for_cluster(spec, "fp32", 4)
    assert model.zero_grad_s(tensors, nbytes) == pytest.approx(5e-6 + 2 * 0.5e-6 + nbytes / 160e9)
    assert spec.at_host_speed(1.0, 2.0).zero_grad_free_Bps == pytest.approx(320e9)  # follows the eager probe
    plain = parse_cluster(cpu_host(**HOST_KEYS), "host.yaml")
    assert ComputeModel.for_cluster(plain, "fp32", 4).zero_grad_s(tensors, nbytes) == 0.0  # not measured
    idle = {name: {r.rank: r.seconds["idle"] for r in predict_step(plan, s).ranks}
            for name, s in (("with", spec), ("without", plain))}
    for rank, (tensors, nbytes) in program.gradients.items():
        assert idle["with"][rank] - idle["without"][rank] == pytest.approx(model.zero_grad_s(tensors, nbytes))


def test_host_costs_slow_a_cpu_step_by_what_they_charge():
    plan = resolve_plan("tiny-pp2")
    base = copy.deepcopy(IDEAL)
    base["gpu"]["peak_tflops"]["fp32"] = 0.07
    plain = predict_step(plan, parse_cluster(base, "cpu.yaml")).step_s
    with_ops = copy.deepcopy(base)
    with_ops["compute"] = {"op_forward_us": 7.0, "op_backward_us": 6.0}
    slowed = predict_step(plan, parse_cluster(with_ops, "cpu.yaml")).step_s
    per_stage = 4 * ((1 + 2 * 102) * 7e-6 + (2 + 2 * 143) * 6e-6)  # 4 microbatches of stage 0, at least
    assert slowed > plain + per_stage


def _one_transfer(spec, sender_busy_s: float, receiver_busy_s: float,
                  gradients: dict[int, tuple[int, float]] | None = None) -> tuple[float, float]:
    """Rank 0 computes, then sends 1 MB to rank 1, which computes, then receives it: (when the send's bytes
    arrived, when the receive ended); ``gradients``: the (tensors, bytes) each rank holds."""
    program = Program(world_size=2)
    program.gradients.update(gradients or {})
    peak = ComputeModel.for_cluster(spec, "fp32", 4).peak_flops
    program.add(0, Op("compute", "compute", "compute", flops=sender_busy_s * peak))
    send = program.add(0, Op("send act stage=0 mb=0 peer=1", "send", "p2p", deps=(0,), ranks=(0, 1), nbytes=1e6,
                             peer=1))
    program.add(1, Op("compute", "compute", "compute", flops=receiver_busy_s * peak))
    program.add(1, Op("recv act stage=0 mb=0 peer=0", "recv", "compute", nbytes=1e6, peer=0, match=send))
    trace = StepSimulator(spec.build(1), ComputeModel.for_cluster(spec, "fp32", 4)).run(program)
    (sent,) = [e for e in trace.events if e.kind == "send"]
    (received,) = [e for e in trace.events if e.kind == "recv"]
    return sent.end_s, received.end_s


def test_a_waiting_receiver_has_its_data_after_the_send_s_own_latency():
    """A CPU host's pipeline transfer takes ``p2p_latency_us`` (measured between bursts of compute) instead of
    the links' latency per step, plus its bytes; a receive posted before the data arrives pays no rendezvous."""
    links = ideal_spec(**{"compute": {"p2p_rendezvous_us": 500.0}})
    own = ideal_spec(**{"compute": {"p2p_rendezvous_us": 500.0, "p2p_latency_us": 300.0}})
    bytes_s = 1e6 / links.intra.bw_Bps
    arrived, received = _one_transfer(links, 1e-3, 0.0)
    assert arrived == pytest.approx(1e-3 + links.intra.latency_s + bytes_s, rel=1e-9) and received == arrived
    arrived, received = _one_transfer(own, 1e-3, 0.0)
    assert arrived == pytest.approx(1e-3 + 300e-6 + bytes_s, rel=1e-9) and received == arrived


def test_a_receive_posted_after_its_data_arrived_pays_the_rendezvous():
    """gloo moves a message only once its receiver asks: a late receive ends ``p2p_rendezvous_us`` after it
    begins."""
    spec = ideal_spec(**{"compute": {"p2p_rendezvous_us": 500.0, "p2p_latency_us": 300.0}})
    arrived, received = _one_transfer(spec, 0.0, 5e-3)
    assert arrived < 5e-3 and received == pytest.approx(5e-3 + 500e-6, rel=1e-9)


def test_a_transfer_s_host_costs_are_read_off_the_gradients_its_receiver_holds():
    """Given by KiB of gradients (they grow with the weights the stages' passes stream), a late receive's
    rendezvous and a waiting receive's latency take the receiver's point: rank 1 holds 512 KiB, its sender 4 MiB."""
    spec = ideal_spec(**{"compute": {"p2p_rendezvous_us": {512: 100.0, 4096: 500.0},
                                     "p2p_latency_us": {512: 80.0, 4096: 300.0}}})
    gradients = {0: (4, 4096 * 1024), 1: (4, 512 * 1024)}
    arrived, received = _one_transfer(spec, 0.0, 5e-3, gradients)
    assert arrived < 5e-3 and received == pytest.approx(5e-3 + 100e-6, rel=1e-9)
    arrived, received = _one_transfer(spec, 1e-3, 0.0, gradients)
    assert arrived == pytest.approx(1e-3 + 80e-6 + 1e6 / spec.intra.bw_Bps, rel=1e-9) and received == arrived
    # a receiver whose gradients are not known: the most the figures give
    assert _one_transfer(spec, 0.0, 5e-3)[1] == pytest.approx(5e-3 + 500e-6, rel=1e-9)


def test_the_loop_s_time_before_each_action_shows_as_idle():
    """Before each pass, each gradient all-reduce the loop issues in turn and the optimizer step, the host's
    loop runs ``action_overhead_us``: the step grows by it per action, and only the idle time does."""
    plan = Plan(model=load_model("course-mlp"), dp=2, grad_sync="per_param")
    base = predict_step(plan, ideal_spec())
    slowed = predict_step(plan, ideal_spec(**{"compute": {"action_overhead_us": 1000.0}}))
    actions = 1 + 1 + 4 + 1  # forward, backward, an all-reduce per parameter, the optimizer step
    assert slowed.step_s == pytest.approx(base.step_s + actions * 1e-3, rel=1e-6)
    before, after = base.ranks[0].seconds, slowed.ranks[0].seconds
    assert after["idle"] == pytest.approx(before["idle"] + actions * 1e-3, rel=1e-6)
    assert all(after[p] == pytest.approx(before[p]) for p in ("forward", "backward", "dp", "optimizer"))
    pipelined = resolve_plan("course-pp")
    idle_before = [b.seconds["idle"] for b in predict_step(pipelined, ideal_spec()).ranks]
    gapped = predict_step(pipelined, ideal_spec(**{"compute": {"action_overhead_us": 1000.0}}))
    assert all(b.seconds["idle"] > idle for b, idle in zip(gapped.ranks, idle_before))


def test_calibrate_s_host_costs_by_gradients_load_back_as_written():
    """A curve by KiB of gradients is written keyed by its sizes; one point at 0 (no size measured: the pipeline
    loop's figure for every rank) as one figure, since a file's keys are sizes: both load back."""
    curve = ((4096, 27e-6), (16384, 85e-6))
    written = host_cluster(2, 1e-4, 1e9, 1e9, action_overhead_s=curve, p2p_issue_s=((0, 40e-6),),
                           p2p_rendezvous_s=((128, 90e-6), (4608, 200e-6)), p2p_latency_s=((128, 95e-6),))
    assert written["compute"]["action_overhead_us"] == {4096: pytest.approx(27.0), 16384: pytest.approx(85.0)}
    assert written["compute"]["p2p_issue_us"] == pytest.approx(40.0)
    assert written["compute"]["p2p_rendezvous_us"] == {128: pytest.approx(90.0), 4608: pytest.approx(200.0)}
    spec = parse_cluster(written, "host.yaml")
    assert spec.action_overhead == ((4096, pytest.approx(27e-6)), (16384, pytest.approx(85e-6)))
    assert spec.p2p_issue == ((0, pytest.approx(40e-6)),)
    assert spec.p2p_rendezvous == ((128, pytest.approx(90e-6)), (4608, pytest.approx(200e-6)))
    assert spec.p2p_latency == ((128, pytest.approx(95e-6)),)


def test_the_loop_s_time_before_each_action_is_read_off_at_the_gradients_each_rank_holds():
    """Given by the gradients a rank holds (a step that streams more memory leaves the loop's Python colder), each
    rank's time before an action is read off the points, linear in the log of its gradients, and held at the end
    points beyond them; the eager probe scales every point."""
    curve = {1024: 20.0, 4096: 60.0, 16384: 100.0}  # KiB -> us
    compute = ComputeModel.for_cluster(ideal_spec(**{"compute": {"action_overhead_us": curve}}), "fp32", 4)
    assert compute.action_gap_s(2048 * 1024) == pytest.approx(40e-6)  # halfway in log between 1 and 4 MiB
    assert compute.action_gap_s(4096 * 1024) == pytest.approx(60e-6)
    assert (compute.action_gap_s(100 * 1024), compute.action_gap_s(1 << 40)) == pytest.approx((20e-6, 100e-6))
    assert compute.action_gap_s() == pytest.approx(100e-6)  # not known: the coldest
    spec = ideal_spec(**{"compute": {"action_overhead_us": curve}})
    assert spec.at_host_speed(1.0, 0.5).action_overhead == ((1024, pytest.approx(40e-6)), (4096, pytest.approx(
        120e-6)), (16384, pytest.approx(200e-6)))
    # course DDP's ranks hold 4 x 4 MiB of fp32 gradients, its data-parallel ranks on 2 pipeline stages half that
    plan = Plan(model=load_model("course-mlp"), dp=2, grad_sync="per_param")
    base, slowed = (predict_step(plan, ideal_spec(**extra)) for extra in ({}, {"compute": {"action_overhead_us":
                                                                                               curve}}))
    actions = 1 + 1 + 4 + 1  # forward, backward, an all-reduce per parameter, the optimizer step
    assert slowed.step_s == pytest.approx(base.step_s + actions * 100e-6, rel=1e-6)
    staged = resolve_plan("course-pp")
    flat = predict_step(staged, ideal_spec(**{"compute": {"action_overhead_us": 80.0}}))
    read = predict_step(staged, ideal_spec(**{"compute": {"action_overhead_us": {8192: 80.0, 16384: 200.0}}}))
    assert read.step_s == pytest.approx(flat.step_s, rel=1e-9)  # 8 MiB a rank: the first point's 80 us
    # a send's issue likewise (its ranks hold 8 MiB: beyond the last point), and halfway in log between two
    flat = predict_step(staged, ideal_spec(**{"compute": {"p2p_issue_us": 300.0}}))
    read = predict_step(staged, ideal_spec(**{"compute": {"p2p_issue_us": {1024: 100.0, 4096: 300.0}}}))
    assert read.step_s == pytest.approx(flat.step_s, rel=1e-9)
    assert ComputeModel.for_cluster(ideal_spec(**{"compute": {"p2p_issue_us": {1024: 100.0, 4096: 300.0}}}),
                                    "fp32", 4).send_issue_s(2048 * 1024) == pytest.approx(200e-6)


def test_a_pass_after_its_receive_waits_for_the_loop_again():
    """The loop's Python runs between a receive's end and its pass (the executor's ``_F`` and ``_B``): each pass
    of a pipeline's later stage begins ``action_overhead_us`` after its receive ends, as the receive began that
    long after the pass before."""
    trace = predict_step(resolve_plan("course-pp"), ideal_spec(**{"compute": {"action_overhead_us": 1000.0}})).trace
    events = {e.name: e for e in trace.events if e.rank == 1}
    for mb in range(4):
        received = events[f"recv act stage=0 mb={mb} peer=0"]
        assert events[f"F stage=1 mb={mb}"].start_s == pytest.approx(received.end_s + 1e-3, rel=1e-9)
    assert events["recv act stage=0 mb=1 peer=0"].start_s == pytest.approx(events["F stage=1 mb=0"].end_s + 1e-3)


def test_each_send_s_issue_delays_the_rank_s_next_action():
    """The loop issues a pass's sends before it moves on: the next action starts ``action_overhead_us`` plus
    ``p2p_issue_us`` per send after the pass ends (the transfer itself leaves at the pass's end)."""
    spec = ideal_spec(**{"compute": {"action_overhead_us": 100.0, "p2p_issue_us": 400.0,
                                     "p2p_latency_us": 300.0}})
    compute = ComputeModel.for_cluster(spec, "fp32", 4)
    program = Program(world_size=2)
    first = program.add(0, Op("F stage=0 mb=0", "compute", "compute", flops=1e-3 * compute.peak_flops,
                              opens_action=True))
    sends = [program.add(0, Op(f"send act stage=0 mb={mb} peer=1", "send", "p2p", deps=(first,), ranks=(0, 1),
                               nbytes=1e3, peer=1)) for mb in range(2)]
    program.add(0, Op("B stage=0 mb=0", "compute", "compute", flops=1e-3 * compute.peak_flops, opens_action=True))
    for mb, send in enumerate(sends):
        program.add(1, Op(f"recv act stage=0 mb={mb} peer=0", "recv", "compute", nbytes=1e3, peer=0, match=send,
                          opens_action=mb == 0))
    trace = StepSimulator(spec.build(1), compute).run(program)
    events = {e.name: e for e in trace.events}
    assert events["F stage=0 mb=0"].start_s == pytest.approx(100e-6)
    assert events["B stage=0 mb=0"].start_s == pytest.approx(100e-6 + 1e-3 + 100e-6 + 2 * 400e-6)
    assert events["send act stage=0 mb=0 peer=1"].start_s == pytest.approx(1.1e-3)
    assert events["recv act stage=0 mb=0 peer=0"].end_s == pytest.approx(
        1.1e-3 + 300e-6 + 1e3 / spec.intra.bw_Bps, rel=1e-6)


@pytest.mark.parametrize("reduce_bytes", [1e3, 1e9])
def test_sends_issued_while_the_loop_waits_for_a_hook_s_all_reduce_are_covered_by_the_wait(reduce_bytes):
    """After its last backward the loop issues the pass's sends, then waits for the gradient all-reduce a backward
    hook launched, then steps the optimizer: the issues run while it waits, so the optimizer starts the loop's gap
    after the later of the all-reduce's end and the issues' (a short all-reduce: the issues; a long one: its end)."""
    spec = ideal_spec(**{"compute": {"action_overhead_us": 100.0, "p2p_issue_us": 400.0}})
    compute = ComputeModel.for_cluster(spec, "fp32", 4)
    program = Program(world_size=2)
    sends = []
    for rank in (0, 1):
        backward = program.add(rank, Op("B stage=1 mb=0", "compute", "compute", flops=1e-3 * compute.peak_flops,
                                        opens_action=True))
        if rank == 0:
            sends = [program.add(0, Op(f"send grad stage=1 mb={mb} peer=1", "send", "p2p", deps=(backward,),
                                       ranks=(0, 1), nbytes=1e3, peer=1)) for mb in range(2)]
        reduce = program.add(rank, Op("all_reduce dp bucket=0", "collective", "comm", deps=(backward,),
                                      collective="all_reduce", group="dp", ranks=(0, 1), nbytes=reduce_bytes))
        program.add(rank, Op("optimizer step", "optimizer", "compute", deps=(reduce,), opens_action=True))
    for mb, send in enumerate(sends):
        program.add(1, Op(f"recv grad stage=1 mb={mb} peer=0", "recv", "compute", nbytes=1e3, peer=0, match=send))
    trace = StepSimulator(spec.build(1), compute).run(program)
    events = {(e.rank, e.name): e for e in trace.events}
    backward_end = events[0, "B stage=1 mb=0"].end_s
    reduce_end = events[0, "all_reduce dp bucket=0"].end_s
    assert events[0, "optimizer step"].start_s == pytest.approx(max(reduce_end, backward_end + 2 * 400e-6) + 100e-6)
    assert events[1, "optimizer step"].start_s == pytest.approx(events[1, "all_reduce dp bucket=0"].end_s + 100e-6)
    if reduce_bytes > 1e6:
        assert reduce_end > backward_end + 1e-3  # the long all-reduce's wait covered both issues


def _static_memory(bw_GBps: float, **compute) -> object:
    """A CPU host whose every core streams at ``bw_GBps``, however many stream at once."""
    data = cpu_host(**HOST_KEYS, **compute)
    data["gpu"]["hbm_bw_GBps"] = bw_GBps
    return parse_cluster(data, "host.yaml")


@pytest.mark.parametrize("plan, cores, alone, host, each", [
    # one rank streams alone: its core's speed
    (Plan(model=load_model("course-mlp"), dp=1), None, 30.0, 45.0, 30.0),
    # two data-parallel replicas step at once: they split the host's speed ...
    (Plan(model=load_model("course-mlp"), dp=2), None, 30.0, 45.0, 22.5),
    # ... up to a core's speed each
    (Plan(model=load_model("course-mlp"), dp=2), None, 20.0, 100.0, 20.0),
    # four ranks on two cores: each core streams at min(alone, host / 2), its two ranks taking turns
    (Plan(model=load_model("course-mlp"), dp=4), 2, 30.0, 100.0, 30.0),
    (Plan(model=load_model("course-mlp"), dp=4), 2, 60.0, 100.0, 50.0),
])
def test_ranks_streaming_at_once_share_the_host_s_memory(plan, cores, alone, host, each):
    """A step whose ranks all stream at the same moments takes exactly as long as on a host where every core
    streams at ``each`` = min(a core's speed alone, the host's / the cores streaming)."""
    cores = {"cpu_cores": cores} if cores else {}
    shared = predict_step(plan, parse_cluster(cpu_host(**HOST_KEYS, **cores, memory_alone_bw_GBps=alone,
                                                       memory_host_bw_GBps=host), "host.yaml"))
    static = predict_step(plan, _static_memory(each, **cores))
    assert shared.step_s == pytest.approx(static.step_s, rel=1e-9)
    assert shared.ranks[0].seconds == pytest.approx(static.ranks[0].seconds, rel=1e-9)


def test_a_pipeline_s_stages_stream_faster_when_they_step_apart():
    """course PP's stages finish their backward at different times: each optimizer step runs at least as fast
    as with both ranks streaming, no faster than alone, and one of them faster than shared."""
    plan = resolve_plan("course-pp")
    shared = predict_step(plan, parse_cluster(cpu_host(**HOST_KEYS, memory_alone_bw_GBps=40.0,
                                                       memory_host_bw_GBps=40.0), "host.yaml"))
    both, alone = predict_step(plan, _static_memory(20.0)), predict_step(plan, _static_memory(40.0))
    steps = [(r.seconds["optimizer"], b.seconds["optimizer"], a.seconds["optimizer"])
             for r, b, a in zip(shared.ranks, both.ranks, alone.ranks)]
    assert all(a - 1e-12 <= s <= b + 1e-12 for s, b, a in steps)
    assert any(s < b * 0.95 for s, b, _ in steps)


def test_in_step_collective_overhead_is_charged_per_call():
    plan = Plan(model=load_model("course-mlp"), dp=2, grad_sync="per_param")
    base = predict_step(plan, ideal_spec())
    data = copy.deepcopy(IDEAL)
    data["collective_step_overhead_us"] = {"all_reduce": 1000.0}
    slowed = predict_step(plan, parse_cluster(data, "ideal.yaml"))
    assert slowed.step_s == pytest.approx(base.step_s + 4 * 1e-3, rel=0.01)  # one per parameter, in a row


@pytest.mark.parametrize("points, expected_us", [
    ({1024: 300.0, 16384: 100.0}, 200.0),  # course-mlp's gradients are 4 MiB each: between the two figures...
    ({1024: 500.0, 4096: 200.0}, 200.0),  # ... at one ...
    ({256: 600.0, 1024: 400.0}, 400.0),  # ... past the last
])
def test_in_step_collective_overhead_is_read_at_the_call_s_size(points, expected_us):
    """By size, linear in log2 of the size between the points (4 MiB is halfway from 1 to 16 MiB)."""
    plan = Plan(model=load_model("course-mlp"), dp=2, grad_sync="per_param")
    base = predict_step(plan, ideal_spec())
    data = copy.deepcopy(IDEAL)
    data["collective_step_overhead_us"] = {"all_reduce": points}
    slowed = predict_step(plan, parse_cluster(data, "ideal.yaml"))
    assert slowed.step_s == pytest.approx(base.step_s + 4 * expected_us * 1e-6, rel=0.01)


PROBE_US = {256: 250.0, 1024: 400.0, 4096: 1600.0}  # a calibrated collective probe


@pytest.mark.parametrize("kib, extra_us", [
    (128, 125.0),  # below the smallest size: the smallest's extra per byte (250 us per 256 KiB)
    (1024, 400.0),  # at a size: what the probe took more
    (2048, 500.0),  # between two: per byte, linear in log2 of the size (0.39 and 0.098 us a KiB: 0.244)
    (8192, 800.0),  # past the largest: its extra per byte
])
def test_a_collective_takes_what_the_probe_takes_more_per_byte(kib, extra_us):
    spec = parse_cluster(cpu_host(**HOST_KEYS, collective_probe_us=PROBE_US), "host.yaml")
    # an all-reduce on 2 ranks (its bus bytes its size) that took 1 s at calibration
    assert spec.collective_now_s(1.0, "all_reduce", 2, kib * 1024) == 1.0  # no reading around a run: as calibrated
    now = spec.at_collective_probe(((256, 500e-6), (1024, 800e-6), (4096, 2000e-6)))
    assert now.collective_now_s(1.0, "all_reduce", 2, kib * 1024) == pytest.approx(1.0 + extra_us * 1e-6)
    with pytest.raises(ParsimError, match="positive"):
        spec.at_collective_probe(((1024, 0.0),))


def test_a_step_s_collectives_take_what_the_probe_took_more_and_no_less_than_a_quarter():
    """course-mlp's gradients, four all-reduces of 4 MiB in a row (bus bytes 4 MiB on 2 ranks): the probe 1.6 ms
    slower at 4 MiB puts 1.6 ms on each; the compute does not move. A probe far faster than at calibration leaves
    each at a quarter of its calibrated time (FASTEST_AFTER_PROBE)."""
    from parsim.hardware.cluster import FASTEST_AFTER_PROBE

    plan = Plan(model=load_model("course-mlp"), dp=2, grad_sync="per_param")
    spec = parse_cluster(cpu_host(**HOST_KEYS, collective_probe_us=PROBE_US), "host.yaml")
    base = predict_step(plan, spec)
    slowed = predict_step(plan, spec.at_collective_probe(((1024, 400e-6), (4096, 3200e-6))))
    assert slowed.ranks[0].seconds["dp"] == pytest.approx(base.ranks[0].seconds["dp"] + 4 * 1.6e-3, rel=1e-6)
    assert slowed.ranks[0].seconds["backward"] == pytest.approx(base.ranks[0].seconds["backward"], rel=1e-9)
    faster = predict_step(plan, spec.at_collective_probe(((1024, 400e-6), (4096, 1e-6))))
    assert faster.ranks[0].seconds["dp"] == pytest.approx(FASTEST_AFTER_PROBE * base.ranks[0].seconds["dp"],
                                                          rel=1e-6)


def test_more_ranks_than_cores_time_share_them():
    spec = parse_cluster(cpu_host(**HOST_KEYS, cpu_cores=2), "host.yaml")
    two, four = (ComputeModel.for_cluster(spec, "fp32", 4, ranks) for ranks in (2, 4))
    assert two.time_share == 1.0 and four.time_share == 2.0
    assert four.time(matmuls=((64, 1024, 1024),), forward_ops=100) == pytest.approx(
        2 * two.time(matmuls=((64, 1024, 1024),), forward_ops=100))
    assert four.rendezvous_s() == pytest.approx(2 * 150e-6)
    dp = resolve_plan("tiny-pp2", overrides={"parallel": {"dp": 2}})
    shared = predict_step(dp, spec).step_s
    alone = predict_step(dp, parse_cluster(cpu_host(**HOST_KEYS), "host.yaml")).step_s
    assert shared > 1.5 * alone


@pytest.mark.parametrize("ranks, shared, expected", [
    (2, True, (150e-6, 100e-6, 40e-6)),  # a core each: the figures alone
    (4, False, (300e-6, 200e-6, 80e-6)),  # two ranks per core, not measured: stretched like compute
    (4, True, (2500e-6, 300e-6, 400e-6)),  # two ranks per core, measured
    (3, True, (1325e-6, 200e-6, 220e-6)),  # 1.5 ranks per core: halfway
    (8, True, (5000e-6, 600e-6, 800e-6)),  # four per core: the measured figures stretched 2x
])
def test_pipeline_host_costs_on_shared_cores_take_what_was_measured_there(ranks, shared, expected):
    keys = {**HOST_KEYS, "p2p_latency_us": 100.0, "cpu_cores": 2, **({"shared_cores": SHARED} if shared else {})}
    model = ComputeModel.for_cluster(parse_cluster(cpu_host(**keys), "host.yaml"), "fp32", 4, ranks)
    assert (model.rendezvous_s(), model.send_latency_s(), model.action_gap_s()) == pytest.approx(expected)


@pytest.mark.parametrize("ranks, matmul, eager", [(2, 1.0, 1.0), (3, 1.65, 1.8), (4, 2.3, 2.6), (8, 4.6, 5.2)])
def test_compute_on_shared_cores_stretches_by_what_was_measured_there(ranks, matmul, eager):
    """Two ranks per core computing at once, measured: a matmul took 2.3x and an eager pass 2.6x as long as
    with a core each. Kernels stretch by the first, the ops' fixed costs by the second (halfway at 1.5 per
    core, in proportion beyond two)."""
    shared = {**SHARED, "matmul_stretch": 2.3, "eager_stretch": 2.6}
    spec = parse_cluster(cpu_host(**HOST_KEYS, cpu_cores=2, shared_cores=shared), "host.yaml")
    alone, model = (ComputeModel.for_cluster(spec, "fp32", 4, n) for n in (2, ranks))
    kernels, host = alone.time(matmuls=((64, 1024, 1024),)), alone.time(forward_ops=100)
    assert model.time(matmuls=((64, 1024, 1024),), forward_ops=100) == pytest.approx(matmul * kernels + eager * host)
    assert parse_cluster(cpu_host(**HOST_KEYS, cpu_cores=2, shared_cores=shared), "h.yaml").shared_cores.to_mapping() \
        == pytest.approx({**SHARED, "p2p_issue_us": 0.0, "matmul_stretch": 2.3, "eager_stretch": 2.6})


@pytest.mark.parametrize("ranks, expected", [(2, 150e-6), (3, 525e-6), (4, 900e-6), (8, 1800e-6)])
def test_a_send_s_issue_on_shared_cores_takes_what_was_measured_there(ranks, expected):
    keys = {**HOST_KEYS, "p2p_issue_us": 150.0, "cpu_cores": 2, "shared_cores": {**SHARED, "p2p_issue_us": 900.0}}
    model = ComputeModel.for_cluster(parse_cluster(cpu_host(**keys), "host.yaml"), "fp32", 4, ranks)
    assert model.send_issue_s() == pytest.approx(expected)


def _two_ranks_on_one_core(**compute_keys) -> tuple[object, ComputeModel, Program]:
    """A host of one core running two ranks, each with half a millisecond of work alone."""
    spec = parse_cluster(cpu_host(**HOST_KEYS, cpu_cores=1, **compute_keys), "host.yaml")
    compute = ComputeModel.for_cluster(spec, "fp32", 4, 2)
    flops = 0.5e-3 * spec.gpu.peak_flops["fp32"]
    assert compute.with_core_each().time(flops=flops) == pytest.approx(0.5e-3)
    program = Program(2)
    for rank in (0, 1):
        program.add(rank, Op("F stage=0 mb=0", "compute", "compute", flops=flops, phase="forward"))
        program.replicas[rank] = (rank,)
    return spec, compute, program


def _ends(spec, compute: ComputeModel, program: Program, take_turns: bool) -> list[float]:
    trace = StepSimulator(spec.build(1), compute, take_turns=take_turns).run(program)
    return sorted(e.start_s + e.dur_s for e in trace.events)


def test_ranks_on_one_core_take_turns_rather_than_stretch():
    """Work shorter than the scheduler's slice (0.75 ms on one CPU): taking turns, one rank ends after its half
    millisecond, the other after its own; stretched, both at once."""
    spec, compute, program = _two_ranks_on_one_core()
    assert _ends(spec, compute, program, take_turns=True) == pytest.approx([0.5e-3, 1e-3])
    assert _ends(spec, compute, program, take_turns=False) == pytest.approx([1e-3, 1e-3])


def test_a_cluster_file_s_time_slice_sets_the_turns():
    """``shared_cores.time_slice_us: 100``: the two ranks' half milliseconds alternate in five slices each, so
    the first ends a slice before the second."""
    spec, compute, program = _two_ranks_on_one_core(shared_cores={**SHARED, "time_slice_us": 100.0})
    assert spec.shared_cores.time_slice_s == pytest.approx(100e-6)
    assert _ends(spec, compute, program, take_turns=True) == pytest.approx([0.9e-3, 1e-3])


def test_a_plan_with_more_ranks_than_cores_simulates_every_rank_and_its_turns():
    """tiny-gpt's data- x pipeline-parallel plan, 4 ranks on 2 cores: every rank is simulated, and a stage's two
    replicas, which share a core, spend their step differently; with a core each, one rank per stage."""
    plan = resolve_plan("tiny-pp2", overrides={"parallel": {"dp": 2}})
    shared = predict_step(plan, parse_cluster(cpu_host(**HOST_KEYS, cpu_cores=2), "host.yaml"))
    assert [b.rank for b in shared.ranks] == [0, 1, 2, 3]
    assert shared.ranks[0].seconds != shared.ranks[2].seconds
    assert shared.takes_turns
    own = predict_step(plan, parse_cluster(cpu_host(**HOST_KEYS, cpu_cores=4), "host.yaml"))
    assert [b.rank for b in own.ranks] == [0, 1] and not own.takes_turns
    pipeline = resolve_plan("tiny-pp2", overrides={"parallel": {"pp": 4}})  # one rank per stage, two on a core
    assert predict_step(pipeline, parse_cluster(cpu_host(**HOST_KEYS, cpu_cores=2), "host.yaml")).takes_turns


def test_a_collective_among_ranks_on_one_core_takes_the_figures_measured_there():
    """tiny-dp2 on a one-core host: its gradient all-reduces run between two processes on that core, 0.5 ms plus
    the bucket's bytes at 1.25 GB/s (the first rank woken has its core at once; the other waits its turn);
    without the one-core figures, over the links fitted between cores."""
    plan = resolve_plan("tiny-dp2")
    one_core = {**SHARED, "one_core_collective_latency_us": 500.0, "one_core_collective_GBps": 1.25}

    def first_bucket(shared: dict) -> list:
        predicted = predict_step(plan, parse_cluster(cpu_host(**HOST_KEYS, cpu_cores=1, shared_cores=shared), "h.yaml"))
        return [e for e in predicted.trace.events if e.name == "all_reduce dp bucket=0"]

    buckets = first_bucket(one_core)
    assert min(e.dur_s for e in buckets) == pytest.approx(0.5e-3 + buckets[0].args["bytes"] / 1.25e9)
    assert min(e.dur_s for e in first_bucket(SHARED)) != pytest.approx(min(e.dur_s for e in buckets))


def test_one_core_collectives_scale_their_bytes_as_nccl_tests_bus_bandwidth():
    spec = parse_cluster(cpu_host(**HOST_KEYS, shared_cores={**SHARED, "one_core_collective_latency_us": 100.0,
                                                               "one_core_collective_GBps": 2.0}), "h.yaml")
    shared = spec.shared_cores
    assert shared.one_core_collective_s("all_reduce", 2, 1e6) == pytest.approx(100e-6 + 1e6 / 2e9)
    assert shared.one_core_collective_s("all_gather", 4, 1e6) == pytest.approx(100e-6 + 0.75e6 / 2e9)
    assert shared.to_mapping()["one_core_collective_GBps"] == pytest.approx(2.0)
    assert parse_cluster(cpu_host(**HOST_KEYS, shared_cores=SHARED), "h.yaml").shared_cores.one_core_collective_s(
        "all_reduce", 2, 1e6) is None


def test_simulate_prints_every_rank_that_takes_turns(tmp_path, capsys):
    (tmp_path / "host.yaml").write_text(yaml.safe_dump(cpu_host(**HOST_KEYS, cpu_cores=2)))
    assert main(["simulate", "tiny-pp2", "--dp", "2", "--cluster", str(tmp_path / "host.yaml")]) == 0
    out = capsys.readouterr().out
    assert "time by phase, per rank (more ranks than the host's cores" in out
    assert all(f"pp {rank % 2} (rank {rank})" in out for rank in range(4))


def test_a_time_shared_pipeline_pays_the_shared_core_costs():
    plan = resolve_plan("tiny-pp2", overrides={"parallel": {"dp": 2}})
    keys = {**HOST_KEYS, "p2p_latency_us": 100.0, "cpu_cores": 2}
    stretched = predict_step(plan, parse_cluster(cpu_host(**keys), "host.yaml"))
    measured = predict_step(plan, parse_cluster(cpu_host(**keys, shared_cores=SHARED), "host.yaml"))
    assert measured.step_s > stretched.step_s
    # the loop's time between actions, and the waits on the ranks it delays, grow (which rank waits where
    # depends on the order the ranks take their turns on each core)
    waited = [sum(b.seconds["idle"] + b.seconds["pp"] for b in p.ranks) for p in (measured, stretched)]
    assert waited[0] > waited[1]
    two_ranks = resolve_plan("tiny-pp2")  # a core each: unchanged
    assert predict_step(two_ranks, parse_cluster(cpu_host(**keys, shared_cores=SHARED), "host.yaml")).step_s == \
        predict_step(two_ranks, parse_cluster(cpu_host(**keys), "host.yaml")).step_s


def test_a_plan_too_small_to_hide_the_host_is_flagged_on_a_gpu_cluster_without_host_costs(capsys, tmp_path):
    """tiny-gpt's ~1,000 eager ops take longer to issue than its kernels run on an H100; a big plan's do not;
    a file with measured host costs prices the host instead of flagging it."""
    assert main(["simulate", "tiny-dp2", "--cluster", "dgx-h100"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "too short to hide the host" in line]
    assert len(notes) == 1 and "calibrate --ranks 1" in notes[0]
    # One rank's ops per step (parsim/lowering/eager_ops.py): the embedding 1 + 2; each of 4 layers, attention 42 + 71
    # with RoPE on queries and keys 2 x (19 + 9) and GQA's 0 + 4, SwiGLU 22 + 50; the head 16 + 31.
    ops = 3 + 4 * (113 + 56 + 4 + 72) + 47
    assert f"issuing its ~{ops:,} eager ops per step takes about 10.3 ms at 10 us each" in notes[0]
    with_host = read_yaml(builtin_clusters()["dgx-h100"])
    with_host["compute"].update(op_forward_us=9.0, op_backward_us=11.0)
    path = tmp_path / "h100-host.yaml"
    path.write_text(yaml.safe_dump(with_host))
    for plan, cluster in (("tiny-dp2", str(path)), ("llama3-8b-fsdp8", "dgx-h100")):
        assert main(["simulate", plan, "--cluster", cluster]) == 0
        assert "too short to hide the host" not in capsys.readouterr().err


def test_every_compute_key_of_a_cluster_file_is_documented():
    from pathlib import Path

    from parsim.hardware.cluster import COMPUTE_KEYS

    text = (Path(__file__).parents[1] / "docs" / "clusters.md").read_text()
    assert [key for key in COMPUTE_KEYS if f"`compute.{key}`" not in text] == []
