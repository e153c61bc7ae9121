"""The plain-torch Mamba2 kernels: the reference every fast Mamba kernel is checked against, and
the fallback that runs on any device (models.kernels picks; docs/models.md "Kernels").

megatron-core's ``MambaMixer`` (megatron/core/ssm/mamba_mixer.py) imports its sequence kernels
from ``mamba_ssm`` (Triton) and ``causal_conv1d`` (CUDA): without those packages it refuses to
build. This module holds what the mixer takes from there, written in torch, with mamba_ssm's
signatures and semantics (``models.kernels.bind`` puts the chosen ones into the mixer's module):

- ``mamba_split_conv1d_scan_combined``: the training / full-sequence path (megatron's
  ``_ssm_training``, also used in eval): split z | xBC | dt, causal depthwise conv + SiLU, the
  chunked scan, the output gated by SiLU(z) (megatron applies its gated norm afterwards);
  ``split_conv1d_scan(conv, scan)`` builds it from any conv with causal-conv1d's contract and any
  chunked scan with mamba_ssm's (the torch ones here, or mamba_ssm's Triton scan: a Triton-only
  mamba_ssm build has no fused conv);
- ``mamba_chunk_scan_combined``: the chunked scan alone, optionally returning the final state
  (megatron's inference prefill ``_ssm_prefill``, which then decodes with the state);
- ``RMSNormGated``: mamba_ssm's grouped RMSNorm with an optional SiLU gate (the mixer's ``norm``).

Packed sequences: ``seq_idx`` (b, l) numbers the segment of every token (megatron builds it from
``cu_seqlens``); the conv window and the scan state never cross a change of ``seq_idx``, so every
segment starts from a zero state, as it does alone. The single-token decode step and the conv
state are megatron's own torch code (it falls back to them when ``causal_conv1d`` /
``selective_state_update`` are absent). Not provided: the dynamic-batching (varlen states) and
CUDA-graph paths, the fused out-projection / norm arguments of the combined kernel (megatron does
not pass them); each is refused with one line.

The scan is the state-space-dual form of Mamba2: per head, h_t = exp(dt_t A) h_{t-1} +
dt_t B_t x_t and y_t = C_t . h_t + D x_t, computed chunk by chunk (quadratic inside a chunk,
a decayed sum of chunk states across chunks). Memory is linear in the sequence: per head the
chunk-local (k x k) decays and C.B of every chunk ((l / k) * k * k = l * k values), one state
per chunk end, and a (chunks x chunks) decay matrix across chunks; no (l x l) matrix over the
whole row (tests/models/test_kernels.py measures what autograd keeps at two lengths). Log-decay
differences are taken in float64 so that a long chunk does not lose precision to cancellation;
everything else runs in float32 and the output comes back in the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.kernels.conv import causal_conv1d_fn, segment_ids

NO_LIMIT = (0.0, float("inf"))


def _head_major_chunks(t: torch.Tensor, pad: int, chunk: int) -> torch.Tensor:
    """(b, l, h, ...) -> (b, h, c, chunk, ...), zero-padded at the end of the sequence."""
    if pad:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
    return t.reshape(t.shape[0], -1, chunk, *t.shape[2:]).movedim(3, 1)


def _masked_exp(log_decay: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """exp of float64 log decays where ``keep``, 0 elsewhere (no overflow off the mask)."""
    return torch.exp(log_decay.masked_fill(~keep, float("-inf"))).float()


def ssd_scan(x, dt, A, B, C, chunk_size: int, seq_idx=None, initial_states=None):
    """The chunked scan on discretised inputs: x (b, l, h, p), dt (b, l, h) (after bias /
    softplus), A (h,), B / C (b, l, g, n) -> (y (b, l, h, p) float32 without the D term,
    final state (b, h, p, n) float32: the state after the last token, of the last segment).

    Layout: heads first, each group's heads side by side ((b, g, r, c, k, ...), r heads per
    group), so the matmuls broadcast B and C over a group's heads instead of copying them."""
    batch, length, heads, headdim = x.shape
    groups = B.shape[2]
    pad = (-length) % chunk_size
    segments = segment_ids(seq_idx, batch, length, x.device)
    segments = torch.cat([segments, segments[:, -1:].expand(batch, pad)], 1)
    seg = segments.reshape(batch, 1, 1, -1, chunk_size)  # (b, ., ., c, k): padding joins the last

    def by_group(t):  # (b, l, h|g, ...) -> (b, g, h/g | 1, c, k, ...)
        t = _head_major_chunks(t, pad, chunk_size)
        return t.reshape(batch, groups, -1, *t.shape[2:])

    xdt = by_group(x.float() * dt.float()[..., None])  # dt x   (b, g, r, c, k, p)
    B, C = by_group(B.float()), by_group(C.float())  # (b, g, 1, c, k, n)
    cum = by_group(dt.double() * A.double()).cumsum(-1)  # (b, g, r, c, k) log decay from the
    # chunk start through token k (inclusive); 0 on padding

    # inside a chunk: y_l += sum_{s <= l, same segment} C_l.B_s exp(cum_l - cum_s) dt_s x_s
    k = torch.arange(chunk_size, device=x.device)
    keep = (k[:, None] >= k[None, :]) & (seg[..., :, None] == seg[..., None, :])  # (.., c, l, s)
    decay = _masked_exp(cum[..., :, None] - cum[..., None, :], keep)
    y = ((C @ B.transpose(-1, -2)) * decay) @ xdt  # (b, g, r, c, l, p)

    # the state at each chunk end from that chunk's tokens (of the chunk end's segment)
    end_seg = seg[..., -1]  # (b, 1, 1, c)
    to_end = _masked_exp(cum[..., -1:] - cum, seg == end_seg[..., None])  # (b, g, r, c, k)
    states = (xdt * to_end[..., None]).transpose(-1, -2) @ B  # (b, g, r, c, p, n)

    # across chunks: the state at every chunk end (index 0: before the first chunk, the initial
    # state, which belongs to the first token's segment) from the chunk states before it
    first = torch.zeros_like(states[..., :1, :, :]) if initial_states is None else \
        initial_states.float().reshape(batch, groups, -1, 1, headdim, states.shape[-1])
    states = torch.cat([first, states], -3).flatten(-2)  # (b, g, r, c+1, p*n)
    ends = F.pad(cum[..., -1].cumsum(-1), (1, 0))  # (b, g, r, c+1) log decay to each chunk end
    end_seg = torch.cat([seg[..., :1, 0], end_seg], -1)  # (b, 1, 1, c+1)
    c = torch.arange(ends.shape[-1], device=x.device)
    keep = (c[:, None] >= c[None, :]) & (end_seg[..., :, None] == end_seg[..., None, :])
    at_ends = _masked_exp(ends[..., :, None] - ends[..., None, :], keep) @ states
    at_ends = at_ends.unflatten(-1, (headdim, -1))  # (b, g, r, c+1, p, n)

    # tokens read the state entering their chunk, decayed to them, if of their segment
    decay_in = _masked_exp(cum, seg == end_seg[..., :-1, None])  # (b, g, r, c, k)
    y = y + (C @ at_ends[..., :-1, :, :].transpose(-1, -2)) * decay_in[..., None]
    y = y.reshape(batch, heads, -1, headdim).transpose(1, 2)[:, :length]
    return y, at_ends[..., -1, :, :].reshape(batch, heads, headdim, -1)


