"""Published training runs, and parsim's predictions of them: the data behind ``parsim validate``.

A validation table (``parsim/validation/training_runs/*.yaml``) names a cluster, the model
and plan settings every row shares (the software the publication ran), and
one row per published run: its model shape, parallel degrees, batch and the
published figure. Each row becomes a :class:`~parsim.workload.plan.Plan`, is simulated
on the cluster, and the prediction is expressed in the publication's own
metric. Nothing here is fitted: a table is a check of the defaults.
"""

from __future__ import annotations

import importlib.resources
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from ..errors import ConfigError, ParsimError
from ..files import read_yaml
from ..hardware.cluster import ClusterSpec, load_cluster
from ..sim.pool import simulate_each
from ..sim.step import predict_step
from ..workload.model import load_model
from ..workload.plan import Plan, parse_plan


@dataclass
class RowResult:
    label: str
    gpus: int
    layout: str  # "tp 8 x pp 4 x dp 32, v 3"
    published: float
    predicted: float
    step_s: float
    duration: bool = False  # the metric is a time (lower is faster), not a rate
    settings: dict[str, str] = field(default_factory=dict)  # the table's per-row settings this row names
    working: str = ""  # how the metric follows from the simulated step, in the row's numbers (:data:`METRICS`)

    @property
    def error(self) -> float:
        """How much faster parsim predicts the run than published, as a ratio minus one: predicted over
        published for a rate, published over predicted for a time. Positive: parsim predicts too fast."""
        if self.duration:
            return self.published / self.predicted - 1
        return self.predicted / self.published - 1


@dataclass
class Validation:
    name: str
    source: str
    metric: str
    cluster: str
    rows: list[RowResult]

    @property
    def median_abs_error(self) -> float:
        return statistics.median(abs(r.error) for r in self.rows)

    @property
    def max_abs_error(self) -> float:
        return max(abs(r.error) for r in self.rows)


def builtin_tables() -> dict[str, Path]:
    folder = importlib.resources.files("parsim.validation").joinpath("training_runs")
    return {Path(p.name).stem: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".yaml")}


# What a table and each of its rows must give, besides the metric's own column. A row naming a model
# (a built-in name or a file) takes its shape from it instead of SHAPE_NUMBERS, with the table's model settings
# over its own; cp and v default to 1, a row's seq to the table's.
TABLE_NUMBERS = ("seq",)
SHAPE_NUMBERS = ("heads", "hidden", "layers")
ROW_NUMBERS = ("tp", "pp", "dp", "global_batch", "microbatch")
OPTIONAL_ROW_NUMBERS = ("cp", "v", "gpus", "seq")
# Every key a table and a row may hold (a row also its table's metrics and settings' keys); percent_of_peak is
# a published column kept beside the metric, read by people, not by parsim.
TABLE_KEYS = ("name", "source", "cluster", "metric", "seq", "vocab", "model", "recompute", "plan", "settings", "rows")
ROW_KEYS = (SHAPE_NUMBERS + ROW_NUMBERS + OPTIONAL_ROW_NUMBERS
            + ("params", "model", "ffn_hidden", "ep", "order", "percent_of_peak"))


