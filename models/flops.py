"""Training FLOPs of one batch (forward + backward), the numerator of TFLOP/s and MFU.

This module owns the FLOP formula of both families: ``batch_flops`` (what ``train.py`` logs) and
``vision_flops`` (the tower alone, for bench/gpu_check.py). Conventions (docs/training.md, "FLOPs"):

- 2 FLOPs per multiply-accumulate of every matmul the model runs on real (non-pad) tokens; the
  backward pass is 2x the forward (gradient of the input and of the weight), except the vision
  patch embedding, whose input (pixels) needs no gradient: 1x;
- causal attention counts the unmasked query-key pairs of each sequence (packed samples
  separately): s * (s + 1) / 2, what a causal flash kernel computes (NeMo / Megatron-Bridge's
  convention, ``causal_self_attn`` 0.5); vision attention counts every pair within each image,
  temporal slice or window;
- Mamba2 (``M``): the projections, the depthwise causal conv1d and the chunked state-space scan
  (SSD: within-chunk C.B and (C.B).x over whole chunks, chunk states B.x, state read-out C.h);
- not counted: element-wise work (norms, activations, softmax, rotary, residuals, the SSD decay
  terms), the embedding look-up, the loss, the optimizer, and the padding a batch carries.

tests/models/test_flops.py checks every formula against torch's FLOP counter
(``torch.utils.flop_counter.FlopCounterMode``) on the tiny models of both families.
"""

from __future__ import annotations

import torch


def batch_flops(batch, model_cfg) -> float:
    """Estimated training FLOPs (forward + backward) of one batch.

    Reads the batch contract's ``attention_mask`` (real tokens), ``cu_seqlens`` (packed
    segments; None: one sequence per row) and ``image_grid_thw`` / ``video_grid_thw``.
    """
    lengths = sequence_lengths(batch.attention_mask, batch.cu_seqlens)
    tokens = float(sum(lengths))
    grids = [g.tolist() for g in (batch.image_grid_thw, batch.video_grid_thw)]
    lm = _hybrid_lm_flops if model_cfg.family == "nemotron_omni" else _qwen_lm_flops
    forward = lm(model_cfg.lm, tokens, lengths) + vision_flops(model_cfg, grids)
    return 3.0 * forward - _patch_embed_flops(model_cfg, grids)


def sequence_lengths(attention_mask: torch.Tensor, cu_seqlens: torch.Tensor | None) -> list[int]:
    """Real (non-pad) tokens of each sequence the LM attends within: each packed segment of the
    flattened rows (``cu_seqlens``), else each row."""
    if cu_seqlens is None:
        return [int(n) for n in attention_mask.sum(1).tolist()]
    real = attention_mask.reshape(-1).long().cumsum(0)
    real = torch.cat([real.new_zeros(1), real])
    bounds = cu_seqlens.long().cpu()
    return [int(n) for n in (real[bounds[1:]] - real[bounds[:-1]]).tolist() if n]


