"""Energon task encoders for VLM SFT (Qwen-VL, Nemotron-Omni).

``energon_tasks.task_encoder_for(config, tokenizer=None)`` returns the encoder of
``config.model`` (defined in ``energon_tasks.task_encoder``; imported on first use so that importing
a light submodule such as ``energon_tasks.families.qwen_vl.geometry`` does not import Energon).
"""

from __future__ import annotations

__all__ = ["task_encoder_for"]


def __getattr__(name: str):
    if name == "task_encoder_for":
        from energon_tasks.task_encoder import task_encoder_for

        return task_encoder_for
    raise AttributeError(f"module 'energon_tasks' has no attribute {name!r}")
