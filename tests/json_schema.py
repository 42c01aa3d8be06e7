"""A small JSON Schema checker for the keywords parsim's schemas use (no dependency needed in CI).

Supports ``type``, ``const``, ``enum``, ``required``, ``properties``,
``additionalProperties``, ``items``, ``minItems``, ``allOf`` and local
``$ref`` (``#/$defs/...``); any other keyword is refused, so a schema cannot
silently say more than this checks.
"""

from __future__ import annotations

from typing import Any

KNOWN = {"$schema", "$id", "$defs", "title", "description", "type", "const", "enum", "required", "properties",
         "additionalProperties", "items", "minItems", "allOf", "$ref"}
TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "null": lambda v: v is None,
}


def errors(value: Any, schema: dict, root: dict | None = None, where: str = "$") -> list[str]:
    """Every way ``value`` breaks ``schema``, as ``path: problem`` lines (empty when it conforms)."""
    root = root or schema
    unknown = set(schema) - KNOWN
    if unknown:
        return [f"{where}: schema keyword(s) {sorted(unknown)} not supported by this checker"]
    if "$ref" in schema:
        target = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        return errors(value, target, root, where)
    found: list[str] = []
    for sub in schema.get("allOf", []):
        found += errors(value, sub, root, where)
    if "type" in schema:
        allowed = [schema["type"]] if isinstance(schema["type"], str) else schema["type"]
        if not any(TYPES[t](value) for t in allowed):
            return found + [f"{where}: {value!r:.60} is not {' or '.join(allowed)}"]
    if "const" in schema and value != schema["const"]:
        found.append(f"{where}: {value!r:.60} is not {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        found.append(f"{where}: {value!r:.60} is not one of {schema['enum']}")
    if isinstance(value, dict):
        found += [f"{where}: lacks {key!r}" for key in schema.get("required", []) if key not in value]
        properties = schema.get("properties", {})
        for key, item in value.items():
            if key in properties:
                found += errors(item, properties[key], root, f"{where}.{key}")
            elif schema.get("additionalProperties") is False:
                found.append(f"{where}: unexpected key {key!r}")
            elif isinstance(schema.get("additionalProperties"), dict):
                found += errors(item, schema["additionalProperties"], root, f"{where}.{key}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            found.append(f"{where}: fewer than {schema['minItems']} items")
        if "items" in schema:
            for i, item in enumerate(value):
                found += errors(item, schema["items"], root, f"{where}[{i}]")
    return found
