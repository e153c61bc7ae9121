"""How train.py gets its model: built for this rank's layout (``build_model``: the family's model,
vision DP over CP inside, the CPU context-parallel attention where there is no GPU), the weights
of ``model.hf`` imported at the run's layout once and cached (``import_hf_weights``), and the
parameter groups the run freezes (``freeze``: ``model.freeze_*``, grouped by the family's
``parameter_group``; a frozen parameter has ``requires_grad`` off before DDP and the optimizer
are built, so it gets no gradient buffer, no reduction and no optimizer state).
"""

from __future__ import annotations

from pathlib import Path

from contract.errors import UsageError
from models import cpu


def build_model(cfg):
    """The model of ``cfg.model.family`` (vision DP over CP inside); CPU CP attention."""
    from models.families import build_model as build

    model = build(cfg.model, vision_dp_over_cp=cfg.parallel.vision_dp)
    cpu.use_cp_attention(model.language_model)
    return model


def freeze(model, cfg) -> tuple[int, int]:
    """Turn off ``requires_grad`` of the parameter groups ``cfg.freeze`` names (on this rank's
    part of the model). Returns (parameters, trainable parameters) of this rank."""
    from models.families import family_of

    frozen, group = cfg.freeze.frozen(), family_of(cfg.model).parameter_group
    total = trainable = 0
    for name, param in model.named_parameters():
        if group(name) in frozen:
            param.requires_grad_(False)
        total += param.numel()
        trainable += param.numel() if param.requires_grad else 0
    return total, trainable


def import_hf_weights(cfg, is_logger: bool) -> str:
    """``model.hf``: the import of the HF model's weights at this run's TP / PP / EP, cached under
    ``train.hf_import_cache`` and reused by reruns (``models.convert.import_hf_cached``); logs
    which weights the run starts from. Returns the import folder (a dist checkpoint)."""
    from models.convert import import_hf_cached
    from models.hf_source import HFSourceError, default_import_cache

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
