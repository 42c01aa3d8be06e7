"""Mixture-of-experts layers with expert parallelism train exactly like one process, on 2 and 4 gloo ranks.

The layer itself (one process) equals a plain loop over tokens and their
top-k experts, output and gradients. Plans of a tiny MoE transformer (one
dense layer, then routed top-2 experts plus one shared expert) take one step,
AdamW included: ep over all data-parallel ranks (each expert on one rank, the
expert-data-parallel group of size 1: nothing to sync, gradients only
divided), ep 2 of dp 4 (experts synced over 2 ranks), ep 1 (experts synced
over dp like the dense weights, in buckets of their own), ep with
pipeline stages (1F1B and zero-bubble's split backward), FSDP and HSDP
(the routed experts a unit of their own on the ranks holding them, as
torchtitan shards them), and ZeRO-1/2 (the experts' buckets sharded apart,
over the ranks holding them). Every rank's loss,
gradients (the routed experts' reported apart: their gradients gather every
expert-parallel rank's tokens, so the division is the easy thing to get
wrong) and weights must equal the reference, and every rank the simulator
times must record exactly its events: the all-to-alls by layer, microbatch
and direction, and the dense and expert gradient syncs.
"""

from __future__ import annotations

import importlib.util

import pytest
from reference_runs import assert_events_as_simulated, assert_step_equals_reference, verify_plans

from parsim.errors import ParsimError
from parsim.lowering.lower import lower
from parsim.workload.model import load_model
from parsim.workload.plan import load_plan

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
pytestmark = needs_torch

MOE = {"kind": "transformer", "name": "moe", "num_layers": 4, "hidden": 32, "num_heads": 4, "num_kv_heads": 2,
       "ffn_hidden": 64, "seq_len": 16, "vocab_size": 64, "num_experts": 4, "experts_per_token": 2,
       "expert_ffn_hidden": 32, "shared_experts": 1, "dense_layers": 1}
BATCH = {"microbatch_size": 2, "num_microbatches": 2}
# DeepSeek-V2/V3's latent attention, queries compressed or not
MLA = {"attention": "mla", "num_kv_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 8,
       "qk_rope_head_dim": 4, "v_head_dim": 6}
BUCKETS = {"grad_sync": "bucketed", "bucket_size": "8KiB", "overlap": True}  # several dense and expert buckets
PER_PARAM = {"grad_sync": "per_param"}
FSDP = {"grad_sync": "fsdp"}
ZERO1, ZERO2 = dict(BUCKETS, zero=1), dict(BUCKETS, zero=2)


def moe_plan(dp: int, ep: int, pp: int = 1, model: dict = MOE, schedule: str = "1f1b", sync: dict = BUCKETS,
             cp: int = 1, capacity: float | None = None, tp: int = 1):
    return load_plan({"model": model, "parallel": {"dp": dp, "ep": ep, "pp": pp, "cp": cp, "tp": tp}, "batch": BATCH,
                      "schedule": schedule, "data_parallel": sync, "sequence_parallel": tp > 1,
                      **({"moe": {"capacity_factor": capacity}} if capacity else {})})


