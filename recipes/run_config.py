"""The one run-config loader of train.py and eval.py: YAML in configs/ + dotted ``key=value``.

This module owns the typed run config (``RunConfig``: model, task encoder, data, parallel layout,
training, logging and checkpoint sections), how it is read (``load_run_config``: a YAML file, an
optional ``model.base`` YAML under the inline model section, or ``model.hf`` (a Hugging Face
model: its config.json is the model section's base, and its own files set the task encoder's
tokenizer, pixel limits and model name, see ``_hf_model``), then command-line overrides such as
``train.steps=20 task_encoder.max_pixels=50176 model.lm.num_layers=2``), and how it is written
back (``to_dict`` / ``dump_yaml``: the resolved config, written to ``<out>/config.yaml`` at
startup and saved in every checkpoint, where eval.py reads it back: ``stored=``). Unknown keys
are an error; every problem of a config is reported together, in one line (``ConfigError``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from contract.bounded_yaml import safe_load
from contract.config import (
    apply_override,
    build_into,
    check_value,
    parse_value,
    raise_problems,
    unknown_key,
)
from contract.errors import ConfigError  # the message lists every problem, separated by '; '
from energon_tasks.config import TaskEncoderConfig
from models.families import PARAMETER_GROUPS, config_from_dict
from models.families.nemotron_omni.config import NemotronOmniModelConfig
from models.families.qwen_vl.config import QwenVLModelConfig
from models.kernels import KernelsConfig
from models.lora import METHODS as PEFT_METHODS
from models.lora import LoRAConfig, read_settings
from recipes.compatibility import compatibility_problems, profile_for


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
    #: plan every step over all DP ranks (energon_tasks/planned_loader.py): the global batch's
    #: samples the same at any DP size (train.global_batch_size rows), tokens and vision work
    #: balanced over the ranks, the data position resumable at any DP size; false: each rank
    #: reads its own Energon loader
    global_plan: bool = False
    #: what a metadataset's blend weights share (global plan): samples, or trained tokens
    blend_weights: str = "samples"


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Parallel layout; data-parallel size = world size / (tp * pp * cp)."""

    tp: int = 1  #: tensor parallel
    pp: int = 1  #: pipeline parallel (needs task_encoder.fixed_length)
    cp: int = 1  #: context parallel (zig-zag split; CPU: exact all-gather attention)
    #: expert parallel (MoE layers): each rank holds num_experts / ep experts; the EP ranks are
    #: drawn from the data-parallel ones (tp * pp * ep must divide the world size)
    ep: int = 1
    #: expert tensor parallel (MoE layers; None: tp, megatron's default): each expert's linears
    #: over etp ranks, e.g. the published Qwen3-VL-235B-A22B layout (tp 4, etp 1, ep 32);
    #: other than tp needs ep > 1 (etp * pp * ep must divide the world size)
    etp: int | None = None
    vision_dp: bool = True  #: shard the vision encoder over the CP ranks (models/vision_dp.py)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Optimisation: AdamW, linear warmup then cosine decay to min_lr."""

    steps: int = 30  #: optimizer steps
    micro_batch_size: int = 1  #: rows per micro-batch per data-parallel rank
    grad_accum: int = 1  #: micro-batches per step
    #: rows (packed or not) per optimizer step over every data-parallel rank; when set,
    #: grad_accum is derived from it: global_batch_size / (micro_batch_size x DP), which must
    #: divide it (so a recipe keeps its batch at any GPU count)
    global_batch_size: int | None = None
    seed: int = 1234
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 3
    weight_decay: float = 0.0  #: decoupled (AdamW); never on biases and norms
    #: no weight decay on the embeddings and the output layer either
    no_decay_embeddings: bool = False
    #: the vision tower's / the projection's own peak rate (None: train.lr, the LM's); each
    #: part's minimum keeps min_lr / lr (recipes/param_groups.py)
    lr_vision_model: float | None = None
    lr_vision_projection: float | None = None
    #: LoRA+: the rate of every adapter's B factor times this (None: 1)
    lora_plus_ratio: float | None = None
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  #: global grad-norm clip (0 = off)
    init_checkpoint: str | None = None  #: megatron dist checkpoint to start from (HF import)
    #: where imports of ``model.hf`` weights are cached, one folder per weights and layout
    #: (default: ``<HF_HOME>/vlm-sft-imports``, next to the hub cache)
    hf_import_cache: str | None = None
    precision: str = "auto"  #: auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    #: shard the optimizer state (fp32 master weights, Adam moments) over the data-parallel ranks
    #: (megatron's DistributedOptimizer: reduce-scatter of grads, all-gather of updated params)
    distributed_optimizer: bool = True
    #: Adam's two moments in fp32, or bf16 (megatron's precision-aware optimizer: 4 of the 12
    #: optimizer bytes per parameter saved; needs TransformerEngine's FusedAdam, bf16 and the
    #: distributed optimizer)
    optimizer_state: str = "fp32"
    #: GiB of one GPU that the layout must fit by the memory estimate (recipes/memory.py; None:
    #: the GPU's own; no check without a GPU unless set)
    gpu_memory_gib: float | None = None
    #: train a layout whose memory estimate exceeds the GPU (train.py refuses it otherwise)
    force_layout: bool = False
    #: validation loss on data.val_split_part every N steps (0: never), over eval_batches
    #: micro-batches per data-parallel rank (the same ones each time)
    eval_interval: int = 0
    eval_batches: int = 8
    #: resume from the newest complete checkpoint of the run when there is one (a requeued job);
    #: otherwise start at step 0 (replacing what an earlier attempt logged)
    auto_resume: bool = False
    keep_checkpoints: int = 2  #: newest complete checkpoints kept (0: all)
    #: a step whose loss or gradient norm is not finite is skipped (no update); this many in a
    #: row stop the run (one line naming the step and its samples)
    max_nonfinite_steps: int = 3


