"""The Qwen3.5 family package: Qwen3.5 (dense, ``qwen3_5``) and Qwen3.5 MoE (``qwen3_5_moe``),
the ``ModelFamily`` of the two (Qwen3.6 / Qwen3.8 reuse the architecture).

- ``config.py``: shapes (``Qwen35ModelConfig``), what differs between the two (``VARIANTS``), HF
  config in and out;
- ``model.py``: ``Qwen35``, the Qwen ViT (``models.layers.qwen_vision``, no DeepStack) + the hybrid
  M-RoPE ``GPTModel`` (Gated DeltaNet layers from ``models.layers.gated_deltanet``, gated
  attention);
- ``hf_mapping.py``: the literal HF weight tables; ``verify_inputs.py``: the inputs of ``verify``;
- ``flops.py``: the FLOP formulas.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from models.families.qwen3_5 import config
from models.families.qwen3_5.flops import head_flops, lm_flops, patch_embed_flops, vision_flops
from models.families.qwen3_5.verify_inputs import hf_inputs, verify_inputs
from models.layers.qwen_vision_config import processor_files as qwen_processor_files
from models.layers.qwen_vision_config import processor_settings

__all__ = ["config", "head_flops", "hf_inputs", "hf_model_class", "layout_problems", "lm_flops",
           "mapping",
           "model_class", "num_experts", "parameter_group", "patch_embed_flops",
           "processor_files", "processor_settings", "verify_inputs", "vision_flops",
           "vision_geometry"]


def model_class() -> type:
    from models.families.qwen3_5.model import Qwen35

    return Qwen35


def mapping() -> ModuleType:
    return importlib.import_module("models.families.qwen3_5.hf_mapping")


def hf_model_class(model_type: str) -> type:
    import transformers

    return getattr(transformers, config.VARIANTS[model_type].architecture)


def processor_files(cfg: config.Qwen35ModelConfig, task_encoder: dict) -> dict[str, dict]:
    """The processor files of an export whose run named no HF model: Qwen3-VL's processors
    (normalisation 0.5; ``models.layers.qwen_vision_config.processor_files``)."""
    return qwen_processor_files(vision_geometry(cfg), task_encoder, mean=(0.5,) * 3,
                                std=(0.5,) * 3, video_processor="Qwen3VLVideoProcessor",
                                processor_class="Qwen3VLProcessor")


def vision_geometry(cfg: config.Qwen35ModelConfig) -> dict[str, int]:
    v = cfg.vision
    return {"patch_size": v.patch_size, "merge_size": cfg.merge_size,
            "temporal_patch_size": v.temporal_patch_size}


def layout_problems(cfg: config.Qwen35ModelConfig, parallel) -> list[str]:
    """Every layout train.py checks runs (with MoE layers TP runs megatron's sequence
    parallelism, as Qwen3-VL MoE's; the Gated DeltaNet's CP paths follow it:
    ``models.layers.gated_deltanet``). A GPU whose fla-core refuses the delta rule's backward trains
    on the torch rule (``models.kernels``). ``model.train_mtp``: PP and CP stay at 1 (the
    head is built and checked at DP, TP and EP, packed or not)."""
    if not cfg.train_mtp:
        return []
    return [f"model.train_mtp=true needs parallel.{key}=1 (the MTP head is not built for "
            f"{key.upper()} > 1 yet), got {value}"
            for key, value in (("pp", parallel.pp), ("cp", parallel.cp))
            if value > 1]


def num_experts(cfg: config.Qwen35ModelConfig) -> int:
    return cfg.lm.num_experts


def parameter_group(name: str) -> str:
    """``vision.merger`` projects into the LM; the rest of ``vision.`` is the tower; everything
    else is the language model."""
    if name.startswith("vision.merger."):
        return "vision_projection"
    return "vision_model" if name.startswith("vision.") else "language_model"
