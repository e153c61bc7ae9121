"""How train.py gets its model: built for this rank's layout (``build_model``: the family's model,
vision DP over CP inside, the CPU context-parallel attention where there is no GPU), the weights
of ``model.hf`` imported at the run's layout once and cached (``import_hf_weights``), and the
parameter groups the run freezes and the LoRA adapters it adds (``freeze``: ``model.freeze_*``,
grouped by the family's ``parameter_group``, and ``model.peft=lora``: ``models.lora``; a frozen
parameter has ``requires_grad`` off before DDP and the optimizer are built, so it gets no
gradient buffer, no reduction and no optimizer state), and the frozen base a run's checkpoints
refer to instead of holding it (``base_source``), and the kernels every layer kind runs on
(``select_kernels``: models/kernels, one start-up line per kind), and the training wrappers and
optimizer around a built model (``wrap_for_training``: train.py's and bench/gpu_train.py's).
"""

from __future__ import annotations

from pathlib import Path

from contract.errors import UsageError
from models import cpu


def select_kernels(kernels_cfg, model_cfg, dtype=None, log: bool = True,
                   prefix: str = "[train]") -> dict:
    """Choose the kernels of ``model_cfg``'s layer kinds for this process's device and ``dtype``
    (None: torch's default; ``kernels_cfg``, the run config's ``kernels``: auto or forced,
    ``models.kernels.select``) before the model is built; print one line per kind when ``log``.

    Raises:
        KernelError: a forced kernel that is missing, refused or disagrees (one line).
    """
    from models import kernels

    choices = kernels.select(kernels_cfg, model_cfg.kernel_kinds(), dtype=dtype)
    for choice in choices.values() if log else ():
        print(f"{prefix} kernel {choice.line()}", flush=True)
    return choices


def build_model(cfg):
    """The model of ``cfg.model.family`` (vision DP over CP inside); CPU CP attention; its MoE
    routers' load counted for the step metrics (``models.layers.moe_aux``)."""
    from models.families import build_model as build
    from models.layers import moe_aux

    model = build(cfg.model, vision_dp_over_cp=cfg.parallel.vision_dp)
    cpu.use_cp_attention(model.language_model)
    moe_aux.track_router_load(model)
    return model