@dataclass(kw_only=True, slots=True)
class LogConfig:
    interval: int = 1  #: log every N steps (console, metrics.jsonl, TensorBoard)
    tensorboard: bool = True  #: when torch.utils.tensorboard imports
    #: (global plan) the keys each DP rank trains per step: <out>/sample_keys.jsonl
    sample_keys: bool = False
    wandb: bool = False  #: when wandb imports
    wandb_project: str = "vlm-sft"
    all_warnings: bool = False  #: show the known third-party warnings (counted and hidden)


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    interval: int = 0  #: save every N steps (0: only at the end)
    save_final: bool = True  #: save after the last step
    dir: str | None = None  #: default: <out>/checkpoints


@dataclass(kw_only=True, slots=True)
class FreezeConfig:
    """Which parameter groups do not train (Megatron-Bridge's names; the run config's model
    section: ``model.freeze_vision_model=true``). Nothing is frozen by default: every parameter
    is fine-tuned; under ``model.peft=lora`` every group is frozen by default (the adapters
    train) and ``model.freeze_<group>=false`` trains that group in full next to them. A frozen
    parameter gets no gradient, no optimizer state and no gradient reduction, and stays
    bit-identical through training, checkpoints and export."""

    freeze_vision_model: bool = False  #: the vision tower (patch embedding, blocks)
    #: the projection into the LM: Qwen-VL's merger and DeepStack mergers, Nemotron's projector
    freeze_vision_projection: bool = False
    freeze_language_model: bool = False  #: the LM, embeddings and output layer included

    def frozen(self) -> tuple[str, ...]:
        """The frozen groups (``models.families.PARAMETER_GROUPS`` names)."""
        return tuple(group for group in PARAMETER_GROUPS if getattr(self, f"freeze_{group}"))


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """A training (or evaluation) run: everything train.py reads."""

    out: str = "runs/train"  #: output folder (metrics.jsonl, TensorBoard, checkpoints)
    model: QwenVLModelConfig | NemotronOmniModelConfig  #: class chosen by ``model.family``
    task_encoder: TaskEncoderConfig  #: the data side's config (budget knobs, tokenizer)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    #: ``kernels.<kind>``: which implementation runs each layer kind (auto: models/kernels)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    #: ``model.hf``: the Hugging Face model (hub id or folder) whose weights the run starts from
    hf: str | None = None
    #: ``model.freeze_*``: the parameter groups that do not train
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    #: ``model.peft=lora`` (or ``dora``) + ``model.lora.*``: the adapters (None: no adapters)
    lora: LoRAConfig | None = None
    #: the recipe applied (configs/recipes/<name>.yaml, recipes/model_recipes.py), None: none
    recipe: str | None = None
    #: what building the config has to say (the recipe applied, CPU-demo values left in a run
    #: of a real model): one line each, printed by train.py
    notes: tuple[str, ...] = ()

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir or Path(self.out) / "checkpoints")


