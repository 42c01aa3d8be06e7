"""The one JSON envelope every ``--json`` output wears.

Every document is an object whose first keys name its shape and the program
that wrote it, followed by the command's own keys::

    {"schema": "parsim.simulate/1", "parsim_version": "0.1.0", "plan": ..., ...}

``schema`` is ``parsim.<command>/<version>``; the version grows only when a
key changes meaning or disappears (new keys may join without it). Each
schema is published as a JSON Schema file in ``parsim/schemas/`` and
described in ``docs/json.md``. Errors under ``--json`` are documents too
(``parsim.error/1``), printed to stdout while the usual line goes to stderr.
"""

from __future__ import annotations

import importlib.resources
import json
import math
import sys
from typing import Any

from .. import __version__

SCHEMA_VERSION = 1


def schema_id(name: str) -> str:
    """``"simulate"`` -> ``"parsim.simulate/1"``."""
    return f"parsim.{name}/{SCHEMA_VERSION}"


def published_schema(name: str) -> dict[str, Any]:
    """The JSON Schema of ``parsim.<name>/1`` documents, as shipped in ``parsim/schemas/``."""
    return json.loads(importlib.resources.files("parsim").joinpath("schemas", f"{name}.json").read_text())


def envelope(name: str, payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` behind the schema name and version; non-finite floats become null (JSON has none)."""
    return {"schema": schema_id(name), "parsim_version": __version__, **_finite(payload)}


def print_json(name: str, payload: dict[str, Any]) -> None:
    """Print one enveloped document to stdout."""
    json.dump(envelope(name, payload), sys.stdout, indent=2, allow_nan=False)
    sys.stdout.write("\n")


def print_error(command: str, message: str) -> None:
    """An error as a ``parsim.error/1`` document, for scripts that asked for JSON."""
    print_json("error", {"command": command, "error": message})


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
