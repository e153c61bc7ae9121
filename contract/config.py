"""The one typed config builder of the project, and its one command-line override syntax.

Every config (the run config's sections, the task encoder's knobs, each family's model config with
its sections) is a keyword-only dataclass built from a nested mapping (YAML, a saved config, or
dotted ``key=value`` overrides applied to one) by ``build``, with one policy:

- a field typed as a dataclass is a section, built the same way (recursively);
- a string given for a field that does not take strings is read as a command-line value
  (``parse_value``: ``"1024"`` -> 1024, ``"true"`` -> True, ``"null"`` -> None, ``"1e-3"`` ->
  0.001), then checked like any other value;
- a value must have the field's type: ``bool`` only where the field is ``bool``, an ``int``
  where a ``float`` is expected is read as that float, ``None`` only where the field allows it,
  lists element by element;
- every problem of the whole config is collected and raised together as one
  ``contract.errors.ConfigError`` (``problems``: one line each, named by the dotted key): an
  unknown key names the valid keys of its section and, where one is close, says "did you mean";
  the dataclass's own checks (``__post_init__`` raising ``ConfigError`` / ``ValueError``) are
  reported under the section's name.

``apply_override(raw, "a.b.c=value")`` sets a dotted key in a nested mapping (``parse_value``).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any

import yaml

from contract.errors import ConfigError

__all__ = ["apply_override", "build", "build_into", "parse_value", "raise_problems",
           "unknown_key"]


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


def raise_problems(problems: list[str]) -> None:
    """Raise the one ``ConfigError`` of ``problems`` (one line, ``; ``-separated); none: return."""
    if problems:
        raise ConfigError("; ".join(problems), problems)


def build(cls: type, raw: Any, section: str) -> Any:
    """``cls`` built from the mapping ``raw`` (see the module docstring).

    Raises:
        ConfigError: every problem, each under its dotted key (``section.key``).
    """
    problems: list[str] = []
    built = build_into(cls, raw, section, problems)
    raise_problems(problems)
    return built


def build_into(cls: type, raw: Any, section: str, problems: list[str]) -> Any | None:
    """``build`` that adds its problems to ``problems`` and returns None instead of raising (so
    a caller building several sections reports them all together)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        problems.append(f"{section}: expected a mapping of keys, got {raw!r}")
        return None
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    before = len(problems)
    values = {}
    for key, value in raw.items():
        name = _dotted(section, key)
        if key not in fields:
            problems.append(unknown_key(name, str(key), list(fields), section))
        elif dataclasses.is_dataclass(hints[key]):
            values[key] = build_into(hints[key], value, name, problems)
        else:
            try:
                values[key] = _coerce(value, hints[key])
            except TypeError:
                problems.append(f"{name}: expected {_describe(hints[key])}, got {value!r}")
    for key, f in fields.items():
        if key in values or key in raw or not _required(f):
            continue
        kind = "section" if dataclasses.is_dataclass(hints[key]) else "key"
        problems.append(f"missing {kind} {_dotted(section, key)}")
    if len(problems) > before:
        return None
    try:
        return cls(**values)
    except ConfigError as error:  # the dataclass's own checks, each under the section's name
        problems += [_dotted(section, problem) for problem in error.problems]
    except (ValueError, TypeError) as error:
        problems.append(f"{section}: {error}" if section else str(error))
    return None


def _dotted(section: str, key: str) -> str:
    return f"{section}.{key}" if section else str(key)


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def unknown_key(name: str, key: str, valid: list[str], section: str) -> str:
    """The problem line of an unknown key ``name`` (``key`` in ``section``): the valid keys, and
    the closest one when there is one."""
    close = difflib.get_close_matches(str(key), valid, n=1)
    hint = f" (did you mean {_dotted(section, close[0])}?)" if close else ""
    return f"unknown key {name}{hint}; valid keys of {section or 'the config'}: {', '.join(valid)}"


def _options(hint: Any) -> tuple[Any, ...]:
    """The types a hint allows (``X | None`` -> (X, NoneType))."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def _describe(hint: Any) -> str:
    names = []
    for option in _options(hint):
        if option is type(None):
            names.append("null")
        elif typing.get_origin(option) in (list, tuple):
            names.append(f"a list of {_describe(typing.get_args(option)[0])}")
        else:
            names.append(getattr(option, "__name__", str(option)))
    return " or ".join(names)


def _coerce(value: Any, hint: Any) -> Any:
    """``value`` as the field's type (the module docstring's policy); TypeError when it is not."""
    options = _options(hint)
    if hint is Any:
        return value
    if isinstance(value, str) and str not in options:
        value = parse_value(value)
    if value is None:
        if type(None) in options:
            return None
        raise TypeError
    for option in options:
        origin = typing.get_origin(option)
        if origin in (list, tuple) and isinstance(value, (list, tuple)):
            (item,) = typing.get_args(option)[:1] or (Any,)
            return [_coerce(element, item) for element in value]
        if option is bool:
            if isinstance(value, bool):
                return value
        elif option is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value) if int not in options else value
        elif option is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif isinstance(option, type) and option is not type(None) and isinstance(value, option):
            return value
    raise TypeError
