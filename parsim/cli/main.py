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
import re
import sys

from ..errors import ParsimError
from ..report.jsondoc import print_error

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


class UsageError(ParsimError):
    """A command line argparse refused; ``prog`` is the (sub)command it belongs to."""

    def __init__(self, prog: str, message: str):
        self.prog = prog
        super().__init__(message)


class Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line (usage is one ``--help`` away), not usage + error; and a
    value that starts with a minus and a digit (``--bucket-size -5MiB``) is a value, refused by its own check,
    not an unknown option."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # argparse's own test for "a negative number, not an option" (private; ``^-\d+$|^-\d*\.\d+$``),
        # widened to anything that starts like one
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str):
        raise UsageError(self.prog, f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="parsim", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"parsim {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"{__package__}.{name}_cmd").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    wants_json = "--json" in argv
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # named by the subcommand they were given to, whose --help lists what it takes
            prog = f"parsim {args.command}" if getattr(args, "command", None) else "parsim"
            raise UsageError(prog, f"unrecognized arguments: {' '.join(extra)} (see '{prog} --help')")
    except UsageError as err:
        return _fail(err.prog, str(err), wants_json)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    prog = f"parsim {args.command}"
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader gone by now must fail here, not in the interpreter's exit flush
        return code
    except ParsimError as err:
        return _fail(prog, str(err), getattr(args, "json", False))
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _reader_gone()
        return 0
    except OSError as err:
        # The file system refused a path that looked fine when checked (full disk, a race).
        where = f" {err.filename}" if err.filename else ""
        return _fail(prog, f"cannot use{where}: {err.strerror or err}", getattr(args, "json", False))


def _fail(prog: str, message: str, as_json: bool) -> int:
    """Exit code 2 with one line on stderr, and an error document on stdout for scripts that asked for JSON."""
    # A quoted key or path may hold line breaks or control characters: escape them, one line whatever it quotes.
    message = "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)
    print(f"{prog}: error: {message}", file=sys.stderr)
    if as_json:
        try:
            print_error(prog.removeprefix("parsim").strip(), message)
            sys.stdout.flush()
        except BrokenPipeError:
            _reader_gone()
    return 2


def _reader_gone() -> None:
    """The reader went away (`parsim ... | head`): stop quietly, and keep Python from complaining
    again when it flushes stdout at exit."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
