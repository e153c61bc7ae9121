"""The one typed config builder of the project, and its one command-line override syntax.

Every config (the run config's sections, the task encoder's knobs, each family's model config with
its sections) is a keyword-only dataclass built from a nested mapping (YAML, a saved config, or
dotted ``key=value`` overrides applied to one) by ``build``, with one policy:

- a field typed as a dataclass is a section, built the same way (recursively);
- a string given for a field that does not take strings is read as a command-line value
  (``parse_value``: ``"1024"`` -> 1024, ``"true"`` -> True, ``"null"`` -> None, ``"1e-3"`` ->
  0.001), then checked like any other value;
- a value typed on the command line (``key=value``: ``CommandLineText``) is the text as typed for
  a string field (``out=0010`` is ``"0010"``, ``out=no`` is ``"no"``, ``out='exp #2'`` is
  ``"exp #2"``; a quoted YAML scalar ``'x'`` is ``x``; ``null`` / ``~`` is None where the field
  allows None), and read as above for any other field;
- a value must have the field's type: ``bool`` only where the field is ``bool``, an ``int``
  where a ``float`` is expected is read as that float, ``None`` only where the field allows it,
  lists element by element;
- every problem of the whole config is collected and raised together as one
  ``contract.errors.ConfigError`` (``problems``: one line each, named by the dotted key): an
  unknown key names the valid keys of its section and, where one is close, says "did you mean";
  the dataclass's own checks (``__post_init__`` raising ``ConfigError`` / ``ValueError``) are
  reported under the section's name; a value shown in a problem is cut to ``SHOWN_CHARS``
  (``shown``).

``apply_override(raw, "a.b.c=value")`` sets a dotted key in a nested mapping to the
``CommandLineText`` of ``value``; ``check_value`` is the policy for one value outside a section.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any

import yaml

from contract.bounded_yaml import safe_load
from contract.errors import ConfigError

__all__ = ["CommandLineText", "apply_override", "build", "build_into", "check_value",
           "parse_value", "raise_problems", "shown", "unknown_key"]

#: the YAML spellings of null: a command-line value for a field that allows None
NULLS = ("null", "Null", "NULL", "~")
#: characters of a value a problem line shows (a longer one is cut, its length said)
SHOWN_CHARS = 120


class CommandLineText(str):
    """A value as typed on the command line (``key=value``): the text itself for a string
    field, a YAML value (``parse_value``) for any other (the module docstring)."""


def shown(value: Any) -> str:
    """``repr(value)`` for a problem line, cut to ``SHOWN_CHARS`` (an expanded YAML value can be
    huge: a message never prints it whole)."""
    text = repr(str(value) if isinstance(value, CommandLineText) else value)
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


def parse_value(text: str) -> Any:
    """A command-line value: a decimal number (``0012`` is 12, not YAML 1.1's octal 10;
    ``1e-3`` is 0.001), else a YAML scalar / list; text that is not YAML (e.g. a layer pattern
    ``*E-E``, a YAML alias) is taken as a string."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    try:
        return safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return str(text)


def _unquoted(text: str) -> str:
    """The command line's text for a string field: as typed, or the string a quoted YAML scalar
    (``'*E-E'``, ``"exp #2"``: quotes a shell left in place) spells."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = None
        if isinstance(value, str):
            return value
    return str(text)


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
    node[leaf] = CommandLineText(text)


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
            values[key] = check_value(name, value, hints[key], problems)
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


def check_value(name: str, value: Any, hint: Any, problems: list[str]) -> Any:
    """``value`` as the type ``hint`` (the module docstring's policy), or None with its problem
    (named ``name``) added to ``problems``."""
    try:
        return _coerce(value, hint)
    except TypeError:
        pass
    yaml_bool = isinstance(value, bool) and str in _options(hint)
    hint_text = " (YAML reads yes / no / on / off as booleans: quote the text)" if yaml_bool \
        else ""
    problems.append(f"{name}: expected {_describe(hint)}, got {shown(value)}{hint_text}")
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
    if isinstance(value, CommandLineText):
        if str in options and not (value in NULLS and type(None) in options):
            return _unquoted(value)
        value = parse_value(value)
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
