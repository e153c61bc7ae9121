"""The shape of the Qwen ViT (Qwen2.5-VL, Qwen3-VL, Qwen3.5: ``models.layers.qwen_vision``) and its
Hugging Face ``vision_config`` in and out, shared by the families that use that tower
(``models/families/qwen_vl``, ``models/families/qwen3_5``). No megatron import: building a
config needs none.

What differs between the towers is the family's ``Variant`` (``vision_act``: the default
``hidden_act``; ``windowed``: Qwen2.5-VL's window attention; ``learned_positions``: Qwen3-VL's /
Qwen3.5's position table; ``deepstack``: Qwen3-VL's DeepStack mergers; ``vision_norm`` /
``gated_mlp``: read by the tower). The processor files of its models (``processor_settings``,
``processor_files``) and the tower's FLOP formulas (``vision_flops``,
``patch_embed_flops``: the conventions of ``models.flops``) live here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from models.flops import pieces
from models.model_config import hf_value as _get
from models.model_config import processor_value


@dataclass(kw_only=True, slots=True)
class VisionConfig:
    """Vision tower shape. Fields marked (2.5) or (3) apply to those towers only ((3): Qwen3-VL
    and Qwen3.5, which has no DeepStack)."""

    depth: int  #: number of ViT blocks
    hidden_size: int  #: ViT width
    intermediate_size: int  #: MLP width
    num_heads: int  #: attention heads
    out_hidden_size: int  #: merger output width (= LM hidden size)
    in_channels: int = 3
    patch_size: int = 14  #: 14 (2.5), 16 (3)
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    hidden_act: str = "silu"  #: "silu" gated MLP (2.5); "gelu_pytorch_tanh" plain MLP (3)
    rope_theta: float = 10000.0  #: 2D vision rotary base
    norm_eps: float = 1e-6
    window_size: int = 112  #: (2.5) window side in pixels
    fullatt_block_indexes: list[int] = field(default_factory=list)  #: (2.5) full-attention blocks
    num_position_embeddings: int = 0  #: (3) learned position table size (a square)
    deepstack_visual_indexes: list[int] = field(default_factory=list)  #: (3) DeepStack taps


#: the ``vision_config`` values a tower is built of: integers >= 1, heads dividing the width
#: (``models.model_config.check_hf_shapes``)
VISION_POSITIVE = tuple(f"vision_config.{key}" for key in (
    "depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "in_channels",
    "patch_size", "temporal_patch_size", "spatial_merge_size"))
VISION_DIVISIBLE = (("vision_config.hidden_size", "vision_config.num_heads"),)


def vision_from_hf(vis: Any, variant) -> VisionConfig:
    """Our ``VisionConfig`` of an HF ``vision_config`` (dict or object) of ``variant``'s tower."""
    vrope = _get(vis, "rope_parameters") or {}
    windowed, learned = variant.windowed, variant.learned_positions
    return VisionConfig(
        depth=_get(vis, "depth"), hidden_size=_get(vis, "hidden_size"),
        intermediate_size=_get(vis, "intermediate_size"), num_heads=_get(vis, "num_heads"),
        out_hidden_size=_get(vis, "out_hidden_size"),
        in_channels=_get(vis, "in_channels") or _get(vis, "in_chans", 3),  # the older name
        patch_size=_get(vis, "patch_size"), temporal_patch_size=_get(vis, "temporal_patch_size", 2),
        spatial_merge_size=_get(vis, "spatial_merge_size", 2),
        hidden_act=_get(vis, "hidden_act", variant.vision_act),
        rope_theta=float(vrope.get("rope_theta", 10000.0)),
        window_size=_get(vis, "window_size", 112) if windowed else 0,
        fullatt_block_indexes=(list(_get(vis, "fullatt_block_indexes", ()) or ())
                               if windowed else []),
        num_position_embeddings=_get(vis, "num_position_embeddings", 0) if learned else 0,
        deepstack_visual_indexes=(list(_get(vis, "deepstack_visual_indexes", ()) or ())
                                  if learned and variant.deepstack else []),
    )


def vision_to_hf(v: VisionConfig, family: str, variant) -> dict:
    """The HF ``vision_config`` dict of ``v`` (``model_type`` ``<family>_vision``)."""
    vision = {"model_type": f"{family}_vision",
              "depth": v.depth, "hidden_size": v.hidden_size,
              "intermediate_size": v.intermediate_size, "num_heads": v.num_heads,
              "out_hidden_size": v.out_hidden_size, "in_channels": v.in_channels,
              "patch_size": v.patch_size, "temporal_patch_size": v.temporal_patch_size,
              "spatial_merge_size": v.spatial_merge_size, "hidden_act": v.hidden_act}
    if variant.learned_positions:
        vision["num_position_embeddings"] = v.num_position_embeddings
    if variant.deepstack:
        vision["deepstack_visual_indexes"] = v.deepstack_visual_indexes
    if variant.windowed:
        vision.update(window_size=v.window_size, fullatt_block_indexes=v.fullatt_block_indexes)
    return vision


