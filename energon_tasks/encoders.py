"""Which task encoder serves which model: ``task_encoder_for(config)``.

This module owns the one mapping from ``TaskEncoderConfig.model`` to the encoder class: the
Qwen-VL names get ``QwenVLTaskEncoder``, the Nemotron-Omni names (dynamic and tiled) get
``NemotronOmniTaskEncoder``. Every place that builds an encoder (``train.py``, ``eval.py``,
``python -m energon_tasks inspect / preview``) goes through it.
"""

from __future__ import annotations

from energon_tasks.config import TaskEncoderConfig


def task_encoder_class(model: str) -> type:
    """The encoder class of a model name (``energon_tasks.geometry.model_family``).

    Raises:
        ValueError: unknown model name.
    """
    from energon_tasks.geometry import model_family

    if model_family(model) == "nemotron-omni":
        from energon_tasks.nemotron_omni import NemotronOmniTaskEncoder

        return NemotronOmniTaskEncoder
    from energon_tasks.qwen_vl import QwenVLTaskEncoder

    return QwenVLTaskEncoder


def task_encoder_for(config: TaskEncoderConfig, tokenizer=None):
    """The task encoder of ``config.model`` (a ``QwenVLTaskEncoder``; Nemotron-Omni: its subclass).

    Args:
        config: the task encoder settings.
        tokenizer: a loaded tokenizer; None loads ``config.tokenizer_name`` (special tokens of the
            model's family checked by ``energon_tasks.tokenizer.load_tokenizer``).
    """
    return task_encoder_class(config.model)(config, tokenizer=tokenizer)
