"""Checks over all gradients before the step, as the simulator prices them: the plan's ``grad_clip``, fp16's
loss scaling; the lowered ops and their closed forms.

Clipping reads every gradient once for the rank's norm, sums the squares over
each dimension whose ranks hold different gradients (one all-reduce of four
bytes each), and scales every gradient (a read and a write) in the optimizer
step. The pipeline ranks' sum is one collective: the ranks that finish their
backward first wait in it, as they do in the executor's ``all_reduce``. fp16
plans first unscale every gradient and look for an overflow (a read and a
write, then the same all-reduces of a flag).
"""

from __future__ import annotations

import pytest
from ideal_cluster import ideal_spec

from parsim.cli.main import main
from parsim.lowering.lower import FP32, UNSCALE_ACCESSES, clip_costs, grad_norm_dims, lower
from parsim.sim.step import predict_step
from parsim.workload.model import load_model
from parsim.workload.plan import Plan, load_plan

GPT = {"kind": "transformer", "name": "gpt", "num_layers": 4, "hidden": 256, "num_heads": 4, "num_kv_heads": 4,
       "ffn_hidden": 1024, "seq_len": 128, "vocab_size": 1024}


def _plan(parallel: dict, clip: float | None = 1.0, **settings) -> Plan:
    data = {"model": GPT, "parallel": parallel, "batch": {"microbatch_size": 1, "num_microbatches": 4}, **settings}
    return load_plan(dict(data, grad_clip=clip) if clip is not None else data)


@pytest.mark.parametrize("parallel,settings,dims", [
    ({"dp": 8}, {}, ()),
    ({"dp": 2, "tp": 2, "pp": 2}, {}, ("tp", "pp")),
    ({"dp": 4, "cp": 2}, {}, ()),
    ({"dp": 8}, {"data_parallel": {"zero": 1}}, ("shard",)),
    ({"dp": 8}, {"data_parallel": {"grad_sync": "fsdp", "shard_group": 4}}, ("shard",)),
])
def test_the_squares_are_summed_over_each_dimension_holding_other_gradients(parallel, settings, dims):
    plan = _plan(parallel, **settings)
    assert grad_norm_dims(plan) == dims
    ops = lower(plan).rank_ops(0)
    names = [op.name for op in ops]
    sums = [f"all_reduce grad_norm dim={d}" for d in dims]
    assert names[names.index("grad norm") + 1:names.index("optimizer step")] == sums
    for op in ops:
        if op.name in sums:
            assert op.nbytes == FP32 and op.phase == "optimizer" and op.negligible
            groups = [op.ranks, *op.mirrors]  # with the other replicas' groups: disjoint, of one size
            assert len({len(g) for g in groups}) == 1 and len(set().union(*groups)) == len(groups) * len(op.ranks)
    assert "grad norm" not in {op.name for op in lower(_plan(parallel, None, **settings)).rank_ops(0)}


def test_experts_spread_over_expert_parallel_ranks_add_their_squares():
    """Without ZeRO over the ep ranks; under ZeRO the shard group's sum already holds every ep rank's experts
    (a shard group holds whole expert-parallel groups) and nothing is summed twice."""
    data = {"model": "mixtral-8x22b", "parallel": {"dp": 8, "ep": 4}, "grad_clip": 1.0,
            "batch": {"microbatch_size": 1, "num_microbatches": 1}}
    assert grad_norm_dims(load_plan(data)) == ("ep",)
    for sync in ({"zero": 1}, {"grad_sync": "fsdp"}, {"grad_sync": "fsdp", "shard_group": 4}):
        assert grad_norm_dims(load_plan(dict(data, data_parallel=sync))) == ("shard",)


def test_clipping_costs_one_read_for_the_norm_and_a_read_and_write_to_scale():
    params, tensors = 1e6, 250
    norm, scale = clip_costs(params, tensors, grad_bytes=4)
    assert norm["hbm_bytes"] == params * 4 and scale["hbm_bytes"] == 2 * params * 4
    assert norm["kernels"] == 3 + 6 and scale["kernels"] == 3  # one per 110 tensors a pass, the norm's scalars