SECTIONS = {"data": DataConfig, "parallel": ParallelConfig, "train": TrainConfig,
            "log": LogConfig, "checkpoint": CheckpointConfig, "kernels": KernelsConfig}


# ------------------------------------------------------------------ sections
def _refine(base: dict, inline: dict) -> dict:
    """``base`` with the inline keys over it (sections merged one level deep)."""
    merged = dict(base)
    for key, value in inline.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def _lora_section(raw: dict, errors: list[str]) -> LoRAConfig | None:
    """``model.peft`` (``lora``, ``dora`` or ``none``) and ``model.lora.*`` (popped from
    ``raw``)."""
    peft, lora = raw.pop("peft", None), raw.pop("lora", None)
    peft = parse_value(peft) if isinstance(peft, str) else peft  # lora | none | null | false
    if peft in (None, "none", False):
        if lora:
            errors.append("model.lora.* is set but model.peft is not: add model.peft=lora "
                          "(or dora)")
        return None
    if peft not in PEFT_METHODS:
        errors.append(f"model.peft must be {', '.join(PEFT_METHODS)} or none, got {peft!r}")
        return None
    return read_settings(peft, lora, errors)  # its problems: _model_section


def _model_section(raw: Any, errors: list[str]):
    """(the model config, its freeze switches, its LoRA settings); the model is None when it
    cannot be built."""
    raw = dict(raw or {})
    lora = _lora_section(raw, errors)
    switches = {key: raw.pop(key) for key in list(raw) if key.startswith("freeze_")}
    if lora is not None:  # under LoRA the base is frozen unless a switch says otherwise
        switches = {f"freeze_{group}": True for group in PARAMETER_GROUPS} | switches
    freeze = build_into(FreezeConfig, switches, "model", errors)
    if lora is not None and freeze is not None:
        errors += [f"model.lora.parts names {group}, which trains in full "
                   f"(model.freeze_{group}=false): adapt it or train it, not both"
                   for group in lora.parts if group not in freeze.frozen()]
    base = raw.pop("base", None)
    if base is not None:
        base = check_value("model.base", base, str, errors)
        if base is None:
            return None, freeze, lora
        try:
            merged = safe_load(Path(base).read_text()) or {}
        except OSError as error:
            errors.append(f"model.base: cannot read {base}: {error.strerror}")
            return None, freeze, lora
        except yaml.YAMLError as error:
            errors.append(f"model.base: {base} is not valid YAML ({_first_line(error)})")
            return None, freeze, lora
        if not isinstance(merged, dict):
            errors.append(f"model.base: {base} is not a mapping of model keys")
            return None, freeze, lora
        raw = _refine(merged, raw)  # inline keys refine the base
    model = None
    try:
        model = config_from_dict(raw)  # the family key picks the config class
    except ConfigError as error:
        errors += error.problems
    except (ValueError, TypeError) as error:
        errors.append(str(error))
    if lora is not None:
        errors += lora.problems(PARAMETER_GROUPS, model and _group_widths(model))
    return model, freeze, lora


def _group_widths(model) -> dict[str, int]:
    """Parameter group -> the narrowest width its linears connect (the LoRA rank's bound): the
    LM's and the tower's hidden sizes; the projection maps one to the other."""
    lm = getattr(getattr(model, "lm", None), "hidden_size", 0)
    vision = getattr(getattr(model, "vision", None), "hidden_size", 0)
    return {"language_model": lm, "vision_model": vision,
            "vision_projection": min(lm, vision) if lm and vision else 0}


