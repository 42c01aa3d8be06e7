"""Activation recomputation and sequence parallelism: memory by Korthikanti et al.'s forms, the extra
forward, MFU against HFU, and the collectives sequence parallelism swaps in."""

from __future__ import annotations

from collections import Counter

import pytest
from ideal_cluster import ideal_spec

from parsim.errors import ParsimError
from parsim.lowering.lower import lower
from parsim.sim.step import predict_step
from parsim.workload.memory import saved_bytes_per_token
from parsim.workload.model import load_model
from parsim.workload.plan import Plan, load_plan

# GPT shapes (multi-head, GeLU MLP of 4h) so Korthikanti et al.'s 34sbh-style forms apply directly.
H = 1024
GPT_SHAPES = {"kind": "transformer", "name": "gpt", "num_layers": 8, "hidden": H, "num_heads": 16,
              "ffn_hidden": 4 * H, "ffn_type": "gelu", "seq_len": 512, "vocab_size": 1000}
GPT = load_model(GPT_SHAPES)
T = 4


def plan(**kw) -> Plan:
    return Plan(model=GPT, tp=T, pp=2, num_microbatches=4, dtype="bf16", **kw)


def layer_bytes(p: Plan) -> int:
    """Saved bytes per token of one decoder layer, from the memory model: the last stage's, less its
    head (never recomputed), over its layers."""
    return layer_bytes_of(p, T)


def layer_bytes_of(p: Plan, tp: int = 1) -> int:
    """:func:`layer_bytes` of a plan of ``tp`` tensor-parallel ranks."""
    costs = p.stage_costs(1)
    head = costs[-1].activation_bytes_per_token(tp)
    return (saved_bytes_per_token(p, 1) - head) // (len(costs) - 1)