def _discretise_dt(dt, dt_bias, dt_softplus: bool, dt_limit) -> torch.Tensor:
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != NO_LIMIT:
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def _skip_and_gate(y, x, D, z):
    if D is not None:
        y = y + x.float() * (D.float()[:, None] if D.dim() == 1 else D.float())
    if z is not None:
        y = y * F.silu(z.float())
    return y


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, cu_seqlens=None,
                              dt_softplus=False, dt_limit=NO_LIMIT, return_final_states=False,
                              return_varlen_states=False, state_dtype=None):
    """mamba_ssm's ``mamba_chunk_scan_combined``: x (b, l, h, p), dt (b, l, h), A (h,),
    B / C (b, l, g, n), D (h,) or (h, p), z (b, l, h, p) -> out (b, l, h, p) in x's dtype
    (y + D x, times SiLU(z) when given), and the final state (b, h, p, n) when asked."""
    del cu_seqlens  # only read with return_varlen_states
    if return_varlen_states:
        raise NotImplementedError("the torch Mamba scan has no varlen states (megatron's dynamic "
                                  "batching inference needs mamba_ssm)")
    dt = _discretise_dt(dt, dt_bias, dt_softplus, dt_limit)
    y, final = ssd_scan(x, dt, A, B, C, chunk_size, seq_idx, initial_states)
    out = _skip_and_gate(y, x, D, z).to(x.dtype)
    if return_final_states:
        return out, final.to(state_dtype or torch.float32)
    return out


