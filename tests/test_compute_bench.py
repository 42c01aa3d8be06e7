"""The CPU compute microbenchmarks run on gloo ranks as ``parsim calibrate`` runs them, and their fits read them."""

from __future__ import annotations

import statistics

import pytest

from parsim.calibrate.host import fit_alone_memory, fit_optimizer, fit_rank_jitter, fit_tp_calls
from parsim.lowering.lower import ADAMW_ACCESSES

pytest.importorskip("torch")

# The large run and the one alone: bytes enough to outweigh the fixed costs (with 2 x 64K parameters a loaded
# host once timed the large step below the one-tensor step, and the fit found no bandwidth term).
RUNS, ALONE = ((1, 256), (16, 256), (2, 1 << 18)), (2, 1 << 18)


def host_optimizer(rank: int, world: int) -> dict:
    from executor.compute_bench import measure_host_optimizer

    return measure_host_optimizer(RUNS, ALONE)


@pytest.mark.multiproc
def test_adamw_is_timed_on_every_rank_at_once_and_on_each_rank_alone():
    from executor.launch import launch

    per_rank = launch(host_optimizer, 2, backend="gloo", timeout_s=120)
    for rows in per_rank:
        assert [row[:2] for row in rows["together"]] == list(RUNS)
        assert [row[:2] for row in rows["alone"]] == [ALONE]  # each rank times its own turn
        assert all(row[2] > 0 for row in rows["together"] + rows["alone"])
    fit = fit_optimizer([row for rows in per_rank for row in rows["together"]], ADAMW_ACCESSES)
    assert fit_alone_memory([row for rows in per_rank for row in rows["alone"]], fit, ADAMW_ACCESSES) > 0


def rank_jitter(rank: int, world: int) -> list[float]:
    from executor.compute_bench import measure_rank_jitter

    # steps of 2 x 256K parameters (about 2 ms here): with 2 x 64K a cold first step or two of 3 ms outweighed
    # the steady 0.6 ms ones, and the fitted jitter once came out above the median step
    return measure_rank_jitter(repeats=9, run=(2, 1 << 18))


@pytest.mark.multiproc
def test_the_same_adamw_steps_are_timed_on_every_rank_started_together():
    from executor.launch import launch

    per_rank = launch(rank_jitter, 2, backend="gloo", timeout_s=120)
    assert [len(times) for times in per_rank] == [9, 9] and all(t > 0 for times in per_rank for t in times)
    assert 0 < fit_rank_jitter([per_rank]) < 1