# ------------------------------------------------------------------ processor files
def processor_settings(image: dict, video: dict) -> tuple[dict, dict]:
    """``preprocessor_config.json`` ``min_pixels`` / ``max_pixels`` (the hub files of
    Qwen2.5-VL) or ``size.shortest_edge`` / ``size.longest_edge`` (transformers 5.x) ->
    ``min_pixels`` / ``max_pixels``; the same keys of the video processor -> ``video_min_pixels``
    / ``video_max_pixels``; geometry: ``patch_size`` / ``merge_size`` (each a positive integer
    or absent: ``models.model_config.processor_value``)."""
    values: dict = {}
    for prefix, processor in (("", image), ("video_", video)):
        for ours, key, size_key in (("min_pixels", "min_pixels", "size.shortest_edge"),
                                    ("max_pixels", "max_pixels", "size.longest_edge")):
            value = processor_value(processor, key)
            value = processor_value(processor, size_key) if value is None else value
            if value is not None:
                values[prefix + ours] = value
    geometry = {key: value for key in ("patch_size", "merge_size")
                if (value := processor_value(image, key)) is not None}
    return values, geometry


def processor_files(geometry: dict, task_encoder: dict, *, mean, std, video_processor: str,
                    processor_class: str) -> dict[str, dict]:
    """The processor files of an export whose run named no HF model (the inverse of
    ``processor_settings``): transformers' Qwen2-VL image processor and ``video_processor`` with
    the run's pixel limits and the tower's ``geometry``, the processor class, the normalisation
    ``mean`` / ``std`` the task encoder used."""
    common = {**geometry, "image_mean": list(mean), "image_std": list(std),
              "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
              "do_normalize": True, "do_convert_rgb": True}

    def limits(low, high) -> dict:
        size = {k: v for k, v in (("shortest_edge", low), ("longest_edge", high)) if v}
        return {"min_pixels": low, "max_pixels": high, "size": size} if size else {}

    image = {"image_processor_type": "Qwen2VLImageProcessor", **common,
             **limits(task_encoder.get("min_pixels"), task_encoder.get("max_pixels"))}
    video = {"video_processor_type": video_processor, **common,
             **limits(task_encoder.get("video_min_pixels"), task_encoder.get("video_max_pixels"))}
    return {"preprocessor_config.json": image, "video_preprocessor_config.json": video,
            "processor_config.json": {"processor_class": processor_class}}


# ------------------------------------------------------------------ FLOPs (models.flops)
def patch_embed_flops(model_cfg, grids) -> float:
    """Forward FLOPs of the vision patch embedding (its backward has no input gradient)."""
    v = model_cfg.vision
    width = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    return sum(2.0 * t * h * w * width * v.hidden_size
               for grid in grids for t, h, w in grid)


def vision_flops(model_cfg, grids) -> float:
    """Forward FLOPs of the ViT + mergers on lists of (t, h, w) grids (images, then videos)."""
    v = model_cfg.vision
    merge = v.spatial_merge_size
    mlp = (3 if v.hidden_act == "silu" else 2) * v.hidden_size * v.intermediate_size
    merged = v.hidden_size * merge ** 2
    mergers = 1 + len(v.deepstack_visual_indexes)  # the final merger + one per DeepStack level
    windowed = model_cfg.variant.windowed  # Qwen3-VL attends over whole slices everywhere
    full_layers = len(v.fullatt_block_indexes) if windowed else v.depth
    window = v.window_size // (merge * v.patch_size) if windowed else 0  # in merged tokens
    flops = patch_embed_flops(model_cfg, grids)
    for grid in grids:
        for t, h, w in grid:
            patches = t * h * w
            flops += 2 * patches * v.depth * (4 * v.hidden_size ** 2 + mlp)
            flops += 2 * patches / merge ** 2 * mergers * (merged * merged
                                                           + merged * v.out_hidden_size)
            pairs = full_layers * t * (h * w) ** 2
            if window:  # each window of the other layers attends within itself
                rows = sum(n * n for n in pieces(h // merge, window))
                cols = sum(n * n for n in pieces(w // merge, window))
                pairs += (v.depth - full_layers) * t * rows * cols * merge ** 4
            flops += 4 * v.hidden_size * pairs
    return flops
