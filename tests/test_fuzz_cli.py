"""Fuzzing the CLI and every file format parsim reads: bad input gets one line and exit code 2.

Each property generates inputs that are wrong by construction (NaN, infinite,
negative, zero or absurdly large figures, wrong types, missing keys, malformed
files, output paths that are directories) and asserts what the design promises:
exit code 2, exactly one line on stderr starting with ``parsim``, never a
traceback, never a hang (each case runs under an alarm), never exit 0, and
never reaching the executor (which is replaced by a tripwire, so no ranks are
ever spawned here). A few properties feed sensible-but-extreme values instead
and only ask for a clean outcome: done, or refused in one line.

CI runs a bounded number of cases (``PARSIM_FUZZ_EXAMPLES``, default 40 per
property, derandomized: about 500 cases in 10 to 40 s); a campaign runs thousands, e.g.
``PARSIM_FUZZ_EXAMPLES=300 PARSIM_FUZZ_RANDOM=1 pytest tests/test_fuzz_cli.py --hypothesis-show-statistics``.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import pytest
import yaml
from fuzz_harness import assert_clean, assert_refused, block_executor, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ideal_cluster import IDEAL

from parsim.files import read_yaml
from parsim.hardware.cluster import builtin_clusters
from parsim.validation.training import builtin_tables
from parsim.workload.model import builtin_models
from parsim.workload.plan import builtin_plans

EXAMPLES = int(os.environ.get("PARSIM_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("PARSIM_FUZZ_RANDOM"),
                database=None, suppress_health_check=list(HealthCheck))

# --------------------------------------------------------------------------- values
NAN, INF = float("nan"), float("inf")
NONSENSE_NUMBERS = [NAN, INF, -INF, -1, -0.5, -1e-9, 1e300, 10**30, -(10**30)]
WRONG_TYPES = ["fast", "", [1, 2], {"x": 1}, True, False]
INT_TEXT = ["-1", "-7", "2.5", "nan", "inf", "abc", "", "1e3", "99999999999999999999", "0x10"]
FLOAT_TEXT = ["nan", "NaN", "inf", "-inf", "-1", "abc", "", "1e999", "-1e-300"]
SIZE_TEXT = ["0", "-1", "nan", "inf", "1e300", "1e999", "abc", "", "12 parsecs", "-5MiB", "0.1", "1e15", "9e18",
             "1e30TiB", "1KiB:2KiB"]
SWEEP_TEXT = ["0:1MiB", "1MiB:1KiB", "1KiB:nan", "nan:1MiB", "1KiB:1e300", "1KiB:8GiB:1", "1KiB:8GiB:0",
              "1KiB:8GiB:-2", "1KiB:8GiB:nan", "1KiB:8GiB:inf", "1:1e12:1.0000001", "::", "1KiB", "a:b",
              "1KiB:2KiB:3:4", "", "1KiB:1e15"]
STAGE_TEXT = ["0,0", "-1,5", "1,,2", "nan", "abc", "", "99999999999,1", "1", "1,1,1,1,1,1,1,1,1,1,1,1,1,1,1",
              "2.5,1.5"]


@pytest.fixture(autouse=True)
def no_executor(monkeypatch):
    block_executor(monkeypatch)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A folder for the cases' files, with an existing directory and a plain file to misuse as paths."""
    root = tmp_path_factory.mktemp("fuzz")
    (root / "a-directory").mkdir()
    (root / "a-file").write_text("not a directory\n")
    return root


def write(path: Path, data: object) -> str:
    """``data`` as YAML (or as is, for text and bytes) at ``path``."""
    if isinstance(data, bytes):
        path.write_bytes(data)
    elif isinstance(data, str):
        path.write_text(data)
    else:
        path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
    return str(path)


def leaves(data: object, path: tuple = ()) -> list[tuple]:
    """Paths to every scalar inside nested mappings and lists."""
    if isinstance(data, dict):
        return [p for k, v in data.items() for p in leaves(v, path + (k,))]
    if isinstance(data, list):
        return [p for i, v in enumerate(data) for p in leaves(v, path + (i,))]
    return [path]


def put(data: object, path: tuple, value: object) -> object:
    """A deep copy of ``data`` with the value at ``path`` replaced (or deleted, for ``DELETE``)."""
    data = copy.deepcopy(data)
    target = data
    for part in path[:-1]:
        target = target[part]
    if value is DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return data