@pytest.mark.multiproc
def test_the_pipeline_s_host_costs_are_timed_with_two_ranks_on_each_core():
    from executor.compute_bench import ONE_CORE_SIZES, measure_on_shared_cores

    rows = measure_on_shared_cores(timeout_s=120, pipeline_steps=8)
    assert len(rows) in (2, 4)  # 2 cores (or 1) shared by twice as many ranks
    for row in rows:
        assert set(row["pipeline"]) == {"action", "issue", "rendezvous", "latency"}
        assert min(row["pipeline"].values()) > 0 and row["step_gaps"] > 0
        assert min(row["speed_probe"]) > 0
    # the late rank of each pair on one core times the all-reduce at each size
    late = [row["one_core_allreduce"] for row in rows[len(rows) // 2:]]
    assert all([n for n, _ in sizes] == list(ONE_CORE_SIZES) and min(t for _, t in sizes) > 0 for sizes in late)
    assert all(row["one_core_allreduce"] is None for row in rows[:len(rows) // 2])
    # one rank per core probes alone too, in turn with every rank at once
    assert [row["speed_probe_alone"] is not None for row in rows] == [r < len(rows) // 2 for r in range(len(rows))]


@pytest.mark.multiproc
def test_the_generic_pipeline_is_run_with_a_core_per_rank_then_with_two_ranks_on_each_core():
    from executor.compute_bench import measure_generic_pipeline
    from executor.launch import usable_cores
    from parsim.calibrate.shared_pipeline import generic_pipeline

    # the median of 5 steps: with 2, one slow first step of the run alone once put it above the shared one
    rounds = measure_generic_pipeline(generic_pipeline(1), generic_pipeline(2), steps=5, rounds=1, timeout_s=120)
    if usable_cores() < 2:
        assert rounds is None
    else:
        [(core_each, two_per_core)] = rounds
        assert 0 < core_each < two_per_core  # twice the work on the same two cores


def step_gaps(rank: int, world: int) -> float:
    from executor.compute_bench import measure_step_gaps

    return measure_step_gaps(steps=3, warmup=1, mlp=(2, 64, 8))


@pytest.mark.multiproc
def test_the_loop_s_time_between_actions_is_timed_in_a_generic_data_parallel_step():
    """Every rank's median gap between its step's actions (here its passes, two all-reduces and AdamW); alone,
    the passes and AdamW. calibrate takes the median over ranks, and the pipeline loop's figure without it."""
    from executor.compute_bench import measure_step_gaps
    from executor.launch import launch
    from parsim.cli.calibrate_cmd import _step_gap

    per_rank = launch(step_gaps, 2, backend="gloo", timeout_s=120)
    assert all(0 < gap < 0.1 for gap in per_rank)
    assert 0 < measure_step_gaps(steps=2, warmup=1, mlp=(1, 32, 4)) < 0.1
    assert _step_gap([{"step_gaps": g} for g in (1e-4, 3e-4, 2e-4)], 5e-5) == pytest.approx(2e-4)
    assert _step_gap([{"pipeline": {}}, {"step_gaps": None}], 5e-5) == 5e-5  # not measured: the loop's


def test_the_pipeline_loop_is_timed_with_stages_of_each_size_and_its_figures_taken_at_each(monkeypatch):
    """The pipeline loop at each width (here faked): the gradients a rank holds with each, smallest first;
    calibrate takes a send's issue, a late receive's rendezvous and a waiting one's latency at every size (each
    size's median over ranks, in KiB)."""
    import executor.compute_bench as bench
    from parsim.cli.calibrate_cmd import _loop_curve

    monkeypatch.setattr(bench, "measure_pipeline_loop", lambda mlp, by_event: {"issue": mlp[1] * 1e-6} if by_event
                        else None)  # each figure a typical event's
    loops = bench.measure_pipeline_loops(widths=(128, 768))
    assert loops == [(2 * 128 * 128 * 4, {"issue": 128e-6}), (2 * 768 * 768 * 4, {"issue": 768e-6})]
    rows = [{"pipeline": [(128 << 10, {"issue": issue}), (4608 << 10, {"issue": 4 * issue})]}
            for issue in (1e-4, 3e-4, 2e-4)] + [{"pipeline": [(128 << 10, None)]}]  # an odd rank out: no loop
    assert _loop_curve(rows, "issue") == ((128, pytest.approx(2e-4)), (4608, pytest.approx(8e-4)))
    assert _loop_curve([{"pipeline": None}], "latency") is None
    # a size at which no receiver waited reads 0: left out, not a 0 us latency
    waited = [{"pipeline": [(128 << 10, {"latency": 0.0}), (4608 << 10, {"latency": 1.5e-4})]}]
    assert _loop_curve(waited, "latency") == ((4608, pytest.approx(1.5e-4)),)
    assert _loop_curve([{"pipeline": [(128 << 10, {"latency": 0.0})]}], "latency") is None


def test_the_loop_s_time_between_actions_is_timed_at_several_sizes_of_the_generic_step():
    """Each width of the generic MLP gives the gradients a rank holds (4 layers of fp32 weights) and the median
    gap; calibrate takes each size's median over ranks, in KiB, and the pipeline loop's figure without any."""
    from executor.compute_bench import measure_step_gap_curve
    from parsim.cli.calibrate_cmd import _step_gap_curve

    curve = measure_step_gap_curve(widths=(16, 32), steps=2, warmup=1)
    assert [nbytes for nbytes, _ in curve] == [4 * 16 * 16 * 4, 4 * 32 * 32 * 4]
    assert all(0 < gap < 0.1 for _, gap in curve)
    rows = [{"step_gaps": [(4 << 20, gap), (16 << 20, 4 * gap)]} for gap in (1e-5, 3e-5, 2e-5)]
    assert _step_gap_curve(rows, 5e-5) == ((4096, pytest.approx(2e-5)), (16384, pytest.approx(8e-5)))
    assert _step_gap_curve([{"pipeline": {}}, {"step_gaps": None}], 5e-5) == ((0, 5e-5),)


def tp_calls(rank: int, world: int) -> dict | None:
    from executor.compute_bench import measure_tp_calls

    return measure_tp_calls(repeats=5)


@pytest.mark.multiproc
def test_a_tensor_parallel_call_s_host_time_is_timed_beyond_its_collective_on_every_rank():
    from executor.compute_bench import measure_tp_calls
    from executor.launch import launch

    per_rank = launch(tp_calls, 2, backend="gloo", timeout_s=120)
    for row in per_rank:
        assert row["forward_s"] > 0 and row["backward_s"] >= 0
    assert fit_tp_calls(per_rank) == pytest.approx(tuple(statistics.median(r[key] for r in per_rank)
                                                         for key in ("forward_s", "backward_s")))
    assert measure_tp_calls() is None  # no process group here: nothing to time
    assert fit_tp_calls([None, None]) is None


def test_a_loop_s_gaps_split_into_its_own_time_and_each_send_s_issue():
    """Gaps before actions with no send are the loop's own time; a gap with sends in it adds their issue."""
    from executor.compute_bench import split_gaps

    step = [("F", "compute", 0.010, 0.020), ("send", "send", 0.021, 0.030),  # gap 0.010 before F: plain
            ("recv", "recv", 0.025, 0.040),  # 5 ms after F, one send issued: the loop's time and one issue
            ("B", "compute", 0.042, 0.050),  # 2 ms: plain
            ("send", "send", 0.051, 0.060), ("send", "send", 0.052, 0.060),
            ("optimizer", "optimizer", 0.058, 0.060)]  # 8 ms with two sends
    action, issue = split_gaps([step])
    assert action == pytest.approx(0.006) and issue == pytest.approx((0.005 + 0.008 - 2 * 0.006) / 3)
    other = [("F", "compute", 0.001, 0.002), ("B", "compute", 0.003, 0.004)]  # two more plain gaps of 1 ms
    # the typical step's: the median of the two steps' mean plain gaps (6 and 1 ms)
    assert split_gaps([step, other]) == pytest.approx((0.0035, (0.005 + 0.008 - 2 * 0.0035) / 3))
    assert split_gaps([other]) == pytest.approx((0.001, 0.0))
    stalled = [e if e[0] != "optimizer" else ("optimizer", "optimizer", 0.064, 0.066) for e in step]
    assert split_gaps([step, step, stalled]) == split_gaps([step])  # one step in three stalls: no one's typical


def test_a_typical_event_leaves_out_stalls_that_hit_most_steps():
    """Two steps of three stall once each, by 5 ms: the typical step pays one stall (its mean per send, or per
    transfer); a typical send or transfer, the median over all of them, pays none."""
    from executor.compute_bench import event_median, split_gaps, typical_step_mean

    def step(stall_s: float) -> list[tuple[str, str, float, float]]:  # a 0.1 ms gap, then three with a send each
        return [("F", "compute", 1e-4, 2e-3), ("send", "send", 2.1e-3, 3e-3), ("B", "compute", 2.4e-3, 3e-3),
                ("send", "send", 3.1e-3, 4e-3), ("recv", "recv", 3.4e-3 + stall_s, 5e-3 + stall_s),
                ("send", "send", 5.1e-3 + stall_s, 6e-3 + stall_s),
                ("optimizer", "optimizer", 5.4e-3 + stall_s, 6e-3 + stall_s)]

    steps = [step(0.0), step(5e-3), step(5e-3)]
    assert split_gaps(steps) == pytest.approx((1e-4, 3e-4 + 5e-3 / 3))
    assert split_gaps(steps, by_event=True) == pytest.approx((1e-4, 3e-4))
    late = [[60e-6, 80e-6], [60e-6, 5e-3], [70e-6, 5e-3]]
    assert typical_step_mean(late) == pytest.approx((60e-6 + 5e-3) / 2)
    assert event_median(late) == pytest.approx(75e-6)
    assert event_median([[], []]) == 0.0


def test_transfers_split_by_whether_the_receive_was_posted_before_the_send():
    from executor.compute_bench import transfer_times

    rank0 = [[("send act stage=0 mb=0 peer=1", "send", 1.0, 1.5), ("recv grad stage=1 mb=0 peer=1", "recv", 2.0, 4.0)]]
    rank1 = [[("recv act stage=0 mb=0 peer=0", "recv", 0.5, 1.2), ("send grad stage=1 mb=0 peer=0", "send", 3.0, 3.1)]]
    late, waiting = transfer_times([(0, rank0), (1, rank1)])
    assert sorted(waiting[0]) == pytest.approx([0.2, 1.0])  # act: issued at 1.0, received at 1.2; grad: 3.0 to 4.0
    assert late == [[]]
    rank1_late = [[("recv act stage=0 mb=0 peer=0", "recv", 1.3, 1.4),
                   ("send grad stage=1 mb=0 peer=0", "send", 3.0, 3.1)]]
    late, waiting = transfer_times([(0, rank0), (1, rank1_late)])
    assert late == [pytest.approx([0.1])] and waiting == [pytest.approx([1.0])]


def test_a_transfer_s_figure_is_its_mean_in_a_typical_step():
    from executor.compute_bench import typical_step_mean

    typical, stalled = [60e-6, 80e-6], [60e-6, 5e-3]
    # one step in four stalls: the typical step has no stall
    assert typical_step_mean([typical, typical, stalled, typical]) == pytest.approx(70e-6)
    # three in four do: the typical step pays one
    assert typical_step_mean([stalled, stalled, typical, stalled]) == pytest.approx((60e-6 + 5e-3) / 2)
    assert typical_step_mean([[], typical]) == pytest.approx(70e-6)  # steps without such transfers do not count
    assert typical_step_mean([[], []]) == 0.0


def test_the_cache_curve_times_a_matmul_cycling_over_each_count_of_weights():
    from executor.compute_bench import measure_cache_hits

    rows = measure_cache_hits(shape=(4, 64, 32), weights=(1, 3), rounds=2)
    call_bytes = (4 * 32 + 32 * 64 + 4 * 64) * 4  # input, weight and output, fp32
    assert [distance for distance, _ in rows] == [call_bytes, 3 * call_bytes]
    assert all(0 < seconds < 0.1 for _, seconds in rows)


def test_the_elementwise_chain_counts_the_bytes_each_op_reads_and_writes():
    """On 8 x 64: a product by a weight row (the tensor read and written, the row read once), a residual add (2
    read, 1 written), the negation of a half and the concatenation (a half each way, then the whole), a product
    by a constant and another add: 13 tensors' worth forward, the row once more."""
    from executor.compute_bench import measure_elementwise

    row = measure_elementwise((8, 64))
    tensor, weight = 8 * 64 * 4, 64 * 4
    assert row["forward_bytes"] == 13 * tensor + weight and row["forward_ops"] == 8
    assert row["backward_bytes"] > row["forward_bytes"] and row["backward_ops"] > row["forward_ops"]
    assert row["forward_s"] > 0 and row["backward_s"] > 0


def test_each_kernel_kind_is_timed_on_its_own_forward_and_backward():
    from executor.compute_bench import measure_kernel_kinds

    rows = measure_kernel_kinds((8, 64))
    assert [r["kind"] for r in rows] == ["gelu", "norm", "softmax"]
    for row in rows:
        assert row["elements"] == 8 * 64 and row["forward_s"] > 0 and row["backward_s"] >= 0
        assert row["forward_ops"] >= 1 and row["backward_ops"] >= 1  # autograd.grad: no accumulation op


def test_the_cost_per_op_is_timed_on_the_reference_layers_whose_ops_the_simulator_counts():
    """The dispatch benchmark's decoder layers dispatch, per layer, the ops parsim.lowering.eager_ops counts for
    a Llama layer (RoPE, grouped-query attention, SwiGLU) and a GPT-2 one (all heads, GeLU, biases)."""
    from executor.compute_bench import DEPTH, measure_dispatch
    from parsim.lowering.eager_ops import transformer_layer_ops

    measured = measure_dispatch()
    names = ["llama layer", "gpt layer", "elementwise"]
    assert [(row["name"], row["layers"]) for row in measured] == [(n, d) for d in (DEPTH, 1) for n in names]
    rows = {row["name"]: row for row in measured if row["layers"] == DEPTH}
    one = {row["name"]: row for row in measured if row["layers"] == 1}  # a pass's own cost: stacks of one block
    for name in names:
        assert (rows[name]["forward_ops"], rows[name]["backward_ops"]) == (DEPTH * one[name]["forward_ops"],
                                                                          DEPTH * one[name]["backward_ops"])
        assert one[name]["forward_s"] > 0 and one[name]["backward_s"] > 0
    for name, counts in (("llama layer", transformer_layer_ops(True, "swiglu", True)),
                         ("gpt layer", transformer_layer_ops(False, "gelu", False))):
        (attention_forward, attention_backward), (ffn_forward, ffn_backward) = counts
        assert rows[name]["forward_ops"] == DEPTH * (attention_forward + ffn_forward)
        assert rows[name]["backward_ops"] == DEPTH * (attention_backward + ffn_backward)
        assert rows[name]["forward_s"] > 0 and rows[name]["backward_s"] > 0
    linears = {"llama layer": 7, "gpt layer": 6}
    assert all(len(rows[name]["matmuls"]) == DEPTH * (n + 16) for name, n in linears.items())  # 16: 2 x 4 heads x 2


def test_an_eager_benchmark_s_samples_give_each_row_its_median_seconds_and_its_counts():
    from executor.compute_bench import median_samples

    def rows(forward_us: float, backward_us: float) -> list[dict]:
        return [{"name": "mlp block", "forward_s": forward_us * 1e-6, "backward_s": backward_us * 1e-6,
                 "forward_ops": 88, "backward_ops": 232, "matmuls": [(32, 128, 32)]},
                {"name": "elementwise", "forward_s": 2 * forward_us * 1e-6, "backward_s": 0.0,
                 "forward_ops": 9, "backward_ops": 13, "matmuls": []}]

    # A slow spell in two samples of five (8.3 and 6.7 us) does not move the median.
    samples = [rows(4.7, 4.0), rows(8.3, 6.4), rows(4.4, 3.9), rows(6.7, 4.6), rows(5.0, 4.1)]
    mlp, elementwise = median_samples(samples)
    assert mlp["forward_s"] == pytest.approx(5.0e-6) and mlp["backward_s"] == pytest.approx(4.1e-6)
    assert (mlp["forward_ops"], mlp["backward_ops"], mlp["matmuls"]) == (88, 232, [(32, 128, 32)])
    assert elementwise["forward_s"] == pytest.approx(10.0e-6) and elementwise["name"] == "elementwise"
    one = median_samples([rows(4.7, 4.0)[0], rows(6.1, 5.0)[0], rows(5.3, 4.4)[0]])  # a benchmark of one row
    assert one["forward_s"] == pytest.approx(5.3e-6) and one["backward_s"] == pytest.approx(4.4e-6)


def test_the_sampled_benchmarks_run_before_every_other_benchmark_and_at_the_end(monkeypatch):
    """Fakes in place of every benchmark: each sampled one runs before each of the 6 others and at the end (7
    samples; the cache curve runs right after the matmuls, against itself), and the figures calibrate fits are
    its samples' medians: an eager pass's seconds, and each of
    AdamW's runs' (its memory speed, timed once, had moved with the host's by 0.80 to 1.07 of the probe's)."""
    import executor.compute_bench as bench
    from executor.speed_probe import Speed

    others = ["measure_matmuls", "measure_cache_hits", "measure_rank_jitter", "measure_zero_grad", "measure_fsdp_host",
              "measure_step_gap_curve", "measure_pipeline_loops"]
    for name in others:
        monkeypatch.setattr(bench, name, lambda: None)
    seconds = iter([9e-6, 1e-6, 2e-6, 40e-6, 5e-6, 6e-6, 7e-6])  # median 6 us, a slow spell (40) or not
    adamw_s = iter([12e-3, 9e-3, 10e-3, 15e-3, 10.5e-3, 11e-3, 9.5e-3])  # median 10.5 ms

    def dispatch() -> list[dict]:
        return [{"name": "mlp block", "forward_s": next(seconds), "backward_s": 0.0, "forward_ops": 88,
                 "backward_ops": 232}]

    def optimizer() -> dict:
        step = next(adamw_s)
        return {"together": [(1, 256, 1e-4), (4, 1 << 20, step)], "alone": [(2, 1 << 21, step / 2)]}

    matmul_s = iter([3e-3, 2e-3, 4e-3, 2.5e-3, 3.5e-3, 2e-3, 3e-3])  # median 3 ms
    calls = []
    sampled = {"dispatch": dispatch, "kernel_kinds": lambda: calls.append(1) or [],
               "tp_calls": lambda: None, "optimizer": optimizer,  # no process group: no tensor-parallel call
               "matmul": lambda: next(matmul_s)}
    monkeypatch.setattr(bench, "SAMPLED_BENCHMARKS", sampled)
    monkeypatch.setattr(bench, "SpeedProbe", lambda: lambda: Speed(7e10, 3e-4, 2e10))
    result = bench._rank_compute(0, 1)
    assert len(calls) == len(others)  # one point before each but the cache curve, one at the end
    assert result["dispatch"] == [{"name": "mlp block", "forward_s": pytest.approx(6e-6), "backward_s": 0.0,
                                   "forward_ops": 88, "backward_ops": 232}]
    assert result["optimizer"] == {"together": [(1, 256, pytest.approx(1e-4)), (4, 1 << 20, pytest.approx(10.5e-3))],
                                   "alone": [(2, 1 << 21, pytest.approx(5.25e-3))]}
    assert len(result["speed_probes"]) == len(calls) and result["tp_calls"] is None
    assert result["matmul"] == pytest.approx(3e-3)
    # each reading beside the work timed right after it, as drawn: the eager work's slow spell at the fourth
    pairs = result["probe_pairs"]
    assert [work for _, work in pairs["eager"]] == pytest.approx([9e-6, 1e-6, 2e-6, 40e-6, 5e-6, 6e-6, 7e-6])
    assert [work for _, work in pairs["matmul"]] == pytest.approx([3e-3, 2e-3, 4e-3, 2.5e-3, 3.5e-3, 2e-3, 3e-3])
    assert [work for _, work in pairs["memory"]] == pytest.approx([12e-3, 9e-3, 10e-3, 15e-3, 10.5e-3, 11e-3, 9.5e-3])
    assert {probe: {reading for reading, _ in readings} for probe, readings in pairs.items()} == pytest.approx(
        {"matmul": {1 / 7e10}, "eager": {3e-4}, "memory": {1 / 2e10}})


def _fsdp_host(rank: int, world: int):
    import torch
    import torch.distributed as dist

    from executor.compute_bench import _TimedGather, _TimedScatter, measure_fsdp_host

    inside = [0.0]  # the comms FSDP2 calls there: each runs its collective and adds the seconds inside it
    gathered, scattered = torch.empty(4), torch.empty(2)
    _TimedGather(inside)(gathered, torch.full((2,), float(rank)), dist.group.WORLD)
    after_gather = inside[0]
    _TimedScatter(inside)(scattered, torch.ones(4), dist.group.WORLD, dist.ReduceOp.SUM)
    comms = (gathered.tolist(), scattered.tolist(), after_gather, inside[0])
    return measure_fsdp_host(units=(1, 3), steps=3, warmup=1), comms


def test_fsdp2_s_own_host_work_is_timed_per_unit_around_real_collectives_their_seconds_left_out():
    from executor.launch import launch
    from parsim.calibrate.host import fit_fsdp_host

    per_rank = launch(_fsdp_host, 2, backend="gloo", timeout_s=120)
    for _, (gathered, scattered, after_gather, after_both) in per_rank:
        assert gathered == [0.0, 0.0, 1.0, 1.0] and scattered == [2.0, 2.0] and 0 < after_gather < after_both
    rows = [row for rank, _ in per_rank for row in rank]
    assert [(units, tensors) for units, tensors, *_ in rows] == [(1, 4), (3, 12)] * 2  # two linears, two tensors
    assert all(sharded[k] > plain[k] for _, _, plain, sharded, _ in rows for k in range(3))  # FSDP2 adds host work
    assert all(len(kept) == 2 and min(kept) > 0 for *_, kept in rows)  # forward and backward moving nothing
    fit = fit_fsdp_host(rows)
    assert fit.unshard_s > 0 and fit.tensor_s > 0 and len(fit.pass_s) == 2
    # A unit's extra is the slope between stack sizes: the root's fixed costs cancel.
    truth = [(n, 4 * n, (0.0, 0.0, 0.0), (7e-4 + 4e-4 * n, 9e-4 + 1e-3 * n, 2e-4 + 8e-4 * n)) for n in (2, 8)]
    assert vars(fit_fsdp_host(truth)) == pytest.approx(
        {"unshard_s": 4e-4, "reduce_s": 6e-4, "tensor_s": 2e-4, "pass_s": None})
    assert fit_fsdp_host(truth[:1]) is None
    kept = [row + ((3e-4 + 1e-4 * row[0], 5e-4 + 2e-4 * row[0]),) for row in truth]
    assert fit_fsdp_host(kept).pass_s == pytest.approx((1e-4, 2e-4))


def test_freeing_gradients_is_timed_per_run_and_fits_by_tensors_and_bytes():
    from executor.compute_bench import measure_zero_grad
    from parsim.calibrate.host import fit_zero_grad

    runs = ((1, 256), (8, 256), (2, 1 << 18))
    rows = measure_zero_grad(runs, repeats=3)
    assert [row[:2] for row in rows] == list(runs) and all(row[2] > 0 for row in rows)
    truth = [(t, n, 5e-6 + t * 0.5e-6 + t * n * 4 / 160e9) for t, n in ((1, 1024), (16, 1024), (4, 1 << 20))]
    fit = fit_zero_grad(truth)
    assert (fit.step_s, fit.tensor_s, fit.bw_Bps) == pytest.approx((5e-6, 0.5e-6, 160e9))


def test_each_probe_reading_is_paired_with_the_work_it_stands_for_timed_after_it():
    """At each point of a calibration each probe's seconds (a FLOP's, an eager pass's, a byte's) beside its work:
    the matmuls' seconds, the dispatch benchmark's passes (forward and backward of every stack, summed), AdamW's
    steps over tensors that stream from memory (every rank at once; the small ones left out); a rank that does not
    probe pairs nothing."""
    from executor.compute_bench import probe_pairs
    from executor.speed_probe import Speed

    speeds = [Speed(50e9, 800e-6, 20e9), Speed(40e9, 1000e-6, 16e9)]
    sampled = {"matmul": [2e-3, 2.5e-3],
               "dispatch": [[{"forward_s": 0.010, "backward_s": 0.020}, {"forward_s": 0.001, "backward_s": 0.002}],
                            [{"forward_s": 0.012, "backward_s": 0.024}, {"forward_s": 0.001, "backward_s": 0.003}]],
               "optimizer": [{"together": [(1, 256, 1e-4), (4, 1 << 20, 0.010), (2, 1 << 21, 0.011)], "alone": []},
                             {"together": [(1, 256, 1e-4), (4, 1 << 20, 0.012), (2, 1 << 21, 0.013)], "alone": []}]}
    assert probe_pairs(speeds, sampled) == {
        "matmul": [(pytest.approx(1 / 50e9), 2e-3), (pytest.approx(1 / 40e9), 2.5e-3)],
        "eager": [(800e-6, pytest.approx(0.033)), (1000e-6, pytest.approx(0.040))],
        "memory": [(pytest.approx(1 / 20e9), pytest.approx(0.021)), (pytest.approx(1 / 16e9), pytest.approx(0.025))]}
    assert probe_pairs([], sampled) == {"matmul": [], "eager": [], "memory": []}


def test_the_matmul_sample_is_one_call_of_each_shape_together_timed_as_the_sweep_times_them(monkeypatch):
    import executor.compute_bench as bench

    assert set(bench.PAIRED_MATMULS) <= set(bench.DEFAULT_SHAPES)  # shapes of the sweep, never a plan's
    asked = []

    def sweep(shapes, repeats):
        asked.append((shapes, repeats))
        return [(shape, 1e-3 * (i + 1)) for i, shape in enumerate(shapes)]

    monkeypatch.setattr(bench, "measure_matmuls", sweep)
    assert bench.measure_matmul_sample() == pytest.approx(6e-3)  # 1 + 2 + 3 ms: a call of each shape
    assert asked == [(bench.PAIRED_MATMULS, 5)]
    monkeypatch.undo()
    assert bench.measure_matmul_sample(((32, 64, 64),), repeats=2) > 0  # the real sweep, one small shape


def test_eager_passes_are_timed_in_turns_a_forward_and_its_backward_of_each_per_round():
    """The dispatch benchmark's stacks of one block and of many are timed round after round, one pass of each per
    round, so a slow spell of the host falls on both depths alike and not on the cost per pass the two tell."""
    from executor.compute_bench import passes_in_turns

    calls = []

    def pass_of(name: str):
        return (lambda: calls.append(f"{name} forward") or name), (lambda out: calls.append(f"{out} backward"))

    times = passes_in_turns([pass_of("deep"), pass_of("one")], repeats=3, footprint_bytes=1 << 12)
    assert len(times) == 2 and all(forward >= 0 and backward >= 0 for forward, backward in times)
    warm_up = ["deep forward", "deep backward", "one forward", "one backward"]
    assert calls == warm_up + warm_up * 3


def test_the_matmul_sweep_times_its_shapes_in_turns_a_run_of_each_per_round(monkeypatch):
    import torch

    import executor.compute_bench as bench

    shapes, calls = ((8, 16, 32), (4, 8, 16)), []  # (m, n, k)
    real = torch.matmul

    def matmul(x, w):
        calls.append((x.shape[0], w.shape[1], x.shape[1]))
        return real(x, w)

    monkeypatch.setattr(torch, "matmul", matmul)
    rows = bench.measure_matmuls(shapes, footprint_bytes=1 << 12, repeats=3)
    assert [shape for shape, _ in rows] == list(shapes) and all(seconds > 0 for _, seconds in rows)
    runs = []  # the timed runs in order: a shape each, whatever its calls
    for shape in calls[len(shapes):]:  # (after each shape's one warm-up call)
        if not runs or runs[-1] != shape:
            runs.append(shape)
    assert runs == list(shapes) * 3  # round after round, each shape once, never one shape's repeats in a row