def load_table(name_or_path: str) -> tuple[dict[str, Any], str]:
    """A validation table, checked key by key: one ConfigError line naming the file and the key."""
    tables = builtin_tables()
    path = tables.get(name_or_path) or Path(name_or_path)
    if not path.is_file():
        raise ParsimError(f"unknown validation table {name_or_path!r}: not a built-in "
                          f"({', '.join(sorted(tables))}) and no such file")
    source = str(path)
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(source, "(file)", f"is {type(data).__name__}", "a mapping of keys")
    if data.get("metric") not in METRICS:
        found = "missing" if data.get("metric") is None else f"is {data['metric']!r}"
        raise ConfigError(source, "metric", found, " or ".join(METRICS))
    unknown = sorted(set(data) - set(TABLE_KEYS))
    if unknown:
        raise ConfigError(source, unknown[0], "unknown key", f"one of {', '.join(TABLE_KEYS)}")
    if not isinstance(data.get("cluster"), str):
        found = "missing" if data.get("cluster") is None else f"is {data['cluster']!r}"
        raise ConfigError(source, "cluster", found, "a built-in cluster name or a file")
    for key in TABLE_NUMBERS:
        _whole(data, key, source, key)
    rows = data.get("rows")
    if not isinstance(rows, list) or not rows:
        raise ConfigError(source, "rows", "missing or empty", "a list of published runs")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError(source, f"rows[{i}]", f"is {row!r}", "a mapping of one run's keys")
        known = ROW_KEYS + tuple(METRICS) + tuple(data.get("settings") or ())
        unknown = sorted(set(row) - set(known))
        if unknown:
            raise ConfigError(source, f"rows[{i}].{unknown[0]}", "unknown key", f"one of {', '.join(known)}")
        if "model" in row and data["metric"] in SHAPE_METRICS:
            raise ConfigError(source, f"rows[{i}].model", f"is {row['model']!r}",
                              f"the row's own {', '.join(SHAPE_NUMBERS)}: {data['metric']} counts FLOPs from them")
        if "model" not in row:
            _whole(data, "vocab", source, "vocab")
        shape = () if "model" in row else SHAPE_NUMBERS
        for key in shape + ROW_NUMBERS + tuple(k for k in OPTIONAL_ROW_NUMBERS if k in row):
            _whole(row, key, source, f"rows[{i}].{key}")
        for key, options in _settings(data, source).items():
            if key in row and row[key] not in options:
                raise ConfigError(source, f"rows[{i}].{key}", f"is {row[key]!r}", " or ".join(map(str, options)))
        published = row.get(data["metric"])
        if isinstance(published, bool) or not isinstance(published, (int, float)) or not 0 < published < math.inf:
            raise ConfigError(source, f"rows[{i}].{data['metric']}", f"is {published!r}", "a positive finite number")
    return data, source


def _settings(data: Mapping[str, Any], source: str) -> dict[str, dict[Any, dict]]:
    """The table's per-row settings: ``{key: {value: plan settings}}``. A row naming ``key: value`` runs
    with those plan settings over the table's shared ones (e.g. the software one row ran differently)."""
    settings = data.get("settings", {})
    if not isinstance(settings, dict) or not all(
            isinstance(options, dict) and all(isinstance(plan, dict) for plan in options.values())
            for options in settings.values()):
        raise ConfigError(source, "settings", f"is {settings!r}",
                          "a mapping of row keys to {value: plan settings}")
    return settings


def _whole(mapping: Mapping[str, Any], key: str, source: str, where: str) -> None:
    value = mapping.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(source, where, "missing" if value is None else f"is {value!r}", "a positive whole number")


def validate(name_or_path: str, progress: Callable[[int, int], None] | None = None) -> Validation:
    """Predict every row of a validation table on its cluster (the rows side by side, a process per core);
    ``progress(rows done, rows)`` as they finish."""
    table, source = load_table(name_or_path)
    cluster = load_cluster(table["cluster"])
    metric = METRICS[table["metric"]]
    rows = table["rows"]
    labels = [str(row.get("params", f"row {i}")) for i, row in enumerate(rows)]
    plans = []
    for i, (row, label) in enumerate(zip(rows, labels)):
        try:
            plan = parse_plan(_plan_mapping(table, row, label), "the row")  # the except below names file and row
        except ParsimError as err:
            raise ParsimError(f"{source}: rows[{i}] ({label}): {err}") from None
        if plan.world != row.get("gpus", plan.world):
            raise ConfigError(source, f"rows[{i}].gpus", f"is {row['gpus']}", f"dp x pp x cp x tp = {plan.world}")
        plans.append(plan)
    if progress:
        progress(0, len(rows))
    steps = simulate_each(_step_or_error, plans, cluster, progress)
    results = []
    for i, (row, label, plan, step_s) in enumerate(zip(rows, labels, plans, steps)):
        if isinstance(step_s, str):
            raise ParsimError(f"{source}: rows[{i}] ({label}): {step_s}")
        layout = (f"tp {plan.tp} x pp {plan.pp}" + (f" x cp {plan.cp}" if plan.cp > 1 else "") + f" x dp {plan.dp}"
                  + (f", ep {plan.ep}" if plan.ep > 1 else "")
                  + (f", v {plan.virtual_stages}" if plan.virtual_stages > 1 else ""))
        named = {key: str(row[key]) for key in table.get("settings", {}) if key in row}
        predicted, working = metric(table, row, step_s, plan.world)
        results.append(RowResult(label, plan.world, layout, float(row[table["metric"]]), predicted, step_s,
                                 table["metric"] in DURATION_METRICS, named, working))
    return Validation(table.get("name", Path(source).stem), table.get("source", ""), table["metric"],
                      cluster.name, results)


