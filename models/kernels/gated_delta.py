"""The plain-torch gated delta rule of the Gated DeltaNet layer: the reference fla-core's kernels
are checked against, and the fallback that runs on any device (models.kernels picks).

``models.layers.gated_deltanet`` calls its sequence kernels with the signatures of
flash-linear-attention (``fla.ops.gated_delta_rule``): ``chunk_gated_delta_rule`` for training /
prefill, ``fused_recurrent_gated_delta_rule`` for the one-token decode step. This module holds both
in torch (the layer's conv: models/kernels/conv.py).

Semantics (per head; q and k already L2-normalised when ``use_qk_l2norm_in_kernel``, q scaled by
``scale``, default ``K ** -0.5``):

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,   o_t = S_t^T q_t

``chunk_gated_delta_rule`` computes it chunk by chunk (the UT-transform form of transformers'
``torch_chunk_gated_delta_rule``, whose results these equal within float32 rounding: parity
tests), one chunk after another (a (chunk x chunk) system per chunk and head: memory linear in
the sequence). Packed sequences: with ``cu_seqlens`` (batch 1, fla's varlen convention) every
segment starts from its own initial state (zero when none is given) and returns its own final
state (N, H, K, V): no state crosses a boundary, so a packed sample equals the same sample alone.
Everything runs in float32; outputs come back in the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's L2 normalisation over the last dim: x / sqrt(sum x^2 + eps)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    """(b, t, h, d) inputs -> float32 (b, h, t, d) / (b, h, t), q scaled."""
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    g, beta = g.transpose(1, 2).float(), beta.transpose(1, 2).float()
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return q * (scale if scale is not None else q.shape[-1] ** -0.5), k, v, g, beta


def _chunked(q, k, v, g, beta, state, chunk: int):
    """The chunked rule on one sequence per batch row: (b, h, t, d) float32 inputs, state
    (b, h, K, V) -> (out (b, h, t, V), final state)."""
    length = q.shape[2]
    pad = (-length) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))

    def chunks(x):  # (b, h, t, ...) -> (b, h, n, chunk, ...)
        return x.reshape(*x.shape[:2], -1, chunk, *x.shape[3:])

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)  # log decay from the chunk start through each position
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay  # unit lower-triangular after the solve's I
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None],
                                              upper=False, unitriangular=True)
    inside = (q @ k.transpose(-1, -2)) * decay
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.zeros_like(values)
    for i in range(q.shape[2]):
        new = values[:, :, i] - k_decayed[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + inside[:, :, i] @ new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ new
    return out.flatten(2, 3)[:, :, :length], state


def _segments(cu_seqlens, length: int) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, length)]
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, cu_seqlens=None,
                           use_qk_l2norm_in_kernel=False, chunk_size: int = 64, **_unused):
    """fla's ``chunk_gated_delta_rule``: q / k (b, t, h, K), v (b, t, h, V), g / beta (b, t, h),
    ``initial_state`` (N, h, K, V) with N = b, or the segments of ``cu_seqlens`` (b = 1) ->
    (o (b, t, h, V) in v's dtype, final states (N, h, K, V) float32 or None)."""
    if q.shape[2] != v.shape[2]:
        raise ValueError(f"chunk_gated_delta_rule: {q.shape[2]} q/k heads, {v.shape[2]} v heads "
                         "(repeat q and k per value head first)")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"chunk_gated_delta_rule: cu_seqlens needs batch 1, got {q.shape[0]}")
    q, k, vf, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    batch, heads, length = vf.shape[:3]
    outs, finals = [], []
    for n, (a, b) in enumerate(_segments(cu_seqlens, length)):
        if initial_state is None:
            state = q.new_zeros(batch, heads, q.shape[-1], vf.shape[-1])
        else:
            state = (initial_state if cu_seqlens is None else initial_state[n:n + 1]).float()
        out, state = _chunked(q[:, :, a:b], k[:, :, a:b], vf[:, :, a:b], g[:, :, a:b],
                              beta[:, :, a:b], state, chunk_size)
        outs.append(out)
        finals.append(state)
    out = torch.cat(outs, 2).transpose(1, 2).to(v.dtype)
    return out, (torch.cat(finals, 0) if output_final_state else None)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                                     output_final_state=False, cu_seqlens=None,
                                     use_qk_l2norm_in_kernel=False, **_unused):
    """fla's ``fused_recurrent_gated_delta_rule`` (the decode step): the rule token by token,
    shapes as :func:`chunk_gated_delta_rule` (no ``cu_seqlens``: one sequence per row)."""
    if cu_seqlens is not None:
        raise ValueError("fused_recurrent_gated_delta_rule: the torch step takes no cu_seqlens")
    q, k, vf, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    batch, heads, length, dv = vf.shape
    state = (torch.zeros(batch, heads, q.shape[-1], dv, device=q.device)
             if initial_state is None else initial_state.float())
    out = torch.empty_like(vf)
    for t in range(length):
        state = state * g[:, :, t].exp()[..., None, None]
        recalled = (state * k[:, :, t, :, None]).sum(-2)
        delta = (vf[:, :, t] - recalled) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[..., None, :]
        out[:, :, t] = (state * q[:, :, t, :, None]).sum(-2)
    return out.transpose(1, 2).to(v.dtype), (state if output_final_state else None)
