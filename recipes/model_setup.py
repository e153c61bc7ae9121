"""How train.py gets its model: built for this rank's layout (``build_model``: the family's model,
vision DP over CP inside, the CPU context-parallel attention where there is no GPU), and the
weights of ``model.hf`` imported at the run's layout once and cached (``import_hf_weights``).
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