def _hf_model(raw: dict, command_line: set[str], errors: list[str]) -> tuple[str, dict] | None:
    """``model.hf``: the HF model's config.json becomes the model section's base (inline
    ``model.*`` keys refine it), and its own files set ``task_encoder.tokenizer`` (the model's
    folder), the pixel limits (``models.hf.source.task_encoder_settings``) and, when the
    configured one does not feed the model's family, ``task_encoder.model``; a
    ``task_encoder.*`` key given on the command line keeps its value. Edits ``raw`` in place;
    returns (source, the processors' patch / merge sizes) or None when ``model.hf`` is unset."""
    from models.hf.source import HFSourceError, model_config_of, resolve, task_encoder_settings

    model = raw.get("model")
    if not isinstance(model, dict) or not model.get("hf"):
        return None
    source = check_value("model.hf", model["hf"], str, errors)
    if source is None:
        return None
    if "base" in model:
        errors.append("model.hf and model.base exclude each other (the HF model is the base)")
        return None
    try:
        folder = resolve(source, weights=False)
        base = model_config_of(folder).to_dict()
        values, geometry = task_encoder_settings(folder, base["family"])
    except (HFSourceError, ValueError, TypeError) as error:
        errors.append(str(error))
        return None
    raw["model"] = _refine(base, {k: v for k, v in model.items() if k != "hf"})
    encoder = raw["task_encoder"] = dict(raw.get("task_encoder") or {})
    values["model"] = profile_for(base["family"], encoder.get("model"))
    for key, value in values.items():
        if f"task_encoder.{key}" not in command_line:
            encoder[key] = value
    return source, geometry


def _task_encoder_section(raw: Any, cp: int, errors: list[str]) -> TaskEncoderConfig | None:
    raw = dict(raw or {})
    given = raw.setdefault("context_parallel_size", cp)
    if (parse_value(given) if isinstance(given, str) else given) != cp:
        errors.append(f"task_encoder.context_parallel_size ({raw['context_parallel_size']}) "
                      f"differs from parallel.cp ({cp}); leave it unset")
        return None
    return build_into(TaskEncoderConfig, raw, "task_encoder", errors)


# ------------------------------------------------------------------ public API
def from_dict(raw: dict, *, command_line: set[str] | frozenset[str] = frozenset(),
              world: int | None = None) -> RunConfig:
    """Build and validate a RunConfig from the nested YAML layout.

    ``command_line``: the dotted keys given as overrides (they win over what ``model.hf`` and
    the recipe set). ``world``: the run's GPUs (processes), when known: the recipe's layout for
    it and ``train.global_batch_size``'s grad_accum.

    Raises:
        ConfigError: every unknown key, wrong type or invalid setting, in one message.
    """
    from recipes.model_recipes import resolve as resolve_recipe
    from recipes.model_recipes import tiny_value_warnings

    errors: list[str] = []
    raw = dict(raw)
    hf = _hf_model(raw, set(command_line), errors)
    hf_failed = bool(errors)  # model.hf unusable: its model section is not built
    applied = None if hf_failed else resolve_recipe(
        raw, raw.pop("recipe", "auto"), set(command_line), world, errors, hf=hf is not None)
    raw.pop("recipe", None)
    out = check_value("out", raw.get("out", "runs/train"), str, errors)  # the text as given
    known = {"out", "model", "task_encoder", *SECTIONS}
    errors += [unknown_key(str(key), str(key), sorted(known), "") for key in raw
               if key not in known]
    sections = {name: build_into(cls, raw.get(name), name, errors) or cls()
                for name, cls in SECTIONS.items()}
    model, freeze, lora = ((None, None, None) if hf_failed
                           else _model_section(raw.get("model"), errors))
    if freeze and lora is None and len(freeze.frozen()) == len(PARAMETER_GROUPS):
        errors.append("model.freeze_vision_model, freeze_vision_projection and "
                      "freeze_language_model are all true: nothing would train")
    task_encoder = _task_encoder_section(raw.get("task_encoder"), sections["parallel"].cp, errors)
    errors += _check_values(sections)
    if hf is not None and task_encoder is not None and model is not None:
        errors += compatibility_problems(model, task_encoder, weights=f"model.hf {hf[0]}",
                                         processor=hf[1])
    if hf is not None and sections["train"].init_checkpoint:
        errors.append("model.hf and train.init_checkpoint exclude each other")
    if world is not None and not errors:
        _derive_grad_accum(sections, world, command_line, errors)
    raise_problems(errors)
    config = RunConfig(out=out, model=model,
                       task_encoder=task_encoder, hf=hf and hf[0], freeze=freeze, lora=lora,
                       recipe=applied and applied.recipe.name, **sections)
    notes = [applied.line()] if applied else []
    tiny = tiny_value_warnings(config)
    if tiny:
        notes.append("warning: a real model with CPU-demo values: " + "; ".join(tiny)
                     + " (configs/recipes/ has real recipes: recipe=<name>)")
    return dataclasses.replace(config, notes=tuple(notes))


