"""The one command-line override syntax of the project's YAML configs: dotted ``key=value``.

This module owns how a value typed on a command line is read (``parse_value``) and set into a
nested config mapping (``apply_override``); the run config (``recipes.run_config``) and the model
configs' ``load_yaml`` use it.
"""

from __future__ import annotations

from typing import Any

import yaml

from contract.errors import ConfigError


def parse_value(text: str) -> Any:
    """A command-line value: YAML scalar/list, with '1e-3'-style numbers read as numbers; text
    that is not YAML (e.g. a layer pattern ``*E-E``, a YAML alias) is taken as a string."""
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                pass
    return value


def apply_override(raw: dict, item: str) -> None:
    """Set ``a.b.c=value`` in a nested dict (creating sections).

    Raises:
        ConfigError: not ``key=value``, or a part of the key that is not a section.
    """
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value")
    key, text = item.split("=", 1)
    *path, leaf = key.strip().split(".")
    node = raw
    for part in path:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
        node = child
    node[leaf] = parse_value(text)