def causal_pairs(lengths: list[int]) -> float:
    """Query-key pairs of causal attention over sequences of these lengths."""
    return float(sum(s * (s + 1) // 2 for s in lengths))


def vision_flops(model_cfg, grids: list[list[list[int]]]) -> float:
    """Forward FLOPs of the vision tower (+ merger / projector) on lists of (t, h, w) grids
    (images first, then videos)."""
    if model_cfg.family == "nemotron_omni":
        return _radio_flops(model_cfg, grids)
    return _qwen_vision_flops(model_cfg, grids)


def _patch_embed_flops(model_cfg, grids) -> float:
    """Forward FLOPs of the vision patch embedding (its backward has no input gradient)."""
    v = model_cfg.vision
    if model_cfg.family == "nemotron_omni":
        widths = [v.in_channels * v.patch_size ** 2 * k for k in (1, v.video_temporal_patch_size)]
    else:
        widths = [v.in_channels * v.temporal_patch_size * v.patch_size ** 2] * 2
    return sum(2.0 * t * h * w * width * v.hidden_size
               for width, grid in zip(widths, grids) for t, h, w in grid)


def _qwen_lm_flops(lm, tokens: float, lengths: list[int]) -> float:
    q, kv = lm.num_heads * lm.head_dim, lm.num_kv_heads * lm.head_dim
    per_token = 2 * (lm.num_layers * (lm.hidden_size * (2 * q + 2 * kv)
                                      + 3 * lm.hidden_size * lm.intermediate_size)
                     + lm.hidden_size * lm.vocab_size)
    return per_token * tokens + lm.num_layers * 4 * q * causal_pairs(lengths)


def _pieces(length: int, size: int) -> list[int]:
    """Lengths of ``length`` cut every ``size`` (windows, scan chunks; the last one partial)."""
    return [size] * (length // size) + ([length % size] if length % size else [])


def _qwen_vision_flops(model_cfg, grids) -> float:
    v = model_cfg.vision
    merge = v.spatial_merge_size
    mlp = (3 if v.hidden_act == "silu" else 2) * v.hidden_size * v.intermediate_size
    merged = v.hidden_size * merge ** 2
    mergers = 1 + len(v.deepstack_visual_indexes)  # the final merger + one per DeepStack level
    windowed = model_cfg.family == "qwen2_5_vl"  # Qwen3-VL attends over whole slices everywhere
    full_layers = len(v.fullatt_block_indexes) if windowed else v.depth
    window = v.window_size // (merge * v.patch_size) if windowed else 0  # in merged tokens
    flops = _patch_embed_flops(model_cfg, grids)
    for grid in grids:
        for t, h, w in grid:
            patches = t * h * w
            flops += 2 * patches * v.depth * (4 * v.hidden_size ** 2 + mlp)
            flops += 2 * patches / merge ** 2 * mergers * (merged * merged
                                                           + merged * v.out_hidden_size)
            pairs = full_layers * t * (h * w) ** 2
            if window:  # each window of the other layers attends within itself
                rows = sum(n * n for n in _pieces(h // merge, window))
                cols = sum(n * n for n in _pieces(w // merge, window))
                pairs += (v.depth - full_layers) * t * rows * cols * merge ** 4
            flops += 4 * v.hidden_size * pairs
    return flops


def _mamba_flops(lm, lengths: list[int]) -> float:
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
    chunk_pairs = sum(sum(c * c for c in _pieces(s, lm.chunk_size)) for s in lengths)
    return 2.0 * (per_token * tokens + chunk_pairs * (group_dim + inner))


def _hybrid_lm_flops(lm, tokens: float, lengths: list[int]) -> float:
    """NemotronH forward FLOPs: per layer symbol of ``lm.pattern`` (2 FLOPs per MAC)."""
    hidden = lm.hidden_size
    q, kv = lm.num_heads * lm.head_dim, lm.num_kv_heads * lm.head_dim
    expert_in = lm.moe_latent_size or hidden
    macs = {  # per token, excluding attention over the sequence and the Mamba scan
        "*": hidden * (2 * q + 2 * kv),
        "-": 2 * hidden * lm.intermediate_size,
        "M": 0,
        "E": (hidden * lm.num_experts + lm.experts_per_token * 2 * expert_in
              * lm.moe_intermediate_size + 2 * hidden * lm.moe_shared_expert_intermediate_size
              + (2 * hidden * expert_in if lm.moe_latent_size else 0)),
    }
    per_token = 2 * (sum(macs[s] for s in lm.pattern) + hidden * lm.vocab_size)
    attention = lm.pattern.count("*") * 4 * q * causal_pairs(lengths)
    return per_token * tokens + attention + lm.pattern.count("M") * _mamba_flops(lm, lengths)


def _radio_flops(model_cfg, grids) -> float:
    """RADIO tower over every segment (prefix tokens included) + patch embed + projector."""
    v = model_cfg.vision
    width, merge = v.hidden_size, model_cfg.merge_size
    mlp = (3 if v.mlp == "swiglu" else 2) * width * v.intermediate_size
    merged = width * merge ** 2
    flops = _patch_embed_flops(model_cfg, grids)
    for grid in grids:
        for t, h, w in grid:
            seq = v.prefix_tokens + h * w
            flops += 2 * t * seq * v.depth * (4 * width ** 2 + mlp)
            flops += 4 * v.depth * width * t * seq * seq
            flops += 2 * t * h * w / merge ** 2 * (
                merged * model_cfg.projector_hidden_size
                + model_cfg.projector_hidden_size * model_cfg.lm.hidden_size)
    return flops