DELETE = object()


def alias_bomb(key: str) -> str:
    """YAML whose ``key`` is nine levels of aliases nine wide: a few lines, 9**9 values once expanded."""
    lines = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    return "\n".join(lines + [f"{key}: *l8", ""])


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def maybe_json(draw, argv: list[str]) -> list[str]:
    return argv + ["--json"] if draw(st.booleans()) else argv


# --------------------------------------------------------------------------- cluster files
CLUSTERS = {"dgx-h100": read_yaml(builtin_clusters()["dgx-h100"]),
            "pcie": read_yaml(builtin_clusters()["pcie-4x-rtx6000ada"]), "ideal": IDEAL}
# Figures that may be zero (and so also tiny): latencies, fixed costs, "unknown" counts.
ZERO_OK = {"latency_us", "spine_hop_latency_us", "kernel_overhead_us", "matmul_half_dim", "op_forward_us",
           "op_backward_us", "optimizer_tensor_us", "optimizer_step_us", "p2p_rendezvous_us", "sm_count",
           "nvlinks_per_gpu"}
ZERO_OK_SECTIONS = {"collective_overhead_us", "collective_step_overhead_us"}
REQUIRED_CLUSTER_KEYS = [("name",), ("gpus_per_node",), ("gpu",), ("gpu", "model"), ("gpu", "peak_tflops"),
                         ("gpu", "hbm_capacity_GB"), ("gpu", "hbm_bw_GBps"), ("intra_node",),
                         ("intra_node", "fabric"), ("intra_node", "bw_GBps_per_direction"),
                         ("intra_node", "latency_us"), ("scale_out",)] + \
                        [("scale_out", k) for k in ("nics_per_node", "nic_bw_Gbps", "latency_us",
                                                    "spine_hop_latency_us", "nodes_per_leaf", "oversubscription")]


def cluster_commands(path: str) -> list[list[str]]:
    return [["collective", "all-reduce", "--cluster", path, "--gpus", "16", "--size", "1MiB"],
            ["clusters", path], ["simulate", "tiny-pp2", "--cluster", path],
            ["plan", "show", "course-pp", "--cluster", path], ["explain", "compute", "tiny-pp2", "--cluster", path],
            ["explain", "memory", "tiny-pp2", "--cluster", path],
            ["compare", "all-reduce", "--cluster", path, "--nproc", "2"]]


@st.composite
def nonsense_cluster_figure(draw):
    base = CLUSTERS[draw(st.sampled_from(sorted(CLUSTERS)))]
    path = draw(st.sampled_from([p for p in leaves(base) if is_number(_get(base, p))]))
    bad = NONSENSE_NUMBERS + WRONG_TYPES
    if path[-1] not in ZERO_OK and not set(path) & ZERO_OK_SECTIONS:
        bad = bad + [0, 0.0, 1e-300]
    return put(base, path, draw(st.sampled_from(bad)))


def _get(data, path):
    for part in path:
        data = data[part]
    return data


@given(data=st.data())
@FUZZ
def test_a_cluster_file_with_a_nonsense_figure_is_refused(data, work):
    path = write(work / "cluster.yaml", data.draw(nonsense_cluster_figure()))
    assert_refused(run_cli(maybe_json(data.draw, data.draw(st.sampled_from(cluster_commands(path))))))


@st.composite
def broken_cluster_file(draw):
    base = CLUSTERS[draw(st.sampled_from(sorted(CLUSTERS)))]
    kind = draw(st.sampled_from(["delete", "section", "unknown", "text", "bytes", "scalar", "aliases"]))
    if kind == "delete":
        return put(base, draw(st.sampled_from(REQUIRED_CLUSTER_KEYS)), DELETE)
    if kind == "section":
        section = draw(st.sampled_from(["gpu", "intra_node", "scale_out", "compute", "nccl", "gpu.peak_tflops"]))
        required = section in ("gpu", "intra_node", "scale_out", "gpu.peak_tflops")  # the others may be empty
        return put(base, tuple(section.split(".")), draw(st.sampled_from(WRONG_TYPES[:4] + [7] + [None] * required)))
    if kind == "unknown":
        where = draw(st.sampled_from([(), ("gpu",), ("intra_node",), ("scale_out",)]))
        return put(base, where + (draw(st.text(max_size=12)) + "_typo",), 1)
    if kind == "text":
        return draw(st.text(max_size=200))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "aliases":
        return alias_bomb(draw(st.sampled_from(["name", "gpus_per_node", "gpu"])))
    return draw(st.sampled_from([[], [1, 2], 7, None, "dgx-h100", {}]))


