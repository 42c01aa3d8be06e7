"""Mixture of experts with expert parallelism: parameters, FLOPs, all-to-alls, expert GEMMs, load imbalance."""

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

MOE_SPEC = {"kind": "transformer", "name": "moe", "num_layers": 4, "hidden": 512, "num_heads": 8, "num_kv_heads": 4,
            "ffn_hidden": 2048, "seq_len": 1024, "vocab_size": 1000, "num_experts": 8, "experts_per_token": 2,
            "expert_ffn_hidden": 1024, "shared_experts": 1, "dense_layers": 1}
MOE = load_model(MOE_SPEC)


def test_mixtral_8x22b_has_141b_parameters_39b_active():
    m = load_model("mixtral-8x22b")
    assert m.num_params == pytest.approx(141e9, rel=0.005)  # Mistral AI: 141B, 39B active
    active = sum(mm.active_params for c in m.costs(1) for mm in c.matmuls) + m.embedding_params
    assert active == pytest.approx(39e9, rel=0.01)
    # MFU counts the FLOPs a token costs: its active experts, not all of them.
    assert m.model_flops_per_token() < 6 * (m.num_params / 3)


def test_dense_first_layers_routed_and_shared_experts():
    layers = MOE.layer_costs(2)
    assert not any(mm.experts > 1 for mm in layers[0].matmuls)  # dense_layers: 1
    routed = [mm for mm in layers[1].matmuls if mm.experts > 1]
    assert [mm.name for mm in routed] == ["moe.expert.gate", "moe.expert.up", "moe.expert.down"]
    assert all((mm.experts, mm.active) == (8, 2) for mm in routed)
    assert any(mm.name == "moe.shared.gate" for mm in layers[1].matmuls)


def plan(ep: int, **kw) -> Plan:
    return Plan(model=MOE, dp=4, ep=ep, dtype="bf16", num_microbatches=1, **kw)


def test_expert_parallelism_spreads_the_experts_and_their_state():
    one, four = plan(1), plan(4)
    per_expert = 3 * 512 * 1024
    assert one.params_per_rank(0) - four.params_per_rank(0) == 3 * (8 - 2) * per_expert  # 3 MoE layers, 2 of 8 kept
    assert four.expert_params_per_rank(0) == 3 * 2 * per_expert
    m1, m4 = memory(plan(4, zero=1))[0], memory(plan(4))[0]
    assert m1.optimizer < m4.optimizer  # ZeRO-1 shards the dense state over 4; each expert has a single owner
    assert m1.optimizer == pytest.approx(12 * (four.params_per_rank(0) - four.expert_params_per_rank(0)) / 4
                                         + 12 * four.expert_params_per_rank(0))


def test_each_moe_layer_dispatches_and_combines_by_all_to_all():
    program = lower(plan(4))
    a2a = [op for op in program.ops if op.group == "ep"]
    # 3 MoE layers x (the counts, then 2 fwd + 2 bwd of rows)
    assert Counter(op.collective for op in a2a) == {"all_to_all": 3 * 5}
    counts = next(op for op in a2a if op.name == "all_to_all ep layer=layer.1 mb=0 dir=fwd0")
    assert counts.nbytes == 8 * 8 and counts.stream == "compute"  # an int64 count per expert
    dispatch = next(op for op in a2a if op.name == "all_to_all ep layer=layer.1 mb=0 dir=fwd1")
    assert dispatch.nbytes == 1024 * 2 * 512 * 2  # tokens x top-2 x hidden x bf16
    assert dispatch.ranks == (0, 1, 2, 3)
    assert not any(op.group == "ep" for op in lower(plan(1)).ops)


