"""The make targets an error message names: only those the Makefile has.

This module owns ``make_target``: ``make <verb>-<make family>-<dataset>`` (``train``, ``export``,
``eval``) when the repository's Makefile defines it, i.e. the make family is one of its
``FAMILIES`` (``contract.families.MAKE_FAMILIES``) and the dataset one of its ``DATASETS``;
otherwise None, and the message says what to run instead. Read from the Makefile itself, so a
message never names a target that does not exist (tests/test_run_inputs.py runs each with
``make -n``).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

MAKEFILE = Path(__file__).resolve().parents[1] / "Makefile"


@functools.lru_cache(maxsize=1)
def _make_lists() -> dict[str, tuple[str, ...]]:
    """The Makefile's ``FAMILIES`` and ``DATASETS`` (empty without a Makefile)."""
    try:
        text = MAKEFILE.read_text()
    except OSError:
        return {}
    return {name: tuple(re.search(rf"^{name}\s*:=\s*(.*)$", text, re.M).group(1).split())
            for name in ("FAMILIES", "DATASETS") if re.search(rf"^{name}\s*:=", text, re.M)}


def make_target(verb: str, make_family: str | None, dataset: str | None) -> str | None:
    """``make <verb>-<make_family>-<dataset>`` when the Makefile has it, else None."""
    lists = _make_lists()
    if make_family in lists.get("FAMILIES", ()) and dataset in lists.get("DATASETS", ()):
        return f"make {verb}-{make_family}-{dataset}"
    return None
