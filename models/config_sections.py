"""What every family's model config module shares: reading an HF config (dict or transformers
object) and splitting the YAML layout into its section dataclasses (unknown keys and missing
sections reported together; a legacy ``parallel`` section, which no code reads, dropped with a
one-line notice: the run's layout is the run config's ``parallel`` section)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

log = logging.getLogger("models.config")


def hf_value(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg[key]`` of an HF config dict, or ``cfg.key`` of a transformers config object."""
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def sections_from_dict(raw: dict, top_cls: type, sections: dict[str, type]):
    """Split the YAML layout into built section dataclasses and the remaining top-level keys.

    Shared by every model family's ``from_dict``. A ``parallel`` section (model YAMLs and saved
    configs written before it was removed: it was never read) is dropped with a one-line notice.

    Raises:
        ValueError: unknown keys (top level and per section) or missing sections, all listed.
    """
    if "parallel" in raw:
        log.warning("model.parallel %s is not read (the run's layout is the run config's "
                    "parallel section); ignored", raw["parallel"])
        raw = {key: value for key, value in raw.items() if key != "parallel"}
    errors: list[str] = []
    top = {f.name for f in dataclasses.fields(top_cls)}
    errors += [f"unknown key {k!r}" for k in raw if k not in top]
    parts: dict[str, Any] = {}
    for name, cls in sections.items():
        section = raw.get(name)
        if section is None:
            errors.append(f"missing section {name!r}")
            continue
        known = {f.name for f in dataclasses.fields(cls)}
        errors += [f"unknown key {name}.{k!r}" for k in section if k not in known]
        try:
            parts[name] = cls(**{k: v for k, v in section.items() if k in known})
        except TypeError as exc:
            errors.append(f"{name}: {exc}")
    if errors:
        raise ValueError("model config: " + "; ".join(errors))
    return parts, {k: v for k, v in raw.items() if k not in sections}
