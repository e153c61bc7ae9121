"""The generated inputs of ``verify`` for Qwen-VL: one image; 3 images of different sizes
interleaved with text; a video; 3-D M-RoPE positions (``models.layers.mrope.qwen_verify_inputs``).
transformers' Qwen-VL forward takes them as they are (``hf_inputs``)."""

from __future__ import annotations

from models.families.qwen_vl.config import QwenVLModelConfig
from models.layers.mrope import qwen_verify_inputs as verify_inputs

__all__ = ["hf_inputs", "verify_inputs"]


def hf_inputs(cfg: QwenVLModelConfig, inputs: dict) -> dict:
    """Our inputs as transformers' Qwen-VL forward takes them: unchanged."""
    return inputs
