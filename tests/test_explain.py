"""`parsim explain bubble` and the pictures of schedules (PNG and terminal Gantt charts)."""

from __future__ import annotations

import json
import re

import pytest

from parsim.cli.main import main
from parsim.report.gantt import ascii_gantt, draw_gantt
from parsim.report.trace import Event, Trace, compute_name, p2p_name
from parsim.schedules import make_schedule, simulate_ideal

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_bubble_walks_a_student_through_1f1b(capsys):
    code, out, _ = run(capsys, "explain", "bubble", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b")
    assert code == 0
    assert "rank 0: F0 F1 F2 F3 B0 F4 B1" in out  # 1. the order
    assert "bubble per rank = (p-1)(t_f + t_b) = (4-1)(1 + 2) = 9" in out  # 2. the closed form
    assert "(p-1)/(m+p-1) = (4-1)/(8+4-1) = 3/11 = 0.2727" in out
    assert "step time 33 units; bubble 27.3% of all rank-time, as the closed form says." in out  # 3. simulated
    assert "Peak per rank: [4, 3, 2, 1]" in out  # 4. memory
    assert "rank 3: .  .  .  F0 B0 -- F1 B1 --" in out  # 5. the picture


def test_interleaving_shows_the_bubble_divided_by_v(capsys):
    code, out, _ = run(capsys, "explain", "bubble", "--schedule", "interleaved-1f1b", "--virtual-stages", "2")
    assert code == 0
    assert "t_f = 0.5, t_b = 1" in out
    assert "(p-1)/(v*m+p-1) = (4-1)/(2*8+4-1) = 3/19 = 0.1579" in out
    assert "15.8% of all rank-time, as the closed form says" in out
    assert "rank 0: 0F0 0F1 0F2 0F3 4F0" in out  # PyTorch's notation when a rank owns several stages


def test_zero_bubble_shows_a_third_of_the_1f1b_bubble(capsys):
    code, out, _ = run(capsys, "explain", "bubble", "--schedule", "zero-bubble")
    assert code == 0
    assert "t_b = 2 = t_i + t_w = 1 + 1" in out
    assert "(p-1)(t_f + t_i - t_w) = (4-1)(1 + 1 - 1) = 3" in out
    assert "11.1% of all rank-time, as the closed form says" in out


def test_zero_bubble_says_when_its_formula_does_not_apply(capsys):
    code, out, _ = run(capsys, "explain", "bubble", "--schedule", "zero-bubble", "--tw", "1.5")
    assert code == 0
    assert "holds when m >= p and t_w <= min(t_f, t_i)" in out


@pytest.mark.parametrize("schedule", ["zero-bubble", "zb-h2", "zbv", "dualpipe-v"])
def test_a_pass_that_takes_no_time_is_left_out_of_the_picture(capsys, schedule):
    code, out, _ = run(capsys, "explain", "bubble", "--schedule", schedule, "--tw", "0")
    picture = out.split("The picture")[1]
    assert code == 0 and "W" not in picture.split("\n", 1)[1] and "F0" in picture


def test_zbv_has_only_the_simulation(capsys):
    code, out, _ = run(capsys, "explain", "bubble", "--schedule", "zbv")
    assert code == 0
    assert "no simple closed form" in out and "Peak per rank: [8, 8, 8, 8]" in out


def test_communication_shows_up_as_the_gap_to_the_closed_form(capsys):
    code, out, _ = run(capsys, "explain", "bubble", "--pp", "2", "-m", "2", "--tcomm", "0.5")
    assert code == 0
    assert "the closed form says 33.3%: transfers on the critical path add 1 to the step" in out


def test_json_is_for_scripts(capsys):
    code, out, _ = run(capsys, "explain", "bubble", "--pp", "4", "-m", "8", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["simulated"]["bubble_fraction"] == pytest.approx(3 / 11)
    assert data["closed_form"]["bubble_fraction"] == pytest.approx(3 / 11)
    assert [r["peak_in_flight"] for r in data["ranks"]] == [4, 3, 2, 1]
    assert data["ranks"][3]["actions"][:3] == ["3F0", "3B0", "3F1"]


def test_gantt_flag_writes_a_png_instead_of_the_terminal_picture(capsys, tmp_path):
    path = tmp_path / "1f1b.png"
    code, out, err = run(capsys, "explain", "bubble", "--gantt", str(path))
    assert code == 0
    assert path.read_bytes().startswith(PNG_MAGIC)
    assert f"wrote {path}" in err and "5. The picture" not in out


@pytest.mark.parametrize("argv,message", [
    (["--schedule", "pipedream"], "unknown pipeline schedule 'pipedream'"),
    (["--schedule", "interleaved-1f1b", "-m", "9"], "9 microbatches do not split into 2; 8 or 10 do"),
    (["--pp", "0"], "pipeline size must be at least 1"),
    (["--tf", "-1"], "--tf must be a finite time >= 0"),
    (["--schedule", "zero-bubble", "--tw", "3"], "--tw (3) is part of the backward and cannot exceed --tb (2)"),
    (["--schedule", "1f1b", "--tw", "1"], "--tw 1: 1f1b runs each backward whole"),
])
def test_bad_arguments_are_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, "explain", "bubble", *argv)
    assert code == 2 and out == ""
    assert err.startswith("parsim explain: error: ") and message in err and err.count("\n") == 1


def test_explain_without_a_topic_names_the_topics_in_one_line(capsys):
    code, _, err = run(capsys, "explain")
    assert code == 2 and err == "parsim explain: error: which topic? bubble, memory or compute " \
                               "(see 'parsim explain --help')\n"


# --- pictures ------------------------------------------------------------------------------------


def test_ascii_gantt_marks_idle_slots_and_long_passes():
    trace = simulate_ideal(make_schedule("gpipe", 2, 2), 1, 2).to_trace()
    assert ascii_gantt(trace).splitlines()[1:] == [
        "rank 0: F0 F1 .  .  .  B0 -- B1 --",
        "rank 1: .  F0 F1 B0 -- B1 -- .  .",
    ]


def test_ascii_gantt_gives_up_when_times_have_no_small_common_slot():
    trace = simulate_ideal(make_schedule("1f1b", 2, 2), 1, 2 ** 0.5).to_trace()
    assert ascii_gantt(trace) is None


@pytest.mark.parametrize("name,v,m", [("interleaved-1f1b", 2, 8), ("zbv", 2, 8), ("1f1b", 1, 64)])
def test_draw_gantt_draws_simulated_schedules(tmp_path, name, v, m):
    timing = simulate_ideal(make_schedule(name, 4, m, v), 1 / v, 2 / v, 0.5 / v if name == "zbv" else 0, 0.1)
    path = tmp_path / "g.png"
    draw_gantt(timing.to_trace(), str(path), f"{name} m={m}")
    assert path.read_bytes().startswith(PNG_MAGIC)


def test_draw_gantt_draws_measured_traces_with_fused_backward_and_collectives(tmp_path):
    events = [Event(compute_name("F", 0, 0), 0, "compute", "compute", 0.0, 1e-3),
              Event(compute_name("BW", 0, 0), 0, "compute", "compute", 2e-3, 2e-3),
              Event(p2p_name("send", "act", 0, 0, 1), 0, "p2p", "send", 1e-3, 1e-4),
              Event("all_reduce dp bucket=0", 0, "comm", "collective", 4e-3, 1e-3),
              Event("optimizer", 1, "compute", "optimizer", 5e-3, 1e-3)]
    path = tmp_path / "measured.png"
    draw_gantt(Trace("measured", 2, events), str(path), "measured")
    assert path.read_bytes().startswith(PNG_MAGIC)


def test_draw_gantt_gives_recompute_and_the_optimizer_colours_of_their_own(tmp_path, monkeypatch):
    """A rank's recompute and optimizer step are compute, not communication: without collectives the legend
    has no communication entry, and no compute box is drawn in its grey."""
    import matplotlib.figure
    from matplotlib.colors import to_rgba

    from parsim.report.gantt import COMM_COLOR

    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *args, **kwargs: figures.append(fig))
    events = [Event(compute_name("F", 0, 0), 0, "compute", "compute", 0.0, 1e-3),
              Event(compute_name("R", 0, 0), 0, "compute", "compute", 1e-3, 1e-3),
              Event(compute_name("B", 0, 0), 0, "compute", "compute", 2e-3, 2e-3),
              Event("optimizer step", 0, "compute", "optimizer", 4e-3, 1e-3)]
    draw_gantt(Trace("simulated", 1, events), str(tmp_path / "g.png"))
    ax = figures[0].axes[0]
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert "R recompute (a forward rerun for its backward)" in labels and "optimizer step, other compute" in labels
    assert not any("communication" in label for label in labels)
    drawn = [tuple(c) for collection in ax.collections for c in collection.get_facecolors()]
    assert to_rgba(COMM_COLOR) not in drawn


