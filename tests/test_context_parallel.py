"""Context parallelism: each rank computes 1/cp of every sequence and exchanges K/V with its cp group."""

from __future__ import annotations

from collections import Counter

import pytest
from ideal_cluster import ideal_spec

from parsim.errors import ParsimError
from parsim.lowering.lower import lower
from parsim.sim.step import predict_step
from parsim.workload.memory import memory
from parsim.workload.model import load_model
from parsim.workload.plan import Plan, resolve_plan

LONG = load_model({"kind": "transformer", "name": "long", "num_layers": 4, "hidden": 1024, "num_heads": 16,
                   "num_kv_heads": 4, "ffn_hidden": 4096, "seq_len": 16384, "vocab_size": 1000})


def plan(cp: int, style: str = "ring", **kw) -> Plan:
    return Plan(model=LONG, cp=cp, tp=2, dtype="bf16", context_parallel=style, num_microbatches=1, **kw)


def test_each_rank_computes_its_share_of_the_sequence():
    assert plan(4).tokens_per_rank == 16384 // 4
    one, four = memory(plan(1))[0], memory(plan(4))[0]
    assert four.activations == pytest.approx(one.activations / 4)
    assert four.weights == one.weights  # weights are replicated over cp ranks


def test_kv_exchange_per_attention_block():
    program = lower(plan(4))
    ops = Counter((op.collective, op.stream) for op in program.ops if op.group == "cp")
    layers = 4
    assert ops == {("all_gather", "cp"): 2 * layers, ("reduce_scatter", "cp"): layers}  # fwd K/V; bwd K/V + dK/dV
    gather = next(op for op in program.ops if op.name == "all_gather cp layer=layer.0 mb=0 dir=fwd")
    kv_per_rank = 2 * (4 * 64 // 2)  # K and V of this tp rank's 2 of the 4 kv heads, head_dim 64
    assert gather.nbytes == kv_per_rank * 2 * 16384  # bf16, the whole sequence (nccl-tests all-gather size)
    assert gather.ranks == (0, 2, 4, 6)  # cp just outside tp 2 in the rank grid


def test_gradients_are_reduced_over_data_and_context_parallel_ranks():
    p = Plan(model=LONG, dp=2, cp=2, tp=2, dtype="bf16", num_microbatches=1)
    reductions = [op for op in lower(p).ops if op.group == "dp"]
    assert reductions and all(len(op.ranks) == 4 for op in reductions)
    cp_group = next(op.ranks for op in lower(p).ops if op.group == "cp")
    assert set(cp_group) < set(reductions[0].ranks)


def test_ring_overlaps_the_exchange_that_all_gather_exposes():
    spec = ideal_spec(**{"scale_out.nic_bw_Gbps": 50.0})
    ring, gather = predict_step(plan(4, "ring"), spec), predict_step(plan(4, "all_gather"), spec)
    assert ring.step_s < gather.step_s
    assert gather.ranks[0].seconds["cp"] > ring.ranks[0].seconds["cp"]
    for r in (ring, gather):
        assert sum(r.ranks[0].seconds.values()) == pytest.approx(r.step_s)


def test_context_parallel_rules():
    with pytest.raises(ParsimError, match="seq_len 16384 divisible by 2 x cp = 10"):
        plan(5)
    with pytest.raises(ParsimError, match="context parallelism splits sequences"):
        Plan(model=load_model("course-mlp"), cp=2)
    with pytest.raises(ParsimError, match="context_parallel 'tree' is not one of ring, all_gather"):
        plan(2, "tree")
    with pytest.raises(ParsimError, match="context_parallel all_gather with cp 1 splits nothing"):
        plan(1, "all_gather")  # a flag that would otherwise do nothing, silently


def test_llama3_long_context_example_fits_like_the_8k_plan():
    long, short = resolve_plan("llama3-405b-128k-cp16"), resolve_plan("llama3-405b-16k")
    assert long.world == short.world == 16384 and long.tokens_per_rank == short.tokens_per_rank
    assert [m.total for m in memory(long)] == pytest.approx([m.total for m in memory(short)])