PLANS_2 = {
    "ep2 x dp2 (edp 1), buckets": moe_plan(2, 2),
    "ep2 x dp2 (edp 1), per-parameter sync, gelu, 8 experts": moe_plan(
        2, 2, model=dict(MOE, ffn_type="gelu", num_experts=8), sync=PER_PARAM),
    "dp2, ep1 (experts synced over dp)": moe_plan(2, 1),
    "cp2 x ep2 (experts over the context-parallel ranks)": moe_plan(1, 2, cp=2),
    "FSDP dp2 ep1 (the experts a unit of their own, over both ranks)": moe_plan(2, 1, sync=FSDP),
    "FSDP dp2 ep2 (each rank's experts whole, never gathered)": moe_plan(2, 2, sync=FSDP),
    "ZeRO-1 dp2 ep2 (each rank's experts whole, only divided)": moe_plan(2, 2, sync=ZERO1),
    "ZeRO-2 dp2 ep1 (experts sharded over both, in buckets of their own)": moe_plan(2, 1, sync=ZERO2),
    "ep2 x dp2, capacity 1.0 (tokens dropped before the dispatch)": moe_plan(2, 2, capacity=1.0),
    "dp2 ep1, capacity 1.25, 8 experts": moe_plan(2, 1, model=dict(MOE, num_experts=8), capacity=1.25),
    "latent attention, ep2 x dp2 (DeepSeek-like)": moe_plan(2, 2, model=dict(MOE, **MLA)),
    "latent attention, queries uncompressed, FSDP dp2": moe_plan(2, 1, model=dict(MOE, **{**MLA, "q_lora_rank": 0}),
                                                                 sync=FSDP),
    "tp2 (routed and shared experts split, sequence parallel)": moe_plan(1, 1, tp=2),
    "tp2, capacity 1.0 (each rank drops over its part of the sequence)": moe_plan(1, 1, tp=2, capacity=1.0),
    "latent attention, ring cp2 x ep2 (K and V of different widths around the ring)": moe_plan(
        1, 2, cp=2, model=dict(MOE, **MLA)),
    "cp2 x ep2, capacity 1.25 (each rank drops over its two chunks)": moe_plan(1, 2, cp=2, capacity=1.25),
}
PLANS_4 = {
    "dp4 ep2 (edp 2), buckets": moe_plan(4, 2),
    "dp4 ep2 (edp 2), per-parameter sync": moe_plan(4, 2, sync=PER_PARAM),
    "dp4 ep4 (edp 1)": moe_plan(4, 4),
    "dp2 x cp2, ep2 (edp 2 over dp x cp)": moe_plan(2, 2, cp=2),
    "ep2 x pp2, 1f1b": moe_plan(2, 2, pp=2),
    "ep2 x pp2, zero-bubble, per-parameter sync": moe_plan(2, 2, pp=2, schedule="zero-bubble", sync=PER_PARAM),
    "FSDP dp4 ep2 (experts over the 2 ranks holding them)": moe_plan(4, 2, sync=FSDP),
    "HSDP dp4 in shard groups of 2, ep1 (experts sharded in each, all-reduced across)": moe_plan(
        4, 1, sync=dict(FSDP, shard_group=2)),
    "HSDP dp4 in shard groups of 2, ep2 (experts whole in each, all-reduced across)": moe_plan(
        4, 2, sync=dict(FSDP, shard_group=2)),
    "FSDP ep2 x pp2, 1f1b (gathered once a step)": moe_plan(2, 2, pp=2, sync=FSDP),
    "ZeRO-1 dp4 ep2 (experts sharded over the 2 ranks holding them)": moe_plan(4, 2, sync=ZERO1),
    "ZeRO-2 dp4 ep2, weights gathered in the next forward": moe_plan(4, 2, sync=dict(ZERO2,
                                                                                     overlap_param_gather=True)),
    "ZeRO-1 HSDP dp4 in shard groups of 2, ep1 (experts sharded in each, all-reduced across)": moe_plan(
        4, 1, sync=dict(ZERO1, shard_group=2)),
    "ZeRO-2 HSDP dp4 in shard groups of 2, ep2 (experts whole in each, all-reduced across)": moe_plan(
        4, 2, sync=dict(ZERO2, shard_group=2)),
    "ep2 x pp2, capacity 1.0, FSDP": moe_plan(2, 2, pp=2, sync=FSDP, capacity=1.0),
    "latent attention, ep2 x pp2, ZeRO-1": moe_plan(2, 2, pp=2, model=dict(MOE, **MLA), sync=ZERO1),
    "tp2 x ep2 (dp2): rows dispatched over ep, then gathered over tp": moe_plan(2, 2, tp=2),
    "tp2 x pp2, gelu, no shared experts, 8 experts": moe_plan(
        1, 1, pp=2, tp=2, model=dict(MOE, ffn_type="gelu", shared_experts=0, num_experts=8)),
    "FSDP tp2 x dp2, ep2": moe_plan(2, 2, tp=2, sync=FSDP),
    "ZeRO-1 tp2 x dp2, ep1": moe_plan(2, 1, tp=2, sync=ZERO1),
    "tp2 x cp2, capacity 1.0, 8 experts": moe_plan(1, 1, cp=2, tp=2, capacity=1.0, model=dict(MOE, num_experts=8)),
    "latent attention, all-gather cp2 x tp2, queries uncompressed": load_plan(
        {"model": dict(MOE, **{**MLA, "q_lora_rank": 0}), "parallel": {"cp": 2, "tp": 2}, "batch": BATCH,
         "data_parallel": BUCKETS, "sequence_parallel": True, "context_parallel": "all_gather"}),
    "latent attention under tp2 x ep2, sequence parallel": moe_plan(2, 2, tp=2, model=dict(MOE, **MLA)),
    "latent attention, queries uncompressed, tp2 x pp2, ZeRO-1": moe_plan(
        1, 1, pp=2, tp=2, model=dict(MOE, **{**MLA, "q_lora_rank": 0}), sync=ZERO1),
    "tp2 x ep2 with tp_comm_overlap (the attention's collectives beside its GEMMs)": load_plan(
        {"model": MOE, "parallel": {"dp": 2, "ep": 2, "tp": 2}, "batch": BATCH, "data_parallel": BUCKETS,
         "sequence_parallel": True, "tp_comm_overlap": True}),
}


