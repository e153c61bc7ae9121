"""The Nemotron-Omni family package (``NemotronH_Omni_Reasoning_V3``): its ``ModelFamily``.

- ``config.py``: shapes (``NemotronOmniModelConfig``: RADIO + projector + hybrid NemotronH LM),
  HF config in and out;
- ``radio.py``: the RADIO-style tower (class / register tokens, interpolated positions, pixel
  shuffle, projector);
- ``model.py``: ``NemotronOmni`` on megatron's hybrid ``MambaModel`` (layer pattern M / * / - / E);
- ``hf_mapping.py``: the literal HF weight table; ``verify_inputs.py``: the inputs of ``verify``
  and their translation to transformers'; ``flops.py``: the FLOP formulas.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from models.families.nemotron_omni import config
from models.families.nemotron_omni.flops import (
    head_flops,
    lm_flops,
    patch_embed_flops,
    vision_flops,
)
from models.families.nemotron_omni.verify_inputs import hf_inputs, verify_inputs

__all__ = ["config", "head_flops", "hf_inputs", "hf_model_class", "layout_problems", "lm_flops",
           "mapping",
           "model_class", "num_experts", "parameter_group", "patch_embed_flops",
           "processor_files", "processor_settings", "verify_inputs", "vision_flops",
           "vision_geometry"]


def model_class() -> type:
    from models.families.nemotron_omni.model import NemotronOmni

    return NemotronOmni


def mapping() -> ModuleType:
    return importlib.import_module("models.families.nemotron_omni.hf_mapping")


def hf_model_class(model_type: str) -> type:
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3,
    )
    return NemotronH_Omni_Reasoning_V3


def processor_settings(image: dict, video: dict) -> tuple[dict, dict]:
    """``min_num_patches`` / ``max_num_patches`` x ``patch_size``**2 -> ``min_pixels`` /
    ``max_pixels``; ``downsample_ratio`` -> merge size; ``video_target_num_patches`` and
    ``video_maintain_aspect_ratio`` of the video processor (numbers positive or absent:
    ``models.model_config.processor_value``)."""
    from models.model_config import processor_value

    values: dict = {}
    geometry: dict = {}
    patch = processor_value(image, "patch_size")
    if patch:
        geometry["patch_size"] = patch
        for ours, theirs in (("min_pixels", "min_num_patches"), ("max_pixels", "max_num_patches")):
            if (count := processor_value(image, theirs)) is not None:
                values[ours] = count * patch ** 2
    ratio = processor_value(image, "downsample_ratio", float)
    if ratio is not None:
        if ratio > 1:
            raise ValueError(f"{getattr(image, 'source', 'image processor')}: downsample_ratio "
                             f"is {ratio}: a pixel shuffle of at most 1 (fix the file)")
        geometry["merge_size"] = round(1 / ratio)
    if (patches := processor_value(video, "video_target_num_patches")) is not None:
        values["video_target_num_patches"] = patches
    if video.get("video_maintain_aspect_ratio") is not None:
        values["video_maintain_aspect_ratio"] = video["video_maintain_aspect_ratio"]
    return values, geometry


def processor_files(cfg: config.NemotronOmniModelConfig, task_encoder: dict) -> dict[str, dict]:
    """The processor files of an export whose run named no HF model (the inverse of
    ``processor_settings``): transformers' Nemotron-Omni image processor with the run's pixel
    limits as patch counts, its video processor with the run's patches per frame, the
    processor class; the tower's patch size, pixel shuffle and normalisation."""
    patch, v = cfg.vision.patch_size, cfg.vision
    common = {"patch_size": patch, "downsample_ratio": cfg.downsample_ratio,
              "image_mean": list(v.norm_mean), "image_std": list(v.norm_std),
              "do_rescale": True, "do_normalize": True, "do_convert_rgb": True}
    image = {"image_processor_type": "NemotronH_Omni_Reasoning_V3ImageProcessor", **common}
    for ours, theirs in (("min_pixels", "min_num_patches"), ("max_pixels", "max_num_patches")):
        if task_encoder.get(ours):
            image[theirs] = max(1, int(task_encoder[ours]) // patch ** 2)
    video = {"video_processor_type": "NemotronH_Omni_Reasoning_V3VideoProcessor", **common,
             **{key: task_encoder[key] for key in ("video_target_num_patches",
                                                   "video_maintain_aspect_ratio")
                if task_encoder.get(key) is not None}}
    processor = {"processor_class": "NemotronH_Omni_Reasoning_V3Processor",  # + its audio part
                 "feature_extractor": {"feature_extractor_type": "ParakeetFeatureExtractor"}}
    return {"preprocessor_config.json": image, "video_preprocessor_config.json": video,
            "processor_config.json": processor}


def vision_geometry(cfg: config.NemotronOmniModelConfig) -> dict[str, int]:
    v = cfg.vision
    return {"patch_size": v.patch_size, "merge_size": cfg.merge_size,
            "temporal_patch_size": v.video_temporal_patch_size}


def layout_problems(cfg: config.NemotronOmniModelConfig, parallel) -> list[str]:
    """MambaModel splits the layer pattern evenly over the pipeline stages; megatron's MoE
    layers (``E``) train under TP only with sequence parallelism, which this LM does not run.
    ``model.train_mtp``: PP, CP and TP stay at 1 (the MTP block is built and checked at DP and
    EP, packed or not)."""
    problems = []
    if cfg.train_mtp:
        problems += [f"model.train_mtp=true needs parallel.{key}=1 (the MTP head is not built "
                     f"for {key.upper()} > 1 yet), got {value}"
                     for key, value in (("pp", parallel.pp), ("cp", parallel.cp),
                                        ("tp", parallel.tp)) if value > 1]
    if cfg.lm.num_layers % parallel.pp:
        problems.append(f"parallel.pp {parallel.pp} does not divide the {cfg.lm.num_layers} "
                        f"layers of model.lm.pattern {cfg.lm.pattern!r} (MambaModel splits it "
                        "evenly)")
    if num_experts(cfg) and parallel.tp > 1:
        problems.append(f"parallel.tp {parallel.tp} with MoE layers (E in model.lm.pattern "
                        f"{cfg.lm.pattern!r}) is not supported yet: megatron's MoE layers train "
                        "under TP only with sequence parallelism, which the Nemotron-Omni LM "
                        "does not run (use parallel.ep)")
    return problems


def num_experts(cfg: config.NemotronOmniModelConfig) -> int:
    """The experts of each ``E`` layer of the pattern, or of the MTP block it trains (0 without
    one)."""
    return cfg.lm.num_experts if "E" in cfg.layer_kinds else 0


def parameter_group(name: str) -> str:
    """``vision.projector`` (pixel shuffle's MLP into the LM) projects; the rest of ``vision.``
    is the RADIO tower; everything else is the language model."""
    if name.startswith("vision.projector."):
        return "vision_projection"
    return "vision_model" if name.startswith("vision.") else "language_model"
