"""ZeRO stages and FSDP: memory per rank by the closed forms, and the collectives each stage adds."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from ideal_cluster import ideal_spec

from parsim.cli.main import main
from parsim.errors import ParsimError
from parsim.lowering.lower import lower
from parsim.sim.step import predict_step
from parsim.workload.memory import memory
from parsim.workload.model import load_model
from parsim.workload.plan import Plan, load_plan

TINY = load_model("tiny-gpt")  # 4 layers, plus embedding and head: 6 FSDP units
N = 4


def plan(zero: int, **kw) -> Plan:
    return Plan(model=TINY, dp=N, dtype="bf16", zero=zero, num_microbatches=kw.pop("num_microbatches", 1), **kw)


@pytest.mark.parametrize("zero, per_param", [
    # Rajbhandari et al. 2020, mixed-precision AdamW: 2 bytes of bf16 weights, 4 of fp32 gradients, 12 of fp32
    # state: Megatron-LM's 18 and, with its distributed optimizer, 6 + 12/d (dist_optimizer.md). FSDP2 keeps fp32
    # shards, which are the master weights: 4 + 4 + 8 = 16/d.
    (0, 2 + 4 + 12), (1, 2 + 4 + 12 / N), (2, 2 + (4 + 12) / N), (3, 16 / N),
])
def test_zero_divides_training_state_by_the_shard_group(zero, per_param):
    mem = memory(plan(zero))[0]
    params = TINY.num_params
    assert mem.weights + mem.gradients + mem.optimizer == pytest.approx(per_param * params)


def test_zero2_gradients_added_up_over_microbatches_peak_whole_as_zero1s():
    """With more than one microbatch ZeRO-2's gradients accumulate whole until the last backward's
    reduce-scatter (Megatron-LM's buckets, as the executor runs them): at their peak not sharded."""
    one, several = memory(plan(2))[0], memory(plan(2, num_microbatches=4))[0]
    assert one.gradients == pytest.approx(4 * TINY.num_params / N)
    assert several.gradients == pytest.approx(4 * TINY.num_params) == memory(plan(1, num_microbatches=4))[0].gradients


def test_bf16_gradients_kept_in_bf16_take_two_bytes():
    mem = memory(plan(0, reduce_dtype="bf16"))[0]
    assert mem.weights + mem.gradients + mem.optimizer == pytest.approx((2 + 2 + 12) * TINY.num_params)


def test_fsdp_holds_two_gathered_layers_and_one_unsharded_gradient():
    mem = memory(plan(3))[0]
    largest = max(c.params_per_rank() for c in plan(3).stage_costs(0))  # the embedding table
    assert mem.buffers == largest * (2 * 2 + 4)  # bf16 weights twice, the fp32 gradient once


@pytest.mark.parametrize("reshard_after_forward", [None, True])
def test_fsdp_under_a_pipeline_holds_every_layer_gathered_and_its_gradients_whole(reshard_after_forward):
    """torch.distributed.pipelining keeps each stage's weights gathered and its gradients unsharded (fp32, the
    reduce dtype) from its first forward to its last backward, whether or not forwards reshard in between."""
    piped = plan(3, pp=2, num_microbatches=4, reshard_after_forward=reshard_after_forward)
    assert piped.reshard_after_forward is bool(reshard_after_forward)  # torchtitan's default: false under pp
    for mem in memory(piped):
        assert mem.buffers == piped.params_per_rank(mem.pp_rank) * (2 + 4)
        assert mem.weights == pytest.approx(4 * piped.params_per_rank(mem.pp_rank) / N)  # the fp32 shards


def test_hsdp_shards_within_the_group_only():
    p = Plan(model=TINY, dp=8, dtype="bf16", zero=3, shard_group=2)
    assert p.shard_size == 2 and memory(p)[0].weights == pytest.approx(4 * TINY.num_params / 2)


def collectives(p: Plan) -> Counter:
    return Counter((op.collective, op.group, op.stream) for op in lower(p).ops if op.kind == "collective")


def test_zero1_reduce_scatters_buckets_and_gathers_the_weights_after_the_optimizer():
    p = plan(1, bucket_size=2**16)
    ops = lower(p).ops
    names = [op.name for op in ops]
    buckets = sum(1 for n in names if n.startswith("reduce_scatter dp bucket="))
    assert buckets > 1 and sum(1 for n in names if n.startswith("all_gather dp bucket=")) == buckets
    assert not any(n.startswith("all_reduce dp") for n in names)
    step = names.index("optimizer step")
    assert all(names.index(f"all_gather dp bucket={k}") > step for k in range(buckets))
    assert all(op.ranks == (0, 1, 2, 3) for op in ops if op.group == "dp")


def test_overlapped_param_gathers_start_the_step_and_each_layer_waits_for_its_bucket():
    """Megatron-LM's --overlap-param-gather: the buckets' all-gathers open the step in forward order (the
    last bucket, holding the first layers, first) and each layer's first forward waits for its buckets."""
    p = plan(1, bucket_size=2**16, overlap_param_gather=True, num_microbatches=2)
    program = lower(p)
    ops, names = program.ops, [op.name for op in program.ops]
    gathers = [op for op in ops if op.name.startswith("all_gather dp bucket=")]
    buckets = sum(1 for n in names if n.startswith("reduce_scatter dp bucket="))
    assert [op.name for op in gathers] == [f"all_gather dp bucket={k}" for k in reversed(range(buckets))]
    assert max(op.id for op in gathers) < min(op.id for op in ops if op.kind == "compute")
    assert names.index("optimizer step") == len(names) - 1  # nothing gathered after the step
    first_forwards = [op for op in ops if op.kind == "compute" and op.name.startswith("F") and op.deps]
    waited = {d for op in first_forwards for d in op.deps}
    assert {op.id for op in gathers} <= waited  # every bucket is waited for by some layer's first forward
    later = [op for op in ops if op.kind == "compute" and op.name.endswith(" mb=1")]
    assert later and not any(set(op.deps) & {g.id for g in gathers} for op in later)  # later microbatches don't


def test_overlapping_the_param_gathers_takes_them_off_the_step_end():
    spec = ideal_spec()
    after, during = (predict_step(plan(1, bucket_size=2**16, num_microbatches=4, overlap_param_gather=o), spec)
                     for o in (False, True))
    gathered = [e for e in after.trace.events if e.rank == 0 and e.name.startswith("all_gather dp")]
    step_end = max(e.start_s + e.dur_s for e in after.trace.events if e.kind == "optimizer")
    assert min(e.start_s for e in gathered) == pytest.approx(step_end)  # after the optimizer: exposed
    assert after.step_s == pytest.approx(max(e.start_s + e.dur_s for e in gathered))
    events = [e for e in during.trace.events if e.rank == 0]
    first = min((e for e in events if e.name.startswith("all_gather dp")), key=lambda e: e.start_s)
    compute = min((e for e in events if e.kind == "compute"), key=lambda e: e.start_s)
    assert first.start_s == 0.0 and compute.start_s == pytest.approx(first.start_s + first.dur_s)
    assert during.step_s == pytest.approx(max(e.start_s + e.dur_s for e in events if e.kind == "optimizer"))
    assert during.step_s < after.step_s


def test_fsdp_gathers_each_layer_before_its_forward_and_backward_and_reduce_scatters_after():
    units = 6  # embedding, 4 layers, head
    m = 2
    ops = collectives(plan(3, num_microbatches=m, grad_sync="fsdp"))
    assert ops[("all_gather", "fsdp", "gather")] == 2 * units * m  # forward, and again before the backward
    assert ops[("reduce_scatter", "fsdp", "comm")] == units * m  # every microbatch (FSDP2's default)
    kept = collectives(plan(3, num_microbatches=m, reshard_after_forward=False))
    assert kept[("all_gather", "fsdp", "gather")] == units * m


def test_fsdp_gather_then_copy_out_precede_the_layer_compute():
    ops = lower(plan(3)).ops
    copies = [op for op in ops if op.name == "F stage=0 mb=0" and op.deps and ops[op.deps[0]].collective]
    gathers = [ops[op.deps[0]] for op in copies]
    assert [g.name for g in gathers] == [
        f"all_gather fsdp layer={unit} stage=0 mb=0 dir=fwd"
        for unit in ("embedding", "layer.0", "layer.1", "layer.2", "layer.3", "head")]
    # FSDP2's copy-out on the compute stream reads the gathered buffer and writes the layer's weights.
    assert all(c.stream == "compute" and c.hbm_bytes == 2 * g.nbytes and c.kernels == 1
               for c, g in zip(copies, gathers))
    assert all(ops[c.id + 1].stream == "compute" and ops[c.id + 1].matmuls for c in copies[1:-1])
    # Prefetch: a layer's gather waits only for the layer two before it to finish.
    assert ops[gathers[2].deps[0]].name == "F stage=0 mb=0" and gathers[2].deps[0] < copies[1].id


def test_fsdp_copies_gradients_in_before_each_reduce_scatter():
    """FSDP2's copy-in reads the bf16 gradients and writes the fp32 reduce-scatter buffer (reduce_dtype)."""
    ops = lower(plan(3)).ops
    scatters = [op for op in ops if op.collective == "reduce_scatter" and op.group == "fsdp"]
    copies = [ops[op.deps[0]] for op in scatters]
    assert all(c.name.startswith("B stage=0") and c.stream == "compute" and c.hbm_bytes == 1.5 * r.nbytes
               for c, r in zip(copies, scatters))


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_gradients_travel_in_the_reduce_dtype_and_weights_in_their_own(zero):
    """bf16 weights reduce fp32 gradients by default (Megatron-LM, torchtitan): twice the bytes of
    reduce_dtype bf16 in every gradient all-reduce and reduce-scatter; weight all-gathers do not change."""
    kw = dict(bucket_size=2**16, grad_sync="fsdp" if zero == 3 else "bucketed")

    def moved(p: Plan) -> dict[str, float]:
        out: Counter = Counter()
        for op in lower(p).ops:
            if op.kind == "collective":
                out[op.collective] += op.nbytes
        return out
    fp32, bf16 = moved(plan(zero, **kw)), moved(plan(zero, reduce_dtype="bf16", **kw))
    assert plan(zero).reduce_dtype == "fp32" and Plan(model=TINY, dtype="fp16").reduce_dtype == "fp16"
    reduced = "all_reduce" if zero == 0 else "reduce_scatter"
    assert fp32[reduced] == pytest.approx(2 * bf16[reduced]) and bf16[reduced] > 0
    assert fp32["all_gather"] == pytest.approx(bf16["all_gather"]) and (zero == 0 or bf16["all_gather"] > 0)


def test_hsdp_all_reduces_each_shard_across_replicas():
    p = Plan(model=TINY, dp=8, dtype="bf16", grad_sync="fsdp", shard_group=4)
    ops = [op for op in lower(p).ops if op.group == "fsdp"]
    scatter = next(op for op in ops if op.collective == "reduce_scatter")
    reduce = next(op for op in ops if op.collective == "all_reduce")
    assert scatter.ranks == (0, 1, 2, 3) and reduce.ranks == (0, 4)
    assert reduce.nbytes == scatter.nbytes / 4


def test_sharding_the_optimizer_shortens_its_step_and_fsdp_time_is_reported():
    spec = ideal_spec()
    ddp, fsdp = predict_step(plan(0), spec), predict_step(plan(3, grad_sync="fsdp"), spec)
    assert fsdp.ranks[0].seconds["optimizer"] == pytest.approx(ddp.ranks[0].seconds["optimizer"] / N, rel=0.2)
    assert "fsdp" in fsdp.ranks[0].seconds
    assert sum(fsdp.ranks[0].seconds.values()) == pytest.approx(fsdp.step_s)


@pytest.mark.parametrize("kwargs, message", [
    (dict(zero=4), "zero 4 is not a ZeRO stage"),
    (dict(zero=1, grad_sync="per_param"), "not per parameter"),
    (dict(zero=2, grad_sync="fsdp"), "it is zero 3, not 2"),
    (dict(shard_group=2), "shard_group (HSDP) needs a ZeRO stage"),
    (dict(zero=3, shard_group=3), "shard_group 3 does not divide the 4 data-parallel ranks"),
    (dict(zero=3, overlap_param_gather=True), "it needs zero 1 or 2, not 3"),
    (dict(overlap_param_gather=True), "it needs zero 1 or 2, not 0"),
])
def test_zero_rules(kwargs, message):
    with pytest.raises(ParsimError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Plan(model=TINY, dp=N, **kwargs)


def test_overlap_param_gather_from_yaml():
    p = load_plan({"model": "llama3-8b", "parallel": {"dp": 8}, "dtype": "bf16",
                   "data_parallel": {"zero": 1, "overlap_param_gather": True}})
    assert p.overlap_param_gather and load_plan(p.to_dict()) == p


def test_fsdp_from_yaml():
    p = load_plan({"model": "llama3-8b", "parallel": {"dp": 8}, "dtype": "bf16",
                   "data_parallel": {"grad_sync": "fsdp", "reshard_after_forward": False}})
    assert (p.zero, p.shard_size, p.reshard_after_forward, p.overlap) == (3, 8, False, True)
    assert load_plan(p.to_dict()) == p


def test_reduce_dtype_from_yaml_and_the_command_line(tmp_path, capsys):
    p = load_plan({"model": "llama3-8b", "parallel": {"dp": 8}, "dtype": "bf16",
                   "data_parallel": {"zero": 1, "reduce_dtype": "bf16"}})
    assert p.reduce_dtype == "bf16" and p.grad_bytes == 2 and load_plan(p.to_dict()) == p
    default = load_plan({"model": "llama3-8b", "parallel": {"dp": 8}, "dtype": "bf16"})
    assert "reduce_dtype" not in default.to_dict()["data_parallel"]
    assert "gradients reduced in fp32" in default.features()
    assert main(["plan", "show", "tiny-dp2", "--dtype", "bf16", "--reduce-dtype", "bf16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["data_parallel"]["reduce_dtype"] == "bf16"
    path = tmp_path / "plan.yaml"
    path.write_text("model: tiny-gpt\nparallel: {dp: 2}\ndata_parallel: {reduce_dtype: fp8}\n")
    assert main(["simulate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "reduce_dtype 'fp8' is not one of fp32, bf16, fp16" in err and len(err.strip().splitlines()) == 1
