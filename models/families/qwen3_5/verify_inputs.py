"""The generated inputs of ``verify`` for Qwen3.5: the Qwen VLMs' rows (one image; 3 images of
different sizes interleaved with text; a video; 3-D M-RoPE positions:
``models.layers.mrope.qwen_verify_inputs``). transformers' Qwen3.5 forward takes them as they
are."""

from __future__ import annotations

from models.families.qwen3_5.config import Qwen35ModelConfig
from models.layers.mrope import qwen_verify_inputs as verify_inputs

__all__ = ["hf_inputs", "verify_inputs"]


def hf_inputs(cfg: Qwen35ModelConfig, inputs: dict) -> dict:
    """Our inputs as transformers' Qwen3.5 forward takes them: unchanged."""
    return inputs
