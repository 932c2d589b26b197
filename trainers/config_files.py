"""``--config FILE``: a YAML or JSON config file read as the ``key=value`` overrides ``trainers.config.override`` takes."""

from __future__ import annotations

import json
from typing import Any

import yaml


def config_file_overrides(path: str) -> list[str]:
    """The ``key=value`` assignments of a YAML or JSON config file (nested sections or dotted keys;
    what ``--print-config`` writes), in the form :func:`override` takes."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"--config {path!r}: cannot read it ({e.strerror or e})") from None
    try:
        if path.endswith(".json"):
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)  # YAML is a superset of JSON
    except Exception as e:  # json.JSONDecodeError, yaml.YAMLError: where, then what
        mark = getattr(e, "problem_mark", None)
        where = (f"line {e.lineno}, column {e.colno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else
                 f"line {mark.line + 1}, column {mark.column + 1}: {getattr(e, 'problem', None) or e}" if mark else
                 str(e).splitlines()[0])
        raise ValueError(f"--config {path!r} is not valid {'JSON' if path.endswith('.json') else 'YAML'} at "
                         f"{where}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path!r} must hold a mapping of config keys, got {type(data).__name__}")
    out: list[str] = []

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                out.append(f"{prefix}{key}={_as_text(value)}")

    walk(data, "")
    return out


def _as_text(value: Any) -> str:
    """A file's value as the text ``--set`` would give (what :func:`_parse` reads back)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return json.dumps(list(value))
    return str(value)