@given(data=st.data())
@FUZZ
def test_a_broken_cluster_file_is_refused(data, work):
    path = write(work / "cluster.yaml", data.draw(broken_cluster_file()))
    assert_refused(run_cli(data.draw(st.sampled_from(cluster_commands(path)))))


@given(data=st.data())
@FUZZ
def test_any_finite_positive_cluster_figure_runs_cleanly(data, work):
    base = CLUSTERS[data.draw(st.sampled_from(sorted(CLUSTERS)))]
    rates = ("GBps", "Gbps", "_us", "_GB", "bw_GBps_per_direction")  # rates, sizes and times: any positive value
    paths = [p for p in leaves(base) if is_number(_get(base, p)) and isinstance(p[-1], str)
             and (p[-1].endswith(rates) or "peak_tflops" in p)]
    changed = base
    for path in data.draw(st.lists(st.sampled_from(paths), min_size=1, max_size=3)):
        changed = put(changed, path, data.draw(st.floats(min_value=1e-6, max_value=1e9)))
    path = write(work / "cluster.yaml", changed)
    argv = data.draw(st.sampled_from([["collective", "all-reduce", "--cluster", path, "--gpus", "16", "--size",
                                       "64MiB", "--json"], ["simulate", "tiny-pp2", "--cluster", path, "--json"]]))
    outcome = run_cli(argv)
    assert_clean(outcome)
    if outcome.code == 0:
        doc = json.loads(outcome.out)
        times = [r["time_s"] for r in doc["results"]] if "results" in doc else [doc["step_s"]]
        assert all(t is not None and math.isfinite(t) and t > 0 for t in times), str(outcome)


# --------------------------------------------------------------------------- models and plans
MODELS = {name: read_yaml(path) for name, path in builtin_models().items()
          if name in ("tiny-gpt", "course-mlp", "mixtral-8x22b", "deepseek-v3")}
# Shape keys a model cannot have zero of.
POSITIVE_MODEL_KEYS = {"num_layers", "width", "batch_size", "hidden", "num_heads", "ffn_hidden", "seq_len",
                       "vocab_size", "num_kv_heads", "experts_per_token", "expert_ffn_hidden"}  # num_experts 0: dense


def model_commands(path: str) -> list[list[str]]:
    return [["plan", "show", "--model", path], ["simulate", "--model", path, "--cluster", "dgx-h100"],
            ["explain", "memory", "--model", path], ["explain", "compute", "--model", path]]


@given(data=st.data())
@FUZZ
def test_a_model_file_with_a_nonsense_shape_is_refused(data, work):
    name = data.draw(st.sampled_from(sorted(MODELS)))
    base = MODELS[name]
    key = data.draw(st.sampled_from([k for k, v in base.items() if is_number(v)]))
    bad = [-1, 2.5, NAN, INF, 10**30, 2**62, "many", True, [4]] + ([0] if key in POSITIVE_MODEL_KEYS else [])
    path = write(work / "model.yaml", put(base, (key,), data.draw(st.sampled_from(bad))))
    assert_refused(run_cli(maybe_json(data.draw, data.draw(st.sampled_from(model_commands(path))))))


@given(data=st.data())
@FUZZ
def test_a_broken_model_file_is_refused(data, work):
    base = MODELS[data.draw(st.sampled_from(sorted(MODELS)))]
    kind = data.draw(st.sampled_from(["kind", "missing", "unknown", "text", "scalar"]))
    if kind == "kind":
        broken = put(base, ("kind",), data.draw(st.sampled_from(["cnn", "", 3, None, ["mlp"]])))
    elif kind == "missing":
        broken = put(base, ("num_layers",), DELETE)
    elif kind == "unknown":
        broken = put(base, ("num_layerz",), 4)
    elif kind == "text":
        broken = data.draw(st.text(max_size=100))
    else:
        broken = data.draw(st.sampled_from([[], 7, None, "tiny-gpt"]))
    path = write(work / "model.yaml", broken)
    assert_refused(run_cli(data.draw(st.sampled_from(model_commands(path)))))


