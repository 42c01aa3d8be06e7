"""User-facing errors.

A ``ParsimError`` is bad input or an impossible request: the CLI prints its
message as one line and exits with code 2. Anything else is a bug.
"""


class ParsimError(Exception):
    """Bad input or an impossible request, explained in one line."""


# A problem quoting what the file holds is cut here: a file that is not YAML at all would fill the screen.
MAX_PROBLEM_CHARS = 120


class ConfigError(ParsimError):
    """A configuration file (cluster, model, plan) is malformed."""

    def __init__(self, source: str, key: str, problem: str, expected: str = ""):
        self.source, self.key, self.problem, self.expected = source, key, problem, expected
        if len(problem) > MAX_PROBLEM_CHARS:
            problem = problem[:MAX_PROBLEM_CHARS - 3] + "..."
        message = f"{source}: {key}: {problem}"
        if expected:
            message += f" (expected {expected})"
        super().__init__(message)
