"""The one run-config loader of train.py and eval.py: YAML in configs/ + dotted ``key=value``.

This module owns the typed run config (``RunConfig``: model, task encoder, data, parallel layout,
training, logging and checkpoint sections), how it is read (``load_run_config``: a YAML file, an
optional ``model.base`` YAML under the inline model section, then command-line overrides such as
``train.steps=20 task_encoder.max_pixels=50176 model.lm.num_layers=2``), and how it is written
back (``to_dict`` / ``dump_yaml``: the resolved config, written to ``<out>/config.yaml`` at
startup and saved in every checkpoint, where eval.py reads it back: ``stored=``). Unknown keys
are an error; every problem of a config is reported together, in one line (``ConfigError``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from models.families import config_from_dict
from models.nemotron_omni_config import NemotronOmniModelConfig
from models.qwen_vl_config import QwenVLModelConfig


class ConfigError(ValueError):
    """The run config is invalid; the message lists every problem, separated by '; '."""


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where the samples come from and how the Energon loader reads them."""

    path: str = ""  #: Energon dataset folder or metadataset YAML (``DATA=`` on the make targets)
    split_part: str = "train"  #: Energon split part
    val_split_part: str = "val"  #: Energon split part of the validation loss (train.eval_interval)
    num_workers: int = 1  #: loader worker processes per data-parallel rank (0 = main process)
    shuffle_buffer_size: int = 100  #: samples in the shuffle buffer
    max_samples_per_sequence: int = 100  #: samples read in a row from one shard
    seed_offset: int = 0  #: changes the shuffle order
    blank_media: bool = False  #: zero every pixel row (the vision-signal control run)
    virtual_dp: int = 1  #: testing: read as N data-parallel ranks, one micro-batch each


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Parallel layout; data-parallel size = world size / (tp * pp * cp)."""

    tp: int = 1  #: tensor parallel
    pp: int = 1  #: pipeline parallel (needs task_encoder.fixed_length)
    cp: int = 1  #: context parallel (zig-zag split; CPU: exact all-gather attention)
    #: expert parallel (MoE layers): each rank holds num_experts / ep experts; the EP ranks are
    #: drawn from the data-parallel ones (tp * pp * ep must divide the world size)
    ep: int = 1
    vision_dp: bool = True  #: shard the vision encoder over the CP ranks (models/vision_dp.py)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Optimisation: AdamW, linear warmup then cosine decay to min_lr."""

    steps: int = 30  #: optimizer steps
    micro_batch_size: int = 1  #: rows per micro-batch per data-parallel rank
    grad_accum: int = 1  #: micro-batches per step
    seed: int = 1234
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  #: global grad-norm clip (0 = off)
    init_checkpoint: str | None = None  #: megatron dist checkpoint to start from (HF import)
    precision: str = "auto"  #: auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    #: shard the optimizer state (fp32 master weights, Adam moments) over the data-parallel ranks
    #: (megatron's DistributedOptimizer: reduce-scatter of grads, all-gather of updated params)
    distributed_optimizer: bool = True
    #: validation loss on data.val_split_part every N steps (0: never), over eval_batches
    #: micro-batches per data-parallel rank (the same ones each time)
    eval_interval: int = 0
    eval_batches: int = 8
    #: resume from the newest complete checkpoint of the run when there is one (a requeued job);
    #: otherwise start at step 0 (replacing what an earlier attempt logged)
    auto_resume: bool = False
    keep_checkpoints: int = 2  #: newest complete checkpoints kept (0: all)