def _derive_grad_accum(s: dict, world: int, command_line, errors: list[str]) -> None:
    """``train.global_batch_size`` set: ``train.grad_accum`` = it / (micro-batch x DP x
    virtual DP) on ``world`` processes (a grad_accum given on the command line must agree)."""
    t, p = s["train"], s["parallel"]
    if not t.global_batch_size:
        return
    dp = max(1, world // (p.tp * p.pp * p.cp)) * s["data"].virtual_dp
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        errors.append(f"train.global_batch_size {t.global_batch_size} is not a multiple of "
                      f"train.micro_batch_size x DP = {t.micro_batch_size} x {dp}")
        return
    accum = t.global_batch_size // per_step
    if "train.grad_accum" in command_line and t.grad_accum != accum:
        errors.append(f"train.grad_accum={t.grad_accum} disagrees with "
                      f"train.global_batch_size {t.global_batch_size} / (micro-batch "
                      f"{t.micro_batch_size} x DP {dp}) = {accum}: give one of them")
        return
    t.grad_accum = accum


#: seeds and seed offsets: numpy's and the loader's RNGs take 32-bit seeds (offsets added)
MAX_SEED = 2**31 - 1


def _check_values(s: dict) -> list[str]:
    """Every value out of its range, one line each (before anything is built: a NaN learning
    rate or a beta of 1.5 would otherwise fail inside the optimizer, some with SIGABRT)."""
    t, p, d = s["train"], s["parallel"], s["data"]
    problems = [f"{name} must be >= 1, got {value}" for name, value in (
        ("train.steps", t.steps), ("train.micro_batch_size", t.micro_batch_size),
        ("train.grad_accum", t.grad_accum), ("parallel.tp", p.tp), ("parallel.pp", p.pp),
        ("parallel.cp", p.cp), ("parallel.ep", p.ep),
        ("parallel.etp", 1 if p.etp is None else p.etp), ("data.virtual_dp", d.virtual_dp),
        ("data.max_samples_per_sequence", d.max_samples_per_sequence),
        ("log.interval", s["log"].interval), ("train.eval_batches", t.eval_batches),
        ("train.max_nonfinite_steps", t.max_nonfinite_steps))
        if value < 1]
    problems += [f"{name} must be >= 0, got {value}" for name, value in (
        ("train.eval_interval", t.eval_interval), ("train.keep_checkpoints", t.keep_checkpoints),
        ("train.warmup_steps", t.warmup_steps), ("data.num_workers", d.num_workers),
        ("data.shuffle_buffer_size", d.shuffle_buffer_size),
        ("checkpoint.interval", s["checkpoint"].interval))
        if value < 0]
    problems += [f"{name} must be in [0, {MAX_SEED}], got {value}" for name, value in (
        ("train.seed", t.seed), ("data.seed_offset", d.seed_offset))
        if not 0 <= value <= MAX_SEED]
    ranges = (("train.lr", t.lr, 0.0, None), ("train.min_lr", t.min_lr, 0.0, None),
              ("train.weight_decay", t.weight_decay, 0.0, None),
              ("train.clip_grad", t.clip_grad, 0.0, None),
              ("train.adam_beta1", t.adam_beta1, 0.0, 1.0),
              ("train.adam_beta2", t.adam_beta2, 0.0, 1.0))
    problems += [f"{name} must be a finite number >= {low:g}"
                 f"{f' and < {high:g}' if high is not None else ''}, got {value}"
                 for name, value, low, high in ranges
                 if not (math.isfinite(value) and value >= low
                         and (high is None or value < high))]
    problems += _rate_problems(t)
    if not (math.isfinite(t.adam_eps) and t.adam_eps > 0):
        problems.append(f"train.adam_eps must be a finite number > 0, got {t.adam_eps}")
    if t.precision not in ("auto", "fp32", "bf16"):
        problems.append(f"train.precision must be auto, fp32 or bf16, got {t.precision!r}")
    if t.lr < t.min_lr:
        problems.append(f"train.lr ({t.lr}) is below train.min_lr ({t.min_lr})")
    if t.global_batch_size is not None and t.global_batch_size < 1:
        problems.append(f"train.global_batch_size must be >= 1, got {t.global_batch_size}")
    if t.optimizer_state not in ("fp32", "bf16"):
        problems.append(f"train.optimizer_state must be fp32 or bf16, got {t.optimizer_state!r}")
    elif t.optimizer_state == "bf16" and (not t.distributed_optimizer or t.precision == "fp32"):
        problems.append("train.optimizer_state=bf16 needs train.distributed_optimizer=true and "
                        "bf16 training (megatron's precision-aware optimizer)")
    for name, value in (("train.lr_vision_model", t.lr_vision_model),
                        ("train.lr_vision_projection", t.lr_vision_projection),
                        ("train.lora_plus_ratio", t.lora_plus_ratio)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            problems.append(f"{name} must be a finite number >= 0, got {value}")
    if d.blend_weights not in ("samples", "tokens"):
        problems.append(f"data.blend_weights must be samples or tokens, got {d.blend_weights!r}")
    if d.global_plan and not t.global_batch_size:
        problems.append("data.global_plan needs train.global_batch_size (the rows of every "
                        "step, the same at any DP size)")
    if not d.global_plan and (d.blend_weights != "samples" or s["log"].sample_keys):
        problems.append("data.blend_weights=tokens and log.sample_keys need data.global_plan="
                        "true")
    if t.gpu_memory_gib is not None and not t.gpu_memory_gib > 0:
        problems.append(f"train.gpu_memory_gib must be > 0, got {t.gpu_memory_gib}")
    return problems


MAX_RATE = 1e30
"""The largest learning rate a group may reach (Adam's first step divides it by 1 - beta1 and
torch converts that to float32: 3.4e38 overflows, a traceback)."""


def _rate_problems(t) -> list[str]:
    """The rates (each part's, LoRA+'s B factors' too) above ``MAX_RATE``, one problem each."""
    rates = (("train.lr", t.lr), ("train.min_lr", t.min_lr),
             ("train.lr_vision_model", t.lr_vision_model),
             ("train.lr_vision_projection", t.lr_vision_projection))
    problems = [f"{name} must be <= {MAX_RATE:g} (a larger rate overflows float32 in the "
                f"update), got {value}" for name, value in rates
                if value is not None and math.isfinite(value) and value > MAX_RATE]
    top = max((v for _, v in rates if v is not None and math.isfinite(v)), default=0.0)
    ratio = t.lora_plus_ratio
    if ratio is not None and math.isfinite(ratio) and top <= MAX_RATE and top * ratio > MAX_RATE:
        problems.append(f"train.lora_plus_ratio {ratio} times the largest rate {top} is above "
                        f"{MAX_RATE:g} (it overflows float32 in the update)")
    return problems


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _merged(base: dict, top: dict) -> dict:
    """``base`` with ``top``'s keys over it, section by section (nested mappings merged)."""
    out = dict(base)
    for key, value in top.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


def load_run_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), *,
                    stored: dict | None = None, world: int | None = None) -> RunConfig:
    """Read ``path`` (YAML), apply dotted ``key=value`` overrides, build and validate.

    ``stored``: the run config saved with a checkpoint (eval.py). It is the base: the file, when
    given, only refines it (its ``model`` section is ignored: the checkpoint's model is the one
    evaluated), then the overrides apply. ``world``: the run's processes (train.py,
    ``recipes.memory --gpus``): the recipe's layout for them, ``train.global_batch_size``.

    Raises:
        ConfigError: the file is missing or not YAML, or any invalid key/value (all listed).
    """
    raw = {}
    if path is not None:
        try:
            raw = safe_load(Path(path).read_text()) or {}
        except OSError as error:
            raise ConfigError(f"config {path}: {error.strerror}") from None
        except yaml.YAMLError as error:
            raise ConfigError(f"config {path}: not valid YAML ({_first_line(error)})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config {path}: not a mapping of sections")
    if stored is not None:
        raw = _merged(stored, {k: v for k, v in raw.items() if k != "model"})
        if set(stored) - {"model"}:  # a saved run config holds resolved values: no recipe
            raw.setdefault("recipe", "none")
    errors = []
    # ``model.base=<yaml>`` or ``model.hf=<model>`` on the command line swaps the model: it
    # replaces the file's whole model section (whose inline keys describe another model), and
    # the other ``model.*`` overrides then refine the new base
    keys = {item.split("=", 1)[0].strip() for item in overrides}
    bases = [item for item in overrides
             if item.split("=", 1)[0].strip() in ("model.base", "model.hf")]
    trains = _family_trained(raw)
    if bases:
        raw["model"] = {}
    for item in [*bases, *(item for item in overrides if item not in bases)]:
        try:
            apply_override(raw, item)
        except ConfigError as error:
            errors.append(str(error))
    raise_problems(errors)
    config = from_dict(raw, command_line=keys, world=world)
    if bases and path is not None and "model.family" not in keys:
        _check_family_kept(config, trains, Path(path), bases[-1])
    return config


