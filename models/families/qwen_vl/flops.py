"""Training-FLOP formulas of Qwen-VL (the conventions of ``models.flops``): the decoder; the ViT
with window / full attention and the mergers (DeepStack included) and the patch embedding are
the tower's (``models.layers.qwen_vision_config``)."""

from __future__ import annotations

from models.flops import causal_pairs
from models.layers.qwen_vision_config import patch_embed_flops, vision_flops

__all__ = ["head_flops", "lm_flops", "patch_embed_flops", "vision_flops"]


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


def head_flops(cfg, tokens: float, lengths: list[int]) -> float:
    """Forward FLOPs of heads trained beside the LM: none here."""
    return 0.0
