"""Entry point of the ``parsim`` command.

Each subcommand lives in its own module exposing ``register(subparsers)``,
which adds its parser and sets ``func`` to a callable ``(args) -> int``.
User errors (:class:`parsim.errors.ParsimError`) become one line on stderr
and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ..errors import ParsimError

# Subcommand modules, in the order --help lists them.
COMMANDS = (
    "clusters", "collective", "bench", "calibrate", "compare",
    "plan", "simulate", "search", "explain", "run", "validate",
)

DESCRIPTION = """\
parsim predicts what a distributed-training plan costs before you rent GPUs,
explains the arithmetic, and checks the prediction on real hardware.

examples:
  parsim collective all-reduce --cluster dgx-h100 --gpus 8 --size 1GiB --explain
  parsim collective all-gather --cluster dgx-h100 --nodes 64 --sweep 1KiB:8GiB
  parsim bench all-reduce --nproc 4 --sweep 1MiB:64MiB
  parsim calibrate --out my-host.yaml
  parsim compare all-reduce --cluster my-host.yaml --nproc 2 --sweep 1MiB:64MiB
  parsim simulate llama3-70b-1024 --cluster dgx-h100 --gantt step.png
  parsim search --model llama3-70b --gpus 1024 --global-batch 4M-tokens --explain
  parsim explain bubble --pp 4 --microbatches 8 --schedule 1f1b
  parsim explain memory llama3-405b-16k
  parsim run course-pp --nproc 2
  parsim compare course-pp --cluster my-host.yaml --nproc 2 --trace both.json
  parsim validate megatron-sc21-table1
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="parsim", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"parsim {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"{__package__}.{name}_cmd").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except ParsimError as err:
        print(f"parsim {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"parsim {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`parsim ... | head`): stop quietly, and keep Python from
        # complaining again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
