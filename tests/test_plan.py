"""Plans: batch rules, validation messages, the rank grid and groups, YAML loading, and ``parsim plan``."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parsim.cli.main import main
from parsim.errors import ConfigError, ParsimError
from parsim.workload.model import load_model
from parsim.workload.plan import DEFAULT_BUCKET_SIZE, Plan, builtin_plans, load_plan, resolve_plan

MLP = load_model("course-mlp")
TINY = load_model("tiny-gpt")
LLAMA70 = load_model("llama3-70b")


# --------------------------------------------------------------------------- examples and batch
@pytest.mark.parametrize("name, world, mbs, nmb", [
    ("course-ddp", 4, 32, 1), ("course-tp", 4, 128, 1), ("course-pp", 2, 32, 4),
    ("tiny-pp2", 2, 2, 4), ("tiny-dp2", 2, 4, 1), ("tiny-tp2", 2, 4, 1), ("llama3-70b-1024", 1024, 1, 16),
    ("llama3-405b-16k", 16384, 1, 16), ("llama3-8b-fsdp8", 8, 1, 1), ("llama3-405b-128k-cp16", 16384, 1, 16),
    ("mixtral-8x22b", 128, 1, 16), ("deepseek-v3-2048", 2048, 1, 120),
])
def test_example_plans_load_with_their_batch_split(name, world, mbs, nmb):
    plan = resolve_plan(name)
    assert (plan.world, plan.microbatch_size, plan.num_microbatches) == (world, mbs, nmb)
    assert plan.global_batch_size == plan.dp * mbs * nmb
    assert load_plan(plan.to_dict()) == plan


def test_course_plans_match_the_lecture():
    ddp, tp, pp = resolve_plan("course-ddp"), resolve_plan("course-tp"), resolve_plan("course-pp")
    assert (ddp.grad_sync, ddp.overlap) == ("per_param", False)
    assert tp.tp_style == "allgather"
    assert pp.schedule == "gpipe" and [list(pp.stage_layers(s)) for s in range(2)] == [[0, 1], [2, 3]]


def test_llama_example_uses_bf16_and_ddp_buckets():
    plan = resolve_plan("llama3-70b-1024", gpus=1024)
    assert (plan.dtype_bytes, plan.bucket_size, plan.overlap) == (2, 25 * 2**20, True)
    assert plan.tokens_per_step == 256 * 8192


def test_mlp_batch_is_derived_from_the_model():
    assert Plan(MLP, dp=4).microbatch_size == 32
    plan = Plan(MLP, dp=2, num_microbatches=4)
    assert (plan.microbatch_size, plan.global_batch_size) == (16, 128)
    assert Plan(MLP, dp=2, microbatch_size=16).num_microbatches == 4


def test_transformer_batch_from_global_batch_size():
    plan = Plan(TINY, dp=2, microbatch_size=2, global_batch_size=16)
    assert plan.num_microbatches == 4
    assert Plan(TINY).global_batch_size == 1


def test_a_pipeline_given_only_its_global_batch_runs_microbatches_of_one():
    """As torchtitan does (pipeline_parallel_microbatch_size = 1), rather than one microbatch that 1F1B
    must refuse; without a pipeline the replica's whole batch is one microbatch."""
    plan = Plan(TINY, dp=2, pp=2, global_batch_size=16)
    assert (plan.microbatch_size, plan.num_microbatches) == (1, 8)
    assert (Plan(TINY, dp=2, global_batch_size=16).microbatch_size, Plan(MLP, pp=2).num_microbatches) == (8, 128)



@pytest.mark.parametrize("schedule, pp, v, least", [
    ("gpipe", 4, 1, 1), ("1f1b", 4, 1, 4), ("zero-bubble", 2, 1, 2), ("zbv", 4, 2, 4), ("dualpipe-v", 2, 2, 4),
    ("interleaved-1f1b", 4, 2, 4), ("interleaved-1f1b", 3, 3, 3),
])
def test_a_pipeline_given_no_batch_runs_the_fewest_microbatches_that_fill_its_schedule(schedule, pp, v, least):
    """One per rank where torch's 1F1B refuses fewer; fewer still run where torch runs them (below)."""
    model = load_model({"kind": "transformer", "num_layers": 24, "hidden": 64, "num_heads": 4, "ffn_hidden": 128,
                        "seq_len": 8, "vocab_size": 100})
    plan = Plan(model, pp=pp, schedule=schedule, virtual_stages=v, microbatch_size=2)
    assert (plan.num_microbatches, plan.microbatch_size) == (least, 2)
    if schedule == "dualpipe-v":
        with pytest.raises(ParsimError, match="needs num_microbatches >= its 4 stages"):
            Plan(model, pp=pp, schedule=schedule, virtual_stages=v, num_microbatches=least - 1)
    elif least > 1:
        assert Plan(model, pp=pp, schedule=schedule, virtual_stages=v, num_microbatches=least - 1).num_microbatches \
            == least - 1


