"""Setting one field of a locked config by its dotted name ({"train.steps": 50}, `--config.train.steps=50`): a
misspelt name is an error with the closest field suggested, and the value is type-checked as ml_collections does."""

from __future__ import annotations

import difflib

import ml_collections

from moejax.config.schema import ConfigError


def _parent(cfg: ml_collections.ConfigDict, key: str) -> tuple[ml_collections.ConfigDict, str]:
    """(the ConfigDict holding the field `key` names, the field's own name); ConfigError when there is none."""
    parent, node, path = None, cfg, []
    for name in key.split("."):
        if not isinstance(node, ml_collections.ConfigDict) or name not in node:
            known = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {'.'.join([*path, close[0]])}?" if close else ""
            raise ConfigError(f"the config has no field {key}{hint}")
        parent, node = node, node[name]
        path.append(name)
    return parent, path[-1]


def set_field(cfg: ml_collections.ConfigDict, key: str, value) -> None:
    """cfg.<key> = value for a dotted key naming an existing field, type-checked as ml_collections does."""
    parent, name = _parent(cfg, key)
    try:
        setattr(parent, name, value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}={value!r}: {e}") from None


def set_field_from_text(cfg: ml_collections.ConfigDict, key: str, text: str) -> None:
    """set_field with the value given as command-line text, read as the field's current type (bool: true/false,
    int, float, else the text itself), as `--config.a.b=v` reads it for a config file."""
    parent, name = _parent(cfg, key)
    current = parent[name]
    try:
        if isinstance(current, bool):
            value = {"true": True, "false": False}[text.strip().lower()]
        elif isinstance(current, (int, float)):
            value = type(current)(text)
        else:
            value = text
    except (KeyError, ValueError):
        raise ConfigError(f"{key}={text!r}: not a {type(current).__name__}") from None
    set_field(cfg, key, value)
