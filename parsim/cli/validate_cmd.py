"""``parsim validate``: parsim's predictions of published results, row by row."""

from __future__ import annotations

import argparse

from ..jsondoc import print_json
from ..table import render_table
from ..validation.training import Validation, builtin_tables, validate
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
  parsim validate megatron-sc21-table1 --json
"""

DEFAULT_TABLE = "megatron-sc21-table1"


def register(subparsers) -> None:
    p = subparsers.add_parser("validate", help="predict published results and print the errors",
                              description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("table", nargs="?", default=DEFAULT_TABLE, metavar="TABLE",
                   help=f"built-in table ({', '.join(sorted(builtin_tables()))}) or a table YAML file")
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
    return 0


class _RowProgress(OpsProgress):
    """``validating: row 3 / 10`` on a terminal."""

    def __call__(self, finished: int, total: int) -> None:
        self.show(f"validating: row {finished + 1 if finished < total else total} / {total}")


def report(v: Validation) -> str:
    rows = [[r.label, f"{r.gpus:,}", r.layout, f"{r.published:g}", f"{r.predicted:.1f}", f"{r.error:+.1%}"]
            for r in v.rows]
    title = f"{v.name}: {v.source}, on {v.cluster} ({v.metric.replace('_', ' ')})"
    table = render_table(["model", "GPUs", "layout", "published", "predicted", "error"], rows, title=title)
    return (f"{table}\n\nmedian |error| {v.median_abs_error:.1%}, max |error| {v.max_abs_error:.1%} "
            f"over {len(v.rows)} rows (positive: parsim predicts faster than measured)")


def to_json(v: Validation) -> dict:
    return {"table": v.name, "source": v.source, "cluster": v.cluster, "metric": v.metric,
            "rows": [{"model": r.label, "gpus": r.gpus, "layout": r.layout, "published": r.published,
                      "predicted": r.predicted, "error": r.error, "step_s": r.step_s} for r in v.rows],
            "median_abs_error": v.median_abs_error, "max_abs_error": v.max_abs_error}
