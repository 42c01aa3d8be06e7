"""User-facing errors.

A ``ParsimError`` is bad input or an impossible request: the CLI prints its
message as one line and exits with code 2. Anything else is a bug.
"""

import difflib


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


# Past this many characters a list of the allowed keys gives way to the closest of them.
MAX_KEYS_LISTED_CHARS = 300


def expected_keys(key: str, allowed) -> str:
    """What an unknown ``key`` should have been: every allowed key, or, where they would not fit on one line, the
    closest (a typo) and how many there are."""
    listing = ", ".join(allowed)
    if len(listing) <= MAX_KEYS_LISTED_CHARS:
        return f"one of {listing}"
    close = difflib.get_close_matches(key, list(allowed), n=3, cutoff=0.6)
    closest = f", the closest {' or '.join(close)}" if close else ""
    return f"one of {len(allowed)} keys{closest}: {listing[:MAX_KEYS_LISTED_CHARS].rsplit(', ', 1)[0]}, ..."
