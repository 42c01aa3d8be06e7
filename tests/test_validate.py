"""``parsim validate``: published results against predictions, with no per-row knobs."""

import json

import pytest
import yaml

from parsim.cli.main import main
from parsim.cli.validate_cmd import _figure
from parsim.validation.training import _plan_mapping, load_table, validate

SMALL_TABLE = """\
source: "a test table"
cluster: dgx-a100
seq: 2048
vocab: 51200
recompute: full
metric: tflops_per_gpu
model: {kind: transformer, ffn_type: gelu, position_embedding: learned, tied_embeddings: true}
plan: {dtype: fp16}
rows:
  - {params: 1.7B, heads: 24, hidden: 2304, layers: 24, tp: 1, pp: 1, dp: 8, gpus: 8, global_batch: 64,
     microbatch: 8, v: 1, tflops_per_gpu: 137}
  - {params: 3.6B, heads: 32, hidden: 3072, layers: 30, tp: 2, pp: 2, dp: 2, gpus: 8, global_batch: 64,
     microbatch: 4, v: 3, tflops_per_gpu: 138}
"""


def test_the_metric_is_the_papers_formula_over_the_predicted_step(tmp_path):
    path = tmp_path / "table.yaml"
    path.write_text(SMALL_TABLE)
    result = validate(str(path))
    first = result.rows[0]
    flops = 96 * 64 * 2048 * 24 * 2304**2 * (1 + 2048 / (6 * 2304) + 51200 / (16 * 24 * 2304))
    assert first.predicted == pytest.approx(flops / first.step_s / 8 / 1e12)
    assert first.error == pytest.approx(first.predicted / 137 - 1)
    assert result.rows[1].layout == "tp 2 x pp 2 x dp 2, v 3"


def test_the_report_prints_every_row_and_the_summary(tmp_path, capsys):
    path = tmp_path / "table.yaml"
    path.write_text(SMALL_TABLE)
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    result = validate(str(path))
    for row in result.rows:
        assert _figure(row.predicted) in out and f"{row.error:+.1%}" in out
    assert f"median |error| {result.median_abs_error:.1%}, max |error| {result.max_abs_error:.1%}" in out


def test_explain_works_each_rows_figure_out_from_its_simulated_step(tmp_path, capsys):
    """``--explain``: the paper's formula with the row's numbers, over the simulated step and the GPUs, lands on the
    figure the table prints."""
    path = tmp_path / "table.yaml"
    path.write_text(SMALL_TABLE)
    assert main(["validate", str(path), "--explain"]) == 0
    out = capsys.readouterr().out
    rows = validate(str(path)).rows
    assert "96 x B 64 x s 2,048 x l 24 x h^2 2,304^2 x (1 + s/6h 0.1481 + V/16lh 0.0579)" in out
    for row in rows:
        assert (f"{row.working} = {_figure(row.predicted)} TFLOP/s per GPU" in out
                and row.working.endswith(f"/ (step {row.step_s:.4g} s x 8 GPUs)"))
        assert f"published {_figure(row.published)}: parsim {row.error:+.1%}" in out


def test_figures_keep_four_significant_digits_and_group_thousands():
    assert [_figure(x) for x in (1.35149, 16.853, 168.04, 14451.2)] == ["1.351", "16.85", "168", "14,451"]


def test_a_row_runs_with_the_settings_it_names(tmp_path):
    """A table's per-row settings (the SC21 rows' --DDP-impl) apply to the rows that name them: torch DDP
    all-reduces during the backward, Megatron-LM's local DDP after it, which takes longer."""
    def step(ddp: str) -> float:
        text = SMALL_TABLE.replace("plan: {dtype: fp16}\n", "plan: {dtype: fp16}\nsettings:\n  ddp:\n"
                                   "    torch: {data_parallel: {overlap: true}}\n"
                                   "    local: {data_parallel: {overlap: false}}\n")
        path = tmp_path / f"{ddp}.yaml"
        path.write_text(text.replace("{params: 1.7B,", f"{{ddp: {ddp}, params: 1.7B,"))
        return validate(str(path)).rows[0].step_s

    assert step("local") > step("torch")