@pytest.mark.parametrize("schedule, v, m", [
    ("1f1b", 1, 1), ("1f1b", 1, 3), ("zero-bubble", 1, 2), ("zbv", 2, 3), ("interleaved-1f1b", 2, 3),
    ("interleaved-1f1b", 2, 6), ("interleaved-1f1b", 3, 10), ("gpipe", 1, 2),
])
def test_pipelines_with_fewer_microbatches_than_ranks_or_uneven_rounds_simulate(schedule, v, m):
    """torch's interleaved schedules run m < pp, or rounds of m // (m // pp) (10 on 4 ranks: 2 rounds of 5), and
    its ZBV runs m < pp too; Megatron's 1F1B warms up with min(pp - r - 1, m) forwards. Every pass runs once."""
    from parsim.hardware.cluster import load_cluster
    from parsim.sim.step import predict_step

    model = load_model({"kind": "transformer", "num_layers": 24, "hidden": 64, "num_heads": 4, "ffn_hidden": 128,
                        "seq_len": 8, "vocab_size": 100})
    plan = Plan(model, pp=4, schedule=schedule, virtual_stages=v, num_microbatches=m, microbatch_size=1)
    trace = predict_step(plan, load_cluster("dgx-h100")).trace
    forwards = sorted(e.name for e in trace.events if e.kind == "compute" and e.name.startswith("F "))
    assert forwards == sorted(f"F stage={stage} mb={mb}" for stage in range(4 * v) for mb in range(m))