PLANS = {name: read_yaml(path) for name, path in builtin_plans().items()
         if name in ("course-pp", "course-ddp", "tiny-pp2", "tiny-tp2", "mixtral-8x22b", "llama3-8b-fsdp8")}
PLAN_FIELDS = {  # where in a plan file, and values wrong there whatever the rest of the file says
    ("parallel", "dp"): [0, -1, 2.5, NAN, 10**30, "two", None, True],
    ("parallel", "tp"): [0, -2, 3.5, INF, 10**30, "x", [2]],
    ("parallel", "pp"): [0, -1, 10**9, "x", 1.5],
    ("parallel", "cp"): [0, -1, 10**12, "x"],
    ("parallel", "ep"): [0, -1, 10**12, "x"],
    ("parallel", "order"): ["dp,dp,tp", "", 7, "dp,pp,tp,cp,zz"],
    ("batch", "microbatch_size"): [0, -1, 10**30, NAN, "x"],
    ("batch", "num_microbatches"): [0, -1, 10**12, NAN, "x"],
    ("batch", "global_batch_size"): [0, -1, 10**30, 3.5, "x"],
    ("schedule",): ["2f2b", "", 1, None],
    ("virtual_stages",): [0, -1, 10**9, 1.5],
    ("layers_per_stage",): [[0, 0], [-1, 5], "even", [10**12, 1], [1.5, 2.5], 3],
    ("dtype",): ["fp4", "", 16],
    ("tensor_parallel",): ["diagonal", 1],
    ("context_parallel",): ["teleport", 1],
    ("sequence_parallel",): ["yes", 1, None],
    ("activation_recompute",): ["most", 3, {"granularity": "full", "layers": -1},
                                {"granularity": "full", "layers": 10**9}],
    ("data_parallel", "grad_sync"): ["psychic", 1],
    ("data_parallel", "bucket_size"): [0, -1, "-5MiB", NAN, INF, "nan", "1e300", "lots", 1e300],
    ("data_parallel", "overlap"): ["sometimes", 2],
    ("data_parallel", "zero"): [4, -1, "three", 1.5],
    ("data_parallel", "shard_group"): [0, -1, 10**12, "x"],
    ("moe", "expert_load"): [0, 0.5, -1, NAN, INF, "x"],
    ("moe", "capacity_factor"): [0, -1, NAN, INF, "x"],
    ("model",): ["no-such-model", 7, None, [], {}],
}


def plan_commands(path: str) -> list[list[str]]:
    return [["plan", "show", path], ["simulate", path, "--cluster", "dgx-h100"], ["explain", "memory", path],
            ["explain", "compute", path], ["run", path], ["compare", path, "--cluster", "dgx-h100"]]


@given(data=st.data())
@FUZZ
def test_a_plan_file_with_a_nonsense_setting_is_refused(data, work):
    base = PLANS[data.draw(st.sampled_from(sorted(PLANS)))]
    where = data.draw(st.sampled_from(sorted(PLAN_FIELDS, key=str)))
    plan = copy.deepcopy(base)
    for part in where[:-1]:
        if not isinstance(plan.get(part), dict):
            plan[part] = {}
    path = write(work / "plan.yaml", put(plan, where, data.draw(st.sampled_from(PLAN_FIELDS[where]))))
    assert_refused(run_cli(maybe_json(data.draw, data.draw(st.sampled_from(plan_commands(path))))))


@pytest.mark.parametrize("flag", ["plan", "--model", "--cluster"])
def test_a_long_text_file_is_refused_without_echoing_it(flag, work):
    """A file that is not YAML keys at all (here a password file's worth of text) parses as one long
    string; the refusal names its type and quotes a little of it, not all of it."""
    path = write(work / "notes.yaml", "\n".join(f"user{i}:x:{i}:{i}:someone:/home/user{i}:/bin/sh" for i in range(80)))
    argv = ["simulate", path] if flag == "plan" else ["simulate", "tiny-pp2", flag, path]
    outcome = run_cli(argv)
    assert_refused(outcome)
    assert "user79" not in outcome.err