# --------------------------------------------------------------------------- one process
def loop_over_tokens(moe, x):
    """The MoE feed-forward written token by token: Mixtral's softmax over the top-k logits, each chosen
    expert's feed-forward on the token, weighted and summed, plus the shared experts."""
    import torch
    import torch.nn.functional as F

    experts, outs = moe.experts, []
    for token in x.reshape(-1, x.shape[-1]):
        top, chosen = (token @ moe.router.weight.T).topk(moe.top_k)
        y = moe.shared(token) if moe.shared is not None else torch.zeros_like(token)
        for gate, e in zip(F.softmax(top, -1), chosen.tolist()):
            if experts.swiglu:
                y = y + gate * ((F.silu(token @ experts.gate[e]) * (token @ experts.up[e])) @ experts.down[e])
            else:
                y = y + gate * (F.gelu(token @ experts.fc1[e]) @ experts.fc2[e])
        outs.append(y)
    return torch.stack(outs).view_as(x)


@pytest.mark.parametrize("ffn_type", ["swiglu", "gelu"])
def test_the_moe_layer_equals_a_loop_over_tokens_and_their_experts(ffn_type):
    import torch

    from executor.train.models import build_pieces
    from executor.train.moe import MoEFeedForward

    model = load_model(dict(MOE, ffn_type=ffn_type, num_experts=8, experts_per_token=3))
    moe = build_pieces(model, seed=3, only={"layer.1"})[0].module.mlp
    assert isinstance(moe, MoEFeedForward)
    assert [name for name, _ in moe.named_parameters()][:4] == (  # the simulator's order: router, experts, shared
        ["router.weight", "experts.gate", "experts.up", "experts.down"] if ffn_type == "swiglu"
        else ["router.weight", "experts.fc1", "experts.fc2", "shared.fc1.weight"])
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    params = [x, *moe.parameters()]
    out, expected = moe(x), loop_over_tokens(moe, x)
    assert torch.allclose(out, expected, atol=1e-6)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((out * weights).sum(), params)
    expected_grads = torch.autograd.grad((expected * weights).sum(), params)
    for p, g, e in zip(params, grads, expected_grads):
        assert torch.allclose(g, e, atol=1e-6), getattr(p, "full_name", "input")


