"""Running parsim's CLI on one fuzzed input, in-process, with a time limit (imported by ``test_fuzz_cli``).

:func:`run_cli` calls :func:`parsim.cli.main.main` with stdout and stderr
captured and an alarm that turns a hang into :class:`Hang`. The executor is
never reached: :func:`block_executor` replaces everything that would spawn
ranks or measure this host, so an input that gets that far was accepted.
"""

from __future__ import annotations

import io
import os
import signal
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass

from parsim.cli.main import main

CASE_TIMEOUT_S = float(os.environ.get("PARSIM_FUZZ_TIMEOUT", "30"))
# Where ranks are spawned or this host is measured: the executor's own checks of a request run first.
EXECUTOR = {
    "executor.launch": ("launch", "run_in_job"),
    "executor.collectives": ("launch", "run_in_job", "measure_reduce_bandwidth"),
}


class Hang(BaseException):
    """A case ran past its time limit (a BaseException, so no ``except Exception`` in parsim swallows it)."""


class ReachedExecutor(BaseException):
    """The input passed every check and the command started measuring."""


@dataclass
class Outcome:
    argv: list[str]
    code: int | str  # "executor" when the command got as far as measuring
    out: str
    err: str

    def __str__(self) -> str:
        return f"parsim {' '.join(self.argv)}\n  exit {self.code}\n  stderr: {self.err!r}\n  stdout: {self.out[:300]!r}"


def block_executor(monkeypatch) -> None:
    """Make every executor entry point raise :class:`ReachedExecutor`."""
    import importlib

    def reached(*args, **kwargs):
        raise ReachedExecutor()

    # Every module imported before any patch: one imported while executor.launch is patched would bind the
    # patched function for good (``from .launch import launch``), and the tests after this one would get it.
    modules = {module: importlib.import_module(module) for module in EXECUTOR}
    for module, names in EXECUTOR.items():
        for name in names:
            monkeypatch.setattr(modules[module], name, reached)


def run_cli(argv: list[str], timeout_s: float = CASE_TIMEOUT_S) -> Outcome:
    """``parsim argv`` in this process; a run past ``timeout_s`` raises :class:`Hang`."""
    out, err = io.StringIO(), io.StringIO()

    def alarm(signum, frame):
        raise Hang(f"parsim {' '.join(argv)} ran past {timeout_s:g} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code: int | str = main(argv)
            except SystemExit as exit_:  # --help and --version
                code = exit_.code if isinstance(exit_.code, int) else 1
            except ReachedExecutor:
                code = "executor"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return Outcome(list(argv), code, out.getvalue(), err.getvalue())


MAX_ERROR_CHARS = 500


def assert_refused(outcome: Outcome) -> None:
    """Exit code 2 and exactly one line on stderr naming parsim; with --json, an error document on stdout."""
    lines = outcome.err.splitlines()
    assert outcome.code == 2 and len(lines) == 1 and lines[0].startswith("parsim"), str(outcome)
    assert len(lines[0]) <= MAX_ERROR_CHARS, str(outcome)  # one line a person reads, not a file echoed back
    assert "Traceback" not in outcome.err, str(outcome)
    if "--json" in outcome.argv:
        import json

        doc = json.loads(outcome.out)
        assert doc["schema"] == "parsim.error/1", str(outcome)


def assert_clean(outcome: Outcome) -> None:
    """Either done (exit 0) or refused in one line (exit 2); never a traceback."""
    if outcome.code == 0:
        assert "Traceback" not in outcome.err, str(outcome)
    else:
        assert_refused(outcome)