@given(data=st.data())
@FUZZ
def test_a_broken_plan_file_is_refused(data, work):
    kind = data.draw(st.sampled_from(["text", "bytes", "scalar", "unknown", "nested", "aliases"]))
    base = PLANS[data.draw(st.sampled_from(sorted(PLANS)))]
    if kind == "text":
        broken = data.draw(st.text(max_size=200))
    elif kind == "bytes":
        broken = data.draw(st.binary(max_size=200))
    elif kind == "scalar":
        broken = data.draw(st.sampled_from([[], 7, None, "course-pp"]))
    elif kind == "unknown":
        broken = put(base, (data.draw(st.sampled_from(["paralel", "batches", "Schedule"])),), 1)
    elif kind == "aliases":
        broken = alias_bomb(data.draw(st.sampled_from(["model", "parallel", "name"])))
    else:
        broken = put(base, (data.draw(st.sampled_from(["parallel", "batch", "data_parallel", "moe"])),),
                     data.draw(st.sampled_from([7, "x", [1, 2]])))
    path = write(work / "plan.yaml", broken)
    assert_refused(run_cli(data.draw(st.sampled_from(plan_commands(path)))))


# --------------------------------------------------------------------------- flags
PLAN_INT_FLAGS = ["--dp", "--tp", "--pp", "--cp", "--ep", "--microbatch-size", "--num-microbatches",
                  "--global-batch-size", "--virtual-stages", "--shard-group"]
FLAG_CASES = [  # (command, flag, bad values)
    *[(["collective", "all-reduce", "--gpus", "8", "--size", "1MiB"], flag, values) for flag, values in [
        ("--size", SIZE_TEXT), ("--sweep", SWEEP_TEXT), ("--gpus", INT_TEXT + ["0", "12", "1000000000"])]],
    (["collective", "all-gather"], "--nodes", INT_TEXT + ["0", "100000000"]),
    (["compare", "all-reduce", "--cluster", "dgx-h100"], "--measured", ["", "no-such-file.json"]),
    *[([cmd, "tiny-pp2"] + extra, flag, INT_TEXT + ["0", "1000000000"])
      for cmd, extra in [("simulate", []), ("explain memory", []), ("explain compute", []), ("plan show", []),
                         ("run", []), ("compare", ["--cluster", "dgx-h100"])] for flag in PLAN_INT_FLAGS],
    *[(["simulate", "tiny-pp2"], flag, values) for flag, values in [
        ("--bucket-size", [t for t in SIZE_TEXT if t != "1e15"]),  # a bucket above the gradients: one bucket
        ("--layers-per-stage", STAGE_TEXT),
        ("--recompute-layers", INT_TEXT + ["1000000"]), ("--expert-load", FLOAT_TEXT + ["0", "0.5"]),
        ("--capacity-factor", FLOAT_TEXT + ["0"])]],
    (["simulate", "mixtral-8x22b"], "--expert-load", FLOAT_TEXT + ["0", "0.5", "1e300"]),
    *[(["explain", "bubble"], flag, INT_TEXT + ["0", "100000000"]) for flag in ("--pp", "-m", "--virtual-stages")],
    *[(["explain", "bubble"], flag, FLOAT_TEXT) for flag in ("--tf", "--tb", "--tw", "--tcomm")],
    (["explain", "bubble"], "--schedule", ["2f2b", "", "1F1B-ish"]),
    (["explain", "memory", "tiny-pp2"], "--pp-rank", ["-1", "2", "nan", "1000000000000"]),
    (["explain", "compute", "tiny-pp2"], "--layer", ["layer.-1", "layer.4", "", "layer.x", "head.0"]),
    *[(["bench", "all-reduce", "--size", "4KiB"], flag, INT_TEXT + ["0", "1000000000"])
      for flag in ("--nproc", "--warmup", "--iters")],
    (["bench", "all-reduce"], "--size", SIZE_TEXT + ["1TiB"]),
    (["bench", "all-reduce"], "--sweep", SWEEP_TEXT + ["1KiB:1TiB"]),
    (["bench", "all-reduce", "--size", "4KiB"], "--timeout", FLOAT_TEXT + ["0"]),
    (["bench", "all-gather", "--nproc", "4"], "--size", ["4", "8", "12"]),
    (["bench", "send-recv"], "--nproc", ["1"]),
    (["bench"], "--backend", ["mpi", ""]),
    *[(["run", "tiny-pp2"], flag, INT_TEXT + ["0", "1000000000"]) for flag in ("--nproc", "--steps")],
    (["run", "tiny-pp2"], "--nproc", ["1", "3"]),
    (["run", "tiny-pp2"], "--warmup", INT_TEXT + ["1000000000"]),
    (["run", "tiny-pp2"], "--timeout", FLOAT_TEXT + ["0"]),
    *[(["compare", "all-reduce", "--cluster", "dgx-h100"], flag, values) for flag, values in [
        ("--nproc", INT_TEXT + ["0", "1000000000"]), ("--size", SIZE_TEXT), ("--sweep", SWEEP_TEXT),
        ("--timeout", FLOAT_TEXT + ["0"])]],
    (["compare", "tiny-pp2", "--cluster", "dgx-h100", "--nproc", "2"], "--steps", INT_TEXT + ["0", "1000000000"]),
    (["calibrate", "--out", "x.yaml"], "--ranks", ["0", "1", "-2", "2,nan", "", "2,,4", "1000000", "a"]),
    (["calibrate", "--out", "x.yaml"], "--ops", ["all-shuffle", "", ",", "all-reduce,,"]),
    (["calibrate", "--out", "x.yaml"], "--sweep", SWEEP_TEXT),
    (["calibrate", "--out", "x.yaml"], "--timeout", FLOAT_TEXT + ["0"]),
    (["calibrate", "--out", "x.yaml"], "--name", ["", " "]),
    (["validate"], "table", ["no-such-table", ""]),
    (["collective"], "op", ["all-shuffle", "", "all reduce"]),
    (["simulate"], "plan", ["no-such-plan", ""]),
    (["clusters"], "cluster", ["no-such-cluster", ""]),
    (["explain"], "topic", ["", "bubbles"]),
]


