"""Training recipes per model family and size: the values a real fine-tune of that model starts
from (configs/recipes/<name>.yaml), and the warning for a real model trained with CPU-demo values.

A recipe file holds:

- ``match``: the model shape it is for (``family``, the LM's ``hidden_size`` and ``num_layers``,
  and ``num_experts`` for MoE models): a run whose ``model.hf`` has that shape gets the recipe
  (``recipe: auto``, the default; a local folder, a fine-tune or a re-upload of the same
  architecture matches as the hub id does); ``recipe=<name>`` picks one by name, ``recipe=none``
  keeps the config file's values;
- ``config``: run-config values (learning rates, warm-up, schedule, sequence length, visual-token
  budget and pixel limits, micro / global batch, loader workers, checkpoint interval, recompute),
  each with its source in a comment;
- ``layouts``: GPU count -> the ``parallel`` (and micro-batch / recompute) values of a layout
  that fits 80 GB GPUs by ``python -m recipes.memory`` (tests/test_model_recipes.py checks each);
  a run of W GPUs takes the layout of the largest count that divides W (the rest is data
  parallel), and none below the smallest: one line.

Precedence: the config file < what ``model.hf``'s own files set (tokenizer, processor pixel
limits) < the recipe < ``key=value`` on the command line. ``resolve`` applies a recipe to a raw
run config (``recipes.run_config`` calls it); ``tiny_value_warnings`` names the CPU-demo values
left in a run of a real model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

RECIPES = Path(__file__).resolve().parent.parent / "configs" / "recipes"
#: what a run with ``model.hf`` should not keep from the CPU-demo configs
MAX_LR_OVER_1B = 1e-4
MIN_SEQ_LENGTH = 4096


@dataclass(frozen=True, slots=True)
class Recipe:
    """One configs/recipes/<name>.yaml."""

    name: str
    path: Path
    match: dict
    config: dict  #: nested run-config values
    layouts: dict[int, dict]  #: GPUs -> nested run-config values of the layout

    def matches(self, model) -> bool:
        """``model``: a model config (the HF model's, as ours)."""
        from models.families import family_of

        return (model.family == self.match.get("family")
                and model.lm.hidden_size == self.match.get("hidden_size")
                and model.lm.num_layers == self.match.get("num_layers")
                and family_of(model).num_experts(model) == (self.match.get("num_experts") or 0))

    def mantis_config(self) -> Path:
        """The train config of the recipe's family on Mantis (its make family's,
        ``configs/train_<make family>_mantis.yaml``): what a recipe is estimated under, on its
        model YAML of the same name (``model.base=configs/<name>.yaml``)."""
        from contract.families import MAKE_FAMILIES

        make = MAKE_FAMILIES[self.match["family"]].replace("-", "_")
        return self.path.parent.parent / f"train_{make}_mantis.yaml"

    def layout_for(self, world: int) -> tuple[int, dict] | None:
        """(GPUs, values) of the layout a run of ``world`` GPUs takes: the largest count that
        divides ``world``; None when there is none."""
        fitting = [n for n in self.layouts if n <= world and world % n == 0]
        return (max(fitting), self.layouts[max(fitting)]) if fitting else None


def load(path: Path) -> Recipe:
    """A recipe file, its ``config`` over its ``base``'s (a file of shared values,
    ``_<base>.yaml`` beside it, which may name a base of its own)."""
    raw = _read(path)
    layouts = {int(gpus): values for gpus, values in (raw.get("layouts") or {}).items()}
    return Recipe(name=path.stem, path=path, match=dict(raw.get("match") or {}),
                  config=_config(path), layouts=layouts)


def _read(path: Path) -> dict:
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict) or not isinstance(raw.get("config", {}), dict):
        raise ValueError(f"recipe {path}: not a mapping with a config section")
    return raw


def _config(path: Path, depth: int = 0) -> dict:
    raw = _read(path)
    config = raw.get("config") or {}
    if raw.get("base") and depth < 4:
        config = _merged(_config(path.parent / f"_{raw['base']}.yaml", depth + 1), config)
    return config


