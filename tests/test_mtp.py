"""Multi-token prediction (the model's ``mtp_layers``): DeepSeek-V3's module on the last pipeline stage, after the
head, as Megatron-LM's ``MultiTokenPredictionLayer`` runs it."""

from __future__ import annotations

import dataclasses
import statistics

import pytest
from simulated import steps_and_memory

from parsim.cli.main import main
from parsim.errors import ParsimError
from parsim.hardware.cluster import load_cluster
from parsim.lowering.lower import lower
from parsim.sim.step import predict_step
from parsim.workload.memory import memory
from parsim.workload.model import load_model
from parsim.workload.plan import Plan, resolve_plan

GPT = load_model({"kind": "transformer", "name": "gpt", "num_layers": 4, "hidden": 1024, "num_heads": 16,
                  "ffn_hidden": 4096, "seq_len": 2048, "vocab_size": 32000, "mtp_layers": 1})
PLAIN = dataclasses.replace(GPT, mtp_layers=0)


def test_deepseek_v3_s_module_is_a_moe_layer_its_projection_and_the_shared_head():
    """DeepSeek-V3 on Hugging Face is 685B: 671B of the main model and 14B of the MTP module, which are its MoE
    layer and projection plus its own copies of the embedding and head (training shares those with the main
    model, report section 2.2)."""
    m = load_model("deepseek-v3")
    (mtp,) = m.mtp_costs(2)
    layer = m.layer_costs(2)[-1]
    h, v = m.hidden, m.vocab_size
    assert mtp.num_params == layer.num_params + 2 * h * h + 3 * h  # eh_proj 2h x h, hnorm, enorm, final norm
    assert m.num_params == pytest.approx(671e9, rel=0.002)  # the main model's count leaves it out
    assert m.num_params + mtp.num_params + 2 * v * h == pytest.approx(685e9, rel=0.002)
    # Per token it runs the layer, the projection and the head once more: model FLOPs count all of it
    head = m.head_cost(2)
    extra = layer.training_flops_per_token() + 3 * 2 * (2 * h * h) + head.training_flops_per_token()
    assert mtp.training_flops_per_token() == extra
    assert m.model_flops_per_token() == dataclasses.replace(m, mtp_layers=0).model_flops_per_token() + extra


def forward_matmul_flops(plan: Plan, rank: int) -> int:
    return sum(2 * m * n * k for op in lower(plan).ops if op.rank == rank and op.name.startswith("F ")
               for m, n, k in op.matmuls)


def test_the_last_stage_runs_it_after_the_head():
    plan = Plan(model=GPT, dp=1, pp=2, dtype="bf16", microbatch_size=1, num_microbatches=4)
    assert [c.name for c in plan.stage_costs(1)] == ["layer.2", "layer.3", "head", "mtp.0"]
    assert [c.name for c in plan.stage_costs(0)] == ["embedding", "layer.0", "layer.1"]
    plain = dataclasses.replace(plan, model=PLAIN)
    (mtp,) = GPT.mtp_costs(2)
    tokens = GPT.seq_len * plan.num_microbatches
    assert forward_matmul_flops(plan, 1) - forward_matmul_flops(plain, 1) == \
        sum(m.flops_per_token() for m in mtp.matmuls) * tokens
    assert forward_matmul_flops(plan, 0) == forward_matmul_flops(plain, 0)
    with_mtp, without = (predict_step(dataclasses.replace(plan, model=m), load_cluster("dgx-h100"))
                         for m in (GPT, PLAIN))
    assert with_mtp.step_s > without.step_s


def test_a_last_stage_apart_from_the_embedding_keeps_a_copy_of_the_table_and_sums_its_gradient():
    """Its next tokens' embedding reads the table: on another pipeline rank than the embedding (1F1B) that rank
    keeps a copy, whose gradient is summed with the first stage's as a tied table's is; a V keeps both ends on
    rank 0 and needs none."""
    loop = Plan(model=GPT, dp=1, pp=2, dtype="bf16", microbatch_size=1, num_microbatches=4)
    v = dataclasses.replace(loop, schedule="zbv", virtual_stages=2, num_microbatches=4)
    table = GPT.vocab_size * GPT.hidden
    copy = [p for c in loop.stage_costs(1) for p in c.params if p.name == "mtp.embed.copy"]
    assert copy and copy[0].numel == table
    assert loop.params_per_rank(1) - dataclasses.replace(loop, model=PLAIN).params_per_rank(1) == \
        loop.stage_costs(1)[-1].num_params + table  # the module, and the copy beside the head
    assert not [p for c in v.stage_costs(3) for p in c.params if p.name == "mtp.embed.copy"]
    sums = [op for op in lower(loop).ops if op.group == "embedding"]
    assert len(sums) == 2 and not [op for op in lower(v).ops if op.group == "embedding"]
    assert memory(loop)[1].weights > memory(dataclasses.replace(loop, model=PLAIN))[1].weights


