"""A reader that closes the pipe (``parsim ... | head``) ends a command quietly, whatever its output's size."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("argv", [
    ["clusters", "--json"],  # a few kB: stays in Python's buffer until the flush at the end
    ["plan", "show", "llama3-405b-16k", "--json"],  # over a MB: fails on a write in the middle
    ["simulate", "--cluster", "nope", "--json"],  # an error document
])
def test_a_pipe_closed_before_any_output_ends_the_command_quietly(argv):
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    try:
        done = subprocess.run([sys.executable, "-m", "parsim", *argv], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write)
    expected = 2 if "nope" in argv else 0
    assert done.returncode == expected
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr and "Exception ignored" not in done.stderr
