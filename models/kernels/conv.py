"""The causal depthwise convolution of the Mamba and Gated DeltaNet layers: the plain-torch
reference (any device) and the adapter that gives fla-core's Triton conv causal-conv1d's contract.

Both layers call the conv with Dao's ``causal_conv1d`` signatures (the fast kernel where it is
built; it is CUDA-only): ``causal_conv1d_fn(x (b, d, l), weight (d, w), bias, seq_idx,
activation)`` for a whole (packed) sequence and ``causal_conv1d_update(x (b, d), conv_state (b,
d, s), weight, bias, activation)`` for one decode step. This module holds those two in torch
(``causal_conv1d_fn``, ``causal_conv1d_update``; ``causal_conv1d`` is the channels-last form the
torch Mamba kernel composes with) and the same two over fla-core's Triton conv
(``fla_causal_conv1d_fn``, ``fla_causal_conv1d_update``). Which one a run uses is
``models.kernels``' choice (kind ``conv``).

Packed sequences: ``seq_idx`` (b, l) numbers the segment of every token; no window reaches into an
earlier segment, so every packed sample is convolved as it is alone. The torch conv computes in
float32 (one shifted multiply-add per tap: memory O(l * d)) and returns the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_ids(seq_idx: torch.Tensor | None, batch: int, length: int, device) -> torch.Tensor:
    """(b, l) long segment number of every token (zeros without ``seq_idx``)."""
    if seq_idx is None:
        return torch.zeros(batch, length, dtype=torch.long, device=device)
    return seq_idx.to(device=device, dtype=torch.long).expand(batch, length)


def _activate(out: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation in ("silu", "swish"):
        return F.silu(out)
    if activation is not None:
        raise ValueError(f"causal conv: activation {activation!r} is not supported")
    return out


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  seq_idx: torch.Tensor | None = None, activation: str | None = "silu"):
    """Depthwise causal conv over time, channels last: x (b, l, d), weight (d, w) -> (b, l, d);
    the window of a token covers only earlier tokens of its own segment (``seq_idx`` (b, l))."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d: activation {activation!r} is not supported")
    batch, length, _ = x.shape
    width = weight.shape[-1]
    segments = segment_ids(seq_idx, batch, length, x.device)
    dtype, x, weight = x.dtype, x.float(), weight.float()
    out = x * weight[:, -1] if bias is None else torch.addcmul(bias.float(), x, weight[:, -1])
    for lag in range(1, width):  # tap width-1-lag multiplies the token `lag` steps back
        earlier = F.pad(x, (0, 0, lag, 0))[:, :length]
        same = F.pad(segments, (lag, 0), value=-1)[:, :length] == segments
        out = out + earlier * same[..., None] * weight[:, width - 1 - lag]
    return _activate(out, activation).to(dtype)


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, activation=None, **_unused):
    """``causal_conv1d.causal_conv1d_fn`` in torch: x (b, d, l), weight (d, w) -> (b, d, l);
    with ``seq_idx`` (b, l) no window reaches into an earlier segment."""
    return causal_conv1d(x.transpose(1, 2), weight, bias, seq_idx, activation).transpose(1, 2)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, **_unused):
    """``causal_conv1d.causal_conv1d_update`` for one token in torch: x (b, d), ``conv_state``
    (b, d, s) with s >= w - 1 the latest inputs (updated in place) -> (b, d)."""
    window = torch.cat([conv_state, x[..., None].to(conv_state.dtype)], -1)
    conv_state.copy_(window[..., 1:])
    width = weight.shape[-1]
    out = (window[..., -width:].float() * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return _activate(out, activation).to(x.dtype)


def cu_seqlens_of(seq_idx: torch.Tensor) -> torch.Tensor:
    """The segment bounds (n + 1,) of one packed row's ``seq_idx`` (1, l)."""
    ids = seq_idx[0]
    starts = torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1
    return torch.cat([starts.new_zeros(1), starts, starts.new_full((1,), ids.numel())])


def fla_causal_conv1d_fn(x, weight, bias=None, seq_idx=None, activation=None, **_unused):
    """``causal_conv1d_fn``'s contract over fla-core's Triton conv: x (b, d, l), weight (d, w) ->
    (b, d, l); a packed row's segments (``seq_idx`` (1, l)) become fla's ``cu_seqlens``."""
    from fla.modules.causal_conv1d import causal_conv1d as fla_conv

    cu = None if seq_idx is None else cu_seqlens_of(seq_idx)
    out, _ = fla_conv(x.transpose(1, 2), weight, bias, activation=activation, cu_seqlens=cu)
    return out.transpose(1, 2)


def fla_causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, **_unused):
    """``causal_conv1d_update``'s contract over fla-core's: x (b, d) one token, ``conv_state``
    (b, d, w - 1) the previous inputs (updated in place) -> (b, d). fla's cache holds w inputs,
    the newest last."""
    from fla.modules.causal_conv1d import causal_conv1d_update as fla_update

    cache = F.pad(conv_state, (1, 0))
    out, cache = fla_update(x, cache, weight=weight, bias=bias, activation=activation)
    conv_state.copy_(cache[..., 1:])
    return out
