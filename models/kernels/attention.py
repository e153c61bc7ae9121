"""Attention within the segments of a packed sequence: the plain-torch reference (SDPA over the
segments of each length) and flash-attn's varlen kernel behind the same call.

A packed row holds several samples (the LM, causal) or images / frames / windows (the vision
towers, non-causal); attention never crosses a segment of ``cu_seqlens``. Both functions take
q (s, heads, d) and k / v (s, kv_heads, d) (grouped-query attention: each key / value head
serves ``heads / kv_heads`` consecutive query heads) and return (s, heads, d).

``sdpa_segments`` sends the segments of one length through ``scaled_dot_product_attention`` as
one batch (a vision batch has a few distinct lengths: its images, or its windows and their edge
remainders; one call per segment took minutes per step for the windows of four 1 MP pages on an
H200); on CUDA SDPA runs its flash / memory-efficient kernels, so no (s x s) score matrix is kept
for a 16K-token segment. ``flash_segments`` is flash-attn's ``flash_attn_varlen_func`` (CUDA,
fp16 / bf16). Which one a run uses is ``models.kernels``' choice (kind ``attention``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def sdpa_segments(q, k, v, cu_seqlens, scale: float | None = None, causal: bool = False,
                  dropout_p: float = 0.0, max_seqlen: int | None = None) -> torch.Tensor:
    """Attention within each segment of ``cu_seqlens`` (module docstring), the segments of one
    length as one SDPA batch; ``max_seqlen`` is not needed (flash's signature)."""
    del max_seqlen
    heads = q.shape[1]
    k, v = _repeat_kv(k, heads), _repeat_kv(v, heads)
    starts, lengths = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    out = q.new_zeros(q.shape)
    for length in lengths.unique().tolist():
        if length == 0:
            continue
        rows = (starts[lengths == length, None]
                + torch.arange(length, device=starts.device)).to(q.device)  # (n, length)
        part = [t[rows].transpose(1, 2) for t in (q, k, v)]  # (n, heads, length, d)
        out[rows] = F.scaled_dot_product_attention(
            *part, is_causal=causal, dropout_p=dropout_p, scale=scale).transpose(1, 2)
    return out


def flash_segments(q, k, v, cu_seqlens, scale: float | None = None, causal: bool = False,
                   dropout_p: float = 0.0, max_seqlen: int | None = None) -> torch.Tensor:
    """``sdpa_segments`` through flash-attn's varlen kernel (grouped-query heads native)."""
    from flash_attn import flash_attn_varlen_func

    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    longest = int(max_seqlen or (cu[1:] - cu[:-1]).max())
    return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, dropout_p=dropout_p,
                                  softmax_scale=scale, causal=causal)