def test_megatron_s_deepseek_layout_leaves_the_last_stage_only_the_head_and_the_module():
    plan = resolve_plan("deepseek-v3-2048")
    assert plan.stage_split[0] == 1 and plan.stage_split[-1] == 0 and set(plan.stage_split[1:-1]) == {2}
    assert [c.name for c in plan.stage_costs(31)] == ["head", "mtp.0"]
    with pytest.raises(ParsimError, match="leaves stage 1 without a layer: every stage but a transformer's first"):
        dataclasses.replace(plan, layers_per_stage=(1, 0) + (2,) * 30)
    with pytest.raises(ParsimError, match="leaves stage 1 without a layer: every stage needs at least one"):
        Plan(model=load_model("course-mlp"), pp=2, microbatch_size=32, num_microbatches=4, layers_per_stage=(4, 0))


def test_the_executor_refuses_it():
    from executor.train.runner import check_plan

    with pytest.raises(ParsimError, match="does not execute multi-token prediction"):
        check_plan(Plan(model=GPT, dp=2, dtype="bf16"))


def test_plan_show_names_the_module_on_its_rank(capsys):
    assert main(["plan", "show", "deepseek-v3-2048"]) == 0
    out = capsys.readouterr().out
    assert "1 multi-token prediction layer" in out
    assert "0 + embedding + head + mtp.0" in out


def test_two_modules_keep_one_copy_and_the_search_prices_them_as_the_simulator_does():
    """Two modules on a last stage apart from the embedding: one copy of the table between them. The fast tier
    counts the same memory to the byte and times about the same step: every DDP plan without recomputation of
    a small GPT with two modules on 4 H100s whose pipeline splits it (2026-12-02: 184 plans, median 0.19%, at
    worst 2.0%; with ZeRO and recomputation too, 728 plans, median 0.39%, at worst 2.0%). With the stages
    balanced as well (2026-12-03), 368 plans, median 0.20%, at worst 3.3%: zero-bubble plans whose last stage
    runs only the head and the two modules (4 layers and 0)."""
    from parsim.search.fast import FastModel
    from parsim.search.space import Candidate, SearchSpace, enumerate_settings

    two = dataclasses.replace(GPT, mtp_layers=2)
    plan = Plan(model=two, dp=1, pp=2, dtype="bf16", microbatch_size=1, num_microbatches=4)
    copies = [p for c in plan.stage_costs(1) for p in c.params if p.name == "mtp.embed.copy"]
    assert [c.name for c in plan.stage_costs(1)][-2:] == ["mtp.0", "mtp.1"] and len(copies) == 1

    space = SearchSpace(two, 4, 8, dtype="bf16", degrees=(("pp", (2, 4)),))
    cluster = load_cluster("dgx-h100")
    fast = FastModel(space, cluster)
    prepared = [fast.prepare(s, variants) for s, variants in enumerate_settings(space)]
    jobs = [(p, i) for p in prepared for i, v in enumerate(p.variants)
            if v.sync_text() == "ddp" and v.recompute == "none"]
    errors = []
    plans = [Candidate(prep.setting, prep.variants[i]).plan(space) for prep, i in jobs]
    for estimate, (step_s, peak) in zip(fast.estimate(jobs), steps_and_memory(plans, cluster)):
        assert estimate.memory_bytes == pytest.approx(peak, rel=1e-12)
        errors.append(abs(estimate.step_s / step_s - 1))
    assert len(errors) > 300 and statistics.median(errors) < 0.01 and max(errors) < 0.035


def test_simulate_says_its_model_flops_include_the_module(capsys):
    """DeepSeek-V3's 291.85 GFLOP a token hold its module's 10.70 (its MoE layer and its pass through the head):
    the step computes them, and the MFU line says so."""
    model = load_model("deepseek-v3")
    assert model.mtp_flops_per_token() == pytest.approx(10.70e9, rel=1e-3)
    assert main(["simulate", "deepseek-v3-2048"]) == 0
    assert "include the multi-token prediction module's, 10.70 of 291.85 GFLOP a token" in capsys.readouterr().out
    assert load_model("llama3-8b").mtp_flops_per_token() == 0