def test_a_capped_moe_layer_drops_each_experts_lowest_gates_beyond_its_capacity_per_group():
    """Megatron-LM's probs drop policy, written token by token: per group of tokens (a rank's microbatch) and
    expert, the ceil(rows / experts x capacity_factor) choices with the highest gates stay; the rest add
    nothing."""
    import math

    import torch
    import torch.nn.functional as F

    from executor.train.models import build_pieces

    moe = build_pieces(load_model(dict(MOE, num_experts=8)), seed=3, only={"layer.1"})[0].module.mlp
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    # two sequences a group: 64 choices over 8 experts, 8 each
    moe.capacity_factor, moe.drop_groups = 1.0, torch.arange(64) // 32
    out = moe(x)
    tokens = x.reshape(-1, 32)
    top, chosen = (tokens @ moe.router.weight.T).topk(moe.top_k)
    gates = F.softmax(top, -1)
    dropped = set()
    for g in range(2):
        for e in range(8):
            rows = [(gates[t, c].item(), t, c) for t in range(32 * g, 32 * (g + 1)) for c in range(2)
                    if chosen[t, c] == e]
            rows.sort(key=lambda r: -r[0])  # stable: equal gates keep token order
            dropped |= {(t, c) for _, t, c in rows[math.ceil(64 / 8):]}
    assert dropped  # a random router overloads some expert
    expected = []
    for t, token in enumerate(tokens):
        y = moe.shared(token)
        for c in range(2):
            if (t, c) not in dropped:
                e = chosen[t, c].item()
                y = y + gates[t, c] * ((F.silu(token @ moe.experts.gate[e]) * (token @ moe.experts.up[e]))
                                       @ moe.experts.down[e])
        expected.append(y)
    expected = torch.stack(expected).view_as(x)
    assert torch.allclose(out, expected, atol=1e-6)
    grads = torch.autograd.grad(out.sum(), [x, *moe.parameters()])
    expected_grads = torch.autograd.grad(expected.sum(), [x, *moe.parameters()])
    for g, e in zip(grads, expected_grads):
        assert torch.allclose(g, e, atol=1e-5)


def test_latent_attention_is_causal_attention_over_its_decompressed_heads():
    """Written out per head: queries through the bottleneck, keys and values from the latent, the shared
    RoPE key part, softmax over earlier positions scaled by the query/key width."""
    import math

    import torch
    import torch.nn.functional as F

    from executor.train.models import build_pieces, rotary

    model = load_model(dict(MOE, **MLA, num_experts=0))
    layer = build_pieces(model, seed=3, only={"layer.1"})[0].module
    attn = layer.attn
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    out = attn(x)
    q = attn.q_b(layer.norm_q_a(attn.q_a(x))).view(2, 16, 4, 12)
    kv_a = attn.kv_a(x)
    kv = attn.kv_b(layer.norm_kv_a(kv_a[..., :8])).view(2, 16, 4, 14)
    k_rope = rotary(kv_a[..., 8:].unsqueeze(1))[:, 0]  # [batch, seq, 4]: one rope key per position
    expected = torch.zeros(2, 16, 4, 6)
    for b in range(2):
        for h in range(4):
            q_h = torch.cat([q[b, :, h, :8], rotary(q[b, :, h, 8:][None, None])[0, 0]], -1)
            k_h = torch.cat([kv[b, :, h, :8], k_rope[b]], -1)
            scores = (q_h @ k_h.T) / math.sqrt(12)
            scores = scores.masked_fill(torch.ones(16, 16).triu(1).bool(), float("-inf"))
            expected[b, :, h] = F.softmax(scores, -1) @ kv[b, :, h, 8:]
    assert torch.allclose(out, attn.o(expected.reshape(2, 16, 24)), atol=1e-6)
    names = [name for name, _ in layer.named_parameters()]
    assert names[-2:] == ["norm_q_a.weight", "norm_kv_a.weight"]  # after the layer's norms: the simulator's order


def test_only_the_layers_after_the_dense_ones_are_moe():
    from executor.train.models import build_pieces
    from executor.train.moe import MoEFeedForward

    pieces = build_pieces(load_model(MOE), seed=0)
    assert [isinstance(getattr(p.module, "mlp", None), MoEFeedForward) for p in pieces] == \
        [False, False, True, True, True, False]  # embedding, layer.0 (dense_layers: 1), 3 MoE layers, head


