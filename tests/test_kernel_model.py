"""The GPU kernel model (parsim.sim.compute) against closed forms, and its cluster-file keys."""

from pathlib import Path

import pytest

from parsim.cli.main import main
from parsim.hardware.cluster import load_cluster
from parsim.sim.compute import MATMUL_TILE, ComputeModel
from parsim.workload.model import AttentionCore, flash_softmax_factor, load_model
from parsim.workload.plan import Plan

A100 = ComputeModel(peak_flops=312e12, hbm_bw_Bps=2039e9, dtype_bytes=2, efficiency=0.869, sm_count=108,
                    memory_efficiency=0.852, attention_efficiency=(0.73, 0.63))


def test_a_matmul_filling_whole_waves_runs_at_the_maximum_achievable_rate():
    m, n = 108 * MATMUL_TILE, 4 * MATMUL_TILE  # 432 tiles: exactly 4 waves of 108 SMs
    assert A100.matmul_rate(m, n, 4096) == pytest.approx(312e12 * 0.869)


def test_a_last_partial_wave_costs_a_whole_wave():
    m, n = 109 * MATMUL_TILE, MATMUL_TILE  # 109 tiles: a full wave and one tile alone in the second
    assert A100.waves(m, n) == pytest.approx(109 / 216)


def test_a_tiles_fixed_cost_in_k_is_a_time_worth_twice_the_steps_in_fp8():
    """rate x k / (k + k0): k0 steps along k at the bf16 rate; fp8's steps take half as long, so its GEMMs pay
    2 k0, and an fp8 plan's LM head (kept in bf16) pays k0."""
    spec = load_cluster("dgx-h100")
    m, n, k = 132 * MATMUL_TILE, 2 * MATMUL_TILE, 1024  # whole waves: the k term is all that is left
    k0 = spec.matmul_k_overhead
    bf16, fp8 = (ComputeModel.for_cluster(spec, dtype, 2) for dtype in ("bf16", "fp8"))
    assert bf16.matmul_rate(m, n, k) == pytest.approx(989.5e12 * 0.803 * k / (k + k0))
    assert fp8.matmul_rate(m, n, k) == pytest.approx(1979e12 * 0.709 * k / (k + 2 * k0))
    assert fp8.matmul_rate(m, n, k, high_precision=True) == pytest.approx(bf16.matmul_rate(m, n, k))


def test_an_fp32_tiles_fixed_cost_is_the_same_time_in_fewer_of_its_slower_steps():
    """fp32 GEMMs (CUDA cores, 67 of 989.5 TFLOP/s on an H100) pay k0 x 67 / 989.5 steps: the tile's fixed
    cost takes as long as bf16's, not 15 times longer."""
    spec = load_cluster("dgx-h100")
    m, n, k = 132 * MATMUL_TILE, 2 * MATMUL_TILE, 1024
    bf16, fp32 = ComputeModel.for_cluster(spec, "bf16", 2), ComputeModel.for_cluster(spec, "fp32", 4)
    k0 = spec.matmul_k_overhead * 67 / 989.5
    efficiency = spec.matmul_efficiency_for("fp32")
    assert fp32.matmul_rate(m, n, k) == pytest.approx(67e12 * efficiency * k / (k + k0))
    work = 2 * m * n * k
    fixed = [work / model.matmul_rate(m, n, k) - work / model.matmul_rate(m, n, 1e12) for model in (bf16, fp32)]
    assert fixed[1] * efficiency == pytest.approx(fixed[0] * 0.803, rel=1e-6)  # the same time at one efficiency


def test_edge_tiles_cost_whole_tiles():
    # 96 columns fill three quarters of one 128-wide tile; 108 of them fill one wave
    assert A100.waves(108 * MATMUL_TILE, 96) == pytest.approx(0.75)


def test_memory_bound_kernels_run_at_the_measured_fraction_of_hbm():
    assert A100.time(hbm_bytes=1.737e9) == pytest.approx(1.737e9 / (2039e9 * 0.852))


def test_attention_core_forward_and_backward_run_at_their_own_rates():
    assert A100.time(attention_flops=1e12) == pytest.approx(1e12 / (312e12 * 0.73))
    assert A100.time(attention_grad_flops=1e12) == pytest.approx(1e12 / (312e12 * 0.63))