@dataclass(kw_only=True, slots=True)
class LogConfig:
    interval: int = 1  #: log every N steps (console, metrics.jsonl, TensorBoard)
    tensorboard: bool = True  #: when torch.utils.tensorboard imports
    wandb: bool = False  #: when wandb imports
    wandb_project: str = "vlm-sft"
    all_warnings: bool = False  #: show the known third-party warnings (counted and hidden)


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    interval: int = 0  #: save every N steps (0: only at the end)
    save_final: bool = True  #: save after the last step
    dir: str | None = None  #: default: <out>/checkpoints


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """A training (or evaluation) run: everything train.py reads."""

    out: str = "runs/train"  #: output folder (metrics.jsonl, TensorBoard, checkpoints)
    model: QwenVLModelConfig | NemotronOmniModelConfig  #: class chosen by ``model.family``
    task_encoder: Any  #: the data side's config (energon_tasks.config.TaskEncoderConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir or Path(self.out) / "checkpoints")


SECTIONS = {"data": DataConfig, "parallel": ParallelConfig, "train": TrainConfig,
            "log": LogConfig, "checkpoint": CheckpointConfig}


# ------------------------------------------------------------------ parsing helpers
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
    """Set ``a.b.c=value`` in a nested dict (creating sections)."""
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


def _allowed(annotation: Any) -> tuple[type, ...]:
    hint = eval(annotation, {"str": str, "int": int, "float": float, "bool": bool,
                             "None": None}) if isinstance(annotation, str) else annotation
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(type(None) if a is None else a for a in typing.get_args(hint))
    return (type(None),) if hint is None else (hint,)


def _coerce(value: Any, allowed: tuple[type, ...]) -> Any:
    if value is None and type(None) in allowed:
        return None
    if isinstance(value, bool):
        if bool in allowed:
            return value
        raise TypeError
    if isinstance(value, int) and float in allowed and int not in allowed:
        return float(value)
    if any(isinstance(value, t) for t in allowed if t is not type(None)):
        return value
    raise TypeError


def build_section(cls: type, raw: Any, name: str, errors: list[str]):
    """``cls(**raw)`` with unknown keys and wrong types added to ``errors`` (then defaults)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        errors.append(f"{name}: expected a mapping, got {raw!r}")
        return cls()
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            errors.append(f"unknown key {name}.{key} (valid: {', '.join(fields)})")
            continue
        try:
            kwargs[key] = _coerce(value, _allowed(fields[key].type))
        except TypeError:
            errors.append(f"{name}.{key}: expected {fields[key].type}, got {value!r}")
    return cls(**kwargs)


def _model_section(raw: Any, errors: list[str]):
    raw = dict(raw or {})
    base = raw.pop("base", None)
    if base is not None:
        try:
            merged = yaml.safe_load(Path(base).read_text()) or {}
        except OSError as error:
            errors.append(f"model.base: cannot read {base}: {error.strerror}")
            return None
        for key, value in raw.items():  # inline keys refine the base (one level deep)
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            else:
                merged[key] = value
        raw = merged
    try:
        return config_from_dict(raw)  # the family key picks the config class
    except (ValueError, TypeError) as error:
        errors.append(str(error))
        return None


def _task_encoder_section(raw: Any, cp: int, errors: list[str], config_cls: type) -> Any:
    raw = dict(raw or {})
    if raw.setdefault("context_parallel_size", cp) != cp:
        errors.append(f"task_encoder.context_parallel_size ({raw['context_parallel_size']}) "
                      f"differs from parallel.cp ({cp}); leave it unset")
        return None
    try:
        return config_cls.from_dict(raw)
    except ValueError as error:
        lines = [ln.strip() for ln in str(error).splitlines()[1:] if ln.strip()]
        errors += [f"task_encoder.{ln}" for ln in lines if not ln.startswith("valid:")]
        return None


# ------------------------------------------------------------------ public API
def from_dict(raw: dict, *, task_encoder_config: type) -> RunConfig:
    """Build and validate a RunConfig from the nested YAML layout.

    ``task_encoder_config`` is the data side's config class (``TaskEncoderConfig``), passed in
    by train.py / eval.py so that models/ never imports energon_tasks.

    Raises:
        ConfigError: every unknown key, wrong type or invalid setting, in one message.
    """
    errors: list[str] = []
    known = {"out", "model", "task_encoder", *SECTIONS}
    errors += [f"unknown key {key} (valid: {', '.join(sorted(known))})"
               for key in raw if key not in known]
    sections = {name: build_section(cls, raw.get(name), name, errors)
                for name, cls in SECTIONS.items()}
    model = _model_section(raw.get("model"), errors)
    task_encoder = _task_encoder_section(raw.get("task_encoder"), sections["parallel"].cp, errors,
                                         task_encoder_config)
    errors += _check_values(sections)
    if errors:
        raise ConfigError("; ".join(errors))
    return RunConfig(out=str(raw.get("out", "runs/train")), model=model,
                     task_encoder=task_encoder, **sections)


def _check_values(s: dict) -> list[str]:
    t, p, d = s["train"], s["parallel"], s["data"]
    problems = [f"{name} must be >= 1, got {value}" for name, value in (
        ("train.steps", t.steps), ("train.micro_batch_size", t.micro_batch_size),
        ("train.grad_accum", t.grad_accum), ("parallel.tp", p.tp), ("parallel.pp", p.pp),
        ("parallel.cp", p.cp), ("data.virtual_dp", d.virtual_dp),
        ("log.interval", s["log"].interval), ("train.eval_batches", t.eval_batches))
        if value < 1]
    problems += [f"{name} must be >= 0, got {value}" for name, value in (
        ("train.eval_interval", t.eval_interval), ("train.keep_checkpoints", t.keep_checkpoints))
        if value < 0]
    if t.precision not in ("auto", "fp32", "bf16"):
        problems.append(f"train.precision must be auto, fp32 or bf16, got {t.precision!r}")
    if t.lr < t.min_lr:
        problems.append(f"train.lr ({t.lr}) is below train.min_lr ({t.min_lr})")
    return problems


def _merged(base: dict, top: dict) -> dict:
    """``base`` with ``top``'s keys over it, section by section (nested mappings merged)."""
    out = dict(base)
    for key, value in top.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


