"""Every --json output wears the one envelope and conforms to its published schema (parsim/schemas/)."""

from __future__ import annotations

import argparse
import importlib.resources
import json
from pathlib import Path

import pytest
from json_schema import errors

from parsim.cli.main import build_parser, main
from parsim.report.jsondoc import published_schema

SCHEMA_DIR = Path(str(importlib.resources.files("parsim").joinpath("schemas")))
SCHEMAS = sorted(p.stem for p in SCHEMA_DIR.glob("*.json"))


def conforms(doc: dict) -> str:
    """The schema name ``doc`` claims, after checking it against that schema (and jsonschema, when installed)."""
    name = doc["schema"].removeprefix("parsim.").removesuffix("/1")
    schema = published_schema(name)
    assert errors(doc, schema) == []
    try:
        import jsonschema
    except ImportError:
        return name
    jsonschema.Draft202012Validator(schema).validate(doc)
    return name


def json_of(capsys, *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_published_schema_is_a_json_schema_named_after_its_file(name):
    schema = published_schema(name)
    assert schema["$id"] == f"parsim.{name}/1" and schema["properties"]["schema"] == {"const": schema["$id"]}
    assert schema["required"][:2] == ["schema", "parsim_version"]
    assert errors({}, schema)  # the checker understands every keyword the file uses
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("argv, name", [
    (["clusters"], "clusters"),
    (["clusters", "dgx-h100"], "clusters"),
    (["collective", "--gpus", "8", "--size", "1MiB"], "collective"),
    (["collective", "--gpus", "8", "--sweep", "1KiB:1MiB:32"], "collective"),
    (["plan", "list"], "plan.list"),
    (["plan", "show", "course-pp", "--cluster", "dgx-h100"], "plan.show"),
    (["simulate", "course-pp", "--cluster", "dgx-h100"], "simulate"),
    (["explain", "bubble", "--pp", "4", "-m", "8", "--schedule", "zero-bubble"], "explain.bubble"),
    (["explain", "memory", "course-pp"], "explain.memory"),
    (["explain", "compute", "course-pp"], "explain.compute"),
    (["explain", "compute", "tiny-tp2", "--sequence-parallel", "--tp-comm-overlap"], "explain.compute"),
    (["search", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "256K-tokens", "--top", "3",
      "--simulate", "1"], "search"),
])
def test_each_command_prints_its_schema(argv, name, capsys):
    assert conforms(json_of(capsys, *argv)) == name


def test_validate_prints_its_schema(tmp_path, capsys):
    """On two rows of the built-in SC21 table, one of each kind of data parallelism (test_validate runs the
    whole table)."""
    import yaml

    table = yaml.safe_load((Path(__file__).parents[1] / "parsim/validation/training_runs/megatron-sc21-table1.yaml")
                           .read_text())
    table["rows"] = [next(row for row in table["rows"] if row["ddp"] == ddp) for ddp in ("torch", "local")]
    path = tmp_path / "table.yaml"
    path.write_text(yaml.safe_dump(table))
    doc = json_of(capsys, "validate", str(path))
    assert conforms(doc) == "validate" and len(doc["rows"]) == 2


def test_bench_json_and_its_saved_file_are_one_schema(monkeypatch, tmp_path, capsys):
    from test_bench import fake_results

    import executor.collectives

    monkeypatch.setattr(executor.collectives, "measure_collectives", lambda *a, **k: fake_results())
    out = tmp_path / "bench.json"
    assert conforms(json_of(capsys, "bench", "all-gather", "--out", str(out))) == "bench"
    assert conforms(json.loads(out.read_text())) == "bench"
    compared = json_of(capsys, "compare", "all-gather", "--cluster", "dgx-h100", "--measured", str(out))
    assert conforms(compared) == "compare.collective"


def test_compare_plan_prints_its_schema(monkeypatch, capsys):
    import executor.train
    from parsim.hardware.cluster import load_cluster
    from parsim.sim.step import predict_step
    from parsim.workload.plan import resolve_plan

    def run_plan(plan, nproc, steps, **kwargs):  # the simulator stands in for the executor
        return predict_step(plan, load_cluster("dgx-h100")).trace, {}

    monkeypatch.setattr(executor.train, "run_plan", run_plan)
    plan = resolve_plan("course-pp")
    doc = json_of(capsys, "compare", "course-pp", "--cluster", "dgx-h100", "--nproc", str(plan.world))
    assert conforms(doc) == "compare.plan" and doc["step_error"] == pytest.approx(0.0)
    # The executor names its collectives as the lowering does (no recognized "op"): each matches one to one.
    doc = json_of(capsys, "compare", "course-tp", "--tp", "2", "--cluster", "dgx-h100", "--nproc", "2")
    assert conforms(doc) == "compare.plan" and doc["collectives"]
    assert {row["status"] for row in doc["collectives"]} == {"matched one to one"}


@pytest.mark.parametrize("argv", [
    ["simulate", "--cluster", "no-such-cluster"],  # an error parsim raises
    ["bench", "--nproc", "many"],  # an error argparse raises
])
def test_errors_under_json_are_documents_too(argv, capsys):
    assert main([*argv, "--json"]) == 2
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert conforms(doc) == "error" and doc["command"] == argv[0]
    assert captured.err == f"parsim {argv[0]}: error: {doc['error']}\n"


def leaf_parsers(parser: argparse.ArgumentParser, prog: str = "parsim"):
    """Every (sub)command that runs something: parsers without subcommands of their own."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield prog, parser
    for action in subs:
        for name, sub in action.choices.items():
            yield from leaf_parsers(sub, f"{prog} {name}")


def test_every_command_has_json():
    lacking = [prog for prog, parser in leaf_parsers(build_parser())
               if "--json" not in parser._option_string_actions]
    assert lacking == []