def test_attention_efficiency_by_length_is_linear_in_log_length_between_points_and_flat_beyond():
    from parsim.sim.compute import at_length

    curve = ((2048, 0.5), (8192, 0.6))
    assert at_length(curve, 4096) == pytest.approx(0.55)  # halfway in log2
    assert at_length(curve, 1024) == 0.5 and at_length(curve, 65536) == 0.6
    assert at_length(curve, 0) == 0.6  # length not known: the longest's
    assert at_length(((0, 0.7),), 4096) == 0.7  # one figure for every length


def test_a_context_parallel_rank_runs_its_attention_kernels_over_its_share_of_the_sequence():
    """On Hopper, FlashAttention-3 runs shorter sequences at a lower rate: cp 4 on an 8k sequence runs
    kernels over 2,048 query positions, and the attention core takes longer per FLOP than at cp 1."""
    spec = load_cluster("dgx-h100")
    model = load_model("llama3-8b")
    rates = {}
    for cp in (1, 4):
        plan = Plan(model=model, dp=8 // cp, cp=cp, dtype="bf16")
        assert plan.attention_seq == 8192 // cp
        compute = ComputeModel.for_cluster(spec, "bf16", 2, attention_seq=plan.attention_seq)
        rates[cp] = 1e12 / compute.time(attention_flops=1e12)
    assert rates[1] == pytest.approx(0.618 * 989.5e12) and rates[4] == pytest.approx(0.559 * 989.5e12)


@pytest.mark.parametrize("value", ["{fast: 0.6}", "{}", "{2048: 1.5}"])
def test_a_bad_attention_curve_is_refused_in_one_line(tmp_path, capsys, value):
    from parsim.hardware.cluster import builtin_clusters

    text = builtin_clusters()["dgx-h100"].read_text()
    assert "    forward: {512: 0.369" in text
    path = tmp_path / "c.yaml"
    path.write_text(text.replace("    forward: {512: 0.369, 1024: 0.481, 2048: 0.559, 4096: 0.603, 8192: 0.618, "
                                 "16384: 0.627}", f"    forward: {value}"))
    assert main(["simulate", "--model", "tiny-gpt", "--dp", "2", "--cluster", str(path)]) == 2
    err = capsys.readouterr().err
    assert "attention_efficiency" in err and len(err.strip().splitlines()) == 1


def test_flash_skips_tiles_above_the_causal_diagonal():
    core = AttentionCore(heads=32, head_dim=128, seq=4096)
    n = 4096 // 128
    assert core.executed_fraction() == pytest.approx((n + 1) / (2 * n))
    assert AttentionCore(32, 128, 4096, kernel="unfused").executed_fraction() == 1.0


def test_smaller_heads_spend_relatively_longer_in_the_softmax():
    assert flash_softmax_factor(128) == 1.0
    assert flash_softmax_factor(64) == pytest.approx((1 + 20 / 64) / (1 + 20 / 128))


def test_unfused_attention_keeps_the_scores_korthikanti_5as():
    flash = load_model({"kind": "transformer", "num_layers": 1, "hidden": 1024, "num_heads": 16,
                        "ffn_hidden": 4096, "seq_len": 2048, "vocab_size": 1000, "dropout": 0.1})
    unfused = load_model(flash.to_dict() | {"attention_kernel": "unfused"})
    extra = (unfused.layer_costs(2)[0].activation_bytes_per_token()
             - flash.layer_costs(2)[0].activation_bytes_per_token())
    assert extra == 5 * 16 * 2048  # 5·a·s bytes per token: softmax out, dropout mask, dropout out


def test_unfused_attention_is_slower_than_flash_on_a_gpu():
    spec = load_cluster("dgx-a100")
    from parsim.sim.step import predict_step

    gpt = {"kind": "transformer", "num_layers": 4, "hidden": 2048, "num_heads": 16, "ffn_hidden": 8192,
           "seq_len": 2048, "vocab_size": 50000, "ffn_type": "gelu"}
    flash = predict_step(Plan(model=load_model(gpt), dp=8, microbatch_size=4), spec).step_s
    unfused = predict_step(Plan(model=load_model(gpt | {"attention_kernel": "unfused"}), dp=8, microbatch_size=4),
                           spec).step_s
    assert unfused > flash


def test_builtin_clusters_carry_sourced_kernel_rates():
    h100 = load_cluster("dgx-h100")
    assert h100.gpu.sm_count == 132
    assert h100.matmul_efficiency_for("bf16") == 0.803 and h100.matmul_efficiency_for("fp16") == 0.803
    assert h100.matmul_efficiency_for("fp8") == 0.709
    assert 0 < h100.memory_efficiency < 1
    for curve in h100.attention_efficiency:  # by query length, rising with it (FlashAttention-3's figures)
        lengths, fractions = zip(*curve)
        assert lengths == (512, 1024, 2048, 4096, 8192, 16384) and all(0 < e < 1 for e in fractions)
        assert list(fractions) == sorted(fractions)


@pytest.mark.parametrize("compute", [
    "  matmul_efficiency: 1.5", "  matmul_efficiency: {bf17: 0.8}", "  memory_efficiency: 0",
    "  attention_efficiency: {forward: .nan}", "  attention_efficiency: 0.7",
])
def test_bad_kernel_rates_are_refused_in_one_line(tmp_path, capsys, compute):
    text = (load_cluster("dgx-a100").source and open(load_cluster("dgx-a100").source).read())
    start, end = text.index("compute:"), text.index("intra_node:")
    path = tmp_path / "bad.yaml"
    path.write_text(text[:start] + "compute:\n" + compute + "\n" + text[end:])
    assert main(["collective", "all-reduce", "--cluster", str(path), "--size", "1MiB"]) == 2
    err = capsys.readouterr().err
    assert "compute." in err and len(err.strip().splitlines()) == 1


def test_explain_compute_lists_every_kernel_and_sums_to_its_passes(capsys):
    assert main(["explain", "compute", "--model", "gpt3-175b", "--tp", "8", "--cluster", "dgx-a100",
                 "--dtype", "fp16", "--json"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    for kind, total in data["pass_s"].items():
        assert sum(k["time_s"] for k in data["kernels"] if k["pass"] == kind) == pytest.approx(total)
    labels = {k["kernel"] for k in data["kernels"]}
    assert {"attn.q", "mlp.fc1 weight grad", "attention core (flash)"} <= labels
    # fp16 weights keep Megatron-LM's main_grad (in fp16): 2 + 2 x 2 bytes per weight, every microbatch
    (mlp,) = [k for k in data["kernels"] if k["block"] == "mlp" and k["kernel"].startswith("add weight gradients")]
    assert mlp["kernel"] == "add weight gradients into main_grad"
    gpt3 = load_model("gpt3-175b")
    assert mlp["shape"] == f"{2 * gpt3.hidden * gpt3.ffn_hidden // 8 * 6 / 1e6:,.1f} MB"


def test_explain_compute_lists_each_memory_bound_kernel_by_its_model_name(capsys):
    """One row per Elementwise kernel with bytes in the pass, named as the model names it, adding up to the
    block's memory-bound bytes."""
    import json

    from parsim.lowering.kernels import block_work

    args = ["explain", "compute", "--model", "llama3-8b", "--cluster", "dgx-h100", "--dtype", "bf16", "--json"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    rows = data["kernels"]
    plan = Plan(model=load_model("llama3-8b"), dp=8, dtype="bf16")
    attention = next(c for c in plan.stage_costs(0) if c.name == "layer.0").blocks[0]
    named = [r for r in rows if r["pass"] == "F" and r["block"] == "attention" and r["bound"] in ("memory", "SMs")]
    assert [r["kernel"] for r in named] == [e.name for e in attention.elementwise]
    work = block_work(plan, attention, "F", data["tokens"])
    assert sum(float(r["shape"].split()[0].replace(",", "")) for r in named) == pytest.approx(
        work.elementwise_bytes / 1e6, rel=1e-3)


def test_explain_compute_shows_the_host_racing_a_gpus_kernels(capsys, tmp_path):
    """With the host's time per op in a GPU's file, each block shows its host row and takes the longer of
    that and its kernels (pinned against the H100 host's figures measured by calibrate --ranks 1)."""
    import json

    gpu_file = str(Path(__file__).parents[1] / "benchmarks/gpu/h100-calibrated-2026-11-26.yaml")
    assert main(["explain", "compute", "tiny-dp2", "--dp", "1", "--cluster", gpu_file, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    spec = load_cluster(gpu_file)
    for kind, total in data["pass_s"].items():
        blocks = {k["block"] for k in data["kernels"] if k["pass"] == kind}
        expected = 0.0
        for block in blocks:
            rows = [k for k in data["kernels"] if k["pass"] == kind and k["block"] == block]
            (host,) = [k for k in rows if k["bound"] == "host"]
            expected += max(host["time_s"], sum(k["time_s"] for k in rows if k is not host))
        assert total == pytest.approx(expected)
    (attention,) = [k for k in data["kernels"]
                    if (k["pass"], k["block"], k["bound"]) == ("F", "attention", "host")]
    assert attention["kernel"] == "host: 80 eager ops (races the kernels)"  # parsim/lowering/eager_ops.py: 42 + 2 x 19
    assert attention["time_s"] == pytest.approx(80 * spec.op_forward_s)
    assert main(["explain", "compute", "tiny-dp2", "--dp", "1", "--cluster", gpu_file]) == 0
    assert "host        9.2 us per forward op, 11.0 us per backward op" in capsys.readouterr().out


def test_explain_compute_shows_an_fp8_plans_casts_and_its_fp8_peak(capsys):
    """The casts get their own row, priced at the memory-bound rate from fp8_cast_bytes; the executed rate
    is set against the fp8 peak, the one an fp8 plan's matmuls run at."""
    import json

    from parsim.lowering.kernels import fp8_cast_bytes
    from parsim.sim.compute import ComputeModel

    args = ["explain", "compute", "--model", "llama3-8b", "--cluster", "dgx-h100", "--dtype", "fp8"]
    assert main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    casts = [k for k in data["kernels"] if k["kernel"] == "fp8 casts (amax, cast and transpose)"]
    assert {k["pass"] for k in casts} == {"F", "B"}
    llama = load_model("llama3-8b")
    plan = Plan(model=llama, dp=1, microbatch_size=1, dtype="fp8")
    model = ComputeModel.for_cluster(load_cluster("dgx-h100"), "fp8", 2)
    for row in casts:
        block = next(b for b in llama.layer_costs(2)[0].blocks if b.name == row["block"])
        nbytes, _ = fp8_cast_bytes(plan, block, row["pass"], data["tokens"])
        assert nbytes and row["time_s"] == pytest.approx(model.time(hbm_bytes=nbytes))
    for kind, total in data["pass_s"].items():
        assert sum(k["time_s"] for k in data["kernels"] if k["pass"] == kind) == pytest.approx(total)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "of the 1979 TFLOP/s fp8 peak" in out
    assert "x k / (k + 384)" in out  # a tile's fixed cost: 192 steps at bf16's rate, twice as many at fp8's


def test_explain_compute_refuses_an_unknown_layer(capsys):
    assert main(["explain", "compute", "llama3-70b-1024", "--layer", "layer.99"]) == 2
    assert "--layer" in capsys.readouterr().err


def test_selective_recompute_drops_the_unfused_scores_and_reruns_them():
    gpt = {"kind": "transformer", "num_layers": 2, "hidden": 1024, "num_heads": 16, "ffn_hidden": 4096,
           "seq_len": 2048, "vocab_size": 1000, "dropout": 0.1, "attention_kernel": "unfused"}
    spec = load_cluster("dgx-a100")
    from parsim.sim.step import predict_step
    from parsim.workload.memory import memory

    plans = {r: Plan(model=load_model(gpt), dp=8, dtype="fp16", activation_recompute=r) for r in ("none", "selective")}
    saved = {r: plans[r].stage_costs(0)[1].activation_bytes_per_token() for r in plans}
    assert saved["none"] - saved["selective"] == 5 * 16 * 2048  # Korthikanti et al.'s 5as
    assert memory(plans["selective"])[0].activations < memory(plans["none"])[0].activations
    assert predict_step(plans["selective"], spec).step_s > predict_step(plans["none"], spec).step_s


def test_gradients_add_up_in_autograds_grad_or_in_megatrons_main_grad():
    """fp32 weights: autograd adds each microbatch's weight gradient into .grad but the first's (read both,
    write one). bf16 weights: a hook adds every microbatch's into main_grad in the reduce dtype (read the
    gradient, read and write main_grad), as Megatron-LM does and the executor does; not under FSDP."""
    from parsim.lowering.kernels import block_work

    model = load_model("llama3-8b")
    block = model.layer_costs(2)[0].blocks[1]
    weights = sum(m.k * m.n for m in block.matmuls)
    for microbatches in (1, 4):
        fp32 = Plan(model=model, dp=1, num_microbatches=microbatches)
        expected = weights * 4 * 3 * (microbatches - 1) / microbatches
        assert block_work(fp32, block, "W", fp32.tokens_per_rank).accumulate_bytes == pytest.approx(expected)
        for reduce_dtype, grad_bytes in (("fp32", 4), ("bf16", 2)):
            bf16 = Plan(model=model, dp=8, num_microbatches=microbatches, dtype="bf16", reduce_dtype=reduce_dtype)
            work = block_work(bf16, block, "W", bf16.tokens_per_rank)
            assert work.accumulate_bytes == pytest.approx(weights * (2 + 2 * grad_bytes))
        fsdp = Plan(model=model, dp=8, num_microbatches=microbatches, dtype="bf16", zero=3, grad_sync="fsdp")
        assert not fsdp.main_grads
        expected = weights * 2 * 3 * (microbatches - 1) / microbatches
        assert block_work(fsdp, block, "W", fsdp.tokens_per_rank).accumulate_bytes == pytest.approx(expected)


def test_a_fused_accumulation_adds_no_pass_and_shortens_every_step_with_a_gradient_buffer():
    """grad_accumulation: fused (Megatron-LM's gradient_accumulation_fusion) accumulates into main_grad in the
    weight-gradient matmul: no pass over the weights, so bf16 steps get shorter with one microbatch too."""
    from parsim.lowering.kernels import block_work
    from parsim.sim.step import predict_step

    spec = load_cluster("dgx-h100")
    model = load_model("llama3-8b")
    block = model.layer_costs(2)[0].blocks[1]
    steps = {}
    for mode in ("autograd", "fused"):
        for microbatches in (1, 4):
            plan = Plan(model=model, dp=8, num_microbatches=microbatches, dtype="bf16", grad_accumulation=mode)
            if mode == "fused":
                assert block_work(plan, block, "W", plan.tokens_per_rank).accumulate_bytes == 0
            steps[mode, microbatches] = predict_step(plan, spec).step_s
    assert steps["fused", 1] < steps["autograd", 1]
    assert steps["fused", 4] < steps["autograd", 4]


def test_the_embedding_backward_zeroes_a_dense_table_gradient_and_adds_it_into_the_sum():
    """torch's embedding_dense_backward writes a table-sized gradient (zeroed, then the rows scattered in),
    which joins main_grad like a weight's, also under fused accumulation (only linear layers fuse it); a
    tied head on the same rank shares the table, whose gradient is added once."""
    from parsim.lowering.kernels import block_work

    model = load_model("llama3-8b")
    table = 128256 * 4096
    for mode in ("autograd", "fused"):
        plan = Plan(model=model, dp=8, num_microbatches=4, dtype="bf16", grad_accumulation=mode, tp=2)
        embedding = plan.stage_costs(0)[0].blocks[0]
        backward = block_work(plan, embedding, "B", plan.tokens_per_rank)
        forward = block_work(plan, embedding, "F", plan.tokens_per_rank)
        assert backward.accumulate_bytes == pytest.approx(table / 2 * plan.accumulation_bytes)
        assert backward.elementwise_bytes - 2 * forward.elementwise_bytes == pytest.approx(table / 2 * 2)
        assert forward.accumulate_bytes == 0
    tied = load_model({"kind": "transformer", "num_layers": 2, "hidden": 64, "num_heads": 4, "ffn_hidden": 128,
                       "seq_len": 32, "vocab_size": 1000, "tied_embeddings": True})
    plan = Plan(model=tied, dp=2, num_microbatches=2, dtype="bf16")
    embedding, *_, head = plan.stage_costs(0)
    accumulated = sum(block_work(plan, b, "B", plan.tokens_per_rank).accumulate_bytes
                      for cost in (embedding, head) for b in cost.blocks)
    assert accumulated == pytest.approx(1000 * 64 * plan.accumulation_bytes)


@pytest.mark.parametrize("key, expected", [("grad_accumulation", "autograd, fused"), ("adamw", "foreach, fused"),
                                           ("adam_moments", "fp32, bf16")])
def test_an_unknown_implementation_is_refused_in_one_line(tmp_path, capsys, key, expected):
    path = tmp_path / "plan.yaml"
    path.write_text(f"model: tiny-gpt\nparallel: {{dp: 2}}\n{key}: fusedd\n")
    assert main(["simulate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{key} 'fusedd' is not one of {expected}" in err and len(err.strip().splitlines()) == 1


def test_a_fused_adamw_makes_one_pass_of_seven_fp32_accesses():
    """adamw: fused reads weight, gradient and both moments and writes weight and moments (7 x 4 bytes per
    parameter) in a launch per 36 tensors; torch's foreach AdamW makes 21 accesses in 8 passes per tensor.
    fp32 weights: nothing else."""
    from parsim.lowering.lower import lower

    model = load_model("llama3-8b")
    steps = {}
    for adamw in ("foreach", "fused"):
        plan = Plan(model=model, dp=8, adamw=adamw)
        (op,) = [op for op in lower(plan).rank_ops(0) if op.phase == "optimizer"]
        params = plan.params_per_rank(0)
        assert op.flops == 12.0 * params
        steps[adamw] = op
    assert steps["fused"].hbm_bytes == 7 * 4 * params and steps["foreach"].hbm_bytes == 21 * 4 * params
    tensors = steps["foreach"].optimizer_tensors
    assert steps["foreach"].kernels == 8 * tensors and steps["fused"].kernels == -(-tensors // 36)
    assert steps["fused"].optimizer_tensors == 0 and steps["fused"].forward_ops == tensors


def test_bf16_moments_halve_adamws_state_and_its_moments_traffic(capsys):
    """adam_moments bf16 (DeepSeek-V3, section 3.3.3; Megatron-LM's precision-aware optimizer): the two moments
    take 2 + 2 bytes per parameter in memory, and the fused step reads and writes them in bf16: 3 x 4 + 4 x 2
    bytes per parameter. It needs the fused step; the executor's torch AdamW does not run it."""
    from parsim.lowering.lower import lower
    from parsim.workload.memory import memory

    model = load_model("llama3-8b")
    fp32, bf16 = (Plan(model=model, dp=8, zero=1, adamw="fused", adam_moments=m) for m in ("fp32", "bf16"))
    params = fp32.params_per_rank(0)
    assert memory(fp32)[0].optimizer - memory(bf16)[0].optimizer == pytest.approx(4 * params / 8)
    (step,) = [op for op in lower(bf16).rank_ops(0) if op.phase == "optimizer"]
    assert step.hbm_bytes == pytest.approx((3 * 4 + 4 * 2) * params / 8)
    assert main(["simulate", "--model", "llama3-8b", "--dp", "8", "--adam-moments", "bf16"]) == 2
    err = capsys.readouterr().err
    assert "adam_moments bf16 needs adamw fused" in err and len(err.strip().splitlines()) == 1
    assert main(["explain", "memory", "--model", "llama3-8b", "--dp", "8", "--zero", "1", "--adamw", "fused",
                 "--adam-moments", "bf16"]) == 0
    assert "4 of bf16 moments" in capsys.readouterr().out


def test_bf16_weights_step_fp32_masters_and_copy_them_back():
    """Mixed precision (Megatron-LM's, the executor's): gradients narrower than fp32 are cast to it (2 + 4
    bytes per parameter), the updated fp32 masters copied into the bf16 weights (4 + 2), a pass per tensor
    each; ZeRO copies only the owned shard; FSDP2 keeps fp32 shards and copies nothing."""
    from parsim.lowering.lower import lower

    model = load_model("llama3-8b")

    def optimizer(**settings):
        plan = Plan(model=model, dp=8, dtype="bf16", adamw="fused", **settings)
        (op,) = [op for op in lower(plan).rank_ops(0) if op.phase == "optimizer"]
        return op, plan.params_per_rank(0)

    op, params = optimizer()
    tensors = op.forward_ops // 2  # fused AdamW's one op per tensor, and the copy's
    assert op.hbm_bytes == pytest.approx(params * (7 * 4 + 4 + 2))
    assert op.kernels == -(-tensors // 36) + tensors
    cast, _ = optimizer(reduce_dtype="bf16")
    assert cast.hbm_bytes == pytest.approx(params * (7 * 4 + 4 + 2 + 2 + 4))
    assert cast.kernels == op.kernels + tensors and cast.forward_ops == 3 * tensors
    zero1, _ = optimizer(zero=1, grad_sync="bucketed")
    assert zero1.hbm_bytes == pytest.approx(params / 8 * (7 * 4 + 4 + 2))
    fsdp, _ = optimizer(zero=3, grad_sync="fsdp")
    assert fsdp.hbm_bytes == pytest.approx(params / 8 * 7 * 4)


def test_a_tensor_parallel_gather_over_features_copies_its_tensor_once():
    from parsim.lowering.kernels import block_work

    model = load_model("course-mlp")
    block = model.layer_costs(4)[0].blocks[0]
    rows, width = 128, model.width
    for kind in ("F", "B"):
        work = {tp: block_work(Plan(model=model, tp=tp, dtype="fp32"), block, kind, rows) for tp in (1, 2)}
        # torch.cat of the gathered columns (forward) or the contiguous chunks (backward): read + write.
        unsharded = block.elementwise[0].bytes_per_token(kind != "F", 4) * rows
        assert work[2].elementwise_bytes - unsharded / 2 == pytest.approx(2 * width * 4 * rows)
        assert work[1].elementwise_bytes == unsharded and work[2].kernels == work[1].kernels + 1


def _kernel_bytes(layer, backward: bool, tp: int = 1) -> int:
    """Memory-bound bytes per token of a layer's pass, over every block's elementwise kernels (fp16)."""
    return sum(k.bytes_per_token(backward, 2, tp) for b in layer.blocks for k in b.elementwise)


def test_unfused_cross_entropy_runs_megatrons_fp32_passes():
    """Megatron-LM's vocab_parallel_cross_entropy on logits cast to fp32: 38 bytes per vocabulary entry
    forward (read the fp16 logits 2, cast write 4, max 4, sub_ 8, exp 8, sum 4, div_ 8) and 14 backward
    (mul_ 8, cast back 4 + 2), against the fused kernel's 2 + 4 each way; split over TP by the vocabulary."""
    gpt = {"kind": "transformer", "num_layers": 1, "hidden": 1024, "num_heads": 16, "ffn_hidden": 4096,
           "seq_len": 2048, "vocab_size": 51200, "ffn_type": "gelu"}
    fused = load_model(gpt).head_cost(2)
    unfused = load_model(gpt | {"cross_entropy": "unfused"}).head_cost(2)
    assert _kernel_bytes(unfused, False) - _kernel_bytes(fused, False) == (38 - 6) * 51200
    assert _kernel_bytes(unfused, True) - _kernel_bytes(fused, True) == (14 - 6) * 51200
    assert _kernel_bytes(unfused, False, tp=8) - _kernel_bytes(fused, False, tp=8) == (38 - 6) * 51200 // 8


def test_unfused_attention_copies_the_context_and_the_qkv_gradient():
    """Megatron-LM's core attention copies the context back to [s, b, h] (forward: read and write h) and
    the split of the fused QKV output gathers three gradients into one (backward: read and write 3h)."""
    gpt = {"kind": "transformer", "num_layers": 1, "hidden": 1024, "num_heads": 16, "ffn_hidden": 4096,
           "seq_len": 2048, "vocab_size": 1000, "ffn_type": "gelu", "attention_kernel": "unfused"}
    layer = load_model(gpt).layer_costs(2)[0]
    copies = next(k for b in layer.blocks for k in b.elementwise if k.name == "attn.core.copies")
    assert (copies.bytes_per_token(False, 2), copies.bytes_per_token(True, 2)) == (2 * 1024 * 2, 6 * 1024 * 2)
    assert copies.bytes_per_token(True, 2, tp=4) == 6 * 1024 * 2 // 4


def test_an_unknown_loss_kernel_is_refused_in_one_line(tmp_path, capsys):
    plan = tmp_path / "p.yaml"
    plan.write_text("model: {kind: transformer, num_layers: 2, hidden: 256, num_heads: 4, ffn_hidden: 1024,"
                    " seq_len: 128, vocab_size: 1000, cross_entropy: liger}\nparallel: {dp: 8}\n")
    assert main(["simulate", str(plan), "--cluster", "dgx-a100"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cross_entropy" in err and "fused or unfused or torch" in err and len(err.splitlines()) == 1


def test_fp8_casts_every_gemm_input_forward_and_every_output_gradient_backward():
    """Transformer Engine's current scaling: amax then cast-and-transpose, 6 bytes per element of each
    GEMM input (the fused QKV and gate-and-up GEMMs share theirs) and of each output gradient; the LM
    head stays in bf16 and bf16 plans cast nothing."""
    from parsim.lowering.kernels import block_work

    model = load_model({"kind": "transformer", "num_layers": 2, "hidden": 1024, "num_heads": 16, "num_kv_heads": 4,
                        "ffn_hidden": 4096, "seq_len": 2048, "vocab_size": 32000})
    h, kv, f, tokens = 1024, 4 * 64, 4096, 2048
    plan = Plan(model=model, dp=8, microbatch_size=1, dtype="fp8")
    attention, mlp = model.layer_costs(2)[0].blocks
    cast = {(b.name, kind): block_work(plan, b, kind, tokens).quantize_bytes
            for b in (attention, mlp) for kind in "FBIW"}
    assert cast["attention", "F"] == 6 * tokens * (h + h)  # x into QKV, the context into the output projection
    assert cast["attention", "B"] == cast["attention", "I"] == 6 * tokens * (h + 2 * kv + h)
    assert cast["mlp", "F"] == 6 * tokens * (h + f)  # x into gate and up, the product into down
    assert cast["mlp", "B"] == 6 * tokens * (2 * f + h)
    assert cast["attention", "W"] == cast["mlp", "W"] == 0
    head = model.head_cost(2).blocks[0]
    assert block_work(plan, head, "F", tokens).quantize_bytes == 0
    bf16 = Plan(model=model, dp=8, microbatch_size=1, dtype="bf16")
    assert block_work(bf16, attention, "F", tokens).quantize_bytes == 0


def test_an_fp8_plan_keeps_the_lm_head_in_bf16():
    """The LM head is not a Transformer Engine module: in an fp8 plan it runs at the bf16 peak and
    efficiency, every block GEMM at fp8's."""
    from parsim.lowering.kernels import block_work
    from parsim.sim.compute import ComputeModel

    spec = load_cluster("dgx-h100")
    model = load_model({"kind": "transformer", "num_layers": 2, "hidden": 4096, "num_heads": 32, "ffn_hidden": 14336,
                        "seq_len": 8192, "vocab_size": 128256})
    plan = Plan(model=model, dp=8, microbatch_size=1, dtype="fp8")
    fp8 = ComputeModel.for_cluster(spec, "fp8", 2)
    bf16 = ComputeModel.for_cluster(spec, "bf16", 2)
    head = block_work(plan, model.head_cost(2).blocks[0], "F", 8192)
    mlp = block_work(plan, model.layer_costs(2)[0].blocks[1], "F", 8192)
    assert head.high_precision and not mlp.high_precision
    shape = head.matmuls[0]
    assert fp8.matmul_time(*shape, 0, head.high_precision) == pytest.approx(bf16.matmul_time(*shape))
    assert fp8.matmul_time(*shape) < 0.6 * bf16.matmul_time(*shape)


def test_the_mlp_s_first_layer_runs_no_input_gradient():
    """autograd computes no gradient for the data the MLP's first layer reads: its backward is the weight
    gradient alone, every later layer's both; the FLOP counts keep the 3x rule."""
    from parsim.lowering.kernels import block_work

    plan = Plan(model=load_model("course-mlp"), dp=1)
    first, second = (plan.stage_costs(0)[i].blocks[0] for i in (0, 1))
    labels = [block_work(plan, b, "B", plan.tokens_per_rank).labels for b in (first, second)]
    assert [label for label in labels[0] if "grad" in label] == ["w weight grad"]
    assert [label for label in labels[1] if "grad" in label] == ["w input grad", "w weight grad"]
    assert first.backward_input_flops_per_token() == second.backward_input_flops_per_token()
