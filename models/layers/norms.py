"""Norm modules of the local (non-TransformerEngine) layer specs that megatron-core lacks, and
the gated RMSNorm's computation.

``ZeroCenteredRMSNorm``: RMSNorm whose weight is stored centred on zero and applied as
``1 + w`` (Qwen3.5 / Qwen3-Next; megatron's ``layernorm_zero_centered_gamma``, which TE's norms
implement and megatron's torch norm refuses). Computed as transformers' ``Qwen3_5RMSNorm``:
normalised in float32, multiplied by ``1 + w`` in float32, cast back to the input's dtype.
Built by megatron's specs as ``norm(config=..., hidden_size=..., eps=...)``.

``gated_rms_norm``: the Gated DeltaNet's output norm (transformers' ``Qwen3_5RMSNormGated``;
its weight applied as is), the one body of ``models.layers.gated_deltanet.GatedRMSNorm`` and of the
DeltaNet's lean decode step (models/generation/decode_deltanet.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """RMSNorm of x over its last dim (float32) times ``weight`` (in x's dtype), times SiLU(z)
    (float32), in x's dtype."""
    dtype = x.dtype
    out = x.float()
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * out.to(dtype) * F.silu(z.float())).to(dtype)


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm with a zero-centred weight (module docstring)."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        if config is not None and getattr(config, "sequence_parallel", False):
            self.weight.sequence_parallel = True  # its gradient is all-reduced over TP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)