@pytest.mark.parametrize("grad_sync", ["per_param", "bucketed"])
def test_expert_gradients_sync_over_the_ranks_holding_the_same_experts(grad_sync):
    """Dense gradients over dp; each routed expert's over edp (dp / ep ranks), numbered after the dense
    ones per parameter, and not at all when every expert lives on a single rank."""
    def dp_syncs(ep: int) -> list:
        program = lower(plan(ep, grad_sync=grad_sync))
        return [op for op in program.rank_ops(0) if op.phase == "dp"]

    dense = 9 + 3 * 10 + 1 + 2  # layer 0: q, k, v, o, 3 matmuls, 2 norms; MoE: router, 3 shared; embedding; head
    held = 3 * 3 * 4  # 3 MoE layers x gate, up, down x 4 of the 8 experts (ep 2)
    edp2 = dp_syncs(2)  # ep 2 of dp 4: ranks 0 and 2 hold the same experts
    expert_ops = [op for op in edp2 if op.ranks == (0, 2)]
    assert expert_ops and all(op.ranks == (0, 1, 2, 3) for op in edp2 if op not in expert_ops)
    if grad_sync == "per_param":
        assert [op.name for op in dp_syncs(4)] == [f"all_reduce dp param={k}" for k in range(dense)]  # edp 1
        assert [op.name for op in edp2] == [f"all_reduce dp param={k}" for k in range(dense + held)]
        assert [op.name for op in expert_ops] == [f"all_reduce dp param={k}" for k in range(dense, dense + held)]
    else:
        assert not any("expert_bucket" in op.name for op in dp_syncs(4))
        assert all(op.name.startswith("all_reduce dp expert_bucket=") for op in expert_ops)


