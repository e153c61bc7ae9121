"""Training-FLOP formulas of Nemotron-Omni (the conventions of ``models.flops``): the hybrid LM by
layer symbol (Mamba2 with its chunked scan, attention, MLP, MoE with the active experts only), the
RADIO tower with its prefix tokens and the projector, the patch embedding."""

from __future__ import annotations

from models.families.nemotron_omni.config import NemotronOmniModelConfig
from models.flops import causal_pairs, pieces


def patch_embed_flops(model_cfg: NemotronOmniModelConfig, grids) -> float:
    """Forward FLOPs of the patch embedding (images: C*P*P per patch; videos: T*C*P*P per
    tubelet patch); its backward has no input gradient."""
    v = model_cfg.vision
    widths = [v.in_channels * v.patch_size ** 2 * k for k in (1, v.video_temporal_patch_size)]
    return sum(2.0 * t * h * w * width * v.hidden_size
               for width, grid in zip(widths, grids) for t, h, w in grid)


def mamba_flops(lm, lengths: list[int]) -> float:
    """Forward FLOPs of one Mamba2 layer over sequences of these lengths (see module docstring).

    in_proj: hidden -> z, x, B, C (groups x state each), dt (one per head); conv1d over x, B, C;
    SSD with chunks of ``chunk_size``: per chunk C.B^T (groups) and (C.B^T).x (heads) over the
    whole chunk block, per token B.x into the chunk state and C.h out of it (heads x head_dim x
    state each); out_proj: inner -> hidden.
    """
    inner = lm.mamba_num_heads * lm.mamba_head_dim
    group_dim = lm.mamba_groups * lm.ssm_state_size
    conv_dim = inner + 2 * group_dim
    tokens = sum(lengths)
    per_token = (lm.hidden_size * (inner + conv_dim + lm.mamba_num_heads)
                 + conv_dim * lm.conv_kernel + 2 * inner * lm.ssm_state_size
                 + inner * lm.hidden_size)
    chunk_pairs = sum(sum(c * c for c in pieces(s, lm.chunk_size)) for s in lengths)
    return 2.0 * (per_token * tokens + chunk_pairs * (group_dim + inner))


def _macs(lm) -> dict[str, float]:
    """Multiply-accumulates per token of one layer of each symbol, excluding attention over
    the sequence and the Mamba scan."""
    hidden = lm.hidden_size
    q, kv = lm.num_heads * lm.head_dim, lm.num_kv_heads * lm.head_dim
    expert_in = lm.moe_latent_size or hidden
    return {
        "*": hidden * (2 * q + 2 * kv),
        "-": 2 * hidden * lm.intermediate_size,
        "M": 0,
        "E": (hidden * lm.num_experts + lm.experts_per_token * 2 * expert_in
              * lm.moe_intermediate_size + 2 * hidden * lm.moe_shared_expert_intermediate_size
              + (2 * hidden * expert_in if lm.moe_latent_size else 0)),
    }


def lm_flops(lm, tokens: float, lengths: list[int]) -> float:
    """NemotronH forward FLOPs: per layer symbol of ``lm.pattern`` (2 FLOPs per MAC)."""
    macs, q = _macs(lm), lm.num_heads * lm.head_dim
    per_token = 2 * (sum(macs[s] for s in lm.pattern) + lm.hidden_size * lm.vocab_size)
    attention = lm.pattern.count("*") * 4 * q * causal_pairs(lengths)
    return per_token * tokens + attention + lm.pattern.count("M") * mamba_flops(lm, lengths)


def vision_flops(model_cfg: NemotronOmniModelConfig, grids) -> float:
    """RADIO tower over every segment (prefix tokens included) + patch embed + projector."""
    v = model_cfg.vision
    width, merge = v.hidden_size, model_cfg.merge_size
    mlp = (3 if v.mlp == "swiglu" else 2) * width * v.intermediate_size
    merged = width * merge ** 2
    flops = patch_embed_flops(model_cfg, grids)
    for grid in grids:
        for t, h, w in grid:
            seq = v.prefix_tokens + h * w
            flops += 2 * t * seq * v.depth * (4 * width ** 2 + mlp)
            flops += 4 * v.depth * width * t * seq * seq
            flops += 2 * t * h * w / merge ** 2 * (
                merged * model_cfg.projector_hidden_size
                + model_cfg.projector_hidden_size * model_cfg.lm.hidden_size)
    return flops


def head_flops(cfg, tokens: float, lengths: list[int]) -> float:
    """Forward FLOPs of the MTP block (``model.train_mtp``; 0 without): ``eh_proj`` (2H -> H),
    its inner layers by ``lm.mtp_pattern`` (as the decoder's of the same symbol), and the output
    layer again."""
    if not cfg.train_mtp:
        return 0.0
    lm, block = cfg.lm, cfg.lm.mtp_pattern
    macs, h = _macs(lm), lm.hidden_size
    per_token = 2 * (2 * h * h + sum(macs[s] for s in block) + h * lm.vocab_size)
    return (per_token * tokens
            + block.count("*") * 4 * lm.num_heads * lm.head_dim * causal_pairs(lengths))