def wrap_for_training(model, t, bf16: bool, config_overrides: dict | None = None):
    """``model`` in megatron's bf16 wrapper (``bf16``) and DDP, and megatron's Adam over it
    (``t``: the run config's ``train`` section; state sharded over DP with
    ``train.distributed_optimizer``, its moments in bf16 with ``train.optimizer_state=bf16``;
    ``config_overrides``: its parameter groups, recipes.param_groups; None: megatron's standard
    weight-decay skips) -> (wrapped model, optimizer)."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from models.parallel import expert_grads_counted_once

    if bf16:
        from megatron.core.transformer.module import Float16Module

        model.config.bf16 = True
        model.config.pipeline_dtype = torch.bfloat16  # the activations sent between PP stages
        model = Float16Module(model.config, model)
    sharded = t.distributed_optimizer
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=sharded,
                                               bucket_size=None)
    model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    state = {} if t.optimizer_state == "fp32" else dict(  # megatron's precision-aware Adam
        use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, bf16=bf16,
        params_dtype=torch.float32, use_distributed_optimizer=sharded,
        clip_grad=t.clip_grad, **state), [model], config_overrides=config_overrides)
    expert_grads_counted_once(optimizer)
    return model, optimizer


def freeze(model, cfg) -> tuple[int, int, int]:
    """Add the LoRA adapters of ``cfg.lora`` (if any), then turn off ``requires_grad`` of the
    parameter groups ``cfg.freeze`` names (on this rank's part of the model; adapters always
    train). Returns (parameters, trainable parameters, adapted linears) of this rank.

    Raises:
        UsageError: ``model.lora`` names no linear of this model, or one LoRA cannot adapt.
    """
    from models.families import family_of
    from models.lora import add_adapters, is_adapter_key

    frozen, group = cfg.freeze.frozen(), family_of(cfg.model).parameter_group
    adapted = []
    if cfg.lora is not None:
        try:
            adapted = add_adapters(model, cfg.lora, group)
        except ValueError as error:
            raise UsageError(str(error)) from None
    total = trainable = 0
    for name, param in model.named_parameters():
        if group(name) in frozen and not is_adapter_key(name):
            param.requires_grad_(False)
        total += param.numel()
        trainable += param.numel() if param.requires_grad else 0
    return total, trainable, len(adapted)


def base_source(cfg) -> dict | None:
    """The weights a run starts from, as its checkpoints record them when they hold only what
    trains: ``{"hf": <model.hf>, "fingerprint": ...}`` or ``{"init_checkpoint": <folder>,
    "fingerprint": ...}``; None when nothing is frozen (the checkpoint holds every weight) or the
    run starts from random weights (the base has no source to refer to)."""
    from models.hf.source import fingerprint, resolve

    if not (cfg.lora is not None or cfg.freeze.frozen()):
        return None
    if cfg.hf:
        return {"hf": cfg.hf, "fingerprint": fingerprint(resolve(cfg.hf, weights=True))}
    if cfg.train.init_checkpoint:
        from models.checkpointing.checkpoint import weights_fingerprint

        folder = Path(cfg.train.init_checkpoint)
        return {"init_checkpoint": str(folder), "fingerprint": weights_fingerprint(folder)}
    return None


def check_base(recorded: dict, cfg, checkpoint: str) -> None:
    """The base this run loads holds the weights the checkpoint was trained on: compared by
    content (``models.hf.source.same_model``; an init checkpoint by ``weights_fingerprint``),
    wherever it is now (a copy, a restore, a move: name it with ``model.hf`` /
    ``train.init_checkpoint``).

    Raises:
        UsageError: another kind of base, or one whose content differs (one line).
    """
    from models.checkpointing.checkpoint import weights_fingerprint
    from models.hf.source import resolve, same_model

    now = base_source(cfg) or {}
    kind = "hf" if "hf" in recorded else "init_checkpoint"
    if kind in now:
        if kind == "hf":
            matches, fingerprint = same_model(recorded.get("fingerprint"),
                                              resolve(cfg.hf, weights=True))
        else:
            fingerprint = weights_fingerprint(now[kind])
            matches = fingerprint == recorded.get("fingerprint")
        if matches:
            return
        now = {kind: now[kind], "fingerprint": fingerprint}
    said = ", ".join(f"{k}={v}" for k, v in recorded.items())
    got = ", ".join(f"{k}={v}" for k, v in now.items()) or "no base"
    raise UsageError(f"checkpoint {checkpoint} holds only what trains on the base {said}; "
                     f"this run's base is {got}, other weights: resume with the same base weights "
                     "(wherever they are now: model.hf / train.init_checkpoint)")


def import_hf_weights(cfg, is_logger: bool) -> str:
    """``model.hf``: the import of the HF model's weights at this run's TP / PP / EP, cached under
    ``train.hf_import_cache`` and reused by reruns (``models.convert.import_hf_cached``); logs
    which weights the run starts from. Returns the import folder (a dist checkpoint)."""
    from models.convert import import_hf_cached
    from models.hf.source import HFSourceError, default_import_cache

    cache = Path(cfg.train.hf_import_cache or default_import_cache())
    try:
        folder, reused = import_hf_cached(cfg.model, cfg.hf, cache)
    except (HFSourceError, UsageError) as error:  # bad source or weights that do not map
        message = str(error)
        raise UsageError(message if message.startswith("model.hf") else
                         f"model.hf {cfg.hf}: {message}") from None
    if is_logger:
        print(f"[train] starting from the HF weights of {cfg.hf} "
              f"({'cached import' if reused else 'imported into'} {folder})", flush=True)
    return str(folder)