def split_conv1d_scan(conv=causal_conv1d_fn, scan=None):
    """``mamba_split_conv1d_scan_combined`` (mamba_ssm's, as megatron calls it) built from
    ``conv`` (causal-conv1d's ``causal_conv1d_fn`` contract: (b, d, l) with ``seq_idx``) and
    ``scan`` (mamba_ssm's ``mamba_chunk_scan_combined`` contract; None: the torch one)."""
    scan = scan or mamba_chunk_scan_combined

    def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D,
                                         chunk_size, initial_states=None, seq_idx=None,
                                         dt_limit=NO_LIMIT, return_final_states=False,
                                         activation="silu", rmsnorm_weight=None,
                                         rmsnorm_eps=1e-6, outproj_weight=None,
                                         outproj_bias=None, headdim=None, ngroups=1,
                                         norm_before_gate=True, state_dtype=None):
        """zxbcdt (b, l, z | xBC | dt), conv1d_weight (conv_dim, w) -> (b, l, dim) =
        scan(conv(xBC)) * SiLU(z) (+ the final state when asked)."""
        del rmsnorm_eps, norm_before_gate  # only read with rmsnorm_weight
        if rmsnorm_weight is not None or outproj_weight is not None or outproj_bias is not None:
            raise NotImplementedError("the composed Mamba kernel does not fuse the norm / out "
                                      "projection (megatron applies them itself)")
        heads = D.shape[0]
        headdim = headdim if D.dim() == 1 else D.shape[1]
        dim = heads * headdim
        state = (conv1d_weight.shape[0] - dim) // (2 * ngroups)
        if zxbcdt.shape[-1] != 2 * dim + 2 * ngroups * state + heads:
            raise NotImplementedError(f"zxbcdt width {zxbcdt.shape[-1]} is not z | xBC | dt of "
                                      f"{heads} heads x {headdim} (extra MLP channels "
                                      "unsupported)")
        z, xbc, dt = zxbcdt.split([dim, dim + 2 * ngroups * state, heads], dim=-1)
        xbc = conv(xbc.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=seq_idx,
                   activation=activation).transpose(1, 2)
        x, B, C = xbc.split([dim, ngroups * state, ngroups * state], dim=-1)
        batch, length = x.shape[:2]
        extra = {} if state_dtype is None else {"state_dtype": state_dtype}
        out = scan(
            x.reshape(batch, length, heads, headdim), dt, A,
            B.reshape(batch, length, ngroups, state), C.reshape(batch, length, ngroups, state),
            chunk_size, D=D, z=z.reshape(batch, length, heads, headdim), dt_bias=dt_bias,
            initial_states=initial_states, seq_idx=seq_idx, dt_softplus=True,
            dt_limit=dt_limit, return_final_states=return_final_states, **extra)
        if return_final_states:
            return out[0].reshape(batch, length, dim), out[1]
        return out.reshape(batch, length, dim)

    return mamba_split_conv1d_scan_combined


#: the training path in torch: torch conv + torch chunked scan
mamba_split_conv1d_scan_combined = split_conv1d_scan()


class RMSNormGated(nn.Module):
    """mamba_ssm's gated RMSNorm (``ops.triton.layernorm_gated.RMSNorm``): RMS-normalise each
    group of ``group_size`` channels; with a gate z, multiply by SiLU(z) before the norm
    (``norm_before_gate=False``, megatron's setting) or after it."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True,
                 device=None, dtype=None):
        super().__init__()
        self.eps, self.norm_before_gate = eps, norm_before_gate
        self.group_size = group_size or hidden_size
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x, z=None):
        dtype = x.dtype
        x = x.float()
        if z is not None and not self.norm_before_gate:
            x = x * F.silu(z.float())
        grouped = x.reshape(*x.shape[:-1], -1, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        out = grouped.reshape(x.shape) * self.weight.float()
        if z is not None and self.norm_before_gate:
            out = out * F.silu(z.float())
        return out.to(dtype)