def test_explain_memory_walks_through_the_rank_that_needs_the_most(capsys):
    assert main(["explain", "memory", "llama3-405b-16k"]) == 0
    out = capsys.readouterr().out
    assert "pipeline rank 1 of llama3-405b-16k" in out  # 15 microbatches of 8 layers beat stage 0's 16 of 7
    assert "4 of fp32 gradients" in out and "= 18 bytes" in out
    assert "ZeRO-2 shards the optimizer state and the gradients over 128" in out
    assert "the gradients add up whole over the microbatches" in out
    assert "65,024 bytes (split along the sequence too" in out  # 32h/t with h 16384, t 8: Llama's GQA/SwiGLU sum
    # fp32 gradients added up whole over 16 microbatches: 12.75 GB more than ZeRO-2's shard (the preset says why)
    assert "it does NOT fit, 3.35 GB over" in out and out.count("\npp ") == 16


def test_explain_memory_and_plan_show_say_what_fsdp_holds_and_moves_under_a_pipeline(capsys):
    from parsim.workload.memory import memory
    from parsim.workload.plan import resolve_plan

    plan = resolve_plan("llama3-405b-16k", overrides={"data_parallel": {"zero": 3, "grad_sync": "fsdp"}})
    assert main(["explain", "memory", "llama3-405b-16k", "--zero", "3", "--grad-sync", "fsdp"]) == 0
    out = capsys.readouterr().out
    rank = int(out.split("pipeline rank ")[1].split()[0])
    buffers = memory(plan)[rank].buffers
    assert buffers == plan.params_per_rank(rank) * (2 + 4)  # bf16 weights gathered, fp32 gradients whole
    assert (f"5. FSDP buffers under a pipeline: every layer's weights stay gathered and its gradients unsharded, "
            f"in fp32, until the stage's last backward (torch.distributed.pipelining): "
            f"{plan.params_per_rank(rank):,} parameters x (2 + 4) bytes = {buffers / 1e9:.2f} GB.") in out
    assert main(["plan", "show", "tiny-pp2", "--dp", "2", "--grad-sync", "fsdp"]) == 0
    assert ("FSDP (ZeRO-3), shards over 2 ranks: each layer's weights all-gathered in its stage's first forward, "
            "its gradients reduce-scattered after the stage's last backward") in capsys.readouterr().out


