"""What ``--resume`` takes from the checkpoint and what it lets the command line change.

This module owns ``reconcile``: before the run plan is resolved, the config of a resumed run is
rebuilt with the checkpoint's own model (its ``config.yaml``: the ``model`` section, ``model.hf``
included); everything else is what the command line gives now. Then each change against the
checkpoint is honoured or refused in one line:

- the model (``model.*``, ``model.hf``, ``model.base``) given on the command line with another
  value than the checkpoint's: refused, naming both (without it the checkpoint's model is used,
  so ``<out>/config.yaml`` is never rewritten with a model the weights are not of); but a
  ``model.hf`` of another place whose model is the checkpoint's is taken (a moved base: its
  weights are checked by content, ``recipes.model_setup.check_base``) and said;
- the parallel layout (``parallel.tp`` / ``pp`` / ``cp`` / ``ep``): refused, naming
  ``train.init_checkpoint=<step folder>`` (a new run from the checkpoint's weights, which
  dist_checkpointing reshards; the optimizer state is saved ``dp_reshardable``, which megatron-core
  0.16 reshards over DP only). Then the checkpoint is checked (``read_train_state``: a planted,
  foreign or half-written one is refused before the rest; a changed DP stays its refusal);
- ``data.path``: honoured; the loader starts fresh on the new data (the saved loader state
  holds positions in the old dataset's shards) and the run says so;
- the loader's shape (``data.num_workers``, ``shuffle_buffer_size``, ``max_samples_per_sequence``,
  ``seed_offset``, ``split_part``, ``virtual_dp``, ``train.micro_batch_size``) with the same data:
  refused (Energon's saved state is per worker and batch; it cannot be redistributed), except
  under ``data.global_plan``, whose one state is the stream's position (any workers, micro-batch
  and DP size);
- the sequence length and visual-token budget (``task_encoder.*``) and ``train.steps``:
  honoured; the restored loader positions stay valid (they index samples, not tokens), the new
  budget applies to every sample from the resumed step on, and the LR schedule is laid over the
  new ``train.steps``; a learning rate (``train.lr``, ``min_lr``, a part's, LoRA+'s ratio)
  changed: honoured from the resumed step, one line.

Raises ``contract.errors.UsageError`` (one line; train.py exits 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from contract.bounded_yaml import safe_load
from contract.errors import UsageError
from models.checkpointing.folders import resolve_checkpoint
from recipes.checkpointing import read_train_state
from recipes.run_config import RunConfig, load_run_config, to_dict
from recipes.run_folder import plan_start

#: the layout a checkpoint's optimizer state is bound to (DP: ``read_train_state``)
LAYOUT_KEYS = ("parallel.tp", "parallel.pp", "parallel.cp", "parallel.ep")
#: what the saved Energon loader state is bound to, besides the data itself
LOADER_KEYS = ("data.num_workers", "data.shuffle_buffer_size", "data.max_samples_per_sequence",
               "data.seed_offset", "data.split_part", "data.virtual_dp",
               "train.micro_batch_size")
#: model fields set from the tokenizer when the plan is resolved (not the user's to give)
DERIVED = frozenset({"image_token_id", "video_token_id", "vision_start_token_id",
                     "vision_end_token_id"})


@dataclass(frozen=True, slots=True)
class Resumed:
    """The config of a resumed run and what changed against its checkpoint."""

    config: RunConfig
    fresh_loader: bool = False  #: the loader starts fresh (``data.path`` changed)
    notes: tuple[str, ...] = ()  #: one line each, printed by rank 0


def _at(tree: dict, key: str):
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def stored_config(step_dir: Path) -> dict | None:
    """The run config a step folder stores (plain YAML data), or None without one."""
    path = step_dir / "config.yaml"
    if not path.is_file():
        return None
    try:
        raw = safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise UsageError(f"checkpoint {step_dir}: config.yaml is unreadable "
                         f"({type(error).__name__})") from None
    return raw if isinstance(raw, dict) else None


def reconcile(cfg: RunConfig, config: str, overrides: tuple[str, ...], resume_from: str | None,
              overwrite: bool, world: int) -> Resumed:
    """The config ``cfg`` (``config`` + ``overrides`` as loaded) of a run that resumes, rebuilt
    on its checkpoint's model, with each change against the checkpoint honoured or refused (see
    the module docstring); a run that does not resume: ``cfg`` unchanged.

    Raises:
        UsageError / ConfigError: a refused change (one line naming both values).
    """
    found, _ = plan_start(Path(cfg.out), cfg.checkpoint_dir, resume_from, overwrite,
                          cfg.train.auto_resume, say=False)  # the plan says it, next
    if found is None:
        return Resumed(cfg)
    step_dir = resolve_checkpoint(found)
    stored = stored_config(step_dir)
    if stored is None or not isinstance(stored.get("model"), dict):
        return Resumed(cfg)  # read_train_state refuses what is not a checkpoint
    given = {item.split("=", 1)[0].strip() for item in overrides}
    rest = tuple(item for item in overrides
                 if not item.split("=", 1)[0].strip().startswith("model."))
    ours = load_run_config(config, rest, stored={"model": stored["model"]}, world=world)
    now, then = to_dict(cfg), to_dict(ours)
    notes = []
    moved = now["model"].get("hf")
    if "model.hf" in given and moved and then["model"].get("hf") not in (None, moved):
        # the same model from another place (a moved base): its weights are checked by content
        ours = load_run_config(config, rest, stored={"model": {**stored["model"], "hf": moved}})
        notes.append(f"model.hf moved ({then['model']['hf']} -> {moved}): the base is checked "
                     "by its content")
        then = to_dict(ours)
    for key in sorted(k for k in given if k.startswith("model.")):
        if key in ("model.base", "model.hf"):
            mine = {k: v for k, v in now["model"].items() if k not in DERIVED}
            theirs = {k: v for k, v in then["model"].items() if k not in DERIVED}
            differ = [k for k in mine if mine.get(k) != theirs.get(k)]
            if differ:
                field = differ[0]
                raise UsageError(f"--resume {step_dir}: its model has model.{field}="
                                 f"{theirs.get(field)}, the command line's {key} gives "
                                 f"{mine.get(field)}: a checkpoint resumes with its own model "
                                 f"(drop {key}=)")
        elif _at(now, key) != _at(then, key):
            raise UsageError(f"--resume {step_dir}: its model has {key}={_at(then, key)}, the "
                             f"command line gives {key}={_at(now, key)}: a checkpoint resumes "
                             f"with its own model (drop {key}=)")
    resumed = _changes(ours, stored, step_dir, world)
    return Resumed(resumed.config, resumed.fresh_loader, (*notes, *resumed.notes))


def _changes(cfg: RunConfig, stored: dict, step_dir: Path, world: int) -> Resumed:
    now = to_dict(cfg)
    p = cfg.parallel  # a foreign, planted or half-written checkpoint is refused before the rest
    read_train_state(step_dir, world // (p.tp * p.pp * p.cp))
    layout = [(k, _at(stored, k) or 1, _at(now, k)) for k in LAYOUT_KEYS
              if (_at(stored, k) or 1) != _at(now, k)]
    if layout:
        saved = ", ".join(f"{k}={a}" for k, a, _ in layout)
        given = ", ".join(f"{k}={b}" for k, _, b in layout)
        raise UsageError(f"--resume {step_dir}: saved at {saved}, this run has {given}: its "
                         "optimizer state reshards over DP only; start a new run from its weights "
                         f"with train.init_checkpoint={step_dir} (optimizer and data position "
                         "start fresh), or resume at the saved layout")
    notes = []
    fresh = _at(stored, "data.path") != _at(now, "data.path")
    if fresh:
        notes.append(f"data.path changed ({_at(stored, 'data.path')} -> "
                     f"{_at(now, 'data.path')}): the loader starts fresh on the new data "
                     "(the checkpoint's loader state is of the old one)")
    elif not (_at(stored, "data.global_plan") and cfg.data.global_plan):  # the plan: any
        for key in LOADER_KEYS:  # worker count, micro-batch, DP size
            if _at(stored, key) is not None and _at(stored, key) != _at(now, key):
                raise UsageError(f"--resume {step_dir}: saved with {key}={_at(stored, key)}, "
                                 f"this run has {key}={_at(now, key)}: the saved loader state "
                                 f"cannot be redistributed (resume with {key}="
                                 f"{_at(stored, key)})")
    for key in ("task_encoder.seq_length", "task_encoder.max_visual_tokens", "train.steps",
                "train.lr", "train.min_lr", "train.lr_vision_model", "train.lr_vision_projection",
                "train.lora_plus_ratio"):
        if _at(stored, key) is not None and _at(stored, key) != _at(now, key):
            notes.append(f"{key} changed ({_at(stored, key)} -> {_at(now, key)}): applies from "
                         "the resumed step on")
    return Resumed(cfg, fresh, tuple(notes))