def with_flag(command: list[str], flag: str, value: str) -> list[str]:
    argv = " ".join(command).split(" ")
    if not flag.startswith("-"):  # a positional: replace or add it after the subcommand
        return argv[:1] + [value] + [a for a in argv[1:] if a.startswith("-")] if len(argv) > 1 else argv + [value]
    if flag in argv:
        i = argv.index(flag)
        return argv[:i] + [f"{flag}={value}"] + argv[i + 2:]
    other = {"--nodes": "--gpus", "--gpus": "--nodes", "--size": "--sweep", "--sweep": "--size"}.get(flag)
    if other in argv:
        i = argv.index(other)
        argv = argv[:i] + argv[i + 2:]
    return argv + [f"{flag}={value}"]


@given(data=st.data())
@FUZZ
def test_a_nonsense_flag_is_refused(data):
    command, flag, values = data.draw(st.sampled_from(FLAG_CASES))
    argv = with_flag(command, flag, data.draw(st.sampled_from(values)))
    assert_refused(run_cli(maybe_json(data.draw, argv)))


# --------------------------------------------------------------------------- output paths
OUTPUT_CASES = [
    (["simulate", "tiny-pp2"], "--trace"), (["simulate", "tiny-pp2"], "--gantt"),
    (["collective", "--gpus", "8", "--sweep", "1KiB:1MiB"], "--plot"), (["explain", "bubble"], "--gantt"),
    (["bench", "--size", "4KiB"], "--out"), (["bench", "--size", "4KiB"], "--plot"),
    (["run", "tiny-pp2"], "--trace"), (["run", "tiny-pp2"], "--chrome"), (["run", "tiny-pp2"], "--profile"),
    (["compare", "all-reduce", "--cluster", "dgx-h100"], "--save-measured"),
    (["compare", "all-reduce", "--cluster", "dgx-h100"], "--plot"),
    (["compare", "tiny-pp2", "--cluster", "dgx-h100", "--nproc", "2"], "--trace"),
    (["calibrate"], "--out"),
]
FOLDER_OUTPUTS = {("simulate", "--trace"), ("run", "--chrome"), ("run", "--profile"), ("compare", "--trace")}


