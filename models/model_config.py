"""What every family's model config module shares: reading a value of an HF config (a dict or a
transformers config object), building the typed config from the YAML layout with the project's
one config builder (``contract.config.build``: unknown keys with the valid ones and a "did you
mean", wrong types, missing sections, all reported together as one ``ConfigError``), and loading a
YAML file with dotted ``key=value`` overrides, and the HF config values no megatron model can be
built of (``check_hf_shapes``: a zero layer or head count, query heads that KV heads do not
divide), named by their ``config.json`` key before anything is built, and the numbers a
processor file sets (``processor_value``: a positive number or absent; 0 is not "absent"). A
legacy ``parallel``
section (model YAMLs and saved configs written before it was removed: it was never read) is
dropped with a one-line notice: the run's layout is the run config's ``parallel`` section."""

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


def _dotted(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        if cfg is None:
            return None
        cfg = hf_value(cfg, part)
    return cfg


def check_hf_shapes(hf: Any, positive: tuple[str, ...] = (),
                    divisible: tuple[tuple[str, str], ...] = ()) -> None:
    """The HF config ``hf``'s shape values a megatron model can be built of: each dotted key of
    ``positive`` (``text_config.num_hidden_layers``) an integer >= 1, and for each pair
    (``key``, ``by``) of ``divisible`` the first value a multiple of the second (where both are
    there: an absent key takes the family's default, checked by its config).

    Raises:
        ValueError: the first value that is not, named by its ``config.json`` key (one line).
    """
    for key in positive:
        value = _dotted(hf, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{key} is {value!r}: a model is built of an integer >= 1 there "
                             "(fix config.json)")
    for key, by in divisible:
        value, divisor = _dotted(hf, key), _dotted(hf, by)
        if isinstance(value, int) and isinstance(divisor, int) and divisor > 0 and value % divisor:
            raise ValueError(f"{key} {value} is not a multiple of {by} {divisor}: no model can "
                             "be built of it (fix config.json)")


class ProcessorFile(dict):
    """A processor config's JSON object with where it came from (a file, or an entry of
    ``processor_config.json``), which ``processor_value`` names."""

    def __init__(self, values: dict, source: str):
        super().__init__(values)
        self.source = source


def processor_value(processor: dict, key: str, kind: type = int) -> int | float | None:
    """``processor[key]`` (``size.shortest_edge``: a key of a nested object) as a positive
    ``kind`` (int or float); None where the key is absent or null.

    Raises:
        ValueError: a value that is there but not a positive number (0 included: it is not
            "absent"), or a nested object that is not one; one line naming the file and the key.
    """
    value: Any = processor
    for at, part in enumerate(key.split(".")):
        if value is None:  # an absent (or null) object: the key is absent
            return None
        if not isinstance(value, dict):
            where = ".".join(key.split(".")[:at])
            raise ValueError(f"{getattr(processor, 'source', 'processor config')}: {where} is "
                             f"{value!r}, not an object: fix or remove the key")
        value = value.get(part)
    if value is None:
        return None
    number = isinstance(value, int) or (kind is float and isinstance(value, float))
    if isinstance(value, bool) or not number or not value > 0:
        raise ValueError(f"{getattr(processor, 'source', 'processor config')}: {key} is "
                         f"{value!r}, not a positive {'integer' if kind is int else 'number'}: "
                         "fix or remove the key")
    return kind(value)


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
