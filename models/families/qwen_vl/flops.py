"""Training-FLOP formulas of Qwen-VL (the conventions of ``models.flops``): the decoder, the ViT
with window / full attention and the mergers (DeepStack included), the patch embedding."""

from __future__ import annotations

from models.families.qwen_vl.config import QwenVLModelConfig
from models.flops import causal_pairs, pieces


def patch_embed_flops(model_cfg: QwenVLModelConfig, grids) -> float:
    """Forward FLOPs of the vision patch embedding (its backward has no input gradient)."""
    v = model_cfg.vision
    width = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    return sum(2.0 * t * h * w * width * v.hidden_size
               for grid in grids for t, h, w in grid)


def lm_flops(lm, tokens: float, lengths: list[int]) -> float:
    """Forward FLOPs of the Qwen2 / Qwen3 decoder over ``tokens`` real tokens in sequences of
    ``lengths`` (attention projections, gated MLP, output layer, causal attention). A MoE layer
    (Qwen3-VL MoE) counts its router and only the ``experts_per_token`` experts each token
    runs (the routing weights' multiply and the sums of the expert outputs are not counted)."""
    q, kv = lm.num_heads * lm.head_dim, lm.num_kv_heads * lm.head_dim
    dense = 3 * lm.hidden_size * lm.intermediate_size
    moe = lm.hidden_size * (lm.num_experts
                            + 3 * lm.experts_per_token * lm.moe_intermediate_size)
    mlp = sum(moe if m else dense for m in lm.moe_layers)
    per_token = 2 * (lm.num_layers * lm.hidden_size * (2 * q + 2 * kv) + mlp
                     + lm.hidden_size * lm.vocab_size)
    return per_token * tokens + lm.num_layers * 4 * q * causal_pairs(lengths)


def vision_flops(model_cfg: QwenVLModelConfig, grids) -> float:
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
