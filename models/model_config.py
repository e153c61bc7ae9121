"""What every family's model config module shares: reading a value of an HF config (a dict or a
transformers config object), building the typed config from the YAML layout with the project's
one config builder (``contract.config.build``: unknown keys with the valid ones and a "did you
mean", wrong types, missing sections, all reported together as one ``ConfigError``), and loading a
YAML file with dotted ``key=value`` overrides. A legacy ``parallel`` section (model YAMLs and
saved configs written before it was removed: it was never read) is dropped with a one-line
notice: the run's layout is the run config's ``parallel`` section."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from contract.bounded_yaml import safe_load
from contract.config import apply_override, build

log = logging.getLogger("models.config")


def hf_value(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg[key]`` of an HF config dict, or ``cfg.key`` of a transformers config object."""
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def build_model_config(cls: type, raw: dict):
    """``cls`` (a family's model config dataclass) from the YAML layout.

    Raises:
        ConfigError: every unknown / missing key and wrong type, under ``model.``; the config's
            own shape checks.
    """
    if "parallel" in raw:
        log.warning("model.parallel %s is not read (the run's layout is the run config's "
                    "parallel section); ignored", raw["parallel"])
        raw = {key: value for key, value in raw.items() if key != "parallel"}
    return build(cls, raw, "model")


def load_model_yaml(path: str | Path, overrides, from_dict):
    """``from_dict`` of the YAML file ``path`` with dotted ``key=value`` overrides applied."""
    raw = safe_load(Path(path).read_text()) or {}
    for item in overrides:
        apply_override(raw, item)
    return from_dict(raw)