@pytest.mark.parametrize("flags, experts", [
    (["--dp", "8", "--ep", "4", "--zero", "1"], "routed experts' over the 2 ranks holding the same experts"),
    (["--dp", "16", "--ep", "4", "--grad-sync", "fsdp", "--shard-group", "8"],
     "routed experts' over the 2 ranks of its shard group holding the same experts"),
    (["--dp", "16", "--ep", "8", "--zero", "1", "--shard-group", "8"],
     "routed experts' not at all: no other rank of its shard group holds them"),
])
def test_explain_memory_says_where_zero_shards_the_experts(capsys, flags, experts):
    assert main(["explain", "memory", "--model", "mixtral-8x22b", "--global-batch-size", "16", *flags]) == 0
    assert f"over 8 data-parallel ranks; {experts}" in capsys.readouterr().out


def test_plan_show_counts_hsdp_replicas_over_data_and_context_parallel_ranks(capsys):
    """dp 16 x cp 2 in shard groups of 8: 4 copies of each shard (dp x cp / shard_group), not dp / shard_group."""
    argv = ["plan", "show", "--model", "llama3-8b", "--dp", "16", "--cp", "2", "--global-batch-size", "32",
            "--shard-group", "8"]
    assert main([*argv, "--grad-sync", "fsdp"]) == 0
    assert "FSDP (ZeRO-3), shards over 8 ranks, replicated 4x (HSDP)" in capsys.readouterr().out
    assert main([*argv, "--zero", "1"]) == 0
    assert "sharded over 8 ranks (HSDP, replicated 4x)" in capsys.readouterr().out