def _family_trained(raw: dict) -> str | None:
    """The family a run config trains: the one its task encoder feeds (None: not one)."""
    from contract.families import PROFILES, profile_name

    encoder = raw.get("task_encoder") if isinstance(raw.get("task_encoder"), dict) else {}
    try:
        return PROFILES[profile_name(encoder.get("model", TaskEncoderConfig().model))]
    except (ValueError, AttributeError):
        return None


def _check_family_kept(config: RunConfig, trains: str | None, path: Path, swap: str) -> None:
    """A ``model.hf`` / ``model.base`` on the command line may change the family only within the
    config's make family (``contract.families.MAKE_FAMILIES``: ``make train-nemotron-omni-*
    HF=<a Qwen model>`` would train Qwen into ``runs/nemotron_omni_*`` without a word);
    ``model.family=<its family>`` on the command line says it is meant.

    Raises:
        ConfigError: one line naming both families and what to run instead.
    """
    from contract.families import MAKE_FAMILIES
    from recipes.make_targets import make_target

    ours, theirs = config.model.family, trains
    if theirs is None or MAKE_FAMILIES.get(ours) == MAKE_FAMILIES.get(theirs):
        return
    key, value = swap.split("=", 1)
    line = MAKE_FAMILIES.get(theirs, "").replace("-", "_")
    dataset = path.stem.removeprefix(f"train_{line}_").replace("_", "-")
    fits = make_target("train", MAKE_FAMILIES.get(ours), dataset)
    instead = f"{fits} {'HF' if key.strip() == 'model.hf' else 'ARGS=model.base'}={value}" \
        if fits else f"a config of the {ours} family (CONFIG=)"
    raise ConfigError(f"{key.strip()} {value} is a {ours} model, but {path} trains {theirs}: "
                      f"use {instead}, or add model.family={ours} to train it with this config")


def to_dict(config: RunConfig) -> dict:
    """The resolved config as plain data (what is logged and saved with checkpoints)."""
    model = {**config.model.to_dict(), **dataclasses.asdict(config.freeze)}
    if config.lora is not None:
        model |= config.lora.stored()
    # resolved values: a recipe is never applied twice (``dump_yaml`` names the one used)
    return {"out": config.out, "recipe": "none",
            "model": {"hf": config.hf, **model} if config.hf else model,
            "task_encoder": config.task_encoder.to_dict(),
            **{name: dataclasses.asdict(getattr(config, name)) for name in SECTIONS}}


def dump_yaml(config: RunConfig) -> str:
    head = (f"# resolved with recipe {config.recipe} (configs/recipes/{config.recipe}.yaml)\n"
            if config.recipe else "")
    return head + yaml.safe_dump(to_dict(config), sort_keys=False)
