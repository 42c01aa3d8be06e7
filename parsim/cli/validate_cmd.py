"""``parsim validate``: parsim's predictions of published results, row by row."""

from __future__ import annotations

import argparse

from ..report.jsondoc import print_json
from ..report.table import render_table
from ..validation.training import UNITS, RowResult, Validation, builtin_tables, validate
from .common import OpsProgress

HELP = """\
Run parsim on published training results and print published vs predicted,
the error of every row, and the median and largest error.

It is a check, not a fit: every figure comes from the built-in clusters'
sourced defaults and the table's description of the software the publication
ran (in the table file, with sources); nothing is tuned per row or to these
results. A positive error means parsim predicts a faster run than was measured.

tables: parsim/validation/training_runs/*.yaml (a path to your own table works too)

examples:
  parsim validate                              (Megatron-LM SC21, Table 1: GPT on A100s, 2021)
  parsim validate megatron-bridge-h100-fp8     (NVIDIA's Llama 3 FP8 runs on H100s, 2025)
  parsim validate megatron-mlsys23-table5      (GPT 22B-1T iteration times on A100s, 2022)
  parsim validate deepseek-v3-h800             (DeepSeek-V3 pre-training on 2,048 H800s, 2024)
  parsim validate torchtitan-a100-fsdp         (torchtitan's FSDP2 runs of Llama 2 and 3 on 64 A100s, 2024)
  parsim validate --explain                    (each row's figure worked out from its simulated step)
  parsim validate megatron-sc21-table1 --json
"""

DEFAULT_TABLE = "megatron-sc21-table1"


def register(subparsers) -> None:
    p = subparsers.add_parser("validate", help="predict published results and print the errors",
                              description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("table", nargs="?", default=DEFAULT_TABLE, metavar="TABLE",
                   help=f"built-in table ({', '.join(sorted(builtin_tables()))}) or a table YAML file")
    p.add_argument("--explain", action="store_true",
                   help="after the table, how each row's predicted figure follows from its simulated step, in the "
                        "publication's own formula with the row's numbers")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    progress = _RowProgress()
    try:
        result = validate(args.table, progress)
    finally:
        progress.close()
    if args.json:
        print_json("validate", to_json(result))
    else:
        print(report(result))
        if args.explain:
            print(f"\n{explain(result)}")
    return 0


class _RowProgress(OpsProgress):
    """``validating: 3 of 10 rows done`` on a terminal."""

    def __call__(self, finished: int, total: int) -> None:
        self.show(f"validating: {finished} of {total} rows done")


def report(v: Validation) -> str:
    settings = any(r.settings for r in v.rows)  # a column only for tables whose rows differ in software
    rows = [[r.label, f"{r.gpus:,}", r.layout, *([_settings(r)] if settings else []), _figure(r.published),
             _figure(r.predicted), f"{r.error:+.1%}"] for r in v.rows]
    title = f"{v.name}: {v.source}, on {v.cluster} ({v.metric.replace('_', ' ')})"
    headers = ["model", "GPUs", "layout", *(["settings"] if settings else []), "published", "predicted", "error"]
    table = render_table(headers, rows, title=title)
    return (f"{table}\n\nmedian |error| {v.median_abs_error:.1%}, max |error| {v.max_abs_error:.1%} "
            f"over {len(v.rows)} rows (positive: parsim predicts faster than measured)")


def explain(v: Validation) -> str:
    """Each row's predicted figure worked out from its simulated step, and how it compares with the published."""
    lines = [f"how each predicted {v.metric.replace('_', ' ')} follows from the simulated step:"]
    for r in v.rows:
        verdict = "faster than measured" if r.error > 0 else "slower than measured" if r.error < 0 else "as measured"
        lines += [f"  {r.label} ({r.layout}):", f"    {r.working} = {_figure(r.predicted)} {UNITS[v.metric]}",
                  f"    published {_figure(r.published)}: parsim {r.error:+.1%}, {verdict}"]
    return "\n".join(lines)


def _settings(row: RowResult) -> str:
    return ", ".join(f"{key} {value}" for key, value in row.settings.items())


def _figure(value: float) -> str:
    """Four significant digits, whole numbers from 1,000 up: 168.4, 1.351 s, 14,451 tokens/s."""
    return f"{value:,.0f}" if value >= 1000 else f"{value:.4g}"


def to_json(v: Validation) -> dict:
    return {"table": v.name, "source": v.source, "cluster": v.cluster, "metric": v.metric,
            "rows": [{"model": r.label, "gpus": r.gpus, "layout": r.layout, "published": r.published,
                      "predicted": r.predicted, "error": r.error, "step_s": r.step_s, "settings": r.settings}
                     for r in v.rows],
            "median_abs_error": v.median_abs_error, "max_abs_error": v.max_abs_error}