def _merged(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


def all_recipes() -> list[Recipe]:
    """Every recipe of configs/recipes/ (the files not starting with ``_``)."""
    return [load(path) for path in sorted(RECIPES.glob("[!_]*.yaml"))]


def _flat(tree: dict, prefix: str = "") -> dict[str, object]:
    """Dotted keys of a nested mapping's leaves."""
    out = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= _flat(value, f"{dotted}.")
        else:
            out[dotted] = value
    return out


def _set(raw: dict, dotted: str, value) -> None:
    *path, leaf = dotted.split(".")
    node = raw
    for part in path:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {} if child is None else dict(child)
        node = child
    node[leaf] = value


@dataclass(frozen=True, slots=True)
class Applied:
    """A recipe applied to a run config."""

    recipe: Recipe
    values: dict[str, object]  #: dotted key -> value the recipe set
    layout_gpus: int | None  #: the GPU count whose layout was used (None: no layout)

    def line(self) -> str:
        layout = (f"; layout of {self.layout_gpus} GPU(s)" if self.layout_gpus else "")
        shown = ", ".join(f"{k}={v}" for k, v in self.values.items())
        return (f"recipe {self.recipe.name} ({self.recipe.path.relative_to(RECIPES.parent.parent)}"
                f"{layout}): {shown} (key=value on the command line wins; recipe=none keeps "
                "the config file's values)")


def resolve(raw: dict, choice: str | None, command_line: set[str], world: int | None,
            errors: list[str], *, hf: bool) -> Applied | None:
    """Apply the recipe ``choice`` (``auto``/None: the one matching ``raw``'s model, only when
    it comes from ``model.hf`` (``hf``); ``none``: no recipe; else a name) to ``raw`` in place,
    leaving the keys given on the command line; its layout for ``world`` GPUs when ``world`` is
    given. Problems go to ``errors``."""
    if choice in ("none", False):
        return None
    try:
        recipes = all_recipes()
    except (OSError, ValueError, KeyError) as error:
        errors.append(f"configs/recipes: {error}")
        return None
    if choice in (None, "auto"):
        model = _model_of(raw) if hf else None
        if model is None:
            return None
        found = [r for r in recipes if r.matches(model)]
        if not found:
            return None
        recipe = found[0]
    else:
        named = {r.name: r for r in recipes}
        if choice not in named:
            errors.append(f"recipe {choice!r} is not one of configs/recipes/: "
                          f"{', '.join(sorted(named))} (or auto, none)")
            return None
        recipe = named[choice]
    values = _flat(recipe.config)
    layout_gpus = None
    if world is not None and recipe.layouts:
        chosen = recipe.layout_for(world)
        if chosen is None and not any(k.startswith("parallel.") for k in command_line):
            errors.append(f"recipe {recipe.name} has no layout for {world} GPU(s): its smallest "
                          f"fitting one is {min(recipe.layouts)} GPUs (80 GB each); give the "
                          "layout (parallel.*=...; python -m recipes.memory CONFIG --gpus "
                          f"{world} --suggest lists those that fit) or recipe=none")
            return None
        if chosen is not None:
            layout_gpus = chosen[0]
            values |= _flat(chosen[1])
    applied = {key: value for key, value in values.items() if key not in command_line}
    for key, value in applied.items():
        _set(raw, key, value)
    return Applied(recipe, applied, layout_gpus)


def _model_of(raw: dict):
    """The model config of ``raw``'s model section, or None when it does not build (building
    the run config reports why)."""
    from contract.errors import ConfigError
    from models.families import RUN_KEYS, config_from_dict

    model = raw.get("model")
    if not isinstance(model, dict):
        return None
    try:
        return config_from_dict({k: v for k, v in model.items() if k not in RUN_KEYS})
    except (ConfigError, ValueError, TypeError):
        return None


def tiny_value_warnings(cfg) -> list[str]:
    """The CPU-demo values a run of a real model (``model.hf``) still has: a learning rate above
    1e-4 on a model over 1B parameters, no checkpoint before the end, a sequence shorter than
    4096 tokens."""
    if not cfg.hf:
        return []
    lm = cfg.model.lm
    found = []
    if 12 * lm.num_layers * lm.hidden_size ** 2 > 1e9 and cfg.train.lr > MAX_LR_OVER_1B:
        found.append(f"train.lr={cfg.train.lr:g} (above {MAX_LR_OVER_1B:g} on a model over 1B "
                     "parameters; full fine-tunes use 5e-6 to 2e-5)")
    if cfg.checkpoint.interval == 0:
        found.append("checkpoint.interval=0 (no checkpoint until the last step)")
    if cfg.task_encoder.seq_length < MIN_SEQ_LENGTH:
        found.append(f"task_encoder.seq_length={cfg.task_encoder.seq_length} (below "
                     f"{MIN_SEQ_LENGTH}: images shrink to fit)")
    return found