def test_data_parallel_groups_are_the_ones_the_lowering_simulates():
    """ep: consecutive data-parallel ranks of a pipeline rank; edp: the ranks holding the same experts."""
    from executor.train.runner import _data_parallel_groups

    plan = moe_plan(4, 2, pp=2)
    program = lower(plan)
    for group in ("ep", "dp"):
        ops = [op for op in program.ops if op.group == group and (group == "ep" or "expert_bucket" in op.name)]
        simulated = {tuple(sorted(g)) for op in ops for g in (op.ranks, *op.mirrors)}
        assert simulated == {tuple(g) for g in _data_parallel_groups(plan, "ep" if group == "ep" else "edp")}
    assert plan.coords(5)[:2] == (2, 1)  # dp 2 of pipeline rank 1 (pipeline ranks alternate)
    assert _data_parallel_groups(plan, "ep", rank=5) == [5, 7]  # dp 2 and 3: experts 0-1 and 2-3
    assert _data_parallel_groups(plan, "edp", rank=5) == [1, 5]  # dp 0 and 2: both hold experts 0-1


@pytest.mark.parametrize("plan, message", [
    (load_plan({"model": dict(MOE, **MLA, num_experts=0), "parallel": {"tp": 2}}),
     r"latent attention \(MLA\) with tensor parallelism but no sequence parallelism"),
])
def test_what_the_executor_does_not_run_is_refused_in_one_line(plan, message):
    from executor.train.runner import check_plan

    with pytest.raises(ParsimError, match=message) as err:
        check_plan(plan)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- on ranks
@pytest.fixture(scope="module")
def results_2() -> list[list[dict]]:
    return verify_plans(PLANS_2, 2, timeout_s=150)


@pytest.fixture(scope="module")
def results_4() -> list[list[dict]]:
    return verify_plans(PLANS_4, 4, timeout_s=200)


CASES = [(2, name) for name in PLANS_2] + [(4, name) for name in PLANS_4]


def _run(request, world: int, name: str) -> tuple:
    plans = PLANS_2 if world == 2 else PLANS_4
    results = request.getfixturevalue(f"results_{world}")
    index = list(plans).index(name)
    return plans[name], [results[rank][index] for rank in range(world)]


@pytest.mark.multiproc
@pytest.mark.parametrize("world, name", CASES)
def test_moe_step_equals_single_process(request, world, name):
    plan, ranks = _run(request, world, name)
    assert_step_equals_reference(plan, ranks)
    for rank, r in enumerate(ranks):
        assert r["expert_params_checked"] and r["max_expert_grad_error"] < 1e-5, f"rank {rank}"
    per_layer = 3 if plan.model.ffn_type == "swiglu" else 2  # gate, up, down or fc1, fc2: one tensor each
    # 3 MoE layers per replica, and each of its context- and tensor-parallel ranks holds a share of the experts
    assert sum(r["expert_params_checked"] for r in ranks) == plan.dp * plan.cp * plan.tp * 3 * per_layer


@pytest.mark.multiproc
@pytest.mark.parametrize("world, name", CASES)
def test_moe_events_match_the_simulated_program(request, world, name):
    """Same names, and the same number of each communication event, on every simulated rank."""
    plan, ranks = _run(request, world, name)
    assert_events_as_simulated(plan, ranks)
    names = {n for r in ranks for n in r["events"]}
    dispatch_grad = 3 if plan.tp > 1 else 1  # after the combine's (and under tp the experts' gather and scatter)
    assert f"all_to_all ep layer=layer.1 mb=1 dir=bwd{dispatch_grad}" in names or plan.ep == 1
    assert any("expert_bucket" in n for n in names) == (plan.grad_sync == "bucketed" and plan.dp * plan.cp > plan.ep)