def test_under_tp_each_rank_dispatches_its_part_of_the_sequence_and_the_tp_group_shares_the_rows():
    """Megatron-LM's MoE under tp 2 (sequence parallel): the shared experts (a gather of the block input, a
    reduce-scatter of their output), the token counts per expert (an int64 each), the dispatch of this rank's half
    of the sequence, the tp gather of the
    rows the experts received; after the experts the reduce-scatter of their partial outputs and the combine.
    The backward runs in reverse, the shared experts last."""
    program = lower(Plan(model=MOE, dp=4, tp=2, ep=2, sequence_parallel=True, dtype="bf16", num_microbatches=1))
    layer = [op for op in program.rank_ops(0) if op.kind == "collective" and "layer=layer.1 " in op.name]
    tokens, routed, hidden = 1024, 1024 * 2 * 512 * 2, 1024 * 512 * 2  # bytes: k rows and one row per token
    forward = [(op.collective, op.group, op.nbytes) for op in layer if "dir=fwd" in op.name][-7:]
    assert forward == [("all_gather", "tp", hidden), ("reduce_scatter", "tp", hidden), ("all_to_all", "ep", 8 * 8),
                       ("all_to_all", "ep", routed / 2), ("all_gather", "tp", routed), ("reduce_scatter", "tp", routed),
                       ("all_to_all", "ep", routed / 2)]
    backward = [(op.collective, op.group) for op in layer if "dir=bwd" in op.name][:6]
    assert backward == [("all_to_all", "ep"), ("all_gather", "tp"), ("reduce_scatter", "tp"), ("all_to_all", "ep"),
                        ("all_gather", "tp"), ("reduce_scatter", "tp")]
    # the router scores this rank's tokens only, and its gradient joins the norms' sum over tp
    moe = next(op for op in program.rank_ops(0) if op.name == "F stage=0 mb=0" and (tokens // 2, 8, 512) in op.matmuls)
    assert (tokens, 8, 512) not in moe.matmuls
    norms = next(op for op in program.rank_ops(0) if op.name == "all_reduce tp params=norms")
    per_layer = 2 * 512  # two norm gains
    assert norms.nbytes == (4 * per_layer + 512 + 3 * 512 * 8) * 4  # + the head's norm + 3 routers, fp32 grads


def test_moe_under_tp_needs_sequence_parallelism_as_megatron():
    with pytest.raises(ParsimError, match="tp 2 with mixture-of-experts layers needs sequence_parallel: true"):
        Plan(model=MOE, dp=2, tp=2)


def test_a_rank_runs_one_gemm_per_expert_it_holds():
    # A hot expert (twice the mean load) sets the pace: its GEMMs take 1024 x 2 x 4 / 8 x 2 tokens, the other
    # expert its rank holds the mean's 1024, as the shared expert (every token once).
    program = lower(plan(4, expert_load=2.0))
    moe = next(op for op in program.ops if op.name == "F stage=0 mb=0" and (1024, 8, 512) in op.matmuls)
    hot = [mm for mm in moe.matmuls if mm[0] == 2048]
    assert len(hot) == 3  # gate, up, down
    mean = [mm for mm in moe.matmuls if mm[0] == 1024 and mm != (1024, 8, 512)]
    assert len(mean) == 2 * 3  # the other expert held and the shared expert


def test_a_hot_experts_rank_moves_its_extra_rows_and_every_rank_waits_for_it():
    """--expert-load 1.5 under tp 2 x ep 2: the busiest expert's rank holds 4 experts, that one at 1.5x the mean
    and the others at the mean, so it receives (1.5 + 3) / 4 = 1.125x the mean rows in the dispatch and sends
    them back in the combine, its tp group gathering and scattering them all; the shared experts' and the
    attention's collectives and the counts carry the same bytes as under balanced routing."""
    def layer(expert_load: float) -> list[tuple[str, str, float]]:
        program = lower(Plan(model=MOE, dp=4, tp=2, ep=2, sequence_parallel=True, dtype="bf16", num_microbatches=1,
                             expert_load=expert_load))
        return [(op.name, op.group, op.nbytes) for op in program.rank_ops(0)
                if op.kind == "collective" and "layer=layer.1 " in op.name]

    even, hot = layer(1.0), layer(1.5)
    routed = 1024 * 2 * 512 * 2  # bytes: the k rows of every token
    scaled = [(e[1], h[2] / e[2]) for e, h in zip(even, hot) if h[2] != e[2]]
    assert scaled == [("ep", 1.125), ("tp", 1.125), ("tp", 1.125), ("ep", 1.125)] * 2  # dispatch, gather, ...
    assert max(h[2] for h in hot) == 1.125 * routed
    assert sum(e[2] == h[2] for e, h in zip(even, hot)) == len(even) - 8  # the rest as balanced


@pytest.mark.parametrize("kernels, unpermute", [("fused", (2 + 1, 2 + 1)), ("eager", (5 * 2 + 1, 7 * 2 + 1))])
def test_the_experts_activation_runs_on_the_busiest_ranks_rows_and_the_rows_come_back_to_their_tokens(kernels,
                                                                                                      unpermute):
    """--expert-load 1.5 on ep 4 (2 experts a rank): the routed experts' SwiGLU runs on the busiest expert's
    rank's rows, (1.5 + 1) / 2 = 1.25x the mean, as their GEMMs do; the shared
    experts' and the sender's permute and unpermute (its own tokens' k rows) do not move. The unpermute
    reads k rows a token and writes one (fused), or reorders, weighs and sums them (eager)."""
    from parsim.lowering.kernels import block_work

    model = load_model({**MOE_SPEC, "layer_kernels": kernels})
    tokens = 1024

    def parts(expert_load: float, kind: str = "F") -> dict[str, float]:
        p = Plan(model=model, dp=4, ep=4, dtype="bf16", num_microbatches=1, expert_load=expert_load)
        block = next(b for c in p.stage_costs(0) for b in c.blocks if b.name == "moe")
        return {name: nbytes for name, nbytes, _ in block_work(p, block, kind, tokens).elementwise_parts}

    even, hot = parts(1.0), parts(1.5)
    assert hot["moe.act"] == 1.25 * even["moe.act"]
    assert all(hot[n] == even[n] for n in ("moe.shared.act", "moe.permute", "moe.unpermute", "moe.norm"))
    assert even["moe.unpermute"] == unpermute[0] * 512 * 2 * tokens  # (k+1)h or (5k+1)h elements, bf16
    assert parts(1.0, "B")["moe.unpermute"] == unpermute[1] * 512 * 2 * tokens


@pytest.mark.parametrize("kernels, ep, accesses", [
    ("fused", 2, (4, 4)), ("fused", 8, None), ("eager", 8, (4, 6)), ("fused", 1, None)])
def test_the_dispatched_rows_are_sorted_by_local_expert_and_back(kernels, ep, accesses):
    """Megatron-LM's alltoall dispatcher copies the received rows into groups by local expert and back where a
    rank holds several experts (ep 2: 4 each; ep 8: one, no copy); the executor's eager dispatcher always, its
    backward scattering into zeros. Each copy reads and writes the k rows of every token: 1024 x 2 x 512."""
    from parsim.lowering.kernels import block_work

    p = Plan(model=load_model({**MOE_SPEC, "layer_kernels": kernels}), dp=8, ep=ep, dtype="bf16",
             num_microbatches=1)
    block = next(b for c in p.stage_costs(0) for b in c.blocks if b.name == "moe")
    sorted_bytes = [{name: nbytes for name, nbytes, _ in block_work(p, block, kind, 1024).elementwise_parts}.get(
        "moe rows sorted by local expert and back") for kind in "FB"]
    expected = [None, None] if accesses is None else [n * 1024 * 2 * 512 * 2 for n in accesses]
    assert sorted_bytes == expected


def test_a_hot_expert_slows_the_step_unless_capacity_drops_its_tokens():
    spec = ideal_spec()
    balanced = predict_step(plan(4), spec).step_s
    hot = predict_step(plan(4, expert_load=2.0), spec).step_s
    capped = predict_step(plan(4, expert_load=2.0, capacity_factor=1.25), spec).step_s
    assert balanced < capped < hot


def test_moe_rules():
    with pytest.raises(ParsimError, match="ep 3 must divide the 4 data-parallel ranks"):
        plan(3)
    with pytest.raises(ParsimError, match="ep 16 must divide"):
        plan(16)
    with pytest.raises(ParsimError, match="expert parallelism needs a mixture-of-experts model"):
        Plan(model=load_model("tiny-gpt"), dp=2, ep=2)
    with pytest.raises(ParsimError, match="expert_load 0.5 is below 1"):
        plan(2, expert_load=0.5)
    with pytest.raises(ParsimError, match="shard_group 2 is not a multiple of ep 4: HSDP shards experts"):
        plan(4, grad_sync="fsdp", shard_group=2)


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_fsdp_shards_experts_over_the_ranks_holding_them_and_the_rest_over_all(ep):
    """torchtitan's FSDP of a mixture-of-experts model: each layer on the data-parallel mesh, its routed
    experts on the mesh of ranks holding the same experts (dp x cp / ep ranks), each gathered and
    reduce-scattered over its own mesh; experts held whole by one rank each (ep = dp x cp) never move."""
    fsdp = plan(ep, grad_sync="fsdp")
    experts = fsdp.expert_params_per_rank(0)  # 3 MoE layers x 8/ep experts x 3 weights
    assert experts == 3 * (8 // ep) * 3 * 512 * 1024
    dense = fsdp.params_per_rank(0) - experts
    replicas = 4 // ep  # ranks holding the same experts
    assert memory(fsdp)[0].weights == pytest.approx(4 * (dense / 4 + experts / replicas))  # FSDP2's fp32 shards
    # FSDP's buffers: the largest layer gathered twice (bf16) and its gradients (fp32); experts held whole
    # are never gathered. Under a pipeline every layer's (4 bytes per parameter is enough to tell).
    held_whole = replicas == 1
    gathered = max(c.params_per_rank(1, ep) - c.expert_params_per_rank(1, ep) * held_whole
                   for c in fsdp.stage_costs(0))
    assert memory(fsdp)[0].buffers == pytest.approx(gathered * (2 * 2 + 4))
    piped = Plan(model=MOE, dp=4, pp=2, ep=ep, dtype="bf16", num_microbatches=2, grad_sync="fsdp")
    stage = piped.params_per_rank(0) - piped.expert_params_per_rank(0) * held_whole
    assert memory(piped)[0].buffers == pytest.approx(stage * (2 + 4))
    ops = lower(fsdp).ops
    gathers = [op for op in ops if op.collective == "all_gather" and op.name.endswith("mb=0 dir=fwd")]
    per_layer_experts = experts // 3 * 2  # bf16 bytes of one layer's experts on this rank
    expert_gathers = [op for op in gathers if ".experts" in op.name]
    if replicas == 1:
        assert not expert_gathers
    else:
        assert [op.name.split()[2] for op in expert_gathers] == [f"layer=layer.{i}.experts" for i in (1, 2, 3)]
        assert all(op.nbytes == per_layer_experts and len(op.ranks) == replicas for op in expert_gathers)
        assert len({op.name for op in ops if op.collective == "reduce_scatter" and ".experts" in op.name}) == 3
    dense_gathers = [op for op in gathers if ".experts" not in op.name]
    assert sum(op.nbytes for op in dense_gathers) == 2 * dense and all(len(op.ranks) == 4 for op in dense_gathers)
    assert predict_step(fsdp, ideal_spec()).ranks[0].seconds["fsdp"] > 0


def hsdp(ep: int, shard_group: int, **kw) -> Plan:
    return Plan(model=MOE, dp=8, ep=ep, dtype="bf16", num_microbatches=1, shard_group=shard_group, **kw)


@pytest.mark.parametrize("grad_sync,zero", [("fsdp", 3), ("bucketed", 1)])
def test_hsdp_shards_experts_within_each_shard_group_and_all_reduces_across(grad_sync, zero):
    """torchtitan's HSDP of a mixture of experts (dp_replicate x dp_shard, ep borrowed from dp_shard): dp 8 in
    2 shard groups of 4 ranks, ep 2. The dense weights shard over the 4 ranks of a shard group; the experts
    over the 2 of them holding the same experts (dp_shard_mod_ep); each shard is all-reduced over the 2 shard
    groups, the experts' too."""
    p = hsdp(2, 4, grad_sync=grad_sync, zero=zero)
    assert (p.shard_size, p.expert_shard_size, p.replicas) == (4, 2, 2)
    experts = p.expert_params_per_rank(0)
    dense = p.params_per_rank(0) - experts
    master = 0 if zero == 3 else 4  # FSDP2's fp32 shards are the master weights
    assert memory(p)[0].optimizer == pytest.approx((dense / 4 + experts / 2) * (8 + master))  # + Adam's m, v
    ops = lower(p).ops
    layer = experts // 3 * 4 if zero == 3 else None  # one layer's expert gradients, fp32, on this rank
    scatters = [op for op in ops if op.collective == "reduce_scatter" and op.rank == 0]
    across = [op for op in ops if op.collective == "all_reduce" and op.rank == 0 and op.phase in ("fsdp", "dp")]
    expert_scatters = [op for op in scatters if "expert" in op.name]
    assert expert_scatters and all(op.ranks == (0, 2) for op in expert_scatters)  # rank 1 holds other experts
    assert all(op.ranks == (0, 1, 2, 3) for op in scatters if "expert" not in op.name)
    assert all(op.ranks == (0, 4) for op in across)  # the same shard in the other shard group
    assert sum(op.nbytes for op in across) == pytest.approx(
        sum(op.nbytes / (2 if "expert" in op.name else 4) for op in scatters))
    if layer is not None:
        assert all(op.nbytes == layer for op in expert_scatters)
    assert predict_step(p, ideal_spec()).step_s > 0


def test_hsdp_with_experts_whole_in_each_shard_group_all_reduces_them_only():
    """ep = shard_group: each rank of a shard group holds other experts, so nothing of theirs is sharded or
    gathered; their gradients are all-reduced over the shard groups (FSDP2 on a replicate x 1 mesh)."""
    p = hsdp(2, 2, grad_sync="fsdp", zero=3)
    assert (p.expert_shard_size, p.replicas) == (1, 4)
    ops = [op for op in lower(p).ops if op.rank == 0 and "expert" in op.name]
    assert ops and {op.collective for op in ops} == {"all_reduce"}
    assert all(op.ranks == (0, 2, 4, 6) for op in ops)
    experts = p.expert_params_per_rank(0)
    assert memory(p)[0].weights == pytest.approx(4 * ((p.params_per_rank(0) - experts) / 2 + experts))


def test_mixtral_example_plan_simulates_and_fits():
    p = resolve_plan("mixtral-8x22b")
    assert (p.world, p.ep, p.pp, p.tp) == (128, 8, 4, 4)
    r = predict_step(p, ideal_spec(**{"gpu.hbm_capacity_GB": 80}))
    assert r.ranks[0].seconds["ep"] > 0 and not r.over_memory


def test_routing_knobs_on_a_dense_model_are_refused_not_ignored():
    with pytest.raises(ParsimError, match="expert_load and capacity_factor describe expert routing"):
        Plan(model=load_model("tiny-gpt"), dp=2, expert_load=2.0)


def test_deepseek_v3_has_671b_parameters_37b_active_with_latent_attention():
    m = load_model("deepseek-v3")
    assert m.num_params == pytest.approx(671e9, rel=0.002)  # DeepSeek-AI 2024: 671B, 37B activated
    active = sum(mm.active_params for c in m.costs(1) for mm in c.matmuls)
    assert active == pytest.approx(37e9, rel=0.02)
    attention = next(b for b in m.layer_costs(2)[0].blocks if b.name == "attention")
    assert [mm.name for mm in attention.matmuls] == ["attn.q_a", "attn.q_b", "attn.kv_a", "attn.kv_b", "attn.o"]
    assert attention.attention_flops_per_token == 2 * 4096 * 128 * (192 + 128)  # scores over 192, values over 128


def test_deepseek_example_plan_keeps_expert_groups_on_eight_nodes():
    p = resolve_plan("deepseek-v3-2048")
    assert (p.world, p.ep, p.pp, p.schedule, p.dtype) == (2048, 64, 16, "dualpipe-v", "fp8")
    ep_group = p.rank_grid[:64, 0, 0, 0]  # stage 0's first expert-parallel group, as the lowering forms it
    assert len(set((ep_group // 8).tolist())) == 8


LATENT = load_model({"kind": "transformer", "name": "mla", "num_layers": 2, "hidden": 512, "num_heads": 8,
                     "num_kv_heads": 8, "ffn_hidden": 1024, "seq_len": 1024, "vocab_size": 1000, "attention": "mla",
                     "q_lora_rank": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
                     "v_head_dim": 32})


def _attention_collectives(plan: Plan, direction: str) -> list[tuple[str, float]]:
    program = lower(plan)
    return [(op.collective, op.nbytes) for op in program.rank_ops(0)
            if op.kind == "collective" and " layer=layer.0 " in op.name and f"dir={direction}" in op.name][
        :4 if direction == "fwd" else None]


def test_latent_attention_under_sequence_parallelism_gathers_its_latents_as_megatron():
    """Megatron-LM's MLA under tp 2 with sequence parallelism: the duplicated down-projections run on the
    rank's half of the sequence; the RoPE key, the normed query latent and the normed key/value latent are
    all-gathered before the up-projections, the output reduce-scattered; the backward mirrors it."""
    plan = Plan(model=LATENT, tp=2, sequence_parallel=True, dtype="bf16", num_microbatches=1)
    tokens = 1024 * 2  # bytes per element
    assert _attention_collectives(plan, "fwd") == [
        ("all_gather", 16 * tokens), ("all_gather", 128 * tokens), ("all_gather", 64 * tokens),
        ("reduce_scatter", 512 * tokens)]
    backward = _attention_collectives(plan, "bwd")
    assert backward[-4:] == [("all_gather", 512 * tokens), ("reduce_scatter", 64 * tokens),
                             ("reduce_scatter", 128 * tokens), ("reduce_scatter", 16 * tokens)]
    program = lower(plan)
    forward = [mm for op in program.rank_ops(0) if op.name == "F stage=0 mb=0" for mm in op.matmuls]
    assert (512, 128, 512) in forward and (512, 80, 512) in forward  # q_a, kv_a on 1024 / 2 rows
    norms = next(op for op in program.rank_ops(0) if op.name == "all_reduce tp params=norms")
    per_layer = 2 * 512 + 128 + 64 + 512 * 128 + 512 * 80  # layer norms, latent norms, q_a and kv_a weights
    assert norms.nbytes == (2 * per_layer + 512) * 4  # + the head's norm, fp32 gradients


def test_latent_attention_without_sequence_parallelism_all_reduces_the_latents_gradients():
    plan = Plan(model=LATENT, tp=2, dtype="bf16", num_microbatches=1)
    tokens = 1024 * 2
    assert _attention_collectives(plan, "fwd")[0] == ("all_reduce", 512 * tokens)
    assert _attention_collectives(plan, "bwd")[-2:] == [("all_reduce", 64 * tokens), ("all_reduce", 128 * tokens)]


def test_the_busiest_experts_rank_keeps_its_extra_rows_for_the_backward():
    """--expert-load 1.5: the rank holding the busiest expert computes 1.5x the mean rows (kernels) and keeps
    them too: the dispatched rows and the experts' intermediates scale by 1.5, the rest of the layer does not."""
    from parsim.workload.plan import resolve_plan

    even, hot = resolve_plan("mixtral-8x22b"), resolve_plan("mixtral-8x22b", overrides={"moe": {"expert_load": 1.5}})
    widths = [{a.name: a.width for a in p.stage_costs(0)[1].activations} for p in (even, hot)]
    for name, width in widths[0].items():
        assert widths[1][name] == (width * 1.5 if name.startswith(("moe.dispatched", "moe.expert.")) else width)
    assert memory(hot)[0].activations > 1.3 * memory(even)[0].activations


def test_simulate_says_mfu_counts_the_rows_a_small_capacity_drops(capsys):
    """Below 1 the capacity factor drops routed rows even under balanced routing: the GEMMs shrink, and the MFU
    line says its model FLOPs still count them (as Megatron-LM's throughput formula does)."""
    from parsim.cli.main import main

    assert main(["simulate", "mixtral-8x22b", "--capacity-factor", "0.5"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "at capacity_factor 0.5 the experts drop at least 50% of the routed rows" in out
    assert main(["simulate", "mixtral-8x22b", "--capacity-factor", "1.25"]) == 0
    assert "drop at least" not in capsys.readouterr().out
