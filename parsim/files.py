"""Reading the YAML and JSON files users hand to parsim, with one-line errors."""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

import yaml

from .errors import ConfigError, ParsimError


# Values a config file may hold once YAML aliases are expanded: real files hold hundreds, while a few
# lines of nested aliases ("billion laughs") expand to billions and hang whatever walks or prints them.
MAX_YAML_VALUES = 1_000_000
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key written twice in one mapping. PyYAML keeps the last silently, so a
    second ``latency_us:`` further down a cluster file would replace the first without a word; YAML itself
    requires keys to be unique. Keys are compared as written (tag and text) before ``<<:`` merges are applied, so
    a key that overrides a merged one is still allowed."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first: dict[tuple[str, str], yaml.Node] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == _MERGE_TAG:
                continue  # (a mapping or list as a key is refused by PyYAML itself: unhashable)
            seen = first.setdefault((key.tag, key.value), key)
            if seen is not key:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key.value!r} appears twice (first at line {seen.start_mark.line + 1})",
                    key.start_mark)
        return super().construct_mapping(node, deep)


def read_yaml(path: str | Path) -> object:
    """A YAML file's contents; a syntax error becomes one ConfigError line with its position."""
    path = Path(path)
    try:
        text = path.read_text()
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is None:  # no document: every file parsim reads holds one
            raise ConfigError(str(path), "(file)", "is empty", "a YAML document")
        if _expanded_size(node, {}) > MAX_YAML_VALUES:
            raise ConfigError(str(path), "(file)", f"expands to more than {MAX_YAML_VALUES:,} values through "
                                                   f"its aliases (&name / *name)", "a configuration file")
        return yaml.load(text, Loader=_UniqueKeyLoader)  # (safe: a SafeLoader, only stricter)
    except UnicodeDecodeError:
        raise ConfigError(str(path), "(file)", "is not text (not UTF-8)", "a YAML file") from None
    except RecursionError:
        raise ConfigError(str(path), "(file)", "nests deeper than Python can read", "a YAML file") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "syntax error"
        raise ConfigError(str(path), "(file)", f"malformed YAML{where}: {problem}") from None
    except OSError as err:
        raise ParsimError(f"cannot read {path}: {err.strerror}") from None


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """Values under ``node`` with every alias expanded (an alias is the same node object again)."""
    if id(node) in sizes:
        return sizes[id(node)]
    sizes[id(node)] = 1  # a node inside itself (a recursive alias) counts once
    if isinstance(node, yaml.SequenceNode):
        sizes[id(node)] = 1 + sum(_expanded_size(child, sizes) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        sizes[id(node)] = 1 + sum(_expanded_size(k, sizes) + _expanded_size(v, sizes) for k, v in node.value)
    return sizes[id(node)]


def read_json(path: str | Path) -> object:
    """A JSON file's contents, gunzipped where its name ends in ``.gz`` (torch.profiler's ``*.json.gz``); a
    missing file, a broken archive or a syntax error becomes one ParsimError line."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        return json.loads((gzip.decompress(raw) if path.suffix == ".gz" else raw).decode())
    except FileNotFoundError:
        raise ParsimError(f"{path}: no such file") from None
    except (gzip.BadGzipFile, EOFError, zlib.error):
        raise ParsimError(f"{path}: not a gzip file (or a truncated one)") from None
    except json.JSONDecodeError as err:
        raise ParsimError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    except UnicodeDecodeError:
        raise ParsimError(f"{path}: not valid JSON (not UTF-8 text)") from None
    except RecursionError:
        raise ParsimError(f"{path}: not valid JSON (nested deeper than Python can read)") from None
    except OSError as err:
        raise ParsimError(f"cannot read {path}: {err.strerror}") from None