def test_simulate_from_flags_alone_notes_the_batch_it_chose(capsys):
    assert main(["simulate", "--model", "tiny-gpt", "--pp", "2", "--cluster", "dgx-h100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"] == "command-line"
    assert main(["plan", "show", "--model", "tiny-gpt", "--pp", "2"]) == 0
    captured = capsys.readouterr()
    assert ("no batch given: 2 microbatches of 1 sample(s) a step, the fewest that fill 1f1b's pipeline on pp 2"
            in captured.err)
    assert "2 microbatches" in captured.out



def test_a_flag_leaving_bucketed_sync_drops_the_files_bucket_size():
    """tiny-dp2 syncs in 256 KiB buckets; --grad-sync fsdp replaces that sync, buckets and all."""
    assert resolve_plan("tiny-dp2").bucket_size == 256 * 1024
    fsdp = resolve_plan("tiny-dp2", overrides={"data_parallel": {"grad_sync": "fsdp"}})
    assert (fsdp.grad_sync, fsdp.zero) == ("fsdp", 3)
    with pytest.raises(ConfigError, match="bucket_size"):  # a bucket size given with it is still refused
        resolve_plan("tiny-dp2", overrides={"data_parallel": {"grad_sync": "fsdp", "bucket_size": "1MiB"}})


def test_virtual_stages_default_to_the_schedules_own():
    """As make_schedule: interleaved 1F1B and the Vs hold two stages per rank unless told, the rest one."""
    for schedule, v in (("interleaved-1f1b", 2), ("zbv", 2), ("dualpipe-v", 2), ("1f1b", 1), ("zero-bubble", 1)):
        assert Plan(TINY, pp=2, num_microbatches=4, schedule=schedule).virtual_stages == v
    # a schedule given over a file's takes its own default, not the count the file gave its schedule
    plan = resolve_plan("llama3-70b-1024", overrides={"schedule": "interleaved-1f1b"})
    assert (plan.schedule, plan.virtual_stages) == ("interleaved-1f1b", 2)
    kept = resolve_plan("llama3-70b-1024", overrides={"schedule": "interleaved-1f1b", "virtual_stages": 4})
    assert kept.virtual_stages == 4


# --------------------------------------------------------------------------- validation
KV3 = load_model({"kind": "transformer", "num_layers": 2, "hidden": 96, "num_heads": 6, "num_kv_heads": 3,
                  "ffn_hidden": 192, "seq_len": 8, "vocab_size": 100})
ODD_FFN = load_model({"kind": "transformer", "num_layers": 2, "hidden": 64, "num_heads": 4,
                      "ffn_hidden": 250, "seq_len": 8, "vocab_size": 100})


@pytest.mark.parametrize("kwargs, message", [
    (dict(model=MLP, pp=8, schedule="gpipe"), "8 pipeline stages (pp 8 x virtual_stages 1) for 4 layers"),
    (dict(model=TINY, pp=2, num_microbatches=4, schedule="interleaved-1f1b", virtual_stages=4),
     "8 pipeline stages (pp 2 x virtual_stages 4) for 4 layers: every stage needs at least one layer"),
    (dict(model=MLP, tp=3), "tp 3 does not divide width 1024"),
    (dict(model=TINY, tp=8), "tp 8 does not divide num_heads 4"),
    (dict(model=ODD_FFN, tp=4), "tp 4 does not divide ffn_hidden 250"),
    (dict(model=KV3, tp=2), "tp 2 and num_kv_heads 3"),
    (dict(model=MLP, dp=3), "the global batch 128 does not split evenly over dp 3"),
    (dict(model=MLP, dp=4, microbatch_size=16, num_microbatches=1),
     "dp 4 x microbatch_size 16 x num_microbatches 1 = 64, not the global batch 128"),
    (dict(model=MLP, global_batch_size=64), "global_batch_size 64 differs from model course-mlp's batch_size 128"),
    (dict(model=TINY, pp=2, num_microbatches=5, schedule="interleaved-1f1b", virtual_stages=2),
     "interleaved-1f1b runs microbatches in max(1, m // pp) = 2 equal rounds, as PyTorch does, and 5 microbatches "
     "do not split into 2; 4 or 6 do"),
    (dict(model=TINY, pp=2, num_microbatches=2, virtual_stages=2), "virtual_stages 2 needs schedule interleaved-1f1b"),
    (dict(model=TINY, pp=2, num_microbatches=2, schedule="interleaved-1f1b", virtual_stages=1),
     "needs virtual_stages >= 2"),
    (dict(model=TINY, pp=2, num_microbatches=2, schedule="zbv", virtual_stages=1), "virtual_stages must be 2, not 1"),
    (dict(model=TINY, microbatch_size=0), "microbatch_size is 0; it must be a whole number >= 1"),
    (dict(model=TINY, tp=0), "tp is 0"),
    (dict(model=TINY, schedule="pipedream"), "schedule 'pipedream' is not one of gpipe, 1f1b"),
    (dict(model=TINY, dtype="fp4"), "dtype 'fp4' is not one of fp32, bf16, fp16, fp8"),
    (dict(model=TINY, tp_style="allgather"), "tensor_parallel 'allgather' does not apply to transformer model"),
    (dict(model=MLP, tp_style="sequence"), "known styles: megatron, allgather"),
    (dict(model=TINY, grad_sync="zero3"), "grad_sync 'zero3' is not one of per_param, bucketed"),
    (dict(model=TINY, grad_sync="per_param", overlap=True), "overlap needs grad_sync bucketed"),
    (dict(model=TINY, order="dp,tp"), "order 'dp,tp' is not a nesting of dp, pp, cp and tp"),
])
def test_each_rule_gives_one_line_naming_the_numbers(kwargs, message):
    with pytest.raises(ParsimError) as err:
        Plan(**kwargs)
    assert message in str(err.value)
    assert str(err.value).startswith("plan plan: ") and "\n" not in str(err.value)


def test_gpu_count_must_match_the_degrees():
    with pytest.raises(ParsimError, match="dp 4 x pp 1 x tp 1 = 4 ranks, but 8 GPUs were given"):
        resolve_plan("course-ddp", gpus=8)
    resolve_plan("course-ddp").validate(gpus=4)


def test_kv_heads_may_split_or_replicate():
    Plan(LLAMA70, tp=8, num_microbatches=1)  # 8 kv heads, one per rank
    Plan(LLAMA70, tp=4)  # two per rank
    Plan(TINY, tp=4)  # 2 kv heads, each on two ranks


# --------------------------------------------------------------------------- rank grid
def test_rank_grid_has_tp_innermost():
    plan = resolve_plan("llama3-70b-1024")
    assert plan.rank_of(dp=1, pp=2, tp=3) == 64 + 16 + 3
    assert plan.coords(83) == (1, 2, 0, 3)  # dp, pp, cp, tp
    assert plan.groups("tp")[1] == list(range(8, 16))
    assert plan.groups("pp")[0] == list(range(0, 64, 8))
    assert plan.groups("dp")[0] == list(range(0, 1024, 64))
    assert plan.group_of(83, "dp")[:2] == [19, 83]


def test_orders_without_cp_keep_working():
    plan = Plan(MLP, dp=2, tp=2, num_microbatches=1, order="tp,pp,dp")
    assert plan.order == "cp,tp,pp,dp"


def test_other_orders_place_other_dims_innermost():
    plan = Plan(MLP, dp=2, tp=2, num_microbatches=1, order="tp,pp,dp")
    assert plan.groups("dp") == [[0, 1], [2, 3]]
    assert plan.groups("tp") == [[0, 2], [1, 3]]


@settings(max_examples=40, deadline=None)
@given(dp=st.integers(1, 4), pp=st.sampled_from([1, 2, 4]), cp=st.sampled_from([1, 2]),
       tp=st.sampled_from([1, 2, 4]), order=st.permutations(["dp", "pp", "cp", "tp"]))
def test_groups_partition_the_ranks_and_coords_invert_rank_of(dp, pp, cp, tp, order):
    plan = Plan(TINY, dp=dp, pp=pp, cp=cp, tp=tp, num_microbatches=4, order=",".join(order))
    for dim in ("dp", "pp", "cp", "tp"):
        groups = plan.groups(dim)
        assert sorted(r for g in groups for r in g) == list(range(plan.world))
        assert all(len(g) == plan.degree(dim) for g in groups)
    for rank in range(plan.world):
        assert plan.rank_of(**plan.coords(rank)._asdict()) == rank
    assert plan.groups(order[-1])[0] == list(range(plan.degree(order[-1])))


def test_out_of_range_indices_are_refused():
    plan = resolve_plan("course-pp")
    with pytest.raises(ParsimError, match="pp index 2 is outside 0..1"):
        plan.rank_of(pp=2)
    with pytest.raises(ParsimError, match="rank 2 is outside 0..1"):
        plan.coords(2)
    with pytest.raises(ParsimError, match="unknown parallel dimension 'ep'"):
        plan.groups("ep")


# --------------------------------------------------------------------------- stages
def test_interleaved_stages_round_robin_over_pipeline_ranks():
    plan = Plan(LLAMA70, pp=8, num_microbatches=16, schedule="interleaved-1f1b", virtual_stages=5)
    assert plan.num_stages == 40
    assert plan.stages_of(0) == [0, 8, 16, 24, 32]
    assert plan.stage_layers(8) == range(16, 18)


def test_embedding_on_first_stage_and_head_on_last():
    plan = resolve_plan("tiny-pp2")
    assert [c.name for c in plan.stage_costs(0)] == ["embedding", "layer.0", "layer.1"]
    assert [c.name for c in plan.stage_costs(1)] == ["layer.2", "layer.3", "head"]
    assert sum(plan.params_per_rank(r) for r in range(plan.pp)) == TINY.num_params


def test_a_tied_head_on_another_pipeline_rank_keeps_a_copy_whose_gradient_is_summed_with_the_table():
    """Megatron-LM: the last stage holds its own copy of a tied table (weights, gradients, optimizer state,
    and its share of the data-parallel sync), and after that sync the two copies' gradients are all-reduced
    between the first and last pipeline ranks. A V schedule puts both ends on rank 0: one table, no sum."""
    from parsim.lowering.lower import lower

    gpt3 = load_model("gpt3-175b")
    table = -(-gpt3.vocab_size // 8) * gpt3.hidden  # one tensor-parallel rank's rows of the padded table
    looped = Plan(model=gpt3, dp=2, tp=8, pp=4, num_microbatches=8, dtype="bf16")
    untied = Plan(model=load_model(dict(gpt3.to_dict(), tied_embeddings=False)), dp=2, tp=8, pp=4, num_microbatches=8,
                  dtype="bf16")
    assert looped.copies_embedding_table
    assert looped.params_per_rank(3) == untied.params_per_rank(3)
    assert looped.params_per_rank(0) == untied.params_per_rank(0)

    program = lower(looped)
    sums = {rank: [op for op in program.rank_ops(rank) if op.name == "all_reduce embedding"] for rank in program.ranks}
    first, last = looped.rank_of(dp=0, pp=0, tp=0), looped.rank_of(dp=0, pp=3, tp=0)
    for rank in (first, last):
        (op,) = sums[rank]
        assert op.ranks == (first, last) and len(op.mirrors) == looped.dp * looped.tp - 1
        assert op.nbytes == table * 4  # the gradients in fp32, bf16's default reduce dtype
        step = next(o for o in program.rank_ops(rank) if o.name == "optimizer step")
        assert op.id in step.deps
    assert not any(sums[r] for r in program.ranks if r not in (first, last))
    assert not any(op.name == "all_reduce embedding" for op in lower(untied).ops)

    v = Plan(model=gpt3, dp=2, tp=8, pp=4, num_microbatches=8, dtype="bf16", schedule="zbv")
    assert not v.copies_embedding_table
    assert v.params_per_rank(0) < untied.params_per_rank(0) + untied.params_per_rank(3)
    assert not any(op.name == "all_reduce embedding" for op in lower(v).ops)

# --------------------------------------------------------------------------- YAML
def test_plan_yaml_with_model_path_relative_to_the_plan(tmp_path):
    (tmp_path / "m.yaml").write_text("kind: mlp\nnum_layers: 2\nwidth: 8\nbatch_size: 8\n")
    (tmp_path / "p.yaml").write_text(
        "model: m.yaml\nparallel: {dp: 2, pp: 2}\nbatch: {num_microbatches: 2}\nschedule: gpipe\n"
        "data_parallel: {grad_sync: bucketed, bucket_size: 1KiB, overlap: false}\n")
    plan = load_plan(tmp_path / "p.yaml", gpus=4)
    assert (plan.name, plan.microbatch_size, plan.bucket_size, plan.overlap) == ("p", 2, 1024, False)


def test_inline_model_and_overrides():
    plan = load_plan({"model": {"kind": "mlp", "num_layers": 4, "width": 16, "batch_size": 8},
                      "parallel": {"dp": 2}}, overrides={"parallel": {"tp": 2}, "dtype": "bf16"})
    assert (plan.dp, plan.tp, plan.dtype, plan.bucket_size) == (2, 2, "bf16", DEFAULT_BUCKET_SIZE)


@pytest.mark.parametrize("text, message", [
    ("model: course-mlp\nparallel: {dp: 4, sp: 2}\n",
     "parallel.sp: unknown key (expected one of dp, tp, pp, cp, ep, order)"),
    ("model: course-mlp\nzero: 3\n", "zero: unknown key (expected one of name, description, cluster, model, parallel"),
    ("model: course-mlp\nparallel: {dp: two}\n", "parallel.dp: is 'two' (expected a whole number)"),
    ("model: course-mlp\nparallel: 4\n", "parallel: is int 4 (expected a mapping of keys)"),
    ("model: course-mlp\ndata_parallel: {bucket_size: lots}\n",
     "data_parallel.bucket_size: is 'lots' (expected a size in bytes"),
    ("model: course-mlp\nparallel: {dp: 4}\ndata_parallel: {grad_sync: per_param, bucket_size: 1MiB}\n",
     "data_parallel.bucket_size: is set with grad_sync per_param"),
    ("model: course-mlp\ndata_parallel: {overlap: yes please}\n", "data_parallel.overlap: is 'yes please'"),
    ("parallel: {dp: 4}\n", "model: missing"),
    ("model: 7\n", "model: is 7 (expected a preset name"),
    ("model: {kind: mlp, num_layers: 2, width: 8}\n", "model: batch_size: missing"),
    ("- model\n", "(file): is list"),
    ("model: course-mlp\nparallel: {dp: 4\n", "(file): malformed YAML at line"),
])
def test_plan_file_problems_are_one_config_error_line(tmp_path, text, message):
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_plan(path)
    assert message in str(err.value)
    assert str(err.value).startswith(str(path)) and "\n" not in str(err.value)


def test_unknown_plan_and_missing_file():
    with pytest.raises(ParsimError, match="unknown plan 'nope': not an example .*course-ddp"):
        resolve_plan("nope")
    with pytest.raises(ParsimError, match="no plan file"):
        load_plan("/nonexistent/plan.yaml")
    assert set(builtin_plans()) >= {"course-ddp", "course-tp", "course-pp", "llama3-70b-1024"}


# --------------------------------------------------------------------------- CLI
def test_cli_show_prints_grid_and_groups(capsys):
    assert main(["plan", "show", "course-tp"]) == 0
    out = capsys.readouterr().out
    assert "course-mlp" in out and "tp 3" in out and "[0 1 2 3]" in out


def test_cli_show_with_cluster_names_link_kinds(capsys):
    assert main(["plan", "show", "llama3-70b-1024", "--cluster", "dgx-h100"]) == 0
    out = capsys.readouterr().out
    tp_row = next(line for line in out.splitlines() if line.startswith("tp "))
    assert "nvlink" in tp_row and "1024 ranks" in out


def test_cli_json_is_a_loadable_plan(capsys):
    assert main(["plan", "show", "course-ddp", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["groups"]["dp"] == [[0, 1, 2, 3]]
    assert load_plan(data["plan"]) == resolve_plan("course-ddp")


def test_cli_flags_override_and_build_plans(capsys):
    assert main(["plan", "show", "llama3-70b-1024", "--tp", "4", "--pp", "16", "--gpus", "1024"]) == 0
    assert "dp 16 x pp 16 x tp 4" in capsys.readouterr().out
    assert main(["plan", "show", "--model", "llama3-8b", "--dp", "8", "--dtype", "bf16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["world"] == 8
    assert main(["plan", "list"]) == 0
    assert main(["plan", "show", "--model", "llama3-8b", "--pp", "2", "--schedule", "interleaved-1f1b"]) == 0
    assert "2 per pipeline rank" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["plan", "show", "course-ddp", "--gpus", "8"], "= 4 ranks, but 8 GPUs were given"),
    (["plan", "show", "course-ddp", "--tp", "3"], "tp 3 does not divide width 1024"),
    (["plan", "show", "no-such-plan"], "unknown plan 'no-such-plan'"),
    (["plan", "show"], "give a plan"),
    (["plan", "show", "course-ddp", "--nodes", "2"], "--nodes needs --cluster"),
])
def test_cli_bad_plans_exit_2_with_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_llama3_405b_splits_into_16_stages_as_meta_did():
    # 126 layers on 16 stages: one layer less on the first and the last (Dubey et al. 2024, section 3.3.2).
    plan = Plan(model=load_model("llama3-405b"), tp=8, pp=16, num_microbatches=16)
    assert plan.stage_split == (7,) + (8,) * 14 + (7,)
    assert plan.stage_layers(1) == range(7, 15) and plan.stage_layers(15) == range(119, 126)
    assert [c.name for c in plan.stage_costs(15)][-1] == "head"


def test_balanced_split_gives_the_head_stage_fewer_layers():
    # Llama 3 70B's LM head costs about 1.2 layers, so an even 10-layer split leaves the last stage slowest.
    plan = Plan(model=load_model("llama3-70b"), tp=8, pp=8, num_microbatches=8, layers_per_stage="balanced")
    assert sum(plan.stage_split) == 80 and plan.stage_split[-1] < 10
    even = Plan(model=load_model("llama3-70b"), tp=8, pp=8, num_microbatches=8)
    assert even.stage_split == (10,) * 8


def test_balanced_split_leaves_an_end_stage_empty_where_its_extra_outweighs_a_stage():
    """DeepSeek-V3's last stage also runs the multi-token prediction module (a layer and a second pass through
    the head: 3.5 layers' FLOPs): alone it outweighs a stage of two layers, so it gets no layer, as in
    Megatron-LM's DeepSeek-V3 layout Et|(tt|)*30mL."""
    plan = Plan(model=load_model("deepseek-v3"), dp=64, ep=64, pp=16, schedule="dualpipe-v", virtual_stages=2,
                dtype="fp8", microbatch_size=1, num_microbatches=64, layers_per_stage="balanced")
    assert plan.stage_split == (1,) + (2,) * 30 + (0,)
    mlp = Plan(model=MLP, pp=3, schedule="gpipe", layers_per_stage="balanced")
    assert min(mlp.stage_split) == 1  # a model without embedding or head keeps a layer on every stage


@pytest.mark.parametrize("split, message", [
    ((8, 8), "lists 2 stages, but pp 4"),
    ((1, 0, 2, 1), "leaves stage 1 without a layer: every stage but a transformer's first and last needs"),
    ((2, 2, 2, 2), r"adds up to 8 layers, not the model's 4"),
])
def test_explicit_stage_splits_are_checked(split, message):
    with pytest.raises(ParsimError, match=message):
        Plan(model=load_model("tiny-gpt"), pp=4, num_microbatches=4, layers_per_stage=split)


def test_stage_split_from_yaml_and_back(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("model: tiny-gpt\nparallel: {pp: 2}\nbatch: {num_microbatches: 2}\nlayers_per_stage: [1, 3]\n")
    plan = load_plan(path)
    assert plan.stage_split == (1, 3) and load_plan(plan.to_dict()).stage_split == (1, 3)
    path.write_text("model: tiny-gpt\nlayers_per_stage: [a]\n")
    with pytest.raises(ParsimError, match="layers_per_stage"):
        load_plan(path)


def test_layers_that_do_not_divide_into_stages_are_balanced():
    plan = Plan(model=MLP, pp=3, schedule="gpipe")
    assert plan.stage_split == (1, 1, 2)  # equal layers: the later stage takes the extra one


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ParsimError, match="every stage needs at least one layer"):
        Plan(model=load_model("tiny-gpt"), pp=8, num_microbatches=8)


def test_frontier_example_plans_say_whether_they_fit():
    from parsim.hardware.cluster import load_cluster
    from parsim.workload.memory import memory

    capacity = load_cluster("dgx-h100").gpu.hbm_capacity_bytes
    llama405 = resolve_plan("llama3-405b-16k")
    assert llama405.stage_split == (7,) + (8,) * 14 + (7,) and llama405.zero == 2 and llama405.sequence_parallel
    fsdp = resolve_plan("llama3-8b-fsdp8")
    assert (fsdp.zero, fsdp.shard_size, fsdp.activation_recompute) == (3, 8, "full")
    assert all(m.total <= capacity for m in memory(fsdp))
    # fp32 gradients added up whole over 16 microbatches: stage 1 is 3.35 GB over (the preset's comment says why)
    assert max(m.total for m in memory(llama405)) - capacity == pytest.approx(3.35e9, abs=0.01e9)


def test_plan_show_describes_every_feature(capsys):
    assert main(["plan", "show", "mixtral-8x22b"]) == 0
    out = capsys.readouterr().out
    assert "experts           8 per MoE layer over ep 8 ranks (1 per GPU), top-2" in out
    assert "tensor parallel   megatron with sequence parallelism" in out
    assert "ZeRO-1: optimizer state sharded over 8 ranks" in out
    assert main(["plan", "show", "llama3-405b-128k-cp16"]) == 0
    out = capsys.readouterr().out
    assert "pipeline          1f1b, 16 stages of 7-8 layers (7/8x14/7)" in out
    assert "context parallel  16 ranks per sequence, K/V all-gathered before attention" in out
    assert "dp 8 x pp 16 x cp 16 x tp 8 = 16384 ranks" in out
    assert main(["plan", "show", "llama3-8b-fsdp8"]) == 0
    out = capsys.readouterr().out
    assert "FSDP (ZeRO-3), shards over 8 ranks" in out and "recompute         full, every layer" in out


def test_plan_show_says_which_kernels_a_transformer_plan_prices(capsys):
    assert main(["plan", "show", "llama3-8b-fsdp8"]) == 0
    assert "kernels           attention flash, layers fused, loss fused" in capsys.readouterr().out
    assert main(["plan", "show", "course-ddp"]) == 0
    assert "kernels " not in capsys.readouterr().out  # the lecture's MLP has no attention or loss kernels to name


def test_plan_show_says_what_runs_around_the_optimizer_step(capsys):
    assert main(["plan", "show", "llama3-8b-fsdp8"]) == 0
    assert "optimizer         AdamW fused\n" in capsys.readouterr().out  # FSDP2 steps its fp32 shards
    assert main(["plan", "show", "tiny-pp2", "--dtype", "fp16", "--grad-clip", "0.5"]) == 0
    assert ("optimizer         AdamW foreach on fp32 master weights, fp16 loss scaling (gradients unscaled and "
            "checked for overflow), gradients clipped to global norm 0.5") in capsys.readouterr().out