def load_run_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), *,
                    task_encoder_config: type, stored: dict | None = None) -> RunConfig:
    """Read ``path`` (YAML), apply dotted ``key=value`` overrides, build and validate.

    ``stored``: the run config saved with a checkpoint (eval.py). It is the base: the file, when
    given, only refines it (its ``model`` section is ignored: the checkpoint's model is the one
    evaluated), then the overrides apply.

    Raises:
        ConfigError: the file is missing or not YAML, or any invalid key/value (all listed).
    """
    raw = {}
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as error:
            raise ConfigError(f"config {path}: {error.strerror}") from None
        except yaml.YAMLError as error:
            raise ConfigError(f"config {path}: not valid YAML ({str(error).splitlines()[0]})"
                              ) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config {path}: not a mapping of sections")
    if stored is not None:
        raw = _merged(stored, {k: v for k, v in raw.items() if k != "model"})
    errors = []
    # ``model.base=<yaml>`` on the command line swaps the model: it replaces the file's whole
    # model section (whose inline keys describe another model), and the other ``model.*``
    # overrides then refine the new base
    bases = [item for item in overrides if item.split("=", 1)[0].strip() == "model.base"]
    if bases:
        raw["model"] = {}
    for item in [*bases, *(item for item in overrides if item not in bases)]:
        try:
            apply_override(raw, item)
        except ConfigError as error:
            errors.append(str(error))
    if errors:
        raise ConfigError("; ".join(errors))
    return from_dict(raw, task_encoder_config=task_encoder_config)


def to_dict(config: RunConfig) -> dict:
    """The resolved config as plain data (what is logged and saved with checkpoints)."""
    return {"out": config.out, "model": config.model.to_dict(),
            "task_encoder": config.task_encoder.to_dict(),
            **{name: dataclasses.asdict(getattr(config, name)) for name in SECTIONS}}


def dump_yaml(config: RunConfig) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)