@given(data=st.data())
@FUZZ
def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(data, work):
    command, flag = data.draw(st.sampled_from(OUTPUT_CASES))
    # Trace flags take a folder (one file per rank) or a .json file; --profile a folder.
    folder = (command[0], flag) in FOLDER_OUTPUTS
    targets = [work / "a-file" if folder else work / "a-directory", work / "a-file" / "out.json",
               "" if folder else Path("")]  # str(Path("")) is ".", a folder that can be written
    if flag != "--profile":  # a folder that does not exist yet is made
        targets.append(work / "no-such-folder" / "out.json")
    target = data.draw(st.sampled_from(targets))
    assert_refused(run_cli(maybe_json(data.draw, command + [flag, str(target)])))


# --------------------------------------------------------------------------- measurement files
MEASURED_ROW = {"op": "all_reduce", "nranks": 2, "size_bytes": 1048576, "time_s": 0.002, "algorithm": "ring",
                "source": "measured", "backend": "gloo", "cluster": "", "extra": {}}
ROW_BAD = {"op": ["all_shuffle", 3, None], "nranks": [0, -1, 2.5, NAN, 10**9, "2", None, True],
           "size_bytes": [0, -1, 2.5, NAN, INF, 10**30, "1MiB", None],
           "time_s": [0, -1, NAN, INF, -INF, "fast", None, 1e300], "extra": ["x", [1]]}


@st.composite
def broken_measurements(draw):
    kind = draw(st.sampled_from(["row", "missing", "top", "rows", "text"]))
    doc = {"schema": "parsim.bench/1", "meta": {}, "results": [dict(MEASURED_ROW), dict(MEASURED_ROW,
                                                                                         size_bytes=2097152)]}
    if kind == "row":
        key = draw(st.sampled_from(sorted(ROW_BAD)))
        doc["results"][draw(st.integers(0, 1))][key] = draw(st.sampled_from(ROW_BAD[key]))
    elif kind == "missing":
        del doc["results"][0][draw(st.sampled_from(["op", "nranks", "size_bytes", "time_s"]))]
    elif kind == "top":
        doc = draw(st.sampled_from([[], None, 7, "results", {"results": None}, {"rows": []}, {"results": []}]))
    elif kind == "rows":
        doc["results"] = draw(st.sampled_from([[1, 2], ["x"], [None], [[]], "x", 3]))
    else:
        return draw(st.one_of(st.text(max_size=200), st.binary(max_size=100)))
    return json.dumps(doc)


@given(data=st.data())
@FUZZ
def test_a_broken_measurement_file_is_refused(data, work):
    path = write(work / "measured.json", data.draw(broken_measurements()))
    argv = ["compare", "all-reduce", "--cluster", "dgx-h100", "--measured", path]
    assert_refused(run_cli(maybe_json(data.draw, argv)))


# --------------------------------------------------------------------------- validation tables
TABLE = read_yaml(builtin_tables()["megatron-sc21-table1"])
TABLE = dict(TABLE, rows=TABLE["rows"][:1])  # one row keeps each case quick
TABLE_BAD = {("seq",): [0, -1, NAN, 10**30, "x"], ("vocab",): [0, -5, "x", 10**30], ("cluster",): [7, "nope", None],
             ("metric",): ["mfu", None], ("rows",): [[], "x", [7], None],
             **{("rows", 0, key): [0, -1, 2.5, NAN, 10**30, "x", None] for key in
                ("heads", "hidden", "layers", "tp", "pp", "dp", "global_batch", "microbatch", "v")},
             ("rows", 0, "tflops_per_gpu"): [0, -1, NAN, INF, "x", None],
             ("rows", 0, "gpus"): [0, -1, 31, 33, 10**12]}


@given(data=st.data())
@FUZZ
def test_a_broken_validation_table_is_refused(data, work):
    where = data.draw(st.sampled_from(sorted(TABLE_BAD, key=str)))
    path = write(work / "table.yaml", put(TABLE, where, data.draw(st.sampled_from(TABLE_BAD[where]))))
    assert_refused(run_cli(maybe_json(data.draw, ["validate", path])))


# --------------------------------------------------------------------------- traces
def profiler_doc() -> dict:
    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0.0, "dur": 100.0}]
    events += [{"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": 10.0}
               for ts, name in [(1.0, "F stage=0 mb=0"), (20.0, "send act stage=0 mb=0 peer=1"),
                                (40.0, "B stage=0 mb=0"), (60.0, "all_reduce dp bucket=0"), (80.0, "optimizer step")]]
    return {"traceEvents": events, "distributedInfo": {"rank": 0, "world_size": 2, "backend": "gloo"}}


