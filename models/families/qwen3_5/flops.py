"""Training-FLOP formulas of Qwen3.5 (the conventions of ``models.flops``): the hybrid decoder
(Gated DeltaNet and gated attention layers, dense or MoE MLPs); the ViT, its merger and the patch
embedding are the tower's (``models.layers.qwen_vision_config``).

A Gated DeltaNet layer per token: the projections (hidden -> q, k (key heads x K each), v, z
(value heads x V), b, a (one per value head); out_proj), the depthwise conv over q | k | v, and
the chunked delta rule over whole chunks of ``CHUNK`` tokens per sequence, per value head and
chunk of C tokens: k.k^T and q.k^T (C^2 K each), the intra-chunk read (C^2 V), and the three
state products (decayed keys against the state, queries against the state, the state update:
C K V each). Not counted (the element-wise convention): the triangular solves of the UT
transform, the decays, norms, gates.
"""

from __future__ import annotations

import math

from models.flops import causal_pairs
from models.layers.qwen_vision_config import patch_embed_flops, vision_flops

__all__ = ["CHUNK", "head_flops", "lm_flops", "patch_embed_flops", "vision_flops"]

#: the chunk length of the chunked delta rule (fla's and the CPU kernel's)
CHUNK = 64


def delta_rule_flops(lm, lengths: list[int]) -> float:
    """Forward FLOPs of one Gated DeltaNet layer's chunked rule over sequences of ``lengths``."""
    c, k, v = CHUNK, lm.linear_key_head_dim, lm.linear_value_head_dim
    chunks = sum(math.ceil(n / c) for n in lengths)
    return 2.0 * chunks * lm.linear_num_value_heads * (c * c * (2 * k + v) + 3 * c * k * v)


def _per_token(lm) -> tuple[float, float, float]:
    """Multiply-accumulates per token of (a gated attention layer's projections, a Gated
    DeltaNet layer's projections and conv, one layer's MLP)."""
    h = lm.hidden_size
    q, kv = lm.num_heads * lm.head_dim, lm.num_kv_heads * lm.head_dim
    keys = lm.linear_num_key_heads * lm.linear_key_head_dim
    values = lm.linear_num_value_heads * lm.linear_value_head_dim
    attention = h * (2 * q + 2 * kv + q)
    delta = (h * (2 * keys + 2 * values + 2 * lm.linear_num_value_heads + values)
             + (2 * keys + values) * lm.linear_conv_kernel)
    if lm.num_experts:
        mlp = h * (lm.num_experts + 3 * lm.experts_per_token * lm.moe_intermediate_size
                   + 3 * lm.shared_expert_intermediate_size + 1)
    else:
        mlp = 3 * h * lm.intermediate_size
    return attention, delta, mlp


def lm_flops(lm, tokens: float, lengths: list[int]) -> float:
    """Forward FLOPs of the Qwen3.5 decoder over ``tokens`` real tokens in sequences of
    ``lengths``: per layer its mixer (gated attention: q and gate, k, v, out projections and
    causal attention; Gated DeltaNet: module docstring) and its MLP (dense SwiGLU, or the router,
    the ``experts_per_token`` experts, the shared expert and its gate), then the output layer."""
    attention, delta, mlp = _per_token(lm)
    linear = sum(lm.linear_layers)
    full = lm.num_layers - linear
    per_token = 2 * (full * attention + linear * delta + lm.num_layers * mlp
                     + lm.hidden_size * lm.vocab_size)
    return (per_token * tokens + full * 4 * lm.num_heads * lm.head_dim * causal_pairs(lengths)
            + linear * delta_rule_flops(lm, lengths))


def head_flops(cfg, tokens: float, lengths: list[int]) -> float:
    """Forward FLOPs of the MTP head (``model.train_mtp``; 0 without): ``fc`` (2H -> H), one
    gated attention layer with the model's MLP, and the output layer again."""
    if not cfg.train_mtp:
        return 0.0
    lm = cfg.lm
    attention, _delta, mlp = _per_token(lm)
    h = lm.hidden_size
    per_token = 2 * (2 * h * h + attention + mlp + h * lm.vocab_size)
    return per_token * tokens + 4 * lm.num_heads * lm.head_dim * causal_pairs(lengths)
