"""Training FLOPs of one batch (forward + backward), the numerator of TFLOP/s and MFU.

This module owns the FLOP count of a batch for every family: ``batch_flops`` (what ``train.py``
logs) and ``vision_flops`` (the tower alone, for bench/gpu_check.py), from each family's own
formulas (``lm_flops``, ``vision_flops``, ``patch_embed_flops`` of its package, ``flops.py``) and
the shared pieces here (real sequence lengths, causal pairs, chunking). Conventions
(docs/training.md, "FLOPs"):

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

from models.families import family_of


def batch_flops(batch, model_cfg) -> float:
    """Estimated training FLOPs (forward + backward) of one batch.

    Reads the batch contract's ``attention_mask`` (real tokens), ``cu_seqlens`` (packed
    segments; None: one sequence per row) and ``image_grid_thw`` / ``video_grid_thw``.
    """
    lengths = sequence_lengths(batch.attention_mask, batch.cu_seqlens)
    tokens = float(sum(lengths))
    grids = [g.tolist() for g in (batch.image_grid_thw, batch.video_grid_thw)]
    family = family_of(model_cfg)
    forward = (family.lm_flops(model_cfg.lm, tokens, lengths)
               + family.head_flops(model_cfg, tokens, lengths) + vision_flops(model_cfg, grids))
    return 3.0 * forward - family.patch_embed_flops(model_cfg, grids)


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
    return family_of(model_cfg).vision_flops(model_cfg, grids)


def pieces(length: int, size: int) -> list[int]:
    """Lengths of ``length`` cut every ``size`` (windows, scan chunks; the last one partial)."""
    return [size] * (length // size) + ([length % size] if length % size else [])