def test_megatron_table_stays_within_the_measured_accuracy(capsys):
    assert main(["validate", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["rows"]) == 10 and data["cluster"] == "dgx-a100"
    # A regression guard at the level reached (docs/kernel-model.md), which meets the target (median at
    # most 10%, max at most 20%): every row is predicted faster than published, by 6-15%.
    assert data["median_abs_error"] < 0.10 and data["max_abs_error"] < 0.16
    assert all(row["error"] > 0 for row in data["rows"])


def test_a_row_may_name_its_model_and_count_tokens(tmp_path):
    """A row naming a built-in model takes its shape from it (at the table's sequence length); the
    tokens/s metric is the global batch's tokens over the step, per GPU."""
    path = tmp_path / "tokens.yaml"
    path.write_text("source: t\ncluster: dgx-h100\nseq: 2048\nmetric: tokens_per_sec_per_gpu\n"
                    "plan: {dtype: bf16}\nrows:\n  - {params: tiny, model: tiny-gpt, tp: 1, pp: 1, cp: 2, dp: 4,"
                    " global_batch: 32, microbatch: 2, tokens_per_sec_per_gpu: 1000}\n")
    row = validate(str(path)).rows[0]
    assert row.predicted == pytest.approx(32 * 2048 / row.step_s / 8)
    assert row.layout == "tp 1 x pp 1 x cp 2 x dp 4" and row.gpus == 8
    assert row.working.startswith("B 32 x s 2,048 = 65,536 tokens a step; / (step ")


def test_megatron_bridge_table_stays_within_the_measured_accuracy(capsys):
    assert main(["validate", "megatron-bridge-h100-fp8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # A regression guard at the level reached (docs/kernel-model.md): every row 6-13% fast.
    assert len(data["rows"]) == 3 and all(0.03 < row["error"] < 0.14 for row in data["rows"])


def test_torchtitan_table_stays_within_the_measured_accuracy(capsys):
    """FSDP2 in eager PyTorch on A100s: a regression guard at the level reached (2026-12-03, every row 8-12%
    fast; docs/kernel-model.md)."""
    assert main(["validate", "torchtitan-a100-fsdp", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["rows"]) == 5 and all(0.04 < row["error"] < 0.16 for row in data["rows"])


def test_a_row_may_give_its_own_sequence_and_the_tables_model_settings_reach_a_named_model(tmp_path):
    """A row's seq overrides the table's (for the plan and the tokens it counts); the table's model settings
    apply over a named model's own."""
    path = tmp_path / "seq.yaml"
    path.write_text("source: t\ncluster: dgx-h100\nseq: 2048\nmetric: tokens_per_sec_per_gpu\n"
                    "model: {layer_kernels: eager}\nplan: {dtype: bf16}\nrows:\n"
                    "  - {params: a, model: tiny-gpt, tp: 1, pp: 1, dp: 8, global_batch: 32, microbatch: 4,"
                    " tokens_per_sec_per_gpu: 1000}\n"
                    "  - {params: b, model: tiny-gpt, seq: 512, tp: 1, pp: 1, dp: 8, global_batch: 32, microbatch: 4,"
                    " tokens_per_sec_per_gpu: 1000}\n")
    table, _ = load_table(str(path))
    assert [_plan_mapping(table, row, "r")["model"]["seq_len"] for row in table["rows"]] == [2048, 512]
    assert _plan_mapping(table, table["rows"][0], "r")["model"]["layer_kernels"] == "eager"
    long, short = validate(str(path)).rows
    assert short.predicted == pytest.approx(32 * 512 / short.step_s / 8) and short.step_s < long.step_s
    assert short.working.startswith("B 32 x s 512 = 16,384 tokens a step")


def test_deepseek_v3_runs_as_its_report_describes_and_at_least_as_fast_as_its_whole_run_averaged(capsys):
    """The published figure averages the whole pre-training run (batch ramp-up, checkpoints, restarts): a step
    of the full batch runs at least that fast. A regression guard at the level reached: +12.2% (2026-12-02, with
    DeepEP's dispatch and the multi-token prediction module)."""
    assert main(["validate", "deepseek-v3-h800", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["layout"] == "tp 1 x pp 16 x dp 128, ep 64, v 2" and 0.0 < row["error"] < 0.2


def test_a_time_metric_counts_a_shorter_published_time_as_a_slower_run(tmp_path, capsys):
    """For iteration_s (a time) the error is published over predicted minus one, so that positive still
    means parsim predicts too fast a run; the rows' named settings show in their own column."""
    path = tmp_path / "time.yaml"
    text = (SMALL_TABLE.replace("metric: tflops_per_gpu", "metric: iteration_s")
            .replace("tflops_per_gpu: 137", "iteration_s: 9.5").replace("tflops_per_gpu: 138", "iteration_s: 0.5")
            .replace("plan: {dtype: fp16}\n", "plan: {dtype: fp16}\nsettings:\n  mode:\n"
                     "    full: {activation_recompute: full}\n    sel: {activation_recompute: selective}\n")
            .replace("{params: 1.7B,", "{mode: sel, params: 1.7B,"))
    path.write_text(text)
    first, second = validate(str(path)).rows
    assert first.predicted == first.step_s and first.error == pytest.approx(9.5 / first.step_s - 1)
    assert first.settings == {"mode": "sel"} and second.settings == {}
    assert first.working == "the simulated step itself"
    assert second.error < 0  # 0.5 s published: parsim predicts slower
    assert main(["validate", str(path)]) == 0
    assert "mode sel" in capsys.readouterr().out


def test_megatron_2022_table_stays_within_the_measured_accuracy(tmp_path):
    """The 2022 table's two smaller models, with full and with selective recompute (the whole table takes
    60 s; its errors are in docs/kernel-model.md): a regression guard at the level reached, within 10%."""
    table, _ = load_table("megatron-mlsys23-table5")
    assert len(table["rows"]) == 8
    table["rows"] = [row for row in table["rows"] if row["params"] in ("22B", "175B")]
    path = tmp_path / "two-models.yaml"
    path.write_text(yaml.safe_dump(table))
    rows = validate(str(path)).rows
    assert len(rows) == 4 and all(abs(row.error) < 0.10 for row in rows)


@pytest.mark.parametrize("text, expected", [
    (SMALL_TABLE.split("rows:")[0] + "rows: []\n", "rows"),
    (SMALL_TABLE.split("rows:")[0] + "rows:\n  - 7\n", "rows[0]"),
    (SMALL_TABLE.replace("cluster: dgx-a100\n", ""), "cluster"),
    (SMALL_TABLE.replace("seq: 2048\n", ""), "seq"),
    (SMALL_TABLE.replace("hidden: 2304", "hidden: null"), "rows[0].hidden"),
    (SMALL_TABLE.replace("tflops_per_gpu: 137", "tflops_per_gpu: fast"), "rows[0].tflops_per_gpu"),
    (SMALL_TABLE.replace("heads: 24", "heads: 25"), "rows[0] (1.7B)"),
    (SMALL_TABLE.replace("metric: tflops_per_gpu", "metric: speed"), "metric"),
    (SMALL_TABLE.replace("metric: tflops_per_gpu\n", ""), "metric: missing"),
    (SMALL_TABLE.replace("{params: 1.7B,", "{params: 1.7B, bogus: 1,"), "rows[0].bogus: unknown key"),
    (SMALL_TABLE.replace("seq: 2048\n", "seq: 2048\nclsuter: x\n"), "clsuter: unknown key"),
    (SMALL_TABLE.replace("heads: 24", "heads: 25"), "rows[0] (1.7B): the row: "),
    (SMALL_TABLE.replace("dp: 8, gpus: 8", "dp: 8, gpus: 9"), "gpus"),
    # refused by the simulator, in a worker process: still one line naming the row
    (SMALL_TABLE.replace("dp: 2, gpus: 8, global_batch: 64", "dp: 3, gpus: 12, global_batch: 48"),
     "rows[1] (3.6B): the plan needs 12 GPUs, which is not a whole number of 8-GPU nodes"),
    (SMALL_TABLE.replace("heads: 24, ", ""), "heads"),
    (SMALL_TABLE.replace("{params: 1.7B,", "{params: 1.7B, model: tiny-gpt,"), "rows[0].model"),
    (SMALL_TABLE.replace("vocab: 51200\n", ""), "vocab"),
    (SMALL_TABLE.replace("metric: tflops_per_gpu", "metric: tokens_per_sec_per_gpu")
     .replace("tflops_per_gpu: 137", "tokens_per_sec_per_gpu: 137")
     .replace("tflops_per_gpu: 138", "tokens_per_sec_per_gpu: 138")
     .replace("{params: 1.7B,", "{params: 1.7B, model: no-such-model,"), "rows[0] (1.7B)"),
    (SMALL_TABLE.replace("plan: {dtype: fp16}\n", "plan: {dtype: fp16}\nsettings: {ddp: {torch: 3}}\n"), "settings"),
    (SMALL_TABLE.replace("plan: {dtype: fp16}\n", "plan: {dtype: fp16}\nsettings: {ddp: {torch: {}}}\n")
     .replace("{params: 1.7B,", "{ddp: horovod, params: 1.7B,"), "rows[0].ddp"),
])
def test_bad_tables_are_refused_in_one_line(tmp_path, capsys, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1


def test_the_help_examples_name_built_in_tables():
    from parsim.cli.validate_cmd import HELP
    from parsim.validation.training import builtin_tables

    examples = [line.split()[2:] for line in HELP.splitlines() if line.strip().startswith("parsim validate")]
    named = [words[0] for words in examples if words and not words[0].startswith(("(", "-"))]
    assert len(named) >= 3 and all(name in builtin_tables() for name in named)


def test_an_unknown_table_names_the_built_in_ones(capsys):
    assert main(["validate", "no-such-table"]) == 2
    assert "megatron-sc21-table1" in capsys.readouterr().err


def test_the_gpu_checks_sc21_plan_is_the_tables_first_row():
    """benchmarks/gpu/sc21-1.7b.yaml, which the GPU check predicts beside a measured layer, is the plan
    `parsim validate` builds for SC21's 1.7B row."""
    from pathlib import Path

    from parsim.hardware.cluster import load_cluster
    from parsim.sim.step import predict_step
    from parsim.validation.training import _plan_mapping
    from parsim.workload.plan import parse_plan, resolve_plan

    table, _ = load_table("megatron-sc21-table1")
    row = parse_plan(_plan_mapping(table, table["rows"][0], "1.7B"), "plan")
    plan = resolve_plan(Path(__file__).parents[1] / "benchmarks/gpu/sc21-1.7b.yaml")
    a100 = load_cluster("dgx-a100")
    assert predict_step(plan, a100).step_s == pytest.approx(predict_step(row, a100).step_s, rel=1e-9)
