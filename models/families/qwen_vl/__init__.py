"""The Qwen-VL family package: Qwen2.5-VL, Qwen3-VL (dense) and Qwen3-VL MoE (Qwen3-VL with MoE
layers in the LM), the ``ModelFamily`` of the three.

- ``config.py``: shapes (``QwenVLModelConfig``), what differs between the two (``VARIANTS``), HF
  config in and out;
- ``vision.py``: the ViT (window attention on 2.5, learned positions + DeepStack on 3);
- ``model.py``: ``QwenVL``, the tower + the M-RoPE ``GPTModel`` (DeepStack hooks; MoE layers);
- ``hf_mapping.py``: the literal HF weight tables; ``verify_inputs.py``: the inputs of ``verify``;
- ``flops.py``: the FLOP formulas.

What the rest of the project asks of the family is the functions below (``models.families.
ModelFamily``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from models.families.qwen_vl import config
from models.families.qwen_vl.flops import head_flops, lm_flops, patch_embed_flops, vision_flops
from models.families.qwen_vl.verify_inputs import hf_inputs, verify_inputs
from models.layers.qwen_vision_config import processor_files as qwen_processor_files
from models.layers.qwen_vision_config import processor_settings

__all__ = ["config", "head_flops", "hf_inputs", "hf_model_class", "layout_problems", "lm_flops",
           "mapping",
           "model_class", "num_experts", "parameter_group", "patch_embed_flops",
           "processor_files", "processor_settings", "verify_inputs", "vision_flops",
           "vision_geometry"]


def model_class() -> type:
    from models.families.qwen_vl.model import QwenVL

    return QwenVL


def mapping() -> ModuleType:
    return importlib.import_module("models.families.qwen_vl.hf_mapping")


def hf_model_class(model_type: str) -> type:
    import transformers

    return getattr(transformers, config.VARIANTS[model_type].architecture)


def processor_files(cfg: config.QwenVLModelConfig, task_encoder: dict) -> dict[str, dict]:
    """The processor files of an export whose run named no HF model
    (``models.layers.qwen_vision_config.processor_files``): the family's video processor and the
    normalisation the task encoder used (CLIP's on 2.5, 0.5 on 3)."""
    from contract.constants import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    qwen3 = cfg.variant.text_v3
    mean, std = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)) if qwen3 else (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)
    return qwen_processor_files(
        vision_geometry(cfg), task_encoder, mean=mean, std=std,
        video_processor="Qwen3VLVideoProcessor" if qwen3 else "Qwen2VLVideoProcessor",
        processor_class="Qwen3VLProcessor" if qwen3 else "Qwen2_5_VLProcessor")


def vision_geometry(cfg: config.QwenVLModelConfig) -> dict[str, int]:
    v = cfg.vision
    return {"patch_size": v.patch_size, "merge_size": cfg.merge_size,
            "temporal_patch_size": v.temporal_patch_size}


def layout_problems(cfg: config.QwenVLModelConfig, parallel) -> list[str]:
    """None: megatron's GPTModel takes every layout train.py checks (Qwen3-VL MoE under TP runs
    megatron's sequence parallelism, which its MoE layers need there)."""
    return []


def num_experts(cfg: config.QwenVLModelConfig) -> int:
    """The experts of each MoE layer (Qwen3-VL MoE); 0 for the dense LMs or when every layer is
    dense (``mlp_only_layers``)."""
    return cfg.lm.num_experts if any(cfg.lm.moe_layers) else 0


def parameter_group(name: str) -> str:
    """``vision.merger`` / ``vision.deepstack_mergers`` project into the LM; the rest of
    ``vision.`` is the tower; everything else is the language model."""
    if name.startswith(("vision.merger.", "vision.deepstack_mergers.")):
        return "vision_projection"
    return "vision_model" if name.startswith("vision.") else "language_model"
