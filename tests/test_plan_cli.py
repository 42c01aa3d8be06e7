"""Plans on the command line: the cluster a plan file names (``cluster:``) as the default ``--cluster``; a plan
changed by flags no longer claiming its file's description, and saying when a dp override grows its batch; the
help's examples; bad paths, flags and values in one plain line."""

from __future__ import annotations

import json

from parsim.cli.main import main
from parsim.workload.plan import resolve_plan


def test_deepseek_v3_runs_on_the_h800s_it_was_written_for_unless_told_otherwise(capsys):
    plan = resolve_plan("deepseek-v3-2048")
    assert plan.cluster == "hgx-h800" and plan.to_dict()["cluster"] == "hgx-h800"
    assert main(["explain", "memory", "deepseek-v3-2048", "--json"]) == 0
    h800 = json.loads(capsys.readouterr().out)
    assert main(["explain", "memory", "deepseek-v3-2048", "--cluster", "dgx-h200", "--json"]) == 0
    h200 = json.loads(capsys.readouterr().out)
    assert h800["capacity_bytes"] == 80e9 and h200["capacity_bytes"] == 141e9


def test_a_plan_without_a_cluster_keeps_the_default(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text("model: tiny-gpt\nparallel: {dp: 2}\n")
    assert main(["explain", "compute", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"] == "dgx-h100"
    path.write_text("model: tiny-gpt\nparallel: {dp: 2}\ncluster: dgx-a100\n")
    assert main(["explain", "compute", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"] == "dgx-a100"


def test_a_plan_changed_on_the_command_line_says_so_in_its_title(capsys):
    assert main(["plan", "show", "llama3-70b-1024", "--tp", "4", "--pp", "16"]) == 0
    title = capsys.readouterr().out.splitlines()[0]
    assert title.startswith("plan llama3-70b-1024: changed on the command line (as written: Llama 3 70B, TP 8")
    assert main(["plan", "show", "llama3-70b-1024"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("plan llama3-70b-1024: Llama 3 70B, TP 8 x PP 8")


def test_bad_plan_paths_and_flags_are_named_plainly(tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    for argv, message in ((["simulate", str(empty)], "empty.yaml: (file): is empty (expected a YAML document)"),
                          (["simulate", str(tmp_path)], "is a folder: give a plan file in it"),
                          (["simulate", "tiny-pp2", "--trace", str(tmp_path / "t.txt")],
                           "name a .json file (one merged trace) or a folder without an extension"),
                          (["simulate", "--nosuch-flag"], "unrecognized arguments: --nosuch-flag (see 'parsim "
                                                          "simulate --help')"),
                          (["search", "--model", "llama3-8b", "--gpus", "8", "--tokens", "-1T"],
                           "--tokens '-1T': give a count"),  # a value, not an unknown option
                          (["explain", "compute", "llama3-8b-fsdp8", "--layer", "layer.32"],
                           "the model has embedding, head, layer.0 to layer.31")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


def test_a_data_parallel_override_that_grows_the_batch_says_how_to_keep_it(capsys):
    assert main(["plan", "show", "llama3-70b-1024", "--pp", "4", "--dp", "32"]) == 0
    err = capsys.readouterr().err
    assert "the global batch is now 512 samples (written: 256); --num-microbatches 8 keeps it" in err
    assert main(["plan", "show", "llama3-70b-1024", "--pp", "4", "--dp", "32", "--num-microbatches", "8"]) == 0
    assert "global batch" not in capsys.readouterr().err


def test_the_simulate_help_examples_fit_in_memory(capsys):
    from parsim.cli import simulate_cmd

    examples = [line.split("(")[0].split()[2:] for line in simulate_cmd.HELP.splitlines()
                if line.startswith("  parsim simulate ") and ".yaml" not in line]  # (a .yaml is the user's own)
    assert len(examples) >= 4
    for argv in examples:
        assert main(["simulate", *argv]) == 0, argv
        assert "does not fit" not in capsys.readouterr().out, argv


def test_a_plan_without_a_dtype_trains_in_its_models_precision(tmp_path, capsys):
    """Llama 3 was trained in bf16, GPT-3 175B in fp16, DeepSeek-V3 in fp8, the course models in fp32: a plan
    built from flags (and a search) takes the model's dtype; a written or given dtype wins."""
    def shown(argv: list[str]) -> dict:
        assert main(argv) == 0
        return json.loads(capsys.readouterr().out)

    for model, dtype in (("llama3-8b", "bf16"), ("gpt3-175b", "fp16"), ("deepseek-v3", "fp8"), ("tiny-gpt", "fp32"),
                         ("course-mlp", "fp32")):
        assert shown(["plan", "show", "--model", model, "--json"])["plan"]["dtype"] == dtype
    assert shown(["plan", "show", "--model", "llama3-8b", "--dtype", "fp32", "--json"])["plan"]["dtype"] == "fp32"
    assert shown(["search", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--simulate", "0",
                  "--top", "1", "--json"])["dtype"] == "bf16"
    model = tmp_path / "m.yaml"
    model.write_text("kind: mlp\nnum_layers: 2\nwidth: 64\nbatch_size: 8\ndtype: bf16\n")
    assert shown(["plan", "show", "--model", str(model), "--json"])["plan"]["dtype"] == "bf16"
    model.write_text("kind: mlp\nnum_layers: 2\nwidth: 64\nbatch_size: 8\ndtype: bfloat16\n")
    assert main(["plan", "show", "--model", str(model)]) == 2
    assert "dtype: is 'bfloat16' (expected fp32 or bf16 or fp16 or fp8)" in capsys.readouterr().err