# --------------------------------------------------------------------------- measured routing
def test_a_moe_layer_records_its_busiest_expert_over_the_mean_when_asked():
    import torch

    from executor.train.models import build_pieces

    moe = build_pieces(load_model(dict(MOE, num_experts=8)), seed=3, only={"layer.1"})[0].module.mlp
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    moe(x)
    assert moe.loads is None  # not asked: nothing kept
    moe.loads = []
    moe(x)
    chosen = (x.reshape(-1, 32) @ moe.router.weight.T).topk(moe.top_k).indices
    counts = torch.bincount(chosen.flatten(), minlength=8)
    # 32 tokens x 2 choices over 8 experts: 8 rows each on average
    assert [float(v) for v in moe.loads] == [pytest.approx(counts.max().item() / 8)]


def test_the_measured_expert_load_is_the_busiest_over_the_ranks_per_forward():
    from executor.train.measure import measured_expert_load

    results = [{"expert_loads": {"stage 0: pieces.1.mlp": [1.5, 1.25], "stage 0: pieces.2.mlp": [1.0, 2.0]}},
               {"expert_loads": {"stage 0: pieces.1.mlp": [1.25, 1.75], "stage 0: pieces.2.mlp": [1.5, 1.0]}}]
    # per forward, the most over the ranks: 1.5, 1.75, 1.5, 2.0
    assert measured_expert_load(results) == {"busiest_over_mean": 1.625, "most": 2.0, "forwards": 4}
    assert measured_expert_load([{"expert_loads": {}}, {}]) is None  # a dense model


@pytest.mark.multiproc
@pytest.mark.parametrize("parallel", [{"parallel": {"dp": 2, "ep": 2}},
                                      {"parallel": {"tp": 2}, "sequence_parallel": True}])
def test_parsim_run_reports_how_evenly_the_steps_routed(tmp_path, capsys, parallel):
    """Over the rows an expert's ranks received: the ep group's dispatch, or the tp group's gather."""
    import json

    from test_json_schema import conforms

    from parsim.cli.main import main

    path = tmp_path / "moe.yaml"
    path.write_text(json.dumps({"model": MOE, "batch": BATCH, **parallel}))
    assert main(["run", str(path), "--nproc", "2", "--steps", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert conforms(summary) == "run"
    load = summary["expert_load"]
    # 3 MoE layers x 2 microbatches x 2 steps; 4 experts, top 2: the busiest gets 1x to 2x the mean
    assert load["forwards"] == 3 * 2 * 2 and 1.0 <= load["busiest_over_mean"] <= load["most"] <= 2.0


def test_compare_prices_the_measured_routing_beside_the_assumed(tmp_path, monkeypatch, capsys):
    """compare prints the measured load beside the plan's, and the step the simulator predicts at the measured
    load (every other figure the plan's): how much of a gap is routing."""
    import dataclasses
    import json

    import executor.train
    from test_json_schema import conforms

    from parsim.cli.main import main
    from parsim.hardware.cluster import load_cluster
    from parsim.sim.step import predict_step

    path = tmp_path / "moe.yaml"
    path.write_text(json.dumps({"model": MOE, "parallel": {"dp": 2, "ep": 2}, "batch": BATCH, "dtype": "bf16"}))
    plan, cluster = load_plan(path), load_cluster("dgx-h100")
    measured = {"busiest_over_mean": 1.5, "most": 2.0, "forwards": 12}
    monkeypatch.setattr(executor.train, "run_plan", lambda plan, *args, **kwargs: (  # the simulator stands in
        predict_step(plan, cluster).trace, {"expert_load": measured}))
    assert main(["compare", str(path), "--cluster", "dgx-h100", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert conforms(doc) == "compare.plan"
    at_measured = predict_step(dataclasses.replace(plan, expert_load=1.5), cluster).step_s
    assert doc["expert_load"] == {**measured, "assumed": 1.0,
                                  "predicted_step_s_at_measured": pytest.approx(at_measured)}
    assert at_measured > doc["predicted_step_s"]  # the busiest expert's GEMMs take longer
    assert main(["compare", str(path), "--cluster", "dgx-h100"]) == 0
    assert "expert load: the busiest expert got 1.50x the mean (median over 12 MoE layer forwards, at most 2.00x); " \
           "the prediction assumes 1x (--expert-load), and at the measured load predicts" in capsys.readouterr().out