def test_on_one_rank_clipping_adds_its_three_passes_to_the_step():
    cluster = ideal_spec()
    plain, clipped = predict_step(_plan({"dp": 1}, None), cluster), predict_step(_plan({"dp": 1}), cluster)
    plan = _plan({"dp": 1})
    params = plan.params_per_rank(0)
    bandwidth = cluster.gpu.hbm_bw_Bps * cluster.memory_efficiency
    assert clipped.step_s - plain.step_s == pytest.approx(3 * params * FP32 / bandwidth, rel=1e-6)
    norm = next(e for e in clipped.trace.events if e.name == "grad norm")
    assert norm.dur_s == pytest.approx(params * FP32 / bandwidth, rel=1e-6)


def test_pipeline_ranks_wait_for_each_other_in_the_sum_of_squares():
    """1F1B ends on pipeline rank 0: the last stage's rank reaches the sum first and waits in it; both ranks
    leave it together and the wait counts as optimizer time."""
    result = predict_step(_plan({"pp": 2}), ideal_spec())
    sums = {e.rank: e for e in result.trace.events if e.name == "all_reduce grad_norm dim=pp"}
    last_backward = {rank: max(e.start_s + e.dur_s for e in result.trace.events
                               if e.rank == rank and e.args.get("phase") == "backward") for rank in sums}
    assert last_backward[1] < last_backward[0]
    assert sums[0].start_s + sums[0].dur_s == pytest.approx(sums[1].start_s + sums[1].dur_s)
    assert sums[1].dur_s > sums[0].dur_s + 0.5 * (last_backward[0] - last_backward[1])
    waited = sums[1].dur_s - sums[0].dur_s
    idle = {b.rank: b.seconds["idle"] for b in predict_step(_plan({"pp": 2}, None), ideal_spec()).ranks}
    clipped = {b.rank: b.seconds for b in result.ranks}
    assert clipped[1]["idle"] == pytest.approx(idle[1] - waited, rel=0.01)  # the wait is now in the sum
    assert clipped[1]["optimizer"] > clipped[0]["optimizer"] + waited * 0.99


def test_a_bad_grad_clip_is_one_line_and_exit_2(capsys):
    for value in ("0", "-1", "nan"):
        assert main(["simulate", "tiny-pp2", "--grad-clip", value]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "grad_clip" in err[0]
    assert main(["search", "--model", "tiny-gpt", "--gpus", "8", "--grad-clip", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--grad-clip -1: give a positive gradient norm" in err[0]
    with pytest.raises(Exception, match="grad_clip"):
        load_plan({"model": "course-mlp", "grad_clip": "high"})


def test_grad_clip_round_trips_and_is_shown():
    plan = _plan({"dp": 2}, 0.5)
    assert load_plan(plan.to_dict()).grad_clip == 0.5 and "grad_clip" not in _plan({"dp": 2}, None).to_dict()
    assert "gradients clipped to norm 0.5" in plan.features()
    course = Plan(model=load_model("course-mlp"), dp=2, grad_clip=1.0)
    assert predict_step(course, ideal_spec()).step_s > predict_step(Plan(model=load_model("course-mlp"), dp=2),
                                                                   ideal_spec()).step_s


def test_fp16_plans_unscale_and_look_for_an_overflow_before_clipping():
    plan = _plan({"dp": 2, "tp": 2, "pp": 2}, dtype="fp16")
    assert plan.scales_loss and not _plan({"dp": 2}, dtype="bf16").scales_loss
    names = [op.name for op in lower(plan).rank_ops(0)]
    assert names[names.index("unscale grads"):] == [
        "unscale grads", "all_reduce found_inf dim=tp", "all_reduce found_inf dim=pp",
        "grad norm", "all_reduce grad_norm dim=tp", "all_reduce grad_norm dim=pp", "optimizer step"]
    cluster = ideal_spec(**{"gpu.peak_tflops": {"bf16": 1000.0, "fp16": 1000.0, "fp32": 500.0}})
    one = _plan({"dp": 1}, None, dtype="fp16")
    unscale = next(e for e in predict_step(one, cluster).trace.events if e.name == "unscale grads")
    params, grad_bytes = one.params_per_rank(0), one.grad_bytes
    assert grad_bytes == 2  # fp16 weights keep and reduce fp16 gradients by default
    assert unscale.dur_s == pytest.approx(UNSCALE_ACCESSES * params * grad_bytes / cluster.gpu.hbm_bw_Bps, rel=1e-6)