@pytest.mark.parametrize("recompute, sp, expected", [
    # Korthikanti et al. 2022, Table 2, with flash attention (no 5as/h term) and no dropout masks (-2):
    ("none", False, 8 * H + 24 * H // T),  # sbh(10 + 24/t) -> 8h + 24h/t bytes per token
    ("selective", False, 8 * H + 24 * H // T),  # the attention scores it would drop are never stored
    ("none", True, 32 * H // T),  # sequence parallelism splits every term: 34sbh/t -> 32h/t
    ("full", False, 2 * H),  # only the layer input: 2sbh
    ("full", True, 2 * H // T),  # the input, split along the sequence
])
def test_activation_memory_per_layer_follows_korthikanti(recompute, sp, expected):
    assert layer_bytes(plan(activation_recompute=recompute, sequence_parallel=sp)) == expected


def test_full_recompute_keeps_one_rebuilt_layer_while_its_backward_runs():
    p = plan(activation_recompute="full", sequence_parallel=True)
    mem = predict_step(p, ideal_spec()).memory[1]
    tokens = p.tokens_per_microbatch
    layer = 32 * H // T  # a rebuilt layer's full activations (with SP)
    assert mem.activations == (mem.in_flight * saved_bytes_per_token(p, 1) + layer) * tokens


def test_recompute_some_layers_of_each_stage():
    p = plan(activation_recompute="full", recompute_layers=1)
    assert [c.name for c in p.recomputed(1)] == ["layer.4"]
    assert layer_bytes(p) * 4 == 3 * (8 * H + 24 * H // T) + 2 * H


def test_recompute_reruns_each_layer_forward_before_its_backward():
    base, full = lower(plan()), lower(plan(activation_recompute="full"))
    forward = [op for op in base.ops if op.rank == 0 and op.name == "F stage=0 mb=0"]
    rerun = [op for op in full.ops if op.rank == 0 and op.name == "R stage=0 mb=0"]
    assert [op.matmuls for op in rerun] == [op.matmuls for op in forward if op.matmuls]  # the embedding has none
    # Each recomputed layer's forward all-reduces again, under their own names.
    assert any(op.name == "all_reduce tp layer=layer.0 mb=0 dir=rec0" for op in full.ops)


def test_recompute_costs_a_forward_more_and_shows_as_hfu():
    spec = ideal_spec()
    base = predict_step(plan(), spec)
    full = predict_step(plan(activation_recompute="full"), spec)
    assert full.step_s > base.step_s
    assert full.hardware_flops > full.model_flops == base.model_flops
    layer_forward = GPT.costs(2)[1].forward_flops_per_token()
    assert full.hardware_flops - full.model_flops == pytest.approx(8 * layer_forward * full.plan.tokens_per_step)
    assert full.hfu == pytest.approx(full.mfu * full.hardware_flops / full.model_flops)
    assert full.ranks[0].seconds["recompute"] > 0 and base.ranks[0].seconds["recompute"] == 0


def test_sequence_parallelism_swaps_all_reduce_for_all_gather_and_reduce_scatter():
    ops = Counter(op.collective for op in lower(plan(sequence_parallel=True)).ops if op.group == "tp")
    plain = Counter(op.collective for op in lower(plan()).ops if op.group == "tp")
    blocks = 2 * 8 * 4  # attention and MLP, 8 layers, 4 microbatches
    # Forward and backward: one all-gather and one reduce-scatter per block where an all-reduce was, and in the
    # backward the block's input gathered again for the weight gradients; the head gathers its input (forward,
    # and again in the backward) and scatters its gradient (backward), the embedding scatters its output
    # (forward) and gathers its gradient (backward).
    assert ops["all_gather"] == 3 * blocks + 4 + 4 + 4 and ops["reduce_scatter"] == 2 * blocks + 4 + 4
    # Gone: the blocks', embedding's and head's all-reduces; new: one sum of the norm gradients per pipeline rank.
    assert plain["all_reduce"] - ops["all_reduce"] == 2 * blocks + 4 + 4 - 2
    assert sum(op.name == "all_reduce tp params=norms" for op in lower(plan(sequence_parallel=True)).ops) == 2


def test_sequence_parallel_pipeline_sends_carry_each_ranks_part_of_the_sequence():
    """Under sequence parallelism a stage's output is split along the sequence, so each tensor-parallel rank sends
    the next stage its part: 1/t of a microbatch's activations (Megatron-LM's get_tensor_shapes)."""
    tokens = 512 * plan().microbatch_size
    for sp, split in ((False, 1), (True, T)):
        sends = {op.nbytes for op in lower(plan(sequence_parallel=sp)).ops if op.kind == "send"}
        assert sends == {tokens * H * 2 / split}  # bf16 activations, or their gradients back


@pytest.mark.parametrize("asynchronous", [False, True])
def test_sequence_parallelism_moves_the_same_bytes_in_line_and_saves_memory(asynchronous):
    """Against ring all-reduces: an all-gather plus a reduce-scatter is a ring all-reduce, split in two, and
    with every collective in line the steps match, but for the input gathered again in the backward.
    (In-switch reduction speeds up the all-reduce only, so there sequence parallelism costs more time.)"""
    spec = ideal_spec(**{"intra_node.in_switch_reduction": False})
    plain = predict_step(plan(tp_async_backward=asynchronous), spec)
    sp = predict_step(plan(sequence_parallel=True, tp_async_backward=asynchronous), spec)
    assert sp.memory[1].activations < plain.memory[1].activations
    if asynchronous:  # the gather again hides in part behind the input-gradient GEMMs
        assert plain.step_s < sp.step_s < plain.step_s * 1.15
        return
    from parsim.search.costs import CommCosts
    from parsim.sim.compute import ComputeModel

    p = plan(sequence_parallel=True, tp_async_backward=False)
    comm = CommCosts(spec, p.world, ComputeModel.for_cluster(spec, p.dtype, p.dtype_bytes))
    program = lower(p)
    # rank 0 (the first of 2 stages): each layer's backward gathers the MLP's input again second, the
    # attention's fifth (after each block's output-gradient gather)
    again = [op for op in program.ops if op.rank == 0 and op.collective == "all_gather"
             and op.name.endswith(("dir=bwd1", "dir=bwd4"))]
    assert len(again) == 4 * 2 * 4  # 4 layers, 2 blocks, 4 microbatches
    regathered_s = sum(comm.time("collective", "all_gather", op.ranks, op.nbytes) for op in again)
    # (an all-gather and a reduce-scatter are a ring all-reduce but for one more latency: the last 1%)
    assert sp.ranks[0].seconds["tp"] - plain.ranks[0].seconds["tp"] == pytest.approx(regathered_s, rel=0.02)


def test_plan_rules_for_recompute_and_sequence_parallelism():
    with pytest.raises(ParsimError, match="activation_recompute 'some' is not one of none, selective, full"):
        plan(activation_recompute="some")
    with pytest.raises(ParsimError, match="recompute_layers needs activation_recompute full"):
        plan(recompute_layers=2)
    with pytest.raises(ParsimError, match="sequence_parallel: .* has no sequence-parallel form"):
        Plan(model=load_model("course-mlp"), tp=2, sequence_parallel=True)


def test_yaml_keys_round_trip():
    p = load_plan({"model": "tiny-gpt", "parallel": {"tp": 2}, "sequence_parallel": True,
                   "activation_recompute": {"granularity": "full", "layers": 2}})
    assert (p.sequence_parallel, p.activation_recompute, p.recompute_layers) == (True, "full", 2)
    assert load_plan(p.to_dict()) == p
    assert load_plan({"model": "tiny-gpt", "activation_recompute": "selective"}).activation_recompute == "selective"


# ----------------------------------------------------------------------------- fp8 storage, recompute modules
def test_fp8_plans_keep_each_linear_s_input_in_fp8_and_the_attention_output_twice():
    """Transformer Engine's linears keep the fp8 copy of their input for the weight gradient: the norms' outputs
    (the QKV and fc1 inputs) and fc2's input at 1 byte, not 2; FlashAttention's output, which its backward
    reads, stays in bf16 beside the output projection's fp8 copy."""
    model = load_model({**GPT_SHAPES, "ffn_type": "swiglu", "ffn_hidden": 3 * H})
    bf16, fp8 = (Plan(model=model, pp=2, num_microbatches=4, dtype=d) for d in ("bf16", "fp8"))
    saved = {a.name: a.bytes_per_token() for a in fp8.stage_costs(1)[0].activations}
    assert saved["attn.in"] == saved["mlp.in"] == H and saved["mlp.down.in"] == 3 * H
    assert saved["attn.o.in"] == 2 * H and saved["attn.o.in.fp8"] == H
    assert layer_bytes_of(bf16) - layer_bytes_of(fp8) == H + H + 3 * H - H


def test_recompute_modules_drop_what_they_rebuild_and_rerun_it_before_the_backward():
    """DeepSeek-V3's selective recompute (Megatron-LM's modules layernorm, mla_up_proj, moe_act): the norms'
    outputs, the up-projections' Q, K, V and the experts' activation outputs are not kept; the backward reruns
    the norms, the up-projection GEMMs with their RoPE, and the activation function."""
    from parsim.lowering.kernels import block_work
    from parsim.workload.plan import resolve_plan

    modules = ["layernorm", "mla_up_proj", "moe_act"]
    kept = resolve_plan("deepseek-v3-2048", overrides={"activation_recompute": "none"})
    rebuilt = resolve_plan("deepseek-v3-2048",
                           overrides={"activation_recompute": {"granularity": "selective", "modules": modules}})
    names = {a.name for a in rebuilt.stage_costs(5)[0].activations}  # a MoE layer (the first three are dense)
    assert names.isdisjoint({"attn.in", "mlp.in", "attn.q", "attn.k", "attn.v", "moe.expert.down.in"})
    assert {"norm.attn.in", "attn.kv_a.out", "attn.o.in", "moe.dispatched", "moe.expert.gate.out"} <= names
    assert saved_bytes_per_token(rebuilt, 5) < 0.6 * saved_bytes_per_token(kept, 5)
    layer = rebuilt.stage_costs(5)[0]
    tokens = rebuilt.tokens_per_rank
    for block in layer.blocks:
        backward, plain = block_work(rebuilt, block, "B", tokens), block_work(kept, block, "B", tokens)
        reruns = [label for label in backward.labels if label.endswith("(recomputed)")]
        parts = [name for name, _, _ in backward.elementwise_parts if name.endswith("(recomputed)")]
        if block.name == "attention":
            assert reruns == ["attn.q_b (recomputed)", "attn.kv_b (recomputed)"]
            assert parts == ["attn.norm (recomputed)", "attn.rope (recomputed)"]
        else:
            assert reruns == [] and parts == ["moe.norm (recomputed)", "moe.act (recomputed)",
                                              "moe.shared.act (recomputed)"]
        assert backward.elementwise_bytes > plain.elementwise_bytes
        assert block_work(rebuilt, block, "F", tokens) == block_work(kept, block, "F", tokens)


def test_recompute_modules_cost_time_and_round_trip():
    spec = ideal_spec()
    none, modules = plan(activation_recompute="none"), plan(activation_recompute="selective",
                                                            recompute_modules=("core_attn", "layernorm"))
    assert predict_step(modules, spec).step_s > predict_step(none, spec).step_s
    assert layer_bytes(modules) == layer_bytes(none) - 2 * 2 * H  # the two norms' bf16 outputs, whole on every rank
    assert load_plan(modules.to_dict()) == modules
    assert modules.to_dict()["activation_recompute"] == {"granularity": "selective",
                                                         "modules": ["core_attn", "layernorm"]}
    assert plan(activation_recompute="selective").recompute_modules == ("core_attn",)  # Megatron-LM's default


@pytest.mark.parametrize("kw, message", [
    ({"activation_recompute": "selective", "recompute_modules": ("mlp",)},
     "recompute module 'mlp' is not one of core_attn, layernorm, mla_up_proj, moe_act"),
    ({"activation_recompute": "selective", "recompute_modules": ("mla_up_proj",)},
     "recompute module mla_up_proj needs a model with latent attention"),
    ({"activation_recompute": "selective", "recompute_modules": ("moe_act",)},
     "recompute module moe_act needs a model with mixture-of-experts layers"),
    ({"activation_recompute": "full", "recompute_modules": ("layernorm",)},
     "recompute modules need activation_recompute selective"),
])
def test_recompute_modules_are_refused_where_they_do_not_apply(kw, message):
    with pytest.raises(ParsimError, match=message):
        plan(**kw)


def test_a_recompute_module_list_of_another_type_is_refused_in_one_line(tmp_path, capsys):
    from parsim.cli.main import main

    path = tmp_path / "plan.yaml"
    path.write_text("model: tiny-gpt\nactivation_recompute: {granularity: selective, modules: layernorm}\n")
    assert main(["simulate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "activation_recompute.modules" in err


def test_the_deepseek_v3_example_fits_its_80_gb_as_it_did_for_deepseek():
    """DeepSeek-V3 trained on 80 GB H800s: with its recomputation and fp8 storage the example fits, each rank's
    activations weighed stage by stage (rank 0's last stage, with the vocabulary's fp32 softmax, holds one
    microbatch at the peak, not 33)."""
    from parsim.hardware.cluster import load_cluster
    from parsim.workload.memory import memory
    from parsim.workload.plan import resolve_plan

    plan = resolve_plan("deepseek-v3-2048")
    ranks = memory(plan)
    assert max(m.total for m in ranks) < load_cluster("dgx-h100").gpu.hbm_capacity_bytes
    first = ranks[0]
    assert first.peak_counts == (32, 1, 0, 0) and first.in_flight == 33
    saved = [saved_bytes_per_token(plan, s) for s in plan.stages_of(0)]
    assert first.activations == (32 * saved[0] + saved[1]) * plan.tokens_per_rank
