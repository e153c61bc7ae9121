"""The Gated DeltaNet's part in greedy generation (models/generation/generate.py): its lean decode
step over the prefill's states (models/generation/decode_step.py) and the hooks that keep left
padding out of those states when prompts of unequal length prefill as one left-padded batch.

models/generation/decode_step.py registers both for ``models.layers.gated_deltanet.GatedDeltaNet``
(``decode_layers.MIXER_DECODERS``, ``PREFILL_PAD_HOOKS``); the state layout is that module's: per
row the conv state (the last w - 1 conv inputs, (B, channels, w - 1)) and the recurrent state (B,
value heads, K, V) float32, in megatron's static inference context under the layer number.

- ``deltanet_step``: one token per row, what the layer's decode path computes with its kernels
  (``causal_conv1d_update``, ``fused_recurrent_gated_delta_rule`` with the q/k L2 norm in the
  kernel), in plain torch over the layer's weights (read once);
- ``deltanet_pad_hooks``: on pad tokens the q / k / v projections (the conv's input) are zero,
  so the conv window of a row's first tokens sees zeros, as from the zero state of a prompt
  alone, and the conv state a short prompt leaves is the same; and b, a are -1e4, so
  beta = sigmoid(b) = 0 and g = -exp(A_log) softplus(a + dt_bias) = 0: the pads' delta-rule
  steps are S = exp(0) S + 0, the state passes them unchanged. (With the pads all before a row's
  first token the zero input alone keeps the state at zero; beta = g = 0 does not rely on it.)
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from models.generation.decode_layers import Unsupported, linear_of, plain
from models.layers.norms import gated_rms_norm

#: the input projections in the layer's order of the conv's channels (q | k | v), then the rest
PROJECTIONS = ("q", "k", "v", "z", "b", "a")


def deltanet_step(mixer, prefilled) -> Callable:
    """x (B, H) (the layer's normed input) -> the mixer's output (B, H) for one token per row,
    advancing its conv window and recurrent state (per value head, q / k of its key head):

        window = (conv state, x W_qkv);  q, k, v = SiLU(window . conv weight)
        q, k = L2-normalised (fla's eps 1e-6), q * K ** -0.5
        beta = sigmoid(x W_b);  g = -exp(A_log) softplus(x W_a + dt_bias)
        S = exp(g) S;  S += beta k (v - S^T k)^T;  o = S^T q
        out = gated RMSNorm(o, x W_z) W_out

    Raises:
        Unsupported: a projection with a bias or a hook (an unmerged LoRA adapter).
    """
    weights = [linear_of(getattr(mixer, f"in_proj_{name}")) for name in PROJECTIONS]
    if any(bias is not None for _, bias in weights):
        raise Unsupported("Gated DeltaNet projection with a bias")
    w_in = torch.cat([weight for weight, _ in weights])  # one matmul for the six projections
    w_out, b_out = linear_of(mixer.out_proj)
    channels = sum(weight.shape[0] for weight, _ in weights[:3])
    split = [channels] + [weight.shape[0] for weight, _ in weights[3:]]
    conv_w = torch.cat([getattr(mixer, f"conv_{name}") for name in PROJECTIONS[:3]]).float()
    key_heads, value_heads = mixer.key_heads, mixer.value_heads
    key_dim, value_dim = mixer.key_dim, mixer.value_dim
    repeat, scale = value_heads // key_heads, key_dim ** -0.5
    decay = -mixer.A_log.float().exp()  # (Hv,)
    dt_bias = mixer.dt_bias.float()
    norm_weight, norm_eps = plain(mixer.norm).weight, mixer.norm.eps
    conv, state = prefilled.row_states(mixer.layer_number)  # (B, C, w - 1), (B, Hv, K, V)
    batch = prefilled.batch
    states = {"conv": conv, "recurrent": state.float()}

    def deltanet(x):
        mix, z, b, a = F.linear(x, w_in).split(split, dim=-1)
        window = torch.cat((states["conv"], mix[..., None].to(states["conv"].dtype)), dim=-1)
        states["conv"] = window[..., 1:]
        mixed = F.silu((window.float() * conv_w).sum(-1)).to(x.dtype)  # (B, C)
        qk, v = mixed.split([2 * key_heads * key_dim, value_heads * value_dim], dim=-1)
        qk = qk.float().view(batch, 2 * key_heads, key_dim)  # q heads, then k heads
        qk = qk * torch.rsqrt((qk * qk).sum(-1, keepdim=True) + 1e-6)  # fla's L2 norm
        qk = qk.repeat_interleave(repeat, dim=1)  # each key head for its value heads
        q, k = qk[:, :value_heads] * scale, qk[:, value_heads:]
        v = v.float().view(batch, value_heads, value_dim)
        beta = b.sigmoid().float()  # (B, Hv)
        g = decay * F.softplus(a.float() + dt_bias)
        s = states["recurrent"] * g.exp()[..., None, None]
        delta = (v - (k[:, :, None] @ s).squeeze(2)) * beta[..., None]  # (B, Hv, V)
        s = s + k[..., None] * delta[:, :, None]
        states["recurrent"] = s
        out = (q[:, :, None] @ s).squeeze(2).to(x.dtype)  # (B, Hv, V)
        out = gated_rms_norm(out, z.view(batch, value_heads, value_dim), norm_weight, norm_eps)
        out = out.reshape(batch, -1)
        return F.linear(out, w_out, b_out)

    return deltanet


def deltanet_pad_hooks(mixer, keep: torch.Tensor) -> list:
    """Hooks on a ``GatedDeltaNet``'s input projections for a left-padded prefill (module
    docstring): q / k / v outputs zero on pads, b / a outputs -1e4 (beta = 0, g = 0). They act on
    the projections' (s, b, width) outputs, the whole sequence also under sequence parallelism.
    ``keep`` (b, s): True on real tokens. Returns the hook handles."""
    keep_sb = keep.transpose(0, 1)[..., None]  # (s, b, 1): megatron's sequence-first layout

    def zero_pads(_module, _args, output):
        out, bias = output
        return out * keep_sb.to(out.dtype), bias

    def no_step_on_pads(_module, _args, output):
        out, bias = output
        return out.masked_fill(~keep_sb, -1e4), bias

    return ([getattr(mixer, f"in_proj_{name}").register_forward_hook(zero_pads)
             for name in PROJECTIONS[:3]]
            + [getattr(mixer, f"in_proj_{name}").register_forward_hook(no_step_on_pads)
               for name in ("b", "a")])
