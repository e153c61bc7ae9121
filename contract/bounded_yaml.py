"""Reading YAML a user hands the project: safe and bounded.

This module owns ``safe_load``, the one reader of every YAML the project takes from a user or a
download (run configs, model base YAMLs, metadatasets, the config a checkpoint stores, a command
line's YAML value, a dataset card): ``yaml.safe_load``'s types (no Python object is ever built),
and bounded. A YAML anchor (``&a``) and its aliases (``*a``) share one value, so ten lines can
stand for 10^9 values: nothing goes wrong at parsing, but whatever walks or prints the value
afterwards (the config builder, an error message) expands it. ``safe_load`` counts the values
the document stands for with every alias expanded (each shared value counted once per use) and
refuses more than ``MAX_VALUES``, more than ``MAX_CHARS`` of text, or nesting deeper than
``MAX_DEPTH``, with ``YAMLTooLarge``: a ``yaml.YAMLError``, so every reader's existing handling
of a bad YAML file names the file in one line.
"""

from __future__ import annotations

from typing import Any

import yaml

#: values a YAML document may stand for, its aliases expanded (a run config has < 1,000)
MAX_VALUES = 100_000
#: characters of YAML text read (a run config or metadataset is a few kB)
MAX_CHARS = 10_000_000
#: nesting of collections (the composer recurses; Python's stack would end first)
MAX_DEPTH = 100


class YAMLTooLarge(yaml.YAMLError):
    """The document stands for more than ``MAX_VALUES`` values (aliases expanded), is longer
    than ``MAX_CHARS`` or nested deeper than ``MAX_DEPTH``."""


def _expanded_size(root: yaml.Node) -> int:
    """Values ``root`` stands for with every alias expanded (a shared node counted each time it
    is used), counted without expanding anything; stops past ``MAX_VALUES``. Raises
    YAMLTooLarge when the nesting is deeper than ``MAX_DEPTH``."""
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 0, False)]
    while stack:
        node, depth, children_done = stack.pop()
        if id(node) in sizes:
            continue
        if depth > MAX_DEPTH:
            raise YAMLTooLarge(f"nested deeper than {MAX_DEPTH} levels: refused")
        children = _children(node)
        if children_done or not children:
            sizes[id(node)] = min(1 + sum(sizes[id(child)] for child in children),
                                  MAX_VALUES + 1)
            continue
        stack.append((node, depth, True))
        stack += [(child, depth + 1, False) for child in children if id(child) not in sizes]
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def safe_load(text: str | bytes) -> Any:
    """``yaml.safe_load(text)`` within the bounds of the module docstring.

    Raises:
        YAMLTooLarge: past a bound (the message says which, and that it is refused).
        yaml.YAMLError: not YAML.
    """
    if len(text) > MAX_CHARS:
        raise YAMLTooLarge(f"{len(text)} characters, more than the {MAX_CHARS} read: refused")
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise YAMLTooLarge(f"nested deeper than {MAX_DEPTH} levels: refused") from None
        if node is None:
            return None
        if _expanded_size(node) > MAX_VALUES:
            raise YAMLTooLarge(f"stands for more than {MAX_VALUES} values once its aliases "
                               "(*name of an &name anchor) are expanded: refused")
        return loader.construct_document(node)
    finally:
        loader.dispose()