def test_explain_memory_names_the_gradients_dtype_when_it_is_not_the_weights(capsys):
    argv = ["explain", "memory", "--model", "llama3-8b", "--dp", "8", "--zero", "1"]
    assert main(argv + ["--dtype", "fp16", "--reduce-dtype", "bf16"]) == 0
    assert "2 bytes of weights + 2 of bf16 gradients + 8 of fp32 moments" in capsys.readouterr().out
    assert main(argv + ["--dtype", "fp16"]) == 0
    assert "2 bytes of weights + 2 of gradients + 8 of fp32 moments" in capsys.readouterr().out


def test_explain_memory_names_the_last_stages_copy_of_a_tied_table(capsys):
    argv = ["explain", "memory", "--model", "gpt3-175b", "--tp", "8", "--pp", "8", "--dp", "4",
            "--num-microbatches", "16", "--microbatch-size", "1", "--dtype", "bf16", "--pp-rank"]
    assert main(argv + ["7"]) == 0
    assert "+ head with its own copy of the embedding table" in capsys.readouterr().out
    assert main(argv + ["0", "--schedule", "zbv"]) == 0
    assert "copy of the tied embedding table" not in capsys.readouterr().out


def test_explain_memory_says_what_to_change_when_a_plan_does_not_fit(capsys):
    assert main(["explain", "memory", "llama3-70b-1024", "--pp", "4", "--dp", "32", "--zero", "0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["explained_pp_rank"] == 0 and data["ranks"][0]["fits"] is False
    assert main(["explain", "memory", "llama3-70b-1024", "--pp", "4", "--dp", "32", "--zero", "0"]) == 0
    assert "try activation recompute" in capsys.readouterr().out
    assert main(["explain", "memory", "llama3-70b-1024", "--pp-rank", "9"]) == 2
    assert "--pp-rank 9 is outside 0..7" in capsys.readouterr().err


@pytest.mark.parametrize("argv, line", [
    ([], "attention   forward 0.618, backward 0.535 of 989.5 TFLOP/s (kernels over 8,192 tokens)"),
    (["--cp", "2", "--dp", "4"],
     "attention   forward 0.603, backward 0.513 of 989.5 TFLOP/s (kernels over 4,096 tokens)"),
])
def test_explain_compute_prints_attentions_rate_at_the_kernels_length(capsys, argv, line):
    """FlashAttention-3's figures by length (dgx-h100): a context-parallel rank's kernels run over 1/cp of it."""
    assert main(["explain", "compute", "llama3-8b-fsdp8", *argv]) == 0
    assert line in capsys.readouterr().out


def test_explain_compute_prices_the_matmuls_on_the_sms_a_collectives_kernel_leaves(capsys):
    """An FSDP plan names its gather's kernel SMs; with --sms-held every matmul runs on the rest: never faster,
    the tile fill over fewer SMs; more SMs than the GPU has is one line and exit 2."""
    assert main(["explain", "compute", "llama3-8b-fsdp8", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    gather = alone["fsdp_gather"]
    assert alone["sms_held"] == 0 and gather["sms"] > 0 and gather["bytes"] > 0
    assert main(["explain", "compute", "llama3-8b-fsdp8", "--sms-held", str(gather["sms"]), "--json"]) == 0
    held = json.loads(capsys.readouterr().out)
    pairs = [(a["time_s"], h["time_s"]) for a, h in zip(alone["kernels"], held["kernels"]) if "x" in a["shape"]]
    assert pairs and all(h >= a for a, h in pairs) and any(h > a for a, h in pairs)
    assert held["pass_s"]["B"] > alone["pass_s"]["B"]
    assert main(["explain", "compute", "llama3-8b-fsdp8"]) == 0
    assert f"its NCCL kernel holds {gather['sms']} SMs while it runs (--sms-held {gather['sms']}" in \
        capsys.readouterr().out
    assert main(["explain", "compute", "llama3-8b-fsdp8", "--sms-held", "24"]) == 0
    assert "x tile fill (132 SMs, 24 of them held by a collective's kernel beside: 108)" in capsys.readouterr().out
    assert main(["explain", "compute", "llama3-8b-fsdp8", "--sms-held", "500"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("--sms-held 500: give 0 to 131, the H100 SXM5 80GB has 132 SMs")


@pytest.mark.parametrize("argv, unit", [(["simulate", "tiny-pp2"], "MB"),
                                        (["simulate", "llama3-8b-fsdp8"], "GB")])
def test_the_memory_table_reads_in_a_unit_its_largest_rank_fills(capsys, argv, unit):
    """A tiny model's memory in MB, not a column of 0.00 GB; a billion-parameter model's in GB. The GPU's
    capacity stays in GB."""
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"peak memory per GPU ({unit})" in out
    header = next(line for line in out.splitlines() if line.startswith("stage  weights"))
    assert f"total {unit}" in header and "fits 80 GB" in header
    rows = [line.split() for line in out.splitlines()[out.splitlines().index(header) + 2:] if line.startswith("pp ")]
    assert rows and all(float(row[-2]) >= 1.0 for row in rows)


def test_explain_memory_of_a_tiny_plan_prints_its_steps_in_a_unit_that_shows_them(capsys):
    """A course plan's memory is megabytes: every step reads in MB, as the table does, not 0.00 GB."""
    assert main(["explain", "memory", "course-pp", "--schedule", "interleaved-1f1b", "--zero", "3"]) == 0
    out = capsys.readouterr().out
    assert "0.00 GB" not in out and "x 32 tokens per microbatch = 0.26 MB per microbatch" in out
    assert "3 x 0.26 + 2 x 0.26 = 1.31 MB" in out and "Total 34.87 MB of 80 GB" in out
    assert "2. AdamW keeps" in out and "ZeRO-3 over one data-parallel rank: nothing to shard" in out


def test_explain_memory_names_the_fsdp_unit_its_buffers_hold(capsys):
    """FSDP's buffers hold the largest unit twice (computing and prefetched) and its gradient once: for Llama 3
    8B that is the head (its final norm makes it 4,096 parameters larger than the embedding), not a layer."""
    assert main(["explain", "memory", "llama3-8b-fsdp8"]) == 0
    head = 128256 * 4096 + 4096
    assert (f"the head: {head:,} parameters x (2 x 2 + 4) bytes = {head * 8 / 1e9:.2f} GB"
            in capsys.readouterr().out)


def test_explain_compute_of_a_tiny_plan_shows_its_figures_in_units_that_show_them(capsys):
    """tiny-tp2's GEMMs are well under a GFLOP and fill a fraction of a percent of the tiles: MFLOP, two
    significant digits of fill and four of TFLOP/s, where every figure had read 0."""
    assert main(["explain", "compute", "tiny-tp2"]) == 0
    out = capsys.readouterr().out
    q = next(line for line in out.splitlines() if line.startswith("forward") and " attn.q " in line)
    # 2 x 128 x 32 x 64 = 524,288 FLOPs; 128 x 32 of one wave's 132 tiles of 128 x 128: 0.19%
    assert "MFLOP" in out and "0.5243" in q and "0.19%" in q and "131 kB" in out


def test_simulate_of_a_pipeline_states_its_bubble_and_the_closed_form_command(capsys):
    """A student checks the simulated bubble against (p-1)/(m+p-1): simulate prints the stages' mean waiting
    share and the explain command for the same schedule, which runs."""
    assert main(["simulate", "llama3-405b-16k"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("pipeline bubble:"))
    share = float(line.split()[2].rstrip("%")) / 100
    assert share == pytest.approx(15 / 31, abs=0.03)  # 1F1B, p = m = 16; transfers and uneven stages aside
    command = line.split(": ", 2)[-1]
    assert command == "parsim explain bubble --pp 16 --microbatches 16 --schedule 1f1b"
    assert main(command.split()[1:]) == 0


def test_zero_bubble_memory_counts_the_microbatches_waiting_on_their_weight_gradient(capsys):
    """ZB-H1 on pp 8: rank 6 runs 2 forwards awaiting their I and 6 microbatches awaiting their W, each keeping
    its linears' inputs and output gradients (for a Llama layer as many bytes as B needed): the same 60 GB as
    rank 0's 8 in flight, where the count alone had said 2 (15 GB)."""
    from parsim.workload.memory import memory, saved_bytes_per_token, waiting_bytes_per_token
    from parsim.workload.plan import load_plan

    plan = load_plan({"model": "llama3-70b", "parallel": {"dp": 16, "tp": 8, "pp": 8}, "dtype": "bf16",
                      "batch": {"microbatch_size": 1, "num_microbatches": 16}, "schedule": "zero-bubble",
                      "data_parallel": {"zero": 1}})
    ranks = memory(plan)
    rank6 = ranks[6]
    assert rank6.peak_counts == (2, 6) and rank6.in_flight == 2
    assert rank6.activations == (2 * saved_bytes_per_token(plan, 6) + 6 * waiting_bytes_per_token(plan, 6)) * 8192
    assert rank6.activations == pytest.approx(ranks[0].activations, rel=1e-4)
    assert main(["explain", "memory", "--model", "llama3-70b", "--tp", "8", "--pp", "8", "--dp", "16", "--zero", "1",
                 "--num-microbatches", "16", "--schedule", "zero-bubble", "--pp-rank", "6"]) == 0
    out = capsys.readouterr().out
    assert "6 of stage 6's awaiting their weight gradient: 2 x 7.51 + 6 x 7.51 = 60.06 GB" in out
    # the table's count says which microbatches its activations hold
    assert re.search(r"pp 6 +[\d.]+ +[\d.]+ +[\d.]+ +60\.06 +2 \+ 6 W ", out)
    assert re.search(r"pp 0 +[\d.]+ +[\d.]+ +[\d.]+ +60\.06 +8 ", out) and "+ W: those whose deferred" in out


def test_explain_bubble_counts_the_microbatches_a_deferred_w_keeps(capsys):
    """ZB-H1 on 4 ranks: the microbatches awaiting their W at each rank's peak (0 to 3), which the in-flight
    count leaves out and explain memory weighs."""
    assert main(["explain", "bubble", "--pp", "4", "--microbatches", "8", "--schedule", "zero-bubble"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Peak per rank: [4, 3, 2, 1]" in out and "at most [0, 1, 2, 3] such per rank" in out