EVENT_BAD = {"ts": [NAN, INF, -INF, "0", None, [1]], "dur": [NAN, -5.0, INF, "1", None], "name": [7, None, ["F"]]}
INFO_BAD = {"rank": [-1, "zero", NAN, 2, 10**12, None, 1.5], "world_size": [0, -2, "two", NAN, 10**12, 1.5]}


@st.composite
def broken_profiler_trace(draw):
    doc = profiler_doc()
    kind = draw(st.sampled_from(["event", "info", "events", "top", "text"]))
    if kind == "event":
        key = draw(st.sampled_from(sorted(EVENT_BAD)))
        doc["traceEvents"][draw(st.integers(1, 5))][key] = draw(st.sampled_from(EVENT_BAD[key]))
    elif kind == "info":
        key = draw(st.sampled_from(sorted(INFO_BAD)))
        doc["distributedInfo"][key] = draw(st.sampled_from(INFO_BAD[key]))
    elif kind == "events":
        doc["traceEvents"] = draw(st.sampled_from([[1, 2], [None], "x", None, [[]]]))
    elif kind == "top":
        doc = draw(st.sampled_from([[], 7, None, {"distributedInfo": "x", "traceEvents": []}]))
    else:
        return draw(st.one_of(st.text(max_size=200), st.binary(max_size=100)))
    return json.dumps(doc)


@given(data=st.data())
@FUZZ
def test_a_broken_profiler_trace_is_refused_in_one_line(data, work):
    folder = work / "profiles"
    folder.mkdir(exist_ok=True)
    write(folder / "rank0.json", data.draw(broken_profiler_trace()))
    argv = ["compare", "tiny-pp2", "--cluster", "dgx-h100", "--measured", str(folder)]
    assert_refused(run_cli(maybe_json(data.draw, argv)))


def test_the_unbroken_profiler_trace_reads():
    from parsim.kineto.read import measured_trace, read_profiles

    folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"parsim-fuzz-profiles-{os.getpid()}"
    folder.mkdir()
    (folder / "rank0.json").write_text(json.dumps(profiler_doc()))
    try:
        trace = measured_trace(read_profiles(folder))
    finally:
        (folder / "rank0.json").unlink()
        folder.rmdir()
    assert [e.name for e in trace.events][:2] == ["F stage=0 mb=0", "send act stage=0 mb=0 peer=1"]


PARSIM_EVENT = {"name": "F stage=0 mb=0", "rank": 0, "stream": "compute", "kind": "compute", "start_s": 0.0,
                "dur_s": 0.001, "args": {}}
PARSIM_EVENT_BAD = {"rank": [-1, 2, "0", None, 2.5], "start_s": [NAN, INF, -1.0, "0", None],
                    "dur_s": [NAN, -1.0, INF, None, "x"], "stream": ["warp", None, 3], "kind": ["dance", None],
                    "name": [None, 7], "args": ["x", [1]]}


@st.composite
def broken_parsim_trace(draw):
    doc = {"source": "measured", "world_size": 2, "meta": {}, "events": [dict(PARSIM_EVENT)]}
    kind = draw(st.sampled_from(["event", "top", "world", "text"]))
    if kind == "event":
        key = draw(st.sampled_from(sorted(PARSIM_EVENT_BAD)))
        doc["events"][0][key] = draw(st.sampled_from(PARSIM_EVENT_BAD[key]))
    elif kind == "world":
        doc["world_size"] = draw(st.sampled_from([0, -1, "two", None, 10**12, NAN]))
    elif kind == "top":
        doc = draw(st.sampled_from([[], None, 7, {"events": "x"}, {"events": [1]}, dict(doc, events=None)]))
    else:
        return draw(st.one_of(st.text(max_size=200), st.binary(max_size=100)))
    return json.dumps(doc)


@given(data=st.data())
@FUZZ
def test_a_broken_parsim_trace_is_refused_in_one_line(data, work):
    from parsim.errors import ParsimError
    from parsim.report.trace import Trace

    path = write(work / "trace.json", data.draw(broken_parsim_trace()))
    with pytest.raises(ParsimError) as refused:
        Trace.load(path)
    assert "\n" not in str(refused.value)