def _step_or_error(plan: Plan, cluster: ClusterSpec) -> float | str:
    """The row's predicted step, or why the simulator refuses it (sent back from a worker process as text)."""
    try:
        return predict_step(plan, cluster).step_s
    except ParsimError as err:
        return str(err)


def _plan_mapping(table: Mapping[str, Any], row: Mapping[str, Any], label: str) -> dict[str, Any]:
    """The row as a plan: its model (named, or the table's shared settings with the row's shape) at the
    table's sequence length, the table's plan settings, the settings the row names, and its layout."""
    seq = _seq(table, row)
    if "model" in row:
        model = dict(load_model(row["model"]).to_dict(), **table.get("model", {}), seq_len=seq)
    else:
        h = row["hidden"]
        model = dict(table.get("model", {}), name=label, num_layers=row["layers"], hidden=h, num_heads=row["heads"],
                     ffn_hidden=row.get("ffn_hidden", 4 * h), seq_len=seq, vocab_size=table["vocab"])
    v = row.get("v", 1)
    plan = {"schedule": "interleaved-1f1b" if v > 1 else "1f1b", "virtual_stages": v,
            "activation_recompute": table.get("recompute", "none"), **table.get("plan", {})}
    for key, options in table.get("settings", {}).items():
        if key in row:
            plan.update(options[row[key]])
    return dict(plan, model=model,
                parallel={"dp": row["dp"], "tp": row["tp"], "pp": row["pp"], "cp": row.get("cp", 1),
                          "ep": row.get("ep", 1), **({"order": row["order"]} if "order" in row else {})},
                batch={"microbatch_size": row["microbatch"], "global_batch_size": row["global_batch"]})


def _seq(table: Mapping[str, Any], row: Mapping[str, Any]) -> int:
    """The row's sequence length: its own, else the table's."""
    return row.get("seq", table["seq"])


def _megatron_tflops(table: Mapping[str, Any], row: Mapping[str, Any], step_s: float, gpus: int) -> tuple[float, str]:
    """Narayanan et al. 2021, eq. 3: ``96·B·s·l·h²·(1 + s/6h + V/16lh)`` FLOPs per iteration (with
    the forward recomputed), over the iteration time, per GPU, in TFLOP/s."""
    s, vocab = _seq(table, row), table["vocab"]
    b, layers, h = row["global_batch"], row["layers"], row["hidden"]
    attention, head = s / (6 * h), vocab / (16 * layers * h)
    flops = 96 * b * s * layers * h * h * (1 + attention + head)
    return flops / step_s / gpus / 1e12, (
        f"Narayanan et al. 2021, eq. 3: 96 x B {b:,} x s {s:,} x l {layers} x h^2 {h:,}^2"
        f" x (1 + s/6h {attention:.4f} + V/16lh {head:.4f}) = {flops:.4g} FLOPs a step;"
        f" / (step {step_s:.4g} s x {gpus:,} GPUs)")


def _tokens_per_gpu(table: Mapping[str, Any], row: Mapping[str, Any], step_s: float, gpus: int) -> tuple[float, str]:
    """Tokens per second per GPU: the global batch's tokens over the iteration time and the GPUs."""
    tokens = row["global_batch"] * _seq(table, row)
    return tokens / step_s / gpus, (f"B {row['global_batch']:,} x s {_seq(table, row):,} = {tokens:,} tokens a step;"
                                    f" / (step {step_s:.4g} s x {gpus:,} GPUs)")


def _iteration_s(table: Mapping[str, Any], row: Mapping[str, Any], step_s: float, gpus: int) -> tuple[float, str]:
    """The iteration (training step) time in seconds."""
    return step_s, "the simulated step itself"


# Each metric's value for a row and its simulated step, with the working that leads to it in the row's numbers
# (``parsim validate --explain``), and the value's unit.
METRICS = {"tflops_per_gpu": _megatron_tflops, "tokens_per_sec_per_gpu": _tokens_per_gpu, "iteration_s": _iteration_s}
UNITS = {"tflops_per_gpu": "TFLOP/s per GPU", "tokens_per_sec_per_gpu": "tokens/s per GPU", "iteration_s": "s"}
DURATION_METRICS = ("iteration_s",)  # lower is faster
SHAPE_METRICS = ("tflops_per_gpu",)  # metrics computed from the row's own shape (no named model)
